//! What a run is asked to do, as serialisable sub-configs: the models, the data, the training
//! hyper-parameters, how it executes, and what it writes. The CLI fills them; `validate` checks
//! every number up front with its flag's name; the resume fingerprint is derived from the
//! sub-configs that change results (`Fingerprint`), so a new flag there is checked on resume
//! without anyone remembering to add it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;

use crate::faults::FaultPlan;
use crate::pipeline::Transport;

/// Which backend runs the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    Cuda,
    Auto,
}

/// The target and the drafter's shape. Field names are the flags' (`--target-seed`, ...).
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ModelOptions {
    /// A preset name or a Hugging Face checkpoint folder.
    pub target: String,
    /// Seed and std of a preset target's random weights.
    pub target_seed: u64,
    pub init_std: f32,
    pub drafter_layers: usize,
    pub block_size: usize,
    /// Tapped target layers, 0-based (None: the DFlash rule).
    pub taps: Option<Vec<usize>>,
    /// A built-in recipe name or a drafter config.json (None: derived from the target with the
    /// three flags above). Its resolved content, not this spelling, enters the fingerprint.
    #[serde(skip)]
    pub drafter_config: Option<String>,
    /// Warm start: the drafter's weights from this checkpoint folder (optimizer fresh). Not in
    /// the fingerprint: a resumed run takes every weight from its own checkpoint instead.
    #[serde(skip)]
    pub init_from: Option<PathBuf>,
}

/// The samples and how each step is cut from them.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct DataOptions {
    /// Pre-tokenized JSON Lines (None: the target generates its own data).
    #[serde(rename = "data")]
    pub path: Option<PathBuf>,
    pub gen_samples: usize,
    pub gen_prompt_len: usize,
    pub gen_temperature: f32,
    pub seq_len: usize,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub anchors: usize,
    pub noise_std: f32,
    pub pad_to_tokens: Option<usize>,
}

/// The optimizer, its schedule and the run's seed.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct TrainOptions {
    pub steps: u32,
    pub lr: f32,
    #[serde(rename = "warmup")]
    pub warmup_frac: f32,
    pub clip: f32,
    /// Seed of the drafter init, anchors, noise and data order.
    pub seed: u64,
    /// The loss weights' decay `exp(-(r-1)/gamma)` (None: the drafter config's, by default the
    /// block-size rule). Left out of the fingerprint when unset, so runs from before the flag
    /// still resume.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_gamma: Option<f32>,
}

/// How the run executes. None of these changes a result: the pipeline, every transport,
/// split-FC, several targets and data-parallel ranks are bit-identical to the synchronous run
/// (the NaN suite proves it), and the lm_head chunk only bounds memory (rows are independent).
/// So a run may resume on another topology; these are not part of the fingerprint.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ExecOptions {
    pub device: Device,
    #[serde(rename = "split-fc-layers")]
    pub split_fc: bool,
    pub max_inflight: usize,
    /// How batches cross from the target to the drafter (None: auto).
    pub transport: Option<Transport>,
    pub target_gpus: Vec<usize>,
    pub drafter_gpus: Vec<usize>,
    /// The synchronous reference (one device: no pipeline; several: lockstep).
    pub sync: bool,
    pub logits_chunk: usize,
    /// What the drafter's backward recomputes (bit-identical at every level).
    pub recompute: crate::model::drafter::Recompute,
    /// The first this many drafter layers' gate|up products wait in pinned host memory between
    /// the forward and the backward (`model::park`); 0 keeps them on the device.
    pub offload_activations: usize,
    /// The drafter's AdamW moments live in pinned host memory and pass through the device a chunk
    /// at a time for each update (`model::moments`); false keeps them on the device.
    pub offload_optimizer: bool,
    /// With `sync` on one device: each step's AdamW runs after the step on the compute stream,
    /// instead of on a stream of its own beside the next step's target forward (the same
    /// results; the baseline of that overlap).
    pub serial_update: bool,
    /// The CUDA allocator's mode (None: normal). Debug modes only; the binary reads
    /// `DFLASH_ALLOC_MODE`.
    #[serde(skip)]
    pub alloc_mode: Option<crate::backend::cuda::alloc::Mode>,
    /// Failure tests only.
    #[serde(skip)]
    pub faults: FaultPlan,
}

