//! What the pipeline measured: time per stage, idle fractions, queue depth over time.

use std::time::Duration;

#[derive(Clone, Debug, Default)]
pub struct PipelineStats {
    pub steps: u32,
    pub skipped: u32,
    pub current_step: u32,
    pub stopped_early: bool,
    pub tokens: u64,
    pub draft_positions: u64,
    pub wall: Duration,
    /// Target forward + pack (+ noise).
    pub target_busy: Duration,
    /// The target side blocked on a full queue (it had nothing to do: the drafter is slower).
    pub target_blocked: Duration,
    /// Split-FC: the target side finishing the previous step's fc update.
    pub target_wait_fc: Duration,
    /// Drafter forward + backward.
    pub drafter_busy: Duration,
    /// The drafter waiting for a batch (it had nothing to do: the target is slower).
    pub drafter_wait: Duration,
    /// Grad norm, clip, AdamW.
    pub optimizer: Duration,
    /// Queue depth right after each publish.
    pub queue_depth: Vec<u32>,
    /// The queue's capacity (`--max-inflight`; 0 without a queue: the synchronous run).
    pub queue_capacity: usize,
    /// The transport used (`same`, `p2p`, `host`; several joined by `+` when pairs of GPUs differ).
    pub transport: String,
    /// Bytes the transports moved (both directions; 0 for a same-GPU hand-off).
    pub bytes_moved: u64,
    /// Device seconds the transports' copies took (None without device timestamps).
    pub copy_seconds: Option<f64>,
    /// The publisher waiting for copies to complete.
    pub publisher_wait_copy: Duration,
    /// The target's device timeline from timed events (summed over target GPUs). None on the CPU.
    pub target_gpu: Option<DeviceTimeline>,
    /// The same per target GPU (one entry per producer, in `--target-gpus` order).
    pub target_gpus: Vec<DeviceTimeline>,
    /// Target and drafter ranks of the run.
    pub target_ranks: usize,
    pub drafter_ranks: usize,
    /// Device seconds rank 0 spent in the gradient all-reduce (data parallel only).
    pub allreduce_seconds: Option<f64>,
    /// Pinned slots still held after the run (must be 0: DESIGN.md rule 5).
    pub slots_in_flight_at_end: usize,
    /// Times a sender found no free pinned slot and had to wait.
    pub slot_waits: u64,
    /// The synchronous loop on a backend with a device clock: each step's device seconds, from
    /// its step marker to the next, for the steps from the first one on in order, as far as the
    /// device has got (read without waiting; all of them once the run has ended). Empty
    /// otherwise.
    pub device_step_secs: Vec<f64>,
    /// Whether `device_step_secs` is being measured (the synchronous loop with a device clock).
    pub device_clock: bool,
    /// The synchronous loop on a backend without a device clock (whose work is done when its
    /// call returns): each step's host seconds, its data, forward, backward and update, in order.
    /// A step's report comes during the next step, so the time between two reports would be
    /// the next step's. Empty otherwise.
    pub host_step_secs: Vec<f64>,
}

/// A target stream's timeline, from timed events: `busy` = the stretches of target work, `span` =
/// first start to last end, `waiting` = the part of the gaps between stretches its thread spent
/// waiting on the drafter side (a full queue or no free pinned slot: the drafter is slower; exact
/// split-FC: dY, the norm and the fc update). Idle = span - busy; of it, `waiting` is the
/// drafter's doing and the rest the pipeline's (host work, copies, launches).
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceTimeline {
    pub busy: Duration,
    pub span: Duration,
    pub waiting: Duration,
}

/// `part / whole` (0 for an empty whole).
fn frac(part: Duration, whole: Duration) -> f64 {
    if whole.is_zero() {
        0.0
    } else {
        part.as_secs_f64() / whole.as_secs_f64()
    }
}

impl DeviceTimeline {
    fn part(&self, d: Duration) -> f64 {
        frac(d, self.span).clamp(0.0, 1.0)
    }
    /// Fraction of the span the stream had no target work.
    pub fn idle(&self) -> f64 {
        1.0 - self.part(self.busy)
    }
    /// Fraction of the span idle while the target waited on the drafter side.
    pub fn waiting_on_drafter(&self) -> f64 {
        self.part(self.waiting).min(self.idle())
    }
    /// Fraction of the span idle for any other reason: the pipeline's own cost.
    pub fn idle_not_waiting(&self) -> f64 {
        (self.idle() - self.waiting_on_drafter()).max(0.0)
    }
}

impl PipelineStats {
    /// Counts a finished step (both the synchronous loop and the pipeline's rank 0 call this).
    pub fn count_step(&mut self, m: &crate::train::step::StepMetrics, wall: Duration) {
        self.steps += 1;
        self.tokens += m.tokens as u64;
        self.draft_positions += m.draft_positions as u64;
        self.skipped += u32::from(m.skipped);
        self.wall = wall;
    }

