//! The drafter recipe (DFLASH.md sections 3 and 7): sliding-window layers (the mask at the window
//! edge and inside the block), the drafter config (built-in recipes, files, checks against the
//! target), the written checkpoint field by field, `--init-from` warm starts, `--loss-gamma`,
//! the config's norm eps, and a CPU run with sliding layers that learns.

use std::path::{Path, PathBuf};

use crate::common::*;
use dflash_engine::backend::cpu::{CpuBackend, CpuBuf, CpuStream};
use dflash_engine::backend::{Backend, DraftAttnShape};
use dflash_engine::config::{DraftLayerType, DrafterConfig, TargetConfig, RECIPE_NAMES};
use dflash_engine::model::drafter::{Drafter, DrafterShape};
use dflash_engine::session::{self, RunOptions};
use dflash_engine::train::checkpoint;
use dflash_engine::train::step::DrafterSide;
use serde_json::{json, Value};

const S: CpuStream = CpuStream;

// ---------------------------------------------------------------------------------------------
// The sliding-window mask (DFLASH.md section 3, "Per-layer attention kind")

/// Whether perturbing key/value row `row` of tensor `which` (1, 2: context; 3, 4: block) changes
/// the output of query slot `slot` of block 0.
fn slot_sees(
    sh: &DraftAttnShape,
    t: &[Vec<f64>; 5],
    anchors: &[i32],
    starts: &[i32],
    which: usize,
    row: usize,
    slot: usize,
) -> bool {
    let w = sh.heads * sh.head_dim;
    let base = attn_out(sh, t, anchors, starts);
    let mut t2 = t.clone();
    t2[which][row * sh.kv_heads * sh.head_dim] += 1.0;
    let o = attn_out(sh, &t2, anchors, starts);
    o[slot * w..(slot + 1) * w] != base[slot * w..(slot + 1) * w]
}

/// Window W = 5, anchor a = 9 (sequence starting at context row 2): slot r sees context
/// positions a + r - (W - 1) ..= a - 1. The key at a + r - (W - 1) is visible, the one before it
/// is not, and a full layer sees that one too (the bound is the window's, nothing else's).
#[test]
fn sliding_window_edge_key_is_visible_and_the_one_before_is_not() {
    let (w, a, start) = (5usize, 9usize, 2usize);
    let sliding = DraftAttnShape {
        num_blocks: 1,
        block_size: 6,
        ctx_rows: 16,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        window: Some(w),
    };
    let full = DraftAttnShape { window: None, ..sliding };
    let t = attn_inputs(&sliding, 3);
    let (anchors, starts) = ([a as i32], [start as i32]);
    let mut checked = 0;
    for r in 0..3 {
        let edge = a + r - (w - 1); // first visible position of slot r
        for which in [1, 2] {
            assert!(slot_sees(&sliding, &t, &anchors, &starts, which, start + edge, r), "slot {r}: key at {edge}");
            assert!(
                !slot_sees(&sliding, &t, &anchors, &starts, which, start + edge - 1, r),
                "slot {r}: key at {} is outside the window",
                edge - 1
            );
            assert!(slot_sees(&full, &t, &anchors, &starts, which, start + edge - 1, r), "full layer, slot {r}");
            // The anchor itself stays invisible in both (pitfall 2).
            assert!(!slot_sees(&sliding, &t, &anchors, &starts, which, start + a, r));
            checked += 1;
        }
    }
    // Slot 4's window (5 positions: 9..=13) starts at the anchor: no context at all; the full
    // layer's slot 4 sees all of it.
    for p in 0..a {
        assert!(!slot_sees(&sliding, &t, &anchors, &starts, 1, start + p, 4), "slot 4 sees context {p}");
        assert!(slot_sees(&full, &t, &anchors, &starts, 1, start + p, 4), "full layer, slot 4, context {p}");
    }
    assert_eq!(checked, 6);
}