/// What the MFU column divides the model FLOPs by (`--mfu-peak`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MfuPeak {
    /// A short burst of bf16 GEMMs on the first device before the first step (about 20 ms, once
    /// per process and device): what the card sustains now, at its clocks.
    Measure,
    /// This many FLOP/s per device, e.g. a datasheet's dense bf16 figure, so that runs on
    /// different days or cards are set against one number.
    Given(f64),
    /// No MFU column (and no GEMM burst at the start).
    Off,
}

impl std::str::FromStr for MfuPeak {
    type Err = String;

    /// `measure`, `off`, or a peak in TFLOP/s per device (a positive number).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "measure" => Ok(MfuPeak::Measure),
            "off" => Ok(MfuPeak::Off),
            v => match v.parse::<f64>() {
                Ok(t) if t.is_finite() && t > 0.0 => Ok(MfuPeak::Given(t * 1e12)),
                _ => Err(format!(
                    "`{v}` is not `measure`, `off` or a device's bf16 peak in TFLOP/s (a positive number, e.g. 989)"
                )),
            },
        }
    }
}

/// `"measure"`, `"off"`, or the given peak in TFLOP/s (what the flag took).
impl Serialize for MfuPeak {
    fn serialize<S: serde::Serializer>(&self, se: S) -> Result<S::Ok, S::Error> {
        match self {
            MfuPeak::Measure => se.serialize_str("measure"),
            MfuPeak::Off => se.serialize_str("off"),
            MfuPeak::Given(p) => se.serialize_f64(p / 1e12),
        }
    }
}

/// Where the run writes and what it shows.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct OutputOptions {
    pub out: PathBuf,
    pub resume: bool,
    pub log_every: u32,
    pub save_every: u32,
    /// Write checkpoints at all (benchmarks turn this off: at the 8B recipe a checkpoint with
    /// masters and moments is ~14 GB).
    #[serde(rename = "checkpoint")]
    pub checkpoints: bool,
    pub keep_last: usize,
    pub quiet: bool,
    /// Stop (with a checkpoint) after this many completed steps, keeping the schedule of `steps`.
    pub stop_after: Option<u32>,
    /// A Chrome/Perfetto trace of the pipeline.
    pub trace: Option<PathBuf>,
    /// TensorBoard event files under `<out>/tb/` beside `<out>/metrics.jsonl`.
    pub tensorboard: bool,
    /// Time every kernel, GEMM and copy of the synchronous step by phase (device events) and
    /// print the phase table in the summary.
    pub profile: bool,
    /// The MFU column's peak.
    pub mfu_peak: MfuPeak,
}

/// Everything `run` needs; the CLI fills it (see `main.rs` for each flag's help).
#[derive(Clone, Debug, Serialize)]
pub struct RunOptions {
    pub model: ModelOptions,
    pub data: DataOptions,
    pub train: TrainOptions,
    pub exec: ExecOptions,
    pub output: OutputOptions,
}

/// The random-init scale of the embedded tiny target. With small weights the residual stream is
/// dominated by the current token's embedding, so greedy decoding falls into repeats and cycles
/// that a drafter can learn (copying from context, short-range patterns); at 0.25 the
/// continuations are chaotic, at 0.02 nearly constant. The hybrid presets draw their embedding
/// and lm_head larger for the same effect (`weights::HYBRID_EMBED_GAIN`).
pub const TINY_INIT_STD: f32 = 0.05;

/// The most micro-batches a target may run ahead: each holds a packed batch in flight (and a
/// pinned slot on the host transport); beyond this the queue only costs memory.
pub const MAX_INFLIGHT: usize = 64;

