//! The MFU column's FLOP model (`train::flops`) against the GEMMs the engine really runs: on the
//! CPU backend, which counts the FLOPs of every GEMM its thread runs, the target's forward to its
//! deepest tap (dense and hybrid) and a whole drafter step must run exactly the GEMM FLOPs the
//! model counts for them, so that a GEMM added to or removed from either side fails here until
//! the model follows.

use crate::common::*;
use dflash_engine::backend::cpu::{thread_gemm_flops, CpuBackend, CpuStream};
use dflash_engine::backend::Backend;
use dflash_engine::config::TargetConfig;
use dflash_engine::model::drafter::DrafterShape;
use dflash_engine::model::target::{Target, TargetInputs, TargetShape};
use dflash_engine::tensor::DType;
use dflash_engine::train::batch::{build_batch, BatchSpec};
use dflash_engine::train::flops::{causal_pairs, DrafterFlops, TargetFlops};
use dflash_engine::train::optim::OptimConfig;
use dflash_engine::train::step::{drafter_step, Context, FcPlace, SingleRank};

const S: CpuStream = CpuStream;

/// GEMM FLOPs the current thread runs in `f`.
fn counted(f: impl FnOnce()) -> f64 {
    let before = thread_gemm_flops();
    f();
    thread_gemm_flops() - before
}

#[test]
fn target_forward_runs_the_gemm_flops_the_model_counts() {
    for (preset, taps) in [("tiny", vec![1, 3]), ("qwen3.5-tiny", vec![0, 4])] {
        let cfg = TargetConfig::preset(preset).unwrap();
        let shape = TargetShape::from(&cfg);
        let be = CpuBackend::new();
        let target = Target::<CpuBackend>::load(&be, shape.clone(), taps.clone(), false, |_, dims| {
            let n: usize = dims.iter().product();
            Ok::<_, dflash_engine::backend::BackendError>(randn(n, n as u64, 0.05).iter().map(|&v| v as f32).collect())
        })
        .unwrap();
        // Two sequences, one past a 64-row chunk.
        let rows = 100;
        let ids: Vec<i32> = (0..rows as i32).map(|i| (i * 7) % 200).collect();
        let pos: Vec<i32> = (0..70).chain(0..30).collect();
        let starts = vec![0, 70, 100];
        let mut out: Vec<_> = taps.iter().map(|_| be.alloc(&S, DType::BF16, rows * shape.hidden).unwrap()).collect();
        let got = counted(|| {
            let inp = TargetInputs { ids: &ids, pos: &pos, seq_starts: &starts, rows };
            target.forward_taps(&be, &S, &inp, &mut out).unwrap()
        });
        let model = TargetFlops::new(&shape, target.last_layer());
        assert_eq!(got, model.gemm_per_token * rows as f64, "{preset}: counted GEMM FLOPs vs the model's");
        assert!(model.per_pair > 0.0, "{preset}: the full-attention layers' pairs count");
        if preset.starts_with("qwen3.5") {
            assert!(model.recurrence_per_token > 0.0, "{preset}: the Gated DeltaNet layers count");
        }
    }
}

#[test]
fn drafter_step_runs_the_gemm_flops_the_model_counts() {
    let be = CpuBackend::new();
    for windows in [vec![None, None], vec![Some(3), None]] {
        let sh = DrafterShape { windows, ..fd_shape() };
        let mut side = cpu_side(&be, &sh);
        // Every sequence draws the same number of anchors and nothing is padded: the model counts
        // real rows and blocks, the step runs every row and block.
        let samples = vec![random_sample(12, 3, 23, 1), random_sample(9, 2, 23, 2)];
        let spec = BatchSpec {
            anchors_per_seq: 2,
            block_size: sh.block_size,
            mask_token_id: sh.mask_token_id,
            gamma: 7.0,
            pad_to_tokens: None,
            seed: 11,
        };
        let hb = build_batch(&samples, &spec, 0, 0).unwrap();
        assert_eq!((hb.real_anchors, hb.n_valid), (hb.num_blocks, hb.rows()), "a batch without padding");
        let x: Vec<f32> = randn(hb.rows() * sh.fc_in(), 5, 1.0).iter().map(|&v| v as f32).collect();
        let mut xb = be.alloc(&S, DType::BF16, x.len()).unwrap();
        be.upload(&S, &x, &mut xb, 0).unwrap();
        let optim = OptimConfig { total_steps: 1, ..OptimConfig::default() };
        let weight = hb.weight_sum;
        let micro = vec![Ok((hb.clone(), Context::Packed(xb)))];
        let got = counted(|| {
            drafter_step(&be, &S, &mut side, 0, weight, micro, &mut SingleRank, FcPlace::Local, true, &optim).unwrap();
        });
        let model = DrafterFlops::of(&sh, &hb);
        assert_eq!(got, model.gemm, "windows {:?}: counted GEMM FLOPs vs the model's", sh.windows);
        assert!(model.attention > 0.0);
        // The step's metrics carry the batch's FLOP sums.
        side.apply_staged(&be, &S).unwrap();
        let m = side.finish_previous(&be).unwrap().expect("the step's metrics");
        assert_eq!(m.drafter_flops, model);
        assert_eq!(m.causal_pairs, causal_pairs(&hb));
        assert_eq!(m.causal_pairs, (12.0 * 13.0 + 9.0 * 10.0) / 2.0);
    }
}

/// The attention part: three times the forward's pair FLOPs per layer, each layer by its own mask;
/// a layer `windows` does not list is full attention, as the drafter reads it.
#[test]
fn drafter_attention_flops_are_three_forwards_per_layer_mask() {
    use dflash_engine::train::batch::HostBatch;
    // Layer 0 sliding (window 4), layer 1 without an entry; block size 4, 2 heads of 4.
    let sh = DrafterShape { windows: vec![Some(4)], ..fd_shape() };
    assert_eq!((sh.layers, sh.block_size, sh.heads, sh.head_dim), (2, 4, 2, 4));
    let hb = HostBatch { anchors: vec![5, -1], num_blocks: 2, real_anchors: 1, n_valid: 10, ..HostBatch::default() };
    // 3 x 4 x head_dim 4 x 2 heads = 96 per pair; 16 pairs (sliding) + 36 (full).
    assert_eq!(DrafterFlops::of(&sh, &hb).attention, 96.0 * (16.0 + 36.0));
}