/// Inside the block a sliding layer is causal: slot r sees slots <= r and not slot r + 1; a full
/// layer's slot r sees slot r + 1.
#[test]
fn sliding_slot_r_does_not_see_r_plus_1_but_full_layer_does() {
    let sliding = DraftAttnShape {
        num_blocks: 2,
        block_size: 4,
        ctx_rows: 12,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        window: Some(3),
    };
    let full = DraftAttnShape { window: None, ..sliding };
    let t = attn_inputs(&sliding, 5);
    let (anchors, starts) = ([6, 4], [0, 0]);
    for r in 0..3 {
        for which in [3, 4] {
            assert!(
                !slot_sees(&sliding, &t, &anchors, &starts, which, r + 1, r),
                "sliding: slot {r} sees slot {}",
                r + 1
            );
            assert!(slot_sees(&sliding, &t, &anchors, &starts, which, r, r), "sliding: slot {r} sees itself");
            assert!(slot_sees(&sliding, &t, &anchors, &starts, which, 0, r), "sliding: slot {r} sees slot 0");
            assert!(slot_sees(&full, &t, &anchors, &starts, which, r + 1, r), "full: slot {r} sees slot {}", r + 1);
        }
    }
    // Blocks stay private in a sliding layer too.
    let w = sliding.heads * sliding.head_dim;
    let base = attn_out(&sliding, &t, &anchors, &starts);
    let mut t2 = t.clone();
    t2[3][0] += 1.0; // block 0, slot 0
    assert_eq!(attn_out(&sliding, &t2, &anchors, &starts)[4 * w..], base[4 * w..]);
}

/// A window of 0 cannot hold the draft token: refused with the op's error, not a NaN.
#[test]
fn a_zero_window_is_refused() {
    let sh = DraftAttnShape {
        num_blocks: 1,
        block_size: 2,
        ctx_rows: 4,
        heads: 1,
        kv_heads: 1,
        head_dim: 4,
        window: Some(0),
    };
    let be = Exact::exact();
    let t = attn_inputs(&sh, 1);
    let b: Vec<CpuBuf<f64>> = t.iter().map(|v| buf(v.clone())).collect();
    let (mut o, mut lse) = (buf(vec![0.0; 8]), buf32(vec![0.0; 2]));
    let e = be.attn_draft_fwd(&S, &sh, &b[0], &b[1], &b[2], &b[3], &b[4], &vec![2], &vec![0], &mut o, &mut lse);
    assert!(e.unwrap_err().to_string().contains("window 0"));
}

// ---------------------------------------------------------------------------------------------
// The drafter config: recipes, files, checks

/// The section-3 tensor names of a drafter with `layers` layers, in no particular order.
fn section3_names(layers: usize) -> Vec<String> {
    let mut names = vec!["fc.weight".to_string(), "hidden_norm.weight".to_string(), "norm.weight".to_string()];
    for l in 0..layers {
        for p in [
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ] {
            names.push(format!("layers.{l}.{p}"));
        }
    }
    names.sort();
    names
}

