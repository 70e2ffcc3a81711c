//! `dflash-engine plot DIR [DIR...] --out curves.png|curves.svg`: a run's curves from its
//! `metrics.jsonl`, in one figure of four panels (loss, accuracy, acceptance length, tokens/s
//! against the step). Several runs are overlaid, each in its own colour, labelled by its folder
//! name. Each series is drawn twice: the raw values thin and faint, an exponential moving average
//! on top (debiased as TensorBoard's smoothing is, so the first steps are not pulled to 0).
//!
//! Text is rendered from an embedded font (an ASCII subset of DejaVu Sans, see
//! `assets/fonts/README.md`), so a PNG needs no system font and no C library.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::train::metrics::{self, MetricsError, MetricsRecord, METRICS_FILE};

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("{dir}: no {METRICS_FILE} in this folder; a run writes it there (`dflash-engine run --out {dir}`), one line per step")]
    NoMetrics { dir: PathBuf },
    #[error("{path}: a file; give the run folder that holds it (`dflash-engine plot {}`)", .path.parent().map_or_else(|| ".".into(), |p| p.display().to_string()))]
    NotAFolder { path: PathBuf },
    #[error("{path}: no complete step yet; plot it once the run has logged a step")]
    NoSteps { path: PathBuf },
    #[error("--out {out}: give a file name ending in .png or .svg")]
    Format { out: PathBuf },
    #[error("--smooth {0}: use a weight in [0, 1) (0 = no smoothing; 0.9 = TensorBoard-like)")]
    Smooth(f64),
    #[error("plot: give at least one run folder")]
    NoRuns,
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    #[error("drawing the plot: {0}")]
    Draw(String),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("listing the run's checkpoints: {0}")]
    Checkpoints(Box<crate::train::checkpoint::CheckpointError>),
    #[error("encoding the PNG: {0}")]
    Png(#[from] png::EncodingError),
    #[error("{path}: not an eval report ({why}); `dflash-engine eval --drafter RUN_DIR` writes it, delete it or run eval again")]
    Eval { path: PathBuf, why: String },
}

type Result<T, E = PlotError> = std::result::Result<T, E>;

/// Figure size in pixels (PNG) or SVG user units.
pub const SIZE: (u32, u32) = (1400, 900);

/// The embedded font: printable ASCII of DejaVu Sans (Bitstream Vera license, kept beside it).
const FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans-ascii.ttf");

/// Run colours (Tableau 10): distinct, and still distinct with the raw lines faded.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// One run's records and its legend label, and its `eval` result when the folder holds one.
#[derive(Clone, Debug)]
pub struct Run {
    pub label: String,
    pub records: Vec<MetricsRecord>,
    /// Its `eval` results, one per evaluated checkpoint, by step.
    pub eval: Vec<EvalMark>,
}

/// What `eval` measured for a run's drafter (an `eval.json`): drawn on the acceptance panel at
/// the step of the evaluated checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalMark {
    pub step: Option<u32>,
    /// Tokens per verification round in real decoding.
    pub accept_len: f64,
    /// Training's metric on eval's outputs.
    pub simulated_accept_len: f64,
}

/// Every eval report of the run in `dir`, by step: its own `eval.json` (`eval` of the run folder,
/// its latest checkpoint at the time) and those in its `step-*` checkpoint folders (`eval` of
/// one checkpoint). Where two are of the same step, the run's own is kept.
pub fn load_evals(dir: &Path) -> Result<Vec<EvalMark>> {
    let steps = crate::train::checkpoint::step_folders(dir).map_err(|e| PlotError::Checkpoints(Box::new(e)))?;
    let mut marks: Vec<EvalMark> = Vec::new();
    for folder in std::iter::once(dir.to_path_buf()).chain(steps.into_iter().map(|(_, p)| p)) {
        if let Some(m) = load_eval(&folder)? {
            if m.step.is_none() || !marks.iter().any(|k| k.step == m.step) {
                marks.push(m);
            }
        }
    }
    marks.sort_by_key(|m| m.step);
    Ok(marks)
}

/// The eval report in `dir`, if any (`eval.json`, written by `dflash-engine eval`).
pub fn load_eval(dir: &Path) -> Result<Option<EvalMark>> {
    let path = dir.join(crate::eval::EVAL_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(PlotError::Io { op: "reading", path, source }),
    };
    let bad = |why: String| PlotError::Eval { path: path.clone(), why };
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let num = |key: &str| v["overall"][key].as_f64().ok_or_else(|| bad(format!("no number overall.{key}")));
    Ok(Some(EvalMark {
        step: v["train_step"].as_u64().and_then(|s| u32::try_from(s).ok()),
        accept_len: num("accept_len")?,
        simulated_accept_len: num("simulated_accept_len")?,
    }))
}

