//! Shared helpers: small shapes, random inputs, gradient comparison, scratch folders.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use dflash_engine::backend::cpu::{CpuBackend, CpuBuf};
use dflash_engine::model::drafter::{Drafter, DrafterShape, ParamGroup};
use dflash_engine::rng::Philox;
use dflash_engine::tensor::DType;
use dflash_engine::train::batch::Sample;

pub type Exact = CpuBackend<f64>;

/// A test's scratch folder, `$TMPDIR/dflash-<tag>-XXXXXX`: removed when dropped; kept, and its
/// path printed to stderr, when dropped by a panic (a failing test's files stay to be looked at).
pub struct Scratch {
    dir: Option<tempfile::TempDir>,
    fresh: AtomicUsize,
}

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let dir = tempfile::Builder::new()
            .prefix(&format!("dflash-{tag}-"))
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a scratch folder for {tag}: {e}"));
        Scratch { dir: Some(dir), fresh: AtomicUsize::new(0) }
    }

    pub fn path(&self) -> &Path {
        self.dir.as_ref().expect("the folder lives until drop").path()
    }

    /// `path().join(p)`, not created.
    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.path().join(p)
    }

    /// A path inside the folder named after `tag`, not created, different on every call (a new
    /// run folder each time a helper builds one).
    pub fn fresh(&self, tag: &str) -> PathBuf {
        self.join(format!("{tag}-{}", self.fresh.fetch_add(1, Ordering::Relaxed)))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let Some(dir) = self.dir.take() else { return };
        if std::thread::panicking() {
            eprintln!("scratch folder kept: {}", dir.keep().display());
        } else {
            let path = dir.path().to_path_buf();
            if let Err(e) = dir.close() {
                eprintln!("could not remove the scratch folder {}: {e}", path.display());
            }
        }
    }
}

/// A drafter side (drafter + fc, seed 4) on the f32 CPU backend with random frozen tables.
pub fn cpu_side(be: &CpuBackend, sh: &DrafterShape) -> dflash_engine::train::step::DrafterSide<CpuBackend> {
    use dflash_engine::backend::Backend;
    use dflash_engine::model::drafter::Frozen;
    let s = be.compute_stream();
    let n = sh.vocab * sh.hidden;
    let table = |seed: u64| {
        let mut t = be.alloc(&s, DType::BF16, n).unwrap();
        be.upload(&s, &randn(n, seed, 1.0).iter().map(|&v| v as f32).collect::<Vec<_>>(), &mut t, 0).unwrap();
        Frozen::owned(t)
    };
    let (d, fc) = Drafter::new(be, &s, sh.clone(), table(1), table(2), 4).unwrap();
    dflash_engine::train::step::DrafterSide::new(be, &s, d, Some(fc)).unwrap()
}

pub fn randn(n: usize, seed: u64, std: f64) -> Vec<f64> {
    let mut r = Philox::new(seed, [77, 77]);
    (0..n).map(|_| std * r.normal()).collect()
}

pub fn buf(v: Vec<f64>) -> CpuBuf<f64> {
    CpuBuf { dtype: DType::BF16, data: v }
}

pub fn buf32(v: Vec<f64>) -> CpuBuf<f64> {
    CpuBuf { dtype: DType::F32, data: v }
}

