//! Greedy decoding of one prompt, with and without speculation, on one backend.
//!
//! Both start from the same prefill (one [`Target::extend`] over the prompt, capturing the taps),
//! so their first token and their caches are identical; after that:
//! - target alone: one [`Target::decode_step`] per token;
//! - speculative (DFlash): per round the drafter drafts one block after the accepted context
//!   (slot 0 = the last token the target produced), the target verifies the whole block in one
//!   extend, the longest prefix of drafts equal to the target's greedy choices is accepted plus
//!   the target's own next token, the target cache is rewound past the rejected rows, and the
//!   accepted tokens' taps (the anchor's and the accepted drafts') join the drafter's context.
//!
//! Greedy choices are the argmax of bf16 logits computed on the device (`Backend::argmax_rows`),
//! the same function for every path, so only the forward differs between them.

use std::time::Instant;

use crate::backend::{Backend, BackendError, Result};
use crate::model::drafting::{DraftCache, DraftWeights};
use crate::model::target::Target;
use crate::tensor::DType;

/// When a decode stops.
#[derive(Clone, Debug)]
pub struct DecodeLimits {
    /// New tokens at most (the first, from the prefill, included).
    pub max_new_tokens: usize,
    /// Stop after producing one of these ids (kept in the output).
    pub eos: Vec<u32>,
}

/// One prompt's greedy continuation and what it cost.
#[derive(Clone, Debug, Default)]
pub struct Decoded {
    pub tokens: Vec<u32>,
    /// Seconds of the prefill (not counted in `decode_secs`).
    pub prefill_secs: f64,
    /// Seconds after the prefill until the last token.
    pub decode_secs: f64,
    /// Speculative only: tokens each verification round produced (accepted drafts + 1), before
    /// the output was cut at the token limit or an end-of-sequence id.
    pub accept_lens: Vec<usize>,
    /// Speculative only: seconds spent drafting (drafter context append + block) and verifying
    /// (target extend + rewind), host-timed around each phase (each ends with a download).
    pub draft_secs: f64,
    pub verify_secs: f64,
}

/// The drafter of a speculative decode: a trained drafter, or none (every round then keeps only
/// the target's own token: greedy decoding through the verification forward, the reference the
/// speculative output must equal on any backend).
#[derive(Clone, Copy)]
pub enum Proposer<'a, B: Backend> {
    Drafter(&'a DraftWeights<'a, B>),
    /// Verify blocks of this many slots with nothing to accept.
    VerifyOnly {
        block_size: usize,
    },
    /// Drafts given by a function of the anchor's position (`block_size - 1` tokens), e.g. a
    /// known continuation with planted errors: drives every acceptance length through the
    /// verification and the rewind (tests and diagnosis).
    Script {
        block_size: usize,
        draft: &'a dyn Fn(usize) -> Vec<u32>,
    },
}

impl<B: Backend> Proposer<'_, B> {
    fn block_size(&self) -> usize {
        match self {
            Proposer::Drafter(d) => d.shape.block_size,
            Proposer::VerifyOnly { block_size } | Proposer::Script { block_size, .. } => *block_size,
        }
    }
}

fn upload_ids<B: Backend>(be: &B, s: &B::Stream, v: &[u32]) -> Result<B::Ids> {
    let host: Vec<i32> = v
        .iter()
        .map(|&t| i32::try_from(t).map_err(|_| BackendError::Shape { op: "decode", what: format!("token id {t}") }))
        .collect::<Result<_>>()?;
    let mut b = be.alloc_ids(s, host.len())?;
    be.upload_ids(s, &host, &mut b)?;
    Ok(b)
}

/// The greedy token of each of `rows` rows of bf16 logits (downloaded: the host waits).
fn greedy<B: Backend>(be: &B, s: &B::Stream, logits: &B::Buf, rows: usize, vocab: usize) -> Result<Vec<u32>> {
    let mut out = be.alloc_ids(s, rows)?;
    be.argmax_rows(s, logits, vocab, rows, vocab, &mut out)?;
    Ok(be.download_ids(s, &out)?.into_iter().map(|t| t.max(0) as u32).collect())
}

/// Cuts `new` at the token limit and after the first end-of-sequence id; true when done.
fn push_tokens(out: &mut Vec<u32>, new: &[u32], lim: &DecodeLimits) -> bool {
    for &t in new {
        if out.len() >= lim.max_new_tokens {
            return true;
        }
        out.push(t);
        if lim.eos.contains(&t) {
            return true;
        }
    }
    out.len() >= lim.max_new_tokens
}

/// The prefill both paths share: the prompt through one extend, its taps, its first token.
struct Prefilled<B: Backend> {
    cache: crate::model::target::KvCache<B>,
    taps: Vec<B::Buf>,
    first: u32,
}

