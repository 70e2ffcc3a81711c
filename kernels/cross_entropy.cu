// cross_entropy.cu: weighted cross-entropy over one chunk of lm_head logits, forward and backward
// in one kernel, the gradient written over the logits in place (DESIGN.md section 8: the full
// logits tensor would be ~10 GB, one chunk of 2048 x 151,936 is 622 MB). Two kernels with the
// same contract: cross_entropy_cluster_bf16 (below; rows of up to 163,840 held in registers by a
// cluster of CTAs, read once) for vocab % 8 == 0 from 32,768 to 163,840, and
// cross_entropy_bf16 (streaming, reads each row twice) for every other shape.
//
// Math (per row r; x = f32(logits[r, :]), w = weights[r], y = labels[r]):
//   argmax[r] = lowest c with x[c] = max_c x[c]      (cpu.rs keeps the first maximum)
//   lse = m + logf(sum_c exp(x[c] - m)), m = max_c x[c]
//   supervised = (w != 0) && 0 <= y < vocab
//   supervised:  loss[r] = w * (lse - x[y]);
//                logits[r, c] = bf16((grad_scale * w) * (exp(x[c] - lse) - [c == y]))
//   otherwise:   loss[r] = 0;  logits[r, c] = +0.0
//   exp is 2^(x log2 e) on MUFU.EX2 (exp_approx; relative error ~1e-6, far under a bf16
//   gradient's 4e-3), and the sum's order differs from cpu.rs's sequential one: compare with a
//   tolerance (loss ~1e-4 relative: the CPU's own f32 sum is off by up to ~2e-5 at 152K-262K).
//   Non-finite logits give a non-finite loss (caught by the finite check); argmax is then some
//   index in [0, vocab).
// Layouts:  logits: [rows, vocab] bf16 row-major, contiguous, overwritten. labels: [rows] i32,
//           weights: [rows] f32, loss: [rows] f32, argmax: [rows] i32 (the launcher passes the
//           offset views: labels + w_off, weights + w_off, loss + loss_off, argmax + argmax_off).
// Preconditions: 1 <= vocab < 2^31, rows >= 0; loss, argmax, labels, weights do not overlap the
//           logits.
//
// cross_entropy_bf16 (streaming). Algorithm: one CTA per row (grid-stride over rows), CE_BLOCK
//   threads.
//   Pass A (read only): each thread walks its chunks k = tid, tid + CE_BLOCK, ... (8 bf16 per
//   chunk when vocab % 8 == 0 and logits is 16-byte aligned, else 1) in increasing column order
//   keeping an online-softmax state (max m, sum s of exp(x - m), index of the first max).
//   States merge in a fixed tree: a xor butterfly within each warp, then every thread merges the
//   CE_WARPS warp states in warp order. Ties on the max keep the lower index.
//   Barrier: the whole row has been read (and x[y] was read by thread 0 before pass A) before
//   pass B writes anything.
//   Pass B: each thread rewrites its own chunks (read x, write the gradient, same thread, same
//   address), or writes zeros for an unsupervised row.
// Launch:   blockDim.x must be CE_BLOCK = 512 (traps otherwise); grid.x = rows (any grid.x >= 1 is
//           valid, grid-stride over rows); no dynamic shared memory; no scratch.
// Bytes:    rows * vocab * 2 * 3 (pass A read, pass B read + write; pass B's read hits L2 only
//           while the rows in flight fit there) + rows * 16.
// Measured (H200, bench with supervised rows of N(0, 1) logits, precise expf): 1024 x 262,144
//           in 0.565 ms, 44.6% of copy bandwidth counted at 4 bytes per element (the minimum).
//           (An earlier bench ran it on zero weights, which skip the exponentials and pass B's
//           read, and reported 0.370 ms at 2048 x 151,936: not what training sees.)
#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;

// Threads per CTA (one CTA per row). 512 = 16 warps: a 152K-vocab row is 37 chunks of 8 per
// thread, and 4 CTAs fit on an SM.
#define CE_BLOCK 512
#define CE_WARPS (CE_BLOCK / 32)
// "No element seen yet" marker for a state's index.
#define CE_NO_INDEX (-1)

