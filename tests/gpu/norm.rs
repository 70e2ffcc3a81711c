//! RMSNorm (kernels/rmsnorm.cu): forward (y, rstd) and backward (dx accumulated in place, dw in
//! f32) against the CPU, on the scalar path (misaligned weight) and the 16-byte vector path.

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::Backend;
use dflash_engine::tensor::DType;

use super::{get, gpu, put, rand, rel_err, BF16_TOL};

#[allow(clippy::too_many_arguments)]
fn rms_case<B: Backend>(
    be: &B,
    rows: usize,
    dim: usize,
    w_off: usize,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    dx0: &[f32],
) -> [Vec<f32>; 4] {
    let s = be.compute_stream();
    let (xb, wb, dyb) = (put(be, x, DType::BF16), put(be, w, DType::BF16), put(be, dy, DType::BF16));
    let mut y = be.alloc(&s, DType::BF16, rows * dim).unwrap();
    let mut r = be.alloc(&s, DType::F32, rows).unwrap();
    be.rmsnorm_fwd(&s, &xb, &wb, w_off, &mut y, &mut r, rows, dim, 1e-6).unwrap();
    let mut dx = put(be, dx0, DType::BF16);
    let mut dw = put(be, &vec![0.25; dim + 1], DType::F32);
    be.rmsnorm_bwd(&s, &dyb, &xb, &wb, w_off, &r, &mut dx, true, &mut dw, w_off, rows, dim).unwrap();
    [get(be, &y), get(be, &r), get(be, &dx), get(be, &dw)]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_rmsnorm_matches_cpu() {
    let g = gpu();
    let c = CpuBackend::new();
    // w_off 1 misaligns the weight (scalar path); w_off 0 with dim % 8 == 0 takes the 16-byte
    // vector path at the model widths.
    let cases = [
        (1, 16, 1),
        (513, 16, 1),
        (37, 100, 1),
        (64, 4096, 1),
        (3, 5120, 1),
        (1, 16, 0),
        (300, 4096, 0),
        (77, 5120, 0),
        (129, 1032, 0),
        (37, 100, 0),
    ];
    for (rows, dim, w_off) in cases {
        let x = rand(rows * dim, 10, 2.0);
        let w: Vec<f32> = rand(dim + 1, 11, 0.2).iter().map(|v| 1.0 + v).collect();
        let dy = rand(rows * dim, 12, 1.0);
        let dx0 = rand(rows * dim, 13, 1.0);
        let a = rms_case(&g, rows, dim, w_off, &x, &w, &dy, &dx0);
        let b = rms_case(&c, rows, dim, w_off, &x, &w, &dy, &dx0);
        for (i, name) in ["y", "rstd", "dx (accumulated)", "dw"].iter().enumerate() {
            rel_err(
                &format!("rmsnorm {name} {rows}x{dim} w_off {w_off}"),
                &a[i],
                &b[i],
                if i == 1 || i == 3 { 1e-5 } else { BF16_TOL },
            );
        }
    }
}