fn prefill<B: Backend>(
    be: &B,
    s: &B::Stream,
    target: &Target<B>,
    prompt: &[u32],
    max_len: usize,
    with_taps: bool,
) -> Result<Prefilled<B>> {
    if prompt.is_empty() {
        return Err(BackendError::Shape { op: "decode", what: "an empty prompt: give at least one token".into() });
    }
    let (p, h, v) = (prompt.len(), target.shape.hidden, target.shape.vocab);
    let mut cache = target.new_cache(be, s, 1, max_len)?;
    let mut taps: Vec<B::Buf> = Vec::new();
    if with_taps {
        for _ in &target.taps {
            taps.push(be.alloc(s, DType::BF16, p * h)?);
        }
    }
    let ids = upload_ids(be, s, prompt)?;
    let mut logits = be.alloc(s, DType::BF16, v)?;
    let taps_out = if with_taps { Some(&mut taps[..]) } else { None };
    target.extend(be, s, &mut cache, &ids, 0, p, taps_out, &mut logits, 1)?;
    let first = greedy(be, s, &logits, 1, v)?[0];
    Ok(Prefilled { cache, taps, first })
}

/// Greedy decoding with the target alone: the shared prefill, then one decode step per token.
pub fn decode_target_alone<B: Backend>(
    be: &B,
    s: &B::Stream,
    target: &Target<B>,
    prompt: &[u32],
    lim: &DecodeLimits,
) -> Result<Decoded> {
    let t0 = Instant::now();
    let p = prompt.len();
    let mut pre = prefill(be, s, target, prompt, p + lim.max_new_tokens, false)?;
    let mut d = Decoded { prefill_secs: t0.elapsed().as_secs_f64(), ..Decoded::default() };
    let t1 = Instant::now();
    let vocab = target.shape.vocab;
    let mut logits = be.alloc(s, DType::BF16, vocab)?;
    let mut tok = be.alloc_ids(s, 1)?;
    let mut done = push_tokens(&mut d.tokens, &[pre.first], lim);
    while !done {
        let last = *d.tokens.last().expect("at least the first token");
        be.upload_ids(s, &[last as i32], &mut tok)?;
        target.decode_step(be, s, &mut pre.cache, &tok, p + d.tokens.len() - 1, &mut logits)?;
        let next = greedy(be, s, &logits, 1, vocab)?[0];
        done = push_tokens(&mut d.tokens, &[next], lim);
    }
    d.decode_secs = t1.elapsed().as_secs_f64();
    Ok(d)
}

/// Greedy decoding with DFlash speculation (module doc). Lossless: the output is the target's
/// own greedy output through the verification forward.
pub fn decode_speculative<B: Backend>(
    be: &B,
    s: &B::Stream,
    target: &Target<B>,
    proposer: Proposer<'_, B>,
    prompt: &[u32],
    lim: &DecodeLimits,
) -> Result<Decoded> {
    let bs = proposer.block_size();
    if bs < 2 {
        return Err(BackendError::Shape {
            op: "decode",
            what: format!("block size {bs}: a round needs at least 2 slots"),
        });
    }
    let t0 = Instant::now();
    let p = prompt.len();
    // The last round may verify a whole block past the last kept token.
    let max_len = p + lim.max_new_tokens + bs;
    let drafting = !matches!(proposer, Proposer::VerifyOnly { .. });
    let with_taps = matches!(proposer, Proposer::Drafter(_));
    let mut pre = prefill(be, s, target, prompt, max_len, with_taps)?;
    let mut dcache = match proposer {
        Proposer::Drafter(dw) => {
            let mut c = DraftCache::new(be, s, dw.shape, max_len)?;
            let taps: Vec<&B::Buf> = pre.taps.iter().collect();
            dw.append_context(be, s, &mut c, &taps, p)?;
            Some(c)
        }
        Proposer::VerifyOnly { .. } | Proposer::Script { .. } => None,
    };
    be.synchronize(s)?;
    let mut d = Decoded { prefill_secs: t0.elapsed().as_secs_f64(), ..Decoded::default() };
    let t1 = Instant::now();
    let (h, vocab) = (target.shape.hidden, target.shape.vocab);
    let mut taps: Vec<B::Buf> = target.taps.iter().map(|_| be.alloc(s, DType::BF16, bs * h)).collect::<Result<_>>()?;
    let mut logits = be.alloc(s, DType::BF16, bs * vocab)?;
    let mut draft_ids = be.alloc_ids(s, bs - 1)?;
    let mut done = push_tokens(&mut d.tokens, &[pre.first], lim);
    while !done {
        // The anchor: the last token the target produced, at position `a` (not yet in any cache).
        let anchor = *d.tokens.last().expect("at least the first token");
        let a = p + d.tokens.len() - 1;
        let td = Instant::now();
        let drafts: Vec<u32> = match (&proposer, &dcache) {
            (Proposer::Drafter(dw), Some(c)) => {
                debug_assert_eq!(c.len, a, "the drafter's context is every token before the anchor");
                dw.draft_block(be, s, c, anchor, &mut draft_ids)?;
                be.download_ids(s, &draft_ids)?.into_iter().map(|t| t.max(0) as u32).collect()
            }
            (Proposer::Script { draft, .. }, _) => {
                let mut v = draft(a);
                v.resize(bs - 1, anchor);
                v
            }
            _ => vec![anchor; bs - 1],
        };
        let tv = Instant::now();
        d.draft_secs += (tv - td).as_secs_f64();
        let mut block = Vec::with_capacity(bs);
        block.push(anchor);
        block.extend_from_slice(&drafts);
        let ids = upload_ids(be, s, &block)?;
        let undo = target.extend(be, s, &mut pre.cache, &ids, a, bs, Some(&mut taps[..]), &mut logits, bs)?;
        let choice = greedy(be, s, &logits, bs, vocab)?;
        // choice[i] is the target's token after block[..=i]: drafts[i] is accepted while equal.
        let accepted = if drafting { drafts.iter().zip(&choice).take_while(|(x, y)| x == y).count() } else { 0 };
        target.rewind(be, s, &mut pre.cache, undo, accepted + 1)?;
        be.synchronize(s)?;
        let tr = Instant::now();
        d.verify_secs += (tr - tv).as_secs_f64();
        d.accept_lens.push(accepted + 1);
        let mut new = drafts[..accepted].to_vec();
        new.push(choice[accepted]);
        done = push_tokens(&mut d.tokens, &new, lim);
        if let (Proposer::Drafter(dw), Some(c)) = (&proposer, dcache.as_mut()) {
            if !done {
                // The anchor's and the accepted drafts' taps become context.
                let tap_refs: Vec<&B::Buf> = taps.iter().collect();
                dw.append_context(be, s, c, &tap_refs, accepted + 1)?;
                be.synchronize(s)?;
                d.draft_secs += tr.elapsed().as_secs_f64();
            }
        }
    }
    d.decode_secs = t1.elapsed().as_secs_f64();
    Ok(d)
}

