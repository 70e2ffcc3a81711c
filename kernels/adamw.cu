// adamw.cu: one AdamW step on the f32 master weights, refreshing the bf16 copy the model reads.
//
// Math (per element; cpu.rs `adamw`, each operation one IEEE f32 rounding, left to right):
//   g  = grad * grad_scale
//   m  = b1 * m + (1 - b1) * g
//   v  = b2 * v + ((1 - b2) * g) * g
//   upd = (m / bc1) / (sqrtf(v / bc2) + eps) + wd * p
//   p  = p - lr * upd;   p = off_tie(p);   w = bf16(p)
//   off_tie (tensor.rs master_off_tie): a p whose low 16 bits are exactly 0x8000 moves one f32 ulp
//   toward bf16(p), so that the split form below is exact.
//   Every step is written with __fmul_rn / __fadd_rn / __fsub_rn / __fdiv_rn / __fsqrt_rn, so
//   nvcc cannot contract anything into an FMA: the result equals the CPU's f32 result bit for bit
//   (masters, moments and bf16 weights), denormals included (no FTZ without fast-math).
// Layouts:  master, grad, m, v: [n] f32; w: [n] bf16. bc1 = 1 - beta1^t, bc2 = 1 - beta2^t are
//           computed by the host in f64 and rounded to f32 (as cpu.rs does).
// adamw_planned_f32: the same update with grad_scale and the skip flag read from the device
//           update plan (reduce.cu update_plan_f32), so the host does not wait for the norm.
// adamw_split_f32, adamw_planned_split_f32: the same two with split masters (tensor.rs
//           master_split): the master is not stored as f32 but as its low 16 bits `lo` beside
//           the bf16 weight w, which carries its upper half up to rounding. Same bits as the f32
//           forms for every master that is off ties (every master the engine writes).
//           Bytes 26 n instead of 30 n; 2 bytes per parameter less memory.
// Preconditions: n >= 0 (0: no-op); the five arrays do not overlap.
// Fast path: 4 elements per access when master, grad, m, v are 16-byte aligned and w is 8-byte
//           aligned; the last n % 4 elements (or all, otherwise) take a scalar loop. Same bits.
// Launch:   blockDim.x any value up to 1024 (256 suggested); grid.x any >= 1 (grid-stride).
//           Suggested grid.x = clamp(ceil(n / 4 / 256), 1, 16 * SM count). No shared memory.
// Bytes:    30 n (read 16 n: p, g, m, v; write 14 n: p, m, v, w).
// FLOPs:    ~17 per element (incl. one IEEE sqrt and three IEEE divisions).
// Bound:    memory. Target >= 80% of the measured device-to-device copy bandwidth (~4.1 TB/s on
//           an H200) for n >= 2^24. Measured (H200, n = 2^26): 3.9 TB/s.
#include "common.cuh"

struct AdamHyper {
  float lr, beta1, beta2, eps, wd, bc1, bc2, grad_scale;
  float one_minus_beta1, one_minus_beta2; // cpu.rs: (F::ONE - b1), one rounding each
};

// tensor.rs master_off_tie: off an exact bf16 tie by one ulp toward the bf16 rounding.
__device__ __forceinline__ float master_off_tie(float p) {
  const uint32_t b = __float_as_uint(p);
  if ((b & 0xFFFFu) != 0x8000u || (b & 0x7FFFFFFFu) > 0x7F800000u) return p;
  return __uint_as_float(((b >> 16) & 1u) ? b + 1u : b - 1u);
}

// tensor.rs master_join: the f32 master from its bf16 weight bits and its low half.
__device__ __forceinline__ float master_join(uint32_t w, uint32_t lo) {
  const uint32_t t = lo > 0x8000u ? ((w - 1u) & 0xFFFFu) : w;
  return __uint_as_float((t << 16) | lo);
}

// One element: updates p, m, v in place and returns p (the caller rounds it to bf16).
__device__ __forceinline__ void adamw_element(float& p, float grad, float& m, float& v,
                                              const AdamHyper& h) {
  const float g = __fmul_rn(grad, h.grad_scale);
  m = __fadd_rn(__fmul_rn(h.beta1, m), __fmul_rn(h.one_minus_beta1, g));
  v = __fadd_rn(__fmul_rn(h.beta2, v), __fmul_rn(__fmul_rn(h.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, h.bc2)), h.eps);
  const float upd = __fadd_rn(__fdiv_rn(__fdiv_rn(m, h.bc1), denom), __fmul_rn(h.wd, p));
  p = master_off_tie(__fsub_rn(p, __fmul_rn(h.lr, upd)));
}

