//! The GEMMs: cuBLASLt's (linear, dX accumulated in place, dW in f32, the residual forms) and the
//! FC projection's own kernels (kernels/fc.cu), against the CPU GEMM.

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::cuda::CudaBackend;
use dflash_engine::backend::{Backend, Gemm};
use dflash_engine::tensor::DType;

use super::{bits_equal, get, gpu, put, rand, rel_err, BF16_TOL};

fn gemm_case<B: Backend>(be: &B, g: &Gemm, a: &[f32], b: &[f32], c0: &[f32], out: DType) -> Vec<f32> {
    let s = be.compute_stream();
    let (a, b) = (put(be, a, DType::BF16), put(be, b, DType::BF16));
    let mut c = put(be, c0, out);
    be.gemm(&s, g, &a, 0, &b, 0, &mut c, 0).unwrap();
    get(be, &c)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gemm_matches_cpu() {
    let g = gpu();
    let c = CpuBackend::new();
    for (m, n, k) in [(1, 1, 1), (7, 33, 65), (128, 256, 64), (300, 96, 520), (16, 1024, 8192)] {
        let a = rand(m * k, 1, 1.0);
        let w = rand(n * k, 2, 1.0);
        let gl = Gemm::linear(m, n, k);
        rel_err(
            &format!("gemm linear {m}x{n}x{k}"),
            &gemm_case(&g, &gl, &a, &w, &vec![0.0; m * n], DType::BF16),
            &gemm_case(&c, &gl, &a, &w, &vec![0.0; m * n], DType::BF16),
            BF16_TOL,
        );
        let dy = rand(m * n, 3, 1.0);
        let gd = Gemm::linear_dx(m, n, k, true);
        let base = rand(m * k, 4, 1.0);
        rel_err(
            &format!("gemm dx (+=) {m}x{n}x{k}"),
            &gemm_case(&g, &gd, &dy, &w, &base, DType::BF16),
            &gemm_case(&c, &gd, &dy, &w, &base, DType::BF16),
            BF16_TOL,
        );
        let gw = Gemm::linear_dw(m, n, k);
        let acc = rand(n * k, 5, 1.0);
        // f32 output: only the accumulation order differs (f32 sums of bf16 products).
        rel_err(
            &format!("gemm dW (f32 +=) {m}x{n}x{k}"),
            &gemm_case(&g, &gw, &dy, &a, &acc, DType::F32),
            &gemm_case(&c, &gw, &dy, &a, &acc, DType::F32),
            1e-5,
        );
    }
}

/// The residual forms against the CPU (one bf16 rounding of the f32 sum there): `d = r + x W^T`
/// (`gemm_residual`, what the targets and the drafter run: r read in the GEMM's epilogue, left as
/// it was, and the same bits when run again) and `y += x W^T` in place (a GEMM with beta 1).
/// Whether the two forms agree bit for bit is printed, not required: on the H200 they did not at
/// 128x256x64 and 300x96x520, where the in-place sums were up to 7e-3 of the largest value from
/// the CPU's (a second bf16 rounding) and `gemm_residual`'s 5e-5 and 1.3e-3. 16x1024x8192 is a
/// decoding step's down projection (few rows, long k).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_residual_gemms_match_cpu() {
    fn run<B: Backend>(be: &B, m: usize, n: usize, k: usize, x: &[f32], w: &[f32], r: &[f32]) -> [Vec<f32>; 4] {
        let s = be.compute_stream();
        let (xb, wb, rb) = (put(be, x, DType::BF16), put(be, w, DType::BF16), put(be, r, DType::BF16));
        let mut d = be.alloc(&s, DType::BF16, m * n).unwrap();
        be.gemm_residual(&s, &Gemm::linear(m, n, k), &xb, &wb, 8, &rb, &mut d).unwrap();
        let mut again = be.alloc(&s, DType::BF16, m * n).unwrap();
        be.gemm_residual(&s, &Gemm::linear(m, n, k), &xb, &wb, 8, &rb, &mut again).unwrap();
        let mut y = put(be, r, DType::BF16);
        be.gemm(&s, &Gemm { beta: 1.0, ..Gemm::linear(m, n, k) }, &xb, 0, &wb, 8, &mut y, 0).unwrap();
        [get(be, &d), get(be, &y), get(be, &rb), get(be, &again)]
    }
    let (g, c) = (gpu(), CpuBackend::new());
    for (m, n, k) in [(1, 1, 1), (7, 33, 65), (128, 256, 64), (300, 96, 520), (16, 1024, 8192)] {
        let x = rand(m * k, 6, 1.0);
        let w = rand(n * k + 8, 7, 1.0);
        let r = rand(m * n, 8, 4.0);
        let [gd, gy, gr, ga] = run(&g, m, n, k, &x, &w, &r);
        let [cd, cy, _, _] = run(&c, m, n, k, &x, &w, &r);
        rel_err(&format!("gemm_residual {m}x{n}x{k}"), &gd, &cd, BF16_TOL);
        rel_err(&format!("gemm in place {m}x{n}x{k}"), &gy, &cy, BF16_TOL);
        bits_equal(&format!("gemm_residual run twice {m}x{n}x{k}"), &ga, &gd);
        let same = gd.iter().zip(&gy).all(|(a, b)| a.to_bits() == b.to_bits());
        println!("gemm_residual vs in place {m}x{n}x{k}: bit-identical {same}");
        let r_bf16: Vec<f32> = r.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        bits_equal(&format!("gemm_residual leaves r {m}x{n}x{k}"), &gr, &r_bf16);
    }
}

