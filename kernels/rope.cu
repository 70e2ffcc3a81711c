// rope.cu: rotary position embedding, rotate-half convention (Qwen3 / Hugging Face), in place,
// forward or inverse (the inverse rotation is the backward: R(-angle) = R(angle)^T).
//
// Math:     for row r, head h, i < half = head_dim / 2:
//             angle = f32(pos[r]) * inv_freq[i]  (one f32 multiply, __fmul_rn)
//             c = cos(angle), s = sin(angle) (precise sincosf; s = -s when inverse != 0)
//             a = x[r, h, i], b = x[r, h, i + half]
//             x[r, h, i] = bf16(a*c - b*s), x[r, h, i + half] = bf16(b*c + a*s)
//           Each product and the sum/difference is rounded once in f32 (__fmul_rn, __fsub_rn,
//           __fadd_rn: never an FMA), as cpu.rs evaluates `a * c - b * sn`. Only sincosf differs
//           from the CPU's libm (CUDA: <= 2 ulp), so compare with a bf16 tolerance.
// Layouts:  x: [rows, heads * head_dim] bf16 row-major, contiguous. pos: [rows] i32 (any value,
//           negative allowed). inv_freq: [head_dim / 2] f32, computed by the host (cpu.rs
//           rope_inv_freq: 1 / theta^(2i / head_dim)).
// Preconditions: head_dim even and >= 2, heads >= 1, rows >= 0 (else no-op).
// Work item: (row, group of V consecutive i). V = 8 when half % 8 == 0 and x is 16-byte aligned
//           (then every a and b group is one 16-byte access), else 1. An item computes its V
//           sincosf once and applies them to every head of the row, so the trigonometry costs
//           rows * half sincosf per call, not rows * heads * half.
// Launch:   blockDim.x any value up to 1024 (256 suggested); grid.x any >= 1 (grid-stride over
//           items). Suggested grid.x = clamp(ceil(rows * half / V / 256), 1, 16 * SM count).
//           No shared memory, no scratch.
// Bytes:    rows * heads * head_dim * 2 * 2 (read + write) + rows * 4 + half * 4.
// FLOPs:    6 per pair per head (4 mul, 2 add) = 3 * rows * heads * head_dim; plus rows * half
//           sincosf (~40 instructions each; angles > 105615 rad take CUDA's slower exact
//           reduction, which uses a small local-memory stack frame, not a spill).
// Bound:    memory. Target >= 80% of the measured device-to-device copy bandwidth (~4.1 TB/s on
//           an H200) for heads >= 8 and rows * heads * head_dim >= 2^24. Measured (H200,
//           32768 rows x 32 heads x 128): 81.1% of copy bandwidth.
// Why head groups: an item loads its V columns of HG heads before it stores any of them, so a
//           thread keeps HG * 2 independent 16-byte loads in flight instead of 2 (x is updated in
//           place: the compiler cannot hoist a later head's loads above an earlier store).
#include "common.cuh"
#include "launch.cuh"

