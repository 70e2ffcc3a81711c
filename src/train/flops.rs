//! Model FLOPs of a training step: the step line's MFU column and the run summary's.
//!
//! What counts is the work a step has to do, once, however the engine schedules it: real tokens
//! and real blocks (padding rows and padded blocks are waste, not work), the target's forward up
//! to its deepest tap, the drafter's forward and backward, and no recomputation. Two FLOPs per
//! multiply-add:
//! - a linear layer `[m, k] x [k, n]`: `2 m n k` forward; a trained one three times that (forward,
//!   dX, dW), over distinct input rows (the drafter's layer 0 projects its mask token once); the
//!   drafter's frozen lm_head twice (forward, dX); the FC twice (forward, dW: the taps need no
//!   gradient), wherever it runs (split-FC moves it, not its work);
//! - attention: `4 * head_dim * heads` per visible (query, key) pair forward (`Q K^T` and `P V`),
//!   twice that backward (`dV`, `dP`, `dQ = dS K`, `dK = dS^T Q`; the kernels' recompute of `S`,
//!   and their second `S` and `dP` in the context-key pass, are the engine's cost, not the model's);
//! - a Gated DeltaNet layer: `6 * dk * dv` per token and value head (the recurrence's `k^T S`, its
//!   rank-one update and the output `q S`), whichever form runs it.
//!
//! Norms, RoPE, activations, the Gated DeltaNet's short convolution and gates, the loss and the
//! optimizer are left out (memory-bound, a few % of the FLOPs). MFU is model FLOPs per second
//! over the devices' measured bf16 GEMM peak ([`measure_gemm_peak`]): no peak is hard-coded
//! (STYLE.md rule 9).

use crate::backend::{Backend, Gemm, Result};
use crate::config::{Arch, LayerType};
use crate::model::drafter::DrafterShape;
use crate::model::target::TargetShape;
use crate::tensor::DType;
use crate::train::batch::HostBatch;
use crate::train::step::StepMetrics;

/// Forward FLOPs of one (query, key) pair of one head of width `head_dim`.
fn pair_flops(head_dim: usize) -> f64 {
    4.0 * head_dim as f64
}

/// The target's forward up to its deepest tap: FLOPs per token (its linear layers' GEMMs, and the
/// Gated DeltaNet recurrence of a hybrid's linear-attention layers) and per causal (query, key)
/// pair of its full-attention layers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TargetFlops {
    pub gemm_per_token: f64,
    pub recurrence_per_token: f64,
    pub per_pair: f64,
}

impl TargetFlops {
    /// Layers `0..=last` of `sh`.
    pub fn new(sh: &TargetShape, last: usize) -> Self {
        let (h, qw, kw, inter) = (sh.hidden as f64, sh.q_width() as f64, sh.kv_width() as f64, sh.inter as f64);
        let mlp = 2.0 * (h * 2.0 * inter + inter * h);
        let attn_pair = pair_flops(sh.head_dim) * sh.heads as f64;
        let mut f = TargetFlops { gemm_per_token: 0.0, recurrence_per_token: 0.0, per_pair: 0.0 };
        for l in 0..=last.min(sh.layers.saturating_sub(1)) {
            f.gemm_per_token += mlp;
            let kind = match &sh.arch {
                Arch::Qwen3 => None,
                Arch::Qwen35(hy) => Some((hy, hy.layer_types[l])),
            };
            match kind {
                // q, k, v (one GEMM), o.
                None => {
                    f.gemm_per_token += 2.0 * (h * (qw + 2.0 * kw) + qw * h);
                    f.per_pair += attn_pair;
                }
                // q | gate, k, v, o.
                Some((_, LayerType::Full)) => {
                    f.gemm_per_token += 2.0 * (h * (2.0 * qw + 2.0 * kw) + qw * h);
                    f.per_pair += attn_pair;
                }
                // in_proj_qkv, in_proj_z, in_proj_b | a, out_proj; the recurrence.
                Some((hy, LayerType::Linear)) => {
                    let (c, vd, hv) = (hy.conv_dim() as f64, hy.value_dim() as f64, hy.linear_num_value_heads as f64);
                    f.gemm_per_token += 2.0 * (h * (c + vd + 2.0 * hv) + vd * h);
                    f.recurrence_per_token += 6.0 * (hy.linear_key_head_dim * hy.linear_value_head_dim) as f64 * hv;
                }
            }
        }
        f
    }

