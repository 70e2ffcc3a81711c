//! `dflash-engine eval`: real speculative decoding with the target and a drafter checkpoint, to
//! prove (or disprove) that the drafter speeds decoding up. Training reports a *simulated*
//! acceptance length; this measures the real one, tokens per verification round, together with
//! tokens/s with speculation and with the target alone on the same engine, and checks that the
//! speculative output is the target's own greedy output (lossless).
//!
//! `decode` holds the two decoding loops; this file is the command: what to load (the target,
//! the drafter, the prompts), the per-prompt loop, the report and where it is written.

pub mod decode;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use serde::Serialize;

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::config::{DrafterConfig, TargetConfig};
use crate::data::Dataset;
use crate::model::drafter::{Drafter, DrafterShape, ParamGroup};
use crate::model::drafting::InferenceDrafter;
use crate::model::target::Target;
use crate::session::setup::TargetSource;
use crate::session::{log, Device, TINY_INIT_STD};
use crate::train::checkpoint;
use decode::{decode_speculative, decode_target_alone, simulated_accept, DecodeLimits, Decoded, Proposer};

/// Generated evaluation prompts are the generator's samples from this index on: a run generates
/// samples `0..--gen-samples`, so these are held out (same generator, never trained on).
pub const HELD_OUT_FIRST_SAMPLE: u32 = 1 << 24;

/// What `eval` is asked to do (the CLI fills it; see `main.rs` for each flag's help).
#[derive(Clone, Debug)]
pub struct EvalOptions {
    /// A preset or a checkpoint folder; None: the drafter's run's target (else `tiny`).
    pub target: Option<String>,
    pub target_seed: Option<u64>,
    pub init_std: Option<f32>,
    /// A run folder, a checkpoint folder (`config.json` + `model.safetensors`), or `random`.
    pub drafter: String,
    /// A `random` drafter's depth, block size and init seed.
    pub drafter_layers: usize,
    pub block_size: usize,
    pub seed: u64,
    /// A JSON Lines file, or `generated`.
    pub prompts: String,
    pub num_prompts: Option<usize>,
    pub max_new_tokens: Option<usize>,
    pub device: Device,
    pub json: bool,
    pub out: Option<PathBuf>,
    pub quiet: bool,
}

impl EvalOptions {
    /// `eval` with only a drafter given.
    pub fn new(drafter: impl Into<String>) -> Self {
        EvalOptions {
            target: None,
            target_seed: None,
            init_std: None,
            drafter: drafter.into(),
            drafter_layers: 2,
            block_size: 16,
            seed: 0,
            prompts: "generated".into(),
            num_prompts: None,
            max_new_tokens: None,
            device: Device::Auto,
            json: false,
            out: None,
            quiet: false,
        }
    }
}

/// One prompt's result.
#[derive(Clone, Debug, Serialize)]
pub struct PromptReport {
    pub index: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub rounds: usize,
    /// Tokens per verification round (accepted drafts + the target's own token), as verified:
    /// a prompt's last round may verify more than `--max-new-tokens` or an end-of-sequence id
    /// lets out (those are `cut_tokens`).
    pub accept_len: f64,
    /// Verified tokens that the output limit or an end-of-sequence id left out.
    pub cut_tokens: usize,
    /// Training's simulated acceptance length on this output (every position an anchor, the
    /// context from one packed target forward): the number to compare with the run's.
    pub simulated_accept_len: f64,
    /// `accept_hist[n - 1]`: rounds that verified `n` tokens, `n` in `1..=block_size`.
    pub accept_hist: Vec<u64>,
    pub spec_tokens_per_s: f64,
    pub target_tokens_per_s: f64,
    pub speedup: f64,
    pub draft_ms_per_round: f64,
    pub verify_ms_per_round: f64,
    pub target_ms_per_token: f64,
    /// The speculative output equals the target-alone greedy output token for token.
    pub lossless: bool,
    /// The first output index where they differ (None when equal).
    pub first_divergence: Option<usize>,
}

