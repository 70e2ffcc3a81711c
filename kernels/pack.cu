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
//           every launch configuration: which thread computes an element never changes its
//           Philox counter, word or arithmetic.
// Preconditions (the Rust launcher checks them and errors before launching):
//           1 <= num_taps <= MAX_TAPS (else the kernel traps); rows, hidden, n_valid >= 0
//           (n_valid > rows acts as rows); noise_std finite and >= 0; taps and out do not overlap.
//           Any grid and any block of <= 256 threads is correct (grid-stride loops); sizes need
//           not be multiples of anything.
// Fast path (hidden % 8 == 0, hidden <= PACK_VEC_MAX_HIDDEN, every pointer 16-byte aligned):
//           a unit is 8 bf16 (one 16-byte load and store). A work item is one tile of one
//           (row t, tap k) segment: H/8 units split into tiles of blockDim.x * PACK_UNITS units;
//           thread i owns units i, i + blockDim.x, ... of the tile (coalesced per warp). All its
//           PACK_UNITS loads are issued before any noise is computed, so each thread keeps 64 bytes
//           in flight, and the Philox rounds (2 blocks per unit: one block serves 4 elements) run
//           while they are. Items are numbered w = t * (K * tiles) + k * tiles + tile, so
//           consecutive blocks write consecutive output. The noise path's bf16 rounding is the
//           hardware cvt.rn.bf16x2.f32 (same bits as half::bf16::from_f32 for every non-NaN
//           value); if any of a thread's results is a NaN or an Inf it is redone in software,
//           which keeps NaN payloads: the same bits as before, whatever the add did with them.
//           Otherwise (ragged hidden sizes, offset views) a scalar path: each thread owns 4
//           consecutive elements, which share one Philox block, so the bits are the same.
// Launch:   blockDim.x <= PACK_MAX_BLOCK = 256 (__launch_bounds__; suggested:
//           round_up(ceil(H / 8 / PACK_UNITS), 32) clamped to [32, 256], so one tile covers a row
//           segment for H <= 8192: 128 threads at H = 4096); grid.x any >= 1 (suggested:
//           rows * K * ceil(H / 8 / (blockDim.x * PACK_UNITS)), one item per block, so the block
//           scheduler balances the tail). No shared memory. 64 registers: 8 blocks of 128 per SM.
// Bytes:    read n_valid*K*H*2 (= rows*K*H*2 without padding) + write rows*K*H*2 per call.
// FLOPs:    0 for the copy; with noise 3 f32 ops per element (the exact FMA (r >> 8) * 2^-23 - 1,
//           *s, +x) plus 10 Philox rounds (2 wide integer multiplies, 2 three-input XORs each)
//           per 4 elements.
// Bound:    memory. Target >= 80% of the device-to-device copy bandwidth measured on the device
//           (~4.1 TB/s read + write on an H200) for both paths. The noise path is limited by the
//           integer pipe (half rate on sm_90): per unit of 8 elements about 40 LOP3 (Philox) + 16
//           (u -> f32) + ~15 (addresses, unpacking, the NaN test) integer instructions and ~40
//           wide multiplies (FMA pipe), against ~320 issue cycles per warp-unit available at 80%
//           of copy bandwidth.
// Measured (H200, 12288 x 4096 x 5 taps, N(0, 1) taps): pack + noise 80.1% of copy bandwidth
//           (with the noise's product and add as two roundings; the one-FMA form, the same bits,
//           has not been timed apart).
#include "common.cuh"
#include "launch.cuh"
#include "philox.cuh"

// MAX_TAPS (launch.cuh): most tapped layers one call packs. DFLASH.md defaults use K = drafter
// layers (5); 16 leaves room and keeps TapPtrs at 128 bytes of kernel parameters.

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

