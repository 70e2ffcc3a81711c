// tma_gemm.cuh: the skeleton fc.cu's GEMM and mlp.cu's gated-MLP kernel share (fc.cu's header
// describes it in full): a STAGES-deep ring of shared-memory stages that one producer thread fills
// by TMA and two consumer warpgroups read with wgmma, a full and an empty mbarrier per stage, and a
// persistent walk of output tiles in groups of GROUP_M row blocks. Each kernel brings what differs:
// which boxes a stage holds (the producer's `load`), the MMAs of a stage (the consumer's `mma`),
// and its epilogue.
#pragma once

#include "common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace tma_gemm {

constexpr int GROUP_M = 16;        // row blocks per raster group (L2 reuse)
constexpr int CONSUMER_WARPS = 8;  // arrivals that free a stage: one per consumer warp

// The PTX wrappers the kernels already share (mma.cuh, wgmma.cuh).
using attn::dynamic_smem_bytes;
using attn::smem_u32;
using attn::wgmma_commit;
using attn::wgmma_fence;
using attn::wgmma_wait;

// Traps unless the kernel runs THREADS x 1 x 1 threads a block with at least smem_bytes of dynamic
// shared memory (the launcher's contract); returns the first `align`-aligned shared address of
// `smem` (the 128-byte swizzle pattern is a function of address bits 4-9: TMA and wgmma agree only
// on 1024-aligned tiles).
template <int THREADS>
__device__ __forceinline__ uint32_t checked_smem_base(const unsigned char* smem, uint32_t smem_bytes,
                                                      uint32_t align) {
  if (blockDim.x != THREADS || blockDim.y != 1 || blockDim.z != 1 || dynamic_smem_bytes() < smem_bytes) {
    __trap();
  }
  return (smem_u32(smem) + (align - 1)) & ~(align - 1);
}

// Tile t (in the persistent walk) -> (row block, column block): groups of GROUP_M row blocks,
// row block fastest inside a group, so consecutive tiles share W rows and nearby ones x rows.
struct TileCoord {
  int m_blk;
  int n_blk;
};

__device__ __forceinline__ TileCoord tile_coord(long long t, int num_m, int num_n) {
  const long long per_group = static_cast<long long>(GROUP_M) * num_n;
  const long long group = t / per_group;
  const int first_m = static_cast<int>(group * GROUP_M);
  const int group_m = min(num_m - first_m, GROUP_M);  // the last group may be short
  const int in_group = static_cast<int>(t - group * per_group);  // < group_m * num_n
  TileCoord c;
  c.m_blk = first_m + in_group % group_m;
  c.n_blk = in_group / group_m;
  return c;
}

// The ring's mbarriers at `bars`: full(s) completes when stage s holds its k-block (the TMA bytes
// landed), empty(s) when all consumer warps are done reading it.
template <int STAGES>
struct Ring {
  uint32_t bars;
  __device__ __forceinline__ uint32_t full(int s) const { return bars + 8u * static_cast<uint32_t>(s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return bars + 8u * static_cast<uint32_t>(STAGES + s); }
  // Thread 0 initialises every barrier; the caller's __syncthreads() publishes them.
  __device__ __forceinline__ void init() const {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) {
        mbar_init(full(s), 1);  // the producer's arrive.expect_tx; the bytes do the rest
        mbar_init(empty(s), CONSUMER_WARPS);
      }
      fence_barrier_init();
    }
  }
};

// The producer (one thread): for each tile of this CTA's walk and each of its num_k k-blocks,
// waits until the consumers freed the next stage, arms its full barrier with the `tx_bytes` the
// stage's boxes hold, and calls load(stage, k0, coord) to issue them.
template <int STAGES, int BK, class Load>
__device__ __forceinline__ void produce(const Ring<STAGES>& ring, long long num_tiles, int num_m, int num_n,
                                        int num_k, uint32_t tx_bytes, Load load) {
  int stage = 0;
  uint32_t phase = 0;
  for (long long t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const TileCoord c = tile_coord(t, num_m, num_n);
    for (int kb = 0; kb < num_k; ++kb) {
      mbar_wait(ring.empty(stage), phase ^ 1u);  // the consumers freed this stage's last use
      mbar_arrive_expect_tx(ring.full(stage), tx_bytes);
      load(stage, kb * BK, c);  // k0 < k <= INT_MAX
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1u;
      }
    }
  }
}

// A consumer warpgroup's main loop over one tile's num_k k-blocks (the ring position `stage`,
// `phase` carries over from tile to tile): mma(stage) issues the stage's wgmmas as one group. One
// group stays in flight: after committing block i it waits for block i - 1's group and only then
// frees that stage. When every group is done, fence() pins the accumulators (so no read of one
// moves above the wait), and the last stage is freed.
template <int STAGES, class Mma, class Fence>
__device__ __forceinline__ void consume_tile(const Ring<STAGES>& ring, int num_k, int lane, int& stage,
                                             uint32_t& phase, Mma mma, Fence fence) {
  int prev_stage = 0;
  for (int kb = 0; kb < num_k; ++kb) {
    mbar_wait(ring.full(stage), phase);
    wgmma_fence();  // orders the zeroing (and the last tile's epilogue reads) before the MMAs
    mma(stage);
    wgmma_commit();
    wgmma_wait<1>();  // block kb - 1's group is done: its stage may be overwritten
    if (kb > 0 && lane == 0) mbar_arrive(ring.empty(prev_stage));
    __syncwarp();
    prev_stage = stage;
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1u;
    }
  }
  wgmma_wait<0>();
  fence();
  if (lane == 0) mbar_arrive(ring.empty(prev_stage));
  __syncwarp();
}

}  // namespace tma_gemm
