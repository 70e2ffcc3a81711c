//! From samples to one micro-batch's host arrays: sequences laid end to end for the target,
//! anchors, block inputs, labels and loss weights for the drafter (DFLASH.md sections 3-4).

use crate::rng::{self, Philox};

/// One pre-tokenized training sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub input_ids: Vec<u32>,
    /// 1 on tokens to learn (the response), 0 on the prompt.
    pub loss_mask: Vec<u8>,
}

impl Sample {
    /// Candidate anchors: positions `p` with `loss_mask[p] & loss_mask[p + 1]`.
    pub fn anchor_candidates(&self) -> Vec<usize> {
        (0..self.input_ids.len().saturating_sub(1))
            .filter(|&p| self.loss_mask[p] != 0 && self.loss_mask[p + 1] != 0)
            .collect()
    }
}

/// How a micro-batch is cut.
#[derive(Clone, Debug)]
pub struct BatchSpec {
    pub anchors_per_seq: usize,
    pub block_size: usize,
    pub mask_token_id: u32,
    /// Loss-weight decay over block slots: `w = exp(-(r - 1) / gamma)`.
    pub gamma: f32,
    /// Pad every micro-batch to exactly this many target rows (static shapes).
    pub pad_to_tokens: Option<usize>,
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("the batch holds {have} tokens, more than --pad-to-tokens {pad}; raise --pad-to-tokens or lower --batch-size / --seq-len")]
    PadTooSmall { have: usize, pad: usize },
    #[error("the batch is empty")]
    Empty,
}

/// Host arrays of one micro-batch; `train::step` uploads them.
#[derive(Clone, Debug, Default)]
pub struct HostBatch {
    // ---- target ----
    /// Token ids of every row (padding rows hold id 0).
    pub ids: Vec<i32>,
    /// Position of each row inside its sequence.
    pub pos: Vec<i32>,
    /// Row ranges of the sequences; padding rows form one extra sequence at the end.
    pub seq_starts: Vec<i32>,
    /// Rows holding real tokens; rows from here on are padding and are packed as zeros.
    pub n_valid: usize,
    // ---- drafter ----
    pub num_blocks: usize,
    /// The same number of slots per real sequence (the most anchors any sequence of the batch
    /// drew, at most `anchors_per_seq`), `-1` where a sequence drew fewer.
    pub anchors: Vec<i32>,
    pub ctx_start: Vec<i32>,
    pub block_ids: Vec<i32>,
    pub block_pos: Vec<i32>,
    /// `-1` where no token exists (slot 0, or past the sequence end).
    pub labels: Vec<i32>,
    pub weights: Vec<f32>,
    /// `sum(weights)` in f64: the step's loss is normalised by the sum over all micro-batches.
    pub weight_sum: f64,
    /// Number of real (non-padded) anchors.
    pub real_anchors: usize,
}

impl HostBatch {
    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// Slots `1..block_size` of every block of a per-slot array (`labels`, `weights`), block
    /// after block: the rows the drafter's lm_head and loss run on (slot 0 is the anchor, never
    /// predicted). Index `j * (block_size - 1) + r - 1` is slot `r` of block `j`.
    pub fn predicted<T: Copy>(&self, per_slot: &[T]) -> Vec<T> {
        let bs = per_slot.len().checked_div(self.num_blocks).unwrap_or(1);
        per_slot.chunks(bs.max(1)).flat_map(|b| b.iter().skip(1).copied()).collect()
    }
}

/// Anchor draw for one sequence: `min(N, #candidates)` candidates uniformly without replacement,
/// keyed by `(seed, step, sequence)`, sorted ascending.
pub fn sample_anchors(sample: &Sample, n: usize, seed: u64, step: u32, seq: u32) -> Vec<usize> {
    let mut cand = sample.anchor_candidates();
    let take = n.min(cand.len());
    // Domain in the low byte, the sequence's index in the step above it.
    let mut r = Philox::new(seed, [step, rng::domain::ANCHORS | (seq << 8)]);
    for i in 0..take {
        let j = i + r.below((cand.len() - i) as u64) as usize;
        cand.swap(i, j);
    }
    cand.truncate(take);
    cand.sort_unstable();
    cand
}

