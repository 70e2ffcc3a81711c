//! The step loop never waits for the device: the update decision made on the device
//! (`Backend::update_plan`, `adamw_planned`) equals the host's `plan_update`, and a run whose
//! metrics come back one step late reports, step for step, what the host-decided step reports,
//! with bit-identical weights (a step with a non-finite loss skipped, and only that one).

use crate::common::*;
use crate::drafter_fd::fd_batch;
use dflash_engine::backend::cpu::{CpuBackend, CpuStream};
use dflash_engine::backend::{AdamStep, Backend};
use dflash_engine::tensor::DType;
use dflash_engine::train::optim::OptimConfig;
use dflash_engine::train::step::{
    drafter_step, global_norm, plan_update, Context, DrafterSide, FcPlace, HostDecided, RankGroup, SingleRank,
    StepMetrics,
};

const S: CpuStream = CpuStream;

fn put(be: &CpuBackend, v: &[f32]) -> <CpuBackend as Backend>::Buf {
    let mut b = be.alloc(&S, DType::F32, v.len()).unwrap();
    be.upload(&S, v, &mut b, 0).unwrap();
    b
}

/// The device plan (`[clip factor, skip]`) of sums of squares and per-slot losses.
fn device_plan(be: &CpuBackend, body: f32, fc: f32, loss: &[f32], weighted: bool, clip: f32) -> (f32, bool) {
    let mut plan = be.alloc(&S, DType::F32, 2).unwrap();
    be.update_plan(&S, &put(be, &[body]), &put(be, &[fc]), &put(be, loss), weighted, clip, &mut plan).unwrap();
    let p = be.download(&S, &plan).unwrap();
    assert!(p[1] == 0.0 || p[1] == 1.0, "skip flag {}", p[1]);
    (p[0], p[1] != 0.0)
}

#[test]
fn device_update_plan_matches_plan_update() {
    let be = CpuBackend::new();
    let losses = [2.5f32, 0.0, 7.25, 1e-3];
    let mut nan_loss = losses;
    nan_loss[2] = f32::NAN;
    let mut inf_loss = losses;
    inf_loss[0] = f32::INFINITY;
    // (body sumsq, fc sumsq, losses, step weight > 0, clip)
    let cases: [(f32, f32, &[f32], bool, f32); 8] = [
        (0.04, 0.09, &losses, true, 1.0),          // finite, below the clip: factor 1
        (3.0, 7.123, &losses, true, 1.0),          // clipped
        (1e6, 2.5e5, &losses, true, 0.5),          // clipped hard
        (3.0, 7.123, &losses, true, 0.0),          // no clip configured
        (0.5, 0.25, &nan_loss, true, 1.0),         // NaN loss: skipped
        (0.5, 0.25, &inf_loss, true, 1.0),         // inf loss: skipped
        (f32::INFINITY, 0.25, &losses, true, 1.0), // inf norm: skipped
        (0.5, f32::NAN, &losses, true, 1.0),       // NaN norm: skipped
    ];
    for (k, &(body, fc, loss, weighted, clip)) in cases.iter().enumerate() {
        let optim = OptimConfig { clip, ..OptimConfig::default() };
        let norm = global_norm(f64::from(fc), f64::from(body));
        let host_loss = loss.iter().map(|&x| f64::from(x)).sum::<f64>() / 3.0;
        let want = plan_update(&optim, 5, host_loss, norm);
        let (scale, skip) = device_plan(&be, body, fc, loss, weighted, clip);
        assert_eq!(skip, want.is_none(), "case {k}: skip");
        if let Some(hp) = want {
            assert_eq!(scale.to_bits(), hp.grad_scale.to_bits(), "case {k}: clip factor {scale} vs {}", hp.grad_scale);
        }
    }
    // The clipped case really clips, the unclipped one does not.
    assert_eq!(device_plan(&be, 0.04, 0.09, &losses, true, 1.0).0, 1.0);
    assert!(device_plan(&be, 3.0, 7.123, &losses, true, 1.0).0 < 0.5);
    // A step without loss weight has loss 0 on the host whatever its slots hold: not skipped.
    let optim = OptimConfig::default();
    assert!(plan_update(&optim, 0, 0.0, 1.0).is_some());
    assert!(!device_plan(&be, 0.5, 0.5, &nan_loss, false, 1.0).1);
}

