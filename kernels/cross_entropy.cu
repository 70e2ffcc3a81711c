// cross_entropy.cu: weighted cross-entropy over one chunk of lm_head logits, forward and backward
// in one kernel, the gradient written over the logits in place (DESIGN.md section 8: the full
// logits tensor would be ~10 GB, one chunk of 2048 x 151,936 is 622 MB). Three kernels with the
// same contract, for vocab % 8 == 0: cross_entropy_cluster_bf16 (below; a row held on chip by a
// cluster of CTAs, read once) from 32,768 to 163,840, cross_entropy_cluster_wide_bf16 (the same
// code, one CTA per SM) from 163,848 to 262,144; cross_entropy_bf16 (streaming, reads each row
// twice) for every other shape.
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
// Bound:    memory. Counted at the minimum 4 bytes per element, the two reads cap it at 66.7% of
//           copy bandwidth, which is why the cluster kernels take every vocabulary they can hold.
//           Target: >= 80% of that cap (53% of copy bandwidth). Measured (H200, supervised rows
//           of N(0, 1) logits; zero weights would skip the exponentials and pass B's read):
//           1024 x 262,144 in 0.448 ms, 56.6% of copy bandwidth.
#include <cooperative_groups.h>

#include "common.cuh"
#include "launch.cuh"

namespace cg = cooperative_groups;

// Threads per CTA (one CTA per row): CE_BLOCK = 512 (launch.cuh) = 16 warps: a 152K-vocab row is
// 37 chunks of 8 per thread, and 4 CTAs fit on an SM.
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

