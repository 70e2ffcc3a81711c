//! `prepare-data`: chat conversations (ShareGPT or OpenAI layout, JSON Lines) to the training
//! data `run --data` reads: the target's chat template renders each conversation, its tokenizer
//! tokenizes it, and the loss mask is 1 exactly on the assistants' answers and their end-of-turn
//! tokens. With `--regenerate` the target first writes every answer itself (`regenerate.rs`).
//!
//! Output is never half-written and a killed run resumes: lines go to `OUT.partial`, whole chunks
//! at a time, each chunk fsynced and then recorded in `OUT.progress` (written atomically: input
//! lines consumed, bytes of `OUT.partial` they produced, the running counts). A rerun of the same
//! command finds the progress file, cuts `OUT.partial` back to the recorded length (dropping
//! lines written after the last record, which it then writes again) and goes on from the next
//! input line; the file `OUT` appears only when everything is done, by rename.

pub mod chat;
pub mod encode;
pub mod regenerate;
pub mod template;

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::backend::{Backend, BackendError};
use crate::model::target::Target;
use chat::Message;
use encode::{Encoder, Skip};
use regenerate::{regenerate_batch, RegenSpec, RegenStats};

/// What can stop `prepare-data` (a skipped conversation is not an error: it is counted).
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("{}: {what}", .path.display())]
    TargetFile { path: PathBuf, what: String },
    #[error(
        "{}: no chat template (neither chat_template.jinja nor a `chat_template` in \
         tokenizer_config.json); copy them from the model's Hugging Face repository",
        .dir.display()
    )]
    NoTemplate { dir: PathBuf },
    #[error("the chat template in {}: {what}", .file.display())]
    Template { file: PathBuf, what: String },
    #[error("{} line {line}: {what}", .path.display())]
    Line { path: PathBuf, line: u64, what: String },
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{} already exists; pass --overwrite to replace it (or choose another --out)",
        .path.display()
    )]
    OutputExists { path: PathBuf },
    #[error(
        "{} records an unfinished run with other settings ({}); rerun with the same flags to \
         finish it, or pass --overwrite to start over",
        .path.display(), .differing.join(", ")
    )]
    ResumeMismatch { path: PathBuf, differing: Vec<String> },
    #[error(
        "the tokenizer has {tokenizer} tokens but the target's vocabulary is {target}: they do \
         not belong together"
    )]
    VocabMismatch { tokenizer: usize, target: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("the target, while regenerating: {0}")]
    Backend(#[from] BackendError),
    #[error("aborting on purpose (DFLASH_FAULT prepare-abort)")]
    InjectedAbort,
    #[error(
        "{}: none of its {lines} lines gave a sample ({}), so nothing was written; check its format (one \
         {{\"messages\": [...]}} or {{\"conversations\": [...]}} object per line, with an assistant turn) and --max-len",
        .input.display(), .skipped.iter().map(|(why, n)| format!("{n} {why}")).collect::<Vec<_>>().join("; ")
    )]
    NoSamples { input: PathBuf, lines: u64, skipped: BTreeMap<String, u64> },
}

/// `--regenerate` settings.
#[derive(Clone, Debug)]
pub struct RegenOptions {
    pub temperature: f32,
    pub max_new_tokens: usize,
    pub seed: u64,
}

/// Everything `prepare-data` is told.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    pub target_dir: PathBuf,
    pub input: PathBuf,
    pub out: PathBuf,
    /// Samples are cut to their first `max_len` tokens.
    pub max_len: Option<usize>,
    pub regenerate: Option<RegenOptions>,
    /// Replace an existing output (or an unfinished run's files).
    pub overwrite: bool,
    /// Input lines per chunk: one progress record each, and decoded together by `--regenerate`.
    pub chunk_lines: usize,
    /// Test hook: abort after appending this 0-based chunk's lines, before recording them.
    pub abort_after_chunk: Option<u64>,
}

/// Counts of a run (the whole run's, across resumes).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PrepareSummary {
    /// Input lines read (blank ones included).
    pub lines: u64,
    pub samples: u64,
    pub tokens: u64,
    pub supervised_tokens: u64,
    pub truncated: u64,
    /// Conversations skipped, by reason.
    pub skipped: BTreeMap<String, u64>,
    /// `--regenerate`: answers written, tokens generated, answers cut at --max-new-tokens,
    /// conversations ended early by --max-len, decoding rows and seconds.
    pub turns: u64,
    pub generated_tokens: u64,
    pub hit_max_new: u64,
    pub cut_at_max_len: u64,
    pub decode_rows: u64,
    pub decode_secs: f64,
    /// The input line this run started after (a resumed run), 0 for a fresh one.
    #[serde(skip)]
    pub resumed_at_line: u64,
}

