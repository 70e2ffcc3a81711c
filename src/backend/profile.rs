//! Where the device time of a step goes (`run --profile`, `bench-pipeline --profile`).
//!
//! The step code says which part of the step it is enqueuing ([`enter`] a [`Region`]: target,
//! FC projection, drafter, loss, optimizer); a backend that profiles times every kernel, GEMM
//! and copy it enqueues with device events and files the interval under a [`Phase`] made of
//! that region and the kind of work (the kernel's family, a GEMM, a copy). The training loop
//! also puts a step marker (`Backend::mark_step`, a timed event) on the stream at the start of
//! each step and after the last one; the profiler's list of timed work is split at those
//! markers ([`take_complete_steps`]), so each [`StepPhases`] holds exactly one step's launches,
//! and its phases plus the idle gaps (before the first launch, between launches, after the
//! last) add up to the marker-to-marker time of the step on the device ([`fold_between`]). A
//! bench without markers times everything it enqueued as one step and compares it with the
//! host's time. The region is per thread (the synchronous step runs on one thread); it costs
//! nothing when no backend profiles.
//!
//! Timing every launch adds two event records to each (a few microseconds of host time); the
//! table therefore reports the profiled step time beside the phases, and a bench compares it with
//! an unprofiled run.

use std::cell::Cell;

/// The part of a step the calling thread is enqueuing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Region {
    #[default]
    Other,
    /// The target's forward and the packing of its taps.
    Target,
    /// The FC projection, forward and backward.
    Fc,
    /// The drafter's layers, forward and backward.
    Drafter,
    /// The chunked lm_head and cross-entropy (forward and backward).
    Loss,
    /// Gradient zeroing, norms and AdamW.
    Optimizer,
}

impl Region {
    /// Where in the step this is, as the memory line says where its peak was reached.
    pub fn place(self) -> &'static str {
        match self {
            Region::Other => "outside the step's phases",
            Region::Target => "in the target's forward",
            Region::Fc => "in the FC projection",
            Region::Drafter => "in the drafter's layers",
            Region::Loss => "in the lm_head + cross-entropy",
            Region::Optimizer => "in the optimizer",
        }
    }
}

thread_local! {
    static REGION: Cell<Region> = const { Cell::new(Region::Other) };
}

/// The region work enqueued by this thread belongs to.
pub fn current() -> Region {
    REGION.with(Cell::get)
}

/// Marks the work this thread enqueues until the guard drops as `r`'s (nesting restores the outer one).
#[must_use = "the region ends when the guard drops"]
pub fn enter(r: Region) -> RegionGuard {
    RegionGuard { outer: REGION.with(|c| c.replace(r)) }
}

pub struct RegionGuard {
    outer: Region,
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        REGION.with(|c| c.set(self.outer));
    }
}

/// What kind of work a timed interval is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    Gemm,
    /// A kernel, by its family (the `kernels/<family>.cu` file stem) and symbol.
    Kernel {
        family: &'static str,
        symbol: &'static str,
    },
    Copy,
}

/// The rows of the phase table, in the order a step runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    TargetGemm,
    TargetAttention,
    TargetElementwise,
    PackNoise,
    FcProjection,
    DrafterGemm,
    DrafterAttentionFwd,
    DrafterAttentionBwd,
    DrafterElementwise,
    LossHead,
    Optimizer,
    Copies,
    Other,
}

impl Phase {
    pub const ALL: [Phase; 13] = [
        Phase::TargetGemm,
        Phase::TargetAttention,
        Phase::TargetElementwise,
        Phase::PackNoise,
        Phase::FcProjection,
        Phase::DrafterGemm,
        Phase::DrafterAttentionFwd,
        Phase::DrafterAttentionBwd,
        Phase::DrafterElementwise,
        Phase::LossHead,
        Phase::Optimizer,
        Phase::Copies,
        Phase::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::TargetGemm => "target GEMMs",
            Phase::TargetAttention => "target attention + delta rule",
            Phase::TargetElementwise => "target norms, RoPE, MLP act, other",
            Phase::PackNoise => "pack taps + noise",
            Phase::FcProjection => "FC projection fwd + bwd",
            Phase::DrafterGemm => "drafter GEMMs fwd + bwd",
            Phase::DrafterAttentionFwd => "drafter attention fwd",
            Phase::DrafterAttentionBwd => "drafter attention bwd",
            Phase::DrafterElementwise => "drafter norms, RoPE, MLP act, other",
            Phase::LossHead => "lm_head + cross-entropy",
            Phase::Optimizer => "optimizer (zero, norm, AdamW)",
            Phase::Copies => "copies (device, host)",
            Phase::Other => "other",
        }
    }

    /// The phase of `work` enqueued in `region`.
    pub fn of(region: Region, work: Work) -> Phase {
        // `attention.cu` (mma.sync) and `attention_wgmma.cu` (warpgroup MMAs) hold the same ops in
        // two forms; the Gated DeltaNet (`gdn.cu`) is the hybrid target's other token mixer.
        let attention = |family: &str| family.starts_with("attention") || family == "gdn";
        match (region, work) {
            (_, Work::Copy) => Phase::Copies,
            (_, Work::Kernel { family: "pack", .. }) => Phase::PackNoise,
            (Region::Optimizer, _) => Phase::Optimizer,
            (Region::Loss, _) => Phase::LossHead,
            (Region::Fc, _) | (_, Work::Kernel { family: "fc", .. }) => Phase::FcProjection,
            // kernels/mlp.cu is the gate | up GEMM with SwiGLU in its epilogue.
            (Region::Target, Work::Gemm | Work::Kernel { family: "mlp", .. }) => Phase::TargetGemm,
            (Region::Target, Work::Kernel { family, .. }) if attention(family) => Phase::TargetAttention,
            (Region::Target, Work::Kernel { .. }) => Phase::TargetElementwise,
            (Region::Drafter, Work::Gemm | Work::Kernel { family: "mlp", .. }) => Phase::DrafterGemm,
            (Region::Drafter, Work::Kernel { family, symbol }) if family.starts_with("attention") => {
                if symbol.contains("bwd") {
                    Phase::DrafterAttentionBwd
                } else {
                    Phase::DrafterAttentionFwd
                }
            }
            (Region::Drafter, Work::Kernel { .. }) => Phase::DrafterElementwise,
            (Region::Other, _) => Phase::Other,
        }
    }
}

