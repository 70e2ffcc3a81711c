//! `dflash-engine eval` on the CPU: speculative decoding is lossless (Qwen3 and Qwen3.5 hybrid
//! targets, every acceptance length driven through verify and rewind), the drafter's inference
//! path equals its training forward, a trained drafter's real acceptance on held-out prompts is
//! what training predicted while a drafter trained off by one collapses there, and a random
//! drafter accepts nothing and ends cleanly.

use std::path::PathBuf;

use crate::common::Scratch;
use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::Backend;
use dflash_engine::config::DrafterConfig;
use dflash_engine::eval::decode::{
    decode_speculative, decode_target_alone, simulated_accept, DecodeLimits, Decoded, Proposer,
};
use dflash_engine::eval::{self, EvalOptions};
use dflash_engine::faults::FaultPlan;
use dflash_engine::model::drafter::{fc_forward, Drafter, DrafterShape, ParamGroup};
use dflash_engine::model::drafting::{DraftCache, InferenceDrafter};
use dflash_engine::model::target::{Target, TargetInputs};
use dflash_engine::session::setup::TargetSource;
use dflash_engine::session::{self, Device, RunOptions, TINY_INIT_STD};
use dflash_engine::tensor::DType;
use dflash_engine::train::batch::{build_batch, BatchSpec, Sample};
use dflash_engine::train::step::{DeviceDraftBatch, StepMetrics};

/// A preset target with every layer loaded, and the default 2-layer drafter's config for it.
pub fn preset<B: Backend>(be: &B, name: &str) -> (Target<B>, DrafterConfig) {
    let src = TargetSource::resolve(name, 0, TINY_INIT_STD, &mut Vec::new()).unwrap();
    let dcfg = DrafterConfig::for_target(src.config(), 2, 16, None).unwrap();
    (src.load(be, dcfg.target_layer_ids.clone(), true).unwrap(), dcfg)
}

/// A freshly initialised drafter for inference (as `eval --drafter random` builds it).
pub fn random_drafter<B: Backend>(be: &B, target: &Target<B>, dcfg: &DrafterConfig, seed: u64) -> InferenceDrafter<B> {
    let s = be.compute_stream();
    let (embed, lm_head) = Drafter::frozen_from_target(target);
    let shape = DrafterShape::from_config(dcfg, 2048);
    let (fc, body) = (shape.fc_table(), shape.body_table());
    let (fh, bh) = (ParamGroup::<B>::init_host(&fc, seed, 0), ParamGroup::<B>::init_host(&body, seed, 1));
    InferenceDrafter::load(be, &s, shape, embed, lm_head, |name, _| -> Result<Vec<f32>, anyhow::Error> {
        let (t, h) = if name == "fc.weight" { (&fc, &fh) } else { (&body, &bh) };
        let e = t.get(name).unwrap();
        Ok(h[e.offset..e.offset + e.numel].to_vec())
    })
    .unwrap()
}

/// Prompts of 1 token, a few, and more than one delta-rule chunk (64).
pub fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    vec![vec![7], (0..8).map(|i| (i * 37 + 5) % vocab).collect(), (0..70).map(|i| (i * 53 + 11) % vocab).collect()]
}

/// Drafts of the known output with one planted error per block, at slot `(5 k) % 17` in round
/// `k` (past the block's end for some rounds), so rounds accept 0, 5, 10, the whole block, 3,
/// ... drafts: every kind of rewind.
pub fn scripted(reference: &[u32], prompt_len: usize, bs: usize, vocab: u32) -> impl Fn(usize) -> Vec<u32> + '_ {
    let round = std::cell::Cell::new(0usize);
    move |a: usize| {
        let i = a - prompt_len; // the anchor is output token i
        let bad = (5 * round.get()) % 17;
        round.set(round.get() + 1);
        (1..bs)
            .map(|r| {
                let t = reference.get(i + r).copied().unwrap_or(0);
                if r - 1 == bad {
                    (t + 1) % vocab
                } else {
                    t
                }
            })
            .collect()
    }
}

