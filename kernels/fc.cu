// fc.cu: the FC projection of the drafter's context path, y = x W^T (DFLASH.md section 2), as a
// Hopper GEMM of our own: TMA loads into a 4-stage shared-memory ring, wgmma on two consumer
// warpgroups, one producer thread. Plus a plain tiled kernel for any shape and alignment.
// CPU reference: src/backend/cpu.rs gemm with Gemm::linear(rows, h, k).
//
// Math:     y[r, n] = bf16( sum_{c < k} x[r, c] * W[n, c] ), products and sums in f32, one RNE
//           rounding per output (common.cuh's f32_to_bf16_bits_rne, as the CPU). Only the f32
//           summation order differs from the CPU (wgmma's internal order; the simple kernel sums
//           c = 0, 1, 2, ... with FMAs), so outputs agree to one bf16 ulp, not bit for bit.
// Layouts:  x [rows, k], W [h, k], y [rows, h]; bf16, row-major, contiguous (W is the FC weight
//           somewhere inside the flat parameter buffer: the launcher passes its address).
// Symbols and when each runs (src/backend/cuda/fc.rs picks; FcPath forces one for tests/benches):
//   fc_wgmma_bf16   the fast path. Needs k % 8 == 0 and h % 8 == 0 (TMA row pitch a multiple of 16
//                   bytes; whole bf16x2 stores), x and W 16-byte aligned (TMA), y 4-byte aligned.
//                   Any rows >= 1: ragged M, N and K edges are zero-filled by TMA (out-of-bounds
//                   box elements read as +0) and masked in the epilogue.
//   fc_simple_bf16  the fallback for everything else (misaligned W offsets, odd k or h): 64 x 64
//                   output tiles, scalar loads, f32 FMAs. Correct for any shape; slow (CUDA cores).
//
// fc_wgmma_bf16 in detail.
//   Tile: BM x BN x BK = 128 x 256 x 64 per CTA; 384 threads = 3 warpgroups:
//     warpgroup 0  producer: one thread issues, per k-block, two TMA boxes (x: 64 x 128, W: 64 x
//                  256 elements, 128-byte swizzle) into the next ring stage and arms its "full"
//                  mbarrier with the 48 KB it expects. The other 127 threads exit at once.
//     warpgroups 1, 2  consumers: each owns 64 of the 128 rows and all 256 columns, i.e. 128 f32
//                  accumulators per thread, and per k-block issues 4 wgmma.m64n256k16 (A and B
//                  both K-major from shared memory) as one wgmma group. One group stays in flight:
//                  after committing block i it waits for block i-1's group and only then frees that
//                  stage (one arrive per warp on its "empty" mbarrier, 8 per phase).
//     Registers: __launch_bounds__(384, 1) caps every thread at 168; a consumer needs its 128
//     accumulators plus ~27 (ptxas: 155, no spills), so there is no setmaxnreg rebalancing (it
//     would buy nothing, and setmaxnreg.inc hangs if the register pool math is ever off). The
//     128 x 256 tile gives 2 * 128 * 256 * 64 / ((128 + 256) * 64 * 2) = 85 FLOP per byte moved
//     into shared memory. (192 x 256 with 3 consumer warpgroups would give 109, but 512 threads
//     leave 128 registers and one m64n256 wgmma with its accumulators needs 154: ptxas refuses
//     it (C7602), setmaxnreg does not lift that compile-time cap.)
//   Persistent: grid = min(tiles, SMs), CTA b takes tiles b, b + grid, ...; the producer runs ahead
//     into the next tile while the consumers store the last one. Tiles are walked in groups of 16
//     row blocks (all column blocks of a group before the next group), so the CTAs running together
//     share x rows and W rows in L2.
//   Shared-memory layout (dynamic, base rounded up to 1024 bytes: the 128-byte swizzle pattern is a
//     function of address bits 4-9, so TMA and wgmma agree only on 1024-aligned tiles):
//     [4 stages x 16 KB of x][4 stages x 32 KB of W][4 full + 4 empty mbarriers]; each tile a stack
//     of 128-byte rows (64 bf16 of K), 16-byte chunk c of row r stored at chunk c ^ (r % 8). The
//     wgmma descriptors say exactly that: 128-byte swizzle, 1024 bytes between 8-row groups; the
//     k16 step within the 64-wide row advances the start address by 32 bytes.
//   Epilogue: straight from the accumulators, each thread stores bf16x2 pairs (row = 16 * warp +
//     lane / 4 (+ 8), column = 8 * j + 2 * (lane % 4)), masked by row < rows and column < h.
//
// Launch:
//   fc_wgmma_bf16   grid: any >= 1 (the persistent walk covers every tile); fc.rs launches
//                   min(ceil(rows / 128) * ceil(h / 256), SM count). Block 384 (checked: traps
//                   otherwise), dynamic smem SMEM_BYTES = 197,696 (checked) -> needs
//                   cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) first (mod.rs does it for
//                   every "fc_" kernel). Arguments: two CUtensorMap by value (__grid_constant__),
//                   built by fc.rs with cuTensorMapEncodeTiled: x as {k, rows} with box {64, 128},
//                   W as {k, h} with box {64, 256}; bf16, 128-byte swizzle, OOB fill zero. A box
//                   may exceed the tensor (h = 64, rows = 1): the driver allows it, the missing
//                   elements arrive as zeros and still count in the 48 KB the stage expects.
//   fc_simple_bf16  grid exactly ceil(rows / 64) * ceil(h / 64), block 256 (checked), no dynamic smem.
// Preconditions (the launcher checks them and errors before launching): rows, h, k >= 1 and <=
//   i32::MAX; buffers hold rows * k, h * k, rows * h elements; y does not overlap x or W.
// Bytes:  >= 2 * (rows * k + h * k + rows * h) per call (each operand once); with L2 reuse inside a
//   16-row-block group, x is read ~once and W ~once per group of 16 * 128 rows from DRAM.
// FLOPs:  2 * rows * h * k.
// Bound:  tensor-core compute for the recipe shapes (12288 x 4096 x 20480: 2.06 TFLOP, 0.77 GB).
//   Target: >= 0.8 x cuBLASLt on 12288 x 4096 x 20480 (cuBLASLt ~870 TFLOP/s on H200, so >= 700).
//   The next limit is L2 -> shared-memory traffic: each CTA pulls (128 + 256) * 64 * 2 bytes per
//   k-block, ~8 TB/s summed over the SMs at 700 TFLOP/s; 2-CTA clusters multicasting the shared
//   W tile (a third less L2 traffic, as cuBLAS does) would lift that ceiling.
// Measured (H200, 12288 x 4096 x 20480): 0.87 x cuBLASLt. benches/kernels.rs prints the ratio
//   ("fc kernel / cuBLASLt"); tests/gpu/gemm.rs gpu_fc_kernel_matches_cpu checks both symbols.
#include "common.cuh"
#include "launch.cuh"
#include "tma.cuh"  // CUtensorMap and the TMA wrappers
#include "tma_gemm.cuh"  // the ring, roles and tile walk fc_wgmma_bf16 shares with mlp.cu
#include "wgmma.cuh"     // descriptors and the m64n256 wgmma (kernels/wgmma_ops.cuh)