// FC projection: kernels/fc.cu, both symbols, against the CPU GEMM.

/// Elements appended after y[rows * h]: they start as NaN and must still be NaN afterwards (a
/// ragged row or column tile that stores past the output would overwrite them).
const FC_TAIL: usize = 256;

/// y = x W^T on the GPU with `path` (None: the automatic choice), W at `w_off` inside `wbuf`.
#[allow(clippy::too_many_arguments)]
fn fc_gpu(
    g: &CudaBackend,
    x: &[f32],
    wbuf: &[f32],
    w_off: usize,
    rows: usize,
    h: usize,
    k: usize,
    path: Option<dflash_engine::backend::cuda::FcPath>,
) -> Vec<f32> {
    let s = g.compute_stream();
    let (xb, wb) = (put(g, x, DType::BF16), put(g, wbuf, DType::BF16));
    // NaN everywhere first: an output element the kernel forgets to write fails the comparison.
    let mut y = put(g, &vec![f32::NAN; rows * h + FC_TAIL], DType::BF16);
    match path {
        Some(p) => g.fc_project_with(&s, &xb, &wb, w_off, &mut y, rows, h, k, p).unwrap(),
        None => g.fc_project(&s, &xb, &wb, w_off, &mut y, rows, h, k).unwrap(),
    }
    let mut out = get(g, &y);
    let tail = out.split_off(rows * h);
    assert!(tail.iter().all(|v| v.is_nan()), "fc {rows}x{h}x{k} ({path:?}) wrote past y[rows * h]");
    out
}

fn fc_cpu(x: &[f32], wbuf: &[f32], w_off: usize, rows: usize, h: usize, k: usize) -> Vec<f32> {
    let c = CpuBackend::new();
    let s = c.compute_stream();
    let (xb, wb) = (put(&c, x, DType::BF16), put(&c, wbuf, DType::BF16));
    let mut y = c.alloc(&s, DType::BF16, rows * h).unwrap();
    c.gemm(&s, &Gemm::linear(rows, h, k), &xb, 0, &wb, w_off, &mut y, 0).unwrap();
    get(&c, &y)
}

