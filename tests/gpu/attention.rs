//! Attention (kernels/attention.cu): the target's causal GQA forward and the drafter's block
//! attention forward and backward, against the CPU.

use dflash_engine::backend::cpu::CpuBackend;
use dflash_engine::backend::{Backend, DraftAttnShape};
use dflash_engine::tensor::DType;

use super::{bits_equal, get, gpu, ids, put, rand, rel_err, starts_of, BF16_TOL};

trait AttnTest {
    #[allow(clippy::too_many_arguments)]
    fn causal(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[i32],
        rows: usize,
        heads: usize,
        kvh: usize,
        hd: usize,
    ) -> Vec<f32>;
    fn draft(&self, sh: &DraftAttnShape, t: &[Vec<f32>; 6], anchors: &[i32], starts: &[i32]) -> Vec<Vec<f32>>;
}

impl<B: Backend> AttnTest for B {
    fn causal(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[i32],
        rows: usize,
        heads: usize,
        kvh: usize,
        hd: usize,
    ) -> Vec<f32> {
        let s = self.compute_stream();
        let mut o = self.alloc(&s, DType::BF16, rows * heads * hd).unwrap();
        self.attn_causal_fwd(
            &s,
            &put(self, q, DType::BF16),
            &put(self, k, DType::BF16),
            &put(self, v, DType::BF16),
            &mut o,
            &ids(self, starts),
            rows,
            heads,
            kvh,
            hd,
        )
        .unwrap();
        get(self, &o)
    }
    fn draft(&self, sh: &DraftAttnShape, t: &[Vec<f32>; 6], anchors: &[i32], starts: &[i32]) -> Vec<Vec<f32>> {
        let s = self.compute_stream();
        let b: Vec<B::Buf> = t.iter().map(|v| put(self, v, DType::BF16)).collect();
        let (a, st) = (ids(self, anchors), ids(self, starts));
        let qn = sh.q_rows() * sh.heads * sh.head_dim;
        let mut o = self.alloc(&s, DType::BF16, qn).unwrap();
        let mut lse = self.alloc(&s, DType::F32, sh.q_rows() * sh.heads).unwrap();
        self.attn_draft_fwd(&s, sh, &b[0], &b[1], &b[2], &b[3], &b[4], &a, &st, &mut o, &mut lse).unwrap();
        let kw = sh.kv_heads * sh.head_dim;
        let mut gr: Vec<B::Buf> = [qn, sh.ctx_rows * kw, sh.ctx_rows * kw, sh.q_rows() * kw, sh.q_rows() * kw]
            .iter()
            .map(|&n| self.alloc(&s, DType::BF16, n).unwrap())
            .collect();
        {
            let [g0, g1, g2, g3, g4] = &mut gr[..] else { unreachable!() };
            self.attn_draft_bwd(
                &s,
                sh,
                &b[0],
                &b[1],
                &b[2],
                &b[3],
                &b[4],
                &a,
                &st,
                &o,
                &lse,
                &b[5],
                [g0, g1, g2, g3, g4],
            )
            .unwrap();
        }
        let mut out = vec![get(self, &o), get(self, &lse)];
        out.extend(gr.iter().map(|x| get(self, x)));
        out
    }
}

// The attention kernels round P and dS to bf16 before their second product (as FlashAttention
// does), the CPU does not: a few bf16 ulps of the largest value. 1.5e-2 relative to the largest.
const ATTN_TOL: f32 = 1.5e-2;

/// Causal: ragged sequences (an empty one and a length-1 one), every head size.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_causal_attention_matches_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    for hd in [16, 32, 64, 128] {
        let starts = vec![0, 1, 1, 130, 200];
        let (rows, heads, kvh) = (200, 4, 2);
        let q = rand(rows * heads * hd, 70, 1.0);
        let k = rand(rows * kvh * hd, 71, 1.0);
        let v = rand(rows * kvh * hd, 72, 1.0);
        rel_err(
            &format!("causal attention hd {hd}"),
            &g.causal(&q, &k, &v, &starts, rows, heads, kvh, hd),
            &c.causal(&q, &k, &v, &starts, rows, heads, kvh, hd),
            ATTN_TOL,
        );
    }
}

