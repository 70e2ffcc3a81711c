// mma.cuh: the tensor-core building blocks of the attention kernels (attention.cu) and the
// decoding attention (decode.cu): PTX wrappers for cp.async, ldmatrix and mma.sync m16n8k16
// (bf16 -> f32), the warp-level products S = A B^T and O += P B, and the online-softmax tile.
// Fragment layouts and conventions are stated at each function.
#pragma once

#include "common.cuh"
#include "launch.cuh"

namespace attn {

typedef __nv_bfloat16 bf16;

// Query rows one warp owns: the M of one m16n8k16 MMA.
constexpr int WARP_ROWS = ATTN_WARP_ROWS;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

template <int HD>
struct Geo {
  static_assert(HD == 16 || HD == 32 || HD == 64 || HD == 128 || HD == 256,
                "head_dim must be 16, 32, 64, 128 (or 256: the causal forward only)");
  static constexpr int LD = HD + ATTN_LD_PAD;  // shared-memory row pitch in bf16 elements
  static constexpr int CHUNKS = HD / 8;  // 16-byte chunks per row
  static constexpr int KT = HD / 16;     // k-steps of 16 over the head dim
  static constexpr int NT = HD / 8;      // n8 tiles over the head dim
};

// Start of the sequence that holds row r: seq_starts[b] for the largest b < num_seqs with
// seq_starts[b] <= r (empty sequences are skipped that way); 0 before the first start.
__device__ __forceinline__ index_t seq_start_of(const int* seq_starts, int num_seqs, index_t r) {
  if (num_seqs <= 0 || r < (index_t)seq_starts[0]) return 0;
  int a = 0, b = num_seqs - 1;
  while (a < b) {
    const int mid = (a + b + 1) >> 1;
    if ((index_t)seq_starts[mid] <= r) a = mid;
    else b = mid - 1;
  }
  return seq_starts[a];
}

// The first key (in the virtual sequence of a drafter block, attention.cu DraftCta) that any slot of a block anchored at a sees:
// 0 in a full layer (window == 0), slot 0's window start max(0, a - (W - 1)) in a sliding one.
__device__ __forceinline__ index_t draft_first_key(index_t a, int window) {
  return window > 0 ? max((index_t)0, a - (index_t)(window - 1)) : (index_t)0;
}

// ---------------------------------------------------------------------------------------------
// PTX wrappers.

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

// 16-byte global -> shared copy; valid == false writes 16 zero bytes and reads nothing (src must
// still be a mapped address, so callers pass a tensor base).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}

__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// d += a * b, one m16n8k16 bf16 MMA with f32 accumulators.
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the special-function unit, denormal results flushed to +0 (ex2.approx.ftz: one MUFU
// instruction; exp2f adds a range test and two multiplies per call to keep results below 2^-126,
// which no attention weight needs: p is a softmax term rounded to bf16 next to terms near 1).
// -inf gives +0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// Two f32 -> bf16x2 (RNE, hardware cvt) for MMA operands; element 0 in the low half.
__device__ __forceinline__ uint32_t pack_op(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t r;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(r));
  return r;
}

// A launcher that disagrees with the documented configuration stops here, before any access.
__device__ __forceinline__ void require_launch(unsigned threads, size_t smem_bytes) {
  if (blockDim.x != threads || blockDim.y != 1 || blockDim.z != 1 || dynamic_smem_bytes() < smem_bytes) {
    __trap();
  }
}

// ---------------------------------------------------------------------------------------------
// Warp-level MMA building blocks. Fragment layouts (lane = 4*gr + tq): C/D element e of n8 tile
// n is row gr + 8*(e>>1), column 8n + 2tq + (e&1). All shared-memory tiles are row-major with
// pitch LD.

// acc[MT][NN][4] = A[16*MT x HD] * B^T, A rows at sA (16*MT rows), B = NN*8 rows of HD at sB, both
// bf16 row-major in shared memory: S = Q K^T and its relatives (dP = dO V^T, S^T = K Q^T). MT > 1
// reuses each B fragment for MT MMAs, which halves shared-memory reads per MMA at MT = 2.
template <int HD, int NN, int MT>
__device__ __forceinline__ void mma_abt(float (&acc)[MT][NN][4], uint32_t sA, uint32_t sB, int lane) {
  constexpr int LD = Geo<HD>::LD;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < NN; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
  }
  const uint32_t a_off = (uint32_t)((((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8) * 2);
  const uint32_t b_off = (uint32_t)((((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8) * 2);
#pragma unroll
  for (int kk = 0; kk < Geo<HD>::KT; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], sA + a_off + (uint32_t)(mt * 16 * LD * 2) + kk * 32);
#pragma unroll
    for (int nn = 0; nn < NN / 2; ++nn) {
      uint32_t b[4];
      ldsm_x4(b, sB + b_off + (uint32_t)(nn * 16 * LD * 2) + kk * 32);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816(acc[mt][2 * nn], a[mt], b[0], b[1]);
        mma16816(acc[mt][2 * nn + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// acc[MT][HD/8][4] += P * B, P = [16*MT x NP*8] f32 in C layout (rounded to bf16 here), B = NP*8
// rows of HD at sB (bf16 row-major, read transposed): O += P V, dQ += dS K, dV += P^T dO,
// dK += dS^T Q.
template <int HD, int NP, int MT>
__device__ __forceinline__ void mma_pb(float (&acc)[MT][HD / 8][4], const float (&p)[MT][NP][4], uint32_t sB,
                                       int lane) {
  constexpr int LD = Geo<HD>::LD;
  const uint32_t b_off = (uint32_t)((((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8) * 2);
#pragma unroll
  for (int kk = 0; kk < NP / 2; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      a[mt][0] = pack_op(p[mt][2 * kk][0], p[mt][2 * kk][1]);
      a[mt][1] = pack_op(p[mt][2 * kk][2], p[mt][2 * kk][3]);
      a[mt][2] = pack_op(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
      a[mt][3] = pack_op(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int nn = 0; nn < HD / 16; ++nn) {
      uint32_t b[4];
      ldsm_x4_t(b, sB + b_off + (uint32_t)(kk * 16 * LD * 2) + nn * 32);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816(acc[mt][2 * nn], a[mt], b[0], b[1]);
        mma16816(acc[mt][2 * nn + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Copies rows [0, nrows) of hd bf16 into shared memory (pitch LD) with 16-byte cp.async; src(i)
// is row i's global address or nullptr for a zero row. All threads of the CTA take part.
template <int HD, class Src>
__device__ __forceinline__ void load_rows(bf16* smem, int nrows, const bf16* any_mapped, Src src) {
  constexpr int C = Geo<HD>::CHUNKS;
  for (int c = threadIdx.x; c < nrows * C; c += blockDim.x) {
    const int i = c / C, ch = c % C;
    const bf16* p = src(i);
    cp_async_16(smem_u32(smem + i * Geo<HD>::LD + ch * 8), p ? p + ch * 8 : any_mapped, p != nullptr);
  }
}

// Writes a warp's 16 x HD f32 accumulator rows, rounded once to bf16, into its 16 shared-memory
// rows at s (pitch LD), then stores rows whose dst(i) is non-null with 16-byte stores.
template <int HD, class Dst>
__device__ __forceinline__ void store_warp_rows(const float (&acc)[HD / 8][4], bf16* s, int lane, Dst dst) {
  constexpr int LD = Geo<HD>::LD;
  const int gr = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    *reinterpret_cast<uint32_t*>(s + gr * LD + n * 8 + 2 * tq) = pack_bf16x2_rne(acc[n][0], acc[n][1]);
    *reinterpret_cast<uint32_t*>(s + (gr + 8) * LD + n * 8 + 2 * tq) = pack_bf16x2_rne(acc[n][2], acc[n][3]);
  }
  __syncwarp();
  constexpr int C = Geo<HD>::CHUNKS;
  for (int c = lane; c < WARP_ROWS * C; c += 32) {
    const int i = c / C, ch = c % C;
    bf16* d = dst(i);
    if (d) {
      *reinterpret_cast<uint4*>(d + ch * 8) = *reinterpret_cast<const uint4*>(s + i * LD + ch * 8);
    }
  }
}

// One K/V tile of the online softmax for one m-tile (16 rows) of a warp, without touching O:
// s holds raw q.k for NN*8 keys; m (running max of scale*log2(e)*q.k) and l (this thread's
// partial row sums) for rows gr and gr+8. vis(half, col) says whether key column col is visible
// to row gr + 8*half; called only when masked. On return s holds p = exp2(scale*log2(e)*q.k - m)
// and alpha the factor O must be rescaled by (softmax_rescale) before p V is added.
template <int NN, bool MASKED, class Vis>
__device__ __forceinline__ void softmax_p_impl(float (&s)[NN][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                               float sl2, int lane, Vis vis) {
  const int tq = lane & 3;
  // The row maxima in 4 independent chains per row half (tile n into chain n % 4), combined at the
  // end: a max is exact in any order, and the chains shorten the dependent FMNMX sequence on the
  // softmax's critical path by 4x.
  constexpr int CH = NN >= 4 ? 4 : 1;
  float mc[2][CH];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int c = 0; c < CH; ++c) mc[h][c] = -INFINITY;
  }
#pragma unroll
  for (int n = 0; n < NN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (MASKED && !vis(e >> 1, n * 8 + 2 * tq + (e & 1))) s[n][e] = -INFINITY;
      mc[e >> 1][n % CH] = fmaxf(mc[e >> 1][n % CH], s[n][e]);
    }
  }
  float mx[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = mc[h][0];
#pragma unroll
    for (int c = 1; c < CH; ++c) mx[h] = fmaxf(mx[h], mc[h][c]);
  }
  float mu[2], rs[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    // scale > 0, so the max of the scaled scores is the scaled max.
    const float mnew = fmaxf(m[h], mx[h] * sl2);
    // A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so that
    // exp2(-inf - -inf) never makes a NaN.
    mu[h] = mnew == -INFINITY ? 0.f : mnew;
    alpha[h] = exp2_ftz(m[h] - mu[h]);
    m[h] = mnew;
  }
#pragma unroll
  for (int n = 0; n < NN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = exp2_ftz(fmaf(s[n][e], sl2, -mu[e >> 1]));
      s[n][e] = p;
      rs[e >> 1] += p;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rs[h];
}

template <int NN, class Vis>
__device__ __forceinline__ void softmax_p(float (&s)[NN][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                          float sl2, bool masked, int lane, Vis vis) {
  // Two copies of the loop, so that the tiles with no mask (most of them) test nothing per
  // element.
  if (masked) softmax_p_impl<NN, true>(s, m, l, alpha, sl2, lane, vis);
  else softmax_p_impl<NN, false>(s, m, l, alpha, sl2, lane, vis);
}

// O *= alpha per row half. Once a row's max has settled (most tiles of a long row) alpha is
// exactly 1 and the rescale is an exact no-op: skip its HD/2 multiplies.
template <int HD>
__device__ __forceinline__ void softmax_rescale(float (&o)[HD / 8][4], const float (&alpha)[2]) {
  if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
    }
  }
}

// softmax_p, then O rescaled: one whole tile of the online softmax (O += p V follows).
template <int HD, int NN, class Vis>
__device__ __forceinline__ void softmax_tile(float (&s)[NN][4], float (&o)[HD / 8][4], float (&m)[2], float (&l)[2],
                                             float sl2, bool masked, int lane, Vis vis) {
  float alpha[2];
  softmax_p<NN>(s, m, l, alpha, sl2, masked, lane, vis);
  softmax_rescale<HD>(o, alpha);
}

// Final normalisation: reduces l over the 4 threads of a row and multiplies by its correctly
// rounded reciprocal (one rounding more than the CPU's acc / sum: within 1.5 ulp of f32, far below
// the bf16 rounding of the output). Not a division per element: __fdiv_rn takes a ~60-instruction
// subroutine whenever the dividend is 0 or subnormal, which an all-zero output row pays on every
// element. l >= 1 for a row with a visible key (its maximum contributes exp2(0)), so
// the reciprocal is always normal; a row with no visible key (padding rows only) gets exactly 0
// (selected, whatever its accumulator holds).
template <int HD>
__device__ __forceinline__ void softmax_finish(float (&o)[HD / 8][4], float (&l)[2]) {
  float r[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    r[h] = l[h] > 0.f ? __frcp_rn(l[h]) : 0.f;
  }
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = l[e >> 1] > 0.f ? __fmul_rn(o[n][e], r[e >> 1]) : 0.f;
  }
}

}  // namespace attn