template <int V>
__device__ __forceinline__ void rope_items(__nv_bfloat16* x, const int* __restrict__ pos,
                                           const float* __restrict__ inv_freq, index_t rows,
                                           int heads, int head_dim, bool inverse) {
  const int half = head_dim / 2;
  const index_t groups_per_row = half / V;
  const index_t total = rows * groups_per_row;
  const index_t width = (index_t)heads * head_dim;
  for (index_t item = grid_thread_index(); item < total; item += grid_thread_count()) {
    // One 64-bit division per item; an item then does `heads` rounds of memory work.
    const index_t row = item / groups_per_row;
    const int i0 = (int)(item - row * groups_per_row) * V;
    const float p = (float)pos[row]; // i32 -> f32 round to nearest, as Rust's `as f32`
    float c[V], s[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float angle = __fmul_rn(p, inv_freq[i0 + j]);
      sincosf(angle, &s[j], &c[j]);
      if (inverse) s[j] = -s[j];
    }
    __nv_bfloat16* xr = x + row * width + i0;
    // Heads go in groups of HG: every load of a group is issued before its first store (x is
    // written in place, so the compiler cannot hoist a later head's loads above a store): HG * 2
    // 16-byte loads in flight per thread instead of 2.
    constexpr int HG = 4;
    for (int h0 = 0; h0 < heads; h0 += HG) {
      const int hn = heads - h0 < HG ? heads - h0 : HG;
      float a[HG][V], b[HG][V];
#pragma unroll
      for (int g = 0; g < HG; ++g) {
        if (g < hn) {
          const __nv_bfloat16* pa = xr + (index_t)(h0 + g) * head_dim;
          bf16_chunk_load<V>(pa, a[g]);
          bf16_chunk_load<V>(pa + half, b[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < HG; ++g) {
        if (g < hn) {
          __nv_bfloat16* pa = xr + (index_t)(h0 + g) * head_dim;
          float oa[V], ob[V];
#pragma unroll
          for (int j = 0; j < V; ++j) {
            oa[j] = __fsub_rn(__fmul_rn(a[g][j], c[j]), __fmul_rn(b[g][j], s[j]));
            ob[j] = __fadd_rn(__fmul_rn(b[g][j], c[j]), __fmul_rn(a[g][j], s[j]));
          }
          bf16_chunk_store_rne<V>(pa, oa);
          bf16_chunk_store_rne<V>(pa + half, ob);
        }
      }
    }
  }
}

extern "C" __global__ void rope_bf16(__nv_bfloat16* x, const int* __restrict__ pos,
                                     const float* __restrict__ inv_freq, long long rows, int heads,
                                     int head_dim, int inverse) {
  if (rows <= 0 || heads <= 0 || head_dim < 2) return;
  const int half = head_dim / 2;
  // half % 8 == 0 makes head_dim, the row width and i0 (+ half) multiples of 8 elements.
  if (half % BF16_PER_VEC == 0 && is_vec_aligned(x)) {
    rope_items<BF16_PER_VEC>(x, pos, inv_freq, rows, heads, head_dim, inverse != 0);
  } else {
    rope_items<1>(x, pos, inv_freq, rows, heads, head_dim, inverse != 0);
  }
}

// ---- qk_norm_rope_bf16_hd<D>: the Qwen3 attention's per-head RMSNorm then RoPE, q and k in one
// launch, reading and writing rows with strides (the fused q|k|v projection in, the KV cache out).
// Math:     for each row r and head h of q (heads) and of k (kv_heads), x = the head's D inputs:
//             inv = 1 / sqrt(sum(x^2) / D + eps)                  (f32)
//             y[c] = bf16(x[c] * inv * w[c])                        (w: q_norm or k_norm weight)
//             then the rotation of rope_bf16 above on y (angle = f32(pos[r]) * inv_freq[i], the
//             same rounded products), rounded to bf16 once more.
//           Exactly rmsnorm_fwd_bf16 followed by rope_bf16, without the round trip through memory
//           (only the order of the sum of squares differs). Both roundings use the hardware's
//           cvt.rn.bf16x2.f32 (pack_bf16x2_rn_fast: the CPU's bits for every non-NaN value).
// Bound:    instruction issue, not memory: per head the sum's shuffles, the exact divide and
//           square root, and the roundings. At the 8B shape (12288 rows, 32/8 heads of 128) on
//           the H200: 0.129 ms in the bench (46% of copy bandwidth; 169 us a call in the step)
//           with the roundings in software (~14 integer instructions a pair) and ss / D as an
//           IEEE division; 0.088 ms (67%; 111 us in the step) as written.
// Layouts:  q_in + r * q_in_stride, k_in + r * k_in_stride: the row's heads, each D contiguous
//           bf16; q_out + r * q_out_stride, k_out + r * k_out_stride likewise. wq, wk: [D] bf16.
//           pos: [rows] i32. inv_freq: [D / 2] f32. With keep_rstd != 0, q_rstd [rows * heads] and
//           k_rstd [rows * kv_heads] f32 receive each head's inv (row-major: r * heads + h), as
//           rmsnorm_fwd's rstd for the norm's backward; with keep_rstd 0 (or no heads on that
//           side) they are never written, but must be live pointers, as every launch argument:
//           the launcher then passes inv_freq's, which this kernel only reads.
// Work:     one warp per QKR_HEADS heads of a row (q heads first, then k heads, counted
//           together): V = bf16_lane_dims(D) elements per lane; the partner of element c
//           (c +- D/2) is the same slot of lane ^ (D / 2 / V). The warp issues its heads' loads
//           together and computes the row's angles once for them.
// Launch:   blockDim.x = QKR_WARPS * 32 (launch.cuh); grid.x = ceil(rows * ceil((heads + kv_heads)
//           / QKR_HEADS) / QKR_WARPS). D >= 16, the offsets of every row and head 2 * V-byte
//           aligned. No shared memory.

template <int D>
__device__ __forceinline__ void qk_norm_rope(const __nv_bfloat16* __restrict__ q_in, long long q_in_stride,
                                             const __nv_bfloat16* __restrict__ k_in, long long k_in_stride,
                                             const __nv_bfloat16* __restrict__ wq,
                                             const __nv_bfloat16* __restrict__ wk, __nv_bfloat16* q_out,
                                             long long q_out_stride, __nv_bfloat16* k_out, long long k_out_stride,
                                             const int* __restrict__ pos, const float* __restrict__ inv_freq,
                                             float* __restrict__ q_rstd, float* __restrict__ k_rstd, int keep_rstd,
                                             long long rows, int heads, int kv_heads, float eps) {
  constexpr int V = bf16_lane_dims(D), G = QKR_HEADS;
  static_assert(D >= 16 && (D & (D - 1)) == 0, "head_dim a power of two (exports below)");
  constexpr int HALF = D / 2;
  constexpr int PARTNER = HALF / V;  // lane distance between element c and c + HALF
  if (blockDim.x != QKR_WARPS * 32) __trap();
  const int lane = threadIdx.x & 31;
  const bool active = lane * V < D;
  const index_t item = (index_t)blockIdx.x * QKR_WARPS + (threadIdx.x >> 5);
  const int per_row = heads + kv_heads, groups = (per_row + G - 1) / G;
  if (item >= rows * groups) return;  // whole warps leave together
  const index_t r = item / groups;
  const int h0 = (int)(item - r * groups) * G, nh = min(G, per_row - h0);
  const int c0 = active ? lane * V : 0;
  // Head hh of the row: q head hh, or k head hh - heads.
  auto in_of = [&](int hh) {
    return hh < heads ? q_in + r * q_in_stride + (index_t)hh * D : k_in + r * k_in_stride + (index_t)(hh - heads) * D;
  };
  Bf16LaneBits<V> xb[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g < nh) xb[g].load(in_of(h0 + g) + c0);
  }
  Bf16LaneBits<V> wqb, wkb;
  wqb.load(wq + c0);
  wkb.load(wk + c0);
  // The row's angles, once for the warp's heads (the same rounded products as rope_bf16).
  const float p = (float)pos[r];
  float sn[V], cs[V];
#pragma unroll
  for (int j = 0; j < V; ++j) sincosf(__fmul_rn(p, inv_freq[(c0 + j) % HALF]), &sn[j], &cs[j]);
  const bool first = c0 < HALF;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g >= nh) break;  // warp-uniform
    const int hh = h0 + g;
    const bool is_q = hh < heads;
    float x[V];
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = xb[g].at(j);
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) ss = active ? fmaf(x[j], x[j], ss) : ss;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
    // As rmsnorm.cu; ss / D is ss * (1 / D) exactly (D a power of two).
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fmul_rn(ss, 1.0f / D), eps)));
    if (keep_rstd && lane == 0) {
      if (is_q) q_rstd[r * heads + hh] = inv;
      else k_rstd[r * kv_heads + (hh - heads)] = inv;
    }
    // x becomes the normed head, then its rotation.
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = __fmul_rn(__fmul_rn(x[j], inv), is_q ? wqb.at(j) : wkb.at(j));
    bf16_lane_round_rn_fast<V>(x);
    float other[V];
