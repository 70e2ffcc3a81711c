// attention_wgmma.cu: the target's causal GQA prefill attention on Hopper's warpgroup MMA
// (wgmma.mma_async, sm_90a), head_dim 128 (Qwen3) and 256 (Qwen3.5/3.6 full attention); below it
// (sections 2 to 4) the drafter's forward and backward at head_dim 128, and (section 5) the same
// causal forward warp-specialised: a producer warpgroup and an mbarrier ring instead of the
// per-tile CTA barrier described below (the default causal kernel; this section's stays as the
// baseline the bench and tests compare it with); sections 6 to 8 do the same for the drafter's
// forward and its backward (the defaults; sections 2 to 4 stay as their baselines).
// Same math, layouts, numerics and preconditions as attn_causal_fwd in attention.cu (its header
// states them); CPU reference: src/backend/cpu.rs attn_causal_fwd.
//
// CTA = (128-row query tile, q head), two warpgroups of 64 rows, heaviest tiles (last rows)
// launched first: CTA b takes tile ntiles - 1 - b / heads, head b % heads. Keys of the tile:
// [ss(first row), last row] in KEYS-row tiles aligned to absolute multiples of KEYS.
// Per key tile t and warpgroup:
//   S_t = Q K_t^T      HD/16 wgmma m64nKEYSk16, Q and K from swizzled shared memory (K-major)
//   online softmax     in registers (mma.cuh softmax_p: the wgmma accumulator of each warp's 16
//                      rows is the m16n8 C fragment), masked per element on diagonal tiles and
//                      tiles a sequence boundary crosses; P rounded to bf16 (as attention.cu)
//   O += P_t V_t       KEYS/16 wgmma m64nHDk16, P from registers, V N-major (transposed read),
//                      issued together with S_{t+1}, so that the softmax of S_{t+1} overlaps it
// K/V move by cp.async: all 256 threads issue tile t + 1's copies right after issuing tile t's
// MMAs; one CTA barrier per tile (after it, the tile has landed and the stages tile t + 1 reuses
// are free: K_{t-1} in ATTN_WG_K_STAGES = 2 stages, V_{t-2} in ATTN_WG_V_STAGES = 3).
// The output is staged through the warpgroup's own (dead) Q rows for 16-byte stores.
//
// Launch: grid ceil(rows / ATTN_WG_ROWS) * heads (exactly), block ATTN_WG_THREADS,
//   dynamic smem (ATTN_WG_ROWS + (ATTN_WG_K_STAGES + ATTN_WG_V_STAGES) * KEYS) * HD * 2 +
//   ATTN_WG_ALIGN bytes (KEYS = ATTN_WG_KEYS_HD128 / _HD256; 197,632 / 230,400), which needs the
//   CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES opt-in. A mismatch traps at entry.
// Registers (ptxas, no spills): 248 at hd 128 (O 64 f32, S 64, P 32 packed), 240 at hd 256
//   (O 128, S 32, P 16).
// Bound: tensor-core compute (4 * hd * heads * sum L(L+1)/2 FLOPs, ~0.31 TFLOP per layer at
//   4 x 3072 tokens, 32/8 heads, hd 128). Each warpgroup overlaps its softmax with its own O += P V;
//   the two warpgroups still meet at the per-tile barrier (the copies are everyone's work), so
//   the tensor cores idle through the copy issue and the barrier wait. Section 5 takes the next
//   steps: a producer warpgroup loading by TMA into an mbarrier ring (the warpgroups never meet at
//   a CTA barrier) and consumer ping-pong. Still open there: persistent CTAs.
#include <climits>

#include "tma.cuh"
#include "wgmma.cuh"

