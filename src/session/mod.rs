//! `dflash-engine run`, as wiring: the options (`options`), the setup they imply (`setup`), the
//! pipeline that runs the steps (`crate::pipeline`, calling the one step driver
//! `train::step::drafter_step`), and what the run shows (`log`). Checkpoint gather/restore live
//! in `train::checkpoint`.

pub mod bench_decode;
pub mod bench_target;
pub mod commands;
pub mod fit;
pub mod log;
pub mod options;
pub mod prepare;
pub mod setup;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, Result};

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::config::{DrafterConfig, TargetConfig};
use crate::data::Dataset;
use crate::model::drafter::DrafterShape;
use crate::pipeline::{self, Control, DrafterRank, PipelineConfig, PipelineError, PipelineStats, TargetRank};
use crate::train::batch::BatchSpec;
use crate::train::checkpoint::{self, TrainerState};
use crate::train::generate::{generate, GenSpec};
use crate::train::optim::OptimConfig;
use crate::train::step::{DrafterSide, NoiseSpec, StepMetrics};
use crate::weights;

pub use commands::{gen_data, inspect};
pub use log::{print_summary, RunSummary, StepClock};
pub use options::{
    DataOptions, Device, ExecOptions, MfuPeak, ModelOptions, OutputOptions, RunOptions, TrainOptions, TINY_INIT_STD,
};
pub use prepare::prepare_data;
use setup::{StepBatches, TargetSource, Topology};

/// The GEMM the MFU column's peak is measured with (`n^3`, bf16), the bench's peak GEMM: three
/// 128 MiB operands (back in the pool before the first step) and about 20 ms of device time. A
/// 4096^3 GEMM is too small for the peak: 512 output tiles leave the last of four waves on 132
/// SMs mostly empty.
const MFU_PEAK_N: usize = 8192;

/// The bf16 GEMM peak of `be`'s device (`train::flops::measure_gemm_peak` at `MFU_PEAK_N`),
/// measured once per process and device: runs started one after another in one process (the
/// test suites, and the compute-sanitizer runs of them, where instrumented GEMMs are slow) share
/// it. `None` without a device clock.
fn device_peak<B: Backend>(be: &B) -> Result<Option<f64>> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static PEAKS: OnceLock<Mutex<HashMap<String, Option<f64>>>> = OnceLock::new();
    // Held across the measurement: two runs starting together on one device must not time their
    // GEMMs side by side (each would see half the rate).
    let mut peaks = PEAKS.get_or_init(Default::default).lock().map_err(|_| anyhow::anyhow!("peak cache poisoned"))?;
    let key = be.name();
    if let Some(&p) = peaks.get(&key) {
        return Ok(p);
    }
    let p = crate::train::flops::measure_gemm_peak(be, MFU_PEAK_N).context("measuring the GEMM peak")?;
    peaks.insert(key, p);
    Ok(p)
}

/// A run that stopped on an error: the cause first, then what the leak check found.
#[derive(Debug, thiserror::Error)]
#[error("{cause} (leak check: {leaks})")]
pub struct RunStopped {
    pub cause: PipelineError,
    pub leaks: String,
}

/// Peak resident memory of this process (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Runs training as `opts` says. Ctrl-C (when `interrupt` is set) stops after the current step
/// with a checkpoint.
pub fn run(opts: &RunOptions, interrupt: Option<Arc<AtomicBool>>) -> Result<RunSummary> {
    opts.validate()?;
    let topo = Topology::from_options(opts)?;
    let out_is_new = !opts.output.out.exists();
    setup::check_outputs(opts)?;
    let r = run_checked(opts, &topo, interrupt);
    if r.is_err() && out_is_new {
        // A run refused before it wrote anything leaves no empty --out behind (remove_dir
        // removes only an empty folder).
        let _ = std::fs::remove_dir(&opts.output.out);
    }
    r
}

