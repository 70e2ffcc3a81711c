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
