// philox.cuh: counter-based random numbers, Philox4x32-10 (Salmon et al., SC'11, "Random123"),
// bit-identical to src/rng.rs. Included, never compiled alone.
//
// Every draw is a pure function of (seed, step, domain, idx): key = [seed lo, seed hi], counter =
// [(idx >> 2) lo, (idx >> 2) hi, step, domain], and element idx takes word idx & 3 of that block.
// So the bits do not depend on the launch configuration, on which thread draws them, or on a
// replay after --resume, and the CPU reference (rng::bits_at, rng::noise_at) reproduces them.
// Four consecutive elements share one block: a kernel that owns elements 4q..4q+3 computes the
// block once (philox_block) instead of four times.
#pragma once

#include <stdint.h>

// Philox multipliers and Weyl key increments (Random123's constants; same names as src/rng.rs).
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

// Counter word 3: what the bits are for (src/rng.rs `domain`), so streams never collide.
#define PHILOX_DOMAIN_NOISE 0u
#define PHILOX_DOMAIN_ANCHORS 1u
#define PHILOX_DOMAIN_DATA 2u
#define PHILOX_DOMAIN_INIT 3u
#define PHILOX_DOMAIN_SHUFFLE 4u

// One Philox4x32 block, 10 rounds: 128 random bits for a 128-bit counter and a 64-bit key.
// Round structure exactly as rng::philox4x32_10 (key bumped before rounds 1..9).
__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint2 key) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key.x += PHILOX_W0;
      key.y += PHILOX_W1;
    }
    const uint32_t hi0 = __umulhi(PHILOX_M0, ctr.x);
    const uint32_t lo0 = PHILOX_M0 * ctr.x;
    const uint32_t hi1 = __umulhi(PHILOX_M1, ctr.z);
    const uint32_t lo1 = PHILOX_M1 * ctr.z;
    ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
  }
  return ctr;
}

__device__ __forceinline__ uint2 philox_seed_key(unsigned long long seed) {
  return make_uint2((uint32_t)seed, (uint32_t)(seed >> 32));
}

// The block serving elements 4*block .. 4*block+3 of (seed, step, domain): word j is element
// 4*block + j. `block` is idx >> 2 (64-bit).
__device__ __forceinline__ uint4 philox_block(unsigned long long seed, uint32_t step,
                                              uint32_t domain, unsigned long long block) {
  const uint4 ctr = make_uint4((uint32_t)block, (uint32_t)(block >> 32), step, domain);
  return philox4x32_10(ctr, philox_seed_key(seed));
}

// Word j (0..3) of a block, j known only at run time.
__device__ __forceinline__ uint32_t philox_word(uint4 b, unsigned int j) {
  return j == 0 ? b.x : j == 1 ? b.y : j == 2 ? b.z : b.w;
}

// The 32 random bits of element idx: rng::bits_at.
__device__ __forceinline__ uint32_t philox_bits_at(unsigned long long seed, uint32_t step,
                                                   uint32_t domain, unsigned long long idx) {
  return philox_word(philox_block(seed, step, domain, idx >> 2), (unsigned int)(idx & 3u));
}

// 24 high bits to a float in [0, 1): rng::u32_to_unit_f32. Exact (24-bit integer times 2^-24),
// so every device makes the same value.
__device__ __forceinline__ float philox_u32_to_unit_f32(uint32_t r) {
  return (float)(r >> 8) * (1.0f / 16777216.0f);
}

// Uniform noise in [-std, std) from 32 random bits: rng::noise_at = std * (2u - 1). With m = r >> 8
// (24 bits, exact in f32) 2u - 1 = m * 2^-23 - 1 exactly: an integer in [-2^23, 2^23) times 2^-23
// is representable, so one FMA (exact product and sum, one rounding of a representable value)
// gives the CPU's value. The product with std is the one rounding, done with __fmul_rn so nvcc
// can never fuse it into an FMA with the caller's add (the CPU rounds the product, then the sum).
__device__ __forceinline__ float philox_noise_from_bits(uint32_t r, float std) {
  const float centred = __fmaf_rn((float)(r >> 8), 1.0f / 8388608.0f, -1.0f); // exact
  return __fmul_rn(std, centred);
}

// philox_noise_from_bits in one instruction: with std_scaled = std * 2^-23 exact (std >= 2^-100,
// so the product is a normal float), fma((r >> 8), std_scaled, -std) is the exact value
// std * centred rounded once, the very rounding __fmul_rn(std, centred) does: the same bits
// (+0 included: x - x is +0 under round-to-nearest).
#define PHILOX_FUSED_MIN_STD 0x1p-100f
__device__ __forceinline__ float philox_noise_fused(uint32_t r, float std_scaled, float std) {
  return __fmaf_rn((float)(r >> 8), std_scaled, -std);
}
