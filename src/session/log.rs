//! What a run shows: the header lines, the progress bar and one line per logged step, and the
//! summary at the end. `--quiet` hides the bar and the step lines; the header and the summary
//! always print (to stderr).

use std::path::PathBuf;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

pub use crate::backend::profile::StepClock;
use crate::pipeline::PipelineStats;
use crate::train::flops::Mfu;
use crate::train::step::StepMetrics;

/// What a run reports at the end (also what tests assert on).
#[derive(Clone, Debug, Default)]
pub struct RunSummary {
    pub history: Vec<StepMetrics>,
    pub stats: PipelineStats,
    pub first_step: u32,
    pub checkpoint: Option<PathBuf>,
    pub backend: String,
    pub peak_rss_bytes: Option<u64>,
    pub data_samples: usize,
    pub gen_seconds: f64,
    pub load_seconds: f64,
    /// Each step's time on `step_clock`: the device's time from the step's marker to the next
    /// (the synchronous loop on a GPU), else the wall time the drafter side saw between two
    /// reports (checkpoint writes excluded).
    pub step_ms: Vec<f64>,
    pub step_clock: StepClock,
    /// Indices into `step_ms` of steps whose device time holds a checkpoint write (the device
    /// idles while the host writes it): left out of the summary's mean and median.
    pub checkpoint_in_step: Vec<usize>,
    pub checkpoint_seconds: f64,
    /// The backend's device-memory report (the CUDA allocator's peak and reserved bytes).
    pub device_memory: Option<String>,
    /// Each GPU's clocks and power over the run (`backend::clocks`); empty on the CPU.
    pub clocks: Vec<String>,
    /// `--profile`: the step's device time by phase.
    pub phases: Option<crate::backend::profile::PhaseTable>,
    /// `--profile`: the steps the table averages, one entry per step, in order.
    pub phase_steps: Vec<crate::backend::profile::StepPhases>,
    /// The FLOP model and peak (measured or given) of the MFU column; `None` without a peak.
    pub mfu: Option<Mfu>,
    /// `--mfu-peak off`: no MFU asked for (the summary says so instead of why there is none).
    pub mfu_off: bool,
}

impl RunSummary {
    /// The step times (ms) the summary's mean and median are taken over: `step_ms` without the
    /// steps that hold a checkpoint write.
    pub fn steady_step_ms(&self) -> Vec<f64> {
        self.step_ms.iter().enumerate().filter(|(i, _)| !self.checkpoint_in_step.contains(i)).map(|(_, &m)| m).collect()
    }

    /// The MFU line: model FLOPs over the time of the steps `steady_step_ms` keeps, less the
    /// first when there are others (it builds the GEMM plans and the allocator's segments, as the
    /// phase table says), the FLOPs of a mean step by part, and the peak they are measured against.
    pub fn mfu_line(&self) -> Option<String> {
        let mfu = self.mfu.as_ref()?;
        let n_all = self.history.len().min(self.step_ms.len());
        let skip_first = usize::from(n_all > 1);
        let steady = || (skip_first..n_all).filter(|i| !self.checkpoint_in_step.contains(i));
        let n = steady().count();
        if n == 0 {
            return None;
        }
        let secs: f64 = steady().map(|i| self.step_ms[i] / 1e3).sum();
        let (mut target, mut gemm, mut attn) = (0.0, 0.0, 0.0);
        for i in steady() {
            let m = &self.history[i];
            target += mfu.target.of(m.tokens, m.causal_pairs);
            gemm += m.drafter_flops.gemm;
            attn += m.drafter_flops.attention;
        }
        let total = target + gemm + attn;
        let per = |x: f64| flops_text(x / n as f64);
        Some(format!(
            "{} of the {} peak: {} of model FLOPs per step (target forward {}, drafter {} of which attention {}) \
             at {}/s, against {}/s ({})",
            percent_text(100.0 * total / secs.max(1e-12) / mfu.peak),
            if mfu.measured { "measured" } else { "given" },
            per(total),
            per(target),
            per(gemm + attn),
            per(attn),
            flops_text(total / secs.max(1e-12)),
            flops_text(mfu.peak),
            mfu.peak_source
        ))
    }
}

/// FLOPs with a unit that leaves one to four digits before the point (`3.2 TFLOP`, `840 MFLOP`).
pub(crate) fn flops_text(x: f64) -> String {
    let (v, unit) = [(1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "kFLOP")]
        .into_iter()
        .find(|&(scale, _)| x >= scale)
        .map_or((x, "FLOP"), |(scale, unit)| (x / scale, unit));
    format!("{v:.1} {unit}")
}