/// The runs in `dirs`, refusing a folder without a metrics file or without a complete step.
/// Labels are the folder names, or the whole paths where two names are the same.
pub fn load_runs(dirs: &[PathBuf]) -> Result<Vec<Run>> {
    if dirs.is_empty() {
        return Err(PlotError::NoRuns);
    }
    let names: Vec<String> = dirs
        .iter()
        .map(|d| d.file_name().map_or_else(|| d.display().to_string(), |n| n.to_string_lossy().into_owned()))
        .collect();
    dirs.iter()
        .zip(&names)
        .map(|(dir, name)| {
            let path = dir.join(METRICS_FILE);
            if dir.is_file() {
                return Err(PlotError::NotAFolder { path: dir.clone() });
            }
            if !path.is_file() {
                return Err(PlotError::NoMetrics { dir: dir.clone() });
            }
            let records = metrics::read_records(&path)?;
            if records.is_empty() {
                return Err(PlotError::NoSteps { path });
            }
            let unique = names.iter().filter(|n| *n == name).count() == 1;
            let eval = load_evals(dir)?;
            Ok(Run { label: if unique { name.clone() } else { dir.display().to_string() }, records, eval })
        })
        .collect()
}

/// Debiased exponential moving average with weight `smooth` on the past (TensorBoard's
/// smoothing): `s_t = smooth * s_(t-1) + (1 - smooth) * x_t`, divided by `1 - smooth^t`.
pub fn ema(xs: &[f64], smooth: f64) -> Vec<f64> {
    let (mut s, mut w) = (0.0, 0.0);
    xs.iter()
        .map(|&x| {
            s = smooth * s + (1.0 - smooth) * x;
            w = smooth * w + (1.0 - smooth);
            s / w
        })
        .collect()
}

/// The (step, value) points of one line.
type Line = Vec<(f64, f64)>;

/// The four panels: title, y-axis label, the value of a record.
type Panel = (&'static str, &'static str, fn(&MetricsRecord) -> f64);
const PANELS: [Panel; 4] = [
    ("loss", "loss", |r| r.loss),
    ("accuracy", "accuracy", |r| r.accuracy),
    ("acceptance length", "accept len (tokens)", |r| r.accept_len),
    ("throughput", "tokens/s", |r| r.tokens_per_s),
];

/// Writes the figure of `dirs` to `out` (.png or .svg) with EMA weight `smooth`.
pub fn plot(dirs: &[PathBuf], out: &Path, smooth: f64) -> Result<()> {
    if !(0.0..1.0).contains(&smooth) {
        return Err(PlotError::Smooth(smooth));
    }
    let ext = out.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    let is_png = match ext.as_deref() {
        Some("png") => true,
        Some("svg") => false,
        _ => return Err(PlotError::Format { out: out.to_path_buf() }),
    };
    let runs = load_runs(dirs)?;
    register_font()?;
    let io = |source| PlotError::Io { op: "writing", path: out.to_path_buf(), source };
    let (w, h) = SIZE;
    if is_png {
        let mut rgb = vec![0u8; w as usize * h as usize * 3];
        {
            let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
            draw(&root, &runs, smooth)?;
            root.present().map_err(draw_err)?;
        }
        let (palette, indices) = to_indexed(&rgb);
        let file = std::fs::File::create(out).map_err(io)?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
        enc.set_color(png::ColorType::Indexed);
        enc.set_palette(palette);
        enc.set_depth(png::BitDepth::Eight);
        // Worth the time: a figure is written once, and is small enough to commit.
        enc.set_compression(png::Compression::High);
        let mut writer = enc.write_header()?;
        writer.write_image_data(&indices)?;
        writer.finish()?;
    } else {
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
            draw(&root, &runs, smooth)?;
            root.present().map_err(draw_err)?;
        }
        std::fs::write(out, svg).map_err(io)?;
    }
    Ok(())
}

fn draw_err(e: impl std::fmt::Display) -> PlotError {
    PlotError::Draw(e.to_string())
}

fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(PlotError::Draw("the embedded font does not parse".into()))
    }
}

