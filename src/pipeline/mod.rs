//! The target -> drafter pipeline (DESIGN.md section 1): producer threads run the frozen target
//! and the post-processing (pack, noise, FC under split-FC) while the drafter trains on earlier
//! batches; bounded queues of `max_inflight` micro-batches sit between them, so a target blocks
//! instead of growing memory without bound.
//!
//! Topology: one producer per target GPU, steps assigned round-robin (step k to target
//! k mod T); one consumer per drafter GPU (data parallel: micro-batch m of a step goes to rank
//! m mod D, gradients are summed across ranks by the backend's all-reduce before the grad norm,
//! and the loss is normalised by the weight of the whole step). Every (target, drafter) pair has
//! its own link and queue, so no queue mixes producers and a rank always knows where its next
//! micro-batch comes from.
//!
//! Under split-FC (exact mode, DFLASH.md section 2) the fc group lives with the (single) target:
//! it projects `X` to `Y` with the weights of the current step, receives `dY` back, computes
//! `dWfc`, reports its squared norm, and applies the same AdamW step as the drafter. Losses and
//! weights are bit-identical to the unsplit pipeline (tested).
//!
//! `lockstep` is the synchronous reference at any topology: a target starts step k only after the
//! drafter finished step k - 1, so nothing overlaps; the async run must match it bit for bit.
//!
//! Failure on any thread ends the run with that thread's error: the others see their channel
//! close or their meeting point abort, and stop; nothing waits forever.

mod exchange;
pub mod slots;
pub mod stats;
pub mod transport;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::backend::slots::SlotMemory as _;
use crate::backend::{AdamStep, Backend, BackendError};
use crate::faults::FaultPlan;
use crate::model::drafter::{fc_backward, fc_forward, ParamGroup};
use crate::model::target::Target;
use crate::tensor::DType;
use crate::train::batch::HostBatch;
use crate::train::optim::OptimConfig;
use crate::train::step::{
    drafter_step, target_pack, Context, DrafterSide, FcPlace, MetricSums, NoiseSpec, Peer, RankGroup, RemoteFc,
    StepError, StepMetrics,
};
pub use exchange::{Exchange, Gate};
pub use stats::{DeviceTimeline, PipelineStats, Trace};
pub use transport::{Link, Parcel, Transport};

/// Why a micro-batch could not be published.
#[derive(Debug, thiserror::Error)]
pub enum PublishFailure {
    /// The receiving drafter rank is gone: a consequence of its own failure, not a cause.
    #[error("the drafter side has stopped")]
    ReceiverGone,
    #[error("waiting for the copy: {0}")]
    Copy(BackendError),
    #[error("injected fault: publish failed")]
    Injected,
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    // `cause`, not `source`: the message already includes it, and a `source` would print it twice
    // in an error chain.
    #[error("target side (producer) failed at step {}: {cause}", .step + 1)]
    Producer { step: u32, cause: Box<dyn std::error::Error + Send + Sync> },
    #[error("drafter side (consumer) failed at step {}: {cause}", .step + 1)]
    Consumer { step: u32, cause: Box<dyn std::error::Error + Send + Sync> },
    #[error("drafter side (consumer) panicked at step {}: {message}", .step + 1)]
    ConsumerPanic { step: u32, message: String },
    #[error("target side (producer) panicked: {message}")]
    ProducerPanic { message: String },
    #[error("could not publish step {} micro-batch {micro} to the drafter: {reason}", .step + 1)]
    Publish { step: u32, micro: usize, reason: PublishFailure },
    #[error("the target side stopped before step {} arrived", .step + 1)]
    ProducerGone { step: u32 },
    #[error("{0}")]
    Aborted(String),
    #[error("setting up the {transport} transport failed: {source}")]
    Setup { transport: String, source: BackendError },
    #[error("{0}")]
    Config(String),
    #[error("stopped by the step callback: {0}")]
    Stopped(String),
}

impl PipelineError {
    /// Errors that only report another thread's stop (the cause is elsewhere).
    fn is_consequence(&self) -> bool {
        match self {
            PipelineError::ProducerGone { .. } | PipelineError::Aborted(_) => true,
            PipelineError::Publish { reason, .. } => matches!(reason, PublishFailure::ReceiverGone),
            _ => false,
        }
    }
}

/// Where the micro-batches of a step come from (a pure function of the step, so a resumed run
/// sees the same data).
pub trait BatchSource: Sync {
    fn micro_batches(&self, step: u32) -> Result<Vec<HostBatch>, Box<dyn std::error::Error + Send + Sync>>;
}

#[derive(Clone, Debug)]
pub struct PipelineConfig {
    pub max_inflight: usize,
    pub first_step: u32,
    pub end_step: u32,
    pub noise: NoiseSpec,
    pub faults: FaultPlan,
    /// Spans of every stage, for `--trace`.
    pub trace: Option<std::sync::Arc<stats::Trace>>,
    /// How batches cross from a target to a drafter (None: `Transport::auto` per pair).
    pub transport: Option<Transport>,
    /// The most context rows a micro-batch can have (sizes the pinned slots).
    pub max_rows: usize,
    /// The synchronous reference: no step overlaps another (see the module docs).
    pub lockstep: bool,
}

/// The target side: the frozen target, and the fc group under split-FC.
pub struct TargetSide<B: Backend> {
    pub target: Target<B>,
    pub fc: Option<Mutex<ParamGroup<B>>>,
}

/// One target GPU.
pub struct TargetRank<'a, B: Backend> {
    pub be: &'a B,
    pub side: &'a TargetSide<B>,
}

/// One data-parallel drafter GPU; every rank starts from the same weights.
pub struct DrafterRank<'a, B: Backend> {
    pub be: &'a B,
    pub side: &'a mut DrafterSide<B>,
    pub comm: B::Comm,
}

/// What the step callback says.
pub enum Control {
    Continue,
    /// Stop after this step (Ctrl-C, a requested early end).
    Stop,
}

/// One micro-batch in flight from a target to a drafter rank.
struct Msg<B: Backend> {
    step: u32,
    micro: usize,
    n_micro: usize,
    /// The loss weight of the whole step (every micro-batch, every rank): the normaliser.
    step_weight: f64,
    hb: HostBatch,
    /// `X` (packed) or, under split-FC, `Y` (projected).
    parcel: Parcel<B>,
}

/// Split-FC, drafter rank -> target side.
enum Back<B: Backend> {
    /// One micro-batch's `dY`, in micro-batch order.
    Dy(Parcel<B>),
    /// The step's update as rank 0 decided it (`None`: skipped).
    Update { hp: Option<AdamStep> },
}

/// Split-FC, target side -> every drafter rank.
enum Report {
    /// `sumsq(dWfc)` of the step, for the global norm.
    FcSumsq(f64),
    /// The fc group holds this step's updated weights.
    UpdateApplied,
}

type BoxErr = Box<dyn std::error::Error + Send + Sync>;
type OnStep<'f, B> = dyn FnMut(&StepMetrics, &mut DrafterSide<B>, &PipelineStats) -> Result<Control, BoxErr> + 'f;

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// The GPU-side start and end of each stretch of target work (timed events on the target's
/// compute stream): the target's idle fraction is measured on the device, not on the host.
type TimedSpans<B> = Vec<(<B as Backend>::Event, <B as Backend>::Event)>;
/// A target's stretches of work on its stream (timed events), each with the host time its thread
/// spent waiting on the drafter side (a full queue, no free pinned slot; split-FC's dY, norm and
/// update) since the previous stretch closed.
type TargetSpans<B> = Vec<(<B as Backend>::Event, <B as Backend>::Event, Duration)>;

