//! `prepare-data` end to end, no downloads: a byte-level BPE tokenizer and a Qwen-style chat
//! template (`<|im_start|>` / `<|im_end|>`) built here. The mask must sit exactly on each answer
//! and its end-of-turn token, in both input layouts, multi-turn, with and without a system
//! prompt; `--max-len` truncation and bad lines are reported; the output trains; `--regenerate`
//! on the tiny target writes the target's greedy answers (checked against a batch-1 decode from
//! scratch, turn by turn) and survives a kill.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::Scratch;
use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::Backend;
use dflash_engine::config::TargetConfig;
use dflash_engine::model::target::Target;
use dflash_engine::prepare::chat::{parse_line, Message};
use dflash_engine::prepare::encode::Encoder;
use dflash_engine::prepare::{prepare, Generator, PrepareError, PrepareOptions, PrepareSummary, RegenOptions};
use dflash_engine::session::setup::TargetSource;
use dflash_engine::session::{self, RunOptions};
use dflash_engine::tensor::DType;
use dflash_engine::weights;
use serde_json::json;

/// Qwen2.5's template without tools: a default system prompt when the conversation has none.
pub const TEMPLATE: &str = r#"{%- for message in messages %}
{%- if loop.first and message.role != 'system' %}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

/// A byte-level BPE over printable ASCII, space and newline, with a few merges, and the three
/// Qwen special tokens after it (about 110 ids: inside the tiny preset's vocabulary of 256).
pub fn tokenizer_json() -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    let mut push = |s: String| {
        let id = vocab.len();
        vocab.insert(s, json!(id));
    };
    for b in 33u8..=126 {
        push((b as char).to_string());
    }
    push("\u{120}".into()); // byte-level space
    push("\u{10a}".into()); // byte-level newline
    let merges = ["\u{120} t", "h e", "i n", "\u{120}t he", "e r", "o u", "\u{120} a"];
    for m in merges {
        push(m.replace(' ', ""));
    }
    let n = vocab.len();
    let added: Vec<_> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": n + i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    })
}

/// Writes the tokenizer and template into `dir` (a target folder, or a bare one).
pub fn write_tokenizer(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json().to_string()).unwrap();
    let cfg = json!({"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"});
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
}

fn opts(dir: &Path, input: &Path, out: &Path) -> PrepareOptions {
    PrepareOptions {
        target_dir: dir.to_path_buf(),
        input: input.to_path_buf(),
        out: out.to_path_buf(),
        max_len: None,
        regenerate: None,
        overwrite: false,
        chunk_lines: 2,
        abort_after_chunk: None,
    }
}

fn run_plain(o: &PrepareOptions) -> Result<PrepareSummary, PrepareError> {
    let enc = Encoder::from_dir(&o.target_dir)?;
    prepare::<CpuBackend>(o, &enc, Some(256), None, |_| {})
}

fn read_samples(path: &Path) -> Vec<(Vec<u32>, Vec<u8>)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let ids = v["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let mask = v["loss_mask"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u8).collect();
            (ids, mask)
        })
        .collect()
}

/// The maximal runs of mask 1, each decoded to text.
fn masked_runs(enc: &Encoder, ids: &[u32], mask: &[u8]) -> Vec<String> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        if mask[i] == 1 {
            let j = (i..ids.len()).find(|&j| mask[j] == 0).unwrap_or(ids.len());
            runs.push(enc.tokenizer.decode(&ids[i..j], false).unwrap());
            i = j;
        } else {
            i += 1;
        }
    }
    runs
}

/// Checks one sample against its conversation: the ids spell the rendered text, and the masked
/// runs are exactly the answers, each followed by `<|im_end|>`, in order.
fn check_sample(enc: &Encoder, msgs: &[Message], ids: &[u32], mask: &[u8]) {
    let text = enc.template.render(msgs, false).unwrap();
    assert_eq!(enc.tokenizer.decode(ids, false).unwrap(), text, "the ids spell the rendered conversation");
    // An answer cut at --max-new-tokens ends with the template's <|im_end|>, not the model's.
    let want: Vec<String> = msgs
        .iter()
        .filter(|m| m.role == "assistant")
        .map(|m| format!("{}{}", m.content, if m.unfinished { "" } else { "<|im_end|>" }))
        .collect();
    assert_eq!(masked_runs(enc, ids, mask), want, "mask 1 exactly on each answer + <|im_end|> where it ended");
}

