// cross_entropy.cu: weighted cross-entropy over one chunk of lm_head logits, forward and backward
// in one kernel, the gradient written over the logits in place (DESIGN.md section 8: the full
// logits tensor would be ~10 GB, one chunk of 2048 x 151,936 is 622 MB).
//
// Math (per row r; x = f32(logits[r, :]), w = weights[r], y = labels[r]):
//   argmax[r] = lowest c with x[c] = max_c x[c]      (cpu.rs keeps the first maximum)
//   lse = m + logf(sum_c expf(x[c] - m)), m = max_c x[c]
//   supervised = (w != 0) && 0 <= y < vocab
//   supervised:  loss[r] = w * (lse - x[y]);
//                logits[r, c] = bf16((grad_scale * w) * (expf(x[c] - lse) - [c == y]))
//   otherwise:   loss[r] = 0;  logits[r, c] = +0.0
//   The loss and gradient expressions are cpu.rs's, one IEEE rounding each (__fmul_rn etc.). The
//   sum is an online softmax (see below), so lse differs from the CPU's by a few ulp: compare
//   with a tolerance. Non-finite logits give a non-finite loss (caught by the finite check);
//   argmax is then some index in [0, vocab).
// Layouts:  logits: [rows, vocab] bf16 row-major, contiguous, overwritten. labels: [rows] i32,
//           weights: [rows] f32, loss: [rows] f32, argmax: [rows] i32 (the launcher passes the
//           offset views: labels + w_off, weights + w_off, loss + loss_off, argmax + argmax_off).
// Preconditions: 1 <= vocab < 2^31, rows >= 0; loss, argmax, labels, weights do not overlap the
//           logits.
// Algorithm: one CTA per row (grid-stride over rows), CE_BLOCK threads.
//   Pass A (read only): each thread walks its chunks k = tid, tid + CE_BLOCK, ... (8 bf16 per
//   chunk when vocab % 8 == 0 and logits is 16-byte aligned, else 1) in increasing column order
//   keeping an online-softmax state (max m, sum s of expf(x - m), index of the first max).
//   States merge in a fixed tree: a xor butterfly within each warp, then every thread merges the
//   CE_WARPS warp states in warp order. Ties on the max keep the lower index.
//   Barrier: the whole row has been read (and x[y] was read by thread 0 before pass A) before
//   pass B writes anything.
//   Pass B: each thread rewrites its own chunks (read x, write the gradient, same thread, same
//   address), or writes zeros for an unsupervised row.
// Launch:   blockDim.x must be CE_BLOCK = 512 (traps otherwise); grid.x = rows (any grid.x >= 1 is
//           valid, grid-stride over rows); no dynamic shared memory; no scratch.
// Bytes:    rows * vocab * 2 * 3 (pass A read, pass B read + write; pass B's read hits L2 for
//           rows resident there) + rows * 16.
// FLOPs:    ~8 per element + 2 expf per element (supervised rows).
// Bound:    memory, nearly co-bound with the FP32 pipe: 2 precise expf (~10 instructions each)
//           per element at 6 bytes per element is ~50% of an H200's issue rate at HBM speed.
//           Target >= 70% of the measured device-to-device copy bandwidth (~4.1 TB/s on an H200)
//           for the 6 bytes per element: a 2048 x 151,936 chunk in <= ~0.65 ms. Measured (H200):
//           0.55 ms, 3.4 TB/s; 2048 x 151,936: 0.370 ms, 79.7% of copy bandwidth. (Walking pass B
//           backwards, two chunks per iteration, to re-read the row's end from L2 measured 0.409 ms:
//           worse, not kept.) Accuracy: lse is within ~1.5e-7 relative of an f64 reference; the
//           CPU reference's sequential f32 sum is off by up to ~2e-5 relative at 152K-262K vocab,
//           so the CPU comparison needs a loss tolerance of ~1e-4 relative.
#include "common.cuh"

// Threads per CTA (one CTA per row). 512 = 16 warps: a 152K-vocab row is 37 chunks of 8 per
// thread, and 4 CTAs fit on an SM.
#define CE_BLOCK 512
#define CE_WARPS (CE_BLOCK / 32)
// "No element seen yet" marker for a state's index.
#define CE_NO_INDEX (-1)

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
    st.s = __fadd_rn(__fmul_rn(st.s, expf(__fsub_rn(st.m, x))), 1.0f);
    st.m = x;
    st.i = c;
  } else {
    // x == m adds exactly 1 (also when both are -inf, where x - m would be NaN).
    st.s = __fadd_rn(st.s, x == st.m ? 1.0f : expf(__fsub_rn(x, st.m)));
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
  const float lo_scaled = lo_m == hi_m ? lo_s : __fmul_rn(lo_s, expf(__fsub_rn(lo_m, hi_m)));
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
          const float p = expf(__fsub_rn(f[j], lse));
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