/// Every field of DFLASH.md section 7 for a recipe, checked one by one against the published
/// values; the file reads back to the same config.
fn check_written_config(v: &Value, name: &str) {
    let d = DrafterConfig::recipe(name).unwrap();
    let (hidden, inter, vocab, target_layers, theta, mask, taps, types, window) = match name {
        "qwen3-8b" => (
            4096,
            12_288,
            151_936,
            36,
            1e6,
            151_669,
            json!([1, 9, 17, 25, 33]),
            json!(vec!["full_attention"; 5]),
            Value::Null,
        ),
        "qwen3.6-27b" => (
            5120,
            17_408,
            248_320,
            64,
            1e7,
            248_070,
            json!([1, 16, 31, 46, 61]),
            json!([
                "sliding_attention",
                "sliding_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention"
            ]),
            json!(2048),
        ),
        _ => unreachable!(),
    };
    let f = |k: &str| v.get(k).unwrap_or_else(|| panic!("{name}: config.json lacks {k}"));
    assert_eq!(f("architectures"), &json!(["DFlashDraftModel"]), "{name}");
    assert_eq!(f("model_type"), "qwen3", "{name}");
    assert_eq!(f("block_size"), 16, "{name}");
    assert_eq!(f("num_target_layers"), target_layers, "{name}");
    assert_eq!(f("dflash_config")["mask_token_id"], mask, "{name}");
    assert_eq!(f("dflash_config")["target_layer_ids"], taps, "{name}: 0-based, never pre-added 1");
    assert_eq!(f("hidden_size"), hidden, "{name}");
    assert_eq!(f("num_hidden_layers"), 5, "{name}");
    assert_eq!(f("num_attention_heads"), 32, "{name}");
    assert_eq!(f("num_key_value_heads"), 8, "{name}");
    assert_eq!(f("head_dim"), 128, "{name}");
    assert_eq!(f("intermediate_size"), inter, "{name}");
    assert_eq!(f("hidden_act"), "silu", "{name}");
    assert_eq!(f("rms_norm_eps").as_f64(), Some(1e-6), "{name}");
    assert_eq!(f("rope_theta").as_f64(), Some(theta), "{name}");
    assert!(f("max_position_embeddings").as_u64().is_some_and(|x| x > 0), "{name}");
    assert_eq!(f("vocab_size"), vocab, "{name}");
    assert_eq!(f("tie_word_embeddings"), false, "{name}");
    assert_eq!(f("layer_types"), &types, "{name}");
    assert_eq!(v.get("sliding_window").cloned().unwrap_or(Value::Null), window, "{name}");
    assert_eq!(f("use_sliding_window"), &json!(!window.is_null()), "{name}");
    assert_eq!(f("dtype"), "bfloat16", "{name}");
    assert_eq!(DrafterConfig::from_json_str(&v.to_string()).unwrap(), d, "{name}: reads back");
}

#[test]
fn both_recipes_carry_every_section_7_field() {
    for name in RECIPE_NAMES {
        let d = DrafterConfig::recipe(name).unwrap();
        check_written_config(&d.to_json_value(), name);
        // The tensors it trains: exactly the section-3 names (no prefix, no embeddings, no fused
        // projections), with the drafter's own attention geometry.
        let sh = DrafterShape::from_config(&d, 2048);
        let mut names: Vec<String> =
            sh.fc_table().entries().iter().chain(sh.body_table().entries()).map(|e| e.name.clone()).collect();
        names.sort();
        assert_eq!(names, section3_names(5), "{name}");
        let q = sh
            .body_table()
            .entries()
            .iter()
            .find(|e| e.name == "layers.0.self_attn.q_proj.weight")
            .unwrap()
            .shape
            .clone();
        assert_eq!(q, vec![32 * 128, d.hidden_size], "{name}");
        let o = sh
            .body_table()
            .entries()
            .iter()
            .find(|e| e.name == "layers.0.self_attn.o_proj.weight")
            .unwrap()
            .shape
            .clone();
        assert_eq!(o, vec![d.hidden_size, 32 * 128], "{name}");
    }
    let d = DrafterConfig::recipe("qwen3.6-27b").unwrap();
    let sh = DrafterShape::from_config(&d, 2048);
    assert_eq!(sh.windows, vec![Some(2048), Some(2048), Some(2048), Some(2048), None]);
    assert_eq!(d.layer_types[4], DraftLayerType::Full);
}

/// The recipes fit the targets they are for; against another target the error names the field.
#[test]
fn recipes_are_checked_against_the_target() {
    let q27 = TargetConfig::preset("qwen3.6-27b-shape").unwrap();
    let q8 = TargetConfig::preset("qwen3-8b-shape").unwrap();
    DrafterConfig::recipe("qwen3.6-27b").unwrap().check_against_target(&q27).unwrap();
    DrafterConfig::recipe("qwen3-8b").unwrap().check_against_target(&q8).unwrap();
    let e = DrafterConfig::recipe("qwen3.6-27b").unwrap().check_against_target(&q8).unwrap_err().to_string();
    assert!(e.contains("hidden_size is 5120 in the drafter but 4096"), "{e}");
    let mut d = DrafterConfig::recipe("qwen3-8b").unwrap();
    d.target_layer_ids = vec![1, 9, 17, 25, 36];
    let e = d.check_against_target(&q8).unwrap_err().to_string();
    assert!(e.contains("target_layer_ids"), "{e}");
    let e = DrafterConfig::from_name_or_file("qwen9").unwrap_err().to_string();
    assert!(e.contains("qwen3-8b") && e.contains("qwen3.6-27b"), "{e}");
}

