//! One training step, in the pieces the pipeline moves between threads and devices:
//! target side (`TargetSide::produce`: forward with taps, pack + noise, FC under split-FC) and
//! drafter side (`DrafterSide::consume` per micro-batch, `DrafterSide::finish_step` once).

use crate::backend::{AdamStep, Backend, Result};
use crate::model::drafter::{fc_backward, fc_forward, DraftInputs, Drafter, DrafterShape, ParamGroup};
use crate::model::target::{Target, TargetInputs};
use crate::tensor::DType;
use crate::train::batch::HostBatch;
use crate::train::optim::OptimConfig;

/// The drafter's device inputs of one micro-batch, owning their buffers.
pub struct DeviceDraftBatch<B: Backend> {
    pub ctx_rows: usize,
    pub num_blocks: usize,
    pub ctx_pos: B::Ids,
    pub block_ids: B::Ids,
    pub block_pos: B::Ids,
    pub anchors: B::Ids,
    pub ctx_start: B::Ids,
    pub labels: B::Ids,
    pub weights: B::Buf,
}

impl<B: Backend> DeviceDraftBatch<B> {
    pub fn upload(be: &B, s: &B::Stream, hb: &HostBatch) -> Result<Self> {
        let ids = |v: &[i32]| -> Result<B::Ids> {
            let mut d = be.alloc_ids(s, v.len())?;
            be.upload_ids(s, v, &mut d)?;
            Ok(d)
        };
        let mut weights = be.alloc(s, DType::F32, hb.weights.len())?;
        be.upload(s, &hb.weights, &mut weights, 0)?;
        Ok(DeviceDraftBatch {
            ctx_rows: hb.rows(),
            num_blocks: hb.num_blocks,
            ctx_pos: ids(&hb.pos)?,
            block_ids: ids(&hb.block_ids)?,
            block_pos: ids(&hb.block_pos)?,
            anchors: ids(&hb.anchors)?,
            ctx_start: ids(&hb.ctx_start)?,
            labels: ids(&hb.labels)?,
            weights,
        })
    }

    pub fn inputs(&self) -> DraftInputs<'_, B> {
        DraftInputs {
            ctx_rows: self.ctx_rows,
            num_blocks: self.num_blocks,
            ctx_pos: &self.ctx_pos,
            block_ids: &self.block_ids,
            block_pos: &self.block_pos,
            anchors: &self.anchors,
            ctx_start: &self.ctx_start,
            labels: &self.labels,
            weights: &self.weights,
        }
    }
}

/// What crosses from the target side to the drafter side for one micro-batch.
pub enum Context<B: Backend> {
    /// Packed taps `X [rows, K*H]` (the default): the drafter applies FC itself.
    Packed(B::Buf),
    /// `Y = X Wfc^T [rows, H]` (split-FC): the target side keeps `X` to compute `dWfc`.
    Projected(B::Buf),
}

/// Noise settings of the pack step.
#[derive(Clone, Copy, Debug)]
pub struct NoiseSpec {
    pub std: f32,
    pub seed: u64,
}

/// Runs the target and the post-processing for one micro-batch: taps -> pack (+ noise).
pub fn target_pack<B: Backend>(
    be: &B,
    s: &B::Stream,
    target: &Target<B>,
    hb: &HostBatch,
    noise: NoiseSpec,
    step: u32,
) -> Result<B::Buf> {
    let rows = hb.rows();
    let h = target.shape.hidden;
    let ids = |v: &[i32]| -> Result<B::Ids> {
        let mut d = be.alloc_ids(s, v.len())?;
        be.upload_ids(s, v, &mut d)?;
        Ok(d)
    };
    let (tok, pos, starts) = (ids(&hb.ids)?, ids(&hb.pos)?, ids(&hb.seq_starts)?);
    let mut taps = Vec::with_capacity(target.taps.len());
    for _ in 0..target.taps.len() {
        taps.push(be.alloc(s, DType::BF16, rows * h)?);
    }
    target.forward_taps(be, s, &TargetInputs { ids: &tok, pos: &pos, seq_starts: &starts, rows }, &mut taps)?;
    let mut x = be.alloc(s, DType::BF16, rows * taps.len() * h)?;
    let refs: Vec<&B::Buf> = taps.iter().collect();
    be.pack_taps(s, &refs, &mut x, rows, h, hb.n_valid, noise.std, noise.seed, step)?;
    Ok(x)
}