/// A thread's track name in the trace: `base`, or `base i` when there are several.
fn track(base: &str, i: usize, n: usize) -> String {
    if n == 1 {
        base.to_string()
    } else {
        format!("{base} {i}")
    }
}

/// Which target runs `step` (round-robin from the first step).
fn owner(cfg: &PipelineConfig, step: u32, targets: usize) -> usize {
    (step - cfg.first_step) as usize % targets
}

/// The forced hazard of the NaN suite (`FaultPlan::hold_reads_at`): the drafter's stream waits
/// on `flag` before reading step `step`'s batch; the target thread starts its next step only
/// after the drafter side dropped that batch, and signals `flag` on its stream after that
/// step's pack. So the target allocates and writes while the batch is still to be read: with
/// the allocator's cross-stream deferral the batch's memory is not reused (the losses stay
/// bit-identical); without it (unsafe-reuse) the drafter reads the next step's data, every time.
struct HeldReads<B: Backend> {
    step: u32,
    flag: B::Buf,
    freed: Mutex<bool>,
    cv: std::sync::Condvar,
}

impl<B: Backend> HeldReads<B> {
    fn mark_freed(&self) {
        if let Ok(mut f) = self.freed.lock() {
            *f = true;
        }
        self.cv.notify_all();
    }

    /// Waits until the held batch was dropped (bounded: a run that stopped before it goes on).
    fn wait_freed(&self) {
        let Ok(mut f) = self.freed.lock() else { return };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !*f && Instant::now() < deadline {
            match self.cv.wait_timeout(f, Duration::from_millis(100)) {
                Ok((g, _)) => f = g,
                Err(_) => return,
            }
        }
    }
}

/// What every thread of a run shares.
struct Shared<'a> {
    cfg: &'a PipelineConfig,
    optim: &'a OptimConfig,
    split: bool,
    targets: usize,
    ranks: usize,
    depth: AtomicUsize,
    stats: Mutex<PipelineStats>,
    started: Instant,
    sums: Exchange<MetricSums>,
    control: Exchange<bool>,
    gate: Gate,
    /// Some thread failed and the meeting points were aborted: errors seen from now on are
    /// consequences, not causes.
    failed: std::sync::atomic::AtomicBool,
}

impl Shared<'_> {
    /// A thread failed on its own account: what fails from now on is a consequence.
    fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
        self.abort_meetings();
    }

    /// Releases every thread that could wait for a stopped one.
    fn abort_meetings(&self) {
        self.sums.abort();
        self.control.abort();
        self.gate.abort();
    }
}