impl RunOptions {
    /// The defaults of `dflash-engine run` with no flags: the tiny preset and self-generated data,
    /// sized to train visibly on two CPU cores in a few minutes.
    pub fn tiny_default() -> Self {
        RunOptions {
            model: ModelOptions {
                target: "tiny".into(),
                target_seed: 0,
                init_std: TINY_INIT_STD,
                drafter_layers: 2,
                block_size: 16,
                taps: None,
                drafter_config: None,
                init_from: None,
            },
            data: DataOptions {
                path: None,
                gen_samples: 512,
                gen_prompt_len: 8,
                gen_temperature: 0.0,
                seq_len: 96,
                batch_size: 8,
                grad_accum: 1,
                anchors: 16,
                noise_std: 0.0,
                pad_to_tokens: None,
            },
            train: TrainOptions { steps: 300, lr: 3e-3, warmup_frac: 0.04, clip: 1.0, seed: 0, loss_gamma: None },
            exec: ExecOptions {
                device: Device::Auto,
                split_fc: false,
                max_inflight: 2,
                transport: None,
                target_gpus: vec![0],
                drafter_gpus: Vec::new(),
                sync: false,
                serial_update: false,
                logits_chunk: 2048,
                recompute: crate::model::drafter::Recompute::Norms,
                offload_activations: 2,
                offload_optimizer: false,
                alloc_mode: None,
                faults: FaultPlan::default(),
            },
            output: OutputOptions {
                out: PathBuf::from("runs/default"),
                resume: false,
                log_every: 10,
                save_every: 100,
                checkpoints: true,
                keep_last: 2,
                quiet: false,
                stop_after: None,
                trace: None,
                tensorboard: true,
                profile: false,
                mfu_peak: MfuPeak::Measure,
            },
        }
    }