/// Both causal kernels (mma.sync and the Hopper warpgroup one) against the CPU, at the head dims
/// the warpgroup kernel takes, on batches long enough to cycle its K/V stages many times: a
/// 1000-row sequence, one of a single row, one that ends mid-tile, query tiles that straddle
/// sequence starts, and GQA (4 and 1 q heads per kv head). Each form must also be bit-identical
/// from run to run.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_causal_attention_forms_match_cpu() {
    use dflash_engine::backend::cuda::AttnForm;
    let (g, c) = (gpu(), CpuBackend::new());
    let s = g.compute_stream();
    for (hd, heads, kvh, lens) in
        [(128, 8, 2, vec![1000usize, 1, 300, 129]), (256, 6, 6, vec![77, 640, 2]), (128, 4, 1, vec![2048])]
    {
        let rows: usize = lens.iter().sum();
        let mut starts = vec![0i32];
        for l in &lens {
            starts.push(starts.last().unwrap() + *l as i32);
        }
        let q = rand(rows * heads * hd, 170 + hd as u64, 1.0);
        let k = rand(rows * kvh * hd, 171, 1.0);
        let v = rand(rows * kvh * hd, 172, 1.0);
        let want = c.causal(&q, &k, &v, &starts, rows, heads, kvh, hd);
        let (qb, kb, vb) = (put(&g, &q, DType::BF16), put(&g, &k, DType::BF16), put(&g, &v, DType::BF16));
        let st = ids(&g, &starts);
        for form in [AttnForm::Mma, AttnForm::Wgmma] {
            assert!(form.takes_causal(hd), "{form:?} has no kernel for head_dim {hd}");
            let run = || {
                let mut o = g.alloc(&s, DType::BF16, rows * heads * hd).unwrap();
                g.attn_causal_fwd_with(form, &s, &qb, &kb, &vb, &mut o, &st, rows, heads, kvh, hd, None).unwrap();
                get(&g, &o)
            };
            let got = run();
            rel_err(
                &format!("{form:?} causal attention hd {hd}, {heads}/{kvh} heads, lens {lens:?}"),
                &got,
                &want,
                ATTN_TOL,
            );
            bits_equal(&format!("{form:?} hd {hd} rerun"), &run(), &got);
        }
    }
}

/// The warp-specialised causal forward (`AttnForm::WarpSpecialized`, attention_wgmma.cu
/// section 5) on every shape the causal tests above and the head_dim 256 test (gpu/hybrid.rs)
/// use, plus two long ragged batches that cycle its K/V rings many times: against the CPU with the tolerance of the test each shape comes from,
/// against the wgmma form (same math and rounding; the same tolerance), and bit-identical from run
/// to run. Covers an empty sequence, length-1 sequences, query tiles that straddle sequence starts,
/// row counts that are not multiples of the 128-row tile (a last tile whose second warpgroup has no
/// rows), and GQA at 1, 2, 3, 4 and 6 q heads per kv head.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_causal_attention_warp_specialized_matches_cpu_and_wgmma() {
    use dflash_engine::backend::cuda::AttnForm;
    let (g, c) = (gpu(), CpuBackend::new());
    let s = g.compute_stream();
    // (head_dim, heads, kv heads, sequence lengths, tolerance against the CPU)
    let cases: Vec<(usize, usize, usize, Vec<usize>, f32)> = vec![
        (128, 4, 2, vec![1, 0, 129, 70], ATTN_TOL),
        (128, 8, 2, vec![1000, 1, 300, 129], ATTN_TOL),
        (256, 6, 6, vec![77, 640, 2], ATTN_TOL),
        (128, 4, 1, vec![2048], ATTN_TOL),
        (256, 6, 2, vec![1, 63, 64, 65, 200], BF16_TOL),
        (256, 24, 4, vec![70, 1, 64], BF16_TOL),
        (256, 2, 2, vec![129], BF16_TOL),
        (128, 16, 4, vec![3, 1500, 64, 700], ATTN_TOL),
        (256, 8, 8, vec![1500, 3, 700], ATTN_TOL),
    ];
    for (hd, heads, kvh, lens, tol) in cases {
        let rows: usize = lens.iter().sum();
        let starts = starts_of(&lens);
        let q = rand(rows * heads * hd, 270 + hd as u64, 1.0);
        let k = rand(rows * kvh * hd, 271, 1.0);
        let v = rand(rows * kvh * hd, 272, 1.0);
        let want = c.causal(&q, &k, &v, &starts, rows, heads, kvh, hd);
        let (qb, kb, vb) = (put(&g, &q, DType::BF16), put(&g, &k, DType::BF16), put(&g, &v, DType::BF16));
        let st = ids(&g, &starts);
        let run = |form: AttnForm| {
            assert!(form.takes_causal(hd), "{form:?} has no kernel for head_dim {hd}");
            let mut o = g.alloc(&s, DType::BF16, rows * heads * hd).unwrap();
            g.attn_causal_fwd_with(form, &s, &qb, &kb, &vb, &mut o, &st, rows, heads, kvh, hd, None).unwrap();
            get(&g, &o)
        };
        let wg = run(AttnForm::Wgmma);
        let form = AttnForm::WarpSpecialized;
        let what = format!("{form:?} hd {hd}, {heads}/{kvh} heads, lens {lens:?}");
        let ws = run(form);
        rel_err(&format!("{what} vs cpu"), &ws, &want, tol);
        rel_err(&format!("{what} vs Wgmma"), &ws, &wg, tol);
        bits_equal(&format!("{what} rerun"), &run(form), &ws);
    }
}