namespace attn {

template <int HD>
struct WgGeo {
  static constexpr int BM = ATTN_WG_ROWS;
  static constexpr int BN = HD > 128 ? ATTN_WG_KEYS_HD256 : ATTN_WG_KEYS_HD128;
  static constexpr int KS = ATTN_WG_K_STAGES, VS = ATTN_WG_V_STAGES;
  static constexpr uint32_t Q_BYTES = BM * HD * 2;
  static constexpr uint32_t KV_BYTES = BN * HD * 2;  // one K or one V tile
  static constexpr uint32_t SMEM = Q_BYTES + (KS + VS) * KV_BYTES + ATTN_WG_ALIGN;
  static_assert(HD == 128 || HD == 256, "the wgmma causal forward takes head_dim 128 or 256");
  static_assert(BM % 8 == 0 && BN % 16 == 0, "swizzle atoms are 8 rows, k steps 16 keys");
};

// Copies R rows of HD bf16 into an R-row swizzled tile with 16-byte cp.async (all threads of the
// CTA); src(i) is row i's global address or nullptr for a zero row. Consecutive threads take
// consecutive chunks of a row: coalesced global reads, and the 8 chunks of one row land in 8
// different bank groups.
template <int HD, int R, class Src>
__device__ __forceinline__ void wg_load_rows(uint32_t tile, const bf16* any_mapped, Src src) {
  constexpr int C = HD / 8;
  static_assert((R * C) % ATTN_WG_THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int c = threadIdx.x; c < R * C; c += ATTN_WG_THREADS) {
    const int i = c / C, ch = c % C;
    const bf16* p = src(i);
    cp_async_16(tile + sw128_chunk<R>(i, ch), p ? p + ch * 8 : any_mapped, p != nullptr);
  }
}

// The wgmma batches every kernel of this file issues per key tile, each committed as one group:
//   wg_issue_s   S = Q K^T: HD/16 m64nBNk16 steps, Q (a BM-row tile) and K (the stage at dk) from
//                swizzled shared memory, HD/64 panels of 128-byte rows each;
//   wg_issue_pv  O += P V: BN/16 m64nHDk16 steps, P from registers (wg_pack_p), V N-major (the stage
//                at dv);
//   wg_pack_p    P (the softmax's f32 tile) rounded to the bf16 A fragments of wg_issue_pv.
template <int HD, int BM, int BN>
__device__ __forceinline__ void wg_issue_s(float (&s)[BN / 8][4], uint64_t dq, uint64_t dk) {
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    const uint32_t off = (uint32_t)((kk & 3) * 32);
    wg_abt<BN>(s, wg_desc_at(dq, (uint32_t)((kk >> 2) * BM * 128) + off),
               wg_desc_at(dk, (uint32_t)((kk >> 2) * BN * 128) + off), kk > 0);
  }
  wgmma_commit();
}
template <int HD, int BN>
__device__ __forceinline__ void wg_issue_pv(float (&acc)[HD / 8][4], const uint32_t (&pa)[BN / 16][4], uint64_t dv) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) wg_pb<HD>(acc, pa[kk], wg_desc_at(dv, (uint32_t)(kk * 16 * 128)), 1);
  wgmma_commit();
}
template <int BN>
__device__ __forceinline__ void wg_pack_p(uint32_t (&pa)[BN / 16][4], const float (&s)[BN / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    pa[kk][0] = pack_op(s[2 * kk][0], s[2 * kk][1]);
    pa[kk][1] = pack_op(s[2 * kk][2], s[2 * kk][3]);
    pa[kk][2] = pack_op(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[kk][3] = pack_op(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

template <int HD>
__device__ __forceinline__ void causal_fwd_wg(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                              const bf16* __restrict__ v, bf16* __restrict__ o,
                                              const int* __restrict__ seq_starts, int num_seqs, index_t rows,
                                              int heads, int kv_heads, float scale) {
  using G = WgGeo<HD>;
  constexpr int BM = G::BM, BN = G::BN, KS = G::KS, VS = G::VS;
  require_launch(ATTN_WG_THREADS, G::SMEM);
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + (ATTN_WG_ALIGN - 1)) & ~(uint32_t)(ATTN_WG_ALIGN - 1);
  unsigned char* const base_ptr = smem_raw + (base - smem_u32(smem_raw));
  const uint32_t sQ = base;
  auto sK = [&](int st) { return base + G::Q_BYTES + (uint32_t)st * G::KV_BYTES; };
  auto sV = [&](int st) { return base + G::Q_BYTES + (uint32_t)(KS + st) * G::KV_BYTES; };

  const int lane = threadIdx.x & 31, wg = warpgroup_index(), wi = (threadIdx.x >> 5) & 3;
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

  // This warpgroup's rows [r0, r1a - q0] and their sequence starts, and this thread's two rows
  // (gr and gr + 8 of its warp's 16), all relative to q0.
  const index_t r0a = q0 + wg * 64;
  const bool live = r0a < rows;
  const index_t r1a = min(r0a + 64, rows) - 1;
  const int r0 = (int)(r0a - q0);
  const int ss0 = live ? (int)(seq_start_of(seq_starts, num_seqs, r0a) - q0) : 0;
  const int ss1 = live ? (int)(seq_start_of(seq_starts, num_seqs, r1a) - q0) : 0;
  int row_of[2], ss_of[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const index_t r = r0a + wi * 16 + gr + 8 * hh;
    row_of[hh] = (int)(r - q0);
    ss_of[hh] = r < rows ? (int)(seq_start_of(seq_starts, num_seqs, r) - q0) : INT_MAX;
  }

  const bf16* kbase = k + kvh * HD;
  const bf16* vbase = v + kvh * HD;
  auto load_kv = [&](index_t kt, int it) {
    const index_t k0 = kt * BN;
    wg_load_rows<HD, BN>(sK(it % KS), k, [&](int i) -> const bf16* {
      const index_t t = k0 + i;
      return (t >= lo && t <= hi) ? kbase + t * kw : nullptr;
    });
    wg_load_rows<HD, BN>(sV(it % VS), v, [&](int i) -> const bf16* {
      const index_t t = k0 + i;
      return (t >= lo && t <= hi) ? vbase + t * kw : nullptr;
    });
  };

  const index_t kt_lo = lo / BN, kt_hi = hi / BN;
  const int n_kt = (int)(kt_hi - kt_lo + 1);
  wg_load_rows<HD, BM>(sQ, q, [&](int i) -> const bf16* {
    const index_t r = q0 + i;
    return r < rows ? q + r * qw + (index_t)h * HD : nullptr;
  });
  load_kv(kt_lo, 0);
  cp_async_commit();

  float acc[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = scale * LOG2E;
  // Q of this warpgroup: rows wg*64.. of every 64-column block; k16 step kk at byte (kk % 4) * 32
  // of block kk / 4.
  const uint32_t sQw = sQ + (uint32_t)(wg * 64 * 128);

  // Software pipeline per warpgroup: in iteration it, S_it = Q K_it^T and O += P_{it-1} V_{it-1}
  // are issued together; the softmax of S_it runs while the tensor cores finish P_{it-1} V_{it-1};
  // then O is rescaled and P_it packed (pa: bf16 pairs, the A operand). No wgmma sits under a
  // branch (ptxas serialises every wgmma of a kernel that has one in a divergent path): a tile with
  // no key visible to a warpgroup's rows is computed fully masked (p = 0, alpha = 1), which costs
  // at most the last tile of the first warpgroup, and the first iteration is peeled.
  float s[BN / 8][4];
  uint32_t pa[BN / 16][4];
  // Waits for tile it's copies; after the barrier every warpgroup has also finished S_{it-1}
  // (K stage (it + 1) % KS) and P_{it-2} V_{it-2} (V stage (it + 1) % VS), which tile it + 1
  // reuses.
  auto tile_ready = [&]() {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
  };
  // Descriptors: built once, then moved by constant byte offsets per k step and stage.
  const uint64_t dq = wg_desc(sQw, 16, 1024);
  const uint64_t dk = wg_desc(sK(0), 16, 1024);
  const uint64_t dv = wg_desc(sV(0), BN * 128, 1024);
  auto issue_s = [&](int it) {
    wg_issue_s<HD, BM, BN>(s, dq, wg_desc_at(dk, (uint32_t)(it % KS) * G::KV_BYTES));
  };
  auto issue_pv = [&](int it) {
    wg_issue_pv<HD, BN>(acc, pa, wg_desc_at(dv, (uint32_t)(it % VS) * G::KV_BYTES));
  };
  // Tile it + 1's copies go out while the tensor cores work on tile it.
  auto prefetch = [&](int it) {
    if (it + 1 < n_kt) load_kv(kt_lo + it + 1, it + 1);
    cp_async_commit();
  };
  // Softmax of S_it into P (in s), statistics updated; alpha for O.
  auto softmax = [&](int it, float (&alpha)[2]) {
    const int k0 = (int)((kt_lo + it) * BN - q0), k1 = k0 + BN - 1;  // relative to q0, like the rows
    // Unmasked only when every key of the tile is visible to every row of the warpgroup.
    const bool masked = !live || !(k0 >= ss1 && k1 <= r0);
    softmax_p<BN / 8>(s, m, l, alpha, sl2, masked, lane, [&](int hh, int col) {
      const int t = k0 + col;
      return t >= ss_of[hh] && t <= row_of[hh];
    });
  };
  auto pack_p = [&]() { wg_pack_p<BN>(pa, s); };

  {  // it = 0: S_0 alone.
    float alpha[2];
    tile_ready();
    wgmma_fence();
    issue_s(0);
    prefetch(0);
    wgmma_wait<0>();
    wg_fence_regs(s);
    softmax(0, alpha);
    softmax_rescale<HD>(acc, alpha);
    pack_p();
  }
  for (int it = 1; it < n_kt; ++it) {
    float alpha[2];
    tile_ready();
    wg_fence_regs(acc);
    wgmma_fence();
    issue_s(it);
    issue_pv(it - 1);
    prefetch(it);
    wgmma_wait<1>();  // S_it (groups complete in order; P_{it-1} V_{it-1} may still run)
    wg_fence_regs(s);
    softmax(it, alpha);
    wgmma_wait<0>();
    wg_fence_regs(acc);
    softmax_rescale<HD>(acc, alpha);
    pack_p();
  }
  wg_fence_regs(acc);
  wgmma_fence();
  issue_pv(n_kt - 1);
  wgmma_wait<0>();
  wg_fence_regs(acc);
  cp_async_wait<0>();
  if (!live) return;

  softmax_finish<HD>(acc, l);
  // Stage the bf16 output in this warpgroup's Q rows (read only by its own, finished, wgmmas):
  // each warp writes and then reads back its own 16 rows.
  const int wr = wg * 64 + wi * 16;  // the warp's first row in the tile
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    const int col = n * 8 + 2 * (lane & 3);
    *reinterpret_cast<uint32_t*>(base_ptr + sw128_elem<BM>(wr + gr, col)) = pack_bf16x2_rne(acc[n][0], acc[n][1]);
    *reinterpret_cast<uint32_t*>(base_ptr + sw128_elem<BM>(wr + gr + 8, col)) =
        pack_bf16x2_rne(acc[n][2], acc[n][3]);
  }
  __syncwarp();
  constexpr int C = HD / 8;
  for (int c = lane; c < 16 * C; c += 32) {
    const int i = c / C, ch = c % C;
    const index_t r = q0 + wr + i;
    if (r < rows) {
      *reinterpret_cast<uint4*>(o + r * qw + (index_t)h * HD + ch * 8) =
          *reinterpret_cast<const uint4*>(base_ptr + sw128_chunk<BM>(wr + i, ch));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 2. Drafter forward: attention.cu's draft_fwd (same math, outputs o and lse, padded blocks, full
// and sliding layers), head_dim 128 and M = block_size * G <= 64. CTA = two consecutive blocks
// (2c, 2c + 1) of one kv head g, one warpgroup each: tile row m = hh * bs + r is slot r of q head
// g * G + hh, rows M..63 are padding (zero q, never stored). Pairs are launched heaviest first
// (later blocks have later anchors).
// Keys: the two blocks' context ranges [cs + first, cs + a) (DFLASH.md section 3; first = 0 in a
// full layer, slot 0's window start in a sliding one) are streamed once, as KEYS-row tiles of
// absolute context rows over their union [Tlo, Thi): adjacent blocks of a sequence share almost
// all of it, so the pair reads it from L2 once instead of twice. Only rows one of the two blocks
// sees are read (the rest of a tile is zero-filled). Each warpgroup masks by its own block's range
// (per slot in a sliding layer); a tile outside it is computed fully masked (no wgmma under a
// branch), which a pair that straddles two sequences pays for the gap between them.
// The tiles run through the causal kernel's pipeline (S_t with P_{t-1} V_{t-1}); then each
// warpgroup's own bs block keys (kb, vb rows j * bs ..) form one last 16-key tile, bidirectional
// in a full layer and causal (slot i <= r) in a sliding one. A block with no context key (anchor 0)
// still runs one fully masked context tile.
//
// Launch: grid ceil(num_blocks / 2) * kv_heads (exactly), block ATTN_WG_THREADS, dynamic smem
//   (ATTN_WG_ROWS + (ATTN_WG_K_STAGES + ATTN_WG_V_STAGES) * ATTN_WG_KEYS_HD128 +
//   4 * ATTN_WG_BLOCK_KEYS) * 128 * 2 + ATTN_WG_ALIGN = 214,016 bytes. Preconditions as
//   attention.cu's draft_fwd, plus block_size <= 16 and M <= 64 (the Rust launcher checks both
//   and otherwise runs the mma.sync kernel); violations trap.
// The drafter forward's epilogue (sections 2 and 6), for block j of consumer warpgroup w (rows
// 64 w .. 64 w + 63 of the 128-row Q tile, whose rows it stages the output through): lse and o of
// the block's M rows; a padded block (anchor < 0) writes exact zeros and lse 0, never NaN.
template <int HD>
__device__ __forceinline__ void draft_fwd_store(float (&acc)[HD / 8][4], const float (&m)[2], float (&l)[2],
                                                bool padded, const int (&mrow)[2], int M, int bs, index_t j, int g,
                                                int Gq, int heads, index_t qw, int w, int wi, int gr, int lane,
                                                unsigned char* base_ptr, bf16* __restrict__ o,
                                                float* __restrict__ lse) {
  constexpr int BM = ATTN_WG_ROWS;
  softmax_finish<HD>(acc, l);
  if ((lane & 3) == 0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int mm = mrow[hh];
      if (mm < M) {
        lse[(j * bs + mm % bs) * heads + g * Gq + mm / bs] = padded ? 0.f : m[hh] * LN2 + logf(l[hh]);
      }
    }
  }
  const int wr = w * 64 + wi * 16;
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    const int col = n * 8 + 2 * (lane & 3);
    *reinterpret_cast<uint32_t*>(base_ptr + sw128_elem<BM>(wr + gr, col)) =
        padded ? 0u : pack_bf16x2_rne(acc[n][0], acc[n][1]);
    *reinterpret_cast<uint32_t*>(base_ptr + sw128_elem<BM>(wr + gr + 8, col)) =
        padded ? 0u : pack_bf16x2_rne(acc[n][2], acc[n][3]);
  }
  __syncwarp();
  constexpr int C = HD / 8;
  for (int c = lane; c < 16 * C; c += 32) {
    const int i = c / C, ch = c % C;
    const int mm = wi * 16 + i;
    if (mm < M) {
      *reinterpret_cast<uint4*>(o + (j * bs + mm % bs) * qw + (index_t)(g * Gq + mm / bs) * HD + ch * 8) =
          *reinterpret_cast<const uint4*>(base_ptr + sw128_chunk<BM>(wr + i, ch));
    }
  }
}

template <int HD>
__device__ __forceinline__ void draft_fwd_wg(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                             const bf16* __restrict__ vc, const bf16* __restrict__ kb,
                                             const bf16* __restrict__ vb, bf16* __restrict__ o,
                                             float* __restrict__ lse, const int* __restrict__ anchors,
                                             const int* __restrict__ ctx_start, int num_blocks, int block_size,
                                             index_t ctx_rows, int heads, int kv_heads, float scale, int window) {
  using G = WgGeo<HD>;
  static_assert(HD == 128, "the wgmma drafter forward takes head_dim 128");
  (void)ctx_rows;  // every row read is inside a block's range, which the launcher checked
  constexpr int BM = G::BM, BN = G::BN, KS = G::KS, VS = G::VS, BB = ATTN_WG_BLOCK_KEYS;
  constexpr uint32_t B_BYTES = BB * HD * 2;
  constexpr uint32_t SMEM = G::SMEM + 4 * B_BYTES;
  require_launch(ATTN_WG_THREADS, SMEM);
  if (window < 0 || block_size < 1 || block_size > BB || kv_heads < 1 || heads % kv_heads != 0 ||
      block_size * (heads / kv_heads) > 64) {
    __trap();
  }
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + (ATTN_WG_ALIGN - 1)) & ~(uint32_t)(ATTN_WG_ALIGN - 1);
  unsigned char* const base_ptr = smem_raw + (base - smem_u32(smem_raw));
  const uint32_t sQ = base;
  auto sK = [&](int st) { return base + G::Q_BYTES + (uint32_t)st * G::KV_BYTES; };
  auto sV = [&](int st) { return base + G::Q_BYTES + (uint32_t)(KS + st) * G::KV_BYTES; };
  // Block keys of warpgroup w: K at sB(w, 0), V at sB(w, 1), 16-row swizzled tiles.
  auto sB = [&](int w, int kv) { return base + G::SMEM - ATTN_WG_ALIGN + (uint32_t)(2 * w + kv) * B_BYTES; };

  const int lane = threadIdx.x & 31, wg = warpgroup_index(), wi = (threadIdx.x >> 5) & 3;
  const int gr = lane >> 2;
  const int Gq = heads / kv_heads, bs = block_size, M = bs * Gq;
  const int g = (int)(blockIdx.x % (unsigned)kv_heads);
  const index_t npairs = ((index_t)num_blocks + 1) / 2;
  const index_t pair = npairs - 1 - (index_t)(blockIdx.x / (unsigned)kv_heads);
  if (pair < 0) return;
  const index_t qw = (index_t)heads * HD, kw = (index_t)kv_heads * HD;

  // Both blocks' context ranges [lo, hi) in absolute context rows (empty: lo >= hi), read by every
  // thread so the tile loop is uniform over the CTA.
  index_t lo_w[2], hi_w[2], a_w[2], cs_w[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const index_t jj = 2 * pair + w;
    a_w[w] = jj < num_blocks ? (index_t)anchors[jj] : -1;
    cs_w[w] = a_w[w] >= 0 ? (index_t)ctx_start[jj] : 0;
    lo_w[w] = a_w[w] > 0 ? cs_w[w] + draft_first_key(a_w[w], window) : LLONG_MAX;
    hi_w[w] = a_w[w] > 0 ? cs_w[w] + a_w[w] : LLONG_MIN;
  }
  const index_t Tlo_raw = min(lo_w[0], lo_w[1]), Thi = max(hi_w[0], hi_w[1]);
  const index_t Tlo = Tlo_raw == LLONG_MAX ? 0 : Tlo_raw;
  // At least one tile (fully masked when neither block has context keys): no branch around it.
  const int n_kt = Thi > Tlo ? (int)((Thi - Tlo + BN - 1) / BN) : 1;

  // This warpgroup's block and this thread's two rows: slot, head, and context range relative to
  // Tlo (empty: vlo > vhi).
  const index_t j = 2 * pair + wg;
  // (Selected, not indexed: an index by the warpgroup would put the arrays on the stack.)
  const index_t a = wg ? a_w[1] : a_w[0], cs = wg ? cs_w[1] : cs_w[0];
  int mrow[2], vlo[2], vhi[2];
  bool rvalid[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    mrow[hh] = wi * 16 + gr + 8 * hh;
    rvalid[hh] = a >= 0 && mrow[hh] < M;
    const int r = mrow[hh] % bs;
    if (rvalid[hh] && a > 0) {
      const index_t first = window > 0 ? max((index_t)0, a + r - (index_t)(window - 1)) : (index_t)0;
      vlo[hh] = (int)(cs + first - Tlo);
      vhi[hh] = (int)(cs + a - Tlo) - 1;
    } else {
      vlo[hh] = 1;
      vhi[hh] = 0;
    }
  }
  // Unmasked context tiles: those inside the rows every slot of this block sees, [cs, cs + a) in
  // a full layer and [cs + max(0, a + bs - W), cs + a) in a sliding one (the last slot's window).
  const index_t all_first = window > 0 ? max((index_t)0, a + bs - (index_t)window) : (index_t)0;
  const bool wg_any = a > 0 && all_first < a;
  const int wlo = wg_any ? (int)(cs + all_first - Tlo) : 0, whi = wg_any ? (int)(cs + a - Tlo) - 1 : -1;
  // Rows either block sees, relative to Tlo: only those are read (the gap between two sequences,
  // and rows beyond one block's range, are zero-filled, so no value outside a block's own
  // context, finite or not, reaches its softmax).
  const int r0lo = a_w[0] > 0 ? (int)(lo_w[0] - Tlo) : 1, r0hi = a_w[0] > 0 ? (int)(hi_w[0] - Tlo) : 0;
  const int r1lo = a_w[1] > 0 ? (int)(lo_w[1] - Tlo) : 1, r1hi = a_w[1] > 0 ? (int)(hi_w[1] - Tlo) : 0;

  const bf16* kbase = kc + (index_t)g * HD;
  const bf16* vbase = vc + (index_t)g * HD;
  auto load_kv = [&](int it) {
    auto seen = [&](int i) {
      const int u = it * BN + i;
      return (u >= r0lo && u < r0hi) || (u >= r1lo && u < r1hi);
    };
    wg_load_rows<HD, BN>(sK(it % KS), kc, [&](int i) -> const bf16* {
      return seen(i) ? kbase + (Tlo + it * BN + i) * kw : nullptr;
    });
    wg_load_rows<HD, BN>(sV(it % VS), vc, [&](int i) -> const bf16* {
      return seen(i) ? vbase + (Tlo + it * BN + i) * kw : nullptr;
    });
  };
  // Q: row i of the CTA tile is row i % 64 of warpgroup i / 64's block.
  wg_load_rows<HD, BM>(sQ, q, [&](int i) -> const bf16* {
    const index_t jj = 2 * pair + i / 64;
    const int mm = i % 64;
    return jj < num_blocks && mm < M ? q + (jj * bs + mm % bs) * qw + (index_t)(g * Gq + mm / bs) * HD : nullptr;
  });
  // Both warpgroups' block keys (rows bs..15 zero).
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const index_t jj = 2 * pair + w;
    const bool live = jj < num_blocks && a_w[w] >= 0;
    wg_load_rows<HD, BB>(sB(w, 0), kb, [&](int i) -> const bf16* {
      return live && i < bs ? kb + (jj * bs + i) * kw + (index_t)g * HD : nullptr;
    });
    wg_load_rows<HD, BB>(sB(w, 1), vb, [&](int i) -> const bf16* {
      return live && i < bs ? vb + (jj * bs + i) * kw + (index_t)g * HD : nullptr;
    });
  }
  load_kv(0);
  cp_async_commit();

  float acc[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = scale * LOG2E;
  const uint32_t sQw = sQ + (uint32_t)(wg * 64 * 128);

  float s[BN / 8][4];
  uint32_t pa[BN / 16][4];
  auto tile_ready = [&]() {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
  };
  // Descriptors: built once, then moved by constant byte offsets per k step and stage.
  const uint64_t dq = wg_desc(sQw, 16, 1024);
  const uint64_t dk = wg_desc(sK(0), 16, 1024);
  const uint64_t dv = wg_desc(sV(0), BN * 128, 1024);
  auto issue_s = [&](int it) {
    wg_issue_s<HD, BM, BN>(s, dq, wg_desc_at(dk, (uint32_t)(it % KS) * G::KV_BYTES));
  };
  auto issue_pv = [&](int it) {
    wg_issue_pv<HD, BN>(acc, pa, wg_desc_at(dv, (uint32_t)(it % VS) * G::KV_BYTES));
  };
  auto prefetch = [&](int it) {
    if (it + 1 < n_kt) load_kv(it + 1);
    cp_async_commit();
  };
  auto softmax = [&](int it, float (&alpha)[2]) {
    const int k0 = it * BN, k1 = k0 + BN - 1;  // relative to Tlo
    const bool masked = !(k0 >= wlo && k1 <= whi);
    softmax_p<BN / 8>(s, m, l, alpha, sl2, masked, lane, [&](int hh, int col) {
      const int t = k0 + col;
      return t >= vlo[hh] && t <= vhi[hh];
    });
  };
  auto pack_p = [&]() { wg_pack_p<BN>(pa, s); };

  {  // context tile 0 (with the block keys and Q)
    float alpha[2];
    tile_ready();
    wgmma_fence();
    issue_s(0);
    prefetch(0);
    wgmma_wait<0>();
    wg_fence_regs(s);
    softmax(0, alpha);
    softmax_rescale<HD>(acc, alpha);
    pack_p();
  }
  for (int it = 1; it < n_kt; ++it) {
    float alpha[2];
    tile_ready();
    wg_fence_regs(acc);
    wgmma_fence();
    issue_s(it);
    issue_pv(it - 1);
    prefetch(it);
    wgmma_wait<1>();
    wg_fence_regs(s);
    softmax(it, alpha);
    wgmma_wait<0>();
    wg_fence_regs(acc);
    softmax_rescale<HD>(acc, alpha);
    pack_p();
  }
  {  // the block's own keys, issued with the last context tile's P V
    float sb[BB / 8][4], alpha[2];
    wg_fence_regs(acc);
    wgmma_fence();
    wg_issue_s<HD, BM, BB>(sb, dq, wg_desc(sB(wg, 0), 16, 1024));
    issue_pv(n_kt - 1);
    wgmma_wait<1>();
    wg_fence_regs(sb);
    softmax_p<BB / 8>(sb, m, l, alpha, sl2, true, lane, [&](int hh, int col) {
      return rvalid[hh] && col < bs && (window == 0 || col <= mrow[hh] % bs);
    });
    wgmma_wait<0>();
    wg_fence_regs(acc);
    softmax_rescale<HD>(acc, alpha);
    uint32_t pb[1][4];
    wg_pack_p<BB>(pb, sb);
    wgmma_fence();
    wg_issue_pv<HD, BB>(acc, pb, wg_desc(sB(wg, 1), BB * 128, 1024));
    wgmma_wait<0>();
    wg_fence_regs(acc);
  }
  cp_async_wait<0>();
  if (j >= num_blocks) return;
  draft_fwd_store<HD>(acc, m, l, a < 0, mrow, M, bs, j, g, Gq, heads, qw, wg, wi, gr, lane, base_ptr, o, lse);
}


// ---------------------------------------------------------------------------------------------
// 3. Drafter backward over queries: attention.cu's draft_bwd_q (same math and numerics: dq for the
// M rows of each block, dkb/dvb for its bs block keys, which only that block sees), head_dim 128
// and M = block_size * G <= 64. CTA, pairs and context streaming as draft_fwd_wg above: two
// consecutive blocks (one warpgroup each) of one kv head g, their context ranges streamed once as
// ATTN_WG_BWD_KEYS-row tiles over the union [Tlo, Thi). Per context tile t and warpgroup:
//   S_t = Q K_t^T, dP_t = dO V_t^T   2 x HD/16 wgmma m64n64k16 (Q, dO, K, V K-major in shared memory)
//   dS = P (dP - D) scale            P = exp2(S scale log2(e) - lse log2(e)), D = dsum (the prep
//                                    kernel's rowsum(dO o)); masked keys give dS = 0 exactly (a
//                                    select: never 0 * inf or 0 * NaN)
//   dQ += dS_t K_t                   BN/16 wgmma m64n128k16, dS rounded to bf16 in registers (the A
//                                    operand), K N-major (transposed read, as V in the forward)
// software-pipelined like the forward: S_t and dP_t are issued with dQ += dS_{t-1} K_{t-1}, so the
// dS math of tile t overlaps the tensor cores' dQ product of tile t - 1. K stays two iterations
// (ATTN_WG_BWD_K_STAGES = 3 stages), V one (2 stages); one CTA barrier per tile.
// Then each warpgroup's own block keys form one last 16-key tile (bidirectional in a full layer,
// causal in a sliding one): dQ += dS_b K_b by wgmma; P_b and dS_b (f32) go to shared memory and
// dkb[i] = sum_m dS_b[m][i] q[m], dvb[i] = sum_m P_b[m][i] dO[m] are summed with f32 FMAs in row
// order m (attention.cu's block-key path). dQ is staged through the (dead) K stages for 16-byte
// stores. Padded blocks (anchor < 0) write exact zeros.
//
// Launch: grid ceil(num_blocks / 2) * kv_heads (exactly), block ATTN_WG_THREADS, dynamic smem
//   (2 * ATTN_WG_ROWS + (ATTN_WG_BWD_K_STAGES + ATTN_WG_BWD_V_STAGES) * ATTN_WG_BWD_KEYS +
//   4 * ATTN_WG_BLOCK_KEYS) * 128 * 2 + 4 * 64 * ATTN_WG_BLOCK_KEYS * 4 + ATTN_WG_ALIGN = 181,248
//   bytes. Preconditions as draft_fwd_wg (block_size <= 16, M <= 64); violations trap.
// Registers (ptxas, no spills): 221 (dQ 64 f32, S 32, dP 32, dS 16 packed).
// dS = P (dP - D) scale of one tile for this thread's two rows (the wgmma accumulator layout of
// wgmma_ops.cuh), into s: P = exp2(S scale log2(e) - lse log2(e)); a key vis() rejects gets exactly
// 0 (selected, so an overflowing score outside the row's range cannot leak inf or NaN). Rows with
// lse2 = +inf (padding) get P = 0. vis(hh, col) is asked only when masked.
template <int NN, bool MASKED, class Vis>
__device__ __forceinline__ void ds_tile_impl(float (&s)[NN][4], const float (&dp)[NN][4], float sl2,
                                             const float (&lse2)[2], const float (&dsm)[2], float scale, int lane,
                                             Vis vis) {
  const int tq = lane & 3;
#pragma unroll
  for (int n = 0; n < NN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hh = e >> 1;
      const float p = exp2_ftz(fmaf(s[n][e], sl2, -lse2[hh]));
      const float ds = p * (dp[n][e] - dsm[hh]) * scale;
      s[n][e] = (!MASKED || vis(hh, n * 8 + 2 * tq + (e & 1))) ? ds : 0.f;
    }
  }
}

template <int NN, class Vis>
__device__ __forceinline__ void ds_tile(float (&s)[NN][4], const float (&dp)[NN][4], float sl2, const float (&lse2)[2],
                                        const float (&dsm)[2], float scale, bool masked, int lane, Vis vis) {
  // Two copies of the loop, so that the unmasked tiles (most of them) test nothing per element.
  if (masked) ds_tile_impl<NN, true>(s, dp, sl2, lse2, dsm, scale, lane, vis);
  else ds_tile_impl<NN, false>(s, dp, sl2, lse2, dsm, scale, lane, vis);
}

// The mbarriers of sections 6 and 8 from q_full on (8 bytes each, the k_full .. v_empty lambdas'
// layout): Q full (one arrival, thread 0's), then per K stage full (one arrival) and empty (one per
// consumer warp: 8), then the same per V stage. Thread 0 initialises them; then the CTA's only
// barrier.
__device__ __forceinline__ void ws_draft_init_rings(uint32_t q_full, int ks, int vs) {
  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    for (int st = 0; st < ks; ++st) {
      mbar_init(q_full + 8u * (uint32_t)(1 + st), 1);
      mbar_init(q_full + 8u * (uint32_t)(1 + ks + st), 2 * 4);
    }
    for (int st = 0; st < vs; ++st) {
      mbar_init(q_full + 8u * (uint32_t)(1 + 2 * ks + st), 1);
      mbar_init(q_full + 8u * (uint32_t)(1 + 2 * ks + vs + st), 2 * 4);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the only CTA-wide barrier
}

// The block pair of a warp-specialised drafter CTA (sections 6 and 8; sections 2 and 3 compute the
// same in place): both blocks' anchors a_w (-1: padded or past num_blocks) and context starts cs_w,
// the union [Tlo, Thi) of their context ranges [cs + first, cs + a) streamed as n_kt >= 1 tiles of
// BN rows, and each block's range relative to Tlo, [r0lo, r0hi) and [r1lo, r1hi) (empty: lo >= hi).
template <int BN>
__device__ __forceinline__ void draft_pair_ranges(index_t pair, int num_blocks, const int* __restrict__ anchors,
                                                  const int* __restrict__ ctx_start, int window, index_t (&a_w)[2],
                                                  index_t (&cs_w)[2], index_t& Tlo, int& n_kt, int& r0lo, int& r0hi,
                                                  int& r1lo, int& r1hi) {
  index_t lo_w[2], hi_w[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const index_t jj = 2 * pair + w;
    a_w[w] = jj < num_blocks ? (index_t)anchors[jj] : -1;
    cs_w[w] = a_w[w] >= 0 ? (index_t)ctx_start[jj] : 0;
    lo_w[w] = a_w[w] > 0 ? cs_w[w] + draft_first_key(a_w[w], window) : LLONG_MAX;
    hi_w[w] = a_w[w] > 0 ? cs_w[w] + a_w[w] : LLONG_MIN;
  }
  const index_t Tlo_raw = min(lo_w[0], lo_w[1]), Thi = max(hi_w[0], hi_w[1]);
  Tlo = Tlo_raw == LLONG_MAX ? 0 : Tlo_raw;
  n_kt = Thi > Tlo ? (int)((Thi - Tlo + BN - 1) / BN) : 1;
  r0lo = a_w[0] > 0 ? (int)(lo_w[0] - Tlo) : 1;
  r0hi = a_w[0] > 0 ? (int)(hi_w[0] - Tlo) : 0;
  r1lo = a_w[1] > 0 ? (int)(lo_w[1] - Tlo) : 1;
  r1hi = a_w[1] > 0 ? (int)(hi_w[1] - Tlo) : 0;
}

// What a drafter-backward-over-queries thread knows about its block and its two rows (sections 3
// and 8): block j (= 2 pair + w) with anchor a and context start cs; per row hh the tile row
// mrow, whether it is a real query row, its visible context range [vlo, vhi] relative to Tlo
// (empty: vlo > vhi), lse * log2(e) (+inf on invalid rows: p = 0) and dsum; and [wlo, whi], the
// keys every row of the block sees (a tile inside it is unmasked).
struct DraftBwdQRows {
  index_t j, a, cs;
  int mrow[2], vlo[2], vhi[2], wlo, whi;
  bool rvalid[2];
  float lse2[2], dsm[2];
};

__device__ __forceinline__ DraftBwdQRows draft_bwd_q_rows(int w, index_t pair, const index_t (&a_w)[2],
                                                          const index_t (&cs_w)[2], index_t Tlo, int wi, int gr,
                                                          int bs, int M, int Gq, int g, int heads, int window,
                                                          const float* __restrict__ lse,
                                                          const float* __restrict__ dsum) {
  DraftBwdQRows t;
  t.j = 2 * pair + w;
  t.a = w ? a_w[1] : a_w[0];
  t.cs = w ? cs_w[1] : cs_w[0];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    t.mrow[hh] = wi * 16 + gr + 8 * hh;
    t.rvalid[hh] = t.a >= 0 && t.mrow[hh] < M;
    const int r = t.mrow[hh] % bs;
    if (t.rvalid[hh] && t.a > 0) {
      const index_t first = window > 0 ? max((index_t)0, t.a + r - (index_t)(window - 1)) : (index_t)0;
      t.vlo[hh] = (int)(t.cs + first - Tlo);
      t.vhi[hh] = (int)(t.cs + t.a - Tlo) - 1;
    } else {
      t.vlo[hh] = 1;
      t.vhi[hh] = 0;
    }
    if (t.rvalid[hh]) {
      const index_t idx = (t.j * bs + r) * heads + g * Gq + t.mrow[hh] / bs;
      t.lse2[hh] = lse[idx] * LOG2E;
      t.dsm[hh] = dsum[idx];
    } else {
      t.lse2[hh] = INFINITY;
      t.dsm[hh] = 0.f;
    }
  }
  const index_t all_first = window > 0 ? max((index_t)0, t.a + bs - (index_t)window) : (index_t)0;
  const bool any = t.a > 0 && all_first < t.a;
  t.wlo = any ? (int)(t.cs + all_first - Tlo) : 0;
  t.whi = any ? (int)(t.cs + t.a - Tlo) - 1 : -1;
  return t;
}

// The block-key tile of sections 3 and 8: from S_b and dP_b (this thread's two rows, BB keys), P_b
// and dS_b in f32 into the side buffers fp and fds ([64 rows][BB], every entry written: 0 where
// masked or past M), and dS_b left in sb for dQ += dS_b K_b. Keys: bidirectional in a full layer,
// causal (slot i <= r) in a sliding one.
template <int BB>
__device__ __forceinline__ void draft_bwd_block_tile(float (&sb)[BB / 8][4], const float (&dpb)[BB / 8][4],
                                                     const DraftBwdQRows& t, float sl2, float scale, int bs,
                                                     int window, int lane, float* fp, float* fds) {
#pragma unroll
  for (int n = 0; n < BB / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hh = e >> 1, col = n * 8 + 2 * (lane & 3) + (e & 1);
      const bool vis = t.rvalid[hh] && col < bs && (window == 0 || col <= t.mrow[hh] % bs);
      float p = 0.f, ds = 0.f;
      if (vis) {
        p = exp2_ftz(fmaf(sb[n][e], sl2, -t.lse2[hh]));
        ds = p * (dpb[n][e] - t.dsm[hh]) * scale;
      }
      fp[t.mrow[hh] * BB + col] = p;
      fds[t.mrow[hh] * BB + col] = ds;
      sb[n][e] = ds;
    }
  }
}

// dkb[i] = sum_m dS_b[m][i] q[m] and dvb[i] = sum_m P_b[m][i] dO[m] of block j, f32 FMAs in row
// order m (attention.cu's block-key path), by the 128 threads of the block's warpgroup (tid):
// q and dO are rows 64 w + m of the BM-row swizzled tiles at q_tile / o_tile, P_b and dS_b the
// side buffers. A padded block writes exact zeros.
template <int HD, int BM, int BB>
__device__ __forceinline__ void draft_bwd_block_key_grads(const unsigned char* q_tile, const unsigned char* o_tile,
                                                          const float* fp, const float* fds, int w, int tid,
                                                          int bs, int M, index_t j, int g, index_t kw, bool padded,
                                                          bf16* __restrict__ dkb, bf16* __restrict__ dvb) {
  constexpr int C = HD / 8;
  for (int it = tid; it < 2 * bs * C; it += 128) {
    const int which = it / (bs * C);  // 0: dkb, 1: dvb
    const int rem = it % (bs * C);
    const int i = rem / C, ch = rem % C;
    const float* coef = which ? fp : fds;
    const unsigned char* src = which ? o_tile : q_tile;
    float r8[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int mr = 0; mr < M; ++mr) {
      const float cf = coef[mr * BB + i];
      const uint4 x = *reinterpret_cast<const uint4*>(src + sw128_chunk<BM>(w * 64 + mr, ch));
      const uint32_t xw[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        r8[2 * k] = fmaf(cf, bf16x2_lo_to_f32(xw[k]), r8[2 * k]);
        r8[2 * k + 1] = fmaf(cf, bf16x2_hi_to_f32(xw[k]), r8[2 * k + 1]);
      }
    }
    bf16* dst = (which ? dvb : dkb) + (j * bs + i) * kw + (index_t)g * HD + ch * 8;
    *reinterpret_cast<uint4*>(dst) =
        padded ? make_uint4(0u, 0u, 0u, 0u)
               : make_uint4(pack_bf16x2_rne(r8[0], r8[1]), pack_bf16x2_rne(r8[2], r8[3]),
                            pack_bf16x2_rne(r8[4], r8[5]), pack_bf16x2_rne(r8[6], r8[7]));
  }
}

// dQ of block j (warpgroup w's rows 64 w .. of a BM-row swizzled staging tile, each warp its own
// 16 rows) to dq with 16-byte stores; a padded block writes exact zeros.
template <int HD, int BM>
__device__ __forceinline__ void draft_bwd_q_store(const float (&acc)[HD / 8][4], unsigned char* stage, int w, int wi,
                                                  int gr, int lane, bool padded, int M, int bs, index_t j, int g,
                                                  int Gq, index_t qw, bf16* __restrict__ dq) {
  constexpr int C = HD / 8;
  const int wr = w * 64 + wi * 16;
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    const int col = n * 8 + 2 * (lane & 3);
    *reinterpret_cast<uint32_t*>(stage + sw128_elem<BM>(wr + gr, col)) =
        padded ? 0u : pack_bf16x2_rne(acc[n][0], acc[n][1]);
    *reinterpret_cast<uint32_t*>(stage + sw128_elem<BM>(wr + gr + 8, col)) =
        padded ? 0u : pack_bf16x2_rne(acc[n][2], acc[n][3]);
  }
  __syncwarp();
  for (int c = lane; c < 16 * C; c += 32) {
    const int i = c / C, ch = c % C;
    const int mm = wi * 16 + i;
    if (mm < M) {
      *reinterpret_cast<uint4*>(dq + (j * bs + mm % bs) * qw + (index_t)(g * Gq + mm / bs) * HD + ch * 8) =
          *reinterpret_cast<const uint4*>(stage + sw128_chunk<BM>(wr + i, ch));
    }
  }
}