// Units (8 bf16, 16 bytes) each thread of the fast path owns per work item: their loads are all
// in flight together (64 bytes per thread).
// (PACK_UNITS, launch.cuh)
// Launch bounds: at most PACK_MAX_BLOCK threads per block, and registers for PACK_MIN_BLOCKS such
// blocks per SM (<= 64 per thread). Without the cap the noise path takes 80 registers (6 warps per
// scheduler instead of 8) to keep every unit's Philox words live; with it the Philox rounds still
// run before the loaded data is touched.
// (PACK_MAX_BLOCK, launch.cuh)
#define PACK_MIN_BLOCKS 4
// Largest hidden size of the fast path: unit indices within a row stay in 32-bit ints. (Larger
// sizes take the scalar path, which is correct for any size.)
// (PACK_VEC_MAX_HIDDEN, launch.cuh)

// Split w into q = w / d and w - q * d; 32-bit division while w fits (every launch the launcher
// makes), so no 64-bit division runs per work item.
__device__ __forceinline__ index_t pack_divmod(index_t w, index_t d, index_t& rem) {
  index_t q;
  if (w <= 0xFFFFFFFFLL && d <= 0xFFFFFFFFLL) {
    q = (index_t)((uint32_t)w / (uint32_t)d);
  } else {
    q = w / d;
  }
  rem = w - q * d;
  return q;
}

