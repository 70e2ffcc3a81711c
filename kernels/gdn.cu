// gdn.cu: the gated delta rule of the Gated DeltaNet (QWEN35.md section 4), token by token
// (decode) and in chunks of GDN_CHUNK tokens (prefill, the taps' forward).
// CPU reference: src/backend/cpu.rs gdn_head_recurrent, gdn_head_chunked (and gdn_fwd's driver).
//
// Math, per (sequence, value head h), state S [dk, dv] f32 from `state` (or 0):
//   recurrent  S = exp(g_t) S;  S += beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t
//   chunked    per chunk of L <= GDN_CHUNK tokens from the sequence start, G = cumsum(g) within it,
//              A[i][j] = beta_i (k_i . k_j) exp(G_i - G_j) (j < i), forward substitution of
//              (I + A) W = diag(beta exp(G)) K and (I + A) U = diag(beta) V, then
//              V' = U - W S;  o_i = exp(G_i) q_i^T S + sum_{j<=i} (q_i . k_j) exp(G_i - G_j) V'_j;
//              S = exp(G_L) S + sum_j exp(G_L - G_j) k_j V'_j^T.
//   Both give the same outputs up to rounding (tests/qwen35.rs proves it in f64 on the CPU).
// Layouts:  q, k: f32 [rows, k_heads * dk] (L2-normalised, q scaled by dk^-0.5); v: f32 [rows,
//           v_heads * dv]; g: f32 [rows, v_heads] (log decay); beta: bf16 [rows, v_heads];
//           o: bf16 [rows, v_heads * dv]; state: f32 [state_seqs, v_heads, dk, dv] or null.
//           Value head h reads key head h / (v_heads / k_heads). seq_starts: i32 [n_starts]; CTA
//           sequence b < n_starts - 1 is rows [starts[b], starts[b+1]) and b = n_starts - 1 the
//           rows past the last entry (clipped to rows; an empty range does nothing). A sequence
//           b < state_seqs reads and writes its state; the rest start from 0 and keep nothing.
// Launch:   grid n_starts * v_heads (CTA = (sequence, value head), sequences in order), block
//           GDN_THREADS. Dynamic shared memory (f32 words):
//             recurrent  dk * dv + 2 * dk                                  (128/128: 66,560 B)
//             chunked    dk * dv + 2 * C * dk + C * dv + C * C + 3 * C, C = GDN_CHUNK
//                                                                          (128/128: 180,992 B)
//           above 48 KB, so the function's max dynamic shared memory must be raised (the Rust
//           loader does it for every kernel).
// FLOPs:    recurrent 6 dk dv per token and head. chunked per chunk and head: 2 * (L^2/2 dk
//           [A] + L^2/2 (dk + dv) [solve] + L dk dv [W S] + L^2/2 dk [Q K^T] + L dk dv [Q S] +
//           L^2/2 dv [intra] + L dk dv [S update]) ~ 8.6 MFLOP at L = 64, dk = dv = 128.
// Bytes:    q, k are read once per value head: rows * v_heads * (2 * dk * 4 + dv * 2 [v] + dv * 2
//           [o] + 4 [g] + 2 [beta]) (+ 2 * dk * dv * 4 per sequence and head with a state); the
//           state stays on chip for the whole sequence.
// Bound:    the chunked kernel's products (W S, Q S, K^T V', Q K^T, K K^T) are matrix products
//           of 64 x 128 x 128 per chunk; this SIMT version runs them on CUDA cores (f32 FMAs),
//           one CTA per (sequence, head), the chunks of a sequence in order. Target: the
//           flash-linear-attention Triton kernel's time at the 27B shape (tensor cores).
#include "common.cuh"
#include "launch.cuh"

namespace gdn {

constexpr int C = GDN_CHUNK;

// Rows [r0, r1) of CTA sequence b (see the header); r1 <= r0 means empty.
__device__ __forceinline__ void seq_range(const int* seq_starts, int n_starts, index_t rows, int b, index_t& r0,
                                          index_t& r1) {
  if (b < n_starts - 1) {
    r0 = seq_starts[b];
    r1 = seq_starts[b + 1];
  } else {
    r0 = seq_starts[n_starts - 1];
    r1 = rows;
  }
  r0 = r0 < 0 ? 0 : (r0 > rows ? rows : r0);
  r1 = r1 > rows ? rows : r1;
}

}  // namespace gdn

// One CTA per (sequence, value head); thread c owns column c of S (and of v, o). Two barriers
// per token: q_t, k_t are staged in shared memory for every column.
extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_recurrent_fwd(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const __nv_bfloat16* __restrict__ beta, __nv_bfloat16* __restrict__ o,
    float* __restrict__ state, int state_seqs, const int* __restrict__ seq_starts, int n_starts, long long rows,
    int k_heads, int v_heads, int dk, int dv) {
  extern __shared__ __align__(128) float smem[];
  float* S = smem;            // [dk][dv]
  float* sq = S + dk * dv;    // [dk]
  float* sk = sq + dk;        // [dk]
  const int h = (int)(blockIdx.x % (unsigned)v_heads);
  const int b = (int)(blockIdx.x / (unsigned)v_heads);
  index_t r0, r1;
  gdn::seq_range(seq_starts, n_starts, rows, b, r0, r1);
  if (r1 <= r0) return;
  const int kh = h / (v_heads / k_heads);
  const index_t kw = (index_t)k_heads * dk, vw = (index_t)v_heads * dv;
  float* st = (state != nullptr && b < state_seqs) ? state + ((index_t)b * v_heads + h) * dk * dv : nullptr;
  for (int e = threadIdx.x; e < dk * dv; e += blockDim.x) S[e] = st ? st[e] : 0.f;
  for (index_t t = r0; t < r1; ++t) {
    __syncthreads();  // the previous token's reads of sq, sk are done
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
      sq[i] = q[t * kw + (index_t)kh * dk + i];
      sk[i] = k[t * kw + (index_t)kh * dk + i];
    }
    __syncthreads();
    const float decay = expf(g[t * v_heads + h]);
    const float bt = bf16_to_f32(beta[t * v_heads + h]);
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
      float kv = 0.f;
      for (int i = 0; i < dk; ++i) {
        const float s = S[i * dv + c] * decay;
        S[i * dv + c] = s;
        kv += s * sk[i];
      }
      const float delta = bt * (v[t * vw + (index_t)h * dv + c] - kv);
      float acc = 0.f;
      for (int i = 0; i < dk; ++i) {
        const float s = S[i * dv + c] + sk[i] * delta;
        S[i * dv + c] = s;
        acc += s * sq[i];
      }
      o[t * vw + (index_t)h * dv + c] = f32_to_bf16_rne(acc);
    }
  }
  if (st) {
    __syncthreads();
    for (int e = threadIdx.x; e < dk * dv; e += blockDim.x) st[e] = S[e];
  }
}

// One CTA per (sequence, value head), the chunks in order, S in shared memory throughout.
// Shared memory (f32): S [dk][dv] | K [C][dk] | W [C][dk] (then Q) | U [C][dv] (then V') |
// A [C][C] (then the masked, decayed Q K^T) | G [C] | beta [C] | exp(G_L - G_j) [C].
extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_chunked_fwd_simt(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const __nv_bfloat16* __restrict__ beta, __nv_bfloat16* __restrict__ o,
    float* __restrict__ state, int state_seqs, const int* __restrict__ seq_starts, int n_starts, long long rows,
    int k_heads, int v_heads, int dk, int dv) {
  using gdn::C;
  extern __shared__ __align__(128) float smem[];
  float* S = smem;
  float* K = S + dk * dv;
  float* W = K + C * dk;
  float* U = W + C * dk;
  float* A = U + C * dv;
  float* G = A + C * C;
  float* Bt = G + C;
  float* E = Bt + C;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int h = (int)(blockIdx.x % (unsigned)v_heads);
  const int b = (int)(blockIdx.x / (unsigned)v_heads);
  index_t r0, r1;
  gdn::seq_range(seq_starts, n_starts, rows, b, r0, r1);
  if (r1 <= r0) return;
  const int kh = h / (v_heads / k_heads);
  const index_t kw = (index_t)k_heads * dk, vw = (index_t)v_heads * dv;
  const float* qh = q + (index_t)kh * dk;
  const float* kh_ = k + (index_t)kh * dk;
  const float* vh = v + (index_t)h * dv;
  __nv_bfloat16* oh = o + (index_t)h * dv;
  float* st = (state != nullptr && b < state_seqs) ? state + ((index_t)b * v_heads + h) * dk * dv : nullptr;
  for (int e = tid; e < dk * dv; e += nt) S[e] = st ? st[e] : 0.f;

  for (index_t c0 = r0; c0 < r1; c0 += C) {
    const int L = (int)min((index_t)C, r1 - c0);
    __syncthreads();  // the previous chunk is done with every buffer
    // Load K, beta, the log decays; U = diag(beta) V needs beta, so V comes after the barrier.
    for (int e = tid; e < L * dk; e += nt) {
      const int i = e / dk, d = e - i * dk;
      K[e] = kh_[(c0 + i) * kw + d];
    }
    for (int i = tid; i < L; i += nt) Bt[i] = bf16_to_f32(beta[(c0 + i) * v_heads + h]);
    if (tid == 0) {
      // Sequential, as cpu.rs accumulates it.
      float acc = 0.f;
      for (int i = 0; i < L; ++i) {
        acc += g[(c0 + i) * v_heads + h];
        G[i] = acc;
      }
    }
    __syncthreads();
    for (int e = tid; e < L * dv; e += nt) {
      const int i = e / dv, c = e - i * dv;
      U[e] = Bt[i] * vh[(c0 + i) * vw + c];
    }
    for (int e = tid; e < L * dk; e += nt) {
      const int i = e / dk;
      W[e] = Bt[i] * expf(G[i]) * K[e];
    }
    // A (strictly lower; row i's decay exp(G_i - G_j) <= 1 for j < i since g <= 0).
    for (int e = tid; e < L * L; e += nt) {
      const int i = e / L, j = e - i * L;
      float a = 0.f;
      if (j < i) {
        float dot = 0.f;
        for (int d = 0; d < dk; ++d) dot += K[i * dk + d] * K[j * dk + d];
        a = Bt[i] * dot * expf(G[i] - G[j]);
      }
      A[i * C + j] = a;
    }
    for (int i = tid; i < L; i += nt) E[i] = expf(G[L - 1] - G[i]);
    __syncthreads();
    // Forward substitution, one column of W or U per thread: row i subtracts A[i][j] row j.
    for (int col = tid; col < dk + dv; col += nt) {
      float* X = col < dk ? W + col : U + (col - dk);
      const int ld = col < dk ? dk : dv;
      for (int i = 1; i < L; ++i) {
        float x = X[i * ld];
        for (int j = 0; j < i; ++j) x -= A[i * C + j] * X[j * ld];
        X[i * ld] = x;
      }
    }
    __syncthreads();
    // V' = U - W S (in place in U).
    for (int e = tid; e < L * dv; e += nt) {
      const int i = e / dv, c = e - i * dv;
      float ws = 0.f;
      for (int d = 0; d < dk; ++d) ws += W[i * dk + d] * S[d * dv + c];
      U[e] -= ws;
    }
    __syncthreads();
    // W is dead: Q takes its place; A becomes the decayed, causal Q K^T.
    for (int e = tid; e < L * dk; e += nt) {
      const int i = e / dk, d = e - i * dk;
      W[e] = qh[(c0 + i) * kw + d];
    }
    __syncthreads();
    for (int e = tid; e < L * L; e += nt) {
      const int i = e / L, j = e - i * L;
      float a = 0.f;
      if (j <= i) {
        float dot = 0.f;
        for (int d = 0; d < dk; ++d) dot += W[i * dk + d] * K[j * dk + d];
        a = dot * expf(G[i] - G[j]);
      }
      A[i * C + j] = a;
    }
    __syncthreads();
    // Outputs: the state entering the chunk plus the intra-chunk attention over V'.
    for (int e = tid; e < L * dv; e += nt) {
      const int i = e / dv, c = e - i * dv;
      float qs = 0.f;
      for (int d = 0; d < dk; ++d) qs += W[i * dk + d] * S[d * dv + c];
      float intra = 0.f;
      for (int j = 0; j <= i; ++j) intra += A[i * C + j] * U[j * dv + c];
      oh[(c0 + i) * vw + c] = f32_to_bf16_rne(expf(G[i]) * qs + intra);
    }
    __syncthreads();
    // The state leaving the chunk.
    const float end_decay = expf(G[L - 1]);
    for (int e = tid; e < dk * dv; e += nt) {
      const int d = e / dv, c = e - d * dv;
      float s = S[e] * end_decay;
      for (int j = 0; j < L; ++j) s += (E[j] * K[j * dk + d]) * U[j * dv + c];
      S[e] = s;
    }
  }
  if (st) {
    __syncthreads();
    for (int e = tid; e < dk * dv; e += nt) st[e] = S[e];
  }
}

// ---------------------------------------------------------------------------------------------
// The chunked form on tensor cores: the same steps as gdn_chunked_fwd_simt, with every matrix
// product of the chunk (K K^T, W S, Q K^T, Q S + A V', K^T V') as 16 x 16 x 8 TF32 MMAs (wmma,
// f32 accumulators) over f32 shared-memory tiles. The chunk is padded to C rows with zeros (K, W,
// Q, U and the masked A), so a partial last chunk runs the same tiles. The forward substitution
// stays on CUDA cores (a 64-step dependent chain per column). TF32 keeps 10 mantissa bits of each
// product operand (~5e-4 relative), below the bf16 rounding of the outputs; the state and every
// accumulator stay f32. Requires dk % 16 == 0 and dv % 16 == 0 (the Rust launcher falls back to
// the SIMT kernel otherwise). Shared memory: the SIMT layout plus one 16 x 16 f32 staging tile per
// warp for the bf16 output stores, every row padded by P = GDN_TC_PAD floats:
// 4 * (dk*(dv+P) + 2*C*(dk+P) + C*(dv+P) + C*(C+P) + 3*C + 8*256) bytes (128/128: 195,328).
#include <mma.h>

namespace gdn {

namespace wm = nvcuda::wmma;
constexpr int T = 16;        // output tile edge
constexpr int KS = 8;        // k-step of a TF32 MMA
constexpr int WARPS = GDN_THREADS / 32;
constexpr int PAD = GDN_TC_PAD;  // f32 elements of padding per shared-memory row

template <class Layout>
using FragA = wm::fragment<wm::matrix_a, T, T, KS, wm::precision::tf32, Layout>;
template <class Layout>
using FragB = wm::fragment<wm::matrix_b, T, T, KS, wm::precision::tf32, Layout>;
using Acc = wm::fragment<wm::accumulator, T, T, KS, float>;

// acc += A[16 x kdim] B[kdim x 16]: A at a (row-major: element (m, k) at a[m*lda + k]; col-major:
// a[k*lda + m]), B at b likewise (row-major (k, n) at b[k*ldb + n]; col-major b[n*ldb + k]).
template <class LA, class LB>
__device__ __forceinline__ void mma_acc(Acc& acc, const float* a, int lda, const float* b, int ldb, int kdim) {
  constexpr bool a_row = std::is_same<LA, wm::row_major>::value;
  constexpr bool b_row = std::is_same<LB, wm::row_major>::value;
  FragA<LA> fa;
  FragB<LB> fb;
  for (int k0 = 0; k0 < kdim; k0 += KS) {
    wm::load_matrix_sync(fa, a + (a_row ? k0 : k0 * lda), lda);
    wm::load_matrix_sync(fb, b + (b_row ? k0 * ldb : k0), ldb);
#pragma unroll
    for (int t = 0; t < fa.num_elements; ++t) fa.x[t] = wm::__float_to_tf32(fa.x[t]);
#pragma unroll
    for (int t = 0; t < fb.num_elements; ++t) fb.x[t] = wm::__float_to_tf32(fb.x[t]);
    wm::mma_sync(acc, fa, fb, acc);
  }
}

}  // namespace gdn