#pragma unroll
    for (int j = 0; j < V; ++j) other[j] = __shfl_xor_sync(0xFFFFFFFFu, x[j], PARTNER);
    if (!active) continue;
    __nv_bfloat16* out = is_q ? q_out + r * q_out_stride + (index_t)hh * D
                              : k_out + r * k_out_stride + (index_t)(hh - heads) * D;
    float o[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      // first half: a = y, b = other -> a*c - b*s; second half: b = y, a = other -> b*c + a*s.
      o[j] = first ? __fsub_rn(__fmul_rn(x[j], cs[j]), __fmul_rn(other[j], sn[j]))
                   : __fadd_rn(__fmul_rn(x[j], cs[j]), __fmul_rn(other[j], sn[j]));
    }
    bf16_lane_store_rn_fast<V>(out + c0, o);  // the launcher checks the 2 * V-byte alignment
  }
}

#define QKR_EXPORT(D)                                                                                          \
  extern "C" __global__ void __launch_bounds__(QKR_WARPS * 32) qk_norm_rope_bf16_hd##D(                        \
      const __nv_bfloat16* q_in, long long q_in_stride, const __nv_bfloat16* k_in, long long k_in_stride,     \
      const __nv_bfloat16* wq, const __nv_bfloat16* wk, __nv_bfloat16* q_out, long long q_out_stride,         \
      __nv_bfloat16* k_out, long long k_out_stride, const int* pos, const float* inv_freq, float* q_rstd,     \
      float* k_rstd, int keep_rstd, long long rows, int heads, int kv_heads, float eps) {                      \
    qk_norm_rope<D>(q_in, q_in_stride, k_in, k_in_stride, wq, wk, q_out, q_out_stride, k_out, k_out_stride,    \
                    pos, inv_freq, q_rstd, k_rstd, keep_rstd, rows, heads, kv_heads, eps);                     \
  }

QKR_EXPORT(16)
QKR_EXPORT(32)
QKR_EXPORT(64)
QKR_EXPORT(128)
QKR_EXPORT(256)