impl PrepareSummary {
    pub fn supervised_fraction(&self) -> f64 {
        self.supervised_tokens as f64 / self.tokens.max(1) as f64
    }

    /// The summary block printed at the end.
    pub fn describe(&self, out: &Path) -> String {
        let mut s = format!(
            "wrote {}: {} samples, {} tokens, {:.1}% supervised, {} truncated to --max-len, {} skipped\n",
            out.display(),
            self.samples,
            self.tokens,
            100.0 * self.supervised_fraction(),
            self.truncated,
            self.skipped.values().sum::<u64>()
        );
        for (why, n) in &self.skipped {
            s.push_str(&format!("  skipped {n}: {why}\n"));
        }
        if self.turns > 0 {
            s.push_str(&format!(
                "regenerated {} answers, {} tokens ({} cut at --max-new-tokens, {} conversations ended by --max-len); \
                 {:.0} generated tokens/s, {:.0} decoded rows/s\n",
                self.turns,
                self.generated_tokens,
                self.hit_max_new,
                self.cut_at_max_len,
                self.generated_tokens as f64 / self.decode_secs.max(1e-9),
                self.decode_rows as f64 / self.decode_secs.max(1e-9),
            ));
        }
        if self.resumed_at_line > 0 {
            s.push_str(&format!("(resumed after input line {})\n", self.resumed_at_line));
        }
        s
    }
}

/// The progress record of an unfinished run.
#[derive(Serialize, Deserialize)]
struct Progress {
    settings: serde_json::Value,
    lines_done: u64,
    bytes: u64,
    counts: PrepareSummary,
}

/// `OUT.partial` and `OUT.progress`.
fn side_files(out: &Path) -> (PathBuf, PathBuf) {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    (out.with_file_name(format!("{name}.partial")), out.with_file_name(format!("{name}.progress")))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PrepareError + '_ {
    move |source| PrepareError::Io { path: path.to_path_buf(), source }
}

fn sha256_file(path: &Path) -> Result<String, PrepareError> {
    let mut f = File::open(path).map_err(io(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// What must match for a rerun to continue an unfinished one: the input's content, the target's
/// tokenizer and template, and every flag that changes the output.
fn settings(o: &PrepareOptions, enc: &Encoder) -> Result<serde_json::Value, PrepareError> {
    let tok = sha256_file(&o.target_dir.join("tokenizer.json"))?;
    let tmpl = sha256_file(&enc.template.source)?;
    let mut v = serde_json::json!({
        "input": sha256_file(&o.input)?,
        "tokenizer": tok,
        "template": tmpl,
        "max-len": o.max_len,
        "batch": o.chunk_lines,
    });
    if let Some(r) = &o.regenerate {
        v["regenerate"] = serde_json::json!(true);
        v["temperature"] = serde_json::json!(r.temperature);
        v["max-new-tokens"] = serde_json::json!(r.max_new_tokens);
        v["seed"] = serde_json::json!(r.seed);
        let cfg = o.target_dir.join("config.json");
        v["target"] = serde_json::json!(std::fs::read_to_string(&cfg).map(|t| sha256_hex(t.as_bytes())).ok());
    }
    Ok(v)
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|b| format!("{b:02x}")).collect()
}

fn differing(a: &serde_json::Value, b: &serde_json::Value) -> Vec<String> {
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else { return vec!["all".into()] };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| match k.as_str() {
            "input" => "the input file's content".to_string(),
            "tokenizer" => "the target's tokenizer.json".to_string(),
            "template" => "the chat template".to_string(),
            "target" => "the target's config.json".to_string(),
            flag => format!("--{flag}"),
        })
        .collect()
}

/// The target that regenerates answers: a backend, its stream and the loaded model.
pub struct Generator<'a, B: Backend> {
    pub be: &'a B,
    pub stream: &'a B::Stream,
    pub target: &'a Target<B>,
}

/// Whether `out` names the existing file `input` (through any spelling or link); `out` need not
/// exist.
fn same_path(input: &Path, out: &Path) -> bool {
    let Ok(a) = input.canonicalize() else { return false };
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    match (parent.canonicalize(), out.file_name()) {
        (Ok(dir), Some(name)) => a == dir.join(name) || out.canonicalize().is_ok_and(|b| b == a),
        _ => false,
    }
}

