// mlp.cu: the first half of a gated MLP as one kernel: the gate | up projection and SwiGLU,
// act = silu(x Wg^T) * (x Wu^T). The target's forward (keep_gu 0) never writes the
// [rows, 2 * inter] projection; the drafter's (keep_gu 1) keeps it for its backward, written by
// the same helper warps that write act, so no second pass reads it back.
// CPU reference: src/backend/cpu.rs gemm with Gemm::linear(rows, 2 * inter, k), then swiglu_fwd.
//
// Math:     g[r, n] = bf16(sum_c x[r, c] Wg[n, c]), u[r, n] = bf16(sum_c x[r, c] Wu[n, c]) (f32
//           products and sums, one RNE rounding each, as the GEMM's bf16 output), then
//           act[r, n] = bf16(silu(g) * u) with swiglu.cu's operations in its order (__fdiv_rn,
//           __fadd_rn, __fmul_rn, expf). So act equals swiglu_fwd of this kernel's own g and u bit
//           for bit; against cuBLASLt's GEMM + swiglu_fwd only the f32 summation order differs
//           (g and u within a bf16 ulp).
// Layouts:  x [rows, k]; W [2 * inter, k] = [Wg; Wu] (gate_proj's rows, then up_proj's, as the
//           flat parameter buffer holds them); act [rows, inter]; gu [rows, 2 * inter] (g then u
//           per row, the GEMM's output layout; written only when keep_gu != 0, and then exactly
//           the g and u act was computed from). bf16, row-major, contiguous.
// Symbol:   mlp_swiglu_wgmma_bf16. Needs k % 8 == 0 and inter % 8 == 0 (TMA row pitch a multiple
//           of 16 bytes; whole bf16x2 stores), x and W 16-byte aligned, act (and gu) 4-byte
//           aligned. Any rows >= 1. src/backend/cuda/mlp.rs checks all of it and falls back to the
//           GEMM + swiglu.
//
// In detail: fc.cu's fc_wgmma_bf16 (read its header first), with another tile, a shorter ring and
// an epilogue in two parts.
//   Tile: 128 rows x MLP_BN (128) output columns. Its stage holds x's 128 x 64 box and two W boxes
//     of 128 x 64: gate rows n0 .. n0 + 127 and up rows inter + n0 .. inter + n0 + 127, one above
//     the other. The two boxes make one 256-row K-major tile (each is a whole number of 8-row
//     swizzle atoms), so one wgmma.m64n256k16 per k16 step gives each consumer warpgroup its 64
//     rows' gate columns (accumulators d[0..15]) and up columns (d[16..31]) of the same outputs.
//     So a thread holds g and u of the same output column: d[j][e] and d[j + 16][e].
//   Edges: in the last column block (inter % 128 != 0) the gate box runs on into W's up rows and
//     the up box past W's end (TMA reads those as zeros); both land only in columns >= inter, which
//     the epilogue does not store. Ragged rows and K: zero-filled by TMA, masked in the epilogue.
//   Producer, persistent walk in groups of 16 row blocks: as fc.cu; the ring is 3 stages of 48 KB
//     (MLP_STAGES): the staging tile (68 KB) takes the fourth stage's bytes and 20 KB more.
//   Epilogue, in two halves that run beside the next tile's main loop:
//     consumers  wait until the staging tile is free (its "empty" barrier), round g and u to bf16
//                (as the GEMM's output; the hardware's cvt, the same bits for every non-NaN value)
//                and store them as (gate pair, up pair) 8-byte slots, slot p of a row holding
//                output columns 2p and 2p + 1; arrive on "full"; start the next tile.
//     helpers    the producer warpgroup's warps 1-3, idle in fc.cu: per tile, wait on "full", then
//                for each of their rows (warp w: rows w - 1, w + 2, ...) and each half of 32
//                slots, SwiGLU in f32 and one bf16x2 store per lane (128 contiguous bytes a warp
//                store; with keep_gu, also the g pair and the u pair into gu, 128 contiguous
//                bytes each); arrive on "empty".
//     So the consumers' epilogue is 64 bf16x2 conversions and 32 shared stores a thread, where the
//     in-register SwiGLU (64 expf and IEEE divisions a thread) held the tensor cores idle for
//     about a tenth of each tile. rows * inter * 2 bytes are written instead of the GEMM's
//     rows * inter * 4, with no second pass reading them back.
//
// Launch:   grid any >= 1 (mlp.rs: min(ceil(rows / 128) * ceil(inter / 128), SM count)), block
//           FC_THREADS (384, checked: traps otherwise), dynamic smem MLP_SMEM_BYTES (218,176,
//           checked). Arguments: two CUtensorMap by value (__grid_constant__), built by mlp.rs:
//           x as {k, rows} with box {64, 128}, W as {k, 2 * inter} with box {64, 128}; bf16,
//           128-byte swizzle, OOB fill zero. gu is a live pointer even with keep_gu 0 (mlp.rs
//           passes act's then; never dereferenced).
// Bytes:    >= 2 * (rows * k + 2 * inter * k + rows * inter) (+ 4 * rows * inter with keep_gu).
// FLOPs:    4 * rows * inter * k (the two projections) + ~5 per output.
// Bound:    tensor-core compute at the recipes' shapes (8B: 12288 x 2 * 12288 x 4096; 27B:
//           12288 x 2 * 17408 x 5120). Target: the cuBLASLt GEMM's time alone, so the SwiGLU pass
//           (~0.45 ms a layer at these shapes) is saved whole; benches/kernels.rs ("mlp") times
//           both forms side by side.
// Measured (H100; the bench's mlp group: rounds of 20 calls back to back under the power cap,
//           the two forms in turn, median round): 1.075x the two-step form's throughput at the
//           8B shape (3.524 against 3.789 ms), 1.071x at the 27B shape (6.062 against 6.493 ms);
//           Nsight Compute: SM (tensor pipe) throughput 95-96%. Inside the 8B step 3,477 us a
//           layer against the GEMM's 3,431 + swiglu_fwd's 458 in the same call; inside the 27B
//           forward 6,144 us (the two steps: 6,122 + 460 in an earlier call). Output equal to
//           cuBLASLt + swiglu_fwd bit for bit on every test case. The first version ran SwiGLU
//           and the stores in the consumers' registers before the next tile's MMAs: 0.875x and
//           0.892x. Single calls with the GPU idle between them run at boost clocks and favour
//           cuBLASLt (0.910x at the 27B shape in one such run), so the bench times sustained
//           rounds.
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
constexpr int STAGES = MLP_STAGES;
constexpr int WG_ROWS = 64;
constexpr int THREADS = FC_THREADS;    // producer warpgroup + 2 consumer warpgroups
constexpr int NT = 2 * BN / 8;         // n8 accumulator blocks per thread: gate then up
constexpr int HELPER_WARPS = 3;        // the producer warpgroup's warps 1-3: SwiGLU and the stores
constexpr uint32_t A_STAGE_BYTES = BM * BK * 2;       // 16 KB
constexpr uint32_t B_HALF_BYTES = BN * BK * 2;        // 16 KB: one W box (gate or up)
constexpr uint32_t B_STAGE_BYTES = 2 * B_HALF_BYTES;  // 32 KB
constexpr uint32_t STAGE_TX_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
constexpr uint32_t PITCH = MLP_STAGING_PITCH;         // staging row: BN (gate, up) pairs + padding
constexpr uint32_t STAGING_BYTES = BM * PITCH;
constexpr uint32_t SWIZZLE_ALIGN = FC_SWIZZLE_ALIGN;
constexpr uint32_t SMEM_BYTES = MLP_SMEM_BYTES;
static_assert(SMEM_BYTES == STAGES * STAGE_TX_BYTES + STAGING_BYTES + (2 * STAGES + 2) * 8 + SWIZZLE_ALIGN,
              "launch.cuh MLP_SMEM_BYTES must cover the ring, the staging tile, the barriers and the slack");