// ---- On-chip path: a cluster of CTAs holds one row ------------------------------------------------
// The streaming kernel above reads a row twice; its second read only hits L2 while the rows in
// flight fit there (4 CTAs x 132 SMs x a 304 KB row is 160 MB, far over the H200's 50 MB), so at
// a 152K vocab it moves ~6 bytes per element. Here a cluster of CTAS CTAs (thread blocks on
// different SMs that can write each other's shared memory) owns a row at a time: each CTA's share
// of the row arrives in shared memory by bulk copy (TMA) a row ahead and stays there until the
// single write (4 bytes per element in all), and the CTAs exchange one online-softmax state each
// per row: one message round trip.
//
// Math (x = f32(logits[r, :]); L = log2 e):
//   m = max_c x[c] (NaNs skipped), argmax = lowest c with x[c] == m (0 if there is none: a row of
//   NaNs). Each CTA q exponentiates its share against its own max m_q (no wait for the row's):
//   e[c] = 2^(x[c] L - m_q L) (ex2.approx of one FMA), s_q = sum e[c]; the states (m_q, s_q, i_q)
//   merge as online softmax (s = s_hi + s_lo 2^((m_lo - m_hi) L)) into (m, s, argmax);
//   lse = m + logf(s);
//   supervised:  loss[r] = w (lse - x[y]);
//                logits[r, c] = bf16(k_q e[c] - [c == y] grad_scale w),
//                k_q = (grad_scale w / s) 2^((m_q - m) L)      (cvt.rn, NaN payloads not kept)
//   otherwise:   loss[r] = 0; logits[r, c] = +0.0.
//   Against the CPU's expf(x - lse): ~1e-6 relative per probability, far under a bf16
//   gradient's 4e-3 and the 1e-4 loss tolerance. Non-finite logits give a non-finite loss.
// Layout/preconditions: as cross_entropy_bf16, plus vocab % 8 == 0, logits 16-byte aligned and
//   vocab <= the kernel's maximum (CTAS * BLOCK * MAXC * 8; the launcher picks this kernel
//   only then; it traps otherwise).
// Algorithm: cluster q (CTAs [CTAS q, CTAS q + CTAS)) takes rows q, q + Q, ... for
//   Q = gridDim.x / CTAS clusters (the launcher makes them co-resident). Thread t of CTA rank r
//   is cluster thread g = r * BLOCK + t and owns the 8-element chunks g + i * CTAS * BLOCK,
//   i < MAXC, in increasing column order; the CTA's share is MAXC contiguous segments of BLOCK
//   chunks. Thread 0 keeps up to STAGES rows' shares in flight (bulk copies completing on the
//   stage's mbarrier). Per row (the CTA's it-th, in stage it % STAGES):
//   1. wait for the stage (every pass reads the thread's chunks from it; past the row: -inf); the
//      thread owning the label's chunk reads x[label] (it writes the loss);
//   2. thread max (packed bf16x2 max, NaNs skipped) -> warp max -> shared memory; block barrier 1
//      (after which thread 0 refills the previous row's stage: every thread has finished reading
//      it); every thread takes the CTA max m_q over the warps in order; the threads holding m_q
//      search its lowest index; e[c], s per thread in chunk order -> warp (xor butterfly) ->
//      shared memory with the warp's lowest index (redux); block barrier 2;
//   3. warp 0 sums the warps in a fixed tree and lane 0 sends (m_q, s_q, i_q) to every CTA of the
//      cluster (one message, into slot [rank] of buffer it % 2);
//   4. every thread waits for the CTAS messages and merges them (butterflies over lanes: the
//      same bits in every thread of every CTA) -> m, s, argmax; then writes the gradient (or
//      zeros) over its own chunks with streaming stores; the label's owner then rewrites that one
//      element with the one-hot term subtracted.
//   Messages (see "Cluster messages" below) are double-buffered by row parity: a CTA sends row
//   it + 2's state into buffer it % 2 of another CTA only after that CTA's row it + 1 message
//   arrived, which it sends only after every one of its threads read row it's slots (block
//   barriers of row it + 1). Every read of a row precedes the CTA's message and every write of it
//   follows all CTAS messages; each thread writes only its own chunks: the in-place update is
//   race-free. Every sum's order is fixed by the shapes alone: results are deterministic.
// Launch:   grid.x = CTAS * Q, 1 <= Q (<= the co-resident cluster count, for the rows in
//           flight to overlap the math; any Q is correct), blockDim.x = BLOCK, the kernel's
//           STAGES * MAXC * BLOCK * 16 bytes of dynamic shared memory; the cluster shape is
//           compiled in (__cluster_dims__).
// Bytes:    rows * vocab * 4 (one read, one write) + rows * 16.
// Bound:    memory, with the exponentials (two MUFU ops per element: half the SFU rate at HBM
//           speed) and ~9 other instructions per element overlapping the two rows in flight per
//           SM. Target >= 80% of the measured device-to-device copy bandwidth (4.24 TB/s on the
//           H200), counted at 4 bytes per element. Measured (H200, supervised rows of N(0, 1)
//           logits): 2048 x 151,936 in 0.350 ms (83.9%); the wide kernel at 1024 x 262,144 in
//           0.296 ms (85.1%, against the streaming kernel's 56.6%).
// Why it is shaped so:
//   - The row arrives by TMA into a ring of stages, rows ahead, and stays in shared memory (not
//     registers), so two CTAs fit on an SM up to 163,840 and two rows are in flight per SM.
//   - One message round trip per row: each CTA exponentiates against its own max and the
//     (m, s, i) states merge afterwards, instead of a first round trip for the row's max.
//   - One max-index search per CTA (the threads holding m_q) and a butterfly merge of the
//     states: measured faster than a search in every warp.
//   - Messages by st.async into mbarrier-counted slots, not cluster barriers: a barrier's release
//     waits for the thread's outstanding loads, so the next row's copies could not overlap.
//   - Above 163,840 a 2-stage ring of the 8-CTA share no longer fits twice on an SM: the wide
//     kernel runs one CTA of 512 threads per SM, 8 chunks each, 2 stages (the fastest of the
//     one-CTA-per-SM layouts measured at 262,144).
//   - Clusters of 8, the portable size, for both.
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

