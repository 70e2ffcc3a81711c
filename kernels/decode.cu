// decode.cu: attention of a few query rows over a KV cache (decoding and verification), split
// over the keys (split-K "flash decoding") so a handful of rows still fills the GPU.
// CPU reference: src/backend/cpu.rs attn_decode; DESIGN.md section 8.
//
// Math:     query row r (of `rows`) sees the cache rows base(r) + [0, len(r)), with
//           base(r) = r * row_stride and len(r) = len0 + r * len_inc (decoding a batch: stride =
//           the cache's max_len, len = step + 1, inc 0; verifying a block of one sequence: stride
//           0, len = start + 1, inc 1: causal). Head h reads kv head h / G, G = heads / kv_heads.
//             o[r,h] = sum_t softmax_t(scale * q[r,h].k[t]) v[t],
//             lse[r,h] = m + ln(sum_t exp(scale q.k - m))        (natural log, f32)
//           The row's own key and value are in the cache already (the caller writes them first).
// Layouts:  q, o: bf16 [rows, heads*D]. kc, vc: bf16 cache rows of kv_heads*D. lse: f32
//           [rows*heads]. part_o: f32 [rows, heads, splits, D]; part_ml: f32 [rows, heads,
//           splits, 2] (the running max in log2 units and the sum of exp2 under it).
// Numerics: q.k in f32 from bf16 inputs (CUDA-core FMAs, no bf16 rounding of scores or
//           probabilities), scores pre-scaled by scale*log2(e) and exponentiated with exp2f, every
//           accumulator f32; o is rounded to bf16 once (RNE). Splits are combined in split order:
//           bit-identical run to run.
// Symbols:  <kernel>_hd<D> for D in {16, 32, 64, 128, 256} (every head dim a preset uses);
//           attn_decode_split4_* is the split kernel for G <= 4 (fewer registers).
// Launch:   attn_decode_split_bf16_hd<D>: grid splits*kv_heads*rows (block b: split b % splits, kv
//           head (b / splits) % kv_heads, row b / (splits*kv_heads); traps on another size), block
//           DEC_WARPS*32;
//           split s takes keys [s*split_keys, (s+1)*split_keys) of each row (an empty range writes
//           m = -inf, l = 0). G <= DEC_MAX_GROUP. Static shared memory only.
//           attn_decode_combine_hd<D>: grid rows*heads, block D (one thread per dim; traps
//           otherwise).
// Bytes:    per row and kv head: len * D * 2 * 2 (K and V) + q; part traffic rows*heads*splits*(D+2)*4*2.
// Bound:    memory (the cache read); the host picks split_keys so rows*kv_heads*splits is about
//           4 CTAs per SM, each warp with DEC_UNROLL key rows in flight.
#include "common.cuh"
#include "launch.cuh"