/// Both sides round the f32 sum of the same bf16 products once to bf16; only the order of the f32
/// additions differs, which moves a sum by far less than 1e-4 of the largest output at these k.
/// So every element must agree to one bf16 ulp of itself (2^-7 relative at most) plus that
/// 1e-4 floor, and max |diff| / max |ref| must stay under BF16_TOL. A wrong, missing (NaN) or
/// misplaced element fails the first check even when it is small.
fn fc_close(what: &str, got: &[f32], want: &[f32]) {
    elementwise_close(what, got, want, 1.0, 1e-4);
}

/// max |diff| / max |ref| under BF16_TOL, and every element within `ulps` bf16 ulps (2^-7
/// relative) of the larger of the two values plus `floor` times the largest reference output.
fn elementwise_close(what: &str, got: &[f32], want: &[f32], ulps: f32, floor: f32) {
    rel_err(what, got, want, BF16_TOL);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let ulp = 2f32.powi(-7);
    let bad: Vec<usize> = (0..want.len())
        .filter(|&i| {
            let diff = (got[i] - want[i]).abs(); // NaN when either side is NaN: counted as off
            diff.is_nan() || diff > ulps * ulp * got[i].abs().max(want[i].abs()) + floor * scale
        })
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} elements off by more than {ulps} bf16 ulps; first at {i}: {} vs {}",
            bad.len(),
            got[i],
            want[i]
        );
    }
}

/// The FC projection (kernels/fc.cu): the wgmma/TMA kernel and the simple fallback, each forced,
/// and the automatic choice, against the CPU GEMM. Shapes: ragged rows (1, 100, 3072), column and
/// K tails (h = 264, k = 136), the tiny preset (96 x 64 x 192), more tiles than SMs (persistent
/// CTAs), an aligned nonzero weight offset, a misaligned one and k % 8 != 0 (the fast kernel must
/// refuse; the automatic choice falls back), and 4096 x 4096 x 20480 against cuBLASLt in full and
/// the CPU on sampled rows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_fc_kernel_matches_cpu() {
    use dflash_engine::backend::cuda::FcPath;
    let g = gpu();
    // (rows, h, k, w_off, fast path possible)
    let cases: [(usize, usize, usize, usize, bool); 12] = [
        (1, 256, 64, 0, true),
        (100, 512, 320, 64, true),
        (3072, 256, 1024, 0, true),
        (96, 64, 192, 0, true),
        (800, 64, 320, 0, true),
        (300, 264, 136, 8, true),
        (130, 512, 4096, 0, true),
        (1100, 4096, 256, 0, true),
        (0, 64, 64, 0, true),
        (100, 256, 192, 3, false),
        (37, 72, 100, 0, false),
        (5, 30, 64, 0, false),
    ];
    for (rows, h, k, w_off, fast_ok) in cases {
        let x = rand((rows * k).max(1), 31, 1.0); // never an empty upload (rows = 0)
                                                  // W inside a larger buffer of unrelated values: reading at the wrong offset shows.
        let mut wbuf = rand(w_off + h * k + 64, 32, 1.0);
        wbuf[w_off..w_off + h * k].copy_from_slice(&rand(h * k, 33, 1.0));
        let want = fc_cpu(&x, &wbuf, w_off, rows, h, k);
        let tag = format!("fc {rows}x{h}x{k} w_off {w_off}");
        let simple = fc_gpu(&g, &x, &wbuf, w_off, rows, h, k, Some(FcPath::Simple));
        fc_close(&format!("{tag} simple"), &simple, &want);
        let auto = fc_gpu(&g, &x, &wbuf, w_off, rows, h, k, None);
        fc_close(&format!("{tag} auto"), &auto, &want);
        if fast_ok {
            let fast = fc_gpu(&g, &x, &wbuf, w_off, rows, h, k, Some(FcPath::Fast));
            fc_close(&format!("{tag} fast"), &fast, &want);
            // The automatic choice is the fast kernel here, and the kernel is deterministic.
            bits_equal(&format!("{tag} auto == fast"), &auto, &fast);
        } else {
            bits_equal(&format!("{tag} auto == simple"), &auto, &simple);
            let s = g.compute_stream();
            let (xb, wb) = (put(&g, &x, DType::BF16), put(&g, &wbuf, DType::BF16));
            let mut y = g.alloc(&s, DType::BF16, rows * h).unwrap();
            let forced = g.fc_project_with(&s, &xb, &wb, w_off, &mut y, rows, h, k, FcPath::Fast);
            assert!(forced.is_err(), "{tag}: the fast kernel accepted operands it cannot take");
        }
    }

    // The recipe-sized K: 320 k-blocks through the 4-stage ring, several tiles per CTA. Under
    // compute-sanitizer (DFLASH_SANITIZE=1) a smaller K keeps the instrumented run to seconds;
    // the shapes above already cover every tail.
    let k = if std::env::var_os("DFLASH_SANITIZE").is_some() { 1024 } else { 20480 };
    let (rows, h) = (4096, 4096);
    let x = rand(rows * k, 41, 1.0);
    let w = rand(h * k, 42, 1.0);
    let tag = format!("fc {rows}x{h}x{k}");
    let fast = fc_gpu(&g, &x, &w, 0, rows, h, k, Some(FcPath::Fast));
    // Every element against the simple kernel (f32 sums rounded once, as the fast one) ...
    let simple = fc_gpu(&g, &x, &w, 0, rows, h, k, Some(FcPath::Simple));
    fc_close(&format!("{tag} fast vs simple"), &fast, &simple);
    // ... and against cuBLASLt with the max-relative bound only: its algorithm may reduce split-K
    // partials in bf16, which is more than one rounding.
    // (Not under the sanitizers: racecheck reports hazards inside cuBLASLt's own kernel, which is
    // not ours to check; our kernels are.)
    if std::env::var_os("DFLASH_SANITIZE").is_none() {
        let lt = gemm_case(&g, &Gemm::linear(rows, h, k), &x, &w, &vec![0.0; rows * h], DType::BF16);
        rel_err(&format!("{tag} fast vs cuBLASLt"), &fast, &lt, BF16_TOL);
    }
    // The CPU on rows spread over every row tile position (first, last, tile edges).
    let picked: Vec<usize> = vec![0, 1, 63, 64, 127, 128, 1000, 2047, 2048, 3333, 4094, 4095];
    let xs: Vec<f32> = picked.iter().flat_map(|&r| x[r * k..(r + 1) * k].iter().copied()).collect();
    let want = fc_cpu(&xs, &w, 0, picked.len(), h, k);
    let got: Vec<f32> = picked.iter().flat_map(|&r| fast[r * h..(r + 1) * h].iter().copied()).collect();
    fc_close(&format!("{tag} fast vs cpu (12 rows)"), &got, &want);
}

