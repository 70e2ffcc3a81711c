//! The target -> drafter pipeline (DESIGN.md section 1): a producer thread runs the frozen target
//! and the post-processing (pack, noise, FC under split-FC) while the drafter trains on earlier
//! batches; a bounded queue of `max_inflight` micro-batches sits between them, so the target
//! blocks instead of growing memory without bound.
//!
//! Under split-FC (exact mode, DFLASH.md section 2) the fc group lives with the target: it
//! projects `X` to `Y` with the weights of the current step, receives `dY` back, computes `dWfc`,
//! reports its squared norm, and applies the same AdamW step as the drafter. Losses and weights
//! are bit-identical to the unsplit pipeline (tested).
//!
//! Failure on either side ends the run with that side's error: the other side sees its channel
//! close and stops; nothing waits forever.

pub mod slots;
pub mod stats;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::backend::{AdamStep, Backend, BackendError};
use crate::model::drafter::{fc_backward, fc_forward, ParamGroup};
use crate::model::target::Target;
use crate::train::batch::HostBatch;
use crate::train::optim::OptimConfig;
use crate::train::step::{
    global_norm, plan_update, target_pack, Context, DrafterSide, MetricSums, NoiseSpec, StepMetrics,
};
pub use stats::{PipelineStats, Trace};

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("target side (producer) failed at step {step}: {source}")]
    Producer { step: u32, source: Box<dyn std::error::Error + Send + Sync> },
    #[error("drafter side (consumer) failed at step {step}: {source}")]
    Consumer { step: u32, source: Box<dyn std::error::Error + Send + Sync> },
    #[error("drafter side (consumer) panicked at step {step}: {message}")]
    ConsumerPanic { step: u32, message: String },
    #[error("target side (producer) panicked: {message}")]
    ProducerPanic { message: String },
    #[error("could not publish step {step} micro-batch {micro} to the drafter: {reason}")]
    Publish { step: u32, micro: usize, reason: String },
    #[error("the target side stopped before step {step} arrived")]
    ProducerGone { step: u32 },
    #[error("stopped by the step callback: {0}")]
    Stopped(String),
}

/// Where the micro-batches of a step come from (a pure function of the step, so a resumed run
/// sees the same data).
pub trait BatchSource: Sync {
    fn micro_batches(&self, step: u32) -> Result<Vec<HostBatch>, Box<dyn std::error::Error + Send + Sync>>;
}

/// Test hooks: make one stage boundary fail at a given step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// The producer returns an error before running the target of this step.
    pub producer_error_at: Option<u32>,
    /// Publishing this step's first micro-batch fails (as a failed copy/put would).
    pub publish_error_at: Option<u32>,
    /// The consumer panics on receiving this step.
    pub consumer_panic_at: Option<u32>,
}

#[derive(Clone, Debug)]
pub struct PipelineConfig {
    pub max_inflight: usize,
    pub first_step: u32,
    pub end_step: u32,
    pub noise: NoiseSpec,
    pub faults: Faults,
    /// Spans of every stage, for `--trace`.
    pub trace: Option<std::sync::Arc<stats::Trace>>,
}

/// The target side: the frozen target, and the fc group under split-FC.
pub struct TargetSide<B: Backend> {
    pub target: Target<B>,
    pub fc: Option<Mutex<ParamGroup<B>>>,
}

/// What the step callback says.
pub enum Control {
    Continue,
    /// Stop after this step (Ctrl-C, a requested early end).
    Stop,
}

struct Msg<B: Backend> {
    step: u32,
    micro: usize,
    n_micro: usize,
    hb: HostBatch,
    ctx: Context<B>,
    /// The stream that wrote `ctx`: the consumer's stream waits on it before the first read.
    from: B::Stream,
}

