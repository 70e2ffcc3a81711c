// elementwise.cu: fills, dtype conversions, the non-finite counter and the embedding gather: the
// memory-bound odds and ends every step needs.
//
// Math (n elements, T = bf16, every bf16 write one RNE rounding, f32_to_bf16_rne = half::bf16):
//   fill_f32             x[i] = v                                   fill_bf16  x[i] = bf16(v)
//   convert_f32_to_bf16  dst[i] = bf16(src[i])                      convert_bf16_to_f32  exact
//   count_nonfinite_*    out[0] += #{i : x[i] is NaN or +-Inf}      (u64; launcher zeroes out[0])
//   embed_bf16           out[r, :] = table[ids[r], :] (bit copy); ids[r] outside [0, vocab)
//                        -> out[r, :] = NaN (0x7FC0) so the finite check catches it.
// Layouts:  flat contiguous arrays; embed: table [vocab, dim], out [rows, dim] row-major bf16,
//           ids [rows] i32. The launcher passes offset views as pointers (table + off).
// Preconditions: n, rows, dim >= 0 (<= 0: nothing to do); src/dst, table/out do not overlap.
// Fast path: 16-byte accesses when every pointer is 16-byte aligned (and, for embed, dim % 8 == 0):
//           8 bf16 or 4 f32 per access; the remaining n % 8 (n % 4) elements, or everything when
//           unaligned, take a scalar loop. Results are bit-identical on both paths.
// Launch (every kernel here): blockDim.x any multiple of 32 up to 1024 (256 suggested; the
//           count kernels trap otherwise because their warp reduction needs whole warps); grid.x
//           any >= 1 (grid-stride loops). Suggested grid.x = clamp(ceil(work / 256), 1,
//           16 * SM count) with work = ceil(n / 8) (bf16 vectors), ceil(n / 4) (fill_f32), or
//           rows * ceil(dim / 8) (embed). No shared memory, no scratch.
// Bytes:    fill: 4n / 2n written. convert: 4n + 2n. count: 4n / 2n read.
//           embed: rows * dim * 2 * 2 + rows * 4.
// FLOPs:    0 (integer bit tests for count).
// Bound:    memory. Target >= 80% of the measured device-to-device copy bandwidth (~4.1 TB/s on
//           an H200) for n or rows * dim >= 2^24; embed's table rows are random 2*dim-byte reads.
// Determinism: no float reductions; count uses one integer atomicAdd per warp with a non-zero
//           count (exact in any order).
#include "common.cuh"

// f32 elements in one VEC_BYTES access.
#define F32_PER_VEC 4
// bf16 NaN written for an out-of-range embedding id: the canonical quiet NaN, i.e. what
// f32_to_bf16_rne(NAN) gives.
#define BF16_NAN_BITS 0x7FC0u

// ---- fills ------------------------------------------------------------------------------------

extern "C" __global__ void fill_f32(float* __restrict__ x, long long n, float v) {
  if (n <= 0) return;
  const index_t first = grid_thread_index();
  const index_t stride = grid_thread_count();
  index_t done = 0; // elements covered by the vector loop
  if (is_vec_aligned(x)) {
    const index_t nv = n / F32_PER_VEC;
    const float4 v4 = make_float4(v, v, v, v);
    float4* x4 = reinterpret_cast<float4*>(x);
    for (index_t i = first; i < nv; i += stride) x4[i] = v4;
    done = nv * F32_PER_VEC;
  }
  for (index_t i = done + first; i < n; i += stride) x[i] = v;
}

extern "C" __global__ void fill_bf16(__nv_bfloat16* __restrict__ x, long long n, float v) {
  if (n <= 0) return;
  // Rounded once, here; every element gets the same bits.
  const uint32_t b = f32_to_bf16_bits_rne(v);
  const index_t first = grid_thread_index();
  const index_t stride = grid_thread_count();
  index_t done = 0;
  if (is_vec_aligned(x)) {
    const index_t nv = n / BF16_PER_VEC;
    const uint32_t b2 = b | (b << 16);
    const uint4 v4 = make_uint4(b2, b2, b2, b2);
    uint4* x4 = reinterpret_cast<uint4*>(x);
    for (index_t i = first; i < nv; i += stride) x4[i] = v4;
    done = nv * BF16_PER_VEC;
  }
  unsigned short* xs = reinterpret_cast<unsigned short*>(x);
  for (index_t i = done + first; i < n; i += stride) xs[i] = (unsigned short)b;
}

// ---- conversions ------------------------------------------------------------------------------

extern "C" __global__ void convert_f32_to_bf16(const float* __restrict__ src,
                                               __nv_bfloat16* __restrict__ dst, long long n) {
  if (n <= 0) return;
  const index_t first = grid_thread_index();
  const index_t stride = grid_thread_count();
  index_t done = 0;
  if (is_vec_aligned(src) && is_vec_aligned(dst)) {
    const index_t nv = n / BF16_PER_VEC;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (index_t i = first; i < nv; i += stride) {
      const float4 a = s4[2 * i];
      const float4 b = s4[2 * i + 1];
      const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      d4[i] = bf16x8_pack_rne(f);
    }
    done = nv * BF16_PER_VEC;
  }
  for (index_t i = done + first; i < n; i += stride) dst[i] = f32_to_bf16_rne(src[i]);
}

