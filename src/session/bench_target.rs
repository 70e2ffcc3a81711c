//! `dflash-engine bench-target`: tokens/s of the target's forward with taps (the first stage of
//! every training step) at a given batch, on its own; `--profile` adds the per-operation device
//! time of one forward. The forward runs to the deepest tapped layer, as in training (default:
//! the taps of a 5-layer drafter, DFLASH.md section 1).

use std::time::Instant;

use anyhow::{Context as _, Result};

use super::options::Device;
use super::setup::TargetSource;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{alloc::Mode, CudaBackend};
use crate::backend::profile::PhaseTable;
use crate::backend::Backend;
use crate::model::target::TargetInputs;
use crate::tensor::DType;

/// What `bench-target` measures.
#[derive(Clone, Debug)]
pub struct TargetBenchOptions {
    pub target: String,
    pub init_std: f32,
    /// Sequences per forward, each `seq_len` tokens (packed into one batch).
    pub batch: usize,
    pub seq_len: usize,
    /// Tapped layers (default: 5 taps by DFLASH.md's rule); the forward stops at the deepest.
    pub taps: Option<Vec<usize>>,
    pub steps: usize,
    pub device: Device,
    pub profile: bool,
}

/// The measured rate.
#[derive(Clone, Debug)]
pub struct TargetBench {
    pub tokens_per_s: f64,
    pub median_ms: f64,
    /// Layers run (0..=deepest tap).
    pub layers: usize,
}

pub fn bench_target(o: &TargetBenchOptions) -> Result<TargetBench> {
    anyhow::ensure!(
        o.batch >= 1 && o.seq_len >= 1 && o.steps >= 1,
        "--batch, --seq-len and --steps must be at least 1"
    );
    let src = TargetSource::resolve(&o.target, 0, o.init_std, &mut Vec::new())?;
    eprintln!("target    {}", src.describe());
    match o.device {
        Device::Cpu => on(&CpuBackend::new(), &src, o),
        Device::Cuda | Device::Auto => {
            let be = CudaBackend::new(0, Mode::Normal).map_err(|why| anyhow::anyhow!("--device cuda: {why}"))?;
            on(&be, &src, o)
        }
    }
}

fn on<B: Backend>(be: &B, src: &TargetSource, o: &TargetBenchOptions) -> Result<TargetBench> {
    let cfg = src.config().clone();
    let taps = match &o.taps {
        Some(t) => t.clone(),
        None => crate::config::default_tap_layers(cfg.num_hidden_layers, 5),
    };
    if let Some(&bad) = taps.iter().find(|&&t| t >= cfg.num_hidden_layers) {
        anyhow::bail!("--taps: layer {bad} is past the target's last layer {}", cfg.num_hidden_layers - 1);
    }
    let t_load = Instant::now();
    let target = src.load(be, taps.clone(), false).context("loading the target")?;
    let s = be.compute_stream();
    be.synchronize(&s)?;
    let layers = taps.iter().max().map_or(0, |&l| l + 1);
    eprintln!(
        "loaded    layers 0..={} (taps {taps:?}) in {:.1} s on {}",
        layers - 1,
        t_load.elapsed().as_secs_f64(),
        be.name()
    );

    let rows = o.batch * o.seq_len;
    let vocab = cfg.vocab_size.min(1 << 20);
    let ids: Vec<i32> = (0..rows).map(|i| (i.wrapping_mul(2_654_435_761) % vocab) as i32).collect();
    let pos: Vec<i32> = (0..rows).map(|i| (i % o.seq_len) as i32).collect();
    let starts: Vec<i32> = (0..=o.batch).map(|b| (b * o.seq_len) as i32).collect();
    let up = |v: &[i32]| -> Result<B::Ids> {
        let mut d = be.alloc_ids(&s, v.len())?;
        be.upload_ids(&s, v, &mut d)?;
        Ok(d)
    };
    let (d_ids, d_pos, d_starts) = (up(&ids)?, up(&pos)?, up(&starts)?);
    let inp = TargetInputs { ids: &d_ids, pos: &d_pos, seq_starts: &d_starts, rows };
    let mut taps_out: Vec<B::Buf> =
        taps.iter().map(|_| be.alloc(&s, DType::BF16, rows * cfg.hidden_size)).collect::<Result<_, _>>()?;
    let mut ms = Vec::new();
    let monitor = be.clock_monitor();
    let pb = super::log::bar(false, o.steps as u64 + 1, "forward");
    for i in 0..=o.steps {
        be.synchronize(&s)?;
        let t0 = Instant::now();
        target.forward_taps(be, &s, &inp, &mut taps_out)?;
        be.synchronize(&s)?;
        if i > 0 {
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        pb.set_position(i as u64 + 1);
    }
    pb.finish_and_clear();
    ms.sort_by(f64::total_cmp);
    let median_ms = ms[ms.len() / 2];
    let r = TargetBench { tokens_per_s: rows as f64 / (median_ms / 1e3), median_ms, layers };
    println!(
        "forward   {} x {} tokens, layers 0..={}: {:.1} ms median of {} ({:.0} tokens/s)",
        o.batch,
        o.seq_len,
        layers - 1,
        r.median_ms,
        o.steps,
        r.tokens_per_s
    );
    match monitor {
        Some(Ok(m)) => println!("clocks    {}", m.finish().describe()),
        Some(Err(why)) => println!("clocks    not sampled ({why})"),
        None => {}
    }
    if o.profile {
        if be.start_profile() {
            let mut steps = Vec::new();
            for _ in 0..2 {
                let t0 = Instant::now();
                target.forward_taps(be, &s, &inp, &mut taps_out)?;
                let p = be.take_profile_step()?.unwrap_or_default();
                steps.push((p, t0.elapsed().as_secs_f64()));
            }
            if let Some(mut t) = PhaseTable::from_steps(&steps, 1) {
                // The forward's GEMMs against the card's own rate, measured after the forwards.
                t.gemm_peak = super::device_peak(be)?;
                println!("{}{}", t.render(), t.render_ops(25));
            }
        } else {
            println!("note      --profile: this backend has no device clock");
        }
    }
    Ok(r)
}
