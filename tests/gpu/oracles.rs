//! The external oracles on the GPU machine: the target's taps against Hugging Face transformers'
//! Qwen3, and the drafter's loss and gradients against a PyTorch autograd implementation of
//! DFLASH.md (tests/reference/). Both need python3 with torch (and transformers) installed.

use std::path::PathBuf;
use std::process::Command;

use dflash_engine::backend::Backend;
use dflash_engine::rng::Philox;
use dflash_engine::tensor::DType;

use super::{get, gpu, ids, put, rand, rel_err};
use crate::common::Scratch;

/// Where tests/reference lives: the working directory (the GPU bundle runs from the repo root),
/// or DFLASH_REPO_ROOT.
fn reference_script(name: &str) -> PathBuf {
    let root =
        std::env::var("DFLASH_REPO_ROOT").map(PathBuf::from).unwrap_or_else(|_| std::env::current_dir().unwrap());
    let p = root.join("tests/reference").join(name);
    assert!(p.exists(), "{} not found: run from the repository root or set DFLASH_REPO_ROOT", p.display());
    p
}

fn python(script: &str, args: &[String]) {
    let out = Command::new("python3")
        .arg(reference_script(script))
        .args(args)
        .output()
        .expect("python3 must be installed on the GPU machine");
    println!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "{script} failed:\n{}", String::from_utf8_lossy(&out.stderr));
}

fn write_ids(path: &std::path::Path, ids: &[i32], b: usize, s: usize) {
    let bytes: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
    dflash_engine::weights::write_safetensors_atomic(
        path,
        &[("input_ids".to_string(), safetensors::Dtype::I32, vec![b, s], bytes)],
        None,
    )
    .unwrap();
}

/// The target's taps on CUDA against Hugging Face transformers' Qwen3 on the same safetensors
/// file: the output of 0-based layer L is HF's hidden_states[L + 1].
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_taps_match_hugging_face() {
    use dflash_engine::config::TargetConfig;
    use dflash_engine::model::target::{Target, TargetInputs, TargetShape};
    let g = gpu();
    let scratch = Scratch::new("gpu-gpu_taps_match_hugging_face");
    for (preset, taps) in [("tiny", vec![1usize, 3]), ("small", vec![1, 4, 7])] {
        let dir = scratch.join(format!("hf-{preset}"));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = TargetConfig::preset(preset).unwrap();
        dflash_engine::weights::init_target(&cfg, 3, 0.05, dir.join("model")).unwrap();
        let (b, s) = (2usize, 64usize);
        let mut r = Philox::new(5, [1, 1]);
        let tokens: Vec<i32> = (0..b * s).map(|_| r.below(cfg.vocab_size as u64 - 3) as i32).collect();
        write_ids(&dir.join("in.safetensors"), &tokens, b, s);
        let layers = taps.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
        python(
            "hf_taps.py",
            &[
                format!("--model={}", dir.join("model").display()),
                format!("--input={}", dir.join("in.safetensors").display()),
                format!("--layers={layers}"),
                format!("--out={}", dir.join("out.safetensors").display()),
            ],
        );
        let files = dflash_engine::weights::ModelFiles::open(dir.join("model")).unwrap();
        let target =
            Target::load(&g, TargetShape::from(&cfg), taps.clone(), false, |n, d| -> anyhow::Result<Vec<f32>> {
                Ok(files.tensor_f32(n, d)?)
            })
            .unwrap();
        let st = g.compute_stream();
        let pos: Vec<i32> = (0..b).flat_map(|_| 0..s as i32).collect();
        let starts: Vec<i32> = (0..=b).map(|i| (i * s) as i32).collect();
        let mut outs: Vec<_> =
            taps.iter().map(|_| g.alloc(&st, DType::BF16, b * s * cfg.hidden_size).unwrap()).collect();
        target
            .forward_taps(
                &g,
                &st,
                &TargetInputs {
                    ids: &ids(&g, &tokens),
                    pos: &ids(&g, &pos),
                    seq_starts: &ids(&g, &starts),
                    rows: b * s,
                },
                &mut outs,
            )
            .unwrap();
        let hf = dflash_engine::weights::TensorStore::open_file(dir.join("out.safetensors")).unwrap();
        let hf_taps: Vec<Vec<f32>> =
            taps.iter().map(|l| hf.tensor_f32(&format!("tap_{l}"), &[b, s, cfg.hidden_size]).unwrap()).collect();
        for (k, &l) in taps.iter().enumerate() {
            let ours = get(&g, &outs[k]);
            // Two bf16 forwards that round at different points (fused vs separate ops): each layer
            // adds about one bf16 ulp (4e-3) of the residual's largest value; 3e-2 covers 8 layers.
            let own = rel_err(&format!("taps vs HF {preset} layer {l}"), &ours, &hf_taps[k], 3e-2);
            // Teeth: the same tap is much farther from HF's output of any other layer, so an
            // off-by-one layer could not pass.
            for (j, &other) in taps.iter().enumerate().filter(|&(j, _)| j != k) {
                let scale = hf_taps[j].iter().fold(0f32, |m, x| m.max(x.abs()));
                let far = ours.iter().zip(&hf_taps[j]).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                println!("  engine layer {l} vs HF layer {other}: {far:.3e}");
                assert!(far > 3.0 * own, "layer {l} is as close to HF layer {other} ({far}) as to its own ({own})");
            }
        }
    }
}

