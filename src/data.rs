//! Training data: pre-tokenized JSON Lines, one sample a line, validated as it streams in; and
//! the order in which a run visits the samples.
//!
//! Format (extra keys are ignored, blank lines skipped):
//! ```text
//! {"input_ids": [151644, 872, 198, ...], "loss_mask": [0, 0, 0, ..., 1, 1, 1]}
//! ```
//! `loss_mask` is 1 on tokens to learn (the response) and 0 on the prompt. A sample trains the
//! drafter only through anchor candidates `p` with `loss_mask[p] & loss_mask[p + 1]` (DFLASH.md
//! section 4), so a sample without one is refused: it would cost target compute and teach nothing.
//!
//! Order: the sample stream is epoch 0, epoch 1, ... laid end to end, each epoch a Fisher-Yates
//! permutation drawn from Philox keyed by `(seed, epoch, domain::SHUFFLE)`; step `s` takes stream
//! positions `s * batch_size .. (s + 1) * batch_size`. The samples of a step are therefore a pure
//! function of `(step, batch_size, seed)` and the file: `--resume` needs no saved data state,
//! only the step count.

use crate::rng::{self, Philox};
use crate::train::batch::Sample;
use serde::Deserialize;
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Where a sample came from, for error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// 1-based line number of a JSON Lines file.
    Line { path: PathBuf, line: u64 },
    /// 0-based index into the vector given to [`Dataset::from_samples`].
    Generated { index: usize },
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Line { path, line } => write!(f, "{} line {line}", path.display()),
            Origin::Generated { index } => write!(f, "generated sample {index}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot open the training data {}: {source}", .path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read {at}: {source}")]
    Read {
        at: Origin,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{at}, column {column}: not valid JSON ({message}); each line must be one object like \
         {{\"input_ids\": [...], \"loss_mask\": [...]}}"
    )]
    Json { at: Origin, column: usize, message: String },
    #[error("{at}: the field `{field}` is missing; each line needs both `input_ids` and `loss_mask`")]
    MissingField { at: Origin, field: &'static str },
    #[error(
        "{at}: token id {id} at position {position} is outside the vocabulary (size {vocab_size}); \
         the data was probably tokenized for another model: tokenize it with the target's tokenizer"
    )]
    TokenOutOfVocab { at: Origin, position: usize, id: u64, vocab_size: usize },
    #[error("{at}: `loss_mask` has {mask_len} entries but `input_ids` has {ids_len}; they must be the same length")]
    LengthMismatch { at: Origin, ids_len: usize, mask_len: usize },
    #[error("{at}: `loss_mask[{position}]` is {value}; mask values must be 0 (prompt) or 1 (learn)")]
    MaskValue { at: Origin, position: usize, value: u64 },
    #[error("{at}: the sample is empty (`input_ids` has no tokens); remove the line")]
    EmptySample { at: Origin },
    #[error(
        "{at}: no two consecutive tokens have loss_mask 1{}, so the sample has no anchor and would \
         contribute nothing to training; remove it or give it a longer response",
        fmt_truncation(*.truncated_to)
    )]
    NoSupervisedPair { at: Origin, truncated_to: Option<usize> },
    #[error("{}: no samples (the file is empty or holds only blank lines)", fmt_source(.path))]
    NoSamples { path: Option<PathBuf> },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

fn fmt_truncation(t: Option<usize>) -> String {
    t.map_or(String::new(), |s| {
        format!(" within its first {s} tokens (it was cut to --seq-len {s}; a longer --seq-len may keep it)")
    })
}

fn fmt_source(p: &Option<PathBuf>) -> String {
    p.as_ref().map_or_else(|| "the generated data".to_string(), |p| p.display().to_string())
}

/// One line as serde sees it. Ids are read as u64 so that an id beyond u32 is reported as "out
/// of vocabulary" rather than as a JSON type error; fields are optional so that a missing one
/// gets its own message.
#[derive(Deserialize)]
struct Line {
    input_ids: Option<Vec<u64>>,
    loss_mask: Option<Vec<u64>>,
}