extern "C" __global__ void __launch_bounds__(GDN_THREADS, 1) gdn_chunked_fwd_tc(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const __nv_bfloat16* __restrict__ beta, __nv_bfloat16* __restrict__ o,
    float* __restrict__ state, int state_seqs, const int* __restrict__ seq_starts, int n_starts, long long rows,
    int k_heads, int v_heads, int dk, int dv) {
  using gdn::C;
  using gdn::T;
  namespace wm = gdn::wm;
  extern __shared__ __align__(128) float smem[];
  // Row pitches padded by 4 floats: consecutive rows start 4 banks apart, so the 8 rows of a
  // fragment load hit 32 different banks (an unpadded 128-float row puts them all in one).
  const int lk = dk + gdn::PAD, lv = dv + gdn::PAD;
  constexpr int la = C + gdn::PAD;
  float* S = smem;           // [dk][lv]
  float* K = S + dk * lv;    // [C][lk]
  float* W = K + C * lk;     // [C][lk]
  float* U = W + C * lk;     // [C][lv]
  float* A = U + C * lv;     // [C][la]
  float* G = A + C * la;
  float* Bt = G + C;
  float* E = Bt + C;
  float* stage = E + C;  // [WARPS][T * T]
  const int tid = threadIdx.x, nt = blockDim.x, warp = tid >> 5, lane = tid & 31;
  if (blockDim.x != GDN_THREADS || (dk % T) != 0 || (dv % T) != 0) __trap();
  const int h = (int)(blockIdx.x % (unsigned)v_heads);
  const int b = (int)(blockIdx.x / (unsigned)v_heads);
  index_t r0, r1;
  gdn::seq_range(seq_starts, n_starts, rows, b, r0, r1);
  if (r1 <= r0) return;
  const int kh = h / (v_heads / k_heads);
  const index_t kw = (index_t)k_heads * dk, vw = (index_t)v_heads * dv;
  const float* qh = q + (index_t)kh * dk;
  const float* kh_ = k + (index_t)kh * dk;
  const float* vh = v + (index_t)h * dv;
  __nv_bfloat16* oh = o + (index_t)h * dv;
  float* st = (state != nullptr && b < state_seqs) ? state + ((index_t)b * v_heads + h) * dk * dv : nullptr;
  for (int e = tid; e < dk * dv; e += nt) S[(e / dv) * lv + e % dv] = st ? st[e] : 0.f;
  const int tiles_kk = (C / T) * (C / T);     // L x L products
  const int tiles_lv = (C / T) * (dv / T);    // L x dv products
  const int tiles_s = (dk / T) * (dv / T);    // dk x dv (the state)

  for (index_t c0 = r0; c0 < r1; c0 += C) {
    const int L = (int)min((index_t)C, r1 - c0);
    __syncthreads();  // the previous chunk is done with every buffer
    for (int e = tid; e < C * dk; e += nt) {
      const int i = e / dk, d = e - i * dk;
      K[i * lk + d] = i < L ? kh_[(c0 + i) * kw + d] : 0.f;
    }
    for (int i = tid; i < C; i += nt) Bt[i] = i < L ? bf16_to_f32(beta[(c0 + i) * v_heads + h]) : 0.f;
    if (tid == 0) {
      float acc = 0.f;
      for (int i = 0; i < C; ++i) {
        if (i < L) acc += g[(c0 + i) * v_heads + h];
        G[i] = acc;
      }
    }
    __syncthreads();
    // U = diag(beta) V, W = diag(beta exp(G)) K, E = exp(G_L - G_j); meanwhile A = K K^T.
    for (int e = tid; e < C * dv; e += nt) {
      const int i = e / dv, c = e - i * dv;
      U[i * lv + c] = i < L ? Bt[i] * vh[(c0 + i) * vw + c] : 0.f;
    }
    for (int e = tid; e < C * dk; e += nt) {
      const int i = e / dk, d = e - i * dk;
      W[i * lk + d] = Bt[i] * expf(G[i]) * K[i * lk + d];
    }
    for (int i = tid; i < C; i += nt) E[i] = i < L ? expf(G[L - 1] - G[i]) : 0.f;
    for (int t = warp; t < tiles_kk; t += gdn::WARPS) {
      const int i0 = (t / (C / T)) * T, j0 = (t % (C / T)) * T;
      gdn::Acc acc;
      wm::fill_fragment(acc, 0.f);
      gdn::mma_acc<wm::row_major, wm::col_major>(acc, K + i0 * lk, lk, K + j0 * lk, lk, dk);
      wm::store_matrix_sync(A + i0 * la + j0, acc, la, wm::mem_row_major);
    }
    __syncthreads();
    for (int e = tid; e < C * C; e += nt) {
      const int i = e / C, j = e - i * C;
      A[i * la + j] = (j < i && i < L) ? Bt[i] * A[i * la + j] * expf(G[i] - G[j]) : 0.f;
    }
    __syncthreads();
    for (int col = tid; col < dk + dv; col += nt) {
      float* X = col < dk ? W + col : U + (col - dk);
      const int ld = col < dk ? lk : lv;
      for (int i = 1; i < L; ++i) {
        float x = X[i * ld];
        for (int j = 0; j < i; ++j) x -= A[i * la + j] * X[j * ld];
        X[i * ld] = x;
      }
    }
    __syncthreads();
    // V' = U - W S: the accumulator starts from U, W's fragments are negated.
    for (int t = warp; t < tiles_lv; t += gdn::WARPS) {
      const int i0 = (t / (dv / T)) * T, n0 = (t % (dv / T)) * T;
      gdn::Acc acc;
      wm::load_matrix_sync(acc, U + i0 * lv + n0, lv, wm::mem_row_major);
      gdn::FragA<wm::row_major> fa;
      gdn::FragB<wm::row_major> fb;
      for (int k0 = 0; k0 < dk; k0 += gdn::KS) {
        wm::load_matrix_sync(fa, W + i0 * lk + k0, lk);
        wm::load_matrix_sync(fb, S + k0 * lv + n0, lv);
#pragma unroll
        for (int x = 0; x < fa.num_elements; ++x) fa.x[x] = -wm::__float_to_tf32(fa.x[x]);
#pragma unroll
        for (int x = 0; x < fb.num_elements; ++x) fb.x[x] = wm::__float_to_tf32(fb.x[x]);
        wm::mma_sync(acc, fa, fb, acc);
      }
      // Each tile is read and written by its own warp only: in place is safe.
      wm::store_matrix_sync(U + i0 * lv + n0, acc, lv, wm::mem_row_major);
    }
    __syncthreads();
    for (int e = tid; e < C * dk; e += nt) {
      const int i = e / dk, d = e - i * dk;
      W[i * lk + d] = i < L ? qh[(c0 + i) * kw + d] : 0.f;
    }
    __syncthreads();
    for (int t = warp; t < tiles_kk; t += gdn::WARPS) {
      const int i0 = (t / (C / T)) * T, j0 = (t % (C / T)) * T;
      gdn::Acc acc;
      wm::fill_fragment(acc, 0.f);
      gdn::mma_acc<wm::row_major, wm::col_major>(acc, W + i0 * lk, lk, K + j0 * lk, lk, dk);
      wm::store_matrix_sync(A + i0 * la + j0, acc, la, wm::mem_row_major);
    }
    __syncthreads();
    // The decayed causal mask on Q K^T; Q's rows take exp(G_i) (the state term's decay); K's rows
    // take exp(G_L - G_j) (the state update's decay). Q K^T was taken before either.
    for (int e = tid; e < C * C; e += nt) {
      const int i = e / C, j = e - i * C;
      A[i * la + j] = (j <= i && i < L) ? A[i * la + j] * expf(G[i] - G[j]) : 0.f;
    }
    for (int e = tid; e < C * dk; e += nt) {
      const int i = e / dk, d = e - i * dk;
      W[i * lk + d] *= expf(G[i]);
      K[i * lk + d] *= E[i];
    }
    __syncthreads();
    // o = (exp(G) Q) S + A V', staged per warp and stored as bf16.
    float* sw = stage + warp * T * T;
    for (int t = warp; t < tiles_lv; t += gdn::WARPS) {
      const int i0 = (t / (dv / T)) * T, n0 = (t % (dv / T)) * T;
      if (i0 >= L) continue;  // warp-uniform: whole tile past the chunk
      gdn::Acc acc;
      wm::fill_fragment(acc, 0.f);
      gdn::mma_acc<wm::row_major, wm::row_major>(acc, W + i0 * lk, lk, S + n0, lv, dk);
      gdn::mma_acc<wm::row_major, wm::row_major>(acc, A + i0 * la, la, U + n0, lv, C);
      wm::store_matrix_sync(sw, acc, T, wm::mem_row_major);
      __syncwarp();
      for (int e = lane; e < T * T; e += 32) {
        const int i = i0 + e / T, c = n0 + e % T;
        if (i < L) oh[(c0 + i) * vw + c] = f32_to_bf16_rne(sw[e]);
      }
      __syncwarp();
    }
    __syncthreads();
    // S = exp(G_L) S + (E K)^T V'.
    const float end_decay = expf(G[L - 1]);
    for (int t = warp; t < tiles_s; t += gdn::WARPS) {
      const int d0 = (t / (dv / T)) * T, n0 = (t % (dv / T)) * T;
      gdn::Acc acc;
      wm::load_matrix_sync(acc, S + d0 * lv + n0, lv, wm::mem_row_major);
#pragma unroll
      for (int x = 0; x < acc.num_elements; ++x) acc.x[x] *= end_decay;
      gdn::mma_acc<wm::col_major, wm::row_major>(acc, K + d0, lk, U + n0, lv, C);
      wm::store_matrix_sync(S + d0 * lv + n0, acc, lv, wm::mem_row_major);
    }
  }
  if (st) {
    __syncthreads();
    for (int e = tid; e < dk * dv; e += nt) st[e] = S[(e / dv) * lv + e % dv];
  }
}

// ---------------------------------------------------------------------------------------------
// The split chunked form: the TC kernel's steps in three kernels, so that only the state
// recurrence runs chunk after chunk (flash-linear-attention's decomposition: chunk-local prep,
// the state pass, the output).
//
// Math (per chunk of L <= C tokens from its sequence's start, value head h; as above):
//   gdn_split_prep   G = cumsum(g);  A[i][j] = beta_i (k_i . k_j) exp(G_i - G_j) (j < i);
//                    [W | U] = (I + A)^-1 [diag(beta exp(G)) K | diag(beta) V], solved in blocks
//                    of 16 rows (the off-diagonal blocks' products on tensor cores, the 16-row
//                    diagonal blocks by forward substitution on CUDA cores).
//   gdn_split_state  per dv block of GDN_SPLIT_BV columns, the chunks in order from S = state (or
//                    0): S_c = S (stored); V' = U - W S_c (stored over U);
//                    S = exp(G_L) S + K^T diag(exp(G_L - G_j)) V'.  The last S is the state out.
//   gdn_split_out    o_i = exp(G_i) q_i^T S_c + sum_{j<=i} (q_i . k_j) exp(G_i - G_j) V'_j.
// Chunk slots: chunk j of sequence b (rows [r0, r1), seq_range) is slot r0 / C + b + j, which is
// unique per chunk and below n_slots = ceil(rows / C) + n_starts (for any rows r0 <= r1 <= rows,
// r0 / C + ceil((r1 - r0) / C) <= r1 / C + 1, so sequence b's slots end before b + 1's begin).
// The prep and output kernels run one CTA per slot and find its chunk by a binary search of the
// starts (a slot no chunk has returns at once); the state pass walks its sequence's slots.
// Scratch (f32, from the caller; rows >= L of a chunk are zero in W, U, V'; G's pad repeats G_L):
//   W [n_slots][v_heads][C][dk]   U, then V' [n_slots][v_heads][C][dv]   G [n_slots][v_heads][C]
//   S [n_slots][v_heads][dk][dv]  = 4 * n_slots * v_heads * (C (dk + dv + 1) + dk dv) bytes
//   (27B shape, 48 heads, 128/128: 1,241,837,568 B at 4 x 3072 tokens, 416,047,104 B at 1 x 4096).
// Launch (dynamic shared memory in f32 words, P = GDN_TC_PAD, 128/128 in bytes):
//   prep   grid n_slots * v_heads, GDN_THREADS; C (dk+P) + C (dv+P) + C (C+P) + 2 C   (85,504)
//   state  grid n_starts * v_heads * ceil(dv / BV), GDN_SPLIT_STATE_THREADS, BV = GDN_SPLIT_BV;
//          2 C (dk+P) + (dk + C) (BV+P) + C                                            (95,488)
//   out    grid n_slots * v_heads * ceil(dv / BO), GDN_THREADS, BO = GDN_SPLIT_OUT_BV;
//          C max(dk+P, BO+P) + max(C (dk+P), dk (BO+P)) + C (C+P) + C (BO+P) + C   (103,680)
//   each small enough for 2 CTAs per SM at 128/128 (228 KB per SM on Hopper).
// Precision: the prep's products (K K^T and the solve's blocks) are 3xTF32 (hi/lo split, ~f32);
//   the state pass and the output use 1xTF32 operands with f32 accumulators, as the TC kernel.
// FLOPs per chunk and head (L = 64, dk = dv = 128): prep 3 x 2 (10/16 L^2 dk [K K^T] + 6 x 16^2
//   (dk + dv) [solve blocks]) + 2 (L^2/2 (dk + dv)) [16-row substitution, CUDA cores] ~ 9 MFLOP;
//   state 2 (2 L dk dv) = 4.2 MFLOP; out 2 (L^2/2 dk n_o + L dk dv + L^2/2 dv) ~ 3.4 MFLOP at
//   n_o = dv / BO = 2 blocks (each recomputes Q K^T).
// Bytes (f32 scratch, per chunk and head, 128/128): prep reads k, v (64 KB) and writes W, U, G
//   (64 KB); the state pass reads W, K once per dv block (4 x 64 KB, mostly from L2: the 4 blocks
//   are neighbouring CTAs), U, writes V' (32 KB each) and S_c (64 KB); the output reads q, k once
//   per block (2 x 64 KB, L2), S_c (64 KB), V' (32 KB) and writes o (16 KB bf16).
// Bound: the state pass is the critical path: 48 chunks in a row per CTA at 4 x 3072, each two
//   64 x 128 x 32 products and ~72 KB of loads (W, K, U), not overlapped with the products
//   within a CTA (single-buffered; the second CTA on the SM overlaps them); 768 CTAs at 2 per SM
//   are three waves on 132 SMs (1 x 4096: 192 CTAs, one wave of 64 chunks).