/// A sequence's keys and values reach no product of a query tile that begins after the sequence
/// ends: with the first sequence's V rows NaN and K rows inf, every row from the first 128-row
/// tile boundary after it on (every form's query tiles divide 128) is finite and equal to the
/// CPU's, in every causal form and at both head dims. The second sequence starts inside a tile, so
/// its first key tile holds rows of the first (zero-filled: the warp-specialised form's cp.async
/// path); the later ones start on a tile boundary (its TMA path). (Rows of the second sequence in
/// the first sequence's last query tile share that tile's key range, which begins at the first
/// sequence's start: there the masked keys' values are read, with P = 0, in every form.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_causal_attention_keeps_non_finite_values_inside_their_sequence() {
    use dflash_engine::backend::cuda::AttnForm;
    let (g, c) = (gpu(), CpuBackend::new());
    let s = g.compute_stream();
    for (hd, heads, kvh, lens) in [(128, 8, 2, vec![100usize, 284, 256, 70]), (256, 6, 2, vec![70, 186, 128, 90])] {
        let rows: usize = lens.iter().sum();
        let starts = starts_of(&lens);
        let q = rand(rows * heads * hd, 280, 1.0);
        let mut k = rand(rows * kvh * hd, 281, 1.0);
        let mut v = rand(rows * kvh * hd, 282, 1.0);
        let bad = lens[0] * kvh * hd;
        k[..bad].iter_mut().for_each(|x| *x = f32::INFINITY);
        v[..bad].iter_mut().for_each(|x| *x = f32::NAN);
        let want = c.causal(&q, &k, &v, &starts, rows, heads, kvh, hd);
        let later = lens[0].next_multiple_of(128) * heads * hd..;
        assert!(want[later.clone()].iter().all(|x| x.is_finite()), "the CPU reference isolates sequences");
        let (qb, kb, vb) = (put(&g, &q, DType::BF16), put(&g, &k, DType::BF16), put(&g, &v, DType::BF16));
        let st = ids(&g, &starts);
        for form in [AttnForm::Mma, AttnForm::Wgmma, AttnForm::WarpSpecialized] {
            if !form.takes_causal(hd) {
                continue;
            }
            let mut o = g.alloc(&s, DType::BF16, rows * heads * hd).unwrap();
            g.attn_causal_fwd_with(form, &s, &qb, &kb, &vb, &mut o, &st, rows, heads, kvh, hd, None).unwrap();
            let got = get(&g, &o);
            let what = format!("{form:?} hd {hd}, lens {lens:?}, sequence 0 non-finite: later tiles");
            rel_err(&what, &got[later.clone()], &want[later.clone()], ATTN_TOL);
        }
    }
}

/// Drafter: two sequences, anchors at 0 and at the end, padded blocks, block sizes 16 and 1.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_drafter_attention_matches_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    for (hd, bs, heads, kvh) in [(16, 16, 4, 2), (128, 16, 32, 8), (64, 5, 6, 2), (32, 1, 4, 1)] {
        let ctx_rows = 150;
        let anchors = vec![0, 17, 99, -1, 3, 49, -1];
        let starts = vec![0, 0, 0, 0, 100, 100, 100];
        let sh = DraftAttnShape {
            num_blocks: 7,
            block_size: bs,
            ctx_rows,
            heads,
            kv_heads: kvh,
            head_dim: hd,
            window: None,
        };
        let (qn, kn, kb) = (sh.q_rows() * heads * hd, ctx_rows * kvh * hd, sh.q_rows() * kvh * hd);
        let t = [
            rand(qn, 80, 1.0),
            rand(kn, 81, 1.0),
            rand(kn, 82, 1.0),
            rand(kb, 83, 1.0),
            rand(kb, 84, 1.0),
            rand(qn, 85, 1.0),
        ];
        let (a, b) = (g.draft(&sh, &t, &anchors, &starts), c.draft(&sh, &t, &anchors, &starts));
        for (i, name) in ["o", "lse", "dq", "dkc", "dvc", "dkb", "dvb"].iter().enumerate() {
            rel_err(
                &format!("drafter attention {name} hd {hd} bs {bs} {heads}/{kvh}"),
                &a[i],
                &b[i],
                if i == 1 { 1e-5 } else { ATTN_TOL },
            );
        }
        // Padded blocks: exact zeros out.
        let w = heads * hd;
        assert!(a[0][3 * bs * w..4 * bs * w].iter().all(|&x| x == 0.0));
    }
}

