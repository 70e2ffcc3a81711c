// common.cuh: index types, grid-stride helpers and bf16 <-> f32 conversions shared by every kernel
// family. Included, never compiled alone (build.rs compiles only kernels/*.cu).
//
// Conventions every kernel follows (STYLE.md rules 4 and 2):
// - 64-bit index math everywhere: tensors reach 2^31 elements (one step's packed taps for a 27B
//   target are ~2^30 bf16, and tests exercise > 2^31), so an `int` index silently wraps.
// - bf16 rounding matches the CPU reference bit for bit: the CPU backend rounds with
//   `half::bf16::from_f32`, reproduced here by `f32_to_bf16_bits_rne` (NaN payloads included).
// - No fast-math: build.rs compiles without --use_fast_math, so f32 denormals are kept (-ftz=false)
//   as on the CPU; where an expression must not be contracted into an FMA we say so with
//   __fmul_rn / __fadd_rn.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

// Signed 64-bit element index / count. Signed so that `i < n` loops and differences behave, and
// so that it matches the `long long` kernel arguments the Rust launchers pass (i64).
typedef long long index_t;

// Bytes in one vectorised global access (ld.global.v4.u32 / st.global.v4.u32).
#define VEC_BYTES 16
// bf16 elements in one VEC_BYTES access.
#define BF16_PER_VEC 8

// This thread's index in a 1-D grid, in 64 bits (blockIdx.x * blockDim.x overflows 32 bits for
// grids of more than 2^31 threads).
__device__ __forceinline__ index_t grid_thread_index() {
  return (index_t)blockIdx.x * (index_t)blockDim.x + (index_t)threadIdx.x;
}

// Threads in a 1-D grid: the stride of a grid-stride loop, in 64 bits.
__device__ __forceinline__ index_t grid_thread_count() {
  return (index_t)gridDim.x * (index_t)blockDim.x;
}

// True when `p` may be accessed with VEC_BYTES-wide loads/stores.
__device__ __forceinline__ bool is_vec_aligned(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % VEC_BYTES) == 0;
}

// bf16 bits -> f32: exact (bf16 is the top half of an f32), NaN payloads kept.
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}

__device__ __forceinline__ float bf16_to_f32(__nv_bfloat16 x) {
  return bf16_bits_to_f32(__bfloat16_as_ushort(x));
}

// f32 -> bf16 bits, round to nearest, ties to even; a NaN stays a NaN with its sign and top
// payload bits and the quiet bit set. This is exactly `half::bf16::from_f32` (the CPU reference),
// so bit-equality tests hold even for NaN inputs; __float2bfloat16_rn does not promise that.
__device__ __forceinline__ uint32_t f32_to_bf16_bits_rne(float f) {
  const uint32_t x = __float_as_uint(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    return (x >> 16) | 0x0040u;
  }
  // Adding 0x7FFF plus the lowest kept bit rounds to nearest with ties to even; a carry out of
  // the mantissa correctly bumps the exponent (up to +inf).
  const uint32_t lsb = (x >> 16) & 1u;
  return (x + 0x7FFFu + lsb) >> 16;
}

__device__ __forceinline__ __nv_bfloat16 f32_to_bf16_rne(float f) {
  return __ushort_as_bfloat16((unsigned short)f32_to_bf16_bits_rne(f));
}