/// Per-step numbers the log line shows (DFLASH.md section 4).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepMetrics {
    pub step: u32,
    /// `sum(w * CE) / sum(w)` over the whole step.
    pub loss: f64,
    /// Argmax == label over supervised slots.
    pub accuracy: f64,
    /// Mean simulated acceptance length over real blocks.
    pub accept_len: f64,
    pub grad_norm: f64,
    pub lr: f32,
    pub skipped: bool,
    pub tokens: usize,
    pub draft_positions: usize,
}

/// Host-side metric sums of a step, accumulated over its micro-batches.
#[derive(Clone, Debug, Default)]
pub struct MetricSums {
    pub loss: f64,
    pub weight: f64,
    pub correct: u64,
    pub supervised: u64,
    pub accept: f64,
    pub blocks: u64,
    pub tokens: usize,
    pub draft_positions: usize,
}

impl MetricSums {
    /// Adds another rank's sums of the same step.
    pub fn merge(&mut self, o: &MetricSums) {
        self.loss += o.loss;
        self.weight += o.weight;
        self.correct += o.correct;
        self.supervised += o.supervised;
        self.accept += o.accept;
        self.blocks += o.blocks;
        self.tokens += o.tokens;
        self.draft_positions += o.draft_positions;
    }

    /// Adds one micro-batch from its per-slot loss and argmax.
    pub fn add(&mut self, hb: &HostBatch, bs: usize, loss: &[f32], argmax: &[i32]) {
        self.loss += loss.iter().map(|&x| f64::from(x)).sum::<f64>();
        self.weight += hb.weight_sum;
        self.tokens += hb.n_valid;
        for j in 0..hb.num_blocks {
            if hb.anchors[j] < 0 {
                continue;
            }
            self.blocks += 1;
            let mut run = true;
            let mut accepted = 1.0;
            for r in 1..bs {
                let i = j * bs + r;
                let hit = hb.labels[i] >= 0 && argmax[i] == hb.labels[i];
                if hb.weights[i] > 0.0 {
                    self.supervised += 1;
                    self.correct += u64::from(hit);
                    self.draft_positions += 1;
                }
                run &= hit;
                if run {
                    accepted += 1.0;
                }
            }
            self.accept += accepted;
        }
    }
}

/// The drafter side: the body, and the fc group unless split-FC moved it to the target side.
pub struct DrafterSide<B: Backend> {
    pub drafter: Drafter<B>,
    pub fc: Option<ParamGroup<B>>,
    sumsq: B::Buf,
    /// Per micro-batch loss and argmax of this step, read back once per step (`take_metrics`) so
    /// the host never waits for the device between micro-batches.
    outputs: Vec<(HostBatch, B::Buf, B::Ids)>,
}

impl<B: Backend> DrafterSide<B> {
    pub fn new(be: &B, s: &B::Stream, drafter: Drafter<B>, fc: Option<ParamGroup<B>>) -> Result<Self> {
        Ok(DrafterSide { drafter, fc, sumsq: be.alloc(s, DType::F32, 1)?, outputs: Vec::new() })
    }

    pub fn shape(&self) -> &DrafterShape {
        &self.drafter.shape
    }

    /// Forward + backward of one micro-batch; gradients accumulate. Keeps the per-slot loss and
    /// argmax on the device for `take_metrics`; returns under split-FC the `dY` the target side
    /// needs. Enqueues work only: the host does not wait for the device here.
    pub fn consume(
        &mut self,
        be: &B,
        s: &B::Stream,
        hb: &HostBatch,
        ctx: &Context<B>,
        grad_scale: f32,
    ) -> Result<Option<B::Buf>> {
        let dev = DeviceDraftBatch::upload(be, s, hb)?;
        let rows = hb.rows();
        let h = self.drafter.shape.hidden;
        let mut dy = be.alloc(s, DType::BF16, rows * h)?;
        let out = match ctx {
            Context::Packed(x) => {
                let fc = self.fc.as_mut().expect("packed context needs the fc group on the drafter side");
                let mut y = be.alloc(s, DType::BF16, rows * h)?;
                fc_forward(be, s, fc, x, &mut y, rows)?;
                let out = self.drafter.forward_backward(be, s, &dev.inputs(), &y, grad_scale, &mut dy)?;
                fc_backward(be, s, fc, &dy, x, rows)?;
                out
            }
            Context::Projected(y) => self.drafter.forward_backward(be, s, &dev.inputs(), y, grad_scale, &mut dy)?,
        };
        self.outputs.push((hb.clone(), out.loss, out.argmax));
        Ok(match ctx {
            Context::Packed(_) => None,
            Context::Projected(_) => Some(dy),
        })
    }