/// Every drafter forward kernel (mma.sync, the Hopper warpgroup one, which takes two blocks per CTA
/// and streams their shared context once, and its warp-specialised form, which loads the context
/// tiles every row of which a block sees by TMA and the others by cp.async with the rest
/// zero-filled) against the CPU, o and lse, into NaN-filled
/// outputs: anchors at 0 and at a sequence's end, padded blocks, CTAs whose two blocks lie in two
/// sequences, an odd block count (a CTA with one block), padding rows (block_size * G < 64), full
/// and sliding layers (windows shorter than a block too), and contexts of thousands of rows (many
/// K/V stages). Each form must be bit-identical from run to run.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_drafter_forward_forms_match_cpu() {
    use dflash_engine::backend::cuda::AttnForm;
    let (g, c) = (gpu(), CpuBackend::new());
    // Sequence 0 holds blocks 0..=10 (context rows 0..2800), sequence 1 blocks 11..=23 (rows
    // 2800..5600): the CTA of blocks (10, 11) spans both. Block 5 is padded, block 23 anchored at
    // the very end of its sequence.
    let long_anchors: Vec<i32> = (0..24)
        .map(|i| {
            if i == 5 {
                -1
            } else if i == 23 {
                2800
            } else {
                (i % 11) * 250 + 7
            }
        })
        .collect();
    let long_starts: Vec<i32> = (0..24).map(|i| if i < 11 { 0 } else { 2800 }).collect();
    // Blocks (2, 3) span the two sequences (context rows 0..100 and 100..150); block 2 and block 5
    // are anchored at their sequences' ends; block 6 (padded) is alone in its CTA.
    let (anchors, starts) = (vec![0, 17, 100, 5, 3, 50, -1], vec![0, 0, 0, 100, 100, 100, 100]);
    #[allow(clippy::type_complexity)]
    let cases: Vec<(usize, usize, usize, usize, Vec<i32>, Vec<i32>, Vec<Option<usize>>)> = vec![
        (16, 32, 8, 150, anchors.clone(), starts.clone(), vec![None, Some(8), Some(3)]),
        (5, 6, 2, 150, anchors, starts, vec![None, Some(40)]),
        (16, 32, 8, 5600, long_anchors, long_starts, vec![None, Some(2048), Some(3)]),
    ];
    for (bs, heads, kvh, ctx_rows, anchors, starts, windows) in cases {
        let hd = 128;
        for window in windows {
            let sh = DraftAttnShape {
                num_blocks: anchors.len(),
                block_size: bs,
                ctx_rows,
                heads,
                kv_heads: kvh,
                head_dim: hd,
                window,
            };
            let (qn, kn, kbn) = (sh.q_rows() * heads * hd, ctx_rows * kvh * hd, sh.q_rows() * kvh * hd);
            let t =
                [rand(qn, 180, 1.0), rand(kn, 181, 1.0), rand(kn, 182, 1.0), rand(kbn, 183, 1.0), rand(kbn, 184, 1.0)];
            // o and lse of one forward on backend `be` (the form picked by `launch`).
            fn fwd<B: Backend>(
                be: &B,
                sh: &DraftAttnShape,
                t: &[Vec<f32>; 5],
                anchors: &[i32],
                starts: &[i32],
                launch: impl Fn(&B, &B::Stream, &[B::Buf], &B::Ids, &B::Ids, &mut B::Buf, &mut B::Buf),
            ) -> (Vec<f32>, Vec<f32>) {
                let s = be.compute_stream();
                let b: Vec<B::Buf> = t.iter().map(|v| put(be, v, DType::BF16)).collect();
                // NaN-filled outputs: an element the kernel fails to write shows up as NaN (and
                // fails rel_err), even where the expected value is zero.
                let mut o = put(be, &vec![f32::NAN; sh.q_rows() * sh.heads * sh.head_dim], DType::BF16);
                let mut lse = put(be, &vec![f32::NAN; sh.q_rows() * sh.heads], DType::F32);
                launch(be, &s, &b, &ids(be, anchors), &ids(be, starts), &mut o, &mut lse);
                (get(be, &o), get(be, &lse))
            }
            let want = fwd(&c, &sh, &t, &anchors, &starts, |be, s, b, a, st, o, lse| {
                be.attn_draft_fwd(s, &sh, &b[0], &b[1], &b[2], &b[3], &b[4], a, st, o, lse).unwrap()
            });
            let gpu_fwd = |form: AttnForm| {
                fwd(&g, &sh, &t, &anchors, &starts, |be, s, b, a, st, o, lse| {
                    be.attn_draft_fwd_with(form, s, &sh, &b[0], &b[1], &b[2], &b[3], &b[4], a, st, o, lse).unwrap()
                })
            };
            for form in [AttnForm::Mma, AttnForm::Wgmma, AttnForm::WarpSpecialized] {
                assert!(form.takes_draft(&sh), "{form:?} takes bs {bs}, {heads}/{kvh} heads");
                let what = format!("{form:?} drafter fwd bs {bs} {heads}/{kvh} ctx {ctx_rows} window {window:?}");
                let got = gpu_fwd(form);
                rel_err(&format!("{what} o"), &got.0, &want.0, ATTN_TOL);
                rel_err(&format!("{what} lse"), &got.1, &want.1, 1e-5);
                let again = gpu_fwd(form);
                bits_equal(&format!("{what} rerun o"), &again.0, &got.0);
                bits_equal(&format!("{what} rerun lse"), &again.1, &got.1);
                // Padded blocks: exact zeros out, lse 0.
                let w = heads * hd;
                for (j, &a) in anchors.iter().enumerate() {
                    if a < 0 {
                        assert!(got.0[j * bs * w..(j + 1) * bs * w].iter().all(|&x| x == 0.0), "{what}: block {j}");
                        assert!(
                            got.1[j * bs * heads..(j + 1) * bs * heads].iter().all(|&x| x == 0.0),
                            "{what}: lse {j}"
                        );
                    }
                }
            }
        }
    }
}