/// RGB pixels as a palette image (a third of the bytes to compress, and a figure has few
/// colours: white, greys, the runs' colours and the antialiasing shades between them). The 256
/// most frequent colours form the palette; a rarer shade, if any, takes the nearest entry, so a
/// figure of at most 256 colours is encoded losslessly.
fn to_indexed(rgb: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut counts: std::collections::HashMap<[u8; 3], u64> = std::collections::HashMap::new();
    for p in rgb.chunks_exact(3) {
        *counts.entry([p[0], p[1], p[2]]).or_default() += 1;
    }
    let mut by_count: Vec<([u8; 3], u64)> = counts.into_iter().collect();
    by_count.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let palette: Vec<[u8; 3]> = by_count.iter().take(256).map(|c| c.0).collect();
    let dist = |a: [u8; 3], b: [u8; 3]| -> i32 { (0..3).map(|i| (i32::from(a[i]) - i32::from(b[i])).pow(2)).sum() };
    let index: std::collections::HashMap<[u8; 3], u8> = by_count
        .iter()
        .map(|&(c, _)| {
            let best = (0..palette.len()).min_by_key(|&i| dist(c, palette[i])).unwrap_or(0);
            (c, u8::try_from(best).expect("at most 256 palette entries"))
        })
        .collect();
    let indices = rgb.chunks_exact(3).map(|p| index[&[p[0], p[1], p[2]]]).collect();
    (palette.concat(), indices)
}

/// `c` at `strength` over white, as an opaque colour.
fn tint(c: RGBColor, strength: f64) -> RGBColor {
    let mix = |v: u8| (255.0 - strength * (255.0 - f64::from(v))).round() as u8;
    RGBColor(mix(c.0), mix(c.1), mix(c.2))
}

/// A short tick label: a k/M suffix for large values (tokens/s), at most 3 decimals otherwise,
/// trailing zeros dropped.
fn compact(x: f64) -> String {
    let trim = |s: String| if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s };
    let a = x.abs();
    if a >= 1e6 {
        trim(format!("{:.2}", x / 1e6)) + "M"
    } else if a >= 1e4 {
        trim(format!("{:.1}", x / 1e3)) + "k"
    } else if a >= 100.0 {
        format!("{x:.0}")
    } else {
        trim(format!("{x:.3}"))
    }
}