// The gated MLP's gate | up projection with SwiGLU in one kernel (kernels/mlp.cu).

/// `act = swiglu(x [Wg; Wu]^T)` in `form` on the GPU, and with `keep` the gate | up projection it
/// kept (else empty). NaN-filled outputs with guard tails: an element the kernel forgets, or one
/// past the end, shows.
#[allow(clippy::too_many_arguments)]
fn mlp_gpu(
    g: &CudaBackend,
    x: &[f32],
    wbuf: &[f32],
    w_off: usize,
    [rows, inter, k]: [usize; 3],
    form: dflash_engine::backend::cuda::MlpForm,
    keep: bool,
) -> [Vec<f32>; 2] {
    let s = g.compute_stream();
    let (xb, wb) = (put(g, x, DType::BF16), put(g, wbuf, DType::BF16));
    let mut act = put(g, &vec![f32::NAN; rows * inter + FC_TAIL], DType::BF16);
    let mut gu = keep.then(|| put(g, &vec![f32::NAN; rows * 2 * inter + FC_TAIL], DType::BF16));
    g.mlp_gate_up_act_with(&s, &xb, &wb, w_off, &mut act, gu.as_mut(), rows, inter, k, form).unwrap();
    let unpad = |b: &_, n: usize, what: &str| {
        let mut out = get(g, b);
        let tail = out.split_off(n);
        assert!(tail.iter().all(|v| v.is_nan()), "mlp {rows}x{inter}x{k} ({form:?}) wrote past {what}");
        out
    };
    let act = unpad(&act, rows * inter, "act[rows * inter]");
    [act, gu.map_or_else(Vec::new, |gu| unpad(&gu, rows * 2 * inter, "gu[rows * 2 * inter]"))]
}