/// The report's file name: in a run folder (its latest checkpoint's), or in one of its `step-*`
/// checkpoint folders (that checkpoint's); `plot` reads both.
pub const EVAL_FILE: &str = "eval.json";

/// The whole evaluation (written as `eval.json`).
#[derive(Clone, Debug, Serialize)]
pub struct EvalReport {
    pub backend: String,
    pub target: String,
    pub drafter: String,
    pub prompts: String,
    pub block_size: usize,
    pub max_new_tokens: usize,
    /// The training run's last simulated acceptance length, per position (DFLASH.md section 4),
    /// the mean over its last logged steps up to the checkpoint (None: not a trained run's
    /// drafter).
    pub train_accept_len: Option<f64>,
    /// The same steps' prediction of real decoding's tokens per round
    /// (`MetricSums::round_accept_len`): the number `accept_len` of `overall` should be near.
    pub train_round_accept_len: Option<f64>,
    /// How many steps the two means cover (1: only the checkpoint's own step was known).
    pub train_steps_averaged: Option<usize>,
    pub train_step: Option<u32>,
    pub per_prompt: Vec<PromptReport>,
    pub overall: PromptReport,
    /// Prompts whose speculative output equals the target-alone output.
    pub lossless_prompts: usize,
    /// CUDA only: the weights-read-once bound of batch-1 decoding.
    pub bound: Option<DecodeBound>,
}

/// Batch-1 target-alone decoding against reading the weights once at the measured copy rate.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeBound {
    /// Bytes one decoding step reads: every layer and the lm_head (the embedding: one row).
    pub weight_bytes: u64,
    /// Device-to-device copy rate, (read + write) bytes per second, median of several copies.
    pub copy_bytes_per_s: f64,
    pub read_once_ms: f64,
    pub target_ms_per_token: f64,
    pub ratio: f64,
}

/// Runs `eval` as `o` says, prints the report, writes `eval.json`.
pub fn eval(o: &EvalOptions) -> Result<EvalReport> {
    use crate::backend::cuda::{alloc::Mode, CudaBackend};
    if o.num_prompts == Some(0) {
        bail!("--num-prompts 0: give at least 1");
    }
    if let Some(v) = o.init_std {
        crate::session::options::positive_f32("--init-std", v)?;
    }
    // Where the report goes must be writable before minutes of decoding, not after.
    if let Some(out) = &o.out {
        crate::session::setup::check_file_writable("--out", out)?;
    }
    match o.device {
        Device::Cpu => eval_on(&CpuBackend::new(), o),
        Device::Cuda => {
            eval_on(&CudaBackend::new(0, Mode::Normal).map_err(|why| anyhow::anyhow!("--device cuda: {why}"))?, o)
        }
        Device::Auto => match CudaBackend::new(0, Mode::Normal) {
            Ok(be) => eval_on(&be, o),
            Err(why) => {
                eprintln!("note      no usable GPU ({why}); running on the CPU backend");
                eval_on(&CpuBackend::new(), o)
            }
        },
    }
}

/// Where the drafter comes from.
enum DrafterSource {
    Random,
    /// A checkpoint folder and the training run holding it, if any (its metrics give training's
    /// acceptance).
    Checkpoint {
        dir: PathBuf,
        run_dir: Option<PathBuf>,
        /// Where the report goes without `--out`: the run's `eval.json` for a run folder (its
        /// latest checkpoint); the checkpoint folder's own for one of a run's `step-*` folders,
        /// so that evaluating an earlier checkpoint leaves the latest's report as it is; none
        /// for a checkpoint outside a run.
        report: Option<PathBuf>,
    },
}

