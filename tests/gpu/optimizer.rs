//! The optimizer step and the gradient checks: AdamW (kernels/adamw.cu) bit-identical to the
//! CPU; the sum of squares (kernels/reduce.cu) and the non-finite count (kernels/elementwise.cu)
//! against the CPU and run to run.

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::cuda::CudaBackend;
use dflash_engine::backend::{AdamStep, Backend};
use dflash_engine::tensor::DType;

use super::{bits_equal, get, gpu, put, rand};

trait OptTest {
    fn adam(&self, p: &[f32], gr: &[f32], m: &[f32], v: &[f32]) -> [Vec<f32>; 4];
    fn sumsq(&self, x: &[f32]) -> f32;
    fn nonfinite(&self, x: &[f32], dt: DType) -> u64;
}

impl<B: Backend> OptTest for B {
    fn adam(&self, p: &[f32], gr: &[f32], m: &[f32], v: &[f32]) -> [Vec<f32>; 4] {
        let s = self.compute_stream();
        let (mut pb, gb, mut mb, mut vb) =
            (put(self, p, DType::F32), put(self, gr, DType::F32), put(self, m, DType::F32), put(self, v, DType::F32));
        let mut w = self.alloc(&s, DType::BF16, p.len()).unwrap();
        let hp = AdamStep { lr: 6e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, t: 7, grad_scale: 0.5 };
        self.adamw(&s, &mut pb, &gb, &mut mb, &mut vb, &mut w, 0, &hp).unwrap();
        [get(self, &pb), get(self, &mb), get(self, &vb), get(self, &w)]
    }
    fn sumsq(&self, x: &[f32]) -> f32 {
        let s = self.compute_stream();
        let mut out = self.alloc(&s, DType::F32, 1).unwrap();
        self.sum_squares(&s, &put(self, x, DType::F32), &mut out).unwrap();
        get(self, &out)[0]
    }
    fn nonfinite(&self, x: &[f32], dt: DType) -> u64 {
        self.count_nonfinite(&self.compute_stream(), &put(self, x, dt)).unwrap()
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_adamw_is_bit_identical() {
    let (g, c) = (gpu(), CpuBackend::new());
    let n = 10_001;
    let (p, gr, m) = (rand(n, 1, 1.0), rand(n, 2, 1.0), rand(n, 3, 0.1));
    let v: Vec<f32> = rand(n, 4, 0.1).iter().map(|x| x * x).collect();
    let (a, b) = (g.adam(&p, &gr, &m, &v), c.adam(&p, &gr, &m, &v));
    for (i, name) in ["master", "m", "v", "bf16 weights"].iter().enumerate() {
        bits_equal(&format!("adamw {name}"), &a[i], &b[i]);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_reductions_match_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    let x = rand(3_000_001, 5, 1.0);
    let (sg, sc) = (g.sumsq(&x), c.sumsq(&x));
    println!("sum of squares gpu {sg} cpu {sc}");
    assert!(((sg - sc) / sc).abs() < 1e-5);
    assert_eq!(g.sumsq(&x).to_bits(), sg.to_bits(), "sum of squares must be run-to-run identical");
    let mut bad = rand(1000, 6, 1.0);
    bad[3] = f32::NAN;
    bad[999] = f32::INFINITY;
    bad[500] = f32::NEG_INFINITY;
    assert_eq!(g.nonfinite(&bad, DType::F32), 3);
    assert_eq!(g.nonfinite(&bad, DType::BF16), 3);
}

/// The device update plan (kernels/reduce.cu `update_plan_f32`) equals the CPU's, bit for bit,
/// on finite, clipped, unclipped, NaN-loss and inf-norm inputs; `adamw_planned_f32` equals
/// `adamw_f32` with the plan's factor and leaves everything untouched on a skip; an async
/// readback returns what was on the device.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_update_plan_and_planned_adamw_match_cpu() {
    fn plan<B: Backend>(be: &B, body: f32, fc: f32, loss: &[f32], weighted: bool, clip: f32) -> Vec<f32> {
        let s = be.compute_stream();
        let mut out = be.alloc(&s, DType::F32, 2).unwrap();
        let (b, f, l) = (put(be, &[body], DType::F32), put(be, &[fc], DType::F32), put(be, loss, DType::F32));
        be.update_plan(&s, &b, &f, &l, weighted, clip, &mut out).unwrap();
        get(be, &out)
    }
    let (g, c) = (gpu(), CpuBackend::new());
    let mut loss = rand(9_000, 7, 2.0);
    let nan_loss = {
        let mut l = loss.clone();
        l[8_999] = f32::NAN;
        l
    };
    loss[0] = 0.0;
    let cases: [(f32, f32, &[f32], bool, f32); 7] = [
        (0.04, 0.09, &loss, true, 1.0),
        (3.0, 7.123, &loss, true, 1.0),
        (1e6, 2.5e5, &loss, true, 0.5),
        (3.0, 7.123, &loss, true, 0.0),
        (0.5, 0.25, &nan_loss, true, 1.0),
        (0.5, 0.25, &nan_loss, false, 1.0),
        (f32::INFINITY, 0.25, &loss, true, 1.0),
    ];
    for (k, &(body, fc, l, w, clip)) in cases.iter().enumerate() {
        bits_equal(&format!("update plan case {k}"), &plan(&g, body, fc, l, w, clip), &plan(&c, body, fc, l, w, clip));
    }
    assert_eq!(plan(&g, 0.5, 0.25, &nan_loss, true, 1.0)[1], 1.0, "a NaN loss skips");
    assert_eq!(plan(&g, 3.0, 7.123, &loss, true, 1.0)[1], 0.0);

    let n = 10_001;
    let (p, gr, m) = (rand(n, 1, 1.0), rand(n, 2, 1.0), rand(n, 3, 0.1));
    let v: Vec<f32> = rand(n, 4, 0.1).iter().map(|x| x * x).collect();
    let hp = AdamStep { lr: 6e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, t: 7, grad_scale: 0.5 };
    let planned = |pl: [f32; 2]| {
        let s = g.compute_stream();
        let (mut pb, gb, mut mb, mut vb) =
            (put(&g, &p, DType::F32), put(&g, &gr, DType::F32), put(&g, &m, DType::F32), put(&g, &v, DType::F32));
        let mut w = g.alloc(&s, DType::BF16, n).unwrap();
        g.adamw_planned(&s, &mut pb, &gb, &mut mb, &mut vb, &mut w, 0, &hp, &put(&g, &pl, DType::F32)).unwrap();
        [get(&g, &pb), get(&g, &mb), get(&g, &vb)]
    };
    let want = c.adam(&p, &gr, &m, &v);
    let got = planned([0.5, 0.0]);
    for (i, name) in ["master", "m", "v"].iter().enumerate() {
        bits_equal(&format!("adamw_planned {name}"), &got[i], &want[i]);
    }
    let skipped = planned([0.5, 1.0]);
    for (i, (name, orig)) in [("master", &p), ("m", &m), ("v", &v)].iter().enumerate() {
        bits_equal(&format!("skipped adamw_planned {name}"), &skipped[i], orig);
    }

    let s = g.compute_stream();
    let (a, b) = (put(&g, &loss, DType::F32), put(&g, &[1.5, -2.0], DType::F32));
    let mut ids = g.alloc_ids(&s, 5).unwrap();
    g.upload_ids(&s, &[3, -1, 7, 0, 42], &mut ids).unwrap();
    for _ in 0..3 {
        let r = g.read_async(&s, &[&a, &b], &[&ids]).unwrap();
        let (f, i) = g.read_wait(r).unwrap();
        bits_equal("read_async loss", &f[0], &loss);
        assert_eq!(f[1], [1.5, -2.0]);
        assert_eq!(i[0], [3, -1, 7, 0, 42]);
    }
}

/// Split masters (the CUDA backend's layout: the low halves beside the bf16 weights,
/// `tensor::master_split`) give the f32 masters of the CPU bit for bit: set and read back, three
/// AdamW steps (plain and planned, a million elements: a few dozen land on a bf16 tie and are
/// moved off it on both sides), and a skipped planned step that leaves every bit as it was.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_split_masters_match_f32_masters() {
    let (g, c) = (gpu(), CpuBackend::new());
    let n = 1_000_003;
    let p: Vec<f32> = rand(n, 11, 0.05).iter().map(|&x| dflash_engine::tensor::master_off_tie(x)).collect();
    let (gr, m0) = (rand(n, 12, 1.0), rand(n, 13, 0.01));
    let v0: Vec<f32> = rand(n, 14, 0.01).iter().map(|x| x * x).collect();
    let (s, cs) = (g.compute_stream(), c.compute_stream());
    let mut master = g.alloc_master(&s, n).unwrap();
    assert_eq!(g.dtype(&master).size_bytes(), 2, "the CUDA backend keeps 2 bytes per master");
    let mut w = g.alloc(&s, DType::BF16, n).unwrap();
    g.set_master(&s, &p, &mut master, &mut w).unwrap();
    bits_equal("split masters as set", &g.get_master(&s, &master, &w).unwrap(), &p);
    let (gb, mut mb, mut vb) = (put(&g, &gr, DType::F32), put(&g, &m0, DType::F32), put(&g, &v0, DType::F32));
    let (mut cp, cg, mut cm, mut cv) =
        (put(&c, &p, DType::F32), put(&c, &gr, DType::F32), put(&c, &m0, DType::F32), put(&c, &v0, DType::F32));
    let mut cw = c.alloc(&cs, DType::BF16, n).unwrap();
    let plan = put(&g, &[0.25, 0.0], DType::F32);
    for t in 1..=3 {
        let hp = AdamStep { lr: 3e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t, grad_scale: 0.25 };
        if t == 2 {
            g.adamw_planned(&s, &mut master, &gb, &mut mb, &mut vb, &mut w, 0, &hp, &plan).unwrap();
        } else {
            g.adamw(&s, &mut master, &gb, &mut mb, &mut vb, &mut w, 0, &hp).unwrap();
        }
        c.adamw(&cs, &mut cp, &cg, &mut cm, &mut cv, &mut cw, 0, &hp).unwrap();
    }
    let want = get(&c, &cp);
    let moved = want.iter().filter(|x| matches!(x.to_bits() & 0xFFFF, 0x7FFF | 0x8001)).count();
    println!("{moved} of {n} masters end one ulp next to a tie (some of them moved off one)");
    let got = [g.get_master(&s, &master, &w).unwrap(), get(&g, &mb), get(&g, &vb), get(&g, &w)];
    for (i, (name, b)) in [("masters", &cp), ("m", &cm), ("v", &cv), ("bf16 weights", &cw)].iter().enumerate() {
        bits_equal(&format!("split-master adamw {name}"), &got[i], &get(&c, b));
    }
    let hp = AdamStep { lr: 3e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 4, grad_scale: 0.25 };
    g.adamw_planned(&s, &mut master, &gb, &mut mb, &mut vb, &mut w, 0, &hp, &put(&g, &[0.25, 1.0], DType::F32))
        .unwrap();
    bits_equal("skipped step: masters", &g.get_master(&s, &master, &w).unwrap(), &want);
    bits_equal("skipped step: bf16 weights", &get(&g, &w), &got[3]);
}

/// AdamW moments in pinned host memory (`--offload-optimizer`: `model::moments`), brought through
/// the device a chunk at a time on two copy streams, update bit for bit as moments on the device:
/// a group of 3 tensors in 12 chunks (the last one shorter), four steps with new gradients each
/// (planned, plain, a skipped planned step, planned), masters, bf16 weights and both moments
/// compared after each; new masters zeroing the moments; and the moments set from the host and
/// read back through the chunks.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_offloaded_moments_update_bit_identically() {
    use dflash_engine::model::drafter::ParamGroup;
    use dflash_engine::model::ParamTable;
    let g = gpu();
    let s = g.compute_stream();
    let mut table = ParamTable::default();
    table.push("a", &[317, 129]);
    table.push("b", &[1000]);
    table.push("c", &[64, 97]);
    let n = table.total();
    let chunk = 4096;
    assert!(n.div_ceil(chunk) == 12 && n % chunk != 0, "{n} parameters: 12 chunks, the last one shorter");
    let p: Vec<f32> = rand(n, 21, 0.05);
    let make = || {
        let mut grp = ParamGroup::new(&g, &s, table.clone()).unwrap();
        grp.set_masters(&g, &s, &p).unwrap();
        grp
    };
    let (mut dev, mut off) = (make(), make());
    assert_eq!(off.offload_moments(&g, &s, chunk).unwrap(), 8 * n);
    let state = |grp: &ParamGroup<CudaBackend>| {
        let (m, v) = grp.moments.download(&g, &s).unwrap();
        [grp.masters(&g, &s).unwrap(), get(&g, &grp.weights), m, v]
    };
    for t in 1..=4u32 {
        let gr = rand(n, 30 + u64::from(t), 1.0);
        for grp in [&mut dev, &mut off] {
            g.upload(&s, &gr, &mut grp.grad, 0).unwrap();
        }
        let hp = AdamStep { lr: 3e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t, grad_scale: 1.0 };
        let plan = put(&g, &[0.5, if t == 3 { 1.0 } else { 0.0 }], DType::F32);
        let before = state(&off);
        for grp in [&mut dev, &mut off] {
            if t == 2 {
                grp.adamw(&g, &s, &hp).unwrap();
            } else {
                grp.adamw_planned(&g, &s, &hp, &plan).unwrap();
            }
        }
        let (want, got) = (state(&dev), state(&off));
        for (i, name) in ["masters", "bf16 weights", "m", "v"].iter().enumerate() {
            bits_equal(&format!("step {t}: offloaded {name}"), &got[i], &want[i]);
        }
        if t == 3 {
            for (i, name) in ["masters", "bf16 weights", "m", "v"].iter().enumerate() {
                bits_equal(&format!("skipped step: {name}"), &got[i], &before[i]);
            }
        } else {
            assert_ne!(got[2], before[2], "step {t} moved the moments");
        }
    }
    // New masters zero the moments, chunk by chunk on the host side.
    for grp in [&mut dev, &mut off] {
        grp.set_masters(&g, &s, &p).unwrap();
    }
    let (want, got) = (state(&dev), state(&off));
    assert!(got[2].iter().chain(&got[3]).all(|&x| x == 0.0), "zeroed moments");
    for (i, name) in ["masters", "bf16 weights", "m", "v"].iter().enumerate() {
        bits_equal(&format!("reset: offloaded {name}"), &got[i], &want[i]);
    }
    let (m, v) = (rand(n, 41, 1.0), rand(n, 42, 1.0));
    off.moments.upload(&g, &s, &m, &v).unwrap();
    let (m2, v2) = off.moments.download(&g, &s).unwrap();
    bits_equal("moments set from the host and read back", &m2, &m);
    bits_equal("moments set from the host and read back (v)", &v2, &v);
}
