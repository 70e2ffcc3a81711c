// hybrid.cu: the small ops of the Qwen3.5/3.6 hybrid target's forward (QWEN35.md sections 2-4),
// everything but the delta rule itself (gdn.cu) and the attention (attention.cu).
// CPU reference: src/backend/cpu.rs (rmsnorm1p_fwd, gated_rmsnorm_fwd, rope_partial,
// copy_strided, sigmoid_mul, causal_conv1d_silu, gdn_gates, l2norm_fwd); the fused passes at the
// end: src/backend/fused.rs (compositions of those).
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
//           Row kernels (norms) give each warp one row at a time (gated_rmsnorm two at dim <= 128):
//           grid ceil(rows / 8); the bf16 norms move 4 elements (8 bytes) a lane where
//           dim % 4 == 0 and the pointers allow. rmsnorm1p_fwd_bf16_v4 / _v5 instead give a row
//           to a block of dim / (8 VPT) threads (VPT = 4 or 5; 256 bytes of shared memory), grid
//           min(rows, 2^31 - 1): the launcher's pick where dim and the pointers allow. conv1d:
//           one item per HYB_CONV_ROWS rows of a channel, kernel_size <= HYB_CONV_MAX_K (traps
//           otherwise). copy_strided: a CTA per row (grid-stride over rows), 16-byte units where addresses,
//           strides and width allow.
//           No shared memory but rmsnorm1p's block variants'.
// Bytes:    each kernel reads its inputs once and writes its output once (the row norms read a
//           row twice, the second time from L1/L2); e.g. rmsnorm1p 4 * rows * dim + 2 * dim.
// FLOPs:    O(1) per element (conv1d: 2K + ~20 for silu); all memory-bound. Target: >= 60% of the
//           device-to-device copy bandwidth at the 27B shape (these ops are < 2% of the forward).
#include <climits>
#include <type_traits>

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

// The first listed sequence start after row r (a row index past every row when there is none).
__device__ __forceinline__ index_t next_start_after(const int* seq_starts, int n, index_t r) {
  int a = 0, b = n;  // first index with seq_starts[i] > r
  while (a < b) {
    const int mid = (a + b) >> 1;
    if ((index_t)seq_starts[mid] <= r) a = mid + 1;
    else b = mid;
  }
  return a < n ? (index_t)seq_starts[a] : LLONG_MAX;
}

}  // namespace hyb

using hyb::bf16;

namespace hyb {

// Four bf16 at p (8-byte aligned) as f32, and four f32 stored as bf16 (RNE).
__device__ __forceinline__ void load4(const bf16* p, float (&f)[4]) { bf16_lane_load<4>(p, f); }
__device__ __forceinline__ void store4_rne(bf16* p, const float (&f)[4]) {
  *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2_rne(f[0], f[1]), pack_bf16x2_rne(f[2], f[3]));
}
__device__ __forceinline__ bool aligned8(const void* p) { return ((uintptr_t)p % 8) == 0; }

// One warp per row, lane l holding the 4-element groups l, l + 32, ... (8-byte accesses; every
// pointer 8-byte aligned and dim % 4 == 0), or the elements l, l + 32, ... otherwise. f(c, x_c,
// i) gives output element c from x's element (f32) and i = 1 / sqrt(mean(x^2) + eps).
template <class F>
__device__ __forceinline__ void norm_rows(const bf16* __restrict__ x, bf16* __restrict__ y, long long rows, int dim,
                                          float eps, bool vec, F f) {
  const int lane = threadIdx.x & 31;
  for (index_t r = (index_t)blockIdx.x * WARPS + (threadIdx.x >> 5); r < rows; r += (index_t)gridDim.x * WARPS) {
    const bf16* xr = x + r * dim;
    bf16* yr = y + r * dim;
    if (vec) {
      float ss = 0.f;
      for (int c = lane * 4; c < dim; c += 128) {
        float v[4];
        load4(xr + c, v);
#pragma unroll
        for (int i = 0; i < 4; ++i) ss = fmaf(v[i], v[i], ss);
      }
      const float inv = 1.f / sqrtf(warp_sum(ss) / (float)dim + eps);
      for (int c = lane * 4; c < dim; c += 128) {
        float v[4];
        load4(xr + c, v);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = f(r, c + i, v[i], inv);
        store4_rne(yr + c, v);
      }
    } else {
      const float inv = 1.f / sqrtf(row_sumsq(xr, dim, lane) / (float)dim + eps);
      for (int c = lane; c < dim; c += 32) yr[c] = f32_to_bf16_rne(f(r, c, bf16_to_f32(xr[c]), inv));
    }
  }
}

}  // namespace hyb

