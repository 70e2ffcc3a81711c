//! Every op's backward against f64 central differences of `L = sum(r * op(x))`.

use crate::common::*;
use dflash_engine::backend::cpu::{CpuBuf, CpuStream};
use dflash_engine::backend::{Backend, DraftAttnShape, Gemm};

const S: CpuStream = CpuStream;

#[test]
fn gemm_linear_forms() {
    let be = Exact::exact();
    let (m, n, k) = (5, 3, 7);
    let x = randn(m * k, 1, 1.0);
    let w = randn(n * k, 2, 1.0);
    let r = randn(m * n, 3, 1.0);
    let loss = |x: &[f64], w: &[f64]| {
        let mut y = buf(vec![0.0; m * n]);
        be.gemm(&S, &Gemm::linear(m, n, k), &buf(x.to_vec()), 0, &buf(w.to_vec()), 0, &mut y, 0).unwrap();
        dot(&y.data, &r)
    };
    let mut dx = buf(vec![0.0; m * k]);
    be.gemm(&S, &Gemm::linear_dx(m, n, k, false), &buf(r.clone()), 0, &buf(w.clone()), 0, &mut dx, 0).unwrap();
    // dW accumulates: start from a known value and subtract it.
    let mut dw = buf32(vec![0.5; n * k]);
    be.gemm(&S, &Gemm::linear_dw(m, n, k), &buf(r.clone()), 0, &buf(x.clone()), 0, &mut dw, 0).unwrap();
    let dw: Vec<f64> = dw.data.iter().map(|v| v - 0.5).collect();
    assert_grad_close("gemm dX", &dx.data, &numeric_grad(&x, |x| loss(x, &w)));
    assert_grad_close("gemm dW", &dw, &numeric_grad(&w, |w| loss(&x, w)));
}

/// The residual forms: `gemm_residual` writes `r + x W^T` and leaves `r`; a GEMM with beta 1
/// adds `x W^T` to what `y` holds, in place; both equal the sum computed here.
#[test]
fn gemm_residual_forms() {
    let be = Exact::exact();
    let (m, n, k, w_off) = (4, 3, 5, 2);
    let x = randn(m * k, 11, 1.0);
    let w = randn(w_off + n * k, 12, 1.0);
    let r = randn(m * n, 13, 1.0);
    let mut want = r.clone();
    for i in 0..m {
        for j in 0..n {
            want[i * n + j] += (0..k).map(|p| x[i * k + p] * w[w_off + j * k + p]).sum::<f64>();
        }
    }
    let (xb, wb, rb) = (buf(x.clone()), buf(w.clone()), buf(r.clone()));
    let mut d = buf(vec![f64::NAN; m * n]);
    be.gemm_residual(&S, &Gemm::linear(m, n, k), &xb, &wb, w_off, &rb, &mut d).unwrap();
    let mut y = buf(r.clone());
    be.gemm(&S, &Gemm { beta: 1.0, ..Gemm::linear(m, n, k) }, &xb, 0, &wb, w_off, &mut y, 0).unwrap();
    for (what, got) in [("gemm_residual", &d.data), ("in place", &y.data)] {
        for (g, e) in got.iter().zip(&want) {
            assert!((g - e).abs() <= 1e-12 * e.abs().max(1.0), "{what}: {g} vs {e}");
        }
    }
    assert_eq!(rb.data, r, "gemm_residual left r as it was");
}