namespace gdn {

constexpr int WARPS_S = GDN_SPLIT_STATE_THREADS / 32;
constexpr int BV = GDN_SPLIT_BV;
constexpr int BO = GDN_SPLIT_OUT_BV;

__device__ __forceinline__ void cp16(float* dst, const float* src, bool valid) {
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_commit_wait_all() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// rows x cols f32 (cols % 4 == 0) from global src (row pitch sld, 16-byte aligned rows) to shared
// dst (pitch dld); rows >= valid_rows are zero-filled and read nothing (src is still a mapped
// address: the tile's base).
__device__ __forceinline__ void tile_async(float* dst, int dld, const float* src, index_t sld, int rows, int cols,
                                           int valid_rows, int tid, int nt) {
  const int c4 = cols / 4;
  for (int e = tid; e < rows * c4; e += nt) {
    const int i = e / c4, c = (e - i * c4) * 4;
    const bool ok = i < valid_rows;
    cp16(dst + i * dld + c, ok ? src + (index_t)i * sld + c : src, ok);
  }
}

// First slot of sequence b (see the header).
__device__ __forceinline__ index_t slot_base(const int* seq_starts, int n_starts, index_t rows, int b) {
  index_t r0, r1;
  seq_range(seq_starts, n_starts, rows, b, r0, r1);
  return r0 / C + b;
}

// The chunk of slot s: sequence b, first row c0, length L; false if no chunk has this slot.
__device__ __forceinline__ bool slot_chunk(const int* seq_starts, int n_starts, index_t rows, index_t s, int& b,
                                           index_t& c0, int& L) {
  int lo = 0, hi = n_starts - 1, found = -1;
  while (lo <= hi) {
    const int mid = (lo + hi) >> 1;
    if (slot_base(seq_starts, n_starts, rows, mid) <= s) {
      found = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  if (found < 0) return false;
  index_t r0, r1;
  seq_range(seq_starts, n_starts, rows, found, r0, r1);
  const index_t j = s - (r0 / C + found);
  c0 = r0 + j * C;
  if (r1 <= r0 || c0 >= r1) return false;
  b = found;
  L = (int)min((index_t)C, r1 - c0);
  return true;
}

// acc (+/-)= A[16 x kdim] B[kdim x 16] in 3xTF32: each operand split into a TF32 high part and
// a TF32 remainder; hi*hi + hi*lo + lo*hi keeps ~f32 accuracy. Layouts as mma_acc.
template <class LA, class LB>
__device__ __forceinline__ void mma_acc3(Acc& acc, const float* a, int lda, const float* b, int ldb, int kdim,
                                         bool negate) {
  constexpr bool a_row = std::is_same<LA, wm::row_major>::value;
  constexpr bool b_row = std::is_same<LB, wm::row_major>::value;
  FragA<LA> ah, al;
  FragB<LB> bh, bl;
  for (int k0 = 0; k0 < kdim; k0 += KS) {
    wm::load_matrix_sync(ah, a + (a_row ? k0 : k0 * lda), lda);
    wm::load_matrix_sync(bh, b + (b_row ? k0 * ldb : k0), ldb);
#pragma unroll
    for (int t = 0; t < ah.num_elements; ++t) {
      const float x = negate ? -ah.x[t] : ah.x[t];
      const float hi = wm::__float_to_tf32(x);
      ah.x[t] = hi;
      al.x[t] = wm::__float_to_tf32(x - hi);
    }
#pragma unroll
    for (int t = 0; t < bh.num_elements; ++t) {
      const float x = bh.x[t];
      const float hi = wm::__float_to_tf32(x);
      bh.x[t] = hi;
      bl.x[t] = wm::__float_to_tf32(x - hi);
    }
    wm::mma_sync(acc, al, bh, acc);
    wm::mma_sync(acc, ah, bl, acc);
    wm::mma_sync(acc, ah, bh, acc);
  }
}

}  // namespace gdn

namespace gdn {

// The split form's prep up to the solve (gdn_split_prep): CTA (slot, value head)
// loads its chunk, takes G, A and solves (I + A) [W | U] = [diag(beta exp(G)) K | diag(beta) V];
// on return (after a barrier) smem holds W [C][dk+P] | U [C][dv+P] | A [C][C+P] | G [C] | beta [C]
// in f32 (rows >= L zero, G's pad repeats G_L). False (before any barrier, so the whole CTA
// returns) when no chunk has this slot.
__device__ __forceinline__ bool prep_solve(const float* __restrict__ k, const float* __restrict__ v,
                                           const float* __restrict__ g, const __nv_bfloat16* __restrict__ beta,
                                           const int* __restrict__ seq_starts, int n_starts, long long rows,
                                           int k_heads, int v_heads, int dk, int dv, float* smem, index_t& slot,
                                           index_t& c0, int& L) {
  const int lk = dk + PAD, lv = dv + PAD;
  constexpr int la = C + PAD;
  float* X = smem;        // [C][lk]
  float* U = X + C * lk;  // [C][lv]
  float* A = U + C * lv;  // [C][la]
  float* G = A + C * la;  // [C]
  float* Bt = G + C;      // [C]
  const int tid = threadIdx.x, nt = blockDim.x, warp = tid >> 5;
  if (blockDim.x != GDN_THREADS || (dk % T) != 0 || (dv % T) != 0) __trap();
  const int h = (int)(blockIdx.x % (unsigned)v_heads);
  slot = (index_t)(blockIdx.x / (unsigned)v_heads);
  int b;
  if (!slot_chunk(seq_starts, n_starts, rows, slot, b, c0, L)) return false;
  const int kh = h / (v_heads / k_heads);
  const index_t kw = (index_t)k_heads * dk, vw = (index_t)v_heads * dv;
  tile_async(X, lk, k + c0 * kw + (index_t)kh * dk, kw, C, dk, L, tid, nt);
  tile_async(U, lv, v + c0 * vw + (index_t)h * dv, vw, C, dv, L, tid, nt);
  for (int i = tid; i < C; i += nt) {
    Bt[i] = i < L ? bf16_to_f32(beta[(c0 + i) * v_heads + h]) : 0.f;
    G[i] = i < L ? g[(c0 + i) * v_heads + h] : 0.f;  // loaded in parallel, summed below
  }
  cp_commit_wait_all();
  __syncthreads();
  if (tid == 0) {
    // Sequential, as cpu.rs accumulates it (from shared memory: one global latency, not C); the
    // pad repeats G_L.
    float acc = 0.f;
    for (int i = 0; i < C; ++i) {
      if (i < L) acc += G[i];
      G[i] = acc;
    }
  }
  // (G is next read after the barrier that follows A.)
  // A = K K^T, the tiles on or below the diagonal (the mask zeroes the rest).
  for (int t = warp; t < (C / T) * (C / T); t += WARPS) {
    const int i0 = (t / (C / T)) * T, j0 = (t % (C / T)) * T;
    if (j0 > i0) continue;
    Acc acc;
    wm::fill_fragment(acc, 0.f);
    mma_acc3<wm::row_major, wm::col_major>(acc, X + i0 * lk, lk, X + j0 * lk, lk, dk, false);
    wm::store_matrix_sync(A + i0 * la + j0, acc, la, wm::mem_row_major);
  }
  __syncthreads();
  for (int e = tid; e < C * C; e += nt) {
    const int i = e / C, j = e - i * C;
    A[i * la + j] = (j < i && i < L) ? Bt[i] * A[i * la + j] * expf(G[i] - G[j]) : 0.f;
  }
  for (int e = tid; e < C * dk; e += nt) {
    const int i = e / dk, d = e - i * dk;
    X[i * lk + d] *= Bt[i] * expf(G[i]);
  }
  for (int e = tid; e < C * dv; e += nt) {
    const int i = e / dv, c = e - i * dv;
    U[i * lv + c] *= Bt[i];
  }
  __syncthreads();
  // (I + A) [W | U] = [W | U] in blocks of T rows: rows of block r first lose A[r, <r] times the
  // finished rows above (tensor cores), then the block's own lower triangle (one column a thread).
  const int col_tiles = dk / T + dv / T;
  for (int r0 = 0; r0 < C; r0 += T) {
    if (r0 > 0) {
      for (int t = warp; t < col_tiles; t += WARPS) {
        float* Xc = t < dk / T ? X + t * T : U + (t - dk / T) * T;
        const int ld = t < dk / T ? lk : lv;
        Acc acc;
        wm::load_matrix_sync(acc, Xc + r0 * ld, ld, wm::mem_row_major);
        mma_acc3<wm::row_major, wm::row_major>(acc, A + r0 * la, la, Xc, ld, r0, true);
        // Each tile is read and written by its own warp only; the rows it reads (< r0) are final.
        wm::store_matrix_sync(Xc + r0 * ld, acc, ld, wm::mem_row_major);
      }
      __syncthreads();
    }
    for (int col = tid; col < dk + dv; col += nt) {
      float* Xc = col < dk ? X + col : U + (col - dk);
      const int ld = col < dk ? lk : lv;
      float x[T];
#pragma unroll
      for (int i = 0; i < T; ++i) x[i] = Xc[(r0 + i) * ld];
#pragma unroll
      for (int i = 1; i < T; ++i) {
#pragma unroll
        for (int j = 0; j < i; ++j) x[i] -= A[(r0 + i) * la + r0 + j] * x[j];
      }
#pragma unroll
      for (int i = 1; i < T; ++i) Xc[(r0 + i) * ld] = x[i];
    }
    __syncthreads();
  }
  return true;
}

}  // namespace gdn

// One CTA per (chunk slot, value head): G, A, and the solve for W and U, written to scratch.
// Shared memory (f32): K, then W [C][dk+P] | V, then U [C][dv+P] | A [C][C+P] | G [C] | beta [C].
extern "C" __global__ void __launch_bounds__(GDN_THREADS, 2) gdn_split_prep(
    const float* __restrict__ k, const float* __restrict__ v, const float* __restrict__ g,
    const __nv_bfloat16* __restrict__ beta, float* __restrict__ w_out, float* __restrict__ u_out,
    float* __restrict__ g_out, const int* __restrict__ seq_starts, int n_starts, long long rows, int k_heads,
    int v_heads, int dk, int dv) {
  extern __shared__ __align__(128) float smem[];
  const int lk = dk + gdn::PAD, lv = dv + gdn::PAD;
  float* X = smem;
  float* U = X + gdn::C * lk;
  float* G = U + gdn::C * lv + gdn::C * (gdn::C + gdn::PAD);
  const int tid = threadIdx.x, nt = blockDim.x;
  const int h = (int)(blockIdx.x % (unsigned)v_heads);
  using gdn::C;
  index_t slot, c0;
  int L;
  if (!gdn::prep_solve(k, v, g, beta, seq_starts, n_starts, rows, k_heads, v_heads, dk, dv, smem, slot, c0, L)) return;
  const index_t sh = slot * v_heads + h;
  float* wo = w_out + sh * C * dk;
  float* uo = u_out + sh * C * dv;
  for (int e = tid; e < C * dk / 4; e += nt) {
    const int i = e / (dk / 4), d = (e - i * (dk / 4)) * 4;
    *reinterpret_cast<float4*>(wo + i * dk + d) = *reinterpret_cast<const float4*>(X + i * lk + d);
  }
  for (int e = tid; e < C * dv / 4; e += nt) {
    const int i = e / (dv / 4), c = (e - i * (dv / 4)) * 4;
    *reinterpret_cast<float4*>(uo + i * dv + c) = *reinterpret_cast<const float4*>(U + i * lv + c);
  }
  for (int i = tid; i < C; i += nt) g_out[sh * C + i] = G[i];
}

// One CTA per (sequence, value head, block of BV value columns), the chunks in order, the state
// block S [dk][BV] in shared memory throughout. Shared memory (f32): W [C][dk+P] | K [C][dk+P] |
// S [dk][BV+P] | U, then V' [C][BV+P] | G [C] (the pad keeps the layout's 16-byte alignment).
extern "C" __global__ void __launch_bounds__(GDN_SPLIT_STATE_THREADS, 2) gdn_split_state(
    const float* __restrict__ k, const float* __restrict__ w_in, float* __restrict__ u_v,
    const float* __restrict__ g_in, float* __restrict__ s_out, float* __restrict__ state, int state_seqs,
    const int* __restrict__ seq_starts, int n_starts, long long rows, int k_heads, int v_heads, int dk, int dv) {
  using gdn::BV;
  using gdn::C;
  using gdn::T;
  namespace wm = gdn::wm;
  extern __shared__ __align__(128) float smem[];
  const int lk = dk + gdn::PAD;
  constexpr int lb = BV + gdn::PAD;
  float* sW = smem;           // [C][lk]
  float* sK = sW + C * lk;    // [C][lk]
  float* sS = sK + C * lk;    // [dk][lb]
  float* sV = sS + dk * lb;   // [C][lb]
  float* sG = sV + C * lb;    // [C]
  const int tid = threadIdx.x, nt = blockDim.x, warp = tid >> 5;
  if (blockDim.x != GDN_SPLIT_STATE_THREADS || (dk % T) != 0 || (dv % T) != 0) __trap();
  const int nvb = (dv + BV - 1) / BV;
  const int vb = (int)(blockIdx.x % (unsigned)nvb);
  const int h = (int)((blockIdx.x / (unsigned)nvb) % (unsigned)v_heads);
  const int b = (int)(blockIdx.x / (unsigned)nvb / (unsigned)v_heads);
  index_t r0, r1;
  gdn::seq_range(seq_starts, n_starts, rows, b, r0, r1);
  if (r1 <= r0) return;
  const int v0 = vb * BV, bw = min(BV, dv - v0);  // a multiple of T
  const int kh = h / (v_heads / k_heads);
  const index_t kw = (index_t)k_heads * dk;
  float* st = (state != nullptr && b < state_seqs) ? state + ((index_t)b * v_heads + h) * dk * dv : nullptr;
  for (int e = tid; e < dk * bw; e += nt) {
    const int d = e / bw, c = e - d * bw;
    sS[d * lb + c] = st ? st[(index_t)d * dv + v0 + c] : 0.f;
  }
  __syncthreads();
  const int tiles_v = (C / T) * (bw / T), tiles_s = (dk / T) * (bw / T);
  const index_t base = r0 / C + b;
  for (index_t c0 = r0, j = 0; c0 < r1; c0 += C, ++j) {
    // The previous chunk ended with a barrier: every buffer is free, sS holds S_c.
    const int L = (int)min((index_t)C, r1 - c0);
    const index_t sh = (base + j) * v_heads + h;
    float* uv = u_v + sh * C * dv + v0;
    gdn::tile_async(sW, lk, w_in + sh * C * dk, dk, C, dk, C, tid, nt);
    gdn::tile_async(sK, lk, k + c0 * kw + (index_t)kh * dk, kw, C, dk, L, tid, nt);
    gdn::tile_async(sV, lb, uv, dv, C, bw, C, tid, nt);
    for (int i = tid; i < C; i += nt) sG[i] = g_in[sh * C + i];
    float* sc = s_out + sh * dk * dv + v0;
    for (int e = tid; e < dk * bw; e += nt) {
      const int d = e / bw, c = e - d * bw;
      sc[(index_t)d * dv + c] = sS[d * lb + c];
    }
    gdn::cp_commit_wait_all();
    __syncthreads();
    // V' = U - W S_c: the accumulator starts from U, W's fragments are negated.
    for (int t = warp; t < tiles_v; t += gdn::WARPS_S) {
      const int i0 = (t / (bw / T)) * T, n0 = (t % (bw / T)) * T;
      gdn::Acc acc;
      wm::load_matrix_sync(acc, sV + i0 * lb + n0, lb, wm::mem_row_major);
      gdn::FragA<wm::row_major> fa;
      gdn::FragB<wm::row_major> fb;
      for (int k0 = 0; k0 < dk; k0 += gdn::KS) {
        wm::load_matrix_sync(fa, sW + i0 * lk + k0, lk);
        wm::load_matrix_sync(fb, sS + k0 * lb + n0, lb);
#pragma unroll
        for (int x = 0; x < fa.num_elements; ++x) fa.x[x] = -wm::__float_to_tf32(fa.x[x]);
#pragma unroll
        for (int x = 0; x < fb.num_elements; ++x) fb.x[x] = wm::__float_to_tf32(fb.x[x]);
        wm::mma_sync(acc, fa, fb, acc);
      }
      wm::store_matrix_sync(sV + i0 * lb + n0, acc, lb, wm::mem_row_major);
    }
    __syncthreads();
    // V' out (over U; its rows >= L are 0 - 0), and diag(exp(G_L - G_j)) V' for the update.
    const float gl = sG[L - 1];
    for (int e = tid; e < C * bw; e += nt) {
      const int i = e / bw, c = e - i * bw;
      const float x = sV[i * lb + c];
      uv[(index_t)i * dv + c] = x;
      sV[i * lb + c] = x * expf(gl - sG[i]);
    }
    __syncthreads();
    // S = exp(G_L) S + K^T (E V').
    const float end_decay = expf(gl);
    for (int t = warp; t < tiles_s; t += gdn::WARPS_S) {
      const int d0 = (t / (bw / T)) * T, n0 = (t % (bw / T)) * T;
      gdn::Acc acc;
      wm::load_matrix_sync(acc, sS + d0 * lb + n0, lb, wm::mem_row_major);
#pragma unroll
      for (int x = 0; x < acc.num_elements; ++x) acc.x[x] *= end_decay;
      gdn::mma_acc<wm::col_major, wm::row_major>(acc, sK + d0, lk, sV + n0, lb, C);
      wm::store_matrix_sync(sS + d0 * lb + n0, acc, lb, wm::mem_row_major);
    }
    __syncthreads();
  }
  if (st) {
    for (int e = tid; e < dk * bw; e += nt) {
      const int d = e / bw, c = e - d * bw;
      st[(index_t)d * dv + v0 + c] = sS[d * lb + c];
    }
  }
}

// One CTA per (chunk slot, value head, block of BO value columns). Shared memory (f32):
// Q, then the output tile [C][max(dk, BO)+P] | K, then S_c (K dead once Q K^T is taken)
// [max(C (dk+P), dk (BO+P))] | A [C][C+P] | V' [C][BO+P] | G [C].
extern "C" __global__ void __launch_bounds__(GDN_THREADS, 2) gdn_split_out(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ vp,
    const float* __restrict__ g_in, const float* __restrict__ s_in, __nv_bfloat16* __restrict__ o,
    const int* __restrict__ seq_starts, int n_starts, long long rows, int k_heads, int v_heads, int dk, int dv) {
  using gdn::BO;
  using gdn::C;
  using gdn::T;
  namespace wm = gdn::wm;
  extern __shared__ __align__(128) float smem[];
  const int lk = dk + gdn::PAD;
  constexpr int lb = BO + gdn::PAD;
  constexpr int la = C + gdn::PAD;
  const int lq = lk > lb ? lk : lb;
  float* sQ = smem;                                             // [C][lq]
  float* sK = sQ + C * lq;                                      // [C][lk], then S_c [dk][lb]
  float* sA = sK + (C * lk > dk * lb ? C * lk : dk * lb);       // [C][la]
  float* sV = sA + C * la;                                      // [C][lb]
  float* sG = sV + C * lb;                                      // [C]
  float* sS = sK;
  const int tid = threadIdx.x, nt = blockDim.x, warp = tid >> 5;
  if (blockDim.x != GDN_THREADS || (dk % T) != 0 || (dv % T) != 0) __trap();
  const int nvb = (dv + BO - 1) / BO;
  const int vb = (int)(blockIdx.x % (unsigned)nvb);
  const int h = (int)((blockIdx.x / (unsigned)nvb) % (unsigned)v_heads);
  const index_t slot = (index_t)(blockIdx.x / (unsigned)nvb / (unsigned)v_heads);
  int b;
  index_t c0;
  int L;
  if (!gdn::slot_chunk(seq_starts, n_starts, rows, slot, b, c0, L)) return;
  const int v0 = vb * BO, bw = min(BO, dv - v0);  // a multiple of T
  const int kh = h / (v_heads / k_heads);
  const index_t kw = (index_t)k_heads * dk, vw = (index_t)v_heads * dv;
  const index_t sh = slot * v_heads + h;
  gdn::tile_async(sQ, lq, q + c0 * kw + (index_t)kh * dk, kw, C, dk, L, tid, nt);
  gdn::tile_async(sK, lk, k + c0 * kw + (index_t)kh * dk, kw, C, dk, L, tid, nt);
  gdn::tile_async(sV, lb, vp + sh * C * dv + v0, dv, C, bw, C, tid, nt);
  for (int i = tid; i < C; i += nt) sG[i] = g_in[sh * C + i];
  gdn::cp_commit_wait_all();
  __syncthreads();
  // Q K^T on and below the diagonal, rows < L.
  for (int t = warp; t < (C / T) * (C / T); t += gdn::WARPS) {
    const int i0 = (t / (C / T)) * T, j0 = (t % (C / T)) * T;
    if (j0 > i0 || i0 >= L) continue;
    gdn::Acc acc;
    wm::fill_fragment(acc, 0.f);
    gdn::mma_acc<wm::row_major, wm::col_major>(acc, sQ + i0 * lq, lq, sK + j0 * lk, lk, dk);
    wm::store_matrix_sync(sA + i0 * la + j0, acc, la, wm::mem_row_major);
  }
  __syncthreads();
  // K is dead: S_c takes its place. Meanwhile the decayed causal mask, and Q's rows take exp(G_i).
  gdn::tile_async(sS, lb, s_in + sh * dk * dv + v0, dv, dk, bw, dk, tid, nt);
  for (int e = tid; e < C * C; e += nt) {
    const int i = e / C, j = e - i * C;
    sA[i * la + j] = (j <= i && i < L) ? sA[i * la + j] * expf(sG[i] - sG[j]) : 0.f;
  }
  for (int e = tid; e < C * dk; e += nt) {
    const int i = e / dk, d = e - i * dk;
    sQ[i * lq + d] *= expf(sG[i]);
  }
  gdn::cp_commit_wait_all();
  __syncthreads();
  // o = (exp(G) Q) S_c + A V': at most 16 tiles of 16 x 16, two per warp; A's row block i0 is
  // zero past column i0 + T.
  const int tiles = (C / T) * (bw / T);
  gdn::Acc acc[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int t = warp + u * gdn::WARPS;
    const int i0 = (t / (bw / T)) * T, n0 = (t % (bw / T)) * T;
    wm::fill_fragment(acc[u], 0.f);
    if (t < tiles && i0 < L) {
      gdn::mma_acc<wm::row_major, wm::row_major>(acc[u], sQ + i0 * lq, lq, sS + n0, lb, dk);
      gdn::mma_acc<wm::row_major, wm::row_major>(acc[u], sA + i0 * la, la, sV + n0, lb, i0 + T);
    }
  }
  __syncthreads();  // every warp is done with Q: the output tiles take its place
  float* sO = sQ;   // [C][lb]
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int t = warp + u * gdn::WARPS;
    const int i0 = (t / (bw / T)) * T, n0 = (t % (bw / T)) * T;
    if (t < tiles && i0 < L) wm::store_matrix_sync(sO + i0 * lb + n0, acc[u], lb, wm::mem_row_major);
  }
  __syncthreads();
  __nv_bfloat16* oh = o + c0 * vw + (index_t)h * dv + v0;
  for (int e = tid; e < L * bw; e += nt) {
    const int i = e / bw, c = e - i * bw;
    oh[(index_t)i * vw + c] = f32_to_bf16_rne(sO[i * lb + c]);
  }
}

// ---------------------------------------------------------------------------------------------
// The fast split form: the split form's three steps with bf16 scratch and bf16 tensor-core
// operands (mma.sync m16n8k16, f32 accumulators; mma.cuh), as flash-linear-attention's
// chunk_gated_delta_rule keeps its w, u, v_new and per-chunk states h in bf16.
//
// Math (as the split form, per chunk of L <= C tokens, value head h):
//   gdn_fast_prep   K K^T on bf16 tensor cores (k as hi + lo pairs, ~f32), A masked and decayed,
//                   the explicit inverse Ai = (I + A)^-1 in f32 (16 x 16 diagonal blocks by
//                   substitution, then the off-diagonal blocks from them, as flash-linear-
//                   attention's solve_tril), W = (Ai diag(beta exp(G))) K and U = (Ai diag(beta))
//                   V on tensor cores (hi + lo operands, ~f32), written rounded to bf16, and
//                   Ke^T = (diag(exp(G_L - G_j)) K)^T (bf16, rows j >= L zero) so the state pass
//                   needs neither k nor G per row. W and Ke^T are written in MMA A-fragment order
//                   (gdn::frag_index), U row-major.
//   gdn_fast_state  per (sequence, value head, block of GDN_FAST_BV value columns): the state
//                   block S [dk][BV] lives in the warps' f32 MMA accumulators for the whole
//                   sequence (warp w owns the 16-row tiles w, w + 4 of dk). Per chunk:
//                   S_c = bf16(S) (stored, and the B operand of the next product);
//                   V' = bf16(U - W S_c) (stored over U);  S = exp(G_L) S + Ke^T V'.
//                   W and Ke^T go from global memory (L2) straight into registers as A
//                   fragments, the next chunk's issued as soon as the current ones are consumed;
//                   U arrives by cp.async a chunk ahead; the chunk after that is prefetched
//                   into L2 by the bulk copy engine. The last S (f32) is the state out.
//   gdn_fast_out    per (chunk slot, key head, block of GDN_FAST_OUT_BV = 128 value columns),
//                   the key head's value heads in turn (q, k and Q K^T shared by them),
//                   8 warps, two per 16 rows of the chunk (64 value columns each): A = mask(Q
//                   K^T) exp(G_i - G_j) (f32 accumulators, half the 16-column tiles each, then
//                   rounded to bf16 as the A operand and shared), o = exp(G_i) (Q S_c) + A V'.
//                   q and k are read as f32 and staged as bf16 hi + lo pairs (Q K^T in three
//                   products, Q S_c in two: ~f32 q and k; rounding them to bf16 was the largest
//                   single error term, tests/reference/gdn_bf16_rounding.py), once per chunk
//                   and key head at dv <= 128.
// Scratch: W, Ke^T [n_slots][v_heads][C * dk] bf16 (fragment order); U then V'
//   [n_slots][v_heads][C][dv] bf16; G [n_slots][v_heads][C] f32; S_c [n_slots][v_heads][dk][dv]
//   bf16 = n_slots * v_heads * (2 C (2 dk + dv) + 4 C + 2 dk dv) bytes (27B shape at 4 x 3072:
//   777 MB, 0.63x the split form's).
// Requires dk % 16 == 0, dk <= 128 (two 16-row state tiles per warp), dv % 16 == 0 (the Rust
//   launcher uses the split form otherwise).
// Launch (dynamic shared memory in bytes, P = GDN_FAST_PAD bf16, 128/128):
//   prep   grid n_slots * k_heads, GDN_THREADS (gdn_fast_prep_nk8 where dk = dv = 128,
//          gdn_fast_prep_nk0 otherwise; likewise gdn_fast_out_nk8 / _nk0; the CTA takes its
//          key head's value heads in turn);
//          2 (2 C (dk+P) + 2 C (dv+P)) + 4 (2 C (C+4) + 768 + 4 C)        (108,544; 2 CTAs/SM)
//   state  grid n_starts * v_heads * ceil(dv / BV), GDN_FAST_STATE_THREADS (gdn_fast_state_nk8
//          where dk = 128 and BV divides dv, gdn_fast_state_nk0 otherwise);
//          2 [2 C (BV+P) + dk (BV+P) + C (BV+P)]             (25,600; registers: 3 CTAs/SM)
//   out    grid n_slots * k_heads * ceil(dv / BO), GDN_FAST_OUT_THREADS (the CTA takes its key
//          head's v_heads / k_heads value heads in turn);
//          2 [2 C (dk+P) + max(2 C (dk+P), 2 C (BO+P)) + dk (BO+P)] + 4 (2 C)   (104,960; 2 CTAs/SM)
// Time at the 27B shape, 4 x 3072 tokens (H200, nsys inside the 27B forward, measured with the
//   previous version of these kernels): out 1.28 ms, prep 0.94, state 0.90 (kernel bench: 2.54
//   ms in all at 4 x 3072, 0.95 at 1 x 4096; fla 1.29 and 0.93). The
//   useful work is ~106 GFLOP and ~1 GB of HBM traffic, so each kernel was bound by latency and
//   serialisation, not by the tensor cores or HBM. What changed and the expected effect
//   (estimates, not measured):
//   out    was 18,816 CTAs of 4 warps (2 per SM: 8 warps/SM), each re-reading and re-splitting
//          q, k (64 KB of f32, in 4 dependent load batches) and recomputing Q K^T for its 64
//          columns, with the causal work all on one scheduler (warp 3: 352 MMAs, warp 0: 184).
//          Now 9,408 CTAs of 8 warps (16 warps/SM), q and k in one load batch once per (chunk,
//          head) (L2 -> SM traffic 1.7 -> 1.1 GB), Q K^T once per (chunk, head) (2 x 480 MMAs
//          per 128 columns before, 480 now), V' loaded under Q S_c, the busiest scheduler 440
//          MMAs per 128 columns (before: 2 x 352): ~0.45-0.65 ms.
//   state  was 768 CTAs at 2 per SM (95 KB of staging for double-buffered W, Ke): 3 waves of
//          48 dependent chunk steps, 3 barriers a step, W and Ke through shared memory. Now W
//          and Ke^T (fragment order, 16-byte coalesced loads) go to registers, so shared memory
//          is 26 KB and the 168 registers allow 3 CTAs per SM: 2 waves, 2 barriers a step,
//          no ldmatrix for A operands. Each step's loads (W, Ke^T, U: 36 KB a CTA, issued by
//          every resident CTA at about the same time) were an HBM round trip under load with
//          one step of lead; now chunk j + 2 is prefetched into L2 (cp.async.bulk.prefetch,
//          each of a head's value-block CTAs a quarter), so they hit L2: ~0.4-0.55 ms.
//   prep   k and v now load in one batch with beta and g in flight (one global latency
//          instead of three), G's 64-step sum is unrolled (its loads issue together), the W/U
//          row blocks pair r with 3 - r per scheduler (the worst scheduler did 384 of the CTA's
//          960 MMAs, now 240), the off-diagonal inverse blocks take 4 columns a thread (~4,100
//          -> ~1,000 shared-memory wavefronts a CTA, of ~8,000 in all: with 2 CTAs per SM the
//          shared-memory pipe is a likely bound), Ke^T reads exp(G_L - G_j) per row from shared
//          memory: ~0.6-0.8 ms.
//   Measured (H200, Nsight Compute, one launch each at 4 x 3072): prep 642 us, state 581, out
//   521; kernel bench 1.844 ms at 4 x 3072 and 0.840 at 1 x 4096. All three were issue-bound,
//   not memory-bound: the state pass issued ~1,600 warp instructions per chunk step for its 64
//   MMAs (43% of issue slots busy, 2.9 warps per scheduler), most of them integer work: the
//   tile copies' divisions by a run-time column count, 64-bit chunk offsets recomputed per
//   step, the software bf16 rounding (~14 instructions per pair) and a branch around every
//   ldmatrix + MMA pair for partial tiles. Then:
//   state  one kernel per shape class (gdn_fast_state_nk8: dk = 128, whole value blocks; every
//          loop bound a constant, no branches in the MMA loops, the tile copies by shifts,
//          chunk pointers advanced by a stride, G_L loaded two chunks ahead) and the hardware's
//          cvt.rn.bf16x2.f32 (pack_bf16x2_rn_fast: the same bits for every non-NaN input) in
//          all three kernels: 1,080 SASS instructions for the whole nk8 kernel. Kernel bench
//          1.411 ms at 4 x 3072 (fla 1.379 in the same run: 0.98x) and 0.542 ms at 1 x 4096
//          (fla 1.077: 1.99x); inside the 27B forward prep 769 us, state 364, out 641 per layer
//          (before: 841, 773, 671).
//   What bounds prep and out now (same profile, before the state change; their code is
//   unchanged but for the rounding): prep ~4,200 warp instructions per warp (IMAD 22%), 27% of
//   its stall samples at the inverse's barriers (one per distance step) and 24% on fixed-latency
//   dependencies; out waits mostly on its q/k staging loads (one batch per CTA, nothing
//   overlapping it at 2 CTAs per SM) and on the barrier after Q K^T.
//   prep and out, the same treatment (NOT YET RUN ON A GPU): their bodies compiled for
//   dk = dv = 128 (nk8) and for run-time shapes (nk0), the thread count a constant in both;
//   static SASS prep 3,584 -> 3,016 instructions, out 2,784 -> 2,336 (their staging loops
//   divided by dk / 4 at run time).
//   Registers (ptxas, sm_90a): prep 126 (nk8 and nk0), state 168 (nk8 and nk0; nk0 spills 8
//   bytes), out 105 (nk8) / 122 (nk0).
//   Then prep and out took one CTA per (chunk, key head) over its value heads (k, q staged and
//   K K^T, Q K^T taken once per key head, kept in registers): kernel bench 1.321 -> 1.132 ms at
//   4 x 3072 (fla 1.137 in the same run) with the output pass alone. Registers: prep 126 (nk8;
//   nk0 128, spilling 24 bytes), out 124 (nk8) / 128 (nk0).
// Precision: S_c, V', W, U, Ke^T and A are rounded to bf16 as MMA operands (8 mantissa bits,
//   ~2e-3 relative each), q and k kept as hi + lo pairs (the prep's k, v and scaled inverse
//   too: its products drop only lo x lo, ~2^-17 relative), the running state and every accumulator
//   f32; flash-linear-attention rounds the same operands (and q, k) to bf16. The operations and
//   their order are those of the previous layout (same MMAs in the same accumulation order), so
//   the outputs are unchanged bit for bit and the rounding model stands.

#include "mma.cuh"

namespace gdn {

using attn::bf16;
constexpr int FP = GDN_FAST_PAD;               // bf16 padding per shared-memory row
constexpr int FBV = GDN_FAST_BV;               // state pass: value columns per CTA
constexpr int FBO = GDN_FAST_OUT_BV;           // output: value columns per CTA
constexpr int FW_S = GDN_FAST_STATE_THREADS / 32;
constexpr int FW_O = GDN_FAST_OUT_THREADS / 32;
static_assert(FW_S * 16 == C, "state pass: one warp per 16 rows of a chunk");
static_assert(FW_O * 16 == 2 * C && FBO % 32 == 0, "output: two warps (column halves) per 16 rows");
static_assert(FBV % 16 == 0 && FBO % 16 == 0, "value blocks of whole 16-column tiles");
static_assert(FBO == 128, "the fused gated norm: four value columns a lane, one head a warp");

// rows x cols bf16 (cols % 8 == 0) from global src (row pitch sld elements, 16-byte aligned
// rows) to shared dst (pitch dld); rows >= valid_rows zero-filled.
__device__ __forceinline__ void tile_async_bf16(bf16* dst, int dld, const bf16* src, index_t sld, int rows, int cols,
                                                int valid_rows, int tid, int nt) {
  const int c8 = cols / 8;
  for (int e = tid; e < rows * c8; e += nt) {
    const int i = e / c8, c = (e - i * c8) * 8;
    const bool ok = i < valid_rows;
    attn::cp_async_16(attn::smem_u32(dst + i * dld + c), ok ? src + (index_t)i * sld + c : src, ok);
  }
}

// Two f32 tiles of the same rows (a chunk's q and k, or k and v; cols % 4 == 0) from global as
// bf16 pairs in shared memory (pitch dld): hi = bf16(x) at dst and lo = bf16(x - hi) at dst +
// lo_off (hi + lo keeps ~16 mantissa bits); rows >= valid_rows zero. Loads of both tiles go out in
// batches of FB per thread and tile before their stores, so a thread waits for one global latency
// per batch, not per element or per tile.
constexpr int FB = 8;
__device__ __forceinline__ uint32_t lo_part(float a, float b, uint32_t hi) {
  return attn::pack_op(a - bf16x2_lo_to_f32(hi), b - bf16x2_hi_to_f32(hi));
}
__device__ __forceinline__ void store_bf16x2(bf16* dst, int lo_off, const float4 x) {
  const uint32_t h0 = attn::pack_op(x.x, x.y), h1 = attn::pack_op(x.z, x.w);
  *reinterpret_cast<uint2*>(dst) = make_uint2(h0, h1);
  *reinterpret_cast<uint2*>(dst + lo_off) = make_uint2(lo_part(x.x, x.y, h0), lo_part(x.z, x.w, h1));
}
struct TileF32 {
  bf16* dst;  // hi part; lo part lo_off further
  int lo_off, dld;
  const float* src;
  index_t sld;
  int cols;  // % 4 == 0
};
// (TWO = false: t0 alone, t1 is not read.)
template <bool TWO = true>
__device__ __forceinline__ void tiles2_f32_to_bf16x2(const TileF32 t0, const TileF32 t1, int rows, int valid_rows,
                                                     int tid, int nt) {
  const int c0 = t0.cols / 4, c1 = TWO ? t1.cols / 4 : 1, n0 = rows * c0, n1 = TWO ? rows * c1 : 0;
  const int n = n0 > n1 ? n0 : n1;
  for (int e0 = tid; e0 < n; e0 += FB * nt) {
    float4 x0[FB], x1[FB];
#pragma unroll
    for (int u = 0; u < FB; ++u) {
      const int e = e0 + u * nt, i0 = e / c0, i1 = e / c1;
      x0[u] = x1[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (e < n0 && i0 < valid_rows)
        x0[u] = __ldg(reinterpret_cast<const float4*>(t0.src + (index_t)i0 * t0.sld + (e - i0 * c0) * 4));
      if (e < n1 && i1 < valid_rows)
        x1[u] = __ldg(reinterpret_cast<const float4*>(t1.src + (index_t)i1 * t1.sld + (e - i1 * c1) * 4));
    }
#pragma unroll
    for (int u = 0; u < FB; ++u) {
      const int e = e0 + u * nt, i0 = e / c0, i1 = e / c1;
      if (e < n0) store_bf16x2(t0.dst + i0 * t0.dld + (e - i0 * c0) * 4, t0.lo_off, x0[u]);
      if (e < n1) store_bf16x2(t1.dst + i1 * t1.dld + (e - i1 * c1) * 4, t1.lo_off, x1[u]);
    }
  }
}

// rows x cols bf16 (cols % 8 == 0) from shared src (pitch sld) to global dst (pitch dld).
__device__ __forceinline__ void tile_store_bf16(bf16* dst, index_t dld, const bf16* src, int sld, int rows, int cols,
                                                int tid, int nt) {
  const int c8 = cols / 8;
  for (int e = tid; e < rows * c8; e += nt) {
    const int i = e / c8, c = (e - i * c8) * 8;
    *reinterpret_cast<uint4*>(dst + (index_t)i * dld + c) = *reinterpret_cast<const uint4*>(src + i * sld + c);
  }
}

// ldmatrix lane offsets (bytes) into a row-major bf16 tile of pitch ld:
//   a_rows: the A operand (m16 x k16) of rows m, columns k (non-transposed);
//   a_cols: the A operand of a tile stored transposed ([k][m]: element (m, k) at row k, column m);
//   b_rows: two n8 B operands (k16 x n16) of a tile stored [k][n] (transposed load), as mma_pb;
//   b_cols: two n8 B operands of a tile stored [n][k] (B^T row-major), as mma_abt.
__device__ __forceinline__ uint32_t off_a_rows(int lane, int ld) {
  return (uint32_t)((((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8) * 2);
}
__device__ __forceinline__ uint32_t off_a_cols(int lane, int ld) {
  return (uint32_t)((((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8) * 2);
}
__device__ __forceinline__ uint32_t off_b_rows(int lane, int ld) {
  return (uint32_t)((((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8) * 2);
}
__device__ __forceinline__ uint32_t off_b_cols(int lane, int ld) {
  return (uint32_t)((((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8) * 2);
}

// Fragment order of the fast form's W and Ke^T scratch (the state pass's A operands): a [16 mt..]
// x [16 kt..] tile of an m x (nk * 16) matrix is 32 lanes x 8 bf16 (the lane's m16n8k16 A fragment
// a0..a3, 16 bytes), tiles in (mt, kt) order. Element offset of lane's fragment:
__device__ __forceinline__ int frag_index(int mt, int kt, int nk, int lane) { return ((mt * nk + kt) * 32 + lane) * 8; }

// Part `part` of `parts` of a contiguous global range of `bytes` (a multiple of 16, 16-byte
// aligned) prefetched into L2 by the bulk copy engine (one instruction, no registers or shared
// memory; a hint, so nothing waits for it).
__device__ __forceinline__ void prefetch_l2_part(const void* p, int bytes, int part, int parts) {
  const int per = (bytes / parts) & ~15, off = part * per, len = part == parts - 1 ? bytes - off : per;
  if (len > 0)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(reinterpret_cast<const char*>(p) + off), "r"(len)
                 : "memory");
}

// The 16-byte units of a ROWS x COLS bf16 tile (every row valid) split over NT threads, as
// tile_async_bf16 and tile_store_bf16 split them but with a constant trip count and shifts where
// those divide by a run-time cols / 8: f(row, column) for each of this thread's units.
template <int ROWS, int COLS, int NT, class F>
__device__ __forceinline__ void tile_units_fixed(int tid, F f) {
  constexpr int C8 = COLS / 8, N = ROWS * C8;
  static_assert(N % NT == 0, "whole rounds of the CTA");
#pragma unroll
  for (int it = 0; it < N / NT; ++it) {
    const unsigned e = (unsigned)(tid + it * NT);
    f(e / C8, (e % C8) * 8);
  }
}
template <int ROWS, int COLS, int NT>
__device__ __forceinline__ void tile_async_fixed(bf16* dst, int dld, const bf16* src, index_t sld, int tid) {
  tile_units_fixed<ROWS, COLS, NT>(tid, [&](unsigned i, unsigned c) {
    attn::cp_async_16(attn::smem_u32(dst + i * dld + c), src + (index_t)i * sld + c, true);
  });
}
template <int ROWS, int COLS, int NT>
__device__ __forceinline__ void tile_store_fixed(bf16* dst, index_t dld, const bf16* src, int sld, int tid) {
  tile_units_fixed<ROWS, COLS, NT>(tid, [&](unsigned i, unsigned c) {
    *reinterpret_cast<uint4*>(dst + (index_t)i * dld + c) = *reinterpret_cast<const uint4*>(src + i * sld + c);
  });
}

}  // namespace gdn

// One CTA (GDN_THREADS = 8 warps) per (chunk slot, key head), taking the key head's value heads
// in turn: G, A, the explicit inverse (I + A)^-1 and W, U as its products, written as bf16 W, U
// and Ke^T (see above). k is staged and K K^T taken once for all of them (one CTA per value head
// did both three times at the 27B shape).
// Steps (each ends at a barrier), per value head:
//   1. v (f32; with k for the first head) staged as bf16 hi + lo pairs (one load batch); g,
//      beta; thread 0 sums G (as cpu.rs, unrolled).
//   2. K K^T on tensor cores (3 bf16 MMAs per step: hi hi, hi lo, lo hi; ~f32), warp w the row
//      block w & 3 and the column half w >> 2, for the first head only (kept in registers);
//      masked, decayed and scaled by this head's beta into A (f32).
//   3. Ai = (I + A)^-1 in f32 on CUDA cores: the four 16 x 16 diagonal blocks by substitution
//      (one column a thread, 16 steps), then the off-diagonal blocks by distance d = 1, 2, 3:
//      Ai[i][i-d] = -Ai[i][i] (sum_{m=i-d}^{i-1} A[i][m] Ai[m][i-d]) (two barriers each).
//   4. W = (Ai diag(beta exp(G))) K, U = (Ai diag(beta)) V on tensor cores: warp w < 4 the
//      row block w of W, warp w >= 4 the row block 7 - w of U (a scheduler's two warps get row
//      blocks r and 3 - r, equal work); Ai's scaled rows as bf16 hi + lo A fragments, K and V
//      hi + lo (3 MMAs a step), only the k-steps on or below the diagonal; rounded to bf16 from
//      the accumulators into global memory (W in fragment order: 16-byte stores).
//      Ke^T = bf16(exp(G_L - G_j) (k_hi + k_lo))^T in fragment order.
// Shared memory (bytes): bf16 Kh, Kl [C][dk+FP] | Vh, Vl [C][dv+FP] | f32 A, Ai [C][C+4] |
//   T [3][16][16] | G, beta, beta exp(G), exp(G_L - G) [C] = 2 (2 C (dk+FP) + 2 C (dv+FP))
//   + 4 (2 C (C+4) + 768 + 4 C)  (128/128: 108,544; 2 CTAs per SM).
// The prep body, compiled twice as the state pass's is: DK = 128 for dk = dv = 128 (the 27B
// shape: every staging loop, K K^T and W/U loop bound a constant, the tile copies by shifts) and
// DK = 0 for the run-time shapes. The thread count is the constant GDN_THREADS in both.
template <int DK>
__device__ __forceinline__ void fast_prep_body(
    const float* __restrict__ k, const float* __restrict__ v, const float* __restrict__ g,
    const __nv_bfloat16* __restrict__ beta, __nv_bfloat16* __restrict__ w_out, __nv_bfloat16* __restrict__ u_out,
    __nv_bfloat16* __restrict__ ke_out, float* __restrict__ g_out, const int* __restrict__ seq_starts, int n_starts,
    long long rows, int k_heads, int v_heads, int dk_rt, int dv_rt, float* smem) {
  using gdn::bf16;
  using gdn::C;
  using gdn::FP;
  const int dk = DK > 0 ? DK : dk_rt, dv = DK > 0 ? DK : dv_rt;
  constexpr int LA = C + 4;  // f32 pitch of A, Ai
  const int lk = dk + FP, lv = dv + FP;
  bf16* Kh = reinterpret_cast<bf16*>(smem);
  bf16* Kl = Kh + C * lk;
  bf16* Vh = Kl + C * lk;
  bf16* Vl = Vh + C * lv;
  float* A = reinterpret_cast<float*>(Vl + C * lv);  // 16-byte aligned: every tile is C * 16 * x bytes
  float* Ai = A + C * LA;
  float* Tm = Ai + C * LA;  // [3][16][16]
  float* G = Tm + 3 * 256;
  float* Bt = G + C;
  float* Sw = Bt + C;  // beta_j exp(G_j)
  float* Ef = Sw + C;  // exp(G_L - G_j) (0 for j >= L)
  constexpr int nt = GDN_THREADS;  // the kernel traps on any other block size
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gr = lane >> 2, tq = lane & 3;
  if (blockDim.x != GDN_THREADS || (dk % 16) != 0 || (dv % 16) != 0 || dk > 128) __trap();
  const int kh = (int)(blockIdx.x % (unsigned)k_heads);
  const index_t slot = (index_t)(blockIdx.x / (unsigned)k_heads);
  int b;
  index_t c0;
  int L;
  if (!gdn::slot_chunk(seq_starts, n_starts, rows, slot, b, c0, L)) return;
  const int gv = v_heads / k_heads, h0 = kh * gv;  // this CTA's value heads h0 .. h0 + gv - 1
  const index_t kw = (index_t)k_heads * dk, vw = (index_t)v_heads * dv;
  // 2. K K^T (raw, kept in registers for every value head of the key head): warp w rows
  // rb*16.., columns ch*32..ch*32+31 (skipped where wholly above the diagonal: nothing reads
  // those entries of A).
  const int rb = warp & 3, ch = warp >> 2;
  const bool kk_live = ch * 32 <= rb * 16 + 15;
  float kk_acc[4][4];
#pragma unroll
  for (int n = 0; n < 4; ++n) kk_acc[n][0] = kk_acc[n][1] = kk_acc[n][2] = kk_acc[n][3] = 0.f;
  for (int jh = 0; jh < gv; ++jh) {
    const int h = h0 + jh;
    // beta and g into registers first (nt >= C), stored after v (and k): their loads are in
    // flight with those (G is summed below).
    const float bv = tid < L ? bf16_to_f32(beta[(c0 + tid) * v_heads + h]) : 0.f;
    const float gv_ = tid < L ? g[(c0 + tid) * v_heads + h] : 0.f;
    const gdn::TileF32 vt = {Vh, C * lv, lv, v + c0 * vw + (index_t)h * dv, vw, dv};
    if (jh == 0) {
      gdn::tiles2_f32_to_bf16x2({Kh, C * lk, lk, k + c0 * kw + (index_t)kh * dk, kw, dk}, vt, C, L, tid, nt);
    } else {
      gdn::tiles2_f32_to_bf16x2<false>(vt, vt, C, L, tid, nt);
    }
    if (tid < C) {
      Bt[tid] = bv;
      G[tid] = gv_;
    }
    __syncthreads();
    if (tid == 0) {
      // Sequential, as cpu.rs accumulates it; the pad repeats G_L. Unrolled, so the C shared-memory
      // loads issue together and only the adds are in a chain.
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < C; ++i) {
        if (i < L) acc += G[i];
        G[i] = acc;
      }
    }
    if (jh == 0 && kk_live) {
      const uint32_t kh_s = attn::smem_u32(Kh), kl_s = attn::smem_u32(Kl);
      const uint32_t a_off = gdn::off_a_rows(lane, lk) + (uint32_t)(rb * 16 * lk * 2);
      const uint32_t b_off = gdn::off_b_cols(lane, lk) + (uint32_t)(ch * 32 * lk * 2);
      for (int k0 = 0; k0 < dk; k0 += 16) {
        uint32_t ah[4], al[4];
        attn::ldsm_x4(ah, kh_s + a_off + k0 * 2);
        attn::ldsm_x4(al, kl_s + a_off + k0 * 2);
#pragma unroll
        for (int nn = 0; nn < 2; ++nn) {
          uint32_t bh[4], bl[4];
          attn::ldsm_x4(bh, kh_s + b_off + (uint32_t)(nn * 16 * lk * 2) + k0 * 2);
          attn::ldsm_x4(bl, kl_s + b_off + (uint32_t)(nn * 16 * lk * 2) + k0 * 2);
          attn::mma16816(kk_acc[2 * nn], al, bh[0], bh[1]);
          attn::mma16816(kk_acc[2 * nn], ah, bl[0], bl[1]);
          attn::mma16816(kk_acc[2 * nn], ah, bh[0], bh[1]);
          attn::mma16816(kk_acc[2 * nn + 1], al, bh[2], bh[3]);
          attn::mma16816(kk_acc[2 * nn + 1], ah, bl[2], bl[3]);
          attn::mma16816(kk_acc[2 * nn + 1], ah, bh[2], bh[3]);
        }
      }
    }
    __syncthreads();  // G summed
    if (kk_live) {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = rb * 16 + gr + 8 * (e >> 1), j = ch * 32 + n * 8 + 2 * tq + (e & 1);
          A[i * LA + j] = (j < i && i < L) ? Bt[i] * kk_acc[n][e] * expf(G[i] - G[j]) : 0.f;
        }
      }
    }
    for (int i = tid; i < C; i += nt) {
      Sw[i] = Bt[i] * expf(G[i]);
      Ef[i] = i < L ? expf(G[L - 1] - G[i]) : 0.f;
    }
    __syncthreads();
    // 3. Diagonal blocks of Ai: thread t < C solves column t & 15 of block t >> 4.
    if (tid < C) {
      const int base = (tid >> 4) * 16, c = tid & 15;
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float s = i == c ? 1.f : 0.f;
#pragma unroll
        for (int j = 0; j < i; ++j) s -= A[(base + i) * LA + base + j] * x[j];
        x[i] = s;
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) Ai[(base + i) * LA + base + c] = x[i];
    }
    __syncthreads();
    // Each thread takes 4 adjacent columns of one row (a float4 of the right operand, its left
    // operand entry used 4 times): a quarter of the shared-memory loads of one entry a thread, the
    // same sums in the same order.
    for (int d = 1; d < 4; ++d) {
      const int nb = 4 - d;
      for (int e = tid; e < nb * 64; e += nt) {
        const int m = e >> 6, r = (e >> 2) & 15, c = (e & 3) * 4, i = m + d;
        const float* a = A + (i * 16 + r) * LA + m * 16;
        const float* x = Ai + (m * 16) * LA + m * 16 + c;
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int t = 0; t < 16 * d; ++t) {
          const float av = a[t];
          const float4 xv = *reinterpret_cast<const float4*>(x + t * LA);
          s.x += av * xv.x;
          s.y += av * xv.y;
          s.z += av * xv.z;
          s.w += av * xv.w;
        }
        *reinterpret_cast<float4*>(Tm + m * 256 + r * 16 + c) = s;
      }
      __syncthreads();
      for (int e = tid; e < nb * 64; e += nt) {
        const int m = e >> 6, r = (e >> 2) & 15, c = (e & 3) * 4, i = m + d;
        const float* a = Ai + (i * 16 + r) * LA + i * 16;
        const float* t = Tm + m * 256 + c;
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int u = 0; u < 16; ++u) {
          const float av = a[u];
          const float4 tv = *reinterpret_cast<const float4*>(t + u * 16);
          s.x += av * tv.x;
          s.y += av * tv.y;
          s.z += av * tv.z;
          s.w += av * tv.w;
        }
        *reinterpret_cast<float4*>(Ai + (i * 16 + r) * LA + m * 16 + c) = make_float4(-s.x, -s.y, -s.z, -s.w);
      }
      __syncthreads();
    }
    // 4. W (warps 0-3, row block w) and U (warps 4-7, row block 7 - w): warps w and w + 4 share a
    // scheduler, and the work grows with the row block (rb + 1 k-steps), so each scheduler gets the
    // row blocks r and 3 - r.
    {
      const bool is_u = warp >= 4;
      const int rb = is_u ? 7 - warp : warp;
      const int ncols = is_u ? dv : dk, ld = is_u ? lv : lk;
      const float* sc = is_u ? Bt : Sw;
      const uint32_t xh_s = attn::smem_u32(is_u ? Vh : Kh), xl_s = attn::smem_u32(is_u ? Vl : Kl);
      bf16* dst = (is_u ? u_out + (slot * v_heads + h) * C * dv : w_out + (slot * v_heads + h) * C * dk);
      const int nk = dk / 16;  // W's k-steps (one pass: dk <= 128)
      const uint32_t b_off = gdn::off_b_rows(lane, ld);
      const int r0 = rb * 16 + gr, r1 = r0 + 8;
      for (int n0 = 0; n0 < ncols; n0 += 128) {
        float acc[16][4];
#pragma unroll
        for (int n = 0; n < 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
        for (int kk = 0; kk <= rb; ++kk) {
          const int j0 = kk * 16 + 2 * tq, j1 = j0 + 8;
          const float s00 = sc[j0], s01 = sc[j0 + 1], s10 = sc[j1], s11 = sc[j1 + 1];
          const float x[8] = {Ai[r0 * LA + j0] * s00, Ai[r0 * LA + j0 + 1] * s01, Ai[r1 * LA + j0] * s00,
                              Ai[r1 * LA + j0 + 1] * s01, Ai[r0 * LA + j1] * s10, Ai[r0 * LA + j1 + 1] * s11,
                              Ai[r1 * LA + j1] * s10, Ai[r1 * LA + j1 + 1] * s11};
          uint32_t ah[4], al[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            ah[q] = attn::pack_op(x[2 * q], x[2 * q + 1]);
            al[q] = gdn::lo_part(x[2 * q], x[2 * q + 1], ah[q]);
          }
#pragma unroll
          for (int nn = 0; nn < 8; ++nn) {
            if (n0 + nn * 16 < ncols) {
              const uint32_t o = b_off + (uint32_t)(kk * 16 * ld * 2) + (uint32_t)((n0 + nn * 16) * 2);
              uint32_t bh[4], bl[4];
              attn::ldsm_x4_t(bh, xh_s + o);
              attn::ldsm_x4_t(bl, xl_s + o);
              attn::mma16816(acc[2 * nn], al, bh[0], bh[1]);
              attn::mma16816(acc[2 * nn], ah, bl[0], bl[1]);
              attn::mma16816(acc[2 * nn], ah, bh[0], bh[1]);
              attn::mma16816(acc[2 * nn + 1], al, bh[2], bh[3]);
              attn::mma16816(acc[2 * nn + 1], ah, bl[2], bl[3]);
              attn::mma16816(acc[2 * nn + 1], ah, bh[2], bh[3]);
            }
          }
        }
        if (is_u) {
#pragma unroll
          for (int n = 0; n < 16; ++n) {
            const int c = n0 + n * 8 + 2 * tq;
            if (c < ncols) {
              *reinterpret_cast<uint32_t*>(dst + r0 * ncols + c) = pack_bf16x2_rn_fast(acc[n][0], acc[n][1]);
              *reinterpret_cast<uint32_t*>(dst + r1 * ncols + c) = pack_bf16x2_rn_fast(acc[n][2], acc[n][3]);
            }
          }
        } else {
          // W in the state pass's A-fragment order: a lane's accumulators of n8 tiles 2 kt and
          // 2 kt + 1 are its A fragment of k-step kt (gdn::frag_index).
#pragma unroll
          for (int kt = 0; kt < 8; ++kt) {
            if (kt < nk) {
              const uint4 f = make_uint4(pack_bf16x2_rn_fast(acc[2 * kt][0], acc[2 * kt][1]),
                                         pack_bf16x2_rn_fast(acc[2 * kt][2], acc[2 * kt][3]),
                                         pack_bf16x2_rn_fast(acc[2 * kt + 1][0], acc[2 * kt + 1][1]),
                                         pack_bf16x2_rn_fast(acc[2 * kt + 1][2], acc[2 * kt + 1][3]));
              *reinterpret_cast<uint4*>(dst + gdn::frag_index(rb, kt, nk, lane)) = f;
            }
          }
        }
      }
    }
    // Ke^T = (diag(exp(G_L - G_j)) K)^T from the staged hi + lo (rows j >= L zero), in the state
    // pass's A-fragment order (m: dk tiles, k: the chunk's 4 k-steps), and G. Fragment register r
    // of a lane holds Ke^T rows 16 mt + gr + 8 (r & 1), columns (chunk rows) 16 kt + 2 tq + 8 (r >> 1)
    // and + 1.
    const index_t sh = slot * v_heads + h;
    bf16* ko = ke_out + sh * C * dk;
    for (int e = tid; e < C * dk / 8; e += nt) {
      const int t = e >> 5, ln = e & 31, mt = t / (C / 16), kt = t - mt * (C / 16);
      const int fr = ln >> 2, fq = ln & 3;
      uint32_t f[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int m = mt * 16 + fr + 8 * (r & 1), j = kt * 16 + 2 * fq + 8 * (r >> 1);
        const float x0 = bf16_to_f32(Kh[j * lk + m]) + bf16_to_f32(Kl[j * lk + m]);
        const float x1 = bf16_to_f32(Kh[(j + 1) * lk + m]) + bf16_to_f32(Kl[(j + 1) * lk + m]);
        f[r] = pack_bf16x2_rn_fast(x0 * Ef[j], x1 * Ef[j + 1]);
      }
      *reinterpret_cast<uint4*>(ko + gdn::frag_index(mt, kt, C / 16, ln)) = make_uint4(f[0], f[1], f[2], f[3]);
    }
    for (int i = tid; i < C; i += nt) g_out[sh * C + i] = G[i];
    if (jh + 1 < gv) __syncthreads();  // the next head's v, beta and G take this head's place
  }
}

#define GDN_FAST_PREP_EXPORT(NK)                                                                                    \
  extern "C" __global__ void __launch_bounds__(GDN_THREADS, 2) gdn_fast_prep_nk##NK(                                \
      const float* __restrict__ k, const float* __restrict__ v, const float* __restrict__ g,                        \
      const __nv_bfloat16* __restrict__ beta, __nv_bfloat16* __restrict__ w_out, __nv_bfloat16* __restrict__ u_out, \
      __nv_bfloat16* __restrict__ ke_out, float* __restrict__ g_out, const int* __restrict__ seq_starts,            \
      int n_starts, long long rows, int k_heads, int v_heads, int dk, int dv) {                                     \
    if (NK > 0 && (dk != 16 * NK || dv != 16 * NK)) __trap();                                                       \
    extern __shared__ __align__(128) float smem[];                                                                  \
    fast_prep_body<16 * NK>(k, v, g, beta, w_out, u_out, ke_out, g_out, seq_starts, n_starts, rows, k_heads,        \
                            v_heads, dk, dv, smem);                                                                 \
  }

GDN_FAST_PREP_EXPORT(0)
GDN_FAST_PREP_EXPORT(8)

// One CTA per (sequence, value head, block of BV value columns), the chunks in order, the state
// block in the warps' accumulators. W and Ke^T come from global memory straight into registers as
// A fragments (the prep writes them in fragment order, gdn::frag_index: one 16-byte load per lane
// and fragment, 512 contiguous bytes per warp); the next chunk's are loaded as soon as the
// current ones are used (W after V', Ke^T after the update), so their latency hides behind the
// rest of the chunk. Only the shared operands go through shared memory. Two barriers per chunk.
// Shared memory (bf16): 2 stages of U [C][BV+P] | S_c [dk][BV+P] | V' [C][BV+P].
// The body is compiled twice: NK = 8 for dk = 128 with whole value blocks (dv % BV == 0, every
// 27B-shaped call), where every tile count and loop bound is a constant, so the MMA loops have no
// branches, the tile copies no divisions and ptxas can overlap each ldmatrix with the MMAs before
// it; NK = 0 reads dk and the block width at run time (any dk <= 128 and dv that tile by 16). The
// chunk pointers advance by a stride per chunk, and G_L is loaded two chunks ahead (a load one
// chunk ahead still stalled the loop's head: it queues behind the chunk's 16-byte loads).
// st: this (sequence, head)'s [dk][dv] f32 state, read at the start and written at the end, or
// null (zero start, nothing kept); the kernel wrapper resolves it.
template <int NK>
__device__ __forceinline__ void fast_state_body(const gdn::bf16* __restrict__ w_in, const gdn::bf16* __restrict__ ke_in,
                                                gdn::bf16* __restrict__ u_v, const float* __restrict__ g_in,
                                                gdn::bf16* __restrict__ s_out, float* __restrict__ st, index_t r0,
                                                index_t r1, int b, int h, int vb, int nvb, int v_heads, int dk_rt,
                                                int dv, float* smem) {
  using gdn::C;
  using gdn::FBV;
  using gdn::bf16;
  constexpr int lb = FBV + gdn::FP;
  constexpr int KT = C / 16;  // k-steps of the update (the chunk's rows)
  constexpr int NT = GDN_FAST_STATE_THREADS;
  const int dk = NK > 0 ? 16 * NK : dk_rt;
  bf16* sU = reinterpret_cast<bf16*>(smem);  // 2 stages of [C][lb]
  bf16* sS = sU + 2 * C * lb;                 // [dk][lb]
  bf16* sV = sS + dk * lb;                    // [C][lb]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gr = lane >> 2, tq = lane & 3;
  const int v0 = vb * FBV;
  const int bw = NK > 0 ? FBV : min(FBV, dv - v0);  // a multiple of 16
  const int nb = bw / 8;                            // n8 tiles in use
  const int nk = dk / 16;                           // k-steps of V' = U - W S_c (<= 8)
  // The state block: warp w owns dk rows [16 m, 16 m + 16) for m = w, w + FW_S (those < dk / 16).
  float acc[2][FBV / 8][4];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int m = warp + u * gdn::FW_S;
#pragma unroll
    for (int n = 0; n < FBV / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = m * 16 + gr + 8 * (e >> 1), c = n * 8 + 2 * tq + (e & 1);
        acc[u][n][e] = (st && m < nk && n < nb) ? st[(index_t)d * dv + v0 + c] : 0.f;
      }
    }
  }
  const index_t base = r0 / C + b;
  const index_t n_chunks = (r1 - r0 + C - 1) / C;
  // Chunk j's scratch, advanced by one chunk's stride (v_heads slots) per step.
  const index_t sh0 = base * v_heads + h;
  const index_t step_wk = (index_t)v_heads * C * dk, step_u = (index_t)v_heads * C * dv;
  const index_t step_s = (index_t)v_heads * dk * dv, step_g = (index_t)v_heads * C;
  const bf16* wq = w_in + sh0 * C * dk;
  const bf16* kq = ke_in + sh0 * C * dk;
  bf16* uq = u_v + sh0 * C * dv;  // the head's U / V' rows (column 0)
  bf16* sq = s_out + sh0 * dk * dv + v0;
  const float* gq = g_in + sh0 * C + C - 1;  // G's pad repeats G_L
  // A fragments: W rows [16 warp, 16 warp + 16) (k: dk), Ke^T rows of dk tiles warp, warp + FW_S
  // (k: the chunk's rows). Offsets in 16-byte units (gdn::frag_index / 8).
  const int w_off = warp * nk * 32 + lane;
  uint4 wf[8], kf[2][KT];
  auto load_w = [&](const bf16* p) {
    const uint4* q = reinterpret_cast<const uint4*>(p) + w_off;
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      if (kt < nk) wf[kt] = __ldg(q + kt * 32);
    }
  };
  auto load_k = [&](const bf16* p) {
    const uint4* q = reinterpret_cast<const uint4*>(p) + lane;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int m = warp + u * gdn::FW_S;
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
        if (m < nk) kf[u][kt] = __ldg(q + (m * KT + kt) * 32);
      }
    }
  };
  auto load_u = [&](const bf16* p, int stage) {
    if constexpr (NK > 0) {
      gdn::tile_async_fixed<C, FBV, NT>(sU + stage * C * lb, lb, p + v0, dv, tid);
    } else {
      gdn::tile_async_bf16(sU + stage * C * lb, lb, p + v0, dv, C, bw, C, tid, NT);
    }
  };
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) wf[kt] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int u = 0; u < 2; ++u) {
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) kf[u][kt] = make_uint4(0u, 0u, 0u, 0u);
  }
  load_w(wq);
  load_k(kq);
  load_u(uq, 0);
  attn::cp_async_commit();
  float gl = gq[0], gl1 = n_chunks > 1 ? gq[step_g] : 0.f;
  for (index_t j = 0; j < n_chunks; ++j) {
    const bool more = j + 1 < n_chunks;
    // Chunk j + 2's W, Ke^T and U (the whole head's rows) into L2, this CTA its share of each
    // (the value blocks of a head split every range), so the loads issued during chunk j + 1
    // hit L2 rather than HBM.
    if (tid == 0 && j + 2 < n_chunks) {
      gdn::prefetch_l2_part(wq + 2 * step_wk, 2 * C * dk, vb, nvb);
      gdn::prefetch_l2_part(kq + 2 * step_wk, 2 * C * dk, vb, nvb);
      gdn::prefetch_l2_part(uq + 2 * step_u, 2 * C * dv, vb, nvb);
    }
    // U's other stage was last read before the previous chunk's second barrier.
    if (more) load_u(uq + step_u, (int)(j & 1) ^ 1);
    attn::cp_async_commit();
    const float gl2 = j + 2 < n_chunks ? gq[2 * step_g] : 0.f;
    // S_c = bf16(S) into sS (each warp its own rows; every read of the previous S_c was before
    // the previous chunk's second barrier).
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int m = warp + u * gdn::FW_S;
      if (m >= nk) continue;
#pragma unroll
      for (int n = 0; n < FBV / 8; ++n) {
        if (n >= nb) continue;
        bf16* p = sS + (m * 16 + gr) * lb + n * 8 + 2 * tq;
        *reinterpret_cast<uint32_t*>(p) = pack_bf16x2_rn_fast(acc[u][n][0], acc[u][n][1]);
        *reinterpret_cast<uint32_t*>(p + 8 * lb) = pack_bf16x2_rn_fast(acc[u][n][2], acc[u][n][3]);
      }
    }
    attn::cp_async_wait<1>();  // this chunk's U
    __syncthreads();           // S_c complete; every read of the previous V' is done
    const bf16* cU = sU + (int)(j & 1) * C * lb;
    if constexpr (NK > 0) {
      gdn::tile_store_fixed<16 * NK, FBV, NT>(sq, dv, sS, lb, tid);
    } else {
      gdn::tile_store_bf16(sq, dv, sS, lb, dk, bw, tid, NT);
    }
    // V' = U - W S_c for rows [16 warp, 16 warp + 16): W's fragments negated (exact in bf16).
    float pv[FBV / 8][4];
