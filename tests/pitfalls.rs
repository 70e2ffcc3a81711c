//! DFLASH.md section 6: one test per pitfall, each failing if the pitfall is present.

use crate::common::*;
use crate::drafter_fd::fd_batch;
use dflash_engine::backend::cpu::{CpuBackend, CpuStream};
use dflash_engine::backend::{AdamStep, Backend, DraftAttnShape};
use dflash_engine::model::drafter::{fc_backward, fc_forward, DrafterShape};
use dflash_engine::model::target::{Target, TargetInputs, TargetShape};
use dflash_engine::tensor::DType;
use dflash_engine::train::batch::{build_batch, BatchSpec, HostBatch, Sample};
use dflash_engine::train::optim::OptimConfig;
use dflash_engine::train::step::{plan_update, DeviceDraftBatch, DrafterSide};

const S: CpuStream = CpuStream;

/// Pitfall 1: slot r of a block predicts the token AT anchor + r, not anchor + r + 1.
#[test]
fn pitfall_1_labels_are_not_shifted() {
    let s = Sample { input_ids: (100..140).collect(), loss_mask: vec![1; 40] };
    let spec =
        BatchSpec { anchors_per_seq: 5, block_size: 8, mask_token_id: 7, gamma: 4.0, pad_to_tokens: None, seed: 3 };
    let b = build_batch(std::slice::from_ref(&s), &spec, 0, 0).unwrap();
    let mut checked = 0;
    for j in 0..5 {
        let a = b.anchors[j] as usize;
        for r in 1..8 {
            if a + r < 40 {
                assert_eq!(b.labels[j * 8 + r], s.input_ids[a + r] as i32, "block {j} slot {r}");
                checked += 1;
            }
        }
    }
    assert!(checked > 20);
}

/// Pitfall 2: context key t is visible iff t < anchor (strictly). The anchor's own hidden state
/// encodes the token the first slot must predict.
#[test]
fn pitfall_2_context_at_the_anchor_is_invisible() {
    let sh =
        DraftAttnShape { num_blocks: 1, block_size: 4, ctx_rows: 10, heads: 2, kv_heads: 1, head_dim: 4, window: None };
    let t = attn_inputs(&sh, 1);
    let (anchors, starts) = ([5], [2]); // sequence starts at row 2, anchor at local position 5
    let base = attn_out(&sh, &t, &anchors, &starts);
    for (row, visible) in [(2 + 5, false), (2 + 4, true), (2, true), (9, false)] {
        for which in [1, 2] {
            let mut t2 = t.clone();
            t2[which][row * 4] += 1.0;
            let changed = attn_out(&sh, &t2, &anchors, &starts) != base;
            assert_eq!(changed, visible, "context row {row} (tensor {which}) visible={visible}");
        }
    }
}

/// Pitfall 3: inside a block the mask is bidirectional (slot 0 sees slot 3), and blocks never see
/// each other.
#[test]
fn pitfall_3_block_mask_is_bidirectional_and_private() {
    let sh =
        DraftAttnShape { num_blocks: 2, block_size: 4, ctx_rows: 8, heads: 2, kv_heads: 2, head_dim: 4, window: None };
    let t = attn_inputs(&sh, 9);
    let (anchors, starts) = ([3, 5], [0, 0]);
    let base = attn_out(&sh, &t, &anchors, &starts);
    let width = 8;
    let mut t2 = t.clone();
    t2[3][3 * width] += 1.0; // key of block 0, slot 3
    let o = attn_out(&sh, &t2, &anchors, &starts);
    assert_ne!(o[..width], base[..width], "slot 0 must see slot 3 of its block");
    assert_eq!(o[4 * width..], base[4 * width..], "block 1 must not see block 0");
}

fn tiny_target_shape() -> TargetShape {
    TargetShape {
        hidden: 16,
        layers: 4,
        heads: 2,
        kv_heads: 1,
        head_dim: 8,
        inter: 24,
        vocab: 40,
        eps: 1e-6,
        rope_theta: 1e6,
        tied_embeddings: false,
        arch: dflash_engine::config::Arch::Qwen3,
    }
}

