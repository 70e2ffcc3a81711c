//! The Qwen3.5/3.6 hybrid target's kernels (kernels/hybrid.cu, kernels/gdn.cu, the head_dim 256
//! causal attention of kernels/attention.cu) against the CPU reference, on ragged packed batches
//! (sequence lengths 1, 63, 64, 65, 200 around the 64-token delta-rule chunk), and the whole
//! qwen3.5-tiny target's taps on CUDA against the CPU.
//!
//! The CPU backend rounds every stored value to its buffer's dtype as the kernels do, so the
//! remaining differences are summation order and libm vs CUDA math (a bf16 ulp or two).

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::cuda::{CudaBackend, GdnForm};
use dflash_engine::backend::fused::GdnOutNorm;
use dflash_engine::backend::{Backend, GdnShape};
use dflash_engine::rng::Philox;
use dflash_engine::tensor::DType;

use super::{bits_equal, get, gpu, ids, positions, put, rand, rel_err, starts_of, BF16_TOL};

/// The ragged lengths every packed-batch test uses: one token, a chunk minus one, a chunk, a
/// chunk plus one, and several chunks with a partial last one.
const LENS: [usize; 5] = [1, 63, 64, 65, 200];

// ---------------------------------------------------------------------------------------------
// Row norms
// ---------------------------------------------------------------------------------------------

fn norms<B: Backend>(be: &B, rows: usize, dim: usize, w_off: usize, x: &[f32], z: &[f32], w: &[f32]) -> [Vec<f32>; 4] {
    let s = be.compute_stream();
    let (xb, zb, wb) = (put(be, x, DType::BF16), put(be, z, DType::BF16), put(be, w, DType::BF16));
    let mut y1 = be.alloc(&s, DType::BF16, rows * dim).unwrap();
    be.rmsnorm1p_fwd(&s, &xb, &wb, w_off, &mut y1, rows, dim, 1e-6).unwrap();
    let mut y2 = be.alloc(&s, DType::BF16, rows * dim).unwrap();
    be.gated_rmsnorm_fwd(&s, &xb, &zb, &wb, w_off, &mut y2, rows, dim, 1e-6).unwrap();
    let mut y3 = be.alloc(&s, DType::F32, rows * dim).unwrap();
    be.l2norm_fwd(&s, &xb, &mut y3, rows, dim, 1e-6, 1.0 / (dim as f32).sqrt()).unwrap();
    // The target's own layout: f32 in (the convolution's output), f32 out.
    let mut y4 = be.alloc(&s, DType::F32, rows * dim).unwrap();
    be.l2norm_fwd(&s, &put(be, x, DType::F32), &mut y4, rows, dim, 1e-6, 1.0 / (dim as f32).sqrt()).unwrap();
    [get(be, &y1), get(be, &y2), get(be, &y3), get(be, &y4)]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_hybrid_norms_match_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    // dim <= 128 with aligned rows takes gated_rmsnorm's two-rows-per-warp path (38 x 100: lanes
    // past the row idle). rmsnorm1p gives a row to a block at 5120 (128 threads of 5 16-byte
    // groups), 4096 (128 of 4) and 2560 (64 of 5) with x, y and w 16-byte aligned (w_off 8), a
    // warp otherwise (5120 with w_off 4: 8 bytes off).
    for (rows, dim, w_off) in [
        (1, 16, 0),
        (37, 100, 1),
        (38, 100, 0),
        (393, 128, 0),
        (1000, 64, 4),
        (64, 256, 3),
        (5, 5120, 0),
        (393, 5120, 0),
        (17, 4096, 8),
        (9, 2560, 0),
        (7, 5120, 4),
        (200, 33, 2),
    ] {
        let x = rand(rows * dim, 20, 2.0);
        let z = rand(rows * dim, 21, 2.0);
        let w = rand(dim + w_off, 22, 0.3);
        let a = norms(&g, rows, dim, w_off, &x, &z, &w);
        let b = norms(&c, rows, dim, w_off, &x, &z, &w);
        rel_err(&format!("rmsnorm1p {rows}x{dim} w_off {w_off}"), &a[0], &b[0], BF16_TOL);
        rel_err(&format!("gated_rmsnorm {rows}x{dim} w_off {w_off}"), &a[1], &b[1], BF16_TOL);
        // f32 out: only the summation order of the row's squares differs.
        rel_err(&format!("l2norm (f32 out) {rows}x{dim}"), &a[2], &b[2], 1e-5);
        rel_err(&format!("l2norm (f32 in and out) {rows}x{dim}"), &a[3], &b[3], 1e-5);
    }
}

// ---------------------------------------------------------------------------------------------
// Partial RoPE, strided copies, the sigmoid gate
// ---------------------------------------------------------------------------------------------