/// A drafter config.json with a bad layer field: each error names the field.
#[test]
fn drafter_config_file_errors_name_the_field() {
    let base = DrafterConfig::recipe("qwen3.6-27b").unwrap().to_json_value();
    #[allow(clippy::type_complexity)]
    let cases: Vec<(&str, Box<dyn Fn(&mut serde_json::Map<String, Value>)>)> = vec![
        ("layer_types", Box::new(|m| drop(m.insert("layer_types".into(), json!(vec!["sliding_attention"; 3]))))),
        ("layer_types", Box::new(|m| drop(m.insert("layer_types".into(), json!(vec!["linear_attention"; 5]))))),
        ("sliding_window", Box::new(|m| drop(m.insert("sliding_window".into(), Value::Null)))),
        ("sliding_window", Box::new(|m| drop(m.insert("sliding_window".into(), json!(0))))),
        ("use_sliding_window", Box::new(|m| drop(m.insert("use_sliding_window".into(), json!(false))))),
        ("rms_norm_eps", Box::new(|m| drop(m.insert("rms_norm_eps".into(), json!(-1.0))))),
    ];
    for (field, edit) in cases {
        let mut v = base.clone();
        edit(v.as_object_mut().unwrap());
        let e = DrafterConfig::from_json_str(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
    // Absent layer_types: every layer full, as DFLASH.md says.
    let mut v = base.clone();
    v.as_object_mut().unwrap().remove("layer_types");
    let d = DrafterConfig::from_json_str(&v.to_string()).unwrap();
    assert!(d.layer_types.iter().all(|t| *t == DraftLayerType::Full) && d.sliding_window.is_none());
}

// ---------------------------------------------------------------------------------------------
// Runs on the CPU

/// A drafter for the tiny target with its own geometry (8 query heads x 16 = 128 wide against
/// hidden 64, 2 KV heads, MLP 128): a sliding layer of `window` under a full one.
fn tiny_sliding_config(window: usize) -> DrafterConfig {
    let tiny = TargetConfig::preset("tiny").unwrap();
    let mut d = DrafterConfig::for_target(&tiny, 2, 16, None).unwrap();
    d.num_attention_heads = 8;
    d.num_key_value_heads = 2;
    d.head_dim = 16;
    d.intermediate_size = 128;
    d.rms_norm_eps = 1e-5;
    d.layer_types = vec![DraftLayerType::Sliding, DraftLayerType::Full];
    d.sliding_window = Some(window);
    d.validate().unwrap();
    d
}

/// Writes `d` as `dir`/drafter.json; returns the file's path.
fn write_config(d: &DrafterConfig, dir: PathBuf) -> PathBuf {
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("drafter.json");
    std::fs::write(&p, d.to_json()).unwrap();
    p
}

/// Six quick CPU steps written into `out`, with the drafter config file `cfg` if given.
fn small(out: PathBuf, cfg: Option<&Path>) -> RunOptions {
    let mut ro = RunOptions::tiny_default();
    ro.data.gen_samples = 32;
    ro.data.seq_len = 40;
    ro.train.steps = 6;
    ro.data.batch_size = 3;
    ro.data.anchors = 6;
    ro.output.quiet = true;
    ro.output.out = out;
    ro.exec.device = session::Device::Cpu;
    ro.model.drafter_config = cfg.map(|p| p.display().to_string());
    ro
}

/// Same bar as `run::default_run_learns`: the default run, shortened, with a drafter whose first
/// layer slides (window 12 over 96-token sequences) and whose attention geometry is its own.
#[test]
fn sliding_drafter_run_learns() {
    let scratch = Scratch::new("recipe-sliding_drafter_run_learns");
    let cfg = write_config(&tiny_sliding_config(12), scratch.fresh("learn-cfg"));
    let mut opts = RunOptions::tiny_default();
    opts.train.steps = 200;
    opts.output.quiet = true;
    opts.output.out = scratch.fresh("learn");
    opts.exec.device = session::Device::Cpu;
    opts.model.drafter_config = Some(cfg.display().to_string());
    let r = session::run(&opts, None).unwrap();
    let first = &r.history[0];
    let tail = &r.history[r.history.len() - 10..];
    let mean = |f: &dyn Fn(&dflash_engine::train::step::StepMetrics) -> f64| tail.iter().map(f).sum::<f64>() / 10.0;
    let (loss, accept) = (mean(&|m| m.loss), mean(&|m| m.accept_len));
    assert!(loss < 0.7 * first.loss, "loss {:.3} -> {loss:.3}", first.loss);
    assert!(accept >= first.accept_len + 0.3, "accept {:.3} -> {accept:.3}", first.accept_len);
    assert!(r.history.iter().all(|m| !m.skipped));
}

/// The checkpoint a run with a sliding drafter writes: config.json is the run's drafter config
/// with layer_types, sliding_window, use_sliding_window, num_target_layers, block_size, the
/// config's rope_theta and eps; model.safetensors holds exactly the section-3 names in bf16.
#[test]
fn the_written_checkpoint_carries_the_drafter_config() {
    let scratch = Scratch::new("recipe-the_written_checkpoint_carries_the_drafter_config");
    let d = tiny_sliding_config(8);
    let cfg = write_config(&d, scratch.fresh("ck-cfg"));
    let opts = small(scratch.fresh("ck"), Some(&cfg));
    session::run(&opts, None).unwrap();
    let ck = checkpoint::load_latest(&opts.output.out).unwrap().unwrap();
    let v: Value = serde_json::from_str(&ck.config_json).unwrap();
    assert_eq!(v["layer_types"], json!(["sliding_attention", "full_attention"]));
    assert_eq!(v["sliding_window"], 8);
    assert_eq!(v["use_sliding_window"], true);
    assert_eq!(v["num_target_layers"], 6);
    assert_eq!(v["block_size"], 16);
    assert_eq!(v["num_attention_heads"], 8);
    assert_eq!(v["intermediate_size"], 128);
    assert_eq!(v["rms_norm_eps"].as_f64(), Some(1e-5));
    assert_eq!(v["rope_theta"].as_f64(), Some(TargetConfig::preset("tiny").unwrap().rope_theta));
    assert_eq!(DrafterConfig::from_json_str(&ck.config_json).unwrap(), d);
    let model = dflash_engine::weights::TensorStore::open_file(ck.dir.join(checkpoint::MODEL_FILE)).unwrap();
    let mut names: Vec<String> = model.names().iter().map(|s| s.to_string()).collect();
    names.sort();
    assert_eq!(names, section3_names(2));
    for n in &names {
        assert_eq!(model.tensor_info(n).unwrap().dtype, safetensors::Dtype::BF16, "{n}");
    }
}

/// The drafter sides a run of `opts` builds, before any step (CPU, one rank).
fn fresh_side(opts: &RunOptions) -> (CpuBackend, DrafterSide<CpuBackend>, DrafterConfig) {
    let tcfg = TargetConfig::preset("tiny").unwrap();
    let dcfg = session::drafter_config(opts, &tcfg).unwrap();
    let be = CpuBackend::new();
    let s = be.compute_stream();
    let n = tcfg.vocab_size * tcfg.hidden_size;
    let (embed, head) = (
        be.alloc(&s, dflash_engine::tensor::DType::BF16, n).unwrap(),
        be.alloc(&s, dflash_engine::tensor::DType::BF16, n).unwrap(),
    );
    let (drafter, fc) = Drafter::new(
        &be,
        &s,
        DrafterShape::from_config(&dcfg, 64),
        dflash_engine::model::drafter::Frozen::owned(embed),
        dflash_engine::model::drafter::Frozen::owned(head),
        99,
    )
    .unwrap();
    let side = DrafterSide::new(&be, &s, drafter, Some(fc)).unwrap();
    (be, side, dcfg)
}

/// Train, then warm-start from the checkpoint: the drafter's masters equal the checkpoint's f32
/// masters bit for bit, its bf16 weights equal model.safetensors bit for bit, and the optimizer
/// starts fresh (zero moments). From a published-style folder (config.json + model.safetensors
/// only) the weights equal the model file's bf16 bit for bit.
#[test]
fn init_from_round_trips_bit_for_bit() {
    let scratch = Scratch::new("recipe-init_from_round_trips_bit_for_bit");
    let cfg = write_config(&tiny_sliding_config(8), scratch.fresh("init-cfg"));
    let opts = small(scratch.fresh("init-a"), Some(&cfg));
    session::run(&opts, None).unwrap();
    let ck = checkpoint::load_latest(&opts.output.out).unwrap().unwrap();
    let model = dflash_engine::weights::TensorStore::open_file(ck.dir.join(checkpoint::MODEL_FILE)).unwrap();

    let check = |init: &checkpoint::InitWeights, want_masters: bool| {
        let (be, mut side, _) = fresh_side(&opts);
        let s = be.compute_stream();
        checkpoint::apply_init(&be, &s, &mut side, init).unwrap();
        let mut n = 0;
        for g in side.fc.iter().chain(std::iter::once(&side.drafter.body)) {
            let (master, weights) = (g.masters(&be, &s).unwrap(), be.download(&s, &g.weights).unwrap());
            let (m, v) = g.moments.download(&be, &s).unwrap();
            assert!(m.iter().chain(&v).all(|&x| x == 0.0), "the optimizer starts fresh");
            for e in g.table.entries() {
                let r = e.offset..e.offset + e.numel;
                let file = model.tensor_f32(&e.name, &e.shape).unwrap();
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&weights[r.clone()]), bits(&file), "{}: bf16 weights", e.name);
                let want = if want_masters { ck.tensor(&e.name, &e.shape).unwrap().master.clone() } else { file };
                assert_eq!(bits(&master[r]), bits(&want), "{}: masters", e.name);
                n += 1;
            }
        }
        assert_eq!(n, section3_names(2).len());
    };
    // This engine's checkpoint, by its run folder (the latest checkpoint) and by its step folder.
    let init = checkpoint::load_init(&opts.output.out, &tiny_sliding_config(8)).unwrap();
    assert!(init.from_masters && init.dir == ck.dir);
    check(&init, true);
    // A published drafter's layout.
    let published = scratch.fresh("published");
    std::fs::create_dir_all(&published).unwrap();
    for f in [checkpoint::MODEL_FILE, checkpoint::CONFIG_FILE] {
        std::fs::copy(ck.dir.join(f), published.join(f)).unwrap();
    }
    let init = checkpoint::load_init(&published, &tiny_sliding_config(8)).unwrap();
    assert!(!init.from_masters);
    check(&init, false);

    // The run path: a warm-started run trains from there, its first loss below the fresh run's.
    let mut warm = small(scratch.fresh("init-b"), Some(&cfg));
    warm.model.init_from = Some(published.clone());
    let r = session::run(&warm, None).unwrap();
    let fresh = session::run(&small(scratch.fresh("init-c"), Some(&cfg)), None).unwrap();
    assert!(r.history[0].loss < fresh.history[0].loss, "{} vs {}", r.history[0].loss, fresh.history[0].loss);

    // Another drafter (window 16): refused, naming the field.
    let other = write_config(&tiny_sliding_config(16), scratch.fresh("init-other"));
    let mut bad = small(scratch.fresh("init-d"), Some(&other));
    bad.model.init_from = Some(published.clone());
    let e = format!("{:#}", session::run(&bad, None).unwrap_err());
    assert!(e.contains("sliding_window") && e.contains("--init-from") && e.contains("--drafter-config"), "{e}");
    // Another target (a drafter takes its hidden size from it): the advice is the target.
    let mut moved = small(scratch.fresh("init-f"), None);
    moved.model.target = "small".into();
    moved.model.init_from = Some(published);
    let e = format!("{:#}", session::run(&moved, None).unwrap_err());
    assert!(e.contains("hidden_size") && e.contains("another target") && e.contains("--target"), "{e}");
    // Not a checkpoint at all.
    let mut none = small(scratch.fresh("init-e"), Some(&cfg));
    none.model.init_from = Some(scratch.fresh("nothing"));
    let e = format!("{:#}", session::run(&none, None).unwrap_err());
    assert!(e.contains("--init-from") && e.contains("no drafter checkpoint"), "{e}");
}