static_assert(B_HALF_BYTES % SWIZZLE_ALIGN == 0 && A_STAGE_BYTES % SWIZZLE_ALIGN == 0,
              "every box must start on a swizzle atom");
static_assert(BM == 2 * WG_ROWS && THREADS == 3 * 128 && 2 * BN == 256, "one m64n256 wgmma per k16 step");
static_assert(PITCH % 8 == 0 && (PITCH / 4) % 32 == 8,
              "8-byte staging stores; rows r and r + 4 of a warp's 8 share banks, so 2 wavefronts a store");
static_assert(BN == 2 * 64, "a helper warp takes a staging row as two halves of 32 pairs");

// The staging tile's barriers (after the ring's): full completes when every consumer thread has
// written its pairs of the tile, empty when every helper thread has read them.
struct Staging {
  uint32_t base;  // shared-memory address of row 0
  uint32_t bars;
  __device__ __forceinline__ uint32_t full() const { return bars; }
  __device__ __forceinline__ uint32_t empty() const { return bars + 8u; }
};

// act for one output pair from its staged (gate, up) bf16 pairs: SwiGLU in f32 on the bf16 values
// (swiglu.cu's formula and order), one bf16x2 of the results.
__device__ __forceinline__ uint32_t swiglu_staged(uint32_t g2, uint32_t u2) {
  const float g0 = __uint_as_float(g2 << 16), g1 = __uint_as_float(g2 & 0xffff0000u);
  const float u0 = __uint_as_float(u2 << 16), u1 = __uint_as_float(u2 & 0xffff0000u);
  return pack_bf16x2_rne(swiglu_fwd_f32(g0, u0), swiglu_fwd_f32(g1, u1));
}