fn lossless_on_the_cpu(name: &str) {
    let be = CpuBackend::new();
    let s = be.compute_stream();
    let (target, dcfg) = preset(&be, name);
    let vocab = target.shape.vocab as u32;
    let bs = dcfg.block_size;
    let drafter = random_drafter(&be, &target, &dcfg, 3);
    let dw = drafter.weights();
    let lim = DecodeLimits { max_new_tokens: 60, eos: Vec::new() };
    let mut lens = Vec::new();
    for prompt in prompts(vocab) {
        let reference = decode_target_alone(&be, &s, &target, &prompt, &lim).unwrap();
        assert_eq!(reference.tokens.len(), 60);
        let script = scripted(&reference.tokens, prompt.len(), bs, vocab);
        let runs: [(&str, Proposer<'_, CpuBackend>); 3] = [
            ("verify-only", Proposer::VerifyOnly { block_size: bs }),
            ("scripted", Proposer::Script { block_size: bs, draft: &script }),
            ("random drafter", Proposer::Drafter(&dw)),
        ];
        for (what, p) in runs {
            let d: Decoded = decode_speculative(&be, &s, &target, p, &prompt, &lim).unwrap();
            assert_eq!(d.tokens, reference.tokens, "{name}, {what}, prompt of {}", prompt.len());
            if what == "scripted" {
                lens.extend(d.accept_lens);
            }
        }
    }
    // The scripted rounds kept every length: a rewind of 1, of a whole block, and between.
    let distinct: std::collections::BTreeSet<usize> = lens.iter().copied().collect();
    assert!(distinct.contains(&1) && distinct.contains(&bs) && distinct.len() >= 6, "{name}: {distinct:?}");
}

/// Lossless (issue item 3): with any drafts, the speculative output equals the target's own
/// greedy decoding token for token; the rounds rewind the KV cache by every amount.
#[test]
fn eval_is_lossless_on_the_cpu_qwen3_tiny() {
    lossless_on_the_cpu("tiny");
}

/// The same on the Qwen3.5 hybrid: rejected rows must leave the delta-rule state and the
/// convolution inputs exactly as decoding the kept rows alone would.
#[test]
fn eval_is_lossless_on_the_cpu_qwen35_tiny() {
    lossless_on_the_cpu("qwen3.5-tiny");
}

/// The drafter's inference path (context K/V cached and appended, one block per round) drafts
/// exactly what its training forward predicts for a block at the same anchor, from the same
/// taps: same semantics (context strictly before the anchor, slot 0 the anchor token, slot r
/// predicting a + r), same arithmetic.
#[test]
fn drafter_inference_equals_the_training_forward() {
    let be = CpuBackend::new();
    let s = be.compute_stream();
    let (target, dcfg) = preset(&be, "tiny");
    let shape = DrafterShape::from_config(&dcfg, 2048);
    let (embed, lm_head) = Drafter::frozen_from_target(&target);
    let (mut drafter, fc) = Drafter::new(&be, &s, shape.clone(), embed, lm_head, 5).unwrap();
    let n = 48;
    let sample = Sample { input_ids: (0..n as u32).map(|i| (i * 29 + 3) % 250).collect(), loss_mask: vec![1; n] };
    let seq: Vec<i32> = sample.input_ids.iter().map(|&t| t as i32).collect();
    let up = |v: &[i32]| {
        let mut b = be.alloc_ids(&s, v.len()).unwrap();
        be.upload_ids(&s, v, &mut b).unwrap();
        b
    };
    let (ids, pos, starts) = (up(&seq), up(&(0..n as i32).collect::<Vec<_>>()), up(&[0, n as i32]));
    let h = shape.hidden;
    let mut taps: Vec<_> = target.taps.iter().map(|_| be.alloc(&s, DType::BF16, n * h).unwrap()).collect();
    target
        .forward_taps(&be, &s, &TargetInputs { ids: &ids, pos: &pos, seq_starts: &starts, rows: n }, &mut taps)
        .unwrap();
    // Training: packed taps -> fc -> the forward over 6 blocks.
    let spec = BatchSpec {
        anchors_per_seq: 6,
        block_size: shape.block_size,
        mask_token_id: shape.mask_token_id,
        gamma: 7.0,
        pad_to_tokens: None,
        seed: 1,
    };
    let hb = build_batch(std::slice::from_ref(&sample), &spec, 0, 0).unwrap();
    let mut x = be.alloc(&s, DType::BF16, n * shape.fc_in()).unwrap();
    let tap_refs: Vec<_> = taps.iter().collect();
    be.pack_taps(&s, &tap_refs, &mut x, n, h, n, 0.0, 0, 0).unwrap();
    let mut y = be.alloc(&s, DType::BF16, n * h).unwrap();
    fc_forward(&be, &s, &fc, &x, &mut y, n).unwrap();
    let dev = DeviceDraftBatch::upload(&be, &s, &hb).unwrap();
    let mut dy = be.alloc(&s, DType::BF16, n * h).unwrap();
    let out = drafter.forward_backward(&be, &s, &dev.inputs(), &y, 1.0, &mut dy).unwrap();
    let trained_argmax = be.download_ids(&s, &out.argmax).unwrap();
    // Inference: for each anchor, the context rows 0..a, then one block.
    let dw = drafter.weights_for_inference(&fc);
    let mut checked = 0;
    for (j, &a) in hb.anchors.iter().enumerate() {
        let a = a as usize;
        let mut cache = DraftCache::new(&be, &s, &shape, n).unwrap();
        dw.append_context(&be, &s, &mut cache, &tap_refs, a).unwrap();
        let mut d = be.alloc_ids(&s, shape.block_size - 1).unwrap();
        dw.draft_block(&be, &s, &cache, sample.input_ids[a], &mut d).unwrap();
        let drafts = be.download_ids(&s, &d).unwrap();
        let bs = shape.block_size;
        assert_eq!(drafts[..], trained_argmax[j * (bs - 1)..(j + 1) * (bs - 1)], "block {j} at anchor {a}");
        checked += 1;
    }
    assert_eq!(checked, 6);
    // And the simulated acceptance over a sequence is the training metric's definition.
    let sim = simulated_accept(&be, &s, &target, &dw, &sample.input_ids, 10).unwrap();
    assert_eq!(sim.len(), n - 1 - 10);
    assert!(sim.iter().all(|&x| (1..=shape.block_size).contains(&x)));
}

/// The default run, shortened to 100 steps on 192 generated samples (the whole default run, 300
/// steps on 512, takes minutes on two CPU cores), written into `out`; returns its folder and its
/// history.
fn short_default_run(out: PathBuf, faults: FaultPlan) -> (PathBuf, Vec<StepMetrics>) {
    short_cpu_run(out, faults, |ro| ro.train.steps = 100)
}

/// A quiet CPU run of the tiny default on 192 generated samples, changed by `adjust`, in the
/// fresh folder `out`; returns the folder and the run's history.
fn short_cpu_run(out: PathBuf, faults: FaultPlan, adjust: impl FnOnce(&mut RunOptions)) -> (PathBuf, Vec<StepMetrics>) {
    let mut ro = RunOptions::tiny_default();
    ro.data.gen_samples = 192;
    ro.exec.device = Device::Cpu;
    ro.exec.faults = faults;
    ro.output.quiet = true;
    ro.output.tensorboard = false;
    ro.output.out = out;
    adjust(&mut ro);
    let r = session::run(&ro, None).unwrap();
    (ro.output.out, r.history)
}

/// `eval` of a run's drafter on 32 held-out prompts of the default generator (each decoded to
/// the training sequences' length).
fn eval_run(dir: &std::path::Path) -> eval::EvalReport {
    let mut o = EvalOptions::new(dir.display().to_string());
    o.device = Device::Cpu;
    o.quiet = true;
    o.num_prompts = Some(32);
    eval::eval(&o).unwrap()
}

/// Consistency with training (issue item 3): after the default run (shortened), `eval` on
/// held-out prompts of the same generator measures, in real decoding, an acceptance length
/// within 20% of the one the run's last steps predicted (their mean over the last 20 steps:
/// one step's 128 blocks come from 8 sequences whose acceptance differs a lot). The output stays
/// lossless and eval.json lands in the run folder with training's numbers beside it.
///
/// The prediction is the per-round one (`round_accept_len`). The per-position mean training
/// also logs (DFLASH.md section 4) is ~3x above real decoding here, and that is no decoding
/// bug: the default data's greedy text falls into runs of one repeated token, which the drafter
/// accepts whole, between stretches it cannot predict; a run of 40 tokens is 40 positions of
/// ~16 but only 3 rounds.
#[test]
fn eval_acceptance_is_within_20_percent_of_training() {
    let scratch = Scratch::new("eval-eval_acceptance_is_within_20_percent_of_training");
    let (dir, history) = short_default_run(scratch.fresh("consistent"), FaultPlan::default());
    let r = eval_run(&dir);
    let tail = &history[history.len() - eval::TRAIN_STEPS_AVERAGED..];
    let mean = |f: fn(&StepMetrics) -> f64| tail.iter().map(f).sum::<f64>() / tail.len() as f64;
    let (per_position, per_round) = (mean(|m| m.accept_len), mean(|m| m.round_accept_len));
    let real = r.overall.accept_len;
    println!(
        "training: {per_position:.3} per position, {per_round:.3} per round (last 20 steps); eval on held-out \
         prompts: real {real:.3} per round, simulated {:.3} per position",
        r.overall.simulated_accept_len
    );
    // eval reads the same numbers back from the run's metrics.jsonl.
    assert_eq!(r.train_steps_averaged, Some(eval::TRAIN_STEPS_AVERAGED));
    assert!((r.train_round_accept_len.unwrap() - per_round).abs() < 1e-9);
    assert!((r.train_accept_len.unwrap() - per_position).abs() < 1e-9);
    assert!(per_position > 2.0, "the run must have learned something: {per_position}");
    assert!(real > 1.1, "real decoding accepted nothing: {real}");
    assert!(
        (real / per_round - 1.0).abs() <= 0.2,
        "real decoding's {real:.3} tokens per round is not within 20% of training's prediction {per_round:.3}"
    );
    assert_eq!(r.lossless_prompts, r.per_prompt.len());
    // The verified tokens are the output's, less each prompt's prefill token, plus those the
    // limit cut from last rounds: the summary's two per-round numbers add up.
    for p in r.per_prompt.iter().chain([&r.overall]) {
        let verified = (p.accept_len * p.rounds as f64).round() as usize;
        let prompts = if std::ptr::eq(p, &r.overall) { r.per_prompt.len() } else { 1 };
        assert_eq!(verified, p.new_tokens - prompts + p.cut_tokens, "{p:?}");
        assert!(p.cut_tokens < r.block_size * prompts, "only a last round is cut: {p:?}");
    }
    assert_eq!(r.train_step, Some(100));
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("eval.json")).unwrap()).unwrap();
    assert_eq!(written["overall"]["rounds"].as_u64(), Some(r.overall.rounds as u64));
    assert!(written["train_round_accept_len"].as_f64().is_some());

    // One of the run's checkpoint folders: its report goes into that folder, and the run's own
    // (the latest checkpoint's) stays as it was; plot shows both.
    let run_report = std::fs::read_to_string(dir.join("eval.json")).unwrap();
    let (step, folder) = dflash_engine::train::checkpoint::step_folders(&dir).unwrap().remove(0);
    let mut o = EvalOptions::new(folder.display().to_string());
    o.device = Device::Cpu;
    o.quiet = true;
    o.num_prompts = Some(2);
    let early = eval::eval(&o).unwrap();
    assert_eq!(early.train_step, Some(step));
    assert_eq!(std::fs::read_to_string(dir.join("eval.json")).unwrap(), run_report, "the run's report was replaced");
    let own: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("eval.json")).unwrap()).unwrap();
    assert_eq!(own["train_step"].as_u64(), Some(u64::from(step)));
    let marks = dflash_engine::plot::load_evals(&dir).unwrap();
    assert_eq!(marks.first().and_then(|m| m.step), Some(step), "{marks:?}");
    assert_eq!(marks.last().and_then(|m| m.step), Some(100), "{marks:?}");
}