/// `--loss-gamma` replaces the decay: it reaches the written config and changes the loss; a
/// resume with another gamma is refused naming the flag.
#[test]
fn loss_gamma_overrides_the_decay() {
    let scratch = Scratch::new("recipe-loss_gamma_overrides_the_decay");
    let base = small(scratch.fresh("gamma-a"), None);
    let mut g = small(scratch.fresh("gamma-b"), None);
    g.train.loss_gamma = Some(2.0);
    let (r0, r1) = (session::run(&base, None).unwrap(), session::run(&g, None).unwrap());
    assert_ne!(r0.history[0].loss, r1.history[0].loss);
    let ck = checkpoint::load_latest(&g.output.out).unwrap().unwrap();
    let v: Value = serde_json::from_str(&ck.config_json).unwrap();
    assert_eq!(v["dflash_config"]["loss_gamma"].as_f64(), Some(2.0));
    let mut again = g.clone();
    again.output.resume = true;
    again.train.loss_gamma = Some(3.0);
    let e = format!("{:#}", session::run(&again, None).unwrap_err());
    assert!(e.contains("--loss-gamma"), "{e}");
}

/// The config's rms_norm_eps reaches hidden_norm and the final norm: with a huge eps the
/// normalised context and output shrink, so the first loss moves; the drafter shape carries it.
#[test]
fn rms_norm_eps_comes_from_the_config() {
    let scratch = Scratch::new("recipe-rms_norm_eps_comes_from_the_config");
    let mut d = tiny_sliding_config(8);
    let a = session::run(&small(scratch.fresh("eps-a"), Some(&write_config(&d, scratch.fresh("eps-a-cfg")))), None)
        .unwrap();
    d.rms_norm_eps = 10.0;
    assert_eq!(DrafterShape::from_config(&d, 64).eps, 10.0);
    let b = session::run(&small(scratch.fresh("eps-b"), Some(&write_config(&d, scratch.fresh("eps-b-cfg")))), None)
        .unwrap();
    assert_ne!(a.history[0].loss, b.history[0].loss);
}

