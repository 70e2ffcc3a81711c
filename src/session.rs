//! `dflash-engine run`, top to bottom: resolve the target and data, build both sides, resume if
//! asked, run the pipeline, log, checkpoint, summarise. The CLI only fills `RunOptions`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::config::{DrafterConfig, TargetConfig};
use crate::data::Dataset;
use crate::model::drafter::{Drafter, DrafterShape, ParamGroup};
use crate::model::target::{Target, TargetShape};
use crate::pipeline::{
    self, BatchSource, Control, DrafterRank, Faults, PipelineConfig, PipelineStats, TargetRank, TargetSide, Transport,
};
use crate::train::batch::{build_batch, BatchSpec, HostBatch, Sample};
use crate::train::checkpoint::{self, TensorState, TrainerState};
use crate::train::generate::{generate, GenSpec};
use crate::train::optim::OptimConfig;
use crate::train::step::{DrafterSide, NoiseSpec, StepMetrics};
use crate::weights::{self, ModelFiles};

/// Which backend runs the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
    Auto,
}

/// Everything `run` needs; the CLI fills it (see `main.rs` for each flag's help).
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub target: String,
    pub target_seed: u64,
    pub init_std: f32,
    pub data: Option<PathBuf>,
    pub gen_samples: usize,
    pub gen_prompt_len: usize,
    pub gen_temperature: f32,
    pub steps: u32,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub seq_len: usize,
    pub anchors: usize,
    pub block_size: usize,
    pub drafter_layers: usize,
    pub taps: Option<Vec<usize>>,
    pub noise_std: f32,
    pub split_fc: bool,
    pub pad_to_tokens: Option<usize>,
    pub max_inflight: usize,
    pub device: Device,
    pub seed: u64,
    pub out: PathBuf,
    pub resume: bool,
    pub lr: f32,
    pub warmup_frac: f32,
    pub clip: f32,
    pub log_every: u32,
    pub save_every: u32,
    /// Write checkpoints at all (benchmarks turn this off: a drafter's masters and moments at
    /// the 8B recipe are ~14 GB per checkpoint).
    pub checkpoints: bool,
    pub keep_last: usize,
    pub logits_chunk: usize,
    pub quiet: bool,
    pub faults: Faults,
    /// Stop (with a checkpoint) after this many completed steps, keeping the schedule of `steps`.
    pub stop_after: Option<u32>,
    /// No pipeline: target and drafter alternate on one thread (the reference for bit-identity).
    pub sync: bool,
    /// Write a Chrome/Perfetto trace of the pipeline here.
    pub trace: Option<PathBuf>,
    /// The CUDA allocator's mode (None: `DFLASH_ALLOC_MODE`, else normal). Debug modes only.
    pub alloc_mode: Option<crate::backend::cuda::alloc::Mode>,
    /// How batches cross from the target to the drafter (None: auto).
    pub transport: Option<Transport>,
    /// CUDA devices of the target and of the drafter (empty drafter list: the target's).
    pub target_gpus: Vec<usize>,
    pub drafter_gpus: Vec<usize>,
    /// Write TensorBoard event files under `<out>/tb/` beside `<out>/metrics.jsonl`.
    pub tensorboard: bool,
}

impl RunOptions {
    /// The defaults of `dflash-engine run` with no flags: the tiny preset and self-generated data,
    /// sized to train visibly on two CPU cores in a few minutes.
    pub fn tiny_default() -> Self {
        RunOptions {
            target: "tiny".into(),
            target_seed: 0,
            init_std: TINY_INIT_STD,
            data: None,
            gen_samples: 512,
            gen_prompt_len: 8,
            gen_temperature: 0.0,
            steps: 300,
            batch_size: 8,
            grad_accum: 1,
            seq_len: 96,
            anchors: 16,
            block_size: 16,
            drafter_layers: 2,
            taps: None,
            noise_std: 0.0,
            split_fc: false,
            pad_to_tokens: None,
            max_inflight: 2,
            device: Device::Auto,
            seed: 0,
            out: PathBuf::from("runs/default"),
            resume: false,
            lr: 3e-3,
            warmup_frac: 0.04,
            clip: 1.0,
            log_every: 10,
            save_every: 100,
            checkpoints: true,
            keep_last: 2,
            logits_chunk: 2048,
            quiet: false,
            faults: Faults::default(),
            stop_after: None,
            sync: false,
            trace: None,
            alloc_mode: None,
            transport: None,
            target_gpus: vec![0],
            drafter_gpus: Vec::new(),
            tensorboard: true,
        }
    }
}