const SINGLE_OPENAI: &str = r#"{"messages": [{"role": "user", "content": "What is the answer?"}, {"role": "assistant", "content": "The answer is forty two."}]}"#;
const MULTI_SHAREGPT: &str = r#"{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello! How can I help?"}, {"from": "human", "value": "Tell me about the sea"}, {"from": "gpt", "value": "It is wet, and blue.\nVery deep."}]}"#;
const MULTI_OPENAI: &str = r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me about the sea"}, {"role": "assistant", "content": "It is wet, and blue.\nVery deep."}]}"#;
const NO_ANSWER: &str = r#"{"messages": [{"role": "user", "content": "Anyone?"}]}"#;

#[test]
fn prepare_masks_exactly_the_answers_in_both_layouts() {
    let scratch = Scratch::new("prep-prepare_masks_exactly_the_answers_in_both_layouts");
    let dir = scratch.path().to_path_buf();
    write_tokenizer(&dir);
    let input = dir.join("chats.jsonl");
    let lines = [SINGLE_OPENAI, MULTI_SHAREGPT, "", MULTI_OPENAI, NO_ANSWER];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.join("train.jsonl");
    let s = run_plain(&opts(&dir, &input, &out)).unwrap();
    assert_eq!((s.samples, s.lines, s.truncated), (3, 5, 0));
    assert_eq!(s.skipped.get("no assistant turn"), Some(&1), "{:?}", s.skipped);
    let enc = Encoder::from_dir(&dir).unwrap();
    assert_eq!(enc.end_of_turn.as_deref(), Some("<|im_end|>"));
    let samples = read_samples(&out);
    assert_eq!(samples.len(), 3);
    for ((ids, mask), line) in samples.iter().zip([SINGLE_OPENAI, MULTI_SHAREGPT, MULTI_OPENAI]) {
        check_sample(&enc, &parse_line(line).unwrap(), ids, mask);
    }
    // The default system prompt is there (and unmasked) when the conversation has none.
    let text = enc.tokenizer.decode(&samples[0].0, false).unwrap();
    assert!(text.starts_with("<|im_start|>system\nYou are a helpful assistant.<|im_end|>"), "{text}");
    // Both layouts of one conversation give the same sample.
    assert_eq!(samples[1], samples[2]);
    // The merges are used: fewer tokens than characters.
    assert!(samples[0].0.len() < text.len() - 20, "{} tokens for {} chars", samples[0].0.len(), text.len());
    let sup: u64 = samples.iter().map(|(_, m)| m.iter().map(|&x| u64::from(x)).sum::<u64>()).sum();
    assert_eq!(s.supervised_tokens, sup);
    assert_eq!(s.tokens, samples.iter().map(|(i, _)| i.len() as u64).sum::<u64>());
    assert!(!dir.join("train.jsonl.partial").exists() && !dir.join("train.jsonl.progress").exists());
    // A second run into the same --out is refused, --overwrite replaces it.
    let e = run_plain(&opts(&dir, &input, &out)).unwrap_err();
    assert!(matches!(e, PrepareError::OutputExists { .. }), "{e}");
    run_plain(&PrepareOptions { overwrite: true, ..opts(&dir, &input, &out) }).unwrap();
    assert_eq!(read_samples(&out), samples);
    // --out naming the input, in any spelling, is refused even with --overwrite: the
    // conversations would be replaced by their tokens.
    let chats = std::fs::read(&input).unwrap();
    for same in [input.clone(), dir.join(".").join("chats.jsonl")] {
        let e = run_plain(&PrepareOptions { overwrite: true, ..opts(&dir, &input, &same) }).unwrap_err();
        assert!(e.to_string().contains("is the --input file"), "{e}");
    }
    assert_eq!(std::fs::read(&input).unwrap(), chats);
}