/// A percentage with one decimal, and two significant digits below 1% (a tiny model's MFU is
/// not 0.0%).
fn percent_text(p: f64) -> String {
    if p >= 1.0 || p <= 0.0 || !p.is_finite() {
        format!("{p:.1}%")
    } else {
        let decimals = (1.0 - p.log10().floor()) as usize;
        format!("{p:.decimals$}%")
    }
}

/// A progress bar (hidden under `--quiet` or with `len` 0).
pub fn bar(quiet: bool, len: u64, msg: &str) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:30}] {pos}/{len} {elapsed_precise} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// The step log of a run: the bar, the header line and one line every `log_every` steps. The
/// ms column is the step's device time when the pipeline measures one (the synchronous loop on
/// a GPU): a step's line then waits until the device has finished the step (the next report, or
/// the end of the run), since the metrics arrive before that. Otherwise it is the host's time
/// between two reports and the line prints at once.
pub struct StepLog {
    pb: ProgressBar,
    quiet: bool,
    log_every: u32,
    steps: u32,
    first_step: u32,
    last: Instant,
    pub history: Vec<StepMetrics>,
    /// The host's time of each step (ms).
    pub step_ms: Vec<f64>,
    /// Lines not printed yet: waiting for their step's device time.
    waiting: std::collections::VecDeque<usize>,
    /// The MFU column's model and peak (`n/a` without).
    mfu: Option<Mfu>,
}

const HEADER: &str = "  step |   loss |   acc | accept | grad-norm |       lr |     ms |    tok/s | MFU";

impl StepLog {
    pub fn new(quiet: bool, log_every: u32, steps: u32, first_step: u32) -> Self {
        let pb = bar(quiet, u64::from(steps), "train");
        pb.set_position(u64::from(first_step));
        let log = StepLog {
            pb,
            quiet,
            log_every: log_every.max(1),
            steps,
            first_step,
            last: Instant::now(),
            history: Vec::new(),
            step_ms: Vec::new(),
            waiting: std::collections::VecDeque::new(),
            mfu: None,
        };
        if !quiet {
            log.line(HEADER.to_string());
        }
        log
    }

    /// Fills the MFU column from now on.
    pub fn set_mfu(&mut self, mfu: Mfu) {
        self.mfu = Some(mfu);
    }

    fn line(&self, text: String) {
        // A hidden bar (no terminal) would swallow println: print plainly then.
        if self.pb.is_hidden() {
            eprintln!("{text}");
        } else {
            self.pb.println(text);
        }
    }

    /// Records a finished step (`st`: the pipeline's counters, with the device step times known
    /// so far); returns its host time in ms: the synchronous loop's own measure of the step where
    /// it has one (`PipelineStats::host_step_secs`), else the time since the previous step ended.
    pub fn step(&mut self, m: &StepMetrics, st: &PipelineStats) -> f64 {
        let ms = match st.host_step_secs.get(self.history.len()) {
            Some(secs) => secs * 1e3,
            None => self.last.elapsed().as_secs_f64() * 1e3,
        };
        self.pb.inc(1);
        self.history.push(m.clone());
        self.step_ms.push(ms);
        self.waiting.push_back(self.history.len() - 1);
        self.print_ready(st, false);
        ms
    }

    /// Prints the waiting lines whose time is known, in order (`all`: every one, on the host's
    /// time where the device's is missing).
    fn print_ready(&mut self, st: &PipelineStats, all: bool) {
        while let Some(&i) = self.waiting.front() {
            let ms = match st.device_step_secs.get(i) {
                Some(secs) => secs * 1e3,
                None if all || !st.device_clock => self.step_ms[i],
                None => break,
            };
            self.waiting.pop_front();
            let m = &self.history[i];
            let done = m.step + 1;
            let log = m.step == self.first_step || done % self.log_every == 0 || done == self.steps || m.skipped;
            if log && !self.quiet {
                let note = if m.skipped { "  (step skipped: non-finite loss or grad norm)" } else { "" };
                let mfu = match &self.mfu {
                    Some(f) => percent_text(f.percent(m, ms / 1e3)),
                    None => "n/a".to_string(),
                };
                self.line(format!(
                    "{:>6} | {:>6.3} | {:>5.3} | {:>6.3} | {:>9.3} | {:>8.2e} | {:>6.0} | {:>8.0} | {mfu}{note}",
                    done,
                    m.loss,
                    m.accuracy,
                    m.accept_len,
                    m.grad_norm,
                    m.lr,
                    ms,
                    m.tokens as f64 / (ms / 1e3)
                ));
            }
        }
    }

