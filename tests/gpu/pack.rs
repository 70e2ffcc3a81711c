//! Tap packing with noise (kernels/pack.cu) and the embedding gather (embed_bf16 in
//! kernels/elementwise.cu): copies plus counter-based noise, so bit-identical to the CPU.

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::Backend;
use dflash_engine::tensor::DType;

use super::{bits_equal, get, gpu, ids, put, rand};

trait PackTest {
    fn pack(&self, taps: &[Vec<f32>], rows: usize, hidden: usize, n_valid: usize, std: f32) -> Vec<f32>;
    fn embed_rows(&self, table: &[f32], ids: &[i32], dim: usize) -> Vec<f32>;
}

impl<B: Backend> PackTest for B {
    fn pack(&self, taps: &[Vec<f32>], rows: usize, hidden: usize, n_valid: usize, std: f32) -> Vec<f32> {
        let s = self.compute_stream();
        let bufs: Vec<B::Buf> = taps.iter().map(|t| put(self, t, DType::BF16)).collect();
        let refs: Vec<&B::Buf> = bufs.iter().collect();
        let mut out = self.alloc(&s, DType::BF16, rows * taps.len() * hidden).unwrap();
        self.pack_taps(&s, &refs, &mut out, rows, hidden, n_valid, std, 1234, 77).unwrap();
        get(self, &out)
    }
    fn embed_rows(&self, table: &[f32], id: &[i32], dim: usize) -> Vec<f32> {
        let s = self.compute_stream();
        let mut out = self.alloc(&s, DType::BF16, id.len() * dim).unwrap();
        self.embed(&s, &put(self, table, DType::BF16), 0, &ids(self, id), &mut out, id.len(), dim).unwrap();
        get(self, &out)
    }
}

/// Pack and noise are copies plus counter-based noise: bit-identical to the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_pack_noise_is_bit_identical() {
    let (g, c) = (gpu(), CpuBackend::new());
    // Includes padding rows (n_valid < rows) at widths % 8 == 0 (the 16-byte path).
    let cases =
        [(1, 8, 1, 1), (37, 100, 3, 30), (256, 4096, 5, 256), (9, 13, 2, 9), (300, 4096, 5, 200), (64, 1032, 3, 50)];
    for (rows, hidden, k, n_valid) in cases {
        let taps: Vec<Vec<f32>> = (0..k).map(|i| rand(rows * hidden, 50 + i as u64, 3.0)).collect();
        for std in [0.0, 0.05] {
            bits_equal(
                &format!("pack {rows}x{hidden}x{k} valid {n_valid} noise {std}"),
                &g.pack(&taps, rows, hidden, n_valid, std),
                &c.pack(&taps, rows, hidden, n_valid, std),
            );
        }
    }
}

/// The embedding is a gather: bit-identical to the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_embed_is_bit_identical() {
    let (g, c) = (gpu(), CpuBackend::new());
    let table = rand(300 * 72, 60, 1.0);
    let id: Vec<i32> = (0..97).map(|i| (i * 37) % 300).collect();
    bits_equal("embed", &g.embed_rows(&table, &id, 72), &c.embed_rows(&table, &id, 72));
}