// 2^x, MUFU.EX2 (~2 ulp; results under 2^-126 flush to 0, which a softmax term can afford).
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// e^x as 2^(x log2 e): one multiply and MUFU.EX2, relative error ~1e-6 for the |x| < ~20 a softmax
// meets (the rounding of x log2 e dominates), against ~10 instructions for a precise expf.
#define CE_LOG2E 1.4426950408889634f
__device__ __forceinline__ float exp_approx(float x) { return ex2_approx(x * CE_LOG2E); }

// Online-softmax state of a set of elements: m = their max, s = sum of expf(x - m) over them,
// i = the lowest index holding m (CE_NO_INDEX for the empty set).
struct SoftmaxState {
  float m;
  float s;
  int i;
};

// Adds element (x, c) to st; c is larger than every index already in st.
__device__ __forceinline__ void ce_push(SoftmaxState& st, float x, int c) {
  if (st.i == CE_NO_INDEX) { // first element: also makes a NaN or -inf first element well defined
    st.m = x;
    st.s = 1.0f;
    st.i = c;
  } else if (x > st.m) { // strictly greater: a tie keeps the earlier (lower) index
    st.s = __fadd_rn(__fmul_rn(st.s, exp_approx(__fsub_rn(st.m, x))), 1.0f);
    st.m = x;
    st.i = c;
  } else {
    // x == m adds exactly 1 (also when both are -inf, where x - m would be NaN).
    st.s = __fadd_rn(st.s, x == st.m ? 1.0f : exp_approx(__fsub_rn(x, st.m)));
  }
}

// The merge of two states. Symmetric (merge(a, b) and merge(b, a) give the same bits: the winner
// is chosen by (m, index) alone and its sum comes first), which the xor butterfly relies on.
__device__ __forceinline__ SoftmaxState ce_merge(const SoftmaxState& a, const SoftmaxState& b) {
  if (b.i == CE_NO_INDEX) return a;
  if (a.i == CE_NO_INDEX) return b;
  const bool b_wins = b.m > a.m || (b.m == a.m && b.i < a.i);
  // Selected by value (not by reference) so the states stay in registers.
  const float hi_m = b_wins ? b.m : a.m, hi_s = b_wins ? b.s : a.s;
  const float lo_m = b_wins ? a.m : b.m, lo_s = b_wins ? a.s : b.s;
  const float lo_scaled = lo_m == hi_m ? lo_s : __fmul_rn(lo_s, exp_approx(__fsub_rn(lo_m, hi_m)));
  SoftmaxState r;
  r.m = hi_m;
  r.s = __fadd_rn(hi_s, lo_scaled);
  r.i = b_wins ? b.i : a.i;
  return r;
}

__device__ __forceinline__ SoftmaxState ce_shfl_xor(const SoftmaxState& st, int offset) {
  SoftmaxState o;
  o.m = __shfl_xor_sync(0xFFFFFFFFu, st.m, offset);
  o.s = __shfl_xor_sync(0xFFFFFFFFu, st.s, offset);
  o.i = __shfl_xor_sync(0xFFFFFFFFu, st.i, offset);
  return o;
}