impl DrafterSource {
    fn resolve(spec: &str) -> Result<Self> {
        if spec == "random" && !Path::new(spec).exists() {
            return Ok(DrafterSource::Random);
        }
        let path = PathBuf::from(spec);
        if !path.is_dir() {
            bail!(
                "--drafter {spec}: not a folder; give a run's --out folder, a checkpoint folder (config.json + model.safetensors), or `random`"
            );
        }
        if let Some(name) = checkpoint::latest_name(&path)? {
            let report = Some(path.join(EVAL_FILE));
            return Ok(DrafterSource::Checkpoint { dir: path.join(name), run_dir: Some(path), report });
        }
        if !path.join(checkpoint::CONFIG_FILE).is_file() || !path.join(checkpoint::MODEL_FILE).is_file() {
            bail!(
                "--drafter {spec}: holds neither checkpoints of a run nor {} + {}",
                checkpoint::CONFIG_FILE,
                checkpoint::MODEL_FILE
            );
        }
        let run_dir =
            path.parent().filter(|p| checkpoint::latest_name(p).ok().flatten().is_some()).map(Path::to_path_buf);
        let report = run_dir.as_ref().map(|_| path.join(EVAL_FILE));
        Ok(DrafterSource::Checkpoint { dir: path, run_dir, report })
    }

    /// The training run's state saved with the checkpoint (None: not ours, or random).
    fn trainer_state(&self) -> Option<checkpoint::TrainerState> {
        let DrafterSource::Checkpoint { dir, .. } = self else { return None };
        let text = std::fs::read_to_string(dir.join(checkpoint::STATE_FILE)).ok()?;
        serde_json::from_str(&text).ok()
    }
}

/// A value of the run's fingerprint (its flags by name).
fn fp<'a>(state: &'a Option<checkpoint::TrainerState>, key: &str) -> Option<&'a serde_json::Value> {
    state.as_ref()?.run_fingerprint.get(key)
}

/// The prompts to decode, and the default number of new tokens for them.
fn load_prompts(
    o: &EvalOptions,
    tcfg: &TargetConfig,
    dcfg: &DrafterConfig,
    state: &Option<checkpoint::TrainerState>,
) -> Result<(Vec<Vec<u32>>, usize, String)> {
    let num = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_u64);
    if o.prompts == "generated" && !Path::new("generated").exists() {
        let seed = num(fp(state, "seed")).unwrap_or(0);
        let prompt_len = num(fp(state, "gen-prompt-len")).unwrap_or(8) as usize;
        let seq_len = num(fp(state, "seq-len")).unwrap_or(96) as usize;
        let ordinary = tcfg.bos_token_id.unwrap_or(dcfg.mask_token_id).min(dcfg.mask_token_id);
        let n = o.num_prompts.unwrap_or(16);
        let prompts = (0..n)
            .map(|i| crate::train::generate::prompt(seed, HELD_OUT_FIRST_SAMPLE + i as u32, prompt_len, ordinary))
            .collect();
        let what = format!(
            "generated, held out ({n} prompts of {prompt_len} tokens, seed {seed}, samples {HELD_OUT_FIRST_SAMPLE}..)"
        );
        return Ok((prompts, seq_len.saturating_sub(prompt_len).max(1), what));
    }
    let path = Path::new(&o.prompts);
    let data = Dataset::from_jsonl(path, tcfg.vocab_size, u32::MAX as usize)
        .with_context(|| format!("--prompts {}", path.display()))?;
    let mut prompts = Vec::new();
    let mut no_prompt = 0;
    for smp in data.samples() {
        let first_supervised = smp.loss_mask.iter().position(|&m| m != 0).unwrap_or(smp.input_ids.len());
        if first_supervised == 0 {
            no_prompt += 1;
            continue;
        }
        prompts.push(smp.input_ids[..first_supervised].to_vec());
        if o.num_prompts.is_some_and(|n| prompts.len() >= n) {
            break;
        }
    }
    if prompts.is_empty() {
        bail!(
            "--prompts {}: no sample has a prompt (tokens before the first supervised one, loss_mask 0)",
            path.display()
        );
    }
    if no_prompt > 0 {
        eprintln!("note      {no_prompt} samples start supervised (no prompt): skipped");
    }
    let what = format!("{} ({} prompts)", path.display(), prompts.len());
    Ok((prompts, 256, what))
}

