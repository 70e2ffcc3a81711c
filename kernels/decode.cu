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
// Tiles:    a CTA takes one (row, kv head, split); the G query heads are the M rows of one
//           m16n8k16 tile (rows G..15 are zero queries whose results are dropped). The tensor
//           cores idle at G/16 use, but the kernel is bound by the cache read, and S = Q K^T and
//           O += P V are 2 x D/16 MMAs per DEC_KEYS keys instead of CUDA-core dot products
//           reduced across a warp with shuffles (that kernel ran at 20% of copy bandwidth, this
//           one at 50-70%). Each warp streams its own tiles (every W-th DEC_KEYS-key tile of the
//           split) through its own two-stage cp.async buffers: no barrier until the warps merge.
// Numerics: q.k in f32 on tensor cores from bf16 inputs, P rounded to bf16 as the A operand of
//           the second MMA (attention.cu's convention), softmax statistics and accumulators f32,
//           exp via exp2 of scores pre-scaled by scale*log2(e) (mma.cuh exp2_ftz; exp2f where the
//           warps' and splits' maxima merge). Warps merge in warp order,
//           splits in split order: bit-identical run to run. o is rounded to bf16 once (RNE).
// Symbols:  attn_decode_mma_bf16_hd<D>, attn_decode_combine_hd<D> for D in {16, 32, 64, 128, 256}
//           (every head dim a preset uses).
// Launch:   attn_decode_mma: grid splits * kv_heads * rows (block b: split b % splits, kv head
//           (b / splits) % kv_heads, row b / (splits * kv_heads)), block W * 32 with
//           1 <= W <= DEC_MMA_MAX_WARPS, dynamic smem (ATTN_WARP_ROWS + 4 * DEC_KEYS * W) * LD * 2
//           bytes, LD = D + ATTN_LD_PAD (hd 128, W 4: 73,984). Split s takes keys
//           [s*split_keys, (s+1)*split_keys) of each row (an empty range writes m = -inf, l = 0).
//           G <= ATTN_WARP_ROWS. Violations trap.
//           attn_decode_combine: grid rows*heads, block D (one thread per dim; traps otherwise).
// Bytes:    per row and kv head: len * D * 2 * 2 (K and V) + q; part traffic rows*heads*splits*(D+2)*4*2.
// Bound:    memory (the cache read). The host picks split_keys (a multiple of DEC_KEYS) so that
//           rows * kv_heads * splits is about 2 CTAs per SM, and W = split_keys / DEC_KEYS up to
//           DEC_MMA_MAX_WARPS (H200: 2 CTAs per SM measured fastest of 1-8; benches/kernels.rs).
#include "mma.cuh"