/// The off-by-one switch (`FaultPlan::context_off_by_one`) is a trainer's label shift: slot `r`
/// of the block at anchor `a` learns the token at `a + r + 1`, none past the sequence's end,
/// every other slot's weight kept, and the step's weight sum follows.
#[test]
fn off_by_one_switch_shifts_every_label_one_ahead() {
    let bs = 4;
    let samples: Vec<Sample> = [(12usize, 3usize), (9, 2)]
        .iter()
        .map(|&(n, p)| Sample {
            input_ids: (0..n as u32).map(|i| 100 + i * 7 + n as u32).collect(),
            loss_mask: (0..n).map(|i| u8::from(i >= p)).collect(),
        })
        .collect();
    let spec = BatchSpec {
        anchors_per_seq: 5,
        block_size: bs,
        mask_token_id: 255,
        gamma: 7.0,
        pad_to_tokens: Some(32),
        seed: 3,
    };
    let right = build_batch(&samples, &spec, 2, 0).unwrap();
    let mut b = right.clone();
    dflash_engine::session::setup::shift_labels_one_ahead(&mut b, bs);
    assert_eq!(
        (b.ids.clone(), b.block_ids.clone(), b.anchors.clone()),
        (right.ids.clone(), right.block_ids.clone(), right.anchors.clone())
    );
    let mut checked = 0;
    for j in 0..b.num_blocks {
        let Ok(a) = usize::try_from(b.anchors[j]) else { continue };
        let smp = &samples[j / (b.num_blocks / samples.len())];
        for r in 1..bs {
            let i = j * bs + r;
            if a + r + 1 < smp.input_ids.len() {
                assert_eq!(b.labels[i], smp.input_ids[a + r + 1] as i32, "block {j} slot {r}");
                assert_eq!(b.weights[i], right.weights[i]);
                checked += 1;
            } else {
                assert_eq!((b.labels[i], b.weights[i]), (-1, 0.0), "block {j} slot {r}: past the end");
            }
        }
        assert_eq!((b.labels[j * bs], b.weights[j * bs]), (-1, 0.0));
    }
    assert!(checked > 20);
    assert!((b.weight_sum - b.weights.iter().map(|&w| f64::from(w)).sum::<f64>()).abs() < 1e-9);
    assert!(b.weight_sum < right.weight_sum);
}