/// The random-init scale of the embedded tiny target. With small weights the residual stream is
/// dominated by the current token's embedding, so greedy decoding falls into repeats and cycles
/// that a drafter can learn (copying from context, short-range patterns); at 0.25 the
/// continuations are chaotic, at 0.02 nearly constant.
pub const TINY_INIT_STD: f32 = 0.05;

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
    /// Wall time of each step as the drafter side saw it (checkpoint writes excluded).
    pub step_ms: Vec<f64>,
    pub checkpoint_seconds: f64,
    /// The backend's device-memory report (the CUDA allocator's peak and reserved bytes).
    pub device_memory: Option<String>,
}

/// Where a run's target comes from.
enum TargetSource {
    Preset { cfg: TargetConfig, seed: u64, std: f32 },
    Files(ModelFiles),
}

impl TargetSource {
    fn resolve(spec: &str, seed: u64, std: f32) -> Result<Self> {
        if crate::config::PRESET_NAMES.contains(&spec) && !Path::new(spec).exists() {
            return Ok(TargetSource::Preset { cfg: TargetConfig::preset(spec)?, seed, std });
        }
        let files = ModelFiles::open(spec).with_context(|| {
            format!(
                "--target {spec}: not a preset ({}) and not a readable Hugging Face checkpoint folder",
                crate::config::PRESET_NAMES.join(", ")
            )
        })?;
        Ok(TargetSource::Files(files))
    }

    fn config(&self) -> &TargetConfig {
        match self {
            TargetSource::Preset { cfg, .. } => cfg,
            TargetSource::Files(f) => f.config(),
        }
    }

    fn describe(&self) -> String {
        match self {
            TargetSource::Preset { cfg, seed, std } => format!(
                "preset ({} layers, hidden {}, vocab {}, init seed {seed}, std {std})",
                cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
            ),
            TargetSource::Files(f) => format!(
                "{} ({} layers, hidden {})",
                f.dir().display(),
                f.config().num_hidden_layers,
                f.config().hidden_size
            ),
        }
    }

    /// Loads the target on `be`: only the layers up to the last tap unless `all_layers`.
    fn load<B: Backend>(&self, be: &B, taps: Vec<usize>, all_layers: bool) -> Result<Target<B>> {
        let shape = TargetShape::from(self.config());
        match self {
            TargetSource::Preset { cfg, seed, std } => {
                let specs = weights::target_tensor_specs(cfg);
                Target::load(be, shape, taps, all_layers, |name, dims| -> Result<Vec<f32>> {
                    let (t, spec) = specs
                        .iter()
                        .enumerate()
                        .find(|(_, s)| s.name == name)
                        .with_context(|| format!("preset has no tensor {name}"))?;
                    anyhow::ensure!(
                        spec.shape == dims,
                        "preset tensor {name}: shape {:?}, expected {dims:?}",
                        spec.shape
                    );
                    let n: usize = dims.iter().product();
                    Ok((0..n as u64)
                        .into_par_iter()
                        .map(|e| weights::init_value_bf16(spec.role, *seed, t as u32, e, *std).to_f32())
                        .collect())
                })
            }
            TargetSource::Files(f) => Target::load(be, shape, taps, all_layers, |name, dims| -> Result<Vec<f32>> {
                Ok(f.tensor_f32(name, dims)?)
            }),
        }
    }
}

/// Samples of a step, cut into micro-batches: a pure function of the step.
struct StepBatches {
    data: Dataset,
    spec: BatchSpec,
    batch_size: usize,
    grad_accum: usize,
    seed: u64,
}

impl BatchSource for StepBatches {
    fn micro_batches(&self, step: u32) -> Result<Vec<HostBatch>, Box<dyn std::error::Error + Send + Sync>> {
        let per_micro = self.batch_size;
        let samples: Vec<Sample> = self.data.samples_for_step(u64::from(step), per_micro * self.grad_accum, self.seed);
        let mut out = Vec::with_capacity(self.grad_accum);
        for (m, chunk) in samples.chunks(per_micro).enumerate() {
            out.push(build_batch(chunk, &self.spec, step, (m * per_micro) as u32)?);
        }
        Ok(out)
    }
}

/// A fingerprint of everything that must match for `--resume` to continue the same run.
fn run_fingerprint(o: &RunOptions, target: &str) -> String {
    format!(
        "target={target};data={:?};gen={}x{}@{};seed={};batch={}x{};seq={};anchors={};bs={};layers={};taps={:?};noise={};steps={};lr={};pad={:?}",
        o.data, o.gen_samples, o.gen_prompt_len, o.gen_temperature, o.seed, o.batch_size, o.grad_accum, o.seq_len, o.anchors, o.block_size, o.drafter_layers, o.taps, o.noise_std, o.steps, o.lr, o.pad_to_tokens
    )
}

/// Peak resident memory of this process (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn bar(quiet: bool, len: u64, msg: &str) -> ProgressBar {
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