// Thread 0: one bulk copy (TMA) per segment of this CTA's share of a row into a stage, all
// completing on the stage's mbarrier. Segment c is chunks [c * CEC_CTAS * BLOCK + rank * BLOCK,
// + BLOCK) of the row, clipped to it: contiguous, 16-byte aligned, a multiple of 16 bytes.
template <int CTAS, int BLOCK, int MAXC>
__device__ __forceinline__ void cec_issue_share(uint4* stage, uint32_t mbar, const __nv_bfloat16* lr,
                                                int rank, int chunks) {
  uint32_t bytes[MAXC];
  uint32_t total = 0;
#pragma unroll
  for (int c = 0; c < MAXC; ++c) {
    const int start = c * CTAS * BLOCK + rank * BLOCK;
    const int n = min(max(chunks - start, 0), BLOCK);
    bytes[c] = (uint32_t)n * VEC_BYTES;
    total += bytes[c];
  }
  cec_mbar_expect(mbar, total);
#pragma unroll
  for (int c = 0; c < MAXC; ++c) {
    if (bytes[c] == 0) continue;
    const uint4* src = reinterpret_cast<const uint4*>(lr) + c * CTAS * BLOCK + rank * BLOCK;
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            cec_smem(stage + c * BLOCK)),
        "l"(src), "r"(bytes[c]), "r"(mbar)
        : "memory");
  }
}

// ---- Cluster messages: st.async into every CTA's slot, counted by the receiver's mbarrier -------
// A cluster barrier (barrier.cluster.arrive.release) waits for the thread's outstanding loads, so
// with one the next row's loads could not overlap this row's math (measured: 0.727 ms instead of
// the ~0.3 ms the bandwidth allows for 2048 x 151,936). Instead each CTA's thread 0 pushes its
// state into slot [rank] of every CTA of the cluster with st.async, which completes bytes on the
// receiver's mbarrier; the receiver waits for the expected bytes (one phase per use of the
// buffer) and reads its own slots. No fence, no barrier: the loads in flight stay in flight.

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

__device__ __forceinline__ void cec_send(uint32_t slot, uint32_t mbar, uint32_t rank, uint4 v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                   cec_remote(slot, rank)),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cec_remote(mbar, rank))
               : "memory");
}

// A CTA's softmax state for a row: m = the max of its share, s = sum 2^((x - m) L) over it, i = the
// lowest index holding m (an all -inf share: (-inf, 0, its lowest index)); the message's words.
struct CecState {
  float m;
  float s;
  int i;
};

__device__ __forceinline__ CecState cec_unslot(const uint4& v) {
  return CecState{__uint_as_float(v.x), __uint_as_float(v.y), (int)v.z};
}