fn eval_on<B: Backend>(be: &B, o: &EvalOptions) -> Result<EvalReport> {
    let s = be.compute_stream();
    let say = |m: String| eprintln!("{m}");
    let src = DrafterSource::resolve(&o.drafter)?;
    if let (None, DrafterSource::Checkpoint { report: Some(path), .. }) = (&o.out, &src) {
        // The report goes into the run: found unwritable before the decoding, not after.
        crate::session::setup::check_file_writable("the report (choose another place with --out):", path)?;
    }
    let state = src.trainer_state();

    // The target: as given, else the drafter's run's (a preset with its seed and std).
    let run_target = fp(&state, "target");
    let preset_of_run = run_target.and_then(|t| t.get("preset")).and_then(|v| v.as_str()).map(str::to_string);
    let target_spec = match (&o.target, &preset_of_run) {
        (Some(t), _) => t.clone(),
        (None, Some(p)) => p.clone(),
        (None, None) if run_target.is_some() => {
            bail!("--target: the drafter's run trained against a checkpoint folder; give that folder with --target")
        }
        (None, None) => "tiny".into(),
    };
    crate::session::setup::refuse_preset_flags(
        &target_spec,
        &[("--target-seed", o.target_seed.is_some()), ("--init-std", o.init_std.is_some())],
    )?;
    let run_num = |k: &str| run_target.and_then(|t| t.get(k)).and_then(serde_json::Value::as_f64);
    let target_seed = o.target_seed.or(run_num("seed").map(|x| x as u64)).unwrap_or(0);
    let init_std = o.init_std.or(run_num("std").map(|x| x as f32)).unwrap_or(TINY_INIT_STD);
    let mut notes = Vec::new();
    let tsrc = TargetSource::resolve(&target_spec, target_seed, init_std, &mut notes)?;
    if let (Some(p), Some(t)) = (&preset_of_run, &o.target) {
        if p != t {
            notes.push(format!("--target {t}: the drafter was trained against {p}"));
        }
    }
    let tcfg = tsrc.config().clone();

    // The drafter's config.
    let dcfg = match &src {
        DrafterSource::Random => DrafterConfig::for_target(&tcfg, o.drafter_layers, o.block_size, None)?,
        DrafterSource::Checkpoint { dir, .. } => DrafterConfig::from_file(dir.join(checkpoint::CONFIG_FILE))?,
    };
    dcfg.check_against_target(&tcfg).context("--drafter does not fit --target")?;
    crate::session::setup::check_block_size(std::slice::from_ref(be), dcfg.block_size)?;
    let (prompts, default_new, prompts_what) = load_prompts(o, &tcfg, &dcfg, &state)?;
    let max_new = o.max_new_tokens.unwrap_or(default_new);
    if max_new == 0 {
        bail!("--max-new-tokens 0: give at least 1");
    }
    let backend = be.name();
    say(format!("backend   {backend}"));
    say(format!("target    {}", tsrc.describe()));
    notes.into_iter().for_each(|n| say(format!("note      {n}")));
    let drafter_what = match &src {
        DrafterSource::Random => format!("random init (seed {})", o.seed),
        DrafterSource::Checkpoint { dir, .. } => dir.display().to_string(),
    };
    say(format!(
        "drafter   {drafter_what}: {} layers, block {}, taps {:?}, mask token {}",
        dcfg.num_layers, dcfg.block_size, dcfg.target_layer_ids, dcfg.mask_token_id
    ));
    say(format!("prompts   {prompts_what}, up to {max_new} new tokens each"));

    // Load both models.
    let t0 = Instant::now();
    let target = tsrc.load(be, dcfg.target_layer_ids.clone(), true)?;
    let (embed, lm_head) = Drafter::frozen_from_target(&target);
    let dshape = DrafterShape::from_config(&dcfg, 2048);
    let drafter = match &src {
        DrafterSource::Random => {
            let (fc, body) = (dshape.fc_table(), dshape.body_table());
            let (fc_host, body_host) =
                (ParamGroup::<B>::init_host(&fc, o.seed, 0), ParamGroup::<B>::init_host(&body, o.seed, 1));
            InferenceDrafter::load(be, &s, dshape, embed, lm_head, |name, _| -> Result<Vec<f32>> {
                let (table, host) = if name == "fc.weight" { (&fc, &fc_host) } else { (&body, &body_host) };
                let e = table.get(name).context("a drafter tensor")?;
                Ok(host[e.offset..e.offset + e.numel].to_vec())
            })?
        }
        DrafterSource::Checkpoint { dir, .. } => {
            let store = crate::weights::TensorStore::open_dir(dir)?;
            InferenceDrafter::load(be, &s, dshape, embed, lm_head, |name, shape| -> Result<Vec<f32>> {
                Ok(store.tensor_f32(name, shape)?)
            })?
        }
    };
    be.synchronize(&s)?;
    say(format!("loaded    target and drafter in {:.1} s", t0.elapsed().as_secs_f64()));

    let lim = DecodeLimits { max_new_tokens: max_new, eos: tcfg.eos_token_id.clone() };
    let dw = drafter.weights();
    // One short untimed pass of each path first: one-time costs (kernel selection, first
    // allocations) would otherwise land on the first prompt.
    let warm = DecodeLimits { max_new_tokens: max_new.min(2 * dcfg.block_size), eos: Vec::new() };
    decode_speculative(be, &s, &target, Proposer::Drafter(&dw), &prompts[0], &warm)?;
    decode_target_alone(be, &s, &target, &prompts[0], &warm)?;

    let pb = log::bar(o.quiet, prompts.len() as u64, "eval");
    let mut per_prompt = Vec::with_capacity(prompts.len());
    let mut all_spec = Vec::new();
    let mut all_alone = Vec::new();
    let mut all_sim: Vec<Vec<usize>> = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let spec = decode_speculative(be, &s, &target, Proposer::Drafter(&dw), prompt, &lim)?;
        let alone = decode_target_alone(be, &s, &target, prompt, &lim)?;
        let seq: Vec<u32> = prompt.iter().chain(&spec.tokens).copied().collect();
        let sim = simulated_accept(be, &s, &target, &dw, &seq, prompt.len())?;
        let r = prompt_report(i, prompt.len(), dcfg.block_size, &[&spec], &[&alone], &[&sim]);
        if !o.quiet {
            pb.suspend(|| eprintln!("{}", prompt_line(&r)));
        }
        per_prompt.push(r);
        all_spec.push(spec);
        all_alone.push(alone);
        all_sim.push(sim);
        pb.inc(1);
    }
    pb.finish_and_clear();
    let spec_refs: Vec<&Decoded> = all_spec.iter().collect();
    let alone_refs: Vec<&Decoded> = all_alone.iter().collect();
    let sim_refs: Vec<&Vec<usize>> = all_sim.iter().collect();
    let mut overall =
        prompt_report(0, prompts.iter().map(Vec::len).sum(), dcfg.block_size, &spec_refs, &alone_refs, &sim_refs);
    overall.lossless = per_prompt.iter().all(|r| r.lossless);
    overall.first_divergence = None;
    let lossless_prompts = per_prompt.iter().filter(|r| r.lossless).count();
    let bound = decode_bound(be, &target, overall.target_ms_per_token)?;
    let run_dir = match &src {
        DrafterSource::Checkpoint { run_dir, .. } => run_dir.as_deref(),
        DrafterSource::Random => None,
    };
    let train = training_acceptance(run_dir, &state);
    let report = EvalReport {
        backend,
        target: tsrc.describe(),
        drafter: drafter_what,
        prompts: prompts_what,
        block_size: dcfg.block_size,
        max_new_tokens: max_new,
        train_accept_len: train.map(|t| t.accept_len),
        train_round_accept_len: train.and_then(|t| t.round_accept_len),
        train_steps_averaged: train.map(|t| t.steps),
        train_step: state.as_ref().map(|st| st.step),
        per_prompt,
        overall,
        lossless_prompts,
        bound,
    };
    print_summary(&report);
    let dest = o.out.clone().or_else(|| match &src {
        DrafterSource::Checkpoint { report, .. } => report.clone(),
        DrafterSource::Random => None,
    });
    let text = serde_json::to_string_pretty(&report)?;
    if let Some(path) = dest {
        crate::weights::write_file_atomic(&path, text.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        say(format!("wrote     {}", path.display()));
    }
    if o.json {
        println!("{text}");
    }
    Ok(report)
}

