// hybrid.cu: the small ops of the Qwen3.5/3.6 hybrid target's forward (QWEN35.md sections 2-4),
// everything but the delta rule itself (gdn.cu) and the attention (attention.cu).
// CPU reference: src/backend/cpu.rs (rmsnorm1p_fwd, gated_rmsnorm_fwd, rope_partial,
// copy_strided, sigmoid_mul, causal_conv1d_silu, gdn_gates, l2norm_fwd).
//
// Math (f32 inside, every output rounded once, RNE as common.cuh):
//   rmsnorm1p      y = x * (1 / sqrt(mean(x^2) + eps)) * (1 + w)              per row of dim
//   gated_rmsnorm  y = x * (1 / sqrt(mean(x^2) + eps)) * w * silu(z)          per row of dim
//   l2norm         y = x * (scale / sqrt(sum(x^2) + eps))                      per row of dim
//   rope_partial   dims [0, rot) of each head rotate in pairs (i, i + rot/2) by pos * inv_freq[i];
//                  dims [rot, head_dim) are not touched (in place)
//   copy_strided   dst[r * ds + c] = src[r * ss + c], c < width
//   sigmoid_mul    x = x / (1 + exp(-gate))
//   conv1d_silu    y[t, c] = silu(sum_{j<K, t-K+1+j >= ss(t)} w[c, j] * x[t-K+1+j, c]), the window
//                  cut at the start ss(t) of row t's sequence (zero left padding per sequence)
//   gdn_gates      beta = 1 / (1 + exp(-b)); g = -exp(A_log[h]) * softplus(a + dt_bias[h]),
//                  softplus(x) = x above 20 (PyTorch's threshold), log(1 + exp(x)) otherwise
// Layouts:  row-major, contiguous. bf16 everywhere except l2norm's output and gdn_gates' g (f32).
//           seq_starts: i32 [n_starts], rising from 0; row t belongs to the last listed start
//           <= t (rows past the last entry form one more sequence, as cpu.rs seq_ranges does).
// Launch:   every kernel: blockDim.x = HYB_BLOCK (launch.cuh), any grid >= 1 (grid-stride).
//           Row kernels (norms) give each warp one row at a time: grid ceil(rows / 8).
//           No shared memory.
// Bytes:    each kernel reads its inputs once and writes its output once (the row norms read a
//           row twice, the second time from L1/L2); e.g. rmsnorm1p 4 * rows * dim + 2 * dim.
// FLOPs:    O(1) per element (conv1d: 2K + ~20 for silu); all memory-bound. Target: >= 60% of the
//           device-to-device copy bandwidth at the 27B shape (these ops are < 2% of the forward).
#include "common.cuh"
#include "launch.cuh"

namespace hyb {

typedef __nv_bfloat16 bf16;

constexpr int WARPS = HYB_BLOCK / 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of squares of one row, reduced over the warp (every lane gets it).
template <class T>
__device__ __forceinline__ float row_sumsq(const T* xr, int dim, int lane);

template <>
__device__ __forceinline__ float row_sumsq<bf16>(const bf16* xr, int dim, int lane) {
  float ss = 0.f;
  for (int c = lane; c < dim; c += 32) {
    const float v = bf16_to_f32(xr[c]);
    ss = fmaf(v, v, ss);
  }
  return warp_sum(ss);
}

template <>
__device__ __forceinline__ float row_sumsq<float>(const float* xr, int dim, int lane) {
  float ss = 0.f;
  for (int c = lane; c < dim; c += 32) ss = fmaf(xr[c], xr[c], ss);
  return warp_sum(ss);
}

// An element as f32, from bf16 or f32 storage; and stored back (bf16 rounded to nearest even).
__device__ __forceinline__ float load_f32(const bf16* p) { return bf16_to_f32(*p); }
__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ void store_f32(bf16* p, float v) { *p = f32_to_bf16_rne(v); }
__device__ __forceinline__ void store_f32(float* p, float v) { *p = v; }

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// Start of the sequence holding row r: the largest seq_starts[b] <= r over all n entries (0 when
// r precedes them all). Binary search; n is small (sequences per batch + 1).
__device__ __forceinline__ index_t seq_start_of(const int* seq_starts, int n, index_t r) {
  if (n <= 0 || r < (index_t)seq_starts[0]) return 0;
  int a = 0, b = n - 1;
  while (a < b) {
    const int mid = (a + b + 1) >> 1;
    if ((index_t)seq_starts[mid] <= r) a = mid;
    else b = mid - 1;
  }
  return seq_starts[a];
}

}  // namespace hyb

