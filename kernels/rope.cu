// rope.cu: rotary position embedding, rotate-half convention (Qwen3 / Hugging Face), in place,
// forward or inverse (the inverse rotation is the backward: R(-angle) = R(angle)^T).
//
// Math:     for row r, head h, i < half = head_dim / 2:
//             angle = f32(pos[r]) * inv_freq[i]  (one f32 multiply, __fmul_rn)
//             c = cos(angle), s = sin(angle) (precise sincosf; s = -s when inverse != 0)
//             a = x[r, h, i], b = x[r, h, i + half]
//             x[r, h, i] = bf16(a*c - b*s), x[r, h, i + half] = bf16(b*c + a*s)
//           Each product and the sum/difference is rounded once in f32 (__fmul_rn, __fsub_rn,
//           __fadd_rn: never an FMA), as cpu.rs evaluates `a * c - b * sn`. Only sincosf differs
//           from the CPU's libm (CUDA: <= 2 ulp), so compare with a bf16 tolerance.
// Layouts:  x: [rows, heads * head_dim] bf16 row-major, contiguous. pos: [rows] i32 (any value,
//           negative allowed). inv_freq: [head_dim / 2] f32, computed by the host (cpu.rs
//           rope_inv_freq: 1 / theta^(2i / head_dim)).
// Preconditions: head_dim even and >= 2, heads >= 1, rows >= 0 (else no-op).
// Work item: (row, group of V consecutive i). V = 8 when half % 8 == 0 and x is 16-byte aligned
//           (then every a and b group is one 16-byte access), else 1. An item computes its V
//           sincosf once and applies them to every head of the row, so the trigonometry costs
//           rows * half sincosf per call, not rows * heads * half.
// Launch:   blockDim.x any value up to 1024 (256 suggested); grid.x any >= 1 (grid-stride over
//           items). Suggested grid.x = clamp(ceil(rows * half / V / 256), 1, 16 * SM count).
//           No shared memory, no scratch.
// Bytes:    rows * heads * head_dim * 2 * 2 (read + write) + rows * 4 + half * 4.
// FLOPs:    6 per pair per head (4 mul, 2 add) = 3 * rows * heads * head_dim; plus rows * half
//           sincosf (~40 instructions each; angles > 105615 rad take CUDA's slower exact
//           reduction, which uses a small local-memory stack frame, not a spill).
// Bound:    memory. Target >= 80% of the measured device-to-device copy bandwidth (~4.1 TB/s on
//           an H200) for heads >= 8 and rows * heads * head_dim >= 2^24. Measured (H200,
//           32768 rows x 32 heads x 128): 81.1% of copy bandwidth.
// Why head groups: an item loads its V columns of HG heads before it stores any of them, so a
//           thread keeps HG * 2 independent 16-byte loads in flight instead of 2 (x is updated in
//           place: the compiler cannot hoist a later head's loads above an earlier store).
#include "common.cuh"

template <int V>
__device__ __forceinline__ void rope_items(__nv_bfloat16* x, const int* __restrict__ pos,
                                           const float* __restrict__ inv_freq, index_t rows,
                                           int heads, int head_dim, bool inverse) {
  const int half = head_dim / 2;
  const index_t groups_per_row = half / V;
  const index_t total = rows * groups_per_row;
  const index_t width = (index_t)heads * head_dim;
  for (index_t item = grid_thread_index(); item < total; item += grid_thread_count()) {
    // One 64-bit division per item; an item then does `heads` rounds of memory work.
    const index_t row = item / groups_per_row;
    const int i0 = (int)(item - row * groups_per_row) * V;
    const float p = (float)pos[row]; // i32 -> f32 round to nearest, as Rust's `as f32`
    float c[V], s[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float angle = __fmul_rn(p, inv_freq[i0 + j]);
      sincosf(angle, &s[j], &c[j]);
      if (inverse) s[j] = -s[j];
    }
    __nv_bfloat16* xr = x + row * width + i0;
    // Heads go in groups of HG: every load of a group is issued before its first store (x is
    // written in place, so the compiler cannot hoist a later head's loads above a store): HG * 2
    // 16-byte loads in flight per thread instead of 2.
    constexpr int HG = 4;
    for (int h0 = 0; h0 < heads; h0 += HG) {
      const int hn = heads - h0 < HG ? heads - h0 : HG;
      float a[HG][V], b[HG][V];
#pragma unroll
      for (int g = 0; g < HG; ++g) {
        if (g < hn) {
          const __nv_bfloat16* pa = xr + (index_t)(h0 + g) * head_dim;
          bf16_chunk_load<V>(pa, a[g]);
          bf16_chunk_load<V>(pa + half, b[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < HG; ++g) {
        if (g < hn) {
          __nv_bfloat16* pa = xr + (index_t)(h0 + g) * head_dim;
          float oa[V], ob[V];
#pragma unroll
          for (int j = 0; j < V; ++j) {
            oa[j] = __fsub_rn(__fmul_rn(a[g][j], c[j]), __fmul_rn(b[g][j], s[j]));
            ob[j] = __fadd_rn(__fmul_rn(b[g][j], c[j]), __fmul_rn(a[g][j], s[j]));
          }
          bf16_chunk_store_rne<V>(pa, oa);
          bf16_chunk_store_rne<V>(pa + half, ob);
        }
      }
    }
  }
}

extern "C" __global__ void rope_bf16(__nv_bfloat16* x, const int* __restrict__ pos,
                                     const float* __restrict__ inv_freq, long long rows, int heads,
                                     int head_dim, int inverse) {
  if (rows <= 0 || heads <= 0 || head_dim < 2) return;
  const int half = head_dim / 2;
  // half % 8 == 0 makes head_dim, the row width and i0 (+ half) multiples of 8 elements.
  if (half % BF16_PER_VEC == 0 && is_vec_aligned(x)) {
    rope_items<BF16_PER_VEC>(x, pos, inv_freq, rows, heads, head_dim, inverse != 0);
  } else {
    rope_items<1>(x, pos, inv_freq, rows, heads, head_dim, inverse != 0);
  }
}