/// One step's device time by phase (seconds), as the backend measured it.
#[derive(Clone, Debug, Default)]
pub struct StepPhases {
    pub by_phase: Vec<(Phase, f64)>,
    /// The time no interval covered: between the first interval's start and the last one's end,
    /// and, for a step between two markers, also from the opening marker to the first start and
    /// from the last end to the closing marker.
    pub gaps: f64,
    /// First start to last end; marker to marker for a step between two markers.
    pub span: f64,
    /// Device seconds from this step's marker to the next (None without markers: a bench's work,
    /// compared with the host's time).
    pub step: Option<f64>,
    /// Intervals timed.
    pub intervals: usize,
    /// Device seconds and count per operation (a kernel's symbol, a GEMM's shape, a copy).
    pub by_op: Vec<(String, f64, usize)>,
    /// The idle gaps (seconds, count) by the launch that ends them ("step end" for the time
    /// from the last launch to the closing marker): a gap before a launch is time the device
    /// waited for the host to enqueue it.
    pub gaps_by_op: Vec<(String, f64, usize)>,
    /// Per phase, its GEMMs' device seconds and FLOPs (from their labels, [`gemm_flops`]).
    pub gemms: Vec<(Phase, f64, f64)>,
}

/// Adds `secs` and `flops` to `phase`'s entry of `into`.
fn add_gemm(into: &mut Vec<(Phase, f64, f64)>, phase: Phase, secs: f64, flops: f64) {
    match into.iter_mut().find(|(p, _, _)| *p == phase) {
        Some(e) => {
            e.1 += secs;
            e.2 += flops;
        }
        None => into.push((phase, secs, flops)),
    }
}

impl StepPhases {
    /// Phases plus gaps: the span, unless intervals overlap (work on two streams at once) or
    /// reach outside the step's markers.
    pub fn accounted(&self) -> f64 {
        self.by_phase.iter().map(|(_, s)| s).sum::<f64>() + self.gaps
    }
}

/// Which clock a step time was read from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StepClock {
    /// The host's time between two reports of a step (what the host saw, not the device).
    #[default]
    Host,
    /// The device's time between two step markers on the compute stream.
    Device,
}

impl StepClock {
    pub fn describe(self) -> &'static str {
        match self {
            StepClock::Host => "host clock",
            StepClock::Device => "device clock, step marker to step marker",
        }
    }
}

/// How far the phases' sum may be from the step time before the table flags it (phases + gaps
/// equal a marker-to-marker step by construction unless launches overlap or leak across markers).
pub const SUM_TOLERANCE: f64 = 0.05;

/// Mean phase times over the profiled steps, against the step time.
#[derive(Clone, Debug, Default)]
pub struct PhaseTable {
    pub steps: usize,
    pub by_phase: Vec<(Phase, f64)>,
    pub gaps: f64,
    pub span: f64,
    /// The mean step time the phases are compared with, read from `clock`.
    pub step: f64,
    pub clock: StepClock,
    pub intervals: f64,
    /// Per step: device seconds and launches per operation, longest first.
    pub by_op: Vec<(String, f64, f64)>,
    /// Per step: idle seconds and gaps by the launch that ends them, longest first.
    pub gaps_by_op: Vec<(String, f64, f64)>,
    /// Per step and phase: its GEMMs' device seconds and FLOPs.
    pub gemms: Vec<(Phase, f64, f64)>,
    /// The device's bf16 GEMM rate (FLOP/s) that [`PhaseTable::render`] sets the GEMMs against:
    /// the MFU peak, a short burst of 8192^3 GEMMs (`train::flops::measure_gemm_peak`), above
    /// what a power-capped step sustains; `None` leaves that line out.
    pub gemm_peak: Option<f64>,
}

/// Adds `1/n` of each `(label, secs, count)` of one step to the per-step means in `into`.
fn add_means(into: &mut Vec<(String, f64, f64)>, step: &[(String, f64, usize)], n: f64) {
    for (op, secs, count) in step {
        match into.iter_mut().find(|(o, _, _)| o == op) {
            Some(e) => {
                e.1 += secs / n;
                e.2 += *count as f64 / n;
            }
            None => into.push((op.clone(), secs / n, *count as f64 / n)),
        }
    }
}