#[test]
fn prepare_truncates_to_max_len_and_counts_it() {
    let scratch = Scratch::new("prep-prepare_truncates_to_max_len_and_counts_it");
    let dir = scratch.path().to_path_buf();
    write_tokenizer(&dir);
    let input = dir.join("chats.jsonl");
    std::fs::write(&input, format!("{SINGLE_OPENAI}\n{MULTI_SHAREGPT}\n")).unwrap();
    let full = dir.join("full.jsonl");
    run_plain(&opts(&dir, &input, &full)).unwrap();
    let whole = read_samples(&full);
    // Cut inside the second conversation's first answer: the first conversation's answer starts
    // later, so it keeps no supervised pair and is skipped.
    let enc = Encoder::from_dir(&dir).unwrap();
    let first_answer = |m: &[u8]| m.iter().position(|&x| x == 1).unwrap();
    let (a0, a1) = (first_answer(&whole[0].1), first_answer(&whole[1].1));
    assert!(a1 + 3 < a0, "the test needs the multi-turn answer to start first ({a1} vs {a0})");
    let max_len = a1 + 3;
    let out = dir.join("cut.jsonl");
    let s = run_plain(&PrepareOptions { max_len: Some(max_len), ..opts(&dir, &input, &out) }).unwrap();
    assert_eq!((s.samples, s.truncated), (1, 1));
    assert_eq!(s.skipped.get("no two consecutive supervised tokens (within --max-len)"), Some(&1), "{:?}", s.skipped);
    let cut = read_samples(&out);
    assert_eq!(cut[0].0, whole[1].0[..max_len].to_vec());
    assert_eq!(cut[0].1, whole[1].1[..max_len].to_vec());
    assert!(s.describe(&out).contains("1 truncated"), "{}", s.describe(&out));
    // A cut that leaves no sample at all is an error naming why, and the output written before
    // stays as it was (an empty file would only fail later, in `run --data`).
    let before = std::fs::read(&out).unwrap();
    let o = PrepareOptions { max_len: Some(2), overwrite: true, ..opts(&dir, &input, &out) };
    let e = run_plain(&o).unwrap_err().to_string();
    assert!(e.contains("chats.jsonl: none of its 2 lines gave a sample") && e.contains("2 no two consecutive"), "{e}");
    assert_eq!(std::fs::read(&out).unwrap(), before);
    let fresh = dir.join("none.jsonl");
    run_plain(&PrepareOptions { max_len: Some(2), ..opts(&dir, &input, &fresh) }).unwrap_err();
    assert!(std::fs::read_dir(&dir).unwrap().all(|f| !f.unwrap().file_name().to_string_lossy().starts_with("none.")));
    drop(enc);
}

