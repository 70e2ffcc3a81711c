//! `dflash-engine run` end to end on the CPU: learning, resume, crash safety, split-FC, async vs
//! sync, failures at each stage boundary, data and target errors.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{final_masters, losses, Scratch};
use dflash_engine::faults::FaultPlan;
use dflash_engine::session::{self, RunOptions};
use dflash_engine::train::checkpoint;

/// A small, fast configuration (seconds per run) for the equality tests, writing into `out`.
fn small(out: PathBuf) -> RunOptions {
    {
        let mut ro = RunOptions::tiny_default();
        ro.data.gen_samples = 32;
        ro.data.seq_len = 40;
        ro.train.steps = 8;
        ro.data.batch_size = 3;
        ro.data.anchors = 6;
        ro.model.block_size = 8;
        ro.output.save_every = 4;
        ro.output.quiet = true;
        ro.output.out = out;
        ro
    }
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = v.collect();
    v.iter().sum::<f64>() / v.len() as f64
}

/// The default run, shortened: the loss falls below 0.7x its first value and the simulated
/// acceptance length rises by at least 0.3 (both averaged over the last 10 steps: single steps
/// are noisy with 8 sequences a batch).
#[test]
fn default_run_learns() {
    let scratch = Scratch::new("run-default_run_learns");
    let opts = {
        let mut ro = RunOptions::tiny_default();
        ro.train.steps = 200;
        ro.output.quiet = true;
        ro.output.out = scratch.fresh("learn");
        ro
    };
    let r = session::run(&opts, None).unwrap();
    let first = &r.history[0];
    let tail = &r.history[r.history.len() - 10..];
    let (loss, accept) = (mean(tail.iter().map(|m| m.loss)), mean(tail.iter().map(|m| m.accept_len)));
    assert!(loss < 0.7 * first.loss, "loss {:.3} -> {loss:.3}", first.loss);
    assert!(accept >= first.accept_len + 0.3, "accept {:.3} -> {accept:.3}", first.accept_len);
    assert!(r.history.iter().all(|m| !m.skipped));
}

/// Stopping at step 4 and resuming reproduces the uninterrupted run bit for bit: losses and the
/// final weights.
#[test]
fn resume_reproduces_the_uninterrupted_run() {
    let scratch = Scratch::new("run-resume_reproduces_the_uninterrupted_run");
    let full = small(scratch.fresh("full"));
    let a = session::run(&full, None).unwrap();
    let part = {
        let mut ro = small(scratch.fresh("part"));
        ro.output.stop_after = Some(4);
        ro
    };
    let b1 = session::run(&part, None).unwrap();
    assert_eq!(b1.history.len(), 4);
    let b2 = session::run(
        &{
            let mut ro = part.clone();
            ro.output.resume = true;
            ro.output.stop_after = None;
            ro
        },
        None,
    )
    .unwrap();
    assert_eq!(b2.first_step, 4);
    let mut joined = losses(&b1);
    joined.extend(losses(&b2));
    assert_eq!(joined, losses(&a));
    assert_eq!(final_masters(&part.output.out), final_masters(&full.output.out));
}

