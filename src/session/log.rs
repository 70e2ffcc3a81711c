//! What a run shows: the header lines, the progress bar and one line per logged step, and the
//! summary at the end. `--quiet` hides the bar and the step lines; the header and the summary
//! always print (to stderr).

use std::path::PathBuf;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

use crate::pipeline::PipelineStats;
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
    /// Wall time of each step as the drafter side saw it (checkpoint writes excluded).
    pub step_ms: Vec<f64>,
    pub checkpoint_seconds: f64,
    /// The backend's device-memory report (the CUDA allocator's peak and reserved bytes).
    pub device_memory: Option<String>,
    /// `--profile`: the step's device time by phase.
    pub phases: Option<crate::backend::profile::PhaseTable>,
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

/// The step log of a run: the bar, the header line and one line every `log_every` steps.
pub struct StepLog {
    pb: ProgressBar,
    quiet: bool,
    log_every: u32,
    steps: u32,
    first_step: u32,
    last: Instant,
    pub history: Vec<StepMetrics>,
    pub step_ms: Vec<f64>,
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
        };
        if !quiet {
            log.line(HEADER.to_string());
        }
        log
    }

    fn line(&self, text: String) {
        // A hidden bar (no terminal) would swallow println: print plainly then.
        if self.pb.is_hidden() {
            eprintln!("{text}");
        } else {
            self.pb.println(text);
        }
    }

    /// Records a finished step; returns its wall time in ms (since the previous step ended).
    pub fn step(&mut self, m: &StepMetrics) -> f64 {
        let ms = self.last.elapsed().as_secs_f64() * 1e3;
        self.pb.inc(1);
        let done = m.step + 1;
        let log = m.step == self.first_step || done % self.log_every == 0 || done == self.steps || m.skipped;
        if log && !self.quiet {
            let note = if m.skipped { "  (step skipped: non-finite loss or grad norm)" } else { "" };
            self.line(format!(
                "{:>6} | {:>6.3} | {:>5.3} | {:>6.3} | {:>9.3} | {:>8.2e} | {:>6.0} | {:>8.0} | n/a{note}",
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
        self.history.push(m.clone());
        self.step_ms.push(ms);
        ms
    }

    /// The next step's time starts now (after a checkpoint write, which is not step time).
    pub fn restart_clock(&mut self) {
        self.last = Instant::now();
    }

    pub fn finish(&self) {
        self.pb.finish_and_clear();
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
    // steps also pay for plan selection and the allocator's first segments).
    let train = (wall - r.checkpoint_seconds).max(1e-9);
    let mut ms = r.step_ms.clone();
    ms.sort_by(|a, b| a.total_cmp(b));
    let median = ms.get(ms.len() / 2).copied().unwrap_or(0.0);
    let steps = f64::from(st.steps.max(1));
    eprintln!(
        "throughput     {:.0} tokens/s, {:.0} draft positions/s; {:.1} ms/step mean, {:.1} ms/step median ({:.0} tokens/s at the median)",
        st.tokens as f64 / train,
        st.draft_positions as f64 / train,
        1e3 * train / steps,
        median,
        st.tokens as f64 / steps / (median / 1e3).max(1e-9)
    );
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
        eprint!("{}", p.render_ops(15));
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
    if let Some(c) = &r.checkpoint {
        eprintln!("checkpoint     {}", c.display());
    }
}
