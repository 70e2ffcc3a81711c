//! The run's record: `metrics.jsonl` across stop and resume (deterministic fields equal to the
//! uninterrupted run's, no gap, no duplicate, torn lines repaired), the TensorBoard event files
//! (read back by an independent reader that checks both checksums of every record and applies
//! TensorBoard's restart rule), `plot` (PNG and SVG, one and two runs, refusals) and `inspect`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::Scratch;
use dflash_engine::plot::{self, PlotError};
use dflash_engine::session::{self, RunOptions};
use dflash_engine::train::metrics::{read_records, MetricsLog, MetricsRecord, METRICS_FILE, TENSORBOARD_DIR};

fn bin() -> String {
    std::env::var("DFLASH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dflash-engine").to_string())
}

/// The configuration of `tests/run.rs`'s equality tests: 8 steps in seconds, writing into `out`.
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

/// The fields a resumed run reproduces exactly (everything but the timings), as bits.
type Deterministic = (u32, u64, u64, u64, u64, u32, bool);

fn deterministic(recs: &[MetricsRecord]) -> Vec<Deterministic> {
    recs.iter()
        .map(|r| {
            (
                r.step,
                r.loss.to_bits(),
                r.accuracy.to_bits(),
                r.accept_len.to_bits(),
                r.grad_norm.to_bits(),
                r.lr.to_bits(),
                r.skipped,
            )
        })
        .collect()
}

fn records(dir: &Path) -> Vec<MetricsRecord> {
    read_records(&dir.join(METRICS_FILE)).unwrap()
}

// ---- An event-file reader written from the format's definition, independent of the writer ----

/// CRC-32C bit by bit (the writer uses a table).
fn crc32c(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 == 1 { (c >> 1) ^ 0x82f6_3b78 } else { c >> 1 };
        }
    }
    !c
}

fn masked(c: u32) -> u32 {
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

enum Wire<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Bytes(&'a [u8]),
    Fixed32([u8; 4]),
}

/// The (field number, value) pairs of one protobuf message.
fn fields(mut b: &[u8]) -> Vec<(u64, Wire<'_>)> {
    fn varint(b: &mut &[u8]) -> u64 {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = b[0];
            *b = &b[1..];
            v |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return v;
            }
        }
        panic!("varint longer than 10 bytes");
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b);
        let w = match key & 7 {
            0 => Wire::Varint(varint(&mut b)),
            1 => {
                let (x, rest) = b.split_at(8);
                b = rest;
                Wire::Fixed64(x.try_into().unwrap())
            }
            2 => {
                let n = varint(&mut b) as usize;
                let (x, rest) = b.split_at(n);
                b = rest;
                Wire::Bytes(x)
            }
            5 => {
                let (x, rest) = b.split_at(4);
                b = rest;
                Wire::Fixed32(x.try_into().unwrap())
            }
            t => panic!("unexpected wire type {t}"),
        };
        out.push((key >> 3, w));
    }
    out
}

#[derive(Debug, Default)]
struct Event {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    session_start: bool,
    scalars: Vec<(String, f32)>,
}

/// Every event of one file; every record's length and data checksums must match.
fn read_event_file(path: &Path) -> Vec<Event> {
    let bytes = std::fs::read(path).unwrap();
    let mut at = 0;
    let mut out = Vec::new();
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        assert_eq!(masked(crc32c(len_bytes)), u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()));
        let data = &bytes[at + 12..at + 12 + len];
        let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(masked(crc32c(data)), crc, "{}: record {} data checksum", path.display(), out.len());
        at += 16 + len;
        let mut e = Event::default();
        for (f, w) in fields(data) {
            match (f, w) {
                (1, Wire::Fixed64(x)) => e.wall_time = f64::from_le_bytes(x),
                (2, Wire::Varint(v)) => e.step = v as i64,
                (3, Wire::Bytes(s)) => e.file_version = Some(String::from_utf8(s.to_vec()).unwrap()),
                (5, Wire::Bytes(summary)) => {
                    for (f, w) in fields(summary) {
                        let (1, Wire::Bytes(value)) = (f, w) else { panic!("Summary field {f}") };
                        let (mut tag, mut v) = (String::new(), None);
                        for (f, w) in fields(value) {
                            match (f, w) {
                                (1, Wire::Bytes(t)) => tag = String::from_utf8(t.to_vec()).unwrap(),
                                (2, Wire::Fixed32(x)) => v = Some(f32::from_le_bytes(x)),
                                (f, _) => panic!("Summary.Value field {f}"),
                            }
                        }
                        e.scalars.push((tag, v.expect("a simple_value")));
                    }
                }
                (7, Wire::Bytes(log)) => {
                    e.session_start = fields(log).iter().any(|(f, w)| *f == 1 && matches!(w, Wire::Varint(1)));
                }
                (f, _) => panic!("unexpected Event field {f}"),
            }
        }
        out.push(e);
    }
    out
}

