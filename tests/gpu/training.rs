//! Training on CUDA end to end: the loss curve tracks the CPU backend's, and two CUDA runs are
//! bit-identical.

use crate::common::Scratch;
use dflash_engine::session::{self, Device, RunOptions};

/// 50 training steps on CUDA track the CPU backend (same data file, same seed), and two CUDA runs
/// give bit-identical losses: one with the defaults (the first two layers' gate|up parked in host
/// memory), one with `--recompute projections`, nothing parked and the AdamW moments in host
/// memory (`--offload-optimizer`, its final checkpoint written from them).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_training_tracks_cpu_and_is_deterministic() {
    tracks_cpu_and_is_deterministic("train", None);
}

/// The same with a drafter whose first layer slides (window 12 over 96-token sequences) and
/// whose attention geometry is its own (8 query heads x 16 against hidden 64, 2 KV heads, MLP
/// 128, norm eps 1e-5), given as a --drafter-config file.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_sliding_drafter_training_tracks_cpu_and_is_deterministic() {
    use dflash_engine::config::{DraftLayerType, DrafterConfig, TargetConfig};
    let scratch = Scratch::new("gpu-gpu_sliding_drafter_training_tracks_cpu_and_is_deterministic");
    let dir = scratch.path().to_path_buf();
    std::fs::create_dir_all(&dir).unwrap();
    let mut d = DrafterConfig::for_target(&TargetConfig::preset("tiny").unwrap(), 2, 16, None).unwrap();
    (d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.intermediate_size) = (8, 2, 16, 128);
    d.rms_norm_eps = 1e-5;
    d.layer_types = vec![DraftLayerType::Sliding, DraftLayerType::Full];
    d.sliding_window = Some(12);
    d.validate().unwrap();
    let cfg = dir.join("drafter.json");
    std::fs::write(&cfg, d.to_json()).unwrap();
    tracks_cpu_and_is_deterministic("train-sliding", Some(cfg.display().to_string()));
}

fn tracks_cpu_and_is_deterministic(tag: &str, drafter_config: Option<String>) {
    use dflash_engine::model::drafter::Recompute;
    let scratch = Scratch::new(&format!("gpu-tracks_cpu_and_is_deterministic-{tag}"));
    let dir = scratch.path().to_path_buf();
    let data = dir.join("data.jsonl");
    session::gen_data("tiny", 256, 96, session::TINY_INIT_STD, &data, false).unwrap();
    let base = {
        let mut ro = RunOptions::tiny_default();
        ro.train.steps = 50;
        ro.output.quiet = true;
        ro.data.path = Some(data);
        ro.output.save_every = 1000;
        ro.model.drafter_config = drafter_config;
        ro
    };
    // The second CUDA run rebuilds the projections in the backward instead of keeping them, keeps
    // every gate|up product on the device and the AdamW moments on the host: none may change a bit.
    let run = |device, recompute, tag: &str| {
        session::run(
            &{
                let mut ro = base.clone();
                ro.exec.device = device;
                ro.exec.recompute = recompute;
                if recompute == Recompute::Projections {
                    ro.exec.offload_activations = 0;
                    ro.exec.offload_optimizer = true;
                }
                ro.output.out = dir.join(tag);
                ro
            },
            None,
        )
        .unwrap()
    };
    let (g1, g2, c) = (
        run(Device::Cuda, Recompute::Norms, "g1"),
        run(Device::Cuda, Recompute::Projections, "g2"),
        run(Device::Cpu, Recompute::Norms, "c"),
    );
    assert!(g1.backend.starts_with("cuda"), "{}", g1.backend);
    let bits = |r: &session::RunSummary| r.history.iter().map(|m| m.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&g1),
        bits(&g2),
        "two CUDA runs with the same seed, one recomputing the projections, parking nothing and keeping the moments on the host, must be bit-identical"
    );
    // The final checkpoints' masters and moments (g2's read back through the host chunks).
    let state = |tag: &str| {
        let ck = dflash_engine::train::checkpoint::load_latest(dir.join(tag)).unwrap().expect("a final checkpoint");
        let b = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        ck.tensors.iter().map(|t| (t.name.clone(), b(&t.master), b(&t.exp_avg), b(&t.exp_avg_sq))).collect::<Vec<_>>()
    };
    let (s1, s2) = (state("g1"), state("g2"));
    assert!(!s1.is_empty() && s1.iter().all(|t| t.2.iter().any(|&x| x != 0)), "trained moments in the checkpoint");
    assert!(s1 == s2, "the final checkpoints' masters and moments must be bit-identical");
    // bf16 activations rounded at the same points but summed in other orders: the runs drift
    // apart slowly; 5% per step at most, 2% on average over 50 steps.
    let rel: Vec<f64> = g1.history.iter().zip(&c.history).map(|(a, b)| ((a.loss - b.loss) / b.loss).abs()).collect();
    let (max, mean) = (rel.iter().cloned().fold(0.0, f64::max), rel.iter().sum::<f64>() / rel.len() as f64);
    println!("cuda vs cpu loss over 50 steps: max rel {max:.3e}, mean rel {mean:.3e}; first {:.4} vs {:.4}, last {:.4} vs {:.4}", g1.history[0].loss, c.history[0].loss, g1.history[49].loss, c.history[49].loss);
    assert!(max < 0.05 && mean < 0.02, "max {max}, mean {mean}");
}

