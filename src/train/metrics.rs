//! The run's record: `<out>/metrics.jsonl`, one JSON object per optimizer step, appended and
//! flushed as the run goes, and the same scalars as TensorBoard events under `<out>/tb/`.
//!
//! A run of days gets killed and resumed; the file must read as one clean run anyway:
//! - each line goes out in one write call ending in '\n', so a kill leaves at most one torn last
//!   line, and opening the log drops it;
//! - a resumed run first drops every line past the checkpoint it resumes from (the steps a killed
//!   run logged but never saved), rewriting the file atomically (temp file + rename), then
//!   appends: no gap and no duplicate step;
//! - the line of a step is written before that step's checkpoint, so a checkpoint's step always
//!   has its line.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::pipeline::PipelineStats;
use crate::tensorboard::{self, EventWriter, TensorBoardError};
use crate::train::step::StepMetrics;

/// The metrics file in a run's `--out` folder.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The TensorBoard folder in a run's `--out` folder (`tensorboard --logdir <out>/tb`).
pub const TENSORBOARD_DIR: &str = "tb";

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} line {line}: not a metrics record ({why}); move the file away to start a new one")]
    BadLine { path: PathBuf, line: usize, why: String },
    #[error("rewriting {path}: {source}")]
    Rewrite {
        path: PathBuf,
        #[source]
        source: crate::weights::WeightsError,
    },
    #[error("TensorBoard events: {0}")]
    TensorBoard(#[from] TensorBoardError),
}

type Result<T, E = MetricsError> = std::result::Result<T, E>;

/// One optimizer step. The first eight fields are a pure function of the run's flags and seed
/// (a resumed run reproduces them bit for bit); the rest are timings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricsRecord {
    /// Completed optimizer steps, 1-based: the number the step line prints and a checkpoint
    /// (`step-N`) counts.
    pub step: u32,
    /// Non-finite values (a skipped step's loss) are written as `null` and read back as NaN.
    #[serde(with = "nullable")]
    pub loss: f64,
    pub accuracy: f64,
    /// Simulated acceptance length (DFLASH.md section 4), per position.
    pub accept_len: f64,
    /// The tokens per round real decoding gets, predicted from the same blocks
    /// (`MetricSums::round_accept_len`; 0 in records of older runs).
    #[serde(default)]
    pub round_accept_len: f64,
    #[serde(with = "nullable")]
    pub grad_norm: f64,
    pub lr: f32,
    /// The update was skipped (non-finite loss or grad norm).
    pub skipped: bool,
    /// Wall time of the step as the drafter side saw it (checkpoint writes excluded).
    pub step_ms: f64,
    pub tokens_per_s: f64,
    pub draft_positions_per_s: f64,
    /// Fraction of this step's wall time the target side did not compute, and the drafter side
    /// waited for data (means over ranks; see `PipelineStats`).
    pub target_idle: f64,
    pub drafter_idle: f64,
    /// Mean queue depth over the publishes since the previous step (the last depth when none).
    pub queue_depth: f64,
    /// Seconds since the Unix epoch at the end of the step.
    pub time: f64,
}