    /// Checks every number before anything is loaded; each error names its flag and the range.
    pub fn validate(&self) -> Result<(), OptionsError> {
        let (m, d, t, e, o) = (&self.model, &self.data, &self.train, &self.exec, &self.output);
        positive_f32("--init-std", m.init_std)?;
        at_least("--drafter-layers", m.drafter_layers, 1)?;
        at_least("--block-size", m.block_size, 2)?;
        at_least("--seq-len", d.seq_len, 2)?;
        at_least("--batch-size", d.batch_size, 1)?;
        at_least("--grad-accum", d.grad_accum, 1)?;
        at_least("--anchors", d.anchors, 1)?;
        non_negative_f32("--noise-std", d.noise_std)?;
        if d.path.is_none() {
            at_least("--gen-samples", d.gen_samples, 1)?;
            at_least("--gen-prompt-len", d.gen_prompt_len, 1)?;
            non_negative_f32("--gen-temperature", d.gen_temperature)?;
            if d.seq_len < shortest_generated(d.gen_prompt_len) {
                return Err(OptionsError::Relation(format!(
                    "--seq-len {} must exceed --gen-prompt-len {} by at least 2 (a generated sample needs a continuation to supervise)",
                    d.seq_len, d.gen_prompt_len
                )));
            }
        }
        if let Some(pad) = d.pad_to_tokens {
            let need = d.batch_size.saturating_mul(d.seq_len);
            if pad < need {
                return Err(OptionsError::Relation(format!(
                    "--pad-to-tokens {pad} is smaller than a micro-batch can be (--batch-size {} x --seq-len {} = {need} tokens): use at least {need}",
                    d.batch_size, d.seq_len
                )));
            }
        }
        at_least("--steps", t.steps as usize, 1)?;
        positive_f32("--lr", t.lr)?;
        if t.lr > 1.0 {
            return Err(OptionsError::Range {
                flag: "--lr",
                value: t.lr.to_string(),
                want: "at most 1 (AdamW moves every weight by up to lr per step; the DFlash recipe uses 6e-4)",
            });
        }
        if !(t.warmup_frac.is_finite() && (0.0..=1.0).contains(&t.warmup_frac)) {
            return Err(OptionsError::Range {
                flag: "--warmup",
                value: t.warmup_frac.to_string(),
                want: "a fraction of the steps in [0, 1]",
            });
        }
        positive_f32("--clip", t.clip)?;
        if let Some(g) = t.loss_gamma {
            positive_f32("--loss-gamma", g)?;
        }
        at_least("--max-inflight", e.max_inflight, 1)?;
        let mut devices: Vec<usize> = e.target_gpus.iter().chain(&e.drafter_gpus).copied().collect();
        devices.sort_unstable();
        devices.dedup();
        if e.transport == Some(Transport::Same) && devices.len() > 1 {
            return Err(OptionsError::Relation(format!(
                "--transport same hands buffers over on one GPU, but this run uses {devices:?}: use --transport p2p or host, or put the target and the drafter on one GPU"
            )));
        }
        let sync_on_one_device =
            e.sync && e.target_gpus.len() <= 1 && (e.drafter_gpus.is_empty() || e.drafter_gpus == e.target_gpus);
        if o.profile && !sync_on_one_device {
            return Err(OptionsError::Relation(
                "--profile times the synchronous step on one device, where the phases follow one another on one stream: add --sync (target and drafter on one GPU)".into(),
            ));
        }
        if e.serial_update && !sync_on_one_device {
            return Err(OptionsError::Relation(
                "--serial-update moves the synchronous step's AdamW back after the step on one device; elsewhere it already runs there or on the drafter's own stream: add --sync (target and drafter on one GPU) or drop the flag".into(),
            ));
        }
        if e.max_inflight > MAX_INFLIGHT {
            return Err(OptionsError::Range {
                flag: "--max-inflight",
                value: e.max_inflight.to_string(),
                want: "at most 64 (each micro-batch in flight holds its packed taps; 2-4 keep the target busy)",
            });
        }
        at_least("--logits-chunk", e.logits_chunk, 1)?;
        at_least("--log-every", o.log_every as usize, 1)?;
        at_least("--save-every", o.save_every as usize, 1)?;
        at_least("--keep-last", o.keep_last, 1)?;
        if o.stop_after == Some(0) {
            return Err(OptionsError::Range { flag: "--stop-after", value: "0".into(), want: "at least 1" });
        }
        Ok(())
    }

    /// The settings a resumed run must share with the run it continues: every field of the
    /// model, data and training sub-configs (by flag name), with `--target` and `--data` replaced
    /// by what they identify (a checkpoint's config and tensor index, or a preset; the data's
    /// content), so that `./data.jsonl` and `data.jsonl` match and an edited file does not.
    /// With `--drafter-config`, `drafter` is the resolved drafter config (a recipe's or a file's
    /// content, wherever the file lies), stored as `drafter-config`.
    pub fn fingerprint(
        &self,
        target_identity: serde_json::Value,
        data_identity: serde_json::Value,
        drafter: Option<serde_json::Value>,
    ) -> Fingerprint {
        let mut map = BTreeMap::new();
        for part in [to_map(&self.model), to_map(&self.data), to_map(&self.train)] {
            map.extend(part);
        }
        if self.data.path.is_some() {
            // The generator's flags do nothing with --data (the CLI refuses them there).
            GENERATOR_KEYS.iter().for_each(|k| drop(map.remove(*k)));
        }
        map.insert("target".into(), target_identity);
        map.insert("data".into(), data_identity);
        if let Some(d) = drafter {
            map.insert("drafter-config".into(), d);
        }
        Fingerprint(map)
    }
}

fn to_map(v: &impl Serialize) -> BTreeMap<String, serde_json::Value> {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::Object(m)) => m.into_iter().collect(),
        // The sub-configs are plain structs: they always serialise to an object.
        _ => BTreeMap::new(),
    }
}

