// attention.cu: the target's causal GQA prefill attention and the drafter's block attention
// (forward and a deterministic backward), on tensor cores (mma.sync m16n8k16 bf16 -> f32).
// DESIGN.md section 8, DFLASH.md section 3; CPU reference: src/backend/cpu.rs attn_causal_fwd,
// attn_draft_fwd, attn_draft_bwd.
//
// Math:
//   causal fwd  o[i,h] = sum_{t=ss(i)..i} softmax_t(scale * q[i,h].k[t,h/G]) v[t,h/G],
//               ss(i) = start of row i's sequence (seq_starts), G = heads / kv_heads.
//   draft fwd   block j, anchor a = anchors[j] >= 0, keys = context rows ctx_start[j] + [0, a)
//               (STRICTLY before the anchor) then the bs rows of block j itself (bidirectional);
//               o = softmax(scale q.k) v, lse = m + ln(sum exp(s - m)) (natural log, f32).
//               a < 0 (padded block): o = +0, lse = 0.
//               window W > 0 (a sliding-window layer, DFLASH.md section 3): slot r sees context
//               rows a + r - (W - 1) <= u < a and block slots <= r (causal inside the block);
//               W == 0: full attention as above.
//   draft bwd   p = exp(scale q.k - lse), dp = do.v, ds = p (dp - dsum) scale, dsum = do.o;
//               dq = sum_keys ds k; dk = sum_rows ds q; dv = sum_rows p do. Every gradient is
//               written (=), never accumulated into (+=), and no floating-point atomics exist:
//               results are bit-identical run to run.
// Layouts:  bf16 row-major. q, o, d_o, dq: [q_rows, heads*hd]; k, v (causal), kc, vc, dkc, dvc:
//           [rows, kv_heads*hd]; kb, vb, dkb, dvb: [num_blocks*bs, kv_heads*hd] (block j = rows
//           j*bs..(j+1)*bs). lse, dsum: f32 [q_rows, heads] (index row*heads + h). anchors,
//           ctx_start, seq_starts, ctx_block_begin/end: i32. Head h reads kv head h / G.
// Numerics: scores, softmax statistics and all accumulators in f32; exp via exp2 (mma.cuh
//           exp2_ftz) of scores pre-scaled by scale*log2(e). P (and dS) are rounded to bf16 once as the A operand of
//           the second MMA (the flash-attention convention; ~2^-9 relative per term, averaging
//           out over keys); the block-key gradients dkb/dvb use f32 P/dS with CUDA-core FMAs.
//           Every output element is rounded to bf16 exactly once (RNE, common.cuh).
// Symbols:  <kernel>_bf16_hd<D> for D in {16, 32, 64, 128}: attn_causal_fwd, attn_draft_fwd,
//           attn_draft_bwd_prep, attn_draft_bwd_q, attn_draft_bwd_kv. One symbol per head dim;
//           the Rust launcher picks by head_dim. attn_causal_fwd also at D = 256 (Qwen3.5/3.6
//           full attention; ATTN_CAUSAL_EXPORT below, 64 query rows per CTA).
//
// Tiles (each constant below repeats its own reason): a drafter block's bs queries and the G q
//   heads of one kv head all see the same keys (DESIGN.md section 8), so a CTA takes one (block,
//   kv head) as a single M = bs * G row tile, 16 rows per warp (the M of one m16n8k16), against
//   64-key K/V tiles (a 16 x 64 S tile is 32 f32 registers per thread; a 64 x 128 bf16 stage is
//   16 KB). The causal forward gives each of its 4 warps two 16-row m-tiles (128 query rows of one
//   head per CTA), so every K/V fragment read from shared memory feeds two MMAs; its 32-key tiles
//   keep the 2 x 16 x 128 O accumulators plus S within 255 registers without spills, and 69.6 KB
//   of shared memory at hd 128 lets two CTAs share an SM. bwd_kv owns 64 context keys per CTA
//   (4 warps of 16) and takes a block's query rows 32 at a time (4 n8 tiles of S^T per warp): one
//   CTA owns each context tile's dK/dV, so they are summed in a fixed order without atomics.
//
// Launch configurations (1-D grids and blocks; the kernels check blockDim and the dynamic
// shared-memory size at entry and __trap() on a mismatch, so a launcher bug fails loudly instead
// of reading garbage). LD = hd + 8 (bf16 elements per shared-memory row: 16 bytes of padding make
// every ldmatrix conflict-free for all four head dims). G = heads / kv_heads, M = block_size * G.
//   attn_causal_fwd     grid  ceil(rows / 128) * heads, block 128,
//                       smem  (128 + 4*32) * LD * 2 bytes                (hd 128: 69,632)
//   attn_draft_fwd      W = ceil(M / 16); grid num_blocks * kv_heads, block 32*W,
//                       smem  (16*W + 4*64) * LD * 2                     (hd 128, W 4: 87,040)
//   attn_draft_bwd_prep grid  any >= 1 (grid-stride; ceil(q_rows*heads*hd/8 / 256) is enough),
//                       block any multiple of 32 (256), smem 0
//   attn_draft_bwd_q    W = ceil(M / 16); grid num_blocks * kv_heads, block 32*W,
//                       smem  (32*W + 4*64) * LD * 2 + 2*16*W * 16 * 4   (hd 128, W 4: 112,640)
//   attn_draft_bwd_kv   Mp = 32 * ceil(M / 32); grid ceil(ctx_rows / 64) * kv_heads, block 128,
//                       smem  (2*64 + 4*Mp) * LD * 2 + 4 * Mp * 4        (hd 128, Mp 64: 105,472)
//                       plus 4,224 bytes of static shared memory (visible-block list)
//   Grids must be exactly these sizes: CTA b maps to (tile or block) = count - 1 - b / heads (resp.
//   / kv_heads), so that the heaviest work (last rows, latest anchors) starts first.
//   Every kernel above 48 KB of dynamic shared memory needs, once per function before its first
//   launch, cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
//   (runtime API: cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
//   set it to the largest size the function will be launched with. The largest need is 176,128
//   bytes (bwd_kv, hd 128, M 128; + 4,224 static), under the H100/H200 limit of 227 KB.
// Preconditions (the Rust launcher checks them and errors before launching):
//   hd in {16, 32, 64, 128}; heads % kv_heads == 0; every tensor pointer 16-byte aligned (rows are
//   moved in 16-byte cp.async chunks); lse/dsum 4-byte aligned.
//   causal: seq_starts ascending, seq_starts[0] == 0, seq_starts[num_seqs] == rows, num_seqs >= 1;
//     K/V rows of a sequence finite (a masked score contributes exactly 0 * v; rows outside the
//     tile's key range are zero-filled, but in a query tile that straddles two sequences the
//     earlier sequence's values are multiplied by 0 for the later sequence's rows).
//   drafter: window >= 0 (0 is a full layer, the Rust side's None; Some(0) is refused there);
//     1 <= block_size, M = block_size * G <= 128; bwd_q also block_size <= 16 (the f32
//     P/dS side buffers of the block keys); for a >= 0: ctx_start[j] >= 0 and
//     ctx_start[j] + a <= ctx_rows (as cpu.rs DraftGeom checks). Violations trap.
//   bwd_kv: for every context row t, [ctx_block_begin[t], ctx_block_end[t]) must contain every
//     block j that sees t (ctx_start[j] <= t < ctx_start[j] + anchors[j]); blocks in the range
//     that do not see t (other sequences' blocks, padded blocks, anchors <= t - ctx_start[j]) are
//     masked by that exact test, so a wider range costs time, never correctness. Visibility per
//     (t, j) is decided by the anchor test alone, as in cpu.rs; the range only bounds the scan.
//
// Work per call (useful, n_j = a_j + bs keys of non-padded block j, L_b = sequence lengths):
//   causal   FLOPs 4*hd*heads*sum_b L_b(L_b+1)/2; bytes >= rows*(2*heads + 2*kv_heads)*hd*2
//            (+ K/V re-reads per 128-row query tile and head, served mostly by L2).
//   draft    FLOPs 4*hd*G*bs*kv_heads*sum_j n_j; bytes >= 2*q_rows*heads*hd*2 + 2*(q_rows +
//            ctx_rows)*kv_heads*hd*2 + 4*q_rows*heads (+ context re-reads, one per block).
//   bwd_prep FLOPs 2*q_rows*heads*hd; bytes 2*q_rows*heads*hd*2 + 4*q_rows*heads.
//   bwd_q    FLOPs 6*hd*G*bs*kv_heads*sum_j n_j + 4*hd*M*bs*kv_heads per block (block keys).
//   bwd_kv   FLOPs 8*hd*G*bs*kv_heads*sum_j a_j; re-reads q/d_o of each block once per 64-row
//            context tile it sees.
//   sliding  (window W) every a_j above becomes min(a_j, W - 1): the tiles start at slot 0's window
//            (masked per slot inside), and bwd_kv skips the blocks whose windows miss its tile.
// Bound: tensor-core compute at these shapes (~0.31 TFLOP per causal layer at 4 x 3072 tokens,
//   32/8 heads, hd 128); with mma.sync and 16-32 rows per warp, shared-memory reads of K/V
//   fragments and the softmax between the two MMAs are what hold it below the tensor peak.
//   Target: >= 40% of the measured dense bf16 peak (~790 TFLOP/s on H200). Measured (H200,
//   standalone harness): causal 4 x 3072, 32/8, hd 128: 1.63 ms = 190 TFLOP/s (24%); drafter
//   4 x 512 blocks x 16, contexts 3072, 32/8, hd 128: fwd 5.5 ms = 151 TFLOP/s, bwd_q 8.3 ms =
//   150, bwd_kv 9.3 ms = 175 (19-22%). The causal forward at head_dim 128 and 256 now runs on
//   warpgroup MMAs by default (attention_wgmma.cu: 244 and 303 TFLOP/s at the bench's shapes);
//   this file's attn_causal_fwd serves the other head dims and DFLASH_ATTN_FORM=mma. So do the
//   drafter forward, bwd_q and bwd_kv at head_dim 128 (attention_wgmma.cu draft_fwd_wg,
//   draft_bwd_q_wg, draft_bwd_kv_wg: block_size <= 16, M <= 64); bwd_prep and attn_draft_kv_ranges
//   serve both forms.
#include <climits>

