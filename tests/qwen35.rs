//! The Qwen3.5/3.6 hybrid target on the CPU: every new op against its textbook formula written
//! plainly here, the chunked gated delta rule against the recurrent definition (exact f64
//! backend), and the whole target (packing, decoding, training).

use crate::common::{buf, buf32, randn, Exact, Scratch};
use dflash_engine::backend::cpu::{CpuBuf, CpuStream};
use dflash_engine::backend::{Backend, GdnShape};

const S: CpuStream = CpuStream;

fn be() -> Exact {
    Exact::exact()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

/// Max |a - b| relative to max |b| (b must not be all zero: the check would be vacuous).
fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    assert!(scale > 1e-6, "reference is all zero");
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

// ---------------------------------------------------------------------------------------------
// Elementwise and per-row ops
// ---------------------------------------------------------------------------------------------

#[test]
fn rmsnorm1p_is_x_over_rms_times_one_plus_w_also_per_head() {
    // rows = tokens * heads, dim = head_dim: the per-head q/k norm is the same op.
    let (rows, dim, eps) = (6, 8, 1e-6);
    let x = randn(rows * dim, 1, 1.5);
    let w = randn(dim + 3, 2, 0.2);
    let mut y = buf(vec![0.0; rows * dim]);
    be().rmsnorm1p_fwd(&S, &buf(x.clone()), &buf(w.clone()), 3, &mut y, rows, dim, eps as f32).unwrap();
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        let ms = xr.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        for c in 0..dim {
            let want = xr[c] / (ms + f64::from(eps as f32)).sqrt() * (1.0 + w[3 + c]);
            assert!((y.data[r * dim + c] - want).abs() < 1e-12, "row {r} col {c}");
        }
    }
}

#[test]
fn gated_rmsnorm_is_plain_w_times_silu_z() {
    let (rows, dim, eps) = (5, 8, 1e-6);
    let (x, z, w) = (randn(rows * dim, 3, 1.0), randn(rows * dim, 4, 2.0), randn(dim, 5, 1.0));
    let mut y = buf(vec![0.0; rows * dim]);
    be().gated_rmsnorm_fwd(&S, &buf(x.clone()), &buf(z.clone()), &buf(w.clone()), 0, &mut y, rows, dim, eps as f32)
        .unwrap();
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        let ms = xr.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        for c in 0..dim {
            let want = xr[c] / (ms + f64::from(eps as f32)).sqrt() * w[c] * silu(z[r * dim + c]);
            assert!((y.data[r * dim + c] - want).abs() < 1e-12);
        }
    }
}

#[test]
fn partial_rope_rotates_the_first_dims_and_passes_the_rest() {
    let (rows, heads, hd, rot, theta) = (5, 3, 16, 4, 1e7f32);
    let x = randn(rows * heads * hd, 6, 1.0);
    let pos: Vec<i32> = vec![0, 1, 7, 300, 4095];
    let mut y = buf(x.clone());
    be().rope_partial(&S, &mut y, &pos, rows, heads, hd, rot, theta).unwrap();
    let half = rot / 2;
    for r in 0..rows {
        for h in 0..heads {
            let o = r * heads * hd + h * hd;
            for j in 0..half {
                // inv_freq_j = theta^(-2j / rot), in f32 as transformers computes it.
                let inv = 1.0 / theta.powf((2 * j) as f32 / rot as f32);
                let ang = pos[r] as f32 * inv;
                let (c, s) = (f64::from(ang.cos()), f64::from(ang.sin()));
                let (a, b) = (x[o + j], x[o + j + half]);
                assert!((y.data[o + j] - (a * c - b * s)).abs() < 1e-12);
                assert!((y.data[o + j + half] - (b * c + a * s)).abs() < 1e-12);
            }
            assert_eq!(y.data[o + rot..o + hd], x[o + rot..o + hd], "dims past rot_dim pass through");
        }
    }
    // rot_dim = head_dim is the full rotation of the Qwen3 op.
    let (mut full, mut part) = (buf(x.clone()), buf(x.clone()));
    be().rope(&S, &mut full, &pos, rows, heads, hd, theta, false).unwrap();
    be().rope_partial(&S, &mut part, &pos, rows, heads, hd, hd, theta).unwrap();
    assert_eq!(full.data, part.data);
    assert!(be().rope_partial(&S, &mut part, &pos, rows, heads, hd, 3, theta).is_err(), "odd rot_dim");
}