/// The drafter's loss and every parameter gradient on CUDA against a PyTorch autograd
/// implementation of DFLASH.md (tests/reference/drafter_ref.py) on the same inputs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_drafter_matches_pytorch() {
    drafter_vs_pytorch(vec![None; 2], 1e-6);
}

/// The Qwen3.6-27B recipe's layer mix, 4 sliding layers then 1 full layer, on a small shape:
/// the window (6) is shorter than most anchors' contexts and smaller than 2 blocks, so its
/// lower bound and the causal block mask decide what each slot sees; norm eps 1e-5 (from the
/// config) for every norm, hidden_norm and the final norm included.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_sliding_drafter_matches_pytorch() {
    drafter_vs_pytorch(vec![Some(6), Some(6), Some(6), Some(6), None], 1e-5);
}

/// One drafter step on the GPU against tests/reference/drafter_ref.py: the loss and every
/// parameter's gradient.
fn drafter_vs_pytorch(windows: Vec<Option<usize>>, eps: f32) {
    use dflash_engine::model::drafter::{fc_backward, fc_forward, Drafter, DrafterShape};
    use dflash_engine::train::batch::{build_batch, BatchSpec, Sample};
    use dflash_engine::train::step::DeviceDraftBatch;
    let g = gpu();
    let st = g.compute_stream();
    let layers = windows.len();
    let sh = DrafterShape {
        hidden: 64,
        layers,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        inter: 96,
        vocab: 256,
        num_taps: 2,
        block_size: 8,
        eps,
        rope_theta: 1e6,
        windows: windows.clone(),
        mask_token_id: 255,
        logits_chunk_rows: 37,
        recompute: dflash_engine::model::drafter::Recompute::Norms,
        offload_layers: 1,
    };
    let mut r = Philox::new(9, [2, 2]);
    let samples: Vec<Sample> = [(60, 10), (41, 5), (7, 5)]
        .iter()
        .map(|&(len, prompt)| Sample {
            input_ids: (0..len).map(|_| r.below(250) as u32).collect(),
            loss_mask: (0..len).map(|i| u8::from(i >= prompt)).collect(),
        })
        .collect();
    let hb = build_batch(
        &samples,
        &BatchSpec { anchors_per_seq: 6, block_size: 8, mask_token_id: 255, gamma: 4.0, pad_to_tokens: None, seed: 4 },
        0,
        0,
    )
    .unwrap();
    let bf = |v: Vec<f32>| v.iter().map(|&x| dflash_engine::tensor::round_bf16(x)).collect::<Vec<f32>>();
    let n = sh.vocab * sh.hidden;
    let (embed_h, head_h) = (bf(rand(n, 1, 1.0)), bf(rand(n, 2, 0.5)));
    let x_h = bf(rand(hb.rows() * sh.fc_in(), 3, 1.0));
    let (mut d, mut fc) = {
        let frozen = |h: &[f32]| dflash_engine::model::drafter::Frozen::owned(put(&g, h, DType::BF16));
        Drafter::new(&g, &st, sh.clone(), frozen(&embed_h), frozen(&head_h), 7).unwrap()
    };
    // Larger weights than the default init so every gradient is well above rounding noise.
    let mut params = Vec::new();
    for (gi, grp) in [&mut fc, &mut d.body].into_iter().enumerate() {
        let mut host = vec![0f32; grp.table.total()];
        for (ei, e) in grp.table.entries().iter().enumerate() {
            let v = bf(rand(e.numel, 100 + (gi * 100 + ei) as u64, 1.0)
                .iter()
                .map(|x| if e.shape.len() == 1 { 1.0 + 0.1 * x } else { 0.15 * x })
                .collect());
            host[e.offset..e.offset + e.numel].copy_from_slice(&v);
            params.push((e.name.clone(), e.shape.clone(), v));
        }
        grp.set_masters(&g, &st, &host).unwrap();
    }
    let xb = put(&g, &x_h, DType::BF16);
    let dev = DeviceDraftBatch::upload(&g, &st, &hb).unwrap();
    let mut y = g.alloc(&st, DType::BF16, hb.rows() * sh.hidden).unwrap();
    let mut dy = g.alloc(&st, DType::BF16, hb.rows() * sh.hidden).unwrap();
    fc_forward(&g, &st, &fc, &xb, &mut y, hb.rows()).unwrap();
    let out = d.forward_backward(&g, &st, &dev.inputs(), &y, (1.0 / hb.weight_sum) as f32, &mut dy).unwrap();
    fc_backward(&g, &st, &mut fc, &dy, &xb, hb.rows()).unwrap();
    let loss = get(&g, &out.loss).iter().map(|&x| f64::from(x)).sum::<f64>() / hb.weight_sum;

    // The case file for the oracle.
    let scratch = Scratch::new("gpu-drafter_vs_pytorch");
    let dir = scratch.path().to_path_buf();
    let f32b = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let i32b = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    use safetensors::Dtype::{F32, I32};
    let mut t = vec![
        ("x".to_string(), F32, vec![hb.rows(), sh.fc_in()], f32b(&x_h)),
        ("embed".to_string(), F32, vec![sh.vocab, sh.hidden], f32b(&embed_h)),
        ("lm_head".to_string(), F32, vec![sh.vocab, sh.hidden], f32b(&head_h)),
        ("ctx_pos".to_string(), I32, vec![hb.rows()], i32b(&hb.pos)),
        ("block_ids".to_string(), I32, vec![hb.block_ids.len()], i32b(&hb.block_ids)),
        ("block_pos".to_string(), I32, vec![hb.block_pos.len()], i32b(&hb.block_pos)),
        ("anchors".to_string(), I32, vec![hb.anchors.len()], i32b(&hb.anchors)),
        ("ctx_start".to_string(), I32, vec![hb.ctx_start.len()], i32b(&hb.ctx_start)),
        ("labels".to_string(), I32, vec![hb.labels.len()], i32b(&hb.labels)),
        ("weights".to_string(), F32, vec![hb.weights.len()], f32b(&hb.weights)),
    ];
    for (name, shape, v) in &params {
        t.push((name.clone(), F32, shape.clone(), f32b(v)));
    }
    let layer_windows: Vec<String> = windows.iter().map(|w| w.unwrap_or(0).to_string()).collect();
    let meta: std::collections::HashMap<String, String> = [
        ("heads", "4".to_string()),
        ("kv_heads", "2".to_string()),
        ("head_dim", "16".to_string()),
        ("block_size", "8".to_string()),
        ("layers", layers.to_string()),
        ("rms_eps", f64::from(eps).to_string()),
        ("norm_eps", f64::from(eps).to_string()),
        ("rope_theta", "1000000".to_string()),
        ("layer_windows", layer_windows.join(",")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    dflash_engine::weights::write_safetensors_atomic(dir.join("case.safetensors"), &t, Some(meta)).unwrap();
    python(
        "drafter_ref.py",
        &[
            format!("--case={}", dir.join("case.safetensors").display()),
            format!("--out={}", dir.join("ref.safetensors").display()),
            "--dtype=float32".into(),
        ],
    );
    let rf = dflash_engine::weights::TensorStore::open_file(dir.join("ref.safetensors")).unwrap();
    let want_loss = f64::from(rf.tensor_f32("loss", &[1]).unwrap()[0]);
    println!("drafter loss ({layers} layers, windows {windows:?}): engine (cuda) {loss:.6}, pytorch {want_loss:.6}");
    assert!(((loss - want_loss) / want_loss).abs() < 1e-2, "loss {loss} vs {want_loss}");
    let (gf, gb) = (get(&g, &fc.grad), get(&g, &d.body.grad));
    for grp_entries in [(&fc.table, &gf), (&d.body.table, &gb)] {
        for e in grp_entries.0.entries() {
            let ours = &grp_entries.1[e.offset..e.offset + e.numel];
            let want = rf.tensor_f32(&format!("grad.{}", e.name), &e.shape).unwrap();
            // The engine keeps activations and their gradients in bf16; the oracle is f32.
            // Relative to the tensor's largest gradient: 5e-2.
            rel_err(&format!("grad {} vs pytorch", e.name), ours, &want, 5e-2);
        }
    }
}

/// The engine's taps of one packed batch on `be` (`None` where the backend has no kernel for
/// one of the target's ops yet).
fn packed_taps<B: Backend>(
    be: &B,
    dir: &std::path::Path,
    cfg: &dflash_engine::config::TargetConfig,
    taps: &[usize],
    tokens: &[i32],
    lens: &[usize],
) -> Option<Vec<Vec<f32>>> {
    use dflash_engine::model::target::{Target, TargetInputs, TargetShape};
    let files = dflash_engine::weights::ModelFiles::open(dir).unwrap();
    let target = Target::load(be, TargetShape::from(cfg), taps.to_vec(), false, |n, d| -> anyhow::Result<Vec<f32>> {
        Ok(files.tensor_f32(n, d)?)
    })
    .unwrap();
    let st = be.compute_stream();
    let rows = tokens.len();
    let pos: Vec<i32> = lens.iter().flat_map(|&l| 0..l as i32).collect();
    let mut starts = vec![0i32];
    for &l in lens {
        starts.push(starts.last().unwrap() + l as i32);
    }
    let mut outs: Vec<_> = taps.iter().map(|_| be.alloc(&st, DType::BF16, rows * cfg.hidden_size).unwrap()).collect();
    let inputs = TargetInputs { ids: &ids(be, tokens), pos: &ids(be, &pos), seq_starts: &ids(be, &starts), rows };
    match target.forward_taps(be, &st, &inputs, &mut outs) {
        Ok(()) => Some(outs.iter().map(|o| get(be, o)).collect()),
        Err(dflash_engine::backend::BackendError::Unsupported(why)) => {
            println!("  {}: {why}", be.name());
            None
        }
        Err(e) => panic!("forward on {}: {e}", be.name()),
    }
}

/// The Qwen3.5/3.6 hybrid target's taps against transformers' `Qwen3_5ForCausalLM` on the same
/// checkpoint (tests/reference/hf_qwen35_taps.py), on a packed batch of ragged sequences (one
/// longer than a 64-token chunk and not a multiple of it): a tap after a Gated DeltaNet layer and
/// one after a full-attention layer. transformers runs in f32 and in bf16; the engine's error
/// against the f32 result must be at most 1.5x transformers' own bf16 error, on the CPU backend
/// (the reference) and on CUDA.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_qwen35_taps_match_hugging_face() {
    qwen35_taps_match_hugging_face(Some(&gpu()), "cuda");
}

/// [`gpu_qwen35_taps_match_hugging_face`] with transformers and the engine on the CPU only (no
/// GPU; needs python3 with torch and transformers): the CPU reference's accuracy check.
#[test]
#[ignore = "needs python3 with torch and transformers"]
fn cpu_qwen35_taps_match_hugging_face() {
    qwen35_taps_match_hugging_face(None, "cpu");
}

/// A preset's checkpoint with every matrix, the embedding and the lm_head too, drawn at std 0.05:
/// the init the hybrid tolerance table was measured with. (The hybrid presets draw their
/// embedding and lm_head larger, `weights::HYBRID_EMBED_GAIN`; a residual stream dominated by
/// the embedding would hide the layers' rounding behind the embedding's.)
fn write_uniform_init(cfg: &dflash_engine::config::TargetConfig, seed: u64, dir: &std::path::Path) {
    use dflash_engine::weights::{init_value_bf16, target_tensor_specs, TensorRole};
    let tensors: Vec<_> = target_tensor_specs(cfg)
        .iter()
        .enumerate()
        .map(|(t, spec)| {
            let role = match spec.role {
                TensorRole::Scaled { .. } => TensorRole::Linear,
                r => r,
            };
            let bytes: Vec<u8> =
                (0..spec.numel()).flat_map(|e| init_value_bf16(role, seed, t as u32, e, 0.05).to_le_bytes()).collect();
            (spec.name.clone(), safetensors::Dtype::BF16, spec.shape.clone(), bytes)
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    dflash_engine::weights::write_safetensors_atomic(dir.join("model.safetensors"), &tensors, None).unwrap();
    std::fs::write(dir.join("config.json"), cfg.to_hf_json()).unwrap();
}

fn qwen35_taps_match_hugging_face(g: Option<&dflash_engine::backend::cuda::CudaBackend>, device: &str) {
    use dflash_engine::backend::cpu::CpuBackend;
    use dflash_engine::config::TargetConfig;
    let mut fails = Vec::new();
    let scratch = Scratch::new(&format!("gpu-qwen35_taps_match_hugging_face-{device}"));
    for preset in ["qwen3.5-tiny", "qwen3.5-small"] {
        let cfg = TargetConfig::preset(preset).unwrap();
        let dflash_engine::config::Arch::Qwen35(hy) = &cfg.arch else { panic!("{preset} is not a hybrid preset") };
        // true: full attention.
        let kinds: Vec<bool> = hy.layer_types.iter().map(|t| *t == dflash_engine::config::LayerType::Full).collect();
        let linear = (0..cfg.num_hidden_layers).find(|&i| !kinds[i]).expect("a linear layer");
        let full = (0..cfg.num_hidden_layers).find(|&i| kinds[i]).expect("a full-attention layer");
        let taps = vec![linear.min(full), linear.max(full)];
        let dir = scratch.join(format!("hf35-{preset}"));
        std::fs::create_dir_all(&dir).unwrap();
        write_uniform_init(&cfg, 3, &dir.join("model"));
        let lens = [100usize, 37, 5];
        let n: usize = lens.iter().sum();
        let mut r = Philox::new(9, [2, 2]);
        let tokens: Vec<i32> = (0..n).map(|_| r.below(cfg.vocab_size as u64 - 3) as i32).collect();
        let mut starts = vec![0i32];
        for &l in &lens {
            starts.push(starts.last().unwrap() + l as i32);
        }
        let to_bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        dflash_engine::weights::write_safetensors_atomic(
            dir.join("in.safetensors"),
            &[
                ("input_ids".to_string(), safetensors::Dtype::I32, vec![n], to_bytes(&tokens)),
                ("seq_starts".to_string(), safetensors::Dtype::I32, vec![lens.len() + 1], to_bytes(&starts)),
            ],
            None,
        )
        .unwrap();
        let layers = taps.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
        python(
            "hf_qwen35_taps.py",
            &[
                format!("--model={}", dir.join("model").display()),
                format!("--input={}", dir.join("in.safetensors").display()),
                format!("--layers={layers}"),
                format!("--out={}", dir.join("out.safetensors").display()),
                format!("--device={device}"),
            ],
        );
        let hf = dflash_engine::weights::TensorStore::open_file(dir.join("out.safetensors")).unwrap();
        let cpu = CpuBackend::new();
        let engines: Vec<(String, Vec<Vec<f32>>)> = [
            packed_taps(&cpu, &dir.join("model"), &cfg, &taps, &tokens, &lens).map(|t| (cpu.name(), t)),
            // Every hybrid op has a CUDA kernel: with a GPU the CUDA run is required, not optional.
            g.map(|g| {
                let t =
                    packed_taps(g, &dir.join("model"), &cfg, &taps, &tokens, &lens).expect("CUDA runs every hybrid op");
                (g.name(), t)
            }),
        ]
        .into_iter()
        .flatten()
        .collect();
        // The engine's math without rounding (f64): any error left is a formula difference.
        let exact = packed_taps(&CpuBackend::exact(), &dir.join("model"), &cfg, &taps, &tokens, &lens)
            .expect("the exact CPU backend runs every op");
        for (k, &l) in taps.iter().enumerate() {
            let f32_ref = hf.tensor_f32(&format!("tap_{l}_float32"), &[n, cfg.hidden_size]).unwrap();
            let bf16 = hf.tensor_f32(&format!("tap_{l}_bfloat16"), &[n, cfg.hidden_size]).unwrap();
            let scale = f32_ref.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
            let err = |a: &[f32]| a.iter().zip(&f32_ref).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
            let hf_bf16 = err(&bf16);
            let kind = if kinds[l] { "full attention" } else { "Gated DeltaNet" };
            println!("{preset} layer {l} ({kind}): transformers bf16 vs f32 {hf_bf16:.3e}");
            let math = err(&exact[k]);
            println!("  engine in f64 without rounding vs transformers f32: {math:.3e}");
            if math > 1e-4 {
                fails.push(format!(
                    "{preset} layer {l}: the unrounded engine differs from transformers f32 by {math:.3e}"
                ));
            }
            for (name, t) in &engines {
                let ours = err(&t[k]);
                println!("  engine on {name} vs transformers f32: {ours:.3e} ({:.2}x its bf16)", ours / hf_bf16);
                if ours > 1.5 * hf_bf16 {
                    fails.push(format!("{preset} layer {l} on {name}: {ours:.3e} > 1.5 x {hf_bf16:.3e}"));
                }
            }
        }
    }
    assert!(fails.is_empty(), "error above 1.5x transformers' bf16 error:\n{}", fails.join("\n"));
}