/// The CPU's GEMM then its swiglu_fwd (the reference the target's forward is tested against):
/// [act, gate | up].
fn mlp_cpu(x: &[f32], wbuf: &[f32], w_off: usize, rows: usize, inter: usize, k: usize) -> [Vec<f32>; 2] {
    let c = CpuBackend::new();
    let s = c.compute_stream();
    let (xb, wb) = (put(&c, x, DType::BF16), put(&c, wbuf, DType::BF16));
    let mut act = c.alloc(&s, DType::BF16, rows * inter).unwrap();
    let mut gu = c.alloc(&s, DType::BF16, rows * 2 * inter).unwrap();
    c.mlp_gate_up_act(&s, &xb, &wb, w_off, &mut act, Some(&mut gu), rows, inter, k).unwrap();
    [get(&c, &act), get(&c, &gu)]
}

/// swiglu_fwd on the GPU of a kept gate | up (what the fused kernel's act must equal bit for bit).
fn swiglu_gpu(g: &CudaBackend, gu: &[f32], rows: usize, inter: usize) -> Vec<f32> {
    let s = g.compute_stream();
    let mut act = g.alloc(&s, DType::BF16, rows * inter).unwrap();
    g.swiglu_fwd(&s, &put(g, gu, DType::BF16), &mut act, rows, inter).unwrap();
    get(g, &act)
}

/// g and u each within one bf16 ulp of the reference's (the GEMM's f32 summation order), and
/// silu(g) * u moves by up to ~|g| ulps of itself where the gate is negative (silu's relative
/// slope is 1 + g (1 - sigmoid(g))): every element within 16 ulps of itself plus 1e-3 of the
/// largest output, and max |diff| / max |ref| under BF16_TOL. A missing (NaN), misplaced or
/// wrong-half element (gate and up swapped, another column's up) fails the first check.
fn mlp_close(what: &str, got: &[f32], want: &[f32]) {
    elementwise_close(what, got, want, 16.0, 1e-3);
}