enum Back<B: Backend> {
    Dy { dy: B::Buf, from: B::Stream },
    Update { hp: Option<AdamStep> },
}

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Runs steps `first_step..end_step`. `on_step` sees each finished step's metrics (and may
/// checkpoint); it runs on the calling thread, after the step's update.
pub fn run<B: Backend>(
    be: &B,
    tside: &TargetSide<B>,
    side: &mut DrafterSide<B>,
    source: &dyn BatchSource,
    cfg: &PipelineConfig,
    optim: &OptimConfig,
    on_step: &mut dyn FnMut(&StepMetrics, &mut DrafterSide<B>, &PipelineStats) -> Result<Control, BoxErr>,
) -> Result<PipelineStats, PipelineError> {
    let split = tside.fc.is_some();
    let (tx, rx) = mpsc::sync_channel::<Msg<B>>(cfg.max_inflight.max(1));
    let (back_tx, back_rx) = mpsc::channel::<Back<B>>();
    let (report_tx, report_rx) = mpsc::channel::<f64>();
    let depth = AtomicUsize::new(0);
    let stats = Mutex::new(PipelineStats::default());
    let started = Instant::now();

    let result = std::thread::scope(|scope| {
        let producer = scope.spawn(|| produce(be, tside, source, cfg, tx, back_rx, report_tx, &depth, &stats));
        let consumer = std::panic::catch_unwind(AssertUnwindSafe(|| {
            consume(be, side, cfg, optim, split, rx, back_tx, report_rx, &depth, &stats, started, on_step)
        }));
        let p = producer.join();
        match (consumer, p) {
            // The consumer only saw the producer's channel close: the producer's error is the cause.
            (Ok(Err(PipelineError::ProducerGone { .. })), Ok(Err(e))) => Err(e),
            (Ok(Err(PipelineError::ProducerGone { .. })), Err(panic)) => {
                Err(PipelineError::ProducerPanic { message: panic_message(&*panic) })
            }
            // The consumer's own failure is the cause; the producer then only saw a closed channel.
            (Ok(Err(e)), _) => Err(e),
            (Err(panic), _) => Err(PipelineError::ConsumerPanic {
                step: stats.lock().map(|s| s.current_step).unwrap_or(0),
                message: panic_message(&*panic),
            }),
            (Ok(Ok(())), Err(panic)) => Err(PipelineError::ProducerPanic { message: panic_message(&*panic) }),
            (Ok(Ok(())), Ok(Err(e))) => match e {
                // The consumer stopped early on purpose: the producer's send failed, that is fine.
                PipelineError::Publish { .. } | PipelineError::ProducerGone { .. }
                    if stats.lock().map(|s| s.stopped_early).unwrap_or(false) =>
                {
                    Ok(())
                }
                e => Err(e),
            },
            (Ok(Ok(())), Ok(Ok(()))) => Ok(()),
        }
    });
    let mut st = stats.into_inner().unwrap_or_default();
    st.wall = started.elapsed();
    result.map(|_| st)
}

#[allow(clippy::too_many_arguments)]
fn produce<B: Backend>(
    be: &B,
    tside: &TargetSide<B>,
    source: &dyn BatchSource,
    cfg: &PipelineConfig,
    tx: SyncSender<Msg<B>>,
    back_rx: Receiver<Back<B>>,
    report_tx: Sender<f64>,
    depth: &AtomicUsize,
    stats: &Mutex<PipelineStats>,
) -> Result<(), PipelineError> {
    // The target side computes on its own stream; the drafter's stream waits on it per batch.
    let s = be.new_stream().map_err(|e| PipelineError::Producer { step: cfg.first_step, source: Box::new(e) })?;
    let perr = |step: u32| move |e: BoxErr| PipelineError::Producer { step, source: e };
    // Split-FC: the packed X of the previous step, kept for dWfc.
    let mut prev: Option<(u32, Vec<(HostBatch, B::Buf)>)> = None;
    for step in cfg.first_step..cfg.end_step {
        if cfg.faults.producer_error_at == Some(step) {
            return Err(PipelineError::Producer { step, source: "injected fault: producer error".into() });
        }
        let t0 = Instant::now();
        let hbs = source.micro_batches(step).map_err(perr(step))?;
        let mut packed = Vec::with_capacity(hbs.len());
        for hb in hbs {
            let x = target_pack(be, &s, &tside.target, &hb, cfg.noise, step).map_err(|e| perr(step)(Box::new(e)))?;
            packed.push((hb, x));
        }
        add_time(stats, |st| &mut st.target_busy, t0.elapsed());
        if let Some(tr) = &cfg.trace {
            tr.span("target", format!("step {step}: target forward + pack"), t0);
        }
        if let Some(fc) = &tside.fc {
            // Exact split-FC: finish the previous step's fc update before projecting this step.
            if let Some((pstep, pbatches)) = prev.take() {
                let t1 = Instant::now();
                finish_fc_step(be, &s, fc, &pbatches, &back_rx, &report_tx).map_err(|e| match e {
                    FcError::Backend(e) => perr(pstep)(Box::new(e)),
                    FcError::Gone => PipelineError::ProducerGone { step: pstep },
                })?;
                add_time(stats, |st| &mut st.target_wait_fc, t1.elapsed());
                if let Some(tr) = &cfg.trace {
                    tr.span("target", format!("step {pstep}: split-FC dW + update"), t1);
                }
            }
        }
        let n_micro = packed.len();
        let mut keep = Vec::new();
        for (micro, (hb, x)) in packed.into_iter().enumerate() {
            if cfg.faults.publish_error_at == Some(step) {
                return Err(PipelineError::Publish { step, micro, reason: "injected fault: publish failed".into() });
            }
            let ctx = match &tside.fc {
                Some(fc) => {
                    let fc = fc
                        .lock()
                        .map_err(|_| PipelineError::ProducerPanic { message: "fc group lock poisoned".into() })?;
                    let hidden = tside.target.shape.hidden;
                    let mut y = be
                        .alloc(&s, crate::tensor::DType::BF16, hb.rows() * hidden)
                        .map_err(|e| perr(step)(Box::new(e)))?;
                    fc_forward(be, &s, &fc, &x, &mut y, hb.rows()).map_err(|e| perr(step)(Box::new(e)))?;
                    keep.push((hb.clone(), x));
                    Context::Projected(y)
                }
                None => Context::Packed(x),
            };
            let t2 = Instant::now();
            depth.fetch_add(1, Ordering::SeqCst);
            if tx.send(Msg { step, micro, n_micro, hb, ctx, from: s.clone() }).is_err() {
                depth.fetch_sub(1, Ordering::SeqCst);
                return Err(PipelineError::Publish { step, micro, reason: "the drafter side has stopped".into() });
            }
            add_time(stats, |st| &mut st.target_blocked, t2.elapsed());
            if let Some(tr) = &cfg.trace {
                tr.span("target (queue)", format!("step {step}.{micro}: publish (blocked while full)"), t2);
            }
            if let Ok(mut st) = stats.lock() {
                st.queue_depth.push(depth.load(Ordering::SeqCst) as u32);
            }
        }
        if tside.fc.is_some() {
            prev = Some((step, keep));
        }
    }
    if let (Some(fc), Some((pstep, pbatches))) = (&tside.fc, prev.take()) {
        finish_fc_step(be, &s, fc, &pbatches, &back_rx, &report_tx).map_err(|e| match e {
            FcError::Backend(e) => perr(pstep)(Box::new(e)),
            FcError::Gone => PipelineError::ProducerGone { step: pstep },
        })?;
    }
    Ok(())
}

