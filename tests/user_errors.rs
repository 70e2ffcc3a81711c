//! Bad input and the messages a new user reads: one regression test per defect found by trying
//! the engine as a newcomer would (flags, paths, folders, data files), each named after it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use crate::common::Scratch;
use dflash_engine::faults::FaultPlan;
use dflash_engine::session::{self, RunOptions};
use dflash_engine::train::batch::{build_batch, BatchSpec, Sample};

/// Seconds per run: 2 steps on a few generated samples, written into `out`.
fn quick(out: PathBuf) -> RunOptions {
    let mut o = RunOptions::tiny_default();
    o.data.gen_samples = 8;
    o.data.seq_len = 24;
    o.data.batch_size = 2;
    o.data.anchors = 4;
    o.model.block_size = 4;
    o.train.steps = 2;
    o.output.quiet = true;
    o.output.out = out;
    o
}

fn bin() -> String {
    std::env::var("DFLASH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dflash-engine").to_string())
}

/// Runs the binary; returns the output and stderr as text.
fn cli(args: &[&str], cwd: Option<&Path>) -> (Output, String) {
    let mut c = Command::new(bin());
    c.args(args);
    if let Some(d) = cwd {
        c.current_dir(d);
    }
    let out = c.output().expect("the binary runs");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, err)
}

const QUICK_ARGS: &[&str] = &[
    "--gen-samples",
    "8",
    "--seq-len",
    "24",
    "--batch-size",
    "2",
    "--anchors",
    "4",
    "--block-size",
    "4",
    "--steps",
    "2",
];

fn run_args<'a>(out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["run", "--out", out];
    v.extend_from_slice(QUICK_ARGS);
    v.extend_from_slice(extra);
    v
}

/// `--lr nan` trained, wrote an all-NaN checkpoint and exited 0; `--init-std nan` reported
/// accuracy 1.000; negative and absurd values were accepted. Each now stops the binary before
/// anything is written, naming the flag.
#[test]
fn non_finite_or_out_of_range_flags_stop_before_training() {
    let scratch = Scratch::new("user-non_finite_or_out_of_range_flags_stop_before_training");
    for (flag, value) in [
        ("--lr", "nan"),
        ("--lr", "inf"),
        ("--lr", "1e30"),
        ("--lr", "-1"),
        ("--init-std", "nan"),
        ("--clip", "nan"),
        ("--warmup", "nan"),
        ("--warmup", "-1"),
        ("--gen-temperature", "-1"),
    ] {
        let out = scratch.fresh("bad-flag");
        let o = out.display().to_string();
        let arg = format!("{flag}={value}"); // `--lr -1` would read -1 as a flag
        let (res, err) = cli(&run_args(&o, &[&arg]), None);
        assert!(!res.status.success(), "{flag} {value} must fail: {err}");
        assert!(err.contains(&format!("{flag} ")), "{flag} {value}: the error names the flag: {err}");
        assert!(!out.join("latest").exists(), "{flag} {value}: nothing may be written");
    }
}

/// `--mfu-peak`: a given peak is set against (the summary says "given" and the figure), `off`
/// leaves the column out and says so, and a bad value stops the binary naming the flag.
#[test]
fn mfu_peak_is_given_or_off_or_refused() {
    let scratch = Scratch::new("user-mfu_peak_is_given_or_off_or_refused");
    let out = scratch.fresh("given").display().to_string();
    let (res, err) = cli(&run_args(&out, &["--mfu-peak", "0.05"]), None);
    assert!(res.status.success(), "{err}");
    assert!(err.contains("peak 50.0 GFLOP/s per device, given (--mfu-peak)"), "{err}");
    let line = err.lines().find(|l| l.starts_with("mfu            ")).expect("a summary mfu line");
    assert!(line.contains("of the given peak") && line.contains("(--mfu-peak)"), "{line}");
    let out = scratch.fresh("off").display().to_string();
    let (res, err) = cli(&run_args(&out, &["--mfu-peak", "off"]), None);
    assert!(res.status.success(), "{err}");
    assert!(err.lines().any(|l| l == "mfu            off (--mfu-peak off)"), "{err}");
    let out = scratch.fresh("bad").display().to_string();
    let (res, err) = cli(&run_args(&out, &["--mfu-peak", "fast"]), None);
    assert!(!res.status.success() && err.contains("--mfu-peak") && err.contains("TFLOP/s"), "{err}");
    assert!(!std::path::Path::new(&out).join("latest").exists(), "nothing may be written");
}