template <int HD>
__device__ __forceinline__ void draft_bwd_q_wg(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                               const bf16* __restrict__ vc, const bf16* __restrict__ kb,
                                               const bf16* __restrict__ vb, const float* __restrict__ lse,
                                               const float* __restrict__ dsum, const bf16* __restrict__ d_o,
                                               bf16* __restrict__ dq, bf16* __restrict__ dkb, bf16* __restrict__ dvb,
                                               const int* __restrict__ anchors, const int* __restrict__ ctx_start,
                                               int num_blocks, int block_size, index_t ctx_rows, int heads,
                                               int kv_heads, float scale, int window) {
  static_assert(HD == 128, "the wgmma drafter backward takes head_dim 128");
  (void)ctx_rows;  // every row read is inside a block's range, which the launcher checked
  constexpr int BM = ATTN_WG_ROWS, BN = ATTN_WG_BWD_KEYS, KS = ATTN_WG_BWD_K_STAGES, VS = ATTN_WG_BWD_V_STAGES;
  constexpr int BB = ATTN_WG_BLOCK_KEYS;
  static_assert(BM == 128 && BN % 16 == 0 && BB == 16, "tile shapes of the wgmma wrappers");
  constexpr uint32_t Q_BYTES = BM * HD * 2, KV_BYTES = BN * HD * 2, B_BYTES = BB * HD * 2;
  constexpr uint32_t F_OFF = 2 * Q_BYTES + (KS + VS) * KV_BYTES + 4 * B_BYTES;
  constexpr uint32_t F_BYTES = 64 * BB * 4;  // one f32 [64][BB] side buffer
  constexpr uint32_t SMEM = F_OFF + 4 * F_BYTES + ATTN_WG_ALIGN;
  static_assert(KS * KV_BYTES >= Q_BYTES, "dQ is staged in the K stages");
  require_launch(ATTN_WG_THREADS, SMEM);
  if (window < 0 || block_size < 1 || block_size > BB || kv_heads < 1 || heads % kv_heads != 0 ||
      block_size * (heads / kv_heads) > 64) {
    __trap();
  }
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + (ATTN_WG_ALIGN - 1)) & ~(uint32_t)(ATTN_WG_ALIGN - 1);
  unsigned char* const base_ptr = smem_raw + (base - smem_u32(smem_raw));
  const uint32_t sQ = base, sO = base + Q_BYTES;
  auto sK = [&](int st) { return base + 2 * Q_BYTES + (uint32_t)st * KV_BYTES; };
  auto sV = [&](int st) { return base + 2 * Q_BYTES + (uint32_t)(KS + st) * KV_BYTES; };
  // Block keys of warpgroup w: K at sB(w, 0), V at sB(w, 1), 16-row swizzled tiles.
  auto sB = [&](int w, int kv) { return base + 2 * Q_BYTES + (KS + VS) * KV_BYTES + (uint32_t)(2 * w + kv) * B_BYTES; };
  // f32 P (kind 0) and dS (kind 1) of warpgroup w's block keys, [64 rows][BB keys].
  auto fbuf = [&](int w, int kind) { return reinterpret_cast<float*>(base_ptr + F_OFF + (uint32_t)(2 * w + kind) * F_BYTES); };

  const int lane = threadIdx.x & 31, wg = warpgroup_index(), wi = (threadIdx.x >> 5) & 3;
  const int gr = lane >> 2;
  const int Gq = heads / kv_heads, bs = block_size, M = bs * Gq;
  const int g = (int)(blockIdx.x % (unsigned)kv_heads);
  const index_t npairs = ((index_t)num_blocks + 1) / 2;
  const index_t pair = npairs - 1 - (index_t)(blockIdx.x / (unsigned)kv_heads);
  if (pair < 0) return;
  const index_t qw = (index_t)heads * HD, kw = (index_t)kv_heads * HD;

  // Both blocks' context ranges [lo, hi) (as draft_fwd_wg).
  index_t lo_w[2], hi_w[2], a_w[2], cs_w[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const index_t jj = 2 * pair + w;
    a_w[w] = jj < num_blocks ? (index_t)anchors[jj] : -1;
    cs_w[w] = a_w[w] >= 0 ? (index_t)ctx_start[jj] : 0;
    lo_w[w] = a_w[w] > 0 ? cs_w[w] + draft_first_key(a_w[w], window) : LLONG_MAX;
    hi_w[w] = a_w[w] > 0 ? cs_w[w] + a_w[w] : LLONG_MIN;
  }
  const index_t Tlo_raw = min(lo_w[0], lo_w[1]), Thi = max(hi_w[0], hi_w[1]);
  const index_t Tlo = Tlo_raw == LLONG_MAX ? 0 : Tlo_raw;
  const int n_kt = Thi > Tlo ? (int)((Thi - Tlo + BN - 1) / BN) : 1;

  const DraftBwdQRows rows = draft_bwd_q_rows(wg, pair, a_w, cs_w, Tlo, wi, gr, bs, M, Gq, g, heads, window, lse, dsum);
  const index_t j = rows.j, a = rows.a;
  const int r0lo = a_w[0] > 0 ? (int)(lo_w[0] - Tlo) : 1, r0hi = a_w[0] > 0 ? (int)(hi_w[0] - Tlo) : 0;
  const int r1lo = a_w[1] > 0 ? (int)(lo_w[1] - Tlo) : 1, r1hi = a_w[1] > 0 ? (int)(hi_w[1] - Tlo) : 0;

  const bf16* kbase = kc + (index_t)g * HD;
  const bf16* vbase = vc + (index_t)g * HD;
  auto load_kv = [&](int it) {
    auto seen = [&](int i) {
      const int u = it * BN + i;
      return (u >= r0lo && u < r0hi) || (u >= r1lo && u < r1hi);
    };
    wg_load_rows<HD, BN>(sK(it % KS), kc, [&](int i) -> const bf16* {
      return seen(i) ? kbase + (Tlo + it * BN + i) * kw : nullptr;
    });
    wg_load_rows<HD, BN>(sV(it % VS), vc, [&](int i) -> const bf16* {
      return seen(i) ? vbase + (Tlo + it * BN + i) * kw : nullptr;
    });
  };
  // Q and dO: row i of the CTA tile is row i % 64 of warpgroup i / 64's block (zero past M and for
  // padded blocks, so padding rows give S = dP = 0).
  auto q_row = [&](int i, const bf16* t) -> const bf16* {
    const index_t jj = 2 * pair + i / 64;
    const int mm = i % 64;
    const bool live = jj < num_blocks && mm < M && (i < 64 ? a_w[0] : a_w[1]) >= 0;
    return live ? t + (jj * bs + mm % bs) * qw + (index_t)(g * Gq + mm / bs) * HD : nullptr;
  };
  wg_load_rows<HD, BM>(sQ, q, [&](int i) { return q_row(i, q); });
  wg_load_rows<HD, BM>(sO, d_o, [&](int i) { return q_row(i, d_o); });
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const index_t jj = 2 * pair + w;
    const bool live = jj < num_blocks && a_w[w] >= 0;
    wg_load_rows<HD, BB>(sB(w, 0), kb, [&](int i) -> const bf16* {
      return live && i < bs ? kb + (jj * bs + i) * kw + (index_t)g * HD : nullptr;
    });
    wg_load_rows<HD, BB>(sB(w, 1), vb, [&](int i) -> const bf16* {
      return live && i < bs ? vb + (jj * bs + i) * kw + (index_t)g * HD : nullptr;
    });
  }
  load_kv(0);
  cp_async_commit();

  float acc[HD / 8][4];  // dQ
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  const float sl2 = scale * LOG2E;
  float s[BN / 8][4], dp[BN / 8][4];
  uint32_t pa[BN / 16][4];
  auto tile_ready = [&]() {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
  };
  const uint64_t dqd = wg_desc(sQ + (uint32_t)(wg * 64 * 128), 16, 1024);
  const uint64_t dod = wg_desc(sO + (uint32_t)(wg * 64 * 128), 16, 1024);
  const uint64_t dk = wg_desc(sK(0), 16, 1024);          // K-major: S = Q K^T
  const uint64_t dkn = wg_desc(sK(0), BN * 128, 1024);   // N-major: dQ += dS K
  const uint64_t dv = wg_desc(sV(0), 16, 1024);          // K-major: dP = dO V^T
  auto issue_sdp = [&](int it) {
    const uint64_t dks = wg_desc_at(dk, (uint32_t)(it % KS) * KV_BYTES);
    const uint64_t dvs = wg_desc_at(dv, (uint32_t)(it % VS) * KV_BYTES);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t off = (uint32_t)((kk & 3) * 32);
      wg_abt<BN>(s, wg_desc_at(dqd, (uint32_t)((kk >> 2) * BM * 128) + off),
                 wg_desc_at(dks, (uint32_t)((kk >> 2) * BN * 128) + off), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t off = (uint32_t)((kk & 3) * 32);
      wg_abt<BN>(dp, wg_desc_at(dod, (uint32_t)((kk >> 2) * BM * 128) + off),
                 wg_desc_at(dvs, (uint32_t)((kk >> 2) * BN * 128) + off), kk > 0);
    }
    wgmma_commit();
  };
  auto issue_dq = [&](int it) {
    const uint64_t dks = wg_desc_at(dkn, (uint32_t)(it % KS) * KV_BYTES);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wg_pb<HD>(acc, pa[kk], wg_desc_at(dks, (uint32_t)(kk * 16 * 128)), 1);
    wgmma_commit();
  };
  auto prefetch = [&](int it) {
    if (it + 1 < n_kt) load_kv(it + 1);
    cp_async_commit();
  };
  // dS of context tile it into s (f32; 0 where masked).
  auto grad_s = [&](int it) {
    const int k0 = it * BN, k1 = k0 + BN - 1;  // relative to Tlo
    const bool masked = !(k0 >= rows.wlo && k1 <= rows.whi);
    ds_tile<BN / 8>(s, dp, sl2, rows.lse2, rows.dsm, scale, masked, lane, [&](int hh, int col) {
      const int t = k0 + col;
      return t >= rows.vlo[hh] && t <= rows.vhi[hh];
    });
  };
  auto pack_ds = [&]() {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = pack_op(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = pack_op(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = pack_op(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = pack_op(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  };

  {  // context tile 0 (with Q, dO and the block keys)
    tile_ready();
    wgmma_fence();
    issue_sdp(0);
    prefetch(0);
    wgmma_wait<0>();
    wg_fence_regs(s);
    wg_fence_regs(dp);
    grad_s(0);
    pack_ds();
  }
  for (int it = 1; it < n_kt; ++it) {
    tile_ready();
    wg_fence_regs(acc);
    wgmma_fence();
    issue_sdp(it);
    issue_dq(it - 1);
    prefetch(it);
    wgmma_wait<1>();  // S_it and dP_it (dQ += dS_{it-1} K_{it-1} may still run)
    wg_fence_regs(s);
    wg_fence_regs(dp);
    grad_s(it);
    wgmma_wait<0>();
    wg_fence_regs(acc);
    pack_ds();
  }
  {  // the block's own keys, issued with the last context tile's dQ product
    float sb[BB / 8][4], dpb[BB / 8][4];
    wg_fence_regs(acc);
    wgmma_fence();
    const uint64_t dkb_d = wg_desc(sB(wg, 0), 16, 1024);
    const uint64_t dvb_d = wg_desc(sB(wg, 1), 16, 1024);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t off = (uint32_t)((kk & 3) * 32);
      wg_abt<BB>(sb, wg_desc_at(dqd, (uint32_t)((kk >> 2) * BM * 128) + off),
                 wg_desc_at(dkb_d, (uint32_t)((kk >> 2) * BB * 128) + off), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t off = (uint32_t)((kk & 3) * 32);
      wg_abt<BB>(dpb, wg_desc_at(dod, (uint32_t)((kk >> 2) * BM * 128) + off),
                 wg_desc_at(dvb_d, (uint32_t)((kk >> 2) * BB * 128) + off), kk > 0);
    }
    wgmma_commit();
    issue_dq(n_kt - 1);
    wgmma_wait<1>();
    wg_fence_regs(sb);
    wg_fence_regs(dpb);
    // P_b and dS_b in f32, kept in shared memory for dkb / dvb (every one of the 64 x 16 entries
    // is written: 0 where masked or past M).
    draft_bwd_block_tile<BB>(sb, dpb, rows, sl2, scale, bs, window, lane, fbuf(wg, 0), fbuf(wg, 1));
    wgmma_wait<0>();
    wg_fence_regs(acc);
    uint32_t pb[4];
    pb[0] = pack_op(sb[0][0], sb[0][1]);
    pb[1] = pack_op(sb[0][2], sb[0][3]);
    pb[2] = pack_op(sb[1][0], sb[1][1]);
    pb[3] = pack_op(sb[1][2], sb[1][3]);
    wgmma_fence();
    wg_pb<HD>(acc, pb, wg_desc(sB(wg, 0), BB * 128, 1024), 1);
    wgmma_commit();
    wgmma_wait<0>();
    wg_fence_regs(acc);
  }
  cp_async_wait<0>();
  // Every warpgroup's wgmmas are done (the K stages are free for staging dQ) and the f32 side
  // buffers are complete.
  __syncthreads();
  if (j >= num_blocks) return;
  const bool padded = a < 0;  // exact zeros, never NaN

  // dkb / dvb of this warpgroup's block: one thread per (key, 16-byte chunk, which).
  draft_bwd_block_key_grads<HD, BM, BB>(base_ptr, base_ptr + Q_BYTES, fbuf(wg, 0), fbuf(wg, 1), wg, threadIdx.x & 127,
                                        bs, M, j, g, kw, padded, dkb, dvb);
  // dQ, staged in the K stages as a BM-row swizzled tile (each warp its own 16 rows).
  draft_bwd_q_store<HD, BM>(acc, base_ptr + 2 * Q_BYTES, wg, wi, gr, lane, padded, M, bs, j, g, Gq, qw, dq);
}


// ---------------------------------------------------------------------------------------------
// 4. Drafter backward over context keys: attention.cu's draft_bwd_kv (same math and numerics:
// dkc/dvc of every context row, = never +=, one owner thread per element and a fixed summation
// order over blocks in increasing j), head_dim 128 and M <= 64. CTA = (ATTN_WG_BWD_KV_ROWS context
// rows, kv head g), 64 rows (keys) per warpgroup. The blocks that see any row of the CTA's tile
// come from attn_draft_kv_ranges' per-row ranges, compacted into a list in increasing j as in
// draft_bwd_kv; per listed block jj its M query rows are staged (64-row Q and dO tiles, 2 stages,
// rows past M zero with lse = +inf, dsum = 0) and each warpgroup computes, with its keys as the
// wgmma rows:
//   S^T = K Q^T, dP^T = V dO^T   2 x HD/16 wgmma m64n64k16 (all K-major in shared memory)
//   P^T = exp2(S^T scale log2(e) - lse log2(e)), masked by the same per-(key, slot) test as
//   draft_bwd_kv (selected: masked entries are exact zeros)
//   dV += P^T dO                 4 wgmma m64n128k16, P^T from registers (bf16), dO N-major
//   dS^T = P^T (dP^T - D) scale
//   dK += dS^T Q                 4 wgmma m64n128k16, dS^T from registers, Q N-major
// dV's product runs while dS^T is computed. A block the warpgroup's rows do not see is computed
// fully masked (no wgmma under a branch). dK and dV are staged through the warpgroup's own K and V
// rows for 16-byte stores.
//
// Launch: grid ceil(ctx_rows / ATTN_WG_BWD_KV_ROWS) * kv_heads (at least kv_heads), block
//   ATTN_WG_THREADS, dynamic smem (2 * ATTN_WG_BWD_KV_ROWS + 4 * 64) * 128 * 2 + 4 * 64 * 4 +
//   ATTN_WG_ALIGN = 133,120 bytes, plus 4,160 bytes of static shared memory (visible-block list).
//   Preconditions as draft_bwd_kv plus M <= 64; violations trap.
// Registers (ptxas, no spills): 240 (dK and dV 64 f32 each, S^T and dP^T 32 each, P^T and dS^T
//   16 packed each).
// Sections 4 and 7, per visible block and warpgroup (its 64 keys as the wgmma rows, the block's
// QR query rows as columns): P^T = exp2(S^T scale log2(e) - lse log2(e)) in st_ (lq: the block's
// lse per column times lq_scale, i.e. section 4 keeps lse and passes log2(e), section 7 keeps
// lse log2(e) and passes 1), masked per (key row, query column) where `masked` (vis: the thread's two key
// rows see the block; sliding: slot r <= last_slot), selected so masked entries are exact zeros;
// then packed to the bf16 A operand pp of dV += P^T dO.
template <int QR>
__device__ __forceinline__ void kv_p_tile(float (&st_)[QR / 8][4], uint32_t (&pp)[QR / 16][4], const float* lq,
                                          float lq_scale, float sl2, bool masked, const bool (&vis)[2], const index_t (&last_slot)[2],
                                          int window, int bs, int tq) {
#pragma unroll
  for (int nn = 0; nn < QR / 8; ++nn) {
    const int col = nn * 8 + 2 * tq;
    const float2 l2 = *reinterpret_cast<const float2*>(lq + col);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float lv = (e & 1) ? l2.y : l2.x;
      const float p = exp2_ftz(fmaf(st_[nn][e], sl2, -lv * lq_scale));
      bool seen = true;
      if (masked) {
        seen = vis[e >> 1] && (window <= 0 || (index_t)((col + (e & 1)) % bs) <= last_slot[e >> 1]);
      }
      st_[nn][e] = seen ? p : 0.f;
    }
  }
#pragma unroll
  for (int kk = 0; kk < QR / 16; ++kk) {
    pp[kk][0] = pack_op(st_[2 * kk][0], st_[2 * kk][1]);
    pp[kk][1] = pack_op(st_[2 * kk][2], st_[2 * kk][3]);
    pp[kk][2] = pack_op(st_[2 * kk + 1][0], st_[2 * kk + 1][1]);
    pp[kk][3] = pack_op(st_[2 * kk + 1][2], st_[2 * kk + 1][3]);
  }
}

// dS^T = P^T (dP^T - D) scale into dpt (dq_: the block's dsum per column; 0 where P^T is 0 by the
// mask: P is exactly 0 there and dP^T is finite), packed to the A operand ps of dK += dS^T Q.
template <int QR>
__device__ __forceinline__ void kv_ds_tile(float (&dpt)[QR / 8][4], uint32_t (&ps)[QR / 16][4],
                                           const float (&st_)[QR / 8][4], const float* dq_, float scale, int tq) {
#pragma unroll
  for (int nn = 0; nn < QR / 8; ++nn) {
    const int col = nn * 8 + 2 * tq;
    const float2 d2 = *reinterpret_cast<const float2*>(dq_ + col);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float dd = (e & 1) ? d2.y : d2.x;
      dpt[nn][e] = st_[nn][e] * (dpt[nn][e] - dd) * scale;
    }
  }
#pragma unroll
  for (int kk = 0; kk < QR / 16; ++kk) {
    ps[kk][0] = pack_op(dpt[2 * kk][0], dpt[2 * kk][1]);
    ps[kk][1] = pack_op(dpt[2 * kk][2], dpt[2 * kk][3]);
    ps[kk][2] = pack_op(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
    ps[kk][3] = pack_op(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
  }
}

// dK and dV of a warpgroup's 64 context rows (sections 4 and 7), staged in its own rows of the
// KR-row K and V tiles at base_ptr and base_ptr + k_bytes (read only by its own, finished,
// wgmmas): each warp writes and then reads back its 16 rows (tile rows wr .. wr + 15, context rows
// t0 + wr ..), rows at or past t_end are not stored.
template <int HD, int KR>
__device__ __forceinline__ void kv_store(const float (&dk)[HD / 8][4], const float (&dv)[HD / 8][4],
                                         unsigned char* base_ptr, uint32_t k_bytes, int wr, int gr, int tq, int lane,
                                         index_t t0, index_t t_end, index_t kw, int g, bf16* __restrict__ dkc,
                                         bf16* __restrict__ dvc) {
  constexpr int C = HD / 8;
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    unsigned char* const tile = base_ptr + (which ? k_bytes : 0);
    const float(&acc)[HD / 8][4] = which ? dv : dk;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      const int col = n * 8 + 2 * tq;
      *reinterpret_cast<uint32_t*>(tile + sw128_elem<KR>(wr + gr, col)) = pack_bf16x2_rne(acc[n][0], acc[n][1]);
      *reinterpret_cast<uint32_t*>(tile + sw128_elem<KR>(wr + gr + 8, col)) = pack_bf16x2_rne(acc[n][2], acc[n][3]);
    }
    __syncwarp();
    bf16* const out = which ? dvc : dkc;
    for (int c = lane; c < 16 * C; c += 32) {
      const int i = c / C, ch = c % C;
      const index_t t = t0 + wr + i;
      if (t < t_end) {
        *reinterpret_cast<uint4*>(out + t * kw + (index_t)g * HD + ch * 8) =
            *reinterpret_cast<const uint4*>(tile + sw128_chunk<KR>(wr + i, ch));
      }
    }
  }
}

template <int HD>
__device__ __forceinline__ void draft_bwd_kv_wg(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                                const bf16* __restrict__ vc, const float* __restrict__ lse,
                                                const float* __restrict__ dsum, const bf16* __restrict__ d_o,
                                                bf16* __restrict__ dkc, bf16* __restrict__ dvc,
                                                const int* __restrict__ anchors, const int* __restrict__ ctx_start,
                                                int num_blocks, int block_size, index_t ctx_rows, int heads,
                                                int kv_heads, float scale, const int* __restrict__ ctx_block_begin,
                                                const int* __restrict__ ctx_block_end, int window) {
  static_assert(HD == 128, "the wgmma drafter backward takes head_dim 128");
  constexpr int KR = ATTN_WG_BWD_KV_ROWS, QR = 64, WARPS = ATTN_WG_THREADS / 32, CAP = 1024;
  constexpr uint32_t K_BYTES = KR * HD * 2, Q_BYTES = QR * HD * 2;
  constexpr uint32_t L_OFF = 2 * K_BYTES + 4 * Q_BYTES;
  constexpr uint32_t SMEM = L_OFF + 4 * QR * 4 + ATTN_WG_ALIGN;
  require_launch(ATTN_WG_THREADS, SMEM);
  if (window < 0 || block_size < 1 || kv_heads < 1 || heads % kv_heads != 0 ||
      block_size * (heads / kv_heads) > QR) {
    __trap();
  }
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + (ATTN_WG_ALIGN - 1)) & ~(uint32_t)(ATTN_WG_ALIGN - 1);
  unsigned char* const base_ptr = smem_raw + (base - smem_u32(smem_raw));
  const uint32_t sK = base, sV = base + K_BYTES;
  auto sQ = [&](int st) { return base + 2 * K_BYTES + (uint32_t)st * Q_BYTES; };
  auto sO = [&](int st) { return base + 2 * K_BYTES + (uint32_t)(2 + st) * Q_BYTES; };
  auto sL = [&](int st) { return reinterpret_cast<float*>(base_ptr + L_OFF + (uint32_t)st * QR * 4); };
  auto sD = [&](int st) { return reinterpret_cast<float*>(base_ptr + L_OFF + (uint32_t)(2 + st) * QR * 4); };
  __shared__ int s_list[CAP];
  __shared__ int s_red[2][WARPS];
  __shared__ int s_cnt[WARPS];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warpgroup_index(), wi = (threadIdx.x >> 5) & 3;
  const int gr = lane >> 2, tq = lane & 3;
  const int Gq = heads / kv_heads, bs = block_size, M = bs * Gq;
  const int g = (int)(blockIdx.x % (unsigned)kv_heads);
  const index_t t0 = (index_t)(blockIdx.x / (unsigned)kv_heads) * KR;
  if (t0 >= ctx_rows) return;
  const index_t t_end = min(t0 + KR, ctx_rows);
  const index_t qw = (index_t)heads * HD, kw = (index_t)kv_heads * HD;

  // Blocks to scan: the union of the tile rows' ranges.
  {
    int jb = INT_MAX, je = INT_MIN;
    if (threadIdx.x < KR && t0 + threadIdx.x < t_end) {
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
  wg_load_rows<HD, KR>(sK, kc, [&](int i) -> const bf16* {
    const index_t t = t0 + i;
    return t < t_end ? kc + t * kw + (index_t)g * HD : nullptr;
  });
  wg_load_rows<HD, KR>(sV, vc, [&](int i) -> const bf16* {
    const index_t t = t0 + i;
    return t < t_end ? vc + t * kw + (index_t)g * HD : nullptr;
  });
  cp_async_commit();
  __syncthreads();
  int j_lo = INT_MAX, j_hi = INT_MIN;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    j_lo = min(j_lo, s_red[0][w]);
    j_hi = max(j_hi, s_red[1][w]);
  }
  j_lo = max(j_lo, 0);
  j_hi = min(j_hi, num_blocks);

  // This warpgroup's 64 keys [tw0, tw0 + 64) and this thread's two rows.
  const index_t tw0 = t0 + wg * 64;
  index_t trow[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) trow[hh] = tw0 + wi * 16 + gr + 8 * hh;

  float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
  }
  const float sl2 = scale * LOG2E;

  auto load_block = [&](int jj, int st) {
    const index_t row0 = (index_t)jj * bs;
    wg_load_rows<HD, QR>(sQ(st), q, [&](int mr) -> const bf16* {
      return mr < M ? q + (row0 + mr % bs) * qw + (index_t)(g * Gq + mr / bs) * HD : nullptr;
    });
    wg_load_rows<HD, QR>(sO(st), d_o, [&](int mr) -> const bf16* {
      return mr < M ? d_o + (row0 + mr % bs) * qw + (index_t)(g * Gq + mr / bs) * HD : nullptr;
    });
    for (int mr = threadIdx.x; mr < QR; mr += ATTN_WG_THREADS) {
      if (mr < M) {
        const index_t idx = (row0 + mr % bs) * heads + g * Gq + mr / bs;
        cp_async_4(smem_u32(sL(st) + mr), lse + idx);
        cp_async_4(smem_u32(sD(st) + mr), dsum + idx);
      } else {
        sL(st)[mr] = INFINITY;  // p = 0 on padding columns
        sD(st)[mr] = 0.f;
      }
    }
  };
  auto tile_sees = [&](int jj) -> bool {
    const index_t aa = anchors[jj];
    if (aa < 0) return false;
    const index_t c0 = ctx_start[jj];
    return c0 + draft_first_key(aa, window) < t_end && c0 + aa > t0;
  };
  auto tile_ready = [&]() {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
  };

  // Descriptors: K and V of this warpgroup as the A operand (K-major, column blocks KR rows
  // apart); Q and dO stages as K-major B (S^T, dP^T) and as N-major B (dK, dV).
  const uint64_t dka = wg_desc(sK + (uint32_t)(wg * 64 * 128), 16, 1024);
  const uint64_t dva = wg_desc(sV + (uint32_t)(wg * 64 * 128), 16, 1024);
  const uint64_t dqb = wg_desc(sQ(0), 16, 1024), dob = wg_desc(sO(0), 16, 1024);
  const uint64_t dqn = wg_desc(sQ(0), QR * 128, 1024), don = wg_desc(sO(0), QR * 128, 1024);

  float st_[QR / 8][4], dpt[QR / 8][4];
  uint32_t pp[QR / 16][4], ps[QR / 16][4];
  int stage = 0;
  int cursor = j_lo;
  while (cursor < j_hi) {
    // Compact the visible blocks of [cursor, ...) into s_list, in increasing j.
    int n = 0;
    while (cursor < j_hi && n + ATTN_WG_THREADS <= CAP) {
      const int jj = cursor + (int)threadIdx.x;
      const bool vis = jj < j_hi && tile_sees(jj);
      const unsigned ballot = __ballot_sync(0xffffffffu, vis);
      if (lane == 0) s_cnt[warp] = __popc(ballot);
      __syncthreads();
      int before = 0, total = 0;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const int c = s_cnt[w];
        before += w < warp ? c : 0;
        total += c;
      }
      if (vis) s_list[n + before + __popc(ballot & ((1u << lane) - 1u))] = jj;
      n += total;
      cursor += ATTN_WG_THREADS;
      __syncthreads();
    }
    if (n == 0) continue;

    load_block(s_list[0], stage);
    cp_async_commit();
    for (int li = 0; li < n; ++li) {
      const int jj = s_list[li];
      const int st = stage;
      // Block li's rows have landed, and every warpgroup is done with block li - 1 (whose stage
      // the next load reuses).
      tile_ready();
      if (li + 1 < n) load_block(s_list[li + 1], st ^ 1);
      cp_async_commit();
      const index_t aa = anchors[jj];
      const index_t cs = ctx_start[jj];
      const index_t ce = cs + aa;  // rows [cs, ce) see block jj (a full layer)
      bool vis[2];
      index_t last_slot[2];  // sliding: row t is seen by the slots r <= t - ce + (W - 1)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        vis[hh] = trow[hh] < t_end && trow[hh] >= cs && trow[hh] < ce;
        last_slot[hh] = window > 0 ? trow[hh] - ce + (index_t)(window - 1) : (index_t)INT_MAX;
      }
      // Unmasked when all 64 keys of the warpgroup are seen by every slot of the block.
      const index_t all_first = window > 0 ? max((index_t)0, aa + bs - (index_t)window) : (index_t)0;
      const bool masked = !(tw0 >= cs + all_first && tw0 + 63 < ce && tw0 + 63 < t_end);

      wgmma_fence();
      {
        const uint64_t dqs = wg_desc_at(dqb, (uint32_t)st * Q_BYTES);
        const uint64_t dos = wg_desc_at(dob, (uint32_t)st * Q_BYTES);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          const uint32_t off = (uint32_t)((kk & 3) * 32);
          wg_abt<QR>(st_, wg_desc_at(dka, (uint32_t)((kk >> 2) * KR * 128) + off),
                     wg_desc_at(dqs, (uint32_t)((kk >> 2) * QR * 128) + off), kk > 0);
        }
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          const uint32_t off = (uint32_t)((kk & 3) * 32);
          wg_abt<QR>(dpt, wg_desc_at(dva, (uint32_t)((kk >> 2) * KR * 128) + off),
                     wg_desc_at(dos, (uint32_t)((kk >> 2) * QR * 128) + off), kk > 0);
        }
        wgmma_commit();
      }
      wgmma_wait<0>();
      wg_fence_regs(st_);
      wg_fence_regs(dpt);
      const float* lq = sL(st);
      const float* dq_ = sD(st);
      kv_p_tile<QR>(st_, pp, lq, LOG2E, sl2, masked, vis, last_slot, window, bs, tq);
      wg_fence_regs(dv);
      wgmma_fence();
      {
        const uint64_t dos = wg_desc_at(don, (uint32_t)st * Q_BYTES);
#pragma unroll
        for (int kk = 0; kk < QR / 16; ++kk) wg_pb<HD>(dv, pp[kk], wg_desc_at(dos, (uint32_t)(kk * 16 * 128)), 1);
        wgmma_commit();
      }
      kv_ds_tile<QR>(dpt, ps, st_, dq_, scale, tq);
      wg_fence_regs(dk);
      wgmma_fence();
      {
        const uint64_t dqs = wg_desc_at(dqn, (uint32_t)st * Q_BYTES);
#pragma unroll
        for (int kk = 0; kk < QR / 16; ++kk) wg_pb<HD>(dk, ps[kk], wg_desc_at(dqs, (uint32_t)(kk * 16 * 128)), 1);
        wgmma_commit();
      }
      // Both products read this stage and the packed registers: done before the next block.
      wgmma_wait<0>();
      wg_fence_regs(dv);
      wg_fence_regs(dk);
      stage ^= 1;
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  // dK and dV, staged in this warpgroup's own K and V rows.
  kv_store<HD, KR>(dk, dv, base_ptr, K_BYTES, wg * 64 + wi * 16, gr, tq, lane, t0, t_end, kw, g, dkc, dvc);
}