/// Runs steps `first_step..end_step` with one producer per target and one consumer per drafter
/// rank (the same backend may appear on both sides: one GPU). `on_step` sees each finished step's
/// metrics with rank 0's drafter side (and may checkpoint); it runs on the calling thread, after
/// the step's update.
pub fn run<B: Backend>(
    targets: &[TargetRank<'_, B>],
    drafters: Vec<DrafterRank<'_, B>>,
    source: &dyn BatchSource,
    cfg: &PipelineConfig,
    optim: &OptimConfig,
    on_step: &mut OnStep<'_, B>,
) -> (Result<(), PipelineError>, PipelineStats) {
    let (nt, nd) = (targets.len(), drafters.len());
    let fail = |e: PipelineError| (Err(e), PipelineStats::default());
    if nt == 0 || nd == 0 {
        return fail(PipelineError::Config("the pipeline needs at least one target and one drafter".into()));
    }
    let split = targets[0].side.fc.is_some();
    if split && nt > 1 {
        return fail(PipelineError::Config(format!(
            "split-FC keeps the fc group with the target and needs one target GPU (got {nt}): give one --target-gpus or drop --split-fc-layers"
        )));
    }
    let dbes: Vec<&B> = drafters.iter().map(|d| d.be).collect();
    // The group's communicators stay here, so any thread can abort all of them: a rank that
    // stops must release the others from a collective they already entered.
    let mut comms = Vec::with_capacity(nd);
    let mut drafter_sides = Vec::with_capacity(nd);
    for d in drafters {
        comms.push(d.comm);
        drafter_sides.push((d.be, d.side));
    }

    let (fwd, back) = match make_links(targets, &dbes, cfg, split) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let mut names: Vec<&'static str> = fwd.iter().flatten().map(|l| l.kind.name()).collect();
    names.sort_unstable();
    names.dedup();
    let transport_name = names.join("+");
    let target_streams = match make_target_streams(targets) {
        Ok(s) => s,
        Err(e) => return fail(PipelineError::Setup { transport: transport_name.clone(), source: e }),
    };

    let hold = match make_hold(targets, &dbes, &target_streams, cfg) {
        Ok(h) => h,
        Err(e) => return fail(e),
    };
    let hold_ref = hold.as_ref();

    // producer p -> publisher p (rendezvous); publisher p -> rank r (bounded, one per pair).
    let mut prod_tx = Vec::new();
    let mut pub_rx = Vec::new();
    let mut pub_tx: Vec<Vec<SyncSender<Msg<B>>>> = Vec::new();
    let mut cons_rx: Vec<Vec<Receiver<Msg<B>>>> = (0..nd).map(|_| Vec::new()).collect();
    for _ in 0..nt {
        let (tx, rx) = mpsc::sync_channel::<Msg<B>>(0);
        prod_tx.push(tx);
        pub_rx.push(rx);
        let mut row = Vec::new();
        for rxs in cons_rx.iter_mut() {
            let (tx, rx) = mpsc::sync_channel::<Msg<B>>(cfg.max_inflight.max(1));
            row.push(tx);
            rxs.push(rx);
        }
        pub_tx.push(row);
    }
    // Split-FC: rank r -> the target (dY, and rank 0's update), the target -> rank r (reports).
    let (mut back_tx, mut back_rx, mut report_tx, mut report_rx) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..nd {
        let (a, b) = mpsc::channel::<Back<B>>();
        back_tx.push(a);
        back_rx.push(b);
        let (c, d) = mpsc::channel::<Report>();
        report_tx.push(c);
        report_rx.push(d);
    }
    let shared = Shared {
        cfg,
        optim,
        split,
        targets: nt,
        ranks: nd,
        depth: AtomicUsize::new(0),
        stats: Mutex::new(PipelineStats::default()),
        started: Instant::now(),
        sums: Exchange::new(nd),
        control: Exchange::new(nd),
        gate: Gate::new(cfg.first_step),
        failed: std::sync::atomic::AtomicBool::new(false),
    };
    let sh = &shared;
    let (fwd_ref, back_ref) = (&fwd, &back);
    let shutdown_links = || {
        for l in fwd_ref.iter().flatten().chain(back_ref.iter()) {
            l.shutdown();
        }
    };
    let comms_ref = &comms;
    let dbes_ref = &dbes;
    let on_failure = || {
        shutdown_links();
        for (be, c) in dbes_ref.iter().zip(comms_ref) {
            be.comm_abort(c);
        }
    };

    let (result, spans, allreduce) = std::thread::scope(|scope| {
        let mut producers = Vec::new();
        let mut back_rx = Some(back_rx);
        let mut report_tx = Some(report_tx);
        for (p, (t, tx)) in targets.iter().zip(prod_tx).enumerate() {
            let s = &target_streams[p];
            let links = &fwd[p];
            // Only the target of a split-FC run (there is one) talks back with the ranks.
            let (brx, rtx) = if p == 0 {
                (back_rx.take().unwrap_or_default(), report_tx.take().unwrap_or_default())
            } else {
                (Vec::new(), Vec::new())
            };
            producers.push(scope.spawn(move || {
                let mut spans = Vec::new();
                let r = produce(p, t.be, s, t.side, source, sh, links, back_ref, tx, brx, rtx, hold_ref, &mut spans)
                    .map_err(|e| consequence_if_failed(sh, e));
                if r.is_err() {
                    // A rank may wait for this target's step at the gate or for the others.
                    sh.fail();
                }
                (r, spans)
            }));
        }
        let publishers: Vec<_> = pub_rx
            .into_iter()
            .zip(pub_tx)
            .enumerate()
            .map(|(p, (rx, txs))| {
                let links = &fwd[p];
                scope.spawn(move || publish(p, links, sh, rx, txs))
            })
            .collect();
        let mut ranks = drafter_sides.into_iter().zip(cons_rx).zip(back_tx.into_iter().zip(report_rx)).enumerate();
        let first = ranks.next();
        let mut others = Vec::new();
        for (r, (((be, side), rxs), (btx, rrx))) in ranks {
            let links: Vec<&Link<'_, B>> = fwd.iter().map(|row| &row[r]).collect();
            let bl = back.get(r);
            let comm = &comms_ref[r];
            let on_failure = &on_failure;
            others.push(scope.spawn(move || {
                let res = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    let io = RankIo { fwd: links, back: bl, rxs, back_tx: btx, report_rx: rrx, hold: None };
                    consume(r, be, side, comm, sh, io, None)
                }));
                settle_rank(sh, &res, on_failure);
                res
            }));
        }
        let (r0, mut allreduce) = match first {
            Some((r, (((be, side), rxs), (btx, rrx)))) => {
                let links: Vec<&Link<'_, B>> = fwd.iter().map(|row| &row[r]).collect();
                let comm = &comms_ref[r];
                let res = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    let io =
                        RankIo { fwd: links, back: back.get(r), rxs, back_tx: btx, report_rx: rrx, hold: hold_ref };
                    consume(r, be, side, comm, sh, io, Some(on_step))
                }));
                settle_rank(sh, &res, &on_failure);
                match res {
                    Ok((r, ar)) => (Ok(r), ar),
                    Err(p) => (Err(p), None),
                }
            }
            None => unreachable!("at least one drafter rank"),
        };
        let mut consumers = vec![r0];
        for h in others {
            match h.join() {
                Ok(Ok((r, _))) => consumers.push(Ok(r)),
                Ok(Err(p)) | Err(p) => consumers.push(Err(p)),
            }
        }
        let mut prod_results = Vec::new();
        let mut spans = Vec::new();
        for h in producers {
            match h.join() {
                Ok((r, sp)) => {
                    prod_results.push(r);
                    spans.push(sp);
                }
                Err(panic) => {
                    prod_results.push(Err(PipelineError::ProducerPanic { message: panic_message(&*panic) }));
                    spans.push(Vec::new());
                }
            }
        }
        let pub_results: Vec<Result<(), PipelineError>> = publishers
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| Err(PipelineError::ProducerPanic { message: panic_message(&*p) })))
            .collect();
        let step = sh.stats.lock().map(|s| s.current_step).unwrap_or(0);
        let consumers: Vec<Result<(), PipelineError>> = consumers
            .into_iter()
            .map(|c| c.unwrap_or_else(|p| Err(PipelineError::ConsumerPanic { step, message: panic_message(&*p) })))
            .collect();
        let stopped_early = sh.stats.lock().map(|s| s.stopped_early).unwrap_or(false);
        let result = root_cause(consumers, prod_results, pub_results, stopped_early);
        (result, spans, allreduce.take())
    });
    // The side streams die with this function; the backends' own streams, which free the weights
    // and caches later, continue only after everything enqueued on them (rule 3 at the end).
    for (p, t) in targets.iter().enumerate() {
        let mut streams = vec![&target_streams[p]];
        streams.extend(fwd[p].iter().map(|l| l.src_stream()));
        if p == 0 {
            streams.extend(back.iter().map(|l| l.dst_stream()));
        }
        join_streams(t.be, &streams);
    }
    for (r, bd) in dbes.iter().enumerate() {
        let mut streams: Vec<&B::Stream> = fwd.iter().map(|row| row[r].dst_stream()).collect();
        streams.extend(back.get(r).map(|l| l.src_stream()));
        join_streams(*bd, &streams);
    }
    let mut st = shared.stats.into_inner().unwrap_or_default();
    st.wall = shared.started.elapsed();
    st.transport = transport_name;
    st.target_ranks = nt;
    st.drafter_ranks = nd;
    st.queue_capacity = cfg.max_inflight.max(1) * nt * nd;
    st.allreduce_seconds = allreduce;
    let links = || fwd.iter().flatten().chain(back.iter());
    st.bytes_moved = links().map(|l| l.bytes_moved()).sum();
    st.copy_seconds = links().filter_map(|l| l.copy_seconds()).reduce(|a, b| a + b);
    st.target_gpus = targets.iter().zip(&spans).filter_map(|(t, sp)| device_timeline(t.be, sp)).collect();
    if !st.target_gpus.is_empty() {
        st.target_gpu = Some(DeviceTimeline {
            busy: st.target_gpus.iter().map(|g| g.busy).sum(),
            span: st.target_gpus.iter().map(|g| g.span).sum(),
            waiting: st.target_gpus.iter().map(|g| g.waiting).sum(),
        });
    }
    // Every parcel is gone by now: no slot may still be held (rule 5).
    for l in links() {
        if let Some(s) = l.slot_stats() {
            st.slots_in_flight_at_end += s.in_flight;
            st.slot_waits += s.waits;
        }
    }
    (result, st)
}

