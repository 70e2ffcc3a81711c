//! `dflash-engine bench-decode`: the decoding throughput that bounds `prepare-data
//! --regenerate`, against the memory bound it implies.
//!
//! A decode step reads every weight once (the embedding only at the batch's rows) for the whole
//! batch, so at batch `B` it cannot beat `B / (weight bytes / copy bandwidth)` tokens/s; the
//! bandwidth is measured here as a large device-to-device copy (bytes read + written over its
//! time). The KV cache read at the benchmark's context is printed beside it as a second bound.
//! The decode loop is the one `--regenerate` runs (greedy): upload the tokens,
//! `Target::decode_step`, the argmax of each row on the device, download the picked ids; the step
//! alone is timed with device events where the backend has them.

use std::time::Instant;

use anyhow::{Context as _, Result};

use super::options::Device;
use super::setup::TargetSource;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{alloc::Mode, CudaBackend};
use crate::backend::Backend;
use crate::model::target::names;
use crate::tensor::DType;

/// What `bench-decode` measures.
#[derive(Clone, Debug)]
pub struct DecodeBenchOptions {
    pub target: String,
    pub init_std: f32,
    pub batch: usize,
    /// Positions decoded before timing (the cache the timed steps attend to).
    pub context: usize,
    pub steps: usize,
    pub device: Device,
    /// Profile a few steps after the timed ones (per-operation device time).
    pub profile: bool,
}

/// The measured rates.
#[derive(Clone, Debug)]
pub struct DecodeBench {
    pub tokens_per_s: f64,
    /// Tokens/s counting only the decode step's own time (no logits download, no pick).
    pub step_tokens_per_s: f64,
    pub copy_gb_s: f64,
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    /// `batch / (weight bytes / copy bandwidth)`.
    pub bound_tokens_per_s: f64,
}

