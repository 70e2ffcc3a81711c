//! One whole drafter step (FC, hidden_norm, every layer, final norm, chunked lm_head + CE) against
//! finite differences of the step's loss, for every parameter of both groups.

use crate::common::*;
use dflash_engine::backend::cpu::CpuStream;
use dflash_engine::model::drafter::{fc_backward, fc_forward};
use dflash_engine::train::batch::{build_batch, BatchSpec, HostBatch};
use dflash_engine::train::step::{DeviceDraftBatch, DrafterSide};

const S: CpuStream = CpuStream;

pub fn fd_batch() -> HostBatch {
    let sh = fd_shape();
    // Three sequences: the last has one candidate anchor, so two of its three blocks are padded.
    let samples = vec![random_sample(10, 3, 23, 1), random_sample(7, 2, 23, 2), random_sample(4, 2, 23, 3)];
    let spec = BatchSpec {
        anchors_per_seq: 3,
        block_size: sh.block_size,
        mask_token_id: sh.mask_token_id,
        gamma: 7.0,
        pad_to_tokens: None,
        seed: 11,
    };
    build_batch(&samples, &spec, 0, 0).unwrap()
}

/// The step's loss read straight from the f64 device buffer (a download would round it to f32,
/// which is too coarse for central differences).
fn step_loss(side: &mut DrafterSide<Exact>, hb: &HostBatch, x: &[f64]) -> f64 {
    let be = Exact::exact();
    let sh = side.drafter.shape.clone();
    let dev = DeviceDraftBatch::upload(&be, &S, hb).unwrap();
    let x = buf(x.to_vec());
    let mut y = buf(vec![0.0; hb.rows() * sh.hidden]);
    let mut dy = buf(vec![0.0; hb.rows() * sh.hidden]);
    let fc = side.fc.as_mut().unwrap();
    fc_forward(&be, &S, fc, &x, &mut y, hb.rows()).unwrap();
    let out = side.drafter.forward_backward(&be, &S, &dev.inputs(), &y, (1.0 / hb.weight_sum) as f32, &mut dy).unwrap();
    fc_backward(&be, &S, side.fc.as_mut().unwrap(), &dy, &x, hb.rows()).unwrap();
    out.loss.data.iter().sum::<f64>() / hb.weight_sum
}

#[test]
fn whole_drafter_step_matches_finite_differences() {
    whole_step_matches_finite_differences(fd_shape());
}

/// A sliding layer (window 3: shorter than most contexts, and slot 3 of a block reaches back
/// only to a + 1) under a full one, with norm eps 1e-5 from the config in every norm.
#[test]
fn whole_sliding_drafter_step_matches_finite_differences() {
    let sh = dflash_engine::model::drafter::DrafterShape { windows: vec![Some(3), None], eps: 1e-5, ..fd_shape() };
    whole_step_matches_finite_differences(sh);
}

fn whole_step_matches_finite_differences(sh: dflash_engine::model::drafter::DrafterShape) {
    let be = Exact::exact();
    let hb = fd_batch();
    assert!(hb.anchors.contains(&-1), "the case must include padded blocks");
    let x = randn(hb.rows() * sh.fc_in(), 99, 1.0);
    let (drafter, fc) = exact_drafter(&sh, 7);
    let mut side = DrafterSide::new(&be, &S, drafter, Some(fc)).unwrap();
    side.zero_grad(&be, &S).unwrap();
    let _ = step_loss(&mut side, &hb, &x);
    let body_grad = side.drafter.body.grad.data.clone();
    let fc_grad = side.fc.as_ref().unwrap().grad.data.clone();
    let gs32 = f64::from((1.0 / hb.weight_sum) as f32) * hb.weight_sum;

    let mut checked = 0;
    for group in 0..2 {
        let entries = if group == 0 {
            side.fc.as_ref().unwrap().table.entries().to_vec()
        } else {
            side.drafter.body.table.entries().to_vec()
        };
        for e in entries {
            let analytic = if group == 0 { &fc_grad } else { &body_grad }[e.offset..e.offset + e.numel].to_vec();
            let base: Vec<f64> = {
                let g = if group == 0 { side.fc.as_ref().unwrap() } else { &side.drafter.body };
                g.weights.data[e.offset..e.offset + e.numel].to_vec()
            };
            let numeric = numeric_grad(&base, |v| {
                let g = if group == 0 { side.fc.as_mut().unwrap() } else { &mut side.drafter.body };
                g.weights.data[e.offset..e.offset + e.numel].copy_from_slice(v);
                let l = step_loss(&mut side, &hb, &x);
                l * gs32
            });
            {
                let g = if group == 0 { side.fc.as_mut().unwrap() } else { &mut side.drafter.body };
                g.weights.data[e.offset..e.offset + e.numel].copy_from_slice(&base);
            }
            assert_grad_close(&e.name, &analytic, &numeric);
            checked += e.numel;
        }
    }
    assert_eq!(checked, side.drafter.body.table.numel() + side.fc.as_ref().unwrap().table.numel());
}
