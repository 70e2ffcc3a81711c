//! One training step. The target side of a micro-batch is `target_pack` (forward with taps,
//! pack + noise; the pipeline adds FC under split-FC). The drafter side of a whole step is
//! `drafter_step`, the one step driver that the synchronous path, the pipeline and data
//! parallelism all call: where the fc group lives (`FcPlace`) and which ranks share the step
//! (`RankGroup`) are its arguments, not branches in the callers.

use crate::backend::profile::{self, Region};
use crate::backend::{AdamStep, Backend, BackendError, Result};
use crate::faults::UpdateFault;
use crate::model::drafter::{fc_backward, fc_forward, DraftInputs, Drafter, DrafterShape, ParamGroup};
use crate::model::target::{Target, TargetInputs};
use crate::tensor::DType;
use crate::train::batch::HostBatch;
use crate::train::flops::{causal_pairs, DrafterFlops};
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
        // The loss runs on the predicted slots only (HostBatch::predicted).
        let w = hb.predicted(&hb.weights);
        let mut weights = be.alloc(s, DType::F32, w.len().max(1))?;
        be.upload(s, &w, &mut weights, 0)?;
        Ok(DeviceDraftBatch {
            ctx_rows: hb.rows(),
            num_blocks: hb.num_blocks,
            ctx_pos: ids(&hb.pos)?,
            block_ids: ids(&hb.block_ids)?,
            block_pos: ids(&hb.block_pos)?,
            anchors: ids(&hb.anchors)?,
            ctx_start: ids(&hb.ctx_start)?,
            labels: ids(&hb.predicted(&hb.labels))?,
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
    let _region = profile::enter(Region::Target);
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
        taps.push(be.alloc_uninit(s, DType::BF16, rows * h)?);
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
    /// Mean simulated acceptance length over real blocks (per position: every block counts once).
    pub accept_len: f64,
    /// The tokens per round real decoding gets, predicted from the same blocks (their harmonic
    /// mean: see [`MetricSums::round_accept_len`]).
    pub round_accept_len: f64,
    pub grad_norm: f64,
    pub lr: f32,
    pub skipped: bool,
    pub tokens: usize,
    pub draft_positions: usize,
    /// Causal (query, key) pairs of the step's real target sequences (the target's model FLOPs:
    /// `flops::TargetFlops::of`).
    pub causal_pairs: f64,
    /// The drafter's model FLOPs of the step (`flops::DrafterFlops`).
    pub drafter_flops: DrafterFlops,
}

/// Host-side metric sums of a step, accumulated over its micro-batches.
#[derive(Clone, Debug, Default)]
pub struct MetricSums {
    pub loss: f64,
    pub weight: f64,
    pub correct: u64,
    pub supervised: u64,
    pub accept: f64,
    /// `sum(1 / accepted)` over real blocks.
    pub inv_accept: f64,
    pub blocks: u64,
    pub tokens: usize,
    pub draft_positions: usize,
    pub causal_pairs: f64,
    pub drafter_flops: DrafterFlops,
}

impl MetricSums {
    /// Adds another rank's sums of the same step.
    pub fn merge(&mut self, o: &MetricSums) {
        self.loss += o.loss;
        self.weight += o.weight;
        self.correct += o.correct;
        self.supervised += o.supervised;
        self.accept += o.accept;
        self.inv_accept += o.inv_accept;
        self.blocks += o.blocks;
        self.tokens += o.tokens;
        self.draft_positions += o.draft_positions;
        self.causal_pairs += o.causal_pairs;
        self.drafter_flops += o.drafter_flops;
    }

    /// Adds one micro-batch of a drafter of shape `sh` from its per-slot loss and argmax.
    pub fn add(&mut self, hb: &HostBatch, sh: &DrafterShape, loss: &[f32], argmax: &[i32]) {
        let bs = sh.block_size;
        self.loss += loss.iter().map(|&x| f64::from(x)).sum::<f64>();
        self.weight += hb.weight_sum;
        self.tokens += hb.n_valid;
        self.causal_pairs += causal_pairs(hb);
        self.drafter_flops += DrafterFlops::of(sh, hb);
        for j in 0..hb.num_blocks {
            if hb.anchors[j] < 0 {
                continue;
            }
            self.blocks += 1;
            let mut run = true;
            let mut accepted = 1.0;
            for r in 1..bs {
                // argmax holds the predicted slots only (HostBatch::predicted).
                let i = j * bs + r;
                let hit = hb.labels[i] >= 0 && argmax[j * (bs - 1) + r - 1] == hb.labels[i];
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
            self.inv_accept += 1.0 / accepted;
        }
    }

    /// The acceptance length real decoding gets, tokens per verification round, predicted from
    /// the step's blocks: `blocks / sum(1 / accepted)`.
    ///
    /// The per-position mean (`accept_len`, DFLASH.md section 4) is not that number: decoding's
    /// rounds start where the previous one stopped, so a stretch of `S` tokens whose blocks
    /// accept `l` tokens each takes `S / l` rounds, and long accepted stretches take few rounds.
    /// Pooled over stretches, the tokens per round are `sum S / sum(S / l)`: the harmonic mean of
    /// the per-position acceptance (the anchors are uniform over positions). When acceptance
    /// differs between stretches of text (a cycle the drafter copies, text it cannot predict)
    /// the per-position mean overstates real decoding by a wide margin and this does not. It is
    /// exact where acceptance is constant along each stretch; where it falls towards each hard
    /// token (a sawtooth) rounds start at the hard tokens and this is below the real figure.
    pub fn round_accept_len(&self) -> f64 {
        if self.blocks > 0 && self.inv_accept > 0.0 {
            self.blocks as f64 / self.inv_accept
        } else {
            0.0
        }
    }
}

/// The drafter side: the body, and the fc group unless split-FC moved it to the target side.
pub struct DrafterSide<B: Backend> {
    pub drafter: Drafter<B>,
    pub fc: Option<ParamGroup<B>>,
    sumsq: B::Buf,
    /// `sumsq(dWfc)` of the local fc group, beside the body's for the device update plan.
    fc_sumsq: B::Buf,
    /// The device update plan of the step being applied: `[clip factor, skip]`.
    plan: B::Buf,
    /// Per micro-batch loss and argmax of this step, read back once per step so the host never
    /// waits for the device between micro-batches.
    outputs: Vec<(HostBatch, B::Buf, B::Ids)>,
    /// A step computed on the device whose update is still to be enqueued (`apply_staged`).
    staged: Option<Staged<B>>,
    /// The metrics of the last step whose update was enqueued, on their way to the host
    /// (`finish_previous`).
    pending: Option<PendingMetrics<B>>,
    /// The stream the AdamW runs on when the synchronous loop overlaps it with the next step's
    /// target forward (`overlap_updates`); None: the compute stream the caller passes.
    update_stream: Option<B::Stream>,
    /// The end of the last update enqueued on `update_stream` that the compute stream has not
    /// waited for yet (`join_update`).
    updated: Option<B::Event>,
    /// The forced hazard of the update stream (`UpdateFault`, test-only).
    hold: Option<UpdateHold<B>>,
}

/// `UpdateFault` armed: each update waits on `flag` (zeroed on the compute stream) reaching its
/// number; `held` updates were enqueued, the first `released` of them released.
struct UpdateHold<B: Backend> {
    unjoined: bool,
    flag: B::Buf,
    held: u32,
    released: u32,
}

/// A step whose forward, backward, norm and update plan are enqueued, and whose AdamW is not.
struct Staged<B: Backend> {
    hp: AdamStep,
    metrics: PendingMetrics<B>,
}

/// A step's metrics, read back one step late (the host never waits for the device in the step
/// loop) or, where the host decided the update itself, already known.
enum PendingMetrics<B: Backend> {
    Ready(StepMetrics),
    InFlight(Box<InFlight<B>>),
}

/// One async device -> host read of a step's metric sources: every slot's loss (all micro-batches
/// in one buffer), the two sums of squares, each micro-batch's argmax.
struct InFlight<B: Backend> {
    step: u32,
    optim: OptimConfig,
    batches: Vec<HostBatch>,
    read: B::Readback,
    /// The device buffers read (kept alive until the read completed).
    _keep: (B::Buf, Vec<B::Ids>),
}

impl<B: Backend> InFlight<B> {
    /// Waits for the read and computes the step's metrics exactly as the host-decided path does.
    fn finish(self, be: &B, sh: &DrafterShape) -> Result<StepMetrics> {
        let (f, argmax) = be.read_wait(self.read)?;
        let (loss, body, fc) = (&f[0], f64::from(f[1][0]), f64::from(f[2][0]));
        let mut sums = MetricSums::default();
        let mut off = 0;
        for (hb, am) in self.batches.iter().zip(&argmax) {
            sums.add(hb, sh, &loss[off..off + am.len()], am);
            off += am.len();
        }
        Ok(step_metrics(&self.optim, self.step, &sums, global_norm(fc, body)))
    }
}

/// The metrics of a step from its summed metrics and its global norm.
fn step_metrics(optim: &OptimConfig, step: u32, sums: &MetricSums, norm: f64) -> StepMetrics {
    let loss = sums.loss();
    StepMetrics {
        step,
        loss,
        accuracy: if sums.supervised > 0 { sums.correct as f64 / sums.supervised as f64 } else { 0.0 },
        accept_len: if sums.blocks > 0 { sums.accept / sums.blocks as f64 } else { 0.0 },
        round_accept_len: sums.round_accept_len(),
        grad_norm: norm,
        lr: optim.lr_at(step),
        skipped: plan_update(optim, step, loss, norm).is_none(),
        tokens: sums.tokens,
        draft_positions: sums.draft_positions,
        causal_pairs: sums.causal_pairs,
        drafter_flops: sums.drafter_flops,
    }
}

impl<B: Backend> DrafterSide<B> {
    pub fn new(be: &B, s: &B::Stream, drafter: Drafter<B>, fc: Option<ParamGroup<B>>) -> Result<Self> {
        Ok(DrafterSide {
            drafter,
            fc,
            sumsq: be.alloc(s, DType::F32, 1)?,
            fc_sumsq: be.alloc(s, DType::F32, 1)?,
            plan: be.alloc(s, DType::F32, 2)?,
            outputs: Vec::new(),
            staged: None,
            pending: None,
            update_stream: None,
            updated: None,
            hold: None,
        })
    }

    /// From now on the AdamW of each step runs on a stream of its own, so that in the synchronous
    /// loop it runs beside the next step's target forward, which reads none of the drafter's
    /// buffers (with `--offload-optimizer` the update is the moments' trip over PCIe, about 280 ms
    /// a step at the Qwen3.6-27B recipe). The update stream waits for the step's gradients and
    /// plan (an event), records its use of every buffer it touches (DESIGN.md rule 2: they are
    /// freed on the compute stream at the end), takes its offloaded moments' staging buffers from
    /// its own pool, and the compute stream waits for its end before the first drafter work of the
    /// next step (`join_update`). The same kernels on the same values: results are unchanged.
    /// `fault` arms the forced hazard of the failure tests (`UpdateFault`); the flag it needs is
    /// made on `s`.
    pub fn overlap_updates(&mut self, be: &B, s: &B::Stream, fault: UpdateFault) -> Result<()> {
        let u = be.new_stream()?;
        if fault != UpdateFault::None {
            let flag = be.alloc(s, DType::F32, 1)?;
            self.hold = Some(UpdateHold { unjoined: fault == UpdateFault::Unjoined, flag, held: 0, released: 0 });
        }
        let mut used: Vec<&B::Buf> = self.hold.iter().map(|h| &h.flag).chain(std::iter::once(&self.plan)).collect();
        for g in self.fc.iter().chain(std::iter::once(&self.drafter.body)) {
            used.extend([&g.weights, &g.master, &g.grad]);
            if let crate::model::moments::Moments::Device { m, v } = &g.moments {
                used.extend([m, v]);
            }
        }
        be.record_use(&u, &used)?;
        self.update_stream = Some(u);
        Ok(())
    }

    /// The compute stream `s` waits, on the device, for the last update enqueued on the update
    /// stream, once (nothing without one, or once waited for). Each step's first drafter work
    /// (`zero_grad`), a checkpoint's `gather` and the end of the run call it.
    pub fn join_update(&mut self, be: &B, s: &B::Stream) -> Result<()> {
        // The defect the hazard test must see: no wait (`release_update` comes later).
        if self.hold.as_ref().is_some_and(|h| h.unjoined) {
            return Ok(());
        }
        self.release_update(be, s)?;
        match self.updated.take() {
            Some(ev) => be.wait_event(s, &ev),
            None => Ok(()),
        }
    }

    /// Under `UpdateFault`: `s` releases the held updates, if one waits.
    pub fn release_update(&mut self, be: &B, s: &B::Stream) -> Result<()> {
        match &mut self.hold {
            Some(h) if h.released < h.held => {
                h.released = h.held;
                be.signal_flag(s, &h.flag, h.held)
            }
            _ => Ok(()),
        }
    }

    pub fn shape(&self) -> &DrafterShape {
        &self.drafter.shape
    }

    /// Forward + backward of one micro-batch; gradients accumulate. Keeps the per-slot loss and
    /// argmax on the device for the step's metrics; returns under split-FC the `dY` the target
    /// side needs. Enqueues work only: the host does not wait for the device here.
    pub fn consume(
        &mut self,
        be: &B,
        s: &B::Stream,
        hb: HostBatch,
        ctx: &Context<B>,
        grad_scale: f32,
    ) -> Result<Option<B::Buf>> {
        let dev = DeviceDraftBatch::upload(be, s, &hb)?;
        let rows = hb.rows();
        let h = self.drafter.shape.hidden;
        let mut dy = be.alloc_uninit(s, DType::BF16, rows * h)?;
        let out = match ctx {
            Context::Packed(x) => {
                let fc = self.fc.as_mut().expect("packed context needs the fc group on the drafter side");
                let mut y = be.alloc_uninit(s, DType::BF16, rows * h)?;
                {
                    let _fc = profile::enter(Region::Fc);
                    fc_forward(be, s, fc, x, &mut y, rows)?;
                }
                let out = self.drafter.forward_backward(be, s, &dev.inputs(), &y, grad_scale, &mut dy)?;
                let _fc = profile::enter(Region::Fc);
                fc_backward(be, s, fc, &dy, x, rows)?;
                out
            }
            Context::Projected(y) => self.drafter.forward_backward(be, s, &dev.inputs(), y, grad_scale, &mut dy)?,
        };
        self.outputs.push((hb, out.loss, out.argmax));
        Ok(match ctx {
            Context::Packed(_) => None,
            Context::Projected(_) => Some(dy),
        })
    }

    /// Reads back the loss and argmax of every micro-batch consumed since the last call (the
    /// host waits for the drafter's forward passes: the host-decided path only).
    pub fn take_metrics(&mut self, be: &B, s: &B::Stream) -> Result<MetricSums> {
        let mut sums = MetricSums::default();
        for (hb, loss, argmax) in self.outputs.drain(..) {
            let loss = be.download(s, &loss)?;
            let argmax = be.download_ids(s, &argmax)?;
            sums.add(&hb, &self.drafter.shape, &loss, &argmax);
        }
        Ok(sums)
    }

    /// Drops the outputs, the staged update and the metrics in flight of a run that stopped
    /// (a failure, or a stop decided before the staged step's update).
    pub fn discard_outputs(&mut self) {
        self.outputs.clear();
        self.staged = None;
        self.pending = None;
    }

    /// Drops the step whose update was not enqueued yet (the run stops before it).
    pub fn discard_staged(&mut self) {
        self.staged = None;
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
        self.join_update(be, s)?;
        self.drafter.body.zero_grad(be, s)?;
        if let Some(fc) = &mut self.fc {
            fc.zero_grad(be, s)?;
        }
        Ok(())
    }

    /// The device path of a step's end: the sums of squares, the update plan and an async read of
    /// the metric sources, all enqueued; the AdamW itself waits in `staged` for `apply_staged`.
    fn stage_on_device(&mut self, be: &B, s: &B::Stream, step: u32, optim: &OptimConfig) -> Result<()> {
        let outputs = std::mem::take(&mut self.outputs);
        let slots: usize = outputs.iter().map(|(_, l, _)| be.len(l)).sum();
        // Every slot's loss in one buffer: what the plan checks and what one copy reads back.
        let mut loss_all = be.alloc(s, DType::F32, slots.max(1))?;
        let mut off = 0;
        let mut weight = 0.0;
        let mut batches = Vec::with_capacity(outputs.len());
        let mut argmax = Vec::with_capacity(outputs.len());
        for (hb, loss, am) in outputs {
            let n = be.len(&loss);
            be.copy(s, &loss, 0, &mut loss_all, off, n)?;
            off += n;
            weight += hb.weight_sum;
            batches.push(hb);
            argmax.push(am);
        }
        let fc = self.fc.as_ref().expect("the device update plan needs the fc group on the drafter side");
        self.drafter.body.grad_sumsq(be, s, &mut self.sumsq)?;
        fc.grad_sumsq(be, s, &mut self.fc_sumsq)?;
        be.update_plan(s, &self.sumsq, &self.fc_sumsq, &loss_all, weight > 0.0, optim.clip, &mut self.plan)?;
        let read = {
            let ids: Vec<&B::Ids> = argmax.iter().collect();
            // The loss buffer holds `slots` values (one more, zero, when the step has none).
            be.read_async(s, &[&loss_all, &self.sumsq, &self.fc_sumsq], &ids)?
        };
        let metrics = PendingMetrics::InFlight(Box::new(InFlight {
            step,
            optim: optim.clone(),
            batches,
            read,
            _keep: (loss_all, argmax),
        }));
        // The step count and lr depend on the step index only; the clip factor and the skip come
        // from the plan on the device.
        self.staged = Some(Staged { hp: optim.adam_step(step, 0.0), metrics });
        Ok(())
    }

    /// Enqueues the AdamW of the step `drafter_step` staged (nothing when the host already
    /// applied it); its metrics become the ones `finish_previous` reads next.
    pub fn apply_staged(&mut self, be: &B, s: &B::Stream) -> Result<()> {
        let Some(st) = self.staged.take() else { return Ok(()) };
        let _opt = profile::enter(Region::Optimizer);
        let on = match &self.update_stream {
            Some(u) => {
                // The update reads the step's gradients and plan, all written on `s` so far.
                let computed = be.record_event(s)?;
                be.wait_event(u, &computed)?;
                if let Some(h) = &mut self.hold {
                    h.held += 1;
                    be.wait_flag(u, &h.flag, h.held)?;
                }
                u.clone()
            }
            None => s.clone(),
        };
        if let Some(fc) = &mut self.fc {
            fc.adamw_planned(be, &on, &st.hp, &self.plan)?;
        }
        self.drafter.body.adamw_planned(be, &on, &st.hp, &self.plan)?;
        if self.update_stream.is_some() {
            self.updated = Some(be.record_event(&on)?);
        }
        self.pending = Some(st.metrics);
        Ok(())
    }

    /// The metrics of the last step whose update was enqueued (the host waits for that step's
    /// read, long done by now while the device runs the next step), or None when there is none.
    pub fn finish_previous(&mut self, be: &B) -> Result<Option<StepMetrics>> {
        match self.pending.take() {
            None => Ok(None),
            Some(PendingMetrics::Ready(m)) => Ok(Some(m)),
            Some(PendingMetrics::InFlight(f)) => f.finish(be, &self.drafter.shape).map(Some),
        }
    }

    /// Whether a step is staged (computed, its update not yet enqueued).
    pub fn has_staged(&self) -> bool {
        self.staged.is_some()
    }
}

/// The global norm from the two groups' sums of squares, always added in the same order
/// (fc first), wherever the fc group lives.
pub fn global_norm(fc_sumsq: f64, body_sumsq: f64) -> f64 {
    (fc_sumsq + body_sumsq).sqrt()
}

/// Decides the update of a step: returns the AdamW step, or `None` (skip) on a non-finite loss
/// or gradient norm (DFLASH.md pitfall 7).
pub fn plan_update(optim: &OptimConfig, step: u32, loss: f64, grad_norm: f64) -> Option<AdamStep> {
    if loss.is_finite() && grad_norm.is_finite() {
        Some(optim.adam_step(step, grad_norm))
    } else {
        None
    }
}

/// The factor every micro-batch's gradient is scaled by: one over the loss weight of the whole
/// step (every micro-batch, every rank), so the step's loss is `sum(w * CE) / sum(w)`
/// (DFLASH.md pitfall 8). A step with no supervised slot contributes nothing.
pub fn grad_scale(step_weight: f64) -> f32 {
    if step_weight > 0.0 {
        (1.0 / step_weight) as f32
    } else {
        0.0
    }
}

impl MetricSums {
    /// The step's loss, `sum(w * CE) / sum(w)`: the one place it is normalised.
    pub fn loss(&self) -> f64 {
        if self.weight > 0.0 {
            self.loss / self.weight
        } else {
            0.0
        }
    }
}

/// Why a drafter step did not finish.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The part of the run this step waits for (the target side under split-FC, another data
    /// parallel rank) stopped: a consequence, its own error is the cause.
    #[error("{0} stopped")]
    PeerStopped(Peer),
}

/// Who a step waited for when it stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// The target side, which holds the fc group under split-FC.
    TargetSide,
    /// Another data-parallel drafter rank.
    DrafterRank,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Peer::TargetSide => "the target side",
            Peer::DrafterRank => "another drafter rank",
        })
    }
}