// CTAS CTAs per cluster (one row), BLOCK threads per CTA, MAXC chunks of 8 per thread, STAGES row
// shares in the ring. Every pass reads the thread's chunks from the stage (registers hold none of
// the row: up to 163,840 two CTAs fit on an SM, so two rows are in flight on each), and the
// gradient recomputes
// the exponentials (two MUFU ops per element). A stage is refilled at the next row's first block
// barrier, after every thread's last read of it (the previous row's gradient pass).
template <int CTAS, int BLOCK, int MAXC, int STAGES>
__device__ __forceinline__ void cec_rows(__nv_bfloat16* logits, const int* __restrict__ labels,
                                         const float* __restrict__ weights, long long rows, int vocab,
                                         float grad_scale, float* __restrict__ loss,
                                         int* __restrict__ argmax) {
  constexpr int WARPS = BLOCK / 32;
  constexpr int THREADS = CTAS * BLOCK;
  constexpr int STAGE_CHUNKS = MAXC * BLOCK;
  static_assert(WARPS >= 2 && WARPS <= 32 && (WARPS & (WARPS - 1)) == 0, "warp tree: a power of 2");
  static_assert(CTAS >= 2 && CTAS <= 32 && (CTAS & (CTAS - 1)) == 0, "lane butterflies: a power of 2");
  static_assert(STAGES >= 2, "a stage is refilled one row after its last read");
  __shared__ float warp_m[WARPS];
  __shared__ float warp_s[WARPS];
  __shared__ int warp_i[WARPS];
  // Buffer p's slot [r]: CTA r's state for this CTA's rows of parity p; one mbarrier per buffer.
  __shared__ __align__(16) uint4 slot[2][CTAS];
  __shared__ __align__(8) uint64_t mbar_msg[2];
  __shared__ __align__(8) uint64_t mbar_full[STAGES]; // stage s holds its row
  extern __shared__ __align__(128) uint4 cec_stage[];     // [STAGES][MAXC][BLOCK]
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (blockDim.x != BLOCK || gridDim.x % CTAS != 0 || vocab % BF16_PER_VEC != 0 ||
      vocab > THREADS * MAXC * BF16_PER_VEC || !is_vec_aligned(logits) || rows > INT_MAX - (long long)gridDim.x * STAGES ||
      dyn_smem < STAGES * STAGE_CHUNKS * VEC_BYTES) {
    __trap();
  }
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = rank * BLOCK + tid;
  const int chunks = vocab / BF16_PER_VEC;
  const int clusters = (int)gridDim.x / CTAS;
  const float L2E = CE_LOG2E;

  const int first = (int)blockIdx.x / CTAS; // the cluster's first row
  if (tid == 0) {
    cec_mbar_init(cec_smem(&mbar_msg[0]));
    cec_mbar_init(cec_smem(&mbar_msg[1]));
    for (int st = 0; st < STAGES; ++st) cec_mbar_init(cec_smem(&mbar_full[st]));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); // the barriers, to the TMA unit
    // The prologue: the first STAGES rows in flight.
    for (int st = 0; st < STAGES; ++st) {
      const int r = first + st * clusters;
      if (r < rows) {
        cec_issue_share<CTAS, BLOCK, MAXC>(cec_stage + st * STAGE_CHUNKS, cec_smem(&mbar_full[st]),
                                     logits + (index_t)r * vocab, rank, chunks);
      }
    }
  }
  cluster.sync(); // every mbarrier is initialised before any CTA sends

  // Each row's weight and label are loaded one row ahead (their latency is off the row's path).
  float w_next = first < rows ? weights[first] : 0.0f;
  int label_next = first < rows ? labels[first] : 0;
  int it = 0; // this CTA's row count: the row sits in stage it % STAGES
  for (int row = first; row < rows; row += clusters, ++it) { // uniform over the cluster
    const float w = w_next;
    const int label = label_next;
    if (row + clusters < rows) {
      w_next = weights[row + clusters];
      label_next = labels[row + clusters];
    }
    __nv_bfloat16* lr = logits + (index_t)row * vocab;
    const int st = it % STAGES;
    const uint4* stage = cec_stage + st * STAGE_CHUNKS;
    cec_mbar_wait(cec_smem(&mbar_full[st]), (uint32_t)(it / STAGES) & 1u);
    // Chunk c of this thread; past the row: -inf bits (0xFF80), which add 2^-inf = 0 and lose
    // every max.
    auto chunk = [&](int c) -> uint4 {
      return g + c * THREADS < chunks ? stage[c * BLOCK + tid]
                                      : make_uint4(0xFF80FF80u, 0xFF80FF80u, 0xFF80FF80u, 0xFF80FF80u);
    };
    const bool supervised = w != 0.0f && label >= 0 && label < vocab;
    // The thread owning the label's chunk reads x[label] (before its CTA's message, so before
    // any CTA writes the row) for the loss and the one-hot term.
    const bool owner = supervised && g == (label >> 3) % THREADS;
    const float x_label = owner ? bf16_to_f32(lr[label]) : 0.0f;

    // 2. The CTA's max (warp maxes through shared memory), the first index holding it, and the
    //    exponentials against it.
    uint32_t mp = 0xFF80FF80u;
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
      const uint4 v = chunk(c);
      mp = bf16x2_max(mp, bf16x2_max(bf16x2_max(v.x, v.y), bf16x2_max(v.z, v.w)));
    }
    const float my_m = fmaxf(bf16x2_lo_to_f32(mp), bf16x2_hi_to_f32(mp)); // fmaxf skips NaNs too
    float wm = my_m;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) wm = fmaxf(wm, __shfl_xor_sync(0xFFFFFFFFu, wm, o));
    if (lane == 0) warp_m[warp] = wm;
    __syncthreads();
    if (tid == 0 && it >= 1) {
      // Every thread has finished reading the previous row's stage (barrier above): it takes the
      // row STAGES after that one.
      const int ahead = row + (STAGES - 1) * clusters;
      if (ahead < rows) {
        // The stage's reads were generic-proxy loads; its refill is an async-proxy write: the
        // PTX memory model orders the two only through a proxy fence.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        const int ds = (it - 1) % STAGES;
        cec_issue_share<CTAS, BLOCK, MAXC>(cec_stage + ds * STAGE_CHUNKS, cec_smem(&mbar_full[ds]),
                                           logits + (index_t)ahead * vocab, rank, chunks);
      }
    }
    float cm = warp_m[0];