/// Runs the benchmark and prints its table.
pub fn bench_decode(o: &DecodeBenchOptions) -> Result<DecodeBench> {
    anyhow::ensure!(o.batch >= 1 && o.steps >= 1, "--batch and --steps must be at least 1");
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Seconds of `f` on `s`: device events where the backend has them, else the host's clock.
fn timed<B: Backend>(be: &B, s: &B::Stream, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    be.synchronize(s)?;
    let t0 = Instant::now();
    let e0 = be.record_timed(s)?;
    f()?;
    let e1 = be.record_timed(s)?;
    be.synchronize(s)?;
    Ok(match (e0, e1) {
        (Some(a), Some(b)) => be.elapsed_secs(&a, &b).unwrap_or_else(|| t0.elapsed().as_secs_f64()),
        _ => t0.elapsed().as_secs_f64(),
    })
}

fn on<B: Backend>(be: &B, src: &TargetSource, o: &DecodeBenchOptions) -> Result<DecodeBench> {
    let cfg = src.config().clone();
    let t_load = Instant::now();
    let target = src.load(be, vec![cfg.num_hidden_layers - 1], true).context("loading the target")?;
    let s = be.compute_stream();
    be.synchronize(&s)?;
    eprintln!("loaded    in {:.1} s on {}", t_load.elapsed().as_secs_f64(), be.name());

    // Copy bandwidth: a buffer past any L2 (256 MiB, or the weights if smaller), median of 10.
    let n = (128usize << 20).min(target.table.total());
    let a = be.alloc(&s, DType::BF16, n)?;
    let mut b = be.alloc(&s, DType::BF16, n)?;
    let mut secs = Vec::new();
    for _ in 0..11 {
        secs.push(timed(be, &s, || Ok(be.copy(&s, &a, 0, &mut b, 0, n)?))?);
    }
    let copy_gb_s = 2.0 * (n * 2) as f64 / median(secs[1..].to_vec()) / 1e9;
    drop((a, b));

    let sh = &target.shape;
    // Counted per tensor (the table's total includes alignment padding nothing reads).
    let read: usize = target
        .table
        .entries()
        .iter()
        .filter(|e| e.name != names::EMBED)
        .map(|e| e.shape.iter().product::<usize>())
        .sum();
    let weight_bytes = 2 * read as u64;
    let kv_bytes = 2 * 2 * (o.batch * o.context * sh.layers * sh.kv_width()) as u64;
    let bound = o.batch as f64 / (weight_bytes as f64 / (copy_gb_s * 1e9));

    let max_len = o.context + o.steps + if o.profile { 7 } else { 1 };
    let mut cache = target.new_cache(be, &s, o.batch, max_len)?;
    let mut logits = be.alloc(&s, DType::F32, o.batch * sh.vocab)?;
    let mut tokens = be.alloc_ids(&s, o.batch)?;
    let mut picked = be.alloc_ids(&s, o.batch)?;
    let mut cur: Vec<i32> = (0..o.batch).map(|i| (i * 7919 % sh.vocab.min(1000)) as i32).collect();
    let pb = super::log::bar(false, o.context as u64, "context");
    for t in 0..o.context {
        be.upload_ids(&s, &cur, &mut tokens)?;
        target.decode_step(be, &s, &mut cache, &tokens, t, &mut logits)?;
        cur.iter_mut().for_each(|x| *x = (*x + 1) % sh.vocab as i32);
        pb.set_position(t as u64 + 1);
    }
    be.synchronize(&s)?;
    pb.finish_and_clear();
    let mut step_secs = Vec::new();
    let mut full_secs = Vec::new();
    for t in o.context..o.context + o.steps {
        let t0 = Instant::now();
        be.upload_ids(&s, &cur, &mut tokens)?;
        step_secs.push(timed(be, &s, || Ok(target.decode_step(be, &s, &mut cache, &tokens, t, &mut logits)?))?);
        // Greedy, as --regenerate picks by default: the argmax on the device, the ids down.
        be.argmax_rows(&s, &logits, sh.vocab, o.batch, sh.vocab, &mut picked)?;
        cur = be.download_ids(&s, &picked)?;
        full_secs.push(t0.elapsed().as_secs_f64());
    }
    if o.profile {
        // Profiled apart from the timed steps: timing every launch adds host work to each.
        if be.start_profile() {
            let mut steps = Vec::new();
            for t in o.context + o.steps..o.context + o.steps + 6 {
                let t0 = Instant::now();
                be.upload_ids(&s, &cur, &mut tokens)?;
                target.decode_step(be, &s, &mut cache, &tokens, t, &mut logits)?;
                let p = be.take_profile_step()?.unwrap_or_default();
                steps.push((p, t0.elapsed().as_secs_f64()));
            }
            if let Some(t) = crate::backend::profile::PhaseTable::from_steps(&steps, 1) {
                println!("{}{}", t.render(), t.render_ops(25));
            }
        } else {
            println!("note      --profile: this backend has no device clock");
        }
    }
    let r = DecodeBench {
        tokens_per_s: o.batch as f64 / median(full_secs),
        step_tokens_per_s: o.batch as f64 / median(step_secs),
        copy_gb_s,
        weight_bytes,
        kv_bytes,
        bound_tokens_per_s: bound,
    };
    let kv_bound = o.batch as f64 / ((weight_bytes + kv_bytes) as f64 / (copy_gb_s * 1e9));
    println!(
        "decode    batch {} at context {} ({} timed steps, median)\n\
         copy      {:.0} GB/s (device-to-device, read + write)\n\
         weights   {:.2} GB read per step; bound {:.0} tokens/s\n\
         kv cache  {:.2} GB read per step at this context; weights + cache bound {:.0} tokens/s\n\
         measured  {:.0} tokens/s ({:.0}% of the weight bound) with logits download and pick; \
         {:.0} tokens/s ({:.0}%) for the decode step alone",
        o.batch,
        o.context,
        o.steps,
        copy_gb_s,
        weight_bytes as f64 / 1e9,
        bound,
        kv_bytes as f64 / 1e9,
        kv_bound,
        r.tokens_per_s,
        100.0 * r.tokens_per_s / bound,
        r.step_tokens_per_s,
        100.0 * r.step_tokens_per_s / bound,
    );
    Ok(r)
}
