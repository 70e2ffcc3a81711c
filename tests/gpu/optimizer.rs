//! The optimizer step and the gradient checks: AdamW (kernels/adamw.cu) bit-identical to the
//! CPU; the sum of squares (kernels/reduce.cu) and the non-finite count (kernels/elementwise.cu)
//! against the CPU and run to run.

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::{AdamStep, Backend};
use dflash_engine::tensor::DType;

use super::{bits_equal, get, gpu, put, rand};

trait OptTest {
    fn adam(&self, p: &[f32], gr: &[f32], m: &[f32], v: &[f32]) -> [Vec<f32>; 4];
    fn sumsq(&self, x: &[f32]) -> f32;
    fn nonfinite(&self, x: &[f32], dt: DType) -> u64;
}

impl<B: Backend> OptTest for B {
    fn adam(&self, p: &[f32], gr: &[f32], m: &[f32], v: &[f32]) -> [Vec<f32>; 4] {
        let s = self.compute_stream();
        let (mut pb, gb, mut mb, mut vb) =
            (put(self, p, DType::F32), put(self, gr, DType::F32), put(self, m, DType::F32), put(self, v, DType::F32));
        let mut w = self.alloc(&s, DType::BF16, p.len()).unwrap();
        let hp = AdamStep { lr: 6e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, t: 7, grad_scale: 0.5 };
        self.adamw(&s, &mut pb, &gb, &mut mb, &mut vb, &mut w, &hp).unwrap();
        [get(self, &pb), get(self, &mb), get(self, &vb), get(self, &w)]
    }
    fn sumsq(&self, x: &[f32]) -> f32 {
        let s = self.compute_stream();
        let mut out = self.alloc(&s, DType::F32, 1).unwrap();
        self.sum_squares(&s, &put(self, x, DType::F32), &mut out).unwrap();
        get(self, &out)[0]
    }
    fn nonfinite(&self, x: &[f32], dt: DType) -> u64 {
        self.count_nonfinite(&self.compute_stream(), &put(self, x, dt)).unwrap()
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_adamw_is_bit_identical() {
    let (g, c) = (gpu(), CpuBackend::new());
    let n = 10_001;
    let (p, gr, m) = (rand(n, 1, 1.0), rand(n, 2, 1.0), rand(n, 3, 0.1));
    let v: Vec<f32> = rand(n, 4, 0.1).iter().map(|x| x * x).collect();
    let (a, b) = (g.adam(&p, &gr, &m, &v), c.adam(&p, &gr, &m, &v));
    for (i, name) in ["master", "m", "v", "bf16 weights"].iter().enumerate() {
        bits_equal(&format!("adamw {name}"), &a[i], &b[i]);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_reductions_match_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    let x = rand(3_000_001, 5, 1.0);
    let (sg, sc) = (g.sumsq(&x), c.sumsq(&x));
    println!("sum of squares gpu {sg} cpu {sc}");
    assert!(((sg - sc) / sc).abs() < 1e-5);
    assert_eq!(g.sumsq(&x).to_bits(), sg.to_bits(), "sum of squares must be run-to-run identical");
    let mut bad = rand(1000, 6, 1.0);
    bad[3] = f32::NAN;
    bad[999] = f32::INFINITY;
    bad[500] = f32::NEG_INFINITY;
    assert_eq!(g.nonfinite(&bad, DType::F32), 3);
    assert_eq!(g.nonfinite(&bad, DType::BF16), 3);
}