#include "mma.cuh"

namespace attn {

// Keys per K/V tile of the drafter kernels: a 16 x 64 S tile is 32 f32 registers per thread, and
// 64 x 128 bf16 = 16 KB per stage.
constexpr int KEYS = ATTN_KEYS;
// Causal forward: 4 warps x 2 m-tiles = 128 query rows of one head per CTA, 32-key K/V tiles.
// Two m-tiles per warp reuse every K/V fragment read from shared memory twice (measured on H200 at
// Qwen3-8B shape: 190 TFLOP/s, against 154 with one m-tile and 64-key tiles); 32-key tiles keep
// the 2 x 16 x 128 O accumulators plus S within 255 registers without spills, and 69.6 KB of
// shared memory at hd 128 lets two CTAs share an SM.
constexpr int CAUSAL_WARPS = ATTN_CAUSAL_WARPS;
constexpr int CAUSAL_MT = ATTN_CAUSAL_MT;
constexpr int CAUSAL_KEYS = ATTN_CAUSAL_KEYS;
constexpr int CAUSAL_ROWS = ATTN_CAUSAL_ROWS;
// Drafter forward: one m-tile (16 rows) per warp. Two were slower at M = 64 (101 vs 155 TFLOP/s):
// a CTA of 2 warps leaves too few warps per SM.
constexpr int DRAFT_FWD_MT = 1;
// Drafter query tile limit: block_size * G rows, at most 8 warps.
constexpr int DRAFT_MAX_ROWS = ATTN_DRAFT_MAX_ROWS;
// Drafter backward over context: 64 context rows (keys) per CTA, 4 warps of 16 keys each; the
// query rows of a block are consumed in chunks of 32 (4 n8 tiles of S^T per warp).
constexpr int KV_ROWS = ATTN_KV_ROWS;
constexpr int KV_WARPS = ATTN_KV_WARPS;
constexpr int KV_CHUNK = ATTN_KV_CHUNK;
// Visible-block list capacity of attn_draft_bwd_kv (static shared memory, 4 KB).
constexpr int KV_LIST_CAP = 1024;
// Block keys in the f32 P / dS side buffers of attn_draft_bwd_q: block_size <= 16 (DFLASH.md's
// default; M <= 128 alone would allow 128 with G = 1), checked in the kernel.
constexpr int MAX_BLOCK_KEYS = ATTN_MAX_BLOCK_KEYS;

// ---------------------------------------------------------------------------------------------
// 1. Target causal forward. CTA = (128-row query tile, q head); heaviest tiles (last rows) are
// launched first. Keys of the tile: [ss(first row), last row], in 32-row tiles aligned to
// absolute row multiples of 32, double-buffered with cp.async. Per 16-row m-tile each key tile
// is skipped (no visible element), full (no mask) or masked per element (the diagonal tiles,
// and tiles that a sequence boundary crosses, so a query tile may straddle sequences).

template <int HD>
__device__ __forceinline__ void causal_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                           const bf16* __restrict__ v, bf16* __restrict__ o,
                                           const int* __restrict__ seq_starts, int num_seqs, index_t rows,
                                           int heads, int kv_heads, float scale) {
  constexpr int LD = Geo<HD>::LD;
  // hd 256 (Qwen3.5/3.6 full attention): one m-tile per warp, so the 16 x 256 O accumulators
  // (128 registers) plus S fit in 255 registers; 64 query rows per CTA, 101 KB of shared memory.
  constexpr int MT = HD > 128 ? ATTN_CAUSAL_MT_HD256 : CAUSAL_MT;
  constexpr int BN = CAUSAL_KEYS, BM = HD > 128 ? ATTN_CAUSAL_ROWS_HD256 : CAUSAL_ROWS, WR = MT * WARP_ROWS;
  static_assert(BM == CAUSAL_WARPS * WR, "each warp owns MT m-tiles of the CTA's rows");
  require_launch(CAUSAL_WARPS * 32, (size_t)(BM + 4 * BN) * LD * 2);
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK = sQ + BM * LD;        // [2][BN][LD]
  bf16* sV = sK + 2 * BN * LD;    // [2][BN][LD]

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gr = lane >> 2;
  const index_t ntiles = (rows + BM - 1) / BM;
  const int h = (int)(blockIdx.x % (unsigned)heads);
  const index_t tile = ntiles - 1 - (index_t)(blockIdx.x / (unsigned)heads);
  if (tile < 0) return;
  const int kvh = h / (heads / kv_heads);
  const index_t qw = (index_t)heads * HD, kw = (index_t)kv_heads * HD;
  const index_t q0 = tile * BM;
  const index_t lo = seq_start_of(seq_starts, num_seqs, q0);  // first key any row of the tile sees
  const index_t hi = min(q0 + BM, rows) - 1;                   // last key

  // Per m-tile of this warp: its rows [r0, r1] (clamped to rows), their sequence starts, and per
  // thread row its key range [ss, row]; rows past the end see nothing. All as 32-bit offsets from
  // q0 (a sequence is shorter than 2^31 rows), which saves registers where they are scarcest.
  const index_t rw0 = q0 + warp * WR;
  int mt_r0[MT], mt_r1[MT], mt_ss0[MT], mt_ss1[MT], row_of[MT][2], ss_of[MT][2];
  bool mt_live[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const index_t r0 = rw0 + mt * WARP_ROWS;
    const index_t r1 = min(r0 + WARP_ROWS, rows) - 1;
    mt_live[mt] = r0 < rows;
    mt_r0[mt] = (int)(r0 - q0);
    mt_r1[mt] = (int)(r1 - q0);
    mt_ss0[mt] = mt_live[mt] ? (int)(seq_start_of(seq_starts, num_seqs, r0) - q0) : 0;
    mt_ss1[mt] = mt_live[mt] ? (int)(seq_start_of(seq_starts, num_seqs, r1) - q0) : 0;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const index_t r = r0 + gr + 8 * hh;
      row_of[mt][hh] = (int)(r - q0);
      ss_of[mt][hh] = r < rows ? (int)(seq_start_of(seq_starts, num_seqs, r) - q0) : INT_MAX;
    }
  }

  const bf16* kbase = k + kvh * HD;
  const bf16* vbase = v + kvh * HD;
  auto load_kv = [&](index_t kt, int st) {
    const index_t k0 = kt * BN;
    load_rows<HD>(sK + st * BN * LD, BN, k, [&](int i) -> const bf16* {
      const index_t t = k0 + i;
      return (t >= lo && t <= hi) ? kbase + t * kw : nullptr;
    });
    load_rows<HD>(sV + st * BN * LD, BN, v, [&](int i) -> const bf16* {
      const index_t t = k0 + i;
      return (t >= lo && t <= hi) ? vbase + t * kw : nullptr;
    });
  };

  load_rows<HD>(sQ, BM, q, [&](int i) -> const bf16* {
    const index_t r = q0 + i;
    return r < rows ? q + r * qw + (index_t)h * HD : nullptr;
  });
  const index_t kt_lo = lo / BN, kt_hi = hi / BN;
  load_kv(kt_lo, 0);
  cp_async_commit();

  float acc[MT][HD / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }
  const float sl2 = scale * LOG2E;
  const uint32_t sQw = smem_u32(sQ + warp * WR * LD);

  for (index_t kt = kt_lo; kt <= kt_hi; ++kt) {
    const int st = (int)((kt - kt_lo) & 1);
    if (kt < kt_hi) load_kv(kt + 1, st ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int k0 = (int)(kt * BN - q0), k1 = k0 + BN - 1;  // relative to q0, like the rows
    // An m-tile skips a key tile with no visible element, needs no mask when every element is
    // visible, and is masked per element otherwise (diagonal and sequence-boundary tiles).
    bool any = false, masked[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const bool skip = !mt_live[mt] || k0 > mt_r1[mt] || k1 < mt_ss0[mt];
      any |= !skip;
      masked[mt] = !(k0 >= mt_ss1[mt] && k1 <= mt_r0[mt]);
    }
    if (any) {
      float s[MT][BN / 8][4];
      mma_abt<HD, BN / 8, MT>(s, sQw, smem_u32(sK + st * BN * LD), lane);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        softmax_tile<HD, BN / 8>(s[mt], acc[mt], m[mt], l[mt], sl2, masked[mt], lane, [&](int hh, int col) {
          const int t = k0 + col;
          return t >= ss_of[mt][hh] && t <= row_of[mt][hh];
        });
      }
      mma_pb<HD, BN / 8, MT>(acc, s, smem_u32(sV + st * BN * LD), lane);
    }
    __syncthreads();
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (!mt_live[mt]) continue;
    softmax_finish<HD>(acc[mt], l[mt]);
    // The warp's own Q rows are dead now: stage the bf16 output there for 16-byte stores.
    store_warp_rows<HD>(acc[mt], sQ + (warp * WR + mt * WARP_ROWS) * LD, lane, [&](int i) -> bf16* {
      const index_t r = q0 + mt_r0[mt] + i;
      return r < rows ? o + r * qw + (index_t)h * HD : nullptr;
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Drafter geometry shared by the three block-attention kernels. A CTA of attn_draft_fwd /
// attn_draft_bwd_q owns (block j, kv head g) and its M = G * bs query rows: tile row
// m = hh * bs + r is slot r of q head g*G + hh. Its keys form one virtual sequence
// u in [0, a + bs): u < a is context row ctx_start[j] + u, u >= a is block row j*bs + u - a.

struct DraftCta {
  int G, bs, M, W;
  index_t j;
  int g;

  __device__ __forceinline__ DraftCta(int num_blocks, int block_size, int heads, int kv_heads) {
    G = heads / kv_heads;
    bs = block_size;
    M = bs * G;
    W = (M + WARP_ROWS - 1) / WARP_ROWS;
    g = (int)(blockIdx.x % (unsigned)kv_heads);
    // Later blocks have later anchors, hence more keys: launch them first.
    j = (index_t)num_blocks - 1 - (index_t)(blockIdx.x / (unsigned)kv_heads);
  }
  // Global row and head of tile row m (< M).
  __device__ __forceinline__ index_t q_row(int m) const { return j * bs + m % bs; }
  __device__ __forceinline__ int q_head(int m) const { return g * G + m / bs; }
};

__device__ __forceinline__ void draft_checks(int block_size, int heads, int kv_heads) {
  if (block_size < 1 || kv_heads < 1 || heads % kv_heads != 0 || block_size * (heads / kv_heads) > DRAFT_MAX_ROWS) {
    __trap();
  }
}

// Whether slot r sees key u of the virtual sequence: u < nk, and in a sliding layer
// (window W > 0) a context key u < a needs u >= a + r - (W - 1), a block key (slot u - a) needs
// u - a <= r.
__device__ __forceinline__ bool draft_visible(index_t u, index_t a, index_t nk, int r, int window) {
  if (u >= nk) return false;
  if (window <= 0) return true;
  return u < a ? u >= a + r - (index_t)(window - 1) : u - a <= (index_t)r;
}

// The key tile loader of the virtual sequence (see DraftCta).
template <int HD>
__device__ __forceinline__ void draft_load_kv(bf16* sK, bf16* sV, index_t k0, index_t a, index_t nk, index_t cs,
                                              index_t blk_row0, index_t kw, int g, const bf16* kc, const bf16* vc,
                                              const bf16* kb, const bf16* vb) {
  load_rows<HD>(sK, KEYS, kb, [&](int i) -> const bf16* {
    const index_t u = k0 + i;
    if (u < a) return kc + (cs + u) * kw + (index_t)g * HD;
    if (u < nk) return kb + (blk_row0 + u - a) * kw + (index_t)g * HD;
    return nullptr;
  });
  load_rows<HD>(sV, KEYS, vb, [&](int i) -> const bf16* {
    const index_t u = k0 + i;
    if (u < a) return vc + (cs + u) * kw + (index_t)g * HD;
    if (u < nk) return vb + (blk_row0 + u - a) * kw + (index_t)g * HD;
    return nullptr;
  });
}

// Writes +0.0 to hd bf16 elements at row_ptr(i) for i < n (16-byte stores): padded blocks.
template <int HD, class RowPtr>
__device__ __forceinline__ void zero_rows(int n, RowPtr row_ptr) {
  constexpr int C = Geo<HD>::CHUNKS;
  for (int c = threadIdx.x; c < n * C; c += blockDim.x) {
    *reinterpret_cast<uint4*>(row_ptr(c / C) + (c % C) * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// ---------------------------------------------------------------------------------------------
// 2. Drafter forward.

template <int HD>
__device__ __forceinline__ void draft_fwd(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                          const bf16* __restrict__ vc, const bf16* __restrict__ kb,
                                          const bf16* __restrict__ vb, bf16* __restrict__ o, float* __restrict__ lse,
                                          const int* __restrict__ anchors, const int* __restrict__ ctx_start,
                                          int num_blocks, int block_size, index_t ctx_rows, int heads, int kv_heads,
                                          float scale, int window) {
  (void)ctx_rows;
  constexpr int LD = Geo<HD>::LD;
  constexpr int MT = DRAFT_FWD_MT, WR = MT * WARP_ROWS;
  if (window < 0) __trap();
  draft_checks(block_size, heads, kv_heads);
  DraftCta d(num_blocks, block_size, heads, kv_heads);
  const index_t qw = (index_t)heads * HD, kw = (index_t)kv_heads * HD;
  const int W = (d.M + WR - 1) / WR;
  const int MP = W * WR;
  require_launch(W * 32, (size_t)(MP + 4 * KEYS) * LD * 2);
  if (d.j < 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gr = lane >> 2, tq = lane & 3;

  const index_t a = anchors[d.j];
  if (a < 0) {
    // Padded block: exact zeros, never NaN.
    zero_rows<HD>(d.M, [&](int m) { return o + d.q_row(m) * qw + (index_t)d.q_head(m) * HD; });
    for (int m = threadIdx.x; m < d.M; m += blockDim.x) lse[d.q_row(m) * heads + d.q_head(m)] = 0.f;
    return;
  }
  const index_t cs = ctx_start[d.j];
  const index_t nk = a + d.bs;
  const index_t blk_row0 = d.j * d.bs;
  // A sliding layer's earliest visible key is slot 0's a - (W - 1): the tiles start there.
  const index_t u0 = draft_first_key(a, window);

  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [MP][LD]
  bf16* sK = sQ + MP * LD;                       // [2][KEYS][LD]
  bf16* sV = sK + 2 * KEYS * LD;                 // [2][KEYS][LD]

  load_rows<HD>(sQ, MP, q, [&](int m) -> const bf16* {
    return m < d.M ? q + d.q_row(m) * qw + (index_t)d.q_head(m) * HD : nullptr;
  });
  draft_load_kv<HD>(sK, sV, u0, a, nk, cs, blk_row0, kw, d.g, kc, vc, kb, vb);
  cp_async_commit();

  float acc[MT][HD / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }
  const float sl2 = scale * LOG2E;
  const uint32_t sQw = smem_u32(sQ + warp * WR * LD);
  const index_t nkt = (nk - u0 + KEYS - 1) / KEYS;

  for (index_t kt = 0; kt < nkt; ++kt) {
    const int st = (int)(kt & 1);
    if (kt + 1 < nkt) {
      draft_load_kv<HD>(sK + (st ^ 1) * KEYS * LD, sV + (st ^ 1) * KEYS * LD, u0 + (kt + 1) * KEYS, a, nk, cs,
                        blk_row0, kw, d.g, kc, vc, kb, vb);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const index_t k0 = u0 + kt * KEYS;
    float s[MT][KEYS / 8][4];
    mma_abt<HD, KEYS / 8, MT>(s, sQw, smem_u32(sK + st * KEYS * LD), lane);
    // In a full layer every query row sees the same keys: only the tail of the last tile is
    // masked. A sliding layer masks per slot (window start, causal block) in every tile.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int mrow0 = warp * WR + mt * WARP_ROWS + gr;
      softmax_tile<HD, KEYS / 8>(s[mt], acc[mt], m[mt], l[mt], sl2, window > 0 || k0 + KEYS > nk, lane,
                                 [&](int half, int col) {
                                   return draft_visible(k0 + col, a, nk, (mrow0 + 8 * half) % d.bs, window);
                                 });
    }
    mma_pb<HD, KEYS / 8, MT>(acc, s, smem_u32(sV + st * KEYS * LD), lane);
    __syncthreads();
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int mrow0 = warp * WR + mt * WARP_ROWS;
    if (mrow0 >= d.M) continue;
    softmax_finish<HD>(acc[mt], l[mt]);
    if (tq == 0) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int mr = mrow0 + gr + 8 * hh;
        if (mr < d.M) lse[d.q_row(mr) * heads + d.q_head(mr)] = m[mt][hh] * LN2 + logf(l[mt][hh]);
      }
    }
    store_warp_rows<HD>(acc[mt], sQ + mrow0 * LD, lane, [&](int i) -> bf16* {
      const int mr = mrow0 + i;
      return mr < d.M ? o + d.q_row(mr) * qw + (index_t)d.q_head(mr) * HD : nullptr;
    });
  }
}

// ---------------------------------------------------------------------------------------------
// 3a. dsum = rowsum(d_o * o) per (row, head), f32. TPI = hd/8 threads per (row, head), each one
// 16-byte vector of both tensors, reduced with shuffles; loops are warp-uniform.

template <int HD>
__device__ __forceinline__ void draft_bwd_prep(const bf16* __restrict__ o, const bf16* __restrict__ d_o,
                                               float* __restrict__ dsum, index_t q_rows, int heads) {
  constexpr int TPI = HD / 8;
  constexpr int PER_WARP = 32 / TPI;
  const int lane = threadIdx.x & 31;
  const index_t items = q_rows * heads;
  const index_t warp_id = grid_thread_index() >> 5;
  const index_t warps = grid_thread_count() >> 5;
  for (index_t base = warp_id * PER_WARP; base < items; base += warps * PER_WARP) {
    const index_t it = base + lane / TPI;
    const int sub = lane % TPI;
    float acc = 0.f;
    if (it < items) {
      const uint4 a = *reinterpret_cast<const uint4*>(o + it * HD + sub * 8);
      const uint4 b = *reinterpret_cast<const uint4*>(d_o + it * HD + sub * 8);
      const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        acc = fmaf(bf16x2_lo_to_f32(aw[w]), bf16x2_lo_to_f32(bw[w]), acc);
        acc = fmaf(bf16x2_hi_to_f32(aw[w]), bf16x2_hi_to_f32(bw[w]), acc);
      }
    }
#pragma unroll
    for (int off = 1; off < TPI; off <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (it < items && sub == 0) dsum[it] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// 3b. Drafter backward over queries: CTA = (block j, kv head g), keys as in the forward. Writes
// dq for the M rows and dkb/dvb for the block's bs keys (only this block sees them).

template <int HD>
__device__ __forceinline__ void draft_bwd_q(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                            const bf16* __restrict__ vc, const bf16* __restrict__ kb,
                                            const bf16* __restrict__ vb, const float* __restrict__ lse,
                                            const float* __restrict__ dsum, const bf16* __restrict__ d_o,
                                            bf16* __restrict__ dq, bf16* __restrict__ dkb, bf16* __restrict__ dvb,
                                            const int* __restrict__ anchors, const int* __restrict__ ctx_start,
                                            int num_blocks, int block_size, index_t ctx_rows, int heads,
                                            int kv_heads, float scale, int window) {
  (void)ctx_rows;
  constexpr int LD = Geo<HD>::LD;
  draft_checks(block_size, heads, kv_heads);
  if (block_size > MAX_BLOCK_KEYS || window < 0) __trap();
  DraftCta d(num_blocks, block_size, heads, kv_heads);
  const index_t qw = (index_t)heads * HD, kw = (index_t)kv_heads * HD;
  const int MP = d.W * WARP_ROWS;
  require_launch(d.W * 32, (size_t)(2 * MP + 4 * KEYS) * LD * 2 + (size_t)2 * MP * MAX_BLOCK_KEYS * 4);
  if (d.j < 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gr = lane >> 2, tq = lane & 3;
  const index_t blk_row0 = d.j * d.bs;

  const index_t a = anchors[d.j];
  if (a < 0) {
    zero_rows<HD>(d.M, [&](int m) { return dq + d.q_row(m) * qw + (index_t)d.q_head(m) * HD; });
    zero_rows<HD>(d.bs, [&](int i) { return dkb + (blk_row0 + i) * kw + (index_t)d.g * HD; });
    zero_rows<HD>(d.bs, [&](int i) { return dvb + (blk_row0 + i) * kw + (index_t)d.g * HD; });
    return;
  }
  const index_t cs = ctx_start[d.j];
  const index_t nk = a + d.bs;
  const index_t u0 = draft_first_key(a, window);

  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [MP][LD]
  bf16* sO = sQ + MP * LD;                       // d_o rows [MP][LD]
  bf16* sK = sO + MP * LD;                       // [2][KEYS][LD]
  bf16* sV = sK + 2 * KEYS * LD;                 // [2][KEYS][LD]
  float* sP = reinterpret_cast<float*>(sV + 2 * KEYS * LD);  // [MP][MAX_BLOCK_KEYS] f32 P of block keys
  float* sDS = sP + MP * MAX_BLOCK_KEYS;                     // [MP][MAX_BLOCK_KEYS] f32 dS of block keys

  load_rows<HD>(sQ, MP, q, [&](int mr) -> const bf16* {
    return mr < d.M ? q + d.q_row(mr) * qw + (index_t)d.q_head(mr) * HD : nullptr;
  });
  load_rows<HD>(sO, MP, d_o, [&](int mr) -> const bf16* {
    return mr < d.M ? d_o + d.q_row(mr) * qw + (index_t)d.q_head(mr) * HD : nullptr;
  });
  draft_load_kv<HD>(sK, sV, u0, a, nk, cs, blk_row0, kw, d.g, kc, vc, kb, vb);
  cp_async_commit();

  // Row statistics of this thread's rows; padding rows get lse = +inf (p = 0) and dsum = 0.
  float lse2[2], dsm[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int mr = warp * WARP_ROWS + gr + 8 * hh;
    if (mr < d.M) {
      const index_t idx = d.q_row(mr) * heads + d.q_head(mr);
      lse2[hh] = lse[idx] * LOG2E;
      dsm[hh] = dsum[idx];
    } else {
      lse2[hh] = INFINITY;
      dsm[hh] = 0.f;
    }
  }

  float acc[1][HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) acc[0][n][0] = acc[0][n][1] = acc[0][n][2] = acc[0][n][3] = 0.f;
  const float sl2 = scale * LOG2E;
  const uint32_t sQw = smem_u32(sQ + warp * WARP_ROWS * LD);
  const uint32_t sOw = smem_u32(sO + warp * WARP_ROWS * LD);
  const index_t nkt = (nk - u0 + KEYS - 1) / KEYS;
  constexpr int HALF = KEYS / 2;

  for (index_t kt = 0; kt < nkt; ++kt) {
    const int st = (int)(kt & 1);
    if (kt + 1 < nkt) {
      draft_load_kv<HD>(sK + (st ^ 1) * KEYS * LD, sV + (st ^ 1) * KEYS * LD, u0 + (kt + 1) * KEYS, a, nk, cs,
                        blk_row0, kw, d.g, kc, vc, kb, vb);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    // Two halves of 32 keys: S and dP of a whole 64-key tile plus dq would not fit in registers.
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      const index_t k0 = u0 + kt * KEYS + half * HALF;
      const uint32_t sKh = smem_u32(sK + (st * KEYS + half * HALF) * LD);
      const uint32_t sVh = smem_u32(sV + (st * KEYS + half * HALF) * LD);
      float s[1][HALF / 8][4], dp[1][HALF / 8][4];
      mma_abt<HD, HALF / 8, 1>(s, sQw, sKh, lane);
      mma_abt<HD, HALF / 8, 1>(dp, sOw, sVh, lane);
#pragma unroll
      for (int n = 0; n < HALF / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e >> 1;
          const index_t u = k0 + n * 8 + 2 * tq + (e & 1);
          const int mr = warp * WARP_ROWS + gr + 8 * hh;
          // Full layers skip the slot's modulo: it sat in the inner loop of every layer.
          const bool vis = window > 0 ? draft_visible(u, a, nk, mr % d.bs, window) : u < nk;
          const float p = vis ? exp2_ftz(fmaf(s[0][n][e], sl2, -lse2[hh])) : 0.f;
          const float ds = p * (dp[0][n][e] - dsm[hh]) * scale;
          if (u >= a && u < nk) {
            sP[mr * MAX_BLOCK_KEYS + (int)(u - a)] = p;
            sDS[mr * MAX_BLOCK_KEYS + (int)(u - a)] = ds;
          }
          s[0][n][e] = ds;
        }
      }
      mma_pb<HD, HALF / 8, 1>(acc, s, sKh, lane);
    }
    __syncthreads();
  }

  // dq: staged through this warp's rows of the (now idle) K buffers.
  store_warp_rows<HD>(acc[0], sK + warp * WARP_ROWS * LD, lane, [&](int i) -> bf16* {
    const int mr = warp * WARP_ROWS + i;
    return mr < d.M ? dq + d.q_row(mr) * qw + (index_t)d.q_head(mr) * HD : nullptr;
  });

  // dkb[i] = sum_m dS[m][i] q[m], dvb[i] = sum_m P[m][i] do[m], f32 FMAs in row order m; one
  // thread per (key, 8 columns, which).
  constexpr int C = Geo<HD>::CHUNKS;
  for (int it = threadIdx.x; it < 2 * d.bs * C; it += blockDim.x) {
    const int which = it / (d.bs * C);  // 0: dkb, 1: dvb
    const int rem = it % (d.bs * C);
    const int i = rem / C, ch = rem % C;
    const float* coef = which ? sP : sDS;
    const bf16* src = which ? sO : sQ;
    float r8[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int mr = 0; mr < d.M; ++mr) {
      const float c = coef[mr * MAX_BLOCK_KEYS + i];
      const uint4 x = *reinterpret_cast<const uint4*>(src + mr * LD + ch * 8);
      const uint32_t xw[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        r8[2 * w] = fmaf(c, bf16x2_lo_to_f32(xw[w]), r8[2 * w]);
        r8[2 * w + 1] = fmaf(c, bf16x2_hi_to_f32(xw[w]), r8[2 * w + 1]);
      }
    }
    bf16* dst = (which ? dvb : dkb) + (blk_row0 + i) * kw + (index_t)d.g * HD + ch * 8;
    *reinterpret_cast<uint4*>(dst) = make_uint4(pack_bf16x2_rne(r8[0], r8[1]), pack_bf16x2_rne(r8[2], r8[3]),
                                                pack_bf16x2_rne(r8[4], r8[5]), pack_bf16x2_rne(r8[6], r8[7]));
  }
}

// ---------------------------------------------------------------------------------------------
// 3c. Drafter backward over context keys: CTA = (64 context rows, kv head g), 4 warps of 16
// rows. For each block j that sees any row of the tile, in increasing j, the M query rows of
// (j, g) are staged (double-buffered) and each warp accumulates
// dK += dS^T Q, dV += P^T dO with S^T = K Q^T computed directly (keys as MMA rows), so every
// dkc/dvc element has one owner thread and one fixed summation order.

template <int HD>
__device__ __forceinline__ void draft_bwd_kv(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                             const bf16* __restrict__ vc, const float* __restrict__ lse,
                                             const float* __restrict__ dsum, const bf16* __restrict__ d_o,
                                             bf16* __restrict__ dkc, bf16* __restrict__ dvc,
                                             const int* __restrict__ anchors, const int* __restrict__ ctx_start,
                                             int num_blocks, int block_size, index_t ctx_rows, int heads,
                                             int kv_heads, float scale, const int* __restrict__ ctx_block_begin,
                                             const int* __restrict__ ctx_block_end, int window) {
  constexpr int LD = Geo<HD>::LD;
  draft_checks(block_size, heads, kv_heads);
  if (window < 0) __trap();
  const int G = heads / kv_heads, bs = block_size, M = bs * G;
  const int MP = (M + KV_CHUNK - 1) / KV_CHUNK * KV_CHUNK;
  require_launch(KV_WARPS * 32, (size_t)(2 * KV_ROWS + 4 * MP) * LD * 2 + (size_t)4 * MP * 4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gr = lane >> 2, tq = lane & 3;
  const int g = (int)(blockIdx.x % (unsigned)kv_heads);
  const index_t t0 = (index_t)(blockIdx.x / (unsigned)kv_heads) * KV_ROWS;
  if (t0 >= ctx_rows) return;
  const index_t t_end = min(t0 + KV_ROWS, ctx_rows);
  const index_t qw = (index_t)heads * HD, kw = (index_t)kv_heads * HD;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);  // [KV_ROWS][LD]
  bf16* sV = sK + KV_ROWS * LD;                  // [KV_ROWS][LD]
  bf16* sQ = sV + KV_ROWS * LD;                  // [2][MP][LD]
  bf16* sO = sQ + 2 * MP * LD;                   // [2][MP][LD]
  float* sL = reinterpret_cast<float*>(sO + 2 * MP * LD);  // [2][MP] raw lse
  float* sD = sL + 2 * MP;                                 // [2][MP] dsum
  __shared__ int s_list[KV_LIST_CAP];
  __shared__ int s_red[2][KV_WARPS];  // block-range reduction
  __shared__ int s_cnt[KV_WARPS];     // visible blocks per warp in one compaction round

  // Blocks to scan: the union of the tile rows' ranges.
  {
    int jb = INT_MAX, je = INT_MIN;
    if (threadIdx.x < KV_ROWS && t0 + threadIdx.x < t_end) {
      jb = ctx_block_begin[t0 + threadIdx.x];
      je = ctx_block_end[t0 + threadIdx.x];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      jb = min(jb, __shfl_xor_sync(0xffffffffu, jb, off));
      je = max(je, __shfl_xor_sync(0xffffffffu, je, off));
    }
    if (lane == 0) {
      s_red[0][warp] = jb;
      s_red[1][warp] = je;
    }
  }
  // Padding rows M..MP-1 of both query stages: q = d_o = 0, lse = +inf (p = 0), dsum = 0. Only
  // rows < M are ever loaded, so this holds for the whole kernel; stale shared memory there
  // could hold NaN bit patterns, and 0 * NaN would reach dK.
  for (int i = threadIdx.x; i < 2 * MP; i += blockDim.x) {
    if (i % MP >= M) {
      sL[i] = INFINITY;
      sD[i] = 0.f;
    }
  }
  for (int c = threadIdx.x; c < 2 * MP * Geo<HD>::CHUNKS; c += blockDim.x) {
    const int row = c / Geo<HD>::CHUNKS;
    if (row % MP >= M) {
      const int off = row * LD + (c % Geo<HD>::CHUNKS) * 8;
      *reinterpret_cast<uint4*>(sQ + off) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(sO + off) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  load_rows<HD>(sK, KV_ROWS, kc, [&](int i) -> const bf16* {
    const index_t t = t0 + i;
    return t < t_end ? kc + t * kw + (index_t)g * HD : nullptr;
  });
  load_rows<HD>(sV, KV_ROWS, vc, [&](int i) -> const bf16* {
    const index_t t = t0 + i;
    return t < t_end ? vc + t * kw + (index_t)g * HD : nullptr;
  });
  cp_async_commit();
  __syncthreads();
  int j_lo = INT_MAX, j_hi = INT_MIN;
#pragma unroll
  for (int w = 0; w < KV_WARPS; ++w) {
    j_lo = min(j_lo, s_red[0][w]);
    j_hi = max(j_hi, s_red[1][w]);
  }
  j_lo = max(j_lo, 0);
  j_hi = min(j_hi, num_blocks);

  // This warp's 16 context rows.
  const index_t tw0 = t0 + warp * WARP_ROWS;
  const index_t tw1 = min(tw0 + WARP_ROWS, t_end);  // exclusive; tw1 <= tw0 means no rows
  index_t trow[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) trow[hh] = tw0 + gr + 8 * hh;

  float dk[1][HD / 8][4], dv[1][HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[0][n][e] = dv[0][n][e] = 0.f;
  }
  const float sl2 = scale * LOG2E;
  const uint32_t sKw = smem_u32(sK + warp * WARP_ROWS * LD);
  const uint32_t sVw = smem_u32(sV + warp * WARP_ROWS * LD);

  auto load_block = [&](int jj, int st) {
    const index_t row0 = (index_t)jj * bs;
    load_rows<HD>(sQ + st * MP * LD, M, q, [&](int mr) -> const bf16* {
      return q + (row0 + mr % bs) * qw + (index_t)(g * G + mr / bs) * HD;
    });
    load_rows<HD>(sO + st * MP * LD, M, d_o, [&](int mr) -> const bf16* {
      return d_o + (row0 + mr % bs) * qw + (index_t)(g * G + mr / bs) * HD;
    });
    for (int mr = threadIdx.x; mr < M; mr += blockDim.x) {
      const index_t idx = (row0 + mr % bs) * heads + g * G + mr / bs;
      cp_async_4(smem_u32(sL + st * MP + mr), lse + idx);
      cp_async_4(smem_u32(sD + st * MP + mr), dsum + idx);
    }
  };
  // Rows [cs + first, cs + a) of the context see block j (first = 0 in a full layer, slot 0's
  // window start in a sliding one); padded blocks see nothing.
  auto tile_sees = [&](int jj) -> bool {
    const index_t aa = anchors[jj];
    if (aa < 0) return false;
    const index_t c0 = ctx_start[jj];
    return c0 + draft_first_key(aa, window) < t_end && c0 + aa > t0;
  };

  int st = 0;
  int cursor = j_lo;
  while (cursor < j_hi) {
    // Compact the visible blocks of [cursor, ...) into s_list, in increasing j.
    int n = 0;
    while (cursor < j_hi && n + (int)blockDim.x <= KV_LIST_CAP) {
      const int jj = cursor + (int)threadIdx.x;
      const bool vis = jj < j_hi && tile_sees(jj);
      const unsigned ballot = __ballot_sync(0xffffffffu, vis);
      if (lane == 0) s_cnt[warp] = __popc(ballot);
      __syncthreads();
      int before = 0, total = 0;
#pragma unroll
      for (int w = 0; w < KV_WARPS; ++w) {
        const int c = s_cnt[w];
        before += w < warp ? c : 0;
        total += c;
      }
      if (vis) s_list[n + before + __popc(ballot & ((1u << lane) - 1u))] = jj;
      n += total;
      cursor += (int)blockDim.x;
      __syncthreads();
    }
    if (n == 0) continue;

    load_block(s_list[0], st);
    cp_async_commit();
    for (int li = 0; li < n; ++li) {
      const int jj = s_list[li];
      if (li + 1 < n) load_block(s_list[li + 1], st ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
      const index_t cs = ctx_start[jj];
      const index_t ce = cs + anchors[jj];  // rows [cs, ce) see block jj (a full layer)
      if (tw0 < tw1 && cs + draft_first_key(anchors[jj], window) < tw1 && ce > tw0) {
        bool vis[2];
        // Sliding layer: context row t is seen by the slots r <= (t - cs) - a + (W - 1).
        index_t last_slot[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          vis[hh] = trow[hh] < t_end && trow[hh] >= cs && trow[hh] < ce;
          last_slot[hh] = window > 0 ? trow[hh] - ce + (index_t)(window - 1) : (index_t)INT_MAX;
        }
        const bf16* sQs = sQ + st * MP * LD;
        const bf16* sOs = sO + st * MP * LD;
        const float* sLs = sL + st * MP;
        const float* sDs = sD + st * MP;
        for (int c0 = 0; c0 < MP; c0 += KV_CHUNK) {
          float s[1][KV_CHUNK / 8][4], dp[1][KV_CHUNK / 8][4];
          mma_abt<HD, KV_CHUNK / 8, 1>(s, sKw, smem_u32(sQs + c0 * LD), lane);
          mma_abt<HD, KV_CHUNK / 8, 1>(dp, sVw, smem_u32(sOs + c0 * LD), lane);
#pragma unroll
          for (int nn = 0; nn < KV_CHUNK / 8; ++nn) {
            const int col = c0 + nn * 8 + 2 * tq;
            const float2 l2 = *reinterpret_cast<const float2*>(sLs + col);
            const float2 d2 = *reinterpret_cast<const float2*>(sDs + col);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float lv = (e & 1) ? l2.y : l2.x;
              const float dv_ = (e & 1) ? d2.y : d2.x;
              const bool seen =
                  vis[e >> 1] && (window <= 0 || (index_t)((col + (e & 1)) % bs) <= last_slot[e >> 1]);
              const float p = seen ? exp2_ftz(fmaf(s[0][nn][e], sl2, -lv * LOG2E)) : 0.f;
              s[0][nn][e] = p;
              dp[0][nn][e] = p * (dp[0][nn][e] - dv_) * scale;
            }
          }
          mma_pb<HD, KV_CHUNK / 8, 1>(dv, s, smem_u32(sOs + c0 * LD), lane);
          mma_pb<HD, KV_CHUNK / 8, 1>(dk, dp, smem_u32(sQs + c0 * LD), lane);
        }
      }
      __syncthreads();
      st ^= 1;
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if (tw0 >= tw1) return;
  store_warp_rows<HD>(dk[0], sK + warp * WARP_ROWS * LD, lane, [&](int i) -> bf16* {
    const index_t t = tw0 + i;
    return t < t_end ? dkc + t * kw + (index_t)g * HD : nullptr;
  });
  store_warp_rows<HD>(dv[0], sV + warp * WARP_ROWS * LD, lane, [&](int i) -> bf16* {
    const index_t t = tw0 + i;
    return t < t_end ? dvc + t * kw + (index_t)g * HD : nullptr;
  });
}

}  // namespace attn

// ---------------------------------------------------------------------------------------------
// Exported symbols: one per kernel and head dim.

#define ATTN_EXPORT(D)                                                                                           \
  extern "C" __global__ void __launch_bounds__(attn::CAUSAL_WARPS * 32, 2) attn_causal_fwd_bf16_hd##D(          \
      const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* o,                \
      const int* seq_starts, int num_seqs, long long rows, int heads, int kv_heads, float scale) {               \
    attn::causal_fwd<D>(q, k, v, o, seq_starts, num_seqs, rows, heads, kv_heads, scale);                       \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(256, 1) attn_draft_fwd_bf16_hd##D(                                  \
      const __nv_bfloat16* q, const __nv_bfloat16* kc, const __nv_bfloat16* vc, const __nv_bfloat16* kb,       \
      const __nv_bfloat16* vb, __nv_bfloat16* o, float* lse, const int* anchors, const int* ctx_start,         \
      int num_blocks, int block_size, long long ctx_rows, int heads, int kv_heads, float scale, int window) {   \
    attn::draft_fwd<D>(q, kc, vc, kb, vb, o, lse, anchors, ctx_start, num_blocks, block_size, ctx_rows, heads, \
                       kv_heads, scale, window);                                                                 \
  }                                                                                                              \
  extern "C" __global__ void attn_draft_bwd_prep_bf16_hd##D(const __nv_bfloat16* o, const __nv_bfloat16* d_o,  \
                                                            float* dsum, long long q_rows, int heads) {          \
    attn::draft_bwd_prep<D>(o, d_o, dsum, q_rows, heads);                                                        \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(256, 1) attn_draft_bwd_q_bf16_hd##D(                                \
      const __nv_bfloat16* q, const __nv_bfloat16* kc, const __nv_bfloat16* vc, const __nv_bfloat16* kb,       \
      const __nv_bfloat16* vb, const float* lse, const float* dsum, const __nv_bfloat16* d_o,                  \
      __nv_bfloat16* dq, __nv_bfloat16* dkb, __nv_bfloat16* dvb, const int* anchors, const int* ctx_start,     \
      int num_blocks, int block_size, long long ctx_rows, int heads, int kv_heads, float scale, int window) {   \
    attn::draft_bwd_q<D>(q, kc, vc, kb, vb, lse, dsum, d_o, dq, dkb, dvb, anchors, ctx_start, num_blocks,      \
                         block_size, ctx_rows, heads, kv_heads, scale, window);                                  \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(attn::KV_WARPS * 32, 2) attn_draft_bwd_kv_bf16_hd##D(            \
      const __nv_bfloat16* q, const __nv_bfloat16* kc, const __nv_bfloat16* vc, const float* lse,              \
      const float* dsum, const __nv_bfloat16* d_o, __nv_bfloat16* dkc, __nv_bfloat16* dvc, const int* anchors, \
      const int* ctx_start, int num_blocks, int block_size, long long ctx_rows, int heads, int kv_heads,        \
      float scale, const int* ctx_block_begin, const int* ctx_block_end, int window) {                           \
    attn::draft_bwd_kv<D>(q, kc, vc, lse, dsum, d_o, dkc, dvc, anchors, ctx_start, num_blocks, block_size,     \
                          ctx_rows, heads, kv_heads, scale, ctx_block_begin, ctx_block_end, window);             \
  }

ATTN_EXPORT(16)
ATTN_EXPORT(32)
ATTN_EXPORT(64)
ATTN_EXPORT(128)

// The causal forward alone at head dims the drafter does not use (Qwen3.5/3.6: 256). Launch as
// above with ATTN_CAUSAL_ROWS_HD256 query rows per CTA: grid ceil(rows / 64) * heads, block 128,
// smem (64 + 4*32) * LD * 2 bytes (hd 256: 101,376).
#define ATTN_CAUSAL_EXPORT(D)                                                                                    \
  extern "C" __global__ void __launch_bounds__(attn::CAUSAL_WARPS * 32, 2) attn_causal_fwd_bf16_hd##D(          \
      const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* o,                \
      const int* seq_starts, int num_seqs, long long rows, int heads, int kv_heads, float scale) {               \
    attn::causal_fwd<D>(q, k, v, o, seq_starts, num_seqs, rows, heads, kv_heads, scale);                       \
  }

ATTN_CAUSAL_EXPORT(256)

// attn_draft_kv_ranges: for every context row t, the range [begin, end) of blocks that may see it
// (the input of attn_draft_bwd_kv), computed on the device so the backward never waits for the
// host. Blocks are laid out sequence by sequence, so ctx_start is non-decreasing:
//   end   = #{ j : ctx_start[j] <= t }                  (upper bound)
//   begin = #{ j : ctx_start[j] <  ctx_start[end - 1] }  (first block of that sequence), 0 if end == 0.
// Rows past the last block of their sequence get that sequence's blocks; the bwd_kv kernel still
// checks each block's anchor, so those rows receive exact zeros.
// Launch: any 1-D grid and block (grid-stride over ctx_rows); ceil(ctx_rows / 256) x 256.
extern "C" __global__ void attn_draft_kv_ranges(const int* __restrict__ ctx_start, int num_blocks,
                                                long long ctx_rows, int* __restrict__ ctx_block_begin,
                                                int* __restrict__ ctx_block_end) {
  for (index_t t = grid_thread_index(); t < ctx_rows; t += grid_thread_count()) {
    int lo = 0, hi = num_blocks;  // upper bound of t
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if ((index_t)ctx_start[mid] <= t) lo = mid + 1; else hi = mid;
    }
    const int end = lo;
    int begin = 0;
    if (end > 0) {
      const int st = ctx_start[end - 1];
      int a = 0, b = end - 1;  // lower bound of st
      while (a < b) {
        const int mid = (a + b) >> 1;
        if (ctx_start[mid] < st) a = mid + 1; else b = mid;
      }
      begin = a;
    }
    ctx_block_begin[t] = begin;
    ctx_block_end[t] = end;
  }
}