/// `f64` with non-finite values as JSON `null` (JSON has no NaN).
mod nullable {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

impl MetricsRecord {
    /// The TensorBoard scalars of this record (tag, value).
    pub fn scalars(&self) -> Vec<(&'static str, f32)> {
        vec![
            ("train/loss", self.loss as f32),
            ("train/accuracy", self.accuracy as f32),
            ("train/accept_len", self.accept_len as f32),
            ("train/round_accept_len", self.round_accept_len as f32),
            ("train/grad_norm", self.grad_norm as f32),
            ("train/lr", self.lr),
            ("train/skipped", f32::from(u8::from(self.skipped))),
            ("perf/step_ms", self.step_ms as f32),
            ("perf/tokens_per_s", self.tokens_per_s as f32),
            ("perf/draft_positions_per_s", self.draft_positions_per_s as f32),
            ("pipeline/target_idle", self.target_idle as f32),
            ("pipeline/drafter_idle", self.drafter_idle as f32),
            ("pipeline/queue_depth", self.queue_depth as f32),
        ]
    }
}

/// The cumulative pipeline counters at the end of the previous step: the per-step idle
/// fractions and queue depth are differences against them.
#[derive(Clone, Debug, Default)]
struct Window {
    wall: Duration,
    target_busy: Duration,
    drafter_wait: Duration,
    depths_seen: usize,
    last_depth: f64,
}

impl Window {
    /// The record of step `m` (its wall time `ms`), given the counters `st` at its end; moves
    /// the window on to `st`.
    fn record(&mut self, m: &StepMetrics, ms: f64, st: &PipelineStats) -> MetricsRecord {
        let span = st.wall.saturating_sub(self.wall).as_secs_f64();
        let frac = |d: Duration, ranks: usize| {
            if span > 0.0 {
                (d.as_secs_f64() / ranks.max(1) as f64 / span).clamp(0.0, 1.0)
            } else {
                0.0
            }
        };
        let target_busy = frac(st.target_busy.saturating_sub(self.target_busy), st.target_ranks);
        let drafter_idle = frac(st.drafter_wait.saturating_sub(self.drafter_wait), st.drafter_ranks);
        let new_depths = st.queue_depth.get(self.depths_seen..).unwrap_or(&[]);
        if !new_depths.is_empty() {
            let sum: f64 = new_depths.iter().map(|&d| f64::from(d)).sum();
            self.last_depth = sum / new_depths.len() as f64;
        } else if let Some(&d) = st.queue_depth.last() {
            self.last_depth = f64::from(d);
        }
        let secs = (ms / 1e3).max(1e-9);
        let rec = MetricsRecord {
            step: m.step + 1,
            loss: m.loss,
            accuracy: m.accuracy,
            accept_len: m.accept_len,
            round_accept_len: m.round_accept_len,
            grad_norm: m.grad_norm,
            lr: m.lr,
            skipped: m.skipped,
            step_ms: ms,
            tokens_per_s: m.tokens as f64 / secs,
            draft_positions_per_s: m.draft_positions as f64 / secs,
            target_idle: 1.0 - target_busy,
            drafter_idle,
            queue_depth: self.last_depth,
            time: tensorboard::unix_seconds(),
        };
        *self = Window {
            wall: st.wall,
            target_busy: st.target_busy,
            drafter_wait: st.drafter_wait,
            depths_seen: st.queue_depth.len(),
            last_depth: self.last_depth,
        };
        rec
    }
}

/// What opening the log found in an existing file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Repair {
    /// Lines kept (steps up to the resume point).
    pub kept: usize,
    /// Complete lines dropped because their step is past the resume point.
    pub dropped: usize,
    /// A torn last line (no '\n': a kill mid-write) was dropped.
    pub torn: bool,
    /// The last kept step.
    pub last_step: Option<u32>,
}

/// Makes `path` hold exactly its complete lines with `step <= keep_through`: drops a torn last
/// line and every later step, rewriting the file atomically when anything changes. A missing
/// file is an empty one.
pub fn repair(path: &Path, keep_through: u32) -> Result<Repair> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Repair::default()),
        Err(source) => return Err(MetricsError::Io { path: path.to_path_buf(), op: "read", source }),
    };
    #[derive(Deserialize)]
    struct StepOnly {
        step: u32,
    }
    let mut r = Repair::default();
    let mut kept = Vec::with_capacity(bytes.len());
    let mut rest = &bytes[..];
    let mut line_no = 0;
    while !rest.is_empty() {
        line_no += 1;
        let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
            r.torn = true;
            break;
        };
        let line = &rest[..=nl];
        rest = &rest[nl + 1..];
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let s: StepOnly = serde_json::from_slice(line).map_err(|e| MetricsError::BadLine {
            path: path.to_path_buf(),
            line: line_no,
            why: e.to_string(),
        })?;
        if s.step <= keep_through {
            // The kept lines are copied as written, not re-serialised: a resumed file is
            // byte-identical to the uninterrupted run's up to the resume point.
            kept.extend_from_slice(line);
            r.kept += 1;
            r.last_step = Some(s.step);
        } else {
            r.dropped += 1;
        }
    }
    if kept.len() != bytes.len() {
        crate::weights::write_file_atomic(path, &kept)
            .map_err(|source| MetricsError::Rewrite { path: path.to_path_buf(), source })?;
    }
    Ok(r)
}