/// Builds one micro-batch. `seq_base` is the index of the first sample within the optimizer step
/// (so each sequence of a step draws its own anchors).
pub fn build_batch(samples: &[Sample], spec: &BatchSpec, step: u32, seq_base: u32) -> Result<HostBatch, BatchError> {
    if samples.is_empty() {
        return Err(BatchError::Empty);
    }
    let bs = spec.block_size;
    // Every sequence gets as many block slots as the batch's most anchors actually drawn (not
    // `anchors_per_seq`: a sequence with few candidates would otherwise cost all the padded
    // blocks' attention, activations and logits for nothing).
    let drawn: Vec<Vec<usize>> = samples
        .iter()
        .enumerate()
        .map(|(si, smp)| sample_anchors(smp, spec.anchors_per_seq, spec.seed, step, seq_base + si as u32))
        .collect();
    let n = drawn.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut b = HostBatch::default();
    for (smp, anchors) in samples.iter().zip(drawn) {
        let start = b.ids.len();
        b.seq_starts.push(start as i32);
        b.ids.extend(smp.input_ids.iter().map(|&t| t as i32));
        b.pos.extend(0..smp.input_ids.len() as i32);
        b.real_anchors += anchors.len();
        let len = smp.input_ids.len();
        for slot in 0..n {
            let a = anchors.get(slot).copied();
            b.anchors.push(a.map_or(-1, |a| a as i32));
            b.ctx_start.push(start as i32);
            for r in 0..bs {
                let (tok, pos, label, w) = match a {
                    None => (spec.mask_token_id as i32, 0, -1, 0.0),
                    Some(a) => {
                        let p = a + r;
                        let tok = if r == 0 { smp.input_ids[a] as i32 } else { spec.mask_token_id as i32 };
                        // Slot r predicts the token AT a + r (not a + r + 1); slot 0 is the given anchor token.
                        let label = if r > 0 && p < len { smp.input_ids[p] as i32 } else { -1 };
                        let w = if r > 0 && p < len && smp.loss_mask[p] != 0 {
                            (-((r - 1) as f32) / spec.gamma).exp()
                        } else {
                            0.0
                        };
                        (tok, p as i32, label, w)
                    }
                };
                b.block_ids.push(tok);
                b.block_pos.push(pos);
                b.labels.push(label);
                b.weights.push(w);
                b.weight_sum += f64::from(w);
            }
        }
    }
    b.n_valid = b.ids.len();
    b.num_blocks = samples.len() * n;
    if let Some(pad) = spec.pad_to_tokens {
        if b.n_valid > pad {
            return Err(BatchError::PadTooSmall { have: b.n_valid, pad });
        }
        if pad > b.n_valid {
            b.seq_starts.push(b.n_valid as i32);
            b.ids.resize(pad, 0);
            b.pos.extend(0..(pad - b.n_valid) as i32);
        }
    }
    b.seq_starts.push(b.ids.len() as i32);
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n: usize) -> BatchSpec {
        BatchSpec { anchors_per_seq: n, block_size: 4, mask_token_id: 99, gamma: 7.0, pad_to_tokens: None, seed: 5 }
    }

    fn sample(len: usize, prompt: usize) -> Sample {
        Sample {
            input_ids: (0..len as u32).map(|i| 10 + i).collect(),
            loss_mask: (0..len).map(|i| u8::from(i >= prompt)).collect(),
        }
    }

    #[test]
    fn anchors_are_sorted_unique_candidates() {
        let s = sample(40, 10);
        for step in 0..20 {
            let a = sample_anchors(&s, 8, 1, step, 0);
            assert_eq!(a.len(), 8);
            assert!(a.windows(2).all(|w| w[0] < w[1]));
            assert!(a.iter().all(|&p| p >= 10 && p + 1 < 40));
        }
        // Fewer candidates than slots: all of them.
        assert_eq!(sample_anchors(&sample(6, 3), 8, 1, 0, 0), vec![3, 4]);
        // Different steps and sequences draw differently.
        assert_ne!(sample_anchors(&s, 8, 1, 0, 0), sample_anchors(&s, 8, 1, 1, 0));
        assert_ne!(sample_anchors(&s, 8, 1, 0, 0), sample_anchors(&s, 8, 1, 0, 1));
    }

    #[test]
    fn every_candidate_is_drawn_roughly_uniformly() {
        let s = sample(22, 0); // 21 candidates
        let mut hits = [0u32; 21];
        for step in 0..3000 {
            for p in sample_anchors(&s, 3, 9, step, 0) {
                hits[p] += 1;
            }
        }
        // Expected 3000 * 3 / 21 = 428.6 per candidate.
        assert!(hits.iter().all(|&h| (340..520).contains(&h)), "{hits:?}");
    }

    #[test]
    fn labels_weights_and_padding() {
        let s = sample(12, 4);
        let b = build_batch(std::slice::from_ref(&s), &spec(2), 0, 0).unwrap();
        assert_eq!(b.num_blocks, 2);
        for j in 0..2 {
            let a = b.anchors[j] as usize;
            assert_eq!(b.block_ids[j * 4], s.input_ids[a] as i32);
            assert_eq!(b.labels[j * 4], -1);
            assert_eq!(b.weights[j * 4], 0.0);
            for r in 1..4 {
                assert_eq!(b.block_ids[j * 4 + r], 99);
                assert_eq!(b.block_pos[j * 4 + r], (a + r) as i32);
                if a + r < 12 {
                    assert_eq!(b.labels[j * 4 + r], s.input_ids[a + r] as i32);
                    assert_eq!(b.weights[j * 4 + r], (-((r - 1) as f32) / 7.0).exp());
                } else {
                    assert_eq!((b.labels[j * 4 + r], b.weights[j * 4 + r]), (-1, 0.0));
                }
            }
        }
        let padded =
            build_batch(std::slice::from_ref(&s), &BatchSpec { pad_to_tokens: Some(16), ..spec(2) }, 0, 0).unwrap();
        assert_eq!((padded.rows(), padded.n_valid), (16, 12));
        assert_eq!(padded.seq_starts, vec![0, 12, 16]);
        assert!(matches!(
            build_batch(&[s], &BatchSpec { pad_to_tokens: Some(8), ..spec(2) }, 0, 0),
            Err(BatchError::PadTooSmall { .. })
        ));
    }
}