/// `run --gen-prompt-len 0` and `gen-data --seq-len` up to 8 panicked in the generator; now they
/// are errors naming the flag, and no file is written.
#[test]
fn degenerate_generation_lengths_are_errors_not_panics() {
    let scratch = Scratch::new("user-degenerate_generation_lengths_are_errors_not_panics");
    let out = scratch.fresh("prompt0").display().to_string();
    let (res, err) = cli(&run_args(&out, &["--gen-prompt-len", "0"]), None);
    assert!(!res.status.success() && err.contains("--gen-prompt-len") && !err.contains("panicked"), "{err}");
    for seq in ["1", "8", "9"] {
        let file = scratch.fresh("gen").with_extension("jsonl");
        let f = file.display().to_string();
        let (res, err) = cli(&["gen-data", "--seq-len", seq, "--samples", "4", "--out", &f], None);
        assert!(!res.status.success(), "--seq-len {seq} must fail: {err}");
        assert!(err.contains("--seq-len") && !err.contains("panicked"), "--seq-len {seq}: {err}");
        // gen-data has no --gen-prompt-len: its error names the prompt's length instead.
        assert!(!err.contains("--gen-prompt-len") && err.contains("prompt tokens"), "--seq-len {seq}: {err}");
        assert!(!file.exists(), "--seq-len {seq}: no file");
    }
    let file = scratch.fresh("gen0").with_extension("jsonl");
    let f = file.display().to_string();
    let (res, err) = cli(&["gen-data", "--samples", "0", "--out", &f], None);
    assert!(!res.status.success() && err.contains("--samples"), "{err}");
    assert!(!file.exists());
    // An existing file (a user's own data.jsonl, say) is kept unless --overwrite.
    std::fs::write(&file, "mine\n").unwrap();
    let (res, err) = cli(&["gen-data", "--samples", "2", "--seq-len", "12", "--out", &f], None);
    assert!(!res.status.success() && err.contains("already exists") && err.contains("--overwrite"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine\n");
    let (res, err) = cli(&["gen-data", "--samples", "2", "--seq-len", "12", "--out", &f, "--overwrite"], None);
    assert!(res.status.success(), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap().lines().count(), 2);
}

/// An absurd `--pad-to-tokens` or `--max-inflight` aborted the process on a multi-terabyte
/// allocation; now the run refuses with the size it would need.
#[test]
fn absurd_sizes_are_refused_with_the_memory_they_need() {
    let scratch = Scratch::new("user-absurd_sizes_are_refused_with_the_memory_they_need");
    let mut o = quick(scratch.fresh("pad"));
    o.data.pad_to_tokens = Some(1 << 40);
    let e = format!("{:#}", session::run(&o, None).expect_err("too large"));
    assert!(e.contains("--pad-to-tokens") && e.contains("GiB"), "{e}");
    let mut o = quick(scratch.fresh("inflight"));
    o.exec.max_inflight = 1 << 30;
    let e = format!("{:#}", session::run(&o, None).expect_err("too large"));
    assert!(e.contains("--max-inflight"), "{e}");
}

/// An `--out` that cannot be written was found at the first checkpoint (100 steps lost), an
/// unwritable `--trace` after the whole run. Both are checked before anything is loaded.
#[test]
fn unwritable_out_and_trace_are_found_before_training() {
    let scratch = Scratch::new("user-unwritable_out_and_trace_are_found_before_training");
    let dir = scratch.fresh("unwritable");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let mut o = quick(scratch.fresh("x"));
    o.output.out = file.join("run");
    let t0 = Instant::now();
    let e = format!("{:#}", session::run(&o, None).expect_err("out under a file"));
    assert!(e.contains("--out"), "{e}");
    assert!(t0.elapsed().as_secs() < 5, "found before loading anything");
    let mut o = quick(scratch.fresh("trace"));
    o.output.trace = Some(file.join("trace.json"));
    let e = format!("{:#}", session::run(&o, None).expect_err("trace under a file"));
    assert!(e.contains("--trace"), "{e}");
    let mut o = quick(scratch.fresh("trace-dir"));
    o.output.trace = Some(dir.clone());
    let e = format!("{:#}", session::run(&o, None).expect_err("trace is a folder"));
    assert!(e.contains("--trace"), "{e}");
}

/// Running again into an `--out` holding checkpoints, without `--resume`, silently restarted and
/// mixed two runs' checkpoints in one folder. Now it refuses and says what to do.
#[test]
fn a_second_run_into_a_run_folder_needs_resume() {
    let scratch = Scratch::new("user-a_second_run_into_a_run_folder_needs_resume");
    let o = quick(scratch.fresh("twice"));
    session::run(&o, None).unwrap();
    let e = format!("{:#}", session::run(&o, None).expect_err("refused"));
    assert!(e.contains("--resume") && e.contains("another --out"), "{e}");
}

/// A resume with another `--target-seed` silently trained against another target; `--warmup`,
/// `--clip` and `--init-std` were not checked; `dir/./data.jsonl` and `dir/data.jsonl` were a
/// mismatch while an edited data file was not. The fingerprint names each differing flag.
#[test]
fn resume_checks_every_setting_that_changes_results() {
    let scratch = Scratch::new("user-resume_checks_every_setting_that_changes_results");
    let dir = scratch.fresh("fp");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("data.jsonl");
    session::gen_data("tiny", 12, 24, session::TINY_INIT_STD, &data, false).unwrap();
    let mut o = quick(scratch.fresh("fp"));
    o.data.path = Some(data.clone());
    o.train.steps = 4;
    o.output.stop_after = Some(2);
    session::run(&o, None).unwrap();
    let resume = |f: &dyn Fn(&mut RunOptions)| {
        let mut r = o.clone();
        r.output.resume = true;
        r.output.stop_after = Some(3);
        f(&mut r);
        session::run(&r, None)
    };
    for (flag, f) in [
        ("--target-seed", &(|r: &mut RunOptions| r.model.target_seed = 1) as &dyn Fn(&mut RunOptions)),
        ("--warmup", &|r: &mut RunOptions| r.train.warmup_frac = 0.5),
        ("--clip", &|r: &mut RunOptions| r.train.clip = 0.5),
        ("--init-std", &|r: &mut RunOptions| r.model.init_std = 0.1),
    ] {
        let e = format!("{:#}", resume(f).expect_err(flag));
        assert!(e.contains(&format!("--{}:", flag.trim_start_matches("--"))), "{flag}: {e}");
    }
    // Another spelling of the same file resumes; execution settings may change.
    let same = dir.join(".").join("data.jsonl");
    let r = resume(&|r: &mut RunOptions| {
        r.data.path = Some(same.clone());
        r.exec.max_inflight = 3;
    })
    .expect("same data, another path");
    assert_eq!(r.first_step, 2);
    // Edited content does not.
    let mut text = std::fs::read_to_string(&data).unwrap();
    text = text.replacen("\"input_ids\":[", "\"input_ids\":[1,", 1).replacen("\"loss_mask\":[", "\"loss_mask\":[0,", 1);
    std::fs::write(&data, text).unwrap();
    let e = format!("{:#}", resume(&|_| {}).expect_err("edited data"));
    assert!(e.contains("--data:"), "{e}");
}

/// `--anchors` beyond a sequence's candidates cost as if all were used (1000 anchors on 24-token
/// samples: 26x the time and 400x the memory of 16, for the same loss). A batch now has as many
/// block slots per sequence as the most anchors any of its sequences drew.
#[test]
fn anchors_beyond_the_candidates_cost_nothing() {
    let scratch = Scratch::new("user-anchors_beyond_the_candidates_cost_nothing");
    let s = Sample { input_ids: (0..24).collect(), loss_mask: [vec![0; 8], vec![1; 16]].concat() };
    let spec = |n: usize| BatchSpec {
        anchors_per_seq: n,
        block_size: 4,
        mask_token_id: 99,
        gamma: 7.0,
        pad_to_tokens: None,
        seed: 1,
    };
    let few = build_batch(&[s.clone(), s.clone()], &spec(16), 0, 0).unwrap();
    let many = build_batch(&[s.clone(), s], &spec(1000), 0, 0).unwrap();
    assert_eq!(few.num_blocks, 2 * 15, "15 candidates per sequence");
    assert_eq!(many.num_blocks, few.num_blocks);
    assert_eq!(many.anchors, few.anchors);
    let mut a = quick(scratch.fresh("anchors-16"));
    a.data.anchors = 16;
    let mut b = quick(scratch.fresh("anchors-1000"));
    b.data.anchors = 1000;
    let (ra, rb) = (session::run(&a, None).unwrap(), session::run(&b, None).unwrap());
    assert_eq!(crate::common::losses(&ra), crate::common::losses(&rb));
}

/// The error headline was the leak check ("the run stopped (...)") with the cause under
/// "Caused by"; now the cause comes first.
#[test]
fn a_failed_run_leads_with_its_cause() {
    let scratch = Scratch::new("user-a_failed_run_leads_with_its_cause");
    let mut o = quick(scratch.fresh("cause"));
    o.exec.faults = FaultPlan { producer_error_at: Some(1), ..Default::default() };
    let e = session::run(&o, None).expect_err("fails");
    let head = e.to_string();
    assert!(head.starts_with("target side (producer) failed at step 2"), "{head}");
    assert!(head.contains("leak check: no leaked slot or block"), "{head}");
}

/// A config.json that is not JSON printed serde's message twice (in the message, and again as
/// its cause); each cause now appears once.
#[test]
fn a_cause_is_printed_once() {
    let scratch = Scratch::new("user-a_cause_is_printed_once");
    let dir = scratch.fresh("model");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"qwen3\"").unwrap();
    let out = scratch.fresh("run").display().to_string();
    let (res, err) = cli(&run_args(&out, &["--target", &dir.display().to_string()]), None);
    assert!(!res.status.success());
    assert_eq!(err.matches("EOF while parsing").count(), 1, "{err}");
    assert!(err.contains("Caused by:") && err.contains("config.json: not valid JSON"), "{err}");
}

/// `--target FILE` said the file "does not exist"; a local folder named like a preset silently
/// shadowed the preset; the data line said "greedy" when sampling.
#[test]
fn target_and_data_lines_say_what_was_used() {
    let scratch = Scratch::new("user-target_and_data_lines_say_what_was_used");
    let dir = scratch.fresh("names");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    std::fs::write(&file, b"not a folder").unwrap();
    let mut o = quick(scratch.fresh("file"));
    o.model.target = file.display().to_string();
    let e = format!("{:#}", session::run(&o, None).expect_err("a file"));
    assert!(e.contains("is a file") && !e.contains("does not exist"), "{e}");

    let (res, err) = cli(&["init-model", "--preset", "tiny", "--out", "tiny"], Some(&dir));
    assert!(res.status.success(), "{err}");
    // A preset's random-weight flags do nothing for a folder: refused, naming the flag.
    for flag in ["--init-std", "--target-seed"] {
        let out = dir.join("seeded").display().to_string();
        let (res, err) = cli(&run_args(&out, &["--target", "./tiny", flag, "1"]), Some(&dir));
        assert!(!res.status.success() && err.contains(flag) && err.contains("not a preset"), "{flag}: {err}");
    }
    let (res, err) =
        cli(&["eval", "--drafter", "random", "--device", "cpu", "--target", "./tiny", "--init-std", "1"], Some(&dir));
    assert!(!res.status.success() && err.contains("--init-std") && err.contains("not a preset"), "{err}");
    let (res, err) = cli(&["gen-data", "--target", "./tiny", "--init-std", "1", "--out", "g.jsonl"], Some(&dir));
    assert!(!res.status.success() && err.contains("--init-std") && err.contains("not a preset"), "{err}");
    for bench in ["bench-decode", "bench-target"] {
        let (res, err) = cli(&[bench, "--device", "cpu", "--target", "./tiny", "--init-std", "1"], Some(&dir));
        assert!(!res.status.success() && err.contains("--init-std") && err.contains("not a preset"), "{bench}: {err}");
    }
    let out = dir.join("run").display().to_string();
    let (res, err) = cli(&run_args(&out, &["--target", "tiny", "--gen-temperature", "0.7"]), Some(&dir));
    assert!(res.status.success(), "{err}");
    assert!(err.contains("using the folder ./tiny"), "{err}");
    assert!(err.contains("sampled at temperature 0.7") && !err.contains("greedy"), "{err}");
}

/// `--quiet` hid the header and the summary, though it is documented to hide only the progress
/// bar and the step lines.
#[test]
fn quiet_hides_only_the_bar_and_the_step_lines() {
    let scratch = Scratch::new("user-quiet_hides_only_the_bar_and_the_step_lines");
    let out = scratch.fresh("quiet").display().to_string();
    let (res, err) = cli(&run_args(&out, &["--quiet"]), None);
    assert!(res.status.success(), "{err}");
    assert!(err.contains("backend ") && err.contains("== run summary"), "{err}");
    assert!(!err.contains("  step |"), "{err}");
    let out = scratch.fresh("loud").display().to_string();
    let (_, err) = cli(&run_args(&out, &[]), None);
    assert!(err.contains("  step |"), "{err}");
}

/// The summary said "queue mean depth 2.31 of 3" with `--max-inflight 2`: the depth counted a
/// batch still waiting to enter the queue. It is now at most the queue's capacity.
#[test]
fn queue_depth_never_exceeds_max_inflight() {
    let scratch = Scratch::new("user-queue_depth_never_exceeds_max_inflight");
    let mut o = quick(scratch.fresh("depth"));
    o.train.steps = 6;
    o.exec.max_inflight = 2;
    let r = session::run(&o, None).unwrap();
    assert_eq!(r.stats.queue_capacity, 2);
    assert!(r.stats.queue_depth.iter().all(|&d| d <= 2), "{:?}", r.stats.queue_depth);
    assert!(r.stats.mean_queue_depth() <= 2.0);
}

/// `inspect RUN_DIR` did not follow `latest`: it now shows the run's latest checkpoint.
#[test]
fn inspect_follows_latest_in_a_run_folder() {
    let scratch = Scratch::new("user-inspect_follows_latest_in_a_run_folder");
    let o = quick(scratch.fresh("inspect"));
    session::run(&o, None).unwrap();
    let (res, err) = cli(&["inspect", &o.output.out.display().to_string()], None);
    let text = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{err}");
    assert!(text.contains("latest checkpoint step-00000002") && text.contains("drafter:"), "{text}");
    assert!(text.contains("fc.weight"), "{text}");
    // Without `latest` (what resume's advice for a broken one leads to) the newest step-* folder
    // is shown, as resume and --init-from take it; eval reads the folder the same way.
    std::fs::remove_file(o.output.out.join("latest")).unwrap();
    let (res, err) = cli(&["inspect", &o.output.out.display().to_string()], None);
    let text = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success() && text.contains("latest checkpoint step-00000002"), "{text}{err}");
    // A reader that stops early (`inspect DIR | head -1`) ends it quietly, without a panic.
    let mut child = Command::new(bin())
        .args(["inspect", &o.output.out.display().to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let done = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success() && !err.contains("panicked"), "{err}");
    // A file is not a folder to inspect.
    let (res, err) = cli(&["inspect", &o.output.out.join("metrics.jsonl").display().to_string()], None);
    assert!(!res.status.success() && err.contains("not a folder"), "{err}");
    // A drafter folder without its weights says so (not how to make a random target).
    let part = scratch.fresh("config-only");
    std::fs::create_dir_all(&part).unwrap();
    std::fs::copy(o.output.out.join("step-00000002/config.json"), part.join("config.json")).unwrap();
    let (res, err) = cli(&["inspect", &part.display().to_string()], None);
    assert!(!res.status.success() && err.contains("without its weights") && !err.contains("init-model"), "{err}");
    // A run without checkpoints shows its last metrics and says why there is nothing more.
    let mut o = quick(scratch.fresh("no-checkpoint"));
    o.output.checkpoints = false;
    session::run(&o, None).unwrap();
    let (res, err) = cli(&["inspect", &o.output.out.display().to_string()], None);
    let text = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{err}");
    assert!(text.contains("step 2") && text.contains("no checkpoint (the run had --no-checkpoint"), "{text}");
}

/// `--drafter-config` replaces the drafter flags: giving both is refused by name instead of one
/// silently winning; a recipe for another target names the field that does not fit.
#[test]
fn drafter_config_conflicts_and_mismatches_are_named() {
    let scratch = Scratch::new("user-drafter_config_conflicts_and_mismatches_are_named");
    let (out, err) = cli(&["run", "--drafter-config", "qwen3-8b", "--drafter-layers", "3"], None);
    assert!(!out.status.success());
    assert!(err.contains("--drafter-layers") && err.contains("--drafter-config"), "{err}");
    let mut o = quick(scratch.fresh("recipe-mismatch"));
    o.model.drafter_config = Some("qwen3.6-27b".into());
    let e = format!("{:#}", session::run(&o, None).unwrap_err());
    assert!(
        e.contains("--drafter-config qwen3.6-27b") && e.contains("hidden_size is 5120 in the drafter but 64"),
        "{e}"
    );
}

/// A bad data line, a finished run's `--resume` and a missing `--init-from` were found only after
/// the target had loaded (minutes at 27B); a finished run's resume printed an empty summary. Each
/// now stops before the load, saying what to do.
#[test]
fn data_resume_and_warm_start_mistakes_stop_before_the_load() {
    let scratch = Scratch::new("user-data_resume_and_warm_start_mistakes_stop_before_the_load");
    let dir = scratch.fresh("files");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("bad.jsonl");
    std::fs::write(&data, "{\"input_ids\": [1, 2, 3], \"loss_mask\": [0, 1, 1]}\n{\"input_ids\": [1, 2\n").unwrap();
    let out = scratch.fresh("bad").display().to_string();
    let d = data.display().to_string();
    let mut args: Vec<&str> = vec!["run", "--out", &out, "--data", &d];
    args.extend(QUICK_ARGS.iter().skip(2)); // all but --gen-samples, which --data rules out
    let (res, err) = cli(&args, None);
    assert!(!res.status.success() && err.contains("line 2"), "{err}");
    // Samples longer than --seq-len are cut, and the data line says how many.
    let good = dir.join("long.jsonl");
    let line = |n: u32| {
        format!("{{\"input_ids\": {:?}, \"loss_mask\": {:?}}}\n", (1..=n).collect::<Vec<_>>(), vec![1; n as usize])
    };
    std::fs::write(&good, [line(40), line(10), line(30)].concat()).unwrap();
    let g = good.display().to_string();
    let out_long = scratch.fresh("long").display().to_string();
    let mut args: Vec<&str> = vec!["run", "--quiet", "--no-checkpoint", "--out", &out_long, "--data", &g];
    args.extend(QUICK_ARGS.iter().skip(2));
    let (res, err) = cli(&args, None);
    assert!(res.status.success(), "{err}");
    assert!(
        err.contains("data      3 samples, 58 tokens (2 longer than --seq-len 24 cut to their first 24 tokens)"),
        "{err}"
    );
    // A generator flag beside --data would be ignored: it is refused instead.
    let (res, err) = cli(&run_args(&out, &["--data", &d]), None);
    assert!(!res.status.success() && err.contains("--gen-samples") && err.contains("--data"), "{err}");
    assert!(!err.contains("loaded "), "the data is read before the target loads: {err}");

    let missing = dir.join("no-such-run").display().to_string();
    let out = scratch.fresh("init").display().to_string();
    let (res, err) = cli(&run_args(&out, &["--init-from", &missing]), None);
    assert!(!res.status.success() && err.contains("no-such-run"), "{err}");
    assert!(!err.contains("loaded "), "the warm start is checked before the target loads: {err}");
    assert!(!Path::new(&out).exists(), "a refused run leaves no empty --out behind");

    let mut o = quick(scratch.fresh("done"));
    session::run(&o, None).unwrap();
    o.output.resume = true;
    let e = format!("{:#}", session::run(&o, None).expect_err("nothing left to train"));
    assert!(e.contains("is complete") && e.contains("--init-from"), "{e}");
    // What it advises works.
    let mut more = quick(scratch.fresh("more"));
    more.model.init_from = Some(o.output.out.clone());
    let r = session::run(&more, None).expect("a new run from the finished one's weights");
    assert_eq!(r.history.len(), 2);
}

/// `init-model` into a folder holding a model replaced it without a word (and left a stale shard
/// index that a loader would follow); `--init-std 0` wrote an all-zero model.
#[test]
fn init_model_keeps_an_existing_model_unless_told() {
    let scratch = Scratch::new("user-init_model_keeps_an_existing_model_unless_told");
    let dir = scratch.fresh("model");
    let d = dir.display().to_string();
    let (res, err) = cli(&["init-model", "--preset", "tiny", "--out", &d], None);
    assert!(res.status.success(), "{err}");
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(&index, "{}").unwrap();
    let before = std::fs::read(dir.join("model.safetensors")).unwrap();
    let (res, err) = cli(&["init-model", "--preset", "tiny", "--seed", "1", "--out", &d], None);
    assert!(!res.status.success() && err.contains("already holds a model") && err.contains("--overwrite"), "{err}");
    assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), before, "left as it was");
    let (res, err) = cli(&["init-model", "--preset", "tiny", "--seed", "1", "--out", &d, "--overwrite"], None);
    assert!(res.status.success(), "{err}");
    assert!(!index.exists(), "the stale index is gone");
    assert_ne!(std::fs::read(dir.join("model.safetensors")).unwrap(), before, "a new model");
    let other = scratch.fresh("zero").display().to_string();
    let (res, err) = cli(&["init-model", "--init-std", "0", "--out", &other], None);
    assert!(!res.status.success() && err.contains("--init-std 0"), "{err}");
}