#[test]
fn sigmoid_gate_and_strided_copy() {
    let (x, g) = (randn(12, 7, 1.0), randn(12, 8, 3.0));
    let mut y = buf(x.clone());
    be().sigmoid_mul(&S, &mut y, &buf(g.clone())).unwrap();
    for i in 0..12 {
        assert!((y.data[i] - x[i] * sigmoid(g[i])).abs() < 1e-14);
    }
    // [q_0 | g_0 | q_1 | g_1] rows of width 2 * hd: the gates of 3 rows x 2 heads (hd 2).
    let src: Vec<f64> = (0..24).map(f64::from).collect();
    let mut dst = buf(vec![-1.0; 12]);
    be().copy_strided(&S, &buf(src), 2, 4, &mut dst, 0, 2, 6, 2).unwrap();
    assert_eq!(dst.data, [2., 3., 6., 7., 10., 11., 14., 15., 18., 19., 22., 23.]);
    assert!(be().copy_strided(&S, &buf(vec![0.0; 23]), 2, 4, &mut dst, 0, 2, 6, 2).is_err());
}

#[test]
fn l2norm_scales_each_row_to_the_given_length() {
    let (rows, dim) = (7, 16);
    let x = randn(rows * dim, 9, 2.0);
    let mut y = buf32(vec![0.0; rows * dim]);
    let scale = 0.25f32;
    be().l2norm_fwd(&S, &buf(x.clone()), &mut y, rows, dim, 1e-6, scale).unwrap();
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        let inv = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() + f64::from(1e-6f32)).sqrt();
        for c in 0..dim {
            assert!((y.data[r * dim + c] - 0.25 * xr[c] * inv).abs() < 1e-14);
        }
    }
}

#[test]
fn gdn_gates_are_sigmoid_and_minus_exp_alog_softplus() {
    let (rows, heads) = (4, 3);
    let b = randn(rows * heads, 10, 2.0);
    // a spans both branches of softplus (linear above 20).
    let mut a = randn(rows * heads, 11, 3.0);
    a[0] = 25.0;
    a[1] = -30.0;
    let mut w = vec![0.0; 8];
    let (a_log, dt_bias) = ([0.5f64, -1.0, 2.7], [1.0f64, 0.3, -0.7]);
    w[1..4].copy_from_slice(&a_log);
    w[5..8].copy_from_slice(&dt_bias);
    let (mut beta, mut g) = (buf(vec![0.0; rows * heads]), buf32(vec![0.0; rows * heads]));
    be().gdn_gates(&S, &buf(b.clone()), &buf(a.clone()), &buf(w), 1, 5, &mut beta, &mut g, rows, heads).unwrap();
    for i in 0..rows * heads {
        let h = i % heads;
        let x = a[i] + dt_bias[h];
        let sp = if x > 20.0 { x } else { (1.0 + x.exp()).ln() };
        assert!((beta.data[i] - sigmoid(b[i])).abs() < 1e-15);
        assert!((g.data[i] - (-a_log[h].exp() * sp)).abs() < 1e-12 * (1.0 + sp.abs()), "{i}");
        assert!(g.data[i] <= 0.0);
    }
}