#[test]
fn adamw_planned_is_adamw_with_the_plans_factor_or_nothing() {
    let be = CpuBackend::new();
    let n = 37;
    let r = |seed| randn(n, seed, 1.0).iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let (p0, g, m0) = (r(1), r(2), r(3));
    let v0: Vec<f32> = r(4).iter().map(|x| x * x).collect();
    let hp = AdamStep { lr: 6e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, t: 3, grad_scale: 0.3 };
    let run = |plan: Option<[f32; 2]>| {
        let (mut p, gb, mut m, mut v) = (put(&be, &p0), put(&be, &g), put(&be, &m0), put(&be, &v0));
        let mut w = be.alloc(&S, DType::BF16, n).unwrap();
        match plan {
            Some(pl) => be.adamw_planned(&S, &mut p, &gb, &mut m, &mut v, &mut w, 0, &hp, &put(&be, &pl)).unwrap(),
            None => be.adamw(&S, &mut p, &gb, &mut m, &mut v, &mut w, 0, &hp).unwrap(),
        }
        [&p, &m, &v, &w].map(|b| be.download(&S, b).unwrap().iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
    };
    assert_eq!(run(Some([0.3, 0.0])), run(None), "the plan's factor is the host's grad_scale");
    let skipped = run(Some([0.3, 1.0]));
    let untouched = [&p0, &m0, &v0].map(|x| x.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
    assert_eq!(skipped[..3], untouched, "a skipped step leaves masters and moments untouched");
    assert_ne!(run(Some([0.3, 0.0]))[0], untouched[0], "an applied step moves the masters");
}

fn new_side(be: &CpuBackend) -> DrafterSide<CpuBackend> {
    crate::common::cpu_side(be, &fd_shape())
}

/// Masters and first moments of both groups, as bits.
fn state(be: &CpuBackend, side: &DrafterSide<CpuBackend>) -> Vec<Vec<u32>> {
    let fc = side.fc.as_ref().unwrap();
    let b = &side.drafter.body;
    let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect();
    let m = |g: &dflash_engine::model::drafter::ParamGroup<CpuBackend>| g.moments.download(be, &S).unwrap().0;
    vec![bits(be.download(&S, &b.master).unwrap()), bits(m(b)), bits(be.download(&S, &fc.master).unwrap()), bits(m(fc))]
}

/// `steps` steps of two micro-batches each through `drafter_step`, with the caller's protocol of
/// the pipeline (read the previous step's metrics, then apply this step's update). Step `poison`
/// gets NaN packed taps. Returns each step's metrics and the state after each step's update.
/// `offload`: the moments live in host slots (`ParamGroup::offload_moments`), three chunks a
/// group with a shorter last one, instead of device buffers.
fn drive(
    ranks: &mut dyn RankGroup<CpuBackend>,
    steps: u32,
    poison: u32,
    offload: bool,
) -> (Vec<StepMetrics>, Vec<Vec<Vec<u32>>>) {
    let be = CpuBackend::new();
    let mut side = new_side(&be);
    if offload {
        for g in side.fc.iter_mut().chain(std::iter::once(&mut side.drafter.body)) {
            let n = g.table.total();
            let chunk = n / 3 + 1;
            assert!(n > 2 * chunk && n % chunk != 0, "{n} parameters: three chunks, the last one shorter");
            assert_eq!(g.offload_moments(&be, &S, chunk).unwrap(), 8 * n, "m and v, 4 bytes each");
            assert!(g.moments.is_offloaded());
        }
    }
    let sh = fd_shape();
    let hb = fd_batch();
    let optim = OptimConfig { total_steps: steps, clip: 0.05, ..OptimConfig::default() };
    let (mut metrics, mut states) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let micro: Vec<_> = (0..2u64)
            .map(|k| {
                let x: Vec<f32> = if step == poison {
                    vec![f32::NAN; hb.rows() * sh.fc_in()]
                } else {
                    randn(hb.rows() * sh.fc_in(), 100 + 2 * u64::from(step) + k, 1.0)
                        .iter()
                        .map(|&v| v as f32)
                        .collect()
                };
                let mut xb = be.alloc(&S, DType::BF16, x.len()).unwrap();
                be.upload(&S, &x, &mut xb, 0).unwrap();
                Ok((hb.clone(), Context::Packed(xb)))
            })
            .collect();
        let weight = 2.0 * hb.weight_sum;
        drafter_step(&be, &S, &mut side, step, weight, micro, ranks, FcPlace::Local, true, &optim).unwrap();
        metrics.extend(side.finish_previous(&be).unwrap());
        side.apply_staged(&be, &S).unwrap();
        states.push(state(&be, &side));
    }
    metrics.extend(side.finish_previous(&be).unwrap());
    assert!(side.finish_previous(&be).unwrap().is_none(), "every step reported once");
    (metrics, states)
}

/// Metrics compared bit for bit (a skipped step's loss is NaN).
fn bits(m: &StepMetrics) -> Vec<u64> {
    vec![
        u64::from(m.step),
        m.loss.to_bits(),
        m.accuracy.to_bits(),
        m.accept_len.to_bits(),
        m.round_accept_len.to_bits(),
        m.grad_norm.to_bits(),
        u64::from(m.lr.to_bits()),
        u64::from(m.skipped),
        m.tokens as u64,
        m.draft_positions as u64,
    ]
}

#[test]
fn late_metrics_equal_the_host_decided_steps_and_a_nan_step_is_skipped() {
    let steps = 5;
    let poison = 2;
    let (dev_m, dev_s) = drive(&mut SingleRank, steps, poison, false);
    let (host_m, host_s) = drive(&mut HostDecided, steps, poison, false);
    assert_eq!(dev_m.len(), steps as usize);
    for (k, (a, b)) in dev_m.iter().zip(&host_m).enumerate() {
        assert_eq!(a.step, k as u32, "metrics come in step order");
        assert_eq!(bits(a), bits(b), "step {k}: late metrics {a:?} vs host-decided {b:?}");
    }
    assert_eq!(dev_s, host_s, "the weights and moments after every step are bit-identical");
    // Exactly the poisoned step was skipped, and it left every master and moment untouched.
    let skipped: Vec<u32> = dev_m.iter().filter(|m| m.skipped).map(|m| m.step).collect();
    assert_eq!(skipped, [poison]);
    assert!(dev_m[poison as usize].loss.is_nan());
    assert_eq!(dev_s[poison as usize], dev_s[poison as usize - 1], "the skipped step changed nothing");
    assert_ne!(dev_s[poison as usize + 1], dev_s[poison as usize], "the step after it trains again");
    // The clip (0.05) binds on the finite steps, so the device clip factor is exercised.
    assert!(dev_m.iter().filter(|m| !m.skipped).all(|m| m.grad_norm > 0.05), "{dev_m:?}");
}

/// AdamW moments kept in host slots (`--offload-optimizer`), a chunk at a time through the
/// update, train bit for bit as moments on the device: the device-planned update and the
/// host-decided one, the clip binding, a skipped NaN step leaving the moments as they were, and
/// every step's masters and first moments compared.
#[test]
fn offloaded_moments_train_bit_identically() {
    let (steps, poison) = (5, 2);
    let (dev_m, dev_s) = drive(&mut SingleRank, steps, poison, false);
    for ranks in [&mut SingleRank as &mut dyn RankGroup<CpuBackend>, &mut HostDecided] {
        let (off_m, off_s) = drive(ranks, steps, poison, true);
        assert_eq!(off_m.iter().map(bits).collect::<Vec<_>>(), dev_m.iter().map(bits).collect::<Vec<_>>());
        assert_eq!(off_s, dev_s, "masters and moments after every step");
    }
    assert_eq!(dev_s[poison as usize], dev_s[poison as usize - 1], "the skipped step changed nothing");
}