/// `eval --num-prompts 0` panicked; an `--out` in a missing folder failed after all the decoding;
/// `--init-std 0` decoded against an all-zero target; `bench-pipeline --steps 2` printed a table
/// of zeros.
#[test]
fn eval_and_bench_arguments_are_checked_first() {
    let scratch = Scratch::new("user-eval_and_bench_arguments_are_checked_first");
    let eval = |extra: &[&str]| {
        let mut a = vec!["eval", "--drafter", "random", "--device", "cpu", "--quiet"];
        a.extend_from_slice(extra);
        cli(&a, None)
    };
    let (res, err) = eval(&["--num-prompts", "0"]);
    assert!(!res.status.success() && err.contains("--num-prompts 0") && !err.contains("panicked"), "{err}");
    // A folder that cannot be made: one under a file.
    let file = scratch.fresh("a-file");
    std::fs::write(&file, b"x").unwrap();
    let out = file.join("eval.json").display().to_string();
    let t0 = Instant::now();
    let (res, err) = eval(&["--out", &out]);
    assert!(
        !res.status.success() && err.contains("--out") && err.contains("a-file") && !err.contains("accept"),
        "{err}"
    );
    assert!(t0.elapsed().as_secs() < 10, "refused before decoding");
    let (res, err) = eval(&["--init-std", "0"]);
    assert!(!res.status.success() && err.contains("--init-std 0"), "{err}");
    let out = scratch.fresh("bench").display().to_string();
    let mut a = vec!["bench-pipeline", "--device", "cpu", "--out", &out];
    a.extend_from_slice(QUICK_ARGS);
    let (res, err) = cli(&a, None);
    assert!(!res.status.success() && err.contains("--steps 2") && err.contains("--steps 3"), "{err}");
    a.extend_from_slice(&["--stop-after", "1"]);
    let (res, err) = cli(&a, None);
    assert!(!res.status.success() && err.contains("drop --resume and --stop-after"), "{err}");
}