/// Runs training as `opts` says. Ctrl-C (when `interrupt` is set) stops after the current step
/// with a checkpoint.
pub fn run(opts: &RunOptions, interrupt: Option<Arc<AtomicBool>>) -> Result<RunSummary> {
    use crate::backend::cuda::CudaBackend;
    // Debug modes of the CUDA allocator (DESIGN.md rule 6): poison freed blocks with NaN, skip
    // the cross-stream deferral (test-only: reproduces the corruption), or map every free to
    // cuMemFreeAsync so compute-sanitizer can check the stream bookkeeping.
    let mode = match opts.alloc_mode {
        Some(m) => m,
        None => alloc_mode_from_env()?,
    };
    let topo = Topology::from_options(opts)?;
    let cuda = |ordinal: usize| CudaBackend::new(ordinal, mode).map_err(|why| anyhow::anyhow!("--device cuda: {why}"));
    let cpus = || -> Vec<CpuBackend> { topo.devices.iter().map(|_| CpuBackend::new()).collect() };
    let on_cuda = |first: CudaBackend| -> Result<RunSummary> {
        let mut bes = vec![first];
        for &d in &topo.devices[1..] {
            bes.push(cuda(d)?);
        }
        run_on(&bes, &topo, opts, interrupt.clone())
    };
    match opts.device {
        Device::Cpu => run_on(&cpus(), &topo, opts, interrupt),
        Device::Cuda => on_cuda(cuda(topo.devices[0])?),
        Device::Auto => match CudaBackend::new(topo.devices[0], mode) {
            Ok(be) => on_cuda(be),
            Err(why) => {
                if !opts.quiet {
                    eprintln!("note      no usable GPU ({why}); running on the CPU backend");
                }
                run_on(&cpus(), &topo, opts, interrupt)
            }
        },
    }
}

/// Which device runs what: `devices` lists each device once (first use first); `targets` and
/// `drafters` index into it. On the CPU backend each listed device is a separate CPU backend
/// (same host), so the multi-device paths run and are tested without a GPU.
#[derive(Clone, Debug)]
struct Topology {
    devices: Vec<usize>,
    targets: Vec<usize>,
    drafters: Vec<usize>,
}

impl Topology {
    fn from_options(o: &RunOptions) -> Result<Self> {
        let t: Vec<usize> = if o.target_gpus.is_empty() { vec![0] } else { o.target_gpus.clone() };
        let d: Vec<usize> = if o.drafter_gpus.is_empty() { vec![t[0]] } else { o.drafter_gpus.clone() };
        for (flag, list) in [("--target-gpus", &t), ("--drafter-gpus", &d)] {
            let mut u = list.clone();
            u.sort_unstable();
            u.dedup();
            if u.len() != list.len() {
                bail!("{flag} {list:?} lists a device twice: give each GPU once");
            }
        }
        let mut devices: Vec<usize> = Vec::new();
        for &x in t.iter().chain(&d) {
            if !devices.contains(&x) {
                devices.push(x);
            }
        }
        let at = |x: &usize| devices.iter().position(|y| y == x).unwrap_or(0);
        Ok(Topology { targets: t.iter().map(at).collect(), drafters: d.iter().map(at).collect(), devices })
    }
}

/// `DFLASH_ALLOC_MODE`: the CUDA allocator's debug modes (DESIGN.md rule 6).
fn alloc_mode_from_env() -> Result<crate::backend::cuda::alloc::Mode> {
    use crate::backend::cuda::alloc::Mode;
    Ok(match std::env::var("DFLASH_ALLOC_MODE").as_deref() {
        Ok("poison") => Mode::PoisonOnFree,
        Ok("unsafe-reuse") => Mode::UnsafeReuse,
        Ok("free-async") => Mode::FreeAsync,
        Ok("normal") | Err(_) => Mode::Normal,
        Ok(other) => bail!("DFLASH_ALLOC_MODE={other}: use normal, poison, unsafe-reuse or free-async"),
    })
}

/// Bytes of one micro-batch's packed taps (rows x taps x hidden, bf16) for these flags.
pub fn micro_batch_bytes(opts: &RunOptions) -> Result<usize> {
    let src = TargetSource::resolve(&opts.target, opts.target_seed, opts.init_std)?;
    let tcfg = src.config().clone();
    let dcfg = DrafterConfig::for_target(&tcfg, opts.drafter_layers, opts.block_size, opts.taps.clone())?;
    let rows = (opts.batch_size * opts.seq_len).max(opts.pad_to_tokens.unwrap_or(0));
    Ok(rows * dcfg.target_layer_ids.len() * tcfg.hidden_size * 2)
}

