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
}

impl PipelineStats {
    fn frac(part: Duration, wall: Duration) -> f64 {
        if wall.is_zero() {
            0.0
        } else {
            part.as_secs_f64() / wall.as_secs_f64()
        }
    }
    /// Fraction of the wall time the target side did not compute.
    pub fn target_idle_fraction(&self) -> f64 {
        1.0 - Self::frac(self.target_busy, self.wall).min(1.0)
    }
    /// Fraction of the wall time the drafter side waited for data.
    pub fn drafter_idle_fraction(&self) -> f64 {
        Self::frac(self.drafter_wait, self.wall).min(1.0)
    }
    pub fn mean_queue_depth(&self) -> f64 {
        if self.queue_depth.is_empty() {
            0.0
        } else {
            self.queue_depth.iter().map(|&d| f64::from(d)).sum::<f64>() / self.queue_depth.len() as f64
        }
    }
}
