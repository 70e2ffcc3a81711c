// adamw.cu: one AdamW step on the f32 master weights, refreshing the bf16 copy the model reads.
//
// Math (per element; cpu.rs `adamw`, each operation one IEEE f32 rounding, left to right):
//   g  = grad * grad_scale
//   m  = b1 * m + (1 - b1) * g
//   v  = b2 * v + ((1 - b2) * g) * g
//   upd = (m / bc1) / (sqrtf(v / bc2) + eps) + wd * p
//   p  = p - lr * upd;   w = bf16(p)
//   Every step is written with __fmul_rn / __fadd_rn / __fsub_rn / __fdiv_rn / __fsqrt_rn, so
//   nvcc cannot contract anything into an FMA: the result equals the CPU's f32 result bit for bit
//   (masters, moments and bf16 weights), denormals included (no FTZ without fast-math).
// Layouts:  master, grad, m, v: [n] f32; w: [n] bf16. bc1 = 1 - beta1^t, bc2 = 1 - beta2^t are
//           computed by the host in f64 and rounded to f32 (as cpu.rs does).
// adamw_planned_f32: the same update with grad_scale and the skip flag read from the device
//           update plan (reduce.cu update_plan_f32), so the host does not wait for the norm.
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

// One element: updates p, m, v in place and returns p (the caller rounds it to bf16).
__device__ __forceinline__ void adamw_element(float& p, float grad, float& m, float& v,
                                              const AdamHyper& h) {
  const float g = __fmul_rn(grad, h.grad_scale);
  m = __fadd_rn(__fmul_rn(h.beta1, m), __fmul_rn(h.one_minus_beta1, g));
  v = __fadd_rn(__fmul_rn(h.beta2, v), __fmul_rn(__fmul_rn(h.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, h.bc2)), h.eps);
  const float upd = __fadd_rn(__fdiv_rn(__fdiv_rn(m, h.bc1), denom), __fmul_rn(h.wd, p));
  p = __fsub_rn(p, __fmul_rn(h.lr, upd));
}

// The whole update over the grid with the hyper-parameters in `h`.
__device__ __forceinline__ void adamw_all(float* __restrict__ master,
                                          const float* __restrict__ grad, float* __restrict__ m,
                                          float* __restrict__ v, __nv_bfloat16* __restrict__ w,
                                          long long n, const AdamHyper& h) {
  const index_t first = grid_thread_index();
  const index_t stride = grid_thread_count();
  index_t done = 0;
  if (is_vec_aligned(master) && is_vec_aligned(grad) && is_vec_aligned(m) && is_vec_aligned(v) &&
      (reinterpret_cast<uintptr_t>(w) % 8) == 0) {
    const index_t nv = n / 4;
    float4* p4 = reinterpret_cast<float4*>(master);
    const float4* g4 = reinterpret_cast<const float4*>(grad);
    float4* m4 = reinterpret_cast<float4*>(m);
    float4* v4 = reinterpret_cast<float4*>(v);
    uint2* w2 = reinterpret_cast<uint2*>(w);
    for (index_t i = first; i < nv; i += stride) {
      float4 p = p4[i], mm = m4[i], vv = v4[i];
      const float4 g = g4[i];
      adamw_element(p.x, g.x, mm.x, vv.x, h);
      adamw_element(p.y, g.y, mm.y, vv.y, h);
      adamw_element(p.z, g.z, mm.z, vv.z, h);
      adamw_element(p.w, g.w, mm.w, vv.w, h);
      p4[i] = p;
      m4[i] = mm;
      v4[i] = vv;
      w2[i] = make_uint2(pack_bf16x2_rne(p.x, p.y), pack_bf16x2_rne(p.z, p.w));
    }
    done = nv * 4;
  }
  for (index_t i = done + first; i < n; i += stride) {
    float p = master[i], mm = m[i], vv = v[i];
    adamw_element(p, grad[i], mm, vv, h);
    master[i] = p;
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
  adamw_all(master, grad, m, v, w, n, adam_hyper(lr, beta1, beta2, eps, wd, bc1, bc2, grad_scale));
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
  adamw_all(master, grad, m, v, w, n, adam_hyper(lr, beta1, beta2, eps, wd, bc1, bc2, plan[0]));
}