namespace hyb {

// rmsnorm1p with a block per row (NT = dim / (8 VPT) threads, a multiple of 32): thread i holds
// the row's 16-byte groups i, i + NT, ... (VPT of them, coalesced across the block), loads them
// at once and keeps them in registers for the second pass (no reread of x), and loads w while the
// warps' sums meet in shared memory. The warp per row of norm_rows takes 5120 elements in 40
// dependent rounds and 12288 rows as 1.45 waves of warps; here every load of a row is in flight at
// once. Same products as norm_rows; the row's sum of squares is added in another order.
template <int VPT>
__device__ __forceinline__ void norm1p_block_rows(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                  bf16* __restrict__ y, long long rows, int dim, float eps) {
  __shared__ float part[2][32];
  const int tid = threadIdx.x, nt = blockDim.x, nw = nt >> 5;
  if (nt * 8 * VPT != dim || (nt & 31) != 0) __trap();
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  int parity = 0;
  for (index_t r = blockIdx.x; r < rows; r += gridDim.x, parity ^= 1) {
    const uint4* x4 = reinterpret_cast<const uint4*>(x + r * dim);
    uint4 xv[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) xv[i] = x4[i * nt + tid];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      float a[8];
      bf16x8_unpack(xv[i], a);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss = fmaf(a[e], a[e], ss);
    }
    uint4 wv[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) wv[i] = w4[i * nt + tid];
    ss = warp_sum(ss);
    if ((tid & 31) == 0) part[parity][tid >> 5] = ss;
    __syncthreads();  // (the other parity's slots are free: every thread read them a row ago)
    float tot = 0.f;
    for (int i = 0; i < nw; ++i) tot += part[parity][i];
    const float inv = 1.f / sqrtf(tot / (float)dim + eps);
    uint4* y4 = reinterpret_cast<uint4*>(y + r * dim);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      float v[8], wf[8];
      bf16x8_unpack(xv[i], v);
      bf16x8_unpack(wv[i], wf);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = v[e] * inv * (1.f + wf[e]);
      y4[i * nt + tid] = bf16x8_pack_rne(v);
    }
  }
}

// rmsnorm1p_fwd_bf16_v0: a warp per row, any dim; _v4, _v5: a block per row of VPT = 4 or 5
// 16-byte groups a thread (the launcher picks; one argument list for all three).
template <int V>
__device__ __forceinline__ void norm1p(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ y,
                                       long long rows, int dim, float eps) {
  if constexpr (V == 0) {
    const bool vec = dim % 4 == 0 && aligned8(x) && aligned8(w) && aligned8(y);
    norm_rows(x, y, rows, dim, eps, vec,
              [&](index_t, int c, float xc, float inv) { return xc * inv * (1.f + bf16_to_f32(w[c])); });
  } else {
    norm1p_block_rows<V>(x, w, y, rows, dim, eps);
  }
}

}  // namespace hyb

#define HYB_NORM1P_EXPORT(V)                                                                                    \
  extern "C" __global__ void __launch_bounds__(HYB_BLOCK) rmsnorm1p_fwd_bf16_v##V(                             \
      const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y, \
      long long rows, int dim, float eps) {                                                                    \
    hyb::norm1p<V>(x, w, y, rows, dim, eps);                                                                   \
  }

HYB_NORM1P_EXPORT(0)
HYB_NORM1P_EXPORT(4)
HYB_NORM1P_EXPORT(5)

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) gated_rmsnorm_fwd_bf16(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ z, const __nv_bfloat16* __restrict__ w,
    __nv_bfloat16* __restrict__ y, long long rows, int dim, float eps) {
  using namespace hyb;
  const bool vec = dim % 4 == 0 && aligned8(x) && aligned8(z) && aligned8(w) && aligned8(y);
  if (vec && dim <= 128) {
    // Heads of at most 128 elements (the Gated DeltaNet's value heads), two rows per warp: lane
    // l holds elements 4l..4l+3 of both, and x and z of both are loaded before the reductions
    // (a warp per row left one 256-byte row in flight per warp). Same sums and products, in the
    // same order, as norm_rows below.
    const int lane = threadIdx.x & 31;
    const bool active = lane * 4 < dim;
    const int c = active ? lane * 4 : 0;
    float wv[4];
    load4(w + c, wv);
    const index_t warps = (index_t)gridDim.x * WARPS;
    for (index_t r0 = 2 * ((index_t)blockIdx.x * WARPS + (threadIdx.x >> 5)); r0 < rows; r0 += 2 * warps) {
      const bool two = r0 + 1 < rows;  // the same for the whole warp
      float xa[4] = {0.f, 0.f, 0.f, 0.f}, za[4] = {0.f, 0.f, 0.f, 0.f};
      float xb[4] = {0.f, 0.f, 0.f, 0.f}, zb[4] = {0.f, 0.f, 0.f, 0.f};
      if (active) {
        load4(x + r0 * dim + c, xa);
        load4(z + r0 * dim + c, za);
        if (two) {
          load4(x + (r0 + 1) * dim + c, xb);
          load4(z + (r0 + 1) * dim + c, zb);
        }
      }
      float sa = 0.f, sb = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) sa = fmaf(xa[i], xa[i], sa), sb = fmaf(xb[i], xb[i], sb);
      const float ia = 1.f / sqrtf(warp_sum(sa) / (float)dim + eps);
      const float ib = 1.f / sqrtf(warp_sum(sb) / (float)dim + eps);
      if (!active) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        xa[i] = xa[i] * ia * wv[i] * silu(za[i]);
        xb[i] = xb[i] * ib * wv[i] * silu(zb[i]);
      }
      store4_rne(y + r0 * dim + c, xa);
      if (two) store4_rne(y + (r0 + 1) * dim + c, xb);
    }
    return;
  }
  norm_rows(x, y, rows, dim, eps, vec, [&](index_t r, int c, float xc, float inv) {
    return xc * inv * bf16_to_f32(w[c]) * silu(bf16_to_f32(z[r * dim + c]));
  });
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