/// Steps of a run averaged for its acceptance: one step's blocks are few (a batch of sequences
/// whose acceptance differs a lot from one to the next), so a single step's value is noise.
pub const TRAIN_STEPS_AVERAGED: usize = 20;

/// A run's simulated acceptance at a checkpoint.
#[derive(Clone, Copy, Debug)]
struct TrainAcceptance {
    accept_len: f64,
    round_accept_len: Option<f64>,
    steps: usize,
}

/// The means over the last [`TRAIN_STEPS_AVERAGED`] steps up to the checkpoint, read from the
/// run's `metrics.jsonl`; without it, the checkpoint's own step (saved with it).
fn training_acceptance(run_dir: Option<&Path>, state: &Option<checkpoint::TrainerState>) -> Option<TrainAcceptance> {
    let st = state.as_ref()?;
    let logged = run_dir
        .map(|d| d.join(crate::train::metrics::METRICS_FILE))
        .filter(|p| p.is_file())
        .and_then(|p| crate::train::metrics::read_records(&p).ok())
        .map(|recs| recs.into_iter().filter(|r| r.step <= st.step && !r.skipped).collect::<Vec<_>>())
        .filter(|recs| recs.last().is_some_and(|r| r.step == st.step));
    if let Some(recs) = logged {
        let tail = &recs[recs.len().saturating_sub(TRAIN_STEPS_AVERAGED)..];
        let mean = |f: &dyn Fn(&crate::train::metrics::MetricsRecord) -> f64| {
            tail.iter().map(f).sum::<f64>() / tail.len() as f64
        };
        let rounds = tail.iter().all(|r| r.round_accept_len > 0.0);
        return Some(TrainAcceptance {
            accept_len: mean(&|r| r.accept_len),
            round_accept_len: rounds.then(|| mean(&|r| r.round_accept_len)),
            steps: tail.len(),
        });
    }
    let num = |k: &str| st.extra.get(k).and_then(serde_json::Value::as_f64);
    Some(TrainAcceptance { accept_len: num("accept_len")?, round_accept_len: num("round_accept_len"), steps: 1 })
}