template <int V>
__device__ __forceinline__ void ce_rows(__nv_bfloat16* logits, const int* __restrict__ labels,
                                        const float* __restrict__ weights, index_t rows, int vocab,
                                        float grad_scale, float* __restrict__ loss,
                                        int* __restrict__ argmax) {
  __shared__ float warp_m[CE_WARPS];
  __shared__ float warp_s[CE_WARPS];
  __shared__ int warp_i[CE_WARPS];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int chunks = vocab / V;
  for (index_t row = blockIdx.x; row < rows; row += gridDim.x) { // uniform over the block
    __nv_bfloat16* lr = logits + row * vocab;
    const float w = weights[row];
    const int label = labels[row];
    const bool supervised = w != 0.0f && label >= 0 && label < vocab;
    // x[label] is read (by thread 0, which writes the loss) before the barrier that separates
    // the read pass from the write pass.
    float label_logit = 0.0f;
    if (tid == 0 && supervised) label_logit = bf16_to_f32(lr[label]);

    // Pass A: read the whole row.
    SoftmaxState st;
    st.m = -INFINITY;
    st.s = 0.0f;
    st.i = CE_NO_INDEX;
    for (int k = tid; k < chunks; k += CE_BLOCK) {
      float f[V];
      bf16_chunk_load<V>(lr + (index_t)k * V, f);
#pragma unroll
      for (int j = 0; j < V; ++j) ce_push(st, f[j], k * V + j);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) st = ce_merge(st, ce_shfl_xor(st, o));
    if (lane == 0) {
      warp_m[warp] = st.m;
      warp_s[warp] = st.s;
      warp_i[warp] = st.i;
    }
    __syncthreads(); // the whole row has been read: pass B may overwrite it
    SoftmaxState row_st;
    row_st.m = warp_m[0];
    row_st.s = warp_s[0];
    row_st.i = warp_i[0];
#pragma unroll
    for (int i = 1; i < CE_WARPS; ++i) {
      SoftmaxState other;
      other.m = warp_m[i];
      other.s = warp_s[i];
      other.i = warp_i[i];
      row_st = ce_merge(row_st, other);
    }
    const float lse = __fadd_rn(row_st.m, logf(row_st.s));
    if (tid == 0) {
      argmax[row] = row_st.i;
      loss[row] = supervised ? __fmul_rn(w, __fsub_rn(lse, label_logit)) : 0.0f;
    }

    // Pass B: the gradient over the logits, in place.
    if (supervised) {
      const float coef = __fmul_rn(grad_scale, w);
      for (int k = tid; k < chunks; k += CE_BLOCK) {
        float f[V];
        bf16_chunk_load<V>(lr + (index_t)k * V, f);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float p = exp_approx(__fsub_rn(f[j], lse));
          const float onehot = (k * V + j == label) ? 1.0f : 0.0f;
          f[j] = __fmul_rn(coef, __fsub_rn(p, onehot));
        }
        bf16_chunk_store_rne<V>(lr + (index_t)k * V, f);
      }
    } else {
      float zero[V];
#pragma unroll
      for (int j = 0; j < V; ++j) zero[j] = 0.0f;
      for (int k = tid; k < chunks; k += CE_BLOCK) {
        bf16_chunk_store_rne<V>(lr + (index_t)k * V, zero);
      }
    }
    // warp_* are rewritten for the next row only after every thread has read them.
    __syncthreads();
  }
}

