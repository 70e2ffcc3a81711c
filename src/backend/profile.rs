//! Where the device time of a step goes (`run --profile`, `bench-pipeline --profile`).
//!
//! The step code says which part of the step it is enqueuing ([`enter`] a [`Region`]: target,
//! FC projection, drafter, loss, optimizer); a backend that profiles times every kernel, GEMM
//! and copy it enqueues with device events and files the interval under a [`Phase`] made of
//! that region and the kind of work (the kernel's family, a GEMM, a copy). Per step the phases,
//! plus the gaps where the stream had nothing to run, add up to the stream's busy span; the table
//! compares that with the host's step time. The region is per thread (the synchronous step runs
//! on one thread); it costs nothing when no backend profiles.
//!
//! Timing every launch adds two event records to each (a few microseconds of host time); the
//! table therefore reports the profiled step time beside the phases, and a bench compares it with
//! an unprofiled run.

use std::cell::Cell;

/// The part of a step the calling thread is enqueuing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
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
            (Region::Target, Work::Gemm) => Phase::TargetGemm,
            (Region::Target, Work::Kernel { family, .. }) if attention(family) => Phase::TargetAttention,
            (Region::Target, Work::Kernel { .. }) => Phase::TargetElementwise,
            (Region::Drafter, Work::Gemm) => Phase::DrafterGemm,
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
    /// Between the first interval's start and the last one's end, the time no interval covered.
    pub gaps: f64,
    /// First start to last end.
    pub span: f64,
    /// Intervals timed.
    pub intervals: usize,
    /// Device seconds and count per operation (a kernel's symbol, a GEMM's shape, a copy).
    pub by_op: Vec<(String, f64, usize)>,
}

/// Mean phase times over the profiled steps, against the host's step time.
#[derive(Clone, Debug, Default)]
pub struct PhaseTable {
    pub steps: usize,
    pub by_phase: Vec<(Phase, f64)>,
    pub gaps: f64,
    pub span: f64,
    pub host_step: f64,
    pub intervals: f64,
    /// Per step: device seconds and launches per operation, longest first.
    pub by_op: Vec<(String, f64, f64)>,
}

impl PhaseTable {
    /// Means over `steps` (each with the host's step seconds), leaving out the first `warmup`
    /// (plans and caches are built there) when enough steps remain.
    pub fn from_steps(steps: &[(StepPhases, f64)], warmup: usize) -> Option<PhaseTable> {
        let skip = if steps.len() > warmup { warmup } else { 0 };
        let used = &steps[skip..];
        if used.is_empty() {
            return None;
        }
        let n = used.len() as f64;
        let mut by_phase: Vec<(Phase, f64)> = Phase::ALL.iter().map(|&p| (p, 0.0)).collect();
        let mut t = PhaseTable { steps: used.len(), ..PhaseTable::default() };
        for (sp, host) in used {
            for &(p, secs) in &sp.by_phase {
                if let Some(e) = by_phase.iter_mut().find(|(q, _)| *q == p) {
                    e.1 += secs / n;
                }
            }
            t.gaps += sp.gaps / n;
            t.span += sp.span / n;
            t.host_step += host / n;
            t.intervals += sp.intervals as f64 / n;
            for (op, secs, count) in &sp.by_op {
                match t.by_op.iter_mut().find(|(o, _, _)| o == op) {
                    Some(e) => {
                        e.1 += secs / n;
                        e.2 += *count as f64 / n;
                    }
                    None => t.by_op.push((op.clone(), secs / n, *count as f64 / n)),
                }
            }
        }
        by_phase.retain(|&(_, s)| s > 0.0);
        t.by_phase = by_phase;
        t.by_op.sort_by(|a, b| b.1.total_cmp(&a.1));
        Some(t)
    }

    /// The `top` operations by device time per step, with launches per step and mean time each.
    pub fn render_ops(&self, top: usize) -> String {
        let mut out = format!("operations by device time per step (top {top} of {})\n", self.by_op.len());
        for (op, secs, count) in self.by_op.iter().take(top) {
            let each = if *count > 0.0 { secs / count } else { 0.0 };
            out += &format!("  {:<48} {:>9.3} ms {:>7.0} x {:>8.1} us\n", op, secs * 1e3, count, each * 1e6);
        }
        out
    }

    /// Phases plus gaps: the stream's span, by construction within rounding.
    pub fn accounted(&self) -> f64 {
        self.by_phase.iter().map(|(_, s)| s).sum::<f64>() + self.gaps
    }

    pub fn render(&self) -> String {
        let ms = |s: f64| s * 1e3;
        let pct = |s: f64| if self.host_step > 0.0 { 100.0 * s / self.host_step } else { 0.0 };
        let mut out = format!(
            "phases (device events, mean of {} step{}, {:.0} timed launches per step)\n",
            self.steps,
            if self.steps == 1 { "" } else { "s" },
            self.intervals
        );
        for (p, s) in &self.by_phase {
            out += &format!("  {:<40} {:>9.2} ms {:>6.1}%\n", p.name(), ms(*s), pct(*s));
        }
        out += &format!("  {:<40} {:>9.2} ms {:>6.1}%\n", "idle gaps on the stream", ms(self.gaps), pct(self.gaps));
        let acc = self.accounted();
        out += &format!(
            "  {:<40} {:>9.2} ms {:>6.1}% of the host's step time {:.2} ms\n",
            "sum",
            ms(acc),
            pct(acc),
            ms(self.host_step)
        );
        out
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
    let (first, mut reach, mut gaps) = (iv[0].1, iv[0].1, 0.0);
    for &(p, a, b) in &iv {
        match by.iter_mut().find(|(q, _)| *q == p) {
            Some(e) => e.1 += (b - a).max(0.0),
            None => by.push((p, (b - a).max(0.0))),
        }
        if a > reach {
            gaps += a - reach;
        }
        reach = reach.max(b);
    }
    StepPhases { by_phase: by, gaps, span: reach - first, intervals: iv.len(), by_op: Vec::new() }
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
        assert_eq!(Phase::of(Region::Target, k("attention", "attn_causal_fwd_bf16_hd128")), Phase::TargetAttention);
        assert_eq!(Phase::of(Region::Target, k("pack", "pack_taps_noise_bf16")), Phase::PackNoise);
        assert_eq!(
            Phase::of(Region::Drafter, k("attention", "attn_draft_bwd_q_bf16_hd128")),
            Phase::DrafterAttentionBwd
        );
        assert_eq!(Phase::of(Region::Drafter, k("attention", "attn_draft_fwd_bf16_hd128")), Phase::DrafterAttentionFwd);
        assert_eq!(Phase::of(Region::Drafter, k("rmsnorm", "rmsnorm_fwd_bf16")), Phase::DrafterElementwise);
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
}
