//! `--regenerate`: every assistant turn replaced by the target's own answer, turn by turn, a batch
//! of conversations at a time over one KV cache, as the DFlash recipe prepares its data (the
//! drafter learns what the target actually says).
//!
//! Round `r` answers every conversation's `r`-th assistant turn: its prompt is the conversation so
//! far (earlier answers already regenerated) rendered with the generation prompt. All sequences
//! of the batch step through positions together (`Target::decode_step` at one position `t`): a
//! sequence still inside its prompt feeds its next prompt token and ignores the logits, one past
//! it feeds what it generated, one that has finished (or has no turn this round) re-feeds its own
//! earlier tokens, which leaves its cache as it was.
//!
//! The cache is kept across rounds. `fed[i]` are the tokens whose keys and values sequence `i`
//! holds (a causal prefix: rewriting position `t` invalidates everything after it); a round
//! starts at the shortest common prefix of any prompt with what its sequence holds, so turn
//! `r + 1` re-reads only the answer's end and the new user turn, not the whole conversation.
//!
//! A generated answer ends at a stop token (the end-of-turn token, eos), at `--max-new-tokens`, or
//! when the sequence fills `--max-len`; a turn whose prompt does not fit ends the conversation
//! there. Ids the tokenizer does not have (a checkpoint's embedding is often padded past its
//! vocabulary) are never picked.

use std::time::Instant;

use super::chat::Message;
use super::encode::{Encoder, Skip};
use crate::backend::{Backend, Result};
use crate::model::target::Target;
use crate::rng::{self, Philox};
use crate::tensor::DType;
use crate::train::generate::pick_token;

/// How answers are generated.
#[derive(Clone, Debug)]
pub struct RegenSpec {
    /// 0 = greedy.
    pub temperature: f32,
    pub max_new_tokens: usize,
    /// Positions per sequence (prompt + answer); the cache holds this many.
    pub max_len: usize,
    /// Sampling draws are keyed by (seed, conversation, turn, position): a resumed run draws the
    /// same tokens.
    pub seed: u64,
}

/// Counts for the summary and the throughput line.
#[derive(Clone, Debug, Default)]
pub struct RegenStats {
    pub turns: u64,
    pub generated_tokens: u64,
    /// Answers cut at `--max-new-tokens` (no stop token).
    pub hit_max_new: u64,
    /// Conversations ended early because a turn did not fit in `--max-len`.
    pub cut_at_max_len: u64,
    /// Decoding steps and the rows they ran (batch x steps), and their seconds.
    pub steps: u64,
    pub rows: u64,
    pub decode_secs: f64,
}

/// One conversation of the batch.
struct Seq {
    /// Indices of its assistant turns.
    answers: Vec<usize>,
    /// Tokens whose keys and values the cache holds, positions `0..fed.len()`.
    fed: Vec<u32>,
    /// This round: the prompt, what was generated, and whether generation has ended.
    prompt: Vec<u32>,
    generated: Vec<u32>,
    active: bool,
    finished: bool,
    skip: Option<Skip>,
}

impl Seq {
    /// The token this sequence feeds at position `t`.
    fn token_at(&self, t: usize) -> u32 {
        if self.active && !self.finished {
            if t < self.prompt.len() {
                return self.prompt[t];
            }
            return self.generated[t - self.prompt.len()];
        }
        // Re-feed a held token (its cache row is rewritten with the same values) or a pad past
        // the end (a row that nothing reads).
        self.fed.get(t).copied().unwrap_or(0)
    }
}