/// Epoch permutations kept for reuse: a step needs one, or two where it straddles an epoch
/// boundary. Recomputing costs O(len) Philox draws per step, which a cache makes O(1).
const PERMUTATION_CACHE: usize = 2;

type Permutation = Arc<Vec<usize>>;

/// The training samples of a run, validated, truncated to the sequence length.
#[derive(Debug)]
pub struct Dataset {
    samples: Vec<Sample>,
    truncated: usize,
    total_tokens: u64,
    /// `(seed, epoch, permutation)`, most recent last. Invisible to callers: results are the
    /// same with or without it.
    cache: Mutex<Vec<(u64, u64, Permutation)>>,
}

impl Dataset {
    /// Reads and validates a JSON Lines file (see the module doc), streaming it line by line.
    /// Samples longer than `seq_len` are cut to their first `seq_len` tokens (counted by
    /// [`Dataset::truncated`]) and must still hold a supervised pair. Every error names the file
    /// and the 1-based line.
    pub fn from_jsonl(path: impl AsRef<Path>, vocab_size: usize, seq_len: usize) -> Result<Dataset, DataError> {
        let path = path.as_ref();
        if seq_len < 2 {
            return Err(DataError::InvalidArgument(format!(
                "seq_len {seq_len}: a sample needs at least 2 tokens to hold a supervised pair"
            )));
        }
        if vocab_size == 0 || vocab_size as u64 > 1 << 32 {
            return Err(DataError::InvalidArgument(format!("vocab_size {vocab_size}: token ids are u32")));
        }
        let file = File::open(path).map_err(|source| DataError::Open { path: path.to_path_buf(), source })?;
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut buf = Vec::new();
        let mut samples = Vec::new();
        let mut truncated = 0;
        let mut line_no = 0u64;
        loop {
            buf.clear();
            line_no += 1;
            let at = || Origin::Line { path: path.to_path_buf(), line: line_no };
            let n = reader.read_until(b'\n', &mut buf).map_err(|source| DataError::Read { at: at(), source })?;
            if n == 0 {
                break;
            }
            let mut text = buf.as_slice();
            if line_no == 1 {
                // Editors on Windows like to start UTF-8 files with a byte-order mark.
                text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
            }
            if text.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let parsed: Line = serde_json::from_slice(text).map_err(|e| json_error(at(), &e))?;
            let Some(ids) = parsed.input_ids else {
                return Err(DataError::MissingField { at: at(), field: "input_ids" });
            };
            let Some(mask) = parsed.loss_mask else {
                return Err(DataError::MissingField { at: at(), field: "loss_mask" });
            };
            if let Some((position, &id)) = ids.iter().enumerate().find(|(_, &id)| id >= vocab_size as u64) {
                return Err(DataError::TokenOutOfVocab { at: at(), position, id, vocab_size });
            }
            // Lossless: every id is below vocab_size, which is at most 2^32 (checked above).
            let ids: Vec<u32> = ids.iter().map(|&id| id as u32).collect();
            let (mut sample, was_cut) = validate(at(), ids, &mask, Some(seq_len))?;
            if was_cut {
                truncated += 1;
            }
            sample.input_ids.shrink_to_fit();
            samples.push(sample);
        }
        if samples.is_empty() {
            return Err(DataError::NoSamples { path: Some(path.to_path_buf()) });
        }
        Ok(Self::new(samples, truncated))
    }

    /// Wraps samples made in memory (e.g. generated by the target) with the same checks as a
    /// file, except the vocabulary (the generator's ids are the target's by construction) and
    /// truncation (the generator already respects the sequence length).
    pub fn from_samples(samples: Vec<Sample>) -> Result<Dataset, DataError> {
        if samples.is_empty() {
            return Err(DataError::NoSamples { path: None });
        }
        let mut checked = Vec::with_capacity(samples.len());
        for (index, s) in samples.into_iter().enumerate() {
            let mask: Vec<u64> = s.loss_mask.iter().map(|&m| u64::from(m)).collect();
            let (sample, _) = validate(Origin::Generated { index }, s.input_ids, &mask, None)?;
            checked.push(sample);
        }
        Ok(Self::new(checked, 0))
    }