    /// The next step's time starts now (after a checkpoint write, which is not step time).
    pub fn restart_clock(&mut self) {
        self.last = Instant::now();
    }

    /// Prints the lines still waiting (`st`: the counters at the end of the run) and clears the bar.
    pub fn finish(&mut self, st: &PipelineStats) {
        self.print_ready(st, true);
        self.pb.finish_and_clear();
    }

    /// Each step's time and the clock it was read from: the device's when it timed every
    /// recorded step, else the host's.
    pub fn step_times(&self, st: &PipelineStats) -> (Vec<f64>, StepClock) {
        match st.device_step_secs.get(..self.step_ms.len()) {
            Some(dev) if st.device_clock => (dev.iter().map(|s| s * 1e3).collect(), StepClock::Device),
            _ => (self.step_ms.clone(), StepClock::Host),
        }
    }
}

/// What is still held after the pipeline ended: pinned slots, and device bytes beyond those held
/// before it started (weights, optimizer state), per device.
pub fn leak_check(before: &[Option<usize>], after: &[Option<usize>], st: &PipelineStats) -> String {
    let mut parts = vec![format!("{} pinned slots held", st.slots_in_flight_at_end)];
    let mut leaked = st.slots_in_flight_at_end > 0;
    for (i, (b, a)) in before.iter().zip(after).enumerate() {
        let name = if before.len() == 1 { "device".to_string() } else { format!("device {i}") };
        if let (Some(b), Some(a)) = (b, a) {
            if a > b {
                leaked = true;
                parts.push(format!("{name} memory {} bytes above its start", a - b));
            } else {
                parts.push(format!("{name} memory back to its start"));
            }
        }
    }
    format!("{}: {}", if leaked { "LEAK" } else { "no leaked slot or block" }, parts.join(", "))
}

fn secs(d: std::time::Duration) -> f64 {
    d.as_secs_f64()
}