enum FcError {
    Backend(BackendError),
    Gone,
}

impl From<BackendError> for FcError {
    fn from(e: BackendError) -> Self {
        FcError::Backend(e)
    }
}

/// The target side's half of a split-FC step: `dWfc += dY^T X` per micro-batch in order, report
/// `sumsq(dWfc)`, then apply the update the drafter side decided.
fn finish_fc_step<B: Backend>(
    be: &B,
    s: &B::Stream,
    fc: &Mutex<ParamGroup<B>>,
    batches: &[(HostBatch, B::Buf)],
    back_rx: &Receiver<Back<B>>,
    report_tx: &Sender<f64>,
) -> Result<(), FcError> {
    let mut fc = fc.lock().map_err(|_| FcError::Gone)?;
    fc.zero_grad(be, s)?;
    for (hb, x) in batches {
        let dy = match back_rx.recv() {
            Ok(Back::Dy { dy, from }) => {
                be.hand_over(&from, s, &[&dy])?;
                dy
            }
            _ => return Err(FcError::Gone),
        };
        fc_backward(be, s, &mut fc, &dy, x, hb.rows())?;
    }
    let mut out = be.alloc(s, crate::tensor::DType::F32, 1)?;
    fc.grad_sumsq(be, s, &mut out)?;
    let sumsq = f64::from(be.download(s, &out)?[0]);
    report_tx.send(sumsq).map_err(|_| FcError::Gone)?;
    match back_rx.recv() {
        Ok(Back::Update { hp }) => {
            if let Some(hp) = hp {
                fc.adamw(be, s, &hp)?;
            }
        }
        _ => return Err(FcError::Gone),
    }
    // Tell the drafter side the fc weights of this step are final (checkpoints read them, from
    // another stream: so the host waits for the update first).
    be.synchronize(s)?;
    report_tx.send(f64::NAN).map_err(|_| FcError::Gone)?;
    Ok(())
}

fn add_time(stats: &Mutex<PipelineStats>, f: impl FnOnce(&mut PipelineStats) -> &mut Duration, d: Duration) {
    if let Ok(mut st) = stats.lock() {
        *f(&mut st) += d;
    }
}