/// The three drafter backward forms (mma.sync; Hopper warpgroup MMAs: the query-side kernel pairs
/// two blocks per CTA like the warpgroup forward, the context-key kernel takes 128 context rows
/// per CTA and stages each visible block's queries once; and that context-key kernel
/// warp-specialised, fed by TMA) against the CPU on the forward forms
/// test's cases: anchors at 0 and at a sequence's end, padded blocks, CTAs whose two blocks lie in
/// two sequences, an odd block count, M = 15 (padding rows), windows 3, 8, 40 and 2048 beside full
/// layers, and 5600-row contexts. Both backends take the CPU forward's o and lse, so only the
/// backward is compared; all five gradients go into NaN-filled buffers (every element must be
/// written), padded blocks must get exact zeros, and each form must be bit-identical from run to
/// run.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_drafter_backward_forms_match_cpu() {
    use dflash_engine::backend::cuda::AttnForm;
    let (g, c) = (gpu(), CpuBackend::new());
    let long_anchors: Vec<i32> = (0..24)
        .map(|i| {
            if i == 5 {
                -1
            } else if i == 23 {
                2800
            } else {
                (i % 11) * 250 + 7
            }
        })
        .collect();
    let long_starts: Vec<i32> = (0..24).map(|i| if i < 11 { 0 } else { 2800 }).collect();
    let (anchors, starts) = (vec![0, 17, 100, 5, 3, 50, -1], vec![0, 0, 0, 100, 100, 100, 100]);
    #[allow(clippy::type_complexity)]
    let cases: Vec<(usize, usize, usize, usize, Vec<i32>, Vec<i32>, Vec<Option<usize>>)> = vec![
        (16, 32, 8, 150, anchors.clone(), starts.clone(), vec![None, Some(8), Some(3)]),
        (5, 6, 2, 150, anchors, starts, vec![None, Some(40)]),
        (16, 32, 8, 5600, long_anchors, long_starts, vec![None, Some(2048), Some(3)]),
    ];
    type Grads = Vec<Vec<f32>>;
    // The five gradients (dq, dkc, dvc, dkb, dvb) of one backward on backend `be`, from the
    // inputs t = [q, kc, vc, kb, vb, d_o] and the forward's o and lse.
    fn bwd<B: Backend>(
        be: &B,
        sh: &DraftAttnShape,
        t: &[Vec<f32>; 6],
        fwd: &(Vec<f32>, Vec<f32>),
        anchors: &[i32],
        starts: &[i32],
        launch: impl Fn(&B, &B::Stream, &[B::Buf], &B::Ids, &B::Ids, &B::Buf, &B::Buf, [&mut B::Buf; 5]),
    ) -> Grads {
        let s = be.compute_stream();
        let b: Vec<B::Buf> = t.iter().map(|v| put(be, v, DType::BF16)).collect();
        let (o, lse) = (put(be, &fwd.0, DType::BF16), put(be, &fwd.1, DType::F32));
        let kw = sh.kv_heads * sh.head_dim;
        let sizes = [
            sh.q_rows() * sh.heads * sh.head_dim,
            sh.ctx_rows * kw,
            sh.ctx_rows * kw,
            sh.q_rows() * kw,
            sh.q_rows() * kw,
        ];
        // NaN-filled: an element the kernels fail to write shows up as NaN and fails rel_err.
        let mut gr: Vec<B::Buf> = sizes.iter().map(|&n| put(be, &vec![f32::NAN; n], DType::BF16)).collect();
        {
            let [g0, g1, g2, g3, g4] = &mut gr[..] else { unreachable!() };
            launch(be, &s, &b, &ids(be, anchors), &ids(be, starts), &o, &lse, [g0, g1, g2, g3, g4]);
        }
        gr.iter().map(|x| get(be, x)).collect()
    }
    for (bs, heads, kvh, ctx_rows, anchors, starts, windows) in cases {
        let hd = 128;
        for window in windows {
            let sh = DraftAttnShape {
                num_blocks: anchors.len(),
                block_size: bs,
                ctx_rows,
                heads,
                kv_heads: kvh,
                head_dim: hd,
                window,
            };
            let (qn, kn, kbn) = (sh.q_rows() * heads * hd, ctx_rows * kvh * hd, sh.q_rows() * kvh * hd);
            let t = [
                rand(qn, 280, 1.0),
                rand(kn, 281, 1.0),
                rand(kn, 282, 1.0),
                rand(kbn, 283, 1.0),
                rand(kbn, 284, 1.0),
                rand(qn, 285, 1.0),
            ];
            // The CPU forward's o and lse feed both backends.
            let fwd = {
                let s = c.compute_stream();
                let b: Vec<_> = t[..5].iter().map(|v| put(&c, v, DType::BF16)).collect();
                let mut o = c.alloc(&s, DType::BF16, qn).unwrap();
                let mut lse = c.alloc(&s, DType::F32, sh.q_rows() * heads).unwrap();
                let (a, st) = (ids(&c, &anchors), ids(&c, &starts));
                c.attn_draft_fwd(&s, &sh, &b[0], &b[1], &b[2], &b[3], &b[4], &a, &st, &mut o, &mut lse).unwrap();
                (get(&c, &o), get(&c, &lse))
            };
            let want = bwd(&c, &sh, &t, &fwd, &anchors, &starts, |be, s, b, a, st, o, lse, gr| {
                be.attn_draft_bwd(s, &sh, &b[0], &b[1], &b[2], &b[3], &b[4], a, st, o, lse, &b[5], gr).unwrap()
            });
            let gpu_bwd = |form: AttnForm| {
                bwd(&g, &sh, &t, &fwd, &anchors, &starts, |be, s, b, a, st, o, lse, gr| {
                    be.attn_draft_bwd_with(form, s, &sh, &b[0], &b[1], &b[2], &b[3], &b[4], a, st, o, lse, &b[5], gr)
                        .unwrap()
                })
            };
            let mut by_form = Vec::new();
            for form in [AttnForm::Mma, AttnForm::Wgmma, AttnForm::WarpSpecialized] {
                assert!(form.takes_draft(&sh), "{form:?} takes bs {bs}, {heads}/{kvh} heads");
                let what = format!("{form:?} drafter bwd bs {bs} {heads}/{kvh} ctx {ctx_rows} window {window:?}");
                let got = gpu_bwd(form);
                for (i, name) in ["dq", "dkc", "dvc", "dkb", "dvb"].iter().enumerate() {
                    rel_err(&format!("{what} {name}"), &got[i], &want[i], ATTN_TOL);
                }
                let again = gpu_bwd(form);
                for (i, name) in ["dq", "dkc", "dvc", "dkb", "dvb"].iter().enumerate() {
                    bits_equal(&format!("{what} rerun {name}"), &again[i], &got[i]);
                }
                // Padded blocks: exact zeros out of dq, dkb and dvb.
                let (w, kw) = (heads * hd, kvh * hd);
                for (j, &a) in anchors.iter().enumerate() {
                    if a < 0 {
                        assert!(got[0][j * bs * w..(j + 1) * bs * w].iter().all(|&x| x == 0.0), "{what}: dq {j}");
                        for (i, name) in [(3, "dkb"), (4, "dvb")] {
                            assert!(
                                got[i][j * bs * kw..(j + 1) * bs * kw].iter().all(|&x| x == 0.0),
                                "{what}: {name} {j}"
                            );
                        }
                    }
                }
                by_form.push(got);
            }
            // The warp-specialised context-key kernel computes the warpgroup one's products in the
            // same order (only the copies differ), and both share the query-side kernel: every
            // gradient bit for bit.
            for (i, name) in ["dq", "dkc", "dvc", "dkb", "dvb"].iter().enumerate() {
                let what = format!("WarpSpecialized vs Wgmma bs {bs} {heads}/{kvh} ctx {ctx_rows} window {window:?}");
                bits_equal(&format!("{what} {name}"), &by_form[2][i], &by_form[1][i]);
            }
        }
    }
}