// ---------------------------------------------------------------------------------------------
// 5. Causal forward, warp-specialised (the FlashAttention-3 structure): section 1's math, masking,
// numerics, output layout and preconditions, with the copies taken off the MMA warpgroups and done
// by TMA. attn_causal_fwd_ws_bf16_hd* (the consumers run independently); head_dim 128 and 256.
//
// Output gate (the Qwen3.5 gated attention, QWEN35.md section 3): with gated != 0 each output
// element is o = bf16(bf16(o) / (1 + expf(-gate[(r * heads + h) * gate_stride + c]))), hybrid.cu
// sigmoid_mul_strided_bf16's formula and rounding on this kernel's bf16 output, so the result is
// that pass's bit for bit without its read and write of o. With gated 0, gate is never read.
//
// CTA b = section 1's CTA b: (128-row query tile ntiles - 1 - b / heads, q head b % heads),
// heaviest first, the same key range [lo, hi] and KEYS-row key tiles. A persistent launch (one CTA
// per SM) was built on an earlier, cp.async-fed form of this kernel; racecheck reported
// shared-memory write hazards in it and it was no faster, so it was taken out.
// CTA = 384 threads = 3 warpgroups:
//   warpgroup 0     producer. setmaxnreg.dec to ATTN_WS_PRODUCER_REGS (24). Per key tile t it
//                   fills K stage t % KS with K_t and V stage t % VS with V_t, and Q once after
//                   K_0 (order K_0, Q, V_0, K_1, V_1, ...), each fill after waiting on the stage's
//                   "empty" mbarrier:
//                   - by TMA when the tile starts inside the key range (every tile but a first one
//                     that a sequence start cuts): thread 0 arrives on the stage's "full" mbarrier
//                     with expect-tx of the tile's bytes and issues HD / 64 box loads (64 columns x
//                     KEYS rows each, the 128-byte swizzle of section 1's layout; Q: 128 rows).
//                     Rows past hi are past `rows` (hi is the tile's last query row and KEYS
//                     divides 128), which TMA reads as zero; Q's rows past `rows` likewise.
//                   - by cp.async otherwise: all 128 threads meet at a named barrier (so threads
//                     1..127, which skip the TMA tiles, wait on the empty mbarrier at thread 0's
//                     ring position: parity waits are never more than one phase behind), copy the
//                     rows [lo, hi] of the tile with the rows before lo zero-filled, exactly as
//                     section 1 (so the previous sequence's values reach no product), wait for
//                     their copies, meet again, and thread 0 arrives on "full".
//                   "Full" mbarriers count one arrival (thread 0's) plus, for TMA, the bytes.
//   warpgroups 1, 2 consumers. setmaxnreg.inc to ATTN_WS_CONSUMER_REGS (240). Consumer c owns
//                   rows 64c .. 64c + 63 of the tile and runs section 1's pipeline unchanged
//                   (S_t issued with P_{t-1} V_{t-1}, the softmax of S_t under the latter, P rounded
//                   to bf16, no wgmma under a branch, fully masked tiles computed); only the waits
//                   differ. Before issuing it waits on Q's (first tile), K_t's and V_{t-1}'s full
//                   mbarriers and executes fence.proxy.async (the cp.async fills are generic-proxy
//                   writes; wgmma reads through the async proxy), then waits for its turn: with
//                   ATTN_WS_PINGPONG the two consumers issue their batches alternately (named
//                   barriers 2 and 3; see the consumer code). When wgmma.wait_group shows S_t
//                   complete each warp arrives once on K stage t's empty mbarrier, and when it shows
//                   P_{t-1} V_{t-1} complete on V stage t - 1's (count 8: every consumer warp).
// No CTA-wide barrier after the setup one (mbarrier init): the consumers never wait for the copy
// issue, only for data and (ping-pong) for each other's wgmma issue, never for a softmax.
// Measured (H200, 4 x 3072, 32/8 heads, hd 128): 0.861 ms with 128-thread cp.async fills, 0.691
// with TMA, 0.681 with ping-pong (cuDNN 0.56), 0.644 with the warpgroup index uniform
// (warpgroup_index; cuDNN 0.595 in that run), 0.583-0.586 with softmax_finish's reciprocal in
// place of a division per output element (cuDNN 0.567-0.597 in those calls); 1 x 4096, 24/4,
// hd 256: 0.510, 0.386, 0.388, 0.364, 0.331 (cuDNN 0.38-0.41, 0.378). A persistent form was measured and not kept: one CTA per SM taking units
// from an atomic counter, the rings running on across units, the unit number handed to the
// consumers in a shared-memory word ordered by Q's full/empty mbarriers. It ran 0.631 / 0.372 ms
// against 0.650 / 0.377 for the same code with a CTA per unit (2% faster at hd 128, 2% slower at
// hd 256 than this form), and racecheck flagged that hand-off, so this form keeps one unit per
// CTA. Its stage indices had to restart at 0 each unit to stay on the uniform datapath.
// Phases: a stage of a ring of n is used by tiles s, s + n, ...; use u = t / n. The consumers wait
// on full with parity u & 1; the producer waits on empty with parity (u & 1) ^ 1 (use u - 1's
// release; a fresh mbarrier reports its preceding phase, parity 1, complete, so the first pass
// does not wait). Neither side can get two phases ahead of the other: the producer refills a stage
// only after both consumers released it, and they release it only after waiting for it to be full.
// No deadlock: tile t needs K_t and V_{t-1}; the producer issues V_{t-1} then K_t, which need the
// P V and S of tiles VS and KS back, earlier steps of the consumers (VS >= 2, KS >= 1).
// Buffer reuse: a consumer arrives on an empty mbarrier only after wgmma.wait_group has shown the
// wgmmas that read the stage complete; the producer's refill is ordered after the arrive by the
// mbarrier's release/acquire, so it never overwrites an operand in use. The output is staged
// through the consumer's own Q rows (section 1), which nothing refills.
//
// Launch: grid ceil(rows / ATTN_WG_ROWS) * heads (exactly), block ATTN_WS_THREADS (384), dynamic
//   smem (ATTN_WG_ROWS + (KS + ATTN_WS_V_STAGES) * KEYS) * HD * 2 + ATTN_WS_BAR_BYTES +
//   ATTN_WG_ALIGN bytes, KS = ATTN_WS_K_STAGES_HD128 (3) / _HD256 (2), VS = 3, KEYS as section 1
//   (128 / 64): 230,528 at both head dims (the opt-in maximum is 232,448), one CTA per SM. Layout
//   from the 1024-aligned base (TMA's 128-byte swizzle and wgmma's agree on 1024-aligned tiles):
//   Q, KS K stages, VS V stages, the mbarriers (Q full; K full, K empty, V full, V empty per
//   stage). A block, grid or smem mismatch, or rows >= 2^31 - 128 (the tile geometry is in 32-bit
//   ints; seq_starts are ints anyway), traps at entry; rows = 0 is not launched.
// Registers (ptxas): 168 per thread at launch (the cap of 384 threads: 64,512 of the SM's 65,536);
//   setmaxnreg then gives the producer 24 and each consumer 240 (128 * 24 + 256 * 240 = 64,512, so
//   setmaxnreg.inc never waits on a short pool). The consumers fit 240 without spills; at hd 128
//   the producer's cp.async path spills 8 bytes (once per cut tile), the TMA path none.
template <int HD>
struct WsGeo {
  static constexpr int BM = ATTN_WG_ROWS;
  static constexpr int BN = HD > 128 ? ATTN_WG_KEYS_HD256 : ATTN_WG_KEYS_HD128;
  static constexpr int KS = HD > 128 ? ATTN_WS_K_STAGES_HD256 : ATTN_WS_K_STAGES_HD128, VS = ATTN_WS_V_STAGES;
  static constexpr uint32_t Q_BYTES = BM * HD * 2;
  static constexpr uint32_t KV_BYTES = BN * HD * 2;
  static constexpr uint32_t BAR_OFF = Q_BYTES + (KS + VS) * KV_BYTES;
  static constexpr uint32_t SMEM = BAR_OFF + ATTN_WS_BAR_BYTES + ATTN_WG_ALIGN;
  static_assert(HD == 128 || HD == 256, "the warp-specialised causal forward takes head_dim 128 or 256");
  static_assert((1 + 2 * KS + 2 * VS) * 8 <= ATTN_WS_BAR_BYTES, "the mbarriers fit their slots");
  static_assert(KS >= 1 && VS >= 2, "V_{t-1} and V_t are in flight together");
  static_assert(SMEM <= 232448, "over the opt-in shared memory of a CTA");
};