using hyb::bf16;

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) rmsnorm1p_fwd_bf16(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y,
    long long rows, int dim, float eps) {
  const int lane = threadIdx.x & 31;
  for (index_t r = (index_t)blockIdx.x * hyb::WARPS + (threadIdx.x >> 5); r < rows;
       r += (index_t)gridDim.x * hyb::WARPS) {
    const bf16* xr = x + r * dim;
    const float inv = 1.f / sqrtf(hyb::row_sumsq(xr, dim, lane) / (float)dim + eps);
    for (int c = lane; c < dim; c += 32) {
      y[r * dim + c] = f32_to_bf16_rne(bf16_to_f32(xr[c]) * inv * (1.f + bf16_to_f32(w[c])));
    }
  }
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) gated_rmsnorm_fwd_bf16(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ z, const __nv_bfloat16* __restrict__ w,
    __nv_bfloat16* __restrict__ y, long long rows, int dim, float eps) {
  const int lane = threadIdx.x & 31;
  for (index_t r = (index_t)blockIdx.x * hyb::WARPS + (threadIdx.x >> 5); r < rows;
       r += (index_t)gridDim.x * hyb::WARPS) {
    const bf16* xr = x + r * dim;
    const float inv = 1.f / sqrtf(hyb::row_sumsq(xr, dim, lane) / (float)dim + eps);
    for (int c = lane; c < dim; c += 32) {
      const float v = bf16_to_f32(xr[c]) * inv * bf16_to_f32(w[c]) * hyb::silu(bf16_to_f32(z[r * dim + c]));
      y[r * dim + c] = f32_to_bf16_rne(v);
    }
  }
}

// x (bf16 or f32) scaled to unit L2 norm per row, times `scale`, in f32.
template <class T>
__device__ __forceinline__ void l2norm_rows(const T* __restrict__ x, float* __restrict__ y, long long rows, int dim,
                                            float eps, float scale) {
  const int lane = threadIdx.x & 31;
  for (index_t r = (index_t)blockIdx.x * hyb::WARPS + (threadIdx.x >> 5); r < rows;
       r += (index_t)gridDim.x * hyb::WARPS) {
    const T* xr = x + r * dim;
    const float inv = scale / sqrtf(hyb::row_sumsq(xr, dim, lane) + eps);
    for (int c = lane; c < dim; c += 32) y[r * dim + c] = hyb::load_f32(xr + c) * inv;
  }
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) l2norm_fwd_bf16_f32(const __nv_bfloat16* __restrict__ x,
                                                                          float* __restrict__ y, long long rows,
                                                                          int dim, float eps, float scale) {
  l2norm_rows(x, y, rows, dim, eps, scale);
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) l2norm_fwd_f32_f32(const float* __restrict__ x,
                                                                         float* __restrict__ y, long long rows,
                                                                         int dim, float eps, float scale) {
  l2norm_rows(x, y, rows, dim, eps, scale);
}