    /// Fraction of the wall time the target side did not compute (mean over target GPUs; the
    /// host-side times are sums over them).
    pub fn target_idle_fraction(&self) -> f64 {
        1.0 - frac(self.target_busy / self.target_ranks.max(1) as u32, self.wall).min(1.0)
    }
    /// Fraction of its device timeline the target's stream had no work for a reason other than
    /// waiting on the drafter side (None without timed events). See `DeviceTimeline`.
    pub fn target_gpu_idle_fraction(&self) -> Option<f64> {
        self.target_gpu.map(|t| t.idle_not_waiting())
    }
    /// The same for each target GPU, in `--target-gpus` order.
    pub fn per_target_gpu_idle(&self) -> Vec<f64> {
        self.target_gpus.iter().map(DeviceTimeline::idle_not_waiting).collect()
    }
    /// Fraction of the wall time the drafter side waited for data.
    pub fn drafter_idle_fraction(&self) -> f64 {
        frac(self.drafter_wait / self.drafter_ranks.max(1) as u32, self.wall).min(1.0)
    }
    pub fn mean_queue_depth(&self) -> f64 {
        if self.queue_depth.is_empty() {
            0.0
        } else {
            self.queue_depth.iter().map(|&d| f64::from(d)).sum::<f64>() / self.queue_depth.len() as f64
        }
    }
}

/// A Chrome / Perfetto trace of the pipeline (`--trace FILE`): one track per thread, one span per
/// stage, so a user sees in a browser (chrome://tracing, ui.perfetto.dev) whether the target
/// computes while the drafter trains.
#[derive(Debug)]
pub struct Trace {
    start: std::time::Instant,
    spans: std::sync::Mutex<Vec<Span>>,
    /// Counter samples (name, time, value): the queue depth over time.
    counters: std::sync::Mutex<Vec<(String, f64, f64)>>,
}

#[derive(Clone, Debug)]
struct Span {
    track: String,
    name: String,
    start_us: f64,
    dur_us: f64,
}

impl Default for Trace {
    fn default() -> Self {
        Trace {
            start: std::time::Instant::now(),
            spans: std::sync::Mutex::new(Vec::new()),
            counters: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl Trace {
    /// Records `name` on `track`, from `t0` until now.
    pub fn span(&self, track: impl Into<String>, name: impl Into<String>, t0: std::time::Instant) {
        self.span_between(track, name, t0, std::time::Instant::now());
    }

    /// Records `name` on `track`, from `t0` to `t1`.
    pub fn span_between(
        &self,
        track: impl Into<String>,
        name: impl Into<String>,
        t0: std::time::Instant,
        t1: std::time::Instant,
    ) {
        let start_us = t0.saturating_duration_since(self.start).as_secs_f64() * 1e6;
        let dur_us = t1.saturating_duration_since(t0).as_secs_f64() * 1e6;
        if let Ok(mut s) = self.spans.lock() {
            s.push(Span { track: track.into(), name: name.into(), start_us, dur_us });
        }
    }

    /// Records `value` of counter `name` now (a counter track in the trace viewer).
    pub fn counter(&self, name: &str, value: f64) {
        let ts = self.start.elapsed().as_secs_f64() * 1e6;
        if let Ok(mut c) = self.counters.lock() {
            c.push((name.to_string(), ts, value));
        }
    }

    pub fn len(&self) -> usize {
        self.spans.lock().map(|s| s.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The trace in Chrome's JSON trace-event format.
    pub fn to_json(&self) -> serde_json::Value {
        let spans = self.spans.lock().map(|s| s.clone()).unwrap_or_default();
        let mut tracks: Vec<&str> = Vec::new();
        for s in &spans {
            if !tracks.contains(&s.track.as_str()) {
                tracks.push(&s.track);
            }
        }
        let mut events: Vec<serde_json::Value> = tracks
            .iter()
            .enumerate()
            .map(|(tid, t)| serde_json::json!({ "name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": { "name": t } }))
            .collect();
        for s in &spans {
            let tid = tracks.iter().position(|t| *t == s.track).unwrap_or(0);
            events.push(serde_json::json!({ "name": s.name, "ph": "X", "pid": 0, "tid": tid, "ts": s.start_us, "dur": s.dur_us }));
        }
        for (name, ts, value) in self.counters.lock().map(|c| c.clone()).unwrap_or_default() {
            events.push(
                serde_json::json!({ "name": name, "ph": "C", "pid": 0, "ts": ts, "args": { "micro-batches": value } }),
            );
        }
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }

    /// Total time two tracks were busy at the same time (the overlap the pipeline exists for).
    pub fn overlap_us(&self, a: &str, b: &str) -> f64 {
        let spans = self.spans.lock().map(|s| s.clone()).unwrap_or_default();
        let (xs, ys): (Vec<&Span>, Vec<&Span>) =
            (spans.iter().filter(|s| s.track == a).collect(), spans.iter().filter(|s| s.track == b).collect());
        let mut total = 0.0;
        for x in &xs {
            for y in &ys {
                let lo = x.start_us.max(y.start_us);
                let hi = (x.start_us + x.dur_us).min(y.start_us + y.dur_us);
                total += (hi - lo).max(0.0);
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceTimeline;
    use std::time::Duration;

    #[test]
    fn idle_splits_into_waiting_on_the_drafter_and_the_rest() {
        let ms = Duration::from_millis;
        // 1000 ms span, 700 busy: 300 idle, 250 of it while the target waited on the drafter.
        let t = DeviceTimeline { busy: ms(700), span: ms(1000), waiting: ms(250) };
        assert!((t.idle() - 0.30).abs() < 1e-12);
        assert!((t.waiting_on_drafter() - 0.25).abs() < 1e-12);
        assert!((t.idle_not_waiting() - 0.05).abs() < 1e-12);
        // Waiting can never explain more than the idle time itself.
        let t = DeviceTimeline { busy: ms(900), span: ms(1000), waiting: ms(400) };
        assert!((t.waiting_on_drafter() - 0.10).abs() < 1e-12);
        assert_eq!(t.idle_not_waiting(), 0.0);
        assert_eq!(DeviceTimeline::default().idle(), 1.0);
    }
}