/// The binary killed in the middle of writing a checkpoint (abort between the model file and the
/// folder rename) leaves the previous checkpoint loadable, and resuming from it still reproduces
/// the uninterrupted run.
#[test]
fn kill_during_save_keeps_the_last_checkpoint() {
    let scratch = Scratch::new("run-kill_during_save_keeps_the_last_checkpoint");
    // DFLASH_BIN: where the binary is when the tests run on another machine (the GPU bundle).
    let bin = std::env::var("DFLASH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dflash-engine").to_string());
    let out = scratch.fresh("kill");
    let args = |extra: &[&str]| {
        let mut v: Vec<String> = [
            "run",
            "--quiet",
            "--gen-samples",
            "32",
            "--seq-len",
            "40",
            "--steps",
            "8",
            "--batch-size",
            "3",
            "--anchors",
            "6",
            "--block-size",
            "8",
            "--save-every",
            "4",
            "--out",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.push(out.display().to_string());
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let ok = Command::new(&bin).args(args(&["--stop-after", "4"])).status().unwrap();
    assert!(ok.success());
    let crashed =
        Command::new(&bin).args(args(&["--resume"])).env("DFLASH_FAULT", "checkpoint-mid-write").status().unwrap();
    assert!(!crashed.success(), "the fault must kill the process");
    let ck = checkpoint::load_latest(&out).unwrap().expect("the step-4 checkpoint survives");
    assert_eq!(ck.state.step, 4);
    let resumed = Command::new(&bin).args(args(&["--resume"])).status().unwrap();
    assert!(resumed.success());
    let full = small(scratch.fresh("kill-ref"));
    session::run(&full, None).unwrap();
    assert_eq!(final_masters(&out), final_masters(&full.output.out));
}

/// Ctrl-C stops after the current step with a checkpoint, and the process says so and exits 130
/// (it exited 0, so `run && eval` went on as if training had finished); the run resumes.
#[test]
fn ctrl_c_checkpoints_and_exits_130() {
    let scratch = Scratch::new("run-ctrl_c_checkpoints_and_exits_130");
    let bin = std::env::var("DFLASH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dflash-engine").to_string());
    let out = scratch.fresh("ctrl-c");
    let args = ["run", "--quiet", "--device", "cpu", "--steps", "100000", "--gen-samples", "32", "--seq-len", "40"];
    let child =
        Command::new(&bin).args(args).arg("--out").arg(&out).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let metrics = out.join("metrics.jsonl");
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 2 {
        assert!(t0.elapsed().as_secs() < 120, "no step logged in 120 s");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let kill = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let done = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(130), "{err}");
    assert!(
        err.contains("interrupted at step")
            && err.contains("of 100000: continue it with the same command and --resume"),
        "{err}"
    );
    let ck = checkpoint::load_latest(&out).unwrap().expect("the stop writes a checkpoint");
    assert!(ck.state.step >= 2, "{}", ck.state.step);
    let resumed = Command::new(&bin)
        .args(args)
        .arg("--out")
        .arg(&out)
        .args(["--resume", "--stop-after", &(ck.state.step + 1).to_string()])
        .status()
        .unwrap();
    assert!(resumed.success());
}

/// Split-FC (exact mode) gives the unsplit run's losses and weights bit for bit over 20 steps,
/// with and without --pad-to-tokens.
#[test]
fn split_fc_is_exact() {
    let scratch = Scratch::new("run-split_fc_is_exact");
    for pad in [None, Some(160)] {
        let base = {
            let mut ro = small(scratch.fresh("unsplit"));
            ro.train.steps = 20;
            ro.output.save_every = 20;
            ro.data.pad_to_tokens = pad;
            ro
        };
        let a = session::run(&base, None).unwrap();
        let split = {
            let mut ro = base.clone();
            ro.exec.split_fc = true;
            ro.output.out = scratch.fresh("split");
            ro
        };
        let b = session::run(&split, None).unwrap();
        assert_eq!(losses(&a), losses(&b), "pad {pad:?}");
        assert_eq!(final_masters(&base.output.out), final_masters(&split.output.out), "pad {pad:?}");
    }
}

/// The pipeline at any depth gives the synchronous run's losses bit for bit.
/// A slow checkpoint under split-FC: while the drafter side writes one (reading the fc group the
/// target side holds), the target side runs ahead to the next step's fc work. That must not hold
/// the fc group while it waits for the drafter, or the two wait for each other forever.
#[test]
fn split_fc_survives_slow_checkpoints() {
    let scratch = Scratch::new("run-split_fc_survives_slow_checkpoints");
    let o = {
        let mut ro = small(scratch.fresh("split-slow-ck"));
        ro.exec.split_fc = true;
        ro.train.steps = 6;
        ro.output.save_every = 1;
        ro.exec.faults = FaultPlan { checkpoint_delay_ms: Some(300), ..Default::default() };
        ro
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(session::run(&o, None).map(|r| r.history.len()));
    });
    let done = rx
        .recv_timeout(std::time::Duration::from_secs(90))
        .expect("the run hung (split-FC and a checkpoint waiting for each other)");
    assert_eq!(done.unwrap(), 6);
}