/// `run` once the options and the output folder are checked.
fn run_checked(opts: &RunOptions, topo: &Topology, interrupt: Option<Arc<AtomicBool>>) -> Result<RunSummary> {
    use crate::backend::cuda::CudaBackend;
    let mode = opts.exec.alloc_mode.unwrap_or(crate::backend::cuda::alloc::Mode::Normal);
    let cuda = |ordinal: usize| CudaBackend::new(ordinal, mode).map_err(|why| anyhow::anyhow!("--device cuda: {why}"));
    let cpus = || -> Vec<CpuBackend> { topo.devices.iter().map(|_| CpuBackend::new()).collect() };
    let on_cuda = |first: CudaBackend| -> Result<RunSummary> {
        let mut bes = vec![first];
        for &d in &topo.devices[1..] {
            bes.push(cuda(d)?);
        }
        run_on(&bes, topo, opts, interrupt.clone())
    };
    match opts.exec.device {
        Device::Cpu => run_on(&cpus(), topo, opts, interrupt),
        Device::Cuda => on_cuda(cuda(topo.devices[0])?),
        Device::Auto => match CudaBackend::new(topo.devices[0], mode) {
            Ok(be) => on_cuda(be),
            Err(why) => {
                eprintln!("note      no usable GPU ({why}); running on the CPU backend");
                run_on(&cpus(), topo, opts, interrupt)
            }
        },
    }
}

/// Bytes of one micro-batch's packed taps (rows x taps x hidden, bf16) for these flags.
pub fn micro_batch_bytes(opts: &RunOptions) -> Result<usize> {
    let src = TargetSource::resolve(&opts.model.target, opts.model.target_seed, opts.model.init_std, &mut Vec::new())?;
    let tcfg = src.config().clone();
    let dcfg = drafter_config(opts, &tcfg)?;
    Ok(setup::max_rows(opts) * dcfg.target_layer_ids.len() * tcfg.hidden_size * 2)
}

/// The run's drafter: `--drafter-config` (a recipe or a file, checked against the target), else
/// derived from the target with `--drafter-layers`, `--block-size` and `--taps`; `--loss-gamma`
/// overrides its decay.
pub fn drafter_config(o: &RunOptions, tcfg: &TargetConfig) -> Result<DrafterConfig> {
    let mut d = match &o.model.drafter_config {
        Some(spec) => {
            let d = DrafterConfig::from_name_or_file(spec).with_context(|| format!("--drafter-config {spec}"))?;
            d.check_against_target(tcfg)
                .with_context(|| format!("--drafter-config {spec} against --target {}", o.model.target))?;
            d
        }
        None => DrafterConfig::for_target(tcfg, o.model.drafter_layers, o.model.block_size, o.model.taps.clone())
            .context("drafter configuration")?,
    };
    if let Some(g) = o.train.loss_gamma {
        d.gamma = f64::from(g);
        d.validate().context("--loss-gamma")?;
    }
    Ok(d)
}

/// The most anchors a sequence can draw: positions `p < len - 1` whose token and next token are
/// both trained (`Sample::anchor_candidates`), so a generated sequence's prompt draws none.
fn anchor_room(o: &RunOptions) -> usize {
    let d = &o.data;
    let untrained = if d.path.is_some() { 0 } else { d.gen_prompt_len };
    d.seq_len.saturating_sub(untrained + 1)
}

/// The run's data: a JSON Lines file, or sequences the target writes itself. Returns the
/// dataset and the generation's seconds.
fn load_data<B: Backend>(
    be: &B,
    o: &RunOptions,
    tcfg: &TargetConfig,
    dcfg: &DrafterConfig,
    target: &crate::model::target::Target<B>,
    from_file: Option<Dataset>,
) -> Result<(Dataset, f64)> {
    let d = &o.data;
    let t0 = Instant::now();
    let data = match from_file {
        Some(data) => data,
        None => {
            let pb = log::bar(o.output.quiet, d.gen_samples as u64, "generate");
            let ordinary = tcfg.bos_token_id.unwrap_or(dcfg.mask_token_id).min(dcfg.mask_token_id);
            let spec = GenSpec {
                num_samples: d.gen_samples,
                prompt_len: d.gen_prompt_len,
                seq_len: d.seq_len,
                temperature: d.gen_temperature,
                seed: o.train.seed,
                ordinary_vocab: ordinary,
                batch: 64,
            };
            let samples = generate(be, &be.compute_stream(), target, &spec, |done| pb.set_position(done as u64))?;
            pb.finish_and_clear();
            Dataset::from_samples(samples)?
        }
    };
    Ok((data, t0.elapsed().as_secs_f64()))
}