/// The same with the Qwen3.5/3.6 hybrid target (qwen3.5-tiny, its data generated once): 20 CUDA
/// steps track the CPU backend's and two CUDA runs are bit-identical. The target's kernels
/// (Gated DeltaNet, gated attention) feed the drafter's taps, so a wrong kernel shows up in the
/// loss from the first step.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_hybrid_training_tracks_cpu_and_is_deterministic() {
    let scratch = Scratch::new("gpu-gpu_hybrid_training_tracks_cpu_and_is_deterministic");
    let dir = scratch.path().to_path_buf();
    let data = dir.join("data.jsonl");
    session::gen_data("qwen3.5-tiny", 64, 64, session::TINY_INIT_STD, &data, false).unwrap();
    let base = {
        let mut ro = RunOptions::tiny_default();
        ro.model.target = "qwen3.5-tiny".into();
        ro.train.steps = 20;
        ro.output.quiet = true;
        ro.data.path = Some(data);
        ro.data.seq_len = 64;
        ro.output.save_every = 1000;
        ro
    };
    let run = |device, tag: &str| {
        session::run(
            &{
                let mut ro = base.clone();
                ro.exec.device = device;
                ro.output.out = dir.join(tag);
                ro
            },
            None,
        )
        .unwrap()
    };
    let (g1, g2, c) = (run(Device::Cuda, "g1"), run(Device::Cuda, "g2"), run(Device::Cpu, "c"));
    assert!(g1.backend.starts_with("cuda"), "{}", g1.backend);
    let bits = |r: &session::RunSummary| r.history.iter().map(|m| m.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&g1), bits(&g2), "two CUDA runs with the same seed must be bit-identical");
    let rel: Vec<f64> = g1.history.iter().zip(&c.history).map(|(a, b)| ((a.loss - b.loss) / b.loss).abs()).collect();
    let (max, mean) = (rel.iter().cloned().fold(0.0, f64::max), rel.iter().sum::<f64>() / rel.len() as f64);
    println!("hybrid cuda vs cpu loss over 20 steps: max rel {max:.3e}, mean rel {mean:.3e}");
    assert!(max < 0.05 && mean < 0.02, "max {max}, mean {mean}");
}