pub fn print_summary(r: &RunSummary) {
    let st = &r.stats;
    let wall = secs(st.wall).max(1e-9);
    eprintln!("\n== run summary ({}) ==", r.backend);
    if let (Some(first), Some(last)) = (r.history.first(), r.history.last()) {
        eprintln!("steps          {} (from {} to {}), {} skipped", st.steps, r.first_step, last.step + 1, st.skipped);
        eprintln!("loss           {:.4} -> {:.4}", first.loss, last.loss);
        eprintln!("accuracy       {:.3} -> {:.3}", first.accuracy, last.accuracy);
        eprintln!(
            "accept length  {:.3} -> {:.3} per position; {:.3} -> {:.3} per round (what decoding gets)",
            first.accept_len, last.accept_len, first.round_accept_len, last.round_accept_len
        );
    }
    // Training time excludes checkpoint writes; the median step is the steady state (the first
    // steps also pay for plan selection and the allocator's first segments). The step times are
    // the device's (marker to marker on the compute stream) where the run measured them: the
    // host's time between two reports is whatever slice of the device's work it was blocked on.
    let train = (wall - r.checkpoint_seconds).max(1e-9);
    let mut ms = r.steady_step_ms();
    ms.sort_by(|a, b| a.total_cmp(b));
    let median = ms.get(ms.len() / 2).copied().unwrap_or(0.0);
    let mean = if ms.is_empty() { 0.0 } else { ms.iter().sum::<f64>() / ms.len() as f64 };
    let steps = f64::from(st.steps.max(1));
    eprintln!(
        "throughput     {:.0} tokens/s, {:.0} draft positions/s over the training wall time",
        st.tokens as f64 / train,
        st.draft_positions as f64 / train,
    );
    let left_out = match r.step_ms.len() - ms.len() {
        0 => String::new(),
        n => format!("; {n} step{} holding a checkpoint write left out", if n == 1 { "" } else { "s" }),
    };
    eprintln!(
        "step time      {:.1} ms mean, {:.1} ms median ({:.0} tokens/s at the median), {}{left_out}",
        mean,
        median,
        st.tokens as f64 / steps / (median / 1e3).max(1e-9),
        r.step_clock.describe()
    );
    match r.mfu_line() {
        Some(line) => eprintln!("mfu            {line}"),
        None if r.mfu_off => eprintln!("mfu            off (--mfu-peak off)"),
        None if r.mfu.is_none() => {
            eprintln!("mfu            n/a: no device clock to measure a GEMM peak with (the CPU backend)")
        }
        None => {}
    }
    eprintln!(
        "time           wall {:.1} s: training {:.1} s, checkpoints {:.1} s; before it: target load {:.1} s, data generation {:.1} s",
        wall, train, r.checkpoint_seconds, r.load_seconds, r.gen_seconds
    );
    if st.target_ranks > 1 || st.drafter_ranks > 1 {
        eprintln!(
            "  (host-side times below are sums over {} target and {} drafter threads; idle is their mean)",
            st.target_ranks, st.drafter_ranks
        );
    }
    if st.queue_capacity == 0 && st.target_busy.is_zero() {
        // One loop runs the target's forward and the drafter's step in turn: the host sees them
        // as one span (the device's split is `--profile`'s phase table).
        eprintln!(
            "  step         target forward + drafter fwd+bwd {:.1} s, optimizer {:.1} s (--sync: one loop, the two \
             sides in turn; --profile splits the step by phase)",
            secs(st.drafter_busy),
            secs(st.optimizer)
        );
    } else {
        eprintln!(
            "  target       forward+pack {:.1} s, blocked on full queue {:.1} s, split-FC sync {:.1} s -> idle {:.1}%",
            secs(st.target_busy),
            secs(st.target_blocked),
            secs(st.target_wait_fc),
            100.0 * st.target_idle_fraction()
        );
        eprintln!(
            "  drafter      fwd+bwd {:.1} s, optimizer {:.1} s, waiting for data {:.1} s -> idle {:.1}%",
            secs(st.drafter_busy),
            secs(st.optimizer),
            secs(st.drafter_wait),
            100.0 * st.drafter_idle_fraction()
        );
    }
    if st.queue_capacity > 0 {
        eprintln!(
            "  queue        mean depth {:.2} of {} (--max-inflight per link)",
            st.mean_queue_depth(),
            st.queue_capacity
        );
    }
    if !st.transport.is_empty() {
        // The copies' own rate (bytes over their device time) is what the peer copy baseline of
        // `bench-pipeline` compares with.
        let own = st.copy_seconds.filter(|&c| c > 0.0).map_or(String::new(), |c| {
            format!(", {:.1} GB/s over the copies' device time", st.bytes_moved as f64 / 1e9 / c)
        });
        eprintln!(
            "  transport    {}: {:.2} GB moved ({:.2} GB/s over the run{own}), publisher waited {:.2} s for copies, {} waits for a pinned slot",
            st.transport,
            st.bytes_moved as f64 / 1e9,
            st.bytes_moved as f64 / 1e9 / wall,
            secs(st.publisher_wait_copy),
            st.slot_waits
        );
    }
    if let Some(p) = &r.phases {
        eprint!("{}", p.render());
        eprint!("{}", p.render_ops(crate::backend::profile::PhaseTable::STEP_OPS));
    }
    if let Some(t) = st.target_gpu {
        eprintln!(
            "  target GPU   busy {:.2} s of {:.2} s on its stream (device timestamps): idle {:.1}% = {:.1}% waiting on the drafter side (full queue or pinned slots{}) + {:.1}% otherwise",
            secs(t.busy),
            secs(t.span),
            100.0 * t.idle(),
            100.0 * t.waiting_on_drafter(),
            if st.target_wait_fc.is_zero() { "" } else { "; split-FC's dY and fc update" },
            100.0 * t.idle_not_waiting()
        );
    }
    if st.target_gpus.len() > 1 {
        let per: Vec<String> = st
            .target_gpus
            .iter()
            .enumerate()
            .map(|(i, t)| {
                format!("{i}: {:.1}% (+{:.1}% waiting)", 100.0 * t.idle_not_waiting(), 100.0 * t.waiting_on_drafter())
            })
            .collect();
        eprintln!("  per target   idle on its stream, in --target-gpus order: {}", per.join(", "));
    }
    if st.drafter_ranks > 1 {
        match st.allreduce_seconds {
            Some(ar) => eprintln!(
                "  all-reduce   {} drafter ranks: {:.3} s of gradient all-reduce on rank 0's stream ({:.1} ms/step)",
                st.drafter_ranks,
                ar,
                1e3 * ar / steps
            ),
            None => eprintln!("  all-reduce   {} drafter ranks (no device timestamps)", st.drafter_ranks),
        }
    }
    if let Some(b) = r.peak_rss_bytes {
        eprintln!("peak memory    {:.1} MiB resident (host)", b as f64 / (1 << 20) as f64);
    }
    if let Some(d) = &r.device_memory {
        eprintln!("device memory  {d}");
    }
    for c in &r.clocks {
        eprintln!("clocks         {c}");
    }
    if let Some(c) = &r.checkpoint {
        eprintln!("checkpoint     {}", c.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(step: u32) -> StepMetrics {
        StepMetrics { step, tokens: 100, ..StepMetrics::default() }
    }

    /// With a device clock a step's line waits for the step's device time (the metrics arrive
    /// while the device still runs the step's update), and the summary takes the device's times;
    /// without one the host's times are used at once.
    #[test]
    fn step_lines_wait_for_the_device_clock_and_the_summary_uses_it() {
        let mut st = PipelineStats { device_clock: true, ..PipelineStats::default() };
        let mut log = StepLog::new(true, 1, 3, 0);
        log.step(&metrics(0), &st);
        assert_eq!(log.waiting.len(), 1, "step 0's device time is not known yet");
        st.device_step_secs.push(0.8);
        log.step(&metrics(1), &st);
        assert_eq!(log.waiting, [1], "step 0 printed, step 1 waits");
        // Not every recorded step timed yet: the host's times.
        assert_eq!(log.step_times(&st).1, StepClock::Host);
        st.device_step_secs.extend([0.7, 0.75]); // step 1, and a step the run stopped before updating
        log.finish(&st);
        assert!(log.waiting.is_empty());
        let (ms, clock) = log.step_times(&st);
        assert_eq!(clock, StepClock::Device);
        assert_eq!(ms.len(), 2);
        assert!((ms[0] - 800.0).abs() < 1e-9 && (ms[1] - 700.0).abs() < 1e-9, "{ms:?}");

        let host = PipelineStats::default();
        let mut log = StepLog::new(true, 1, 3, 0);
        log.step(&metrics(0), &host);
        assert!(log.waiting.is_empty());
        assert_eq!(log.step_times(&host), (log.step_ms.clone(), StepClock::Host));
    }

    #[test]
    fn steps_holding_a_checkpoint_are_left_out_of_the_steady_times() {
        let r = RunSummary {
            step_ms: vec![900.0, 800.0, 5800.0, 810.0],
            step_clock: StepClock::Device,
            checkpoint_in_step: vec![2],
            ..RunSummary::default()
        };
        assert_eq!(r.steady_step_ms(), vec![900.0, 800.0, 810.0]);
    }

    /// MFU: the step's model FLOPs (target from its tokens and pairs, the drafter's sums) over
    /// its time and the peak; the summary's over the steady steps only.
    #[test]
    fn mfu_is_model_flops_over_time_and_the_measured_peak() {
        use crate::train::flops::{DrafterFlops, TargetFlops};
        let mfu = Mfu {
            target: TargetFlops { gemm_per_token: 6e9, recurrence_per_token: 4e9, per_pair: 1e6 },
            peak: 8e12,
            peak_source: "a test".into(),
            measured: true,
        };
        // Target 100 * 1e10 + 1e6 * 1e6 = 2e12, drafter 1.5e12 + 0.5e12: 4e12 per step.
        let m = StepMetrics {
            tokens: 100,
            causal_pairs: 1e6,
            drafter_flops: DrafterFlops { gemm: 1.5e12, attention: 0.5e12 },
            ..StepMetrics::default()
        };
        assert_eq!(mfu.step_flops(&m), 4e12);
        assert!((mfu.percent(&m, 1.0) - 50.0).abs() < 1e-9);
        let r = RunSummary {
            history: vec![m.clone(), m.clone(), m.clone(), m],
            // The first step (GEMM plans, the allocator's first segments) and the third (holding a
            // checkpoint write) are left out.
            step_ms: vec![3000.0, 1000.0, 9000.0, 500.0],
            checkpoint_in_step: vec![2],
            mfu: Some(mfu),
            ..RunSummary::default()
        };
        // 8e12 FLOPs in 1.5 s against 8e12 FLOP/s: 66.7%.
        let line = r.mfu_line().unwrap();
        assert!(line.starts_with("66.7% of the measured peak: 4.0 TFLOP of model FLOPs"), "{line}");
        assert!(
            line.contains("(target forward 2.0 TFLOP, drafter 2.0 TFLOP of which attention 500.0 GFLOP)"),
            "{line}"
        );
        assert!(line.contains("at 5.3 TFLOP/s, against 8.0 TFLOP/s (a test)"), "{line}");
        assert_eq!(flops_text(3.2e6), "3.2 MFLOP");
        assert_eq!(flops_text(933_888.0), "933.9 kFLOP");
        assert_eq!(flops_text(12.0), "12.0 FLOP");
        assert_eq!(percent_text(0.0123), "0.012%");
        assert_eq!(percent_text(0.5), "0.50%");
        assert_eq!(percent_text(0.000_123_4), "0.00012%");
        assert_eq!(percent_text(42.04), "42.0%");
        assert_eq!(percent_text(0.0), "0.0%");
        assert_eq!(RunSummary::default().mfu_line(), None);
    }
}