/// Runs `prepare-data`. `target_vocab` (from the target's config.json) bounds the ids;
/// `generator` is required with `--regenerate`. `progress(lines_done)` follows the input.
pub fn prepare<B: Backend>(
    o: &PrepareOptions,
    enc: &Encoder,
    target_vocab: Option<usize>,
    generator: Option<Generator<'_, B>>,
    mut progress: impl FnMut(u64),
) -> Result<PrepareSummary, PrepareError> {
    if same_path(&o.input, &o.out) {
        return Err(PrepareError::InvalidArgument(format!(
            "--out {} is the --input file: it would be replaced by its own tokens; choose another --out",
            o.out.display()
        )));
    }
    if o.max_len == Some(0) || o.max_len == Some(1) {
        return Err(PrepareError::InvalidArgument(
            "--max-len must be at least 2 (a sample needs a supervised pair)".into(),
        ));
    }
    if o.chunk_lines == 0 {
        return Err(PrepareError::InvalidArgument("--batch must be at least 1".into()));
    }
    if let Some(r) = &o.regenerate {
        if r.max_new_tokens == 0 || !(r.temperature >= 0.0 && r.temperature.is_finite()) {
            return Err(PrepareError::InvalidArgument(
                "--max-new-tokens must be at least 1 and --temperature finite and >= 0".into(),
            ));
        }
        if generator.is_none() {
            return Err(PrepareError::InvalidArgument("--regenerate needs the target's weights loaded".into()));
        }
    }
    if let Some(v) = target_vocab {
        // Ids at or past the target's vocabulary would index past its embedding.
        if enc.tokenizer_vocab > v {
            return Err(PrepareError::VocabMismatch { tokenizer: enc.tokenizer_vocab, target: v });
        }
    }
    let settings = settings(o, enc)?;
    let (partial, progress_path) = side_files(&o.out);
    let mut counts = PrepareSummary::default();
    let mut lines_done = 0u64;
    let mut bytes = 0u64;
    if o.overwrite {
        for p in [&partial, &progress_path] {
            if p.exists() {
                std::fs::remove_file(p).map_err(io(p))?;
            }
        }
    }
    if let Ok(text) = std::fs::read_to_string(&progress_path) {
        let p: Progress = serde_json::from_str(&text).map_err(|e| PrepareError::TargetFile {
            path: progress_path.clone(),
            what: format!("an unreadable progress record ({e}); delete it, or pass --overwrite"),
        })?;
        if p.settings != settings {
            return Err(PrepareError::ResumeMismatch {
                path: progress_path,
                differing: differing(&p.settings, &settings),
            });
        }
        (lines_done, bytes, counts) = (p.lines_done, p.bytes, p.counts);
        counts.resumed_at_line = lines_done;
    } else if o.out.exists() && !o.overwrite {
        return Err(PrepareError::OutputExists { path: o.out.clone() });
    }
    let out = OpenOptions::new().create(true).write(true).truncate(false).open(&partial).map_err(io(&partial))?;
    // Lines written after the last record are dropped (and written again below).
    out.set_len(bytes).map_err(io(&partial))?;
    let mut out = std::io::BufWriter::new(out);
    std::io::Seek::seek(&mut out, std::io::SeekFrom::Start(bytes)).map_err(io(&partial))?;

    let input = File::open(&o.input).map_err(io(&o.input))?;
    let mut reader = BufReader::with_capacity(1 << 20, input);
    let mut line_no = 0u64;
    let mut buf = String::new();
    let chunk = o.chunk_lines;
    let mut chunk_index = lines_done / chunk as u64;
    progress(lines_done);
    loop {
        // One chunk of input lines (the skipped head of a resumed run is read and dropped).
        let mut convs: Vec<(u64, Vec<Message>)> = Vec::new();
        let mut read = 0u64;
        while read < chunk as u64 {
            buf.clear();
            let n = reader.read_line(&mut buf).map_err(io(&o.input))?;
            if n == 0 {
                break;
            }
            line_no += 1;
            if line_no <= lines_done {
                continue;
            }
            read += 1;
            let line = buf.trim();
            if line.is_empty() {
                continue;
            }
            let msgs = chat::parse_line(line).map_err(|e| PrepareError::Line {
                path: o.input.clone(),
                line: line_no,
                what: e.to_string(),
            })?;
            convs.push((line_no, msgs));
        }
        if read == 0 {
            break;
        }
        let mut skips: Vec<Option<Skip>> = vec![None; convs.len()];
        if let (Some(r), Some(g)) = (&o.regenerate, &generator) {
            let spec = RegenSpec {
                temperature: r.temperature,
                max_new_tokens: r.max_new_tokens,
                max_len: o.max_len.unwrap_or(usize::MAX).min(positions_needed(enc, &convs, r.max_new_tokens)),
                seed: r.seed,
            };
            let keys: Vec<u64> = convs.iter().map(|(l, _)| *l).collect();
            let mut msgs: Vec<Vec<Message>> = convs.iter().map(|(_, m)| m.clone()).collect();
            let mut st = RegenStats::default();
            skips = regenerate_batch(g.be, g.stream, g.target, enc, &mut msgs, &keys, &spec, &mut st)?;
            for ((_, m), new) in convs.iter_mut().zip(msgs) {
                *m = new;
            }
            counts.turns += st.turns;
            counts.generated_tokens += st.generated_tokens;
            counts.hit_max_new += st.hit_max_new;
            counts.cut_at_max_len += st.cut_at_max_len;
            counts.decode_rows += st.rows;
            counts.decode_secs += st.decode_secs;
        }
        let mut text = String::new();
        for ((_, msgs), skip) in convs.iter().zip(skips) {
            let res = match skip {
                Some(s) => Err(s),
                None => enc.encode(msgs).and_then(|(ids, mask)| truncate(ids, mask, o.max_len, &mut counts)),
            };
            match res {
                Ok((ids, mask)) => {
                    counts.samples += 1;
                    counts.tokens += ids.len() as u64;
                    counts.supervised_tokens += mask.iter().map(|&m| u64::from(m)).sum::<u64>();
                    let line = serde_json::json!({ "input_ids": ids, "loss_mask": mask });
                    text.push_str(&line.to_string());
                    text.push('\n');
                }
                Err(s) => *counts.skipped.entry(s.reason()).or_default() += 1,
            }
        }
        lines_done += read;
        counts.lines = lines_done;
        out.write_all(text.as_bytes()).map_err(io(&partial))?;
        out.flush().map_err(io(&partial))?;
        out.get_ref().sync_data().map_err(io(&partial))?;
        bytes += text.len() as u64;
        if o.abort_after_chunk == Some(chunk_index) {
            return Err(PrepareError::InjectedAbort);
        }
        let rec = Progress { settings: settings.clone(), lines_done, bytes, counts: counts.clone() };
        let rec = serde_json::to_vec(&rec).map_err(|e| PrepareError::InvalidArgument(e.to_string()))?;
        crate::weights::write_file_atomic(&progress_path, &rec).map_err(|e| PrepareError::Io {
            path: progress_path.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
        chunk_index += 1;
        progress(lines_done);
    }
    drop(out);
    if counts.samples == 0 {
        // An empty file would fail only later, in `run --data`; an existing --out stays as it was.
        for p in [&partial, &progress_path] {
            std::fs::remove_file(p).map_err(io(p))?;
        }
        return Err(PrepareError::NoSamples { input: o.input.clone(), lines: counts.lines, skipped: counts.skipped });
    }
    std::fs::rename(&partial, &o.out).map_err(io(&o.out))?;
    std::fs::remove_file(&progress_path).map_err(io(&progress_path))?;
    Ok(counts)
}

/// Positions a chunk's conversations may need: the last answer's prompt as the dataset has it,
/// plus a full answer budget for every turn (regenerated answers may be longer than the
/// originals), the longest of the chunk. It sizes the cache, capped by `--max-len`.
fn positions_needed(enc: &Encoder, convs: &[(u64, Vec<Message>)], max_new_tokens: usize) -> usize {
    convs
        .iter()
        .filter_map(|(_, m)| {
            let turns = m.iter().filter(|x| x.role == "assistant").count();
            let a = m.iter().rposition(|x| x.role == "assistant")?;
            let prompt = enc.encode_prompt(&m[..a]).ok()?.len();
            Some(prompt + turns * max_new_tokens + 1)
        })
        .max()
        .unwrap_or(1)
}

/// Cuts a sample to `max_len` tokens (counted), refusing it if no supervised pair is left.
fn truncate(
    mut ids: Vec<u32>,
    mut mask: Vec<u8>,
    max_len: Option<usize>,
    counts: &mut PrepareSummary,
) -> Result<(Vec<u32>, Vec<u8>), Skip> {
    let cut = max_len.is_some_and(|m| ids.len() > m);
    if let Some(m) = max_len {
        ids.truncate(m);
        mask.truncate(m);
    }
    if !mask.windows(2).any(|w| w[0] == 1 && w[1] == 1) {
        return Err(Skip::NoSupervisedPair);
    }
    if cut {
        counts.truncated += 1;
    }
    Ok((ids, mask))
}