/// Sliding-window drafter layers (DFLASH.md section 3) against the CPU, forward and backward,
/// at the window edges: W = 1 (no context, the block's slot 0 only for slot 0), W < block size
/// (late slots see no context), W around the 64-key tile (63, 64, 65: the first tile starts
/// mid-tile), W longer than every context (= a full layer's context with a causal block), and
/// the recipe's 2048 over 3000-row contexts; anchors at 0, mid-sequence, late, and padded blocks.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_sliding_drafter_attention_matches_cpu() {
    let (g, c) = (gpu(), CpuBackend::new());
    #[allow(clippy::type_complexity)]
    let cases: [(usize, usize, usize, usize, usize, &[usize]); 4] = [
        (128, 16, 32, 8, 150, &[1, 5, 63, 64, 65, 200]),
        (64, 5, 6, 2, 150, &[2, 17]),
        (16, 16, 4, 2, 150, &[15, 16, 130]),
        (128, 16, 32, 8, 3000, &[2048]),
    ];
    for (hd, bs, heads, kvh, ctx_rows, windows) in cases {
        let half = ctx_rows / 2 + 10;
        let anchors = vec![0, 17, 99, -1, 3, 49, -1, (half - 11) as i32, (ctx_rows - half - 1) as i32];
        let starts = vec![0, 0, 0, 0, 0, 0, 0, 0, half as i32];
        for &w in windows {
            let sh = DraftAttnShape {
                num_blocks: anchors.len(),
                block_size: bs,
                ctx_rows,
                heads,
                kv_heads: kvh,
                head_dim: hd,
                window: Some(w),
            };
            let (qn, kn, kb) = (sh.q_rows() * heads * hd, ctx_rows * kvh * hd, sh.q_rows() * kvh * hd);
            let seed = 90 + w as u64;
            let t = [
                rand(qn, seed, 1.0),
                rand(kn, seed + 1, 1.0),
                rand(kn, seed + 2, 1.0),
                rand(kb, seed + 3, 1.0),
                rand(kb, seed + 4, 1.0),
                rand(qn, seed + 5, 1.0),
            ];
            let (a, b) = (g.draft(&sh, &t, &anchors, &starts), c.draft(&sh, &t, &anchors, &starts));
            for (i, name) in ["o", "lse", "dq", "dkc", "dvc", "dkb", "dvb"].iter().enumerate() {
                rel_err(
                    &format!("sliding drafter attention {name} W {w} hd {hd} bs {bs} {heads}/{kvh} ctx {ctx_rows}"),
                    &a[i],
                    &b[i],
                    if i == 1 { 1e-5 } else { ATTN_TOL },
                );
            }
            let width = heads * hd;
            assert!(a[0][3 * bs * width..4 * bs * width].iter().all(|&x| x == 0.0), "padded block: zeros");
            // Context rows outside every window get exactly zero gradient (never NaN).
            assert!(a[3].iter().chain(&a[4]).all(|x| x.is_finite()));
        }
    }
}

