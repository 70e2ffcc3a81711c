// rmsnorm.cu: RMSNorm forward and a deterministic, atomic-free backward (hidden norms, dim ~ 1K-8K,
// and the per-head QK-norm, dim = head_dim with rows = tokens * heads, up to ~4M rows).
//
// Math (per row of dim, f32 math, each bf16 write one RNE rounding, as cpu.rs):
//   fwd:  ms = sum_c x^2 / dim; r = 1 / sqrtf(ms + eps) (IEEE div and sqrt, not rsqrtf);
//         rstd[row] = r; y = bf16((x * r) * w).
//   bwd:  gx = sum_c (dy * w) * x; coef = (((gx * r) * r) * r) * (1 / dim);
//         g = ((r * dy) * w) - (x * coef); dx = bf16(g), or bf16(f32(dx_old) + g) if accumulate_dx;
//         dw_partial[p, c] = sum over the rows of part p of (dy * x) * r        (f32, see Order)
//   dw reduce: dw[c] = dw[c] + sum_p dw_partial[p, c]                           (f32, see Order)
//   The element-wise expressions use __fmul_rn/__fadd_rn/__fsub_rn in cpu.rs's left-to-right order,
//   so they match the CPU bit for bit given the same row sum; only the row sums (ms, gx, and the
//   dw sums) are ordered differently from the CPU (fmaf per thread, then a fixed tree). The
//   8-wide register paths round y and dx with the hardware's cvt.rn.bf16x2.f32 (the same bits for
//   every non-NaN value; a NaN stays a NaN but its payload is not kept).
// Layouts:  x, y, dy, dx: [rows, dim] bf16 row-major, contiguous. w: [dim] bf16 (the launcher
//           passes w + w_off). rstd: [rows] f32. dw_partial: [parts, dim] f32 scratch, parts =
//           ceil(rows / rows_per_part), every element written. dw: [dim] f32 (the launcher passes
//           dw + dw_off).
// Preconditions: dim >= 1, rows >= 0, rows_per_part >= 1 (else the kernels return without
//           writing); eps >= 0; no output overlaps an input of the same kernel.
//
// Row teams. A row is handled by a team of T threads (a power of two), R = RMS_BLOCK / T rows per
// block at a time. A lane owns chunks k = lane, lane + T, ... of the row; a chunk is 8 bf16 (one
// 16-byte access) when dim % 8 == 0 and every bf16 pointer is 16-byte aligned, else 1 element.
//   Tw(dim) = min(32, nextpow2(ceil(ceil(dim / 8) / RMS_CHUNKS_PER_LANE)))     (warp teams)
//   T(dim)  = dim <= 1024 ? Tw(dim) : 256, forward and backward (above 1024 the whole block owns
//             a row: the backward's dw accumulators of a block stay dim floats, and a thread's
//             share of a row fits in registers)
//   e.g. dim 16 -> T 1, R 256; dim 64 -> T 2, R 128; dim 128 -> T 4, R 64; dim 256 -> T 8,
//   R 32; dim 1024 -> T 32, R 8; dim > 1024 -> T 256, R 1.
//   Team sums: shuffle-xor butterflies within the team (T <= 32), or warp butterflies plus the
//   8 warp sums added in warp order (T = 256).
//   Rows in registers (T = 256, 8-wide chunks, dim <= 8 * 256 * RMS_REG_CHUNKS = 8192): a thread
//   reads its <= 4 chunks of the row once, into registers, and computes the output from them,
//   with the next row's loads issued before this row's sum and barrier (forward always; backward
//   for dim <= 4096, within a part). Otherwise (warp teams, 1-element chunks, dim > 8192) a row
//   is read twice (sum, then output); the second read hits L1/L2, so HBM traffic is one read, but
//   each of its chunks is a dependent round trip.
//
// Launch rules (blockDim.x must be RMS_BLOCK = 256 for all three kernels; they trap otherwise):
//   rmsnorm_fwd_bf16:  any grid.x >= 1 (grid-stride over row groups); no dynamic shared memory.
//                      Recommended: R = 256 / T(dim); grid.x = ceil(rows / R) for warp teams; for
//                      T = 256, min(rows, resident blocks per SM * SM count) (occupancy query),
//                      so every block streams ~rows / grid rows with its next row in flight.
//   rmsnorm_bwd_bf16:  R = 256 / T(dim). rows_per_part = max(R, ceil(rows / RMS_BWD_TARGET_PARTS))
//                      recommended (<= 1024 parts: ~2 waves of 4 blocks per SM on an H200, a
//                      small dw_partial); parts = ceil(rows / rows_per_part); grid.x =
//                      max(1, parts) (any grid.x >= 1 is valid: grid-stride over parts); dynamic
//                      shared memory = R * (dim + RMS_SLAB_PAD) * 4 bytes, RMS_SLAB_PAD = 4
//                      (<= 40 KiB for dim <= 1024, (dim + 4) * 4 above: over 48 KiB, i.e.
//                      dim > 12284, needs CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).
//   rmsnorm_dw_reduce_f32: grid.x = ceil(dim / 32) (any grid.x >= 1 is valid); no dynamic smem.
// Order (fixed: the results depend on rows, dim and rows_per_part only, never on the grid):
//   dw_partial[p, c]: team t of the block sums rows p*rpp + t, p*rpp + t + R, ... in increasing
//   order (in shared memory), then the R team sums are added in increasing t. The reduce splits
//   the parts into RMS_DW_SLICES contiguous slices, sums each slice in increasing p, adds the
//   slice sums in increasing slice order, then adds that total to dw[c] (once, as the CPU does).
//   The register paths keep every order above: same bits as the two-pass loops with the same T.
// Bytes:    fwd: rows * dim * 4 + rows * 4 + dim * 2. bwd: rows * dim * 6 (+ 2 more per element
//           with accumulate_dx) + rows * 4 + dim * 2 + parts * dim * 4. reduce: parts * dim * 4 +
//           dim * 8. (The launcher does not zero dw_partial: the kernel writes all of it.)
// FLOPs:    fwd ~4 per element; bwd ~10 per element.
// Bound:    memory. Target >= 80% of the measured device-to-device copy bandwidth (~4.1 TB/s on an
//           H200) for rows * dim >= 2^24, for both the dim = 16..256 and the dim >= 1024 regimes.
//           Bytes in flight per SM at dim 4096: forward 5 blocks x 8 KiB (the next row's x),
//           backward 4 blocks x 16 KiB (the next row's dy and x); ~20 KiB of reads in flight per
//           SM cover HBM latency at 80% of copy bandwidth.
// Measured (H200, 32768 x 4096, N(0, 1) inputs): fwd 88.6%, bwd 91.0% of copy bandwidth (6 bytes
//           per element counted for the backward).
#include "common.cuh"
#include "launch.cuh"

