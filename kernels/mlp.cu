// mlp.cu: the first half of the target's gated MLP as one kernel: the gate | up projection and
// SwiGLU, act = silu(x Wg^T) * (x Wu^T), without writing the [rows, 2 * inter] projection.
// CPU reference: src/backend/cpu.rs gemm with Gemm::linear(rows, 2 * inter, k), then swiglu_fwd.
//
// Math:     g[r, n] = bf16(sum_c x[r, c] Wg[n, c]), u[r, n] = bf16(sum_c x[r, c] Wu[n, c]) (f32
//           products and sums, one RNE rounding each, as the GEMM's bf16 output), then
//           act[r, n] = bf16(silu(g) * u) with swiglu.cu's operations in its order (__fdiv_rn,
//           __fadd_rn, __fmul_rn, expf). So act equals swiglu_fwd of this kernel's own g and u bit
//           for bit; against cuBLASLt's GEMM + swiglu_fwd only the f32 summation order differs
//           (g and u within a bf16 ulp).
// Layouts:  x [rows, k]; W [2 * inter, k] = [Wg; Wu] (gate_proj's rows, then up_proj's, as the
//           flat parameter buffer holds them); act [rows, inter]. bf16, row-major, contiguous.
// Symbol:   mlp_swiglu_wgmma_bf16. Needs k % 8 == 0 and inter % 8 == 0 (TMA row pitch a multiple
//           of 16 bytes; whole bf16x2 stores), x and W 16-byte aligned, act 4-byte aligned. Any
//           rows >= 1. src/backend/cuda/mlp.rs checks all of it and falls back to the GEMM + swiglu.
//
// In detail: fc.cu's fc_wgmma_bf16 (read its header first), with one change of tile.
//   Tile: 128 rows x MLP_BN (128) output columns. Its stage holds x's 128 x 64 box and two W boxes
//     of 128 x 64: gate rows n0 .. n0 + 127 and up rows inter + n0 .. inter + n0 + 127, one above
//     the other. The two boxes make one 256-row K-major tile (each is a whole number of 8-row
//     swizzle atoms), so one wgmma.m64n256k16 per k16 step gives each consumer warpgroup its 64
//     rows' gate columns (accumulators d[0..15]) and up columns (d[16..31]) of the same outputs.
//     So a thread holds g and u of the same output column: d[j][e] and d[j + 16][e].
//   Edges: in the last column block (inter % 128 != 0) the gate box runs on into W's up rows and
//     the up box past W's end (TMA reads those as zeros); both land only in columns >= inter, which
//     the epilogue does not store. Ragged rows and K: zero-filled by TMA, masked in the epilogue.
//   Producer, ring (4 stages of 48 KB), persistent walk in groups of 16 row blocks: as fc.cu.
//   Epilogue: g and u rounded to bf16 (as the GEMM's output), SwiGLU in f32, one bf16x2 store per
//     pair of columns: rows * inter * 2 bytes written instead of the GEMM's rows * inter * 4, and
//     no second pass reading them back.
//
// Launch:   grid any >= 1 (mlp.rs: min(ceil(rows / 128) * ceil(inter / 128), SM count)), block
//           FC_THREADS (384, checked: traps otherwise), dynamic smem MLP_SMEM_BYTES (197,696,
//           checked). Arguments: two CUtensorMap by value (__grid_constant__), built by mlp.rs:
//           x as {k, rows} with box {64, 128}, W as {k, 2 * inter} with box {64, 128}; bf16,
//           128-byte swizzle, OOB fill zero.
// Bytes:    >= 2 * (rows * k + 2 * inter * k + rows * inter).
// FLOPs:    4 * rows * inter * k (the two projections) + ~5 per output.
// Bound:    tensor-core compute at the recipes' shapes (8B: 12288 x 2 * 12288 x 4096; 27B:
//           12288 x 2 * 17408 x 5120). Target: the cuBLASLt GEMM's time alone, so the SwiGLU pass
//           (~0.45 ms a layer at these shapes) is saved whole; benches/kernels.rs ("mlp") times
//           both forms side by side.
// Measured (H100, the bench's mlp group): 0.875x the two-step form's throughput at the 8B shape
//           (3.815 against 3.338 ms), 0.892x at the 27B shape (6.872 against 6.131 ms); output
//           equal to cuBLASLt + swiglu_fwd bit for bit on every test case. The epilogue stores
//           from registers before the next tile's MMAs start (as fc.cu), which at 64-80 k-blocks
//           a tile costs more than the saved pass: hence not the default. The next step is an
//           epilogue that overlaps the next tile's main loop.
#include "common.cuh"
#include "launch.cuh"
#include "tma.cuh"
#include "swiglu.cuh"  // the formula swiglu.cu runs, so the same bits
#include "tma_gemm.cuh"  // the ring, roles and tile walk shared with fc.cu
#include "wgmma.cuh"