// One arrival on bar once every cp.async this thread issued before has completed (the expected
// count includes it: .noinc).
__device__ __forceinline__ void ws_cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Named barriers 2 and 3 hand the consumers' turn to issue wgmmas back and forth (ping-pong,
// below): bar.sync waits for the own barrier's 256 arrivals (its own 128 threads and the other
// consumer's 128), bar.arrive adds the other consumer's 128 without waiting.
__device__ __forceinline__ void ws_turn_wait(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void ws_turn_pass(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

template <int N>
__device__ __forceinline__ void ws_setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void ws_setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Copies rows [i_lo, i_hi] of an R-row tile (row i at row0 + i * pitch) into an R-row swizzled
// tile with the 128 threads of the producer warpgroup (t = its thread 0..127), the other rows
// zero-filled; thread t takes chunk t % C of rows t / C, t / C + 128 / C, ... Written for the
// producer's 24 registers: one row per iteration, 32-bit row tests and offsets.
template <int HD, int R>
__device__ __forceinline__ void ws_load_rows(uint32_t tile, const bf16* row0, int pitch, int i_lo, int i_hi,
                                             const bf16* any_mapped, int t) {
  constexpr int C = HD / 8, STEP = 128 / C;
  static_assert(128 % C == 0 && R % STEP == 0, "every producer thread copies the same number of chunks");
  const int ch = t % C;
  int i = t / C;
  int off = i * pitch + ch * 8;  // < R * pitch: heads * head_dim is far below 2^24
#pragma unroll 1
  for (; i < R; i += STEP, off += STEP * pitch) {
    const bool ok = i >= i_lo && i <= i_hi;
    cp_async_16(tile + sw128_chunk<R>(i, ch), ok ? row0 + off : any_mapped, ok);
  }
}

template <int HD>
__device__ __forceinline__ void causal_fwd_ws(const CUtensorMap* map_q, const CUtensorMap* map_k,
                                              const CUtensorMap* map_v, const bf16* __restrict__ k,
                                              const bf16* __restrict__ v, bf16* __restrict__ o,
                                              const bf16* __restrict__ gate, index_t gate_stride, int gated,
                                              const int* __restrict__ seq_starts, int num_seqs, index_t rows,
                                              int heads, int kv_heads, float scale) {
  using G = WsGeo<HD>;
  constexpr int BM = G::BM, BN = G::BN, KS = G::KS, VS = G::VS;
  require_launch(ATTN_WS_THREADS, G::SMEM);
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + (ATTN_WG_ALIGN - 1)) & ~(uint32_t)(ATTN_WG_ALIGN - 1);
  unsigned char* const base_ptr = smem_raw + (base - smem_u32(smem_raw));
  const uint32_t sQ = base;
  auto sK = [&](int st) { return base + G::Q_BYTES + (uint32_t)st * G::KV_BYTES; };
  auto sV = [&](int st) { return base + G::Q_BYTES + (uint32_t)(KS + st) * G::KV_BYTES; };
  const uint32_t q_full = base + G::BAR_OFF;
  auto k_full = [&](int st) { return q_full + 8u * (uint32_t)(1 + st); };
  auto k_empty = [&](int st) { return q_full + 8u * (uint32_t)(1 + KS + st); };
  auto v_full = [&](int st) { return q_full + 8u * (uint32_t)(1 + 2 * KS + st); };
  auto v_empty = [&](int st) { return q_full + 8u * (uint32_t)(1 + 2 * KS + VS + st); };

  const int wg = warpgroup_index();
  const index_t ntiles = (rows + BM - 1) / BM;
  const index_t qw = (index_t)heads * HD;
  // The CTA's unit: query tile ntiles - 1 - b / heads of head b % heads (heaviest first), its key
  // tiles section 1's, in 32-bit ints: rows < 2^31 - BM (checked below; seq_starts are ints, so
  // no longer batch can be described anyway).
  const int h = (int)(blockIdx.x % (unsigned)heads);
  const int q0 = (int)((ntiles - 1 - blockIdx.x / (unsigned)heads) * BM);
  const int lo = (int)seq_start_of(seq_starts, num_seqs, q0);  // first key any row of the tile sees
  const int hi = (int)min((index_t)q0 + BM, rows) - 1;         // last key
  const int kt_lo = lo / BN, n_kt = hi / BN - kt_lo + 1;
  if (rows > (index_t)(INT_MAX - BM) || (long long)gridDim.x != (long long)ntiles * heads) __trap();

  if (threadIdx.x == 0) {
    // Full: one arrival (the producer's thread 0: expect-tx for a TMA fill, a plain arrive after
    // a cp.async fill). Empty: one arrival per consumer warp.
    mbar_init(q_full, 1);
    for (int st = 0; st < KS; ++st) {
      mbar_init(k_full(st), 1);
      mbar_init(k_empty(st), 2 * 4);
    }
    for (int st = 0; st < VS; ++st) {
      mbar_init(v_full(st), 1);
      mbar_init(v_empty(st), 2 * 4);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the only CTA-wide barrier: the mbarriers are initialised before any use

  if (wg == 0) {
    // ---- producer ----
    ws_setmaxnreg_dec<ATTN_WS_PRODUCER_REGS>();
    const int t = threadIdx.x;
    if (t == 0) {
      prefetch_tensor_map(map_q);
      prefetch_tensor_map(map_k);
      prefetch_tensor_map(map_v);
    }
    // One K or V tile into a stage: by TMA from thread 0 (HD / 64 boxes of 64 columns x BN rows,
    // the 128-byte swizzle of the consumers' descriptors; rows past `rows` read as zero) when the
    // tile starts inside the unit's key range, else (a sequence starts inside the tile) by
    // cp.async from all 128 threads with the rows before `lo` zero-filled, then a producer-wide
    // named barrier and thread 0's plain arrive. Every thread of the warpgroup takes the same
    // branch (it depends on the unit and tile only); in the cp.async case the named barrier also
    // brings threads 1..127, which skip the TMA tiles, back to thread 0's ring position before
    // they wait on an empty mbarrier, so their parity waits are never more than one phase behind.
    auto fill = [&](uint32_t dst, const CUtensorMap* map, const bf16* src, int kvh, int k0, int i_lo, int i_hi,
                    uint32_t full, uint32_t empty, uint32_t parity) {
      if (i_lo == 0) {
        if (t == 0) {
          mbar_wait(empty, parity);
          mbar_arrive_expect_tx(full, G::KV_BYTES);
#pragma unroll
          for (int p = 0; p < HD / 64; ++p) tma_load_2d(dst + (uint32_t)(p * BN * 128), map, full, kvh * HD + p * 64, k0);
        }
        return;
      }
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
      mbar_wait(empty, parity);
      const index_t kw = (index_t)kv_heads * HD;
      ws_load_rows<HD, BN>(dst, src + (index_t)k0 * kw + kvh * HD, (int)kw, i_lo, i_hi, src, t);
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
      if (t == 0) mbar_arrive(full);
    };
    const int kvh = h / (heads / kv_heads);
    for (int it = 0; it < n_kt; ++it) {
      const int k0 = (kt_lo + it) * BN;
      // Rows of the tile inside the key range [lo, hi] (empty when i_lo > i_hi). Rows past hi are
      // past `rows` (hi is the tile's last query row, and BN divides BM): zero under TMA too.
      const int i_lo = max(lo - k0, 0), i_hi = min(hi - k0, BN - 1);
      const int ks = it % KS, vs = it % VS;
      fill(sK(ks), map_k, k, kvh, k0, i_lo, i_hi, k_full(ks), k_empty(ks), (uint32_t)((it / KS) & 1) ^ 1u);
      if (it == 0 && t == 0) {
        // Q after K_0 (rows past `rows` read as zero).
        mbar_arrive_expect_tx(q_full, G::Q_BYTES);
#pragma unroll
        for (int p = 0; p < HD / 64; ++p) tma_load_2d(sQ + (uint32_t)(p * BM * 128), map_q, q_full, h * HD + p * 64, q0);
      }
      fill(sV(vs), map_v, v, kvh, k0, i_lo, i_hi, v_full(vs), v_empty(vs), (uint32_t)((it / VS) & 1) ^ 1u);
    }
    return;
  }

  // ---- consumers ----
  ws_setmaxnreg_inc<ATTN_WS_CONSUMER_REGS>();
  const int cw = wg - 1, lane = threadIdx.x & 31, wi = (threadIdx.x >> 5) & 3;
  const int gr = lane >> 2;
  const float sl2 = scale * LOG2E;
  const uint32_t sQw = sQ + (uint32_t)(cw * 64 * 128);
  const uint64_t dq = wg_desc(sQw, 16, 1024);
  const uint64_t dk = wg_desc(sK(0), 16, 1024);
  const uint64_t dv = wg_desc(sV(0), BN * 128, 1024);
  float acc[HD / 8][4];
  float s[BN / 8][4];
  uint32_t pa[BN / 16][4];
  auto issue_s = [&](int gi) {
    wg_issue_s<HD, BM, BN>(s, dq, wg_desc_at(dk, (uint32_t)(gi % KS) * G::KV_BYTES));
  };
  auto issue_pv = [&](int gi) {
    wg_issue_pv<HD, BN>(acc, pa, wg_desc_at(dv, (uint32_t)(gi % VS) * G::KV_BYTES));
  };
  // One arrival per warp (the empty mbarriers count the 8 consumer warps).
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  auto pack_p = [&]() { wg_pack_p<BN>(pa, s); };

  // Ping-pong (ATTN_WS_PINGPONG): the consumers issue their wgmma batches in turns, consumer 0
  // first, so that one's softmax runs under the other's products instead of both softmaxes at once
  // with the tensor cores idle. Consumer c waits on barrier 2 + c before each batch and passes the
  // turn to barrier 3 - c after issuing it. Both issue n_kt + 1 batches (same tile); consumer 1
  // passes once at the start and skips its last pass, so every arrival is matched by a wait.
  const int my_turn = 2 + cw, their_turn = 3 - cw;
  auto turn_wait = [&]() {
    if (ATTN_WS_PINGPONG) ws_turn_wait(my_turn);
  };
  auto turn_pass = [&](bool last) {
    if (ATTN_WS_PINGPONG && !(last && cw == 1)) ws_turn_pass(their_turn);
  };
  if (ATTN_WS_PINGPONG && cw == 1) ws_turn_pass(their_turn);

  const int nrows = (int)rows;
  // This warpgroup's rows and sequence starts, this thread's two rows: as section 1, relative
  // to q0.
  const int r0 = cw * 64;
  const bool live = q0 + r0 < nrows;
  const int ss1 = live ? (int)seq_start_of(seq_starts, num_seqs, min(q0 + r0 + 64, nrows) - 1) - q0 : 0;
  int row_of[2], ss_of[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_of[hh] = r0 + wi * 16 + gr + 8 * hh;
    ss_of[hh] = q0 + row_of[hh] < nrows ? (int)seq_start_of(seq_starts, num_seqs, q0 + row_of[hh]) - q0 : INT_MAX;
  }
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  auto softmax = [&](int it, float (&alpha)[2]) {
    const int k0 = (kt_lo + it) * BN - q0, k1 = k0 + BN - 1;
    const bool masked = !live || !(k0 >= ss1 && k1 <= r0);
    softmax_p<BN / 8>(s, m, l, alpha, sl2, masked, lane, [&](int hh, int col) {
      const int t = k0 + col;
      return t >= ss_of[hh] && t <= row_of[hh];
    });
  };

  mbar_wait(q_full, 0u);
  {  // it = 0: S_0 alone.
    float alpha[2];
    mbar_wait(k_full(0), 0u);
    fence_proxy_async();
    turn_wait();
    wgmma_fence();
    issue_s(0);
    turn_pass(false);
    wgmma_wait<0>();
    wg_fence_regs(s);
    release(k_empty(0));
    softmax(0, alpha);
    softmax_rescale<HD>(acc, alpha);
    pack_p();
  }
  for (int it = 1; it < n_kt; ++it) {
    float alpha[2];
    const int gi = it, ks = gi % KS, pvs = (gi - 1) % VS;
    mbar_wait(k_full(ks), (uint32_t)(gi / KS) & 1u);
    mbar_wait(v_full(pvs), (uint32_t)((gi - 1) / VS) & 1u);
    fence_proxy_async();
    wg_fence_regs(acc);
    turn_wait();
    wgmma_fence();
    issue_s(gi);
    issue_pv(gi - 1);
    turn_pass(false);
    wgmma_wait<1>();  // S_it (groups complete in order; P_{it-1} V_{it-1} may still run)
    wg_fence_regs(s);
    release(k_empty(ks));
    softmax(it, alpha);
    wgmma_wait<0>();
    wg_fence_regs(acc);
    release(v_empty(pvs));
    softmax_rescale<HD>(acc, alpha);
    pack_p();
  }
  {
    const int gl = n_kt - 1, pvs = gl % VS;
    mbar_wait(v_full(pvs), (uint32_t)(gl / VS) & 1u);
    fence_proxy_async();
    wg_fence_regs(acc);
    turn_wait();
    wgmma_fence();
    issue_pv(gl);
    turn_pass(true);
    wgmma_wait<0>();
    wg_fence_regs(acc);
    release(v_empty(pvs));
  }

  if (live) {
    softmax_finish<HD>(acc, l);
    // Stage the bf16 output in this warpgroup's Q rows (read only by its own, finished,
    // wgmmas): each warp writes and then reads back its own 16 rows.
    const int wr = cw * 64 + wi * 16;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      const int col = n * 8 + 2 * (lane & 3);
      *reinterpret_cast<uint32_t*>(base_ptr + sw128_elem<BM>(wr + gr, col)) =
          pack_bf16x2_rne(acc[n][0], acc[n][1]);
      *reinterpret_cast<uint32_t*>(base_ptr + sw128_elem<BM>(wr + gr + 8, col)) =
          pack_bf16x2_rne(acc[n][2], acc[n][3]);
    }
    __syncwarp();
    constexpr int C = HD / 8;
    for (int c = lane; c < 16 * C; c += 32) {
      const int i = c / C, ch = c % C;
      const int rr = q0 + wr + i;
      if (rr < nrows) {
        uint4 out = *reinterpret_cast<const uint4*>(base_ptr + sw128_chunk<BM>(wr + i, ch));
        if (gated) {
          float x[8], g[8];
          bf16x8_unpack(out, x);
          bf16x8_unpack(*reinterpret_cast<const uint4*>(gate + ((index_t)rr * heads + h) * gate_stride + ch * 8), g);
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] = x[e] / (1.f + expf(-g[e]));
          out = make_uint4(pack_bf16x2_rne(x[0], x[1]), pack_bf16x2_rne(x[2], x[3]), pack_bf16x2_rne(x[4], x[5]),
                           pack_bf16x2_rne(x[6], x[7]));
        }
        *reinterpret_cast<uint4*>(o + (index_t)rr * qw + h * HD + ch * 8) = out;
      }
    }
  }
}


// ---------------------------------------------------------------------------------------------
// 6. Drafter forward, warp-specialised: section 2's math, masks, numerics, outputs (o, lse) and
// preconditions with section 5's structure. attn_draft_fwd_ws_bf16_hd128.
// CTA b = section 2's CTA b: the block pair (2c, 2c + 1) of kv head g, one consumer warpgroup per
// block, the context rows either block sees streamed once as KEYS-row tiles over the union
// [Tlo, Thi), then each consumer's own 16 block keys.
// CTA = 384 threads:
//   warpgroup 0     producer (setmaxnreg.dec to ATTN_WS_PRODUCER_REGS). Per context tile t it fills
//                   K stage t % KS and V stage t % VS, each after waiting on the stage's empty
//                   mbarrier: by TMA (thread 0: expect-tx, HD / 64 boxes of 64 columns x KEYS rows
//                   from context row Tlo + t * KEYS) when every row of the tile is one a block
//                   sees, else by cp.async from all 128 threads with the other rows zero-filled,
//                   as section 2 (a named barrier before, so every thread waits at thread 0's ring
//                   position, and after the copies; then thread 0 arrives). Before K_0, Q and
//                   both blocks' keys by TMA on Q's full mbarrier: row i of the Q tile is row
//                   i % 64 of block 2c + i / 64, slot r of q head g * Gq + hh for i % 64 = hh *
//                   block_size + r, which one 3-D box per block and 64-column panel gathers
//                   (map_q: {column, row, head} with the head stride innermost but one); rows TMA
//                   leaves alone (Q rows past M, key rows past block_size, a padded block's keys)
//                   are zeroed with plain stores before thread 0 arrives. (This replaced a
//                   cp.async gather by the producer's 128 threads, issued after K_0, that the
//                   consumers waited for at the start of every CTA.)
//   warpgroups 1, 2 consumers (setmaxnreg.inc to ATTN_WS_CONSUMER_REGS): section 2's pipeline per
//                   block (S_t with P_{t-1} V_{t-1}, masks by the block's own range, the block-key
//                   tile last), with section 5's waits, releases and ping-pong (ATTN_WS_PINGPONG;
//                   n_kt + 1 turns each: the context tiles and the last one, which issues the
//                   block-key S with the last P V).
// Phases, buffer reuse and deadlock freedom as section 5 (the ring positions are the context
// tiles). Q and the block keys are loaded once and never refilled; the output is staged through
// the consumer's own Q rows.
// Measured (H200, the bench's 2048 blocks x 16, 32/8 heads, full layer): 2.589 ms with the
// cp.async Q gather and a division per output element, timed on all-zero inputs (every output
// 0, so every division took __fdiv_rn's slow path); 1.791 ms with Q by TMA and softmax_finish's
// reciprocal, on N(0, 1) inputs (FlexAttention 2.614 ms in the same call; sliding 1.707 ms).
// Launch: grid ceil(num_blocks / 2) * kv_heads (exactly), block ATTN_WS_THREADS (384), dynamic smem
//   (ATTN_WG_ROWS + (ATTN_WS_DRAFT_K_STAGES + ATTN_WS_DRAFT_V_STAGES) * ATTN_WG_KEYS_HD128 +
//   4 * ATTN_WG_BLOCK_KEYS) * 128 * 2 + ATTN_WS_BAR_BYTES + ATTN_WG_ALIGN = 214,144 bytes, and
//   TMA descriptors (128-byte swizzle, 64-column boxes) of: q as {128, num_blocks * block_size,
//   heads} with strides (heads * 256, 256) bytes and boxes {64, block_size, heads / kv_heads};
//   kb and vb as [num_blocks * block_size, kv_heads * 128] in boxes of block_size rows; kc and vc
//   as [ctx_rows, kv_heads * 128] in boxes of KEYS rows. ctx_rows >= 1. Preconditions as section
//   2, plus (num_blocks + 1) * block_size < 2^31 - 1; violations trap.
template <int HD>
struct WsDraftGeo {
  static constexpr int BM = ATTN_WG_ROWS, BN = ATTN_WG_KEYS_HD128, BB = ATTN_WG_BLOCK_KEYS;
  static constexpr int KS = ATTN_WS_DRAFT_K_STAGES, VS = ATTN_WS_DRAFT_V_STAGES;
  static constexpr uint32_t Q_BYTES = BM * HD * 2, KV_BYTES = BN * HD * 2, B_BYTES = BB * HD * 2;
  static constexpr uint32_t B_OFF = Q_BYTES + (KS + VS) * KV_BYTES;
  static constexpr uint32_t BAR_OFF = B_OFF + 4 * B_BYTES;
  static constexpr uint32_t SMEM = BAR_OFF + ATTN_WS_BAR_BYTES + ATTN_WG_ALIGN;
  static_assert(HD == 128, "the warp-specialised drafter forward takes head_dim 128");
  static_assert((1 + 2 * KS + 2 * VS) * 8 <= ATTN_WS_BAR_BYTES, "the mbarriers fit their slots");
  static_assert(KS >= 1 && VS >= 2, "V_{t-1} and V_t are in flight together");
  static_assert(B_BYTES % 1024 == 0, "block-key tiles start on swizzle atoms");
  static_assert(SMEM <= 232448, "over the opt-in shared memory of a CTA");
};

// Copies rows of an R-row swizzled tile with the producer warpgroup's 128 threads (t = 0..127);
// src(i) is row i's global address or nullptr for a zero row (section 1's wg_load_rows for 128
// threads).
template <int HD, int R, class Src>
__device__ __forceinline__ void ws_load_rows_at(uint32_t tile, const bf16* any_mapped, int t, Src src) {
  constexpr int C = HD / 8;
  static_assert((R * C) % 128 == 0, "every producer thread copies the same number of chunks");
#pragma unroll 1
  for (int c = t; c < R * C; c += 128) {
    const int i = c / C, ch = c % C;
    const bf16* p = src(i);
    cp_async_16(tile + sw128_chunk<R>(i, ch), p ? p + ch * 8 : any_mapped, p != nullptr);
  }
}

// 16 zero bytes at a shared-memory address (a generic-proxy store, as cp.async's zero fill).
__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
}