/// The fused kernel against the CPU's GEMM + SwiGLU and cuBLASLt's GEMM + swiglu_fwd. Shapes:
/// one row, ragged rows and K, an inter that ends inside a 128-column tile (the gate box runs on
/// into W's up rows there, the up box past W's end), more tiles than SMs (persistent CTAs), an
/// aligned nonzero weight offset inside a larger buffer, and operands the kernel must refuse
/// (a misaligned weight offset, inter % 8 != 0). With the projection kept (the drafter's
/// forward), act is the same bits as without, the kept gate | up is within the GEMM's rounding of
/// the CPU's, and swiglu_fwd of it gives act bit for bit; so does the two-step form's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_mlp_fused_kernel_matches_cpu() {
    use dflash_engine::backend::cuda::MlpForm;
    let g = gpu();
    // (rows, inter, k, w_off, the fused kernel can take it)
    let cases: [(usize, usize, usize, usize, bool); 9] = [
        (1, 8, 64, 0, true),
        (100, 128, 320, 64, true),
        (300, 200, 136, 8, true),
        (130, 384, 1024, 0, true),
        (2000, 2048, 128, 0, true),
        (257, 136, 72, 0, true),
        (0, 64, 64, 0, true),
        (100, 256, 192, 3, false),
        (37, 100, 64, 0, false),
    ];
    for (rows, inter, k, w_off, fused_ok) in cases {
        let x = rand((rows * k).max(1), 51, 1.0);
        let mut wbuf = rand(w_off + 2 * inter * k + 64, 52, 1.0);
        wbuf[w_off..w_off + 2 * inter * k].copy_from_slice(&rand(2 * inter * k, 53, 0.5));
        let tag = format!("mlp {rows}x{inter}x{k} w_off {w_off}");
        let shape = [rows, inter, k];
        if fused_ok {
            let [want, want_gu] = mlp_cpu(&x, &wbuf, w_off, rows, inter, k);
            let [two_step, _] = mlp_gpu(&g, &x, &wbuf, w_off, shape, MlpForm::Gemm, false);
            mlp_close(&format!("{tag} gemm + swiglu"), &two_step, &want);
            let [fused, _] = mlp_gpu(&g, &x, &wbuf, w_off, shape, MlpForm::Fused, false);
            mlp_close(&format!("{tag} fused vs cpu"), &fused, &want);
            mlp_close(&format!("{tag} fused vs cuBLASLt + swiglu"), &fused, &two_step);
            let [again, _] = mlp_gpu(&g, &x, &wbuf, w_off, shape, MlpForm::Fused, false);
            bits_equal(&format!("{tag} fused: rerun"), &again, &fused);
            let same = fused.iter().zip(&two_step).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
            eprintln!("{tag}: fused equals cuBLASLt + swiglu bit for bit in {same} of {} elements", fused.len());
            for form in [MlpForm::Fused, MlpForm::Gemm] {
                let [act, gu] = mlp_gpu(&g, &x, &wbuf, w_off, shape, form, true);
                let plain = if form == MlpForm::Fused { &fused } else { &two_step };
                bits_equal(&format!("{tag} {form:?} keeping gate | up: act"), &act, plain);
                // Each of g and u is one bf16 rounding of its f32 sum: within a bf16 ulp of the CPU's.
                elementwise_close(&format!("{tag} {form:?} kept gate | up vs cpu"), &gu, &want_gu, 1.0, 1e-3);
                bits_equal(
                    &format!("{tag} {form:?}: swiglu_fwd(kept gate | up)"),
                    &swiglu_gpu(&g, &gu, rows, inter),
                    &act,
                );
            }
        } else {
            let s = g.compute_stream();
            let (xb, wb) = (put(&g, &x, DType::BF16), put(&g, &wbuf, DType::BF16));
            let mut act = g.alloc(&s, DType::BF16, rows * inter).unwrap();
            let forced = g.mlp_gate_up_act_with(&s, &xb, &wb, w_off, &mut act, None, rows, inter, k, MlpForm::Fused);
            assert!(forced.is_err(), "{tag}: the fused kernel accepted operands it cannot take");
        }
    }
    // A recipe-like K through the 3-stage ring with several tiles per CTA, against cuBLASLt + swiglu
    // (the CPU on sampled rows). Smaller under compute-sanitizer (DFLASH_SANITIZE=1).
    let (rows, inter, k) =
        if std::env::var_os("DFLASH_SANITIZE").is_some() { (512, 512, 512) } else { (4096, 3072, 4096) };
    let x = rand(rows * k, 61, 1.0);
    let w = rand(2 * inter * k, 62, 0.05);
    let tag = format!("mlp {rows}x{inter}x{k}");
    let [fused, gu] = mlp_gpu(&g, &x, &w, 0, [rows, inter, k], MlpForm::Fused, true);
    let [two_step, two_step_gu] = mlp_gpu(&g, &x, &w, 0, [rows, inter, k], MlpForm::Gemm, true);
    mlp_close(&format!("{tag} fused vs cuBLASLt + swiglu"), &fused, &two_step);
    // Each of g and u one bf16 rounding of its f32 sum, in another order than cuBLASLt's.
    elementwise_close(&format!("{tag} fused kept gate | up vs cuBLASLt's"), &gu, &two_step_gu, 1.0, 1e-3);
    bits_equal(&format!("{tag} fused: swiglu_fwd(kept gate | up)"), &swiglu_gpu(&g, &gu, rows, inter), &fused);
    let picked: Vec<usize> = vec![0, 1, 127, 128, rows / 2, rows - 1];
    let xs: Vec<f32> = picked.iter().flat_map(|&r| x[r * k..(r + 1) * k].iter().copied()).collect();
    let [want, _] = mlp_cpu(&xs, &w, 0, picked.len(), inter, k);
    let got: Vec<f32> = picked.iter().flat_map(|&r| fused[r * inter..(r + 1) * inter].iter().copied()).collect();
    mlp_close(&format!("{tag} fused vs cpu (6 rows)"), &got, &want);
}