    fn new(samples: Vec<Sample>, truncated: usize) -> Self {
        let total_tokens = samples.iter().map(|s| s.input_ids.len() as u64).sum();
        Dataset { samples, truncated, total_tokens, cache: Mutex::new(Vec::new()) }
    }

    /// Number of samples (one epoch).
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Always false: an empty data set is refused at construction.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Tokens over all samples, after truncation.
    pub fn total_tokens(&self) -> u64 {
        self.total_tokens
    }

    /// How many samples were longer than `seq_len` and were cut.
    pub fn truncated(&self) -> usize {
        self.truncated
    }

    /// The samples in file order.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// The epoch that the first sample of `step` belongs to (0-based).
    pub fn epoch_of_step(&self, step: u64, batch_size: usize) -> u64 {
        let first = u128::from(step) * batch_size as u128;
        u64::try_from(first / self.samples.len() as u128).unwrap_or(u64::MAX)
    }

    /// Indices (into [`Dataset::samples`]) of the `batch_size` samples of `step`: stream
    /// positions `step * batch_size ..` where position `p` is element `p % len` of the
    /// permutation of epoch `p / len`. A pure function of `(step, batch_size, seed)` and the
    /// data. A step may straddle two epochs; if `batch_size > len` it holds repeats.
    pub fn indices_for_step(&self, step: u64, batch_size: usize, seed: u64) -> Vec<usize> {
        let n = self.samples.len() as u128;
        let first = u128::from(step) * batch_size as u128;
        let mut out = Vec::with_capacity(batch_size);
        let mut current: Option<(u128, Permutation)> = None;
        for i in 0..batch_size as u128 {
            let p = first + i;
            let epoch = p / n;
            let perm = match &current {
                Some((e, perm)) if *e == epoch => perm.clone(),
                _ => {
                    let perm = self.permutation(seed, epoch);
                    current = Some((epoch, perm.clone()));
                    perm
                }
            };
            out.push(perm[(p % n) as usize]);
        }
        out
    }

    /// The samples of `step` (see [`Dataset::indices_for_step`]), cloned so that they can go
    /// straight to `train::batch::build_batch`; the copy is one batch of tokens, noise next to
    /// a training step.
    pub fn samples_for_step(&self, step: u64, batch_size: usize, seed: u64) -> Vec<Sample> {
        self.indices_for_step(step, batch_size, seed).into_iter().map(|i| self.samples[i].clone()).collect()
    }

    /// The permutation of one epoch, from the cache or drawn.
    fn permutation(&self, seed: u64, epoch: u128) -> Permutation {
        // Epochs past 2^56 would alias in the key below; at one sample per step that is
        // 7e16 steps, so the clamp can never change a real run.
        let epoch = u64::try_from(epoch).unwrap_or(u64::MAX);
        // A poisoned lock only means another thread panicked mid-update; the cache holds
        // complete entries or none, so it is safe to keep using.
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, _, perm)) = cache.iter().find(|(s, e, _)| *s == seed && *e == epoch) {
            return perm.clone();
        }
        let perm = Arc::new(epoch_permutation(self.samples.len(), seed, epoch));
        if cache.len() == PERMUTATION_CACHE {
            cache.remove(0);
        }
        cache.push((seed, epoch, perm.clone()));
        perm
    }
}

/// The order of epoch `epoch`: forward Fisher-Yates over `0..n` (`for i in 0..n-1: swap(i, i +
/// below(n - i))`, the same draw as anchor sampling) on the stream `Philox::new(seed, [epoch low
/// 32 bits, domain::SHUFFLE | (epoch bits 32..56) << 8])` — domain in the low byte of the second
/// word, as everywhere else, so shuffles never share bits with anchors or noise.
pub fn epoch_permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let stream = [epoch as u32, rng::domain::SHUFFLE | (((epoch >> 32) as u32) << 8)];
    let mut r = Philox::new(seed, stream);
    let mut perm: Vec<usize> = (0..n).collect();
    for i in 0..n.saturating_sub(1) {
        let j = i + r.below((n - i) as u64) as usize;
        perm.swap(i, j);
    }
    perm
}