// Producer of sections 6 and 8, context tile `it` of a K or V ring (BN-row stages): after waiting
// on the stage's empty mbarrier, by TMA (thread 0: expect-tx and HD / 64 boxes of 64 columns x BN
// rows from context row Tlo + it * BN) when every row of the tile is one a block sees, else by
// cp.async from the producer's 128 threads (t) with the other rows zero-filled, between two
// meetings at named barrier 1 (so every thread waits at thread 0's ring position); then thread 0
// arrives on full. [r0lo, r0hi) and [r1lo, r1hi): the two blocks' rows relative to Tlo.
template <int HD, int BN>
__device__ __forceinline__ void ws_draft_fill(uint32_t dst, const CUtensorMap* map, const bf16* src, int it,
                                              uint32_t full, uint32_t empty, uint32_t parity, index_t Tlo, int r0lo,
                                              int r0hi, int r1lo, int r1hi, int g, index_t kw, int t) {
  const int u0 = it * BN, u1 = u0 + BN;
  // Whether every row of the tile is one a block sees: inside one block's range, or inside their
  // union where the two ranges overlap or touch.
  const bool in0 = u0 >= r0lo && u1 <= r0hi, in1 = u0 >= r1lo && u1 <= r1hi;
  const bool joined = r0lo < r0hi && r1lo < r1hi && r1lo <= r0hi && r0lo <= r1hi;
  if (in0 || in1 || (joined && u0 >= min(r0lo, r1lo) && u1 <= max(r0hi, r1hi))) {
    if (t == 0) {
      mbar_wait(empty, parity);
      mbar_arrive_expect_tx(full, BN * HD * 2);
#pragma unroll
      for (int p = 0; p < HD / 64; ++p)
        tma_load_2d(dst + (uint32_t)(p * BN * 128), map, full, g * HD + p * 64, (int)(Tlo + u0));
    }
    return;
  }
  asm volatile("bar.sync 1, 128;\n" ::: "memory");
  mbar_wait(empty, parity);
  const bf16* rows0 = src + (Tlo + u0) * kw + (index_t)g * HD;
  ws_load_rows_at<HD, BN>(dst, src, t, [&](int i) -> const bf16* {
    const int u = u0 + i;
    return (u >= r0lo && u < r0hi) || (u >= r1lo && u < r1hi) ? rows0 + (index_t)i * kw : nullptr;
  });
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  asm volatile("bar.sync 1, 128;\n" ::: "memory");
  if (t == 0) mbar_arrive(full);
}

// Producer of sections 6 and 8: the block pair's query-side tiles, once, on q_full. Q by TMA (and
// dO likewise when DO): block 2 pair + w's M rows for kv head g are one box per 64-column panel
// ({64 columns, bs slots, Gq heads}: tile row 64 w + hh * bs + r of the BM-row tile); a block past
// num_blocks reads as zero. Its keys by TMA (map_kb / map_vb, boxes of bs rows, into the BB-row
// tiles at sB0 + (2 w + kv) * BB * HD * 2) when the block is live (live[w]); rows TMA does not
// write (Q and dO rows past M, key rows past bs, a dead block's keys) are zeroed first with plain
// stores (zeros need no swizzle), which named barrier 1 orders before thread 0's arrival.
template <int HD, int BM, int BB, bool DO>
__device__ __forceinline__ void ws_draft_load_queries(const bool (&live)[2], index_t pair, int bs, int M, int Gq,
                                                      int g, uint32_t sQ, uint32_t sO, uint32_t sB0,
                                                      const CUtensorMap* map_q, const CUtensorMap* map_do,
                                                      const CUtensorMap* map_kb, const CUtensorMap* map_vb,
                                                      uint32_t q_full, int t) {
  auto sB = [&](int w, int kv) { return sB0 + (uint32_t)(2 * w + kv) * (BB * HD * 2); };
  if (M < 64 || bs < BB || !live[0] || !live[1]) {
    const int qz = 64 - M;
    auto zero_rows = [&](uint32_t panel0, int rows_per_panel, int r0, int n) {
      for (int c = t; c < HD / 64 * n * 8; c += 128) {
        const int p = c / (n * 8), r = r0 + c % (n * 8) / 8, ch = c % 8;
        st_shared_zero16(panel0 + (uint32_t)((p * rows_per_panel + r) * 128 + ch * 16));
      }
    };
#pragma unroll
    for (int w = 0; w < 2; ++w) {  // unrolled: live[] stays in registers
      if (qz > 0) {
        zero_rows(sQ + (uint32_t)(w * 64 * 128), BM, M, qz);
        if (DO) zero_rows(sO + (uint32_t)(w * 64 * 128), BM, M, qz);
      }
      const int kz0 = live[w] ? bs : 0;
      if (kz0 < BB) {
        zero_rows(sB(w, 0), BB, kz0, BB - kz0);
        zero_rows(sB(w, 1), BB, kz0, BB - kz0);
      }
    }
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
  }
  if (t == 0) {
    const uint32_t q_box = 64 * M * 2, key_box = 64 * bs * 2;
    mbar_arrive_expect_tx(q_full, (DO ? 2 : 1) * 2 * (HD / 64) * q_box + (live[0] + live[1]) * 2 * (HD / 64) * key_box);
#pragma unroll
    for (int w = 0; w < 2; ++w) {  // unrolled: live[] stays in registers
      const int jj = (int)(2 * pair + w);
#pragma unroll
      for (int p = 0; p < HD / 64; ++p) {
        tma_load_3d(sQ + (uint32_t)((w * 64 + p * BM) * 128), map_q, q_full, p * 64, jj * bs, g * Gq);
        if (DO) tma_load_3d(sO + (uint32_t)((w * 64 + p * BM) * 128), map_do, q_full, p * 64, jj * bs, g * Gq);
        if (live[w]) {
          tma_load_2d(sB(w, 0) + (uint32_t)(p * BB * 128), map_kb, q_full, g * HD + p * 64, jj * bs);
          tma_load_2d(sB(w, 1) + (uint32_t)(p * BB * 128), map_vb, q_full, g * HD + p * 64, jj * bs);
        }
      }
    }
  }
}

template <int HD>
__device__ __forceinline__ void draft_fwd_ws(const CUtensorMap* map_q, const CUtensorMap* map_kb,
                                             const CUtensorMap* map_vb, const CUtensorMap* map_k,
                                             const CUtensorMap* map_v, const bf16* __restrict__ kc,
                                             const bf16* __restrict__ vc, bf16* __restrict__ o,
                                             float* __restrict__ lse, const int* __restrict__ anchors,
                                             const int* __restrict__ ctx_start, int num_blocks, int block_size,
                                             index_t ctx_rows, int heads, int kv_heads, float scale, int window) {
  using G = WsDraftGeo<HD>;
  constexpr int BM = G::BM, BN = G::BN, KS = G::KS, VS = G::VS, BB = G::BB;
  (void)ctx_rows;  // every row read is inside a block's range, which the launcher checked
  require_launch(ATTN_WS_THREADS, G::SMEM);
  // (num_blocks + 1) * block_size < 2^31 - 1: the TMA row coordinates of Q and the block keys are
  // ints.
  if (window < 0 || block_size < 1 || block_size > BB || kv_heads < 1 || heads % kv_heads != 0 ||
      block_size * (heads / kv_heads) > 64 || ((long long)num_blocks + 1) * block_size >= INT_MAX ||
      (long long)gridDim.x != ((long long)num_blocks + 1) / 2 * kv_heads) {
    __trap();
  }
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + (ATTN_WG_ALIGN - 1)) & ~(uint32_t)(ATTN_WG_ALIGN - 1);
  unsigned char* const base_ptr = smem_raw + (base - smem_u32(smem_raw));
  const uint32_t sQ = base;
  auto sK = [&](int st) { return base + G::Q_BYTES + (uint32_t)st * G::KV_BYTES; };
  auto sV = [&](int st) { return base + G::Q_BYTES + (uint32_t)(KS + st) * G::KV_BYTES; };
  // Block keys of consumer w: K at sB(w, 0), V at sB(w, 1), 16-row swizzled tiles of HD / 64
  // panels (BB rows of 128 bytes each), 1024-byte aligned as TMA's 128-byte swizzle needs.
  auto sB = [&](int w, int kv) { return base + G::B_OFF + (uint32_t)(2 * w + kv) * G::B_BYTES; };
  const uint32_t q_full = base + G::BAR_OFF;
  auto k_full = [&](int st) { return q_full + 8u * (uint32_t)(1 + st); };
  auto k_empty = [&](int st) { return q_full + 8u * (uint32_t)(1 + KS + st); };
  auto v_full = [&](int st) { return q_full + 8u * (uint32_t)(1 + 2 * KS + st); };
  auto v_empty = [&](int st) { return q_full + 8u * (uint32_t)(1 + 2 * KS + VS + st); };

  const int wg = warpgroup_index();
  const int Gq = heads / kv_heads, bs = block_size, M = bs * Gq;
  const int g = (int)(blockIdx.x % (unsigned)kv_heads);
  const index_t npairs = ((index_t)num_blocks + 1) / 2;
  const index_t pair = npairs - 1 - (index_t)(blockIdx.x / (unsigned)kv_heads);
  const index_t qw = (index_t)heads * HD, kw = (index_t)kv_heads * HD;

  // Both blocks' context ranges (section 2's).
  index_t a_w[2], cs_w[2], Tlo;
  int n_kt, r0lo, r0hi, r1lo, r1hi;
  draft_pair_ranges<BN>(pair, num_blocks, anchors, ctx_start, window, a_w, cs_w, Tlo, n_kt, r0lo, r0hi, r1lo, r1hi);

  ws_draft_init_rings(q_full, KS, VS);

  if (wg == 0) {
    // ---- producer ----
    ws_setmaxnreg_dec<ATTN_WS_PRODUCER_REGS>();
    const int t = threadIdx.x;
    if (t == 0) {
      prefetch_tensor_map(map_q);
      prefetch_tensor_map(map_kb);
      prefetch_tensor_map(map_vb);
      prefetch_tensor_map(map_k);
      prefetch_tensor_map(map_v);
    }
    // Q and both blocks' keys, once, on q_full. Q by TMA: block jj's M rows for kv head g are one
    // box of map_q per 64-column panel ({64 columns, bs slots, Gq heads}: tile row hh * bs + r);
    // a block past num_blocks reads as zero. Its keys by TMA likewise (map_kb / map_vb, boxes of
    // bs rows) when the block is live; rows TMA does not write (Q rows past M, key rows past bs,
    // a dead block's keys) are zeroed here first with plain stores (zeros need no swizzle), which
    // the named barrier orders before thread 0's arrival.
    const bool live[2] = {2 * pair < num_blocks && a_w[0] >= 0, 2 * pair + 1 < num_blocks && a_w[1] >= 0};
    ws_draft_load_queries<HD, BM, BB, false>(live, pair, bs, M, Gq, g, sQ, 0u, sB(0, 0), map_q, nullptr, map_kb, map_vb,
                                            q_full, t);
    for (int it = 0; it < n_kt; ++it) {
      const int ks = it % KS, vs = it % VS;
      ws_draft_fill<HD, BN>(sK(ks), map_k, kc, it, k_full(ks), k_empty(ks), (uint32_t)((it / KS) & 1) ^ 1u, Tlo, r0lo,
                            r0hi, r1lo, r1hi, g, kw, t);
      ws_draft_fill<HD, BN>(sV(vs), map_v, vc, it, v_full(vs), v_empty(vs), (uint32_t)((it / VS) & 1) ^ 1u, Tlo, r0lo,
                            r0hi, r1lo, r1hi, g, kw, t);
    }
    return;
  }

  // ---- consumers ----
  ws_setmaxnreg_inc<ATTN_WS_CONSUMER_REGS>();
  const int cw = wg - 1, lane = threadIdx.x & 31, wi = (threadIdx.x >> 5) & 3;
  const int gr = lane >> 2;
  // This consumer's block and this thread's two rows: slot, head, and context range relative to
  // Tlo (empty: vlo > vhi), as section 2.
  const index_t j = 2 * pair + cw;
  const index_t a = cw ? a_w[1] : a_w[0], cs = cw ? cs_w[1] : cs_w[0];
  int mrow[2], vlo[2], vhi[2];
  bool rvalid[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    mrow[hh] = wi * 16 + gr + 8 * hh;
    rvalid[hh] = a >= 0 && mrow[hh] < M;
    const int r = mrow[hh] % bs;
    if (rvalid[hh] && a > 0) {
      const index_t first = window > 0 ? max((index_t)0, a + r - (index_t)(window - 1)) : (index_t)0;
      vlo[hh] = (int)(cs + first - Tlo);
      vhi[hh] = (int)(cs + a - Tlo) - 1;
    } else {
      vlo[hh] = 1;
      vhi[hh] = 0;
    }
  }
  const index_t all_first = window > 0 ? max((index_t)0, a + bs - (index_t)window) : (index_t)0;
  const bool wg_any = a > 0 && all_first < a;
  const int wlo = wg_any ? (int)(cs + all_first - Tlo) : 0, whi = wg_any ? (int)(cs + a - Tlo) - 1 : -1;

  float acc[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = scale * LOG2E;
  const uint32_t sQw = sQ + (uint32_t)(cw * 64 * 128);
  float s[BN / 8][4];
  uint32_t pa[BN / 16][4];
  const uint64_t dq = wg_desc(sQw, 16, 1024);
  const uint64_t dk = wg_desc(sK(0), 16, 1024);
  const uint64_t dv = wg_desc(sV(0), BN * 128, 1024);
  auto issue_s = [&](int it) {
    wg_issue_s<HD, BM, BN>(s, dq, wg_desc_at(dk, (uint32_t)(it % KS) * G::KV_BYTES));
  };
  auto issue_pv = [&](int it) {
    wg_issue_pv<HD, BN>(acc, pa, wg_desc_at(dv, (uint32_t)(it % VS) * G::KV_BYTES));
  };
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  // Ping-pong as section 5: consumer c waits on barrier 2 + c and passes to 3 - c; consumer 1
  // passes once first and skips its last pass.
  const int my_turn = 2 + cw, their_turn = 3 - cw;
  auto turn_wait = [&]() {
    if (ATTN_WS_PINGPONG) ws_turn_wait(my_turn);
  };
  auto turn_pass = [&](bool last) {
    if (ATTN_WS_PINGPONG && !(last && cw == 1)) ws_turn_pass(their_turn);
  };
  if (ATTN_WS_PINGPONG && cw == 1) ws_turn_pass(their_turn);
  auto softmax = [&](int it, float (&alpha)[2]) {
    const int k0 = it * BN, k1 = k0 + BN - 1;  // relative to Tlo
    const bool masked = !(k0 >= wlo && k1 <= whi);
    softmax_p<BN / 8>(s, m, l, alpha, sl2, masked, lane, [&](int hh, int col) {
      const int tt = k0 + col;
      return tt >= vlo[hh] && tt <= vhi[hh];
    });
  };
  auto pack_p = [&]() { wg_pack_p<BN>(pa, s); };

  mbar_wait(q_full, 0u);
  {  // context tile 0 alone
    float alpha[2];
    mbar_wait(k_full(0), 0u);
    fence_proxy_async();
    turn_wait();
    wgmma_fence();
    issue_s(0);
    turn_pass(false);
    wgmma_wait<0>();
    wg_fence_regs(s);
    release(k_empty(0));
    softmax(0, alpha);
    softmax_rescale<HD>(acc, alpha);
    pack_p();
  }
  for (int it = 1; it < n_kt; ++it) {
    float alpha[2];
    const int ks = it % KS, pvs = (it - 1) % VS;
    mbar_wait(k_full(ks), (uint32_t)(it / KS) & 1u);
    mbar_wait(v_full(pvs), (uint32_t)((it - 1) / VS) & 1u);
    fence_proxy_async();
    wg_fence_regs(acc);
    turn_wait();
    wgmma_fence();
    issue_s(it);
    issue_pv(it - 1);
    turn_pass(false);
    wgmma_wait<1>();
    wg_fence_regs(s);
    release(k_empty(ks));
    softmax(it, alpha);
    wgmma_wait<0>();
    wg_fence_regs(acc);
    release(v_empty(pvs));
    softmax_rescale<HD>(acc, alpha);
    pack_p();
  }
  {  // the block's own keys, issued with the last context tile's P V
    float sb[BB / 8][4], alpha[2];
    const int gl = n_kt - 1, pvs = gl % VS;
    mbar_wait(v_full(pvs), (uint32_t)(gl / VS) & 1u);
    fence_proxy_async();
    wg_fence_regs(acc);
    turn_wait();
    wgmma_fence();
    wg_issue_s<HD, BM, BB>(sb, dq, wg_desc(sB(cw, 0), 16, 1024));
    issue_pv(gl);
    turn_pass(true);
    wgmma_wait<1>();
    wg_fence_regs(sb);
    softmax_p<BB / 8>(sb, m, l, alpha, sl2, true, lane, [&](int hh, int col) {
      return rvalid[hh] && col < bs && (window == 0 || col <= mrow[hh] % bs);
    });
    wgmma_wait<0>();
    wg_fence_regs(acc);
    release(v_empty(pvs));
    softmax_rescale<HD>(acc, alpha);
    uint32_t pb[1][4];
    wg_pack_p<BB>(pb, sb);
    wgmma_fence();
    wg_issue_pv<HD, BB>(acc, pb, wg_desc(sB(cw, 1), BB * 128, 1024));
    wgmma_wait<0>();
    wg_fence_regs(acc);
  }
  if (j >= num_blocks) return;
  draft_fwd_store<HD>(acc, m, l, a < 0, mrow, M, bs, j, g, Gq, heads, qw, cw, wi, gr, lane, base_ptr, o, lse);
}


// ---------------------------------------------------------------------------------------------
// 7. Drafter backward over context keys, warp-specialised: section 4's math, masks, numerics,
// outputs (dkc, dvc: = never +=, blocks summed in increasing j) and preconditions with section 5's
// structure; the first CTAs of attn_draft_bwd_ws_bf16_hd128.
// CTA b = section 4's CTA b: ATTN_WG_BWD_KV_ROWS (128) context rows t0 .. t0 + 127 of kv head g.
// CTA = 384 threads:
//   warpgroup 0     producer (setmaxnreg.dec to ATTN_WS_PRODUCER_REGS); its warp 0 does the work,
//                   warps 1-3 leave. Lane 0 loads the CTA's K and V rows once by TMA (map_k,
//                   map_v: HD / 64 boxes of 64 columns x 128 rows each; rows past ctx_rows read as
//                   zero) on kv_full. Then the warp scans the blocks [j_lo, j_hi) that
//                   attn_draft_kv_ranges gives the tile's rows, 32 at a time, keeps those whose
//                   context range meets the tile (section 4's test), and gives each kept block,
//                   in increasing j, the next stage of a ring of ATTN_WS_BWD_Q_STAGES: after
//                   waiting on the stage's empty mbarrier, the lanes write the block's 64 lse *
//                   log2(e) and dsum values (+inf and 0 on rows past M) and lane 0 a descriptor
//                   {j, anchor, ctx_start} with plain stores; each lane then arrives on the stage's
//                   full mbarrier (count 32), lane 0 with expect-tx before it loads Q and dO by TMA,
//                   one 3-D box per 64-column panel each (map_q, map_do: {column, slot, head}, tile
//                   row hh * block_size + r, as section 6's Q). After the last block a descriptor
//                   with j = -1 and the 32 plain arrivals end the consumers' loop.
//   warpgroups 1, 2 consumers (setmaxnreg.inc to ATTN_WS_CONSUMER_REGS): consumer c owns context
//                   rows t0 + 64c .. t0 + 64c + 63 as the wgmma rows and runs section 4's products
//                   per block (S^T and dP^T issued together, P^T computed as soon as S^T is
//                   complete while dP^T runs; dV += P^T dO issued, dS^T computed under it; dK +=
//                   dS^T Q), then releases the stage: each thread arrives on its empty mbarrier
//                   (count 256). The descriptor gives the block's anchor and context start, so the
//                   consumers read no global memory until their stores.
// Every thread that writes or reads a stage's lse, dsum or descriptor with plain shared-memory
// accesses arrives on the mbarrier that hands the stage over itself (the release of its own
// accesses), rather than one lane per warp after __syncwarp: racecheck, which does not follow that
// cumulativity, reported each of those accesses as a hazard in the per-warp form.
// Q and dO rows past M are zeroed once before the CTA barrier (generic stores, then
// fence.proxy.async): TMA writes only rows < M of any stage, so they stay zero, and with lse = +inf
// and dsum = 0 those columns give P^T = dS^T = 0 exactly.
// Phases, buffer reuse and deadlock freedom as section 5: item n of the list uses stage n % QS;
// the consumers wait on full with parity (n / QS) & 1, the producer on empty with the opposite
// parity; a stage is refilled only after both consumers released it, which they do after
// wgmma.wait_group shows every product that read it complete. dK and dV are staged through the
// consumer's own K and V rows (read only by its own, finished, wgmmas; nothing refills them).
// Launch (as part of attn_draft_bwd_ws_bf16_hd128): CTAs 0 .. ceil(ctx_rows / 128) * kv_heads - 1,
//   block ATTN_WS_THREADS (384), dynamic smem at least WsBwdKvGeo::SMEM = 199,872 bytes, and TMA
//   descriptors (128-byte swizzle, 64-column boxes) of q and d_o as {128, num_blocks * block_size,
//   heads} with strides (heads * 256, 256) bytes and boxes {64, block_size, heads / kv_heads}, kc
//   and vc as [ctx_rows, kv_heads * 128] in boxes of 128 rows. 1 <= ctx_rows < 2^31 - 256 and (num_blocks + 1) * block_size < 2^31 - 1 (TMA's 32-bit
//   coordinates); otherwise section 4's preconditions. Violations trap.
template <int HD>
struct WsBwdKvGeo {
  static constexpr int KR = ATTN_WG_BWD_KV_ROWS, QR = 64, QS = ATTN_WS_BWD_Q_STAGES;
  static constexpr uint32_t K_BYTES = KR * HD * 2, Q_BYTES = QR * HD * 2;
  static constexpr uint32_t Q_OFF = 2 * K_BYTES;            // Q stages, then dO stages
  static constexpr uint32_t L_OFF = Q_OFF + 2 * QS * Q_BYTES;  // per stage: 64 lse * log2(e), 64 dsum (f32)
  static constexpr uint32_t META_OFF = L_OFF + QS * 2 * QR * 4;  // per stage: int4 {j, anchor, cs, 0}
  static constexpr uint32_t BAR_OFF = META_OFF + QS * 16;
  static constexpr uint32_t SMEM = BAR_OFF + ATTN_WS_BAR_BYTES + ATTN_WG_ALIGN;
  static_assert(HD == 128, "the warp-specialised drafter backward takes head_dim 128");
  static_assert(KR == 128 && KR == ATTN_WG_KEYS_HD128, "the K/V boxes are the forward's 128-row boxes");
  static_assert((1 + 2 * QS) * 8 <= ATTN_WS_BAR_BYTES, "the mbarriers fit their slots");
  static_assert(QS >= 2, "the producer runs ahead of the consumers");
  static_assert(SMEM <= 232448, "over the opt-in shared memory of a CTA");
};