/// A resume with another drafter config is refused, naming --drafter-config.
#[test]
fn the_drafter_config_is_part_of_the_resume_fingerprint() {
    let scratch = Scratch::new("recipe-the_drafter_config_is_part_of_the_resume_fingerprint");
    let c8 = write_config(&tiny_sliding_config(8), scratch.fresh("fp-8"));
    let mut opts = small(scratch.fresh("fp"), Some(&c8));
    opts.train.steps = 8;
    opts.output.stop_after = Some(6);
    session::run(&opts, None).unwrap();
    let mut again = opts.clone();
    again.output.resume = true;
    again.output.stop_after = None;
    again.model.drafter_config =
        Some(write_config(&tiny_sliding_config(9), scratch.fresh("fp-9")).display().to_string());
    let e = format!("{:#}", session::run(&again, None).unwrap_err());
    assert!(e.contains("--drafter-config") && e.contains("sliding_window"), "{e}");
    // The same content from another path resumes.
    let copy = scratch.fresh("fp-copy");
    std::fs::create_dir_all(&copy).unwrap();
    std::fs::copy(&c8, copy.join("d.json")).unwrap();
    again.model.drafter_config = Some(copy.join("d.json").display().to_string());
    let r = session::run(&again, None).unwrap();
    assert_eq!(r.first_step, 6);
}