/// serde_json ends its messages with "at line 1 column N"; the line is always 1 here (one JSON
/// document per line), so the position is reported once, as our line and its column.
fn json_error(at: Origin, e: &serde_json::Error) -> DataError {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = full.strip_suffix(&suffix).unwrap_or(&full).to_string();
    DataError::Json { at, column: e.column(), message }
}

/// The checks every sample passes, wherever it came from. Returns the sample and whether it was
/// truncated to `seq_len`.
fn validate(at: Origin, ids: Vec<u32>, mask: &[u64], seq_len: Option<usize>) -> Result<(Sample, bool), DataError> {
    if ids.is_empty() {
        return Err(DataError::EmptySample { at });
    }
    if mask.len() != ids.len() {
        return Err(DataError::LengthMismatch { at, ids_len: ids.len(), mask_len: mask.len() });
    }
    if let Some((position, &value)) = mask.iter().enumerate().find(|(_, &m)| m > 1) {
        return Err(DataError::MaskValue { at, position, value });
    }
    let mut sample = Sample { input_ids: ids, loss_mask: mask.iter().map(|&m| m as u8).collect() };
    let cut = seq_len.filter(|&s| sample.input_ids.len() > s);
    if let Some(s) = cut {
        sample.input_ids.truncate(s);
        sample.loss_mask.truncate(s);
    }
    let has_pair = sample.loss_mask.windows(2).any(|w| w[0] != 0 && w[1] != 0);
    if !has_pair {
        return Err(DataError::NoSupervisedPair { at, truncated_to: cut });
    }
    Ok((sample, cut.is_some()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A JSON Lines file under the system temp dir with a name unique to this process and call,
    /// removed when dropped.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(contents: &str) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!("dflash-data-test-{}-{n}.jsonl", std::process::id()));
            std::fs::write(&p, contents).unwrap();
            TempFile(p)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    const VOCAB: usize = 1000;

    fn load(contents: &str, seq_len: usize) -> (TempFile, Result<Dataset, DataError>) {
        let f = TempFile::new(contents);
        let r = Dataset::from_jsonl(&f.0, VOCAB, seq_len);
        (f, r)
    }

    /// Loads, expects an error, and checks that its message names the file and the line.
    fn load_err(contents: &str, seq_len: usize, line: u64) -> DataError {
        let (f, r) = load(contents, seq_len);
        let e = r.expect_err("the data should have been refused");
        let msg = e.to_string();
        assert!(msg.contains(&format!("{} line {line}", f.0.display())), "{msg}");
        e
    }

    fn sample(len: usize, prompt: usize) -> Sample {
        Sample {
            input_ids: (0..len as u32).map(|i| (i * 7 + 3) % VOCAB as u32).collect(),
            loss_mask: (0..len).map(|i| u8::from(i >= prompt)).collect(),
        }
    }

    fn dataset(n: usize) -> Dataset {
        Dataset::from_samples((0..n).map(|i| sample(4 + i % 5, 1)).collect()).unwrap()
    }

    #[test]
    fn reads_samples_skips_blank_lines_and_ignores_extra_keys() {
        let text = "\u{feff}{\"input_ids\": [1, 2, 3], \"loss_mask\": [0, 1, 1], \"source\": \"chat\"}\n\
                    \n   \r\n\
                    {\"loss_mask\": [1, 1], \"input_ids\": [999, 0], \"meta\": {\"x\": [1]}}\r\n\
                    {\"input_ids\": [5, 6, 7, 8], \"loss_mask\": [0, 0, 1, 1]}";
        let (_f, r) = load(text, 16);
        let d = r.unwrap();
        assert_eq!(d.len(), 3);
        assert_eq!(d.samples()[0], Sample { input_ids: vec![1, 2, 3], loss_mask: vec![0, 1, 1] });
        assert_eq!(d.samples()[1], Sample { input_ids: vec![999, 0], loss_mask: vec![1, 1] });
        assert_eq!(d.samples()[2].input_ids, vec![5, 6, 7, 8]);
        assert_eq!(d.total_tokens(), 9);
        assert_eq!(d.truncated(), 0);
    }

    #[test]
    fn missing_file_is_an_open_error() {
        let p = std::env::temp_dir().join(format!("dflash-data-test-{}-does-not-exist.jsonl", std::process::id()));
        let e = Dataset::from_jsonl(&p, VOCAB, 16).unwrap_err();
        assert!(matches!(&e, DataError::Open { path, .. } if *path == p), "{e}");
        assert!(e.to_string().contains(&p.display().to_string()));
    }

    #[test]
    fn bad_json_reports_line_column_and_serde_message() {
        let text = "{\"input_ids\": [1, 2], \"loss_mask\": [1, 1]}\n{\"input_ids\": [1, 2,, 3]}\n";
        let e = load_err(text, 16, 2);
        match &e {
            DataError::Json { column, message, .. } => {
                assert_eq!(*column, 21, "the second comma");
                assert!(message.contains("expected value"), "{message}");
                assert!(!message.contains("line 1"), "{message}");
            }
            other => panic!("{other}"),
        }
        // Wrong types are JSON errors too, with serde's words.
        let e = load_err("{\"input_ids\": [-1, 2], \"loss_mask\": [1, 1]}", 16, 1);
        assert!(matches!(&e, DataError::Json { message, .. } if message.contains("-1")), "{e}");
        let e = load_err("{\"input_ids\": \"hello\", \"loss_mask\": [1, 1]}", 16, 1);
        assert!(matches!(e, DataError::Json { .. }));
        // A file cut in the middle of its last line (an interrupted copy).
        let e = load_err("{\"input_ids\": [1, 2], \"loss_mask\": [1, 1]}\n{\"input_ids\": [1, 2], \"loss_ma", 16, 2);
        assert!(matches!(&e, DataError::Json { message, .. } if message.contains("EOF")), "{e}");
    }

    #[test]
    fn missing_fields_are_named() {
        let ok = "{\"input_ids\": [1, 2], \"loss_mask\": [1, 1]}\n";
        let e = load_err(&format!("{ok}{ok}{{\"input_ids\": [1, 2]}}\n"), 16, 3);
        assert!(matches!(e, DataError::MissingField { field: "loss_mask", .. }), "{e}");
        let e = load_err(&format!("{ok}\n{{\"ids\": [1, 2], \"loss_mask\": [1, 1]}}"), 16, 3);
        assert!(matches!(e, DataError::MissingField { field: "input_ids", .. }), "{e}");
    }

    #[test]
    fn out_of_vocabulary_id_names_the_id_and_the_model() {
        let e = load_err("{\"input_ids\": [1, 999, 1000], \"loss_mask\": [0, 1, 1]}", 16, 1);
        assert!(matches!(e, DataError::TokenOutOfVocab { position: 2, id: 1000, vocab_size: VOCAB, .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("1000") && msg.contains("another model"), "{msg}");
        // Beyond u32: still an out-of-vocabulary error, not a type error.
        let e = load_err("{\"input_ids\": [5000000000, 1], \"loss_mask\": [1, 1]}", 16, 1);
        assert!(matches!(e, DataError::TokenOutOfVocab { id: 5_000_000_000, .. }), "{e}");
    }

    #[test]
    fn mask_length_must_match() {
        let e = load_err("{\"input_ids\": [1, 2, 3], \"loss_mask\": [1, 1]}", 16, 1);
        assert!(matches!(e, DataError::LengthMismatch { ids_len: 3, mask_len: 2, .. }), "{e}");
    }

    #[test]
    fn mask_values_must_be_zero_or_one() {
        let e = load_err("{\"input_ids\": [1, 2, 3], \"loss_mask\": [0, 1, 2]}", 16, 1);
        assert!(matches!(e, DataError::MaskValue { position: 2, value: 2, .. }), "{e}");
    }

    #[test]
    fn empty_sample_is_refused() {
        let e = load_err("{\"input_ids\": [], \"loss_mask\": []}", 16, 1);
        assert!(matches!(e, DataError::EmptySample { .. }), "{e}");
    }

    #[test]
    fn sample_without_supervised_pair_is_refused() {
        // Alternating mask: tokens to learn, but never two in a row.
        let e = load_err("{\"input_ids\": [1, 2, 3, 4], \"loss_mask\": [1, 0, 1, 0]}", 16, 1);
        assert!(matches!(e, DataError::NoSupervisedPair { truncated_to: None, .. }), "{e}");
        assert!(e.to_string().contains("contribute nothing"), "{e}");
        let e = load_err("{\"input_ids\": [1], \"loss_mask\": [1]}", 16, 1);
        assert!(matches!(e, DataError::NoSupervisedPair { .. }), "{e}");
    }

    #[test]
    fn file_without_samples_is_refused() {
        let (f, r) = load("\n  \n\n", 16);
        let e = r.unwrap_err();
        assert!(matches!(&e, DataError::NoSamples { path: Some(p) } if *p == f.0), "{e}");
        assert!(e.to_string().contains(&f.0.display().to_string()));
        let (_f, r) = load("", 16);
        assert!(matches!(r, Err(DataError::NoSamples { .. })));
    }

    #[test]
    fn long_samples_are_truncated_and_rechecked() {
        let text = "{\"input_ids\": [1, 2, 3, 4, 5, 6], \"loss_mask\": [0, 0, 1, 1, 1, 1]}\n\
                    {\"input_ids\": [1, 2, 3, 4], \"loss_mask\": [1, 1, 1, 1]}\n\
                    {\"input_ids\": [1, 2, 3, 4, 5], \"loss_mask\": [0, 1, 1, 0, 0]}";
        let (_f, r) = load(text, 4);
        let d = r.unwrap();
        assert_eq!(d.truncated(), 2);
        assert_eq!(d.samples()[0], Sample { input_ids: vec![1, 2, 3, 4], loss_mask: vec![0, 0, 1, 1] });
        assert_eq!(d.samples()[1].input_ids.len(), 4, "exactly seq_len is not truncated");
        assert_eq!(d.samples()[2].input_ids, vec![1, 2, 3, 4]);
        assert_eq!(d.total_tokens(), 12);
        // The response starts at position 3: within 3 tokens only one learned token remains.
        let e = load_err(text, 3, 1);
        assert!(matches!(e, DataError::NoSupervisedPair { truncated_to: Some(3), .. }), "{e}");
        assert!(e.to_string().contains("--seq-len 3"), "{e}");
        let (_f, r) = load(text, 1);
        assert!(matches!(r, Err(DataError::InvalidArgument(_))));
    }

    #[test]
    fn generated_samples_get_the_same_checks() {
        assert!(matches!(Dataset::from_samples(vec![]), Err(DataError::NoSamples { path: None })));
        let bad = Sample { input_ids: vec![1, 2, 3], loss_mask: vec![1, 0, 1] };
        let e = Dataset::from_samples(vec![sample(5, 1), bad]).unwrap_err();
        assert!(matches!(e, DataError::NoSupervisedPair { at: Origin::Generated { index: 1 }, .. }), "{e}");
        assert!(e.to_string().contains("generated sample 1"), "{e}");
        let bad = Sample { input_ids: vec![1, 2, 3], loss_mask: vec![1, 1, 3] };
        assert!(matches!(Dataset::from_samples(vec![bad]), Err(DataError::MaskValue { value: 3, .. })));
        let bad = Sample { input_ids: vec![1, 2, 3], loss_mask: vec![1, 1] };
        assert!(matches!(Dataset::from_samples(vec![bad]), Err(DataError::LengthMismatch { .. })));
        let bad = Sample { input_ids: vec![], loss_mask: vec![] };
        assert!(matches!(Dataset::from_samples(vec![bad]), Err(DataError::EmptySample { .. })));
    }

    #[test]
    fn samples_for_step_is_a_pure_function() {
        let a = dataset(37);
        let b = dataset(37);
        // Different call orders, a different cache state, a fresh data set: the same answers.
        let forward: Vec<Vec<usize>> = (0..30).map(|s| a.indices_for_step(s, 5, 11)).collect();
        let backward: Vec<Vec<usize>> = (0..30).rev().map(|s| b.indices_for_step(s, 5, 11)).collect();
        for (s, want) in forward.iter().enumerate() {
            assert_eq!(&backward[29 - s], want, "step {s}");
            assert_eq!(&a.indices_for_step(s as u64, 5, 7), &dataset(37).indices_for_step(s as u64, 5, 7));
            assert_eq!(a.indices_for_step(s as u64, 5, 11), *want, "step {s} after other seeds");
        }
        let got: Vec<Sample> = a.samples_for_step(3, 5, 11);
        let want: Vec<Sample> = forward[3].iter().map(|&i| a.samples()[i].clone()).collect();
        assert_eq!(got, want);
        // The seed matters.
        assert_ne!(a.indices_for_step(0, 37, 11), a.indices_for_step(0, 37, 12));
    }

    #[test]
    fn steps_tile_the_stream_of_epochs() {
        let d = dataset(10);
        // Batch 3 over 10 samples: step 3 takes stream positions 9, 10, 11 (epoch 0 then 1).
        let stream: Vec<usize> = (0..20).flat_map(|s| d.indices_for_step(s, 3, 5)).collect();
        let e0 = epoch_permutation(10, 5, 0);
        let e1 = epoch_permutation(10, 5, 1);
        assert_eq!(&stream[..10], e0.as_slice());
        assert_eq!(&stream[10..20], e1.as_slice());
        assert_eq!(d.indices_for_step(3, 3, 5), vec![e0[9], e1[0], e1[1]]);
        assert_eq!(d.epoch_of_step(3, 3), 0);
        assert_eq!(d.epoch_of_step(4, 3), 1);
        assert_eq!(d.epoch_of_step(20, 3), 6);
        // A batch larger than the data set repeats samples and spans epochs.
        let big = d.indices_for_step(1, 25, 5);
        assert_eq!(big.len(), 25);
        assert_eq!(big[5..15], epoch_permutation(10, 5, 3)[..]);
        assert!(d.indices_for_step(4, 0, 5).is_empty());
    }

    #[test]
    fn one_epoch_visits_every_sample_once_and_epochs_differ() {
        for n in [1usize, 2, 3, 17, 1000] {
            let d = dataset(n);
            let mut epochs = Vec::new();
            for epoch in 0..4u64 {
                // Batch 1: step == stream position.
                let visit: Vec<usize> =
                    (epoch * n as u64..(epoch + 1) * n as u64).flat_map(|s| d.indices_for_step(s, 1, 42)).collect();
                let mut sorted = visit.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n {n} epoch {epoch}");
                epochs.push(visit);
            }
            if n >= 17 {
                assert_ne!(epochs[0], epochs[1]);
                assert_ne!(epochs[1], epochs[2]);
                assert_ne!(epochs[0], (0..n).collect::<Vec<_>>(), "the first epoch is shuffled too");
            }
        }
    }

    #[test]
    fn shuffle_is_roughly_uniform() {
        // Where does sample 0 land, over many epochs of 4? Each slot ~1/4 (binomial: 2000 +- 5 sigma).
        let mut counts = [0usize; 4];
        for epoch in 0..8000 {
            let perm = epoch_permutation(4, 9, epoch);
            counts[perm.iter().position(|&i| i == 0).unwrap()] += 1;
        }
        for c in counts {
            assert!((c as f64 - 2000.0).abs() < 5.0 * (8000.0f64 * 0.25 * 0.75).sqrt(), "{counts:?}");
        }
        // And all 24 orders appear.
        let orders: HashSet<Vec<usize>> = (0..2000).map(|e| epoch_permutation(4, 9, e)).collect();
        assert_eq!(orders.len(), 24);
    }
}