#pragma unroll
    for (int v = 1; v < WARPS; ++v) cm = fmaxf(cm, warp_m[v]);
    int my_i = CEC_NO_INDEX;
    if (my_m == cm) { // only the few threads holding the CTA's max search (a NaN matches none)
#pragma unroll
      for (int c = MAXC - 1; c >= 0; --c) { // backwards: the last hit is the lowest index
        float f[8];
        bf16x8_unpack(chunk(c), f);
#pragma unroll
        for (int j = 7; j >= 0; --j) {
          if (f[j] == cm) my_i = (g + c * THREADS) * BF16_PER_VEC + j;
        }
      }
    }
    // A CTA whose elements are all -inf exponentiates against 0 (e = 0, s = 0) instead of
    // -inf - -inf = NaN; its state is then (-inf, 0, its index), which every finite state beats.
    const float ref = cm == -INFINITY ? 0.0f : cm;
    const float refl = ref * L2E;
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
      float f[8];
      bf16x8_unpack(chunk(c), f);
#pragma unroll
      for (int j = 0; j < 8; ++j) s += ex2_approx(fmaf(f[j], L2E, -refl)); // past the row: 2^-inf = 0
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    const int wi = __reduce_min_sync(0xFFFFFFFFu, my_i);
    if (lane == 0) {
      warp_s[warp] = s;
      warp_i[warp] = wi;
    }
    __syncthreads();

    // 3. The CTA's state (sums in a fixed tree over the warps), to every CTA of the cluster.
    //    warp_m is rewritten (next row) only after the barrier above, which every thread reached
    //    after reading it; warp_s and warp_i only after the next row's first barrier, which warp 0
    //    reaches after reading them.
    const int buf = it & 1;
    if (warp == 0) {
      float cs = lane < WARPS ? warp_s[lane] : 0.0f;
#pragma unroll
      for (int o = WARPS / 2; o > 0; o >>= 1) cs += __shfl_down_sync(0xFFFFFFFFu, cs, o);
      const int ci = __reduce_min_sync(0xFFFFFFFFu, lane < WARPS ? warp_i[lane] : CEC_NO_INDEX);
      if (lane == 0) {
        const uint32_t mb = cec_smem(&mbar_msg[buf]);
        cec_mbar_expect(mb, CTAS * (uint32_t)sizeof(uint4));
        const uint4 msg = make_uint4(__float_as_uint(cm), __float_as_uint(cs), (uint32_t)ci, 0u);
#pragma unroll
        for (int r = 0; r < CTAS; ++r) cec_send(cec_smem(&slot[buf][rank]), mb, r, msg);
      }
    }

    // 4. The row's state (the same bits in every thread of every CTA), the gradient.
    cec_mbar_wait(cec_smem(&mbar_msg[buf]), (uint32_t)(it >> 1) & 1u);
    // Lane l of every warp takes CTA (l % CTAS)'s state; the row's max, sum and index come from
    // xor butterflies over groups of CTAS lanes (a + b == b + a: every lane of every warp, in
    // every CTA, gets the same bits): ~20 instructions instead of a merge tree's ~110.
    const CecState mine = cec_unslot(slot[buf][lane % CTAS]);
    float row_m = mine.m;
