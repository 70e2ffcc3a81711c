//! The elementwise kernels: RoPE forward and inverse (kernels/rope.cu), the fused q/k norm + RoPE,
//! and SwiGLU forward and backward (kernels/swiglu.cu), against the CPU.

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::{Backend, QkRstd};
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
/// exact zeros in the gate (the division's slow path). The backward's recomputed activation (over
/// its dact) equals the forward's output bit for bit on each backend.
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
        for (name, r) in [("gpu", &a), ("cpu", &b)] {
            let same = r[0].iter().zip(&r[2]).filter(|(x, y)| x.to_bits() == y.to_bits()).count();
            assert_eq!(same, rows * inter, "{name} {rows}x{inter}: swiglu_bwd's act differs from swiglu_fwd's out");
        }
    }
}

/// Object-safe wrappers so one closure drives both backends.
trait SwiTest {
    /// [swiglu_fwd's out, swiglu_bwd's dgu, swiglu_bwd's act (over its dact)].
    fn run(&self, gu: &[f32], d: &[f32], rows: usize, inter: usize) -> [Vec<f32>; 3];
}

impl<B: Backend> SwiTest for B {
    fn run(&self, gu: &[f32], d: &[f32], rows: usize, inter: usize) -> [Vec<f32>; 3] {
        let s = self.compute_stream();
        let gub = put(self, gu, DType::BF16);
        let mut out = self.alloc(&s, DType::BF16, rows * inter).unwrap();
        self.swiglu_fwd(&s, &gub, &mut out, rows, inter).unwrap();
        let (mut dgu, mut dact) = (gub, put(self, d, DType::BF16));
        self.swiglu_bwd(&s, &mut dact, &mut dgu, rows, inter).unwrap();
        [get(self, &out), get(self, &dgu), get(self, &dact)]
    }
}

/// The fused q/k norm + RoPE (kernels/rope.cu qk_norm_rope_bf16_hd*) against the CPU's, which is
/// rmsnorm_fwd then rope: q and k read with the fused projection's row stride, k written with a
/// KV cache's stride and offset; every head dim a preset uses. The CPU op itself is checked
/// against the two separate ops here too (bit for bit: the same arithmetic).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_qk_norm_rope_matches_cpu() {
    use dflash_engine::backend::{QkNormRope, Rows};
    let (g, c) = (gpu(), CpuBackend::new());
    // The last two: keys only (no query heads), as the drafter's context keys and decoding's
    // cache append call it.
    for (rows, heads, kvh, hd) in [
        (1, 32, 8, 128),
        (64, 32, 8, 128),
        (37, 4, 2, 16),
        (9, 8, 4, 32),
        (5, 8, 2, 64),
        (3, 24, 4, 256),
        (64, 0, 8, 128),
        (37, 0, 2, 16),
    ] {
        let (qw, kw) = (heads * hd, kvh * hd);
        let stride = qw + 2 * kw;
        let (cache_stride, cache_off) = (7 * kw, 2 * kw);
        let qkv = rand(rows * stride, 40 + hd as u64, 3.0);
        let w = rand(2 * hd + 8, 41, 1.0);
        let pos: Vec<i32> = (0..rows as i32).map(|i| i * 977 + 3).collect();
        let sh = QkNormRope {
            rows,
            heads,
            kv_heads: kvh,
            head_dim: hd,
            eps: 1e-6,
            theta: 1e6,
            q_in: Rows { off: 0, stride },
            k_in: Rows { off: qw, stride },
            q_out: Rows { off: 0, stride: qw },
            k_out: Rows { off: cache_off, stride: cache_stride },
            wq_off: 0,
            wk_off: hd + 8,
        };
        let run = |be: &dyn QkTest, keep| be.qk(&sh, &qkv, &w, &pos, rows * cache_stride + cache_off, keep);
        let ((gq, gk, _), (cq, ck, _)) = (run(&g, false), run(&c, false));
        let what = format!("qk_norm_rope {rows} rows {heads}/{kvh} heads hd {hd}");
        rel_err(&format!("{what}: q"), &gq, &cq, BF16_TOL);
        rel_err(&format!("{what}: k (cache rows)"), &gk, &ck, BF16_TOL);
        // Keeping the rstd (as the drafter's training does) changes no output bit, and the rstd
        // is the CPU's up to the order of the sum of squares.
        let ((gq2, gk2, gr), (cq2, ck2, cr)) = (run(&g, true), run(&c, true));
        bits_equal(&format!("{what}: q with rstd kept"), &gq2, &gq);
        bits_equal(&format!("{what}: k with rstd kept"), &gk2, &gk);
        bits_equal(&format!("{what}: cpu q with rstd kept"), &cq2, &cq);
        bits_equal(&format!("{what}: cpu k with rstd kept"), &ck2, &ck);
        let ([gqr, gkr], [cqr, ckr]) = (gr.expect("kept"), cr.expect("kept"));
        rel_err(&format!("{what}: q rstd"), &gqr, &cqr, 1e-6);
        rel_err(&format!("{what}: k rstd"), &gkr, &ckr, 1e-6);
        // Cache rows outside the written ones stay untouched (zero).
        for r in 0..rows {
            let gap = &gk[cache_off + r * cache_stride + kw..][..cache_stride - kw];
            assert!(gap.iter().all(|&x| x == 0.0), "{what}: wrote outside row {r}'s keys");
        }
        if heads == 0 {
            continue;
        }
        // The CPU op is rmsnorm_fwd then rope, bit for bit.
        let s = c.compute_stream();
        let mut q_sep = Vec::new();
        for r in 0..rows {
            q_sep.extend_from_slice(&qkv[r * stride..][..qw]);
        }
        let qin = put(&c, &q_sep, DType::BF16);
        let mut y = c.alloc(&s, DType::BF16, rows * qw).unwrap();
        let mut rstd = c.alloc(&s, DType::F32, rows * heads).unwrap();
        c.rmsnorm_fwd(&s, &qin, &put(&c, &w, DType::BF16), 0, &mut y, &mut rstd, rows * heads, hd, 1e-6).unwrap();
        c.rope(&s, &mut y, &ids(&c, &pos), rows, heads, hd, 1e6, false).unwrap();
        bits_equal(&format!("{what}: cpu fused == rmsnorm_fwd + rope"), &cq, &get(&c, &y));
        bits_equal(&format!("{what}: cpu fused rstd == rmsnorm_fwd's"), &cqr, &get(&c, &rstd));
    }
}