/// Per tag, the (step, value) points TensorBoard shows.
type View = BTreeMap<String, Vec<(i64, f32)>>;

/// What TensorBoard shows for a folder of event files: files in name order, each must open with
/// its file version; a `SessionLog.START` at step s drops everything seen with a step >= s.
fn tensorboard_view(dir: &Path) -> (View, Vec<Vec<Event>>) {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let mut view = View::new();
    let mut all = Vec::new();
    for f in &files {
        assert!(f.file_name().unwrap().to_str().unwrap().contains("tfevents"), "{}", f.display());
        let events = read_event_file(f);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"), "{}", f.display());
        for e in &events {
            assert!(e.wall_time > 1.5e9, "wall time {} is not a Unix time", e.wall_time);
            if e.session_start {
                for points in view.values_mut() {
                    points.retain(|p| p.0 < e.step);
                }
            }
            for (tag, v) in &e.scalars {
                view.entry(tag.clone()).or_default().push((e.step, *v));
            }
        }
        all.push(events);
    }
    (view, all)
}

/// The event files of `dir` show exactly the metrics file's steps and values, once each.
fn assert_tensorboard_matches(dir: &Path, recs: &[MetricsRecord]) -> Vec<Vec<Event>> {
    let (view, files) = tensorboard_view(&dir.join(TENSORBOARD_DIR));
    let want =
        |f: fn(&MetricsRecord) -> f32| -> Vec<(i64, f32)> { recs.iter().map(|r| (i64::from(r.step), f(r))).collect() };
    assert_eq!(view["train/loss"], want(|r| r.loss as f32));
    assert_eq!(view["train/accuracy"], want(|r| r.accuracy as f32));
    assert_eq!(view["train/accept_len"], want(|r| r.accept_len as f32));
    assert_eq!(view["train/round_accept_len"], want(|r| r.round_accept_len as f32));
    assert_eq!(view["train/lr"], want(|r| r.lr));
    // Timings are not reproducible, but the event file holds the run's own values.
    let steps: Vec<i64> = view["perf/tokens_per_s"].iter().map(|p| p.0).collect();
    assert_eq!(steps, recs.iter().map(|r| i64::from(r.step)).collect::<Vec<_>>());
    assert_eq!(view.len(), 13, "{:?}", view.keys().collect::<Vec<_>>());
    files
}

// ---- Tests ----