/// The links: `fwd[p][r]` from target `p` to rank `r`; `back[r]` from rank `r` to the target
/// (split-FC only).
#[allow(clippy::type_complexity)]
fn make_links<'a, B: Backend>(
    targets: &[TargetRank<'a, B>],
    dbes: &[&'a B],
    cfg: &PipelineConfig,
    split: bool,
) -> Result<(Vec<Vec<Link<'a, B>>>, Vec<Link<'a, B>>), PipelineError> {
    let hidden = targets[0].side.target.shape.hidden;
    let width = if split { hidden } else { hidden * targets[0].side.target.taps.len() };
    let slots = cfg.max_inflight.max(1) + 3;
    let kind = |a: &B, b: &B| cfg.transport.unwrap_or_else(|| Transport::auto(a, b));
    let setup = |k: Transport, e| PipelineError::Setup { transport: k.name().into(), source: e };
    let mut fwd = Vec::with_capacity(targets.len());
    for t in targets {
        let mut row = Vec::with_capacity(dbes.len());
        for &bd in dbes {
            let k = kind(t.be, bd);
            row.push(Link::new(k, t.be, bd, cfg.max_rows * width * 2, slots).map_err(|e| setup(k, e))?);
        }
        fwd.push(row);
    }
    let mut back = Vec::new();
    if split {
        for &bd in dbes {
            let k = kind(bd, targets[0].be);
            back.push(Link::new(k, bd, targets[0].be, cfg.max_rows * hidden * 2, slots).map_err(|e| setup(k, e))?);
        }
    }
    Ok((fwd, back))
}

/// One compute stream per target. It lives as long as the links' copy streams: until every
/// buffer allocated on it was freed (a freed block names its owner stream). Rule 3: it reads
/// the target's weights (uploaded on the backend's own stream, without the host waiting) only
/// after an event that covers their upload.
fn make_target_streams<B: Backend>(targets: &[TargetRank<'_, B>]) -> Result<Vec<B::Stream>, BackendError> {
    targets
        .iter()
        .map(|t| {
            let st = t.be.new_stream()?;
            t.be.wait_event(&st, &t.be.record_event(&t.be.compute_stream())?)?;
            Ok(st)
        })
        .collect()
}

/// A target's device timeline from its stretches of work: busy = the sum of the stretches,
/// span = first start to last end, waiting = the part of each gap between stretches its thread
/// spent waiting on the drafter side (a gap is charged at most its own length). None without
/// timed events (the CPU backend).
fn device_timeline<B: Backend>(be: &B, sp: &TargetSpans<B>) -> Option<DeviceTimeline> {
    let (first, last) = (sp.first()?, sp.last()?);
    let busy: f64 = sp.iter().map(|(a, b, _)| be.elapsed_secs(a, b)).sum::<Option<f64>>()?;
    let waiting: f64 = sp
        .windows(2)
        .map(|w| be.elapsed_secs(&w[0].1, &w[1].0).map(|gap| gap.max(0.0).min(w[1].2.as_secs_f64())))
        .sum::<Option<f64>>()?;
    let span = be.elapsed_secs(&first.0, &last.1)?;
    Some(DeviceTimeline {
        busy: Duration::from_secs_f64(busy),
        span: Duration::from_secs_f64(span),
        waiting: Duration::from_secs_f64(waiting),
    })
}

/// The held reads of `FaultPlan::hold_reads_at`, on one target and one drafter rank only (the
/// forced hazard needs the batch handed over on one device). The flag lives on the drafter's
/// stream and is also written on the target's.
fn make_hold<B: Backend>(
    targets: &[TargetRank<'_, B>],
    dbes: &[&B],
    target_streams: &[B::Stream],
    cfg: &PipelineConfig,
) -> Result<Option<HeldReads<B>>, PipelineError> {
    let Some(step) = cfg.faults.hold_reads_at else { return Ok(None) };
    if targets.len() != 1 || dbes.len() != 1 || step + 1 >= cfg.end_step || step < cfg.first_step {
        return Err(PipelineError::Config(format!(
            "the held-reads fault needs one target, one drafter rank and a step before the last (got step {step})"
        )));
    }
    let setup = |e| PipelineError::Setup { transport: "held reads".into(), source: e };
    let be = dbes[0];
    let ds = be.compute_stream();
    let mut flag = be.alloc(&ds, DType::F32, 1).map_err(setup)?;
    be.fill(&ds, &mut flag, 0.0).map_err(setup)?;
    // The target's stream writes the flag only after this zeroing.
    let ready = be.record_event(&ds).map_err(setup)?;
    targets[0].be.wait_event(&target_streams[0], &ready).map_err(setup)?;
    targets[0].be.record_use(&target_streams[0], &[&flag]).map_err(setup)?;
    Ok(Some(HeldReads { step, flag, freed: Mutex::new(false), cv: std::sync::Condvar::new() }))
}

/// The synchronous reference on one device: target and drafter alternate on the calling thread,
/// one step at a time (`drafter_step` runs the target inside the step, micro-batch by
/// micro-batch). `on_step` is called as in `run`. With a device clock the steps are timed on the
/// device (step markers on the compute stream): `PipelineStats::device_step_secs`, as far as known at each report.
pub fn run_sync<B: Backend>(
    be: &B,
    tside: &TargetSide<B>,
    side: &mut DrafterSide<B>,
    source: &dyn BatchSource,
    cfg: &PipelineConfig,
    optim: &OptimConfig,
    on_step: &mut OnStep<'_, B>,
) -> (Result<(), PipelineError>, PipelineStats) {
    let s = be.compute_stream();
    let started = Instant::now();
    let mut st = PipelineStats { target_ranks: 1, drafter_ranks: 1, ..PipelineStats::default() };
    let mut clock = StepMarkers::<B>::new();
    let mut result = Ok(());
    for step in cfg.first_step..cfg.end_step {
        st.current_step = step;
        // The step's start on the device clock (the previous step's end), and what the device
        // finished since the last look.
        if let Err(e) = clock.mark(be, &s, &mut st) {
            result = Err(PipelineError::Consumer { step, cause: Box::new(e) });
            break;
        }
        clock.read_done(be, &mut st);
        let t_step = Instant::now();
        let micro = match source.micro_batches(step) {
            Ok(m) => m,
            Err(cause) => {
                result = Err(PipelineError::Producer { step, cause });
                break;
            }
        };
        let t0 = Instant::now();
        if let Err(e) = crate::train::step::sync_step(be, &s, &tside.target, side, micro, cfg.noise, optim, step) {
            result = Err(PipelineError::Consumer { step, cause: Box::new(e) });
            break;
        }
        st.drafter_busy += t0.elapsed();
        let mut host_secs = t_step.elapsed().as_secs_f64();
        // The previous step's metrics while this one runs on the device; this step's update
        // waits until they were seen (a checkpoint of that step reads its weights).
        clock.read_done(be, &mut st);
        match sync_report(be, side, &mut st, started, on_step) {
            Ok(false) => {}
            Ok(true) => {
                side.discard_staged();
                break;
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
        let t_update = Instant::now();
        if let Err(e) = side.apply_staged(be, &s) {
            result = Err(PipelineError::Consumer { step, cause: Box::new(e) });
            break;
        }
        // Without a device clock the step's own time on the host, the report (and a checkpoint)
        // of the step before left out.
        if !st.device_clock {
            host_secs += t_update.elapsed().as_secs_f64();
            st.host_step_secs.push(host_secs);
        }
    }
    // A held update no step released (`UpdateFault::Unjoined`, test-only) runs now, so the run
    // ends with nothing waiting on the device; and the last update (on its own stream) is part of
    // the last step's time on the device clock.
    if let Err(e) = side.release_update(be, &s).and_then(|()| side.join_update(be, &s)) {
        result = result.and(Err(PipelineError::Consumer { step: st.current_step, cause: Box::new(e) }));
    }
    // The last step's metrics, also after a failure (the step before the failed one finished).
    side.discard_staged();
    // The end of the last step on the device clock: the host waits for it (the run is over).
    if let (Err(e), Ok(())) = (clock.mark(be, &s, &mut st), &result) {
        result = Err(PipelineError::Consumer { step: st.current_step, cause: Box::new(e) });
    }
    clock.read_all(be, &mut st);
    let last = sync_report(be, side, &mut st, started, on_step);
    if let (Ok(()), Err(e)) = (&result, last) {
        result = Err(e);
    }
    if result.is_err() {
        side.discard_outputs();
    }
    st.wall = started.elapsed();
    (result, st)
}

/// The synchronous loop's step clock: a timed event on the compute stream at the start of each
/// step and one after the last (`Backend::mark_step`). A step's device time is the span from its
/// marker to the next, read once the next has completed, found by a non-blocking query: the loop
/// never waits for the device for it, except after the last step. The steps' times go to
/// `PipelineStats::device_step_secs` in order; a backend without a device clock gives none.
struct StepMarkers<B: Backend> {
    /// Markers whose following marker has not been read yet (the oldest first).
    markers: std::collections::VecDeque<B::Event>,
    /// A marker could not be timed: no more are read.
    stopped: bool,
}

impl<B: Backend> StepMarkers<B> {
    fn new() -> Self {
        StepMarkers { markers: std::collections::VecDeque::new(), stopped: false }
    }

    fn mark(&mut self, be: &B, s: &B::Stream, st: &mut PipelineStats) -> Result<(), BackendError> {
        if self.stopped {
            return Ok(());
        }
        if let Some(ev) = be.mark_step(s)? {
            self.markers.push_back(ev);
            st.device_clock = true;
        }
        Ok(())
    }

    /// The steps whose closing marker has completed, without waiting.
    fn read_done(&mut self, be: &B, st: &mut PipelineStats) {
        let mem = be.host_mem();
        while self.markers.len() >= 2 && mem.done(&self.markers[1]) {
            self.read_one(be, st);
        }
    }

    /// Every step left (the host waits for the last marker).
    fn read_all(&mut self, be: &B, st: &mut PipelineStats) {
        while self.markers.len() >= 2 {
            self.read_one(be, st);
        }
    }

    fn read_one(&mut self, be: &B, st: &mut PipelineStats) {
        let Some(start) = self.markers.pop_front() else { return };
        match self.markers.front().and_then(|end| be.elapsed_secs(&start, end)) {
            Some(secs) => st.device_step_secs.push(secs),
            // An event the driver cannot time: the clock stops (the summary falls back to the
            // host's times for the steps it lacks).
            None => {
                self.markers.clear();
                self.stopped = true;
                st.device_clock = false;
            }
        }
    }
}

/// `run_sync`'s reporting of the last step whose update was enqueued; true: `on_step` stops.
fn sync_report<B: Backend>(
    be: &B,
    side: &mut DrafterSide<B>,
    st: &mut PipelineStats,
    started: Instant,
    on_step: &mut OnStep<'_, B>,
) -> Result<bool, PipelineError> {
    let m = match side.finish_previous(be) {
        Ok(Some(m)) => m,
        Ok(None) => return Ok(false),
        Err(e) => return Err(PipelineError::Consumer { step: st.current_step, cause: Box::new(e) }),
    };
    st.count_step(&m, started.elapsed());
    match on_step(&m, side, st) {
        Ok(Control::Continue) => Ok(false),
        Ok(Control::Stop) => {
            st.stopped_early = true;
            Ok(true)
        }
        Err(cause) => Err(PipelineError::Consumer { step: m.step, cause }),
    }
}

/// After a rank ended: if it failed (an error or a panic), nobody may keep waiting for it: the
/// meeting points, the slot pools and the collectives are aborted.
fn settle_rank<T, P>(sh: &Shared<'_>, res: &Result<(Result<(), PipelineError>, T), P>, on_failure: &dyn Fn()) {
    match res {
        Ok((Ok(()), _)) => {}
        // It only saw another thread stop (the target side gone, a meeting aborted): that
        // thread's own error is the one to report (shutting the slot pools now would give a
        // blocked producer a second, misleading error).
        Ok((Err(e), _)) if e.is_consequence() => sh.abort_meetings(),
        _ => {
            sh.fail();
            on_failure();
        }
    }
}

/// An error a thread hit after another thread had already failed is reported as a consequence
/// (a closed slot pool, an aborted collective), so the first failure stays the cause.
fn consequence_if_failed(sh: &Shared<'_>, e: PipelineError) -> PipelineError {
    if sh.failed.load(Ordering::SeqCst) && !e.is_consequence() {
        PipelineError::Aborted(format!("{e} (after another part of the run had stopped)"))
    } else {
        e
    }
}

/// `be`'s own stream continues only after everything enqueued on `streams`.
fn join_streams<B: Backend>(be: &B, streams: &[&B::Stream]) {
    for st in streams {
        if let Ok(ev) = be.record_event(st) {
            let _ = be.wait_event(&be.compute_stream(), &ev);
        }
    }
}

/// The run's outcome from every thread's: the first cause (drafter ranks, then targets, then
/// publishers), else success when the drafter side stopped on purpose, else the first
/// consequence.
fn root_cause(
    consumers: Vec<Result<(), PipelineError>>,
    producers: Vec<Result<(), PipelineError>>,
    publishers: Vec<Result<(), PipelineError>>,
    stopped_early: bool,
) -> Result<(), PipelineError> {
    let errs: Vec<PipelineError> =
        consumers.into_iter().chain(producers).chain(publishers).filter_map(|r| r.err()).collect();
    let (causes, consequences): (Vec<_>, Vec<_>) = errs.into_iter().partition(|e| !e.is_consequence());
    if let Some(e) = causes.into_iter().next() {
        return Err(e);
    }
    if stopped_early {
        return Ok(());
    }
    match consequences.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Forwards target `p`'s parcels to the drafter ranks: the host waits for each copy to complete
/// (so a rank only ever sees finished copies and the sources are released early), then blocks
/// on that rank's bounded queue.
fn publish<B: Backend>(
    p: usize,
    links: &[Link<'_, B>],
    sh: &Shared<'_>,
    rx: Receiver<Msg<B>>,
    txs: Vec<SyncSender<Msg<B>>>,
) -> Result<(), PipelineError> {
    let name = track("publisher", p, sh.targets);
    for mut msg in rx {
        let (step, micro) = (msg.step, msg.micro);
        let rank = micro % sh.ranks;
        if sh.cfg.faults.publish_error_at == Some(step) {
            return Err(PipelineError::Publish { step, micro, reason: PublishFailure::Injected });
        }
        let t0 = Instant::now();
        links[rank].settle(&mut msg.parcel).map_err(|e| PipelineError::Publish {
            step,
            micro,
            reason: PublishFailure::Copy(e),
        })?;
        add_time(&sh.stats, |st| &mut st.publisher_wait_copy, t0.elapsed());
        if let Some(tr) = &sh.cfg.trace {
            tr.span(name.as_str(), format!("step {step}.{micro}: {} copy", links[rank].kind.name()), t0);
        }
        sh.depth.fetch_add(1, Ordering::SeqCst);
        if txs[rank].send(msg).is_err() {
            sh.depth.fetch_sub(1, Ordering::SeqCst);
            return Err(PipelineError::Publish { step, micro, reason: PublishFailure::ReceiverGone });
        }
        // Between the increment and a consumer's decrement the counter can read one above the
        // queues' capacity: what they hold is at most `max_inflight` per target-rank link.
        let d = sh.depth.load(Ordering::SeqCst).min(sh.cfg.max_inflight.max(1) * sh.targets * sh.ranks);
        if let Ok(mut st) = sh.stats.lock() {
            st.queue_depth.push(d as u32);
        }
        if let Some(tr) = &sh.cfg.trace {
            tr.counter("queue depth", d as f64);
        }
    }
    Ok(())
}

/// Target `p`: runs its steps (round-robin) on its stream `s`; copies run on the links' copy
/// streams.
#[allow(clippy::too_many_arguments)]
fn produce<B: Backend>(
    p: usize,
    be: &B,
    s: &B::Stream,
    tside: &TargetSide<B>,
    source: &dyn BatchSource,
    sh: &Shared<'_>,
    fwd: &[Link<'_, B>],
    back: &[Link<'_, B>],
    tx: SyncSender<Msg<B>>,
    back_rx: Vec<Receiver<Back<B>>>,
    report_tx: Vec<Sender<Report>>,
    hold: Option<&HeldReads<B>>,
    spans: &mut TargetSpans<B>,
) -> Result<(), PipelineError> {
    let cfg = sh.cfg;
    let name = track("target", p, sh.targets);
    let perr = |step: u32| move |e: BoxErr| PipelineError::Producer { step, cause: e };
    let berr = |step: u32| move |e: BackendError| PipelineError::Producer { step, cause: Box::new(e) };
    let fc_err = |pstep: u32| {
        move |e: FcError| match e {
            FcError::Backend(e) => berr(pstep)(e),
            FcError::Gone => PipelineError::ProducerGone { step: pstep },
        }
    };
    // Split-FC: the packed X of the previous step (its index, and each micro-batch with its X),
    // kept for dWfc.
    type Packed<B> = Vec<(HostBatch, <B as Backend>::Buf)>;
    let mut prev: Option<(u32, Packed<B>)> = None;
    let steps = (cfg.first_step..cfg.end_step).filter(|&k| owner(cfg, k, sh.targets) == p);
    // Host time waited on the drafter side since the last stretch of target work closed; every
    // such wait happens with no stretch open.
    let mut waited = Duration::ZERO;
    for step in steps {
        if cfg.faults.producer_error_at == Some(step) {
            return Err(PipelineError::Producer { step, cause: "injected fault: producer error".into() });
        }
        if cfg.lockstep {
            // Split-FC's previous update needs this thread before the drafter can finish.
            if let (Some(fc), Some((pstep, pbatches))) = (&tside.fc, prev.take()) {
                finish_fc_step(be, s, fc, back, &pbatches, &back_rx, &report_tx).map_err(fc_err(pstep))?;
            }
            sh.gate
                .wait_for(step)
                .map_err(|_| PipelineError::Aborted(format!("step {}: the drafter side stopped", step + 1)))?;
        }
        let t0 = Instant::now();
        let hbs = source.micro_batches(step).map_err(perr(step))?;
        if hbs.is_empty() || hbs.len() % sh.ranks != 0 {
            return Err(PipelineError::Producer {
                step,
                cause: format!(
                    "the step has {} micro-batches: with {} drafter GPUs it needs a positive multiple of {} (set --grad-accum to one)",
                    hbs.len(),
                    sh.ranks,
                    sh.ranks
                )
                .into(),
            });
        }
        let step_weight: f64 = hbs.iter().map(|hb| hb.weight_sum).sum();
        let t_start = be.record_timed(s).map_err(berr(step))?;
        let mut wait_before = std::mem::take(&mut waited);
        let held = hold.filter(|h| h.step + 1 == step);
        if let Some(h) = held {
            h.wait_freed();
        }
        let mut packed = Vec::with_capacity(hbs.len());
        for hb in hbs {
            let x = target_pack(be, s, &tside.target, &hb, cfg.noise, step).map_err(berr(step))?;
            packed.push((hb, x));
        }
        if let Some(h) = held {
            be.signal_flag(s, &h.flag, 1).map_err(berr(step))?;
        }
        add_time(&sh.stats, |st| &mut st.target_busy, t0.elapsed());
        if let Some(tr) = &cfg.trace {
            tr.span(name.as_str(), format!("step {step}: target forward + pack"), t0);
        }
        let mut t_start = t_start;
        if let Some(fc) = &tside.fc {
            // Exact split-FC: finish the previous step's fc update before projecting this step.
            if let Some((pstep, pbatches)) = prev.take() {
                // The wait for dY is not target work: close this stretch of the device timeline.
                if let (Some(a), Some(b)) = (t_start.take(), be.record_timed(s).map_err(berr(step))?) {
                    spans.push((a, b, wait_before));
                }
                let t1 = Instant::now();
                finish_fc_step(be, s, fc, back, &pbatches, &back_rx, &report_tx).map_err(fc_err(pstep))?;
                add_time(&sh.stats, |st| &mut st.target_wait_fc, t1.elapsed());
                // dW and the fc update (target work) are in this wait too: it waits for the
                // drafter between them, and split-FC's idle is charged to the drafter side.
                waited += t1.elapsed();
                if let Some(tr) = &cfg.trace {
                    tr.span(name.as_str(), format!("step {pstep}: split-FC dW + update"), t1);
                }
                t_start = be.record_timed(s).map_err(berr(step))?;
                wait_before = std::mem::take(&mut waited);
            }
        }
        let n_micro = packed.len();
        let mut keep = Vec::new();
        for (micro, (hb, x)) in packed.into_iter().enumerate() {
            if micro > 0 && tside.fc.is_some() {
                // The projection of this micro-batch: target work after the previous one's send.
                t_start = be.record_timed(s).map_err(berr(step))?;
                wait_before = std::mem::take(&mut waited);
            }
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
            // The stretch closes before the publish, which blocks while the queue is full.
            if t_start.is_some() {
                if let (Some(a), Some(b)) = (t_start.take(), be.record_timed(s).map_err(berr(step))?) {
                    spans.push((a, b, wait_before));
                }
            }
            // Host staging blocks here while every pinned slot is taken: slots come back only
            // after the drafter side's H2D, so this too is waiting on the drafter.
            let t_send = Instant::now();
            let parcel = fwd[micro % sh.ranks].send(s, out, step, micro, &cfg.faults).map_err(berr(step))?;
            let t2 = Instant::now();
            if tx.send(Msg { step, micro, n_micro, step_weight, hb, parcel }).is_err() {
                return Err(PipelineError::Publish { step, micro, reason: PublishFailure::ReceiverGone });
            }
            waited += t_send.elapsed();
            add_time(&sh.stats, |st| &mut st.target_blocked, t2.elapsed());
            if let Some(tr) = &cfg.trace {
                tr.span(
                    track("target (queue)", p, sh.targets),
                    format!("step {step}.{micro}: publish (blocked while full)"),
                    t2,
                );
            }
        }
        if tside.fc.is_some() {
            prev = Some((step, keep));
        }
    }
    if let (Some(fc), Some((pstep, pbatches))) = (&tside.fc, prev.take()) {
        finish_fc_step(be, s, fc, back, &pbatches, &back_rx, &report_tx).map_err(fc_err(pstep))?;
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

/// The target side's half of a split-FC step: `dWfc += dY^T X` per micro-batch in order (micro
/// m's dY comes from rank m mod D), report `sumsq(dWfc)` to every rank, then apply the update
/// rank 0 decided. The fc group is locked only while it is computed on, never while this thread
/// waits for the drafter side: a checkpoint on the drafter side reads the group and may be what
/// the drafter side is busy with.
fn finish_fc_step<B: Backend>(
    be: &B,
    s: &B::Stream,
    fc: &Mutex<ParamGroup<B>>,
    back: &[Link<'_, B>],
    batches: &[(HostBatch, B::Buf)],
    back_rx: &[Receiver<Back<B>>],
    report_tx: &[Sender<Report>],
) -> Result<(), FcError> {
    let ranks = back_rx.len();
    if ranks == 0 || back.len() != ranks {
        return Err(FcError::Gone);
    }
    // Sources of dY peer copies, alive until `s` (which waited for the copies) is synchronised,
    // on every path.
    let mut hold = HeldUntilSync { be, s, bufs: Vec::new() };
    let mut dys = Vec::with_capacity(batches.len());
    for m in 0..batches.len() {
        let r = m % ranks;
        match back_rx[r].recv() {
            Ok(Back::Dy(parcel)) => dys.push(back[r].receive(s, parcel, &mut hold.bufs)?),
            _ => return Err(FcError::Gone),
        }
    }
    let sumsq = {
        let mut fc = fc.lock().map_err(|_| FcError::Gone)?;
        fc.zero_grad(be, s)?;
        for ((hb, x), dy) in batches.iter().zip(&dys) {
            fc_backward(be, s, &mut fc, dy, x, hb.rows())?;
        }
        let mut out = be.alloc(s, crate::tensor::DType::F32, 1)?;
        fc.grad_sumsq(be, s, &mut out)?;
        f64::from(be.download(s, &out)?[0])
    };
    drop(dys);
    for tx in report_tx {
        tx.send(Report::FcSumsq(sumsq)).map_err(|_| FcError::Gone)?;
    }
    let hp = match back_rx[0].recv() {
        Ok(Back::Update { hp }) => hp,
        _ => return Err(FcError::Gone),
    };
    {
        let mut fc = fc.lock().map_err(|_| FcError::Gone)?;
        if let Some(hp) = hp {
            fc.adamw(be, s, &hp)?;
        }
        // Tell the drafter side the fc weights of this step are final (checkpoints read them,
        // from another stream: so the host waits for the update first).
        be.synchronize(s)?;
    }
    hold.bufs.clear();
    for tx in report_tx {
        tx.send(Report::UpdateApplied).map_err(|_| FcError::Gone)?;
    }
    Ok(())
}

fn add_time(stats: &Mutex<PipelineStats>, f: impl FnOnce(&mut PipelineStats) -> &mut Duration, d: Duration) {
    if let Ok(mut st) = stats.lock() {
        *f(&mut st) += d;
    }
}

/// A drafter rank's ends of the links and channels: from each target (indexed by target), and
/// back to the target under split-FC.
struct RankIo<'l, 'a, B: Backend> {
    fwd: Vec<&'l Link<'a, B>>,
    back: Option<&'l Link<'a, B>>,
    rxs: Vec<Receiver<Msg<B>>>,
    back_tx: Sender<Back<B>>,
    report_rx: Receiver<Report>,
    hold: Option<&'l HeldReads<B>>,
}

/// Drafter rank `rank`: receives its micro-batches of each step (from the step's target), trains
/// on them, sums gradients with the other ranks, and applies the update. Rank 0 also runs
/// `on_step` and decides for every rank whether to go on. Returns the all-reduce's device
/// seconds (rank 0, data parallel only). The channels close when it returns.
fn consume<B: Backend>(
    rank: usize,
    be: &B,
    side: &mut DrafterSide<B>,
    comm: &B::Comm,
    sh: &Shared<'_>,
    io: RankIo<'_, '_, B>,
    mut on_step: Option<&mut OnStep<'_, B>>,
) -> (Result<(), PipelineError>, Option<f64>) {
    let mut timed: TimedSpans<B> = Vec::new();
    let r = consume_steps(rank, be, side, comm, sh, &io, &mut on_step, &mut timed);
    // The last step's metrics (one step late), also after a failure: the step before the one
    // that failed was finished and is reported as it was before that failure.
    side.discard_staged();
    let last = report_previous(be, side, sh, &mut on_step);
    let r = match (r, last) {
        (Ok(()), Err(Reported::Backend(e))) => {
            Err(PipelineError::Consumer { step: sh.cfg.end_step.saturating_sub(1), cause: Box::new(e) })
        }
        (Ok(()), Err(Reported::OnStep(step, cause))) => Err(PipelineError::Consumer { step, cause }),
        (Ok(()), Err(Reported::Stats)) => Err(PipelineError::Stopped("stats lock poisoned".into())),
        (r, _) => r,
    }
    .map_err(|e| consequence_if_failed(sh, e));
    if r.is_err() {
        side.discard_outputs();
    }
    let allreduce =
        if timed.is_empty() || rank != 0 { None } else { timed.iter().map(|(a, b)| be.elapsed_secs(a, b)).sum() };
    (r, allreduce)
}

#[allow(clippy::too_many_arguments)]
fn consume_steps<B: Backend>(
    rank: usize,
    be: &B,
    side: &mut DrafterSide<B>,
    comm: &B::Comm,
    sh: &Shared<'_>,
    io: &RankIo<'_, '_, B>,
    on_step: &mut Option<&mut OnStep<'_, B>>,
    timed: &mut TimedSpans<B>,
) -> Result<(), PipelineError> {
    let RankIo { fwd, back, rxs, back_tx, report_rx, hold } = io;
    let cfg = sh.cfg;
    let s = be.compute_stream();
    let name = track("drafter", rank, sh.ranks);
    let wait_name = track("drafter (waiting)", rank, sh.ranks);
    let stopped =
        |step: u32| move |_| PipelineError::Aborted(format!("step {}: another drafter rank stopped", step + 1));
    for step in cfg.first_step..cfg.end_step {
        if rank == 0 {
            if let Ok(mut st) = sh.stats.lock() {
                st.current_step = step;
            }
        }
        let berr = |e: BackendError| PipelineError::Consumer { step, cause: Box::new(e) };
        let p = owner(cfg, step, sh.targets);
        let mut pending: Vec<(HostBatch, B::Buf)> = Vec::new();
        let mut expected = 1;
        let mut step_weight = 0.0;
        // All of this rank's micro-batches are needed before its first backward: the loss is
        // normalised by the weight sum of the whole step (DFLASH.md pitfall 8). Each one's H2D
        // (host transport) is enqueued as soon as it arrives.
        while pending.len() < expected {
            let t0 = Instant::now();
            let msg = rxs[p].recv().map_err(|_| PipelineError::ProducerGone { step })?;
            let d = sh.depth.fetch_sub(1, Ordering::SeqCst).saturating_sub(1);
            if let Some(tr) = &cfg.trace {
                tr.counter("queue depth", d as f64);
            }
            add_time(&sh.stats, |st| &mut st.drafter_wait, t0.elapsed());
            if let Some(tr) = &cfg.trace {
                tr.span(wait_name.as_str(), format!("step {step}: wait for batch"), t0);
            }
            if cfg.faults.consumer_panic_at == Some(msg.step) && rank + 1 == sh.ranks {
                panic!("injected fault: consumer panic at step {}", msg.step + 1);
            }
            debug_assert_eq!((msg.step, msg.micro), (step, rank + pending.len() * sh.ranks));
            expected = msg.n_micro / sh.ranks;
            step_weight = msg.step_weight;
            // Forward parcels are settled by the publisher: nothing is left to hold.
            let mut hold = Vec::new();
            let buf = fwd[p].receive(&s, msg.parcel, &mut hold).map_err(berr)?;
            debug_assert!(hold.is_empty());
            pending.push((msg.hb, buf));
        }
        let mut group = RankPeers { rank, sh, comm, timed: &mut *timed };
        let mut remote = back.map(|back| SplitFcPort { back, step, sent: 0, back_tx, report_rx });
        let fc = match remote.as_mut() {
            Some(r) => FcPlace::Remote(r),
            None => FcPlace::Local,
        };
        let held = hold.filter(|h| h.step == step);
        if let Some(h) = held {
            be.wait_flag(&s, &h.flag, 1).map_err(berr)?;
        }
        let batches = pending
            .into_iter()
            .map(|(hb, buf)| {
                let ctx = if sh.split { Context::Projected(buf) } else { Context::Packed(buf) };
                Ok((hb, ctx))
            })
            // Asked once more after the last micro-batch was consumed and dropped.
            .chain(std::iter::from_fn(move || {
                held.inspect(|h| h.mark_freed());
                None
            }));
        let times = drafter_step(be, &s, side, step, step_weight, batches, &mut group, fc, rank == 0, sh.optim)
            .map_err(|e| match e {
                StepError::Backend(e) => berr(e),
                StepError::PeerStopped(Peer::TargetSide) => PipelineError::ProducerGone { step },
                StepError::PeerStopped(Peer::DrafterRank) => {
                    PipelineError::Aborted(format!("step {}: another drafter rank stopped", step + 1))
                }
            })?;
        add_time(&sh.stats, |st| &mut st.drafter_busy, times.computed - times.started);
        add_time(&sh.stats, |st| &mut st.optimizer, times.computed.elapsed());
        if let Some(tr) = &cfg.trace {
            tr.span_between(
                name.as_str(),
                format!("step {step}: drafter forward + backward"),
                times.started,
                times.computed,
            );
            tr.span(name.as_str(), format!("step {step}: grad sum + norm + AdamW"), times.computed);
        }
        // The metrics of the last step whose update was enqueued: the previous one while this
        // step runs on the device (its update waits until they were seen: a checkpoint of that
        // step reads its weights), this one where the host decided the update.
        let stop = report_previous(be, side, sh, on_step).map_err(|cause| match cause {
            Reported::Backend(e) => berr(e),
            Reported::OnStep(step, cause) => PipelineError::Consumer { step, cause },
            Reported::Stats => PipelineError::Stopped("stats lock poisoned".into()),
        })?;
        if stop {
            side.discard_staged();
        } else {
            side.apply_staged(be, &s).map_err(berr)?;
        }
        // Rank 0 decides for everyone.
        let stop = if sh.ranks == 1 { stop } else { sh.control.all_gather(rank, stop).map_err(stopped(step))?[0] };
        if rank == 0 {
            sh.gate.advance(step + 1);
        }
        if stop {
            if let Ok(mut st) = sh.stats.lock() {
                st.stopped_early = true;
            }
            // A lockstep target waiting for the next step must not wait forever.
            sh.gate.abort();
            return Ok(());
        }
    }
    Ok(())
}

/// Why reporting a step's metrics failed.
enum Reported {
    Backend(BackendError),
    OnStep(u32, BoxErr),
    Stats,
}

/// Reads the metrics of the last step whose update was enqueued (`DrafterSide::finish_previous`)
/// and, on rank 0, counts them and runs `on_step`. Returns whether `on_step` asked to stop.
fn report_previous<B: Backend>(
    be: &B,
    side: &mut DrafterSide<B>,
    sh: &Shared<'_>,
    on_step: &mut Option<&mut OnStep<'_, B>>,
) -> Result<bool, Reported> {
    let Some(metrics) = side.finish_previous(be).map_err(Reported::Backend)? else { return Ok(false) };
    let Some(f) = on_step.as_mut() else { return Ok(false) };
    let snapshot = {
        let mut st = sh.stats.lock().map_err(|_| Reported::Stats)?;
        st.count_step(&metrics, sh.started.elapsed());
        st.clone()
    };
    Ok(matches!(f(&metrics, side, &snapshot).map_err(|e| Reported::OnStep(metrics.step, e))?, Control::Stop))
}

/// The other data-parallel ranks of a step, as `drafter_step` sees them: metric sums are
/// gathered through the shared exchange, gradients summed by the backend's all-reduce (timed).
struct RankPeers<'x, 'a, B: Backend> {
    rank: usize,
    sh: &'x Shared<'a>,
    comm: &'x B::Comm,
    timed: &'x mut TimedSpans<B>,
}

impl<B: Backend> RankGroup<B> for RankPeers<'_, '_, B> {
    fn reduce(
        &mut self,
        be: &B,
        s: &B::Stream,
        side: &mut DrafterSide<B>,
        local: MetricSums,
    ) -> Result<MetricSums, StepError> {
        if self.sh.ranks == 1 {
            return Ok(local);
        }
        // Every rank reached this point (or one stopped and nobody enters the all-reduce).
        let all = self.sh.sums.all_gather(self.rank, local).map_err(|_| StepError::PeerStopped(Peer::DrafterRank))?;
        let mut sums = MetricSums::default();
        for m in all.iter() {
            sums.merge(m);
        }
        let a = be.record_timed(s)?;
        be.all_reduce_sum(s, self.comm, &mut side.drafter.body.grad)?;
        if let Some(fc) = &mut side.fc {
            be.all_reduce_sum(s, self.comm, &mut fc.grad)?;
        }
        if let (Some(a), Some(b)) = (a, be.record_timed(s)?) {
            self.timed.push((a, b));
        }
        Ok(sums)
    }
}

/// A drafter rank's end of the split-FC protocol (the target side's is `finish_fc_step`).
struct SplitFcPort<'x, 'l, 'a, B: Backend> {
    back: &'l Link<'a, B>,
    step: u32,
    sent: usize,
    back_tx: &'x Sender<Back<B>>,
    report_rx: &'x Receiver<Report>,
}

impl<B: Backend> RemoteFc<B> for SplitFcPort<'_, '_, '_, B> {
    fn send_dy(&mut self, s: &B::Stream, dy: B::Buf) -> Result<(), StepError> {
        // dY copies carry no injected fault: the plan arms the forward copies.
        let parcel = self.back.send(s, dy, self.step, self.sent, &FaultPlan::default())?;
        self.sent += 1;
        self.back_tx.send(Back::Dy(parcel)).map_err(|_| StepError::PeerStopped(Peer::TargetSide))
    }

    fn fc_sumsq(&mut self) -> Result<f64, StepError> {
        match self.report_rx.recv() {
            Ok(Report::FcSumsq(x)) => Ok(x),
            _ => Err(StepError::PeerStopped(Peer::TargetSide)),
        }
    }

    fn decide(&mut self, hp: Option<AdamStep>) -> Result<(), StepError> {
        self.back_tx.send(Back::Update { hp }).map_err(|_| StepError::PeerStopped(Peer::TargetSide))
    }

    fn await_update(&mut self) -> Result<(), StepError> {
        match self.report_rx.recv() {
            Ok(Report::UpdateApplied) => Ok(()),
            _ => Err(StepError::PeerStopped(Peer::TargetSide)),
        }
    }
}
