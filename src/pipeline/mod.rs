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
pub mod transport;

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
use crate::train::step::{global_norm, plan_update, target_pack, Context, DrafterSide, NoiseSpec, StepMetrics};
pub use stats::{PipelineStats, Trace};
pub use transport::{Link, Parcel, Transport};

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
    #[error("setting up the {transport} transport failed: {source}")]
    Setup { transport: &'static str, source: BackendError },
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
    /// Publishing this step's first micro-batch fails (as a failed put would).
    pub publish_error_at: Option<u32>,
    /// The consumer panics on receiving this step.
    pub consumer_panic_at: Option<u32>,
    /// The transport's copy of this step's first micro-batch fails, after its slot or buffer was
    /// taken (tests that nothing leaks).
    pub copy_error_at: Option<u32>,
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
    /// How batches cross from the target to the drafter.
    pub transport: Transport,
    /// The most context rows a micro-batch can have (sizes the pinned slots).
    pub max_rows: usize,
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

/// One micro-batch in flight from the target side to the drafter side.
struct Msg<B: Backend> {
    step: u32,
    micro: usize,
    n_micro: usize,
    hb: HostBatch,
    /// `X` (packed) or, under split-FC, `Y` (projected).
    parcel: Parcel<B>,
}

enum Back<B: Backend> {
    Dy(Parcel<B>),
    Update { hp: Option<AdamStep> },
}

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// The GPU-side start and end of each stretch of target work (timed events on the target's
/// compute stream): the target's idle fraction is measured on the device, not on the host.
type TimedSpans<B> = Vec<(<B as Backend>::Event, <B as Backend>::Event)>;

/// Runs steps `first_step..end_step`: the target on `bt` (its own stream), the drafter on `bd`'s
/// compute stream, batches crossing by `cfg.transport` (`bt` and `bd` are the same backend on one
/// GPU). `on_step` sees each finished step's metrics (and may checkpoint); it runs on the calling
/// thread, after the step's update.
#[allow(clippy::too_many_arguments)]
pub fn run<B: Backend>(
    bt: &B,
    bd: &B,
    tside: &TargetSide<B>,
    side: &mut DrafterSide<B>,
    source: &dyn BatchSource,
    cfg: &PipelineConfig,
    optim: &OptimConfig,
    on_step: &mut dyn FnMut(&StepMetrics, &mut DrafterSide<B>, &PipelineStats) -> Result<Control, BoxErr>,
) -> (Result<(), PipelineError>, PipelineStats) {
    let split = tside.fc.is_some();
    let hidden = tside.target.shape.hidden;
    let width = if split { hidden } else { hidden * tside.target.taps.len() };
    let slots = cfg.max_inflight.max(1) + 3;
    let setup = |e| PipelineError::Setup { transport: cfg.transport.name(), source: e };
    let links = Link::new(cfg.transport, bt, bd, cfg.max_rows * width * 2, slots)
        .and_then(|f| Ok((f, Link::new(cfg.transport, bd, bt, cfg.max_rows * hidden * 2, slots)?)));
    let (fwd, back) = match links {
        Ok(l) => l,
        Err(e) => return (Err(setup(e)), PipelineStats::default()),
    };
    // The target's compute stream lives as long as the links' copy streams: until every buffer
    // allocated on it was freed (a freed block names its owner stream; a destroyed stream's
    // handle may come back as another stream).
    // Rule 3: it reads the target's weights (uploaded on the backend's own stream, without the
    // host waiting) only after an event that covers their upload.
    let target_stream = match bt.new_stream().and_then(|st| {
        bt.wait_event(&st, &bt.record_event(&bt.compute_stream())?)?;
        Ok(st)
    }) {
        Ok(s) => s,
        Err(e) => return (Err(setup(e)), PipelineStats::default()),
    };
    let (tx, pub_rx) = mpsc::sync_channel::<Msg<B>>(0);
    let (pub_tx, rx) = mpsc::sync_channel::<Msg<B>>(cfg.max_inflight.max(1));
    let (back_tx, back_rx) = mpsc::channel::<Back<B>>();
    let (report_tx, report_rx) = mpsc::channel::<f64>();
    let depth = AtomicUsize::new(0);
    let stats = Mutex::new(PipelineStats::default());
    let started = Instant::now();

    let (result, spans) = std::thread::scope(|scope| {
        let producer = scope.spawn(|| {
            let mut spans = Vec::new();
            let r = produce(
                bt,
                &target_stream,
                tside,
                source,
                cfg,
                &fwd,
                &back,
                tx,
                back_rx,
                report_tx,
                &stats,
                &mut spans,
            );
            (r, spans)
        });
        let publisher = scope.spawn(|| publish(&fwd, cfg, pub_rx, pub_tx, &depth, &stats));
        let consumer = std::panic::catch_unwind(AssertUnwindSafe(|| {
            consume(bd, side, cfg, optim, split, &fwd, &back, rx, back_tx, report_rx, &depth, &stats, started, on_step)
        }));
        // The drafter side failed on its own: nobody may stay blocked on a pinned slot. (When it
        // only saw the target side stop, the target side's own error is the one to report.)
        if !matches!(consumer, Ok(Ok(())) | Ok(Err(PipelineError::ProducerGone { .. }))) {
            fwd.shutdown();
            back.shutdown();
        }
        let p = producer.join();
        let pb = publisher.join();
        let (p, spans) = match p {
            Ok((r, spans)) => (Ok(r), spans),
            Err(panic) => (Err(panic), Vec::new()),
        };
        let pb = match pb {
            Ok(r) => r,
            Err(panic) => Err(PipelineError::ProducerPanic { message: panic_message(&*panic) }),
        };
        let stopped_early = stats.lock().map(|s| s.stopped_early).unwrap_or(false);
        let r = match (consumer, p) {
            // The consumer only saw the producer's channel close: the producer's (or publisher's)
            // error is the cause.
            (Ok(Err(PipelineError::ProducerGone { .. })), Ok(Err(e))) => match (e, pb) {
                // The producer only saw the publisher stop: the publisher's error is the cause.
                (PipelineError::Publish { .. }, Err(pe)) => Err(pe),
                (e, _) => Err(e),
            },
            (Ok(Err(PipelineError::ProducerGone { .. })), Ok(Ok(()))) => pb.and(Ok(())),
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
                PipelineError::Publish { .. } | PipelineError::ProducerGone { .. } if stopped_early => Ok(()),
                e => Err(e),
            },
            (Ok(Ok(())), Ok(Ok(()))) => match pb {
                Err(PipelineError::Publish { .. }) if stopped_early => Ok(()),
                other => other,
            },
        };
        (r, spans)
    });
    // The side streams die with this function; the backends' own streams, which free the weights
    // and caches later, continue only after everything enqueued on them (rule 3 at the end).
    let side_streams: [(&B, Vec<&B::Stream>); 2] = [
        (bt, vec![&target_stream, fwd.src_stream(), back.dst_stream()]),
        (bd, vec![fwd.dst_stream(), back.src_stream()]),
    ];
    for (be, streams) in side_streams {
        for st in streams {
            if let Ok(ev) = be.record_event(st) {
                let _ = be.wait_event(&be.compute_stream(), &ev);
            }
        }
    }
    let mut st = stats.into_inner().unwrap_or_default();
    st.wall = started.elapsed();
    st.transport = cfg.transport.name();
    st.bytes_moved = fwd.bytes_moved() + back.bytes_moved();
    st.copy_seconds = match (fwd.copy_seconds(), back.copy_seconds()) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
    };
    // The target's device timeline: busy = sum of its stretches, span = first start to last end.
    if let (Some(first), Some(last)) = (spans.first(), spans.last()) {
        let busy: Option<f64> = spans.iter().map(|(a, b)| bt.elapsed_secs(a, b)).sum();
        if let (Some(busy), Some(span)) = (busy, bt.elapsed_secs(&first.0, &last.1)) {
            st.target_gpu = Some((Duration::from_secs_f64(busy), Duration::from_secs_f64(span)));
        }
    }
    // Every parcel is gone by now: no slot may still be held (rule 5).
    for link in [&fwd, &back] {
        if let Some(s) = link.slot_stats() {
            st.slots_in_flight_at_end += s.in_flight;
            st.slot_waits += s.waits;
        }
    }
    if result.is_err() {
        side.discard_outputs();
    }
    (result, st)
}