namespace hyb {

// dst rows of wbytes bytes from src rows, in units of U (a CTA per row, grid-stride over rows):
// the caller has checked that both addresses, both strides and the width are multiples of
// sizeof(U).
template <class U>
__device__ __forceinline__ void copy_units(const char* __restrict__ src, index_t ss, char* __restrict__ dst,
                                           index_t ds, index_t rows, index_t wbytes) {
  const int wu = (int)(wbytes / (index_t)sizeof(U));
  for (index_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const U* s = reinterpret_cast<const U*>(src + r * ss);
    U* d = reinterpret_cast<U*>(dst + r * ds);
    for (int c = threadIdx.x; c < wu; c += blockDim.x) d[c] = s[c];
  }
}

// A strided row copy as bytes, in the widest unit (16, 8, 4 or 2 bytes) that every address,
// stride and the width allow: the target's splits of f32 projections (widths of 512 B and up) move
// in 16-byte units. Element size E in bytes; strides and width in elements.
template <int E>
__device__ __forceinline__ void copy_strided_bytes(const void* src, index_t src_stride, void* dst, index_t dst_stride,
                                                   index_t rows, index_t width) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  const index_t ss = src_stride * E, ds = dst_stride * E, wb = width * E;
  const unsigned long long all =
      (unsigned long long)(uintptr_t)s | (unsigned long long)(uintptr_t)d | (unsigned long long)ss |
      (unsigned long long)ds | (unsigned long long)wb;
  if (all % 16 == 0) copy_units<uint4>(s, ss, d, ds, rows, wb);
  else if (all % 8 == 0) copy_units<uint2>(s, ss, d, ds, rows, wb);
  else if (all % 4 == 0) copy_units<uint32_t>(s, ss, d, ds, rows, wb);
  else copy_units<uint16_t>(s, ss, d, ds, rows, wb);
}

}  // namespace hyb

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) copy_strided_bf16(const __nv_bfloat16* __restrict__ src,
                                                                        long long src_stride,
                                                                        __nv_bfloat16* __restrict__ dst,
                                                                        long long dst_stride, long long rows,
                                                                        long long width) {
  hyb::copy_strided_bytes<2>(src, src_stride, dst, dst_stride, rows, width);
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) copy_strided_f32(const float* __restrict__ src,
                                                                       long long src_stride, float* __restrict__ dst,
                                                                       long long dst_stride, long long rows,
                                                                       long long width) {
  hyb::copy_strided_bytes<4>(src, src_stride, dst, dst_stride, rows, width);
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) sigmoid_mul_bf16(__nv_bfloat16* __restrict__ x,
                                                                       const __nv_bfloat16* __restrict__ gate,
                                                                       long long n) {
  for (index_t e = grid_thread_index(); e < n; e += grid_thread_count()) {
    const float g = bf16_to_f32(gate[e]);
    x[e] = f32_to_bf16_rne(bf16_to_f32(x[e]) / (1.f + expf(-g)));
  }
}

// One item per run of HYB_CONV_ROWS rows of one channel (four adjacent channels for f32 rows of
// 16-byte groups): the channels' weights and last K - 1 inputs stay in registers, so each input
// is read once (plus K - 1 per run), coalesced across the warp's channels. Inputs before the row's sequence start are zeros (a run that crosses a start
// clears its window there). The taps sum from the oldest input to t, as cpu.rs sums them (the
// zeros add exactly nothing: a sum that starts at +0 never becomes -0).
// V consecutive channels of one row as f32 (V == 4: one 16-byte f32 load), and stored back.
template <int V>
__device__ __forceinline__ void load_vec(const float* p, float (&v)[V]) {
  if constexpr (V == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = p[i];
  }
}
template <int V>
__device__ __forceinline__ void load_vec(const bf16* p, float (&v)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) v[i] = bf16_to_f32(p[i]);
}
template <int V>
__device__ __forceinline__ void store_vec(float* p, const float (&v)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = v[i];
  }
}
template <int V>
__device__ __forceinline__ void store_vec(bf16* p, const float (&v)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) p[i] = f32_to_bf16_rne(v[i]);
}

