//! GPU tests: every CUDA kernel against the CPU reference on random inputs, training on CUDA
//! against the CPU, determinism, and the Hugging Face / PyTorch oracles. All `#[ignore]`d here;
//! the GPU machine runs them with `--include-ignored` (scripts/gpu-bundle.sh). Each fails when its
//! GPU result is wrong, and fails (never passes) when no GPU is present.
//!
//! One module per kernel family (kernels/*.cu), then the whole-model checks. Every test name
//! starts with `gpu_`; `gpu::MODULE::` selects a family (scripts/sanitize.sh does).
//!
//! - `gemm`: cuBLASLt's GEMM (linear, dX, dW, the residual forms) and the FC projection (kernels/fc.cu)
//! - `norm`: RMSNorm forward and backward (kernels/rmsnorm.cu)
//! - `elementwise`: RoPE and the fused q/k norm + RoPE (rope.cu), SwiGLU (swiglu.cu)
//! - `pack`: tap packing with noise (pack.cu) and the embedding gather (elementwise.cu)
//! - `attention`: target causal attention and drafter attention forward/backward (attention.cu)
//! - `hybrid`: the Qwen3.5/3.6 ops (hybrid.cu), the gated delta rule (gdn.cu), causal attention
//!   at head_dim 256, and the qwen3.5-tiny target's taps on CUDA against the CPU
//! - `hybrid_fused`: the hybrid forward's fused passes (hybrid.cu) against the unfused CPU ops
//! - `cross_entropy`: fused lm_head loss, dlogits and argmax (cross_entropy.cu)
//! - `optimizer`: AdamW (adamw.cu), sum of squares (reduce.cu), the non-finite count (elementwise.cu)
//! - `training`: 50 steps on CUDA against the CPU backend, and run-to-run bit-identity (also with
//!   the qwen3.5-tiny hybrid target)
//! - `eval`: speculative decoding on CUDA: lossless against greedy through the same verification
//!   forward; divergence from one-token decoding reported with its top-2 logit gap
//! - `oracles`: target taps against Hugging Face, the drafter against PyTorch autograd
//! - `regenerate`: `prepare-data --regenerate`'s batched decoding == batch-1 greedy decoding on CUDA

mod attention;
mod cross_entropy;
mod elementwise;
mod eval;
mod gemm;
mod hybrid;
mod hybrid_fused;
mod norm;
mod optimizer;
mod oracles;
mod pack;
mod regenerate;
mod training;

use dflash_engine::backend::cuda::{alloc::Mode, CudaBackend};
use dflash_engine::backend::Backend;
use dflash_engine::rng::Philox;
use dflash_engine::tensor::DType;

fn gpu() -> CudaBackend {
    CudaBackend::new(0, Mode::Normal).unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"))
}

fn rand(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut r = Philox::new(seed, [91, 91]);
    (0..n).map(|_| (std as f64 * r.normal()) as f32).collect()
}

fn put<B: Backend>(be: &B, v: &[f32], dt: DType) -> B::Buf {
    let s = be.compute_stream();
    let mut b = be.alloc(&s, dt, v.len()).unwrap();
    be.upload(&s, v, &mut b, 0).unwrap();
    b
}

fn ids<B: Backend>(be: &B, v: &[i32]) -> B::Ids {
    let s = be.compute_stream();
    let mut b = be.alloc_ids(&s, v.len()).unwrap();
    be.upload_ids(&s, v, &mut b).unwrap();
    b
}

/// The seq_starts of a packed batch of sequences of these lengths: 0, then each end.
fn starts_of(lens: &[usize]) -> Vec<i32> {
    let mut s = vec![0i32];
    for &l in lens {
        s.push(s.last().unwrap() + l as i32);
    }
    s
}

/// Each packed row's position in its own sequence.
fn positions(lens: &[usize]) -> Vec<i32> {
    lens.iter().flat_map(|&l| 0..l as i32).collect()
}

fn get<B: Backend>(be: &B, b: &B::Buf) -> Vec<f32> {
    be.download(&be.compute_stream(), b).unwrap()
}

/// max |a - b| / max |b|: one number per comparison, printed, so the closing note can quote it.
fn rel_err(what: &str, gpu: &[f32], cpu: &[f32], tol: f32) -> f32 {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    let scale = cpu.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    let err =
        gpu.iter()
            .zip(cpu)
            .fold(0f32, |m, (a, b)| if a.is_nan() || b.is_nan() { f32::INFINITY } else { m.max((a - b).abs()) });
    let rel = err / scale;
    println!("{what:<48} max rel err {rel:.3e} (tol {tol:.1e})");
    assert!(rel <= tol, "{what}: max |gpu - cpu| / max |cpu| = {rel:e} > {tol:e}");
    rel
}

fn bits_equal(what: &str, gpu: &[f32], cpu: &[f32]) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    let diff = gpu.iter().zip(cpu).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    println!("{what:<48} bit-identical: {}", diff == 0);
    assert_eq!(diff, 0, "{what}: {diff} elements differ");
}

// A bf16 result computed in f32 and rounded once differs from the CPU's only through summation
// order: about one bf16 ulp (2^-8 relative) of the largest value; 1e-2 leaves room for two.
const BF16_TOL: f32 = 1e-2;