#[allow(clippy::too_many_arguments)]
fn consume<B: Backend>(
    be: &B,
    side: &mut DrafterSide<B>,
    cfg: &PipelineConfig,
    optim: &OptimConfig,
    split: bool,
    rx: Receiver<Msg<B>>,
    back_tx: Sender<Back<B>>,
    report_rx: Receiver<f64>,
    depth: &AtomicUsize,
    stats: &Mutex<PipelineStats>,
    started: Instant,
    on_step: &mut dyn FnMut(&StepMetrics, &mut DrafterSide<B>, &PipelineStats) -> Result<Control, BoxErr>,
) -> Result<(), PipelineError> {
    let s = be.compute_stream();
    for step in cfg.first_step..cfg.end_step {
        if let Ok(mut st) = stats.lock() {
            st.current_step = step;
        }
        let cerr = |e: BoxErr| PipelineError::Consumer { step, source: e };
        let mut sums = MetricSums::default();
        let mut pending: Vec<Msg<B>> = Vec::new();
        let mut micro = 0;
        let mut n_micro = 1;
        // All micro-batches of a step are needed before the first backward: the loss is
        // normalised by the weight sum of the whole step (DFLASH.md pitfall 8).
        while micro < n_micro {
            let t0 = Instant::now();
            let msg = rx.recv().map_err(|_| PipelineError::ProducerGone { step })?;
            depth.fetch_sub(1, Ordering::SeqCst);
            add_time(stats, |st| &mut st.drafter_wait, t0.elapsed());
            if let Some(tr) = &cfg.trace {
                tr.span("drafter (waiting)", format!("step {step}: wait for batch"), t0);
            }
            if cfg.faults.consumer_panic_at == Some(msg.step) {
                panic!("injected fault: consumer panic at step {}", msg.step);
            }
            debug_assert_eq!((msg.step, msg.micro), (step, micro));
            n_micro = msg.n_micro;
            micro += 1;
            pending.push(msg);
        }
        let total_w: f64 = pending.iter().map(|m| m.hb.weight_sum).sum();
        let grad_scale = if total_w > 0.0 { (1.0 / total_w) as f32 } else { 0.0 };
        let t1 = Instant::now();
        side.zero_grad(be, &s).map_err(|e| cerr(Box::new(e)))?;
        for msg in pending {
            let buf = match &msg.ctx {
                Context::Packed(b) | Context::Projected(b) => b,
            };
            be.hand_over(&msg.from, &s, &[buf]).map_err(|e| cerr(Box::new(e)))?;
            let dy = side.consume(be, &s, &msg.hb, &msg.ctx, grad_scale, &mut sums).map_err(|e| cerr(Box::new(e)))?;
            if let Some(dy) = dy {
                back_tx.send(Back::Dy { dy, from: s.clone() }).map_err(|_| PipelineError::ProducerGone { step })?;
            }
        }
        add_time(stats, |st| &mut st.drafter_busy, t1.elapsed());
        if let Some(tr) = &cfg.trace {
            tr.span("drafter", format!("step {step}: drafter forward + backward"), t1);
        }
        let t2 = Instant::now();
        let (body, local_fc) = side.grad_sumsq(be, &s).map_err(|e| cerr(Box::new(e)))?;
        let fc_sumsq = if split {
            report_rx.recv().map_err(|_| PipelineError::ProducerGone { step })?
        } else {
            local_fc.unwrap_or(0.0)
        };
        let norm = global_norm(fc_sumsq, body);
        let loss = if sums.weight > 0.0 { sums.loss / sums.weight } else { 0.0 };
        let hp = plan_update(optim, step, loss, norm);
        if split {
            back_tx.send(Back::Update { hp }).map_err(|_| PipelineError::ProducerGone { step })?;
        }
        let metrics = crate::train::step::apply_update(be, &s, side, hp, sums, norm, optim, step)
            .map_err(|e| cerr(Box::new(e)))?;
        if split {
            // Wait until the target side applied the same update to the fc group.
            report_rx.recv().map_err(|_| PipelineError::ProducerGone { step })?;
        }
        add_time(stats, |st| &mut st.optimizer, t2.elapsed());
        if let Some(tr) = &cfg.trace {
            tr.span("drafter", format!("step {step}: grad norm + AdamW"), t2);
        }
        let snapshot = {
            let mut st = stats.lock().map_err(|_| PipelineError::Stopped("stats lock poisoned".into()))?;
            st.steps += 1;
            st.tokens += metrics.tokens as u64;
            st.draft_positions += metrics.draft_positions as u64;
            st.skipped += u32::from(metrics.skipped);
            st.wall = started.elapsed();
            st.clone()
        };
        match on_step(&metrics, side, &snapshot).map_err(cerr)? {
            Control::Continue => {}
            Control::Stop => {
                if let Ok(mut st) = stats.lock() {
                    st.stopped_early = true;
                }
                return Ok(());
            }
        }
    }
    Ok(())
}
