// swiglu.cuh: SwiGLU's forward on one (gate, up) pair, the one formula swiglu.cu's pass and
// mlp.cu's fused epilogue both run, so the two give the same bits from the same bf16 inputs:
// silu(g) * u with silu(g) = g / (1 + expf(-g)), every operation one IEEE rounding in cpu.rs's
// left-to-right order (__fdiv_rn, __fadd_rn, __fmul_rn: never an FMA); only expf differs from
// the CPU's libm (CUDA: <= 2 ulp).
#pragma once

__device__ __forceinline__ float swiglu_fwd_f32(float g, float u) {
  const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
  return __fmul_rn(silu, u);
}