// Threads per block, every rmsnorm kernel (the team math and the 8-warp block sum assume it).
// (RMS_BLOCK, launch.cuh)
#define RMS_WARPS (RMS_BLOCK / 32)
// Largest dim whose backward uses warp teams; above it a whole block owns a row, so that a block's
// dw accumulators (R * dim floats of shared memory) stay small.
// (RMS_WARP_TEAM_MAX_DIM, launch.cuh)
// Floats of padding after each team's dw accumulator slab in the backward (rms_slab_stride).
// (RMS_SLAB_PAD, launch.cuh)
// Chunks of 8 a lane of a warp team owns (at most; fewer for dims that are not a power of two):
// 4 independent 16-byte loads in flight per thread keep enough bytes in flight to cover HBM
// latency even for dim = 16, where a team is a single thread.
// (A constant, not a macro: nvcc does not expand macros inside #pragma unroll.)
// (RMS_CHUNKS_PER_LANE, launch.cuh)
// Most 16-byte chunks per thread the register-resident block-team paths hold (dim <= 8 * 256 * 4 =
// 8192); larger dims take the two-pass loops.
constexpr int RMS_REG_CHUNKS = 4;
// Recommended upper bound on the backward's part count (see the launch rule).
// (RMS_BWD_TARGET_PARTS, launch.cuh)
// Resident blocks per SM the register allocation must allow (__launch_bounds__): 5 x 256 threads
// (<= 48 registers) forward, 4 x 256 (<= 64 registers) backward: enough loads in flight to cover
// HBM latency in a memory-bound kernel, without spills.
#define RMS_FWD_MIN_BLOCKS 5
#define RMS_BWD_MIN_BLOCKS 4
// Loads rmsnorm_dw_reduce_f32 issues together per thread before adding them.
constexpr int RMS_DW_BATCH = 32;
// Contiguous slices of parts summed in parallel by rmsnorm_dw_reduce_f32 (one warp each).
#define RMS_DW_SLICES RMS_WARPS

// Tw(dim) from the header: the forward's team, and the backward's for dim <= 1024.
__device__ __forceinline__ int rms_warp_team_size(int dim) {
  const int chunks = (dim + BF16_PER_VEC - 1) / BF16_PER_VEC;
  const int lanes = (chunks + RMS_CHUNKS_PER_LANE - 1) / RMS_CHUNKS_PER_LANE;
  int t = 1;
  while (t < lanes && t < 32) t <<= 1;
  return t;
}

