//! GPU tests: every CUDA kernel against the CPU reference on random inputs, training on CUDA
//! against the CPU, determinism, and the Hugging Face / PyTorch oracles. All `#[ignore]`d here;
//! the GPU machine runs them with `--include-ignored` (scripts/gpu-bundle.sh). Each fails when its
//! GPU result is wrong, and fails (never passes) when no GPU is present.

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::cuda::{alloc::Mode, CudaBackend};
use dflash_engine::backend::{AdamStep, Backend, DraftAttnShape, Gemm};
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

fn gemm_case<B: Backend>(be: &B, g: &Gemm, a: &[f32], b: &[f32], c0: &[f32], out: DType) -> Vec<f32> {
    let s = be.compute_stream();
    let (a, b) = (put(be, a, DType::BF16), put(be, b, DType::BF16));
    let mut c = put(be, c0, out);
    be.gemm(&s, g, &a, 0, &b, 0, &mut c, 0).unwrap();
    get(be, &c)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gemm_matches_cpu() {
    let g = gpu();
    let c = CpuBackend::new();
    for (m, n, k) in [(1, 1, 1), (7, 33, 65), (128, 256, 64), (300, 96, 520)] {
        let a = rand(m * k, 1, 1.0);
        let w = rand(n * k, 2, 1.0);
        let gl = Gemm::linear(m, n, k);
        rel_err(
            &format!("gemm linear {m}x{n}x{k}"),
            &gemm_case(&g, &gl, &a, &w, &vec![0.0; m * n], DType::BF16),
            &gemm_case(&c, &gl, &a, &w, &vec![0.0; m * n], DType::BF16),
            BF16_TOL,
        );
        let dy = rand(m * n, 3, 1.0);
        let gd = Gemm::linear_dx(m, n, k, true);
        let base = rand(m * k, 4, 1.0);
        rel_err(
            &format!("gemm dx (+=) {m}x{n}x{k}"),
            &gemm_case(&g, &gd, &dy, &w, &base, DType::BF16),
            &gemm_case(&c, &gd, &dy, &w, &base, DType::BF16),
            BF16_TOL,
        );
        let gw = Gemm::linear_dw(m, n, k);
        let acc = rand(n * k, 5, 1.0);
        // f32 output: only the accumulation order differs (f32 sums of bf16 products).
        rel_err(
            &format!("gemm dW (f32 +=) {m}x{n}x{k}"),
            &gemm_case(&g, &gw, &dy, &a, &acc, DType::F32),
            &gemm_case(&c, &gw, &dy, &a, &acc, DType::F32),
            1e-5,
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn rms_case<B: Backend>(
    be: &B,
    rows: usize,
    dim: usize,
    w_off: usize,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    dx0: &[f32],
) -> [Vec<f32>; 4] {
    let s = be.compute_stream();
    let (xb, wb, dyb) = (put(be, x, DType::BF16), put(be, w, DType::BF16), put(be, dy, DType::BF16));
    let mut y = be.alloc(&s, DType::BF16, rows * dim).unwrap();
    let mut r = be.alloc(&s, DType::F32, rows).unwrap();
    be.rmsnorm_fwd(&s, &xb, &wb, w_off, &mut y, &mut r, rows, dim, 1e-6).unwrap();
    let mut dx = put(be, dx0, DType::BF16);
    let mut dw = put(be, &vec![0.25; dim + 1], DType::F32);
    be.rmsnorm_bwd(&s, &dyb, &xb, &wb, w_off, &r, &mut dx, true, &mut dw, w_off, rows, dim).unwrap();
    [get(be, &y), get(be, &r), get(be, &dx), get(be, &dw)]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_norm_rope_swiglu_add_match_cpu() {
    let g = gpu();
    let c = CpuBackend::new();
    // w_off 1 misaligns the weight (scalar path); w_off 0 with dim % 8 == 0 takes the 16-byte
    // vector path at the model widths.
    let cases = [
        (1, 16, 1),
        (513, 16, 1),
        (37, 100, 1),
        (64, 4096, 1),
        (3, 5120, 1),
        (1, 16, 0),
        (300, 4096, 0),
        (77, 5120, 0),
        (129, 1032, 0),
        (37, 100, 0),
    ];
    for (rows, dim, w_off) in cases {
        let x = rand(rows * dim, 10, 2.0);
        let w: Vec<f32> = rand(dim + 1, 11, 0.2).iter().map(|v| 1.0 + v).collect();
        let dy = rand(rows * dim, 12, 1.0);
        let dx0 = rand(rows * dim, 13, 1.0);
        let a = rms_case(&g, rows, dim, w_off, &x, &w, &dy, &dx0);
        let b = rms_case(&c, rows, dim, w_off, &x, &w, &dy, &dx0);
        for (i, name) in ["y", "rstd", "dx (accumulated)", "dw"].iter().enumerate() {
            rel_err(
                &format!("rmsnorm {name} {rows}x{dim} w_off {w_off}"),
                &a[i],
                &b[i],
                if i == 1 || i == 3 { 1e-5 } else { BF16_TOL },
            );
        }
    }
    // RoPE forward and inverse, positions up to 40k.
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
    // SwiGLU forward/backward: a ragged width (scalar path), widths % 8 == 0 (8-wide path), and
    // exact zeros in the gate (the division's slow path).
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
    // Residual add: one rounding of an exact f32 sum: bit-identical.
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

/// Pack, noise and embedding are copies plus counter-based noise: bit-identical to the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_pack_noise_embed_are_bit_identical() {
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
    let table = rand(300 * 72, 60, 1.0);
    let id: Vec<i32> = (0..97).map(|i| (i * 37) % 300).collect();
    bits_equal("embed", &g.embed_rows(&table, &id, 72), &c.embed_rows(&table, &id, 72));
}

trait AttnTest {
    fn causal(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[i32],
        rows: usize,
        heads: usize,
        kvh: usize,
        hd: usize,
    ) -> Vec<f32>;
    fn draft(&self, sh: &DraftAttnShape, t: &[Vec<f32>; 6], anchors: &[i32], starts: &[i32]) -> Vec<Vec<f32>>;
}

impl<B: Backend> AttnTest for B {
    fn causal(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[i32],
        rows: usize,
        heads: usize,
        kvh: usize,
        hd: usize,
    ) -> Vec<f32> {
        let s = self.compute_stream();
        let mut o = self.alloc(&s, DType::BF16, rows * heads * hd).unwrap();
        self.attn_causal_fwd(
            &s,
            &put(self, q, DType::BF16),
            &put(self, k, DType::BF16),
            &put(self, v, DType::BF16),
            &mut o,
            &ids(self, starts),
            rows,
            heads,
            kvh,
            hd,
        )
        .unwrap();
        get(self, &o)
    }
    fn draft(&self, sh: &DraftAttnShape, t: &[Vec<f32>; 6], anchors: &[i32], starts: &[i32]) -> Vec<Vec<f32>> {
        let s = self.compute_stream();
        let b: Vec<B::Buf> = t.iter().map(|v| put(self, v, DType::BF16)).collect();
        let (a, st) = (ids(self, anchors), ids(self, starts));
        let qn = sh.q_rows() * sh.heads * sh.head_dim;
        let mut o = self.alloc(&s, DType::BF16, qn).unwrap();
        let mut lse = self.alloc(&s, DType::F32, sh.q_rows() * sh.heads).unwrap();
        self.attn_draft_fwd(&s, sh, &b[0], &b[1], &b[2], &b[3], &b[4], &a, &st, &mut o, &mut lse).unwrap();
        let kw = sh.kv_heads * sh.head_dim;
        let mut gr: Vec<B::Buf> = [qn, sh.ctx_rows * kw, sh.ctx_rows * kw, sh.q_rows() * kw, sh.q_rows() * kw]
            .iter()
            .map(|&n| self.alloc(&s, DType::BF16, n).unwrap())
            .collect();
        {
            let [g0, g1, g2, g3, g4] = &mut gr[..] else { unreachable!() };
            self.attn_draft_bwd(
                &s,
                sh,
                &b[0],
                &b[1],
                &b[2],
                &b[3],
                &b[4],
                &a,
                &st,
                &o,
                &lse,
                &b[5],
                [g0, g1, g2, g3, g4],
            )
            .unwrap();
        }
        let mut out = vec![get(self, &o), get(self, &lse)];
        out.extend(gr.iter().map(|x| get(self, x)));
        out
    }
}

// The attention kernels round P and dS to bf16 before their second product (as FlashAttention
// does), the CPU does not: a few bf16 ulps of the largest value. 1.5e-2 relative to the largest.
const ATTN_TOL: f32 = 1.5e-2;

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attention_matches_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    // Causal: ragged sequences (an empty one and a length-1 one), every head size.
    for hd in [16, 32, 64, 128] {
        let starts = vec![0, 1, 1, 130, 200];
        let (rows, heads, kvh) = (200, 4, 2);
        let q = rand(rows * heads * hd, 70, 1.0);
        let k = rand(rows * kvh * hd, 71, 1.0);
        let v = rand(rows * kvh * hd, 72, 1.0);
        rel_err(
            &format!("causal attention hd {hd}"),
            &g.causal(&q, &k, &v, &starts, rows, heads, kvh, hd),
            &c.causal(&q, &k, &v, &starts, rows, heads, kvh, hd),
            ATTN_TOL,
        );
    }
    // Drafter: two sequences, anchors at 0 and at the end, padded blocks, block sizes 16 and 1.
    for (hd, bs, heads, kvh) in [(16, 16, 4, 2), (128, 16, 32, 8), (64, 5, 6, 2), (32, 1, 4, 1)] {
        let ctx_rows = 150;
        let anchors = vec![0, 17, 99, -1, 3, 49, -1];
        let starts = vec![0, 0, 0, 0, 100, 100, 100];
        let sh = DraftAttnShape { num_blocks: 7, block_size: bs, ctx_rows, heads, kv_heads: kvh, head_dim: hd };
        let (qn, kn, kb) = (sh.q_rows() * heads * hd, ctx_rows * kvh * hd, sh.q_rows() * kvh * hd);
        let t = [
            rand(qn, 80, 1.0),
            rand(kn, 81, 1.0),
            rand(kn, 82, 1.0),
            rand(kb, 83, 1.0),
            rand(kb, 84, 1.0),
            rand(qn, 85, 1.0),
        ];
        let (a, b) = (g.draft(&sh, &t, &anchors, &starts), c.draft(&sh, &t, &anchors, &starts));
        for (i, name) in ["o", "lse", "dq", "dkc", "dvc", "dkb", "dvb"].iter().enumerate() {
            rel_err(
                &format!("drafter attention {name} hd {hd} bs {bs} {heads}/{kvh}"),
                &a[i],
                &b[i],
                if i == 1 { 1e-5 } else { ATTN_TOL },
            );
        }
        // Padded blocks: exact zeros out.
        let w = heads * hd;
        assert!(a[0][3 * bs * w..4 * bs * w].iter().all(|&x| x == 0.0));
    }
}

trait LossTest {
    fn ce(&self, logits: &[f32], labels: &[i32], w: &[f32], rows: usize, vocab: usize) -> [Vec<f32>; 3];
    fn adam(&self, p: &[f32], gr: &[f32], m: &[f32], v: &[f32]) -> [Vec<f32>; 4];
    fn sumsq(&self, x: &[f32]) -> f32;
    fn nonfinite(&self, x: &[f32], dt: DType) -> u64;
}

impl<B: Backend> LossTest for B {
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
fn gpu_loss_optimizer_reductions_match_cpu() {
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
    let n = 10_001;
    let (p, gr, m) = (rand(n, 1, 1.0), rand(n, 2, 1.0), rand(n, 3, 0.1));
    let v: Vec<f32> = rand(n, 4, 0.1).iter().map(|x| x * x).collect();
    let (a, b) = (g.adam(&p, &gr, &m, &v), c.adam(&p, &gr, &m, &v));
    for (i, name) in ["master", "m", "v", "bf16 weights"].iter().enumerate() {
        bits_equal(&format!("adamw {name}"), &a[i], &b[i]);
    }
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

// ---------------------------------------------------------------------------------------------
// Whole-model checks
// ---------------------------------------------------------------------------------------------

use dflash_engine::session::{self, Device, RunOptions};
use std::path::PathBuf;
use std::process::Command;

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dflash-gpu-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Where tests/reference lives: the working directory (the GPU bundle runs from the repo root),
/// or DFLASH_REPO_ROOT.
fn reference_script(name: &str) -> PathBuf {
    let root =
        std::env::var("DFLASH_REPO_ROOT").map(PathBuf::from).unwrap_or_else(|_| std::env::current_dir().unwrap());
    let p = root.join("tests/reference").join(name);
    assert!(p.exists(), "{} not found: run from the repository root or set DFLASH_REPO_ROOT", p.display());
    p
}

fn python(script: &str, args: &[String]) {
    let out = Command::new("python3")
        .arg(reference_script(script))
        .args(args)
        .output()
        .expect("python3 must be installed on the GPU machine");
    println!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "{script} failed:\n{}", String::from_utf8_lossy(&out.stderr));
}

/// 50 training steps on CUDA track the CPU backend (same data file, same seed), and two CUDA runs
/// give bit-identical losses.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_training_tracks_cpu_and_is_deterministic() {
    let dir = tmp("train");
    let data = dir.join("data.jsonl");
    session::gen_data("tiny", 256, 96, session::TINY_INIT_STD, &data).unwrap();
    let base = {
        let mut ro = RunOptions::tiny_default();
        ro.train.steps = 50;
        ro.output.quiet = true;
        ro.data.path = Some(data);
        ro.output.save_every = 1000;
        ro
    };
    let run = |device, tag: &str| {
        session::run(
            &{
                let mut ro = base.clone();
                ro.exec.device = device;
                ro.output.out = dir.join(tag);
                ro
            },
            None,
        )
        .unwrap()
    };
    let (g1, g2, c) = (run(Device::Cuda, "g1"), run(Device::Cuda, "g2"), run(Device::Cpu, "c"));
    assert!(g1.backend.starts_with("cuda"), "{}", g1.backend);
    let bits = |r: &session::RunSummary| r.history.iter().map(|m| m.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&g1), bits(&g2), "two CUDA runs with the same seed must be bit-identical");
    // bf16 activations rounded at the same points but summed in other orders: the runs drift
    // apart slowly; 5% per step at most, 2% on average over 50 steps.
    let rel: Vec<f64> = g1.history.iter().zip(&c.history).map(|(a, b)| ((a.loss - b.loss) / b.loss).abs()).collect();
    let (max, mean) = (rel.iter().cloned().fold(0.0, f64::max), rel.iter().sum::<f64>() / rel.len() as f64);
    println!("cuda vs cpu loss over 50 steps: max rel {max:.3e}, mean rel {mean:.3e}; first {:.4} vs {:.4}, last {:.4} vs {:.4}", g1.history[0].loss, c.history[0].loss, g1.history[49].loss, c.history[49].loss);
    assert!(max < 0.05 && mean < 0.02, "max {max}, mean {mean}");
}

fn write_ids(path: &std::path::Path, ids: &[i32], b: usize, s: usize) {
    let bytes: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
    dflash_engine::weights::write_safetensors_atomic(
        path,
        &[("input_ids".to_string(), safetensors::Dtype::I32, vec![b, s], bytes)],
        None,
    )
    .unwrap();
}

/// The target's taps on CUDA against Hugging Face transformers' Qwen3 on the same safetensors
/// file: the output of 0-based layer L is HF's hidden_states[L + 1].
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_taps_match_hugging_face() {
    use dflash_engine::config::TargetConfig;
    use dflash_engine::model::target::{Target, TargetInputs, TargetShape};
    let g = gpu();
    for (preset, taps) in [("tiny", vec![1usize, 3]), ("small", vec![1, 4, 7])] {
        let dir = tmp(&format!("hf-{preset}"));
        let cfg = TargetConfig::preset(preset).unwrap();
        dflash_engine::weights::init_target(&cfg, 3, 0.05, dir.join("model")).unwrap();
        let (b, s) = (2usize, 64usize);
        let mut r = Philox::new(5, [1, 1]);
        let tokens: Vec<i32> = (0..b * s).map(|_| r.below(cfg.vocab_size as u64 - 3) as i32).collect();
        write_ids(&dir.join("in.safetensors"), &tokens, b, s);
        let layers = taps.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
        python(
            "hf_taps.py",
            &[
                format!("--model={}", dir.join("model").display()),
                format!("--input={}", dir.join("in.safetensors").display()),
                format!("--layers={layers}"),
                format!("--out={}", dir.join("out.safetensors").display()),
            ],
        );
        let files = dflash_engine::weights::ModelFiles::open(dir.join("model")).unwrap();
        let target =
            Target::load(&g, TargetShape::from(&cfg), taps.clone(), false, |n, d| -> anyhow::Result<Vec<f32>> {
                Ok(files.tensor_f32(n, d)?)
            })
            .unwrap();
        let st = g.compute_stream();
        let pos: Vec<i32> = (0..b).flat_map(|_| 0..s as i32).collect();
        let starts: Vec<i32> = (0..=b).map(|i| (i * s) as i32).collect();
        let mut outs: Vec<_> =
            taps.iter().map(|_| g.alloc(&st, DType::BF16, b * s * cfg.hidden_size).unwrap()).collect();
        target
            .forward_taps(
                &g,
                &st,
                &TargetInputs {
                    ids: &ids(&g, &tokens),
                    pos: &ids(&g, &pos),
                    seq_starts: &ids(&g, &starts),
                    rows: b * s,
                },
                &mut outs,
            )
            .unwrap();
        let hf = dflash_engine::weights::TensorStore::open_file(dir.join("out.safetensors")).unwrap();
        let hf_taps: Vec<Vec<f32>> =
            taps.iter().map(|l| hf.tensor_f32(&format!("tap_{l}"), &[b, s, cfg.hidden_size]).unwrap()).collect();
        for (k, &l) in taps.iter().enumerate() {
            let ours = get(&g, &outs[k]);
            // Two bf16 forwards that round at different points (fused vs separate ops): each layer
            // adds about one bf16 ulp (4e-3) of the residual's largest value; 3e-2 covers 8 layers.
            let own = rel_err(&format!("taps vs HF {preset} layer {l}"), &ours, &hf_taps[k], 3e-2);
            // Teeth: the same tap is much farther from HF's output of any other layer, so an
            // off-by-one layer could not pass.
            for (j, &other) in taps.iter().enumerate().filter(|&(j, _)| j != k) {
                let scale = hf_taps[j].iter().fold(0f32, |m, x| m.max(x.abs()));
                let far = ours.iter().zip(&hf_taps[j]).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                println!("  engine layer {l} vs HF layer {other}: {far:.3e}");
                assert!(far > 3.0 * own, "layer {l} is as close to HF layer {other} ({far}) as to its own ({own})");
            }
        }
    }
}

/// The drafter's loss and every parameter gradient on CUDA against a PyTorch autograd
/// implementation of DFLASH.md (tests/reference/drafter_ref.py) on the same inputs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_drafter_matches_pytorch() {
    use dflash_engine::model::drafter::{fc_backward, fc_forward, Drafter, DrafterShape};
    use dflash_engine::train::batch::{build_batch, BatchSpec, Sample};
    use dflash_engine::train::step::DeviceDraftBatch;
    let g = gpu();
    let st = g.compute_stream();
    let sh = DrafterShape {
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        inter: 96,
        vocab: 256,
        num_taps: 2,
        block_size: 8,
        eps: 1e-6,
        rope_theta: 1e6,
        mask_token_id: 255,
        logits_chunk_rows: 37,
    };
    let mut r = Philox::new(9, [2, 2]);
    let samples: Vec<Sample> = [(60, 10), (41, 5), (7, 5)]
        .iter()
        .map(|&(len, prompt)| Sample {
            input_ids: (0..len).map(|_| r.below(250) as u32).collect(),
            loss_mask: (0..len).map(|i| u8::from(i >= prompt)).collect(),
        })
        .collect();
    let hb = build_batch(
        &samples,
        &BatchSpec { anchors_per_seq: 6, block_size: 8, mask_token_id: 255, gamma: 4.0, pad_to_tokens: None, seed: 4 },
        0,
        0,
    )
    .unwrap();
    let bf = |v: Vec<f32>| v.iter().map(|&x| dflash_engine::tensor::round_bf16(x)).collect::<Vec<f32>>();
    let n = sh.vocab * sh.hidden;
    let (embed_h, head_h) = (bf(rand(n, 1, 1.0)), bf(rand(n, 2, 0.5)));
    let x_h = bf(rand(hb.rows() * sh.fc_in(), 3, 1.0));
    let (mut d, mut fc) =
        Drafter::new(&g, &st, sh.clone(), put(&g, &embed_h, DType::BF16), put(&g, &head_h, DType::BF16), 7).unwrap();
    // Larger weights than the default init so every gradient is well above rounding noise.
    let mut params = Vec::new();
    for (gi, grp) in [&mut fc, &mut d.body].into_iter().enumerate() {
        let mut host = vec![0f32; grp.table.total()];
        for (ei, e) in grp.table.entries().iter().enumerate() {
            let v = bf(rand(e.numel, 100 + (gi * 100 + ei) as u64, 1.0)
                .iter()
                .map(|x| if e.shape.len() == 1 { 1.0 + 0.1 * x } else { 0.15 * x })
                .collect());
            host[e.offset..e.offset + e.numel].copy_from_slice(&v);
            params.push((e.name.clone(), e.shape.clone(), v));
        }
        grp.set_masters(&g, &st, &host).unwrap();
    }
    let xb = put(&g, &x_h, DType::BF16);
    let dev = DeviceDraftBatch::upload(&g, &st, &hb).unwrap();
    let mut y = g.alloc(&st, DType::BF16, hb.rows() * sh.hidden).unwrap();
    let mut dy = g.alloc(&st, DType::BF16, hb.rows() * sh.hidden).unwrap();
    fc_forward(&g, &st, &fc, &xb, &mut y, hb.rows()).unwrap();
    let out = d.forward_backward(&g, &st, &dev.inputs(), &y, (1.0 / hb.weight_sum) as f32, &mut dy).unwrap();
    fc_backward(&g, &st, &mut fc, &dy, &xb, hb.rows()).unwrap();
    let loss = get(&g, &out.loss).iter().map(|&x| f64::from(x)).sum::<f64>() / hb.weight_sum;

    // The case file for the oracle.
    let dir = tmp("drafter-ref");
    let f32b = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let i32b = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    use safetensors::Dtype::{F32, I32};
    let mut t = vec![
        ("x".to_string(), F32, vec![hb.rows(), sh.fc_in()], f32b(&x_h)),
        ("embed".to_string(), F32, vec![sh.vocab, sh.hidden], f32b(&embed_h)),
        ("lm_head".to_string(), F32, vec![sh.vocab, sh.hidden], f32b(&head_h)),
        ("ctx_pos".to_string(), I32, vec![hb.rows()], i32b(&hb.pos)),
        ("block_ids".to_string(), I32, vec![hb.block_ids.len()], i32b(&hb.block_ids)),
        ("block_pos".to_string(), I32, vec![hb.block_pos.len()], i32b(&hb.block_pos)),
        ("anchors".to_string(), I32, vec![hb.anchors.len()], i32b(&hb.anchors)),
        ("ctx_start".to_string(), I32, vec![hb.ctx_start.len()], i32b(&hb.ctx_start)),
        ("labels".to_string(), I32, vec![hb.labels.len()], i32b(&hb.labels)),
        ("weights".to_string(), F32, vec![hb.weights.len()], f32b(&hb.weights)),
    ];
    for (name, shape, v) in &params {
        t.push((name.clone(), F32, shape.clone(), f32b(v)));
    }
    let meta: std::collections::HashMap<String, String> = [
        ("heads", "4"),
        ("kv_heads", "2"),
        ("head_dim", "16"),
        ("block_size", "8"),
        ("layers", "2"),
        ("rms_eps", "1e-6"),
        ("norm_eps", "1e-6"),
        ("rope_theta", "1000000"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    dflash_engine::weights::write_safetensors_atomic(dir.join("case.safetensors"), &t, Some(meta)).unwrap();
    python(
        "drafter_ref.py",
        &[
            format!("--case={}", dir.join("case.safetensors").display()),
            format!("--out={}", dir.join("ref.safetensors").display()),
            "--dtype=float32".into(),
        ],
    );
    let rf = dflash_engine::weights::TensorStore::open_file(dir.join("ref.safetensors")).unwrap();
    let want_loss = f64::from(rf.tensor_f32("loss", &[1]).unwrap()[0]);
    println!("drafter loss: engine (cuda) {loss:.6}, pytorch {want_loss:.6}");
    assert!(((loss - want_loss) / want_loss).abs() < 1e-2, "loss {loss} vs {want_loss}");
    let (gf, gb) = (get(&g, &fc.grad), get(&g, &d.body.grad));
    for grp_entries in [(&fc.table, &gf), (&d.body.table, &gb)] {
        for e in grp_entries.0.entries() {
            let ours = &grp_entries.1[e.offset..e.offset + e.numel];
            let want = rf.tensor_f32(&format!("grad.{}", e.name), &e.shape).unwrap();
            // The engine keeps activations and their gradients in bf16; the oracle is f32.
            // Relative to the tensor's largest gradient: 5e-2.
            rel_err(&format!("grad {} vs pytorch", e.name), ours, &want, 5e-2);
        }
    }
}

// ---- FC projection: kernels/fc.cu, both symbols, against the CPU GEMM --------------------------

/// Elements appended after y[rows * h]: they start as NaN and must still be NaN afterwards (a
/// ragged row or column tile that stores past the output would overwrite them).
const FC_TAIL: usize = 256;

/// y = x W^T on the GPU with `path` (None: the automatic choice), W at `w_off` inside `wbuf`.
#[allow(clippy::too_many_arguments)]
fn fc_gpu(
    g: &CudaBackend,
    x: &[f32],
    wbuf: &[f32],
    w_off: usize,
    rows: usize,
    h: usize,
    k: usize,
    path: Option<dflash_engine::backend::cuda::FcPath>,
) -> Vec<f32> {
    let s = g.compute_stream();
    let (xb, wb) = (put(g, x, DType::BF16), put(g, wbuf, DType::BF16));
    // NaN everywhere first: an output element the kernel forgets to write fails the comparison.
    let mut y = put(g, &vec![f32::NAN; rows * h + FC_TAIL], DType::BF16);
    match path {
        Some(p) => g.fc_project_with(&s, &xb, &wb, w_off, &mut y, rows, h, k, p).unwrap(),
        None => g.fc_project(&s, &xb, &wb, w_off, &mut y, rows, h, k).unwrap(),
    }
    let mut out = get(g, &y);
    let tail = out.split_off(rows * h);
    assert!(tail.iter().all(|v| v.is_nan()), "fc {rows}x{h}x{k} ({path:?}) wrote past y[rows * h]");
    out
}

fn fc_cpu(x: &[f32], wbuf: &[f32], w_off: usize, rows: usize, h: usize, k: usize) -> Vec<f32> {
    let c = CpuBackend::new();
    let s = c.compute_stream();
    let (xb, wb) = (put(&c, x, DType::BF16), put(&c, wbuf, DType::BF16));
    let mut y = c.alloc(&s, DType::BF16, rows * h).unwrap();
    c.gemm(&s, &Gemm::linear(rows, h, k), &xb, 0, &wb, w_off, &mut y, 0).unwrap();
    get(&c, &y)
}

/// Both sides round the f32 sum of the same bf16 products once to bf16; only the order of the f32
/// additions differs, which moves a sum by far less than 1e-4 of the largest output at these k.
/// So every element must agree to one bf16 ulp of itself (2^-7 relative at most) plus that
/// 1e-4 floor, and max |diff| / max |ref| must stay under BF16_TOL. A wrong, missing (NaN) or
/// misplaced element fails the first check even when it is small.
fn fc_close(what: &str, got: &[f32], want: &[f32]) {
    rel_err(what, got, want, BF16_TOL);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let ulp = 2f32.powi(-7);
    let bad: Vec<usize> = (0..want.len())
        .filter(|&i| {
            let diff = (got[i] - want[i]).abs(); // NaN when either side is NaN: counted as off
            diff.is_nan() || diff > ulp * got[i].abs().max(want[i].abs()) + 1e-4 * scale
        })
        .collect();
    if let Some(&i) = bad.first() {
        panic!("{what}: {} elements off by more than one bf16 ulp; first at {i}: {} vs {}", bad.len(), got[i], want[i]);
    }
}

/// The FC projection (kernels/fc.cu): the wgmma/TMA kernel and the simple fallback, each forced,
/// and the automatic choice, against the CPU GEMM. Shapes: ragged rows (1, 100, 3072), column and
/// K tails (h = 264, k = 136), the tiny preset (96 x 64 x 192), more tiles than SMs (persistent
/// CTAs), an aligned nonzero weight offset, a misaligned one and k % 8 != 0 (the fast kernel must
/// refuse; the automatic choice falls back), and 4096 x 4096 x 20480 against cuBLASLt in full and
/// the CPU on sampled rows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_fc_kernel_matches_cpu() {
    use dflash_engine::backend::cuda::FcPath;
    let g = gpu();
    // (rows, h, k, w_off, fast path possible)
    let cases: [(usize, usize, usize, usize, bool); 12] = [
        (1, 256, 64, 0, true),
        (100, 512, 320, 64, true),
        (3072, 256, 1024, 0, true),
        (96, 64, 192, 0, true),
        (800, 64, 320, 0, true),
        (300, 264, 136, 8, true),
        (130, 512, 4096, 0, true),
        (1100, 4096, 256, 0, true),
        (0, 64, 64, 0, true),
        (100, 256, 192, 3, false),
        (37, 72, 100, 0, false),
        (5, 30, 64, 0, false),
    ];
    for (rows, h, k, w_off, fast_ok) in cases {
        let x = rand((rows * k).max(1), 31, 1.0); // never an empty upload (rows = 0)
                                                  // W inside a larger buffer of unrelated values: reading at the wrong offset shows.
        let mut wbuf = rand(w_off + h * k + 64, 32, 1.0);
        wbuf[w_off..w_off + h * k].copy_from_slice(&rand(h * k, 33, 1.0));
        let want = fc_cpu(&x, &wbuf, w_off, rows, h, k);
        let tag = format!("fc {rows}x{h}x{k} w_off {w_off}");
        let simple = fc_gpu(&g, &x, &wbuf, w_off, rows, h, k, Some(FcPath::Simple));
        fc_close(&format!("{tag} simple"), &simple, &want);
        let auto = fc_gpu(&g, &x, &wbuf, w_off, rows, h, k, None);
        fc_close(&format!("{tag} auto"), &auto, &want);
        if fast_ok {
            let fast = fc_gpu(&g, &x, &wbuf, w_off, rows, h, k, Some(FcPath::Fast));
            fc_close(&format!("{tag} fast"), &fast, &want);
            // The automatic choice is the fast kernel here, and the kernel is deterministic.
            bits_equal(&format!("{tag} auto == fast"), &auto, &fast);
        } else {
            bits_equal(&format!("{tag} auto == simple"), &auto, &simple);
            let s = g.compute_stream();
            let (xb, wb) = (put(&g, &x, DType::BF16), put(&g, &wbuf, DType::BF16));
            let mut y = g.alloc(&s, DType::BF16, rows * h).unwrap();
            let forced = g.fc_project_with(&s, &xb, &wb, w_off, &mut y, rows, h, k, FcPath::Fast);
            assert!(forced.is_err(), "{tag}: the fast kernel accepted operands it cannot take");
        }
    }

    // The recipe-sized K: 320 k-blocks through the 4-stage ring, several tiles per CTA. Under
    // compute-sanitizer (DFLASH_SANITIZE=1) a smaller K keeps the instrumented run to seconds;
    // the shapes above already cover every tail.
    let k = if std::env::var_os("DFLASH_SANITIZE").is_some() { 1024 } else { 20480 };
    let (rows, h) = (4096, 4096);
    let x = rand(rows * k, 41, 1.0);
    let w = rand(h * k, 42, 1.0);
    let tag = format!("fc {rows}x{h}x{k}");
    let fast = fc_gpu(&g, &x, &w, 0, rows, h, k, Some(FcPath::Fast));
    // Every element against the simple kernel (f32 sums rounded once, as the fast one) ...
    let simple = fc_gpu(&g, &x, &w, 0, rows, h, k, Some(FcPath::Simple));
    fc_close(&format!("{tag} fast vs simple"), &fast, &simple);
    // ... and against cuBLASLt with the max-relative bound only: its algorithm may reduce split-K
    // partials in bf16, which is more than one rounding.
    // (Not under the sanitizers: racecheck reports hazards inside cuBLASLt's own kernel, which is
    // not ours to check; our kernels are.)
    if std::env::var_os("DFLASH_SANITIZE").is_none() {
        let lt = gemm_case(&g, &Gemm::linear(rows, h, k), &x, &w, &vec![0.0; rows * h], DType::BF16);
        rel_err(&format!("{tag} fast vs cuBLASLt"), &fast, &lt, BF16_TOL);
    }
    // The CPU on rows spread over every row tile position (first, last, tile edges).
    let picked: Vec<usize> = vec![0, 1, 63, 64, 127, 128, 1000, 2047, 2048, 3333, 4094, 4095];
    let xs: Vec<f32> = picked.iter().flat_map(|&r| x[r * k..(r + 1) * k].iter().copied()).collect();
    let want = fc_cpu(&xs, &w, 0, picked.len(), h, k);
    let got: Vec<f32> = picked.iter().flat_map(|&r| fast[r * h..(r + 1) * h].iter().copied()).collect();
    fc_close(&format!("{tag} fast vs cpu (12 rows)"), &got, &want);
}