impl PhaseTable {
    /// Means over `steps` (each with the host's step seconds), leaving out the first `warmup`
    /// (plans and caches are built there) when enough steps remain.
    pub fn from_steps(steps: &[(StepPhases, f64)], warmup: usize) -> Option<PhaseTable> {
        let skip = if steps.len() > warmup { warmup } else { 0 };
        Self::mean(steps[skip..].iter().map(|(sp, host)| (sp, *host)), StepClock::Host)
    }

    /// Means over steps split at step markers, against their device step times, leaving out the
    /// first `warmup` when enough steps remain. None without steps or when one has no marker time.
    pub fn from_marked_steps(steps: &[StepPhases], warmup: usize) -> Option<PhaseTable> {
        let skip = if steps.len() > warmup { warmup } else { 0 };
        let used: Option<Vec<(&StepPhases, f64)>> = steps[skip..].iter().map(|sp| sp.step.map(|t| (sp, t))).collect();
        Self::mean(used?.into_iter(), StepClock::Device)
    }

    fn mean<'a>(used: impl ExactSizeIterator<Item = (&'a StepPhases, f64)>, clock: StepClock) -> Option<PhaseTable> {
        if used.len() == 0 {
            return None;
        }
        let n = used.len() as f64;
        let mut by_phase: Vec<(Phase, f64)> = Phase::ALL.iter().map(|&p| (p, 0.0)).collect();
        let mut t = PhaseTable { steps: used.len(), clock, ..PhaseTable::default() };
        for (sp, step) in used {
            for &(p, secs) in &sp.by_phase {
                if let Some(e) = by_phase.iter_mut().find(|(q, _)| *q == p) {
                    e.1 += secs / n;
                }
            }
            t.gaps += sp.gaps / n;
            t.span += sp.span / n;
            t.step += step / n;
            t.intervals += sp.intervals as f64 / n;
            add_means(&mut t.by_op, &sp.by_op, n);
            add_means(&mut t.gaps_by_op, &sp.gaps_by_op, n);
            for &(p, secs, flops) in &sp.gemms {
                add_gemm(&mut t.gemms, p, secs / n, flops / n);
            }
        }
        by_phase.retain(|&(_, s)| s > 0.0);
        t.by_phase = by_phase;
        t.by_op.sort_by(|a, b| b.1.total_cmp(&a.1));
        t.gaps_by_op.sort_by(|a, b| b.1.total_cmp(&a.1));
        Some(t)
    }

    /// How many operations a profiled training step lists (`run --profile`, `bench-pipeline
    /// --profile`): enough to reach the step's elementwise kernels below its GEMMs.
    pub const STEP_OPS: usize = 30;

    /// The `top` operations by device time per step, with launches per step and mean time each.
    pub fn render_ops(&self, top: usize) -> String {
        let mut out = format!("operations by device time per step (top {top} of {})\n", self.by_op.len());
        for (op, secs, count) in self.by_op.iter().take(top) {
            let each = if *count > 0.0 { secs / count } else { 0.0 };
            // A GEMM's rate, to set beside the card's sustained one (the summary's clocks line).
            let rate = match gemm_flops(op) {
                Some(f) if each > 0.0 => format!(" {:>5.0} TFLOP/s", f / each / 1e12),
                _ => String::new(),
            };
            out += &format!("  {:<48} {:>9.3} ms {:>7.0} x {:>8.1} us{rate}\n", op, secs * 1e3, count, each * 1e6);
        }
        if !self.gaps_by_op.is_empty() {
            out += &format!(
                "idle gaps by the launch that ends them, per step (top {} of {}; the device waited for the host)\n",
                top.min(5),
                self.gaps_by_op.len()
            );
            for (op, secs, count) in self.gaps_by_op.iter().take(top.min(5)) {
                let each = if *count > 0.0 { secs / count } else { 0.0 };
                out += &format!("  before {:<41} {:>9.3} ms {:>7.0} x {:>8.1} us\n", op, secs * 1e3, count, each * 1e6);
            }
        }
        out
    }

    /// Phases plus gaps: the stream's span (marker to marker for marked steps) within rounding,
    /// unless launches overlap.
    pub fn accounted(&self) -> f64 {
        self.by_phase.iter().map(|(_, s)| s).sum::<f64>() + self.gaps
    }

    /// Whether the phases plus gaps come within `SUM_TOLERANCE` of the step time.
    pub fn sums_to_the_step(&self) -> bool {
        self.step > 0.0 && (self.accounted() - self.step).abs() <= SUM_TOLERANCE * self.step
    }

    pub fn render(&self) -> String {
        let ms = |s: f64| s * 1e3;
        let pct = |s: f64| if self.step > 0.0 { 100.0 * s / self.step } else { 0.0 };
        let mut out = format!(
            "phases (device events, mean of {} step{}, {:.0} timed launches per step)\n",
            self.steps,
            if self.steps == 1 { "" } else { "s" },
            self.intervals
        );
        for (p, s) in &self.by_phase {
            // A phase's GEMMs at their rate: the part of the phase the GEMM peak bounds.
            let rate = match self.gemms.iter().find(|g| g.0 == *p) {
                Some(&(_, gs, gf)) if gs > 0.0 => {
                    format!("   GEMMs {:.2} ms at {:.0} TFLOP/s", ms(gs), gf / gs / 1e12)
                }
                _ => String::new(),
            };
            out += &format!("  {:<40} {:>9.2} ms {:>6.1}%{rate}\n", p.name(), ms(*s), pct(*s));
        }
        out += &format!("  {:<40} {:>9.2} ms {:>6.1}%\n", "idle gaps on the stream", ms(self.gaps), pct(self.gaps));
        let acc = self.accounted();
        let (of, verdict) = match self.clock {
            StepClock::Host => ("the host's step time", ""),
            StepClock::Device if self.sums_to_the_step() => ("the device's step time (marker to marker)", ""),
            StepClock::Device => (
                "the device's step time (marker to marker)",
                " -- more than 5% off: launches overlap or fall outside their step",
            ),
        };
        out += &format!(
            "  {:<40} {:>9.2} ms {:>6.1}% of {of} {:.2} ms{verdict}\n",
            "sum",
            ms(acc),
            pct(acc),
            ms(self.step)
        );
        if let Some(line) = self.gemm_bound() {
            out += &line;
        }
        out
    }

    /// The step's GEMMs against the device's measured GEMM rate: how long they took, how long
    /// they would take at that rate, and the step time that leaves with everything else as
    /// measured (a bound on what faster GEMMs alone can give).
    fn gemm_bound(&self) -> Option<String> {
        let peak = self.gemm_peak.filter(|&p| p > 0.0)?;
        let (secs, flops) = self.gemms.iter().fold((0.0, 0.0), |(s, f), g| (s + g.1, f + g.2));
        if secs <= 0.0 || self.step <= 0.0 {
            return None;
        }
        let at_peak = flops / peak;
        Some(format!(
            "  GEMMs: {:.1} TFLOP a step in {:.2} ms ({:.0} TFLOP/s, {:.0}% of the measured {:.0} TFLOP/s); at that rate \
             {:.2} ms, and the step {:.2} ms with the rest ({:.2} ms) as measured\n",
            flops / 1e12,
            secs * 1e3,
            flops / secs / 1e12,
            100.0 * flops / secs / peak,
            peak / 1e12,
            at_peak * 1e3,
            (self.step - secs + at_peak) * 1e3,
            (self.step - secs) * 1e3
        ))
    }
}