namespace mlp {

constexpr int BM = FC_BM;              // output rows per tile (2 consumer warpgroups x 64)
constexpr int BN = MLP_BN;             // output columns per tile; 2 * BN GEMM columns
constexpr int BK = FC_BK;              // K per stage: one 128-byte swizzle row
constexpr int STAGES = FC_STAGES;
constexpr int WG_ROWS = 64;
constexpr int THREADS = FC_THREADS;    // producer warpgroup + 2 consumer warpgroups
constexpr int NT = 2 * BN / 8;         // n8 accumulator blocks per thread: gate then up
constexpr uint32_t A_STAGE_BYTES = BM * BK * 2;       // 16 KB
constexpr uint32_t B_HALF_BYTES = BN * BK * 2;        // 16 KB: one W box (gate or up)
constexpr uint32_t B_STAGE_BYTES = 2 * B_HALF_BYTES;  // 32 KB
constexpr uint32_t STAGE_TX_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
constexpr uint32_t SWIZZLE_ALIGN = FC_SWIZZLE_ALIGN;
constexpr uint32_t SMEM_BYTES = MLP_SMEM_BYTES;
static_assert(SMEM_BYTES == STAGES * STAGE_TX_BYTES + 2 * STAGES * 8 + SWIZZLE_ALIGN,
              "launch.cuh MLP_SMEM_BYTES must cover the ring, its barriers and the alignment slack");
static_assert(B_HALF_BYTES % SWIZZLE_ALIGN == 0 && A_STAGE_BYTES % SWIZZLE_ALIGN == 0,
              "every box must start on a swizzle atom");
static_assert(BM == 2 * WG_ROWS && THREADS == 3 * 128 && 2 * BN == 256, "one m64n256 wgmma per k16 step");

// act for the output pair whose gate accumulators are g[e], g[e + 1] and up ones u[e], u[e + 1]:
// g and u rounded to bf16 first (the GEMM's output), SwiGLU, one bf16x2 of the results.
__device__ __forceinline__ uint32_t swiglu_pair(const float (&g)[4], const float (&u)[4], int e) {
  auto round_bf16 = [](float f) { return bf16_to_f32(f32_to_bf16_rne(f)); };
  return pack_bf16x2_rne(swiglu_fwd_f32(round_bf16(g[e]), round_bf16(u[e])),
                         swiglu_fwd_f32(round_bf16(g[e + 1]), round_bf16(u[e + 1])));
}

}  // namespace mlp

