// swiglu.cu: the SwiGLU activation of the MLP, forward and backward.
//
// Math (g = gate, u = up, d = dact; f32 math, each bf16 write one RNE rounding):
//   fwd:  out = bf16(silu(g) * u), silu(g) = g / (1 + expf(-g))
//   bwd:  sig = 1 / (1 + expf(-g)); silu = g * sig;
//         dgate = bf16(((d * u) * sig) * (1 + g * (1 - sig))); dup = bf16(d * silu);
//         and d's place takes the forward's out (its formula, the same bits), which the down
//         projection's weight gradient needs: recomputed where g and u are in registers anyway
//   Every operation is one IEEE rounding in cpu.rs's left-to-right order (__fmul_rn, __fadd_rn,
//   __fsub_rn, __fdiv_rn: never an FMA); only expf differs from the CPU's libm (CUDA: <= 2 ulp),
//   so compare with a bf16 tolerance. The 8-wide path rounds to bf16 with the hardware's
//   cvt.rn.bf16x2.f32 (4 instructions per 8 outputs instead of ~56 integer ones; the same bits as
//   half::bf16::from_f32 for every non-NaN value, a NaN stays a NaN without its payload).
// Layouts:  gu, dgu: [rows, 2 * inter] bf16 row-major, each row = [gate(inter) | up(inter)].
//           out, dact: [rows, inter] bf16 row-major. All contiguous. The backward runs in place:
//           dgu over gu, out over dact.
// Preconditions: rows, inter >= 0 (0: no-op); the forward's out does not overlap gu; the
//           backward's two buffers do not overlap each other.
// Work item: V consecutive columns of one row; V = 8 (16-byte accesses) when inter % 8 == 0 and
//           every pointer is 16-byte aligned, else 1. Items walk (row, chunk) without division.
// Launch:   blockDim.x any value up to 1024 (256 suggested); grid.x any >= 1 (grid-stride).
//           Suggested grid.x = clamp(ceil(rows * inter / 8 / 256), 1, 16 * SM count). No shared
//           memory, no scratch.
// Bytes:    fwd rows * inter * 6 (read 4, write 2); bwd rows * inter * 12 (read 6, write 6).
// FLOPs:    fwd ~4 + one expf per element; bwd ~14 + one expf per element (the forward's expf
//           is the same expression, computed once).
// Bound:    memory (the expf and the IEEE division fit in the issue slots at HBM rate: the
//           forward's 8-wide loop is ~260 instructions per 8 elements, ~55% of the issue slots a
//           warp has at 80% of copy bandwidth). Target >= 80% of the measured device-to-device
//           copy bandwidth (~4.1 TB/s on an H200) for rows * inter >= 2^24.
// Measured (H200, 8192 x 12288, N(0, 1) inputs): fwd 87.8%, bwd 96.1% of copy bandwidth. A gate of
//           exactly 0 sends the IEEE division g / (1 + e) down its slow path: an all-zero input
//           runs the forward at ~2.2-2.3 TB/s; real activations do not.
#include "common.cuh"
#include "swiglu.cuh"

template <int V>
__device__ __forceinline__ void swiglu_fwd_items(const __nv_bfloat16* __restrict__ gu,
                                                 __nv_bfloat16* __restrict__ out, index_t rows,
                                                 index_t inter) {
  const index_t chunks_per_row = inter / V;
  const index_t total = rows * chunks_per_row;
  const index_t stride = grid_thread_count();
  index_t e = grid_thread_index();
  RowCol pos = rowcol_split(e, chunks_per_row);
  const RowCol d = rowcol_split(stride, chunks_per_row);
  for (; e < total; e += stride, rowcol_advance(pos, d, chunks_per_row)) {
    const __nv_bfloat16* gate = gu + pos.row * 2 * inter + pos.col * V;
    float g[V], u[V], o[V];
    bf16_chunk_load<V>(gate, g);
    bf16_chunk_load<V>(gate + inter, u);
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = swiglu_fwd_f32(g[j], u[j]);
    bf16_chunk_store_rn_fast<V>(out + pos.row * inter + pos.col * V, o);
  }
}

extern "C" __global__ void swiglu_fwd_bf16(const __nv_bfloat16* __restrict__ gu,
                                           __nv_bfloat16* __restrict__ out, long long rows,
                                           int inter) {
  if (rows <= 0 || inter <= 0) return;
  // inter % 8 == 0 keeps the gate, up and out chunks of every row 16-byte aligned.
  if (inter % BF16_PER_VEC == 0 && is_vec_aligned(gu) && is_vec_aligned(out)) {
    swiglu_fwd_items<BF16_PER_VEC>(gu, out, rows, inter);
  } else {
    swiglu_fwd_items<1>(gu, out, rows, inter);
  }
}

// In place: gate|up become their gradient, dact the forward's out. Each item reads its gate, up
// and dact chunks before it writes the same three chunks, and no other item touches them.
template <int V>
__device__ __forceinline__ void swiglu_bwd_items(__nv_bfloat16* __restrict__ dact, __nv_bfloat16* __restrict__ gu,
                                                 index_t rows, index_t inter) {
  const index_t chunks_per_row = inter / V;
  const index_t total = rows * chunks_per_row;
  const index_t stride = grid_thread_count();
  index_t e = grid_thread_index();
  RowCol pos = rowcol_split(e, chunks_per_row);
  const RowCol d = rowcol_split(stride, chunks_per_row);
  for (; e < total; e += stride, rowcol_advance(pos, d, chunks_per_row)) {
    const index_t in_off = pos.row * 2 * inter + pos.col * V;
    const index_t out_off = pos.row * inter + pos.col * V;
    float g[V], u[V], dy[V], dg[V], du[V], act[V];
    bf16_chunk_load<V>(gu + in_off, g);
    bf16_chunk_load<V>(gu + in_off + inter, u);
    bf16_chunk_load<V>(dact + out_off, dy);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g[j])));
      const float silu = __fmul_rn(g[j], sig);
      const float dsig = __fadd_rn(1.0f, __fmul_rn(g[j], __fsub_rn(1.0f, sig)));
      dg[j] = __fmul_rn(__fmul_rn(__fmul_rn(dy[j], u[j]), sig), dsig);
      du[j] = __fmul_rn(dy[j], silu);
      act[j] = swiglu_fwd_f32(g[j], u[j]);
    }
    bf16_chunk_store_rn_fast<V>(gu + in_off, dg);
    bf16_chunk_store_rn_fast<V>(gu + in_off + inter, du);
    bf16_chunk_store_rn_fast<V>(dact + out_off, act);
  }
}

extern "C" __global__ void swiglu_bwd_bf16(__nv_bfloat16* __restrict__ dact, __nv_bfloat16* __restrict__ gu,
                                           long long rows, int inter) {
  if (rows <= 0 || inter <= 0) return;
  if (inter % BF16_PER_VEC == 0 && is_vec_aligned(dact) && is_vec_aligned(gu)) {
    swiglu_bwd_items<BF16_PER_VEC>(dact, gu, rows, inter);
  } else {
    swiglu_bwd_items<1>(dact, gu, rows, inter);
  }
}