    /// The forward's FLOPs over `tokens` tokens whose sequences hold `pairs` causal pairs.
    pub fn of(&self, tokens: usize, pairs: f64) -> f64 {
        (self.gemm_per_token + self.recurrence_per_token) * tokens as f64 + self.per_pair * pairs
    }
}

/// Causal (query, key) pairs of the batch's real sequences: `L (L + 1) / 2` each.
pub fn causal_pairs(hb: &HostBatch) -> f64 {
    hb.seq_starts
        .windows(2)
        .filter(|w| w[1] as usize <= hb.n_valid)
        .map(|w| {
            let l = f64::from(w[1] - w[0]);
            l * (l + 1.0) / 2.0
        })
        .sum()
}

/// (query, key) pairs the drafter's attention sees in one layer (`window`: a sliding one), over
/// the batch's real blocks: slot `r` of a block anchored at `a` sees `a` context rows and every
/// block row in a full layer; in a sliding one the context rows within `window - 1 - r` of it and
/// the block rows up to itself (DFLASH.md section 3).
pub fn drafter_pairs(hb: &HostBatch, block_size: usize, window: Option<usize>) -> f64 {
    let bs = block_size;
    hb.anchors
        .iter()
        .filter(|&&a| a >= 0)
        .map(|&a| {
            let a = a as usize;
            match window {
                None => (bs * (a + bs)) as f64,
                Some(w) => (0..bs).map(|r| (a.min(w.saturating_sub(1 + r)) + r + 1) as f64).sum(),
            }
        })
        .sum()
}

/// The drafter's training FLOPs for one micro-batch: its GEMMs (FC, every layer forward and
/// backward, the lm_head on the predicted slots) and its attention.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DrafterFlops {
    pub gemm: f64,
    pub attention: f64,
}

impl DrafterFlops {
    pub fn of(sh: &DrafterShape, hb: &HostBatch) -> Self {
        let (h, qw, kw, inter) = (sh.hidden as f64, sh.q_width() as f64, sh.kv_width() as f64, sh.inter as f64);
        let bs = sh.block_size;
        let tc = hb.n_valid as f64;
        let tb = (hb.real_anchors * bs) as f64;
        let fc = 2.0 * 2.0 * tc * sh.fc_in() as f64 * h;
        // Per layer: q, k and v of the block rows, o, gate | up, down; k and v of the context rows.
        let linear = tb * (h * qw + 2.0 * h * kw + qw * h + h * 2.0 * inter + inter * h) + tc * 2.0 * h * kw;
        // Layer 0's block rows hold the anchors' tokens and one mask token repeated: its queries,
        // keys and values need those distinct rows only (forward, dX, dW), plus the sums of the
        // mask slots' gradients (a GEMV each; `drafter::SharedRows`).
        let first_layer_saving = if bs > 1 && hb.real_anchors > 0 {
            let distinct = (hb.real_anchors + 1) as f64;
            3.0 * 2.0 * (tb - distinct) * h * (qw + 2.0 * kw) - 2.0 * tb * (qw + 2.0 * kw)
        } else {
            0.0
        };
        let lm_head = 2.0 * 2.0 * (hb.real_anchors * bs.saturating_sub(1)) as f64 * sh.vocab as f64 * h;
        // Forward and backward: three times the forward's pair FLOPs.
        let per_pair = pair_flops(sh.head_dim) * sh.heads as f64 * 3.0;
        // Layer l is full attention unless `windows` gives it a window (as the drafter reads it).
        let window = |l: usize| sh.windows.get(l).copied().flatten();
        DrafterFlops {
            gemm: fc + sh.layers as f64 * 3.0 * 2.0 * linear - first_layer_saving + lm_head,
            attention: (0..sh.layers).map(|l| per_pair * drafter_pairs(hb, bs, window(l))).sum(),
        }
    }