// ---- Register-resident path: a cluster of CTAs holds one row -------------------------------------
// The streaming kernel above reads a row twice; its second read only hits L2 while the rows in
// flight fit there (4 CTAs x 132 SMs x a 304 KB row is 160 MB, far over the H200's 50 MB), so at
// a 152K vocab it moves ~6 bytes per element. Here a cluster of CEC_CTAS CTAs (thread blocks on
// different SMs that can write each other's shared memory) owns a row at a time: each CTA's share
// of the row arrives in shared memory by bulk copy (TMA) CEC_STAGES - 1 rows ahead, each thread
// keeps its part in registers from there to the single write (4 bytes per element in all), and
// the CTAs exchange only their partial max and sums.
//
// Math (x = f32(logits[r, :]); L = log2 e):
//   m = max_c x[c] (NaNs skipped; a row of NaNs gives m = NaN), argmax = lowest c with x[c] == m
//   (0 if there is none: a row of NaNs);
//   e[c] = 2^(x[c] L - m L) (ex2.approx of one FMA: relative error ~1e-6, the rounding of m L
//   dominates), s = sum e[c], lse = m + logf(s);
//   supervised:  loss[r] = w (lse - x[y]);  logits[r, c] = bf16((grad_scale w / s) e[c] - [c == y]
//                grad_scale w)   (cvt.rn, NaN payloads not kept)
//   otherwise:   loss[r] = 0; logits[r, c] = +0.0.
//   Against the CPU's expf(x - lse): ~1e-6 relative per probability, far under a bf16
//   gradient's 4e-3 and the 1e-4 loss tolerance. Non-finite logits give a non-finite loss.
// Layout/preconditions: as cross_entropy_bf16, plus vocab % 8 == 0, logits 16-byte aligned and
//   vocab <= CEC_MAX_VOCAB (the launcher picks this kernel only then; it traps otherwise).
// Algorithm: cluster q (CTAs [CEC_CTAS q, CEC_CTAS q + CEC_CTAS)) takes rows q, q + Q, ... for
//   Q = gridDim.x / CEC_CTAS clusters (the launcher makes them co-resident). Thread t of CTA rank r
//   is cluster thread g = r * CEC_BLOCK + t and owns the 8-element chunks g + i * CEC_THREADS,
//   i < CEC_MAXC, in increasing column order; the CTA's share is CEC_MAXC contiguous segments of
//   CEC_BLOCK chunks. Thread 0 keeps CEC_STAGES rows' shares in flight (bulk copies completing on
//   the stage's mbarrier). Per row (the CTA's it-th, in stage it % CEC_STAGES):
//   1. wait for the stage; each thread copies its chunks into registers; thread 0 reads x[label];
//   2. thread max (packed bf16x2 max, NaNs skipped) -> warp -> CTA (a block barrier, after which
//      thread 0 refills the stage with the row CEC_STAGES ahead) -> sent to every CTA (message A);
//      every thread takes the max over the CEC_CTAS CTAs in rank order -> m;
//   3. the lowest index holding m, searched only by threads whose own max is m; e[c] into
//      registers (f32, replacing the chunk's bf16 as it goes), s per thread in chunk order; warp
//      (xor butterfly: a + b == b + a, so every lane gets the same bits) -> warps in order -> CTA
//      -> sent to every CTA (message B); every thread sums the CTAs in rank order (and takes the
//      lowest index) -> s, argmax;
//   4. the gradient (or zeros) over its own chunks with streaming stores; the thread owning the
//      label's chunk then rewrites that one element with the one-hot term subtracted.
//   Messages (see "Cluster messages" below) go into per-sender slots; a CTA's slot in another CTA
//   is rewritten (next row's A) only after that CTA's B message arrived, which it sends only after
//   reading its A slots, and likewise for B. Every read of a row (step 1) precedes the CTA's A
//   message and every write of it follows the B messages; each thread writes only its own chunks:
//   the in-place update is race-free. Every sum's order is fixed by the shapes alone: results are
//   deterministic.
// Launch:   grid.x = CEC_CTAS * Q, 1 <= Q (<= the co-resident cluster count, for the rows in
//           flight to overlap the math; any Q is correct), blockDim.x = CEC_BLOCK, CEC_SMEM_BYTES
//           of dynamic shared memory; the cluster shape is compiled in (__cluster_dims__).
// Bytes:    rows * vocab * 4 (one read, one write) + rows * 16.
// Bound:    memory, with the exponentials (one MUFU op per element: 1/4 of the SFU rate at HBM
//           speed) and ~6 other instructions per element overlapping the rows in flight.
// History (H200, 2048 x 151,936, bench rows of N(0, 1) logits, all supervised): one row per
//           cluster, 2 CTAs per SM, no prefetch: 0.629 ms (46.5% of copy bandwidth; every CTA
//           loaded, then computed, in step). Next row prefetched into registers with cluster
//           barriers: 0.727 ms (the barrier's release waits for the prefetch). With st.async
//           messages instead of barriers: 0.590 ms (49.6%: one row, 38 KB per SM, in flight).
//           This version (3 rows ahead in shared memory by TMA): 0.412 ms, 3.02 TB/s, 71.3% of
//           the 4.24 TB/s copy peak; under the 80% target. Not yet measured: where the rest goes
//           (the two message round trips per row between SMs, one CTA of 16 warps per SM for
//           ~8 instructions and one MUFU op per element, or the 4 SMs no cluster of 8 fits on).
#define CEC_CTAS 8
#define CEC_BLOCK 512
#define CEC_WARPS (CEC_BLOCK / 32)
#define CEC_THREADS (CEC_CTAS * CEC_BLOCK)
#define CEC_MAXC 5
#define CEC_MAX_VOCAB (CEC_THREADS * CEC_MAXC * BF16_PER_VEC) // 163,840
#define CEC_NO_INDEX 0x7FFFFFFF

// max of two bf16 pairs, per half; a NaN half loses to a number (PTX max without .NaN).
__device__ __forceinline__ uint32_t bf16x2_max(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t cec_smem(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

// One arrival (the phase's only one) that also expects `bytes` of asynchronous data (bulk copies
// or st.async messages).
__device__ __forceinline__ void cec_mbar_expect(uint32_t mbar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mbar), "r"(bytes) : "memory");
}

// Stages of the row-share ring in dynamic shared memory: CEC_MAXC segments of CEC_BLOCK chunks
// (40 KB) each, CEC_STAGES - 1 rows in flight per CTA while it computes one.
#define CEC_STAGES 4
#define CEC_STAGE_CHUNKS (CEC_MAXC * CEC_BLOCK)
#define CEC_SMEM_BYTES (CEC_STAGES * CEC_STAGE_CHUNKS * VEC_BYTES) // 160 KB

