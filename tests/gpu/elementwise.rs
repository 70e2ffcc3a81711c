//! The elementwise kernels: RoPE forward and inverse (kernels/rope.cu), SwiGLU forward and
//! backward (kernels/swiglu.cu) and the residual add (kernels/elementwise.cu), against the CPU.

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::Backend;
use dflash_engine::tensor::DType;

use super::{bits_equal, get, gpu, ids, put, rand, rel_err, BF16_TOL};

/// RoPE forward and inverse, positions up to 40k.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_rope_matches_cpu() {
    let g = gpu();
    let c = CpuBackend::new();
    let (rows, heads, hd) = (50, 3, 128);
    let x = rand(rows * heads * hd, 20, 1.0);
    let pos: Vec<i32> = (0..rows as i32).map(|i| i * 811).collect();
    for inverse in [false, true] {
        let run = |be: &dyn Fn(&[f32]) -> Vec<f32>| be(&x);
        let on_gpu = run(&|x| {
            let mut b = put(&g, x, DType::BF16);
            g.rope(&g.compute_stream(), &mut b, &ids(&g, &pos), rows, heads, hd, 1e6, inverse).unwrap();
            get(&g, &b)
        });
        let on_cpu = run(&|x| {
            let mut b = put(&c, x, DType::BF16);
            c.rope(&c.compute_stream(), &mut b, &ids(&c, &pos), rows, heads, hd, 1e6, inverse).unwrap();
            get(&c, &b)
        });
        rel_err(&format!("rope inverse={inverse}"), &on_gpu, &on_cpu, BF16_TOL);
    }
}

/// SwiGLU forward/backward: a ragged width (scalar path), widths % 8 == 0 (8-wide path), and
/// exact zeros in the gate (the division's slow path).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_swiglu_matches_cpu() {
    let g = gpu();
    let c = CpuBackend::new();
    for (rows, inter, zeros) in [(33, 77, false), (64, 1024, false), (17, 3072, true), (5, 8, false)] {
        let mut gu = rand(rows * 2 * inter, 30, 2.0);
        if zeros {
            for row in gu.chunks_mut(2 * inter) {
                row[..inter].iter_mut().step_by(3).for_each(|v| *v = 0.0);
            }
        }
        let d = rand(rows * inter, 31, 1.0);
        let sw = |be: &dyn SwiTest| be.run(&gu, &d, rows, inter);
        let (a, b) = (sw(&g), sw(&c));
        rel_err(&format!("swiglu fwd {rows}x{inter}"), &a[0], &b[0], BF16_TOL);
        rel_err(&format!("swiglu bwd {rows}x{inter}"), &a[1], &b[1], BF16_TOL);
    }
}

/// Residual add: one rounding of an exact f32 sum: bit-identical.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_add_is_bit_identical() {
    let g = gpu();
    let c = CpuBackend::new();
    let (x, y) = (rand(1001, 40, 1.0), rand(1001, 41, 1.0));
    let add = |be: &dyn SwiTest| be.add(&x, &y);
    bits_equal("add_inplace", &add(&g), &add(&c));
}

/// Object-safe wrappers so one closure drives both backends.
trait SwiTest {
    fn run(&self, gu: &[f32], d: &[f32], rows: usize, inter: usize) -> [Vec<f32>; 2];
    fn add(&self, x: &[f32], y: &[f32]) -> Vec<f32>;
}

impl<B: Backend> SwiTest for B {
    fn run(&self, gu: &[f32], d: &[f32], rows: usize, inter: usize) -> [Vec<f32>; 2] {
        let s = self.compute_stream();
        let gub = put(self, gu, DType::BF16);
        let mut out = self.alloc(&s, DType::BF16, rows * inter).unwrap();
        self.swiglu_fwd(&s, &gub, &mut out, rows, inter).unwrap();
        let mut dgu = self.alloc(&s, DType::BF16, rows * 2 * inter).unwrap();
        self.swiglu_bwd(&s, &put(self, d, DType::BF16), &gub, &mut dgu, rows, inter).unwrap();
        [get(self, &out), get(self, &dgu)]
    }
    fn add(&self, x: &[f32], y: &[f32]) -> Vec<f32> {
        let s = self.compute_stream();
        let mut xb = put(self, x, DType::BF16);
        self.add_inplace(&s, &mut xb, &put(self, y, DType::BF16)).unwrap();
        get(self, &xb)
    }
}