/// The operation label of an `m x n x k` GEMM (`gemm MxNxK`); [`gemm_flops`] reads it back.
pub fn gemm_label(m: usize, n: usize, k: usize) -> String {
    format!("gemm {m}x{n}x{k}")
}

/// The label of a kernel of our own that is an `m x n x k` GEMM with more in its epilogue
/// (kernels/mlp.cu): `<symbol> = gemm MxNxK`, its own row in the per-operation table, counted
/// with the GEMMs by [`gemm_flops`].
pub fn fused_gemm_label(symbol: &str, m: usize, n: usize, k: usize) -> String {
    format!("{symbol} = {}", gemm_label(m, n, k))
}

/// The FLOPs of a GEMM from its operation label ([`gemm_label`], [`fused_gemm_label`]).
pub fn gemm_flops(label: &str) -> Option<f64> {
    let gemm = label.rsplit_once(" = ").map_or(label, |(_, g)| g);
    let dims: Vec<f64> =
        gemm.strip_prefix("gemm ")?.split('x').map(|d| d.parse::<f64>().ok()).collect::<Option<_>>()?;
    match dims[..] {
        [m, n, k] => Some(2.0 * m * n * k),
        _ => None,
    }
}

/// Device seconds and count per operation label, in first-seen order.
pub fn by_op(iv: impl IntoIterator<Item = (String, f64)>) -> Vec<(String, f64, usize)> {
    let mut out: Vec<(String, f64, usize)> = Vec::new();
    for (op, secs) in iv {
        match out.iter_mut().find(|(o, _, _)| *o == op) {
            Some(e) => {
                e.1 += secs.max(0.0);
                e.2 += 1;
            }
            None => out.push((op, secs.max(0.0), 1)),
        }
    }
    out
}

/// Folds intervals `(phase, start, end)` (seconds from any common origin) into one step.
pub fn fold(mut iv: Vec<(Phase, f64, f64)>) -> StepPhases {
    if iv.is_empty() {
        return StepPhases::default();
    }
    iv.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut by: Vec<(Phase, f64)> = Vec::new();
    for &(p, a, b) in &iv {
        match by.iter_mut().find(|(q, _)| *q == p) {
            Some(e) => e.1 += (b - a).max(0.0),
            None => by.push((p, (b - a).max(0.0))),
        }
    }
    let first = iv[0].1;
    let (stretches, reach) = idle_stretches(&iv, first);
    StepPhases {
        by_phase: by,
        gaps: stretches.iter().map(|&(_, g)| g).sum(),
        span: reach - first,
        step: None,
        intervals: iv.len(),
        by_op: Vec::new(),
        gaps_by_op: Vec::new(),
        gemms: Vec::new(),
    }
}

/// [`fold`] for a step between two markers at `start` and `end` (same origin): the time before
/// the first interval and after the last one counts as idle, and the span is the marker-to-marker
/// step time.
pub fn fold_between(iv: Vec<(Phase, f64, f64)>, start: f64, end: f64) -> StepPhases {
    let lead = iv.iter().map(|x| x.1).min_by(f64::total_cmp);
    let tail = iv.iter().map(|x| x.2).max_by(f64::total_cmp);
    let mut s = fold(iv);
    s.gaps += match (lead, tail) {
        (Some(first), Some(last)) => (first - start).max(0.0) + (end - last).max(0.0),
        _ => (end - start).max(0.0),
    };
    s.span = end - start;
    s.step = Some(end - start);
    s
}