// Thread 0: one bulk copy (TMA) per segment of this CTA's share of a row into a stage, all
// completing on the stage's mbarrier. Segment c is chunks [c * CEC_THREADS + rank * CEC_BLOCK,
// + CEC_BLOCK) of the row, clipped to it: contiguous, 16-byte aligned, a multiple of 16 bytes.
__device__ __forceinline__ void cec_issue_share(uint4* stage, uint32_t mbar, const __nv_bfloat16* lr,
                                                int rank, int chunks) {
  uint32_t bytes[CEC_MAXC];
  uint32_t total = 0;
#pragma unroll
  for (int c = 0; c < CEC_MAXC; ++c) {
    const int start = c * CEC_THREADS + rank * CEC_BLOCK;
    const int n = min(max(chunks - start, 0), CEC_BLOCK);
    bytes[c] = (uint32_t)n * VEC_BYTES;
    total += bytes[c];
  }
  cec_mbar_expect(mbar, total);
#pragma unroll
  for (int c = 0; c < CEC_MAXC; ++c) {
    if (bytes[c] == 0) continue;
    const uint4* src = reinterpret_cast<const uint4*>(lr) + c * CEC_THREADS + rank * CEC_BLOCK;
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            cec_smem(stage + c * CEC_BLOCK)),
        "l"(src), "r"(bytes[c]), "r"(mbar)
        : "memory");
  }
}

// ---- Cluster messages: st.async into every CTA's slot, counted by the receiver's mbarrier -------
// A cluster barrier (barrier.cluster.arrive.release) waits for the thread's outstanding loads, so
// with one the next row's loads could not overlap this row's math (measured: 0.727 ms instead of
// the ~0.3 ms the bandwidth allows for 2048 x 151,936). Instead each CTA's thread 0 pushes its
// value into slot [rank] of every CTA of the cluster with st.async, which completes bytes on the
// receiver's mbarrier; the receiver waits for the expected bytes (one phase per row) and reads
// its own slots. No fence, no barrier: the loads in flight stay in flight.

// The shared::cluster address of `addr` (a shared::cta address of this CTA) in CTA `rank`.
__device__ __forceinline__ uint32_t cec_remote(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}

__device__ __forceinline__ void cec_mbar_init(uint32_t mbar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(mbar));
}


// Waits for phase `parity` of a local mbarrier, acquiring at cluster scope: the message barriers'
// bytes come from other CTAs' st.async (a release at cluster scope), and only a cluster-scope
// acquire orders their data before this thread's reads, and this thread's reads of the slots
// before the senders' next writes. (The stage barriers, completed by this CTA's own bulk copies,
// would need only the CTA scope; one wait serves both.)
__device__ __forceinline__ void cec_mbar_wait(uint32_t mbar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(mbar), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ void cec_send1(uint32_t slot, uint32_t mbar, uint32_t rank, uint32_t v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                   cec_remote(slot, rank)),
               "r"(v), "r"(cec_remote(mbar, rank))
               : "memory");
}

__device__ __forceinline__ void cec_send2(uint32_t slot, uint32_t mbar, uint32_t rank, uint32_t a,
                                          uint32_t b) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
                   cec_remote(slot, rank)),
               "r"(a), "r"(b), "r"(cec_remote(mbar, rank))
               : "memory");
}