/// On the CPU backend (which stands in for several devices), `bench-pipeline --target-gpus 0,1`
/// failed on its own serial-update row and `--drafter-gpus 1` was refused as needing CUDA; both
/// now give the whole table, the two-device rows included, and say that the raw peer copy rate
/// needs CUDA devices.
#[test]
fn bench_pipeline_runs_two_device_rows_on_the_cpu() {
    let scratch = Scratch::new("user-bench_pipeline_runs_two_device_rows_on_the_cpu");
    for list in [["--target-gpus", "0,1"], ["--drafter-gpus", "1"]] {
        let out = scratch.fresh("bench").display().to_string();
        let mut a = vec!["bench-pipeline", "--device", "cpu", "--out", &out];
        a.extend_from_slice(&QUICK_ARGS[..QUICK_ARGS.len() - 2]); // all but --steps 2
        a.extend_from_slice(&["--steps", "3", "--grad-accum", "2"]);
        a.extend_from_slice(&list);
        let (res, err) = cli(&a, None);
        let table = String::from_utf8_lossy(&res.stdout);
        assert!(res.status.success(), "{list:?}: {err}");
        for row in [
            "| sync | 0 |",
            "| sync serial update | 0 |",
            "| async p2p | 0->1 |",
            "| async p2p, 2 targets + 2 drafter ranks | 0,1->0,1 |",
        ] {
            assert!(table.contains(row), "{list:?}: no row {row}\n{table}");
        }
        assert!(err.contains("raw peer copy: needs CUDA devices"), "{err}");
    }
}