// T(dim) from the header, forward and backward: warp teams up to dim 1024, then the whole block.
__device__ __forceinline__ int rms_team_size(int dim) {
  return dim > RMS_WARP_TEAM_MAX_DIM ? RMS_BLOCK : rms_warp_team_size(dim);
}

// Floats between two teams' dw accumulator slabs in the backward: dim + RMS_SLAB_PAD. The pad
// (4 floats, keeping 16-byte alignment) staggers the slabs across shared-memory banks; without
// it, at dim = 16 every team's slab starts in the same bank group (4-way conflicts).
__device__ __forceinline__ index_t rms_slab_stride(int dim) { return (index_t)dim + RMS_SLAB_PAD; }

// The lanes of this thread's team within its warp (teams of <= 32 are T-aligned in the warp).
__device__ __forceinline__ unsigned rms_team_mask(int team_size) {
  if (team_size >= 32) return 0xFFFFFFFFu;
  const unsigned lane = threadIdx.x & 31u;
  return ((1u << team_size) - 1u) << (lane & ~(unsigned)(team_size - 1));
}

// Sum of v over the team. Teams <= 32: xor butterfly (every lane ends with the same bits: each
// step adds the same two values, in either order). Block team: warp butterflies, then every
// thread adds the 8 warp sums in warp order. `red` alternates between two buffers per call, so
// one barrier per call suffices: a buffer is rewritten only two calls later, after the barrier of
// the call in between, which every reader of the old values has passed.
__device__ __forceinline__ float rms_team_sum(float v, int team_size, unsigned mask,
                                              float (&red)[2][RMS_WARPS], int& parity) {
  if (team_size <= 32) {
    for (int o = team_size >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
    return v;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  if ((threadIdx.x & 31u) == 0u) red[parity][threadIdx.x >> 5] = v;
  __syncthreads();
  float s = red[parity][0];
#pragma unroll
  for (int i = 1; i < RMS_WARPS; ++i) s += red[parity][i];
  parity ^= 1;
  return s;
}

// ---- forward ------------------------------------------------------------------------------------

template <int V>
__device__ __forceinline__ void rmsnorm_fwd_rows(const __nv_bfloat16* __restrict__ x,
                                                 const __nv_bfloat16* __restrict__ w,
                                                 __nv_bfloat16* __restrict__ y,
                                                 float* __restrict__ rstd, index_t rows, int dim,
                                                 float eps, int team_size,
                                                 float (&red)[2][RMS_WARPS]) {
  const int rows_per_block = RMS_BLOCK / team_size;
  const int lane = threadIdx.x & (team_size - 1);
  const int team = threadIdx.x / team_size;
  const unsigned mask = rms_team_mask(team_size);
  const index_t chunks = dim / V;
  const float dim_f = (float)dim;
  int parity = 0;
  // Block teams: every thread of the block runs the same rows (the barrier in rms_team_sum).
  for (index_t row = (index_t)blockIdx.x * rows_per_block + team; row < rows;
       row += (index_t)gridDim.x * rows_per_block) {
    const __nv_bfloat16* xr = x + row * dim;
    float ss = 0.0f;
    // First touch of the row (HBM): unrolled so a lane's loads are all in flight together.
#pragma unroll RMS_CHUNKS_PER_LANE
    for (index_t k = lane; k < chunks; k += team_size) {
      float f[V];
      bf16_chunk_load<V>(xr + k * V, f);
#pragma unroll
      for (int j = 0; j < V; ++j) ss = fmaf(f[j], f[j], ss);
    }
    ss = rms_team_sum(ss, team_size, mask, red, parity);
    const float ms = __fdiv_rn(ss, dim_f);
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
    if (lane == 0) rstd[row] = r;
    __nv_bfloat16* yr = y + row * dim;
    for (index_t k = lane; k < chunks; k += team_size) {
      float f[V], wf[V];
      bf16_chunk_load<V>(xr + k * V, f); // second read of the row: L1/L2 hit
      bf16_chunk_load<V>(w + k * V, wf);
#pragma unroll
      for (int j = 0; j < V; ++j) f[j] = __fmul_rn(__fmul_rn(f[j], r), wf[j]);
      bf16_chunk_store_rne<V>(yr + k * V, f);
    }
  }
}

// Thread threadIdx.x's <= CPL chunks (threadIdx.x + j * RMS_BLOCK) of a row, as 16-byte words;
// zeros past the row. row_tid = the row's first chunk + threadIdx.x.
template <int CPL>
__device__ __forceinline__ void rms_block_row_load(const uint4* row_tid, int chunks,
                                                   uint4 (&v)[CPL]) {
#pragma unroll
  for (int j = 0; j < CPL; ++j) {
    v[j] = make_uint4(0u, 0u, 0u, 0u);
    if ((int)threadIdx.x + j * RMS_BLOCK < chunks) v[j] = row_tid[j * RMS_BLOCK];
  }
}

// Block teams with the row in registers (8-wide path, 1024 < dim <= 8 * RMS_BLOCK * CPL): thread
// i owns chunks i, i + RMS_BLOCK, ... (as rmsnorm_fwd_rows<8> with T = RMS_BLOCK) and reads each
// chunk of the row once, into registers; the output is computed from them. The two-pass loop
// instead re-read the row after the sum, one dependent L1/L2 round trip per chunk. Software
// pipelined: the loads of the block's next row are issued before this row's sum, barrier and
// stores, so a block always has a row in flight (the launcher runs one block per resident slot,
// grid-striding over rows). The team size is a compile-time constant here, so chunk j's address
// is the thread's base plus an immediate. Same operations in the same order as
// rmsnorm_fwd_rows<8> with the same team, so the same bits.
template <int CPL>
__device__ __forceinline__ void rmsnorm_fwd_rows_block(const __nv_bfloat16* __restrict__ x,
                                                       const __nv_bfloat16* __restrict__ w,
                                                       __nv_bfloat16* __restrict__ y,
                                                       float* __restrict__ rstd, index_t rows,
                                                       int dim, float eps,
                                                       float (&red)[2][RMS_WARPS]) {
  const int tid = threadIdx.x;
  const int chunks = dim / BF16_PER_VEC;
  const float dim_f = (float)dim;
  const uint4* w4 = reinterpret_cast<const uint4*>(w) + tid;
  int parity = 0;
  index_t row = blockIdx.x;
  uint4 xv[CPL];
  if (row < rows) rms_block_row_load<CPL>(reinterpret_cast<const uint4*>(x + row * dim) + tid,
                                          chunks, xv);
  for (; row < rows; row += gridDim.x) { // uniform over the block
    const index_t next = row + gridDim.x;
    uint4 nv[CPL];
    if (next < rows) {
      rms_block_row_load<CPL>(reinterpret_cast<const uint4*>(x + next * dim) + tid, chunks, nv);
    } else {
#pragma unroll
      for (int j = 0; j < CPL; ++j) nv[j] = make_uint4(0u, 0u, 0u, 0u); // never used
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      if (tid + j * RMS_BLOCK < chunks) {
        float f[8];
        bf16x8_unpack(xv[j], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
      }
    }
    ss = rms_team_sum(ss, RMS_BLOCK, 0xFFFFFFFFu, red, parity);
    const float ms = __fdiv_rn(ss, dim_f);
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
    if (tid == 0) rstd[row] = r;
    uint4* yr = reinterpret_cast<uint4*>(y + row * dim) + tid;
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      if (tid + j * RMS_BLOCK < chunks) {
        float f[8], wf[8];
        bf16x8_unpack(xv[j], f);
        // w here, not kept in registers across rows: the same 2 * dim bytes for every row, so
        // L1 hits.
        bf16x8_unpack(w4[j * RMS_BLOCK], wf);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = __fmul_rn(__fmul_rn(f[e], r), wf[e]);
        yr[j * RMS_BLOCK] = bf16x8_pack_rn_fast(f);
      }
    }
#pragma unroll
    for (int j = 0; j < CPL; ++j) xv[j] = nv[j];
  }
}

// The 4-chunk instantiation (4096 < dim <= 8192) as a called function, not inlined: inlined, its
// 16 more live registers made ptxas spill inside the other paths' row loops (the warp-team
// two-pass loops of the QK-norm among them). One call per launch.
__device__ __noinline__ void rmsnorm_fwd_rows_block4(const __nv_bfloat16* __restrict__ x,
                                                     const __nv_bfloat16* __restrict__ w,
                                                     __nv_bfloat16* __restrict__ y,
                                                     float* __restrict__ rstd, index_t rows,
                                                     int dim, float eps,
                                                     float (&red)[2][RMS_WARPS]) {
  rmsnorm_fwd_rows_block<RMS_REG_CHUNKS>(x, w, y, rstd, rows, dim, eps, red);
}

extern "C" __global__ void __launch_bounds__(RMS_BLOCK, RMS_FWD_MIN_BLOCKS)
    rmsnorm_fwd_bf16(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                     __nv_bfloat16* __restrict__ y, float* __restrict__ rstd, long long rows,
                     int dim, float eps) {
  if (blockDim.x != RMS_BLOCK) __trap(); // rows_per_block and the block sum assume it
  if (rows <= 0 || dim <= 0) return;
  __shared__ float red[2][RMS_WARPS];
  const int team_size = rms_team_size(dim);
  // dim % 8 == 0 keeps every row start 16-byte aligned when the base pointers are.
  if (dim % BF16_PER_VEC == 0 && is_vec_aligned(x) && is_vec_aligned(w) && is_vec_aligned(y)) {
    const int chunks = dim / BF16_PER_VEC;
    if (team_size == RMS_BLOCK && chunks <= 2 * RMS_BLOCK) {
      rmsnorm_fwd_rows_block<2>(x, w, y, rstd, rows, dim, eps, red);
    } else if (team_size == RMS_BLOCK && chunks <= RMS_REG_CHUNKS * RMS_BLOCK) {
      rmsnorm_fwd_rows_block4(x, w, y, rstd, rows, dim, eps, red);
    } else {
      rmsnorm_fwd_rows<BF16_PER_VEC>(x, w, y, rstd, rows, dim, eps, team_size, red);
    }
  } else {
    rmsnorm_fwd_rows<1>(x, w, y, rstd, rows, dim, eps, team_size, red);
  }
}

// ---- backward -----------------------------------------------------------------------------------

// acc[0..V) (shared memory) += add[0..V); V == 8 as two 16-byte accesses (acc is 32-byte aligned:
// team slabs are dim * 4 bytes apart with dim % 8 == 0).
template <int V>
__device__ __forceinline__ void smem_chunk_add(float* acc, const float (&add)[V]) {
  if constexpr (V == 8) {
    float4* a4 = reinterpret_cast<float4*>(acc);
    float4 lo = a4[0], hi = a4[1];
    lo.x = __fadd_rn(lo.x, add[0]); lo.y = __fadd_rn(lo.y, add[1]);
    lo.z = __fadd_rn(lo.z, add[2]); lo.w = __fadd_rn(lo.w, add[3]);
    hi.x = __fadd_rn(hi.x, add[4]); hi.y = __fadd_rn(hi.y, add[5]);
    hi.z = __fadd_rn(hi.z, add[6]); hi.w = __fadd_rn(hi.w, add[7]);
    a4[0] = lo;
    a4[1] = hi;
  } else {
    acc[0] = __fadd_rn(acc[0], add[0]);
  }
}

template <int V>
__device__ __forceinline__ void rmsnorm_bwd_parts(
    const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const float* __restrict__ rstd,
    __nv_bfloat16* __restrict__ dx, bool accumulate_dx, float* __restrict__ dw_partial,
    index_t rows, int dim, index_t rows_per_part, int team_size, float* team_acc_all,
    float (&red)[2][RMS_WARPS]) {
  const int rows_per_block = RMS_BLOCK / team_size;
  const int lane = threadIdx.x & (team_size - 1);
  const int team = threadIdx.x / team_size;
  const unsigned mask = rms_team_mask(team_size);
  const index_t chunks = dim / V;
  const float inv_dim = __fdiv_rn(1.0f, (float)dim); // cpu.rs: F::ONE / dim
  const index_t parts = (rows + rows_per_part - 1) / rows_per_part;
  // This team's dw accumulators: one f32 per column, touched only by the lane owning the column
  // (so no barrier between zeroing and accumulating).
  const index_t slab = rms_slab_stride(dim);
  float* acc = team_acc_all + (index_t)team * slab;
  int parity = 0;
  for (index_t p = blockIdx.x; p < parts; p += gridDim.x) { // uniform over the block
    const index_t r0 = p * rows_per_part;
    const index_t r1 = min(rows, r0 + rows_per_part);
    for (index_t k = lane; k < chunks; k += team_size) {
#pragma unroll
      for (int j = 0; j < V; ++j) acc[k * V + j] = 0.0f;
    }
    for (index_t row = r0 + team; row < r1; row += rows_per_block) {
      const __nv_bfloat16* dyr = dy + row * dim;
      const __nv_bfloat16* xr = x + row * dim;
      float gx = 0.0f;
      // First touch of the row (HBM): unrolled so a lane's loads are all in flight together.
#pragma unroll RMS_CHUNKS_PER_LANE
      for (index_t k = lane; k < chunks; k += team_size) {
        float d[V], xf[V], wf[V];
        bf16_chunk_load<V>(dyr + k * V, d);
        bf16_chunk_load<V>(xr + k * V, xf);
        bf16_chunk_load<V>(w + k * V, wf);
#pragma unroll
        for (int j = 0; j < V; ++j) gx = fmaf(__fmul_rn(d[j], wf[j]), xf[j], gx);
      }
      gx = rms_team_sum(gx, team_size, mask, red, parity);
      const float r = rstd[row];
      const float coef = __fmul_rn(__fmul_rn(__fmul_rn(__fmul_rn(gx, r), r), r), inv_dim);
      __nv_bfloat16* dxr = dx + row * dim;
      for (index_t k = lane; k < chunks; k += team_size) {
        float d[V], xf[V], wf[V], g[V], dwc[V];
        bf16_chunk_load<V>(dyr + k * V, d); // second read of the row: L1/L2 hit
        bf16_chunk_load<V>(xr + k * V, xf);
        bf16_chunk_load<V>(w + k * V, wf);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          g[j] = __fsub_rn(__fmul_rn(__fmul_rn(r, d[j]), wf[j]), __fmul_rn(xf[j], coef));
          dwc[j] = __fmul_rn(__fmul_rn(d[j], xf[j]), r);
        }
        if (accumulate_dx) {
          float old[V];
          bf16_chunk_load<V>(dxr + k * V, old);
#pragma unroll
          for (int j = 0; j < V; ++j) g[j] = __fadd_rn(old[j], g[j]);
        }
        bf16_chunk_store_rne<V>(dxr + k * V, g);
        smem_chunk_add<V>(acc + k * V, dwc);
      }
    }
    __syncthreads(); // every team's sums are in shared memory
    for (int c = threadIdx.x; c < dim; c += RMS_BLOCK) {
      float s = team_acc_all[c];
      for (int t = 1; t < rows_per_block; ++t) s = __fadd_rn(s, team_acc_all[t * slab + c]);
      dw_partial[p * dim + c] = s;
    }
    __syncthreads(); // the next part zeroes the accumulators only after they were read
  }
}

// Block teams with the rows in registers (8-wide path, 1024 < dim <= 8 * RMS_BLOCK * CPL):
// rmsnorm_bwd_parts<8> with T = RMS_BLOCK (one row at a time, R = 1), each thread's dy and x
// chunks read once, into registers, and the second phase computed from them instead of
// re-reading the row. Software pipelined within a part (CPL <= 2): the dy and x loads of the next
// row are issued before this row's sum and barrier, so a block always has a row in flight.
// Accumulating into dx, the old dx chunks are loaded at the top of the row. Same operations in
// the same order as rmsnorm_bwd_parts<8>, so the same dx and dw_partial bits.
template <int CPL>
__device__ __forceinline__ void rmsnorm_bwd_parts_block(
    const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const float* __restrict__ rstd,
    __nv_bfloat16* __restrict__ dx, bool accumulate_dx, float* __restrict__ dw_partial,
    index_t rows, int dim, index_t rows_per_part, float* acc, float (&red)[2][RMS_WARPS]) {
  // At CPL 4 the prefetch and the early old dx would need 32 more registers and spill: the row's
  // loads are then issued after the previous row's stores, and the old dx where it is added.
  constexpr bool kPrefetch = CPL <= 2;
  constexpr bool kEarlyOld = CPL <= 2;
  const int tid = threadIdx.x;
  const int chunks = dim / BF16_PER_VEC;
  const float inv_dim = __fdiv_rn(1.0f, (float)dim); // cpu.rs: F::ONE / dim
  const index_t parts = (rows + rows_per_part - 1) / rows_per_part;
  const uint4* w4 = reinterpret_cast<const uint4*>(w) + tid;
  // The block's dw accumulators (one team: dim floats), thread tid's columns only, so no barrier
  // between zeroing and accumulating.
  float4* acc4 = reinterpret_cast<float4*>(acc) + 2 * tid;
  int parity = 0;
  for (index_t p = blockIdx.x; p < parts; p += gridDim.x) { // uniform over the block
    const index_t r0 = p * rows_per_part;
    const index_t r1 = min(rows, r0 + rows_per_part);
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      if (tid + j * RMS_BLOCK < chunks) {
        acc4[2 * j * RMS_BLOCK] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        acc4[2 * j * RMS_BLOCK + 1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    uint4 dv[CPL], xv[CPL]; // r0 < r1: a part holds at least one row
    rms_block_row_load<CPL>(reinterpret_cast<const uint4*>(dy + r0 * dim) + tid, chunks, dv);
    rms_block_row_load<CPL>(reinterpret_cast<const uint4*>(x + r0 * dim) + tid, chunks, xv);
    for (index_t row = r0; row < r1; ++row) { // uniform over the block
      uint4* dxr = reinterpret_cast<uint4*>(dx + row * dim) + tid;
      uint4 ov[CPL];
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        ov[j] = make_uint4(0u, 0u, 0u, 0u);
        if (kEarlyOld && accumulate_dx && tid + j * RMS_BLOCK < chunks) ov[j] = dxr[j * RMS_BLOCK];
      }
      uint4 ndv[CPL], nxv[CPL];
      if (kPrefetch && row + 1 < r1) {
        rms_block_row_load<CPL>(reinterpret_cast<const uint4*>(dy + (row + 1) * dim) + tid,
                                chunks, ndv);
        rms_block_row_load<CPL>(reinterpret_cast<const uint4*>(x + (row + 1) * dim) + tid,
                                chunks, nxv);
      } else {
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
          ndv[j] = make_uint4(0u, 0u, 0u, 0u); // never used
          nxv[j] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
      const float r = rstd[row];
      float gx = 0.0f;
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        if (tid + j * RMS_BLOCK < chunks) {
          float d[8], xf[8], wf[8];
          bf16x8_unpack(dv[j], d);
          bf16x8_unpack(xv[j], xf);
          bf16x8_unpack(w4[j * RMS_BLOCK], wf); // the same 2 * dim bytes every row: L1 hits
#pragma unroll
          for (int e = 0; e < 8; ++e) gx = fmaf(__fmul_rn(d[e], wf[e]), xf[e], gx);
        }
      }
      gx = rms_team_sum(gx, RMS_BLOCK, 0xFFFFFFFFu, red, parity);
      const float coef = __fmul_rn(__fmul_rn(__fmul_rn(__fmul_rn(gx, r), r), r), inv_dim);
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        if (tid + j * RMS_BLOCK < chunks) {
          float d[8], xf[8], wf[8], g[8], dwc[8];
          bf16x8_unpack(dv[j], d);
          bf16x8_unpack(xv[j], xf);
          bf16x8_unpack(w4[j * RMS_BLOCK], wf);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            g[e] = __fsub_rn(__fmul_rn(__fmul_rn(r, d[e]), wf[e]), __fmul_rn(xf[e], coef));
            dwc[e] = __fmul_rn(__fmul_rn(d[e], xf[e]), r);
          }
          if (accumulate_dx) {
            float old[8];
            bf16x8_unpack(kEarlyOld ? ov[j] : dxr[j * RMS_BLOCK], old);
#pragma unroll
            for (int e = 0; e < 8; ++e) g[e] = __fadd_rn(old[e], g[e]);
          }
          dxr[j * RMS_BLOCK] = bf16x8_pack_rn_fast(g);
          smem_chunk_add<BF16_PER_VEC>(reinterpret_cast<float*>(acc4 + 2 * j * RMS_BLOCK), dwc);
        }
      }
      if (kPrefetch) {
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
          dv[j] = ndv[j];
          xv[j] = nxv[j];
        }
      } else if (row + 1 < r1) {
        rms_block_row_load<CPL>(reinterpret_cast<const uint4*>(dy + (row + 1) * dim) + tid,
                                chunks, dv);
        rms_block_row_load<CPL>(reinterpret_cast<const uint4*>(x + (row + 1) * dim) + tid,
                                chunks, xv);
      }
    }
    __syncthreads(); // every thread's sums are in shared memory
    // One team: dw_partial[p, c] = acc[c] (rmsnorm_bwd_parts' team loop adds nothing more).
    for (int c = tid; c < dim; c += RMS_BLOCK) dw_partial[p * dim + c] = acc[c];
    __syncthreads(); // the next part zeroes the accumulators only after they were read
  }
}