#pragma unroll
    for (int o = CTAS / 2; o > 0; o >>= 1) row_m = fmaxf(row_m, __shfl_xor_sync(0xFFFFFFFFu, row_m, o));
    // A state with s == 0 (an all -inf share) adds exactly 0, even when its max is the row's.
    float row_s = mine.s == 0.0f ? 0.0f : mine.s * ex2_approx((mine.m - row_m) * L2E);
#pragma unroll
    for (int o = CTAS / 2; o > 0; o >>= 1) row_s += __shfl_xor_sync(0xFFFFFFFFu, row_s, o);
    const int row_i = __reduce_min_sync(0xFFFFFFFFu, mine.m == row_m ? mine.i : CEC_NO_INDEX);
    const CecState row_st{row_m, row_s, row_i};
    if (rank == 0 && tid == 0) {
      argmax[row] = row_st.i == CEC_NO_INDEX ? 0 : row_st.i;
      if (!supervised) loss[row] = 0.0f;
    }
    if (owner) loss[row] = w * ((row_st.m + logf(row_st.s)) - x_label);
    uint4* out = reinterpret_cast<uint4*>(lr);
    const float coef = grad_scale * w;
    // 2^((m_cta - m) L) rescales this CTA's e to the row's max; an all -inf CTA's e are all 0
    // (its factor, against ref = 0, could overflow to inf and give inf * 0 = NaN).
    const float scale = cm == -INFINITY ? 0.0f : (coef / row_st.s) * ex2_approx((cm - row_st.m) * L2E);
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
      const int k = g + c * THREADS;
      if (k < chunks) {
        float f[8];
        if (supervised) {
          // The same two instructions as the sum's: the same bits.
          bf16x8_unpack(chunk(c), f);
#pragma unroll
          for (int j = 0; j < 8; ++j) f[j] = scale * ex2_approx(fmaf(f[j], L2E, -refl));
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) f[j] = 0.0f;
        }
        __stcs(out + k, bf16x8_pack_rn_fast(f));
      }
    }
    // The label's element again, with the one-hot term subtracted, by the thread that just wrote
    // its chunk (program order: this store lands last). e_label is the very exponential above:
    // same input, same two instructions.
    if (owner) {
      const float e_label = ex2_approx(fmaf(x_label, L2E, -refl));
      lr[label] = __float2bfloat16_rn(fmaf(scale, e_label, -coef));
    }
  }
  cluster.sync(); // no CTA exits while a message to it may be in flight
}

// One cluster kernel: clusters of 8, CTAs of 512 threads, MAXC chunks per thread, a 2-stage ring,
// MIN_CTAS CTAs per SM (the launch bounds' register budget).
#define CEC_KERNEL(NAME, MAXC, MIN_CTAS)                                                              \
  extern "C" __global__ void __cluster_dims__(CEC_CTAS, 1, 1) __launch_bounds__(CEC_BLOCK, MIN_CTAS) \
      NAME(__nv_bfloat16* logits, const int* __restrict__ labels, const float* __restrict__ weights, \
           long long rows, int vocab, float grad_scale, float* __restrict__ loss,                    \
           int* __restrict__ argmax) {                                                               \
    cec_rows<CEC_CTAS, CEC_BLOCK, MAXC, CEC_STAGES>(logits, labels, weights, rows, vocab, grad_scale, \
                                                    loss, argmax);                                   \
  }

// vocab % 8 == 0 in [32,768, 163,840] (Qwen3's 151,936, Llama 3's 128,256): two CTAs per SM,
// 40 KB stages.
CEC_KERNEL(cross_entropy_cluster_bf16, CEC_CHUNKS, 2)

// vocab % 8 == 0 in [163,848, 262,144] (Gemma's 262,144 and 256,000): one CTA per SM (a 64 KB
// share: two CTAs' rings would not fit), 64 KB stages.
CEC_KERNEL(cross_entropy_cluster_wide_bf16, CEC_WIDE_CHUNKS, 1)

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