#[test]
fn causal_conv_is_zero_padded_per_sequence_then_silu() {
    let (channels, k) = (5, 4);
    let starts = vec![0, 1, 3, 9, 10];
    let rows = 10;
    let x = randn(rows * channels, 12, 1.0);
    let w = randn(channels * k, 13, 0.7);
    let mut y = buf(vec![0.0; rows * channels]);
    be().causal_conv1d_silu(&S, &buf(x.clone()), &buf(w.clone()), 0, &mut y, &starts, rows, channels, k).unwrap();
    for s in starts.windows(2) {
        let (a, b) = (s[0] as usize, s[1] as usize);
        // F.conv1d(x, w[C,1,K], padding=K-1, groups=C)[:, :, :T]: out[t] = sum_j w[j] xpad[t + j],
        // xpad = K-1 zeros then the sequence.
        let len = b - a;
        for c in 0..channels {
            let mut xpad = vec![0.0; k - 1];
            xpad.extend((a..b).map(|t| x[t * channels + c]));
            for t in 0..len {
                let conv: f64 = (0..k).map(|j| w[c * k + j] * xpad[t + j]).sum();
                assert!((y.data[(a + t) * channels + c] - silu(conv)).abs() < 1e-13, "row {} ch {c}", a + t);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The gated delta rule
// ---------------------------------------------------------------------------------------------

struct GdnCase {
    sh: GdnShape,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    g: Vec<f64>,
    beta: Vec<f64>,
    starts: Vec<i32>,
}

/// Random inputs as the layer makes them: unit-length k, q of length dk^-0.5, decays in
/// (-0.5, 0) with a few strong ones, beta in (0, 1).
fn gdn_case(lens: &[usize], seed: u64) -> GdnCase {
    let sh = GdnShape { rows: lens.iter().sum(), k_heads: 2, v_heads: 4, k_dim: 8, v_dim: 6 };
    let unit = |x: Vec<f64>, d: usize, len: f64| -> Vec<f64> {
        x.chunks(d)
            .flat_map(|c| {
                let n = c.iter().map(|v| v * v).sum::<f64>().sqrt();
                c.iter().map(|v| len * v / n).collect::<Vec<_>>()
            })
            .collect()
    };
    let kw = sh.k_heads * sh.k_dim;
    let q = unit(randn(sh.rows * kw, seed, 1.0), sh.k_dim, (sh.k_dim as f64).powf(-0.5));
    let k = unit(randn(sh.rows * kw, seed + 1, 1.0), sh.k_dim, 1.0);
    let v = randn(sh.rows * sh.v_heads * sh.v_dim, seed + 2, 1.0);
    let g: Vec<f64> = randn(sh.rows * sh.v_heads, seed + 3, 1.0)
        .iter()
        .enumerate()
        .map(|(i, x)| if i % 17 == 0 { -3.0 * x.abs() } else { -0.25 * sigmoid(*x) })
        .collect();
    let beta: Vec<f64> = randn(sh.rows * sh.v_heads, seed + 4, 2.0).iter().map(|x| sigmoid(*x)).collect();
    let mut starts = vec![0i32];
    for l in lens {
        starts.push(starts.last().unwrap() + *l as i32);
    }
    GdnCase { sh, q, k, v, g, beta, starts }
}

fn run_gdn(c: &GdnCase, chunked: bool, init: Option<Vec<f64>>) -> (Vec<f64>, Option<Vec<f64>>) {
    let mut o = buf(vec![0.0; c.sh.rows * c.sh.v_heads * c.sh.v_dim]);
    let mut state = init.map(buf32);
    let args = (buf(c.q.clone()), buf(c.k.clone()), buf(c.v.clone()), buf32(c.g.clone()), buf(c.beta.clone()));
    let f = if chunked { Exact::gdn_chunked_fwd } else { Exact::gdn_recurrent_fwd };
    f(&be(), &S, &c.sh, &args.0, &args.1, &args.2, &args.3, &args.4, &c.starts, &mut o, state.as_mut()).unwrap();
    (o.data, state.map(|s: CpuBuf<f64>| s.data))
}

/// The definition written out plainly (transformers' torch_recurrent_gated_delta_rule), one
/// sequence and value head at a time, value head h reading key head h / (HV / HK).
fn gdn_textbook(c: &GdnCase) -> Vec<f64> {
    let GdnShape { k_heads, v_heads, k_dim: dk, v_dim: dv, .. } = c.sh;
    let (kw, vw) = (k_heads * dk, v_heads * dv);
    let mut out = vec![0.0; c.sh.rows * vw];
    for seq in c.starts.windows(2) {
        for h in 0..v_heads {
            let kh = h / (v_heads / k_heads);
            let mut s = vec![vec![0.0; dv]; dk]; // S[dk][dv], zero at the sequence start
            for t in seq[0] as usize..seq[1] as usize {
                let q = &c.q[t * kw + kh * dk..][..dk];
                let k = &c.k[t * kw + kh * dk..][..dk];
                let v = &c.v[t * vw + h * dv..][..dv];
                let (g, beta) = (c.g[t * v_heads + h], c.beta[t * v_heads + h]);
                for row in s.iter_mut() {
                    for x in row.iter_mut() {
                        *x *= g.exp();
                    }
                }
                let stk: Vec<f64> = (0..dv).map(|j| (0..dk).map(|i| s[i][j] * k[i]).sum()).collect();
                for i in 0..dk {
                    for j in 0..dv {
                        s[i][j] += beta * k[i] * (v[j] - stk[j]);
                    }
                }
                for j in 0..dv {
                    out[t * vw + h * dv + j] = (0..dk).map(|i| s[i][j] * q[i]).sum();
                }
            }
        }
    }
    out
}

#[test]
fn gdn_recurrent_is_the_definition() {
    let c = gdn_case(&[5, 70, 1, 30], 20);
    let (o, _) = run_gdn(&c, false, None);
    assert!(rel_err(&o, &gdn_textbook(&c)) < 1e-13);
}

#[test]
fn gdn_chunked_equals_recurrent_in_f64() {
    // One sequence of each length around the chunk size, then a packed batch of several.
    let cases: Vec<Vec<usize>> = vec![vec![1], vec![63], vec![64], vec![65], vec![200], vec![3, 64, 130, 1, 65]];
    for lens in cases {
        let c = gdn_case(&lens, 30 + lens.len() as u64);
        let (rec, _) = run_gdn(&c, false, None);
        let (chk, _) = run_gdn(&c, true, None);
        let err = rel_err(&chk, &rec);
        assert!(err < 1e-11, "{lens:?}: chunked vs recurrent {err:e}");
    }
}

#[test]
fn gdn_state_restarts_at_every_sequence_start() {
    let lens = [40usize, 70, 9];
    let c = gdn_case(&lens, 40);
    let (packed, _) = run_gdn(&c, true, None);
    let vw = c.sh.v_heads * c.sh.v_dim;
    let mut r0 = 0;
    for (i, &len) in lens.iter().enumerate() {
        // The same sequence alone.
        let (kw, hv) = (c.sh.k_heads * c.sh.k_dim, c.sh.v_heads);
        let one = GdnCase {
            sh: GdnShape { rows: len, ..c.sh },
            q: c.q[r0 * kw..(r0 + len) * kw].to_vec(),
            k: c.k[r0 * kw..(r0 + len) * kw].to_vec(),
            v: c.v[r0 * vw..(r0 + len) * vw].to_vec(),
            g: c.g[r0 * hv..(r0 + len) * hv].to_vec(),
            beta: c.beta[r0 * hv..(r0 + len) * hv].to_vec(),
            starts: vec![0, len as i32],
        };
        let (alone, _) = run_gdn(&one, true, None);
        assert!(rel_err(&packed[r0 * vw..(r0 + len) * vw], &alone) < 1e-14, "sequence {i}");
        r0 += len;
    }
}

#[test]
fn gdn_state_carries_across_calls_in_both_forms() {
    // Running 130 tokens at once equals 100 tokens then 30 more from the returned state, for
    // the chunked form, the recurrent form, and one token at a time (the decoding path).
    let whole = gdn_case(&[130], 50);
    let (want, _) = run_gdn(&whole, false, None);
    let sh = whole.sh;
    let (kw, vw, hv) = (sh.k_heads * sh.k_dim, sh.v_heads * sh.v_dim, sh.v_heads);
    let part = |a: usize, b: usize| GdnCase {
        sh: GdnShape { rows: b - a, ..sh },
        q: whole.q[a * kw..b * kw].to_vec(),
        k: whole.k[a * kw..b * kw].to_vec(),
        v: whole.v[a * vw..b * vw].to_vec(),
        g: whole.g[a * hv..b * hv].to_vec(),
        beta: whole.beta[a * hv..b * hv].to_vec(),
        starts: vec![0, (b - a) as i32],
    };
    let zero = vec![0.0; hv * sh.k_dim * sh.v_dim];
    for chunked in [true, false] {
        let (o1, s1) = run_gdn(&part(0, 100), chunked, Some(zero.clone()));
        let (o2, _) = run_gdn(&part(100, 130), chunked, s1);
        let got: Vec<f64> = o1.into_iter().chain(o2).collect();
        assert!(rel_err(&got, &want) < 1e-11, "chunked {chunked}");
    }
    let mut state = Some(zero);
    let mut got = Vec::new();
    for t in 0..130 {
        let (o, s) = run_gdn(&part(t, t + 1), false, state);
        got.extend(o);
        state = s;
    }
    assert!(rel_err(&got, &want) < 1e-12);
}

// ---------------------------------------------------------------------------------------------
// The whole target
// ---------------------------------------------------------------------------------------------

use dflash_engine::config::TargetConfig;
use dflash_engine::model::target::{names, Target, TargetInputs, TargetShape};
use dflash_engine::tensor::DType;
use dflash_engine::weights::{init_value_bf16, target_tensor_specs};

/// The qwen3.5-tiny preset's weights (as `run` generates them) on the exact backend.
fn tiny_target(taps: Vec<usize>, all_layers: bool, std: f32) -> Target<Exact> {
    let cfg = TargetConfig::preset("qwen3.5-tiny").unwrap();
    let specs = target_tensor_specs(&cfg);
    Target::load(&be(), TargetShape::from(&cfg), taps, all_layers, |name, dims| {
        let (t, spec) = specs.iter().enumerate().find(|(_, s)| s.name == name).expect("a preset tensor");
        assert_eq!(spec.shape, dims, "{name}");
        let n: usize = dims.iter().product();
        Ok::<_, dflash_engine::backend::BackendError>(
            (0..n as u64).map(|e| init_value_bf16(spec.role, 3, t as u32, e, std).to_f32()).collect(),
        )
    })
    .unwrap()
}

fn tokens(n: usize, seed: u64) -> Vec<i32> {
    randn(n, seed, 1.0).iter().map(|x| ((x.abs() * 1000.0) as i32) % 250).collect()
}

/// Taps of a packed batch of sequences `lens` (positions restart per sequence).
fn taps_of(t: &Target<Exact>, ids: &[i32], lens: &[usize]) -> Vec<Vec<f64>> {
    let rows = ids.len();
    let pos: Vec<i32> = lens.iter().flat_map(|&l| 0..l as i32).collect();
    let mut starts = vec![0i32];
    for &l in lens {
        starts.push(starts.last().unwrap() + l as i32);
    }
    let h = t.shape.hidden;
    let mut out: Vec<_> = t.taps.iter().map(|_| be().alloc(&S, DType::BF16, rows * h).unwrap()).collect();
    let inp = TargetInputs { ids: &ids.to_vec(), pos: &pos, seq_starts: &starts, rows };
    t.forward_taps(&be(), &S, &inp, &mut out).unwrap();
    out.into_iter().map(|b| b.data).collect()
}

#[test]
fn packed_batch_taps_equal_separate_sequences() {
    // Taps at a linear layer (1), the first full layer (3) and a later linear layer (6); the
    // middle sequence is longer than a delta-rule chunk.
    let taps = vec![1, 3, 6];
    let t = tiny_target(taps.clone(), false, 0.05);
    let lens = [5usize, 70, 12];
    let ids = tokens(lens.iter().sum(), 60);
    let packed = taps_of(&t, &ids, &lens);
    let h = t.shape.hidden;
    let mut r0 = 0;
    for &len in &lens {
        let alone = taps_of(&t, &ids[r0..r0 + len], &[len]);
        for k in 0..taps.len() {
            let err = rel_err(&packed[k][r0 * h..(r0 + len) * h], &alone[k]);
            assert!(err < 1e-12, "tap {} of the sequence at row {r0}: {err:e}", taps[k]);
        }
        r0 += len;
    }
    // Layers change the stream (a tap is not just the embedding): each tap differs from the last.
    assert!(rel_err(&packed[0], &packed[1]) > 1e-3 && rel_err(&packed[1], &packed[2]) > 1e-3);
}

#[test]
fn decoding_step_by_step_gives_the_forward_logits() {
    let t = tiny_target(vec![7], true, 0.05);
    let (n, len, h, v) = (3usize, 11usize, t.shape.hidden, t.shape.vocab);
    let seqs: Vec<Vec<i32>> = (0..n).map(|b| tokens(len, 70 + b as u64)).collect();
    // The forward: every sequence's last-layer stream, final norm, lm_head.
    let ids: Vec<i32> = seqs.concat();
    let last = taps_of(&t, &ids, &vec![len; n]).remove(0);
    let rows = n * len;
    let mut xn = buf(vec![0.0; rows * h]);
    be().rmsnorm1p_fwd(&S, &buf(last), &t.weights, t.table.off(names::FINAL_NORM), &mut xn, rows, h, t.shape.eps)
        .unwrap();
    let mut want = buf32(vec![0.0; rows * v]);
    let g = dflash_engine::backend::Gemm::linear(rows, v, h);
    be().gemm(&S, &g, &xn, 0, &t.weights, t.table.off(names::LM_HEAD), &mut want, 0).unwrap();
    // Decoding: one token per sequence per step over the cache.
    let mut cache = t.new_cache(&be(), &S, n, len).unwrap();
    let mut logits = buf32(vec![0.0; n * v]);
    for step in 0..len {
        let cur: Vec<i32> = seqs.iter().map(|q| q[step]).collect();
        t.decode_step(&be(), &S, &mut cache, &cur, step, &mut logits).unwrap();
        for b in 0..n {
            let row = (b * len + step) * v;
            let err = rel_err(&logits.data[b * v..(b + 1) * v], &want.data[row..row + v]);
            assert!(err < 1e-10, "sequence {b} position {step}: {err:e}");
        }
    }
}

/// `run --target qwen3.5-tiny` learns on the CPU with the preset's own weights (its scaled
/// embedding and lm_head, `weights::HYBRID_EMBED_GAIN`): the same bar as `run::default_run_learns`
/// (mean of the last 10 steps: loss below 0.7x the first step's, simulated acceptance length up
/// by at least 0.3) on the default run, shortened like that test. Taps, packing, the drafter step
/// and the data the target generates all go through the same Target API.
#[test]
fn qwen35_tiny_run_learns_on_the_cpu() {
    use dflash_engine::session::{self, Device, RunOptions};
    let scratch = Scratch::new("qwen35-qwen35_tiny_run_learns_on_the_cpu");
    let out = scratch.fresh("learn");
    let opts = {
        let mut ro = RunOptions::tiny_default();
        ro.model.target = "qwen3.5-tiny".into();
        ro.exec.device = Device::Cpu;
        ro.train.steps = 200;
        ro.output.checkpoints = false;
        ro.output.quiet = true;
        ro.output.out = out.clone();
        ro
    };
    let r = session::run(&opts, None).unwrap();
    assert!(r.backend.starts_with("cpu"), "{}", r.backend);
    let first = &r.history[0];
    let tail = &r.history[r.history.len() - 10..];
    let mean = |f: fn(&dflash_engine::train::step::StepMetrics) -> f64| tail.iter().map(f).sum::<f64>() / 10.0;
    let (acc, accept, loss) = (mean(|m| m.accuracy), mean(|m| m.accept_len), mean(|m| m.loss));
    println!(
        "qwen3.5-tiny, {} steps: loss {:.3} -> {loss:.3} ({:.2}x), accept {:.3} -> {accept:.3}, accuracy {:.3} -> {acc:.3}",
        r.history.len(),
        first.loss,
        loss / first.loss,
        first.accept_len,
        first.accuracy
    );
    assert!(r.history.iter().all(|m| !m.skipped && m.loss.is_finite()));
    assert!(loss < 0.7 * first.loss, "loss {:.3} -> {loss:.3}", first.loss);
    assert!(accept >= first.accept_len + 0.3, "accept {:.3} -> {accept:.3}", first.accept_len);
}