/// Stopping after step 4 and resuming gives the uninterrupted run's metrics file on every
/// deterministic field, line for line, steps 1..=8 once each; TensorBoard shows the same values.
#[test]
fn resumed_metrics_equal_the_uninterrupted_runs() {
    let scratch = Scratch::new("metrics-resumed_metrics_equal_the_uninterrupted_runs");
    let full = {
        let mut ro = small(scratch.fresh("metrics-full"));
        ro.output.tensorboard = false;
        ro
    };
    let a = session::run(&full, None).unwrap();
    assert!(!full.output.out.join(TENSORBOARD_DIR).exists(), "tensorboard: false writes no event files");
    let part = {
        let mut ro = small(scratch.fresh("metrics-part"));
        ro.output.stop_after = Some(4);
        ro
    };
    session::run(&part, None).unwrap();
    assert_eq!(records(&part.output.out).len(), 4);
    session::run(
        &{
            let mut ro = part.clone();
            ro.output.resume = true;
            ro.output.stop_after = None;
            ro
        },
        None,
    )
    .unwrap();

    let (ra, rb) = (records(&full.output.out), records(&part.output.out));
    assert_eq!(rb.iter().map(|r| r.step).collect::<Vec<_>>(), (1..=8).collect::<Vec<_>>());
    assert_eq!(deterministic(&ra), deterministic(&rb));
    // The records are the run's own numbers (a JSON round trip of f64 is exact to the last bit
    // only with serde_json's float_roundtrip; 1e-15 relative is far below any real difference).
    for (m, r) in a.history.iter().zip(&ra) {
        assert_eq!((m.step + 1, m.lr, m.skipped), (r.step, r.lr, r.skipped));
        for (x, y) in
            [(m.loss, r.loss), (m.accuracy, r.accuracy), (m.accept_len, r.accept_len), (m.grad_norm, r.grad_norm)]
        {
            assert!((x - y).abs() <= 1e-15 * x.abs(), "step {}: {x} vs {y}", r.step);
        }
        assert!(r.tokens_per_s > 0.0 && r.step_ms > 0.0, "{r:?}");
        assert!((0.0..=1.0).contains(&r.target_idle) && (0.0..=1.0).contains(&r.drafter_idle), "{r:?}");
    }

    let files = assert_tensorboard_matches(&part.output.out, &rb);
    assert_eq!(files.len(), 2, "the resumed run starts a new event file");
    assert!(files[1][1].session_start && files[1][1].step == 5, "the resumed file marks its restart at step 5");

    // `inspect` on the run folder: the last metrics line, then the latest checkpoint.
    let out = Command::new(bin()).arg("inspect").arg(&part.output.out).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("metrics: 8 steps logged; last: step 8 loss"), "{text}");
    assert!(text.contains("drafter: "), "{text}");
}

/// A run killed after logging steps past its last checkpoint, in the middle of a line: the resumed
/// run drops the torn line and those steps (file and TensorBoard), and the result is the
/// uninterrupted run's.
#[test]
fn steps_past_the_checkpoint_and_a_torn_line_give_way_on_resume() {
    let scratch = Scratch::new("metrics-steps_past_the_checkpoint_and_a_torn_line_give_way_on_resume");
    let opts = small(scratch.fresh("metrics-torn"));
    session::run(
        &{
            let mut ro = opts.clone();
            ro.output.stop_after = Some(4);
            ro
        },
        None,
    )
    .unwrap();
    // Steps 5 and 6 logged but never checkpointed, as by a kill between checkpoints...
    session::run(
        &{
            let mut ro = opts.clone();
            ro.output.resume = true;
            ro.output.stop_after = Some(6);
            ro.output.checkpoints = false;
            ro
        },
        None,
    )
    .unwrap();
    assert_eq!(records(&opts.output.out).len(), 6);
    // ...then killed in the middle of step 7's line.
    let path = opts.output.out.join(METRICS_FILE);
    let mut text = std::fs::read_to_string(&path).unwrap();
    let line7 = text.lines().nth(5).unwrap().replace("\"step\":6", "\"step\":7");
    text.push_str(&line7[..line7.len() / 2]);
    std::fs::write(&path, &text).unwrap();

    session::run(
        &{
            let mut ro = opts.clone();
            ro.output.resume = true;
            ro
        },
        None,
    )
    .unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.ends_with('\n'));
    let recs = records(&opts.output.out);
    assert_eq!(recs.iter().map(|r| r.step).collect::<Vec<_>>(), (1..=8).collect::<Vec<_>>());
    let full = small(scratch.fresh("metrics-torn-ref"));
    session::run(&full, None).unwrap();
    assert_eq!(deterministic(&recs), deterministic(&records(&full.output.out)));

    let files = assert_tensorboard_matches(&opts.output.out, &recs);
    assert_eq!(files.len(), 3);
    // The second file still holds the orphaned steps 5 and 6; the third file's start event at
    // step 5 is what supersedes them.
    assert_eq!(files[1].iter().filter(|e| !e.scalars.is_empty()).map(|e| e.step).collect::<Vec<_>>(), [5, 6]);
    assert!(files[2][1].session_start && files[2][1].step == 5);

    // A fresh run (no --resume) into a folder that holds checkpoints is refused: two runs never
    // mix their checkpoints or their records.
    let e = session::run(
        &{
            let mut ro = opts.clone();
            ro.train.steps = 2;
            ro
        },
        None,
    )
    .expect_err("refused without --resume");
    assert!(format!("{e:#}").contains("--resume"), "{e:#}");
    assert_eq!(deterministic(&records(&opts.output.out)), deterministic(&recs), "the record is untouched");
}