#[test]
fn async_matches_sync() {
    let scratch = Scratch::new("run-async_matches_sync");
    let sync = session::run(
        &{
            let mut ro = small(scratch.fresh("sync"));
            ro.exec.sync = true;
            ro
        },
        None,
    )
    .unwrap();
    for inflight in [1, 3] {
        let r = session::run(
            &{
                let mut ro = small(scratch.fresh("async"));
                ro.exec.max_inflight = inflight;
                ro.data.grad_accum = 2;
                ro.exec.sync = false;
                ro
            },
            None,
        )
        .unwrap();
        let s2 = session::run(
            &{
                let mut ro = small(scratch.fresh("sync2"));
                ro.exec.sync = true;
                ro.data.grad_accum = 2;
                ro
            },
            None,
        )
        .unwrap();
        assert_eq!(losses(&r), losses(&s2), "max_inflight {inflight}");
    }
    assert_eq!(sync.history.len(), 8);
    // The step times come from the device clock where there is one (CUDA, picked by the default
    // device when a GPU is present), else from the host's; one per step either way.
    let clock = if sync.backend.starts_with("cuda") { session::StepClock::Device } else { session::StepClock::Host };
    assert_eq!(sync.step_clock, clock, "{}", sync.backend);
    assert_eq!(sync.step_ms.len(), 8);
    assert!(sync.step_ms.iter().all(|&ms| ms > 0.0), "{:?}", sync.step_ms);
    // Each is its own step's time, not the time between two reports: a step is reported during
    // the next one, which made the first time two steps' and the last one almost nothing.
    let mut sorted = sync.step_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    assert!(sorted[0] > 0.25 * median, "a step far shorter than the median: {:?}", sync.step_ms);
}

/// A failure at each stage boundary ends the run with that stage's error, within seconds.
#[test]
fn failures_end_the_run_with_the_right_error() {
    let scratch = Scratch::new("run-failures_end_the_run_with_the_right_error");
    let cases: [(FaultPlan, &str); 3] = [
        // Fault steps are 0-based indices; messages count steps from 1, as the step log does.
        (FaultPlan { producer_error_at: Some(3), ..Default::default() }, "producer) failed at step 4"),
        (FaultPlan { publish_error_at: Some(2), ..Default::default() }, "could not publish step 3"),
        (FaultPlan { consumer_panic_at: Some(4), ..Default::default() }, "consumer) panicked at step 5"),
    ];
    for (faults, want) in cases {
        let t0 = Instant::now();
        let err = session::run(
            &{
                let mut ro = small(scratch.fresh("fault"));
                ro.exec.faults = faults;
                ro
            },
            None,
        )
        .expect_err("the fault must fail the run");
        let msg = format!("{err:#}");
        assert!(msg.contains(want), "{msg}");
        assert!(t0.elapsed() < Duration::from_secs(60), "took {:?}", t0.elapsed());
    }
    // Split-FC adds a back channel: a consumer panic must not leave the target side waiting.
    let err = session::run(
        &{
            let mut ro = small(scratch.fresh("fault-split"));
            ro.exec.split_fc = true;
            ro.exec.faults = FaultPlan { consumer_panic_at: Some(2), ..Default::default() };
            ro
        },
        None,
    )
    .expect_err("fails");
    assert!(format!("{err:#}").contains("panicked at step 3"), "{err:#}");
}