#[test]
fn prepare_names_the_line_of_a_bad_input() {
    let scratch = Scratch::new("prep-prepare_names_the_line_of_a_bad_input");
    let dir = scratch.join("bad");
    std::fs::create_dir_all(&dir).unwrap();
    write_tokenizer(&dir);
    let input = dir.join("chats.jsonl");
    for (bad, what) in [
        ("{\"messages\": [", "not valid JSON"),
        (r#"{"messages": [{"role": "robot", "content": "x"}]}"#, "unknown role \"robot\""),
        (r#"{"text": "x"}"#, "neither `conversations`"),
    ] {
        std::fs::write(&input, format!("{SINGLE_OPENAI}\n\n{bad}\n{SINGLE_OPENAI}\n")).unwrap();
        let out = dir.join("train.jsonl");
        let e = run_plain(&PrepareOptions { overwrite: true, ..opts(&dir, &input, &out) }).unwrap_err().to_string();
        assert!(e.contains("chats.jsonl line 3") && e.contains(what), "{e}");
        assert!(!out.exists(), "no output file after an error");
    }
    // A folder without a template says where to get one.
    let bare = scratch.join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::write(bare.join("tokenizer.json"), tokenizer_json().to_string()).unwrap();
    let e = Encoder::from_dir(&bare).err().unwrap().to_string();
    assert!(e.contains("no chat template"), "{e}");
}

#[test]
fn prepare_output_trains() {
    let scratch = Scratch::new("prep-prepare_output_trains");
    let dir = scratch.path().to_path_buf();
    write_tokenizer(&dir);
    let input = dir.join("chats.jsonl");
    std::fs::write(&input, [SINGLE_OPENAI, MULTI_SHAREGPT, MULTI_OPENAI].join("\n")).unwrap();
    let out = dir.join("train.jsonl");
    run_plain(&opts(&dir, &input, &out)).unwrap();
    let mut ro = RunOptions::tiny_default();
    ro.data.path = Some(out);
    ro.data.seq_len = 256;
    ro.data.batch_size = 2;
    ro.data.anchors = 4;
    ro.model.block_size = 4;
    ro.train.steps = 3;
    ro.output.out = dir.join("run");
    ro.output.quiet = true;
    ro.output.tensorboard = false;
    ro.exec.device = session::Device::Cpu;
    let r = session::run(&ro, None).unwrap();
    assert_eq!(r.history.len(), 3);
    assert!(r.history.iter().all(|h| !h.skipped && h.loss.is_finite()), "every step trains with a finite loss");
}

/// A tiny target folder (the `tiny` preset's random weights) with the test tokenizer: `root`/target.
pub fn tiny_target(root: &Path) -> PathBuf {
    let dir = root.join("target");
    weights::init_target(&TargetConfig::preset("tiny").unwrap(), 0, 0.05, &dir).unwrap();
    write_tokenizer(&dir);
    dir
}

/// Turn by turn, each answer decoded greedily from scratch at batch 1 (a fresh cache per turn):
/// the reference `--regenerate` must reproduce.
pub fn greedy_reference<B: Backend>(
    be: &B,
    target: &Target<B>,
    enc: &Encoder,
    msgs: &[Message],
    max_new: usize,
) -> Vec<Message> {
    let s = be.compute_stream();
    let mut msgs = msgs.to_vec();
    let vocab = target.shape.vocab;
    for a in 0..msgs.len() {
        if msgs[a].role != "assistant" {
            continue;
        }
        let mut seq = enc.encode_prompt(&msgs[..a]).unwrap();
        let prompt = seq.len();
        let mut cache = target.new_cache(be, &s, 1, prompt + max_new + 1).unwrap();
        let mut logits = be.alloc(&s, DType::F32, vocab).unwrap();
        let mut tok = be.alloc_ids(&s, 1).unwrap();
        let mut answer = Vec::new();
        let mut stopped = false;
        for t in 0.. {
            be.upload_ids(&s, &[seq[t] as i32], &mut tok).unwrap();
            target.decode_step(be, &s, &mut cache, &tok, t, &mut logits).unwrap();
            if t + 1 < prompt {
                continue;
            }
            let row = be.download(&s, &logits).unwrap();
            let row = &row[..enc.tokenizer_vocab];
            let next = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b }) as u32;
            if enc.stop_ids.contains(&next) {
                stopped = true;
                break;
            }
            answer.push(next);
            seq.push(next);
            if answer.len() == max_new {
                break;
            }
        }
        msgs[a].content = enc.tokenizer.decode(&answer, false).unwrap();
        msgs[a].unfinished = !stopped;
    }
    msgs
}

const MAX_NEW: usize = 12;

const SHORT: &str = r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}]}"#;

/// The conversations `--regenerate` is tested on (six answers; prompts of different lengths).
pub const REGEN_LINES: [&str; 4] = [MULTI_SHAREGPT, SINGLE_OPENAI, SHORT, MULTI_OPENAI];

/// Writes `REGEN_LINES` and a conversation without an answer (skipped) as the input.
pub fn regen_input(dir: &Path) -> PathBuf {
    let input = dir.join("chats.jsonl");
    let mut lines = REGEN_LINES.to_vec();
    lines.push(NO_ANSWER);
    std::fs::write(&input, lines.join("\n")).unwrap();
    input
}

/// Loads a target folder on `be` with every layer (decoding needs them).
pub fn load_target<B: Backend>(be: &B, dir: &Path) -> Target<B> {
    let src = TargetSource::resolve(&dir.to_string_lossy(), 0, 0.0, &mut Vec::new()).unwrap();
    let last = src.config().num_hidden_layers - 1;
    src.load(be, vec![last], true).unwrap()
}