// Fast path: see the header. hidden % 8 == 0, so a unit never straddles two taps or two rows, and
// every unit starts at an element index e % 8 == 0, so its noise is exactly Philox blocks e/4 and
// e/4 + 1 (e/4 even: e/4 + 1 == e/4 | 1, no carry).
template <bool kNoise>
__device__ __forceinline__ void pack_tiles_vec8(const TapPtrs& taps, index_t num_taps,
                                                __nv_bfloat16* out, index_t rows, index_t hidden,
                                                index_t n_valid, float noise_std,
                                                unsigned long long seed, unsigned int step) {
  const int units_per_seg = (int)(hidden / BF16_PER_VEC);
  const int tile_units = (int)blockDim.x * PACK_UNITS;
  const index_t tiles = (units_per_seg + tile_units - 1) / tile_units;
  const index_t items_per_row = num_taps * tiles;
  const index_t items = rows * items_per_row;
  for (index_t w = blockIdx.x; w < items; w += gridDim.x) { // uniform over the block
    index_t rest;
    const index_t t = pack_divmod(w, items_per_row, rest);
    index_t tile;
    const index_t k = pack_divmod(rest, tiles, tile);
    const bool valid = t < n_valid; // else a padding row: zeros, taps not read
    const index_t seg = t * num_taps + k; // output row segment: elements seg*H .. seg*H + H
    const uint4* src = reinterpret_cast<const uint4*>(taps.p[k] + t * hidden);
    uint4* dst = reinterpret_cast<uint4*>(out + seg * hidden);
    const int u0 = (int)tile * tile_units + (int)threadIdx.x;
    uint4 v[PACK_UNITS];
#pragma unroll
    for (int j = 0; j < PACK_UNITS; ++j) {
      const int u = u0 + j * (int)blockDim.x;
      v[j] = make_uint4(0u, 0u, 0u, 0u); // padding rows: +0.0
      // Streaming load: each tap element is read exactly once, so keep it from evicting lines
      // the next kernels (FC GEMM, the target's next layers) want in L2.
      if (valid && u < units_per_seg) v[j] = __ldcs(src + u);
    }
    if (kNoise && valid) { // uniform over the block
      // Straight-line over the units (no per-unit branch), so the compiler can run the Philox
      // rounds of every unit while the loads are in flight. The noise of unit j, elements
      // e .. e+7 (e = seg * H + 8u): the 4 words of Philox block e/4, then those of e/4 + 1.
      // seg * H / 4 is exact (H % 8 == 0) and e/4 is even, so e/4 + 1 == e/4 | 1.
      const unsigned long long seg_block =
          (unsigned long long)seg * (unsigned long long)(hidden >> 2);
      const float std_scaled = noise_std * (1.0f / 8388608.0f); // exact: see philox_noise_fused
      float f[PACK_UNITS][8];
#pragma unroll
      for (int j = 0; j < PACK_UNITS; ++j) {
        const int u = u0 + j * (int)blockDim.x; // past the segment: computed, never stored
        const unsigned long long block = seg_block + 2ull * (unsigned long long)(unsigned)u;
        const uint4 b0 = philox_block(seed, step, PHILOX_DOMAIN_NOISE, block);
        const uint4 b1 = philox_block(seed, step, PHILOX_DOMAIN_NOISE, block | 1ull);
        const uint32_t r[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) f[j][e] = philox_noise_fused(r[e], std_scaled, noise_std);
      }
#pragma unroll
      for (int j = 0; j < PACK_UNITS; ++j) {
        float x[8];
        bf16x8_unpack(v[j], x);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[j][e] = __fadd_rn(x[e], f[j][e]); // add_noise_bf16's sum
      }
      // The hardware RNE gives half::bf16::from_f32's bits for every non-NaN sum. A NaN sum (it
      // needs a NaN input: the noise is finite) keeps the payload the software rounding gives it,
      // as before this path existed, so a unit with a NaN or Inf result is rounded again in
      // software (rare). The test reads the results, not the inputs, so it is scheduled after
      // the Philox rounds, which then overlap the loads.
      bool nonfinite = false;
#pragma unroll
      for (int j = 0; j < PACK_UNITS; ++j) {
        v[j] = bf16x8_pack_rn_fast(f[j]);
        nonfinite |= bf16x8_any_nonfinite(v[j]); // no short-circuit: no branch
      }
      if (nonfinite) {
#pragma unroll
        for (int j = 0; j < PACK_UNITS; ++j) v[j] = bf16x8_pack_rne(f[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < PACK_UNITS; ++j) {
      const int u = u0 + j * (int)blockDim.x;
      // Plain store (write-back): the FC GEMM reads `out` next, and for small steps it is still
      // in L2.
      if (u < units_per_seg) dst[u] = v[j];
    }
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
extern "C" __global__ void __launch_bounds__(PACK_MAX_BLOCK, PACK_MIN_BLOCKS)
    pack_taps_noise_bf16(const __grid_constant__ TapPtrs taps, int num_taps, __nv_bfloat16* out,
                         long long rows, long long hidden, long long n_valid, float noise_std,
                         unsigned long long seed, unsigned int step) {
  // TapPtrs holds MAX_TAPS pointers: any other count would read past it. The launcher rejects
  // it before launching; trapping here makes a bypassed check loud instead of silent garbage.
  if (num_taps < 1 || num_taps > MAX_TAPS) __trap();
  if (rows <= 0 || hidden <= 0) return;
  const index_t k_taps = num_taps;

  // The fast path's one-FMA noise needs noise_std >= PHILOX_FUSED_MIN_STD (any sensible std is);
  // a smaller one takes the scalar path, whose bits are the same.
  bool vec = (hidden % BF16_PER_VEC) == 0 && hidden <= PACK_VEC_MAX_HIDDEN && is_vec_aligned(out) &&
             (noise_std == 0.0f || noise_std >= PHILOX_FUSED_MIN_STD);
  for (int k = 0; k < num_taps; ++k) vec = vec && is_vec_aligned(taps.p[k]);

  // noise_std == 0 takes the no-add path so the copy is exact bit for bit (x + 0 would turn
  // -0.0 into +0.0 and quieten NaNs).
  const bool noise = noise_std != 0.0f;
  if (vec) {
    if (noise) {
      pack_tiles_vec8<true>(taps, k_taps, out, rows, hidden, n_valid, noise_std, seed, step);
    } else {
      pack_tiles_vec8<false>(taps, k_taps, out, rows, hidden, n_valid, noise_std, seed, step);
    }
  } else {
    if (noise) {
      pack_scalar4<true>(taps, k_taps, out, rows, hidden, n_valid, noise_std, seed, step);
    } else {
      pack_scalar4<false>(taps, k_taps, out, rows, hidden, n_valid, noise_std, seed, step);
    }
  }
}
