//! The small subcommands beside `run`: `inspect` (a checkpoint's config and tensors) and
//! `gen-data` (the embedded default data as JSON Lines).

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

use super::options::RunOptions;
use super::setup::TargetSource;
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::config::{DrafterConfig, TargetConfig};
use crate::train::checkpoint;
use crate::train::generate::{generate, GenSpec};
use crate::weights;

/// `dflash-engine inspect DIR`: a target checkpoint's config and tensors, or a drafter's. A run
/// folder (`--out` of `run`) shows its latest checkpoint.
pub fn inspect(dir: &Path) -> Result<()> {
    // The report is written at the end, in one piece: a closed pipe (`inspect DIR | head`) ends
    // the command quietly instead of panicking inside `println!`.
    let mut text = String::new();
    let r = inspect_into(dir, &mut text);
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
        w => w.context("writing to standard output")?,
    }
    r
}

fn inspect_into(dir: &Path, o: &mut String) -> Result<()> {
    anyhow::ensure!(
        dir.is_dir(),
        "{}: not a folder; give a checkpoint folder (config.json + model.safetensors) or a run's --out folder",
        dir.display()
    );
    let metrics = crate::train::metrics::describe_last(dir)?;
    if let Some(last) = &metrics {
        writeln!(o, "{last}")?;
    }
    let latest = checkpoint::latest_name(dir)?;
    if metrics.is_some() && latest.is_none() && !dir.join("config.json").is_file() {
        // A run folder with metrics and no checkpoint: nothing more to show, and nothing wrong.
        writeln!(
            o,
            "run folder {}: no checkpoint (the run had --no-checkpoint, or stopped before its first save)",
            dir.display()
        )?;
        return Ok(());
    }
    let dir: PathBuf = match latest {
        Some(name) if !dir.join("config.json").is_file() => {
            writeln!(o, "run folder {}: latest checkpoint {name}", dir.display())?;
            dir.join(name)
        }
        _ => dir.to_path_buf(),
    };
    let cfg_text = std::fs::read_to_string(dir.join("config.json")).with_context(|| {
        format!("{}: no readable config.json (a checkpoint folder or a run folder with `latest`)", dir.display())
    })?;
    let drafter = cfg_text.contains("DFlashDraftModel");
    let model = dir.join(checkpoint::MODEL_FILE);
    anyhow::ensure!(
        !drafter || model.is_file(),
        "{}: a drafter's config.json without its weights, {} (a checkpoint folder holds both; one copied \
         in part, or still being written, may not)",
        dir.display(),
        checkpoint::MODEL_FILE
    );
    let store = weights::TensorStore::open_dir(&dir)?;
    if drafter {
        let d = DrafterConfig::from_file(dir.join("config.json"))?;
        writeln!(
            o,
            "drafter: {} layers ({}), block {}, taps {:?}, mask token {}, hidden {}, {}/{} heads x {}, mlp {}",
            d.num_layers,
            d.layer_type_names().join(", "),
            d.block_size,
            d.target_layer_ids,
            d.mask_token_id,
            d.hidden_size,
            d.num_attention_heads,
            d.num_key_value_heads,
            d.head_dim,
            d.intermediate_size
        )?;
        if let Some(w) = d.sliding_window {
            writeln!(o, "sliding window: {w}")?;
        }
        if let Ok(state) = std::fs::read_to_string(dir.join(checkpoint::STATE_FILE)) {
            if let Ok(s) = serde_json::from_str::<checkpoint::TrainerState>(&state) {
                writeln!(o, "trainer: {} steps done, {}", s.step, s.extra)?;
            }
        }
    } else {
        let t = TargetConfig::from_file(dir.join("config.json"))?;
        writeln!(
            o,
            "target: {} layers, hidden {}, heads {}/{} x {}, mlp {}, vocab {}, {} parameters",
            t.num_hidden_layers,
            t.hidden_size,
            t.num_attention_heads,
            t.num_key_value_heads,
            t.head_dim,
            t.intermediate_size,
            t.vocab_size,
            t.num_params()
        )?;
    }
    let mut names = store.names();
    names.sort();
    for n in names {
        let m = store.tensor_info(n)?;
        writeln!(o, "  {n:<56} {:?} {:?}", m.dtype, m.shape)?;
    }
    Ok(())
}

/// `dflash-engine gen-data`: the embedded default data as JSON Lines, generated exactly as `run`
/// generates it (same prompt length, seed and checks), so every file it writes trains.
pub fn gen_data(
    target: &str,
    samples: usize,
    seq_len: usize,
    init_std: f32,
    out: &Path,
    overwrite: bool,
) -> Result<()> {
    if out.exists() && !overwrite {
        anyhow::bail!(
            "--out {}: already exists; pass --overwrite to replace it (or choose another --out)",
            out.display()
        );
    }
    if samples == 0 {
        anyhow::bail!("--samples 0: must be at least 1");
    }
    let d = RunOptions::tiny_default();
    // gen-data's prompts have the default length (`run --gen-prompt-len`, not a flag here).
    if seq_len < super::options::shortest_generated(d.data.gen_prompt_len) {
        anyhow::bail!(
            "--seq-len {seq_len}: must exceed the {} prompt tokens every sample starts with by at least 2 (a sample \
             needs a continuation to supervise)",
            d.data.gen_prompt_len
        );
    }
    let mut o = d.clone();
    o.data.gen_samples = samples;
    o.data.seq_len = seq_len;
    o.model.init_std = init_std;
    o.validate()?;
    let be = CpuBackend::new();
    let s = be.compute_stream();
    let mut notes = Vec::new();
    let src = TargetSource::resolve(target, d.model.target_seed, init_std, &mut notes)?;
    notes.into_iter().for_each(|n| eprintln!("note      {n}"));
    let cfg = src.config().clone();
    let last = cfg.num_hidden_layers - 1;
    let t = src.load(&be, vec![last], true)?;
    let mask = cfg.resolved_mask_token_id()?;
    let ordinary = cfg.bos_token_id.unwrap_or(mask).min(mask);
    let spec = GenSpec {
        num_samples: samples,
        prompt_len: d.data.gen_prompt_len,
        seq_len,
        temperature: 0.0,
        seed: d.train.seed,
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