/// Trains on `bes` (one backend per device of `topo`): the targets and the data-parallel drafter
/// ranks as `topo` places them (all on one backend on one device).
fn run_on<B: Backend>(
    bes: &[B],
    topo: &Topology,
    opts: &RunOptions,
    interrupt: Option<Arc<AtomicBool>>,
) -> Result<RunSummary> {
    let (m, d, t, e, out) = (&opts.model, &opts.data, &opts.train, &opts.exec, &opts.output);
    let one_device = bes.len() == 1;
    let (bt, bd) = (&bes[topo.targets[0]], &bes[topo.drafters[0]]);
    let say = |m: String| eprintln!("{m}");

    // What the options name, checked before the target is loaded.
    let mut notes = Vec::new();
    let src = TargetSource::resolve(&m.target, m.target_seed, m.init_std, &mut notes)?;
    let tcfg = src.config().clone();
    let dcfg = drafter_config(opts, &tcfg)?;
    setup::check_inflight_memory(opts, &tcfg, dcfg.target_layer_ids.len())?;
    setup::check_block_size(bes, dcfg.block_size)?;
    let drafter_identity = m.drafter_config.as_ref().map(|_| dcfg.to_json_value());
    let fingerprint = opts.fingerprint(src.identity()?, setup::data_identity(opts)?, drafter_identity);
    let backend_name = backend_name(bes, topo);
    say(format!("backend   {backend_name}"));
    say(format!("target    {}", src.describe()));
    notes.into_iter().for_each(|n| say(format!("note      {n}")));
    let kinds = match dcfg.sliding_window {
        Some(w) if dcfg.any_sliding() => {
            let n = dcfg.layer_types.iter().filter(|t| **t == crate::config::DraftLayerType::Sliding).count();
            format!(" ({n} sliding, window {w})")
        }
        _ => String::new(),
    };
    say(format!(
        "drafter   {} layers{kinds}, hidden {}, {}/{} heads x {}, mlp {}, block {}, taps {:?}, mask token {}, gamma {}",
        dcfg.num_layers,
        dcfg.hidden_size,
        dcfg.num_attention_heads,
        dcfg.num_key_value_heads,
        dcfg.head_dim,
        dcfg.intermediate_size,
        dcfg.block_size,
        dcfg.target_layer_ids,
        dcfg.mask_token_id,
        dcfg.gamma
    ));

    // On the CPU backend the activations are in host memory already.
    let host = topo.drafters.iter().all(|&i| bes[i].memory_is_host());
    let dshape = DrafterShape {
        recompute: e.recompute,
        offload_layers: if host { 0 } else { e.offload_activations },
        ..DrafterShape::from_config(&dcfg, e.logits_chunk)
    };
    // Whether it can fit the devices, before the load (minutes for a large target).
    let plan = fit::FitPlan {
        target: &crate::model::target::TargetShape::from(&tcfg),
        last_tap: dcfg.target_layer_ids.iter().copied().max().unwrap_or(0),
        drafter: &dshape,
        // A sequence draws at most one anchor per position whose next token is trained.
        rows: d.batch_size * d.anchors.min(anchor_room(opts).max(1)) * dcfg.block_size,
        offload_optimizer: e.offload_optimizer,
        split_fc: e.split_fc,
    };
    fit::check(bes, topo, &plan, d.batch_size, d.grad_accum, &say)?;

    // Before the target loads (minutes for a large one): what a resume or a warm start can check
    // without tensors, and a data file's every line, so that a mistake costs seconds, not a load.
    setup::check_before_load(opts, &dcfg, &fingerprint)?;
    let from_file = match &d.path {
        Some(path) => Some(Dataset::from_jsonl(path, tcfg.vocab_size, d.seq_len)?),
        None => None,
    };
    // The target copies, the data, the drafter ranks and a resumed state.
    let (mut targets, load_seconds) = setup::load_targets(bes, topo, &src, &dcfg, d.path.is_none())?;
    say(format!(
        "loaded    {} target cop{} in {load_seconds:.1} s",
        targets.len(),
        if targets.len() == 1 { "y" } else { "ies" }
    ));
    let (data, gen_seconds) = load_data(bt, opts, &tcfg, &dcfg, &targets[0], from_file)?;
    let how = match (&d.path, d.gen_temperature) {
        (Some(_), _) if data.truncated() > 0 => format!(
            " ({} longer than --seq-len {} cut to their first {} tokens)",
            data.truncated(),
            d.seq_len,
            d.seq_len
        ),
        (Some(_), _) => String::new(),
        (None, 0.0) => format!(" (generated by the target in {gen_seconds:.1} s, greedy)"),
        (None, t) => format!(" (generated by the target in {gen_seconds:.1} s, sampled at temperature {t})"),
    };
    say(format!("data      {} samples, {} tokens{how}", data.len(), data.total_tokens()));
    let mut sides = setup::drafter_sides(bes, topo, &targets[0], &dshape, t.seed)?;
    sides.iter_mut().for_each(|side| side.drafter.park_fault = e.faults.park);
    if dshape.offload_layers > 0 {
        let t0 = std::time::Instant::now();
        let mut pinned = 0;
        for (side, &i) in sides.iter_mut().zip(&topo.drafters) {
            pinned += side.drafter.reserve_parking(&bes[i], d.batch_size * d.anchors)?;
        }
        say(format!(
            "parking   the first {} drafter layers' gate|up products wait in {:.2} GiB of pinned host memory (pinned in {:.1} s)",
            dshape.offload_layers.min(dcfg.num_layers),
            pinned as f64 / (1u64 << 30) as f64,
            t0.elapsed().as_secs_f64()
        ));
    }
    let first_step = setup::resume(bes, topo, opts, &mut sides, &fingerprint, &say)?;
    if first_step == 0 {
        setup::warm_start(bes, topo, opts, &dcfg, &mut sides, &say)?;
    }
    let first = targets.remove(0);
    let tflops = crate::train::flops::TargetFlops::new(&first.shape, first.last_layer());
    let tsides = setup::target_sides(bes, topo, e.split_fc, first, targets, &mut sides)?;
    if e.offload_optimizer && host {
        say("note      --offload-optimizer: this backend's buffers are host memory already; nothing to move".into());
    } else if e.offload_optimizer {
        let t0 = std::time::Instant::now();
        let pinned = setup::offload_moments(bes, topo, &mut sides)?;
        say(format!(
            "optimizer the drafter's AdamW moments live in {:.2} GiB of pinned host memory (pinned in {:.1} s){}",
            pinned as f64 / (1u64 << 30) as f64,
            t0.elapsed().as_secs_f64(),
            if e.split_fc { "; the fc group on the target's device keeps its own" } else { "" }
        ));
    }
    let source = StepBatches {
        data,
        spec: BatchSpec {
            anchors_per_seq: d.anchors,
            block_size: dcfg.block_size,
            mask_token_id: dcfg.mask_token_id,
            gamma: dcfg.gamma as f32,
            pad_to_tokens: d.pad_to_tokens,
            seed: t.seed,
        },
        batch_size: d.batch_size,
        grad_accum: d.grad_accum,
        seed: t.seed,
        context_off_by_one: e.faults.context_off_by_one,
    };
    let optim = OptimConfig {
        lr: t.lr,
        warmup_frac: t.warmup_frac,
        clip: t.clip,
        total_steps: t.steps,
        ..OptimConfig::default()
    };
    let pcfg = PipelineConfig {
        max_inflight: e.max_inflight,
        first_step,
        end_step: t.steps,
        noise: NoiseSpec { std: d.noise_std, seed: t.seed },
        faults: e.faults,
        trace: out.trace.as_ref().map(|_| Arc::new(pipeline::Trace::default())),
        transport: e.transport,
        max_rows: setup::max_rows(opts),
        lockstep: e.sync,
    };

    // The steps: log each (terminal, metrics.jsonl, TensorBoard), checkpoint when due.
    let mut metrics = crate::train::metrics::MetricsLog::open(&out.out, first_step, out.tensorboard)?;
    if let Some(note) = metrics.note() {
        say(note);
    }
    let mut steplog = log::StepLog::new(out.quiet, out.log_every, t.steps, first_step);
    // The MFU column's peak (measured on the first device, or given), counted once per device
    // the run uses.
    let devices = if bes.len() > 1 { format!(", x {} devices", bes.len()) } else { String::new() };
    let peak = match out.mfu_peak {
        MfuPeak::Measure => {
            device_peak(bt)?.map(|p| (p, true, format!("cuBLASLt bf16 {MFU_PEAK_N}^3 on {}{devices}", bt.name())))
        }
        MfuPeak::Given(p) => Some((p, false, format!("--mfu-peak{devices}"))),
        MfuPeak::Off => None,
    };
    let mfu = peak.map(|(peak, measured, source)| {
        let how = if measured { "measured" } else { "given" };
        say(format!("mfu       peak {}/s per device, {how} ({source})", log::flops_text(peak)));
        crate::train::flops::Mfu { target: tflops, peak: peak * bes.len() as f64, peak_source: source, measured }
    });
    if let Some(m) = &mfu {
        steplog.set_mfu(m.clone());
    }
    let profiling = out.profile && bt.start_profile();
    if out.profile && !profiling {
        say("note      --profile: this backend has no device clock, so there is no phase table".into());
    }
    let mut phase_steps = Vec::new();
    let mut checkpoint_in_step = Vec::new();
    let mut last_ckpt = None;
    let mut ckpt_secs = 0.0f64;
    let config_json = dcfg.to_json();
    let fc_home = tsides[0].fc.as_ref();
    let mut on_step = |m: &StepMetrics,
                       side: &mut DrafterSide<B>,
                       st: &PipelineStats|
     -> Result<Control, Box<dyn std::error::Error + Send + Sync>> {
        let ms = steplog.step(m, st);
        if profiling {
            // The steps the device completed by now: the step loop never waits for it.
            phase_steps.extend(bt.take_profile_steps(false)?);
        }
        // Before the checkpoint: a saved step always has its metrics line.
        metrics.record_step(m, ms, st)?;
        let done = m.step + 1;
        let stop =
            interrupt.as_ref().is_some_and(|f| f.load(Ordering::SeqCst)) || out.stop_after.is_some_and(|n| done >= n);
        if out.checkpoints && (done % out.save_every.max(1) == 0 || done == t.steps || stop) {
            let t_ck = Instant::now();
            if let Some(ms) = e.faults.checkpoint_delay_ms {
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
            let tensors = checkpoint::gather(bt, &bt.compute_stream(), bd, &bd.compute_stream(), side, fc_home)?;
            let state = TrainerState {
                step: done,
                seed: t.seed,
                run_fingerprint: fingerprint.to_json(),
                extra: serde_json::json!({
                    "loss": m.loss,
                    "accept_len": m.accept_len,
                    "round_accept_len": m.round_accept_len
                }),
            };
            last_ckpt =
                Some(checkpoint::save_with(&out.out, &state, &config_json, &tensors, out.keep_last, &e.faults)?);
            ckpt_secs += t_ck.elapsed().as_secs_f64();
            // The synchronous loop enqueued the next step before this report: the device idles
            // through the write in that step's marker-to-marker time.
            checkpoint_in_step.push((done - first_step) as usize);
        }
        steplog.restart_clock();
        Ok(if stop { Control::Stop } else { Control::Continue })
    };
    // With --sync on one device each step's AdamW runs beside the next step's target forward,
    // except under --profile, whose phase table times one stream's launches back to back, or when
    // asked not to. Set up before the leak check's starting point (the fault flag lives on).
    if e.sync && one_device && !profiling && !e.serial_update {
        sides[0]
            .overlap_updates(bt, &bt.compute_stream(), e.faults.update)
            .context("setting up the optimizer's stream")?;
    }
    let mem_before: Vec<Option<usize>> = bes.iter().map(|b| b.allocated_bytes()).collect();
    // The clocks and power of each GPU while the steps run (the summary's `clocks` lines).
    let monitors: Vec<_> = bes.iter().filter_map(|b| b.clock_monitor().map(|m| (b.name(), m))).collect();
    let (result, stats) = if e.sync && one_device {
        pipeline::run_sync(bt, &tsides[0], &mut sides[0], &source, &pcfg, &optim, &mut on_step)
    } else {
        let dbes: Vec<&B> = topo.drafters.iter().map(|&i| &bes[i]).collect();
        let comms = B::comm_group(&dbes).context("setting up the drafter GPUs' gradient all-reduce")?;
        let targets: Vec<TargetRank<'_, B>> =
            tsides.iter().zip(&topo.targets).map(|(side, &i)| TargetRank { be: &bes[i], side }).collect();
        let drafters: Vec<DrafterRank<'_, B>> = sides
            .iter_mut()
            .zip(dbes.iter().copied())
            .zip(comms)
            .map(|((side, be), comm)| DrafterRank { be, side, comm })
            .collect();
        pipeline::run(&targets, drafters, &source, &pcfg, &optim, &mut on_step)
    };
    steplog.finish(&stats);
    let clocks: Vec<String> = monitors
        .into_iter()
        .map(|(name, m)| match m {
            Ok(m) => m.finish().describe(),
            Err(why) => format!("{name}: not sampled ({why})"),
        })
        .collect();
    // Whatever the outcome: no pinned slot may still be held and every transient device
    // buffer must be back (DESIGN.md rule 5; the fault tests check this line).
    let after: Vec<Option<usize>> = bes.iter().map(|b| b.allocated_bytes()).collect();
    let leaks = log::leak_check(&mem_before, &after, &stats);
    say(format!("leak check     {leaks}"));
    result.map_err(|cause| RunStopped { cause, leaks })?;
    let (step_ms, step_clock) = steplog.step_times(&stats);
    if profiling {
        // The steps not taken yet (the host waits: the run is over). They correspond to the
        // reported steps in order; a step the run stopped before updating is not one of them.
        phase_steps.extend(bt.take_profile_steps(true)?);
        phase_steps.truncate(steplog.history.len());
    }
    let checkpoint_in_step = if step_clock == StepClock::Device { checkpoint_in_step } else { Vec::new() };
    let steady: Vec<_> = phase_steps
        .iter()
        .enumerate()
        .filter(|(i, _)| !checkpoint_in_step.contains(i))
        .map(|(_, p)| p.clone())
        .collect();
    if let (Some(path), Some(tr)) = (&out.trace, &pcfg.trace) {
        let text = serde_json::to_string(&tr.to_json())?;
        weights::write_file_atomic(path, text.as_bytes())
            .with_context(|| format!("writing the trace {}", path.display()))?;
        say(format!(
            "trace          {} ({} spans; open in ui.perfetto.dev or chrome://tracing)",
            path.display(),
            tr.len()
        ));
    }
    let summary = RunSummary {
        history: std::mem::take(&mut steplog.history),
        stats,
        first_step,
        checkpoint: last_ckpt,
        backend: backend_name,
        peak_rss_bytes: peak_rss_bytes(),
        data_samples: source.data.len(),
        gen_seconds,
        load_seconds,
        step_ms,
        step_clock,
        checkpoint_in_step,
        checkpoint_seconds: ckpt_secs,
        clocks,
        device_memory: if one_device {
            bt.memory_report()
        } else {
            let parts: Option<Vec<String>> =
                bes.iter().map(|b| b.memory_report().map(|m| format!("{}: {m}", b.name()))).collect();
            parts.map(|p| p.join("; "))
        },
        // The first step builds GEMM plans and the allocator's segments: left out.
        // Profiled steps run on one device: its GEMMs against that device's measured rate.
        phases: crate::backend::profile::PhaseTable::from_marked_steps(&steady, 1).map(|mut t| {
            // The phase table sets the GEMMs against a rate this device measured, not a given one.
            t.gemm_peak = mfu.as_ref().filter(|m| m.measured).map(|m| m.peak / bes.len() as f64);
            t
        }),
        phase_steps: steady,
        mfu,
        mfu_off: out.mfu_peak == MfuPeak::Off,
    };
    print_summary(&summary);
    Ok(summary)
}

/// "H200" on one device; "target on ..., drafter on ..." on several.
fn backend_name<B: Backend>(bes: &[B], topo: &Topology) -> String {
    let names = |idx: &[usize]| {
        let n: Vec<String> = idx.iter().map(|&i| bes[i].name()).collect();
        if n.len() > 1 && n.iter().all(|x| *x == n[0]) {
            format!("{} x {}", n.len(), n[0])
        } else {
            n.join(", ")
        }
    };
    if bes.len() == 1 {
        bes[0].name()
    } else {
        format!("target on {}, drafter on {}", names(&topo.targets), names(&topo.drafters))
    }
}