extern "C" __global__ void convert_bf16_to_f32(const __nv_bfloat16* __restrict__ src,
                                               float* __restrict__ dst, long long n) {
  if (n <= 0) return;
  const index_t first = grid_thread_index();
  const index_t stride = grid_thread_count();
  index_t done = 0;
  if (is_vec_aligned(src) && is_vec_aligned(dst)) {
    const index_t nv = n / BF16_PER_VEC;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    float4* d4 = reinterpret_cast<float4*>(dst);
    for (index_t i = first; i < nv; i += stride) {
      float f[8];
      bf16x8_unpack(s4[i], f);
      d4[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
      d4[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
    done = nv * BF16_PER_VEC;
  }
  for (index_t i = done + first; i < n; i += stride) dst[i] = bf16_to_f32(src[i]);
}

// ---- non-finite counters ----------------------------------------------------------------------

// Sums each warp's counts and adds them to out[0] with one integer atomic per warp that found
// anything (almost never: a healthy run adds nothing). Every thread of a whole warp must call it.
__device__ __forceinline__ void nonfinite_flush(unsigned long long count,
                                                unsigned long long* out) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) count += __shfl_xor_sync(0xFFFFFFFFu, count, o);
  if ((threadIdx.x & 31u) == 0u && count != 0ull) atomicAdd(out, count);
}

extern "C" __global__ void count_nonfinite_f32(const float* __restrict__ x, long long n,
                                               unsigned long long* __restrict__ out) {
  if ((blockDim.x & 31u) != 0u) __trap(); // the warp reduction needs whole warps
  const index_t first = grid_thread_index();
  const index_t stride = grid_thread_count();
  unsigned long long count = 0;
  index_t done = 0;
  if (n > 0 && is_vec_aligned(x)) {
    const index_t nv = n / F32_PER_VEC;
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    for (index_t i = first; i < nv; i += stride) {
      const uint4 v = x4[i];
      count += f32_bits_nonfinite(v.x) + f32_bits_nonfinite(v.y) + f32_bits_nonfinite(v.z) +
               f32_bits_nonfinite(v.w);
    }
    done = nv * F32_PER_VEC;
  }
  const uint32_t* xb = reinterpret_cast<const uint32_t*>(x);
  for (index_t i = done + first; i < n; i += stride) count += f32_bits_nonfinite(xb[i]);
  nonfinite_flush(count, out); // every thread gets here: no early return above
}

extern "C" __global__ void count_nonfinite_bf16(const __nv_bfloat16* __restrict__ x, long long n,
                                                unsigned long long* __restrict__ out) {
  if ((blockDim.x & 31u) != 0u) __trap(); // the warp reduction needs whole warps
  const index_t first = grid_thread_index();
  const index_t stride = grid_thread_count();
  unsigned long long count = 0;
  index_t done = 0;
  if (n > 0 && is_vec_aligned(x)) {
    const index_t nv = n / BF16_PER_VEC;
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    for (index_t i = first; i < nv; i += stride) {
      const uint4 v = x4[i];
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        count += bf16_bits_nonfinite(w[j] & 0xFFFFu) + bf16_bits_nonfinite(w[j] >> 16);
      }
    }
    done = nv * BF16_PER_VEC;
  }
  const unsigned short* xb = reinterpret_cast<const unsigned short*>(x);
  for (index_t i = done + first; i < n; i += stride) count += bf16_bits_nonfinite(xb[i]);
  nonfinite_flush(count, out);
}

// ---- embedding gather -------------------------------------------------------------------------

// Items are chunks of V elements of out, walked as (row, chunk) without per-item division.
template <int V>
__device__ __forceinline__ void embed_rows(const __nv_bfloat16* __restrict__ table,
                                           const int* __restrict__ ids,
                                           __nv_bfloat16* __restrict__ out, index_t rows,
                                           index_t dim, index_t vocab) {
  const index_t chunks_per_row = dim / V;
  const index_t total = rows * chunks_per_row;
  const index_t stride = grid_thread_count();
  index_t e = grid_thread_index();
  RowCol pos = rowcol_split(e, chunks_per_row);
  const RowCol d = rowcol_split(stride, chunks_per_row);
  for (; e < total; e += stride, rowcol_advance(pos, d, chunks_per_row)) {
    const index_t id = ids[pos.row];
    __nv_bfloat16* dst = out + pos.row * dim + pos.col * V;
    if constexpr (V == 8) {
      uint4 v = make_uint4(BF16_NAN_BITS * 0x10001u, BF16_NAN_BITS * 0x10001u,
                           BF16_NAN_BITS * 0x10001u, BF16_NAN_BITS * 0x10001u);
      if (id >= 0 && id < vocab) {
        v = *reinterpret_cast<const uint4*>(table + id * dim + pos.col * V);
      }
      *reinterpret_cast<uint4*>(dst) = v;
    } else {
      unsigned short v = (unsigned short)BF16_NAN_BITS;
      if (id >= 0 && id < vocab) {
        v = *reinterpret_cast<const unsigned short*>(table + id * dim + pos.col);
      }
      *reinterpret_cast<unsigned short*>(dst) = v;
    }
  }
}

extern "C" __global__ void embed_bf16(const __nv_bfloat16* __restrict__ table,
                                      const int* __restrict__ ids,
                                      __nv_bfloat16* __restrict__ out, long long rows,
                                      long long dim, long long vocab) {
  if (rows <= 0 || dim <= 0) return;
  // A row starts at id * dim elements: dim % 8 == 0 keeps every row 16-byte aligned.
  if (dim % BF16_PER_VEC == 0 && is_vec_aligned(table) && is_vec_aligned(out)) {
    embed_rows<BF16_PER_VEC>(table, ids, out, rows, dim, vocab);
  } else {
    embed_rows<1>(table, ids, out, rows, dim, vocab);
  }
}