/// The fingerprint's keys of the data generator's flags (`DataOptions`, kebab-case).
const GENERATOR_KEYS: [&str; 3] = ["gen-samples", "gen-prompt-len", "gen-temperature"];

/// The resume fingerprint: flag name -> value (JSON), as stored in a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Fingerprint(pub BTreeMap<String, serde_json::Value>);

impl Fingerprint {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::Value::Object(self.0.clone().into_iter().collect())
    }

    /// A stored fingerprint (None: not in this form, e.g. written by an older engine).
    pub fn from_json(v: &serde_json::Value) -> Option<Self> {
        v.as_object().map(|m| Fingerprint(m.clone().into_iter().collect()))
    }

    /// One line per setting that differs: `--lr: checkpoint 0.003, this run 0.001`. The
    /// generator's flags count only where both sides generate their data (checkpoints of older
    /// engines stored them beside a `--data` file too).
    pub fn differences(&self, this_run: &Fingerprint) -> Vec<String> {
        let generated = |f: &Fingerprint| f.0.get("data") == Some(&serde_json::json!("generated"));
        let both_generate = generated(self) && generated(this_run);
        let mut keys: Vec<&String> = self.0.keys().chain(this_run.0.keys()).collect();
        keys.sort();
        keys.dedup();
        keys.retain(|k| both_generate || !GENERATOR_KEYS.contains(&k.as_str()));
        let show = |v: Option<&serde_json::Value>| v.map_or("(absent)".to_string(), show_value);
        keys.into_iter()
            .filter(|k| self.0.get(*k) != this_run.0.get(*k))
            .map(|k| format!("--{k}: checkpoint {}, this run {}", show(self.0.get(k)), show(this_run.0.get(k))))
            .collect()
    }
}

/// A value as its flag would be written: f32 flags as the f32 they are (0.04, not the f64
/// 0.03999999910593033 they widen to).
fn show_value(v: &serde_json::Value) -> String {
    match v.as_f64() {
        Some(x) if v.is_f64() && f64::from(x as f32) == x => (x as f32).to_string(),
        _ => v.to_string(),
    }
}

/// A flag's value that cannot work.
#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    #[error("{flag} {value}: must be {want}")]
    Range { flag: &'static str, value: String, want: &'static str },
    #[error("{0}")]
    Relation(String),
}

/// The shortest generated sample after a prompt of `prompt_len` tokens: two more tokens, so that
/// it has a continuation to supervise.
pub fn shortest_generated(prompt_len: usize) -> usize {
    prompt_len + 2
}

/// `v` is finite and above 0, or an error naming `flag`.
pub fn positive_f32(flag: &'static str, v: f32) -> Result<(), OptionsError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(OptionsError::Range { flag, value: v.to_string(), want: "a finite number above 0" })
    }
}

fn non_negative_f32(flag: &'static str, v: f32) -> Result<(), OptionsError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(OptionsError::Range { flag, value: v.to_string(), want: "a finite number >= 0" })
    }
}

