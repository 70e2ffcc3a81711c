//! The fused lm_head loss (kernels/cross_entropy.cu): dlogits written in place, the weighted
//! loss and the argmax, against the CPU, for every kernel the vocabulary selects (the cluster
//! kernel, the wide cluster kernel, the streaming kernel); run twice, bit-identical.

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::Backend;
use dflash_engine::tensor::DType;

use super::{bits_equal, get, gpu, ids, put, rand, rel_err, BF16_TOL};

trait CeTest {
    fn ce(&self, logits: &[f32], labels: &[i32], w: &[f32], rows: usize, vocab: usize) -> [Vec<f32>; 3];
}

impl<B: Backend> CeTest for B {
    fn ce(&self, logits: &[f32], labels: &[i32], w: &[f32], rows: usize, vocab: usize) -> [Vec<f32>; 3] {
        let s = self.compute_stream();
        let mut lg = put(self, logits, DType::BF16);
        let mut loss = self.alloc(&s, DType::F32, rows + 2).unwrap();
        let mut am = self.alloc_ids(&s, rows + 2).unwrap();
        self.cross_entropy(
            &s,
            &mut lg,
            &ids(self, labels),
            &put(self, w, DType::F32),
            1,
            rows,
            vocab,
            0.37,
            &mut loss,
            2,
            &mut am,
            2,
        )
        .unwrap();
        [get(self, &lg), get(self, &loss), self.download_ids(&s, &am).unwrap().iter().map(|&x| x as f32).collect()]
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_cross_entropy_matches_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    // 151,936 (Qwen3), 40,000 and 163,840 take the cluster kernel (8 CTAs per row, 5 chunks of 8
    // per thread: 163,840 fills every chunk); 163,848 (one chunk over), 256,000 and 262,144
    // (Gemma's; fills every chunk) the wide cluster kernel (8 chunks per thread, one CTA per SM);
    // 327,680, 327,688 and the vocabularies under 32,768 the streaming kernel. 260 and 70 rows
    // give every cluster several rows: each stage of its ring and each message buffer is reused.
    let shapes = [
        (5, 256),
        (33, 151_936),
        (260, 151_936),
        (3, 1000),
        (9, 40_000),
        (4, 163_840),
        (3, 163_848),
        (5, 256_000),
        (70, 262_144),
        (4, 327_680),
        (4, 327_688),
    ];
    for (rows, vocab) in shapes {
        // Row 2 is unlabelled (-1) and row 3 weightless (when the shape has it): the label and
        // weight lists below hold rows + 1 entries, so a shape needs at least 3 rows.
        assert!(rows >= 3, "{rows} rows: the shape needs at least 3");
        println!("cross-entropy {rows}x{vocab}: {}", g.cross_entropy_kernel(vocab).0);
        let logits = rand(rows * vocab, 90, 3.0);
        let mut labels: Vec<i32> = (0..rows as i32 + 1).map(|i| (i * 7919) % vocab as i32).collect();
        labels[2] = -1;
        let mut w: Vec<f32> = (0..rows + 1).map(|i| 1.0 / (1.0 + i as f32)).collect();
        w[3] = 0.0;
        let (a, b) = (g.ce(&logits, &labels, &w, rows, vocab), c.ce(&logits, &labels, &w, rows, vocab));
        rel_err(&format!("cross-entropy dlogits {rows}x{vocab}"), &a[0], &b[0], BF16_TOL);
        // The GPU sums exp online in f32 in a tree, the CPU left to right: ~1e-5 at 150k.
        rel_err(&format!("cross-entropy loss {rows}x{vocab}"), &a[1], &b[1], 1e-4);
        bits_equal(&format!("cross-entropy argmax {rows}x{vocab}"), &a[2], &b[2]);
        let again = g.ce(&logits, &labels, &w, rows, vocab);
        for (i, what) in ["dlogits", "loss", "argmax"].iter().enumerate() {
            bits_equal(&format!("cross-entropy {what} {rows}x{vocab}, run twice"), &again[i], &a[i]);
        }
    }
}

/// Greedy decoding's pick (kernels/reduce.cu argmax_rows_*): the first maximum of each row's
/// first `cols` entries, f32 and bf16, equal to the CPU's on rows with planted ties (the lower
/// index must win), a maximum past `cols` (must be ignored) and a vocabulary-sized row.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_argmax_rows_matches_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    for (rows, stride, cols) in [(1, 151_936, 151_936), (64, 151_936, 151_665), (7, 1000, 1000), (3, 300, 257)] {
        let mut x = rand(rows * stride, 11 + rows as u64, 1.0);
        for r in 0..rows {
            let row = &mut x[r * stride..(r + 1) * stride];
            // A tie at the top (two equal maxima, the later one must lose), on most rows, and a
            // larger value past cols on every row.
            if r % 3 != 2 {
                let (a, b) = ((r * 37) % cols, (r * 37 + cols / 2 + 1) % cols);
                row[a] = 9.0;
                row[b] = 9.0;
            }
            if cols < stride {
                row[cols] = 50.0;
            }
        }
        for dt in [DType::F32, DType::BF16] {
            let (gv, cv) = (g.argmax(&x, dt, stride, rows, cols), c.argmax(&x, dt, stride, rows, cols));
            assert_eq!(gv, cv, "{rows} x {stride} (cols {cols}) {dt:?}");
            for (r, &i) in cv.iter().enumerate() {
                assert!((i as usize) < cols, "row {r}: index {i} past cols {cols}");
                if r % 3 != 2 {
                    let (a, b) = ((r * 37) % cols, (r * 37 + cols / 2 + 1) % cols);
                    assert_eq!(i as usize, a.min(b), "row {r}: the first of the tied maxima");
                }
            }
        }
    }
}

trait ArgmaxTest {
    fn argmax(&self, x: &[f32], dt: DType, stride: usize, rows: usize, cols: usize) -> Vec<i32>;
}

impl<B: Backend> ArgmaxTest for B {
    fn argmax(&self, x: &[f32], dt: DType, stride: usize, rows: usize, cols: usize) -> Vec<i32> {
        let s = self.compute_stream();
        let mut out = self.alloc_ids(&s, rows).unwrap();
        self.argmax_rows(&s, &put(self, x, dt), stride, rows, cols, &mut out).unwrap();
        self.download_ids(&s, &out).unwrap()
    }
}