#[test]
fn rmsnorm_and_head_norm() {
    let be = Exact::exact();
    // rows x dim, plus the per-head form (rows = tokens * heads, dim = head_dim), with an offset weight.
    for (rows, dim, w_off) in [(3, 5, 0), (6, 4, 3), (1, 9, 1)] {
        let x = randn(rows * dim, 10 + rows as u64, 1.0);
        let w = randn(w_off + dim, 11, 0.5).iter().map(|v| 1.0 + v).collect::<Vec<_>>();
        let r = randn(rows * dim, 12, 1.0);
        let fwd = |x: &[f64], w: &[f64]| {
            let mut y = buf(vec![0.0; rows * dim]);
            let mut rs = buf32(vec![0.0; rows]);
            be.rmsnorm_fwd(&S, &buf(x.to_vec()), &buf(w.to_vec()), w_off, &mut y, &mut rs, rows, dim, 1e-6).unwrap();
            (y, rs)
        };
        let (_, rstd) = fwd(&x, &w);
        let mut dx = buf(vec![0.0; rows * dim]);
        let mut dw = buf32(vec![0.0; w_off + dim]);
        be.rmsnorm_bwd(
            &S,
            &buf(r.clone()),
            &buf(x.clone()),
            &buf(w.clone()),
            w_off,
            &rstd,
            &mut dx,
            false,
            &mut dw,
            w_off,
            rows,
            dim,
        )
        .unwrap();
        assert_grad_close("rmsnorm dx", &dx.data, &numeric_grad(&x, |x| dot(&fwd(x, &w).0.data, &r)));
        let nw = numeric_grad(&w, |w| dot(&fwd(&x, w).0.data, &r));
        assert_grad_close("rmsnorm dw", &dw.data[w_off..], &nw[w_off..]);
        // accumulate_dx adds to what is there.
        let mut dx2 = buf(vec![1.0; rows * dim]);
        let mut dw2 = buf32(vec![0.0; w_off + dim]);
        be.rmsnorm_bwd(
            &S,
            &buf(r.clone()),
            &buf(x.clone()),
            &buf(w.clone()),
            w_off,
            &rstd,
            &mut dx2,
            true,
            &mut dw2,
            w_off,
            rows,
            dim,
        )
        .unwrap();
        for (a, b) in dx2.data.iter().zip(&dx.data) {
            assert!((a - 1.0 - b).abs() < 1e-12);
        }
    }
}

#[test]
fn rope_backward_is_the_inverse_rotation() {
    let be = Exact::exact();
    let (rows, heads, hd) = (5, 3, 8);
    let x = randn(rows * heads * hd, 20, 1.0);
    let r = randn(rows * heads * hd, 21, 1.0);
    let pos: Vec<i32> = vec![0, 3, 17, 1000, 40_000];
    let fwd = |x: &[f64]| {
        let mut b = buf(x.to_vec());
        be.rope(&S, &mut b, &pos, rows, heads, hd, 1e6, false).unwrap();
        dot(&b.data, &r)
    };
    let mut d = buf(r.clone());
    be.rope(&S, &mut d, &pos, rows, heads, hd, 1e6, true).unwrap();
    assert_grad_close("rope dx", &d.data, &numeric_grad(&x, fwd));
    // Position 0 is the identity.
    let mut b = buf(x.clone());
    be.rope(&S, &mut b, &vec![0; rows], rows, heads, hd, 1e6, false).unwrap();
    assert_eq!(b.data, x);
}

#[test]
fn swiglu() {
    let be = Exact::exact();
    let (rows, inter) = (4, 7);
    let gu = randn(rows * 2 * inter, 30, 2.0);
    let r = randn(rows * inter, 31, 1.0);
    let act = |gu: &[f64]| {
        let mut o = buf(vec![0.0; rows * inter]);
        be.swiglu_fwd(&S, &buf(gu.to_vec()), &mut o, rows, inter).unwrap();
        o.data
    };
    let fwd = |gu: &[f64]| dot(&act(gu), &r);
    let (mut dgu, mut dact) = (buf(gu.clone()), buf(r.clone()));
    be.swiglu_bwd(&S, &mut dact, &mut dgu, rows, inter).unwrap();
    assert_grad_close("swiglu dgu", &dgu.data, &numeric_grad(&gu, fwd));
    // The backward leaves the forward's activation over dact, bit for bit.
    assert_eq!(dact.data, act(&gu));
}

#[test]
fn cross_entropy_weighted() {
    let be = Exact::exact();
    let (rows, vocab) = (6, 11);
    let logits = randn(rows * vocab, 40, 2.0);
    let labels: Vec<i32> = vec![3, -1, 10, 0, 5, 7];
    let weights = vec![1.0, 0.0, 0.5, 0.25, 0.0, 2.0];
    let gs = 1.0 / 3.75;
    let run = |lg: &[f64]| {
        let mut l = buf(lg.to_vec());
        let mut loss = buf32(vec![0.0; rows]);
        let mut am = vec![0; rows];
        be.cross_entropy(
            &S,
            &mut l,
            &labels,
            &buf32(weights.clone()),
            0,
            rows,
            vocab,
            gs as f32,
            &mut loss,
            0,
            &mut am,
            0,
        )
        .unwrap();
        (l, loss, am)
    };
    let (grad, loss, am) = run(&logits);
    let n = numeric_grad(&logits, |lg| run(lg).1.data.iter().sum::<f64>() * gs);
    assert_grad_close("cross-entropy dlogits", &grad.data, &n);
    for r in 0..rows {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let best = (0..vocab).max_by(|&a, &b| row[a].partial_cmp(&row[b]).unwrap()).unwrap();
        assert_eq!(am[r] as usize, best);
        if weights[r] == 0.0 {
            assert_eq!(loss.data[r], 0.0);
            assert!(grad.data[r * vocab..(r + 1) * vocab].iter().all(|&g| g == 0.0));
        }
    }
}