/// `--profile` and the step clock: every phase of the step is timed from device events and split
/// into steps at the step markers, so each profiled step holds the same launches (per operation,
/// the same count every step: no step's share of another's work), its phases plus the idle
/// gaps add up to its marker-to-marker device time within 5%, and that time is the summary's
/// step time (the same markers). Timing changes no result (the losses equal an unprofiled run's
/// bit for bit), and the unprofiled run also reports device step times.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_profile_accounts_for_the_step_and_changes_nothing() {
    use dflash_engine::backend::profile::{Phase, StepClock};
    let scratch = Scratch::new("gpu-gpu_profile_accounts_for_the_step_and_changes_nothing");
    let dir = scratch.path().to_path_buf();
    let run = |profile: bool, tag: &str| {
        let mut ro = RunOptions::tiny_default();
        ro.train.steps = 6;
        ro.output.quiet = true;
        ro.output.checkpoints = false;
        ro.exec.device = Device::Cuda;
        ro.exec.sync = true;
        // Every step the same shapes (the generated samples all have --seq-len tokens): the
        // same GEMMs and kernels each step.
        ro.data.pad_to_tokens = Some(ro.data.batch_size * ro.data.seq_len);
        ro.output.profile = profile;
        ro.output.out = dir.join(tag);
        session::run(&ro, None).unwrap()
    };
    let (plain, prof) = (run(false, "plain"), run(true, "prof"));
    let bits = |r: &session::RunSummary| r.history.iter().map(|m| m.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&plain), bits(&prof), "profiling must not change a result");
    assert!(plain.phases.is_none() && plain.phase_steps.is_empty());
    for r in [&plain, &prof] {
        assert_eq!(r.step_clock, StepClock::Device, "the synchronous loop on CUDA times its steps on the device");
        assert_eq!(r.step_ms.len(), 6);
        assert!(r.step_ms.iter().all(|&ms| ms > 0.0 && ms.is_finite()), "{:?}", r.step_ms);
    }
    let t = prof.phases.as_ref().expect("a phase table under --profile on CUDA");
    println!("{}{}", t.render(), t.render_ops(40));
    println!("device step times: plain {:?} ms, profiled {:?} ms", plain.step_ms, prof.step_ms);
    assert_eq!(t.clock, StepClock::Device);
    assert_eq!(prof.phase_steps.len(), 6, "one profiled step per step");
    assert_eq!(t.steps, 5, "six steps, the first left out");
    let got = |p: Phase| t.by_phase.iter().find(|(q, _)| *q == p).map_or(0.0, |(_, s)| *s);
    // Every phase but `Other` (work enqueued outside the step's regions) runs in a step.
    for &p in Phase::ALL.iter().filter(|&&p| p != Phase::Other) {
        assert!(got(p) > 0.0, "phase {} was not timed", p.name());
    }
    // Each step: its own launches only, the same ones every step after the first.
    let counts = |i: usize| {
        let mut c: Vec<(String, usize)> = prof.phase_steps[i].by_op.iter().map(|(op, _, n)| (op.clone(), *n)).collect();
        c.sort();
        c
    };
    for i in 2..6 {
        assert_eq!(counts(i), counts(1), "launches per operation of step {i} differ from step 1's");
    }
    for (i, sp) in prof.phase_steps.iter().enumerate() {
        let step = sp.step.expect("a marker-to-marker time");
        // The same two markers give the summary's step time.
        assert!(
            (step * 1e3 - prof.step_ms[i]).abs() <= 1e-6 * prof.step_ms[i],
            "step {i}: {step} s vs {} ms",
            prof.step_ms[i]
        );
        let acc = sp.accounted();
        assert!((acc - step).abs() <= 0.05 * step, "step {i}: phases + gaps {acc} s vs the device's step {step} s");
        assert!(sp.intervals > 0);
        // The gaps, labelled by the launch that ends them, are the step's gaps.
        let labelled: f64 = sp.gaps_by_op.iter().map(|g| g.1).sum();
        assert!(
            (labelled - sp.gaps).abs() <= 1e-9 + 1e-6 * sp.gaps,
            "step {i}: labelled gaps {labelled} s vs {} s",
            sp.gaps
        );
    }
    assert!(t.sums_to_the_step(), "phases + gaps {} s vs the device's step {} s", t.accounted(), t.step);
    assert!(t.render().contains("of the device's step time"));
}

/// A block larger than the CUDA drafter attention takes is refused before anything loads, naming
/// the limit, and the same run trains on the CPU backend (which takes any block).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_run_refuses_a_block_the_kernels_cannot_take() {
    let scratch = Scratch::new("gpu-gpu_run_refuses_a_block_the_kernels_cannot_take");
    let mut ro = RunOptions::tiny_default();
    ro.train.steps = 1;
    ro.output.quiet = true;
    ro.output.checkpoints = false;
    ro.model.block_size = 32;
    ro.exec.device = Device::Cuda;
    ro.output.out = scratch.path().join("cuda");
    let e = format!("{:#}", session::run(&ro, None).unwrap_err());
    assert!(e.contains("block size 32") && e.contains("up to 16") && e.contains("--device cpu"), "{e}");
    assert!(!ro.output.out.exists(), "a refused run leaves no folder");
    ro.exec.device = Device::Cpu;
    ro.output.out = scratch.path().join("cpu");
    session::run(&ro, None).unwrap();
}