/// Bad input gets an error that names the problem.
#[test]
fn bad_input_is_named() {
    let scratch = Scratch::new("run-bad_input_is_named");
    let dir = scratch.fresh("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("d.jsonl");
    std::fs::write(
        &data,
        "{\"input_ids\": [1, 2, 3], \"loss_mask\": [0, 1, 1]}\n{\"input_ids\": [1, 999], \"loss_mask\": [1, 1]}\n",
    )
    .unwrap();
    let err = session::run(
        &{
            let mut ro = small(scratch.fresh("bad-data"));
            ro.data.path = Some(data);
            ro
        },
        None,
    )
    .expect_err("id 999 is outside the vocabulary");
    let msg = format!("{err:#}");
    assert!(msg.contains("line 2") && msg.contains("999"), "{msg}");
    let err = session::run(
        &{
            let mut ro = small(scratch.fresh("bad-target"));
            ro.model.target = dir.join("nope").display().to_string();
            ro
        },
        None,
    )
    .expect_err("no such folder");
    assert!(format!("{err:#}").contains("nope"), "{err:#}");
    let err = session::run(
        &{
            let mut ro = small(scratch.fresh("bad-pad"));
            ro.data.pad_to_tokens = Some(50);
            ro
        },
        None,
    )
    .expect_err("3 x 40 tokens do not fit in 50");
    assert!(format!("{err:#}").contains("--pad-to-tokens"), "{err:#}");
}

/// Data written by `gen-data` trains through `--data` (the JSONL path end to end).
#[test]
fn jsonl_data_trains() {
    let scratch = Scratch::new("run-jsonl_data_trains");
    let dir = scratch.fresh("jsonl");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("data.jsonl");
    session::gen_data("tiny", 16, 40, session::TINY_INIT_STD, &path, false).unwrap();
    let r = session::run(
        &{
            let mut ro = small(scratch.fresh("jsonl"));
            ro.data.path = Some(path);
            ro.train.steps = 3;
            ro
        },
        None,
    )
    .unwrap();
    assert_eq!(r.data_samples, 16);
    assert!(r.history.iter().all(|m| m.loss.is_finite() && m.loss > 0.0));
}

/// `--trace` writes a Chrome trace with a track per thread, and the target's spans overlap the
/// drafter's (the pipeline runs them concurrently).
#[test]
fn trace_shows_the_overlap() {
    let scratch = Scratch::new("run-trace_shows_the_overlap");
    let opts = small(scratch.fresh("trace"));
    let path = opts.output.out.join("trace.json");
    std::fs::create_dir_all(&opts.output.out).unwrap();
    let (micro, depth_max) = (opts.data.grad_accum, opts.exec.max_inflight + 1);
    session::run(
        &{
            let mut ro = opts;
            ro.output.trace = Some(path.clone());
            ro.train.steps = 6;
            ro
        },
        None,
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let names: Vec<&str> =
        events.iter().filter(|e| e["ph"] == "M").map(|e| e["args"]["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"target") && names.contains(&"drafter"), "{names:?}");
    let spans = |track: &str| -> Vec<(f64, f64)> {
        let tid =
            events.iter().find(|e| e["ph"] == "M" && e["args"]["name"] == track).unwrap()["tid"].as_i64().unwrap();
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"].as_i64() == Some(tid))
            .map(|e| (e["ts"].as_f64().unwrap(), e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap()))
            .collect()
    };
    let (t, d) = (spans("target"), spans("drafter"));
    assert_eq!(t.len(), 6, "one target span per step");
    let overlap: f64 = t.iter().flat_map(|a| d.iter().map(move |b| (a.1.min(b.1) - a.0.max(b.0)).max(0.0))).sum();
    assert!(overlap > 0.0, "target and drafter never ran at the same time");
    // The queue depth over time is a counter track: one sample per publish and per receive.
    let depth: Vec<f64> = events
        .iter()
        .filter(|e| e["ph"] == "C" && e["name"] == "queue depth")
        .map(|e| e["args"]["micro-batches"].as_f64().unwrap())
        .collect();
    assert_eq!(depth.len(), 2 * 6 * micro, "a sample per publish and per receive of every micro-batch");
    // A publisher counts a batch in just before its send blocks on the full queue: one over.
    assert!(depth.iter().all(|&d| d <= depth_max as f64) && depth.iter().any(|&d| d >= 1.0), "{depth:?}");
}