template <class T, int K, int V>
__device__ __forceinline__ void conv1d_silu_k(const T* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                              T* __restrict__ y, const int* __restrict__ seq_starts, int n_starts,
                                              long long rows, int channels) {
  constexpr int R = HYB_CONV_ROWS;
  const int groups = channels / V;  // V divides channels (the caller checks)
  const index_t runs = (rows + R - 1) / R;
  const index_t total = runs * groups;
  for (index_t e = grid_thread_index(); e < total; e += grid_thread_count()) {
    const index_t run = e / groups;
    const int c0 = (int)(e - run * groups) * V;
    const index_t t0 = run * R, t1 = min((index_t)rows, t0 + R);
    // wk[j] multiplies x[t - K + 1 + j]; win[j] = x[t - K + 1 + j] for j < K - 1 (K and V are
    // template parameters so that both arrays live in registers).
    float wk[K][V], win[K][V];
    index_t ss = hyb::seq_start_of(seq_starts, n_starts, t0);
    index_t next = hyb::next_start_after(seq_starts, n_starts, t0);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const index_t src = t0 - (K - 1) + j;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        wk[j][i] = bf16_to_f32(w[(index_t)(c0 + i) * K + j]);
        win[j][i] = 0.f;
      }
      if (j < K - 1 && src >= ss) load_vec<V>(x + src * channels + c0, win[j]);
    }
    for (index_t t = t0; t < t1; ++t) {
      if (t == next) {  // a sequence starts here: nothing before it is visible
#pragma unroll
        for (int j = 0; j < K; ++j) {
#pragma unroll
          for (int i = 0; i < V; ++i) win[j][i] = 0.f;
        }
        next = hyb::next_start_after(seq_starts, n_starts, t);
      }
      float xt[V], out[V];
      load_vec<V>(x + t * channels + c0, xt);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < K - 1; ++j) acc += wk[j][i] * win[j][i];
        acc += wk[K - 1][i] * xt[i];
        out[i] = hyb::silu(acc);
      }
#pragma unroll
      for (int j = 0; j + 1 < K - 1; ++j) {
#pragma unroll
        for (int i = 0; i < V; ++i) win[j][i] = win[j + 1][i];
      }
      if (K > 1) {
#pragma unroll
        for (int i = 0; i < V; ++i) win[K > 1 ? K - 2 : 0][i] = xt[i];
      }
      store_vec<V>(y + t * channels + c0, out);
    }
  }
}

// One item per run of HYB_CONV_ROWS rows of one channel (four adjacent channels for f32 rows of
// 16-byte groups): the channels' weights and last K - 1 inputs stay in registers, so each input
// is read once (plus K - 1 per run), coalesced across the warp's channels. Inputs before the row's sequence start are zeros (a run that crosses a start
// clears its window there). The taps sum from the oldest input to t, as cpu.rs sums them (the
// zeros add exactly nothing: a sum that starts at +0 never becomes -0).
template <class T, int K>
__device__ __forceinline__ void conv1d_silu_k(const T* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                              T* __restrict__ y, const int* __restrict__ seq_starts, int n_starts,
                                              long long rows, int channels) {
  constexpr int R = HYB_CONV_ROWS;
  const index_t runs = (rows + R - 1) / R;
  const index_t total = runs * channels;
  for (index_t e = grid_thread_index(); e < total; e += grid_thread_count()) {
    const index_t run = e / channels;
    const int c = (int)(e - run * channels);
    const index_t t0 = run * R, t1 = min((index_t)rows, t0 + R);
    // wk[j] multiplies x[t - K + 1 + j]; win[j] = x[t - K + 1 + j] for j < K - 1 (K is a
    // template parameter so that both arrays live in registers).
    float wk[K], win[K];
    index_t ss = hyb::seq_start_of(seq_starts, n_starts, t0);
    index_t next = hyb::next_start_after(seq_starts, n_starts, t0);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      wk[j] = bf16_to_f32(w[(index_t)c * K + j]);
      const index_t src = t0 - (K - 1) + j;
      win[j] = (j < K - 1 && src >= ss) ? hyb::load_f32(x + src * channels + c) : 0.f;
    }
    for (index_t t = t0; t < t1; ++t) {
      if (t == next) {  // a sequence starts here: nothing before it is visible
#pragma unroll
        for (int j = 0; j < K; ++j) win[j] = 0.f;
        next = hyb::next_start_after(seq_starts, n_starts, t);
      }
      const float xt = hyb::load_f32(x + t * channels + c);
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < K - 1; ++j) acc += wk[j] * win[j];
      acc += wk[K - 1] * xt;
#pragma unroll
      for (int j = 0; j + 1 < K - 1; ++j) win[j] = win[j + 1];
      if (K > 1) win[K > 1 ? K - 2 : 0] = xt;
      hyb::store_f32(y + t * channels + c, hyb::silu(acc));
    }
  }
}