fn at_least(flag: &'static str, v: usize, min: usize) -> Result<(), OptionsError> {
    if v >= min {
        Ok(())
    } else {
        Err(OptionsError::Range {
            flag,
            value: v.to_string(),
            want: if min == 1 { "at least 1" } else { "at least 2" },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--mfu-peak`: `measure`, `off`, or a positive TFLOP/s figure (kept as FLOP/s); anything
    /// else is refused with what the flag takes.
    #[test]
    fn mfu_peak_takes_measure_off_or_a_positive_peak() {
        assert_eq!("measure".parse::<MfuPeak>(), Ok(MfuPeak::Measure));
        assert_eq!("off".parse::<MfuPeak>(), Ok(MfuPeak::Off));
        assert_eq!("989".parse::<MfuPeak>(), Ok(MfuPeak::Given(989e12)));
        assert_eq!("0.5".parse::<MfuPeak>(), Ok(MfuPeak::Given(0.5e12)));
        for bad in ["0", "-3", "nan", "inf", "fast", ""] {
            let e = bad.parse::<MfuPeak>().expect_err(bad);
            assert!(e.contains("`measure`, `off` or a device's bf16 peak in TFLOP/s"), "{bad}: {e}");
        }
        assert_eq!(serde_json::to_string(&MfuPeak::Given(989e12)).unwrap(), "989.0");
        assert_eq!(serde_json::to_string(&MfuPeak::Off).unwrap(), "\"off\"");
    }

    fn err(f: impl FnOnce(&mut RunOptions)) -> String {
        let mut o = RunOptions::tiny_default();
        f(&mut o);
        o.validate().expect_err("must be rejected").to_string()
    }

    /// Non-finite and out-of-range numbers were accepted (`--lr nan` trained and wrote an all-NaN
    /// checkpoint; `--init-std nan` reported accuracy 1.000): each is refused with its flag.
    #[test]
    fn non_finite_and_out_of_range_numbers_are_refused_with_their_flag() {
        #[allow(clippy::type_complexity)]
        let cases: Vec<(&str, Box<dyn FnOnce(&mut RunOptions)>)> = vec![
            ("--lr", Box::new(|o| o.train.lr = f32::NAN)),
            ("--lr", Box::new(|o| o.train.lr = f32::INFINITY)),
            ("--lr", Box::new(|o| o.train.lr = 1e30)),
            ("--lr", Box::new(|o| o.train.lr = -1.0)),
            ("--init-std", Box::new(|o| o.model.init_std = f32::NAN)),
            ("--clip", Box::new(|o| o.train.clip = f32::NAN)),
            ("--warmup", Box::new(|o| o.train.warmup_frac = f32::NAN)),
            ("--warmup", Box::new(|o| o.train.warmup_frac = -1.0)),
            ("--gen-temperature", Box::new(|o| o.data.gen_temperature = -0.5)),
            ("--noise-std", Box::new(|o| o.data.noise_std = f32::INFINITY)),
            ("--gen-prompt-len", Box::new(|o| o.data.gen_prompt_len = 0)),
            ("--max-inflight", Box::new(|o| o.exec.max_inflight = 1 << 40)),
            ("--pad-to-tokens", Box::new(|o| o.data.pad_to_tokens = Some(10))),
            ("--block-size", Box::new(|o| o.model.block_size = 1)),
        ];
        for (flag, f) in cases {
            let e = err(f);
            assert!(e.starts_with(flag), "{flag}: {e}");
        }
        RunOptions::tiny_default().validate().unwrap();
    }

    /// --transport same on two devices failed only when the pipeline started (after the load,
    /// and after a new run had replaced the folder's metrics); it is refused up front.
    #[test]
    fn transport_same_needs_one_device() {
        let e = err(|o| {
            o.exec.transport = Some(Transport::Same);
            o.exec.drafter_gpus = vec![1];
        });
        assert!(e.contains("--transport same") && e.contains("[0, 1]"), "{e}");
        let mut o = RunOptions::tiny_default();
        o.exec.transport = Some(Transport::Same);
        o.exec.drafter_gpus = vec![0];
        o.validate().unwrap();
    }

    /// The phase table needs the step's phases one after another on one stream.
    #[test]
    fn profile_needs_the_synchronous_step_on_one_device() {
        let e = err(|o| o.output.profile = true);
        assert!(e.contains("--profile") && e.contains("--sync"), "{e}");
        let e = err(|o| {
            o.output.profile = true;
            o.exec.sync = true;
            o.exec.drafter_gpus = vec![1];
        });
        assert!(e.contains("one GPU"), "{e}");
        let mut o = RunOptions::tiny_default();
        o.output.profile = true;
        o.exec.sync = true;
        o.validate().unwrap();
    }

    /// --serial-update only means something where the update has a stream of its own.
    #[test]
    fn serial_update_needs_the_synchronous_step_on_one_device() {
        let e = err(|o| o.exec.serial_update = true);
        assert!(e.contains("--serial-update") && e.contains("--sync"), "{e}");
        let mut o = RunOptions::tiny_default();
        o.exec.serial_update = true;
        o.exec.sync = true;
        o.validate().unwrap();
    }

    #[test]
    fn the_fingerprint_names_each_differing_flag() {
        let a = RunOptions::tiny_default();
        let mut b = a.clone();
        b.train.warmup_frac = 0.1;
        b.train.clip = 0.5;
        b.model.target_seed = 7;
        b.exec.max_inflight = 4; // execution only: not part of the fingerprint
        let id = || serde_json::json!("same");
        let d = a.fingerprint(id(), id(), None).differences(&b.fingerprint(id(), id(), None));
        assert_eq!(d.len(), 3, "{d:?}");
        assert!(d.iter().any(|l| l.starts_with("--warmup: checkpoint 0.04")), "{d:?}");
        assert!(d.iter().any(|l| l.starts_with("--clip")), "{d:?}");
        assert!(d.iter().any(|l| l.starts_with("--target-seed")), "{d:?}");
        let back = Fingerprint::from_json(&a.fingerprint(id(), id(), None).to_json()).unwrap();
        assert!(back.differences(&a.fingerprint(id(), id(), None)).is_empty());
    }

    /// With --data the generator's flags change nothing, so they neither enter the fingerprint
    /// nor count against one stored with them; with generated data they still do.
    #[test]
    fn the_fingerprint_leaves_out_the_generator_with_a_data_file() {
        let id = || serde_json::json!({"sha256": "ab"});
        let mut a = RunOptions::tiny_default();
        a.data.path = Some("data.jsonl".into());
        let fa = a.fingerprint(id(), id(), None);
        assert!(GENERATOR_KEYS.iter().all(|k| !fa.0.contains_key(*k)), "{fa:?}");
        // An older checkpoint's fingerprint, generator flags included, resumes.
        let mut old = fa.clone();
        old.0.insert("gen-samples".into(), serde_json::json!(64));
        assert!(old.differences(&fa).is_empty());
        let gen = || serde_json::json!("generated");
        let mut b = RunOptions::tiny_default();
        b.data.gen_samples = 64;
        let d =
            RunOptions::tiny_default().fingerprint(id(), gen(), None).differences(&b.fingerprint(id(), gen(), None));
        assert_eq!(d, vec!["--gen-samples: checkpoint 512, this run 64".to_string()]);
    }

    /// The drafter config and --loss-gamma change results, so a resume must match them: a
    /// different resolved config or gamma is named; an unset gamma adds no key (runs from
    /// before the flag resume).
    #[test]
    fn the_fingerprint_covers_the_drafter_config_and_loss_gamma() {
        let a = RunOptions::tiny_default();
        let id = || serde_json::json!("same");
        assert!(!a.fingerprint(id(), id(), None).0.contains_key("loss-gamma"));
        let mut b = a.clone();
        b.train.loss_gamma = Some(5.0);
        let d = a.fingerprint(id(), id(), None).differences(&b.fingerprint(id(), id(), None));
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(d[0].starts_with("--loss-gamma: checkpoint (absent), this run 5"), "{d:?}");
        let (c1, c2) = (serde_json::json!({"sliding_window": 2048}), serde_json::json!({"sliding_window": 1024}));
        let d = a.fingerprint(id(), id(), Some(c1.clone())).differences(&a.fingerprint(id(), id(), Some(c2)));
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(d[0].starts_with("--drafter-config: checkpoint"), "{d:?}");
        assert!(a
            .fingerprint(id(), id(), Some(c1.clone()))
            .differences(&a.fingerprint(id(), id(), Some(c1)))
            .is_empty());
        let mut bad = a.clone();
        bad.train.loss_gamma = Some(0.0);
        assert!(bad.validate().unwrap_err().to_string().starts_with("--loss-gamma"));
    }
}