#pragma unroll
    for (int n = 0; n < FBV / 8; ++n) {
      const bf16* p = cU + (warp * 16 + gr) * lb + n * 8 + 2 * tq;
      const bool ok = n < nb;
      const uint32_t lo = ok ? *reinterpret_cast<const uint32_t*>(p) : 0u;
      const uint32_t hi = ok ? *reinterpret_cast<const uint32_t*>(p + 8 * lb) : 0u;
      pv[n][0] = bf16x2_lo_to_f32(lo);
      pv[n][1] = bf16x2_hi_to_f32(lo);
      pv[n][2] = bf16x2_lo_to_f32(hi);
      pv[n][3] = bf16x2_hi_to_f32(hi);
    }
    {
      const uint32_t b_base = attn::smem_u32(sS) + gdn::off_b_rows(lane, lb);
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        if (kk >= nk) continue;
        const uint32_t a[4] = {wf[kk].x ^ 0x80008000u, wf[kk].y ^ 0x80008000u, wf[kk].z ^ 0x80008000u,
                               wf[kk].w ^ 0x80008000u};
#pragma unroll
        for (int nn = 0; nn < FBV / 16; ++nn) {
          if (2 * nn >= nb) continue;
          uint32_t bq[4];
          attn::ldsm_x4_t(bq, b_base + (uint32_t)(kk * 16 * lb * 2) + nn * 32);
          attn::mma16816(pv[2 * nn], a, bq[0], bq[1]);
          attn::mma16816(pv[2 * nn + 1], a, bq[2], bq[3]);
        }
      }
    }
    if (more) load_w(wq + step_wk);