fn run_taps(taps: Vec<usize>, tweak_layer: Option<usize>) -> Vec<Vec<f32>> {
    let be = CpuBackend::new();
    let shape = tiny_target_shape();
    let target = Target::<CpuBackend>::load(
        &be,
        shape.clone(),
        taps.clone(),
        false,
        |name, dims| -> Result<Vec<f32>, dflash_engine::backend::BackendError> {
            let n: usize = dims.iter().product();
            let seed = name.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
            let tweak = tweak_layer.is_some_and(|l| name == format!("model.layers.{l}.mlp.down_proj.weight"));
            let std = if dims.len() == 1 { 0.0 } else { 0.2 };
            Ok(randn(n, seed + u64::from(tweak), std)
                .iter()
                .map(|v| (if dims.len() == 1 { 1.0 } else { 0.0 }) + *v as f32)
                .collect())
        },
    )
    .unwrap();
    let rows = 6;
    let ids = vec![1, 5, 9, 2, 33, 7];
    let pos: Vec<i32> = (0..6).collect();
    let starts = vec![0, 6];
    let mut out: Vec<_> = taps.iter().map(|_| be.alloc(&S, DType::BF16, rows * shape.hidden).unwrap()).collect();
    target.forward_taps(&be, &S, &TargetInputs { ids: &ids, pos: &pos, seq_starts: &starts, rows }, &mut out).unwrap();
    out.iter().map(|b| be.download(&S, b).unwrap()).collect()
}

/// Pitfall 4: tap k is the OUTPUT of 0-based layer `ids[k]` (HF `hidden_states[id + 1]`). If it
/// were the layer's input, changing the layer would not move it; if it were the next layer's
/// output, changing the next layer would.
#[test]
fn pitfall_4_tap_is_the_output_of_its_layer() {
    let base = run_taps(vec![1, 2], None);
    let changed_1 = run_taps(vec![1, 2], Some(1));
    let changed_2 = run_taps(vec![1, 2], Some(2));
    assert_ne!(changed_1[0], base[0], "tap of layer 1 must depend on layer 1");
    assert_eq!(changed_2[0], base[0], "tap of layer 1 must not depend on layer 2");
    assert_ne!(changed_2[1], base[1], "tap of layer 2 must depend on layer 2");
    assert_eq!(run_taps(vec![1], None)[0], base[0], "a tap does not depend on which other taps exist");
}

/// Pitfall 5: a padded block (no anchor) and a block anchored at 0 (empty context) give finite
/// everything, and padded slots give exactly zero loss and zero gradient.
#[test]
fn pitfall_5_empty_rows_give_zeros_not_nan() {
    let be = CpuBackend::new();
    let sh = fd_shape();
    let s0 = Sample { input_ids: vec![3, 4, 5, 6], loss_mask: vec![1, 1, 0, 0] }; // one anchor, at 0
                                                                                  // A batch has as many block slots per sequence as its most anchors drawn: s1 draws 3, so
                                                                                  // s0's second and third slots are padded.
    let s1 = Sample { input_ids: vec![3, 4, 5, 6, 7], loss_mask: vec![1, 1, 1, 1, 1] };
    let spec = BatchSpec {
        anchors_per_seq: 3,
        block_size: sh.block_size,
        mask_token_id: sh.mask_token_id,
        gamma: 7.0,
        pad_to_tokens: Some(16),
        seed: 1,
    };
    let hb = build_batch(&[s0, s1], &spec, 0, 0).unwrap();
    assert_eq!(hb.anchors[..3], [0, -1, -1]);
    let (mut side, _) = f32_side(&sh);
    let x = randn(hb.rows() * sh.fc_in(), 5, 1.0).iter().map(|&v| v as f32).collect::<Vec<_>>();
    let mut xb = be.alloc(&S, DType::BF16, x.len()).unwrap();
    be.upload(&S, &x, &mut xb, 0).unwrap();
    let dev = DeviceDraftBatch::upload(&be, &S, &hb).unwrap();
    let mut y = be.alloc(&S, DType::BF16, hb.rows() * sh.hidden).unwrap();
    let mut dy = be.alloc(&S, DType::BF16, hb.rows() * sh.hidden).unwrap();
    fc_forward(&be, &S, side.fc.as_ref().unwrap(), &xb, &mut y, hb.rows()).unwrap();
    let out = side.drafter.forward_backward(&be, &S, &dev.inputs(), &y, 1.0, &mut dy).unwrap();
    fc_backward(&be, &S, side.fc.as_mut().unwrap(), &dy, &xb, hb.rows()).unwrap();
    assert_eq!(be.count_nonfinite(&S, &side.drafter.body.grad).unwrap(), 0);
    assert_eq!(be.count_nonfinite(&S, &side.fc.as_ref().unwrap().grad).unwrap(), 0);
    assert_eq!(be.count_nonfinite(&S, &out.loss).unwrap(), 0);
    let loss = be.download(&S, &out.loss).unwrap();
    let per = sh.block_size - 1;
    assert!(loss[per..3 * per].iter().all(|&l| l == 0.0), "padded blocks carry no loss");
    assert!(loss[..per].iter().any(|&l| l > 0.0), "the real block is supervised");
}