// The clock monitor (backend::clocks over NVML): what the run summary's `clocks` line reads.

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_clock_monitor_reads_the_device_under_gemm_load() {
    let g: CudaBackend = gpu();
    let s = g.compute_stream();
    let m = g.clock_monitor().expect("the CUDA backend offers a clock monitor").expect("NVML opens the device");
    // About half a second of 4096^3 GEMMs (~0.2 ms each on an H200), waited for in slices so the
    // sampler sees the device busy.
    let n = 4096;
    let (a, b) = (put(&g, &rand(n * n, 1, 1.0), DType::BF16), put(&g, &rand(n * n, 2, 1.0), DType::BF16));
    let mut c = g.alloc(&s, DType::BF16, n * n).unwrap();
    let t0 = std::time::Instant::now();
    while t0.elapsed().as_secs_f64() < 0.5 {
        for _ in 0..50 {
            g.gemm(&s, &Gemm::linear(n, n, n), &a, 0, &b, 0, &mut c, 0).unwrap();
        }
        g.synchronize(&s).unwrap();
    }
    let r = m.finish();
    eprintln!("{}", r.describe());
    // Sampled every 100 ms from the start (before the GEMMs: the operands are made on the host
    // first) to the end of half a second of GEMMs.
    assert!(r.samples >= 3 && r.busy >= 2, "{r:?}");
    let max = r.max_mhz.expect("NVML gives the H200's highest SM clock");
    assert!(max > 0 && r.sm_mhz_median > 0 && r.sm_mhz_median <= max, "{r:?}");
    assert!(r.limit_w.is_some_and(|w| w > 0.0) && r.power_w_mean > 0.0, "{r:?}");
}

/// The MFU column's peak (`train::flops::measure_gemm_peak`): measured on the device, a finite
/// rate above 1 TFLOP/s (any GPU with bf16 tensor cores), and not above what the same GEMMs take
/// timed from the host around a synchronisation (the device events can only be tighter). The
/// CPU backend has no device clock: no peak, and its MFU column says n/a.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gemm_peak_is_measured_on_the_device() {
    use dflash_engine::train::flops::measure_gemm_peak;
    let g = gpu();
    let n = 4096;
    let peak = measure_gemm_peak(&g, n).unwrap().expect("a CUDA backend has a device clock");
    assert!(peak.is_finite() && peak > 1e12, "peak {peak} FLOP/s");
    let s = g.compute_stream();
    let (a, b) = (put(&g, &rand(n * n, 1, 1.0), DType::BF16), put(&g, &rand(n * n, 2, 1.0), DType::BF16));
    let mut c = g.alloc(&s, DType::BF16, n * n).unwrap();
    let gm = Gemm::linear(n, n, n);
    g.gemm(&s, &gm, &a, 0, &b, 0, &mut c, 0).unwrap();
    g.synchronize(&s).unwrap();
    let t = std::time::Instant::now();
    for _ in 0..20 {
        g.gemm(&s, &gm, &a, 0, &b, 0, &mut c, 0).unwrap();
    }
    g.synchronize(&s).unwrap();
    let host = 20.0 * 2.0 * (n as f64).powi(3) / t.elapsed().as_secs_f64();
    println!("measured peak {:.0} TFLOP/s, host-timed {:.0} TFLOP/s", peak / 1e12, host / 1e12);
    assert!(peak >= 0.9 * host, "device-timed {peak} below host-timed {host}");
    assert_eq!(measure_gemm_peak(&CpuBackend::new(), 64).unwrap(), None);
}
