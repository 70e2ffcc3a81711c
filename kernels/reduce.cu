// reduce.cu: deterministic sum of squares (the global gradient norm for clipping), in two kernels
// with a fixed shape, so the f32 result is bit-identical run to run and on any GPU.
//
// Math:     out[0] = sum_i x[i]^2, f32 accumulation.
// Order (fixed by constants, never by the launch or the pointer alignment):
//   sum_squares_partial_f32: SUMSQ_PARTS blocks x SUMSQ_BLOCK threads = G threads. Thread
//   t = block * SUMSQ_BLOCK + tid owns the 4-element groups q = t, t + G, t + 2G, ... (elements
//   4q..4q+3, clipped to n) and accumulates acc = fmaf(x, x, acc) over them in increasing element
//   order. The block's 256 sums: xor butterfly within each warp, then the 8 warp sums added in
//   warp order -> partial[block].
//   sum_partials_f32: thread tid sums partial[tid], partial[tid + 256], ... in order; the same
//   butterfly-then-warp-order tree -> out[0].
//   The CPU sums 16K-element chunks with 8 accumulators: a different order, so GPU vs CPU is
//   compared with a tolerance; GPU vs GPU is bit-exact.
// Layouts:  x: [n] f32, contiguous. partial: [SUMSQ_PARTS] f32 scratch. out: [1] f32.
// Preconditions: n >= 0 (n == 0 gives out[0] = 0); x does not overlap partial or out.
// Launch:   sum_squares_partial_f32: grid.x must be SUMSQ_PARTS = 1024 and blockDim.x must be
//           SUMSQ_BLOCK = 256 (the kernel traps otherwise: the summation order depends on them).
//           sum_partials_f32: grid.x must be 1 and blockDim.x must be SUMSQ_BLOCK (traps
//           otherwise); parts = SUMSQ_PARTS for this pair (any parts >= 0 is accepted).
//           No dynamic shared memory. Scratch: partial, SUMSQ_PARTS f32, owned by the launcher.
// Bytes:    4 n + 4 * SUMSQ_PARTS * 2 + 4.
// FLOPs:    2 n (one FMA per element).
// Bound:    memory. Target >= 80% of the measured device-to-device copy bandwidth's read half
//           (~4.1 TB/s read + write on an H200) for n >= 2^26 (a drafter's gradient); below
//           ~2^20 elements the two launches dominate. Measured (H200, n = 2^28): 4.3 TB/s read.
#include "common.cuh"
#include "launch.cuh"

// Blocks of the partial pass = entries of `partial`. 1024 x 256 threads is ~8 resident blocks
// per SM on a 132-SM H200: one full wave, enough loads in flight to stream at HBM rate.
// (SUMSQ_PARTS, launch.cuh)
// Threads per block, both kernels (8 warps).
// (SUMSQ_BLOCK, launch.cuh)
#define SUMSQ_WARPS (SUMSQ_BLOCK / 32)
// Elements per group (one 16-byte access on the fast path).
#define SUMSQ_GROUP 4