fn f32_side(sh: &DrafterShape) -> (DrafterSide<CpuBackend>, CpuBackend) {
    let be = CpuBackend::new();
    (crate::common::cpu_side(&be, sh), be)
}

fn f32_grads(sh: &DrafterShape, micro: &[HostBatch], x: &[Vec<f32>], per_micro_norm: bool) -> (Vec<f32>, Vec<f32>) {
    let (mut side, be) = f32_side(sh);
    let total: f64 = micro.iter().map(|b| b.weight_sum).sum();
    side.zero_grad(&be, &S).unwrap();
    for (hb, xh) in micro.iter().zip(x) {
        let mut xb = be.alloc(&S, DType::BF16, xh.len()).unwrap();
        be.upload(&S, xh, &mut xb, 0).unwrap();
        let w = if per_micro_norm { hb.weight_sum } else { total };
        side.consume(&be, &S, hb.clone(), &dflash_engine::train::step::Context::Packed(xb), (1.0 / w) as f32).unwrap();
    }
    (be.download(&S, &side.drafter.body.grad).unwrap(), be.download(&S, &side.fc.as_ref().unwrap().grad).unwrap())
}

/// Pitfall 6: logits are materialised a chunk at a time, and the chunk size changes nothing: the
/// loss, argmax and every gradient are bit-identical for chunks of 1, 3 and all rows.
#[test]
fn pitfall_6_chunked_logits_change_nothing() {
    let hb = fd_batch();
    let x: Vec<f32> = randn(hb.rows() * fd_shape().fc_in(), 8, 1.0).iter().map(|&v| v as f32).collect();
    let mut results = Vec::new();
    for chunk in [1, 3, 1 << 20] {
        let sh = DrafterShape { logits_chunk_rows: chunk, ..fd_shape() };
        results.push(f32_grads(&sh, std::slice::from_ref(&hb), std::slice::from_ref(&x), false));
    }
    assert_eq!(results[0], results[2]);
    assert_eq!(results[1], results[2]);
}

/// Pitfall 7: masters are f32, so updates smaller than a bf16 ulp still accumulate; and a step with
/// a non-finite loss or grad norm is skipped.
#[test]
fn pitfall_7_f32_masters_and_skipped_bad_steps() {
    let be = CpuBackend::new();
    let n = 4;
    let mk = |v: f32, dt| {
        let mut b = be.alloc(&S, dt, n).unwrap();
        be.fill(&S, &mut b, v).unwrap();
        b
    };
    let (mut master, grad, mut m, mut v, mut w) =
        (mk(1.0, DType::F32), mk(1.0, DType::F32), mk(0.0, DType::F32), mk(0.0, DType::F32), mk(1.0, DType::BF16));
    // Each step moves the master by ~1e-4, far below bf16's 2^-7 spacing at 1.0.
    for t in 1..=200 {
        let hp = AdamStep { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, t, grad_scale: 1.0 };
        be.adamw(&S, &mut master, &grad, &mut m, &mut v, &mut w, 0, &hp).unwrap();
    }
    let mm = be.download(&S, &master).unwrap()[0];
    assert!((mm - 0.98).abs() < 1e-3, "master {mm}");
    assert_eq!(be.download(&S, &w).unwrap()[0], dflash_engine::tensor::round_bf16(mm));
    let c = OptimConfig::default();
    assert!(plan_update(&c, 0, f64::NAN, 1.0).is_none());
    assert!(plan_update(&c, 0, 1.0, f64::INFINITY).is_none());
    assert!(plan_update(&c, 0, 1.0, 1.0).is_some());
}