/// Random drafter-attention inputs: 4 blocks of 3 slots over 2 sequences of 7 and 5 rows; one
/// block padded, one anchored at 0 (empty context).
struct AttnCase {
    sh: DraftAttnShape,
    anchors: Vec<i32>,
    ctx_start: Vec<i32>,
    t: [Vec<f64>; 5],
}

fn attn_case(window: Option<usize>) -> AttnCase {
    let sh = DraftAttnShape { num_blocks: 4, block_size: 3, ctx_rows: 12, heads: 4, kv_heads: 2, head_dim: 4, window };
    let (qn, kcn, kbn) = (sh.q_rows() * 16, 12 * 8, sh.q_rows() * 8);
    AttnCase {
        sh,
        anchors: vec![4, 0, 3, -1],
        ctx_start: vec![0, 0, 7, 7],
        t: [randn(qn, 50, 1.0), randn(kcn, 51, 1.0), randn(kcn, 52, 1.0), randn(kbn, 53, 1.0), randn(kbn, 54, 1.0)],
    }
}

fn attn_fwd(c: &AttnCase, t: &[Vec<f64>; 5]) -> (CpuBuf<f64>, CpuBuf<f64>) {
    let be = Exact::exact();
    let mut o = buf(vec![0.0; c.sh.q_rows() * 16]);
    let mut lse = buf32(vec![0.0; c.sh.q_rows() * 4]);
    let b: Vec<CpuBuf<f64>> = t.iter().map(|v| buf(v.clone())).collect();
    be.attn_draft_fwd(&S, &c.sh, &b[0], &b[1], &b[2], &b[3], &b[4], &c.anchors, &c.ctx_start, &mut o, &mut lse)
        .unwrap();
    (o, lse)
}

#[test]
fn drafter_attention_backward() {
    attention_backward_matches_finite_differences(None);
}

/// A sliding layer with window 2 (block 0, anchor 4: slot 0 sees context 3 only, slot 2 none,
/// so the block's own causal keys carry most of the softmax) and window 4.
#[test]
fn drafter_sliding_attention_backward() {
    attention_backward_matches_finite_differences(Some(2));
    attention_backward_matches_finite_differences(Some(4));
}

fn attention_backward_matches_finite_differences(window: Option<usize>) {
    let be = Exact::exact();
    let c = attn_case(window);
    let r = randn(c.sh.q_rows() * 16, 55, 1.0);
    let (o, lse) = attn_fwd(&c, &c.t);
    let b: Vec<CpuBuf<f64>> = c.t.iter().map(|v| buf(v.clone())).collect();
    let mut g: Vec<CpuBuf<f64>> = c.t.iter().map(|v| buf(vec![f64::NAN; v.len()])).collect();
    {
        let [g0, g1, g2, g3, g4] = &mut g[..] else { unreachable!() };
        be.attn_draft_bwd(
            &S,
            &c.sh,
            &b[0],
            &b[1],
            &b[2],
            &b[3],
            &b[4],
            &c.anchors,
            &c.ctx_start,
            &o,
            &lse,
            &buf(r.clone()),
            [g0, g1, g2, g3, g4],
        )
        .unwrap();
    }
    for (i, name) in ["dq", "dkc", "dvc", "dkb", "dvb"].iter().enumerate() {
        let n = numeric_grad(&c.t[i], |v| {
            let mut t = c.t.clone();
            t[i] = v.to_vec();
            dot(&attn_fwd(&c, &t).0.data, &r)
        });
        assert_grad_close(name, &g[i].data, &n);
    }
    // The padded block (3): exact zeros out and back, never NaN.
    let pad = 3 * 3;
    assert!(o.data[pad * 16..].iter().all(|&x| x == 0.0));
    assert!(g[0].data[pad * 16..].iter().all(|&x| x == 0.0));
    assert!(g[3].data[pad * 8..].iter().all(|&x| x == 0.0) && g[4].data[pad * 8..].iter().all(|&x| x == 0.0));
}

