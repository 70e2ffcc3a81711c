//! The embedded default data: sequences the default target writes itself, as real DFlash recipes
//! regenerate responses with the target.
//!
//! A prompt of random tokens is followed by a continuation decoded from the target. A target with
//! small random weights has nearly flat next-token distributions, and text *sampled* from it is
//! noise no drafter can learn; greedy decoding (temperature 0, the default) makes every
//! continuation a deterministic function of its prefix, which is exactly what a drafter can learn
//! to predict. A temperature above 0 samples with Philox draws keyed by (seed, sample, position).

use crate::backend::{Backend, Result};
use crate::model::target::Target;
use crate::rng::{self, Philox};
use crate::tensor::DType;
use crate::train::batch::Sample;

#[derive(Clone, Debug)]
pub struct GenSpec {
    pub num_samples: usize,
    pub prompt_len: usize,
    pub seq_len: usize,
    /// 0 = greedy.
    pub temperature: f32,
    pub seed: u64,
    /// Prompt tokens are drawn from `0..ordinary_vocab` (special tokens sit above it).
    pub ordinary_vocab: u32,
    /// Sequences decoded together.
    pub batch: usize,
}

/// Generates `num_samples` samples; `progress(done)` is called after each batch.
pub fn generate<B: Backend>(
    be: &B,
    s: &B::Stream,
    target: &Target<B>,
    spec: &GenSpec,
    mut progress: impl FnMut(usize),
) -> Result<Vec<Sample>> {
    if spec.prompt_len == 0 || spec.prompt_len + 2 > spec.seq_len {
        return Err(crate::backend::BackendError::Shape {
            op: "generate",
            what: format!(
                "prompt length {} and sequence length {}: a sample needs a prompt of at least 1 token and a continuation of at least 2",
                spec.prompt_len, spec.seq_len
            ),
        });
    }
    let vocab = target.shape.vocab;
    let mut out = Vec::with_capacity(spec.num_samples);
    let mut first = 0;
    while first < spec.num_samples {
        let n = spec.batch.max(1).min(spec.num_samples - first);
        let mut seqs: Vec<Vec<u32>> =
            (0..n).map(|i| prompt(spec.seed, (first + i) as u32, spec.prompt_len, spec.ordinary_vocab)).collect();
        let mut cache = target.new_cache(be, s, n, spec.seq_len)?;
        let mut logits = be.alloc(s, DType::F32, n * vocab)?;
        let mut tokens = be.alloc_ids(s, n)?;
        for t in 0..spec.seq_len - 1 {
            let cur: Vec<i32> = seqs.iter().map(|q| q[t] as i32).collect();
            be.upload_ids(s, &cur, &mut tokens)?;
            target.decode_step(be, s, &mut cache, &tokens, t, &mut logits)?;
            if t + 1 < spec.prompt_len {
                continue; // still reading the prompt
            }
            let host = be.download(s, &logits)?;
            for (i, q) in seqs.iter_mut().enumerate() {
                let row = &host[i * vocab..(i + 1) * vocab];
                let (sample, pos) = ((first + i) as u32, t as u32);
                q.push(pick_token(row, spec.temperature, || {
                    Philox::new(spec.seed ^ 0x5eed, [sample, rng::domain::DATA | (pos << 8)])
                }));
            }
        }
        for q in seqs {
            let mask = (0..spec.seq_len).map(|p| u8::from(p >= spec.prompt_len)).collect();
            out.push(Sample { input_ids: q, loss_mask: mask });
        }
        first += n;
        progress(first);
    }
    Ok(out)
}

/// The random prompt of generated sample `index`: `len` tokens from `0..ordinary_vocab`, keyed by
/// `(seed, index)`. `eval --prompts generated` draws held-out prompts from indices no run uses.
pub fn prompt(seed: u64, index: u32, len: usize, ordinary_vocab: u32) -> Vec<u32> {
    let mut r = Philox::new(seed, [index, rng::domain::DATA]);
    (0..len).map(|_| r.below(u64::from(ordinary_vocab)) as u32).collect()
}

/// The next token from one row of logits: the argmax at `temperature <= 0`, else a draw from
/// `softmax(row / temperature)` with one uniform from `draw()` (called only when sampling).
/// Shared by every decoding loop (the default data here, `prepare-data --regenerate`).
pub fn pick_token(row: &[f32], temperature: f32, draw: impl FnOnce() -> Philox) -> u32 {
    let argmax = row.iter().enumerate().fold(0, |b, (i, &x)| if x > row[b] { i } else { b });
    if temperature <= 0.0 {
        return argmax as u32;
    }
    let inv_t = 1.0 / f64::from(temperature);
    let mx = f64::from(row[argmax]);
    let w: Vec<f64> = row.iter().map(|&x| ((f64::from(x) - mx) * inv_t).exp()).collect();
    let total: f64 = w.iter().sum();
    let mut r = draw();
    let mut u = r.uniform_f64() * total;
    for (i, &x) in w.iter().enumerate() {
        if u < x {
            return i as u32;
        }
        u -= x;
    }
    argmax as u32
}