/// The Qwen3.5 hybrid preset's run, shortened to 200 steps on 192 generated samples, with
/// 4-slot blocks and a peak learning rate of 0.01 (the drafter learns the target's next-token
/// map within the steps a CPU test affords), written into `out`; returns its folder and its history.
fn short_hybrid_run(out: PathBuf, faults: FaultPlan) -> (PathBuf, Vec<StepMetrics>) {
    short_cpu_run(out, faults, |ro| {
        ro.model.target = "qwen3.5-tiny".into();
        ro.model.block_size = 4;
        ro.train.steps = 200;
        ro.train.lr = 0.01;
    })
}

/// The complaint the eval command exists for (issue item 3): a drafter trained with its context
/// off by one against its labels (`FaultPlan::context_off_by_one`) scores as well in training as
/// a correct one, and accepts almost nothing when served.
///
/// On the Qwen3.5 hybrid preset the target's next greedy token is mostly a function of the
/// current one, a map with few fixed points: the correct drafter learns `x[a+1]` from the
/// anchor, the off-by-one one `x[a+2]`, which training scores against its own shifted labels
/// and decoding rejects at the first slot. (On the default Qwen3 `tiny` data the switch is
/// harmless: its greedy text is mostly runs of one repeated token, where `x[a+1] == x[a+2]`.)
#[test]
fn off_by_one_drafter_trains_well_and_collapses_in_eval() {
    let scratch = Scratch::new("eval-off_by_one_drafter_trains_well_and_collapses_in_eval");
    let summary = |dir: &std::path::Path, history: &[StepMetrics]| {
        let tail = &history[history.len() - eval::TRAIN_STEPS_AVERAGED..];
        let mean = |f: fn(&StepMetrics) -> f64| tail.iter().map(f).sum::<f64>() / tail.len() as f64;
        let mut o = EvalOptions::new(dir.display().to_string());
        o.device = Device::Cpu;
        o.quiet = true;
        o.num_prompts = Some(16);
        let r = eval::eval(&o).unwrap();
        assert_eq!(r.lossless_prompts, r.per_prompt.len());
        (mean(|m| m.accept_len), mean(|m| m.round_accept_len), r.overall.accept_len)
    };
    let (dir, history) = short_hybrid_run(scratch.fresh("hybrid-right"), FaultPlan::default());
    let (right_pos, right_round, right_real) = summary(&dir, &history);
    let faults = FaultPlan { context_off_by_one: true, ..FaultPlan::default() };
    let (dir, history) = short_hybrid_run(scratch.fresh("hybrid-off-by-one"), faults);
    let (off_pos, off_round, off_real) = summary(&dir, &history);
    println!(
        "correct: training {right_pos:.3} per position, {right_round:.3} per round; eval real {right_real:.3} per round\n\
         off by one: training {off_pos:.3} per position, {off_round:.3} per round; eval real {off_real:.3} per round"
    );
    // The correct drafter learned, and real decoding gets what training predicted.
    assert!(right_real > 1.5, "the correct drafter accepted too little to compare against: {right_real:.3}");
    assert!(
        (right_real / right_round - 1.0).abs() <= 0.2,
        "correct: real {right_real:.3} vs predicted {right_round:.3}"
    );
    // Training cannot tell the off-by-one run apart: its prediction is close to the correct run's.
    assert!(off_round > 1.5 && off_round >= 0.8 * right_round, "off by one: training predicted {off_round:.3}");
    assert!(off_pos >= 0.8 * right_pos, "off by one: {off_pos:.3} per position in training");
    // Served, it collapses: far below its own prediction, and its gain over the target's own
    // token (1 per round) is a small fraction of the correct drafter's.
    assert!(off_real <= 0.75 * off_round, "off by one: real {off_real:.3} vs predicted {off_round:.3}");
    assert!(
        off_real - 1.0 <= 0.3 * (right_real - 1.0),
        "off by one: real {off_real:.3} per round is no collapse next to the correct drafter's {right_real:.3}"
    );
}

/// A random drafter accepts ~nothing, and eval still ends cleanly: every round keeps the
/// target's own token, the output is lossless, the report is written where --out says.
#[test]
fn random_drafter_accepts_nothing_and_ends_cleanly() {
    let scratch = Scratch::new("eval-random_drafter_accepts_nothing_and_ends_cleanly");
    let out = scratch.fresh("random").join("report.json");
    let mut o = EvalOptions::new("random");
    o.device = Device::Cpu;
    o.quiet = true;
    o.num_prompts = Some(4);
    o.max_new_tokens = Some(40);
    o.out = Some(out.clone());
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let r = eval::eval(&o).unwrap();
    assert!(r.overall.accept_len < 1.1, "a random drafter accepted {}", r.overall.accept_len);
    assert_eq!(r.overall.new_tokens, 4 * 40);
    assert_eq!(r.lossless_prompts, 4);
    assert_eq!(r.train_accept_len, None);
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(written["per_prompt"].as_array().map(Vec::len), Some(4));
}