#pragma unroll
    for (int n = 0; n < FBV / 8; ++n) {
      if (n >= nb) continue;
      bf16* p = sV + (warp * 16 + gr) * lb + n * 8 + 2 * tq;
      *reinterpret_cast<uint32_t*>(p) = pack_bf16x2_rn_fast(pv[n][0], pv[n][1]);
      *reinterpret_cast<uint32_t*>(p + 8 * lb) = pack_bf16x2_rn_fast(pv[n][2], pv[n][3]);
    }
    __syncthreads();  // V' complete; every read of S_c and of this U stage is done
    if constexpr (NK > 0) {
      gdn::tile_store_fixed<C, FBV, NT>(uq + v0, dv, sV, lb, tid);
    } else {
      gdn::tile_store_bf16(uq + v0, dv, sV, lb, C, bw, tid, NT);
    }
    // S = exp(G_L) S + Ke^T V': B = V' [C][bw] (transposed loads).
    const float end_decay = expf(gl);
    {
      const uint32_t b_base = attn::smem_u32(sV) + gdn::off_b_rows(lane, lb);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int m = warp + u * gdn::FW_S;
        if (m >= nk) continue;
#pragma unroll
        for (int n = 0; n < FBV / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[u][n][e] *= end_decay;
        }
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
          const uint32_t a[4] = {kf[u][kk].x, kf[u][kk].y, kf[u][kk].z, kf[u][kk].w};
#pragma unroll
          for (int nn = 0; nn < FBV / 16; ++nn) {
            if (2 * nn >= nb) continue;
            uint32_t bq[4];
            attn::ldsm_x4_t(bq, b_base + (uint32_t)(kk * 16 * lb * 2) + nn * 32);
            attn::mma16816(acc[u][2 * nn], a, bq[0], bq[1]);
            attn::mma16816(acc[u][2 * nn + 1], a, bq[2], bq[3]);
          }
        }
      }
    }
    if (more) load_k(kq + step_wk);
    gl = gl1;
    gl1 = gl2;
    wq += step_wk;
    kq += step_wk;
    uq += step_u;
    sq += step_s;
    gq += step_g;
  }
  attn::cp_async_wait<0>();
  if (st) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int m = warp + u * gdn::FW_S;
      if (m >= nk) continue;