trait QkTest {
    fn qk(
        &self,
        sh: &dflash_engine::backend::QkNormRope,
        qkv: &[f32],
        w: &[f32],
        pos: &[i32],
        k_len: usize,
        keep_rstd: bool,
    ) -> QkOut;
}

/// q, k and (when kept) their rstd.
type QkOut = (Vec<f32>, Vec<f32>, Option<[Vec<f32>; 2]>);

impl<B: Backend> QkTest for B {
    fn qk(
        &self,
        sh: &dflash_engine::backend::QkNormRope,
        qkv: &[f32],
        w: &[f32],
        pos: &[i32],
        k_len: usize,
        keep_rstd: bool,
    ) -> QkOut {
        let s = self.compute_stream();
        let qkv = put(self, qkv, DType::BF16);
        // (At least one element: a keys-only call has no query output, but takes a buffer.)
        let mut q = self.alloc(&s, DType::BF16, (sh.rows * sh.heads * sh.head_dim).max(1)).unwrap();
        let mut k = self.alloc(&s, DType::BF16, k_len).unwrap();
        let mut qr = self.alloc(&s, DType::F32, (sh.rows * sh.heads).max(1)).unwrap();
        let mut kr = self.alloc(&s, DType::F32, sh.rows * sh.kv_heads).unwrap();
        let rstd = keep_rstd.then_some(QkRstd { q: Some(&mut qr), k: Some(&mut kr) });
        let w = put(self, w, DType::BF16);
        self.qk_norm_rope(&s, sh, &qkv, &qkv, &w, &mut q, &mut k, &ids(self, pos), rstd).unwrap();
        (get(self, &q), get(self, &k), keep_rstd.then(|| [get(self, &qr), get(self, &kr)]))
    }
}

/// A preset's random init drawn on the device (kernels/init.cu via `fill_init`) equals the host's
/// `init_value_bf16` bit for bit: every role, offsets into a larger buffer, a tensor's later
/// elements (`first`), and a 40M-element draw large enough that elements whose rounding the two
/// libms could decide differently (about one in 2.8 million) come up and are redone on the host.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_fill_init_matches_the_host_draw() {
    use dflash_engine::weights::{init_value_bf16, InitDraw, TensorRole};
    let g = gpu();
    let s = g.compute_stream();
    let roles = [
        (TensorRole::Linear, 1_000_003usize),
        (TensorRole::Embedding, 40_000_000),
        (TensorRole::Scaled { gain: 4 }, 65_537),
        (TensorRole::Conv { kernel: 4 }, 4_099),
        (TensorRole::NormOffset, 5_120),
        (TensorRole::ALog, 48),
        (TensorRole::Norm, 17),
        (TensorRole::DtBias, 1),
    ];
    for (t, &(role, n)) in roles.iter().enumerate() {
        for (off, first) in [(0usize, 0u64), (3, 7_000_000_011)] {
            let draw = InitDraw { role, seed: 0x5EED_0000_0001 + t as u64, stream: 40 + t as u32, std: 0.02, first };
            let mut b = g.alloc(&s, DType::BF16, off + n + 5).unwrap();
            g.fill(&s, &mut b, -7.0).unwrap();
            g.fill_init(&s, &mut b, off, n, &draw).unwrap();
            let got = get(&g, &b);
            let want: Vec<f32> = (0..n)
                .map(|i| init_value_bf16(role, draw.seed, draw.stream, first + i as u64, 0.02).to_f32())
                .collect();
            bits_equal(&format!("fill_init {role:?}, n {n}, off {off}, first {first}"), &got[off..off + n], &want);
            assert!(got[..off].iter().chain(&got[off + n..]).all(|&v| v == -7.0), "{role:?}: wrote outside its range");
        }
    }
}