__device__ __forceinline__ void st_shared_v2(uint32_t addr, uint32_t a, uint32_t b) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ uint2 ld_shared_v2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

}  // namespace mlp

extern "C" __global__ void __launch_bounds__(mlp::THREADS, 1)
    mlp_swiglu_wgmma_bf16(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                          __nv_bfloat16* __restrict__ act, __nv_bfloat16* __restrict__ gu, int keep_gu, int rows,
                          int inter, int k) {
  using namespace mlp;
  using namespace tma_gemm;
  extern __shared__ unsigned char mlp_smem[];
  const uint32_t base = checked_smem_base<THREADS>(mlp_smem, SMEM_BYTES, SWIZZLE_ALIGN);
  if (rows <= 0 || inter <= 0 || k <= 0) return;
  const uint32_t a_smem = base;                              // STAGES x 16 KB of x
  const uint32_t b_smem = base + STAGES * A_STAGE_BYTES;     // STAGES x (16 KB gate + 16 KB up)
  const uint32_t staging = b_smem + STAGES * B_STAGE_BYTES;  // BM rows x PITCH
  const Ring<STAGES> ring{staging + STAGING_BYTES};          // full[STAGES], empty[STAGES]
  const Staging stg{staging, ring.bars + 16u * STAGES};

  const int num_m = static_cast<int>((static_cast<long long>(rows) + BM - 1) / BM);
  const int num_n = static_cast<int>((static_cast<long long>(inter) + BN - 1) / BN);
  const int num_k = static_cast<int>((static_cast<long long>(k) + BK - 1) / BK);
  const long long num_tiles = static_cast<long long>(num_m) * num_n;

  if (threadIdx.x == 0) {
    mbar_init(stg.full(), 2 * 128);              // every consumer thread
    mbar_init(stg.empty(), HELPER_WARPS * 32);   // every helper thread
  }
  ring.init();  // thread 0 again: its fence publishes the two above too
  __syncthreads();  // the last block-wide barrier: the roles below never meet again

  const int warpgroup = attn::warpgroup_index();
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  if (warpgroup == 0) {
    if (warp == 0) {
      // ---- producer: one thread; x's box, then the gate box and the up box under it ----
      if (lane == 0) {
        prefetch_tensor_map(&map_x);
        prefetch_tensor_map(&map_w);
        produce<STAGES, BK>(ring, num_tiles, num_m, num_n, num_k, STAGE_TX_BYTES,
                            [&](int stage, int k0, TileCoord c) {
                              const uint32_t b = b_smem + stage * B_STAGE_BYTES;
                              const int n0 = c.n_blk * BN;
                              tma_load_2d(a_smem + stage * A_STAGE_BYTES, &map_x, ring.full(stage), k0, c.m_blk * BM);
                              tma_load_2d(b, &map_w, ring.full(stage), k0, n0);
                              tma_load_2d(b + B_HALF_BYTES, &map_w, ring.full(stage), k0, inter + n0);
                            });
      }
      return;
    }
    // ---- helpers (warps 1-3): per staged tile, SwiGLU and the act stores, while the consumers
    // run the next tile's main loop. Warp w takes rows w - 1, w + 2, ...; a row's 128 outputs
    // are two halves of 32 lanes, lane l the pair of columns 2 (32 h + l), 2 (32 h + l) + 1:
    // 128 contiguous bytes a warp store. ----
    uint32_t parity = 0;
    for (long long t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const TileCoord c = tile_coord(t, num_m, num_n);
      mbar_wait(stg.full(), parity);
      parity ^= 1u;
      const int rows_here = min(BM, rows - c.m_blk * BM);
#pragma unroll 2
      for (int r = warp - 1; r < rows_here; r += HELPER_WARPS) {
        const long long row = static_cast<long long>(c.m_blk) * BM + r;
        __nv_bfloat16* y = act + row * inter;
        __nv_bfloat16* p = gu + row * 2 * inter;  // dereferenced only with keep_gu
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int slot = 32 * h + lane;
          const long long col = static_cast<long long>(c.n_blk) * BN + 2 * slot;
          const uint2 pair = ld_shared_v2(stg.base + r * PITCH + 8u * slot);
          // inter % 8 == 0 and col even: a pair is wholly inside the row or wholly outside.
          if (col < inter) {
            *reinterpret_cast<uint32_t*>(y + col) = swiglu_staged(pair.x, pair.y);
            if (keep_gu) {
              *reinterpret_cast<uint32_t*>(p + col) = pair.x;
              *reinterpret_cast<uint32_t*>(p + inter + col) = pair.y;
            }
          }
        }
      }
      mbar_arrive(stg.empty());
    }
    return;
  }

  // ---- consumers: warpgroup 1 + c owns tile rows 64c .. 64c + 63 ----
  const int cw = warpgroup - 1;
  // K-major tiles of 128-byte rows: SBO 1024 (8-row groups), LBO unused (16, as CUTLASS sets it).
  const uint64_t desc_a0 = attn::wg_desc(a_smem + static_cast<uint32_t>(cw) * (WG_ROWS * BK * 2), 16, 1024);
  const uint64_t desc_b0 = attn::wg_desc(b_smem, 16, 1024);
  // This thread's two staging rows (16 * warp + lane / 4, + 8) of its warpgroup's 64; the pair
  // slot of accumulator block j is 4 j + lane % 4 (output columns 8 j + 2 (lane % 4), + 1).
  const uint32_t stg_row0 = stg.base + (cw * WG_ROWS + warp * 16 + lane / 4) * PITCH + 8u * (lane % 4);
  const uint32_t stg_row1 = stg_row0 + 8 * PITCH;

  float acc[NT][4];
  int stage = 0;
  uint32_t phase = 0;
  uint32_t stg_parity = 1;  // the staging tile starts empty: its "previous" phase counts as done
  for (long long t = blockIdx.x; t < num_tiles; t += gridDim.x) {
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

    // ---- epilogue: g and u rounded to bf16 (the GEMM's output) and staged as (gate, up) pairs;
    // gate block j and up block j + NT / 2 hold the same output columns. The helpers do the rest.
    mbar_wait(stg.empty(), stg_parity);  // the helpers are done with the previous tile
    stg_parity ^= 1u;
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
      const float(&g)[4] = acc[j];
      const float(&u)[4] = acc[j + NT / 2];
      st_shared_v2(stg_row0 + 32u * j, pack_bf16x2_rn_fast(g[0], g[1]), pack_bf16x2_rn_fast(u[0], u[1]));
      st_shared_v2(stg_row1 + 32u * j, pack_bf16x2_rn_fast(g[2], g[3]), pack_bf16x2_rn_fast(u[2], u[3]));
    }
    mbar_arrive(stg.full());
  }
}