/// The decoding attention (kernels/decode.cu: split-K over the cache, then a combine) against
/// the CPU, in both of its uses: a batch of sequences at one step (rows `max_len` apart in the
/// cache) and consecutive rows of one sequence (causal over the cache). Every head dim a preset
/// uses, groups of 1 to 6 query heads per kv head, one key (the row's own) up to 1,500 (many
/// splits, a last split cut short). o within bf16 rounding, lse within f32 rounding; run twice,
/// bit-identical.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attn_decode_matches_cpu() {
    use dflash_engine::backend::cuda::DecodeTuning;
    use dflash_engine::backend::DecodeAttnShape;
    let (g, c) = (gpu(), CpuBackend::new());
    // (rows, heads, kv_heads, hd, row_stride, len0, len_inc)
    let cases = [
        (64, 32, 8, 128, 300, 257, 0), // Qwen3-8B decoding, batch 64 at step 256
        (1, 32, 8, 128, 0, 1, 0),      // the first token: its own key alone
        (1, 32, 8, 128, 0, 1500, 0),   // batch 1, a long context: many splits
        (16, 32, 8, 128, 0, 700, 1),   // verifying a block of 16 from position 699
        (3, 24, 4, 256, 40, 33, 0),    // Qwen3.6 full attention (6 heads per kv head)
        (8, 24, 4, 256, 0, 100, 1),
        (5, 4, 2, 16, 20, 9, 0), // the tiny presets
        (4, 8, 4, 32, 0, 3, 1),
        (6, 8, 2, 64, 0, 60, 1),   // qwen3.5-small
        (2, 32, 2, 64, 90, 77, 0), // 16 query heads per kv head: every row of the MMA tile
    ];
    // The two default splits and a fine one (1 to 4 warps per CTA, one split or many, partial last
    // tiles).
    let tunings = [DecodeTuning { ctas_per_sm: 2 }, DecodeTuning { ctas_per_sm: 1 }, DecodeTuning { ctas_per_sm: 64 }];
    for (i, &(rows, heads, kv_heads, hd, row_stride, len0, len_inc)) in cases.iter().enumerate() {
        let sh = DecodeAttnShape { rows, heads, kv_heads, head_dim: hd, row_stride, len0, len_inc };
        let cache = sh.cache_rows() + 3;
        let q = rand(rows * heads * hd, 100 + i as u64, 1.0);
        let k = rand(cache * kv_heads * hd, 200 + i as u64, 1.0);
        let v = rand(cache * kv_heads * hd, 300 + i as u64, 1.0);
        let (co, cl) = c.decode(&sh, &q, &k, &v);
        let (go, gl) = g.decode(&sh, &q, &k, &v);
        for t in tunings {
            let what =
                format!("attn_decode {t:?} {rows} rows, {heads}/{kv_heads} heads, hd {hd}, len {len0}+{len_inc}r");
            let (to, tl) = decode_tuned(&g, &sh, &q, &k, &v, t);
            rel_err(&format!("{what}: o"), &to, &co, super::BF16_TOL);
            rel_err(&format!("{what}: lse"), &tl, &cl, 1e-5);
            let (to2, tl2) = decode_tuned(&g, &sh, &q, &k, &v, t);
            super::bits_equal(&format!("{what}: rerun o"), &to2, &to);
            super::bits_equal(&format!("{what}: rerun lse"), &tl2, &tl);
            if t == DecodeTuning::for_head_dim(hd) {
                super::bits_equal(&format!("{what}: the trait's o"), &go, &to);
                super::bits_equal(&format!("{what}: the trait's lse"), &gl, &tl);
            }
        }
    }
}