/// Regenerates every assistant turn of `convs` in place (the batch decodes together). `keys[i]`
/// names conversation `i` for the sampling draws (its line in the input). Returns, per
/// conversation, why it cannot become a sample, if so.
#[allow(clippy::too_many_arguments)]
pub fn regenerate_batch<B: Backend>(
    be: &B,
    s: &B::Stream,
    target: &Target<B>,
    enc: &Encoder,
    convs: &mut [Vec<Message>],
    keys: &[u64],
    spec: &RegenSpec,
    stats: &mut RegenStats,
) -> Result<Vec<Option<Skip>>> {
    let n = convs.len();
    let vocab = target.shape.vocab;
    let pickable = enc.tokenizer_vocab.min(vocab);
    let mut seqs: Vec<Seq> = convs
        .iter()
        .map(|c| Seq {
            answers: (0..c.len()).filter(|&i| c[i].role == "assistant").collect(),
            fed: Vec::new(),
            prompt: Vec::new(),
            generated: Vec::new(),
            active: false,
            finished: false,
            skip: None,
        })
        .collect();
    let rounds = seqs.iter().map(|q| q.answers.len()).max().unwrap_or(0);
    if n == 0 || rounds == 0 {
        return Ok(seqs.into_iter().map(|q| q.skip).collect());
    }
    let mut cache = target.new_cache(be, s, n, spec.max_len)?;
    let mut logits = be.alloc(s, DType::F32, n * vocab)?;
    let mut tokens = be.alloc_ids(s, n)?;
    let mut greedy_ids = be.alloc_ids(s, n)?;
    for round in 0..rounds {
        // This round's prompts.
        for (i, q) in seqs.iter_mut().enumerate() {
            q.active = false;
            q.finished = false;
            q.generated.clear();
            if q.skip.is_some() || round >= q.answers.len() {
                continue;
            }
            let a = q.answers[round];
            match enc.encode_prompt(&convs[i][..a]) {
                Ok(p) if p.len() < spec.max_len && !p.is_empty() => {
                    q.prompt = p;
                    q.active = true;
                }
                Ok(_) => {
                    // The prompt alone fills --max-len: the conversation ends before this turn.
                    convs[i].truncate(a);
                    q.answers.truncate(round);
                    stats.cut_at_max_len += 1;
                }
                Err(skip) => q.skip = Some(skip),
            }
        }
        let active: Vec<usize> = (0..n).filter(|&i| seqs[i].active).collect();
        if active.is_empty() {
            continue;
        }
        // Start where the first active sequence's held tokens stop matching its prompt (at least
        // its last prompt token must be fed: its logits give the first answer token).
        let start = active
            .iter()
            .map(|&i| {
                let q = &seqs[i];
                let common = q.fed.iter().zip(&q.prompt).take_while(|(a, b)| a == b).count();
                common.min(q.prompt.len() - 1)
            })
            .min()
            .unwrap_or(0);
        let mut t = start;
        let t0 = Instant::now();
        let mut steps = 0u64;
        while t < spec.max_len && active.iter().any(|&i| !seqs[i].finished) {
            let cur: Vec<i32> = seqs.iter().map(|q| q.token_at(t) as i32).collect();
            for (q, &tok) in seqs.iter_mut().zip(&cur) {
                q.fed.truncate(t);
                q.fed.push(tok as u32);
            }
            be.upload_ids(s, &cur, &mut tokens)?;
            target.decode_step(be, s, &mut cache, &tokens, t, &mut logits)?;
            steps += 1;
            let wanted = active.iter().any(|&i| !seqs[i].finished && t + 1 >= seqs[i].prompt.len());
            if wanted {
                // Greedy: each row's argmax on the device, only the ids come down; sampling
                // needs the whole rows on the host.
                let (host, picked) = if spec.temperature <= 0.0 {
                    be.argmax_rows(s, &logits, vocab, n, pickable, &mut greedy_ids)?;
                    (Vec::new(), be.download_ids(s, &greedy_ids)?)
                } else {
                    (be.download(s, &logits)?, Vec::new())
                };
                for &i in &active {
                    let q = &mut seqs[i];
                    if q.finished || t + 1 < q.prompt.len() {
                        continue;
                    }
                    let (key, turn, pos) = (keys[i], round as u32, (t + 1) as u64);
                    let tok = match picked.get(i) {
                        Some(&id) => id.max(0) as u32,
                        None => pick_token(&host[i * vocab..i * vocab + pickable], spec.temperature, || {
                            Philox::at_block(spec.seed, [key as u32, rng::domain::DATA | (turn << 8) | 0x80], pos)
                        }),
                    };
                    q.generated.push(tok);
                    let stop = enc.stop_ids.contains(&tok);
                    if !stop && q.generated.len() >= spec.max_new_tokens {
                        stats.hit_max_new += 1;
                    }
                    // The next token would sit at position t + 2: it must fit in the cache.
                    if stop || q.generated.len() >= spec.max_new_tokens || t + 2 >= spec.max_len {
                        q.finished = true;
                    }
                }
            }
            t += 1;
        }
        stats.steps += steps;
        stats.rows += steps * n as u64;
        stats.decode_secs += t0.elapsed().as_secs_f64();
        // The answers become the conversations' text for the next round and for encoding.
        for &i in &active {
            let q = &mut seqs[i];
            stats.turns += 1;
            stats.generated_tokens += q.generated.len() as u64;
            let (answer, unfinished): (&[u32], bool) = match q.generated.last() {
                Some(last) if enc.stop_ids.contains(last) => (&q.generated[..q.generated.len() - 1], false),
                _ => (&q.generated, true),
            };
            match enc.decode(answer) {
                Ok(text) => {
                    let m = &mut convs[i][q.answers[round]];
                    m.content = text;
                    m.unfinished = unfinished;
                }
                Err(skip) => q.skip = Some(skip),
            }
        }
    }
    Ok(seqs.into_iter().map(|q| q.skip).collect())
}