template <int HD>
__device__ __forceinline__ void draft_bwd_kv_ws(const CUtensorMap* map_q, const CUtensorMap* map_do,
                                                const CUtensorMap* map_k, const CUtensorMap* map_v,
                                                const float* __restrict__ lse, const float* __restrict__ dsum,
                                                bf16* __restrict__ dkc, bf16* __restrict__ dvc,
                                                const int* __restrict__ anchors, const int* __restrict__ ctx_start,
                                                int num_blocks, int block_size, index_t ctx_rows, int heads,
                                                int kv_heads, float scale, const int* __restrict__ ctx_block_begin,
                                                const int* __restrict__ ctx_block_end, int window, unsigned cta) {
  using G = WsBwdKvGeo<HD>;
  constexpr int KR = G::KR, QR = G::QR, QS = G::QS;
  require_launch(ATTN_WS_THREADS, G::SMEM);
  if (window < 0 || block_size < 1 || kv_heads < 1 || heads % kv_heads != 0 || block_size * (heads / kv_heads) > QR ||
      ctx_rows < 1 || ctx_rows >= (index_t)INT_MAX - 2 * KR || ((long long)num_blocks + 1) * block_size >= INT_MAX) {
    __trap();
  }
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + (ATTN_WG_ALIGN - 1)) & ~(uint32_t)(ATTN_WG_ALIGN - 1);
  unsigned char* const base_ptr = smem_raw + (base - smem_u32(smem_raw));
  const uint32_t sK = base, sV = base + G::K_BYTES;
  auto sQ = [&](int st) { return base + G::Q_OFF + (uint32_t)st * G::Q_BYTES; };
  auto sO = [&](int st) { return base + G::Q_OFF + (uint32_t)(QS + st) * G::Q_BYTES; };
  auto sL = [&](int st) { return reinterpret_cast<float*>(base_ptr + G::L_OFF + (uint32_t)st * 2 * QR * 4); };
  auto sD = [&](int st) { return reinterpret_cast<float*>(base_ptr + G::L_OFF + ((uint32_t)st * 2 + 1) * QR * 4); };
  auto meta = [&](int st) { return reinterpret_cast<int4*>(base_ptr + G::META_OFF + (uint32_t)st * 16); };
  const uint32_t kv_full = base + G::BAR_OFF;
  auto q_full = [&](int st) { return kv_full + 8u * (uint32_t)(1 + st); };
  auto q_empty = [&](int st) { return kv_full + 8u * (uint32_t)(1 + QS + st); };

  const int wg = warpgroup_index(), lane = threadIdx.x & 31;
  const int Gq = heads / kv_heads, bs = block_size, M = bs * Gq;
  const int g = (int)(cta % (unsigned)kv_heads);
  const index_t t0 = (index_t)(cta / (unsigned)kv_heads) * KR;
  const index_t t_end = min(t0 + KR, ctx_rows);
  const index_t kw = (index_t)kv_heads * HD;

  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    for (int st = 0; st < QS; ++st) {
      mbar_init(q_full(st), 32);       // every producer lane (lane 0 with the expect-tx)
      mbar_init(q_empty(st), 2 * 128);  // every consumer thread
    }
    fence_barrier_init();
  }
  if (M < QR) {  // Q and dO rows past M, every stage and panel: zero once (TMA never writes them)
    const int nz = QR - M;
    for (int c = threadIdx.x; c < 2 * QS * (HD / 64) * nz * 8; c += ATTN_WS_THREADS) {
      const int ch = c % 8, r = M + c / 8 % nz, tile = c / (8 * nz);  // tile = (Q or dO, stage, panel)
      st_shared_zero16(sQ(0) + (uint32_t)tile * QR * 128 + (uint32_t)(r * 128 + ch * 16));
    }
    fence_proxy_async();
  }
  __syncthreads();  // the only CTA-wide barrier

  if (wg == 0) {
    // ---- producer ----
    ws_setmaxnreg_dec<ATTN_WS_PRODUCER_REGS>();
    if (threadIdx.x >= 32) return;
    if (lane == 0) {
      prefetch_tensor_map(map_q);
      prefetch_tensor_map(map_do);
      prefetch_tensor_map(map_k);
      prefetch_tensor_map(map_v);
      mbar_arrive_expect_tx(kv_full, 2 * G::K_BYTES);
#pragma unroll
      for (int p = 0; p < HD / 64; ++p) {
        tma_load_2d(sK + (uint32_t)(p * KR * 128), map_k, kv_full, g * HD + p * 64, (int)t0);
        tma_load_2d(sV + (uint32_t)(p * KR * 128), map_v, kv_full, g * HD + p * 64, (int)t0);
      }
    }
    // Blocks to scan: the union of the tile rows' ranges.
    int j_lo = INT_MAX, j_hi = INT_MIN;
    for (int i = lane; i < KR; i += 32) {
      if (t0 + i < t_end) {
        j_lo = min(j_lo, ctx_block_begin[t0 + i]);
        j_hi = max(j_hi, ctx_block_end[t0 + i]);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      j_lo = min(j_lo, __shfl_xor_sync(0xffffffffu, j_lo, off));
      j_hi = max(j_hi, __shfl_xor_sync(0xffffffffu, j_hi, off));
    }
    j_lo = max(j_lo, 0);
    j_hi = min(j_hi, num_blocks);
    const uint32_t q_tx = 2 * (HD / 64) * 128 * (uint32_t)M;  // Q and dO: one {64, bs, Gq} box per panel
    int n = 0;
#pragma unroll 1
    for (int jb = j_lo; jb < j_hi; jb += 32) {
      const int jj = jb + lane;
      int aa = -1, c0 = 0;
      bool vis = false;
      if (jj < j_hi) {
        aa = anchors[jj];
        if (aa >= 0) {
          c0 = ctx_start[jj];
          vis = (index_t)c0 + draft_first_key(aa, window) < t_end && (index_t)c0 + aa > t0;
        }
      }
      unsigned todo = __ballot_sync(0xffffffffu, vis);
#pragma unroll 1
      while (todo) {
        const int b = __ffs(todo) - 1;
        todo &= todo - 1;
        const int j = jb + b, a_j = __shfl_sync(0xffffffffu, aa, b), c_j = __shfl_sync(0xffffffffu, c0, b);
        const int st = n % QS;
        mbar_wait(q_empty(st), (uint32_t)((n / QS) & 1) ^ 1u);
#pragma unroll
        for (int h = 0; h < QR / 32; ++h) {
          const int mr = lane + 32 * h;
          float l = INFINITY, d = 0.f;  // rows past M: P = 0, dS = 0
          if (mr < M) {
            const index_t idx = ((index_t)j * bs + mr % bs) * heads + g * Gq + mr / bs;
            l = lse[idx] * LOG2E;
            d = dsum[idx];
          }
          sL(st)[mr] = l;
          sD(st)[mr] = d;
        }
        if (lane == 0) {
          *meta(st) = make_int4(j, a_j, c_j, 0);
          mbar_arrive_expect_tx(q_full(st), q_tx);
#pragma unroll
          for (int p = 0; p < HD / 64; ++p) {
            tma_load_3d(sQ(st) + (uint32_t)(p * QR * 128), map_q, q_full(st), p * 64, j * bs, g * Gq);
            tma_load_3d(sO(st) + (uint32_t)(p * QR * 128), map_do, q_full(st), p * 64, j * bs, g * Gq);
          }
        } else {
          mbar_arrive(q_full(st));
        }
        ++n;
      }
    }
    {  // the end of the list
      const int st = n % QS;
      mbar_wait(q_empty(st), (uint32_t)((n / QS) & 1) ^ 1u);
      if (lane == 0) *meta(st) = make_int4(-1, 0, 0, 0);
      mbar_arrive(q_full(st));
    }
    return;
  }

  // ---- consumers ----
  ws_setmaxnreg_inc<ATTN_WS_CONSUMER_REGS>();
  const int cw = wg - 1, wi = (threadIdx.x >> 5) & 3;
  const int gr = lane >> 2, tq = lane & 3;
  // This consumer's 64 keys [tw0, tw0 + 64) and this thread's two rows.
  const index_t tw0 = t0 + cw * 64;
  index_t trow[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) trow[hh] = tw0 + wi * 16 + gr + 8 * hh;

  float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
  }
  const float sl2 = scale * LOG2E;
  // Descriptors: K and V of this consumer as the A operand (K-major, column blocks KR rows apart);
  // Q and dO stages as K-major B (S^T, dP^T) and as N-major B (dK, dV).
  const uint64_t dka = wg_desc(sK + (uint32_t)(cw * 64 * 128), 16, 1024);
  const uint64_t dva = wg_desc(sV + (uint32_t)(cw * 64 * 128), 16, 1024);
  const uint64_t dqb = wg_desc(sQ(0), 16, 1024), dob = wg_desc(sO(0), 16, 1024);
  const uint64_t dqn = wg_desc(sQ(0), QR * 128, 1024), don = wg_desc(sO(0), QR * 128, 1024);

  float st_[QR / 8][4], dpt[QR / 8][4];
  uint32_t pp[QR / 16][4], ps[QR / 16][4];
  mbar_wait(kv_full, 0u);
#pragma unroll 1
  for (int n = 0;; ++n) {
    const int st = n % QS;
    mbar_wait(q_full(st), (uint32_t)(n / QS) & 1u);
    const int4 mt = *meta(st);
    if (mt.x < 0) break;
    const index_t aa = mt.y, cs = mt.z;
    const index_t ce = cs + aa;  // rows [cs, ce) see block j (a full layer)
    bool vis[2];
    index_t last_slot[2];  // sliding: row t is seen by the slots r <= t - ce + (W - 1)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      vis[hh] = trow[hh] < t_end && trow[hh] >= cs && trow[hh] < ce;
      last_slot[hh] = window > 0 ? trow[hh] - ce + (index_t)(window - 1) : (index_t)INT_MAX;
    }
    // Unmasked when all 64 keys of the consumer are seen by every slot of the block.
    const index_t all_first = window > 0 ? max((index_t)0, aa + bs - (index_t)window) : (index_t)0;
    const bool masked = !(tw0 >= cs + all_first && tw0 + 63 < ce && tw0 + 63 < t_end);

    wgmma_fence();
    {
      const uint64_t dqs = wg_desc_at(dqb, (uint32_t)st * G::Q_BYTES);
      const uint64_t dos = wg_desc_at(dob, (uint32_t)st * G::Q_BYTES);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        const uint32_t off = (uint32_t)((kk & 3) * 32);
        wg_abt<QR>(st_, wg_desc_at(dka, (uint32_t)((kk >> 2) * KR * 128) + off),
                   wg_desc_at(dqs, (uint32_t)((kk >> 2) * QR * 128) + off), kk > 0);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        const uint32_t off = (uint32_t)((kk & 3) * 32);
        wg_abt<QR>(dpt, wg_desc_at(dva, (uint32_t)((kk >> 2) * KR * 128) + off),
                   wg_desc_at(dos, (uint32_t)((kk >> 2) * QR * 128) + off), kk > 0);
      }
      wgmma_commit();
    }
    wgmma_wait<1>();  // S^T complete; dP^T may still run
    wg_fence_regs(st_);
    const float* lq = sL(st);
    const float* dq_ = sD(st);
    kv_p_tile<QR>(st_, pp, lq, 1.f, sl2, masked, vis, last_slot, window, bs, tq);
    wgmma_wait<0>();  // dP^T complete
    wg_fence_regs(dpt);
    wg_fence_regs(dv);
    wgmma_fence();
    {
      const uint64_t dos = wg_desc_at(don, (uint32_t)st * G::Q_BYTES);
#pragma unroll
      for (int kk = 0; kk < QR / 16; ++kk) wg_pb<HD>(dv, pp[kk], wg_desc_at(dos, (uint32_t)(kk * 16 * 128)), 1);
      wgmma_commit();
    }
    kv_ds_tile<QR>(dpt, ps, st_, dq_, scale, tq);
    wg_fence_regs(dk);
    wgmma_fence();
    {
      const uint64_t dqs = wg_desc_at(dqn, (uint32_t)st * G::Q_BYTES);
#pragma unroll
      for (int kk = 0; kk < QR / 16; ++kk) wg_pb<HD>(dk, ps[kk], wg_desc_at(dqs, (uint32_t)(kk * 16 * 128)), 1);
      wgmma_commit();
    }
    // Both products read this stage and the packed registers: complete before the stage is freed.
    wgmma_wait<0>();
    wg_fence_regs(dv);
    wg_fence_regs(dk);
    mbar_arrive(q_empty(st));
  }
  // dK and dV, staged in this consumer's own K and V rows.
  kv_store<HD, KR>(dk, dv, base_ptr, G::K_BYTES, cw * 64 + wi * 16, gr, tq, lane, t0, t_end, kw, g, dkc, dvc);
}


// ---------------------------------------------------------------------------------------------
// 8. Drafter backward over queries, warp-specialised: section 3's math, masks, numerics, outputs
// (dq, dkb, dvb) and preconditions with section 6's structure; the CTAs of
// attn_draft_bwd_ws_bf16_hd128 after section 7's.
// CTA b = section 3's CTA b: the block pair (2c, 2c + 1) of kv head g, one consumer warpgroup per
// block, the context rows either block sees streamed once as ATTN_WS_BWD_KEYS-row tiles over the
// union [Tlo, Thi), then each consumer's own block keys.
// CTA = 384 threads:
//   warpgroup 0     producer, as section 6's: Q, dO and both blocks' keys once on q_full (Q and dO
//                   by one 3-D box per block and panel, the keys by 2-D boxes; rows TMA leaves
//                   alone zeroed first), then per context tile t K stage t % KS and V stage t % VS,
//                   each after its empty mbarrier, by TMA when every row of the tile is one a block
//                   sees, else by cp.async with the other rows zero-filled.
//   warpgroups 1, 2 consumers: section 3's pipeline per block (S_t and dP_t issued with dQ +=
//                   dS_{t-1} K_{t-1}; dS_t computed under the latter), section 5's waits and
//                   ping-pong turns (n_kt + 1 each). V stage t is released once S_t and dP_t are
//                   complete, K stage t once dQ += dS_t K_t is (an iteration later). Then the block
//                   keys: S_b and dP_b issued with the last context tile's dQ product, P_b and dS_b
//                   to the consumer's f32 side buffers, dQ += dS_b K_b; after a barrier of the
//                   consumer's own 128 threads, dkb and dvb from the side buffers and the Q and dO
//                   rows, a second barrier, and dQ staged through the consumer's own Q rows.
// Phases, buffer reuse and deadlock freedom as section 5 (tile t needs K_t and V_t; the producer
// issues them after K_{t-KS}, released at iteration t - KS + 1, and V_{t-VS}, released at
// iteration t - VS: earlier steps of the consumers).
// Launch (as part of attn_draft_bwd_ws_bf16_hd128): ceil(num_blocks / 2) * kv_heads CTAs after
//   section 7's, block ATTN_WS_THREADS (384), dynamic smem at least WsBwdQGeo::SMEM = 214,144
//   bytes, and TMA descriptors (128-byte swizzle, 64-column boxes) of q and d_o as section 6's q,
//   kb and vb as section 6's, kc and vc as [ctx_rows, kv_heads * 128] in boxes of
//   ATTN_WS_BWD_KEYS rows. ctx_rows >= 1 and (num_blocks + 1) * block_size <
//   2^31 - 1; otherwise section 3's preconditions. Violations trap.
template <int HD>
struct WsBwdQGeo {
  static constexpr int BM = ATTN_WG_ROWS, BN = ATTN_WS_BWD_KEYS, BB = ATTN_WG_BLOCK_KEYS;
  static constexpr int KS = ATTN_WS_BWD_K_STAGES, VS = ATTN_WS_BWD_V_STAGES;
  static constexpr uint32_t Q_BYTES = BM * HD * 2, KV_BYTES = BN * HD * 2, B_BYTES = BB * HD * 2;
  static constexpr uint32_t K_OFF = 2 * Q_BYTES;  // after Q and dO
  static constexpr uint32_t V_OFF = K_OFF + KS * KV_BYTES;
  static constexpr uint32_t B_OFF = V_OFF + VS * KV_BYTES;
  static constexpr uint32_t F_OFF = B_OFF + 4 * B_BYTES;
  static constexpr uint32_t F_BYTES = 64 * BB * 4;  // one f32 [64][BB] side buffer
  static constexpr uint32_t BAR_OFF = F_OFF + 4 * F_BYTES;
  static constexpr uint32_t SMEM = BAR_OFF + ATTN_WS_BAR_BYTES + ATTN_WG_ALIGN;
  static_assert(HD == 128, "the warp-specialised drafter backward takes head_dim 128");
  static_assert(BM == 128 && BN % 16 == 0 && BB == 16, "tile shapes of the wgmma wrappers");
  static_assert((1 + 2 * KS + 2 * VS) * 8 <= ATTN_WS_BAR_BYTES, "the mbarriers fit their slots");
  static_assert(KS >= 2 && VS >= 1, "K_{t-1} and K_t are in flight together");
  static_assert(B_BYTES % 1024 == 0 && KV_BYTES % 1024 == 0, "tiles start on swizzle atoms");
  static_assert(SMEM <= 232448, "over the opt-in shared memory of a CTA");
};