#[test]
fn causal_attention_matches_brute_force() {
    let be = Exact::exact();
    let (rows, heads, kvh, hd) = (9, 4, 2, 4);
    let q = randn(rows * 16, 60, 1.0);
    let k = randn(rows * 8, 61, 1.0);
    let v = randn(rows * 8, 62, 1.0);
    let starts = vec![0, 5, 9];
    let mut o = buf(vec![0.0; rows * 16]);
    be.attn_causal_fwd(&S, &buf(q.clone()), &buf(k.clone()), &buf(v.clone()), &mut o, &starts, rows, heads, kvh, hd)
        .unwrap();
    for i in 0..rows {
        let s0 = if i < 5 { 0 } else { 5 };
        for h in 0..heads {
            let g = h / 2;
            let sc: Vec<f64> =
                (s0..=i).map(|t| dot(&q[i * 16 + h * 4..][..4], &k[t * 8 + g * 4..][..4]) / 2.0).collect();
            let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = sc.iter().map(|s| (s - mx).exp()).sum();
            for c in 0..hd {
                let want: f64 = (s0..=i).zip(&sc).map(|(t, s)| (s - mx).exp() / z * v[t * 8 + g * 4 + c]).sum();
                assert!((o.data[i * 16 + h * 4 + c] - want).abs() < 1e-12);
            }
        }
    }
}

/// Bad head counts are shape errors naming the op, not panics: no kv head at all (a division by
/// zero before the check was shared by the backends), heads that do not split evenly, and a short
/// buffer.
#[test]
fn causal_attention_rejects_bad_head_counts() {
    let be = Exact::exact();
    let (rows, hd) = (3, 4);
    let z = |n: usize| buf(vec![0.0; n]);
    let starts = vec![0, 3];
    for (heads, kvh, q_len) in [(4, 0, rows * 16), (4, 3, rows * 16), (4, 2, rows * 16 - 1)] {
        let mut o = z(rows * heads * hd);
        let e = be
            .attn_causal_fwd(&S, &z(q_len), &z(rows * 8), &z(rows * 8), &mut o, &starts, rows, heads, kvh, hd)
            .expect_err("a bad shape");
        let msg = e.to_string();
        assert!(msg.contains("attn_causal_fwd"), "{heads}/{kvh}, q {q_len}: {msg}");
    }
}

/// The decoding attention over a cache (`attn_decode`) is the drafter attention with blocks of
/// one slot anchored at the row's position, its own key the block's (how decoding ran before it
/// had its own op): equal on the exact backend, for a batch at one step and a causal block.
#[test]
fn attn_decode_equals_single_slot_draft_attention() {
    use dflash_engine::backend::DecodeAttnShape;
    let be = Exact::exact();
    let (heads, kvh, hd, max_len) = (4, 2, 8, 12);
    let kw = kvh * hd;
    // (rows, row_stride, len0, len_inc): 3 sequences at step 6; 5 rows of one sequence from 4.
    for (rows, row_stride, len0, len_inc) in [(3, max_len, 7, 0), (5, 0, 5, 1)] {
        let sh = DecodeAttnShape { rows, heads, kv_heads: kvh, head_dim: hd, row_stride, len0, len_inc };
        let q = randn(rows * heads * hd, 11, 1.0);
        let cache = randn(rows.max(1) * max_len * kw, 12, 1.0);
        let vcache = randn(rows.max(1) * max_len * kw, 13, 1.0);
        let mut o = buf(vec![0.0; rows * heads * hd]);
        let mut lse = buf32(vec![0.0; rows * heads]);
        be.attn_decode(&S, &sh, &buf(q.clone()), &buf(cache.clone()), &buf(vcache.clone()), &mut o, &mut lse).unwrap();
        // The same as blocks of one slot: context = the row's cache rows before its own key, the
        // own key and value as the block's.
        let (mut kb, mut vb, mut anchors, mut starts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for r in 0..rows {
            let own = r * row_stride + sh.len(r) - 1;
            kb.extend_from_slice(&cache[own * kw..][..kw]);
            vb.extend_from_slice(&vcache[own * kw..][..kw]);
            anchors.push((sh.len(r) - 1) as i32);
            starts.push((r * row_stride) as i32);
        }
        let dsh = DraftAttnShape {
            num_blocks: rows,
            block_size: 1,
            ctx_rows: cache.len() / kw,
            heads,
            kv_heads: kvh,
            head_dim: hd,
            window: None,
        };
        let mut o2 = buf(vec![0.0; rows * heads * hd]);
        let mut lse2 = buf32(vec![0.0; rows * heads]);
        be.attn_draft_fwd(
            &S,
            &dsh,
            &buf(q),
            &buf(cache),
            &buf(vcache),
            &buf(kb),
            &buf(vb),
            &anchors,
            &starts,
            &mut o2,
            &mut lse2,
        )
        .unwrap();
        for (a, b) in o.data.iter().zip(&o2.data) {
            assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "o {a} vs {b}");
        }
        for (a, b) in lse.data.iter().zip(&lse2.data) {
            assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "lse {a} vs {b}");
        }
    }
}

