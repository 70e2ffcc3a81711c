// wgmma.cuh: the building blocks of the Hopper attention kernels (attention_wgmma.cu): 128-byte
// swizzled shared-memory tiles, their wgmma matrix descriptors, and the warpgroup MMA fences.
//
// Tile layout (one per operand tile of R rows x HD bf16 columns, R % 8 == 0, base 1024-aligned):
//   column block cb = col / 64 holds R rows of 128 bytes (64 bf16); 16-byte chunk c (0..7) of row r
//   sits at  cb * R * 128 + r * 128 + ((c ^ (r & 7)) * 16).
// That is the 128B-swizzle atom of the tensor core (8 rows x 128 bytes, 1024 bytes, XOR of the
// chunk index with the row index mod 8), repeated down the rows and then across column blocks.
// The same bytes serve both majornesses (PTX ISA 9.7.15.5.1.2):
//   K-major (rows = M or N, columns = K), Q and K of S = Q K^T: start = tile + cb * R * 128 +
//     (k % 64) * 2 for the k16 step at column k; SBO = 1024 (8-row groups), LBO unused (16).
//   N-major (rows = K, columns = N), V of O += P V: start = tile + k * 128 for the k16 step at key
//     row k; LBO = R * 128 (from one 64-column block to the next), SBO = 1024 (8-key groups).
// Ordering: data written to shared memory by threads (st.shared, cp.async) is seen by the
// tensor core's async proxy only after fence.proxy.async (fence_proxy_async) on the writing side,
// then a barrier; registers written by threads are seen by a wgmma only after wgmma_fence(); a
// wgmma's accumulators are read only after wgmma_wait<0>() and wg_fence_regs (which stops the
// compiler from moving the reads above the wait).
#pragma once

#include "mma.cuh"
#include "wgmma_ops.cuh"

namespace attn {

// Byte offset of 16-byte chunk ch (0 .. HD/8 - 1) of row r in an R-row swizzled tile.
template <int R>
__device__ __forceinline__ uint32_t sw128_chunk(int r, int ch) {
  return (uint32_t)((ch >> 3) * R * 128 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

// Byte offset of element col of row r (the element's own 2 bytes within its chunk).
template <int R>
__device__ __forceinline__ uint32_t sw128_elem(int r, int col) {
  return sw128_chunk<R>(r, col >> 3) + (uint32_t)((col & 7) * 2);
}

// This thread's warpgroup (threadIdx.x / 128), broadcast from lane 0: ptxas then knows it is
// warp-uniform, so what derives from it (a warpgroup's row offset, its wgmma descriptors, stage
// addresses) stays on the uniform datapath. Computed from threadIdx.x directly, the descriptors
// lived in vector registers and every wgmma paid R2UR moves for them (warp-specialised causal
// forward: 1062 -> 1012 SASS instructions per key tile at hd 128, 808 -> 714 at hd 256). All 32
// lanes must be active.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0); }

// A wgmma shared-memory matrix descriptor, 128-byte swizzle, base offset 0 (1024-aligned atoms).
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// The descriptor of the matrix `bytes` further on (same strides and swizzle): the start address
// field is the low 14 bits, in 16-byte units, and shared-memory addresses stay below 256 KB.
__device__ __forceinline__ uint64_t wg_desc_at(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pins accumulator registers at this point of the program (no code motion across it).
template <int NT>
__device__ __forceinline__ void wg_fence_regs(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
  }
}

// S[64 x BN] (+)= A B^T for one k16 step, A and B K-major tiles.
template <int BN>
__device__ __forceinline__ void wg_abt(float (&d)[BN / 8][4], uint64_t da, uint64_t db, int accumulate) {
  if constexpr (BN == 16) wgmma_ss_m64n16k16(d, da, db, accumulate);
  else if constexpr (BN == 64) wgmma_ss_m64n64k16(d, da, db, accumulate);
  else if constexpr (BN == 128) wgmma_ss_m64n128k16(d, da, db, accumulate);
  else if constexpr (BN == 256) wgmma_ss_m64n256k16(d, da, db, accumulate);
  else static_assert(BN == 16 || BN == 64 || BN == 128 || BN == 256, "no wgmma wrapper for this tile");
}

// O[64 x HD] (+)= P B for one k16 step, P in registers, B an N-major tile.
template <int HD>
__device__ __forceinline__ void wg_pb(float (&d)[HD / 8][4], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  if constexpr (HD == 128) wgmma_rs_m64n128k16_tb(d, a, db, accumulate);
  else if constexpr (HD == 256) wgmma_rs_m64n256k16_tb(d, a, db, accumulate);
  else static_assert(HD == 128 || HD == 256, "no wgmma wrapper for this head dim");
}

}  // namespace attn