/// Forwards parcels from the target side to the drafter side: the host waits for each copy to
/// complete (so the drafter only ever sees finished copies and the sources are released early),
/// then blocks on the bounded queue.
fn publish<B: Backend>(
    link: &Link<'_, B>,
    cfg: &PipelineConfig,
    rx: Receiver<Msg<B>>,
    tx: SyncSender<Msg<B>>,
    depth: &AtomicUsize,
    stats: &Mutex<PipelineStats>,
) -> Result<(), PipelineError> {
    for mut msg in rx {
        let (step, micro) = (msg.step, msg.micro);
        if cfg.faults.publish_error_at == Some(step) {
            return Err(PipelineError::Publish { step, micro, reason: "injected fault: publish failed".into() });
        }
        let t0 = Instant::now();
        link.settle(&mut msg.parcel).map_err(|e| PipelineError::Publish {
            step,
            micro,
            reason: format!("waiting for the copy: {e}"),
        })?;
        add_time(stats, |st| &mut st.publisher_wait_copy, t0.elapsed());
        if let Some(tr) = &cfg.trace {
            tr.span("publisher", format!("step {step}.{micro}: {} copy", link.kind.name()), t0);
        }
        depth.fetch_add(1, Ordering::SeqCst);
        if tx.send(msg).is_err() {
            depth.fetch_sub(1, Ordering::SeqCst);
            return Err(PipelineError::Publish { step, micro, reason: "the drafter side has stopped".into() });
        }
        if let Ok(mut st) = stats.lock() {
            st.queue_depth.push(depth.load(Ordering::SeqCst) as u32);
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn produce<B: Backend>(
    be: &B,
    s: &B::Stream,
    tside: &TargetSide<B>,
    source: &dyn BatchSource,
    cfg: &PipelineConfig,
    fwd: &Link<'_, B>,
    back: &Link<'_, B>,
    tx: SyncSender<Msg<B>>,
    back_rx: Receiver<Back<B>>,
    report_tx: Sender<f64>,
    stats: &Mutex<PipelineStats>,
    spans: &mut TimedSpans<B>,
) -> Result<(), PipelineError> {
    // The target side computes on its own stream `s`; copies run on the links' copy streams.
    let perr = |step: u32| move |e: BoxErr| PipelineError::Producer { step, source: e };
    let berr = |step: u32| move |e: BackendError| PipelineError::Producer { step, source: Box::new(e) };
    // Split-FC: the packed X of the previous step, kept for dWfc.
    let mut prev: Option<(u32, Vec<(HostBatch, B::Buf)>)> = None;
    for step in cfg.first_step..cfg.end_step {
        if cfg.faults.producer_error_at == Some(step) {
            return Err(PipelineError::Producer { step, source: "injected fault: producer error".into() });
        }
        let t0 = Instant::now();
        let hbs = source.micro_batches(step).map_err(perr(step))?;
        let t_start = be.record_timed(s).map_err(berr(step))?;
        let mut packed = Vec::with_capacity(hbs.len());
        for hb in hbs {
            let x = target_pack(be, s, &tside.target, &hb, cfg.noise, step).map_err(berr(step))?;
            packed.push((hb, x));
        }
        add_time(stats, |st| &mut st.target_busy, t0.elapsed());
        if let Some(tr) = &cfg.trace {
            tr.span("target", format!("step {step}: target forward + pack"), t0);
        }
        let mut t_start = t_start;
        if let Some(fc) = &tside.fc {
            // Exact split-FC: finish the previous step's fc update before projecting this step.
            if let Some((pstep, pbatches)) = prev.take() {
                // The wait for dY is not target work: close this stretch of the device timeline.
                if let (Some(a), Some(b)) = (t_start.take(), be.record_timed(s).map_err(berr(step))?) {
                    spans.push((a, b));
                }
                let t1 = Instant::now();
                finish_fc_step(be, s, fc, back, &pbatches, &back_rx, &report_tx).map_err(|e| match e {
                    FcError::Backend(e) => berr(pstep)(e),
                    FcError::Gone => PipelineError::ProducerGone { step: pstep },
                })?;
                add_time(stats, |st| &mut st.target_wait_fc, t1.elapsed());
                if let Some(tr) = &cfg.trace {
                    tr.span("target", format!("step {pstep}: split-FC dW + update"), t1);
                }
                t_start = be.record_timed(s).map_err(berr(step))?;
            }
        }
        let n_micro = packed.len();
        let mut keep = Vec::new();
        for (micro, (hb, x)) in packed.into_iter().enumerate() {
            let out = match &tside.fc {
                Some(fc) => {
                    let fc = fc
                        .lock()
                        .map_err(|_| PipelineError::ProducerPanic { message: "fc group lock poisoned".into() })?;
                    let hidden = tside.target.shape.hidden;
                    let mut y = be.alloc(s, crate::tensor::DType::BF16, hb.rows() * hidden).map_err(berr(step))?;
                    fc_forward(be, s, &fc, &x, &mut y, hb.rows()).map_err(berr(step))?;
                    keep.push((hb.clone(), x));
                    y
                }
                None => x,
            };
            if micro + 1 == n_micro {
                if let (Some(a), Some(b)) = (t_start.take(), be.record_timed(s).map_err(berr(step))?) {
                    spans.push((a, b));
                }
            }
            let fault = cfg.faults.copy_error_at == Some(step) && micro == 0;
            let parcel = fwd.send(s, out, fault).map_err(berr(step))?;
            let t2 = Instant::now();
            if tx.send(Msg { step, micro, n_micro, hb, parcel }).is_err() {
                return Err(PipelineError::Publish { step, micro, reason: "the drafter side has stopped".into() });
            }
            add_time(stats, |st| &mut st.target_blocked, t2.elapsed());
            if let Some(tr) = &cfg.trace {
                tr.span("target (queue)", format!("step {step}.{micro}: publish (blocked while full)"), t2);
            }
        }
        if tside.fc.is_some() {
            prev = Some((step, keep));
        }
    }
    if let (Some(fc), Some((pstep, pbatches))) = (&tside.fc, prev.take()) {
        finish_fc_step(be, s, fc, back, &pbatches, &back_rx, &report_tx).map_err(|e| match e {
            FcError::Backend(e) => berr(pstep)(e),
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

/// Buffers another device's copy still reads; `s` waited for those copies. Dropping it makes
/// the host wait for `s` first (only on an error path: the normal path already synchronised).
struct HeldUntilSync<'a, B: Backend> {
    be: &'a B,
    s: &'a B::Stream,
    bufs: Vec<B::Buf>,
}

impl<B: Backend> Drop for HeldUntilSync<'_, B> {
    fn drop(&mut self) {
        if !self.bufs.is_empty() {
            let _ = self.be.synchronize(self.s);
        }
    }
}

/// The target side's half of a split-FC step: `dWfc += dY^T X` per micro-batch in order, report
/// `sumsq(dWfc)`, then apply the update the drafter side decided.
fn finish_fc_step<B: Backend>(
    be: &B,
    s: &B::Stream,
    fc: &Mutex<ParamGroup<B>>,
    back: &Link<'_, B>,
    batches: &[(HostBatch, B::Buf)],
    back_rx: &Receiver<Back<B>>,
    report_tx: &Sender<f64>,
) -> Result<(), FcError> {
    let mut fc = fc.lock().map_err(|_| FcError::Gone)?;
    fc.zero_grad(be, s)?;
    // Sources of dY peer copies, alive until `s` (which waited for the copies) is synchronised,
    // on every path.
    let mut hold = HeldUntilSync { be, s, bufs: Vec::new() };
    for (hb, x) in batches {
        let dy = match back_rx.recv() {
            Ok(Back::Dy(parcel)) => back.receive(s, parcel, &mut hold.bufs)?,
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
    hold.bufs.clear();
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
    fwd: &Link<'_, B>,
    back: &Link<'_, B>,
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
        let berr = |e: BackendError| PipelineError::Consumer { step, source: Box::new(e) };
        let mut pending: Vec<(HostBatch, B::Buf)> = Vec::new();
        let mut micro = 0;
        let mut n_micro = 1;
        // All micro-batches of a step are needed before the first backward: the loss is
        // normalised by the weight sum of the whole step (DFLASH.md pitfall 8). Each one's H2D
        // (host transport) is enqueued as soon as it arrives.
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
            // Forward parcels are settled by the publisher: nothing is left to hold.
            let mut hold = Vec::new();
            let buf = fwd.receive(&s, msg.parcel, &mut hold).map_err(berr)?;
            debug_assert!(hold.is_empty());
            pending.push((msg.hb, buf));
        }
        let total_w: f64 = pending.iter().map(|(hb, _)| hb.weight_sum).sum();
        let grad_scale = if total_w > 0.0 { (1.0 / total_w) as f32 } else { 0.0 };
        let t1 = Instant::now();
        side.zero_grad(be, &s).map_err(berr)?;
        for (hb, buf) in pending {
            let ctx = if split { Context::Projected(buf) } else { Context::Packed(buf) };
            let dy = side.consume(be, &s, &hb, &ctx, grad_scale).map_err(berr)?;
            if let Some(dy) = dy {
                let parcel = back.send(&s, dy, false).map_err(berr)?;
                back_tx.send(Back::Dy(parcel)).map_err(|_| PipelineError::ProducerGone { step })?;
            }
        }
        let sums = side.take_metrics(be, &s).map_err(berr)?;
        add_time(stats, |st| &mut st.drafter_busy, t1.elapsed());
        if let Some(tr) = &cfg.trace {
            tr.span("drafter", format!("step {step}: drafter forward + backward"), t1);
        }
        let t2 = Instant::now();
        let (body, local_fc) = side.grad_sumsq(be, &s).map_err(berr)?;
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
        let metrics = crate::train::step::apply_update(be, &s, side, hp, sums, norm, optim, step).map_err(berr)?;
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