/// `--regenerate` (greedy) on `be` in batches of 3 must equal the batch-1 reference, line by line.
pub fn check_regenerate<B: Backend>(be: &B, tag: &str) {
    let scratch = Scratch::new(&format!("prep-{tag}"));
    let dir = tiny_target(scratch.path());
    let input = regen_input(dir.parent().unwrap());
    let out = dir.parent().unwrap().join("train.jsonl");
    let target = load_target(be, &dir);
    let enc = Encoder::from_dir(&dir).unwrap();
    let o = PrepareOptions {
        regenerate: Some(RegenOptions { temperature: 0.0, max_new_tokens: MAX_NEW, seed: 0 }),
        chunk_lines: 3, // batches of different prompt lengths, one of two turns
        ..opts(&dir, &input, &out)
    };
    let s = be.compute_stream();
    let g = Generator { be, stream: &s, target: &target };
    let sum = prepare(&o, &enc, Some(256), Some(g), |_| {}).unwrap();
    assert_eq!((sum.samples, sum.turns), (4, 6), "{sum:?}");
    let got = read_samples(&out);
    let mut changed = 0;
    for ((ids, mask), line) in got.iter().zip(REGEN_LINES) {
        let orig = parse_line(line).unwrap();
        let want = greedy_reference(be, &target, &enc, &orig, MAX_NEW);
        let (wids, wmask) = enc.encode(&want).unwrap();
        assert_eq!((ids, mask), (&wids, &wmask), "regenerated {line}");
        check_sample(&enc, &want, ids, mask);
        changed += usize::from(want != orig);
    }
    assert_eq!(changed, 4, "every conversation got the target's answers");
    assert!(sum.hit_max_new > 0, "the test covers answers cut at --max-new-tokens: {sum:?}");
    assert!(sum.generated_tokens > 0 && sum.decode_rows >= sum.generated_tokens);
}

#[test]
fn regenerate_writes_the_targets_greedy_answers() {
    check_regenerate(&CpuBackend::new(), "regen");
}

fn bin() -> String {
    std::env::var("DFLASH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dflash-engine").to_string())
}

fn cli(dir: &Path, input: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin());
    c.args(["prepare-data", "--target"]).arg(dir).arg("--input").arg(input).arg("--out").arg(out);
    c.args(["--regenerate", "--device", "cpu", "--batch", "2", "--quiet", "--max-new-tokens", "10"]).args(extra);
    c
}

#[test]
fn regenerate_resumes_after_a_kill_without_duplicates_or_loss() {
    let scratch = Scratch::new("prep-regenerate_resumes_after_a_kill_without_duplicates_or_loss");
    let dir = tiny_target(scratch.path());
    let root = dir.parent().unwrap().to_path_buf();
    let input = regen_input(&root);
    let whole = root.join("whole.jsonl");
    let st = cli(&dir, &input, &whole, &[]).status().unwrap();
    assert!(st.success());
    let out = root.join("killed.jsonl");
    // Killed after writing the second chunk's lines, before recording them.
    let o = cli(&dir, &input, &out, &[]).env("DFLASH_FAULT", "prepare-abort@1").output().unwrap();
    assert!(!o.status.success());
    assert!(!out.exists(), "no output file until the run is complete");
    let partial = root.join("killed.jsonl.partial");
    assert!(std::fs::read_to_string(&partial).unwrap().lines().count() > read_samples(&whole).len() / 3);
    // Other settings are refused, naming the flag.
    let o = cli(&dir, &input, &out, &["--max-new-tokens", "9"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--max-new-tokens"), "{err}");
    // The same command finishes it.
    let o = cli(&dir, &input, &out, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("resumed after input line 2"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&whole).unwrap(), "same bytes as the uninterrupted run");
    assert!(!partial.exists() && !root.join("killed.jsonl.progress").exists());
}

#[test]
fn bench_decode_measures_rate_and_bound_on_the_cpu() {
    use dflash_engine::session::bench_decode::{bench_decode, DecodeBenchOptions};
    let o = DecodeBenchOptions {
        target: "tiny".into(),
        init_std: 0.05,
        batch: 4,
        context: 6,
        steps: 3,
        device: session::Device::Cpu,
        // The CPU has no device clock: the profile is declined, the bench still runs.
        profile: true,
    };
    let r = bench_decode(&o).unwrap();
    // Every weight of the tiny preset but the embedding, bf16: per layer q, k, v, o, gate, up,
    // down, two layer norms and the q/k norms; then the final norm and the lm_head.
    let cfg = TargetConfig::preset("tiny").unwrap();
    let (h, q, kv, hd) =
        (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim);
    let layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size + 2 * h + 2 * hd;
    let want = 2 * (cfg.num_hidden_layers * layer + h + cfg.vocab_size * h) as u64;
    assert_eq!(r.weight_bytes, want);
    assert!(r.copy_gb_s > 0.0 && r.tokens_per_s > 0.0 && r.step_tokens_per_s >= r.tokens_per_s * 0.5);
    let bound = 4.0 / (r.weight_bytes as f64 / (r.copy_gb_s * 1e9));
    assert!((r.bound_tokens_per_s - bound).abs() <= 1e-9 * bound);
    assert_eq!(r.kv_bytes, 2 * 2 * (4 * 6 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim) as u64);
}