/// The report of one prompt (or, given several, of all of them together).
fn prompt_report(
    index: usize,
    prompt_tokens: usize,
    bs: usize,
    spec: &[&Decoded],
    alone: &[&Decoded],
    sim: &[&Vec<usize>],
) -> PromptReport {
    let sims: Vec<usize> = sim.iter().flat_map(|v| v.iter().copied()).collect();
    let sum = |f: &dyn Fn(&Decoded) -> f64, v: &[&Decoded]| v.iter().map(|d| f(d)).sum::<f64>();
    let new_tokens: usize = spec.iter().map(|d| d.tokens.len()).sum();
    let alone_tokens: usize = alone.iter().map(|d| d.tokens.len()).sum();
    let lens: Vec<usize> = spec.iter().flat_map(|d| d.accept_lens.iter().copied()).collect();
    let rounds = lens.len();
    // Each output's first token comes from the prefill; the rest from its rounds.
    let cut_tokens =
        spec.iter().map(|d| d.accept_lens.iter().sum::<usize>().saturating_sub(d.tokens.len().saturating_sub(1))).sum();
    let mut hist = vec![0u64; bs];
    for &n in &lens {
        hist[n.clamp(1, bs) - 1] += 1;
    }
    let spec_secs = sum(&|d| d.decode_secs, spec);
    let alone_secs = sum(&|d| d.decode_secs, alone);
    let per_s = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    let (spec_tps, alone_tps) = (per_s(new_tokens, spec_secs), per_s(alone_tokens, alone_secs));
    let first_divergence = if spec.len() == 1 {
        let (a, b) = (&spec[0].tokens, &alone[0].tokens);
        a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then(|| a.len().min(b.len())))
    } else {
        None
    };
    let per_round = |secs: f64| if rounds > 0 { 1e3 * secs / rounds as f64 } else { 0.0 };
    PromptReport {
        index,
        prompt_tokens,
        new_tokens,
        rounds,
        accept_len: if rounds > 0 { lens.iter().sum::<usize>() as f64 / rounds as f64 } else { 0.0 },
        cut_tokens,
        simulated_accept_len: if sims.is_empty() { 0.0 } else { sims.iter().sum::<usize>() as f64 / sims.len() as f64 },
        accept_hist: hist,
        spec_tokens_per_s: spec_tps,
        target_tokens_per_s: alone_tps,
        speedup: if alone_tps > 0.0 { spec_tps / alone_tps } else { 0.0 },
        draft_ms_per_round: per_round(sum(&|d| d.draft_secs, spec)),
        verify_ms_per_round: per_round(sum(&|d| d.verify_secs, spec)),
        target_ms_per_token: if alone_tokens > 0 { 1e3 * alone_secs / alone_tokens as f64 } else { 0.0 },
        lossless: first_divergence.is_none(),
        first_divergence,
    }
}