namespace attn {

// One warp's K and V tile of DEC_KEYS cache rows from t0 (rows at or past hi zero-filled).
template <int HD>
__device__ __forceinline__ void decode_load_tile(bf16* sK, bf16* sV, const bf16* kbase, const bf16* vbase,
                                                 index_t kvw, index_t t0, index_t hi, const bf16* any_mapped,
                                                 int lane) {
  constexpr int C = Geo<HD>::CHUNKS, LD = Geo<HD>::LD;
  for (int c = lane; c < DEC_KEYS * C; c += 32) {
    const int i = c / C, ch = c % C;
    const bool ok = t0 + i < hi;
    const index_t off = (t0 + i) * kvw + ch * 8;
    cp_async_16(smem_u32(sK + i * LD + ch * 8), ok ? kbase + off : any_mapped, ok);
    cp_async_16(smem_u32(sV + i * LD + ch * 8), ok ? vbase + off : any_mapped, ok);
  }
}

template <int HD>
__device__ __forceinline__ void decode_mma(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                           const bf16* __restrict__ vc, float* __restrict__ part_o,
                                           float* __restrict__ part_ml, int rows, int heads, int kv_heads,
                                           long long row_stride, int len0, int len_inc, int split_keys, int splits,
                                           float scale) {
  constexpr int LD = Geo<HD>::LD, NK = DEC_KEYS / 8, TILE = DEC_KEYS * LD;
  const int W = (int)(blockDim.x >> 5);
  const int g = kv_heads > 0 ? heads / kv_heads : 0;
  if ((blockDim.x & 31) != 0 || W < 1 || W > DEC_MMA_MAX_WARPS) __trap();
  if (g < 1 || g > WARP_ROWS || g * kv_heads != heads || split_keys < 1) __trap();
  if ((long long)gridDim.x != (long long)splits * kv_heads * rows) __trap();
  require_launch(blockDim.x, (size_t)(WARP_ROWS + 4 * DEC_KEYS * W) * LD * 2);
  const int sp = (int)(blockIdx.x % (unsigned)splits);
  const int kvh = (int)((blockIdx.x / (unsigned)splits) % (unsigned)kv_heads);
  const int r = (int)(blockIdx.x / ((unsigned)splits * (unsigned)kv_heads));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  const index_t len = (index_t)len0 + (index_t)r * len_inc;
  const index_t lo = (index_t)sp * split_keys;
  const index_t hi = min(len, lo + (index_t)split_keys);

  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [16][LD], shared by the warps
  bf16* sK = sQ + WARP_ROWS * LD + warp * 4 * TILE;  // this warp's K [2][DEC_KEYS][LD]
  bf16* sV = sK + 2 * TILE;                          // and V [2][DEC_KEYS][LD]
  const index_t kvw = (index_t)kv_heads * HD;
  const bf16* kbase = kc + (index_t)r * row_stride * kvw + (index_t)kvh * HD;
  const bf16* vbase = vc + (index_t)r * row_stride * kvw + (index_t)kvh * HD;

  // Group 0: Q (the whole CTA) and each warp's first tile; group 1: its second tile.
  load_rows<HD>(sQ, WARP_ROWS, q, [&](int m) -> const bf16* {
    return m < g ? q + ((index_t)r * heads + (index_t)kvh * g + m) * HD : nullptr;
  });
  const index_t step = (index_t)W * DEC_KEYS;
  const index_t first = lo + (index_t)warp * DEC_KEYS;
#pragma unroll
  for (int st = 0; st < 2; ++st) {
    const index_t t0 = first + st * step;
    if (t0 < hi) decode_load_tile<HD>(sK + st * TILE, sV + st * TILE, kbase, vbase, kvw, t0, hi, kc, lane);
    cp_async_commit();
  }
  cp_async_wait<1>();
  __syncthreads();  // Q from every thread's copies

  float acc[1][HD / 8][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) acc[0][n][0] = acc[0][n][1] = acc[0][n][2] = acc[0][n][3] = 0.f;
  const float sl2 = scale * LOG2E;
  const uint32_t sQa = smem_u32(sQ);
  int i = 0;
  for (index_t t0 = first; t0 < hi; t0 += step, ++i) {
    const int st = i & 1;
    if (i > 0) {
      cp_async_wait<1>();
      __syncwarp();
    }
    float s[1][NK][4];
    mma_abt<HD, NK, 1>(s, sQa, smem_u32(sK + st * TILE), lane);
    softmax_tile<HD, NK>(s[0], acc[0], m, l, sl2, t0 + DEC_KEYS > hi, lane,
                         [&](int, int col) { return t0 + col < hi; });
    mma_pb<HD, NK, 1>(acc, s, smem_u32(sV + st * TILE), lane);
    __syncwarp();  // every lane's reads of this stage are done before it is refilled
    const index_t tn = t0 + 2 * step;
    if (tn < hi) decode_load_tile<HD>(sK + st * TILE, sV + st * TILE, kbase, vbase, kvw, tn, hi, kc, lane);
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncwarp();

  // The warps' partial softmaxes, merged in warp order: each warp's f32 O rows go over its own
  // (now idle) K buffer, m and l into small static arrays.
  __shared__ float sm_m[DEC_MMA_MAX_WARPS][WARP_ROWS], sm_l[DEC_MMA_MAX_WARPS][WARP_ROWS];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
  }
  float* so = reinterpret_cast<float*>(sK);  // [g][HD] f32: 64 * HD bytes <= 4 * TILE * 2
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = gr + 8 * (e >> 1);
      if (row < g) so[row * HD + n * 8 + 2 * tq + (e & 1)] = acc[0][n][e];
    }
  }
  if (tq == 0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = gr + 8 * hh;
      if (row < g) {
        sm_m[warp][row] = m[hh];
        sm_l[warp][row] = l[hh];
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < g * HD; e += blockDim.x) {
    const int h = e / HD, d = e % HD;
    float mx = -INFINITY;
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, sm_m[w][h]);
    float o = 0.f, ls = 0.f;
    for (int w = 0; w < W; ++w) {
      const float c = sm_m[w][h] == -INFINITY ? 0.f : exp2f(sm_m[w][h] - mx);
      const float* sow = reinterpret_cast<const float*>(sQ + WARP_ROWS * LD + w * 4 * TILE);
      o = fmaf(sow[h * HD + d], c, o);
      ls = fmaf(sm_l[w][h], c, ls);
    }
    const index_t slot = ((index_t)r * heads + (index_t)kvh * g + h) * splits + sp;
    part_o[slot * HD + d] = o;
    if (d == 0) {
      part_ml[slot * 2] = mx;
      part_ml[slot * 2 + 1] = ls;
    }
  }
}

// The splits merged in split order; o = acc / l rounded once, lse in natural log.
template <int D>
__device__ __forceinline__ void decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
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

}  // namespace attn

// The split kernel and its combine pass, at every head dim a preset uses.
#define DEC_EXPORT(D)                                                                                    \
  extern "C" __global__ void __launch_bounds__(DEC_MMA_MAX_WARPS * 32) attn_decode_mma_bf16_hd##D(              \
      const __nv_bfloat16* q, const __nv_bfloat16* kc, const __nv_bfloat16* vc, float* part_o, float* part_ml,   \
      int rows, int heads, int kv_heads, long long row_stride, int len0, int len_inc, int split_keys,             \
      int splits, float scale) {                                                                                  \
    attn::decode_mma<D>(q, kc, vc, part_o, part_ml, rows, heads, kv_heads, row_stride, len0, len_inc,          \
                        split_keys, splits, scale);                                                            \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(D) attn_decode_combine_hd##D(                                   \
      const float* part_o, const float* part_ml, __nv_bfloat16* o, float* lse, int splits) {                   \
    attn::decode_combine<D>(part_o, part_ml, o, lse, splits);                                                  \
  }

DEC_EXPORT(16)
DEC_EXPORT(32)
DEC_EXPORT(64)
DEC_EXPORT(128)
DEC_EXPORT(256)