fn rope_partial<B: Backend>(be: &B, x: &[f32], pos: &[i32], heads: usize, hd: usize, rot: usize) -> Vec<f32> {
    let s = be.compute_stream();
    let mut xb = put(be, x, DType::BF16);
    be.rope_partial(&s, &mut xb, &ids(be, pos), pos.len(), heads, hd, rot, 1e7).unwrap();
    get(be, &xb)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_rope_partial_matches_cpu_and_leaves_the_other_dims() {
    let (g, c) = (gpu(), CpuBackend::new());
    let pos = positions(&LENS);
    for (heads, hd, rot) in [(24, 256, 64), (4, 16, 4), (3, 32, 32), (2, 64, 16)] {
        let x = rand(pos.len() * heads * hd, 30, 1.0);
        let a = rope_partial(&g, &x, &pos, heads, hd, rot);
        let b = rope_partial(&c, &x, &pos, heads, hd, rot);
        rel_err(&format!("rope_partial {heads} heads hd {hd} rot {rot}"), &a, &b, BF16_TOL);
        // The pass-through dims are the input's bf16 bits exactly; the rotated ones changed.
        let xr: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        let (mut same, mut moved) = (Vec::new(), 0usize);
        for (e, (&o, &i)) in a.iter().zip(&xr).enumerate() {
            if e % hd >= rot {
                same.push((o, i));
            } else if o != i {
                moved += 1;
            }
        }
        let (got, want): (Vec<f32>, Vec<f32>) = same.into_iter().unzip();
        bits_equal(&format!("rope_partial pass-through hd {hd} rot {rot}"), &got, &want);
        assert!(moved > pos.len() * heads * rot / 4, "rope_partial rotated only {moved} elements");
    }
}

fn copy_strided<B: Backend>(be: &B, src: &[f32], dst0: &[f32], dt: DType, geo: [usize; 6]) -> Vec<f32> {
    let [src_off, src_stride, dst_off, dst_stride, rows, width] = geo;
    let s = be.compute_stream();
    let mut d = put(be, dst0, dt);
    be.copy_strided(&s, &put(be, src, dt), src_off, src_stride, &mut d, dst_off, dst_stride, rows, width).unwrap();
    get(be, &d)
}

fn sigmoid_mul<B: Backend>(be: &B, x: &[f32], gate: &[f32]) -> Vec<f32> {
    let mut xb = put(be, x, DType::BF16);
    be.sigmoid_mul(&be.compute_stream(), &mut xb, &put(be, gate, DType::BF16)).unwrap();
    get(be, &xb)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_copy_strided_and_sigmoid_mul_match_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    // q | gate interleaved per head (the gated attention's split), and a q | k | v column slice.
    for dt in [DType::BF16, DType::F32] {
        for (rows, src_off, src_stride, dst_off, dst_stride, width) in [
            (393 * 4, 0, 32, 0, 16, 16),
            (393 * 4, 16, 32, 0, 16, 16),
            (200, 70, 300, 5, 130, 130),
            (1, 3, 9, 1, 4, 4),
            // 16-byte units, one and several per thread (the target's q | k | v splits).
            (300, 0, 2560, 8, 2048, 2048),
            (40, 8192, 10240, 0, 6144, 6144),
        ] {
            let src = rand(src_off + rows * src_stride, 40, 1.0);
            let dst0 = rand(dst_off + rows * dst_stride, 41, 1.0);
            let ga = copy_strided(&g, &src, &dst0, dt, [src_off, src_stride, dst_off, dst_stride, rows, width]);
            let ca = copy_strided(&c, &src, &dst0, dt, [src_off, src_stride, dst_off, dst_stride, rows, width]);
            // A copy is exact: every element, the ones between the rows included (untouched).
            bits_equal(&format!("copy_strided {} {rows} rows of {width}", dt.name()), &ga, &ca);
        }
    }
    let n = 393 * 24 * 256 + 7;
    let (x, gate) = (rand(n, 42, 1.0), rand(n, 43, 3.0));
    let (a, b) = (sigmoid_mul(&g, &x, &gate), sigmoid_mul(&c, &x, &gate));
    rel_err("sigmoid_mul", &a, &b, BF16_TOL);
}

// ---------------------------------------------------------------------------------------------
// The convolution and the gates
// ---------------------------------------------------------------------------------------------

#[allow(clippy::too_many_arguments)]
fn conv<B: Backend>(
    be: &B,
    dt: DType,
    x: &[f32],
    w: &[f32],
    w_off: usize,
    starts: &[i32],
    rows: usize,
    ch: usize,
) -> Vec<f32> {
    let s = be.compute_stream();
    let mut y = be.alloc(&s, dt, rows * ch).unwrap();
    be.causal_conv1d_silu(&s, &put(be, x, dt), &put(be, w, DType::BF16), w_off, &mut y, &ids(be, starts), rows, ch, 4)
        .unwrap();
    get(be, &y)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_causal_conv1d_silu_matches_cpu_on_ragged_batches() {
    let (g, c) = (gpu(), CpuBackend::new());
    let rows: usize = LENS.iter().sum();
    for ch in [70usize, 256] {
        let x = rand(rows * ch, 50, 1.0);
        let w = rand(1 + ch * 4, 51, 0.5);
        // The packed batch; the same rows as one sequence (a kernel that ignores seq_starts passes
        // only one of the two); and starts listing the first three sequences only (the rest of the
        // rows form one more sequence, as the CPU reference reads it).
        let packed = starts_of(&LENS);
        for (what, starts) in
            [("packed", packed.clone()), ("one sequence", vec![0, rows as i32]), ("tail", packed[..4].to_vec())]
        {
            // bf16 in and out, and the target's layout: f32 in and out.
            for (dt, tol) in [(DType::BF16, BF16_TOL), (DType::F32, 1e-5)] {
                let a = conv(&g, dt, &x, &w, 1, &starts, rows, ch);
                let b = conv(&c, dt, &x, &w, 1, &starts, rows, ch);
                rel_err(&format!("causal_conv1d_silu {} {what} {rows}x{ch}", dt.name()), &a, &b, tol);
            }
        }
        // The restart matters: the first row of the 63-token sequence sees only itself.
        let one = conv(&c, DType::BF16, &x, &w, 1, &[0, rows as i32], rows, ch);
        let packed_gpu = conv(&g, DType::BF16, &x, &w, 1, &packed, rows, ch);
        assert!(rel_err_quiet(&packed_gpu[ch..2 * ch], &one[ch..2 * ch]) > 1e-2, "no restart at a sequence start");
    }
}

fn rel_err_quiet(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn gates<B: Backend>(be: &B, b: &[f32], a: &[f32], w: &[f32], rows: usize, heads: usize) -> [Vec<f32>; 2] {
    let s = be.compute_stream();
    let mut beta = be.alloc(&s, DType::BF16, rows * heads).unwrap();
    let mut gg = be.alloc(&s, DType::F32, rows * heads).unwrap();
    let wb = put(be, w, DType::BF16);
    be.gdn_gates(
        &s,
        &put(be, b, DType::BF16),
        &put(be, a, DType::BF16),
        &wb,
        3,
        3 + heads,
        &mut beta,
        &mut gg,
        rows,
        heads,
    )
    .unwrap();
    [get(be, &beta), get(be, &gg)]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdn_gates_match_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    let (rows, heads) = (393, 48);
    // a spans the softplus threshold (20) both ways.
    let b = rand(rows * heads, 60, 3.0);
    let a = rand(rows * heads, 61, 12.0);
    let w = rand(3 + 2 * heads, 62, 1.0);
    let x = gates(&g, &b, &a, &w, rows, heads);
    let y = gates(&c, &b, &a, &w, rows, heads);
    rel_err("gdn_gates beta", &x[0], &y[0], BF16_TOL);
    rel_err("gdn_gates g (f32)", &x[1], &y[1], 1e-5);
}

// ---------------------------------------------------------------------------------------------
// The gated delta rule
// ---------------------------------------------------------------------------------------------

/// Inputs as the model feeds them: q, k L2-normalised per head (q scaled by dk^-0.5), f32; v
/// bf16; log decays g < 0 (f32); beta in (0, 1) (bf16).
struct GdnInputs {
    sh: GdnShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

fn gdn_inputs(rows: usize, k_heads: usize, v_heads: usize, dk: usize, dv: usize, seed: u64) -> GdnInputs {
    let unit = |x: Vec<f32>, scale: f32| -> Vec<f32> {
        x.chunks(dk)
            .flat_map(|r| {
                let n = r.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-6);
                r.iter().map(move |v| v / n * scale).collect::<Vec<_>>()
            })
            .collect()
    };
    let mut p = Philox::new(seed, [7, 7]);
    let mut uni = || p.uniform();
    let n = rows * v_heads;
    GdnInputs {
        sh: GdnShape { rows, k_heads, v_heads, k_dim: dk, v_dim: dv },
        q: unit(rand(rows * k_heads * dk, seed + 1, 1.0), 1.0 / (dk as f32).sqrt()),
        k: unit(rand(rows * k_heads * dk, seed + 2, 1.0), 1.0),
        v: rand(rows * v_heads * dv, seed + 3, 1.0),
        // Decays from exp(-0.005) (long memory) to exp(-0.7).
        g: (0..n).map(|_| -(0.005 + 0.7 * uni() * uni())).collect(),
        beta: (0..n).map(|_| 0.05 + 0.9 * uni()).collect(),
    }
}

/// Outputs and (when `state0` is given) the final states, of the chunked or recurrent form.
fn gdn_run<B: Backend>(
    be: &B,
    x: &GdnInputs,
    starts: &[i32],
    chunked: bool,
    state0: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let s = be.compute_stream();
    let sh = &x.sh;
    let (q, k, v) = (put(be, &x.q, DType::F32), put(be, &x.k, DType::F32), put(be, &x.v, DType::F32));
    let (g, beta) = (put(be, &x.g, DType::F32), put(be, &x.beta, DType::BF16));
    let mut o = be.alloc(&s, DType::BF16, sh.rows * sh.v_heads * sh.v_dim).unwrap();
    let mut st = state0.map(|v| put(be, v, DType::F32));
    let st_ids = ids(be, starts);
    if chunked {
        be.gdn_chunked_fwd(&s, sh, &q, &k, &v, &g, &beta, &st_ids, &mut o, st.as_mut()).unwrap();
    } else {
        be.gdn_recurrent_fwd(&s, sh, &q, &k, &v, &g, &beta, &st_ids, &mut o, st.as_mut()).unwrap();
    }
    (get(be, &o), st.map(|b| get(be, &b)).unwrap_or_default())
}

/// One of kernels/gdn.cu's kernels by name (the trait picks the tensor-core one for the chunked
/// form where the head dims allow it; the tests run every kernel).
fn gdn_run_form(
    be: &CudaBackend,
    x: &GdnInputs,
    starts: &[i32],
    form: GdnForm,
    state0: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let s = be.compute_stream();
    let (q, k, v) = (put(be, &x.q, DType::F32), put(be, &x.k, DType::F32), put(be, &x.v, DType::F32));
    let (g, beta) = (put(be, &x.g, DType::F32), put(be, &x.beta, DType::BF16));
    let mut o = be.alloc(&s, DType::BF16, x.sh.rows * x.sh.v_heads * x.sh.v_dim).unwrap();
    let mut st = state0.map(|v| put(be, v, DType::F32));
    be.gdn_launch(form, &s, &x.sh, [&q, &k, &v, &g, &beta], &ids(be, starts), &mut o, st.as_mut()).unwrap();
    (get(be, &o), st.map(|b| get(be, &b)).unwrap_or_default())
}

/// Every delta-rule kernel, the fast split form first (the trait's default).
const GDN_FORMS: [GdnForm; 5] =
    [GdnForm::ChunkedFast, GdnForm::ChunkedSplit, GdnForm::ChunkedTc, GdnForm::ChunkedSimt, GdnForm::Recurrent];

/// `forms` (those that take these head dims) against the CPU (the chunked ones against the CPU's
/// chunked form, the recurrent one against its recurrent form), from a zero state and from a
/// given one (the state out compared too), the chunked kernels against the recurrent one on the
/// GPU, and a rerun bit-identical (outputs and state).
fn gdn_check_forms(what: &str, x: &GdnInputs, starts: &[i32], forms: &[GdnForm]) {
    let (g, c) = (gpu(), CpuBackend::new());
    let seqs = starts.len() - 1;
    let st0 = rand(seqs * x.sh.v_heads * x.sh.k_dim * x.sh.v_dim, 70, 0.1);
    let (rec, _) = gdn_run_form(&g, x, starts, GdnForm::Recurrent, None);
    for &form in forms {
        if !form.takes(x.sh.k_dim, x.sh.v_dim) {
            continue;
        }
        let chunked = form != GdnForm::Recurrent;
        // f32 states after hundreds of updates summed in another order: 1e-3 of the largest entry;
        // the tensor-core kernels round their product operands to TF32 (10 mantissa bits) or
        // bf16 (8 bits; the fast form, whose running state and accumulators stay f32): 1e-2.
        let st_tol =
            if matches!(form, GdnForm::ChunkedTc | GdnForm::ChunkedSplit | GdnForm::ChunkedFast) { 1e-2 } else { 1e-3 };
        let (a, _) = gdn_run_form(&g, x, starts, form, None);
        let (b, _) = gdn_run(&c, x, starts, chunked, None);
        rel_err(&format!("gdn {form:?} {what}"), &a, &b, BF16_TOL);
        if chunked {
            rel_err(&format!("gdn {form:?} vs recurrent on cuda {what}"), &a, &rec, BF16_TOL);
        }
        let (a, sa) = gdn_run_form(&g, x, starts, form, Some(&st0));
        let (b, sb) = gdn_run(&c, x, starts, chunked, Some(&st0));
        rel_err(&format!("gdn {form:?} {what}, state in"), &a, &b, BF16_TOL);
        rel_err(&format!("gdn {form:?} {what}, state out"), &sa, &sb, st_tol);
        let (a2, sa2) = gdn_run_form(&g, x, starts, form, Some(&st0));
        bits_equal(&format!("gdn {form:?} {what}: rerun"), &a2, &a);
        bits_equal(&format!("gdn {form:?} {what}: rerun, state out"), &sa2, &sa);
    }
    // The trait's chunked op runs one of them.
    let (a, _) = gdn_run(&g, x, starts, true, None);
    rel_err(&format!("gdn_chunked_fwd (trait) {what}"), &a, &rec, BF16_TOL);
}

/// The ragged-batch cases for `forms`: GQA (3 value heads per key head) at small dims (the tiny
/// preset's) and at the 27B head dims, dims that end in partial column blocks, dims that do not
/// tile by 16, and each length alone. One test per form, so that each can run in a sanitizer
/// process of its own (racecheck over all five forms in one process runs past a device call's
/// window). `DFLASH_GDN_CASES=i/N` runs only cases i, i + N, ... (run.sh racehybrid splits the
/// slowest forms' tests over N processes that way); unset, every case runs.
fn gdn_ragged_cases(forms: &[GdnForm]) {
    let rows: usize = LENS.iter().sum();
    let packed = starts_of(&LENS);
    // (what, key heads, value heads, dk, dv, seed), on the packed batch.
    let shapes = [
        ("2/6 heads 16x16 packed", 2, 6, 16, 16, 1),
        ("1/3 heads 128x128 packed", 1, 3, 128, 128, 2),
        ("2/4 heads 32x64 packed", 2, 4, 32, 64, 3),
        // Value dims that end in a partial column block of the split form (state pass 32 + 32 +
        // 16, output 64 + 16) and a key dim below the output block.
        ("1/2 heads 48x80 packed", 1, 2, 48, 80, 5),
        ("1/1 heads 16x48 packed", 1, 1, 16, 48, 6),
        // A value dim past one output block of the fast form (128 + 32: the second block's upper
        // half of warps has no columns but still takes its share of Q K^T) and five state blocks.
        ("1/2 heads 32x160 packed", 1, 2, 32, 160, 7),
        // Head dims that do not tile by 16: the CUDA-core kernel and the recurrent one.
        ("1/2 heads 24x40 packed", 1, 2, 24, 40, 4),
    ];
    let mut cases: Vec<(String, GdnInputs, Vec<i32>)> = shapes
        .iter()
        .map(|&(what, hk, hv, dk, dv, seed)| (what.to_string(), gdn_inputs(rows, hk, hv, dk, dv, seed), packed.clone()))
        .collect();
    // Each length alone.
    for (i, &l) in LENS.iter().enumerate() {
        cases.push((
            format!("1/3 heads 64x64 alone, {l} tokens"),
            gdn_inputs(l, 1, 3, 64, 64, 10 + i as u64),
            vec![0, l as i32],
        ));
    }
    let (shard, shards) = match std::env::var("DFLASH_GDN_CASES") {
        Err(_) => (0, 1),
        Ok(v) => {
            let parsed =
                v.split_once('/').and_then(|(i, n)| Some((i.parse::<usize>().ok()?, n.parse::<usize>().ok()?)));
            match parsed {
                Some((i, n)) if i < n => (i, n),
                _ => panic!("DFLASH_GDN_CASES={v:?}: expected i/N with i < N (e.g. 0/4), or unset for every case"),
            }
        }
    };
    let mut ran = 0;
    for (what, x, starts) in cases.iter().skip(shard).step_by(shards) {
        gdn_check_forms(what, x, starts, forms);
        ran += 1;
    }
    assert!(ran > 0, "DFLASH_GDN_CASES={shard}/{shards} selects none of the {} cases", cases.len());
    if shards > 1 {
        eprintln!("gdn ragged cases: {ran} of {} ran (shard {shard}/{shards})", cases.len());
    }
}

/// One GPU test per delta-rule form over `gdn_ragged_cases`.
macro_rules! gdn_ragged_test {
    ($($name:ident: $form:ident),* $(,)?) => {$(
        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn $name() {
            gdn_ragged_cases(&[GdnForm::$form]);
        }
    )*};
}

gdn_ragged_test! {
    gpu_gdn_chunked_fast_matches_cpu_on_ragged_batches: ChunkedFast,
    gpu_gdn_chunked_split_matches_cpu_on_ragged_batches: ChunkedSplit,
    gpu_gdn_chunked_tc_matches_cpu_on_ragged_batches: ChunkedTc,
    gpu_gdn_chunked_simt_matches_cpu_on_ragged_batches: ChunkedSimt,
    gpu_gdn_recurrent_matches_cpu_on_ragged_batches: Recurrent,
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdn_state_restarts_at_every_sequence_start() {
    // The packed batch's outputs equal each sequence run alone (on the GPU, both forms): a kernel
    // that carried the state across a sequence start fails here.
    let g = gpu();
    let rows: usize = LENS.iter().sum();
    let x = gdn_inputs(rows, 2, 6, 32, 32, 80);
    let (hv, dv) = (6, 32);
    for form in GDN_FORMS {
        let (packed, _) = gdn_run_form(&g, &x, &starts_of(&LENS), form, None);
        let (joined, _) = gdn_run_form(&g, &x, &[0, rows as i32], form, None);
        let mut r0 = 0;
        for &l in &LENS {
            let sub = |v: &[f32], w: usize| v[r0 * w..(r0 + l) * w].to_vec();
            let kw = 2 * 32;
            let alone = GdnInputs {
                sh: GdnShape { rows: l, ..x.sh },
                q: sub(&x.q, kw),
                k: sub(&x.k, kw),
                v: sub(&x.v, hv * dv),
                g: sub(&x.g, hv),
                beta: sub(&x.beta, hv),
            };
            let (a, _) = gdn_run_form(&g, &alone, &[0, l as i32], form, None);
            bits_equal(
                &format!("gdn {form:?}: sequence of {l} packed vs alone"),
                &packed[r0 * hv * dv..(r0 + l) * hv * dv],
                &a,
            );
            r0 += l;
        }
        // And the restart changes something: one long sequence differs after the first start.
        assert!(rel_err_quiet(&joined[hv * dv..], &packed[hv * dv..]) > 1e-2, "the packed batch never restarted");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdn_fast_constant_shape_state_pass_matches_cpu() {
    // The fast form's state pass at dk = 128 with whole value blocks runs its constant-shape
    // kernel (gdn_fast_state_nk8): the ragged packed batch at dv = 128 and at dv = 256 (eight
    // value blocks a head), only the fast form, so that compute-sanitizer's racecheck can cover
    // that kernel in seconds (the 27B head-shape test below takes minutes under it).
    let rows: usize = LENS.iter().sum();
    let fast = [GdnForm::ChunkedFast];
    gdn_check_forms("1/3 heads 128x128 packed", &gdn_inputs(rows, 1, 3, 128, 128, 40), &starts_of(&LENS), &fast);
    gdn_check_forms("1/2 heads 128x256 packed", &gdn_inputs(rows, 1, 2, 128, 256, 41), &starts_of(&LENS), &fast);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdn_fast_output_takes_each_key_heads_value_heads_in_turn() {
    // The fast form's prep and output passes run one CTA per (chunk, key head) over that key
    // head's value heads: groups of 1, 2 and 4 value heads (the 27B shape's 3 is in the tests above), at the
    // constant-shape body (128 x 128) and the run-time one (64 x 64, 32 x 160: two value blocks),
    // on the ragged packed batch, only the fast form (about a minute under racecheck).
    let rows: usize = LENS.iter().sum();
    let fast = [GdnForm::ChunkedFast];
    for (i, (kh, vh, dk, dv)) in
        [(2, 2, 128, 128), (2, 4, 128, 128), (1, 4, 128, 128), (2, 4, 64, 64), (1, 4, 32, 160)].into_iter().enumerate()
    {
        let what = format!("{kh}/{vh} heads {dk}x{dv} packed");
        gdn_check_forms(&what, &gdn_inputs(rows, kh, vh, dk, dv, 90 + i as u64), &starts_of(&LENS), &fast);
    }
}

/// The delta rule and its gated output norm: through `gdn_chunked_norm_fwd` (`fused`) or as
/// `gdn_chunked_fwd` then `gated_rmsnorm_fwd`. Returns y and what `core` holds afterwards (filled
/// with 7.0 before the call).
fn gdn_norm_run<B: Backend>(
    be: &B,
    x: &GdnInputs,
    starts: &[i32],
    z: &[f32],
    nw: &[f32],
    fused: bool,
) -> [Vec<f32>; 2] {
    let s = be.compute_stream();
    let sh = &x.sh;
    let n = sh.rows * sh.v_heads * sh.v_dim;
    let (q, k, v) = (put(be, &x.q, DType::F32), put(be, &x.k, DType::F32), put(be, &x.v, DType::F32));
    let (g, beta) = (put(be, &x.g, DType::F32), put(be, &x.beta, DType::BF16));
    let zb = put(be, z, DType::BF16);
    // The norm weight at an offset, as in the target's parameter buffer.
    let w_off = 8;
    let wb = put(be, &[vec![0.5; w_off], nw.to_vec()].concat(), DType::BF16);
    let mut core = be.alloc(&s, DType::BF16, n).unwrap();
    be.fill(&s, &mut core, 7.0).unwrap();
    let mut y = be.alloc(&s, DType::BF16, n).unwrap();
    let st_ids = ids(be, starts);
    if fused {
        let norm = GdnOutNorm { w_off, eps: 1e-6 };
        let qkvgb = [&q, &k, &v, &g, &beta];
        be.gdn_chunked_norm_fwd(&s, sh, qkvgb, &st_ids, None, &zb, &wb, &norm, &mut core, &mut y).unwrap();
    } else {
        be.gdn_chunked_fwd(&s, sh, &q, &k, &v, &g, &beta, &st_ids, &mut core, None).unwrap();
        be.gated_rmsnorm_fwd(&s, &core, &zb, &wb, w_off, &mut y, sh.rows * sh.v_heads, sh.v_dim, 1e-6).unwrap();
    }
    [get(be, &y), get(be, &core)]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdn_fused_output_norm_equals_the_two_ops() {
    // At dk = dv = 128 the fast form's output pass applies the gated RMSNorm itself (the core
    // output is never stored: `core` keeps its fill); its result must equal the delta rule then
    // gated_rmsnorm_fwd bit for bit, and the CPU within bf16 rounding. At 32 x 64 the two ops run
    // (core written).
    let (g, c) = (gpu(), CpuBackend::new());
    let cases = [
        ("1/3 heads 128x128", LENS.to_vec(), 1, 3, 128, 128, true),
        ("16/48 heads 128x128, 129/3/64", vec![129, 3, 64], 16, 48, 128, 128, true),
        ("2/8 heads 128x128", LENS.to_vec(), 2, 8, 128, 128, true),
        ("2/4 heads 32x64", LENS.to_vec(), 2, 4, 32, 64, false),
    ];
    for (seed, (what, lens, kh, vh, dk, dv, fuses)) in cases.into_iter().enumerate() {
        let seed = 60 + 10 * seed as u64;
        let rows: usize = lens.iter().sum();
        let x = gdn_inputs(rows, kh, vh, dk, dv, seed);
        let starts = starts_of(&lens);
        let z = rand(rows * vh * dv, seed + 5, 2.0);
        let nw: Vec<f32> = rand(dv, seed + 6, 0.3).iter().map(|w| 1.0 + w).collect();
        let [fused, core] = gdn_norm_run(&g, &x, &starts, &z, &nw, true);
        let [two, core2] = gdn_norm_run(&g, &x, &starts, &z, &nw, false);
        bits_equal(&format!("{what}: gdn_chunked_norm_fwd vs the two ops"), &fused, &two);
        assert_eq!(core.iter().all(|&c| c == 7.0), fuses, "{what}: core left unwritten iff the norm was fused");
        assert!(core2.iter().any(|&c| c != 7.0), "{what}: the unfused delta rule wrote core");
        let [cpu, _] = gdn_norm_run(&c, &x, &starts, &z, &nw, true);
        rel_err(&format!("{what}: gdn_chunked_norm_fwd cuda vs cpu"), &fused, &cpu, BF16_TOL);
        assert!(
            fused.iter().all(|v| v.is_finite()) && fused.iter().any(|&v| v != 0.0),
            "{what}: y is finite, not all zero"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gdn_split_matches_cpu_at_the_27b_head_shape() {
    // Qwen3.6-27B's Gated DeltaNet heads (48 value heads over 16 key heads, dk = dv = 128) on the
    // ragged packed batch, from a zero state and from a given one: the fast split form (the
    // default), the f32 split form and the one-CTA-per-sequence tensor-core kernel, each against
    // the CPU.
    let rows: usize = LENS.iter().sum();
    let x = gdn_inputs(rows, 16, 48, 128, 128, 27);
    let forms = [GdnForm::ChunkedFast, GdnForm::ChunkedSplit, GdnForm::ChunkedTc];
    gdn_check_forms("16/48 heads 128x128 packed", &x, &starts_of(&LENS), &forms);
    // And a batch whose sequences start mid-chunk of the packed rows and end in a one-token chunk.
    let lens = [129usize, 3, 64];
    let rows: usize = lens.iter().sum();
    let x = gdn_inputs(rows, 16, 48, 128, 128, 28);
    let forms = [GdnForm::ChunkedFast, GdnForm::ChunkedSplit];
    gdn_check_forms("16/48 heads 128x128, 129/3/64", &x, &starts_of(&lens), &forms);
}

// ---------------------------------------------------------------------------------------------
// Causal attention at head_dim 256
// ---------------------------------------------------------------------------------------------

#[allow(clippy::too_many_arguments)]
fn causal<B: Backend>(
    be: &B,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    starts: &[i32],
    rows: usize,
    h: usize,
    kvh: usize,
    hd: usize,
) -> Vec<f32> {
    let s = be.compute_stream();
    let mut o = be.alloc(&s, DType::BF16, rows * h * hd).unwrap();
    let (qb, kb, vb) = (put(be, q, DType::BF16), put(be, k, DType::BF16), put(be, v, DType::BF16));
    be.attn_causal_fwd(&s, &qb, &kb, &vb, &mut o, &ids(be, starts), rows, h, kvh, hd).unwrap();
    get(be, &o)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attn_causal_hd256_matches_cpu_on_ragged_batches() {
    let (g, c) = (gpu(), CpuBackend::new());
    for (h, kvh, lens) in [(6usize, 2usize, LENS.to_vec()), (24, 4, vec![70, 1, 64]), (2, 2, vec![129])] {
        let rows_here: usize = lens.iter().sum();
        let (q, k, v) = (
            rand(rows_here * h * 256, 90, 1.0),
            rand(rows_here * kvh * 256, 91, 1.0),
            rand(rows_here * kvh * 256, 92, 1.0),
        );
        let starts = starts_of(&lens);
        let a = causal(&g, &q, &k, &v, &starts, rows_here, h, kvh, 256);
        let b = causal(&c, &q, &k, &v, &starts, rows_here, h, kvh, 256);
        rel_err(&format!("attn_causal hd 256 {h}/{kvh} heads lens {lens:?}"), &a, &b, BF16_TOL);
    }
}

// ---------------------------------------------------------------------------------------------
// The whole qwen3.5-tiny target
// ---------------------------------------------------------------------------------------------

/// Every matrix at the same std, the embedding and lm_head too: the init these bounds were
/// measured with (the preset draws its embedding and lm_head larger, `weights::HYBRID_EMBED_GAIN`,
/// and a residual stream dominated by the embedding would hide the layers' rounding).
fn uniform(role: dflash_engine::weights::TensorRole) -> dflash_engine::weights::TensorRole {
    use dflash_engine::weights::TensorRole;
    match role {
        TensorRole::Scaled { .. } => TensorRole::Linear,
        r => r,
    }
}

fn tiny_taps<B: Backend>(be: &B, tokens: &[i32], lens: &[usize]) -> Vec<Vec<f32>> {
    use dflash_engine::config::TargetConfig;
    use dflash_engine::model::target::{Target, TargetInputs, TargetShape};
    use dflash_engine::weights::{init_value_bf16, target_tensor_specs};
    let cfg = TargetConfig::preset("qwen3.5-tiny").unwrap();
    let specs = target_tensor_specs(&cfg);
    let taps: Vec<usize> = (0..cfg.num_hidden_layers).collect();
    let t = Target::load(be, TargetShape::from(&cfg), taps.clone(), false, |name, dims| {
        let (i, spec) = specs.iter().enumerate().find(|(_, s)| s.name == name).expect("a preset tensor");
        assert_eq!(spec.shape, dims, "{name}");
        let n: usize = dims.iter().product();
        Ok::<_, dflash_engine::backend::BackendError>(
            (0..n as u64).map(|e| init_value_bf16(uniform(spec.role), 3, i as u32, e, 0.05).to_f32()).collect(),
        )
    })
    .unwrap();
    let s = be.compute_stream();
    let rows = tokens.len();
    let h = cfg.hidden_size;
    let mut outs: Vec<_> = taps.iter().map(|_| be.alloc(&s, DType::BF16, rows * h).unwrap()).collect();
    let inp = TargetInputs {
        ids: &ids(be, tokens),
        pos: &ids(be, &positions(lens)),
        seq_starts: &ids(be, &starts_of(lens)),
        rows,
    };
    t.forward_taps(be, &s, &inp, &mut outs).unwrap();
    outs.iter().map(|o| get(be, o)).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_qwen35_tiny_taps_match_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    let rows: usize = LENS.iter().sum();
    let mut r = Philox::new(5, [3, 3]);
    let tokens: Vec<i32> = (0..rows).map(|_| r.below(250) as i32).collect();
    let a = tiny_taps(&g, &tokens, &LENS);
    let b = tiny_taps(&c, &tokens, &LENS);
    // The same math without rounding (f64 throughout): the yardstick for both backends.
    let exact = tiny_taps(&CpuBackend::exact(), &tokens, &LENS);
    // The first layer's tap directly; past it the two backends' bf16 streams drift apart by more
    // than one rounding step (measured on the H200: 3e-2 at layer 2, 7e-2 at layer 4, and 1.5e-1 in
    // what layer 5 adds), each as close to the exact result as the other. So every tap is held to
    // the CPU reference's own rounding error: CUDA may be at most 2x as far from the exact taps as
    // the CPU backend is (a wrong kernel is off by O(1)).
    rel_err("qwen3.5-tiny tap 0", &a[0], &b[0], 3e-2);
    for l in 0..a.len() {
        let (e_gpu, e_cpu) = (rel_err_quiet(&a[l], &exact[l]), rel_err_quiet(&b[l], &exact[l]));
        println!("qwen3.5-tiny tap {l}: vs exact, cuda {e_gpu:.3e}, cpu {e_cpu:.3e}");
        assert!(e_gpu <= 2.0 * e_cpu + 1e-3, "tap {l}: cuda {e_gpu:.3e} from the exact taps, cpu {e_cpu:.3e}");
    }
}