// The whole update over the grid with the hyper-parameters in `h`. SPLIT: `master` holds the
// masters' low halves (u16 each), their upper halves come from `w`; else f32 masters.
template <bool SPLIT>
__device__ __forceinline__ void adamw_all(void* __restrict__ master,
                                          const float* __restrict__ grad, float* __restrict__ m,
                                          float* __restrict__ v, __nv_bfloat16* __restrict__ w,
                                          long long n, const AdamHyper& h) {
  const index_t first = grid_thread_index();
  const index_t stride = grid_thread_count();
  float* pf = static_cast<float*>(master);
  unsigned short* lo = static_cast<unsigned short*>(master);
  unsigned short* wb = reinterpret_cast<unsigned short*>(w);
  index_t done = 0;
  const bool master_aligned =
      SPLIT ? (reinterpret_cast<uintptr_t>(master) % 8) == 0 : is_vec_aligned(master);
  if (master_aligned && is_vec_aligned(grad) && is_vec_aligned(m) && is_vec_aligned(v) &&
      (reinterpret_cast<uintptr_t>(w) % 8) == 0) {
    const index_t nv = n / 4;
    const float4* g4 = reinterpret_cast<const float4*>(grad);
    float4* m4 = reinterpret_cast<float4*>(m);
    float4* v4 = reinterpret_cast<float4*>(v);
    uint2* w2 = reinterpret_cast<uint2*>(w);
    for (index_t i = first; i < nv; i += stride) {
      float4 p, mm = m4[i], vv = v4[i];
      const float4 g = g4[i];
      if (SPLIT) {
        const uint2 wv = w2[i], lv = reinterpret_cast<const uint2*>(lo)[i];
        p = make_float4(master_join(wv.x & 0xFFFFu, lv.x & 0xFFFFu), master_join(wv.x >> 16, lv.x >> 16),
                        master_join(wv.y & 0xFFFFu, lv.y & 0xFFFFu), master_join(wv.y >> 16, lv.y >> 16));
      } else {
        p = reinterpret_cast<const float4*>(pf)[i];
      }
      adamw_element(p.x, g.x, mm.x, vv.x, h);
      adamw_element(p.y, g.y, mm.y, vv.y, h);
      adamw_element(p.z, g.z, mm.z, vv.z, h);
      adamw_element(p.w, g.w, mm.w, vv.w, h);
      if (SPLIT) {
        const uint32_t a = __float_as_uint(p.x), b = __float_as_uint(p.y), c = __float_as_uint(p.z),
                       d = __float_as_uint(p.w);
        reinterpret_cast<uint2*>(lo)[i] = make_uint2((a & 0xFFFFu) | (b << 16), (c & 0xFFFFu) | (d << 16));
      } else {
        reinterpret_cast<float4*>(pf)[i] = p;
      }
      m4[i] = mm;
      v4[i] = vv;
      w2[i] = make_uint2(pack_bf16x2_rne(p.x, p.y), pack_bf16x2_rne(p.z, p.w));
    }
    done = nv * 4;
  }
  for (index_t i = done + first; i < n; i += stride) {
    float p = SPLIT ? master_join(wb[i], lo[i]) : pf[i];
    float mm = m[i], vv = v[i];
    adamw_element(p, grad[i], mm, vv, h);
    if (SPLIT) {
      lo[i] = (unsigned short)(__float_as_uint(p) & 0xFFFFu);
    } else {
      pf[i] = p;
    }
    m[i] = mm;
    v[i] = vv;
    w[i] = f32_to_bf16_rne(p);
  }
}

__device__ __forceinline__ AdamHyper adam_hyper(float lr, float beta1, float beta2, float eps,
                                                float wd, float bc1, float bc2, float grad_scale) {
  AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.wd = wd;
  h.bc1 = bc1;
  h.bc2 = bc2;
  h.grad_scale = grad_scale;
  h.one_minus_beta1 = __fsub_rn(1.0f, beta1);
  h.one_minus_beta2 = __fsub_rn(1.0f, beta2);
  return h;
}

extern "C" __global__ void adamw_f32(float* __restrict__ master, const float* __restrict__ grad,
                                     float* __restrict__ m, float* __restrict__ v,
                                     __nv_bfloat16* __restrict__ w, long long n, float lr,
                                     float beta1, float beta2, float eps, float wd, float bc1,
                                     float bc2, float grad_scale) {
  if (n <= 0) return;
  adamw_all<false>(master, grad, m, v, w, n, adam_hyper(lr, beta1, beta2, eps, wd, bc1, bc2, grad_scale));
}

// adamw_f32 on split masters: `master` holds each master's low 16 bits (tensor.rs master_split).
extern "C" __global__ void adamw_split_f32(__nv_bfloat16* __restrict__ master, const float* __restrict__ grad,
                                           float* __restrict__ m, float* __restrict__ v,
                                           __nv_bfloat16* __restrict__ w, long long n, float lr,
                                           float beta1, float beta2, float eps, float wd, float bc1,
                                           float bc2, float grad_scale) {
  if (n <= 0) return;
  adamw_all<true>(master, grad, m, v, w, n, adam_hyper(lr, beta1, beta2, eps, wd, bc1, bc2, grad_scale));
}

// adamw_f32 with the clip factor and the skip decision read from the device update plan
// (reduce.cu `update_plan_f32`: plan[0] = clip factor, plan[1] = 1 to skip the step), so the host
// never waits for the gradient norm. A skipped step returns at once: masters, moments and
// weights stay untouched. Same arithmetic as adamw_f32, bit for bit.
extern "C" __global__ void adamw_planned_f32(float* __restrict__ master,
                                             const float* __restrict__ grad,
                                             float* __restrict__ m, float* __restrict__ v,
                                             __nv_bfloat16* __restrict__ w, long long n,
                                             float lr, float beta1, float beta2, float eps,
                                             float wd, float bc1, float bc2,
                                             const float* __restrict__ plan) {
  if (n <= 0 || plan[1] != 0.0f) return;
  adamw_all<false>(master, grad, m, v, w, n, adam_hyper(lr, beta1, beta2, eps, wd, bc1, bc2, plan[0]));
}

// adamw_planned_f32 on split masters.
extern "C" __global__ void adamw_planned_split_f32(__nv_bfloat16* __restrict__ master,
                                                   const float* __restrict__ grad,
                                                   float* __restrict__ m, float* __restrict__ v,
                                                   __nv_bfloat16* __restrict__ w, long long n,
                                                   float lr, float beta1, float beta2, float eps,
                                                   float wd, float bc1, float bc2,
                                                   const float* __restrict__ plan) {
  if (n <= 0 || plan[1] != 0.0f) return;
  adamw_all<true>(master, grad, m, v, w, n, adam_hyper(lr, beta1, beta2, eps, wd, bc1, bc2, plan[0]));
}
