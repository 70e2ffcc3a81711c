//! Run setup: what the options name (the target, the data, the devices), checked before any
//! training, and the two sides built from them (targets, drafter ranks, a resumed state).

use std::io::Read;
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sha2::{Digest, Sha256};

use super::options::RunOptions;
use crate::backend::Backend;
use crate::config::{DrafterConfig, TargetConfig};
use crate::data::Dataset;
use crate::model::drafter::{Drafter, DrafterShape, Frozen};
use crate::model::target::{Target, TargetShape};
use crate::pipeline::{BatchSource, TargetSide};
use crate::train::batch::{build_batch, BatchSpec, HostBatch, Sample};
use crate::train::checkpoint;
use crate::train::step::DrafterSide;
use crate::weights::{self, ModelFiles};

/// Where a run's target comes from.
pub enum TargetSource {
    Preset { name: String, cfg: TargetConfig, seed: u64, std: f32 },
    Files(ModelFiles),
}

impl TargetSource {
    /// `spec` names a preset that `resolve` generates: a preset's name with no file or folder of
    /// that name beside it.
    pub fn is_preset(spec: &str) -> bool {
        crate::config::PRESET_NAMES.contains(&spec) && !Path::new(spec).exists()
    }

    /// A preset name, or a checkpoint folder. A folder that carries a preset's name wins (it is
    /// what the user has on disk) and `note` says so.
    pub fn resolve(spec: &str, seed: u64, std: f32, note: &mut Vec<String>) -> Result<Self> {
        let path = Path::new(spec);
        if Self::is_preset(spec) {
            return Ok(TargetSource::Preset { name: spec.to_string(), cfg: TargetConfig::preset(spec)?, seed, std });
        }
        if path.is_file() {
            bail!(
                "--target {spec} is a file: give the checkpoint's folder (config.json + *.safetensors), or a preset ({})",
                crate::config::PRESET_NAMES.join(", ")
            );
        }
        if crate::config::PRESET_NAMES.contains(&spec) {
            note.push(format!(
                "--target {spec}: using the folder ./{spec}, not the preset of the same name (rename the folder to use the preset)"
            ));
        }
        let files = ModelFiles::open(spec).with_context(|| {
            format!(
                "--target {spec}: not a preset ({}) and not a readable Hugging Face checkpoint folder",
                crate::config::PRESET_NAMES.join(", ")
            )
        })?;
        Ok(TargetSource::Files(files))
    }