extern "C" __global__ void __cluster_dims__(CEC_CTAS, 1, 1) __launch_bounds__(CEC_BLOCK, 1)
    cross_entropy_cluster_bf16(__nv_bfloat16* logits, const int* __restrict__ labels,
                               const float* __restrict__ weights, long long rows, int vocab,
                               float grad_scale, float* __restrict__ loss,
                               int* __restrict__ argmax) {
  __shared__ float warp_f[CEC_WARPS];
  __shared__ int warp_i[CEC_WARPS];
  __shared__ float label_logit;
  // Slot [r]: CTA r's max, and its (sum, first index of the max) pair; one mbarrier for each.
  __shared__ float slot_m[CEC_CTAS];
  __shared__ __align__(8) uint32_t slot_si[CEC_CTAS][2];
  __shared__ __align__(8) uint64_t mbar_m, mbar_si;
  __shared__ __align__(8) uint64_t mbar_full[CEC_STAGES]; // stage s holds its row
  extern __shared__ __align__(128) uint4 cec_stage[];     // [CEC_STAGES][CEC_MAXC][CEC_BLOCK]
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (blockDim.x != CEC_BLOCK || gridDim.x % CEC_CTAS != 0 || vocab % BF16_PER_VEC != 0 ||
      vocab > CEC_MAX_VOCAB || !is_vec_aligned(logits) || dyn_smem < CEC_SMEM_BYTES) {
    __trap();
  }
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = rank * CEC_BLOCK + tid;
  const int chunks = vocab / BF16_PER_VEC;
  const index_t clusters = gridDim.x / CEC_CTAS;
  const float L2E = CE_LOG2E;

  const uint32_t mb_m = cec_smem(&mbar_m), mb_si = cec_smem(&mbar_si);
  const index_t first = blockIdx.x / CEC_CTAS; // the cluster's first row
  if (tid == 0) {
    cec_mbar_init(mb_m);
    cec_mbar_init(mb_si);
    for (int st = 0; st < CEC_STAGES; ++st) cec_mbar_init(cec_smem(&mbar_full[st]));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); // the barriers, to the TMA unit
    // The prologue: the first CEC_STAGES rows in flight.
    for (int st = 0; st < CEC_STAGES; ++st) {
      const index_t r = first + st * clusters;
      if (r < rows) {
        cec_issue_share(cec_stage + st * CEC_STAGE_CHUNKS, cec_smem(&mbar_full[st]),
                        logits + r * vocab, rank, chunks);
      }
    }
  }
  cluster.sync(); // every mbarrier is initialised before any CTA sends

  uint32_t parity = 0; // of this row's phase of mbar_m and mbar_si
  int it = 0;          // this CTA's row count: the row sits in stage it % CEC_STAGES
  for (index_t row = first; row < rows; row += clusters, ++it) { // uniform over the cluster
    __nv_bfloat16* lr = logits + row * vocab;
    const int st = it % CEC_STAGES;
    const uint4* stage = cec_stage + st * CEC_STAGE_CHUNKS;
    cec_mbar_wait(cec_smem(&mbar_full[st]), (uint32_t)(it / CEC_STAGES) & 1u);
    uint4 raw[CEC_MAXC];
#pragma unroll
    for (int c = 0; c < CEC_MAXC; ++c) {
      // Past the row: -inf bits (0xFF80), which no max, sum or index search picks up.
      raw[c] = g + c * CEC_THREADS < chunks ? stage[c * CEC_BLOCK + tid]
                                            : make_uint4(0xFF80FF80u, 0xFF80FF80u, 0xFF80FF80u, 0xFF80FF80u);
    }
    const float w = weights[row];
    const int label = labels[row];
    const bool supervised = w != 0.0f && label >= 0 && label < vocab;
    if (tid == 0) label_logit = supervised ? bf16_to_f32(lr[label]) : 0.0f;

    // 2. The max.
    uint32_t mp = raw[0].x;
#pragma unroll
    for (int c = 0; c < CEC_MAXC; ++c) {
      mp = bf16x2_max(mp, bf16x2_max(bf16x2_max(raw[c].x, raw[c].y), bf16x2_max(raw[c].z, raw[c].w)));
    }
    const float my_m = fmaxf(bf16x2_lo_to_f32(mp), bf16x2_hi_to_f32(mp)); // fmaxf skips NaNs too
    float m = my_m;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if (lane == 0) warp_f[warp] = m;
    __syncthreads();
    if (tid == 0) {
      // Every thread has read the stage (barrier above): it takes the row CEC_STAGES ahead.
      const index_t ahead = row + CEC_STAGES * clusters;
      if (ahead < rows) {
        // The stage's reads were generic-proxy loads; its refill is an async-proxy write: the
        // PTX memory model orders the two only through a proxy fence.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        cec_issue_share(cec_stage + st * CEC_STAGE_CHUNKS, cec_smem(&mbar_full[st]),
                        logits + ahead * vocab, rank, chunks);
      }
      float bm = warp_f[0];
#pragma unroll
      for (int v = 1; v < CEC_WARPS; ++v) bm = fmaxf(bm, warp_f[v]);
      cec_mbar_expect(mb_m, CEC_CTAS * 4);
#pragma unroll
      for (int r = 0; r < CEC_CTAS; ++r) cec_send1(cec_smem(&slot_m[rank]), mb_m, r, __float_as_uint(bm));
    }
    cec_mbar_wait(mb_m, parity); // A: every CTA's max is here
    const float x_label = label_logit; // read before this row's sum barrier (see below)
    float row_m = slot_m[0];