// One item per (row, head, pair i < rot/2): the angle in f32 (one rounded multiply), precise
// sincosf, products and sums each rounded once (no FMA), as cpu.rs evaluates them.
extern "C" __global__ void __launch_bounds__(HYB_BLOCK) rope_partial_bf16(__nv_bfloat16* x, const int* __restrict__ pos,
                                                                        const float* __restrict__ inv_freq,
                                                                        long long rows, int heads, int head_dim,
                                                                        int rot_dim) {
  const int half = rot_dim / 2;
  const index_t per_row = (index_t)heads * half;
  const index_t total = rows * per_row;
  for (index_t e = grid_thread_index(); e < total; e += grid_thread_count()) {
    const index_t r = e / per_row;
    const int rem = (int)(e - r * per_row);
    const int h = rem / half, i = rem - h * half;
    const float angle = __fmul_rn((float)pos[r], inv_freq[i]);
    float s, c;
    sincosf(angle, &s, &c);
    bf16* p = x + r * heads * (index_t)head_dim + (index_t)h * head_dim;
    const float a = bf16_to_f32(p[i]), b = bf16_to_f32(p[i + half]);
    p[i] = f32_to_bf16_rne(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    p[i + half] = f32_to_bf16_rne(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
  }
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) copy_strided_bf16(const __nv_bfloat16* __restrict__ src,
                                                                        long long src_stride,
                                                                        __nv_bfloat16* __restrict__ dst,
                                                                        long long dst_stride, long long rows,
                                                                        long long width) {
  const index_t total = rows * width;
  for (index_t e = grid_thread_index(); e < total; e += grid_thread_count()) {
    const index_t r = e / width, c = e - r * width;
    dst[r * dst_stride + c] = src[r * src_stride + c];
  }
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) copy_strided_f32(const float* __restrict__ src,
                                                                       long long src_stride, float* __restrict__ dst,
                                                                       long long dst_stride, long long rows,
                                                                       long long width) {
  const index_t total = rows * width;
  for (index_t e = grid_thread_index(); e < total; e += grid_thread_count()) {
    const index_t r = e / width, c = e - r * width;
    dst[r * dst_stride + c] = src[r * src_stride + c];
  }
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) sigmoid_mul_bf16(__nv_bfloat16* __restrict__ x,
                                                                       const __nv_bfloat16* __restrict__ gate,
                                                                       long long n) {
  for (index_t e = grid_thread_index(); e < n; e += grid_thread_count()) {
    const float g = bf16_to_f32(gate[e]);
    x[e] = f32_to_bf16_rne(bf16_to_f32(x[e]) / (1.f + expf(-g)));
  }
}

// One item per (row t, channel c). The taps run from the oldest input to t, as cpu.rs sums them.
template <class T>
__device__ __forceinline__ void conv1d_silu(const T* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                            T* __restrict__ y, const int* __restrict__ seq_starts, int n_starts,
                                            long long rows, int channels, int kernel_size) {
  const index_t total = rows * channels;
  for (index_t e = grid_thread_index(); e < total; e += grid_thread_count()) {
    const index_t t = e / channels;
    const int c = (int)(e - t * channels);
    const index_t ss = hyb::seq_start_of(seq_starts, n_starts, t);
    const int kernel = kernel_size;
    index_t first = t + 1 - kernel;
    if (first < ss) first = ss;
    float acc = 0.f;
    for (index_t src = first; src <= t; ++src) {
      acc += bf16_to_f32(w[(index_t)c * kernel + (kernel - 1 - (t - src))]) * hyb::load_f32(x + src * channels + c);
    }
    hyb::store_f32(y + e, hyb::silu(acc));
  }
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) causal_conv1d_silu_bf16(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y,
    const int* __restrict__ seq_starts, int n_starts, long long rows, int channels, int kernel_size) {
  conv1d_silu(x, w, y, seq_starts, n_starts, rows, channels, kernel_size);
}

// The target's layout: the projection, the convolution and its split stay in f32 (one rounding
// fewer before the L2 norm and the delta rule; see model/target/qwen35.rs).
extern "C" __global__ void __launch_bounds__(HYB_BLOCK) causal_conv1d_silu_f32(
    const float* __restrict__ x, const __nv_bfloat16* __restrict__ w, float* __restrict__ y,
    const int* __restrict__ seq_starts, int n_starts, long long rows, int channels, int kernel_size) {
  conv1d_silu(x, w, y, seq_starts, n_starts, rows, channels, kernel_size);
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) gdn_gates_bf16(
    const __nv_bfloat16* __restrict__ b, const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ a_log,
    const __nv_bfloat16* __restrict__ dt_bias, __nv_bfloat16* __restrict__ beta, float* __restrict__ g,
    long long rows, int heads) {
  const index_t total = rows * heads;
  for (index_t e = grid_thread_index(); e < total; e += grid_thread_count()) {
    const int h = (int)(e % heads);
    beta[e] = f32_to_bf16_rne(1.f / (1.f + expf(-bf16_to_f32(b[e]))));
    const float u = bf16_to_f32(a[e]) + bf16_to_f32(dt_bias[h]);
    const float sp = u > 20.f ? u : logf(1.f + expf(u));
    g[e] = -expf(bf16_to_f32(a_log[h])) * sp;
  }
}