// Two bf16 packed in one u32 (element 0 in the low half, as in memory) <-> two f32.
__device__ __forceinline__ float bf16x2_lo_to_f32(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16x2_hi_to_f32(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ uint32_t pack_bf16x2_rne(float lo, float hi) {
  return f32_to_bf16_bits_rne(lo) | (f32_to_bf16_bits_rne(hi) << 16);
}

// Two f32 -> two packed bf16 (lo in the low half) with the hardware's cvt.rn.bf16x2.f32: one
// instruction instead of ~14 integer ones. Round to nearest even, subnormals kept, overflow to
// +-Inf: the same bits as pack_bf16x2_rne (half::bf16::from_f32) for every non-NaN input. A NaN
// comes out as a NaN, but PTX does not promise its payload, so kernels whose NaN bits must match
// the CPU (pack) test for NaN first; kernels compared with a tolerance (a NaN fails it anyway)
// use this directly.
__device__ __forceinline__ uint32_t pack_bf16x2_rn_fast(float lo, float hi) {
  uint32_t d;
  // cvt.rn.bf16x2.f32 d, a, b puts a in the upper half and b in the lower half.
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// ---- 8-wide bf16 chunks, non-finite tests, division-free row/column walks -----------------------
// (used by elementwise, rmsnorm, rope, swiglu, cross_entropy)

// One VEC_BYTES access of 8 bf16 -> 8 f32 (f[j] is element j in memory order). Exact.
__device__ __forceinline__ void bf16x8_unpack(const uint4 v, float (&f)[8]) {
  f[0] = bf16x2_lo_to_f32(v.x); f[1] = bf16x2_hi_to_f32(v.x);
  f[2] = bf16x2_lo_to_f32(v.y); f[3] = bf16x2_hi_to_f32(v.y);
  f[4] = bf16x2_lo_to_f32(v.z); f[5] = bf16x2_hi_to_f32(v.z);
  f[6] = bf16x2_lo_to_f32(v.w); f[7] = bf16x2_hi_to_f32(v.w);
}

// One 8-byte access of 4 bf16 -> 4 f32 (memory order). Exact.
__device__ __forceinline__ void bf16x4_unpack(const uint2 v, float (&f)[4]) {
  f[0] = bf16x2_lo_to_f32(v.x); f[1] = bf16x2_hi_to_f32(v.x);
  f[2] = bf16x2_lo_to_f32(v.y); f[3] = bf16x2_hi_to_f32(v.y);
}

// 8 f32 -> 8 bf16 in one uint4, each rounded once like half::bf16::from_f32.
__device__ __forceinline__ uint4 bf16x8_pack_rne(const float (&f)[8]) {
  return make_uint4(pack_bf16x2_rne(f[0], f[1]), pack_bf16x2_rne(f[2], f[3]),
                    pack_bf16x2_rne(f[4], f[5]), pack_bf16x2_rne(f[6], f[7]));
}

// bf16x8_pack_rne with the hardware conversion (pack_bf16x2_rn_fast: NaN payloads not kept).
__device__ __forceinline__ uint4 bf16x8_pack_rn_fast(const float (&f)[8]) {
  return make_uint4(pack_bf16x2_rn_fast(f[0], f[1]), pack_bf16x2_rn_fast(f[2], f[3]),
                    pack_bf16x2_rn_fast(f[4], f[5]), pack_bf16x2_rn_fast(f[6], f[7]));
}

// True when any of the 8 bf16 in v is a NaN or an Inf. Four bf16x2 FMAs v * 0 + acc (on the FMA
// pipe, not the integer pipe): a finite value times 0 is +-0 and +-0 + +-0 stays a zero, while a
// NaN or an Inf times 0 is a NaN, which the chain carries to the end; then one mask test.
__device__ __forceinline__ bool bf16x8_any_nonfinite(const uint4 v) {
  uint32_t acc;
  asm("{\n\t"
      ".reg .b32 z;\n\t"
      "mov.b32 z, 0;\n\t"
      "fma.rn.bf16x2 %0, %1, z, z;\n\t"
      "fma.rn.bf16x2 %0, %2, z, %0;\n\t"
      "fma.rn.bf16x2 %0, %3, z, %0;\n\t"
      "fma.rn.bf16x2 %0, %4, z, %0;\n\t"
      "}"
      : "=&r"(acc)
      : "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
  return (acc & 0x7FFF7FFFu) != 0u;
}

// V consecutive bf16 at p as f32: V == 8 is one 16-byte load (p must be VEC_BYTES-aligned),
// V == 1 one 2-byte load. Kernels pick V = 8 only after checking size % 8 and alignment.
template <int V>
__device__ __forceinline__ void bf16_chunk_load(const __nv_bfloat16* p, float (&f)[V]) {
  if constexpr (V == 8) {
    bf16x8_unpack(*reinterpret_cast<const uint4*>(p), f);
  } else {
    static_assert(V == 1, "bf16 chunks are 8 or 1 elements");
    f[0] = bf16_to_f32(*p);
  }
}

// The store matching bf16_chunk_load: each value rounded once (RNE, as the CPU reference).
template <int V>
__device__ __forceinline__ void bf16_chunk_store_rne(__nv_bfloat16* p, const float (&f)[V]) {
  if constexpr (V == 8) {
    *reinterpret_cast<uint4*>(p) = bf16x8_pack_rne(f);
  } else {
    static_assert(V == 1, "bf16 chunks are 8 or 1 elements");
    *p = f32_to_bf16_rne(f[0]);
  }
}

// bf16_chunk_store_rne with the hardware conversion for V == 8 (pack_bf16x2_rn_fast: the same bits
// for every non-NaN value, NaN payloads not kept), for kernels compared with a tolerance.
template <int V>
__device__ __forceinline__ void bf16_chunk_store_rn_fast(__nv_bfloat16* p, const float (&f)[V]) {
  if constexpr (V == 8) {
    *reinterpret_cast<uint4*>(p) = bf16x8_pack_rn_fast(f);
  } else {
    bf16_chunk_store_rne<V>(p, f);
  }
}

// NaN or +-Inf (exponent all ones), from the raw bits: no float compare, so no FTZ/NaN subtleties.
__device__ __forceinline__ bool f32_bits_nonfinite(uint32_t bits) {
  return (bits & 0x7F800000u) == 0x7F800000u;
}
__device__ __forceinline__ bool bf16_bits_nonfinite(uint32_t bits16) {
  return (bits16 & 0x7F80u) == 0x7F80u;
}

// Position of flat index e in a [*, width] grid of items. A grid-stride loop splits its start
// and its stride once (the only 64-bit divisions) and then walks with rowcol_advance.
struct RowCol {
  index_t row;
  index_t col;
};

__device__ __forceinline__ RowCol rowcol_split(index_t e, index_t width) {
  RowCol p;
  p.row = e / width;
  p.col = e - p.row * width;
  return p;
}

// p += d (d = rowcol_split(stride)): one carry suffices because p.col, d.col < width.
__device__ __forceinline__ void rowcol_advance(RowCol& p, const RowCol& d, index_t width) {
  p.col += d.col;
  if (p.col >= width) {
    p.col -= width;
    p.row += 1;
  }
  p.row += d.row;
}

// A row of D bf16 spread over a warp: lane_dims(D) consecutive elements per lane (D / 32 from D
// 32 up: one 8-byte load per lane at D 128, 16 bytes at D 256; below 32 one element for each of
// the first D lanes). bf16_lane_load reads V consecutive elements at p (p aligned to V * 2 bytes).
__host__ __device__ constexpr int bf16_lane_dims(int D) { return D >= 32 ? D / 32 : 1; }

template <int V>
__device__ __forceinline__ void bf16_lane_load(const __nv_bfloat16* p, float (&f)[V]) {
  if constexpr (V == 8) {
    bf16x8_unpack(*reinterpret_cast<const uint4*>(p), f);
  } else if constexpr (V == 4) {
    bf16x4_unpack(*reinterpret_cast<const uint2*>(p), f);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = bf16_to_f32(p[i]);
  }
}

// A lane's V consecutive bf16 values, kept packed (two to a register) until used: a warp holds
// several heads' loads in flight in half the registers their floats would take.
template <int V>
struct Bf16LaneBits {
  uint32_t w[(V + 1) / 2];
  __device__ __forceinline__ void load(const __nv_bfloat16* p) {
    if constexpr (V == 8) {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    } else if constexpr (V == 4) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      w[0] = u.x, w[1] = u.y;
    } else if constexpr (V == 2) {
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    } else {
      w[0] = __bfloat16_as_ushort(p[0]);
    }
  }
  // Element j as f32 (exact: a bf16 is the top half of its f32).
  __device__ __forceinline__ float at(int j) const {
    return __uint_as_float(j & 1 ? w[j / 2] & 0xffff0000u : w[j / 2] << 16);
  }
};

// ---- mbarriers (shared::cta), for the producer/consumer rings of fc.cu and attention_wgmma.cu ----

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Spins until the phase with the given parity has completed (acquire at CTA scope). A fresh
// barrier counts its (nonexistent) previous phase, parity 1, as completed: a producer's first pass
// over its ring does not wait.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// The store matching bf16_lane_load: one access a lane (p aligned to V * 2 bytes), each value
// rounded once by the hardware's conversion (pack_bf16x2_rn_fast: the CPU's bits for every non-NaN
// value), for kernels compared with the CPU within a tolerance.
template <int V>
__device__ __forceinline__ void bf16_lane_store_rn_fast(__nv_bfloat16* p, const float (&f)[V]) {
  if constexpr (V == 8) {
    *reinterpret_cast<uint4*>(p) = bf16x8_pack_rn_fast(f);
  } else if constexpr (V == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2_rn_fast(f[0], f[1]), pack_bf16x2_rn_fast(f[2], f[3]));
  } else if constexpr (V == 2) {
    *reinterpret_cast<uint32_t*>(p) = pack_bf16x2_rn_fast(f[0], f[1]);
  } else {
    *p = __ushort_as_bfloat16((unsigned short)pack_bf16x2_rn_fast(f[0], 0.f));
  }
}

// Each of a lane's V values rounded to bf16 and back (f32), two to one hardware conversion: the
// same values as bf16_to_f32(f32_to_bf16_rne(f)) for every non-NaN f, in 3 instructions a pair
// instead of ~14.
template <int V>
__device__ __forceinline__ void bf16_lane_round_rn_fast(float (&f)[V]) {
  static_assert(V == 1 || V % 2 == 0, "a lane holds 1 or an even number of values");
  if constexpr (V == 1) {
    f[0] = bf16x2_lo_to_f32(pack_bf16x2_rn_fast(f[0], 0.f));
  } else {
#pragma unroll
    for (int j = 0; j < V; j += 2) {
      const uint32_t u = pack_bf16x2_rn_fast(f[j], f[j + 1]);
      f[j] = bf16x2_lo_to_f32(u);
      f[j + 1] = bf16x2_hi_to_f32(u);
    }
  }
}