/// The other data-parallel drafter ranks of a step: `reduce` sums the metric sums and the
/// gradients of every rank. One rank (`SingleRank`) has nothing to sum.
pub trait RankGroup<B: Backend> {
    /// Whether this rank is the only one (the step then needs nothing from other ranks on the
    /// host, and its update is decided on the device).
    fn single(&self) -> bool {
        false
    }
    /// Every rank's metric sums and gradients summed; a group of one has nothing to add.
    fn reduce(
        &mut self,
        _be: &B,
        _s: &B::Stream,
        _side: &mut DrafterSide<B>,
        local: MetricSums,
    ) -> std::result::Result<MetricSums, StepError> {
        Ok(local)
    }
}

/// A drafter trained on one device.
pub struct SingleRank;

/// One rank whose update the host decides after reading the norm and the loss back (what every
/// single-rank step did before the device update plan; tests compare the two bit for bit).
pub struct HostDecided;

impl<B: Backend> RankGroup<B> for HostDecided {}

impl<B: Backend> RankGroup<B> for SingleRank {
    fn single(&self) -> bool {
        true
    }
}

/// The split-FC protocol as the drafter rank sees it: the fc group lives with the target side,
/// which receives each micro-batch's `dY`, reports `sumsq(dWfc)`, applies the update the
/// drafter side decided and says when it is done.
pub trait RemoteFc<B: Backend> {
    /// Hands one micro-batch's `dY` (its rows of the fc output's gradient) to the fc group.
    fn send_dy(&mut self, s: &B::Stream, dy: B::Buf) -> std::result::Result<(), StepError>;
    /// Waits for the fc group's squared gradient norm of this step.
    fn fc_sumsq(&mut self) -> std::result::Result<f64, StepError>;
    /// Tells the fc group the step's update (`None`: skipped). Only one rank decides.
    fn decide(&mut self, hp: Option<AdamStep>) -> std::result::Result<(), StepError>;
    /// Waits until the fc group applied the update of this step.
    fn await_update(&mut self) -> std::result::Result<(), StepError>;
}