/// `[lo, hi]` of the finite values, widened by 5% (and to a non-empty range).
fn padded_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) =
        values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(v), h.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = if hi > lo { 0.05 * (hi - lo) } else { 0.5 * lo.abs().max(1e-3) };
    (lo - pad, hi + pad)
}

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, runs: &[Run], smooth: f64) -> Result<()> {
    root.fill(&WHITE).map_err(draw_err)?;
    let title = format!("DFlash drafter training (raw: faint; EMA {smooth}: bold)");
    let body = root.titled(&title, ("sans-serif", 26)).map_err(draw_err)?;
    let x_max = runs.iter().filter_map(|r| r.records.last()).map(|r| r.step).max().unwrap_or(1);
    let x_min = runs.iter().filter_map(|r| r.records.first()).map(|r| r.step).min().unwrap_or(0);
    let (x_lo, x_hi) = (f64::from(x_min.saturating_sub(1)), f64::from(x_max.max(x_min + 1)));
    for (i, (area, (name, y_desc, value))) in body.split_evenly((2, 2)).iter().zip(PANELS).enumerate() {
        // The acceptance panel (i == 2) also holds the eval marks.
        let marks: Vec<(usize, f64, f64, f64)> = if i == 2 {
            runs.iter()
                .enumerate()
                .flat_map(|(k, r)| {
                    r.eval.iter().map(move |e| {
                        let at = e.step.map_or_else(|| r.records.last().map_or(x_hi, |l| f64::from(l.step)), f64::from);
                        (k, at, e.accept_len, e.simulated_accept_len)
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        let (y_lo, y_hi) = padded_range(
            runs.iter().flat_map(|r| r.records.iter().map(value)).chain(marks.iter().flat_map(|m| [m.2, m.3])),
        );
        let mut chart = ChartBuilder::on(area)
            .caption(name, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(78)
            .build_cartesian_2d(x_lo..x_hi, y_lo..y_hi)
            .map_err(draw_err)?;
        let fmt_x = |x: &f64| format!("{x:.0}");
        let fmt_y = |y: &f64| compact(*y);
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(y_desc)
            .x_label_formatter(&fmt_x)
            .y_label_formatter(&fmt_y)
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 16))
            .bold_line_style(RGBColor(215, 215, 215))
            .light_line_style(RGBColor(246, 246, 246))
            .draw()
            .map_err(draw_err)?;
        // Non-finite values (a skipped step's loss) are left out of both lines.
        let lines: Vec<(Line, Line)> = runs
            .iter()
            .map(|run| {
                let raw: Vec<(f64, f64)> =
                    run.records.iter().map(|r| (f64::from(r.step), value(r))).filter(|(_, y)| y.is_finite()).collect();
                let ys: Vec<f64> = raw.iter().map(|p| p.1).collect();
                let smoothed = raw.iter().map(|p| p.0).zip(ema(&ys, smooth)).collect();
                (raw, smoothed)
            })
            .collect();
        // Every run's raw line first, then the smoothed ones on top. Raw lines are an opaque tint
        // rather than translucent: overlaps then add no new colours, which keeps a PNG small.
        for (k, (raw, _)) in lines.iter().enumerate() {
            let faint = tint(COLORS[k % COLORS.len()], 0.3);
            chart.draw_series(LineSeries::new(raw.iter().copied(), faint.stroke_width(1))).map_err(draw_err)?;
        }
        for (k, ((_, smoothed), run)) in lines.iter().zip(runs).enumerate() {
            let color = COLORS[k % COLORS.len()];
            let series = chart
                .draw_series(LineSeries::new(smoothed.iter().copied(), color.stroke_width(2)))
                .map_err(draw_err)?;
            if i == 0 {
                series
                    .label(run.label.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
            }
        }
        // Eval: real decoding's tokens per round (filled circle) and training's metric on the
        // same outputs (hollow circle), at the evaluated step, labelled.
        for &(k, at, real, sim) in &marks {
            let color = COLORS[k % COLORS.len()];
            chart
                .draw_series([
                    Circle::new((at, real), 6, color.filled()),
                    Circle::new((at, sim), 6, color.stroke_width(2)),
                ])
                .map_err(draw_err)?;
            chart
                .draw_series([Text::new(
                    format!("eval {real:.2} (sim {sim:.2})"),
                    (at, real),
                    ("sans-serif", 15).into_font().color(&color).pos(Pos::new(HPos::Right, VPos::Bottom)),
                )])
                .map_err(draw_err)?;
        }
        if i == 0 {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .label_font(("sans-serif", 16))
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(180, 180, 180))
                .draw()
                .map_err(draw_err)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ema_is_debiased_and_zero_smoothing_is_the_identity() {
        let xs = [4.0, 4.0, 4.0, 1.0];
        // A constant stays constant from the first point on (no pull towards 0).
        let s = ema(&xs, 0.9);
        assert!((s[0] - 4.0).abs() < 1e-12 && (s[2] - 4.0).abs() < 1e-12);
        // Then: (0.9 * (0.9 * (0.9 * 0.4 + 0.4) + 0.4) + 0.1) / (1 - 0.9^4).
        let want = (0.9 * (0.9 * (0.9 * 0.4 + 0.4) + 0.4) + 0.1) / (1.0 - 0.9f64.powi(4));
        assert!((s[3] - want).abs() < 1e-12, "{} vs {want}", s[3]);
        assert_eq!(ema(&xs, 0.0), xs.to_vec());
    }

    #[test]
    fn a_palette_image_is_lossless_up_to_256_colours() {
        // 300 colours: the 256 most frequent are kept exactly; the 44 rarest (one pixel each)
        // take their nearest kept neighbour.
        let mut rgb = Vec::new();
        for c in 0..300u32 {
            let n = if c < 256 { 3 } else { 1 };
            for _ in 0..n {
                rgb.extend_from_slice(&[(c % 256) as u8, (c / 256) as u8 * 7, 0]);
            }
        }
        let (palette, idx) = to_indexed(&rgb);
        assert_eq!(palette.len(), 256 * 3);
        let back: Vec<u8> =
            idx.iter().flat_map(|&i| palette[3 * usize::from(i)..3 * usize::from(i) + 3].to_vec()).collect();
        assert_eq!(back[..256 * 9], rgb[..256 * 9]);
        for (got, want) in back[256 * 9..].chunks(3).zip(rgb[256 * 9..].chunks(3)) {
            assert_eq!((got[0], got[1], got[2]), (want[0], 0, 0), "nearest kept colour");
        }
    }

    #[test]
    fn tick_labels_are_compact() {
        assert_eq!(compact(123_456.0), "123.5k");
        assert_eq!(compact(20_000.0), "20k");
        assert_eq!(compact(2_500_000.0), "2.5M");
        assert_eq!(compact(1400.0), "1400");
        assert_eq!(compact(5.6), "5.6");
        assert_eq!(compact(0.125), "0.125");
        assert_eq!(compact(0.0), "0");
    }
}