/// `attn_decode_with` on the GPU, returning o and lse.
fn decode_tuned(
    g: &dflash_engine::backend::cuda::CudaBackend,
    sh: &dflash_engine::backend::DecodeAttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t: dflash_engine::backend::cuda::DecodeTuning,
) -> (Vec<f32>, Vec<f32>) {
    let s = g.compute_stream();
    let mut o = g.alloc(&s, DType::BF16, sh.rows * sh.heads * sh.head_dim).unwrap();
    let mut lse = g.alloc(&s, DType::F32, sh.rows * sh.heads).unwrap();
    let (q, k, v) = (put(g, q, DType::BF16), put(g, k, DType::BF16), put(g, v, DType::BF16));
    g.attn_decode_with(&s, sh, &q, &k, &v, &mut o, &mut lse, t).unwrap();
    (get(g, &o), get(g, &lse))
}

trait DecodeTest {
    fn decode(
        &self,
        sh: &dflash_engine::backend::DecodeAttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> (Vec<f32>, Vec<f32>);
}

impl<B: Backend> DecodeTest for B {
    fn decode(
        &self,
        sh: &dflash_engine::backend::DecodeAttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> (Vec<f32>, Vec<f32>) {
        let s = self.compute_stream();
        let mut o = self.alloc(&s, DType::BF16, sh.rows * sh.heads * sh.head_dim).unwrap();
        let mut lse = self.alloc(&s, DType::F32, sh.rows * sh.heads).unwrap();
        let (q, k, v) = (put(self, q, DType::BF16), put(self, k, DType::BF16), put(self, v, DType::BF16));
        self.attn_decode(&s, sh, &q, &k, &v, &mut o, &mut lse).unwrap();
        (get(self, &o), get(self, &lse))
    }
}