// One item per run of HYB_CONV_ROWS rows of one channel (four adjacent channels for f32 rows of
// 16-byte groups): the channels' weights and last K - 1 inputs stay in registers, so each input
// is read once (plus K - 1 per run), coalesced across the warp's channels. Inputs before the row's sequence start are zeros (a run that crosses a start
// clears its window there). The taps sum from the oldest input to t, as cpu.rs sums them (the
// zeros add exactly nothing: a sum that starts at +0 never becomes -0).
template <class T>
__device__ __forceinline__ void conv1d_silu(const T* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                            T* __restrict__ y, const int* __restrict__ seq_starts, int n_starts,
                                            long long rows, int channels, int kernel_size) {
  static_assert(HYB_CONV_MAX_K == 8, "one case per kernel size below");
  // f32 rows of whole 16-byte groups (the target's layout) take four channels an item.
  const bool vec = std::is_same<T, float>::value && channels % 4 == 0 && ((uintptr_t)x % 16) == 0 &&
                   ((uintptr_t)y % 16) == 0;
#define HYB_CONV_CASE(KS)                                                                      \
  case KS:                                                                                     \
    if (vec) conv1d_silu_k<T, KS, 4>(x, w, y, seq_starts, n_starts, rows, channels);           \
    else conv1d_silu_k<T, KS, 1>(x, w, y, seq_starts, n_starts, rows, channels);               \
    break;
  switch (kernel_size) {
    HYB_CONV_CASE(1)
    HYB_CONV_CASE(2)
    HYB_CONV_CASE(3)
    HYB_CONV_CASE(4)
    HYB_CONV_CASE(5)
    HYB_CONV_CASE(6)
    HYB_CONV_CASE(7)
    HYB_CONV_CASE(8)
    default: __trap();
  }
#undef HYB_CONV_CASE
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

// ---- Fused passes of the target's forward (each the composition of the kernels above that its
// CPU reference runs, with the same roundings; only the order of a row's sum of squares differs).
//   gdn_conv_qkv     conv1d_silu of the f32 q|k|v projection, then the per-head L2 norms of q
//                    (times q_scale) and k, written to q, k, v [rows, key_dim|key_dim|value_dim]
//                    (f32): the conv's output, the split copies and the norms' reads are gone.
//                    One item per warp: a run of HYB_CONV_QKV_STEPS steps of P = WINDOW + 1 - K
//                    rows (4 at K = 4: 32 rows a run) of 32 groups of four channels (each row's
//                    groups padded to whole warps), so a warp's lanes share each row: a key head
//                    (head_lanes = k_dim / 4 lanes, a power of two <= 32) sums its squares over
//                    its lanes with shuffles. A lane holds its step's window (the K - 1 rows
//                    before it and its P rows, 16-byte loads) while the next step's P rows load;
//                    a sequence start zeroes the window rows before it. SiLU and the norms' inverse
//                    square root use the fast intrinsics (a few ulp from the CPU's f32; the test
//                    allows 1e-5). Bytes: 8 * rows * channels (+ (K - 1) / 32 of the reads, L2
//                    hits). At the 27B shape (4 x 3072 rows, 10240 channels, K = 4) on the H200:
//                    0.280 ms in the bench (85% of copy bandwidth), 358 us a layer inside the
//                    forward; the form before it (8-row runs loaded at once, then computed, IEEE
//                    division in SiLU, a select per window row for the sequence start) took
//                    0.442 / 567 us: 118 registers, 2 blocks an SM, and the lanes idle in turn
//                    on loads and on arithmetic. Capping this form at 3 blocks an SM (80
//                    registers, spills) measured 0.348 ms.
//   rmsnorm1p_rope_partial_bf16_hd<D>
//                    per head: y = bf16(rmsnorm1p(x)), then rope_partial on y (same products and
//                    roundings), heads read at x + i * x_stride (the query half of q | gate), written
//                    contiguously. A warp per HYB_NORM_ROPE_HEADS heads of a row (their loads in
//                    flight together, the row's sin and cos computed once for them), V =
//                    bf16_lane_dims(D) elements a lane; the partner of element c (c +- rot/2) sits
//                    rot / 2 / V lanes away (the launcher checks rot / 2 % V == 0 and that x's
//                    offset and stride are multiples of V). Each lane takes one of a round of 32
//                    angles (one sincosf) and the rotating lanes gather theirs by shuffles; the
//                    normed value and the output are rounded by the hardware's cvt.rn.bf16x2.f32
//                    (the CPU's bits for every non-NaN value). 27B query heads (12288 x 24 x 256,
//                    rot 64) on the H200, bench (in the forward, q and k calls averaged):
//                    a warp per head 0.355 ms (214 us); heads in groups, each rotating lane
//                    computing its own angles 0.241 ms (171 us); one sincosf a lane, packed loads,
//                    3 blocks an SM 0.128 ms (100 us); the hardware rounding and ss * (1 / D)
//                    instead of an IEEE division 0.096 ms (69 us), 74% of copy bandwidth.
//   sigmoid_mul_strided  x[r, c] /= 1 + exp(-gate[r * gate_stride + c]) (the gate in place in the
//                    q | gate projection); 8-element (16-byte) accesses where widths, strides and
//                    addresses allow.
//   gdn_gates_ba     gdn_gates with b and a read from one [rows, 2 * heads] b | a projection (one
//                    GEMM instead of two, each of which read the whole normed input).

// silu with the fast exponential and division (a few ulp from silu above; exp(-x) = inf gives 0).
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.f + __expf(-x)); }