namespace fc {

// ---- fast path geometry (launch.cuh holds what the launcher needs too) -------------------------
constexpr int BM = FC_BM;                // output rows per CTA tile (2 consumer warpgroups x 64)
constexpr int BN = FC_BN;                // output columns per CTA tile (one m64n256 wgmma)
constexpr int BK = FC_BK;                // K per stage: 64 bf16 = one 128-byte swizzle row
constexpr int STAGES = FC_STAGES;        // ring depth: 4 x 48 KB of the 227 KB of shared memory
constexpr int WG_ROWS = 64;              // tile rows per consumer warpgroup (the M of wgmma)
constexpr int THREADS = FC_THREADS;      // producer warpgroup + 2 consumer warpgroups
constexpr uint32_t A_STAGE_BYTES = BM * BK * 2;   // 16 KB: x box 64 x 128
constexpr uint32_t B_STAGE_BYTES = BN * BK * 2;   // 32 KB: W box 64 x 256
constexpr uint32_t STAGE_TX_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;  // TMA bytes per stage
constexpr uint32_t SWIZZLE_ALIGN = FC_SWIZZLE_ALIGN; // 128-byte swizzle atom: 8 rows x 128 bytes
constexpr uint32_t BARRIER_BYTES = 2 * STAGES * 8;
constexpr uint32_t SMEM_BYTES = FC_SMEM_BYTES; // 197,696
static_assert(SMEM_BYTES == STAGES * STAGE_TX_BYTES + BARRIER_BYTES + SWIZZLE_ALIGN,
              "launch.cuh FC_SMEM_BYTES must cover the ring, its barriers and the alignment slack");
static_assert(A_STAGE_BYTES % SWIZZLE_ALIGN == 0 && B_STAGE_BYTES % SWIZZLE_ALIGN == 0,
              "every stage must start on a swizzle atom");
static_assert(BM == 2 * WG_ROWS && THREADS == 128 * 3 && tma_gemm::CONSUMER_WARPS == 8, "2 consumer warpgroups");

// ---- simple path geometry --------------------------------------------------------------------
constexpr int S_TILE = FC_S_TILE; // output tile edge
constexpr int S_BK = 32;       // K per shared-memory step
constexpr int S_THREADS = FC_S_THREADS; // 16 x 16 threads, 4 x 4 outputs each

}  // namespace fc