/// Trains on `bes` (one backend per device of `topo`): the targets and the data-parallel drafter
/// ranks as `topo` places them (all on one backend on one device).
fn run_on<B: Backend>(
    bes: &[B],
    topo: &Topology,
    opts: &RunOptions,
    interrupt: Option<Arc<AtomicBool>>,
) -> Result<RunSummary> {
    validate(opts)?;
    let one_device = bes.len() == 1;
    let (nt, nd) = (topo.targets.len(), topo.drafters.len());
    if opts.sync && opts.split_fc && one_device {
        bail!(
            "--sync runs the unsplit reference on one device; drop --split-fc-layers (split-FC is checked against it)"
        );
    }
    if opts.split_fc && nt > 1 {
        bail!("--split-fc-layers keeps the fc group with the target: it needs one target GPU (got --target-gpus with {nt})");
    }
    if opts.grad_accum % nd != 0 {
        bail!(
            "--grad-accum {}: with {nd} drafter GPUs each step's micro-batches are split evenly between them, so it must be a multiple of {nd} (e.g. --batch-size {} --grad-accum {} trains on the same {} sequences per step)",
            opts.grad_accum,
            (opts.batch_size / nd).max(1),
            opts.grad_accum * nd,
            opts.batch_size * opts.grad_accum
        );
    }
    let bt = &bes[topo.targets[0]];
    let bd = &bes[topo.drafters[0]];
    let say = |m: String| {
        if !opts.quiet {
            eprintln!("{m}");
        }
    };
    let s = bt.compute_stream();
    let sd = bd.compute_stream();
    let src = TargetSource::resolve(&opts.target, opts.target_seed, opts.init_std)?;
    let tcfg = src.config().clone();
    let dcfg = DrafterConfig::for_target(&tcfg, opts.drafter_layers, opts.block_size, opts.taps.clone())
        .context("drafter configuration")?;
    let names = |idx: &[usize]| {
        let n: Vec<String> = idx.iter().map(|&i| bes[i].name()).collect();
        if n.len() > 1 && n.iter().all(|x| *x == n[0]) {
            format!("{} x {}", n.len(), n[0])
        } else {
            n.join(", ")
        }
    };
    let backend_name = if one_device {
        bt.name()
    } else {
        format!("target on {}, drafter on {}", names(&topo.targets), names(&topo.drafters))
    };
    say(format!("backend   {backend_name}"));
    say(format!("target    {}", src.describe()));
    say(format!(
        "drafter   {} layers, block {}, taps {:?}, mask token {}",
        dcfg.num_layers, dcfg.block_size, dcfg.target_layer_ids, dcfg.mask_token_id
    ));

    // Data: a JSONL file, or sequences the target writes itself (needs every layer).
    let generated = opts.data.is_none();
    let t_load = Instant::now();
    let target = src.load(bt, dcfg.target_layer_ids.clone(), generated)?;
    // Further target GPUs hold their own copy (only the tapped layers).
    let mut more_targets = Vec::new();
    for &i in &topo.targets[1..] {
        more_targets.push(src.load(&bes[i], dcfg.target_layer_ids.clone(), false)?);
    }
    for &i in &topo.targets {
        bes[i].synchronize(&bes[i].compute_stream())?;
    }
    say(format!(
        "loaded    {} target cop{} in {:.1} s",
        1 + more_targets.len(),
        if more_targets.is_empty() { "y" } else { "ies" },
        t_load.elapsed().as_secs_f64()
    ));
    let t_gen = Instant::now();
    let data = match &opts.data {
        Some(path) => Dataset::from_jsonl(path, tcfg.vocab_size, opts.seq_len)?,
        None => {
            let pb = bar(opts.quiet, opts.gen_samples as u64, "generate");
            let ordinary = tcfg.bos_token_id.unwrap_or(dcfg.mask_token_id).min(dcfg.mask_token_id);
            let spec = GenSpec {
                num_samples: opts.gen_samples,
                prompt_len: opts.gen_prompt_len,
                seq_len: opts.seq_len,
                temperature: opts.gen_temperature,
                seed: opts.seed,
                ordinary_vocab: ordinary,
                batch: 64,
            };
            let samples = generate(bt, &s, &target, &spec, |done| pb.set_position(done as u64))?;
            pb.finish_and_clear();
            Dataset::from_samples(samples)?
        }
    };
    let gen_seconds = t_gen.elapsed().as_secs_f64();
    say(format!(
        "data      {} samples, {} tokens{}",
        data.len(),
        data.total_tokens(),
        if generated { format!(" (generated by the target in {gen_seconds:.1} s, greedy)") } else { String::new() }
    ));

    // Both sides.
    let dshape = DrafterShape::from_config(&dcfg, opts.logits_chunk);
    let (embed, lm_head) = Drafter::frozen_from_target(bt, &s, &target)?;
    // Every rank starts from the same weights (the same seed). The frozen tables are copied to
    // each rank's device; the rank on the target's device (else the last) takes the originals.
    let keeper = topo.drafters.iter().position(|&i| i == topo.targets[0]).unwrap_or(nd - 1);
    let mut tables: Vec<Option<[B::Buf; 2]>> = Vec::with_capacity(nd);
    for (r, &i) in topo.drafters.iter().enumerate() {
        tables.push(if r == keeper {
            None
        } else {
            Some(crate::backend::copy_bufs(bt, &bes[i], &bes[i].compute_stream(), [&embed, &lm_head])?)
        });
    }
    let keeper_be = &bes[topo.drafters[keeper]];
    tables[keeper] = Some(crate::backend::move_bufs(bt, keeper_be, &keeper_be.compute_stream(), [embed, lm_head])?);
    let mut sides: Vec<DrafterSide<B>> = Vec::with_capacity(nd);
    for (t, &i) in tables.into_iter().zip(&topo.drafters) {
        let (be, st) = (&bes[i], bes[i].compute_stream());
        let [e, l] = t.expect("every rank has its tables");
        let (drafter, fc) = Drafter::new(be, &st, dshape.clone(), e, l, opts.seed)?;
        sides.push(DrafterSide::new(be, &st, drafter, Some(fc))?);
    }
    let fingerprint = run_fingerprint(opts, &opts.target);
    let mut first_step = 0;
    if opts.resume {
        match checkpoint::load_latest(&opts.out)? {
            Some(ck) => {
                if ck.state.run_fingerprint != fingerprint {
                    bail!("--resume: the checkpoint in {} was written by a different run configuration.\n  checkpoint: {}\n  this run:   {}\nUse the same flags, or another --out.", ck.dir.display(), ck.state.run_fingerprint, fingerprint);
                }
                for (side, &i) in sides.iter_mut().zip(&topo.drafters) {
                    restore(&bes[i], &bes[i].compute_stream(), side, &ck.tensors)?;
                }
                first_step = ck.state.step;
                say(format!("resume    from {} (step {first_step})", ck.dir.display()));
            }
            None => say(format!("resume    no checkpoint in {}: starting from step 0", opts.out.display())),
        }
    }
    // Split-FC: the fc group lives with the target (on the target's device); the other ranks'
    // copies are dropped.
    let fc = if opts.split_fc {
        for side in &mut sides[1..] {
            side.fc = None;
        }
        match sides[0].fc.take() {
            Some(fc) => Some(Mutex::new(fc.move_to(bd, bt, &s)?)),
            None => None,
        }
    } else {
        None
    };
    let tside = TargetSide { target, fc };
    let more_tsides: Vec<TargetSide<B>> =
        more_targets.into_iter().map(|target| TargetSide { target, fc: None }).collect();
    let source = StepBatches {
        data,
        spec: BatchSpec {
            anchors_per_seq: opts.anchors,
            block_size: opts.block_size,
            mask_token_id: dcfg.mask_token_id,
            gamma: dcfg.gamma as f32,
            pad_to_tokens: opts.pad_to_tokens,
            seed: opts.seed,
        },
        batch_size: opts.batch_size,
        grad_accum: opts.grad_accum,
        seed: opts.seed,
    };
    let optim = OptimConfig {
        lr: opts.lr,
        warmup_frac: opts.warmup_frac,
        clip: opts.clip,
        total_steps: opts.steps,
        ..OptimConfig::default()
    };
    let pcfg = PipelineConfig {
        max_inflight: opts.max_inflight,
        first_step,
        end_step: opts.steps,
        noise: NoiseSpec { std: opts.noise_std, seed: opts.seed },
        faults: opts.faults,
        trace: opts.trace.as_ref().map(|_| Arc::new(pipeline::Trace::default())),
        transport: opts.transport,
        max_rows: (opts.batch_size * opts.seq_len).max(opts.pad_to_tokens.unwrap_or(0)),
        lockstep: opts.sync,
    };

    std::fs::create_dir_all(&opts.out).with_context(|| format!("creating the output folder {}", opts.out.display()))?;
    // Metrics log (train/metrics.rs): metrics.jsonl continued from first_step, TensorBoard events.
    let mut metrics = crate::train::metrics::MetricsLog::open(&opts.out, first_step, opts.tensorboard)?;
    if let Some(note) = metrics.note() {
        say(note);
    }
    let pb = bar(opts.quiet, u64::from(opts.steps), "train");
    pb.set_position(u64::from(first_step));
    let mut history = Vec::new();
    let mut last_ckpt: Option<PathBuf> = None;
    let config_json = dcfg.to_json();
    let header = "  step |   loss |   acc | accept | grad-norm |       lr |     ms |    tok/s | MFU";
    let line = |pb: &ProgressBar, text: String| {
        // A hidden bar (no terminal) would swallow println: print plainly then.
        if pb.is_hidden() {
            eprintln!("{text}");
        } else {
            pb.println(text);
        }
    };
    if !opts.quiet {
        line(&pb, header.to_string());
    }
    let mut last_t = Instant::now();
    let mut step_ms: Vec<f64> = Vec::new();
    let mut ckpt_secs = 0.0f64;
    let mut on_step = |m: &StepMetrics,
                       side: &mut DrafterSide<B>,
                       st: &PipelineStats|
     -> Result<Control, Box<dyn std::error::Error + Send + Sync>> {
        let ms = last_t.elapsed().as_secs_f64() * 1e3;
        last_t = Instant::now();
        pb.inc(1);
        let done = m.step + 1;
        let log = m.step == first_step || done % opts.log_every.max(1) == 0 || done == opts.steps || m.skipped;
        if log && !opts.quiet {
            let note = if m.skipped { "  (step skipped: non-finite loss or grad norm)" } else { "" };
            line(
                &pb,
                format!(
                    "{:>6} | {:>6.3} | {:>5.3} | {:>6.3} | {:>9.3} | {:>8.2e} | {:>6.0} | {:>8.0} | n/a{note}",
                    done,
                    m.loss,
                    m.accuracy,
                    m.accept_len,
                    m.grad_norm,
                    m.lr,
                    ms,
                    m.tokens as f64 / (ms / 1e3)
                ),
            );
        }
        history.push(m.clone());
        // Before the checkpoint: a saved step always has its metrics line.
        metrics.record_step(m, ms, st)?;
        let stop =
            interrupt.as_ref().is_some_and(|f| f.load(Ordering::SeqCst)) || opts.stop_after.is_some_and(|n| done >= n);
        step_ms.push(ms);
        if opts.checkpoints && (done % opts.save_every.max(1) == 0 || done == opts.steps || stop) {
            let t_ck = Instant::now();
            if let Some(ms) = opts.faults.checkpoint_delay_ms {
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
            let tensors = gather(bt, &s, bd, &sd, side, tside.fc.as_ref())?;
            let state = TrainerState {
                step: done,
                seed: opts.seed,
                run_fingerprint: fingerprint.clone(),
                extra: serde_json::json!({ "loss": m.loss, "accept_len": m.accept_len }),
            };
            last_ckpt = Some(checkpoint::save(&opts.out, &state, &config_json, &tensors, opts.keep_last)?);
            ckpt_secs += t_ck.elapsed().as_secs_f64();
        }
        last_t = Instant::now();
        Ok(if stop { Control::Stop } else { Control::Continue })
    };
    let mem_before: Vec<Option<usize>> = bes.iter().map(|b| b.allocated_bytes()).collect();
    let stats = if opts.sync && one_device {
        sync_loop(bt, &tside, &mut sides[0], &source, &pcfg, &optim, &mut on_step)?
    } else {
        let dbes: Vec<&B> = topo.drafters.iter().map(|&i| &bes[i]).collect();
        let comms = B::comm_group(&dbes).context("setting up the drafter GPUs' gradient all-reduce")?;
        let targets: Vec<TargetRank<'_, B>> = std::iter::once(&tside)
            .chain(more_tsides.iter())
            .zip(&topo.targets)
            .map(|(side, &i)| TargetRank { be: &bes[i], side })
            .collect();
        let drafters: Vec<DrafterRank<'_, B>> = sides
            .iter_mut()
            .zip(dbes.iter().copied())
            .zip(comms)
            .map(|((side, be), comm)| DrafterRank { be, side, comm })
            .collect();
        let (result, stats) = pipeline::run(&targets, drafters, &source, &pcfg, &optim, &mut on_step);
        // Whatever the outcome: no pinned slot may still be held and every transient device
        // buffer must be back (DESIGN.md rule 5; the fault tests check this line).
        let after: Vec<Option<usize>> = bes.iter().map(|b| b.allocated_bytes()).collect();
        let leaks = leak_check(&mem_before, &after, &stats);
        if !opts.quiet {
            eprintln!("leak check     {leaks}");
        }
        result.map_err(|e| anyhow::Error::new(e).context(format!("the run stopped ({leaks})")))?;
        stats
    };
    pb.finish_and_clear();
    if let (Some(path), Some(tr)) = (&opts.trace, &pcfg.trace) {
        let text = serde_json::to_string(&tr.to_json())?;
        weights::write_file_atomic(path, text.as_bytes())
            .with_context(|| format!("writing the trace {}", path.display()))?;
        if !opts.quiet {
            eprintln!(
                "trace          {} ({} spans; open in ui.perfetto.dev or chrome://tracing)",
                path.display(),
                tr.len()
            );
        }
    }
    let summary = RunSummary {
        history,
        stats,
        first_step,
        checkpoint: last_ckpt,
        backend: backend_name.clone(),
        peak_rss_bytes: peak_rss_bytes(),
        data_samples: source.data.len(),
        gen_seconds,
        step_ms,
        checkpoint_seconds: ckpt_secs,
        device_memory: if one_device {
            bt.memory_report()
        } else {
            let parts: Option<Vec<String>> =
                bes.iter().map(|b| b.memory_report().map(|m| format!("{}: {m}", b.name()))).collect();
            parts.map(|p| p.join("; "))
        },
    };
    if !opts.quiet {
        print_summary(&summary);
    }
    Ok(summary)
}

/// Target and drafter alternating on the calling thread, one step at a time.
#[allow(clippy::type_complexity)]
fn sync_loop<B: Backend>(
    be: &B,
    tside: &TargetSide<B>,
    side: &mut DrafterSide<B>,
    source: &StepBatches,
    pcfg: &PipelineConfig,
    optim: &OptimConfig,
    on_step: &mut dyn FnMut(
        &StepMetrics,
        &mut DrafterSide<B>,
        &PipelineStats,
    ) -> Result<Control, Box<dyn std::error::Error + Send + Sync>>,
) -> Result<PipelineStats> {
    let s = be.compute_stream();
    let started = Instant::now();
    let mut st = PipelineStats::default();
    for step in pcfg.first_step..pcfg.end_step {
        let micro = source.micro_batches(step).map_err(|e| anyhow::anyhow!("step {step}: {e}"))?;
        let t0 = Instant::now();
        let m = crate::train::step::sync_step(be, &s, &tside.target, side, &micro, pcfg.noise, optim, step)?;
        st.drafter_busy += t0.elapsed();
        st.steps += 1;
        st.tokens += m.tokens as u64;
        st.draft_positions += m.draft_positions as u64;
        st.skipped += u32::from(m.skipped);
        st.wall = started.elapsed();
        if let Control::Stop = on_step(&m, side, &st).map_err(|e| anyhow::anyhow!("step {step}: {e}"))? {
            break;
        }
    }
    st.wall = started.elapsed();
    Ok(st)
}

fn validate(o: &RunOptions) -> Result<()> {
    let bad = |m: &str| -> Result<()> { bail!("{m}") };
    if o.steps == 0 {
        bad("--steps must be at least 1")?;
    }
    if o.batch_size == 0 || o.grad_accum == 0 {
        bad("--batch-size and --grad-accum must be at least 1")?;
    }
    if o.anchors == 0 {
        bad("--anchors must be at least 1")?;
    }
    if o.max_inflight == 0 {
        bad("--max-inflight must be at least 1")?;
    }
    if !(o.noise_std.is_finite() && o.noise_std >= 0.0) {
        bad("--noise-std must be a finite number >= 0")?;
    }
    if o.data.is_none() && o.gen_prompt_len + 2 > o.seq_len {
        bad("--seq-len must exceed the generated prompt length by at least 2")?;
    }
    Ok(())
}

/// What is still held after the pipeline ended: pinned slots, and device bytes beyond those held
/// before it started (weights, optimizer state), per device.
fn leak_check(before: &[Option<usize>], after: &[Option<usize>], st: &PipelineStats) -> String {
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

/// Host copies of every trained tensor (masters and moments) for a checkpoint.
fn gather<B: Backend>(
    bt: &B,
    st: &B::Stream,
    bd: &B,
    sd: &B::Stream,
    side: &DrafterSide<B>,
    remote_fc: Option<&Mutex<ParamGroup<B>>>,
) -> Result<Vec<TensorState>, Box<dyn std::error::Error + Send + Sync>> {
    let mut out = Vec::new();
    let mut take = |be: &B, s: &B::Stream, g: &ParamGroup<B>| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let (master, m, v) = (be.download(s, &g.master)?, be.download(s, &g.m)?, be.download(s, &g.v)?);
        for e in g.table.entries() {
            let r = e.offset..e.offset + e.numel;
            out.push(TensorState {
                name: e.name.clone(),
                shape: e.shape.clone(),
                master: master[r.clone()].to_vec(),
                exp_avg: m[r.clone()].to_vec(),
                exp_avg_sq: v[r].to_vec(),
            });
        }
        Ok(())
    };
    match (&side.fc, remote_fc) {
        (Some(fc), _) => take(bd, sd, fc)?,
        (None, Some(fc)) => take(bt, st, &*fc.lock().map_err(|_| "fc group lock poisoned")?)?,
        (None, None) => return Err("no fc group on either side".into()),
    }
    take(bd, sd, &side.drafter.body)?;
    Ok(out)
}

/// Puts checkpointed masters and moments back (and the bf16 weights from the masters).
fn restore<B: Backend>(be: &B, s: &B::Stream, side: &mut DrafterSide<B>, tensors: &[TensorState]) -> Result<()> {
    let groups: Vec<&mut ParamGroup<B>> = side.fc.iter_mut().chain(std::iter::once(&mut side.drafter.body)).collect();
    for g in groups {
        let n = g.table.total();
        let (mut master, mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
        for e in g.table.entries() {
            let t = tensors
                .iter()
                .find(|t| t.name == e.name)
                .with_context(|| format!("checkpoint has no tensor {}", e.name))?;
            anyhow::ensure!(
                t.shape == e.shape,
                "checkpoint tensor {}: shape {:?}, this drafter needs {:?}",
                e.name,
                t.shape,
                e.shape
            );
            let r = e.offset..e.offset + e.numel;
            master[r.clone()].copy_from_slice(&t.master);
            m[r.clone()].copy_from_slice(&t.exp_avg);
            v[r].copy_from_slice(&t.exp_avg_sq);
        }
        be.upload(s, &master, &mut g.master, 0)?;
        be.upload(s, &master, &mut g.weights, 0)?;
        be.upload(s, &m, &mut g.m, 0)?;
        be.upload(s, &v, &mut g.v, 0)?;
    }
    Ok(())
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
        eprintln!("accept length  {:.3} -> {:.3}", first.accept_len, last.accept_len);
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
        "time           wall {:.1} s: training {:.1} s, checkpoints {:.1} s; data generation {:.1} s (before)",
        wall, train, r.checkpoint_seconds, r.gen_seconds
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
    eprintln!(
        "  queue        mean depth {:.2} of {}",
        st.mean_queue_depth(),
        st.queue_depth.iter().max().copied().unwrap_or(0)
    );
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

/// Fault injection from `DFLASH_FAULT=<kind>@<step>` (kinds: producer-error, publish-error,
/// consumer-panic), for the failure tests that drive the binary.
pub fn faults_from_env() -> Faults {
    let mut f = Faults::default();
    if let Ok(v) = std::env::var("DFLASH_FAULT") {
        if let Some((kind, step)) = v.split_once('@') {
            let step = step.parse().ok();
            match kind {
                "producer-error" => f.producer_error_at = step,
                "publish-error" => f.publish_error_at = step,
                "consumer-panic" => f.consumer_panic_at = step,
                "copy-error" => f.copy_error_at = step,
                _ => {}
            }
        }
    }
    f
}

/// `dflash-engine inspect DIR`: a target checkpoint's config and tensors, or a drafter's; for a
/// run folder its last metrics line, then its latest checkpoint.
pub fn inspect(dir: &Path) -> Result<()> {
    if let Some(last) = crate::train::metrics::describe_last(dir)? {
        println!("{last}");
    }
    let latest = dir.join(checkpoint::LATEST_FILE);
    if !dir.join("config.json").exists() && latest.is_file() {
        let name = std::fs::read_to_string(&latest).with_context(|| format!("reading {}", latest.display()))?;
        return inspect(&dir.join(name.trim()));
    }
    let cfg_text = std::fs::read_to_string(dir.join("config.json"))
        .with_context(|| format!("{}: no readable config.json", dir.display()))?;
    let store = weights::TensorStore::open_dir(dir)?;
    if cfg_text.contains("DFlashDraftModel") {
        let d = DrafterConfig::from_json_str(&cfg_text)?;
        println!(
            "drafter: {} layers, block {}, taps {:?}, mask token {}, hidden {}",
            d.num_layers, d.block_size, d.target_layer_ids, d.mask_token_id, d.hidden_size
        );
    } else {
        let t = TargetConfig::from_json_str(&cfg_text)?;
        println!(
            "target: {} layers, hidden {}, heads {}/{} x {}, mlp {}, vocab {}, {} parameters",
            t.num_hidden_layers,
            t.hidden_size,
            t.num_attention_heads,
            t.num_key_value_heads,
            t.head_dim,
            t.intermediate_size,
            t.vocab_size,
            t.num_params()
        );
    }
    let mut names = store.names();
    names.sort();
    for n in names {
        let m = store.tensor_info(n)?;
        println!("  {n:<56} {:?} {:?}", m.dtype, m.shape);
    }
    Ok(())
}

/// `dflash-engine gen-data`: the embedded default data as JSON Lines.
pub fn gen_data(target: &str, samples: usize, seq_len: usize, init_std: f32, out: &Path) -> Result<()> {
    let be = CpuBackend::new();
    let s = be.compute_stream();
    let d = RunOptions::tiny_default();
    let src = TargetSource::resolve(target, d.target_seed, init_std)?;
    let cfg = src.config().clone();
    let last = cfg.num_hidden_layers - 1;
    let t = src.load(&be, vec![last], true)?;
    let ordinary = cfg.bos_token_id.unwrap_or(cfg.resolved_mask_token_id()?).min(cfg.resolved_mask_token_id()?);
    let spec = GenSpec {
        num_samples: samples,
        prompt_len: d.gen_prompt_len,
        seq_len,
        temperature: 0.0,
        seed: d.seed,
        ordinary_vocab: ordinary,
        batch: 64,
    };
    let data = generate(&be, &s, &t, &spec, |_| {})?;
    let mut text = String::new();
    for smp in &data {
        text.push_str(&serde_json::to_string(
            &serde_json::json!({ "input_ids": smp.input_ids, "loss_mask": smp.loss_mask }),
        )?);
        text.push('\n');
    }
    weights::write_file_atomic(out, text.as_bytes())?;
    eprintln!("wrote {} samples to {}", data.len(), out.display());
    Ok(())
}