template <int K>
__device__ __forceinline__ void conv_qkv_k(const float* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                           float* __restrict__ q, float* __restrict__ k, float* __restrict__ v,
                                           const int* __restrict__ seq_starts, int n_starts, long long rows,
                                           int key_dim, int value_dim, int head_lanes, float eps, float q_scale) {
  // A step of P rows (P = W + 1 - K, at least 1) reads the window xw: the K - 1 rows before it
  // and its own P; the next step's P rows load during this one's arithmetic.
  constexpr int V = 4, W = HYB_CONV_QKV_WINDOW, P = W + 1 - K > 1 ? W + 1 - K : 1, XW = K - 1 + P;
  constexpr int NS = HYB_CONV_QKV_STEPS, RUN = NS * P;
  const int channels = 2 * key_dim + value_dim;
  const int groups = channels / V;         // the launcher checks key_dim % 4 == value_dim % 4 == 0
  const int wpr = (groups + 31) >> 5;      // warps per row: each row's groups padded to whole warps
  const index_t runs = (rows + RUN - 1) / RUN;
  const index_t total = runs * wpr;        // items: (run of RUN rows, 32 channel groups), one a warp
  const int lane = threadIdx.x & 31;
  // Every lane of a warp has the same item: the head shuffles run converged.
  for (index_t item = grid_thread_index() >> 5; item < total; item += grid_thread_count() >> 5) {
    const index_t run = item / wpr;
    const int gi = (int)(item - run * wpr) * 32 + lane;
    const bool active = gi < groups;
    const int c0 = active ? gi * V : 0;
    const index_t t0 = run * RUN;
    const int nr = (int)min((index_t)RUN, (index_t)rows - t0);
    index_t cur = hyb::seq_start_of(seq_starts, n_starts, t0);
    index_t next = hyb::next_start_after(seq_starts, n_starts, t0);
    // Where this lane's four channels go: q (scaled), k, or v; rows ld apart.
    const bool is_q = c0 < key_dim, is_k = !is_q && c0 < 2 * key_dim;
    const int ld = is_q || is_k ? key_dim : value_dim;
    float* dst = (is_q ? q + c0 : is_k ? k + (c0 - key_dim) : v + (c0 - 2 * key_dim)) + t0 * ld;
    const float scale = is_q ? q_scale : 1.f;
    const float* xs = x + c0;
    // The first step's window, rows t0 - K + 1 .. t0 + P - 1; rows before the run's first
    // sequence start (and past the run) stay zero.
    float xw[XW][V];
#pragma unroll
    for (int u = 0; u < XW; ++u) {
      const index_t src = t0 - (K - 1) + u;
#pragma unroll
      for (int i = 0; i < V; ++i) xw[u][i] = 0.f;
      if (u < nr + K - 1 && src >= cur) load_vec<V>(xs + src * channels, xw[u]);
    }
    float wk[K][V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
#pragma unroll
      for (int j = 0; j < K; ++j) wk[j][i] = bf16_to_f32(w[(index_t)(c0 + i) * K + j]);
    }
    for (int st = 0; st < NS; ++st) {
      const int r0 = st * P;
      if (r0 >= nr) break;
      // The next step's rows, in flight during this step (never before a sequence start that
      // matters: they follow every row of this step).
      float nx[P][V];
#pragma unroll
      for (int u = 0; u < P; ++u) {
#pragma unroll
        for (int i = 0; i < V; ++i) nx[u][i] = 0.f;
        if (r0 + P + u < nr) load_vec<V>(xs + (t0 + r0 + P + u) * channels, nx[u]);
      }
#pragma unroll
      for (int r = 0; r < P; ++r) {
        if (r0 + r >= nr) break;
        const index_t t = t0 + r0 + r;
        if (t == next) {  // a sequence starts at t: the window's rows before it read as zero
#pragma unroll
          for (int j = 0; j < K - 1; ++j) {
#pragma unroll
            for (int i = 0; i < V; ++i) xw[r + j][i] = 0.f;
          }
          cur = t;
          next = hyb::next_start_after(seq_starts, n_starts, t);
        }
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          float acc = 0.f;
#pragma unroll
          for (int j = 0; j < K; ++j) acc += wk[j][i] * xw[r + j][i];
          out[i] = silu_fast(acc);
        }
        // The key head's sum of squares over its head_lanes lanes (every lane shuffles; v lanes
        // and padding lanes form groups of their own and ignore the result).
        float sq = 0.f;
#pragma unroll
        for (int i = 0; i < V; ++i) sq = fmaf(out[i], out[i], sq);
        for (int o = head_lanes >> 1; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        if (!active) continue;
        if (is_q || is_k) {
          const float inv = scale * rsqrtf(sq + eps);
#pragma unroll
          for (int i = 0; i < V; ++i) out[i] *= inv;
        }
        store_vec<V>(dst + (index_t)(r0 + r) * ld, out);
      }
#pragma unroll
      for (int j = 0; j < K - 1; ++j) {
#pragma unroll
        for (int i = 0; i < V; ++i) xw[j][i] = xw[P + j][i];
      }
#pragma unroll
      for (int u = 0; u < P; ++u) {
#pragma unroll
        for (int i = 0; i < V; ++i) xw[K - 1 + u][i] = nx[u][i];
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) gdn_conv_qkv_f32(
    const float* __restrict__ x, const __nv_bfloat16* __restrict__ w, float* __restrict__ q, float* __restrict__ k,
    float* __restrict__ v, const int* __restrict__ seq_starts, int n_starts, long long rows, int key_dim,
    int value_dim, int head_lanes, int kernel_size, float eps, float q_scale) {
  static_assert(HYB_CONV_MAX_K == 8, "one case per kernel size below");
#define HYB_CONV_QKV_CASE(KS)                                                                                   \
  case KS:                                                                                                      \
    conv_qkv_k<KS>(x, w, q, k, v, seq_starts, n_starts, rows, key_dim, value_dim, head_lanes, eps, q_scale); \
    break;
  switch (kernel_size) {
    HYB_CONV_QKV_CASE(1)
    HYB_CONV_QKV_CASE(2)
    HYB_CONV_QKV_CASE(3)
    HYB_CONV_QKV_CASE(4)
    HYB_CONV_QKV_CASE(5)
    HYB_CONV_QKV_CASE(6)
    HYB_CONV_QKV_CASE(7)
    HYB_CONV_QKV_CASE(8)
    default: __trap();
  }
#undef HYB_CONV_QKV_CASE
}

template <int D>
__device__ __forceinline__ void norm1p_rope_partial(const __nv_bfloat16* __restrict__ x, long long x_stride,
                                                    const __nv_bfloat16* __restrict__ w,
                                                    __nv_bfloat16* __restrict__ y, const int* __restrict__ pos,
                                                    const float* __restrict__ inv_freq, long long n, int heads,
                                                    int rot_dim, float eps) {
  constexpr int V = bf16_lane_dims(D), G = HYB_NORM_ROPE_HEADS;
  static_assert(D >= 16 && (D & (D - 1)) == 0, "head_dim a power of two (exports below)");
  const int lane = threadIdx.x & 31;
  const bool active = lane * V < D;
  const int c0 = active ? lane * V : 0;
  const int half = rot_dim / 2, partner = half / V;  // lanes between c and c + half
  // Lanes holding rotated dims exchange with their partner, the rest read their own value.
  const int src = lane * V < half ? lane + partner : lane * V < rot_dim ? lane - partner : lane;
  // rot_dim / 2 is a multiple of V (the launcher checks): a lane's elements all rotate or none.
  const bool rotates = active && c0 < rot_dim;
  Bf16LaneBits<V> wb;
  wb.load(w + c0);
  // An item is G heads of one row: they share the row's position, so the angles' sin and cos
  // are computed once for them, and their loads are in flight together.
  const index_t rows = n / heads;
  const int groups = (heads + G - 1) / G;
  const index_t items = rows * groups;
  for (index_t it = (index_t)blockIdx.x * hyb::WARPS + (threadIdx.x >> 5); it < items;
       it += (index_t)gridDim.x * hyb::WARPS) {
    const index_t row = it / groups;
    const int h0 = (int)(it - row * groups) * G, nh = min(G, heads - h0);
    Bf16LaneBits<V> xb[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < nh) xb[g].load(x + (row * heads + h0 + g) * x_stride + c0);
    }
    // The row's rot_dim / 2 angles, 32 at a time: each lane takes one angle's sin and cos (all
    // lanes busy, one sincosf each), then each rotated lane gathers its V by shuffles.
    float sn[V], cs[V];
    const float p = (float)pos[row];
    for (int a0 = 0; a0 < half; a0 += 32) {  // warp-uniform
      float s1 = 0.f, c1 = 0.f;
      if (a0 + lane < half) sincosf(__fmul_rn(p, inv_freq[a0 + lane]), &s1, &c1);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int c = c0 + j, a = (c < half ? c : c - half) - a0;
        const float sv = __shfl_sync(0xffffffffu, s1, a & 31), cv = __shfl_sync(0xffffffffu, c1, a & 31);
        if (rotates && a >= 0 && a < 32) sn[j] = sv, cs[j] = cv;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= nh) break;  // warp-uniform
      float xv[V];
#pragma unroll
      for (int j = 0; j < V; ++j) xv[j] = xb[g].at(j);
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < V; ++j) ss = active ? fmaf(xv[j], xv[j], ss) : ss;
      const float inv = 1.f / sqrtf(hyb::warp_sum(ss) * (1.f / D) + eps);  // / D exactly (a power of two)
      // xv becomes the normed row, then (rotated lanes) its rotation.
#pragma unroll
      for (int j = 0; j < V; ++j) xv[j] = xv[j] * inv * (1.f + wb.at(j));
      bf16_lane_round_rn_fast<V>(xv);
      float other[V];
#pragma unroll
      for (int j = 0; j < V; ++j) other[j] = __shfl_sync(0xffffffffu, xv[j], src);
      if (!active) continue;
      float (&o)[V] = xv;
      if (rotates) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          // rope_partial: first half a*c - b*s (a = y, b = partner), second half b*c + a*s (b = y).
          o[j] = c0 < half ? __fsub_rn(__fmul_rn(xv[j], cs[j]), __fmul_rn(other[j], sn[j]))
                           : __fadd_rn(__fmul_rn(xv[j], cs[j]), __fmul_rn(other[j], sn[j]));
        }
      }
      bf16_lane_store_rn_fast<V>(y + (row * heads + h0 + g) * D + c0, o);
    }
  }
}