extern "C" __global__ void __launch_bounds__(fc::THREADS, 1)
    fc_wgmma_bf16(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                  __nv_bfloat16* __restrict__ y, int rows, int h, int k) {
  using namespace fc;
  using namespace tma_gemm;
  extern __shared__ unsigned char fc_smem[];
  const uint32_t base = checked_smem_base<THREADS>(fc_smem, SMEM_BYTES, SWIZZLE_ALIGN);
  if (rows <= 0 || h <= 0 || k <= 0) return;
  const uint32_t a_smem = base;                                // STAGES x 16 KB
  const uint32_t b_smem = base + STAGES * A_STAGE_BYTES;       // STAGES x 32 KB
  const Ring<STAGES> ring{b_smem + STAGES * B_STAGE_BYTES};    // full[STAGES], empty[STAGES]

  const int num_m = static_cast<int>((static_cast<long long>(rows) + BM - 1) / BM);
  const int num_n = static_cast<int>((static_cast<long long>(h) + BN - 1) / BN);
  const int num_k = static_cast<int>((static_cast<long long>(k) + BK - 1) / BK);
  const long long num_tiles = static_cast<long long>(num_m) * num_n;

  ring.init();
  __syncthreads();  // the last block-wide barrier: the roles below never meet again

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ---- producer: one thread; per k-block the x box and the 256-row W box ----
    if (threadIdx.x == 0) {
      prefetch_tensor_map(&map_x);
      prefetch_tensor_map(&map_w);
      produce<STAGES, BK>(ring, num_tiles, num_m, num_n, num_k, STAGE_TX_BYTES,
                          [&](int stage, int k0, TileCoord c) {
                            tma_load_2d(a_smem + stage * A_STAGE_BYTES, &map_x, ring.full(stage), k0, c.m_blk * BM);
                            tma_load_2d(b_smem + stage * B_STAGE_BYTES, &map_w, ring.full(stage), k0, c.n_blk * BN);
                          });
    }
    return;
  }

  // ---- consumers: warpgroup 1 + c owns tile rows 64c .. 64c + 63 (c = 0, 1) ----
  const int cw = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4;  // warp within the warpgroup
  const int lane = threadIdx.x % 32;
  // Descriptors of stage 0; stage s, k16 step kk adds (s * stage bytes + kk * 32) >> 4 to the
  // start-address field (no carry out of its 14 bits: shared addresses are < 2^18).
  // K-major tiles of 128-byte rows: SBO 1024 (8-row groups), LBO unused (16, as CUTLASS sets it).
  const uint64_t desc_a0 = attn::wg_desc(a_smem + static_cast<uint32_t>(cw) * (WG_ROWS * BK * 2), 16, 1024);
  const uint64_t desc_b0 = attn::wg_desc(b_smem, 16, 1024);

  // acc[j][e]: row 16 * warp + lane / 4 + 8 * (e / 2), column 8j + 2 * (lane % 4) + e % 2.
  float acc[BN / 8][4];
  int stage = 0;
  uint32_t phase = 0;
  for (long long t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const TileCoord c = tile_coord(t, num_m, num_n);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    }
    consume_tile(
        ring, num_k, lane, stage, phase,
        [&](int s) {
          const uint64_t da = desc_a0 + ((static_cast<uint32_t>(s) * A_STAGE_BYTES) >> 4);
          const uint64_t db = desc_b0 + ((static_cast<uint32_t>(s) * B_STAGE_BYTES) >> 4);
#pragma unroll
          for (int kk = 0; kk < BK / 16; ++kk) {
            attn::wg_abt<BN>(acc, da + 2 * kk, db + 2 * kk, 1);  // +32 bytes of K per step
          }
        },
        [&] { attn::wg_fence_regs(acc); });

    // ---- epilogue: bf16x2 stores straight from the accumulators ----
    const long long r0 = static_cast<long long>(c.m_blk) * BM + cw * WG_ROWS + warp * 16 + lane / 4;
    const long long col0 = static_cast<long long>(c.n_blk) * BN + 2 * (lane % 4);
    const bool row0_ok = r0 < rows;
    const bool row1_ok = r0 + 8 < rows;
    __nv_bfloat16* y0 = y + r0 * h + col0;
    __nv_bfloat16* y1 = y0 + 8LL * h;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      // h % 8 == 0 and col0 even: a pair is either wholly inside the row or wholly outside.
      if (col0 + 8 * j < h) {
        if (row0_ok) {
          *reinterpret_cast<uint32_t*>(y0 + 8 * j) = pack_bf16x2_rne(acc[j][0], acc[j][1]);
        }
        if (row1_ok) {
          *reinterpret_cast<uint32_t*>(y1 + 8 * j) = pack_bf16x2_rne(acc[j][2], acc[j][3]);
        }
      }
    }
  }
}