// Called, not inlined, for the same reason as rmsnorm_fwd_rows_block4.
__device__ __noinline__ void rmsnorm_bwd_parts_block4(
    const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const float* __restrict__ rstd,
    __nv_bfloat16* __restrict__ dx, bool accumulate_dx, float* __restrict__ dw_partial,
    index_t rows, int dim, index_t rows_per_part, float* acc, float (&red)[2][RMS_WARPS]) {
  rmsnorm_bwd_parts_block<RMS_REG_CHUNKS>(dy, x, w, rstd, dx, accumulate_dx, dw_partial, rows, dim,
                                          rows_per_part, acc, red);
}

extern "C" __global__ void __launch_bounds__(RMS_BLOCK, RMS_BWD_MIN_BLOCKS)
    rmsnorm_bwd_bf16(const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ x,
                     const __nv_bfloat16* __restrict__ w, const float* __restrict__ rstd,
                     __nv_bfloat16* __restrict__ dx, int accumulate_dx,
                     float* __restrict__ dw_partial, long long rows, int dim,
                     int rows_per_part) {
  if (blockDim.x != RMS_BLOCK) __trap(); // rows_per_block and the block sum assume it
  if (rows <= 0 || dim <= 0 || rows_per_part <= 0) return;
  // [R][dim + RMS_SLAB_PAD] f32 dw accumulators, R = RMS_BLOCK / T: the launcher sizes it.
  extern __shared__ float4 rms_dyn_smem[]; // float4: 16-byte aligned for the vector path
  __shared__ float red[2][RMS_WARPS];
  float* team_acc_all = reinterpret_cast<float*>(rms_dyn_smem);
  const int team_size = rms_team_size(dim);
  const bool acc_dx = accumulate_dx != 0;
  if (dim % BF16_PER_VEC == 0 && is_vec_aligned(dy) && is_vec_aligned(x) && is_vec_aligned(w) &&
      is_vec_aligned(dx)) {
    const int chunks = dim / BF16_PER_VEC;
    if (team_size == RMS_BLOCK && chunks <= 2 * RMS_BLOCK) {
      rmsnorm_bwd_parts_block<2>(dy, x, w, rstd, dx, acc_dx, dw_partial, rows, dim,
                                 rows_per_part, team_acc_all, red);
    } else if (team_size == RMS_BLOCK && chunks <= RMS_REG_CHUNKS * RMS_BLOCK) {
      rmsnorm_bwd_parts_block4(dy, x, w, rstd, dx, acc_dx, dw_partial, rows, dim, rows_per_part,
                               team_acc_all, red);
    } else {
      rmsnorm_bwd_parts<BF16_PER_VEC>(dy, x, w, rstd, dx, acc_dx, dw_partial, rows, dim,
                                      rows_per_part, team_size, team_acc_all, red);
    }
  } else {
    rmsnorm_bwd_parts<1>(dy, x, w, rstd, dx, acc_dx, dw_partial, rows, dim, rows_per_part,
                         team_size, team_acc_all, red);
  }
}