#pragma unroll
    for (int r = 1; r < CEC_CTAS; ++r) row_m = fmaxf(row_m, slot_m[r]);

    // 3. Exponentials, their sum, and the first index of the max.
    int my_i = CEC_NO_INDEX;
    if (my_m == row_m) { // only the few threads holding the max search (a NaN m matches none)
#pragma unroll
      for (int c = CEC_MAXC - 1; c >= 0; --c) { // backwards: the last hit is the lowest index
        float f[8];
        bf16x8_unpack(raw[c], f);
#pragma unroll
        for (int j = 7; j >= 0; --j) {
          if (f[j] == row_m) my_i = (g + c * CEC_THREADS) * BF16_PER_VEC + j;
        }
      }
    }
    const float m2 = row_m * L2E;
    float e[CEC_MAXC][8];
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < CEC_MAXC; ++c) {
      float f[8];
      bf16x8_unpack(raw[c], f);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        e[c][j] = ex2_approx(fmaf(f[j], L2E, -m2)); // past the row: 2^-inf = 0
        s += e[c][j];
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
      my_i = min(my_i, __shfl_xor_sync(0xFFFFFFFFu, my_i, o));
    }
    if (lane == 0) {
      warp_f[warp] = s;
      warp_i[warp] = my_i;
    }
    __syncthreads();
    if (tid == 0) {
      float bs = warp_f[0];
      int bi = warp_i[0];
#pragma unroll
      for (int v = 1; v < CEC_WARPS; ++v) {
        bs += warp_f[v];
        bi = min(bi, warp_i[v]);
      }
      cec_mbar_expect(mb_si, CEC_CTAS * 8);
#pragma unroll
      for (int r = 0; r < CEC_CTAS; ++r) {
        cec_send2(cec_smem(&slot_si[rank][0]), mb_si, r, __float_as_uint(bs), (uint32_t)bi);
      }
    }
    cec_mbar_wait(mb_si, parity); // B: every CTA's sum and index are here
    parity ^= 1u;
    float row_s = __uint_as_float(slot_si[0][0]);
    int row_i = (int)slot_si[0][1];
#pragma unroll
    for (int r = 1; r < CEC_CTAS; ++r) {
      row_s += __uint_as_float(slot_si[r][0]);
      row_i = min(row_i, (int)slot_si[r][1]);
    }
    if (rank == 0 && tid == 0) {
      argmax[row] = row_i == CEC_NO_INDEX ? 0 : row_i;
      loss[row] = supervised ? w * ((row_m + logf(row_s)) - x_label) : 0.0f;
    }

    // 4. The gradient over this thread's chunks.
    uint4* out = reinterpret_cast<uint4*>(lr);
    const float coef = grad_scale * w, scale = coef / row_s;
#pragma unroll
    for (int c = 0; c < CEC_MAXC; ++c) {
      const int k = g + c * CEC_THREADS;
      if (k < chunks) {
        float f[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = supervised ? scale * e[c][j] : 0.0f;
        __stcs(out + k, bf16x8_pack_rn_fast(f));
      }
    }
    // The label's element, rewritten by the thread that just wrote its chunk (program order: this
    // store lands last). e_label is the very e[c][j] above: same input, same two instructions.
    if (supervised && g == (label >> 3) % CEC_THREADS) {
      const float e_label = ex2_approx(fmaf(x_label, L2E, -m2));
      lr[label] = __float2bfloat16_rn(fmaf(scale, e_label, -coef));
    }
  }
  cluster.sync(); // no CTA exits while a message to it may be in flight
}

extern "C" __global__ void __launch_bounds__(CE_BLOCK)
    cross_entropy_bf16(__nv_bfloat16* logits, const int* __restrict__ labels,
                       const float* __restrict__ weights, long long rows, int vocab,
                       float grad_scale, float* __restrict__ loss, int* __restrict__ argmax) {
  if (blockDim.x != CE_BLOCK) __trap(); // the warp-state arrays have CE_WARPS entries
  if (rows <= 0 || vocab <= 0) return;
  // vocab % 8 == 0 keeps every row start 16-byte aligned.
  if (vocab % BF16_PER_VEC == 0 && is_vec_aligned(logits)) {
    ce_rows<BF16_PER_VEC>(logits, labels, weights, rows, vocab, grad_scale, loss, argmax);
  } else {
    ce_rows<1>(logits, labels, weights, rows, vocab, grad_scale, loss, argmax);
  }
}