fn synthetic_run(dir: &Path, steps: u32, scale: f64) {
    let mut log = MetricsLog::open(dir, 0, false).unwrap();
    for step in 1..=steps {
        let x = f64::from(step);
        let skipped = step == steps / 2;
        log.append(&MetricsRecord {
            step,
            loss: if skipped { f64::NAN } else { scale * (5.0 / (1.0 + 0.05 * x) + 0.3 * (x * 1.7).sin()) },
            accuracy: 0.6 * (1.0 - (-x / 30.0).exp()),
            accept_len: 1.0 + 4.0 * (1.0 - (-x / 40.0).exp()),
            round_accept_len: 1.0 + 2.0 * (1.0 - (-x / 40.0).exp()),
            grad_norm: 1.0,
            lr: 1e-3,
            skipped,
            step_ms: 50.0,
            tokens_per_s: 20_000.0 + 1000.0 * (x * 0.3).cos(),
            draft_positions_per_s: 9000.0,
            target_idle: 0.1,
            drafter_idle: 0.05,
            queue_depth: 1.0,
            time: 1.8e9 + x,
        })
        .unwrap();
    }
}

/// `plot` writes a PNG that decodes to the figure's size and an SVG naming the runs, for one run
/// and for two (with a skipped step's NaN loss in each).
#[test]
fn plot_writes_png_and_svg_for_one_and_two_runs() {
    let scratch = Scratch::new("metrics-plot_writes_png_and_svg_for_one_and_two_runs");
    let root = scratch.fresh("plot");
    let (alpha, beta) = (root.join("alpha"), root.join("beta"));
    synthetic_run(&alpha, 120, 1.0);
    synthetic_run(&beta, 80, 0.8);
    for (runs, n) in [(vec![alpha.clone()], 1), (vec![alpha.clone(), beta.clone()], 2)] {
        let png_path = root.join(format!("curves-{n}.png"));
        plot::plot(&runs, &png_path, 0.9).unwrap();
        let bytes = std::fs::read(&png_path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let mut decoder = png::Decoder::new(std::io::Cursor::new(&bytes));
        decoder.set_transformations(png::Transformations::EXPAND); // palette -> RGB
        let mut reader = decoder.read_info().unwrap();
        let mut pixels = vec![0u8; reader.output_buffer_size().unwrap()];
        let frame = reader.next_frame(&mut pixels).unwrap();
        assert_eq!((frame.width, frame.height), plot::SIZE);
        // Something was drawn in the runs' colours, not only a white page.
        let blue = pixels.chunks(3).filter(|p| p == &[31, 119, 180]).count();
        let orange = pixels.chunks(3).filter(|p| p == &[255, 127, 14]).count();
        assert!(blue > 1000, "{blue} pixels of the first run's colour");
        assert_eq!(orange > 1000, n == 2, "{orange} pixels of the second run's colour");

        let svg_path = root.join(format!("curves-{n}.svg"));
        plot::plot(&runs, &svg_path, 0.5).unwrap();
        let svg = std::fs::read_to_string(&svg_path).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{}", &svg[..80.min(svg.len())]);
        for label in ["loss", "accuracy", "acceptance length", "tokens/s", "alpha"] {
            assert!(svg.contains(label), "the SVG has no text {label:?}");
        }
        // The SVG backend writes each text's content on a line of its own.
        assert_eq!(svg.lines().any(|l| l.trim() == "beta"), n == 2);
    }
}

/// `plot` refuses a folder without metrics.jsonl (naming it and saying that a run writes it), an
/// empty metrics file, an unknown image format and a smoothing weight outside [0, 1).
#[test]
fn plot_refuses_what_it_cannot_draw() {
    let scratch = Scratch::new("metrics-plot_refuses_what_it_cannot_draw");
    let root = scratch.fresh("plot-refuse");
    let (good, empty_dir, empty_file) = (root.join("good"), root.join("no-metrics"), root.join("no-steps"));
    synthetic_run(&good, 10, 1.0);
    std::fs::create_dir_all(&empty_dir).unwrap();
    std::fs::create_dir_all(&empty_file).unwrap();
    std::fs::write(empty_file.join(METRICS_FILE), "").unwrap();
    let out = root.join("x.png");

    let err = plot::plot(&[good.clone(), empty_dir.clone()], &out, 0.9).unwrap_err();
    assert!(matches!(err, PlotError::NoMetrics { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains(&empty_dir.display().to_string()) && msg.contains(METRICS_FILE) && msg.contains("run"),
        "{msg}"
    );
    assert!(!out.exists(), "nothing is written when a folder is refused");
    // The metrics file itself, given for its folder, names the folder to give instead.
    let err = plot::plot(&[good.join(METRICS_FILE)], &out, 0.9).unwrap_err().to_string();
    assert!(err.contains("a file; give the run folder") && err.contains(&format!("plot {}`", good.display())), "{err}");
    assert!(matches!(plot::plot(&[empty_file], &out, 0.9), Err(PlotError::NoSteps { .. })));
    assert!(matches!(plot::plot(std::slice::from_ref(&good), &root.join("x.jpg"), 0.9), Err(PlotError::Format { .. })));
    assert!(matches!(plot::plot(std::slice::from_ref(&good), &out, 1.0), Err(PlotError::Smooth(_))));

    // The command line: a non-zero exit and the message on stderr.
    let o = Command::new(bin()).arg("plot").arg(&empty_dir).arg("--out").arg(&out).output().unwrap();
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains(&empty_dir.display().to_string()) && stderr.contains(METRICS_FILE), "{stderr}");
    let o = Command::new(bin()).arg("plot").arg(&good).arg("--out").arg(&out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.is_file());
}

/// A run folder holding `eval.json` gets its eval result on the acceptance panel (real decoding's
/// tokens per round and training's metric on the same outputs, labelled), and a malformed
/// `eval.json` is refused by name.
#[test]
fn plot_marks_the_eval_result_of_a_run() {
    let scratch = Scratch::new("metrics-plot_marks_the_eval_result_of_a_run");
    let root = scratch.fresh("plot-eval");
    let run = root.join("evaluated");
    synthetic_run(&run, 60, 1.0);
    std::fs::write(
        run.join("eval.json"),
        r#"{"train_step": 60, "overall": {"accept_len": 1.52, "simulated_accept_len": 4.07}}"#,
    )
    .unwrap();
    let mark = plot::load_eval(&run).unwrap().expect("the eval report");
    assert_eq!(mark, plot::EvalMark { step: Some(60), accept_len: 1.52, simulated_accept_len: 4.07 });
    // An earlier checkpoint's own report (`eval` of its step folder) is a second mark; one of the
    // same step as the run's is left out.
    for (step, accept) in [(20, 1.21), (60, 9.99)] {
        let folder = run.join(format!("step-{step:08}"));
        std::fs::create_dir_all(&folder).unwrap();
        let report =
            format!(r#"{{"train_step": {step}, "overall": {{"accept_len": {accept}, "simulated_accept_len": 3.5}}}}"#);
        std::fs::write(folder.join("eval.json"), report).unwrap();
    }
    let marks = plot::load_evals(&run).unwrap();
    assert_eq!(marks.iter().map(|m| (m.step, m.accept_len)).collect::<Vec<_>>(), [(Some(20), 1.21), (Some(60), 1.52)]);
    let svg_path = root.join("curves.svg");
    plot::plot(std::slice::from_ref(&run), &svg_path, 0.9).unwrap();
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(svg.contains("eval 1.52 (sim 4.07)"), "no eval label in the SVG");
    assert!(svg.contains("eval 1.21 (sim 3.50)"), "no label for the earlier checkpoint's eval");
    assert!(!svg.contains("9.99"), "a second report of the same step was drawn");
    assert!(svg.contains("<circle"), "no eval marker in the SVG");
    // Without eval.json: no label.
    let plain = root.join("plain");
    synthetic_run(&plain, 60, 1.0);
    plot::plot(&[plain], &svg_path, 0.9).unwrap();
    assert!(!std::fs::read_to_string(&svg_path).unwrap().contains("eval "));
    std::fs::write(run.join("eval.json"), "{\"overall\": {}}").unwrap();
    let err = plot::plot(std::slice::from_ref(&run), &svg_path, 0.9).unwrap_err();
    assert!(matches!(err, PlotError::Eval { .. }) && err.to_string().contains("eval.json"), "{err}");
}