// The fallback: one 64 x 64 output tile per CTA, K in steps of 32 through shared memory (f32,
// [k][row] so the inner loop reads conflict-free), thread (tx, ty) owns rows ty + 16 i and columns
// tx + 16 j (i, j < 4). Any shape, 2-byte alignment.
extern "C" __global__ void __launch_bounds__(fc::S_THREADS)
    fc_simple_bf16(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                   __nv_bfloat16* __restrict__ y, long long rows, int h, int k) {
  using namespace fc;
  if (blockDim.x != S_THREADS || blockDim.y != 1 || blockDim.z != 1) __trap();
  if (rows <= 0 || h <= 0) return;
  __shared__ float xs[S_BK][S_TILE + 1];
  __shared__ float ws[S_BK][S_TILE + 1];
  const long long num_n = (static_cast<long long>(h) + S_TILE - 1) / S_TILE;
  const long long m0 = (static_cast<long long>(blockIdx.x) / num_n) * S_TILE;
  const long long n0 = (static_cast<long long>(blockIdx.x) % num_n) * S_TILE;
  const int tx = threadIdx.x % 16;
  const int ty = threadIdx.x / 16;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  }
  for (long long k0 = 0; k0 < k; k0 += S_BK) {
    for (int e = threadIdx.x; e < S_TILE * S_BK; e += S_THREADS) {
      const int r = e / S_BK;
      const int kk = e % S_BK;
      const long long gk = k0 + kk;
      const long long gr = m0 + r;
      const long long gc = n0 + r;
      xs[kk][r] = (gr < rows && gk < k) ? bf16_to_f32(x[gr * k + gk]) : 0.0f;
      ws[kk][r] = (gc < h && gk < k) ? bf16_to_f32(w[gc * k + gk]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < S_BK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const long long r = m0 + ty + 16 * i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long col = n0 + tx + 16 * j;
      if (r < rows && col < h) y[r * h + col] = f32_to_bf16_rne(acc[i][j]);
    }
  }
}