    pub fn total(&self) -> f64 {
        self.gemm + self.attention
    }
}

impl std::ops::AddAssign for DrafterFlops {
    fn add_assign(&mut self, o: Self) {
        self.gemm += o.gemm;
        self.attention += o.attention;
    }
}

/// Model FLOPs utilisation of training steps: the target's model and the peak of the devices the
/// run uses.
#[derive(Clone, Debug)]
pub struct Mfu {
    pub target: TargetFlops,
    /// FLOP/s: the measured peak of one device times the devices the run uses.
    pub peak: f64,
    /// How the peak was measured (or that it was given), for the summary.
    pub peak_source: String,
    /// Measured on the device (`measure_gemm_peak`), not given (`--mfu-peak`).
    pub measured: bool,
}

impl Mfu {
    /// A step's model FLOPs.
    pub fn step_flops(&self, m: &StepMetrics) -> f64 {
        self.target.of(m.tokens, m.causal_pairs) + m.drafter_flops.total()
    }

    /// The step's MFU in percent, over `secs` seconds.
    pub fn percent(&self, m: &StepMetrics, secs: f64) -> f64 {
        100.0 * self.step_flops(m) / secs.max(1e-12) / self.peak
    }
}

/// `n` bf16 values uniform in [-1, 1) from a 64-bit LCG seeded by `seed`, uploaded in chunks of
/// 2^22 (16 MiB of host memory at a time): the operands of a timed GEMM (all-zero ones draw less
/// power, so the clocks, and the GEMM's TFLOP/s, would be flattered). The bench's GEMMs use it too.
pub fn gemm_operand<B: Backend>(be: &B, s: &B::Stream, n: usize, seed: u64) -> Result<B::Buf> {
    let mut b = be.alloc_uninit(s, DType::BF16, n)?;
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for off in (0..n).step_by(1 << 22) {
        let host: Vec<f32> = (off..(off + (1 << 22)).min(n))
            .map(|_| {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect();
        be.upload(s, &host, &mut b, off)?;
    }
    Ok(b)
}

/// The bf16 GEMM rate of `be` (FLOP/s): ten `n x n x n` GEMMs of random operands timed with
/// device events after two warm-up calls (the bench's peak takes ten too). `None` where the
/// backend has no device clock (the CPU: a reference implementation, whose MFU would say
/// nothing). A short burst: the clocks are at their highest, as in the bench's
/// `cuBLASLt bf16 8192^3` peak.
pub fn measure_gemm_peak<B: Backend>(be: &B, n: usize) -> Result<Option<f64>> {
    let s = be.compute_stream();
    if be.record_timed(&s)?.is_none() {
        return Ok(None);
    }
    let (a, b) = (gemm_operand(be, &s, n * n, 1)?, gemm_operand(be, &s, n * n, 2)?);
    let mut c = be.alloc_uninit(&s, DType::BF16, n * n)?;
    let g = Gemm::linear(n, n, n);
    for _ in 0..2 {
        be.gemm(&s, &g, &a, 0, &b, 0, &mut c, 0)?;
    }
    const CALLS: usize = 10;
    let Some(start) = be.record_timed(&s)? else { return Ok(None) };
    for _ in 0..CALLS {
        be.gemm(&s, &g, &a, 0, &b, 0, &mut c, 0)?;
    }
    let end = be.record_timed(&s)?;
    be.synchronize(&s)?;
    let secs = end.and_then(|e| be.elapsed_secs(&start, &e));
    Ok(secs.filter(|&t| t > 0.0).map(|t| CALLS as f64 * 2.0 * (n as f64).powi(3) / t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HybridConfig;

    fn batch(lens: &[usize], pad: usize, anchors: &[i32]) -> HostBatch {
        let mut hb = HostBatch::default();
        let mut start = 0;
        for &l in lens {
            hb.seq_starts.push(start as i32);
            start += l;
        }
        hb.n_valid = start;
        if pad > 0 {
            hb.seq_starts.push(start as i32);
        }
        hb.seq_starts.push((start + pad) as i32);
        hb.ids = vec![0; start + pad];
        hb.anchors = anchors.to_vec();
        hb.num_blocks = anchors.len();
        hb.real_anchors = anchors.iter().filter(|&&a| a >= 0).count();
        hb
    }

    fn dense(layers: usize) -> TargetShape {
        TargetShape {
            hidden: 8,
            layers,
            heads: 4,
            kv_heads: 2,
            head_dim: 2,
            inter: 16,
            vocab: 50,
            eps: 1e-6,
            rope_theta: 1e4,
            tied_embeddings: false,
            arch: Arch::Qwen3,
        }
    }

    #[test]
    fn causal_pairs_count_real_sequences_only() {
        // Sequences of 3 and 2 tokens, then 4 padding rows: 6 + 3 pairs.
        let hb = batch(&[3, 2], 4, &[]);
        assert_eq!(causal_pairs(&hb), 9.0);
        assert_eq!(causal_pairs(&batch(&[1], 0, &[])), 1.0);
    }

    #[test]
    fn drafter_pairs_follow_the_mask() {
        let bs = 4;
        // Anchor 5: every slot sees 5 context rows and 4 block rows; a padded block sees nothing.
        let hb = batch(&[10], 0, &[5, -1]);
        assert_eq!(drafter_pairs(&hb, bs, None), 36.0);
        // Window 4: slot r sees min(5, 3 - r) context rows and r + 1 block rows:
        // (3 + 1) + (2 + 2) + (1 + 3) + (0 + 4) = 16.
        assert_eq!(drafter_pairs(&hb, bs, Some(4)), 16.0);
        // A window wider than the context is the full context, causal inside the block.
        assert_eq!(drafter_pairs(&hb, bs, Some(100)), (4 * 5 + 1 + 2 + 3 + 4) as f64);
    }

    #[test]
    fn target_flops_by_hand() {
        // Dense, hidden 8, q width 8, kv width 4, mlp 16: per layer
        // 2 (8 (8 + 8) + 8 * 8) + 2 (8 * 32 + 16 * 8) = 384 + 768 = 1152 per token, 4 * 2 * 4 = 32
        // per pair. Layers 0..=1 of 3.
        let f = TargetFlops::new(&dense(3), 1);
        assert_eq!(f, TargetFlops { gemm_per_token: 2.0 * 1152.0, recurrence_per_token: 0.0, per_pair: 2.0 * 32.0 });
        assert_eq!(f.of(10, 55.0), 2.0 * 1152.0 * 10.0 + 2.0 * 32.0 * 55.0);
        // The last layer is clamped to the model's.
        assert_eq!(TargetFlops::new(&dense(3), 7), TargetFlops::new(&dense(3), 2));
        // The hybrid: layer 0 linear, layer 1 full. Linear: 2 heads of dk = dv = 2 (key dim 4,
        // value dim 4, conv dim 12): 2 (8 (12 + 4 + 4) + 4 * 8) + 6 * 4 * 2 = 384 + 48; full:
        // 2 (8 (16 + 8) + 8 * 8) = 512; the MLP 768 each.
        let hy = HybridConfig {
            layer_types: vec![LayerType::Linear, LayerType::Full],
            linear_num_key_heads: 2,
            linear_num_value_heads: 2,
            linear_key_head_dim: 2,
            linear_value_head_dim: 2,
            linear_conv_kernel_dim: 4,
            partial_rotary_factor: 0.25,
        };
        let f = TargetFlops::new(&TargetShape { arch: Arch::Qwen35(hy), ..dense(2) }, 1);
        assert_eq!(
            f,
            TargetFlops { gemm_per_token: 384.0 + 512.0 + 2.0 * 768.0, recurrence_per_token: 48.0, per_pair: 32.0 }
        );
    }
}