// Fixed-tree block sum; every thread calls it; thread 0 gets the total.
__device__ __forceinline__ float sumsq_block_sum(float v) {
  __shared__ float warp_sum[SUMSQ_WARPS];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  if ((threadIdx.x & 31u) == 0u) warp_sum[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = warp_sum[0];
#pragma unroll
  for (int i = 1; i < SUMSQ_WARPS; ++i) s += warp_sum[i];
  return s;
}

extern "C" __global__ void __launch_bounds__(SUMSQ_BLOCK)
    sum_squares_partial_f32(const float* __restrict__ x, long long n,
                            float* __restrict__ partial) {
  if (gridDim.x != SUMSQ_PARTS || blockDim.x != SUMSQ_BLOCK) __trap(); // fixed order
  const index_t threads = (index_t)SUMSQ_PARTS * SUMSQ_BLOCK;
  const index_t t = (index_t)blockIdx.x * SUMSQ_BLOCK + threadIdx.x;
  const index_t full_groups = n > 0 ? n / SUMSQ_GROUP : 0;
  float acc = 0.0f;
  if (is_vec_aligned(x)) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (index_t q = t; q < full_groups; q += threads) {
      const float4 v = x4[q];
      acc = fmaf(v.x, v.x, acc);
      acc = fmaf(v.y, v.y, acc);
      acc = fmaf(v.z, v.z, acc);
      acc = fmaf(v.w, v.w, acc);
    }
  } else {
    // Same groups, same order, same bits: only the loads differ.
    for (index_t q = t; q < full_groups; q += threads) {
      const float* g = x + q * SUMSQ_GROUP;
      acc = fmaf(g[0], g[0], acc);
      acc = fmaf(g[1], g[1], acc);
      acc = fmaf(g[2], g[2], acc);
      acc = fmaf(g[3], g[3], acc);
    }
  }
  // The last partial group (n % 4 elements) is group full_groups, owned by thread
  // full_groups % threads, which visits it after all its full groups: increasing order holds.
  if (n > 0 && t == full_groups % threads) {
    for (index_t i = full_groups * SUMSQ_GROUP; i < n; ++i) acc = fmaf(x[i], x[i], acc);
  }
  const float s = sumsq_block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(SUMSQ_BLOCK)
    sum_partials_f32(const float* __restrict__ partial, int parts, float* __restrict__ out) {
  if (gridDim.x != 1 || blockDim.x != SUMSQ_BLOCK) __trap(); // fixed order
  float acc = 0.0f;
  for (int i = threadIdx.x; i < parts; i += SUMSQ_BLOCK) acc += partial[i];
  const float s = sumsq_block_sum(acc);
  if (threadIdx.x == 0) out[0] = s;
}

// ---- argmax_rows: the greedy token of each row of logits (decoding) ----
// Math:     out[r] = the smallest c in 0..cols with x[r * stride + c] = max over 0..cols of the
//           row (ties go to the lowest index, as a host scan with a strict `>` picks; NaN never
//           wins unless it is at c = 0, the same as that scan).
// Layouts:  x: rows of `stride` elements, the first `cols` read (a vocabulary padded past what
//           a tokenizer can decode is left out by cols < stride). out: [rows] i32.
//           A NaN is never chosen over a number it is compared with; a row of NaNs gets some
//           index in 0..cols (a decoding that meets NaN logits has failed before this).
// Launch:   grid.x = rows, blockDim.x = ARGMAX_BLOCK (launch.cuh; traps otherwise), cols >= 1.
//           No dynamic shared memory.
// Bytes:    rows * cols * sizeof(T) read, 4 * rows written.
// Bound:    memory; a 152K-entry row is 300-600 KB, one block streams it.
__device__ __forceinline__ float argmax_f32(float v) { return v; }
__device__ __forceinline__ float argmax_f32(__nv_bfloat16 v) { return bf16_to_f32(v); }

__device__ __forceinline__ void argmax_keep(float& bv, int& bi, float v, int i) {
  // Ascending scans per thread keep the first maximum; across threads the lower index wins ties.
  if (v > bv || (v == bv && i < bi) || (bi < 0)) { bv = v; bi = i; }
}

template <typename T>
__device__ __forceinline__ void argmax_row(const T* __restrict__ x, long long stride, int cols,
                                           int* __restrict__ out) {
  if (blockDim.x != ARGMAX_BLOCK) __trap();
  const T* row = x + (index_t)blockIdx.x * stride;
  float bv = 0.0f;
  int bi = -1;
  for (int c = threadIdx.x; c < cols; c += ARGMAX_BLOCK) {
    const float v = argmax_f32(row[c]);
    // Strictly greater only: within a thread c ascends, so the first maximum stays.
    if (bi < 0 || v > bv) { bv = v; bi = c; }
  }
  __shared__ float wv[ARGMAX_BLOCK / 32];
  __shared__ int wi[ARGMAX_BLOCK / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xFFFFFFFFu, bv, o);
    const int oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
    if (oi >= 0) argmax_keep(bv, bi, ov, oi);
  }
  if ((threadIdx.x & 31u) == 0u) { wv[threadIdx.x >> 5] = bv; wi[threadIdx.x >> 5] = bi; }
  __syncthreads();
  if (threadIdx.x == 0) {
    float v = wv[0];
    int i = wi[0];
    for (int w = 1; w < ARGMAX_BLOCK / 32; ++w)
      if (wi[w] >= 0 && (i < 0 || wv[w] > v || (wv[w] == v && wi[w] < i))) { v = wv[w]; i = wi[w]; }
    out[blockIdx.x] = i < 0 ? 0 : i;
  }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_BLOCK)
    argmax_rows_f32(const float* __restrict__ x, long long stride, int cols, int* __restrict__ out) {
  argmax_row(x, stride, cols, out);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_BLOCK)
    argmax_rows_bf16(const __nv_bfloat16* __restrict__ x, long long stride, int cols, int* __restrict__ out) {
  argmax_row(x, stride, cols, out);
}

// update_plan_f32: the optimizer's decision of a step on the device, so the host never waits for
// the gradient norm (train/step.rs `plan_update` + optim.rs `clip_scale`, the same f64 math):
//   norm  = sqrt(f64(fc_sumsq[0]) + f64(body_sumsq[0]))          (fc first, as `global_norm`)
//   scale = clip > 0 && norm > f64(clip) ? f32(f64(clip) / (norm + 1e-6)) : 1
//   skip  = !(loss finite && norm finite), where the step's loss `sum(loss) / weight` is finite
//           iff weight == 0 (the host's loss is then 0) or every loss[i] is finite (an f64 sum of
//           finite f32 values cannot overflow).
//   plan[0] = scale; plan[1] = skip ? 1 : 0 (adamw.cu `adamw_planned_f32` reads both).
// Every f64 step is one IEEE rounding (__dadd_rn, __dsqrt_rn, __ddiv_rn), as on the host.
// Layouts:  body_sumsq, fc_sumsq: [1] f32; loss: [n_loss] f32 (every slot of the step); plan: [2].
// Launch:   grid.x = 1, blockDim.x = 256 (any multiple of 32 up to 1024). No dynamic shared memory.
extern "C" __global__ void update_plan_f32(const float* __restrict__ body_sumsq,
                                           const float* __restrict__ fc_sumsq,
                                           const float* __restrict__ loss, long long n_loss,
                                           int weighted, float clip, float* __restrict__ plan) {
  int bad = 0;
  for (long long i = threadIdx.x; i < n_loss; i += blockDim.x) bad |= !isfinite(loss[i]);
  bad = __syncthreads_or(bad);
  if (threadIdx.x != 0) return;
  const double norm = __dsqrt_rn(__dadd_rn((double)fc_sumsq[0], (double)body_sumsq[0]));
  const bool loss_ok = weighted == 0 || bad == 0;
  const bool norm_ok = isfinite(norm);
  float scale = 1.0f;
  if (clip > 0.0f && norm > (double)clip) scale = __double2float_rn(__ddiv_rn((double)clip, __dadd_rn(norm, 1e-6)));
  plan[0] = scale;
  plan[1] = (loss_ok && norm_ok) ? 0.0f : 1.0f;
}