fn prompt_line(r: &PromptReport) -> String {
    format!(
        "prompt {:>4} | {:>4} tokens | {:>4} rounds | accept {:>5.2} (simulated {:>5.2}) | spec {:>9.1} tok/s | target {:>9.1} tok/s | x{:.2} | {}",
        r.index,
        r.new_tokens,
        r.rounds,
        r.accept_len,
        r.simulated_accept_len,
        r.spec_tokens_per_s,
        r.target_tokens_per_s,
        r.speedup,
        match r.first_divergence {
            None => "lossless".to_string(),
            Some(i) => format!("DIFFERS from target-alone at token {i}"),
        }
    )
}

/// Batch-1 decoding's floor: reading the weights once at the device's measured copy rate (CUDA
/// only: the CPU backend has no device clock).
fn decode_bound<B: Backend>(be: &B, target: &Target<B>, target_ms_per_token: f64) -> Result<Option<DecodeBound>> {
    let s = be.compute_stream();
    // 512 MiB each way: far past any L2.
    let n = 256 << 20;
    if be.record_timed(&s)?.is_none() {
        return Ok(None);
    }
    let src = be.alloc(&s, crate::tensor::DType::BF16, n)?;
    let mut dst = be.alloc(&s, crate::tensor::DType::BF16, n)?;
    be.copy(&s, &src, 0, &mut dst, 0, n)?; // warm-up
    let mut rates = Vec::new();
    for _ in 0..7 {
        let start = be.record_timed(&s)?;
        be.copy(&s, &src, 0, &mut dst, 0, n)?;
        let end = be.record_timed(&s)?;
        let secs = match (start, end) {
            (Some(a), Some(b)) => be.elapsed_secs(&a, &b),
            _ => None,
        };
        let Some(secs) = secs else { return Ok(None) };
        // Read + write, bf16.
        rates.push((2 * 2 * n) as f64 / secs);
    }
    rates.sort_by(f64::total_cmp);
    let rate = rates[rates.len() / 2];
    let sh = &target.shape;
    // The embedding table is read one row per token; everything else once per step.
    let weight_bytes = 2 * (target.table.numel() - sh.vocab * sh.hidden) as u64;
    let read_once_ms = 1e3 * weight_bytes as f64 / rate;
    Ok(Some(DecodeBound {
        weight_bytes,
        copy_bytes_per_s: rate,
        read_once_ms,
        target_ms_per_token,
        ratio: target_ms_per_token / read_once_ms,
    }))
}