namespace dec {

template <int D, int GM>
__device__ __forceinline__ void split(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kc,
                                      const __nv_bfloat16* __restrict__ vc, float* __restrict__ part_o,
                                      float* __restrict__ part_ml, int rows, int heads, int kv_heads,
                                      long long row_stride, int len0, int len_inc, int split_keys, int splits,
                                      float scale) {
  constexpr int V = bf16_lane_dims(D);
  constexpr int W = DEC_WARPS;
  if (blockDim.x != W * 32) __trap();
  const int g = heads / kv_heads;
  if (g > GM || g * kv_heads != heads) __trap();
  if ((long long)gridDim.x != (long long)splits * kv_heads * rows) __trap();
  const int sp = blockIdx.x % splits, kvh = (blockIdx.x / splits) % kv_heads, r = blockIdx.x / (splits * kv_heads);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool active = lane * V < D;  // all lanes from D 32 up
  const long long len = (long long)len0 + (long long)r * len_inc;
  const long long lo = (long long)sp * split_keys;
  const long long hi = min(len, lo + split_keys);
  const float qs = scale * 1.4426950408889634f;  // scale * log2(e)

  float qf[GM][V];
#pragma unroll
  for (int h = 0; h < GM; ++h) {
#pragma unroll
    for (int i = 0; i < V; ++i) qf[h][i] = 0.0f;
    if (h < g && active) {
      bf16_lane_load<V>(q + ((index_t)r * heads + kvh * g + h) * D + lane * V, qf[h]);
#pragma unroll
      for (int i = 0; i < V; ++i) qf[h][i] *= qs;
    }
  }
  float m[GM], l[GM], acc[GM][V];
#pragma unroll
  for (int h = 0; h < GM; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i) acc[h][i] = 0.0f;
  }
  const index_t kvw = (index_t)kv_heads * D;
  const index_t lane_off = active ? lane * V : 0;
  const __nv_bfloat16* kbase = kc + ((index_t)r * row_stride) * kvw + kvh * D + lane_off;
  const __nv_bfloat16* vbase = vc + ((index_t)r * row_stride) * kvw + kvh * D + lane_off;
  // DEC_UNROLL keys per warp per iteration, all loaded before any is used: that many K and V
  // rows in flight per warp (one at a time leaves HBM mostly idle at decoding's few warps).
  constexpr int U = DEC_UNROLL;
  for (long long t0 = lo + warp; t0 < hi; t0 += (long long)W * U) {
    float kf[U][V], vf[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long t = t0 + (long long)u * W;
      if (t < hi && active) {
        bf16_lane_load<V>(kbase + t * kvw, kf[u]);
        bf16_lane_load<V>(vbase + t * kvw, vf[u]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) kf[u][i] = vf[u][i] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t0 + (long long)u * W >= hi) break;  // uniform across the warp
#pragma unroll
      for (int h = 0; h < GM; ++h) {
        if (h < g) {
          float s = 0.0f;
#pragma unroll
          for (int i = 0; i < V; ++i) s = fmaf(qf[h][i], kf[u][i], s);
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
          const float mn = fmaxf(m[h], s);
          const float corr = exp2f(m[h] - mn);  // m = -inf at first: exp2(-inf) = 0
          const float p = exp2f(s - mn);
          l[h] = fmaf(l[h], corr, p);
#pragma unroll
          for (int i = 0; i < V; ++i) acc[h][i] = fmaf(acc[h][i], corr, p * vf[u][i]);
          m[h] = mn;
        }
      }
    }
  }
  // The warps' partial softmaxes, merged in warp order.
  __shared__ float sm_o[W][GM][D];
  __shared__ float sm_m[W][GM], sm_l[W][GM];
#pragma unroll
  for (int h = 0; h < GM; ++h) {
    if (h < g) {
      if (active) {
#pragma unroll
        for (int i = 0; i < V; ++i) sm_o[warp][h][lane * V + i] = acc[h][i];
      }
      if (lane == 0) {
        sm_m[warp][h] = m[h];
        sm_l[warp][h] = l[h];
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < g * D; e += W * 32) {
    const int h = e / D, d = e % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, sm_m[w][h]);
    float o = 0.0f, ls = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float c = sm_m[w][h] == -INFINITY ? 0.0f : exp2f(sm_m[w][h] - mx);
      o = fmaf(sm_o[w][h][d], c, o);
      ls = fmaf(sm_l[w][h], c, ls);
    }
    const index_t slot = ((index_t)r * heads + kvh * g + h) * splits + sp;
    part_o[slot * D + d] = o;
    if (d == 0) {
      part_ml[slot * 2] = mx;
      part_ml[slot * 2 + 1] = ls;
    }
  }
}

template <int D>
__device__ __forceinline__ void combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        __nv_bfloat16* __restrict__ o, float* __restrict__ lse, int splits) {
  if (blockDim.x != D) __trap();
  const index_t rh = blockIdx.x;  // r * heads + h
  const int d = threadIdx.x;
  const float* ml = part_ml + rh * splits * 2;
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, ml[2 * s]);
  float acc = 0.0f, ls = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float c = ml[2 * s] == -INFINITY ? 0.0f : exp2f(ml[2 * s] - mx);
    acc = fmaf(part_o[(rh * splits + s) * D + d], c, acc);
    ls = fmaf(ml[2 * s + 1], c, ls);
  }
  o[rh * D + d] = f32_to_bf16_rne(acc / ls);
  if (d == 0) lse[rh] = (mx + log2f(ls)) * 0.6931471805599453f;
}

}  // namespace dec

// Two register budgets of the split kernel: up to DEC_MAX_GROUP query heads per kv head, and up
// to 4 (Qwen3: fewer registers, more resident CTAs); the launcher takes the smaller that fits.
#define DEC_EXPORT(D)                                                                                          \
  extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attn_decode_split_bf16_hd##D(                   \
      const __nv_bfloat16* q, const __nv_bfloat16* kc, const __nv_bfloat16* vc, float* part_o, float* part_ml, \
      int rows, int heads, int kv_heads, long long row_stride, int len0, int len_inc, int split_keys,           \
      int splits, float scale) {                                                                                \
    dec::split<D, DEC_MAX_GROUP>(q, kc, vc, part_o, part_ml, rows, heads, kv_heads, row_stride, len0, len_inc, \
                                 split_keys, splits, scale);                                                    \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attn_decode_split4_bf16_hd##D(                  \
      const __nv_bfloat16* q, const __nv_bfloat16* kc, const __nv_bfloat16* vc, float* part_o, float* part_ml, \
      int rows, int heads, int kv_heads, long long row_stride, int len0, int len_inc, int split_keys,           \
      int splits, float scale) {                                                                                \
    dec::split<D, 4>(q, kc, vc, part_o, part_ml, rows, heads, kv_heads, row_stride, len0, len_inc, split_keys, \
                     splits, scale);                                                                            \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(D) attn_decode_combine_hd##D(                                   \
      const float* part_o, const float* part_ml, __nv_bfloat16* o, float* lse, int splits) {                   \
    dec::combine<D>(part_o, part_ml, o, lse, splits);                                                          \
  }

DEC_EXPORT(16)
DEC_EXPORT(32)
DEC_EXPORT(64)
DEC_EXPORT(128)
DEC_EXPORT(256)