/// One entry of a profiler's list of timed work, in the order the host enqueued it.
#[derive(Clone, Debug, PartialEq)]
pub enum Timed<E> {
    /// A kernel, GEMM or copy between two events, filed under its phase and operation label.
    Launch { phase: Phase, op: String, start: E, end: E },
    /// A step boundary (`Backend::mark_step`).
    Marker(E),
}

/// The launches of one step and the markers around it.
#[derive(Clone, Debug, PartialEq)]
pub struct StepWork<E> {
    pub start: E,
    pub end: E,
    pub launches: Vec<(Phase, String, E, E)>,
}

/// Takes from the front of `list` every complete step: the work from one marker to the next,
/// where every event up to the closing marker has completed (`done`, a non-blocking query; with
/// `all`, the host has waited for everything and every event counts as done). The last completed
/// marker stays at the front of `list` (it opens the next step), with everything after it; a
/// partial step is never taken. Launches before the first marker belong to no step: they are
/// dropped once that marker has completed.
pub fn take_complete_steps<E: Clone>(
    list: &mut Vec<Timed<E>>,
    all: bool,
    mut done: impl FnMut(&E) -> bool,
) -> Vec<StepWork<E>> {
    let mut last_marker = None;
    for (i, t) in list.iter().enumerate() {
        let ev = match t {
            Timed::Launch { end, .. } => end,
            Timed::Marker(e) => e,
        };
        if !all && !done(ev) {
            break;
        }
        if matches!(t, Timed::Marker(_)) {
            last_marker = Some(i);
        }
    }
    let Some(last) = last_marker else { return Vec::new() };
    let mut steps = Vec::new();
    let mut open: Option<StepWork<E>> = None;
    for t in list.drain(..last) {
        match t {
            Timed::Launch { phase, op, start, end } => {
                if let Some(w) = open.as_mut() {
                    w.launches.push((phase, op, start, end));
                }
            }
            Timed::Marker(e) => {
                if let Some(mut w) = open.take() {
                    w.end = e.clone();
                    steps.push(w);
                }
                open = Some(StepWork { start: e.clone(), end: e, launches: Vec::new() });
            }
        }
    }
    if let (Some(mut w), Some(Timed::Marker(e))) = (open, list.first()) {
        w.end = e.clone();
        steps.push(w);
    }
    steps
}

/// Times one step's work: `at` gives an event's seconds from a common origin.
pub fn time_step<E, X>(w: &StepWork<E>, mut at: impl FnMut(&E) -> Result<f64, X>) -> Result<StepPhases, X> {
    let (start, end) = (at(&w.start)?, at(&w.end)?);
    let mut spans = Vec::with_capacity(w.launches.len());
    let mut ops = Vec::with_capacity(w.launches.len());
    for (p, op, a, b) in &w.launches {
        let (a, b) = (at(a)?, at(b)?);
        spans.push((*p, a, b));
        ops.push((op.clone(), b - a));
    }
    let gaps = gaps_by_next(&spans, &ops, start, end);
    let mut gemms = Vec::new();
    for (&(p, a, b), (op, _)) in spans.iter().zip(&ops) {
        if let Some(f) = gemm_flops(op) {
            add_gemm(&mut gemms, p, (b - a).max(0.0), f);
        }
    }
    let mut step = fold_between(spans, start, end);
    step.gemms = gemms;
    step.by_op = by_op(ops);
    step.gaps_by_op = by_op(gaps);
    Ok(step)
}

/// Each idle stretch of a step between markers at `start` and `end`, labelled by the launch that
/// ends it (`spans[i]` is `ops[i]`'s interval) or "step end"; they sum to `fold_between`'s gaps.
fn gaps_by_next(spans: &[(Phase, f64, f64)], ops: &[(String, f64)], start: f64, end: f64) -> Vec<(String, f64)> {
    let (stretches, reach) = idle_stretches(spans, start);
    let mut out: Vec<(String, f64)> = stretches.into_iter().map(|(i, g)| (ops[i].0.clone(), g)).collect();
    if end > reach {
        out.push(("step end".to_string(), end - reach));
    }
    out
}