#pragma unroll
      for (int n = 0; n < FBV / 8; ++n) {
        if (n >= nb) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = m * 16 + gr + 8 * (e >> 1), c = n * 8 + 2 * tq + (e & 1);
          st[(index_t)d * dv + v0 + c] = acc[u][n][e];
        }
      }
    }
  }
}

// Two kernels, one per body (each with its own register allocation: one kernel holding both
// spilled): gdn_fast_state_nk8 for dk = 128 and dv % BV == 0, gdn_fast_state_nk0 otherwise.
#define GDN_FAST_STATE_EXPORT(NK)                                                                                \
  extern "C" __global__ void __launch_bounds__(GDN_FAST_STATE_THREADS, GDN_FAST_STATE_CTAS) gdn_fast_state_nk##NK( \
      const __nv_bfloat16* __restrict__ w_in, const __nv_bfloat16* __restrict__ ke_in,                             \
      __nv_bfloat16* __restrict__ u_v, const float* __restrict__ g_in, __nv_bfloat16* __restrict__ s_out,         \
      float* __restrict__ state, int state_seqs, const int* __restrict__ seq_starts, int n_starts, long long rows, \
      int k_heads, int v_heads, int dk, int dv) {                                                                  \
    using gdn::FBV;                                                                                              \
    if (blockDim.x != GDN_FAST_STATE_THREADS || (dk % 16) != 0 || dk > 32 * gdn::FW_S || (dv % 16) != 0 ||      \
        (NK > 0 && (dk != 16 * NK || dv % FBV != 0)))                                                            \
      __trap();                                                                                                  \
    const int nvb = (dv + FBV - 1) / FBV;                                                                        \
    const int vb = (int)(blockIdx.x % (unsigned)nvb);                                                            \
    const int h = (int)((blockIdx.x / (unsigned)nvb) % (unsigned)v_heads);                                       \
    const int b = (int)(blockIdx.x / (unsigned)nvb / (unsigned)v_heads);                                         \
    index_t r0, r1;                                                                                              \
    gdn::seq_range(seq_starts, n_starts, rows, b, r0, r1);                                                       \
    if (r1 <= r0) return;                                                                                        \
    (void)k_heads;                                                                                               \
    float* st = (state != nullptr && b < state_seqs) ? state + ((index_t)b * v_heads + h) * dk * dv : nullptr;   \
    extern __shared__ __align__(128) float smem[];                                                               \
    fast_state_body<NK>(w_in, ke_in, u_v, g_in, s_out, st, r0, r1, b, h, vb, nvb, v_heads, dk, dv, smem);       \
  }