/// Training's metric on a finished sequence (DFLASH.md section 4): for every anchor `a` in
/// `first..seq.len() - 1`, the drafter drafts a block after the target's taps of positions
/// `0..a` (from one packed forward over the sequence, as training computes them) and scores
/// `1 + the number of leading drafts equal to seq[a + 1..]` (cut at the sequence end). Returns
/// one value per anchor. Real decoding averages over the rounds it runs instead, whose anchors
/// are where the previous round stopped: long accepted stretches take few rounds, so the
/// per-round mean is below this per-position mean whenever acceptance varies along the text.
pub fn simulated_accept<B: Backend>(
    be: &B,
    s: &B::Stream,
    target: &Target<B>,
    dw: &DraftWeights<'_, B>,
    seq: &[u32],
    first: usize,
) -> Result<Vec<usize>> {
    use crate::model::target::TargetInputs;
    let (n, h, bs) = (seq.len(), target.shape.hidden, dw.shape.block_size);
    if n < 2 || first >= n - 1 {
        return Ok(Vec::new());
    }
    let ids = upload_ids(be, s, seq)?;
    let pos = upload_ids(be, s, &(0..n as u32).collect::<Vec<_>>())?;
    let starts = upload_ids(be, s, &[0, n as u32])?;
    let mut taps: Vec<B::Buf> = target.taps.iter().map(|_| be.alloc(s, DType::BF16, n * h)).collect::<Result<_>>()?;
    let inp = TargetInputs { ids: &ids, pos: &pos, seq_starts: &starts, rows: n };
    target.forward_taps(be, s, &inp, &mut taps)?;
    let mut cache = DraftCache::new(be, s, dw.shape, n)?;
    let mut rows: Vec<B::Buf> = target.taps.iter().map(|_| be.alloc(s, DType::BF16, n * h)).collect::<Result<_>>()?;
    let mut drafts = be.alloc_ids(s, bs - 1)?;
    let mut out = Vec::with_capacity(n - 1 - first);
    for a in first..n - 1 {
        // Context: taps of positions cache.len..a, appended.
        let (from, count) = (cache.len, a - cache.len);
        for (dst, src) in rows.iter_mut().zip(&taps) {
            be.copy(s, src, from * h, dst, 0, count * h)?;
        }
        let refs: Vec<&B::Buf> = rows.iter().collect();
        dw.append_context(be, s, &mut cache, &refs, count)?;
        dw.draft_block(be, s, &cache, seq[a], &mut drafts)?;
        let d = be.download_ids(s, &drafts)?;
        let hits = d.iter().zip(&seq[a + 1..]).take_while(|(x, y)| **x >= 0 && **x as u32 == **y).count();
        out.push(1 + hits);
    }
    Ok(out)
}
