// pack.cu: pack the target's tapped hidden states into one row per token, plus optional noise
// (DFLASH.md section 2).
//
// Math:     out[t, k*H + c] = t < n_valid ? bf16_rne(f32(tap_k[t, c]) + s * (2u - 1)) : 0,
//           u = uniform(seed, step, NOISE, idx = t*K*H + k*H + c), for t in 0..rows.
// Layouts:  tap_k: [>= n_valid, H] bf16 row-major, contiguous (row stride H), one pointer per
//           tap, K = num_taps of them, passed by value in TapPtrs (no device-side pointer table
//           to allocate, copy and keep alive per step). out: [rows, K*H] bf16 row-major.
//           Rows n_valid..rows are padding (--pad-to-tokens) and become +0.0; taps are not read
//           there, so a tap needs only n_valid rows.
// Noise:    s = noise_std. s == 0 is a pure bit copy (no add at all: -0.0 stays -0.0, NaN payloads
//           survive). s > 0: u from Philox4x32-10 exactly as rng::noise_at, the noise product
//           and the add each rounded once in f32 (__fmul_rn / __fadd_rn, never an FMA), then one
//           RNE rounding to bf16 as half::bf16::from_f32. Bit-identical to the CPU reference for
//           every launch configuration.
// Preconditions (the Rust launcher checks them and errors before launching):
//           1 <= num_taps <= MAX_TAPS (else the kernel traps); rows, hidden, n_valid >= 0
//           (n_valid > rows acts as rows); noise_std finite and >= 0; taps and out do not overlap.
//           Any grid / block shape is correct (grid-stride loops); sizes need not be multiples of
//           anything.
// Fast path: hidden % 8 == 0 and every pointer 16-byte aligned -> each thread moves 8 bf16
//           (16 bytes) per iteration with one load and one store, and the 8 noise values come
//           from 2 Philox blocks (one block serves 4 elements). Otherwise (ragged hidden sizes,
//           offset views) a scalar path: each thread owns 4 consecutive elements, which share one
//           Philox block, so the bits are the same as the fast path's.
// Bytes:    read n_valid*K*H*2 (= rows*K*H*2 without padding) + write rows*K*H*2 per call.
// FLOPs:    0 for the copy; with noise 4 f32 ops per element (2u, -1, *s, +x) plus 10 Philox
//           rounds (4 integer multiplies each) per 4 elements.
// Bound:    memory. Target >= 80% of the device-to-device copy bandwidth measured on the device
//           (~4.1 TB/s read + write on an H200) for both paths; the Philox integer work fits in
//           the issue slots left over at that rate.
#include "common.cuh"
#include "philox.cuh"

// Most tapped layers one call packs. DFLASH.md defaults use K = drafter layers (5); 16 leaves room
// and keeps TapPtrs at 128 bytes of kernel parameters.
#define MAX_TAPS 16

struct TapPtrs {
  const __nv_bfloat16* p[MAX_TAPS];
};

// Where flat output element e = t*K*H + k*H + c lives: row t, tap k, column c.
struct PackPos {
  index_t t;
  index_t k;
  index_t c;
};

// The only 64-bit divisions: once per thread, never inside the loops.
__device__ __forceinline__ PackPos pack_split(index_t e, index_t num_taps, index_t hidden) {
  const index_t row_width = num_taps * hidden;
  PackPos p;
  p.t = e / row_width;
  const index_t r = e - p.t * row_width;
  p.k = r / hidden;
  p.c = r - p.k * hidden;
  return p;
}

// pos += d, where d = pack_split(delta): mixed-radix addition with carries. One subtraction per
// digit suffices because c, d.c < hidden and k, d.k < num_taps.
__device__ __forceinline__ void pack_advance(PackPos& pos, const PackPos& d, index_t num_taps,
                                             index_t hidden) {
  pos.c += d.c;
  if (pos.c >= hidden) {
    pos.c -= hidden;
    pos.k += 1;
  }
  pos.k += d.k;
  if (pos.k >= num_taps) {
    pos.k -= num_taps;
    pos.t += 1;
  }
  pos.t += d.t;
}

// The source element of an in-range position (t < n_valid).
__device__ __forceinline__ const __nv_bfloat16* pack_src(const TapPtrs& taps, const PackPos& pos,
                                                         index_t hidden) {
  return taps.p[pos.k] + pos.t * hidden + pos.c;
}

// x + noise for one bf16 given as bits, result as bf16 bits.
__device__ __forceinline__ uint32_t add_noise_bf16(uint32_t bits16, uint32_t r, float noise_std) {
  const float x = bf16_bits_to_f32(bits16);
  return f32_to_bf16_bits_rne(__fadd_rn(x, philox_noise_from_bits(r, noise_std)));
}

// Two packed bf16 (element order lo, hi) plus the noise of random words r_lo, r_hi.
__device__ __forceinline__ uint32_t add_noise_bf16x2(uint32_t w, uint32_t r_lo, uint32_t r_hi,
                                                     float noise_std) {
  const float lo = __fadd_rn(bf16x2_lo_to_f32(w), philox_noise_from_bits(r_lo, noise_std));
  const float hi = __fadd_rn(bf16x2_hi_to_f32(w), philox_noise_from_bits(r_hi, noise_std));
  return pack_bf16x2_rne(lo, hi);
}