/// Central differences of `f` at `x`, one coordinate at a time.
pub fn numeric_grad(x: &[f64], mut f: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let h = 1e-5;
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            let x0 = xp[i];
            xp[i] = x0 + h;
            let fp = f(&xp);
            xp[i] = x0 - h;
            let fm = f(&xp);
            xp[i] = x0;
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

/// Max error relative to the tensor's largest gradient. f64 central differences with h = 1e-5 have
/// a truncation error near 1e-10 relative; 1e-6 leaves room for rounding and still catches any
/// wrong term (those show up at 1e-2 and above).
pub fn assert_grad_close(what: &str, analytic: &[f64], numeric: &[f64]) {
    assert_eq!(analytic.len(), numeric.len(), "{what}: lengths");
    let scale = numeric.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    assert!(scale > 1e-9, "{what}: the numeric gradient is all zero, the check would be vacuous");
    let err = analytic.iter().zip(numeric).fold(0.0f64, |m, (a, n)| m.max((a - n).abs()));
    assert!(err / scale < 1e-6, "{what}: max |analytic - numeric| = {err:e}, relative {:e}", err / scale);
}

pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// A drafter small enough for finite differences over every parameter.
pub fn fd_shape() -> DrafterShape {
    DrafterShape {
        hidden: 8,
        layers: 2,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        inter: 12,
        vocab: 24,
        num_taps: 2,
        block_size: 4,
        eps: 1e-6,
        rope_theta: 10_000.0,
        windows: vec![None; 2],
        mask_token_id: 23,
        logits_chunk_rows: 5,
        recompute: dflash_engine::model::drafter::Recompute::Norms,
        offload_layers: 1,
    }
}

/// A random sample of `len` tokens below the mask id, prompt of `prompt` tokens.
pub fn random_sample(len: usize, prompt: usize, vocab_no_mask: u32, seed: u64) -> Sample {
    let mut r = Philox::new(seed, [5, 5]);
    Sample {
        input_ids: (0..len).map(|_| r.below(u64::from(vocab_no_mask)) as u32).collect(),
        loss_mask: (0..len).map(|i| u8::from(i >= prompt)).collect(),
    }
}

/// Drafter + fc on the exact backend with weights larger than the default init (linear ~ N(0, 0.3),
/// norms 1 + N(0, 0.1)) so the tiny model's gradients are far from zero and not symmetric.
pub fn exact_drafter(shape: &DrafterShape, seed: u64) -> (Drafter<Exact>, ParamGroup<Exact>) {
    let be = Exact::exact();
    let s = dflash_engine::backend::cpu::CpuStream;
    let n = shape.vocab * shape.hidden;
    let embed = buf(randn(n, seed + 1, 1.0));
    let lm_head = buf(randn(n, seed + 2, 0.5));
    let (mut d, mut fc) = Drafter::new(
        &be,
        &s,
        shape.clone(),
        dflash_engine::model::drafter::Frozen::owned(embed),
        dflash_engine::model::drafter::Frozen::owned(lm_head),
        seed,
    )
    .unwrap();
    for (gi, g) in [&mut d.body, &mut fc].into_iter().enumerate() {
        for (ei, e) in g.table.entries().to_vec().iter().enumerate() {
            let r = randn(e.numel, seed * 1000 + (gi * 100 + ei) as u64, 1.0);
            let vals: Vec<f64> = r.iter().map(|x| if e.shape.len() == 1 { 1.0 + 0.1 * x } else { 0.3 * x }).collect();
            g.master.data[e.offset..e.offset + e.numel].copy_from_slice(&vals);
        }
        g.weights.data = g.master.data.clone();
    }
    (d, fc)
}

/// A run's per-step losses as bits (bit-identity checks).
pub fn losses(r: &dflash_engine::session::RunSummary) -> Vec<u64> {
    r.history.iter().map(|m| m.loss.to_bits()).collect()
}

/// The latest checkpoint's master weights as bits, by tensor name.
pub fn final_masters(dir: &std::path::Path) -> Vec<(String, Vec<u32>)> {
    let ck = dflash_engine::train::checkpoint::load_latest(dir).unwrap().expect("a checkpoint");
    ck.tensors.iter().map(|t| (t.name.clone(), t.master.iter().map(|x| x.to_bits()).collect())).collect()
}

/// Random q, context k/v and block k/v for the drafter attention at `sh` (N(0, 1), seeds
/// seed..seed + 4).
pub fn attn_inputs(sh: &dflash_engine::backend::DraftAttnShape, seed: u64) -> [Vec<f64>; 5] {
    let (qw, kw) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
    [
        randn(sh.q_rows() * qw, seed, 1.0),
        randn(sh.ctx_rows * kw, seed + 1, 1.0),
        randn(sh.ctx_rows * kw, seed + 2, 1.0),
        randn(sh.q_rows() * kw, seed + 3, 1.0),
        randn(sh.q_rows() * kw, seed + 4, 1.0),
    ]
}

/// The drafter attention's output in f64 on the CPU for `attn_inputs`' tensors.
pub fn attn_out(
    sh: &dflash_engine::backend::DraftAttnShape,
    t: &[Vec<f64>; 5],
    anchors: &[i32],
    starts: &[i32],
) -> Vec<f64> {
    use dflash_engine::backend::Backend;
    let be = Exact::exact();
    let mut o = buf(vec![0.0; sh.q_rows() * sh.heads * sh.head_dim]);
    let mut lse = buf32(vec![0.0; sh.q_rows() * sh.heads]);
    let b: Vec<CpuBuf<f64>> = t.iter().map(|v| buf(v.clone())).collect();
    let s = dflash_engine::backend::cpu::CpuStream;
    be.attn_draft_fwd(&s, sh, &b[0], &b[1], &b[2], &b[3], &b[4], &anchors.to_vec(), &starts.to_vec(), &mut o, &mut lse)
        .unwrap();
    o.data
}
