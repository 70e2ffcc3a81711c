//! `dflash-engine bench-pipeline`: tokens/s of the synchronous reference against the async
//! pipeline on each transport, with the same flags and data, measured in one process, so every
//! ratio compares like with like. With a second GPU (`--drafter-gpus D`) it adds the two-GPU
//! rows (target on one GPU and drafter on the other over p2p and host, split-FC, and both GPUs
//! running both sides: targets in turn, drafter data parallel) and the raw peer copy rate of one
//! micro-batch's taps, the baseline of the peer transport.

use anyhow::Result;

use crate::backend::cuda::{alloc::Mode, CudaBackend};
use crate::backend::Backend;
use crate::pipeline::Transport;
use crate::session::{self, Device, RunOptions, RunSummary};
use crate::tensor::DType;

/// One row of the table.
pub struct BenchRow {
    pub mode: String,
    pub gpus: String,
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    /// Idle fraction of the target's stream not spent waiting on the drafter side (see
    /// `DeviceTimeline`), and the part spent waiting on it.
    pub target_gpu_idle: Option<f64>,
    pub target_waiting: Option<f64>,
    pub drafter_idle: f64,
    pub gb_moved_per_step: f64,
    /// Seconds per step the publisher waited for copies.
    pub copy_wait_ms: f64,
    /// The transport's own rate: bytes over the device time of its copies.
    pub copy_gb_s: Option<f64>,
    /// Idle fraction (not waiting on the drafter side) of each target GPU's stream.
    pub per_target_idle: Vec<f64>,
    /// Gradient all-reduce ms per step (data parallel).
    pub allreduce_ms: Option<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The steady steps of a run's step times. The first two steps warm caches and plans. A
/// pipelined run's last `run_ahead` steps (how many steps its targets may work ahead of its
/// drafter; 0 when synchronous) are left out as well: its targets finish early and those steps
/// are the drafter's alone, so with them the window would hold `run_ahead` target forwards fewer
/// than drafter steps (at the 8B recipe, 6 steps and 2 in flight, the async row read 675 ms per
/// step against 821 for sync, a pipelining gain no single GPU has). Between its ends the targets
/// are `run_ahead` steps ahead, so the window holds as many target forwards as drafter steps.
fn steady_window(step_ms: &[f64], run_ahead: usize) -> &[f64] {
    let n = step_ms.len();
    if 2 + run_ahead < n {
        &step_ms[2..n - run_ahead]
    } else if 2 < n {
        &step_ms[2..]
    } else {
        &step_ms[n.saturating_sub(1)..]
    }
}

/// One row of the table from a run; `run_ahead` as in `steady_window`.
fn row(mode: &str, gpus: String, r: &RunSummary, run_ahead: usize) -> BenchRow {
    // The mean of the steady steps, not their median: an async row's host times are the
    // intervals between metric reports, which alternate long and short around the step time when
    // a report lands mid-step, so only their sum (the throughput) means something; a
    // device-clocked sync row gets the same either way.
    let ms = steady_window(&r.step_ms, run_ahead);
    let mean = if ms.is_empty() { 0.0 } else { ms.iter().sum::<f64>() / ms.len() as f64 };
    let steps = r.history.len().max(1) as f64;
    let tokens = r.stats.tokens as f64 / steps;
    BenchRow {
        mode: mode.into(),
        gpus,
        tokens_per_s: tokens / (mean / 1e3).max(1e-9),
        ms_per_step: mean,
        target_gpu_idle: r.stats.target_gpu_idle_fraction(),
        target_waiting: r.stats.target_gpu.map(|t| t.waiting_on_drafter()),
        drafter_idle: r.stats.drafter_idle_fraction(),
        gb_moved_per_step: r.stats.bytes_moved as f64 / 1e9 / steps,
        copy_wait_ms: r.stats.publisher_wait_copy.as_secs_f64() * 1e3 / steps,
        copy_gb_s: r.stats.copy_seconds.filter(|&s| s > 0.0).map(|s| r.stats.bytes_moved as f64 / 1e9 / s),
        per_target_idle: r.stats.per_target_gpu_idle(),
        allreduce_ms: r.stats.allreduce_seconds.map(|s| s * 1e3 / steps),
    }
}

/// Seconds to copy `bytes` from GPU `from` to GPU `to` (median of 10, events on the receiver).
fn peer_copy_secs(from: usize, to: usize, bytes: usize) -> Result<f64> {
    let a = CudaBackend::new(from, Mode::Normal).map_err(anyhow::Error::msg)?;
    let b = CudaBackend::new(to, Mode::Normal).map_err(anyhow::Error::msg)?;
    let (sa, sb) = (a.compute_stream(), b.compute_stream());
    let n = bytes / 2;
    let src = a.alloc(&sa, DType::BF16, n)?;
    a.synchronize(&sa)?;
    let mut dst = b.alloc(&sb, DType::BF16, n)?;
    let mut t = Vec::new();
    for i in 0..12 {
        let e0 = b.record_timed(&sb)?.expect("CUDA has timed events");
        b.copy_from_peer(&sb, &a, &src, &mut dst)?;
        let e1 = b.record_timed(&sb)?.expect("CUDA has timed events");
        let secs = b.elapsed_secs(&e0, &e1).ok_or_else(|| anyhow::anyhow!("timing the peer copy failed"))?;
        if i >= 2 {
            t.push(secs);
        }
    }
    Ok(median(&t))
}

/// Runs the modes and prints the table. `opts` carries the model, data and shape flags.
pub fn bench_pipeline(opts: &RunOptions) -> Result<Vec<BenchRow>> {
    // Each row is a fresh run of --steps steps: a flag that would cut or continue one is refused
    // rather than ignored.
    anyhow::ensure!(
        !opts.output.resume && opts.output.stop_after.is_none(),
        "bench-pipeline runs every row from step 0 for --steps steps: drop --resume and --stop-after"
    );
    // Each row's first two steps warm plans and caches, and the rest are what it reports.
    anyhow::ensure!(
        opts.train.steps >= 3,
        "bench-pipeline times each row's steps after its first two (warm-up): --steps {} leaves none; give --steps 3 \
         or more (the GPU scripts use 8)",
        opts.train.steps
    );
    let t_gpu = opts.exec.target_gpus.first().copied().unwrap_or(0);
    // No checkpoints: at the 8B recipe each would write ~14 GB of masters and moments.
    let base = {
        let mut ro = opts.clone();
        ro.output.quiet = true;
        ro.output.checkpoints = false;
        ro.output.stop_after = None;
        ro.output.resume = false;
        ro.output.profile = false;
        ro
    };
    let mut rows = Vec::new();
    let one = format!("{t_gpu}");
    let say = |r: &BenchRow| {
        eprintln!(
            "  {:<40} {:<9} {:>9.0} tokens/s  {:>8.1} ms/step  {:>6.2} GB/step moved  target GPU idle {}{}{}",
            r.mode,
            r.gpus,
            r.tokens_per_s,
            r.ms_per_step,
            r.gb_moved_per_step,
            r.target_gpu_idle.map_or("n/a".into(), |f| format!("{:.1}%", 100.0 * f)),
            r.target_waiting.map_or(String::new(), |f| format!(" (+{:.1}% waiting on the drafter)", 100.0 * f)),
            if r.per_target_idle.len() > 1 {
                let per: Vec<String> = r.per_target_idle.iter().map(|f| format!("{:.1}%", 100.0 * f)).collect();
                format!(" (per target: {})", per.join(", "))
            } else {
                String::new()
            }
        )
    };
    // DFLASH_BENCH_ROWS="pat;pat;...": only the rows whose "mode [gpus]" label contains one of the
    // patterns (e.g. "sync [0]" or "2 targets"), so a time-limited session can split the table.
    // "->" keeps only the two-GPU rows and the peer copy baseline.
    let only: Vec<String> = std::env::var("DFLASH_BENCH_ROWS")
        .map(|v| v.split(';').map(str::trim).filter(|p| !p.is_empty()).map(String::from).collect())
        .unwrap_or_default();
    let wanted = |mode: &str, gpus: &str| {
        let label = format!("{mode} [{gpus}]");
        only.is_empty() || only.iter().any(|p| label.contains(p.as_str()))
    };
    let mut go = |mode: &str, gpus: String, o: RunOptions| -> Result<()> {
        if !wanted(mode, &gpus) {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let (ro_sync, ro_ahead) = (o.exec.sync, o.exec.max_inflight * o.exec.target_gpus.len().max(1));
        let r = session::run(
            &{
                let mut ro = o;
                ro.output.out = opts.output.out.join(mode.replace([' ', ','], "-"));
                ro
            },
            None,
        )?;
        let ahead = if ro_sync { 0 } else { ro_ahead };
        let b = row(mode, gpus, &r, ahead);
        say(&b);
        if let Some(p) = &r.phases {
            eprint!("{}", p.render());
            eprint!("{}", p.render_ops(crate::backend::profile::PhaseTable::STEP_OPS));
        }
        eprintln!("    ({:.0} s for the row, loading included)", t0.elapsed().as_secs_f64());
        rows.push(b);
        Ok(())
    };
    eprintln!(
        "bench-pipeline: {} steps per mode; each row the mean of its steps after the first two (a pipelined row also \
         leaves out its last --max-inflight steps)",
        opts.train.steps
    );
    // The one-device rows run on the first target device alone, whatever the lists say.
    let base_one = {
        let mut ro = base.clone();
        ro.exec.target_gpus = vec![t_gpu];
        ro.exec.drafter_gpus = Vec::new();
        ro
    };
    let sync = {
        let mut ro = base_one.clone();
        ro.exec.sync = true;
        ro
    };
    go("sync", one.clone(), sync.clone())?;
    // The same with each step's AdamW after the step instead of beside the next target forward.
    go("sync serial update", one.clone(), {
        let mut ro = sync.clone();
        ro.exec.serial_update = true;
        ro
    })?;
    if opts.output.profile {
        // The same step with every launch timed: its phase table, and what the timing costs
        // (this row's ms/step against the sync row's).
        go("sync profiled", one.clone(), {
            let mut ro = sync;
            ro.output.profile = true;
            ro
        })?;
    }
    for t in [Transport::Same, Transport::Peer, Transport::Host] {
        go(&format!("async {}", t.name()), one.clone(), {
            let mut ro = base_one.clone();
            ro.exec.transport = Some(t);
            ro
        })?;
    }
    let mut peer_rate = None;
    // The second device: the first other one either list names.
    let second = opts.exec.drafter_gpus.iter().chain(&opts.exec.target_gpus).copied().find(|&d| d != t_gpu);
    if let Some(d) = second {
        let two = format!("{t_gpu}->{d}");
        for t in [Transport::Peer, Transport::Host] {
            go(&format!("async {}", t.name()), two.clone(), {
                let mut ro = base_one.clone();
                ro.exec.transport = Some(t);
                ro.exec.drafter_gpus = vec![d];
                ro
            })?;
        }
        // What split-FC saves: Y (hidden wide) crosses instead of X (taps x hidden), dY returns.
        go("async p2p split-FC", two.clone(), {
            let mut ro = base_one.clone();
            ro.exec.transport = Some(Transport::Peer);
            ro.exec.split_fc = true;
            ro.exec.drafter_gpus = vec![d];
            ro
        })?;
        // Both GPUs run both sides: targets take steps in turn, the drafter trains data parallel
        // on the same sequences per step (each rank gets half the micro-batches).
        let (bs, ga) = if base.data.grad_accum % 2 == 0 {
            (base.data.batch_size, base.data.grad_accum)
        } else if base.data.batch_size % 2 == 0 {
            (base.data.batch_size / 2, base.data.grad_accum * 2)
        } else {
            (base.data.batch_size, base.data.grad_accum * 2)
        };
        go("async p2p, 2 targets + 2 drafter ranks", format!("{t_gpu},{d}->{t_gpu},{d}"), {
            let mut ro = base.clone();
            ro.exec.transport = None;
            ro.exec.target_gpus = vec![t_gpu, d];
            ro.exec.drafter_gpus = vec![t_gpu, d];
            ro.data.batch_size = bs;
            ro.data.grad_accum = ga;
            ro
        })?;
        // A micro-batch's packed taps: rows x taps x hidden bf16. A CUDA measurement: on the CPU
        // backend (or `--device auto` without a GPU, where the rows ran on the CPU) there is none.
        let cuda = match opts.exec.device {
            Device::Cpu => false,
            Device::Cuda => true,
            Device::Auto => CudaBackend::new(t_gpu, Mode::Normal).is_ok(),
        };
        if wanted("raw peer copy", &two) && cuda {
            let probe = session::micro_batch_bytes(opts)?;
            let secs = peer_copy_secs(t_gpu, d, probe)?;
            peer_rate = Some((probe, probe as f64 / secs / 1e9));
        } else if wanted("raw peer copy", &two) {
            eprintln!("  raw peer copy: needs CUDA devices; the rows above ran on the CPU backend");
        }
    }
    let sync_tps = rows.iter().find(|r| r.mode == "sync").map_or(f64::NAN, |r| r.tokens_per_s);
    println!(
        "\n| mode | GPUs | tokens/s | vs sync | ms/step | target GPU idle | target waiting on drafter | drafter idle | GB moved/step | copy GB/s | copy wait ms/step | all-reduce ms/step |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.0} | {} | {:.1} | {} | {} | {:.1}% | {:.2} | {} | {:.1} | {} |",
            r.mode,
            r.gpus,
            r.tokens_per_s,
            // Without a sync row in this run (DFLASH_BENCH_ROWS) there is nothing to compare with.
            if sync_tps.is_finite() && sync_tps > 0.0 {
                format!("{:.2}x", r.tokens_per_s / sync_tps)
            } else {
                "-".into()
            },
            r.ms_per_step,
            r.target_gpu_idle.map_or(
                if r.mode.starts_with("sync") { "n/a (alternates)".into() } else { "n/a (no device clock)".into() },
                |f| format!("{:.1}%", 100.0 * f)
            ),
            r.target_waiting.map_or("-".into(), |f| format!("{:.1}%", 100.0 * f)),
            100.0 * r.drafter_idle,
            r.gb_moved_per_step,
            r.copy_gb_s.map_or("-".into(), |g| format!("{g:.1}")),
            r.copy_wait_ms,
            r.allreduce_ms.map_or("-".into(), |m| format!("{m:.1}"))
        );
    }
    if let Some((bytes, rate)) = peer_rate {
        println!("\nraw peer copy of one micro-batch's taps ({:.0} MB): {rate:.1} GB/s", bytes as f64 / 1e6);
        for r in rows.iter().filter(|r| r.mode == "async p2p" && r.gpus.contains("->")) {
            if let Some(got) = r.copy_gb_s {
                println!(
                    "peer transport in the run: {got:.1} GB/s over its copies' device time = {:.0}% of the raw peer copy rate",
                    100.0 * got / rate
                );
            }
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::steady_window;

    #[test]
    fn the_steady_window_leaves_out_warm_up_and_the_drained_tail() {
        let ms = [9.0, 5.0, 4.0, 4.0, 4.0, 1.0, 1.0];
        assert_eq!(steady_window(&ms, 0), &ms[2..]);
        assert_eq!(steady_window(&ms, 2), &[4.0, 4.0, 4.0]);
        // Too short a run to drop the tail: the warm-up still goes; one step: itself.
        assert_eq!(steady_window(&ms[..4], 2), &[4.0, 4.0]);
        assert_eq!(steady_window(&ms[..1], 2), &[9.0]);
        assert!(steady_window(&[], 2).is_empty());
    }
}