/// Pitfall 8: the loss is normalised by the weight sum of the whole step, not per micro-batch:
/// two micro-batches give the gradients of the one batch that holds both.
#[test]
fn pitfall_8_loss_normalised_per_step() {
    let sh = fd_shape();
    let spec = BatchSpec {
        anchors_per_seq: 3,
        block_size: sh.block_size,
        mask_token_id: sh.mask_token_id,
        gamma: 7.0,
        pad_to_tokens: None,
        seed: 2,
    };
    let a = random_sample(12, 2, 23, 1);
    let b = random_sample(6, 3, 23, 2);
    let whole = build_batch(&[a.clone(), b.clone()], &spec, 0, 0).unwrap();
    let m1 = build_batch(&[a], &spec, 0, 0).unwrap();
    let m2 = build_batch(&[b], &spec, 0, 1).unwrap();
    assert_ne!(m1.weight_sum, m2.weight_sum, "unequal micro-batches make the pitfall visible");
    let xw: Vec<f32> = randn(whole.rows() * sh.fc_in(), 3, 1.0).iter().map(|&v| v as f32).collect();
    let split = m1.rows() * sh.fc_in();
    let (x1, x2) = (xw[..split].to_vec(), xw[split..].to_vec());
    let g_whole = f32_grads(&sh, &[whole], &[xw], false);
    let g_micro = f32_grads(&sh, &[m1.clone(), m2.clone()], &[x1.clone(), x2.clone()], false);
    let g_wrong = f32_grads(&sh, &[m1, m2], &[x1, x2], true);
    let rel = |a: &[f32], b: &[f32]| {
        let s = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / s
    };
    // Rows are independent, so activations are bit-identical; only the f32 weight-gradient sums
    // are split differently (two GEMM calls instead of one): f32 rounding, far below 1e-4.
    let (e0, e1) = (rel(&g_micro.0, &g_whole.0), rel(&g_micro.1, &g_whole.1));
    assert!(e0 < 1e-4 && e1 < 1e-4, "{e0:e} {e1:e}");
    assert!(rel(&g_wrong.0, &g_whole.0) > 0.1, "per-micro-batch normalisation must be detectably different");
}

/// Pitfall 6b: what the backward recomputes or parks in host memory instead of keeping on the
/// device changes nothing: every `Recompute` level and every number of offloaded layers (none,
/// some, all, more than there are) gives bit-identical gradients, on full and sliding-window
/// layers, over two micro-batches (so parking slots are reused).
#[test]
fn pitfall_6b_recompute_and_offload_change_nothing() {
    use dflash_engine::model::drafter::Recompute;
    let hb = fd_batch();
    let x: Vec<f32> = randn(hb.rows() * fd_shape().fc_in(), 11, 1.0).iter().map(|&v| v as f32).collect();
    let grads = |recompute, offload_layers| {
        let sh = DrafterShape { recompute, offload_layers, windows: vec![Some(3), None], ..fd_shape() };
        f32_grads(&sh, &[hb.clone(), hb.clone()], &[x.clone(), x.clone()], false)
    };
    let kept = grads(Recompute::Norms, 0);
    assert!(kept.0.iter().any(|&g| g != 0.0), "the gradients are not all zero");
    for (recompute, offload) in
        [(Recompute::Projections, 0), (Recompute::Norms, 1), (Recompute::Norms, 2), (Recompute::Projections, 5)]
    {
        assert!(grads(recompute, offload) == kept, "{recompute:?} with {offload} offloaded layers");
    }
}
