// init.cu: a preset's normally distributed weights drawn on the device, the same bits as the
// host's `weights::init_value_bf16`, so a random-init target loads without billions of host draws.
//
// Math (element i of a tensor, e = first + i; src/weights.rs `init_normal`):
//   w  = Philox4x32-10(counter [e lo, e hi, philox_stream, PHILOX_DOMAIN_INIT], key [seed lo, seed hi])
//   a  = (w0:w1) >> 11, b = (w2:w3) >> 11                     53-bit integers
//   u1 = 1 - a 2^-53 (in (0, 1]), u2 = b 2^-53                exact in f64
//   y  = scale * (sqrt(-2 ln u1) * cos(2 pi u2))              f64
//   x[i] = bf16_rne(f32_rne(y))
// The host computes y with its libm, this kernel with CUDA's (log within 1 ulp, cos within 2 ulp:
// CUDA C Programming Guide, double-precision functions), so the two y differ by a few f64 ulps at
// most; with f32's 2^29-times coarser rounding that changes the f32 (and so the bf16) only where
// y lies within those few ulps of a midpoint between two f32 values. Such elements (|y - m| <=
// 2^-46 |y| for either midpoint m next to f32_rne(y), a margin of 64 to 128 f64 ulps against the
// ~7 the two sides can differ by; and y zero, subnormal or at least FLT_MAX) are listed in
// `suspects` (their index i; `count` is how many there were, which may pass `cap`) and the
// launcher rewrites them with the host's value; the rest are the host's bits. About one element
// in 2.8 million is listed.
// Layout: x [n] bf16 contiguous. suspects [cap] u64, count [1] u64 (the launcher zeroes it).
// Launch: blockDim.x any multiple of 32; grid.x any >= 1 (grid-stride loop).
// Bound: Philox and the f64 log / cos (~2 x 10^9 elements a second on an H100, not memory).
// Determinism: every value is a pure function of (seed, stream, e); the suspects' order depends
// on the schedule, their set does not.
#include "common.cuh"
#include "philox.cuh"

extern "C" __global__ void init_normal_bf16(__nv_bfloat16* __restrict__ x, long long n, unsigned long long first,
                                            unsigned long long seed, unsigned int philox_stream,
                                            unsigned long long scale_bits,
                                            unsigned long long* __restrict__ suspects,
                                            unsigned long long* __restrict__ count, int cap) {
  const double two_pow_m53 = 1.0 / 9007199254740992.0;
  const double tau = 6.283185307179586;  // std::f64::consts::TAU
  const double scale = __longlong_as_double((long long)scale_bits);
  unsigned short* xs = reinterpret_cast<unsigned short*>(x);
  const uint2 key = philox_seed_key(seed);
  for (index_t i = grid_thread_index(); i < n; i += grid_thread_count()) {
    const unsigned long long e = first + (unsigned long long)i;
    const uint4 w = philox4x32_10(make_uint4((uint32_t)e, (uint32_t)(e >> 32), philox_stream, PHILOX_DOMAIN_INIT), key);
    const unsigned long long a = (((unsigned long long)w.x << 32) | w.y) >> 11;
    const unsigned long long b = (((unsigned long long)w.z << 32) | w.w) >> 11;
    const double u1 = __dsub_rn(1.0, __dmul_rn((double)a, two_pow_m53));
    const double u2 = __dmul_rn((double)b, two_pow_m53);
    const double r = __dsqrt_rn(__dmul_rn(-2.0, log(u1)));
    const double y = __dmul_rn(scale, __dmul_rn(r, cos(__dmul_rn(tau, u2))));
    const float f = __double2float_rn(y);
    // The midpoints between f and its f32 neighbours, exact in f64.
    const double fd = (double)f;
    const double lo = 0.5 * (fd + (double)nextafterf(f, -INFINITY));
    const double hi = 0.5 * (fd + (double)nextafterf(f, INFINITY));
    const double margin = fabs(y) * 1.4210854715202004e-14;  // 2^-46 |y|
    // Zero, subnormal, and at or past FLT_MAX (where a neighbour midpoint is infinite) are listed too.
    const bool suspect = !(fabs(y) >= 1.1754943508222875e-38) || fabs(y) >= 3.4028234663852886e38 ||
                         fabs(y - lo) <= margin || fabs(y - hi) <= margin;
    if (suspect) {
      const unsigned long long k = atomicAdd(count, 1ull);
      if (k < (unsigned long long)cap) suspects[k] = (unsigned long long)i;
    }
    xs[i] = (unsigned short)f32_to_bf16_bits_rne(f);
  }
}