GDN_FAST_STATE_EXPORT(0)
GDN_FAST_STATE_EXPORT(8)

// One CTA per (chunk slot, key head, block of BO = GDN_FAST_OUT_BV value columns), 8 warps; the
// CTA takes the key head's value heads (v_heads / k_heads of them, 3 at the 27B shape) one after
// another. q and k are staged once per (chunk, key head) as bf16 hi + lo parts and their raw
// Q K^T taken once, kept in registers: only the decay exp(G_i - G_j) and the states differ from
// one value head to the next. (One CTA per value head staged and multiplied them once per value
// head: 9,408 CTAs at 4 x 3072 tokens, now 3,136.)
// Warp w takes the chunk's rows [16 rb, 16 rb + 16) and the value columns [64 hf, 64 hf + 64) of
// the block, hf = w >> 2, rb = w & 3 for hf = 0 and 3 - (w & 3) for hf = 1 (warps w and w + 4 share
// a scheduler, so each scheduler gets the row blocks rb and 3 - rb: the causal Q K^T and A V'
// work grows with rb, and this pairing gives every scheduler about the same total). Q K^T takes
// hi hi + hi lo + lo hi, Q S_c takes hi + lo (S_c is bf16); the two warps of a row block take
// alternate 16-column tiles of its Q K^T (this warp those with nn & 1 == hf, at most two) and
// exchange them, masked, decayed and rounded to bf16 per value head, through shared memory.
// Steps: S_c of the first head by cp.async while q, k load; Q K^T; barrier (K is dead); then per
// value head: A's tiles, Q S_c, A V', the output rows (or their gated norm); the next head's S_c
// loads during A V' and the output, its V' during the output.
// Shared memory (bf16): Q hi, Q lo [C][lq] | K hi, K lo [C][lk], then V' [C][BO+P] and A [C][C+P],
// the output tile [C][BO+P] over A once A V' is done (so the K region holds max(2 C lk,
// 2 C (BO+P))) | S_c [dk][BO+P] | G [2][C] f32 (this head's and the next); lq = lk = dk + P.
// The output body, compiled twice as the state pass's is: DK = 128 for dk = dv = 128 (one value
// block; every loop bound a constant) and DK = 0 for the run-time shapes. With norm set (DK = 128
// only) it writes the Gated DeltaNet's gated RMSNorm of its output instead of the output
// (gdn_chunked_norm_fwd): z's rows load during the products, the warps meet at a barrier once the
// output tile is written, and each warp normalises eight whole 128-value rows from the bf16 tile;
// the unfused pair's core write, its reread and the norm kernel's launch are gone.
template <int DK>
__device__ __forceinline__ void fast_out_body(
    const float* __restrict__ q, const float* __restrict__ k, const __nv_bfloat16* __restrict__ vp,
    const float* __restrict__ g_in, const __nv_bfloat16* __restrict__ s_in, __nv_bfloat16* __restrict__ o,
    const __nv_bfloat16* __restrict__ z, const __nv_bfloat16* __restrict__ nw, float eps, int norm,
    const int* __restrict__ seq_starts, int n_starts, long long rows, int k_heads, int v_heads, int dk_rt, int dv_rt,
    float* smem) {
  using gdn::C;
  using gdn::FBO;
  using gdn::bf16;
  constexpr int HB = FBO / 2;  // value columns per warp
  const int dk = DK > 0 ? DK : dk_rt, dv = DK > 0 ? DK : dv_rt;
  const int lk = dk + gdn::FP, lq = lk;
  constexpr int lb = FBO + gdn::FP;
  constexpr int la = C + gdn::FP;
  static_assert(lb >= la, "A lies inside the output tile's space");
  const int kreg = 2 * C * lk > 2 * C * lb ? 2 * C * lk : 2 * C * lb;  // K hi + lo, then V' | A (then O)
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // [C][lq], the lo part C * lq further
  bf16* sK = sQ + 2 * C * lq;                // [C][lk], the lo part C * lk further
  bf16* sV = sK;                             // [C][lb] once K is dead
  bf16* sA = sV + C * lb;                    // [C][la] once K is dead
  bf16* sO = sA;                             // [C][lb] once A V' is done
  bf16* sS = sK + kreg;                      // [dk][lb]
  float* sG = reinterpret_cast<float*>(sS + dk * lb);  // [2][C]
  constexpr int nt = GDN_FAST_OUT_THREADS;  // the kernel traps on any other block size
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gr = lane >> 2, tq = lane & 3;
  if (blockDim.x != GDN_FAST_OUT_THREADS || (dk % 16) != 0 || (dv % 16) != 0) __trap();
  const int nvb = (dv + FBO - 1) / FBO;
  const int vb = (int)(blockIdx.x % (unsigned)nvb);
  const int kh = (int)((blockIdx.x / (unsigned)nvb) % (unsigned)k_heads);
  const index_t slot = (index_t)(blockIdx.x / (unsigned)nvb / (unsigned)k_heads);
  int b;
  index_t c0;
  int L;
  if (!gdn::slot_chunk(seq_starts, n_starts, rows, slot, b, c0, L)) return;
  const int gv = v_heads / k_heads, h0 = kh * gv;  // this CTA's value heads h0 .. h0 + gv - 1
  const int v0 = vb * FBO, bw = min(FBO, dv - v0);  // a multiple of 16
  const int hf = warp >> 2, rb = hf ? 3 - (warp & 3) : (warp & 3);
  const int nb = min(max(bw - hf * HB, 0), HB) / 8;  // this warp's n8 tiles (even)
  const int i0 = rb * 16;
  const bool qk_rows = i0 < L;          // the pair's Q K^T share (warp-uniform)
  const bool live = qk_rows && nb > 0;  // this warp's output columns (warp-uniform)
  const index_t kw = (index_t)k_heads * dk, vw = (index_t)v_heads * dv;
  const index_t sh0 = slot * v_heads + h0;
  gdn::tile_async_bf16(sS, lb, s_in + sh0 * dk * dv + v0, dv, dk, bw, dk, tid, nt);
  attn::cp_async_commit();
  // G into a register first (nt >= C), stored after q and k: its load is in flight with theirs.
  float gv_next = tid < C ? g_in[sh0 * C + tid] : 0.f;
  gdn::tiles2_f32_to_bf16x2({sQ, C * lq, lq, q + c0 * kw + (index_t)kh * dk, kw, dk},
                            {sK, C * lk, lk, k + c0 * kw + (index_t)kh * dk, kw, dk}, C, L, tid, nt);
  if (tid < C) sG[tid] = gv_next;
  attn::cp_async_wait<0>();
  __syncthreads();
  const uint32_t q_base = attn::smem_u32(sQ) + (uint32_t)(i0 * lq * 2) + gdn::off_a_rows(lane, lq);
  const uint32_t q_lo = (uint32_t)(C * lq * 2);  // bytes from a hi fragment to its lo one
  // Raw Q K^T of this warp's (at most two) 16-column tiles nn = hf + 2 t <= rb of its row block.
  float pq[2][2][4];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int u = 0; u < 2; ++u) pq[t][u][0] = pq[t][u][1] = pq[t][u][2] = pq[t][u][3] = 0.f;
  }
  if (qk_rows) {
    const uint32_t k_base = attn::smem_u32(sK) + gdn::off_b_cols(lane, lk);
    const uint32_t k_lo = (uint32_t)(C * lk * 2);
    for (int kk = 0; kk < dk / 16; ++kk) {
      uint32_t a[4], al[4];
      attn::ldsm_x4(a, q_base + kk * 32);
      attn::ldsm_x4(al, q_base + q_lo + kk * 32);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int nn = hf + 2 * t;
        if (nn > rb) continue;
        uint32_t bq[4], bl[4];
        attn::ldsm_x4(bq, k_base + (uint32_t)(nn * 16 * lk * 2) + kk * 32);
        attn::ldsm_x4(bl, k_base + k_lo + (uint32_t)(nn * 16 * lk * 2) + kk * 32);
        attn::mma16816(pq[t][0], al, bq[0], bq[1]);
        attn::mma16816(pq[t][1], al, bq[2], bq[3]);
        attn::mma16816(pq[t][0], a, bl[0], bl[1]);
        attn::mma16816(pq[t][1], a, bl[2], bl[3]);
        attn::mma16816(pq[t][0], a, bq[0], bq[1]);
        attn::mma16816(pq[t][1], a, bq[2], bq[3]);
      }
    }
  }
  __syncthreads();  // every warp is done with K: V' and A take its place
  gdn::tile_async_bf16(sV, lb, vp + sh0 * C * dv + v0, dv, C, bw, C, tid, nt);
  attn::cp_async_commit();
  const bool fuse = DK == FBO && norm && live;
  uint2 wr = make_uint2(0u, 0u);
  if (fuse) wr = *reinterpret_cast<const uint2*>(nw + 4 * lane);
  const uint32_t s_base = attn::smem_u32(sS) + gdn::off_b_rows(lane, lb) + (uint32_t)(hf * HB * 2);
  const uint32_t v_base = attn::smem_u32(sV) + gdn::off_b_rows(lane, lb) + (uint32_t)(hf * HB * 2);
  const uint32_t a_base = attn::smem_u32(sA) + (uint32_t)(i0 * la * 2) + gdn::off_a_rows(lane, la);
  const int nrows = min(16, L - i0);
  for (int j = 0; j < gv; ++j) {
    // Outstanding copies here: this head's V' (and its S_c unless j = 0); sG[j & 1] holds its G.
    const int h = h0 + j;
    const index_t sh = sh0 + j;
    const bool more = j + 1 < gv;  // CTA-uniform
    const float* gb = sG + (j & 1) * C;
    if (qk_rows) {
      // This warp's tiles of A = mask(Q K^T) exp(G_i - G_j) as bf16 (the A operand of A V',
      // rounded as pack_op rounds it).
      const float gi[2] = {gb[i0 + gr], gb[i0 + gr + 8]};
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int nn = hf + 2 * t;
        if (nn > rb) continue;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          float e4[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = i0 + gr + 8 * (e >> 1), jc = nn * 16 + u * 8 + 2 * tq + (e & 1);
            e4[e] = (jc <= i && i < L) ? pq[t][u][e] * expf(gi[e >> 1] - gb[jc]) : 0.f;
          }
          bf16* p = sA + (i0 + gr) * la + nn * 16 + u * 8 + 2 * tq;
          *reinterpret_cast<uint32_t*>(p) = attn::pack_op(e4[0], e4[1]);
          *reinterpret_cast<uint32_t*>(p + 8 * la) = attn::pack_op(e4[2], e4[3]);
        }
      }
    }
    // The fused norm's z rows (this warp's eight of the block, see the end): loads in flight
    // during the products below.
    uint2 zr[8];
    if (fuse) {
      const index_t col = (index_t)h * dv + 4 * lane;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int i = 8 * hf + r;
        zr[r] = i < L - i0 ? *reinterpret_cast<const uint2*>(z + (c0 + i0 + i) * vw + col) : make_uint2(0u, 0u);
      }
    }
    if (j > 0) attn::cp_async_wait<1>();  // this head's S_c (its V' may still be in flight)
    __syncthreads();                      // S_c and A visible
    // o = exp(G_i) (Q S_c) + A V'.
    float po[HB / 8][4];