/// Where the fc group lives for a run: one choice, made once.
pub enum FcPlace<'a, B: Backend> {
    /// In `DrafterSide::fc`: the drafter projects the packed taps itself.
    Local,
    /// With the target (split-FC): the drafter receives `Y` and sends `dY` back.
    Remote(&'a mut dyn RemoteFc<B>),
}

/// Host time of a step's two phases (the pipeline's stats and trace show them).
#[derive(Clone, Copy, Debug)]
pub struct StepTimes {
    /// When the first micro-batch's forward was enqueued.
    pub started: std::time::Instant,
    /// When every micro-batch's backward was enqueued (and, where the host decides the update,
    /// the metrics were read back).
    pub computed: std::time::Instant,
}

/// One optimizer step of one drafter rank, the only place a step is written: zero the
/// gradients, forward + backward every micro-batch of this rank with the step's `grad_scale`,
/// sum across ranks, take the global norm (fc group first, wherever it lives), decide and apply
/// AdamW. `micro` yields this rank's micro-batches with their context (the synchronous path runs
/// the target inside the iterator, one micro-batch at a time; the pipeline hands over received
/// parcels). `decides` marks the rank that tells a remote fc group the update.
///
/// With the fc group local and one rank, the host never waits for the device: the norm, the
/// clip factor and the skip decision are made on the device (`Backend::update_plan`), the
/// metric sources are read back asynchronously, and the AdamW is left staged. The caller then
/// reads the previous step's metrics (`DrafterSide::finish_previous`: one step late), and
/// enqueues this step's update (`DrafterSide::apply_staged`) unless it stops there; after the
/// last step `finish_previous` gives the last metrics. Under split-FC or several ranks the host
/// decides (it needs the remote norm and the other ranks' sums anyway): the update is applied
/// here and `finish_previous` gives this step's metrics at once. `step_run` is that protocol.
#[allow(clippy::too_many_arguments)]
pub fn drafter_step<B: Backend>(
    be: &B,
    s: &B::Stream,
    side: &mut DrafterSide<B>,
    step: u32,
    step_weight: f64,
    micro: impl IntoIterator<Item = std::result::Result<(HostBatch, Context<B>), StepError>>,
    ranks: &mut dyn RankGroup<B>,
    mut fc: FcPlace<'_, B>,
    decides: bool,
    optim: &OptimConfig,
) -> std::result::Result<StepTimes, StepError> {
    // A staged update the caller did not apply goes first (the order of updates is the run).
    side.apply_staged(be, s)?;
    let started = std::time::Instant::now();
    let scale = grad_scale(step_weight);
    // The first micro-batch's context before the gradients are zeroed: in the synchronous loop
    // that is the target's forward, which an update on its own stream runs beside
    // (`DrafterSide::overlap_updates`); zeroing waits for that update.
    let mut micro = micro.into_iter();
    let first = micro.next();
    {
        let _opt = profile::enter(Region::Optimizer);
        side.zero_grad(be, s)?;
    }
    for item in first.into_iter().chain(micro) {
        let (hb, ctx) = item?;
        if let (Some(dy), FcPlace::Remote(remote)) = (side.consume(be, s, hb, &ctx, scale)?, &mut fc) {
            remote.send_dy(s, dy)?;
        }
    }
    // `UpdateFault::Unjoined` only: the previous update, never waited for, runs from here.
    side.release_update(be, s)?;
    if matches!(fc, FcPlace::Local) && side.fc.is_some() && ranks.single() {
        let computed = std::time::Instant::now();
        let _opt = profile::enter(Region::Optimizer);
        side.stage_on_device(be, s, step, optim)?;
        return Ok(StepTimes { started, computed });
    }
    let local = side.take_metrics(be, s)?;
    let computed = std::time::Instant::now();
    let _opt = profile::enter(Region::Optimizer);
    let sums = ranks.reduce(be, s, side, local)?;
    let (body, local_fc) = side.grad_sumsq(be, s)?;
    let fc_sumsq = match &mut fc {
        FcPlace::Local => local_fc.unwrap_or(0.0),
        FcPlace::Remote(remote) => remote.fc_sumsq()?,
    };
    let norm = global_norm(fc_sumsq, body);
    let hp = plan_update(optim, step, sums.loss(), norm);
    if let (FcPlace::Remote(remote), true) = (&mut fc, decides) {
        remote.decide(hp)?;
    }
    if let Some(hp) = &hp {
        if let Some(fc) = &mut side.fc {
            fc.adamw(be, s, hp)?;
        }
        side.drafter.body.adamw(be, s, hp)?;
    }
    if let FcPlace::Remote(remote) = &mut fc {
        remote.await_update()?;
    }
    side.pending = Some(PendingMetrics::Ready(step_metrics(optim, step, &sums, norm)));
    Ok(StepTimes { started, computed })
}

/// A whole synchronous step on one backend and one thread (the reference every pipeline must
/// reproduce bit for bit): the target runs inside the step, one micro-batch at a time. The
/// update is left staged as `drafter_step` leaves it.
#[allow(clippy::too_many_arguments)]
pub fn sync_step<B: Backend>(
    be: &B,
    s: &B::Stream,
    target: &Target<B>,
    side: &mut DrafterSide<B>,
    micro: Vec<HostBatch>,
    noise: NoiseSpec,
    optim: &OptimConfig,
    step: u32,
) -> std::result::Result<StepTimes, StepError> {
    let step_weight: f64 = micro.iter().map(|b| b.weight_sum).sum();
    let batches = micro.into_iter().map(|hb| {
        let x = target_pack(be, s, target, &hb, noise, step)?;
        Ok((hb, Context::Packed(x)))
    });
    drafter_step(be, s, side, step, step_weight, batches, &mut SingleRank, FcPlace::Local, true, optim)
}