/// `qk_norm_rope` with the rstd kept (the drafter's training: block queries and keys in one call,
/// context keys alone with no query heads) is `rmsnorm_fwd` then `rope` bit for bit on the CPU
/// backend that rounds as the GPU does, outputs and rstd alike.
#[test]
fn qk_norm_rope_keeps_rmsnorm_fwds_rstd() {
    use dflash_engine::backend::cpu::CpuBackend;
    use dflash_engine::backend::{QkNormRope, QkRstd, Rows};
    use dflash_engine::tensor::DType;
    let be = CpuBackend::new();
    let s = be.compute_stream();
    let (rows, hd, eps, theta) = (7, 16, 1e-6, 1e6);
    let put = |v: Vec<f64>, dt| {
        let mut b = be.alloc(&s, dt, v.len()).unwrap();
        be.upload(&s, &v.iter().map(|&x| x as f32).collect::<Vec<_>>(), &mut b, 0).unwrap();
        b
    };
    let w = put(randn(2 * hd, 30, 1.0), DType::BF16);
    let pos: Vec<i32> = (0..rows as i32).map(|i| 3 * i + 5).collect();
    for (heads, kvh) in [(4, 2), (0, 2)] {
        let (qw, kw) = (heads * hd, kvh * hd);
        let q_in = put(randn((rows * qw).max(1), 31, 2.0), DType::BF16);
        let k_in = put(randn(rows * kw, 32, 2.0), DType::BF16);
        let sh = QkNormRope {
            rows,
            heads,
            kv_heads: kvh,
            head_dim: hd,
            eps,
            theta,
            q_in: Rows { off: 0, stride: qw },
            k_in: Rows { off: 0, stride: kw },
            q_out: Rows { off: 0, stride: qw },
            k_out: Rows { off: 0, stride: kw },
            wq_off: 0,
            wk_off: hd,
        };
        let f32s = |n: usize| be.alloc(&s, DType::F32, n.max(1)).unwrap();
        let (mut q, mut k) =
            (be.alloc(&s, DType::BF16, (rows * qw).max(1)).unwrap(), be.alloc(&s, DType::BF16, rows * kw).unwrap());
        let (mut qr, mut kr) = (f32s(rows * heads), f32s(rows * kvh));
        let rstd = QkRstd { q: (heads > 0).then_some(&mut qr), k: Some(&mut kr) };
        be.qk_norm_rope(&s, &sh, &q_in, &k_in, &w, &mut q, &mut k, &pos, Some(rstd)).unwrap();
        // The two separate ops.
        for (n, x, out, r, w_off, nh) in [("q", &q_in, &q, &qr, 0, heads), ("k", &k_in, &k, &kr, hd, kvh)] {
            if nh == 0 {
                continue;
            }
            let mut y = be.alloc(&s, DType::BF16, rows * nh * hd).unwrap();
            let mut rs = f32s(rows * nh);
            be.rmsnorm_fwd(&s, x, &w, w_off, &mut y, &mut rs, rows * nh, hd, eps).unwrap();
            be.rope(&s, &mut y, &pos, rows, nh, hd, theta, false).unwrap();
            let bits = |b: &CpuBuf<f32>| b.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&y), bits(out)[..rows * nh * hd], "{heads}/{kvh} heads: {n} out");
            assert_eq!(bits(&rs)[..rows * nh], bits(r)[..rows * nh], "{heads}/{kvh} heads: {n} rstd");
        }
    }
}