#pragma unroll
    for (int n = 0; n < HB / 8; ++n) po[n][0] = po[n][1] = po[n][2] = po[n][3] = 0.f;
    if (live) {
      for (int kk = 0; kk < dk / 16; ++kk) {
        uint32_t a[4], al[4];
        attn::ldsm_x4(a, q_base + kk * 32);
        attn::ldsm_x4(al, q_base + q_lo + kk * 32);
#pragma unroll
        for (int nn = 0; nn < HB / 16; ++nn) {
          if (2 * nn >= nb) continue;
          uint32_t bq[4];
          attn::ldsm_x4_t(bq, s_base + (uint32_t)(kk * 16 * lb * 2) + nn * 32);
          attn::mma16816(po[2 * nn], al, bq[0], bq[1]);
          attn::mma16816(po[2 * nn + 1], al, bq[2], bq[3]);
          attn::mma16816(po[2 * nn], a, bq[0], bq[1]);
          attn::mma16816(po[2 * nn + 1], a, bq[2], bq[3]);
        }
      }
      const float eg[2] = {expf(gb[i0 + gr]), expf(gb[i0 + gr + 8])};
#pragma unroll
      for (int n = 0; n < HB / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) po[n][e] *= eg[e >> 1];
      }
    }
    attn::cp_async_wait<0>();
    __syncthreads();  // V' has landed; every warp is done with S_c and with gb
    if (more) {
      gdn::tile_async_bf16(sS, lb, s_in + (sh + 1) * dk * dv + v0, dv, dk, bw, dk, tid, nt);
      attn::cp_async_commit();
      gv_next = tid < C ? g_in[(sh + 1) * C + tid] : 0.f;  // stored below, after the product
    }
    if (live) {
#pragma unroll
      for (int kk = 0; kk < C / 16; ++kk) {
        if (kk > rb) continue;
        uint32_t a[4];
        attn::ldsm_x4(a, a_base + kk * 32);
#pragma unroll
        for (int nn = 0; nn < HB / 16; ++nn) {
          if (2 * nn >= nb) continue;
          uint32_t bq[4];
          attn::ldsm_x4_t(bq, v_base + (uint32_t)(kk * 16 * lb * 2) + nn * 32);
          attn::mma16816(po[2 * nn], a, bq[0], bq[1]);
          attn::mma16816(po[2 * nn + 1], a, bq[2], bq[3]);
        }
      }
    }
    if (more && tid < C) sG[((j + 1) & 1) * C + tid] = gv_next;
    __syncthreads();  // every warp is done with A and V': the output tile takes A's place
    if (more) {
      gdn::tile_async_bf16(sV, lb, vp + (sh + 1) * C * dv + v0, dv, C, bw, C, tid, nt);
      attn::cp_async_commit();
    }
    if (live) {
      // The warp's output tile [16][HB] (rows i0.., columns hf HB..: no other warp touches it),
      // then 16-byte stores.
      bf16* sOw = sO + i0 * lb + hf * HB;
#pragma unroll
      for (int n = 0; n < HB / 8; ++n) {
        if (n >= nb) continue;
        bf16* p = sOw + gr * lb + n * 8 + 2 * tq;
        *reinterpret_cast<uint32_t*>(p) = pack_bf16x2_rn_fast(po[n][0], po[n][1]);
        *reinterpret_cast<uint32_t*>(p + 8 * lb) = pack_bf16x2_rn_fast(po[n][2], po[n][3]);
      }
      if (!fuse) {
        __syncwarp();
        __nv_bfloat16* oh = o + (c0 + i0) * vw + (index_t)h * dv + v0 + hf * HB;
        for (int e = lane; e < nrows * nb; e += 32) {
          const int i = e / nb, c = (e - i * nb) * 8;
          *reinterpret_cast<uint4*>(oh + (index_t)i * vw + c) = *reinterpret_cast<const uint4*>(sOw + i * lb + c);
        }
      }
    }
    if (DK == FBO && norm) {
      // The gated RMSNorm over each whole value head (dv = FBO: this CTA holds every column),
      // with gated_rmsnorm_fwd_bf16's sums, products and roundings in the same order: its input
      // is the bf16 tile above. Once both warps of a row block have written their halves, warp
      // hf takes rows [8 hf, 8 hf + 8) of the block, lane l elements 4l .. 4l + 3. (A CTA
      // barrier: with a named barrier per row-block pair here, racecheck reported the shared
      // reads before this loop's later CTA barriers as racing with the copies issued after
      // them, 12 hazards on the H200, none without the norm; so the loop keeps to CTA barriers.)
      __syncthreads();
      if (fuse) {
        const int c = 4 * lane;
        const bf16* src = sO + i0 * lb + c;
        float wv[4];
        bf16x4_unpack(wr, wv);
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          const int i = 8 * hf + r;
          if (i >= nrows) break;  // warp-uniform
          float xv[4], zv[4];
          bf16_lane_load<4>(src + i * lb, xv);
          bf16x4_unpack(zr[r], zv);
          float ss = 0.f;
#pragma unroll
          for (int e = 0; e < 4; ++e) ss = fmaf(xv[e], xv[e], ss);
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
          const float inv = 1.f / sqrtf(ss / (float)dv + eps);
#pragma unroll
          for (int e = 0; e < 4; ++e) xv[e] = xv[e] * inv * wv[e] * (zv[e] / (1.f + expf(-zv[e])));
          *reinterpret_cast<uint2*>(o + (c0 + i0 + i) * vw + (index_t)h * dv + c) =
              make_uint2(pack_bf16x2_rne(xv[0], xv[1]), pack_bf16x2_rne(xv[2], xv[3]));
        }
      }
    }
    if (more) __syncthreads();  // the output tile is read: the next head's A takes its place
  }
}

#define GDN_FAST_OUT_EXPORT(NK)                                                                                    \
  extern "C" __global__ void __launch_bounds__(GDN_FAST_OUT_THREADS, 2) gdn_fast_out_nk##NK(                       \
      const float* __restrict__ q, const float* __restrict__ k, const __nv_bfloat16* __restrict__ vp,              \
      const float* __restrict__ g_in, const __nv_bfloat16* __restrict__ s_in, __nv_bfloat16* __restrict__ o,       \
      const __nv_bfloat16* __restrict__ z, const __nv_bfloat16* __restrict__ nw, float eps, int norm,              \
      const int* __restrict__ seq_starts, int n_starts, long long rows, int k_heads, int v_heads, int dk, int dv) { \
    if (NK > 0 && (dk != 16 * NK || dv != 16 * NK)) __trap();                                                      \
    if (norm && 16 * NK != gdn::FBO) __trap(); /* the fused norm needs whole value heads in one CTA */          \
    extern __shared__ __align__(128) float smem[];                                                                 \
    fast_out_body<16 * NK>(q, k, vp, g_in, s_in, o, z, nw, eps, norm, seq_starts, n_starts, rows, k_heads, v_heads, \
                           dk, dv, smem);                                                                          \
  }

GDN_FAST_OUT_EXPORT(0)
GDN_FAST_OUT_EXPORT(8)