template <int HD>
__device__ __forceinline__ void draft_bwd_q_ws(const CUtensorMap* map_q, const CUtensorMap* map_do,
                                               const CUtensorMap* map_kb, const CUtensorMap* map_vb,
                                               const CUtensorMap* map_k, const CUtensorMap* map_v,
                                               const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                                               const float* __restrict__ lse, const float* __restrict__ dsum,
                                               bf16* __restrict__ dq, bf16* __restrict__ dkb,
                                               bf16* __restrict__ dvb, const int* __restrict__ anchors,
                                               const int* __restrict__ ctx_start, int num_blocks, int block_size,
                                               index_t ctx_rows, int heads, int kv_heads, float scale, int window,
                                               unsigned cta) {
  using G = WsBwdQGeo<HD>;
  constexpr int BM = G::BM, BN = G::BN, KS = G::KS, VS = G::VS, BB = G::BB;
  (void)ctx_rows;  // every row read is inside a block's range, which the launcher checked
  require_launch(ATTN_WS_THREADS, G::SMEM);
  if (window < 0 || block_size < 1 || block_size > BB || kv_heads < 1 || heads % kv_heads != 0 ||
      block_size * (heads / kv_heads) > 64 || ((long long)num_blocks + 1) * block_size >= INT_MAX) {
    __trap();
  }
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + (ATTN_WG_ALIGN - 1)) & ~(uint32_t)(ATTN_WG_ALIGN - 1);
  unsigned char* const base_ptr = smem_raw + (base - smem_u32(smem_raw));
  const uint32_t sQ = base, sO = base + G::Q_BYTES;
  auto sK = [&](int st) { return base + G::K_OFF + (uint32_t)st * G::KV_BYTES; };
  auto sV = [&](int st) { return base + G::V_OFF + (uint32_t)st * G::KV_BYTES; };
  // Block keys of consumer w: K at sB(w, 0), V at sB(w, 1), 16-row swizzled tiles.
  auto sB = [&](int w, int kv) { return base + G::B_OFF + (uint32_t)(2 * w + kv) * G::B_BYTES; };
  // f32 P (kind 0) and dS (kind 1) of consumer w's block keys, [64 rows][BB keys].
  auto fbuf = [&](int w, int kind) {
    return reinterpret_cast<float*>(base_ptr + G::F_OFF + (uint32_t)(2 * w + kind) * G::F_BYTES);
  };
  const uint32_t q_full = base + G::BAR_OFF;
  auto k_full = [&](int st) { return q_full + 8u * (uint32_t)(1 + st); };
  auto k_empty = [&](int st) { return q_full + 8u * (uint32_t)(1 + KS + st); };
  auto v_full = [&](int st) { return q_full + 8u * (uint32_t)(1 + 2 * KS + st); };
  auto v_empty = [&](int st) { return q_full + 8u * (uint32_t)(1 + 2 * KS + VS + st); };

  const int wg = warpgroup_index();
  const int Gq = heads / kv_heads, bs = block_size, M = bs * Gq;
  const int g = (int)(cta % (unsigned)kv_heads);
  const index_t npairs = ((index_t)num_blocks + 1) / 2;
  const index_t pair = npairs - 1 - (index_t)(cta / (unsigned)kv_heads);
  const index_t qw = (index_t)heads * HD, kw = (index_t)kv_heads * HD;

  // Both blocks' context ranges (section 3's).
  index_t a_w[2], cs_w[2], Tlo;
  int n_kt, r0lo, r0hi, r1lo, r1hi;
  draft_pair_ranges<BN>(pair, num_blocks, anchors, ctx_start, window, a_w, cs_w, Tlo, n_kt, r0lo, r0hi, r1lo, r1hi);

  ws_draft_init_rings(q_full, KS, VS);

  if (wg == 0) {
    // ---- producer ----
    ws_setmaxnreg_dec<ATTN_WS_PRODUCER_REGS>();
    const int t = threadIdx.x;
    if (t == 0) {
      prefetch_tensor_map(map_q);
      prefetch_tensor_map(map_do);
      prefetch_tensor_map(map_kb);
      prefetch_tensor_map(map_vb);
      prefetch_tensor_map(map_k);
      prefetch_tensor_map(map_v);
    }
    // Q, dO and both blocks' keys, once, on q_full (section 6's Q and keys, with dO beside Q).
    const bool live[2] = {2 * pair < num_blocks && a_w[0] >= 0, 2 * pair + 1 < num_blocks && a_w[1] >= 0};
    ws_draft_load_queries<HD, BM, BB, true>(live, pair, bs, M, Gq, g, sQ, sO, sB(0, 0), map_q, map_do, map_kb, map_vb,
                                            q_full, t);
    // The context tiles as ws_draft_fill does it, spelled out here: with the helper the H200 ran
    // this kernel 2.5% slower (6.065 against 5.916 ms in one bench call; the forward, which keeps
    // the helper, did not change), and this form compiles to the instructions it had before.
    auto clean = [&](int u0) {
      const int u1 = u0 + BN;
      const bool in0 = u0 >= r0lo && u1 <= r0hi, in1 = u0 >= r1lo && u1 <= r1hi;
      const bool joined = r0lo < r0hi && r1lo < r1hi && r1lo <= r0hi && r0lo <= r1hi;
      return in0 || in1 || (joined && u0 >= min(r0lo, r1lo) && u1 <= max(r0hi, r1hi));
    };
    auto fill = [&](uint32_t dst, const CUtensorMap* map, const bf16* src, int it, uint32_t full, uint32_t empty,
                    uint32_t parity) {
      const int u0 = it * BN;
      if (clean(u0)) {
        if (t == 0) {
          mbar_wait(empty, parity);
          mbar_arrive_expect_tx(full, G::KV_BYTES);
#pragma unroll
          for (int p = 0; p < HD / 64; ++p)
            tma_load_2d(dst + (uint32_t)(p * BN * 128), map, full, g * HD + p * 64, (int)(Tlo + u0));
        }
        return;
      }
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
      mbar_wait(empty, parity);
      const bf16* rows0 = src + (Tlo + u0) * kw + (index_t)g * HD;
      ws_load_rows_at<HD, BN>(dst, src, t, [&](int i) -> const bf16* {
        const int u = u0 + i;
        return (u >= r0lo && u < r0hi) || (u >= r1lo && u < r1hi) ? rows0 + (index_t)i * kw : nullptr;
      });
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
      if (t == 0) mbar_arrive(full);
    };
    for (int it = 0; it < n_kt; ++it) {
      const int ks = it % KS, vs = it % VS;
      fill(sK(ks), map_k, kc, it, k_full(ks), k_empty(ks), (uint32_t)((it / KS) & 1) ^ 1u);
      fill(sV(vs), map_v, vc, it, v_full(vs), v_empty(vs), (uint32_t)((it / VS) & 1) ^ 1u);
    }
    return;
  }

  // ---- consumers ----
  ws_setmaxnreg_inc<ATTN_WS_CONSUMER_REGS>();
  const int cw = wg - 1, lane = threadIdx.x & 31, wi = (threadIdx.x >> 5) & 3;
  const int gr = lane >> 2;
  const DraftBwdQRows rows = draft_bwd_q_rows(cw, pair, a_w, cs_w, Tlo, wi, gr, bs, M, Gq, g, heads, window, lse, dsum);

  float acc[HD / 8][4];  // dQ
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  const float sl2 = scale * LOG2E;
  float s[BN / 8][4], dp[BN / 8][4];
  uint32_t pa[BN / 16][4];
  const uint64_t dqd = wg_desc(sQ + (uint32_t)(cw * 64 * 128), 16, 1024);
  const uint64_t dod = wg_desc(sO + (uint32_t)(cw * 64 * 128), 16, 1024);
  const uint64_t dk = wg_desc(sK(0), 16, 1024);         // K-major: S = Q K^T
  const uint64_t dkn = wg_desc(sK(0), BN * 128, 1024);  // N-major: dQ += dS K
  const uint64_t dv = wg_desc(sV(0), 16, 1024);         // K-major: dP = dO V^T
  auto issue_sdp = [&](int it) {
    const uint64_t dks = wg_desc_at(dk, (uint32_t)(it % KS) * G::KV_BYTES);
    const uint64_t dvs = wg_desc_at(dv, (uint32_t)(it % VS) * G::KV_BYTES);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t off = (uint32_t)((kk & 3) * 32);
      wg_abt<BN>(s, wg_desc_at(dqd, (uint32_t)((kk >> 2) * BM * 128) + off),
                 wg_desc_at(dks, (uint32_t)((kk >> 2) * BN * 128) + off), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t off = (uint32_t)((kk & 3) * 32);
      wg_abt<BN>(dp, wg_desc_at(dod, (uint32_t)((kk >> 2) * BM * 128) + off),
                 wg_desc_at(dvs, (uint32_t)((kk >> 2) * BN * 128) + off), kk > 0);
    }
    wgmma_commit();
  };
  auto issue_dq = [&](int it) {
    const uint64_t dks = wg_desc_at(dkn, (uint32_t)(it % KS) * G::KV_BYTES);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wg_pb<HD>(acc, pa[kk], wg_desc_at(dks, (uint32_t)(kk * 16 * 128)), 1);
    wgmma_commit();
  };
  // dS of context tile it into s (f32; 0 where masked).
  auto grad_s = [&](int it) {
    const int k0 = it * BN, k1 = k0 + BN - 1;  // relative to Tlo
    const bool masked = !(k0 >= rows.wlo && k1 <= rows.whi);
    ds_tile<BN / 8>(s, dp, sl2, rows.lse2, rows.dsm, scale, masked, lane, [&](int hh, int col) {
      const int tt = k0 + col;
      return tt >= rows.vlo[hh] && tt <= rows.vhi[hh];
    });
  };
  auto pack_ds = [&]() {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = pack_op(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = pack_op(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = pack_op(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = pack_op(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  };
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  const int my_turn = 2 + cw, their_turn = 3 - cw;
  auto turn_wait = [&]() {
    if (ATTN_WS_PINGPONG) ws_turn_wait(my_turn);
  };
  auto turn_pass = [&](bool last) {
    if (ATTN_WS_PINGPONG && !(last && cw == 1)) ws_turn_pass(their_turn);
  };
  if (ATTN_WS_PINGPONG && cw == 1) ws_turn_pass(their_turn);

  mbar_wait(q_full, 0u);
  {  // context tile 0 (with Q, dO and the block keys)
    mbar_wait(k_full(0), 0u);
    mbar_wait(v_full(0), 0u);
    fence_proxy_async();
    turn_wait();
    wgmma_fence();
    issue_sdp(0);
    turn_pass(false);
    wgmma_wait<0>();
    wg_fence_regs(s);
    wg_fence_regs(dp);
    release(v_empty(0));
    grad_s(0);
    pack_ds();
  }
  for (int it = 1; it < n_kt; ++it) {
    const int ks = it % KS, vs = it % VS;
    mbar_wait(k_full(ks), (uint32_t)(it / KS) & 1u);
    mbar_wait(v_full(vs), (uint32_t)(it / VS) & 1u);
    fence_proxy_async();
    wg_fence_regs(acc);
    turn_wait();
    wgmma_fence();
    issue_sdp(it);
    issue_dq(it - 1);
    turn_pass(false);
    wgmma_wait<1>();  // S_it and dP_it (dQ += dS_{it-1} K_{it-1} may still run)
    wg_fence_regs(s);
    wg_fence_regs(dp);
    release(v_empty(vs));
    grad_s(it);
    wgmma_wait<0>();
    wg_fence_regs(acc);
    release(k_empty((it - 1) % KS));
    pack_ds();
  }
  {  // the block's own keys, issued with the last context tile's dQ product
    float sb[BB / 8][4], dpb[BB / 8][4];
    wg_fence_regs(acc);
    turn_wait();
    wgmma_fence();
    const uint64_t dkb_d = wg_desc(sB(cw, 0), 16, 1024);
    const uint64_t dvb_d = wg_desc(sB(cw, 1), 16, 1024);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t off = (uint32_t)((kk & 3) * 32);
      wg_abt<BB>(sb, wg_desc_at(dqd, (uint32_t)((kk >> 2) * BM * 128) + off),
                 wg_desc_at(dkb_d, (uint32_t)((kk >> 2) * BB * 128) + off), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t off = (uint32_t)((kk & 3) * 32);
      wg_abt<BB>(dpb, wg_desc_at(dod, (uint32_t)((kk >> 2) * BM * 128) + off),
                 wg_desc_at(dvb_d, (uint32_t)((kk >> 2) * BB * 128) + off), kk > 0);
    }
    wgmma_commit();
    issue_dq(n_kt - 1);
    turn_pass(true);
    wgmma_wait<1>();
    wg_fence_regs(sb);
    wg_fence_regs(dpb);
    draft_bwd_block_tile<BB>(sb, dpb, rows, sl2, scale, bs, window, lane, fbuf(cw, 0), fbuf(cw, 1));
    wgmma_wait<0>();
    wg_fence_regs(acc);
    release(k_empty((n_kt - 1) % KS));
    uint32_t pb[4];
    pb[0] = pack_op(sb[0][0], sb[0][1]);
    pb[1] = pack_op(sb[0][2], sb[0][3]);
    pb[2] = pack_op(sb[1][0], sb[1][1]);
    pb[3] = pack_op(sb[1][2], sb[1][3]);
    wgmma_fence();
    wg_pb<HD>(acc, pb, wg_desc(sB(cw, 0), BB * 128, 1024), 1);
    wgmma_commit();
    wgmma_wait<0>();
    wg_fence_regs(acc);
  }
  // The consumer's own 128 threads (named barrier 4 + c): its side buffers are complete.
  asm volatile("bar.sync %0, 128;\n" ::"r"(4 + cw) : "memory");
  const index_t j = rows.j;
  if (j >= num_blocks) return;
  const bool padded = rows.a < 0;  // exact zeros, never NaN
  draft_bwd_block_key_grads<HD, BM, BB>(base_ptr, base_ptr + G::Q_BYTES, fbuf(cw, 0), fbuf(cw, 1), cw,
                                        threadIdx.x & 127, bs, M, j, g, kw, padded, dkb, dvb);
  // Every thread of the consumer is done reading its Q rows: dQ is staged through them.
  asm volatile("bar.sync %0, 128;\n" ::"r"(4 + cw) : "memory");
  draft_bwd_q_store<HD, BM>(acc, base_ptr, cw, wi, gr, lane, padded, M, bs, j, g, Gq, qw, dq);
}


// The one-launch drafter backward (sections 7 and 8 in one grid; see attn_draft_bwd_ws_bf16_hd128).
template <int HD>
__device__ __forceinline__ void draft_bwd_ws_fused(
    const CUtensorMap* map_q, const CUtensorMap* map_do, const CUtensorMap* map_kb, const CUtensorMap* map_vb,
    const CUtensorMap* map_k, const CUtensorMap* map_v, const CUtensorMap* map_kc_rows, const CUtensorMap* map_vc_rows,
    const bf16* __restrict__ kc, const bf16* __restrict__ vc, const float* __restrict__ lse,
    const float* __restrict__ dsum, bf16* __restrict__ dq, bf16* __restrict__ dkb, bf16* __restrict__ dvb,
    bf16* __restrict__ dkc, bf16* __restrict__ dvc, const int* __restrict__ anchors,
    const int* __restrict__ ctx_start, int num_blocks, int block_size, index_t ctx_rows, int heads, int kv_heads,
    float scale, const int* __restrict__ ctx_block_begin, const int* __restrict__ ctx_block_end, int window) {
  const long long n_kv = (ctx_rows + ATTN_WG_BWD_KV_ROWS - 1) / ATTN_WG_BWD_KV_ROWS * kv_heads;
  if (kv_heads < 1 || (long long)gridDim.x != n_kv + ((long long)num_blocks + 1) / 2 * kv_heads) __trap();
  if ((long long)blockIdx.x < n_kv) {
    draft_bwd_kv_ws<HD>(map_q, map_do, map_kc_rows, map_vc_rows, lse, dsum, dkc, dvc, anchors, ctx_start,
                               num_blocks, block_size, ctx_rows, heads, kv_heads, scale, ctx_block_begin,
                               ctx_block_end, window, blockIdx.x);
  } else {
    draft_bwd_q_ws<HD>(map_q, map_do, map_kb, map_vb, map_k, map_v, kc, vc, lse, dsum, dq, dkb, dvb, anchors,
                       ctx_start, num_blocks, block_size, ctx_rows, heads, kv_heads, scale, window,
                       (unsigned)(blockIdx.x - n_kv));
  }
}

}  // namespace attn

#define ATTN_WG_EXPORT(D)                                                                                     \
  extern "C" __global__ void __launch_bounds__(ATTN_WG_THREADS, 1) attn_causal_fwd_wg_bf16_hd##D(            \
      const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* o,             \
      const int* seq_starts, int num_seqs, long long rows, int heads, int kv_heads, float scale) {            \
    attn::causal_fwd_wg<D>(q, k, v, o, seq_starts, num_seqs, rows, heads, kv_heads, scale);                 \
  }

ATTN_WG_EXPORT(128)
ATTN_WG_EXPORT(256)

// The warp-specialised causal forward (section 5): section 1's arguments, with TMA descriptors of
// q, k and v (bf16 [rows, heads * HD] and [rows, kv_heads * HD], boxes of 64 columns x 128 / KEYS
// rows, 128-byte swizzle) in place of q; k and v also by pointer for cp.async-filled tiles; the
// optional output gate (gate, gate_stride, gated: section 5's header).
#define ATTN_WS_EXPORT(D)                                                                                     \
  extern "C" __global__ void __launch_bounds__(ATTN_WS_THREADS, 1) attn_causal_fwd_ws_bf16_hd##D(            \
      const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,                  \
      const __grid_constant__ CUtensorMap map_v, const __nv_bfloat16* k, const __nv_bfloat16* v,            \
      __nv_bfloat16* o, const __nv_bfloat16* gate, long long gate_stride, int gated, const int* seq_starts,  \
      int num_seqs, long long rows, int heads, int kv_heads, float scale) {                                  \
    attn::causal_fwd_ws<D>(&map_q, &map_k, &map_v, k, v, o, gate, gate_stride, gated, seq_starts, num_seqs, \
                           rows, heads, kv_heads, scale);                                                     \
  }
ATTN_WS_EXPORT(128)
ATTN_WS_EXPORT(256)

// The drafter forward at head_dim 128 (both drafter recipes); launch above draft_fwd_wg.
extern "C" __global__ void __launch_bounds__(ATTN_WG_THREADS, 1) attn_draft_fwd_wg_bf16_hd128(
    const __nv_bfloat16* q, const __nv_bfloat16* kc, const __nv_bfloat16* vc, const __nv_bfloat16* kb,
    const __nv_bfloat16* vb, __nv_bfloat16* o, float* lse, const int* anchors, const int* ctx_start, int num_blocks,
    int block_size, long long ctx_rows, int heads, int kv_heads, float scale, int window) {
  attn::draft_fwd_wg<128>(q, kc, vc, kb, vb, o, lse, anchors, ctx_start, num_blocks, block_size, ctx_rows, heads,
                          kv_heads, scale, window);
}

// The warp-specialised drafter forward at head_dim 128 (section 6): section 2's arguments with TMA
// descriptors of q, kb, vb, kc and vc in front of them in place of the q, kb and vb pointers.
extern "C" __global__ void __launch_bounds__(ATTN_WS_THREADS, 1) attn_draft_fwd_ws_bf16_hd128(
    const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_kb,
    const __grid_constant__ CUtensorMap map_vb, const __grid_constant__ CUtensorMap map_k,
    const __grid_constant__ CUtensorMap map_v, const __nv_bfloat16* kc, const __nv_bfloat16* vc, __nv_bfloat16* o,
    float* lse, const int* anchors, const int* ctx_start, int num_blocks, int block_size, long long ctx_rows,
    int heads, int kv_heads, float scale, int window) {
  attn::draft_fwd_ws<128>(&map_q, &map_kb, &map_vb, &map_k, &map_v, kc, vc, o, lse, anchors, ctx_start, num_blocks,
                          block_size, ctx_rows, heads, kv_heads, scale, window);
}

// The drafter backward over queries at head_dim 128; launch above draft_bwd_q_wg.
extern "C" __global__ void __launch_bounds__(ATTN_WG_THREADS, 1) attn_draft_bwd_q_wg_bf16_hd128(
    const __nv_bfloat16* q, const __nv_bfloat16* kc, const __nv_bfloat16* vc, const __nv_bfloat16* kb,
    const __nv_bfloat16* vb, const float* lse, const float* dsum, const __nv_bfloat16* d_o, __nv_bfloat16* dq,
    __nv_bfloat16* dkb, __nv_bfloat16* dvb, const int* anchors, const int* ctx_start, int num_blocks, int block_size,
    long long ctx_rows, int heads, int kv_heads, float scale, int window) {
  attn::draft_bwd_q_wg<128>(q, kc, vc, kb, vb, lse, dsum, d_o, dq, dkb, dvb, anchors, ctx_start, num_blocks,
                            block_size, ctx_rows, heads, kv_heads, scale, window);
}

// The drafter backward over context keys at head_dim 128; launch above draft_bwd_kv_wg.
extern "C" __global__ void __launch_bounds__(ATTN_WG_THREADS, 1) attn_draft_bwd_kv_wg_bf16_hd128(
    const __nv_bfloat16* q, const __nv_bfloat16* kc, const __nv_bfloat16* vc, const float* lse, const float* dsum,
    const __nv_bfloat16* d_o, __nv_bfloat16* dkc, __nv_bfloat16* dvc, const int* anchors, const int* ctx_start,
    int num_blocks, int block_size, long long ctx_rows, int heads, int kv_heads, float scale,
    const int* ctx_block_begin, const int* ctx_block_end, int window) {
  attn::draft_bwd_kv_wg<128>(q, kc, vc, lse, dsum, d_o, dkc, dvc, anchors, ctx_start, num_blocks, block_size,
                             ctx_rows, heads, kv_heads, scale, ctx_block_begin, ctx_block_end, window);
}

// Both warp-specialised drafter backward kernels in one launch (sections 7 and 8): CTAs 0 ..
// n_kv - 1 are section 7's (n_kv = ceil(ctx_rows / 128) * kv_heads, the heavier ones, first),
// the rest section 8's, so that the query-side CTAs fill the context-key kernel's last wave.
// Arguments: both kernels' (kc_rows: kc and vc in boxes of 128 rows for section 7; map_k and
// map_v: in boxes of ATTN_WS_BWD_KEYS rows for section 8). Dynamic smem: the larger of the two.
// Measured (H200, the bench's 2048 blocks x 16, 32/8 heads, full layer, prep kernel included):
// sections 3 and 4 (cp.async, a CTA barrier per tile) 10.58 ms, of which 4.33 the query side and
// 6.13 the context-key side (ncu); sections 8 and 7 as two launches 6.12 ms (2.72 + 3.12); one
// launch 5.87 ms; with section 7's per-thread arrivals (racecheck-clean) 5.92-5.95 ms, against
// FlexAttention's 7.71 ms in the same call (sliding layer: 7.03 against 8.96).
extern "C" __global__ void __launch_bounds__(ATTN_WS_THREADS, 1) attn_draft_bwd_ws_bf16_hd128(
    const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_do,
    const __grid_constant__ CUtensorMap map_kb, const __grid_constant__ CUtensorMap map_vb,
    const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v,
    const __grid_constant__ CUtensorMap map_kc_rows, const __grid_constant__ CUtensorMap map_vc_rows,
    const __nv_bfloat16* kc, const __nv_bfloat16* vc, const float* lse, const float* dsum, __nv_bfloat16* dq,
    __nv_bfloat16* dkb, __nv_bfloat16* dvb, __nv_bfloat16* dkc, __nv_bfloat16* dvc, const int* anchors,
    const int* ctx_start, int num_blocks, int block_size, long long ctx_rows, int heads, int kv_heads, float scale,
    const int* ctx_block_begin, const int* ctx_block_end, int window) {
  attn::draft_bwd_ws_fused<128>(&map_q, &map_do, &map_kb, &map_vb, &map_k, &map_v, &map_kc_rows, &map_vc_rows, kc, vc,
                                lse, dsum, dq, dkb, dvb, dkc, dvc, anchors, ctx_start, num_blocks, block_size, ctx_rows,
                                heads, kv_heads, scale, ctx_block_begin, ctx_block_end, window);
}