/// Every record of a metrics file; a torn last line is skipped (the run may still be writing).
pub fn read_records(path: &Path) -> Result<Vec<MetricsRecord>> {
    let text = std::fs::read_to_string(path).map_err(|source| MetricsError::Io {
        path: path.to_path_buf(),
        op: "read",
        source,
    })?;
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    complete
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| MetricsError::BadLine {
                path: path.to_path_buf(),
                line: i + 1,
                why: e.to_string(),
            })
        })
        .collect()
}

/// One line for `inspect`: the last record of `dir/metrics.jsonl`, `None` without one.
pub fn describe_last(dir: &Path) -> Result<Option<String>> {
    let path = dir.join(METRICS_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let recs = read_records(&path)?;
    Ok(recs.last().map(|r| {
        format!(
            "metrics: {} steps logged; last: step {} loss {:.4} acc {:.3} accept-len {:.3} grad-norm {:.3} lr {:.2e} {:.0} tok/s{}",
            recs.len(),
            r.step,
            r.loss,
            r.accuracy,
            r.accept_len,
            r.grad_norm,
            r.lr,
            r.tokens_per_s,
            if r.skipped { " (skipped)" } else { "" }
        )
    }))
}

/// The open log of a run: the metrics file and, unless turned off, a TensorBoard event file.
#[derive(Debug)]
pub struct MetricsLog {
    file: File,
    path: PathBuf,
    tb: Option<EventWriter>,
    window: Window,
    repair: Repair,
    first_step: u32,
}

impl MetricsLog {
    /// Opens `out/metrics.jsonl` for a run whose first step is `first_step` (0-based, i.e. the
    /// number of steps already done: the step of the checkpoint resumed from, or 0), dropping
    /// the lines past it; starts a new event file in `out/tb/` when `tensorboard`. A run from
    /// step 0 replaces the folder's previous record: its metrics lines and event files go.
    pub fn open(out: &Path, first_step: u32, tensorboard: bool) -> Result<Self> {
        std::fs::create_dir_all(out).map_err(|source| MetricsError::Io {
            path: out.to_path_buf(),
            op: "create the folder",
            source,
        })?;
        let path = out.join(METRICS_FILE);
        let repair = repair(&path, first_step)?;
        let file = File::options().create(true).append(true).open(&path).map_err(|source| MetricsError::Io {
            path: path.clone(),
            op: "open for appending",
            source,
        })?;
        let dir = out.join(TENSORBOARD_DIR);
        if first_step == 0 {
            // Event files of an earlier run into this folder would otherwise mix with this one's.
            for old in tensorboard::existing_event_files(&dir)? {
                std::fs::remove_file(&old).map_err(|source| MetricsError::Io {
                    path: old.clone(),
                    op: "remove",
                    source,
                })?;
            }
        }
        let tb = if tensorboard {
            let mut w = EventWriter::create(&dir)?;
            // Steps are 1-based in the log: the first step this run writes is first_step + 1,
            // and every older event from that step on is superseded.
            w.session_start(i64::from(first_step) + 1, tensorboard::unix_seconds())?;
            Some(w)
        } else {
            None
        };
        Ok(MetricsLog { file, path, tb, window: Window::default(), repair, first_step })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What opening found, as a line for the run's header: `None` when there is nothing to say.
    pub fn note(&self) -> Option<String> {
        let r = &self.repair;
        let mut parts = Vec::new();
        if r.dropped > 0 {
            parts.push(format!("dropped {} lines past step {}", r.dropped, self.first_step));
        }
        if r.torn {
            parts.push("dropped a torn last line".to_string());
        }
        if self.first_step > 0 && r.last_step != Some(self.first_step) {
            parts.push(format!(
                "it ends at step {} but the run resumes after step {}: the steps between are missing",
                r.last_step.unwrap_or(0),
                self.first_step
            ));
        }
        (!parts.is_empty()).then(|| format!("metrics   {}: {}", self.path.display(), parts.join("; ")))
    }

    /// Writes step `m`'s record (`ms`: its wall time; `st`: the pipeline counters at its end)
    /// to the file and the event file, and returns it.
    pub fn record_step(&mut self, m: &StepMetrics, ms: f64, st: &PipelineStats) -> Result<MetricsRecord> {
        let rec = self.window.record(m, ms, st);
        self.append(&rec)?;
        Ok(rec)
    }

    /// Appends `rec`: one write call of the whole line, '\n' included (no buffering: a reader
    /// sees the step at once, and a kill tears at most this line).
    pub fn append(&mut self, rec: &MetricsRecord) -> Result<()> {
        let mut line = serde_json::to_vec(rec).expect("a MetricsRecord always serialises");
        line.push(b'\n');
        self.file.write_all(&line).map_err(|source| MetricsError::Io {
            path: self.path.clone(),
            op: "append",
            source,
        })?;
        if let Some(tb) = &mut self.tb {
            tb.scalars(i64::from(rec.step), rec.time, &rec.scalars())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;

    fn rec(step: u32) -> MetricsRecord {
        MetricsRecord {
            step,
            loss: 1.0 / f64::from(step),
            accuracy: 0.5,
            accept_len: 1.25,
            round_accept_len: 1.1,
            grad_norm: 0.3,
            lr: 1e-3,
            skipped: false,
            step_ms: 10.0,
            tokens_per_s: 100.0,
            draft_positions_per_s: 50.0,
            target_idle: 0.1,
            drafter_idle: 0.2,
            queue_depth: 1.5,
            time: 1.7e9,
        }
    }

    #[test]
    fn non_finite_values_round_trip_as_null() {
        let r = MetricsRecord { loss: f64::NAN, grad_norm: f64::INFINITY, skipped: true, ..rec(3) };
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains("\"loss\":null") && text.contains("\"grad_norm\":null"), "{text}");
        let back: MetricsRecord = serde_json::from_str(&text).unwrap();
        assert!(back.loss.is_nan() && back.grad_norm.is_nan());
        assert_eq!(back.step, 3);
    }

    #[test]
    fn repair_keeps_steps_up_to_the_resume_point_and_drops_a_torn_line() {
        let dir = TempDir::new("metrics-repair");
        let path = dir.0.join(METRICS_FILE);
        let lines: Vec<String> = (1..=5).map(|s| serde_json::to_string(&rec(s)).unwrap() + "\n").collect();
        let torn = &lines[0][..20];
        std::fs::write(&path, lines.concat() + torn).unwrap();
        let r = repair(&path, 3).unwrap();
        assert_eq!(r, Repair { kept: 3, dropped: 2, torn: true, last_step: Some(3) });
        assert_eq!(std::fs::read_to_string(&path).unwrap(), lines[..3].concat());
        // Nothing to do: the file stays as it is.
        assert_eq!(repair(&path, 3).unwrap(), Repair { kept: 3, dropped: 0, torn: false, last_step: Some(3) });
        // A broken line in the middle is not silently dropped.
        std::fs::write(&path, format!("{}garbage\n{}", lines[0], lines[1])).unwrap();
        let err = repair(&path, 9).unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains(METRICS_FILE), "{err}");
    }

    #[test]
    fn the_window_turns_cumulative_counters_into_per_step_values() {
        let ms = Duration::from_millis;
        let mut w = Window::default();
        let m = StepMetrics { step: 0, tokens: 1000, draft_positions: 400, ..Default::default() };
        let st = PipelineStats {
            wall: ms(1000),
            target_busy: ms(600),
            drafter_wait: ms(100),
            target_ranks: 1,
            drafter_ranks: 1,
            queue_depth: vec![1, 2],
            ..Default::default()
        };
        let a = w.record(&m, 500.0, &st);
        assert_eq!(a.step, 1);
        assert!((a.target_idle - 0.4).abs() < 1e-12 && (a.drafter_idle - 0.1).abs() < 1e-12);
        assert_eq!((a.queue_depth, a.tokens_per_s, a.draft_positions_per_s), (1.5, 2000.0, 800.0));
        // The second step: 1000 ms more, 900 of them target work, no new publish.
        let st2 = PipelineStats { wall: ms(2000), target_busy: ms(1500), drafter_wait: ms(100), ..st };
        let b = w.record(&StepMetrics { step: 1, ..m }, 1000.0, &st2);
        assert!((b.target_idle - 0.1).abs() < 1e-12 && b.drafter_idle == 0.0);
        assert_eq!(b.queue_depth, 2.0);
    }
}