    /// Reads back the loss and argmax of every micro-batch consumed since the last call (the one
    /// place per step where the host waits for the drafter's forward passes).
    pub fn take_metrics(&mut self, be: &B, s: &B::Stream) -> Result<MetricSums> {
        let mut sums = MetricSums::default();
        for (hb, loss, argmax) in self.outputs.drain(..) {
            let loss = be.download(s, &loss)?;
            let argmax = be.download_ids(s, &argmax)?;
            sums.add(&hb, self.drafter.shape.block_size, &loss, &argmax);
        }
        Ok(sums)
    }

    /// Drops the outputs of a step that will not finish (a failed run).
    pub fn discard_outputs(&mut self) {
        self.outputs.clear();
    }

    /// Sum of squared body (and local fc) gradients.
    pub fn grad_sumsq(&mut self, be: &B, s: &B::Stream) -> Result<(f64, Option<f64>)> {
        self.drafter.body.grad_sumsq(be, s, &mut self.sumsq)?;
        let body = f64::from(be.download(s, &self.sumsq)?[0]);
        let fc = match &self.fc {
            Some(fc) => {
                fc.grad_sumsq(be, s, &mut self.sumsq)?;
                Some(f64::from(be.download(s, &self.sumsq)?[0]))
            }
            None => None,
        };
        Ok((body, fc))
    }

    pub fn zero_grad(&mut self, be: &B, s: &B::Stream) -> Result<()> {
        self.drafter.body.zero_grad(be, s)?;
        if let Some(fc) = &mut self.fc {
            fc.zero_grad(be, s)?;
        }
        Ok(())
    }
}

/// The global norm from the two groups' sums of squares, always added in the same order
/// (fc first), wherever the fc group lives.
pub fn global_norm(fc_sumsq: f64, body_sumsq: f64) -> f64 {
    (fc_sumsq + body_sumsq).sqrt()
}

/// Decides the update of a step: returns the AdamW step, or `None` (skip) on a non-finite loss
/// or gradient norm (DFLASH.md pitfall 7).
pub fn plan_update(optim: &OptimConfig, step: u32, loss: f64, grad_norm: f64) -> Option<crate::backend::AdamStep> {
    if loss.is_finite() && grad_norm.is_finite() {
        Some(optim.adam_step(step, grad_norm))
    } else {
        None
    }
}

/// A whole synchronous step on one backend and one thread (the reference every pipeline must
/// reproduce bit for bit).
#[allow(clippy::too_many_arguments)]
pub fn sync_step<B: Backend>(
    be: &B,
    s: &B::Stream,
    target: &Target<B>,
    side: &mut DrafterSide<B>,
    micro: &[HostBatch],
    noise: NoiseSpec,
    optim: &OptimConfig,
    step: u32,
) -> Result<StepMetrics> {
    let total_w: f64 = micro.iter().map(|b| b.weight_sum).sum();
    let grad_scale = if total_w > 0.0 { (1.0 / total_w) as f32 } else { 0.0 };
    side.zero_grad(be, s)?;
    for hb in micro {
        let x = target_pack(be, s, target, hb, noise, step)?;
        side.consume(be, s, hb, &Context::Packed(x), grad_scale)?;
    }
    let sums = side.take_metrics(be, s)?;
    let (body, fc) = side.grad_sumsq(be, s)?;
    let norm = global_norm(fc.unwrap_or(0.0), body);
    let loss = if sums.weight > 0.0 { sums.loss / sums.weight } else { 0.0 };
    let hp = plan_update(optim, step, loss, norm);
    apply_update(be, s, side, hp, sums, norm, optim, step)
}

/// Applies a step's update to the body and the local fc group (a remote fc group is updated by
/// its owner with the same `hp`), and turns the sums into metrics.
#[allow(clippy::too_many_arguments)]
pub fn apply_update<B: Backend>(
    be: &B,
    s: &B::Stream,
    side: &mut DrafterSide<B>,
    hp: Option<AdamStep>,
    sums: MetricSums,
    norm: f64,
    optim: &OptimConfig,
    step: u32,
) -> Result<StepMetrics> {
    if let Some(hp) = &hp {
        if let Some(fc) = &mut side.fc {
            fc.adamw(be, s, hp)?;
        }
        side.drafter.body.adamw(be, s, hp)?;
    }
    let loss = if sums.weight > 0.0 { sums.loss / sums.weight } else { 0.0 };
    Ok(StepMetrics {
        step,
        loss,
        accuracy: if sums.supervised > 0 { sums.correct as f64 / sums.supervised as f64 } else { 0.0 },
        accept_len: if sums.blocks > 0 { sums.accept / sums.blocks as f64 } else { 0.0 },
        grad_norm: norm,
        lr: optim.lr_at(step),
        skipped: hp.is_none(),
        tokens: sums.tokens,
        draft_positions: sums.draft_positions,
    })
}