// dw[c] += sum_p dw_partial[p, c]. Block = 32 columns x RMS_DW_SLICES warps; warp s sums its
// contiguous slice of parts in increasing p (coalesced: 32 adjacent columns per load), then lane
// c of warp 0 adds the slice sums in slice order and adds the total to dw[c].
extern "C" __global__ void __launch_bounds__(RMS_BLOCK, 1)
    rmsnorm_dw_reduce_f32(const float* __restrict__ dw_partial, int parts, float* __restrict__ dw,
                          int dim) {
  if (blockDim.x != RMS_BLOCK) __trap(); // one warp per slice
  if (dim <= 0) return;
  __shared__ float slice_sum[RMS_DW_SLICES][32];
  const int lane = threadIdx.x & 31;
  const int slice = threadIdx.x >> 5;
  const index_t n_parts = parts > 0 ? parts : 0;
  const index_t per_slice = (n_parts + RMS_DW_SLICES - 1) / RMS_DW_SLICES;
  const index_t p0 = min(n_parts, (index_t)slice * per_slice);
  const index_t p1 = min(n_parts, p0 + per_slice);
  const index_t groups = ((index_t)dim + 31) / 32;
  for (index_t cg = blockIdx.x; cg < groups; cg += gridDim.x) { // uniform over the block
    const index_t c = cg * 32 + lane;
    float s = 0.0f;
    if (c < dim) {
      // The loads do not depend on s: batches of RMS_DW_BATCH loads are issued before their adds
      // (at 1024 parts a slice is 128 of them: 8 round trips to memory instead of ~32 with the
      // compiler's own interleaving; dim / 32 blocks are too few to hide latency with more warps).
      // The adds stay in increasing p.
      index_t p = p0;
      for (; p + RMS_DW_BATCH <= p1; p += RMS_DW_BATCH) {
        float v[RMS_DW_BATCH];
#pragma unroll
        for (int i = 0; i < RMS_DW_BATCH; ++i) v[i] = dw_partial[(p + i) * dim + c];
#pragma unroll
        for (int i = 0; i < RMS_DW_BATCH; ++i) s = __fadd_rn(s, v[i]);
      }
      for (; p < p1; ++p) s = __fadd_rn(s, dw_partial[p * dim + c]);
    }
    slice_sum[slice][lane] = s;
    __syncthreads();
    if (slice == 0 && c < dim) {
      float total = slice_sum[0][lane];
#pragma unroll
      for (int i = 1; i < RMS_DW_SLICES; ++i) total = __fadd_rn(total, slice_sum[i][lane]);
      dw[c] = __fadd_rn(dw[c], total); // cpu.rs: *dwc + acc
    }
    __syncthreads(); // slice_sum is rewritten by the next column group
  }
}