#define HYB_NORM_ROPE_EXPORT(D)                                                                             \
  extern "C" __global__ void __launch_bounds__(HYB_BLOCK, 3) rmsnorm1p_rope_partial_bf16_hd##D(             \
      const __nv_bfloat16* x, long long x_stride, const __nv_bfloat16* w, __nv_bfloat16* y, const int* pos, \
      const float* inv_freq, long long n, int heads, int rot_dim, float eps) {                             \
    norm1p_rope_partial<D>(x, x_stride, w, y, pos, inv_freq, n, heads, rot_dim, eps);                      \
  }

HYB_NORM_ROPE_EXPORT(16)
HYB_NORM_ROPE_EXPORT(32)
HYB_NORM_ROPE_EXPORT(64)
HYB_NORM_ROPE_EXPORT(128)
HYB_NORM_ROPE_EXPORT(256)

extern "C" __global__ void __launch_bounds__(HYB_BLOCK) sigmoid_mul_strided_bf16(
    __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ gate, long long gate_stride, long long rows,
    long long width) {
  const bool vec = width % 8 == 0 && gate_stride % 8 == 0 && ((uintptr_t)x % 16) == 0 && ((uintptr_t)gate % 16) == 0;
  if (vec) {
    const index_t per_row = width / 8, total = rows * per_row;
    for (index_t e = grid_thread_index(); e < total; e += grid_thread_count()) {
      const index_t r = e / per_row, c = (e - r * per_row) * 8;
      uint4* xp = reinterpret_cast<uint4*>(x + r * width + c);
      float xv[8], gv[8];
      bf16x8_unpack(*xp, xv);
      bf16x8_unpack(*reinterpret_cast<const uint4*>(gate + r * gate_stride + c), gv);
#pragma unroll
      for (int i = 0; i < 8; ++i) xv[i] = xv[i] / (1.f + expf(-gv[i]));
      uint4 o;
      o.x = pack_bf16x2_rne(xv[0], xv[1]);
      o.y = pack_bf16x2_rne(xv[2], xv[3]);
      o.z = pack_bf16x2_rne(xv[4], xv[5]);
      o.w = pack_bf16x2_rne(xv[6], xv[7]);
      *xp = o;
    }
  } else {
    const index_t total = rows * width;
    for (index_t e = grid_thread_index(); e < total; e += grid_thread_count()) {
      const index_t r = e / width, c = e - r * width;
      const float g = bf16_to_f32(gate[r * gate_stride + c]);
      x[e] = f32_to_bf16_rne(bf16_to_f32(x[e]) / (1.f + expf(-g)));
    }
  }
}

// gdn_gates with b and a read from one [rows, 2 * heads] projection (b | a per row).
extern "C" __global__ void __launch_bounds__(HYB_BLOCK) gdn_gates_ba_bf16(
    const __nv_bfloat16* __restrict__ ba, const __nv_bfloat16* __restrict__ a_log,
    const __nv_bfloat16* __restrict__ dt_bias, __nv_bfloat16* __restrict__ beta, float* __restrict__ g,
    long long rows, int heads) {
  const index_t total = rows * heads;
  for (index_t e = grid_thread_index(); e < total; e += grid_thread_count()) {
    const index_t r = e / heads;
    const int h = (int)(e - r * heads);
    const bf16* row = ba + r * 2 * heads;
    beta[e] = f32_to_bf16_rne(1.f / (1.f + expf(-bf16_to_f32(row[h]))));
    const float u = bf16_to_f32(row[heads + h]) + bf16_to_f32(dt_bias[h]);
    const float sp = u > 20.f ? u : logf(1.f + expf(u));
    g[e] = -expf(bf16_to_f32(a_log[h])) * sp;
  }
}