/// The idle stretches among intervals `(phase, start, end)` from time `from` on, in time order:
/// each as (the index in `spans` of the interval that ends it, its length); and the last end
/// (`from` without intervals). Overlapping intervals leave no stretch between them.
fn idle_stretches(spans: &[(Phase, f64, f64)], from: f64) -> (Vec<(usize, f64)>, f64) {
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by(|&i, &j| spans[i].1.total_cmp(&spans[j].1));
    let (mut reach, mut out) = (from, Vec::new());
    for i in order {
        let (_, a, b) = spans[i];
        if a > reach {
            out.push((i, a - reach));
        }
        reach = reach.max(b);
    }
    (out, reach)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_nest_and_restore() {
        assert_eq!(current(), Region::Other);
        {
            let _t = enter(Region::Target);
            assert_eq!(current(), Region::Target);
            {
                let _l = enter(Region::Loss);
                assert_eq!(current(), Region::Loss);
            }
            assert_eq!(current(), Region::Target);
        }
        assert_eq!(current(), Region::Other);
    }

    #[test]
    fn phases_by_region_and_work() {
        let k = |family, symbol| Work::Kernel { family, symbol };
        assert_eq!(Phase::of(Region::Target, Work::Gemm), Phase::TargetGemm);
        assert_eq!(Phase::of(Region::Target, k("mlp", "mlp_swiglu_wgmma_bf16")), Phase::TargetGemm);
        assert_eq!(Phase::of(Region::Target, k("swiglu", "swiglu_fwd_bf16")), Phase::TargetElementwise);
        assert_eq!(Phase::of(Region::Target, k("attention", "attn_causal_fwd_bf16_hd128")), Phase::TargetAttention);
        assert_eq!(Phase::of(Region::Target, k("pack", "pack_taps_noise_bf16")), Phase::PackNoise);
        assert_eq!(
            Phase::of(Region::Drafter, k("attention", "attn_draft_bwd_q_bf16_hd128")),
            Phase::DrafterAttentionBwd
        );
        assert_eq!(Phase::of(Region::Drafter, k("attention", "attn_draft_fwd_bf16_hd128")), Phase::DrafterAttentionFwd);
        assert_eq!(Phase::of(Region::Drafter, k("rmsnorm", "rmsnorm_fwd_bf16")), Phase::DrafterElementwise);
        // The drafter's forward runs the fused gate | up kernel too (keeping gate | up).
        assert_eq!(Phase::of(Region::Drafter, k("mlp", "mlp_swiglu_wgmma_bf16")), Phase::DrafterGemm);
        assert_eq!(Phase::of(Region::Drafter, k("swiglu", "swiglu_bwd_bf16")), Phase::DrafterElementwise);
        assert_eq!(Phase::of(Region::Loss, Work::Gemm), Phase::LossHead);
        assert_eq!(Phase::of(Region::Drafter, k("fc", "fc_wgmma_bf16")), Phase::FcProjection);
        assert_eq!(Phase::of(Region::Optimizer, Work::Copy), Phase::Copies);
    }

    #[test]
    fn operations_sum_per_label_and_rank_by_time() {
        let ops = by_op(vec![("gemm 1x8x8".into(), 2e-3), ("copy".into(), 1e-3), ("gemm 1x8x8".into(), 3e-3)]);
        assert_eq!(ops, vec![("gemm 1x8x8".to_string(), 5e-3, 2), ("copy".to_string(), 1e-3, 1)]);
        let step = |by_op: Vec<(String, f64, usize)>| (StepPhases { by_op, ..StepPhases::default() }, 1.0);
        let t = PhaseTable::from_steps(
            &[step(ops.clone()), step(vec![("copy".into(), 9e-3, 3)]), step(vec![("copy".into(), 7e-3, 1)])],
            1,
        )
        .unwrap();
        // Means over the two steps after the warm-up: copy (9 + 7) / 2 ms, 2 launches a step.
        assert_eq!(t.by_op.len(), 1);
        assert!((t.by_op[0].1 - 8e-3).abs() < 1e-12 && (t.by_op[0].2 - 2.0).abs() < 1e-12);
        assert!(t.render_ops(5).contains("copy"));
    }

    #[test]
    fn gemm_rows_show_their_rate() {
        assert_eq!(gemm_flops(&gemm_label(2, 3, 4)), Some(48.0));
        assert_eq!(gemm_flops("gemm 2x3"), None);
        assert_eq!(gemm_flops("gemm_like 2x3x4"), None);
        assert_eq!(gemm_flops("copy"), None);
        assert_eq!(gemm_flops(&fused_gemm_label("mlp_swiglu_wgmma_bf16", 2, 3, 4)), Some(48.0));
        assert_eq!(gemm_flops("mlp_swiglu_wgmma_bf16 = gemm 2x3"), None);
        // 12288 x 34816 x 5120 in 6.4 ms, twice a step: 684.6 TFLOP/s.
        let by_op = vec![(gemm_label(12288, 34816, 5120), 12.8e-3, 2), ("copy".to_string(), 1e-3, 1)];
        let step = || (StepPhases { by_op: by_op.clone(), ..StepPhases::default() }, 1.0);
        let t = PhaseTable::from_steps(&[step(), step()], 1).unwrap();
        let text = t.render_ops(5);
        let gemm = text.lines().find(|l| l.contains("gemm")).unwrap();
        assert!(gemm.ends_with("685 TFLOP/s"), "{text}");
        assert!(!text.lines().find(|l| l.contains("copy")).unwrap().contains("TFLOP"), "{text}");
    }

    #[test]
    fn phases_show_their_gemms_rate_and_the_step_at_the_measured_peak() {
        use Phase::*;
        // 12288 x 24576 x 4096 (2.47 TFLOP) in 4 ms in the target, twice that in 9 ms in the
        // drafter beside 1 ms of attention, in a 20 ms step.
        let g = gemm_label(12288, 24576, 4096);
        let f = gemm_flops(&g).unwrap();
        let w = StepWork {
            start: (0.0, true),
            end: (0.020, true),
            launches: vec![
                (TargetGemm, g.clone(), (0.0, true), (0.004, true)),
                (DrafterGemm, g.clone(), (0.004, true), (0.008, true)),
                (DrafterAttentionFwd, "attn_draft_fwd".to_string(), (0.008, true), (0.009, true)),
                (DrafterGemm, g.clone(), (0.009, true), (0.014, true)),
            ],
        };
        let s = timed(&w);
        let drafter = s.gemms.iter().find(|x| x.0 == DrafterGemm).unwrap();
        assert!((drafter.1 - 0.009).abs() < 1e-12 && (drafter.2 - 2.0 * f).abs() < 1.0);
        assert!(!s.gemms.iter().any(|x| x.0 == DrafterAttentionFwd), "attention is no GEMM");
        let mut t = PhaseTable::from_marked_steps(&[s.clone(), s], 0).unwrap();
        let text = t.render();
        let row = |name: &str| text.lines().find(|l| l.contains(name)).unwrap().to_string();
        // 2.47 TFLOP / 4 ms = 618 TFLOP/s; 4.95 TFLOP / 9 ms = 550.
        assert!(row("target GEMMs").ends_with("GEMMs 4.00 ms at 618 TFLOP/s"), "{text}");
        assert!(row("drafter GEMMs").ends_with("GEMMs 9.00 ms at 550 TFLOP/s"), "{text}");
        assert!(!row("drafter attention fwd").contains("TFLOP"), "{text}");
        assert!(!text.contains("at that rate"), "no peak, no bound: {text}");
        // At a measured 742.2 TFLOP/s the 7.42 TFLOP take 10 ms: the 20 ms step with 13 ms of
        // GEMMs would take 17 ms.
        t.gemm_peak = Some(3.0 * f / 0.010);
        let text = t.render();
        let bound = text.lines().last().unwrap();
        assert!(
            bound.contains("7.4 TFLOP a step in 13.00 ms (571 TFLOP/s, 77% of the measured 742 TFLOP/s)"),
            "{bound}"
        );
        assert!(
            bound.contains("at that rate 10.00 ms, and the step 17.00 ms with the rest (7.00 ms) as measured"),
            "{bound}"
        );
    }

    #[test]
    fn fold_sums_phases_and_gaps_to_the_span() {
        let iv = vec![
            (Phase::TargetGemm, 0.0, 1.0),
            (Phase::DrafterGemm, 3.0, 4.5),
            (Phase::TargetGemm, 1.0, 2.0),
            (Phase::Copies, 5.0, 5.5),
        ];
        let s = fold(iv);
        assert_eq!(s.intervals, 4);
        assert!((s.span - 5.5).abs() < 1e-12);
        assert!((s.gaps - 1.5).abs() < 1e-12, "gaps {}", s.gaps);
        let tg = s.by_phase.iter().find(|(p, _)| *p == Phase::TargetGemm).unwrap().1;
        assert!((tg - 2.0).abs() < 1e-12);
        let t = PhaseTable::from_steps(&[(s.clone(), 6.0), (s, 6.0)], 1).unwrap();
        assert_eq!(t.steps, 1);
        assert!((t.accounted() - 5.5).abs() < 1e-12);
        assert!(t.render().contains("target GEMMs"));
    }

    /// A synthetic event: its time (seconds) and whether the device has passed it.
    type Ev = (f64, bool);

    fn launch(phase: Phase, op: &str, a: f64, b: f64, done: bool) -> Timed<Ev> {
        Timed::Launch { phase, op: op.into(), start: (a, done), end: (b, done) }
    }

    fn marker(t: f64, done: bool) -> Timed<Ev> {
        Timed::Marker((t, done))
    }

    fn timed(w: &StepWork<Ev>) -> StepPhases {
        time_step(w, |e: &Ev| Ok::<f64, ()>(e.0)).unwrap()
    }

    #[test]
    fn complete_steps_are_split_at_the_markers_and_the_rest_stays() {
        use Phase::*;
        let mut list = vec![
            launch(Other, "upload", 0.0, 0.5, true), // before the first marker: no step's
            marker(1.0, true),
            launch(TargetGemm, "gemm 8x8x8", 1.5, 2.0, true),
            launch(DrafterGemm, "gemm 8x8x8", 2.0, 3.0, true),
            marker(4.0, true),
            launch(Optimizer, "adamw", 4.0, 5.0, true),
            marker(6.0, true),
            launch(TargetGemm, "gemm 8x8x8", 6.0, 7.0, false), // the device is here
            marker(8.0, false),
        ];
        let steps = take_complete_steps(&mut list, false, |e| e.1);
        assert_eq!(steps.len(), 2);
        assert_eq!((steps[0].start.0, steps[0].end.0, steps[0].launches.len()), (1.0, 4.0, 2));
        assert_eq!((steps[1].start.0, steps[1].end.0, steps[1].launches.len()), (4.0, 6.0, 1));
        // The last completed marker opens the next step, which is not complete yet.
        assert_eq!(
            list,
            vec![marker(6.0, true), launch(TargetGemm, "gemm 8x8x8", 6.0, 7.0, false), marker(8.0, false)]
        );
        // Nothing new completed: nothing taken, nothing lost.
        assert!(take_complete_steps(&mut list, false, |e| e.1).is_empty());
        assert_eq!(list.len(), 3);
        // The end of the run: the host waited for everything.
        let last = take_complete_steps(&mut list, true, |_| false);
        assert_eq!(last.len(), 1);
        assert_eq!((last[0].start.0, last[0].end.0, last[0].launches.len()), (6.0, 8.0, 1));
        assert_eq!(list, vec![marker(8.0, false)]);

        // Each step's phases and gaps add up to its marker-to-marker time.
        let s0 = timed(&steps[0]);
        assert_eq!(s0.step, Some(3.0));
        assert!((s0.gaps - 1.5).abs() < 1e-12, "0.5 before the first launch, 1.0 after the last: {}", s0.gaps);
        assert!((s0.accounted() - 3.0).abs() < 1e-12);
        assert_eq!(s0.by_op, vec![("gemm 8x8x8".to_string(), 1.5, 2)]);
        // The gaps by what ends them: 0.5 before the first GEMM, 1.0 from the last launch to the
        // closing marker; they sum to the step's gaps.
        assert_eq!(s0.gaps_by_op, vec![("gemm 8x8x8".to_string(), 0.5, 1), ("step end".to_string(), 1.0, 1)]);
        let t = PhaseTable::from_marked_steps(&[s0.clone(), s0], 0).unwrap();
        assert!(t.render_ops(5).contains("before step end"), "{}", t.render_ops(5));
    }

    #[test]
    fn gaps_are_labelled_by_the_launch_that_ends_them_and_overlaps_leave_none() {
        use Phase::*;
        let spans = [(TargetGemm, 1.0, 2.0), (Copies, 1.5, 2.5), (DrafterGemm, 3.0, 4.0), (Optimizer, 3.5, 3.8)];
        let ops: Vec<(String, f64)> = ["gemm", "copy", "attn", "adamw"].iter().map(|o| (o.to_string(), 0.0)).collect();
        let g = gaps_by_next(&spans, &ops, 0.5, 4.25);
        assert_eq!(g, vec![("gemm".to_string(), 0.5), ("attn".to_string(), 0.5), ("step end".to_string(), 0.25)]);
        let total: f64 = g.iter().map(|x| x.1).sum();
        assert!((total - fold_between(spans.to_vec(), 0.5, 4.25).gaps).abs() < 1e-12);
    }

    #[test]
    fn a_step_is_not_taken_before_all_of_its_work_completed() {
        use Phase::*;
        // The closing marker completed, but a launch before it (on another stream) did not.
        let mut list = vec![
            marker(0.0, true),
            launch(Copies, "copy", 0.5, 3.0, false),
            launch(TargetGemm, "gemm 8x8x8", 1.0, 2.0, true),
            marker(2.0, true),
        ];
        assert!(take_complete_steps(&mut list, false, |e| e.1).is_empty());
        assert_eq!(list.len(), 4);
        // No marker at all (a bench's forward): no step.
        let mut bare = vec![launch(TargetGemm, "gemm 8x8x8", 0.0, 1.0, true)];
        assert!(take_complete_steps(&mut bare, true, |e| e.1).is_empty());
        assert_eq!(bare.len(), 1);
        // An empty step: all of it idle.
        let mut empty = vec![marker(0.0, true), marker(2.0, true)];
        let s = take_complete_steps(&mut empty, false, |e| e.1);
        let p = timed(&s[0]);
        assert_eq!((p.intervals, p.gaps, p.step), (0, 2.0, Some(2.0)));
    }

    #[test]
    fn the_sum_check_holds_on_one_stream_and_fails_on_overlap_or_leaks() {
        use Phase::*;
        let step = |launches: Vec<(Phase, f64, f64)>, start: f64, end: f64| {
            let w = StepWork {
                start: (start, true),
                end: (end, true),
                launches: launches.into_iter().map(|(p, a, b)| (p, "op".to_string(), (a, true), (b, true))).collect(),
            };
            timed(&w)
        };
        let serial = step(vec![(TargetGemm, 0.1, 0.4), (LossHead, 0.45, 0.9), (Optimizer, 0.9, 0.98)], 0.0, 1.0);
        let t = PhaseTable::from_marked_steps(&[serial.clone(), serial.clone(), serial], 1).unwrap();
        assert_eq!((t.steps, t.clock), (2, StepClock::Device));
        assert!((t.step - 1.0).abs() < 1e-12 && (t.accounted() - 1.0).abs() < 1e-12);
        assert!(t.sums_to_the_step());
        assert!(t.render().contains("of the device's step time"), "{}", t.render());
        assert!(!t.render().contains("more than 5% off"));
        // Two launches at once (another stream): the phases count the overlap twice.
        let overlap = step(vec![(TargetGemm, 0.0, 0.6), (Copies, 0.3, 0.9)], 0.0, 1.0);
        assert!((overlap.accounted() - 1.3).abs() < 1e-12);
        let t = PhaseTable::from_marked_steps(&[overlap], 0).unwrap();
        assert!(!t.sums_to_the_step());
        assert!(t.render().contains("more than 5% off"));
        // A launch reaching past the closing marker (4% over: still within the tolerance).
        let leak = step(vec![(TargetGemm, 0.0, 1.04)], 0.0, 1.0);
        assert!(PhaseTable::from_marked_steps(&[leak], 0).unwrap().sums_to_the_step());
        let leak = step(vec![(TargetGemm, 0.0, 1.2)], 0.0, 1.0);
        assert!(!PhaseTable::from_marked_steps(&[leak], 0).unwrap().sums_to_the_step());
        // A step without marker times has no device step time.
        assert!(PhaseTable::from_marked_steps(&[StepPhases::default()], 0).is_none());
    }
}