    pub fn config(&self) -> &TargetConfig {
        match self {
            TargetSource::Preset { cfg, .. } => cfg,
            TargetSource::Files(f) => f.config(),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            TargetSource::Preset { name, cfg, seed, std } => format!(
                "preset {name} ({} layers, hidden {}, vocab {}, init seed {seed}, std {std})",
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

    /// What the target is, for the resume fingerprint: a preset with its seed and std, or a
    /// checkpoint's config and a hash of its tensor index (names, dtypes, shapes), wherever the
    /// folder lies.
    pub fn identity(&self) -> Result<serde_json::Value> {
        Ok(match self {
            TargetSource::Preset { name, seed, std, .. } => {
                serde_json::json!({ "preset": name, "seed": seed, "std": std })
            }
            TargetSource::Files(f) => {
                let mut names = f.tensors().names();
                names.sort_unstable();
                let mut h = Sha256::new();
                for n in names {
                    let m = f.tensor_info(n)?;
                    h.update(format!("{n} {:?} {:?}\n", m.dtype, m.shape).as_bytes());
                }
                let config: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(f.dir().join("config.json"))?)?;
                serde_json::json!({ "config": config, "tensor_index_sha256": hex(&h.finalize()) })
            }
        })
    }

    /// Loads the target on `be`: only the layers up to the last tap unless `all_layers`.
    pub fn load<B: Backend>(&self, be: &B, taps: Vec<usize>, all_layers: bool) -> Result<Target<B>> {
        let shape = TargetShape::from(self.config());
        match self {
            TargetSource::Preset { cfg, seed, std, .. } => {
                let specs = weights::target_tensor_specs(cfg);
                let s = be.compute_stream();
                Target::load_with(be, shape, taps, all_layers, |name, dims, buf, off| -> Result<()> {
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
                    let draw =
                        weights::InitDraw { role: spec.role, seed: *seed, stream: t as u32, std: *std, first: 0 };
                    Ok(be.fill_init(&s, buf, off, dims.iter().product(), &draw)?)
                })
            }
            TargetSource::Files(f) => Target::load(be, shape, taps, all_layers, |name, dims| -> Result<Vec<f32>> {
                Ok(f.tensor_f32(name, dims)?)
            }),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A drafter block of `block_size` slots fits the drafter attention of every backend in `bes`
/// (checked before a target loads, not at the first step).
pub fn check_block_size<B: Backend>(bes: &[B], block_size: usize) -> Result<()> {
    for be in bes {
        if let Some(max) = be.max_block_size().filter(|&m| block_size > m) {
            anyhow::bail!(
                "block size {block_size}: {}'s drafter attention takes blocks of up to {max} slots (DFlash drafters \
                 use 16); use --block-size {max} or less, or the CPU backend (--device cpu)",
                be.name()
            );
        }
    }
    Ok(())
}

/// A preset's random-weight flags (`given`: each flag and whether it was given) beside a
/// `--target` that is not a preset: refused, since the folder's own weights are loaded.
pub fn refuse_preset_flags(target: &str, given: &[(&str, bool)]) -> Result<()> {
    let preset = TargetSource::is_preset(target);
    for &(flag, is_given) in given {
        anyhow::ensure!(
            preset || !is_given,
            "{flag} sets a preset target's random weights, but --target {target} is not a preset: its weights are \
             loaded from the folder; drop {flag}"
        );
    }
    Ok(())
}

/// What the data is, for the resume fingerprint: a JSON Lines file's content hash (not its
/// path), or the generator's settings (the target's identity covers the rest).
pub fn data_identity(o: &RunOptions) -> Result<serde_json::Value> {
    Ok(match &o.data.path {
        Some(path) => {
            let mut f = std::fs::File::open(path).with_context(|| format!("--data {}: cannot open", path.display()))?;
            let mut h = Sha256::new();
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = f.read(&mut buf).with_context(|| format!("--data {}: cannot read", path.display()))?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
            }
            serde_json::json!({ "sha256": hex(&h.finalize()) })
        }
        None => serde_json::json!("generated"),
    })
}

/// Which device runs what: `devices` lists each device once (first use first); `targets` and
/// `drafters` index into it. On the CPU backend each listed device is a separate CPU backend
/// (same host), so the multi-device paths run and are tested without a GPU.
#[derive(Clone, Debug)]
pub struct Topology {
    pub devices: Vec<usize>,
    pub targets: Vec<usize>,
    pub drafters: Vec<usize>,
}

impl Topology {
    pub fn from_options(o: &RunOptions) -> Result<Self> {
        let e = &o.exec;
        let t: Vec<usize> = if e.target_gpus.is_empty() { vec![0] } else { e.target_gpus.clone() };
        let d: Vec<usize> = if e.drafter_gpus.is_empty() { vec![t[0]] } else { e.drafter_gpus.clone() };
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
        let topo = Topology { targets: t.iter().map(at).collect(), drafters: d.iter().map(at).collect(), devices };
        topo.check(o)?;
        Ok(topo)
    }

    fn check(&self, o: &RunOptions) -> Result<()> {
        let (nt, nd) = (self.targets.len(), self.drafters.len());
        let (d, e) = (&o.data, &o.exec);
        if e.sync && e.split_fc && self.devices.len() == 1 {
            bail!(
                "--sync runs the unsplit reference on one device; drop --split-fc-layers (split-FC is checked against it)"
            );
        }
        if e.split_fc && nt > 1 {
            bail!("--split-fc-layers keeps the fc group with the target: it needs one target GPU (got --target-gpus with {nt})");
        }
        if d.grad_accum % nd != 0 {
            bail!(
                "--grad-accum {}: with {nd} drafter GPUs each step's micro-batches are split evenly between them, so it must be a multiple of {nd} (e.g. --batch-size {} --grad-accum {} trains on the same {} sequences per step)",
                d.grad_accum,
                (d.batch_size / nd).max(1),
                d.grad_accum * nd,
                d.batch_size * d.grad_accum
            );
        }
        Ok(())
    }
}

/// The most context rows one micro-batch can have (sizes the pinned slots).
pub fn max_rows(o: &RunOptions) -> usize {
    (o.data.batch_size * o.data.seq_len).max(o.data.pad_to_tokens.unwrap_or(0))
}

/// The bytes the batches in flight hold at once: every queued micro-batch's packed taps, plus
/// the pinned slots of a host transport. Checked against the host's memory before anything is
/// allocated, so absurd sizes get an error naming the flags instead of an abort.
pub fn check_inflight_memory(o: &RunOptions, tcfg: &TargetConfig, taps: usize) -> Result<()> {
    let per_batch = (max_rows(o) as u128) * (taps as u128) * (tcfg.hidden_size as u128) * 2;
    let batches = (o.exec.max_inflight as u128) + 3;
    let need = per_batch * batches;
    if let Some(total) = host_memory_bytes() {
        if need > u128::from(total) {
            bail!(
                "the batches in flight need {:.1} GiB ({} micro-batches of {} rows x {} taps x hidden {} in bf16) but this machine has {:.1} GiB: lower --pad-to-tokens, --batch-size/--seq-len or --max-inflight",
                need as f64 / (1u64 << 30) as f64,
                batches,
                max_rows(o),
                taps,
                tcfg.hidden_size,
                total as f64 / (1u64 << 30) as f64
            );
        }
    }
    Ok(())
}

/// The host's physical memory (Linux `MemTotal`).
fn host_memory_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Everything the run writes, checked before training so a bad path costs seconds, not steps:
/// `--out` must be writable and, without `--resume`, hold no earlier run's checkpoints; the
/// `--trace` file must be creatable.
pub fn check_outputs(o: &RunOptions) -> Result<()> {
    let out = &o.output.out;
    std::fs::create_dir_all(out)
        .with_context(|| format!("--out {}: cannot create the output folder", out.display()))?;
    let probe = out.join(format!(".write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("--out {}: the folder is not writable (checkpoints go there)", out.display()))?;
    let _ = std::fs::remove_file(&probe);
    if !o.output.resume {
        if let Some(name) = checkpoint::latest_name(out)? {
            bail!(
                "--out {} already holds checkpoints of a run (latest: {name}): add --resume to continue it, or choose another --out",
                out.display()
            );
        }
    }
    if let Some(trace) = &o.output.trace {
        check_file_writable("--trace", trace)?;
    }
    Ok(())
}

/// The file a flag names can be created or appended to (its folder made if missing); a file that
/// did not exist is removed again. Checked before the work that would write it.
pub fn check_file_writable(flag: &str, path: &Path) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("{flag} {}: cannot create its folder", path.display()))?;
    }
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .with_context(|| format!("{flag} {}: cannot write this file", path.display()))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Samples of a step, cut into micro-batches: a pure function of the step.
pub struct StepBatches {
    pub data: Dataset,
    pub spec: BatchSpec,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub seed: u64,
    /// Test-only (`FaultPlan::context_off_by_one`): every block's labels one token ahead of its
    /// context and anchor ([`shift_labels_one_ahead`]).
    pub context_off_by_one: bool,
}

impl BatchSource for StepBatches {
    fn micro_batches(&self, step: u32) -> Result<Vec<HostBatch>, Box<dyn std::error::Error + Send + Sync>> {
        let per_micro = self.batch_size;
        let samples: Vec<Sample> = self.data.samples_for_step(u64::from(step), per_micro * self.grad_accum, self.seed);
        let mut out = Vec::with_capacity(self.grad_accum);
        for (m, chunk) in samples.chunks(per_micro).enumerate() {
            let mut b = build_batch(chunk, &self.spec, step, u32::try_from(m * per_micro)?)?;
            if self.context_off_by_one {
                shift_labels_one_ahead(&mut b, self.spec.block_size);
            }
            out.push(b);
        }
        Ok(out)
    }
}

/// The trainer off-by-one of `FaultPlan::context_off_by_one` (DFLASH.md pitfall 1): slot `r` of
/// the block at anchor `a` learns the token at `a + r + 1` instead of `a + r`, as a trainer that
/// applies a causal LM's next-token shift to DFlash's labels does. Seen from what the drafter
/// learns to predict, its context rows and its anchor are each one position behind: the context
/// is off by one. Training's metrics compare against these labels, so its accuracy and
/// simulated acceptance look as good as a correct run's; served, slot `r` proposes the token
/// one past the one the target verifies there, and almost nothing is accepted. A label past the
/// sequence's end becomes none (weight 0); the others keep their slot's weight.
pub fn shift_labels_one_ahead(b: &mut HostBatch, bs: usize) {
    let end_of = |start: i32| b.seq_starts.iter().copied().find(|&e| e > start).unwrap_or(start) as usize;
    let mut weight_sum = 0.0;
    for j in 0..b.num_blocks {
        let Ok(a) = usize::try_from(b.anchors[j]) else { continue };
        let start = b.ctx_start[j];
        let (first, end) = (start as usize, end_of(start).min(b.n_valid));
        for r in 1..bs {
            let (i, row) = (j * bs + r, first + a + r + 1);
            if row < end && b.labels[i] >= 0 {
                b.labels[i] = b.ids[row];
            } else {
                b.labels[i] = -1;
                b.weights[i] = 0.0;
            }
            weight_sum += f64::from(b.weights[i]);
        }
    }
    b.weight_sum = weight_sum;
}

/// The drafter ranks, every one from the same weights (the same seed). A rank on the target's
/// device shares the target's embedding and lm_head (no copy); a rank on another device gets
/// copies of its own.
pub fn drafter_sides<B: Backend>(
    bes: &[B],
    topo: &Topology,
    target: &Target<B>,
    dshape: &DrafterShape,
    seed: u64,
) -> Result<Vec<DrafterSide<B>>> {
    let bt = &bes[topo.targets[0]];
    let elsewhere = topo.drafters.iter().any(|&i| i != topo.targets[0]);
    let copies = if elsewhere { Some(Drafter::frozen_copies(bt, &bt.compute_stream(), target)?) } else { None };
    let mut sides = Vec::with_capacity(topo.drafters.len());
    for &i in &topo.drafters {
        let (be, st) = (&bes[i], bes[i].compute_stream());
        let (e, l) = match &copies {
            Some([embed, head]) if i != topo.targets[0] => {
                let [e, l] = crate::backend::copy_bufs(bt, be, &st, [embed, head])?;
                (Frozen::owned(e), Frozen::owned(l))
            }
            _ => Drafter::frozen_from_target(target),
        };
        let (drafter, fc) = Drafter::new(be, &st, dshape.clone(), e, l, seed)?;
        sides.push(DrafterSide::new(be, &st, drafter, Some(fc))?);
    }
    Ok(sides)
}

/// Continues from the latest checkpoint in `--out` when `--resume` says so: the fingerprint
/// must match (each differing flag is named), then every rank gets the saved state. Returns
/// the first step to run.
pub fn resume<B: Backend>(
    bes: &[B],
    topo: &Topology,
    o: &RunOptions,
    sides: &mut [DrafterSide<B>],
    fingerprint: &super::options::Fingerprint,
    say: &dyn Fn(String),
) -> Result<u32> {
    if !o.output.resume {
        return Ok(0);
    }
    let Some(ck) = checkpoint::load_latest(&o.output.out)? else {
        say(format!("resume    no checkpoint in {}: starting from step 0", o.output.out.display()));
        return Ok(0);
    };
    same_settings(&ck.dir, &ck.state, fingerprint)?;
    for (side, &i) in sides.iter_mut().zip(&topo.drafters) {
        checkpoint::restore(&bes[i], &bes[i].compute_stream(), side, &ck.tensors)
            .map_err(|e| anyhow::anyhow!("--resume from {}: {e}", ck.dir.display()))?;
    }
    say(format!("resume    from {} (step {})", ck.dir.display(), ck.state.step));
    Ok(ck.state.step)
}

/// What `--resume` and `--init-from` can check without tensors, before the target loads
/// (minutes for a large one): the latest checkpoint's settings against this run's and a step
/// left to train; else the warm start's folder and its config against the run's drafter.
pub fn check_before_load(
    o: &RunOptions,
    dcfg: &DrafterConfig,
    fingerprint: &super::options::Fingerprint,
) -> Result<()> {
    let latest = if o.output.resume { checkpoint::latest_state(&o.output.out)? } else { None };
    match (latest, &o.model.init_from) {
        (Some((dir, state)), _) => {
            same_settings(&dir, &state, fingerprint)?;
            if state.step >= o.train.steps {
                bail!(
                    "--resume: the run in {} is complete (its checkpoint {} is at step {} of --steps {}): nothing to \
                     train; to train further, start a new run from its weights: --init-from {} and another --out",
                    o.output.out.display(),
                    dir.display(),
                    state.step,
                    o.train.steps,
                    o.output.out.display()
                );
            }
        }
        (None, Some(init)) => {
            checkpoint::check_init(init, dcfg)?;
        }
        (None, None) => {}
    }
    Ok(())
}

/// The checkpoint in `dir` (its trainer state `state`) was written with this run's settings.
fn same_settings(
    dir: &Path,
    state: &checkpoint::TrainerState,
    fingerprint: &super::options::Fingerprint,
) -> Result<()> {
    let Some(theirs) = super::options::Fingerprint::from_json(&state.run_fingerprint) else {
        bail!(
            "--resume: the checkpoint in {} was written by an older engine whose settings cannot be compared: start a new run with another --out",
            dir.display()
        );
    };
    let diff = theirs.differences(fingerprint);
    if !diff.is_empty() {
        bail!(
            "--resume: the checkpoint in {} was written with other settings:\n  {}\nUse the same settings, or another --out.",
            dir.display(),
            diff.join("\n  ")
        );
    }
    Ok(())
}

/// `--init-from`: every drafter rank starts from the checkpoint's weights (its config checked
/// against the run's drafter first), with fresh optimizer state.
pub fn warm_start<B: Backend>(
    bes: &[B],
    topo: &Topology,
    o: &RunOptions,
    dcfg: &DrafterConfig,
    sides: &mut [DrafterSide<B>],
    say: &dyn Fn(String),
) -> Result<()> {
    let Some(dir) = &o.model.init_from else {
        return Ok(());
    };
    let init = checkpoint::load_init(dir, dcfg)?;
    for (side, &i) in sides.iter_mut().zip(&topo.drafters) {
        checkpoint::apply_init(&bes[i], &bes[i].compute_stream(), side, &init)?;
    }
    say(format!(
        "init      drafter weights from {} ({}; optimizer fresh)",
        init.dir.display(),
        if init.from_masters { "f32 masters" } else { "bf16 model" }
    ));
    Ok(())
}

/// The target sides: the first target takes the fc group under split-FC (the other ranks'
/// copies are dropped); further targets only run forward.
pub fn target_sides<B: Backend>(
    bes: &[B],
    topo: &Topology,
    split_fc: bool,
    target: Target<B>,
    more: Vec<Target<B>>,
    sides: &mut [DrafterSide<B>],
) -> Result<Vec<TargetSide<B>>> {
    let (bt, bd) = (&bes[topo.targets[0]], &bes[topo.drafters[0]]);
    let fc = if split_fc {
        for side in &mut sides[1..] {
            side.fc = None;
        }
        match sides[0].fc.take() {
            Some(fc) => Some(Mutex::new(fc.move_to(bd, bt, &bt.compute_stream())?)),
            None => None,
        }
    } else {
        None
    };
    let mut out = vec![TargetSide { target, fc }];
    out.extend(more.into_iter().map(|target| TargetSide { target, fc: None }));
    Ok(out)
}

/// `--offload-optimizer`: every drafter rank's AdamW moments (its body's and, where it holds it,
/// its fc group's) move to pinned host memory, once the groups are placed (`target_sides`) and
/// their state set (`resume`, `warm_start`). Returns the bytes pinned over all ranks.
pub fn offload_moments<B: Backend>(bes: &[B], topo: &Topology, sides: &mut [DrafterSide<B>]) -> Result<usize> {
    let mut pinned = 0;
    for (side, &i) in sides.iter_mut().zip(&topo.drafters) {
        let (be, s) = (&bes[i], bes[i].compute_stream());
        for g in side.fc.iter_mut().chain(std::iter::once(&mut side.drafter.body)) {
            pinned += g.offload_moments(be, &s, crate::model::moments::CHUNK)?;
        }
    }
    Ok(pinned)
}

/// Loads a copy of the target on every target device (only the tapped layers, except the
/// first copy when the data is generated: the generator needs every layer) and waits for the
/// uploads, so the time printed is the load's.
pub fn load_targets<B: Backend>(
    bes: &[B],
    topo: &Topology,
    src: &TargetSource,
    dcfg: &DrafterConfig,
    all_layers: bool,
) -> Result<(Vec<Target<B>>, f64)> {
    let t0 = Instant::now();
    let mut targets = Vec::with_capacity(topo.targets.len());
    for (k, &i) in topo.targets.iter().enumerate() {
        targets.push(src.load(&bes[i], dcfg.target_layer_ids.clone(), all_layers && k == 0)?);
    }
    for &i in &topo.targets {
        bes[i].synchronize(&bes[i].compute_stream())?;
    }
    Ok((targets, t0.elapsed().as_secs_f64()))
}