/// The summary, like `run`'s.
pub fn print_summary(r: &EvalReport) {
    let o = &r.overall;
    eprintln!("---- eval summary ----");
    eprintln!("backend           {}", r.backend);
    eprintln!("prompts           {}", r.prompts);
    // Each prompt's first token comes from its prefill, the rest from the verification rounds.
    let from_rounds = o.new_tokens.saturating_sub(r.per_prompt.len());
    eprintln!(
        "new tokens        {} in {} rounds (block {}): {} from the prefills, {from_rounds} from the rounds",
        o.new_tokens,
        o.rounds,
        r.block_size,
        r.per_prompt.len()
    );
    let steps = |n: usize| if n == 1 { "step".to_string() } else { format!("last {n} steps") };
    let train = match (r.train_accept_len, r.train_step, r.train_steps_averaged) {
        (Some(a), Some(step), Some(n)) => format!(" (training's: {a:.2}, {} to step {step})", steps(n)),
        _ => String::new(),
    };
    let cut = if o.cut_tokens > 0 && o.rounds > 0 {
        format!(
            "; {:.2} let out: {} verified tokens fell past --max-new-tokens or an end-of-sequence id",
            from_rounds as f64 / o.rounds as f64,
            o.cut_tokens
        )
    } else {
        String::new()
    };
    eprintln!("accept length     {:.2} tokens per round (real decoding, as verified){cut}", o.accept_len);
    if let (Some(a), Some(step), Some(n)) = (r.train_round_accept_len, r.train_step, r.train_steps_averaged) {
        eprintln!(
            "predicted         {a:.2} tokens per round by training ({}, to step {step}): real x{:.2} of it",
            steps(n),
            o.accept_len / a
        );
    }
    eprintln!(
        "simulated         {:.2} per position on these outputs, as training measures it{train}",
        o.simulated_accept_len
    );
    let hist: Vec<String> =
        o.accept_hist.iter().enumerate().filter(|(_, &c)| c > 0).map(|(i, c)| format!("{}:{c}", i + 1)).collect();
    eprintln!("accept histogram  {}", hist.join(" "));
    eprintln!(
        "speculative       {:.1} tok/s (draft {:.3} ms + verify {:.3} ms per round)",
        o.spec_tokens_per_s, o.draft_ms_per_round, o.verify_ms_per_round
    );
    eprintln!("target alone      {:.1} tok/s ({:.3} ms per token)", o.target_tokens_per_s, o.target_ms_per_token);
    eprintln!("speedup           x{:.2}", o.speedup);
    eprintln!(
        "lossless          {}/{} prompts equal the target-alone greedy output",
        r.lossless_prompts,
        r.per_prompt.len()
    );
    if let Some(b) = &r.bound {
        eprintln!(
            "decode bound      target alone {:.3} ms/token vs reading {:.2} GB of weights once at {:.2} TB/s (measured copy rate): {:.3} ms, x{:.2}",
            b.target_ms_per_token,
            b.weight_bytes as f64 / 1e9,
            b.copy_bytes_per_s / 1e12,
            b.read_once_ms,
            b.ratio
        );
    }
}
