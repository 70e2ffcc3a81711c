// tma.cuh: the Tensor Memory Accelerator's PTX wrappers (sm_90a), shared by the kernels that load
// shared-memory tiles with it (fc.cu's GEMM ring, attention_wgmma.cu's warp-specialised causal
// and drafter forwards). The descriptors (CUtensorMap) are encoded on the host (src/backend/cuda/tma.rs
// tensor_map_2d / tensor_map_3d) and passed by value as __grid_constant__ kernel parameters.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <stdint.h>

// Makes the initialised mbarriers visible to the TMA unit (the async proxy) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// 2-D TMA box load: element coordinates {c0 (innermost), c1 (rows)}; completion is signalled as
// transaction bytes on `bar`. Box elements outside the tensor read as zero.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// 3-D TMA box load: element coordinates {c0 (innermost), c1, c2}; the box lands in shared memory
// with c0 fastest, then c1, then c2 (whatever the global strides of the three dimensions), which
// lets one box gather rows of several heads into consecutive tile rows.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