extern "C" __global__ void __launch_bounds__(mlp::THREADS, 1)
    mlp_swiglu_wgmma_bf16(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                          __nv_bfloat16* __restrict__ act, int rows, int inter, int k) {
  using namespace mlp;
  using namespace tma_gemm;
  if (blockDim.x != THREADS || blockDim.y != 1 || blockDim.z != 1 || dynamic_smem_bytes() < SMEM_BYTES) {
    __trap();
  }
  if (rows <= 0 || inter <= 0 || k <= 0) return;
  extern __shared__ unsigned char mlp_smem[];
  const uint32_t base = (smem_u32(mlp_smem) + (SWIZZLE_ALIGN - 1)) & ~(SWIZZLE_ALIGN - 1);
  const uint32_t a_smem = base;                              // STAGES x 16 KB of x
  const uint32_t b_smem = base + STAGES * A_STAGE_BYTES;     // STAGES x (16 KB gate + 16 KB up)
  const Ring<STAGES> ring{b_smem + STAGES * B_STAGE_BYTES};  // full[STAGES], empty[STAGES]

  const int num_m = static_cast<int>((static_cast<long long>(rows) + BM - 1) / BM);
  const int num_n = static_cast<int>((static_cast<long long>(inter) + BN - 1) / BN);
  const int num_k = static_cast<int>((static_cast<long long>(k) + BK - 1) / BK);
  const long long num_tiles = static_cast<long long>(num_m) * num_n;

  ring.init();
  __syncthreads();  // the last block-wide barrier: the roles below never meet again

  const int warpgroup = attn::warpgroup_index();
  if (warpgroup == 0) {
    // ---- producer: one thread; x's box, then the gate box and the up box under it ----
    if (threadIdx.x == 0) {
      prefetch_tensor_map(&map_x);
      prefetch_tensor_map(&map_w);
      produce<STAGES, BK>(ring, num_tiles, num_m, num_n, num_k, STAGE_TX_BYTES, [&](int stage, int k0, TileCoord c) {
        const uint32_t b = b_smem + stage * B_STAGE_BYTES;
        const int n0 = c.n_blk * BN;
        tma_load_2d(a_smem + stage * A_STAGE_BYTES, &map_x, ring.full(stage), k0, c.m_blk * BM);
        tma_load_2d(b, &map_w, ring.full(stage), k0, n0);
        tma_load_2d(b + B_HALF_BYTES, &map_w, ring.full(stage), k0, inter + n0);
      });
    }
    return;
  }

  // ---- consumers: warpgroup 1 + c owns tile rows 64c .. 64c + 63 ----
  const int cw = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  // K-major tiles of 128-byte rows: SBO 1024 (8-row groups), LBO unused (16, as CUTLASS sets it).
  const uint64_t desc_a0 = attn::wg_desc(a_smem + static_cast<uint32_t>(cw) * (WG_ROWS * BK * 2), 16, 1024);
  const uint64_t desc_b0 = attn::wg_desc(b_smem, 16, 1024);

  float acc[NT][4];
  int stage = 0;
  uint32_t phase = 0;
  for (long long t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const TileCoord c = tile_coord(t, num_m, num_n);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    }
    consume_tile(
        ring, num_k, lane, stage, phase,
        [&](int s) {
          const uint64_t da = attn::wg_desc_at(desc_a0, static_cast<uint32_t>(s) * A_STAGE_BYTES);
          const uint64_t db = attn::wg_desc_at(desc_b0, static_cast<uint32_t>(s) * B_STAGE_BYTES);
#pragma unroll
          for (int kk = 0; kk < BK / 16; ++kk) {
            attn::wg_abt<2 * BN>(acc, da + 2 * kk, db + 2 * kk, 1);  // +32 bytes of K per k16 step
          }
        },
        [&] { attn::wg_fence_regs(acc); });

    // ---- epilogue: gate block j and up block j + NT / 2 hold the same output columns ----
    const long long r0 = static_cast<long long>(c.m_blk) * BM + cw * WG_ROWS + warp * 16 + lane / 4;
    const long long col0 = static_cast<long long>(c.n_blk) * BN + 2 * (lane % 4);
    const bool row0_ok = r0 < rows;
    const bool row1_ok = r0 + 8 < rows;
    __nv_bfloat16* y0 = act + r0 * inter + col0;
    __nv_bfloat16* y1 = y0 + 8LL * inter;
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
      // inter % 8 == 0 and col0 even: a pair is wholly inside the row or wholly outside.
      if (col0 + 8 * j < inter) {
        if (row0_ok) *reinterpret_cast<uint32_t*>(y0 + 8 * j) = swiglu_pair(acc[j], acc[j + NT / 2], 0);
        if (row1_ok) *reinterpret_cast<uint32_t*>(y1 + 8 * j) = swiglu_pair(acc[j], acc[j + NT / 2], 2);
      }
    }
  }
}
