//! `prepare-data` as wiring: the target folder's tokenizer and template, the backend and the
//! target's weights when answers are regenerated, a progress bar over the input's lines, and the
//! summary. The work itself is `crate::prepare`.

use std::io::BufRead;
use std::path::Path;

use anyhow::{Context as _, Result};

use super::log;
use super::options::Device;
use super::setup::TargetSource;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{alloc::Mode, CudaBackend};
use crate::backend::Backend;
use crate::prepare::encode::Encoder;
use crate::prepare::{prepare, Generator, PrepareOptions, PrepareSummary};

/// Runs `prepare-data` and prints its summary.
pub fn prepare_data(o: &PrepareOptions, device: Device, quiet: bool) -> Result<PrepareSummary> {
    let dir = &o.target_dir;
    anyhow::ensure!(
        dir.is_dir(),
        "--target {}: not a folder; give the target's Hugging Face folder (tokenizer.json, tokenizer_config.json or \
         chat_template.jinja, config.json, and the weights for --regenerate)",
        dir.display()
    );
    let enc = Encoder::from_dir(dir)?;
    let target_vocab = std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("vocab_size").and_then(|x| x.as_u64()))
        .map(|v| v as usize);
    let total = count_lines(&o.input)?;
    let summary = if o.regenerate.is_none() {
        with_bar(quiet, total, |p| prepare::<CpuBackend>(o, &enc, target_vocab, None, p))?
    } else {
        let src = TargetSource::resolve(&dir.to_string_lossy(), 0, 0.0, &mut Vec::new())?;
        let last = src.config().num_hidden_layers - 1;
        let cpu = || -> Result<PrepareSummary> {
            let be = CpuBackend::new();
            regen_on(&be, &src, last, o, &enc, target_vocab, quiet, total)
        };
        match device {
            Device::Cpu => cpu()?,
            Device::Cuda => {
                let be = CudaBackend::new(0, Mode::Normal).map_err(|why| anyhow::anyhow!("--device cuda: {why}"))?;
                regen_on(&be, &src, last, o, &enc, target_vocab, quiet, total)?
            }
            Device::Auto => match CudaBackend::new(0, Mode::Normal) {
                Ok(be) => regen_on(&be, &src, last, o, &enc, target_vocab, quiet, total)?,
                Err(why) => {
                    eprintln!("note      no usable GPU ({why}); regenerating on the CPU backend");
                    cpu()?
                }
            },
        }
    };
    eprint!("{}", summary.describe(&o.out));
    Ok(summary)
}

#[allow(clippy::too_many_arguments)]
fn regen_on<B: Backend>(
    be: &B,
    src: &TargetSource,
    last: usize,
    o: &PrepareOptions,
    enc: &Encoder,
    target_vocab: Option<usize>,
    quiet: bool,
    total: u64,
) -> Result<PrepareSummary> {
    let target = src.load(be, vec![last], true).context("loading the target to regenerate answers")?;
    let s = be.compute_stream();
    eprintln!("regenerating answers with {} on {}", src.describe(), be.name());
    let g = Generator { be, stream: &s, target: &target };
    with_bar(quiet, total, |p| prepare(o, enc, target_vocab, Some(g), p))
}

fn with_bar(
    quiet: bool,
    total: u64,
    f: impl FnOnce(&mut dyn FnMut(u64)) -> std::result::Result<PrepareSummary, crate::prepare::PrepareError>,
) -> Result<PrepareSummary> {
    let pb = log::bar(quiet, total, "prepare");
    let mut tick = |done: u64| pb.set_position(done);
    let r = f(&mut tick);
    pb.finish_and_clear();
    Ok(r?)
}

fn count_lines(path: &Path) -> Result<u64> {
    let f = std::fs::File::open(path).with_context(|| format!("--input {}: cannot open", path.display()))?;
    let mut n = 0u64;
    let mut r = std::io::BufReader::with_capacity(1 << 20, f);
    let mut buf = Vec::new();
    while r.read_until(b'\n', &mut buf).with_context(|| format!("reading {}", path.display()))? > 0 {
        n += 1;
        buf.clear();
    }
    Ok(n)
}