// Fast path: 8 bf16 (one 16-byte access) per thread per iteration. hidden % 8 == 0, so a group
// of 8 never straddles two taps or two rows, and e % 8 == 0, so its noise is exactly Philox
// blocks e/4 and e/4 + 1.
template <bool kNoise>
__device__ __forceinline__ void pack_vec8(const TapPtrs& taps, index_t num_taps,
                                          __nv_bfloat16* out, index_t rows, index_t hidden,
                                          index_t n_valid, float noise_std,
                                          unsigned long long seed, unsigned int step) {
  const index_t total = rows * num_taps * hidden;
  const index_t stride = grid_thread_count() * BF16_PER_VEC;
  index_t e = grid_thread_index() * BF16_PER_VEC;
  PackPos pos = pack_split(e, num_taps, hidden);
  const PackPos d = pack_split(stride, num_taps, hidden);
  for (; e < total; e += stride, pack_advance(pos, d, num_taps, hidden)) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u); // padding rows: +0.0
    if (pos.t < n_valid) {
      // Streaming load: each tap element is read exactly once, so keep it from evicting lines
      // the next kernels (FC GEMM, the target's next layers) want in L2.
      v = __ldcs(reinterpret_cast<const uint4*>(pack_src(taps, pos, hidden)));
      if (kNoise) {
        const unsigned long long block = (unsigned long long)e >> 2;
        const uint4 b0 = philox_block(seed, step, PHILOX_DOMAIN_NOISE, block);
        const uint4 b1 = philox_block(seed, step, PHILOX_DOMAIN_NOISE, block + 1);
        v.x = add_noise_bf16x2(v.x, b0.x, b0.y, noise_std);
        v.y = add_noise_bf16x2(v.y, b0.z, b0.w, noise_std);
        v.z = add_noise_bf16x2(v.z, b1.x, b1.y, noise_std);
        v.w = add_noise_bf16x2(v.w, b1.z, b1.w, noise_std);
      }
    }
    // Plain store (write-back): the FC GEMM reads `out` next, and for small steps it is still in L2.
    *reinterpret_cast<uint4*>(out + e) = v;
  }
}

// Scalar path for ragged shapes and unaligned pointers: each thread owns the 4 elements
// 4q..4q+3 (one Philox block) per iteration; they may straddle taps and rows, so each element
// carries its own position.
template <bool kNoise>
__device__ __forceinline__ void pack_scalar4(const TapPtrs& taps, index_t num_taps,
                                             __nv_bfloat16* out, index_t rows, index_t hidden,
                                             index_t n_valid, float noise_std,
                                             unsigned long long seed, unsigned int step) {
  const index_t total = rows * num_taps * hidden;
  const index_t stride = grid_thread_count() * 4;
  index_t e0 = grid_thread_index() * 4;
  PackPos pos = pack_split(e0, num_taps, hidden);
  const PackPos d = pack_split(stride, num_taps, hidden);
  const PackPos one = pack_split(1, num_taps, hidden);
  unsigned short* out_bits = reinterpret_cast<unsigned short*>(out);
  for (; e0 < total; e0 += stride, pack_advance(pos, d, num_taps, hidden)) {
    uint4 r = make_uint4(0u, 0u, 0u, 0u);
    if (kNoise && pos.t < n_valid) {
      r = philox_block(seed, step, PHILOX_DOMAIN_NOISE, (unsigned long long)e0 >> 2);
    }
    PackPos p = pos;
#pragma unroll
    for (unsigned int j = 0; j < 4; ++j) {
      const index_t e = e0 + j;
      if (e >= total) break;
      uint32_t bits = 0u; // padding rows: +0.0
      if (p.t < n_valid) {
        bits = __ldcs(reinterpret_cast<const unsigned short*>(pack_src(taps, p, hidden)));
        if (kNoise) bits = add_noise_bf16(bits, philox_word(r, j), noise_std);
      }
      out_bits[e] = (unsigned short)bits;
      pack_advance(p, one, num_taps, hidden);
    }
  }
}

// __grid_constant__: `taps` stays in the kernel-parameter (constant) bank and taps.p[k] with a
// run-time k is an indexed constant load; without it nvcc copies the struct to a 128-byte local
// stack frame to index it. The ABI is unchanged: the struct is still passed by value.
extern "C" __global__ void pack_taps_noise_bf16(const __grid_constant__ TapPtrs taps,
                                                int num_taps, __nv_bfloat16* out, long long rows,
                                                long long hidden, long long n_valid,
                                                float noise_std, unsigned long long seed,
                                                unsigned int step) {
  // TapPtrs holds MAX_TAPS pointers: any other count would read past it. The launcher rejects
  // it before launching; trapping here makes a bypassed check loud instead of silent garbage.
  if (num_taps < 1 || num_taps > MAX_TAPS) __trap();
  if (rows <= 0 || hidden <= 0) return;
  const index_t k_taps = num_taps;

  bool vec = (hidden % BF16_PER_VEC) == 0 && is_vec_aligned(out);
  for (int k = 0; k < num_taps; ++k) vec = vec && is_vec_aligned(taps.p[k]);

  // noise_std == 0 takes the no-add path so the copy is exact bit for bit (x + 0 would turn
  // -0.0 into +0.0 and quieten NaNs).
  const bool noise = noise_std != 0.0f;
  if (vec) {
    if (noise) {
      pack_vec8<true>(taps, k_taps, out, rows, hidden, n_valid, noise_std, seed, step);
    } else {
      pack_vec8<false>(taps, k_taps, out, rows, hidden, n_valid, noise_std, seed, step);
    }
  } else {
    if (noise) {
      pack_scalar4<true>(taps, k_taps, out, rows, hidden, n_valid, noise_std, seed, step);
    } else {
      pack_scalar4<false>(taps, k_taps, out, rows, hidden, n_valid, noise_std, seed, step);
    }
  }
}
