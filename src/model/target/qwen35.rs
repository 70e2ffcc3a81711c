//! Qwen3.5/3.6 dense hybrid (QWEN35.md): decoder layers whose token mixer is a Gated DeltaNet
//! (linear attention) or a gated full attention, as `layer_types` says; every RMSNorm but the
//! DeltaNet's output norm is `1 + w`; full attention rotates only the first
//! `head_dim * partial_rotary_factor` dims.
//!
//! Rounding follows a bf16 Hugging Face forward where it costs little: every projection but the
//! DeltaNet's `in_proj_qkv`, beta, the DeltaNet output and each norm round to bf16; the output
//! projections (`o_proj`, `out_proj`, `down_proj`) add themselves to the residual stream in their
//! GEMMs' epilogue, one rounding of the sum (transformers rounds the product, then the sum). The
//! DeltaNet's `in_proj_qkv` output, its convolution output and the q/k/v split (and the decode
//! cache of convolution inputs), the L2-normalised q and k, the log decays `g` and the recurrent
//! state stay f32: rounding the convolution's input and output to bf16 (as transformers does) is
//! the largest error of the layer.

use super::{
    add_projection, attend, input_norm, names, place_kv, positions, to_i32, Attend, Extend, ExtendUndo, Family,
    KvCache, LayerCache, LinearUndo, Target, TargetInputs, TargetShape,
};
use crate::backend::fused::{GdnConvQkv, GdnOutNorm, NormRope};
use crate::backend::{Backend, GdnShape, Gemm, OutGate, Result, GDN_CHUNK};
use crate::config::{Arch, HybridConfig, LayerType};
use crate::model::ParamTable;
use crate::tensor::DType;
use crate::weights::{hybrid_layer_specs, HybridTensor};

pub(super) struct Qwen35;

/// The eps of the per-head L2 norm of q and k (fixed in transformers and flash-linear-attention).
const L2NORM_EPS: f32 = 1e-6;

fn hybrid(sh: &TargetShape) -> &HybridConfig {
    match &sh.arch {
        Arch::Qwen35(hy) => hy,
        Arch::Qwen3 => unreachable!("the Qwen3.5 family runs Qwen3.5 shapes only"),
    }
}

impl<B: Backend> Family<B> for Qwen35 {
    fn param_table(&self, shape: &TargetShape, last: usize) -> ParamTable {
        let (hy, dims) = (hybrid(shape), shape.layer_dims());
        let mut t = ParamTable::default();
        t.push(names::EMBED, &[shape.vocab, shape.hidden]);
        for l in 0..=last {
            for spec in hybrid_layer_specs(l, &dims, hy) {
                // Up right after gate: the MLP's first projection is one [2 * inter, hidden] GEMM;
                // likewise a right after b, the Gated DeltaNet's gate inputs as one [2 * heads,
                // hidden] GEMM.
                if spec.name.ends_with(HybridTensor::UpProj.suffix())
                    || spec.name.ends_with(HybridTensor::InProjA.suffix())
                {
                    t.push_adjacent(spec.name, &spec.shape);
                } else {
                    t.push(spec.name, &spec.shape);
                }
            }
        }
        t.push(names::FINAL_NORM, &[shape.hidden]);
        t.push(names::LM_HEAD, &[shape.vocab, shape.hidden]);
        t
    }

    fn forward_taps(
        &self,
        t: &Target<B>,
        be: &B,
        s: &B::Stream,
        inp: &TargetInputs<'_, B>,
        taps_out: &mut [B::Buf],
    ) -> Result<()> {
        let (rows, h, last) = (inp.rows, t.shape.hidden, t.last_layer());
        let mut sc = Scratch::new(be, s, &t.shape, rows, false)?;
        let mut x = be.alloc_uninit(s, DType::BF16, rows * h)?;
        be.embed(s, &t.weights, t.table.off(names::EMBED), inp.ids, &mut x, rows, h)?;
        be.rmsnorm1p_fwd(s, &x, &t.weights, input_norm(t, 0), &mut sc.xn, rows, h, t.shape.eps)?;
        for l in 0..=last {
            let next = (l < last).then(|| input_norm(t, l + 1));
            layer(t, be, s, l, &mut x, &mut sc, inp.pos, Run::Packed { seq_starts: inp.seq_starts }, next)?;
            t.copy_taps(be, s, l, &x, rows, taps_out)?;
        }
        Ok(())
    }

    fn new_cache(&self, t: &Target<B>, be: &B, s: &B::Stream, batch: usize, max_len: usize) -> Result<KvCache<B>> {
        let (sh, hy) = (&t.shape, hybrid(&t.shape));
        let mut layers = Vec::new();
        for l in 0..t.loaded_layers {
            layers.push(match hy.layer_types[l] {
                LayerType::Full => {
                    let n = batch * max_len * sh.kv_width();
                    LayerCache::Attention { k: be.alloc(s, DType::BF16, n)?, v: be.alloc(s, DType::BF16, n)? }
                }
                LayerType::Linear => LayerCache::Linear {
                    qkv: be.alloc(s, DType::F32, batch * max_len * hy.conv_dim())?,
                    state: be.alloc(
                        s,
                        DType::F32,
                        batch * hy.linear_num_value_heads * hy.linear_key_head_dim * hy.linear_value_head_dim,
                    )?,
                },
            });
        }
        Ok(KvCache { layers, batch, max_len })
    }

    fn decode_step(
        &self,
        t: &Target<B>,
        be: &B,
        s: &B::Stream,
        cache: &mut KvCache<B>,
        tokens: &B::Ids,
        step: usize,
        logits: &mut B::Buf,
    ) -> Result<()> {
        let (sh, hy) = (&t.shape, hybrid(&t.shape));
        let (n, h, max_len) = (cache.batch, sh.hidden, cache.max_len);
        let k = hy.linear_conv_kernel_dim;
        let w = &t.weights;
        let pos = positions(be, s, "decode_step", std::iter::repeat_n(step, n))?;
        let to_i32 = |x: usize| {
            i32::try_from(x)
                .map_err(|_| crate::backend::BackendError::Shape { op: "decode_step", what: format!("{x} rows") })
        };
        // The convolution window of each sequence is a sequence of its own (k rows), and each
        // sequence's token is a sequence of one row for the recurrent step.
        let mut win_starts = be.alloc_ids(s, n + 1)?;
        be.upload_ids(s, &(0..=n).map(|b| to_i32(b * k)).collect::<Result<Vec<_>>>()?, &mut win_starts)?;
        let mut one_starts = be.alloc_ids(s, n + 1)?;
        be.upload_ids(s, &(0..=n).map(to_i32).collect::<Result<Vec<_>>>()?, &mut one_starts)?;
        let mut win = be.alloc(s, DType::F32, n * k * hy.conv_dim())?;
        let mut win_out = be.alloc(s, DType::F32, n * k * hy.conv_dim())?;
        let mut sc = Scratch::new(be, s, sh, n, true)?;
        let mut x = be.alloc(s, DType::BF16, n * h)?;
        be.embed(s, w, t.table.off(names::EMBED), tokens, &mut x, n, h)?;
        be.rmsnorm1p_fwd(s, &x, w, input_norm(t, 0), &mut sc.xn, n, h, sh.eps)?;
        let layers = cache.layers.len();
        for (l, lc) in cache.layers.iter_mut().enumerate() {
            let run = Run::Decode {
                cache: lc,
                step,
                max_len,
                win: &mut win,
                win_out: &mut win_out,
                win_starts: &win_starts,
                one_starts: &one_starts,
            };
            // After the last layer, the final norm (the logits' input).
            let next = if l + 1 < layers { input_norm(t, l + 1) } else { t.table.off(names::FINAL_NORM) };
            layer(t, be, s, l, &mut x, &mut sc, &pos, run, Some(next))?;
        }
        be.gemm(s, &Gemm::linear(n, sh.vocab, h), &sc.xn, 0, w, t.table.off(names::LM_HEAD), logits, 0)
    }

    fn extend(
        &self,
        t: &Target<B>,
        be: &B,
        s: &B::Stream,
        cache: &mut KvCache<B>,
        mut x: Extend<'_, B>,
        logits: &mut B::Buf,
    ) -> Result<ExtendUndo<B>> {
        let (rows, h) = (x.rows, t.shape.hidden);
        let pad = hybrid(&t.shape).linear_conv_kernel_dim - 1;
        let pos = positions(be, s, "extend", x.start..x.start + rows)?;
        // The rows are one sequence for the delta rule, and (after `pad` earlier inputs) one
        // sequence for the convolution.
        let mut one_seq = be.alloc_ids(s, 2)?;
        be.upload_ids(s, &[0, to_i32("extend", rows)?], &mut one_seq)?;
        let mut win_seq = be.alloc_ids(s, 2)?;
        be.upload_ids(s, &[0, to_i32("extend", pad + rows)?], &mut win_seq)?;
        let mut sc = Scratch::new(be, s, &t.shape, rows, true)?;
        let mut hs = be.alloc(s, DType::BF16, rows * h)?;
        be.embed(s, &t.weights, t.table.off(names::EMBED), x.tokens, &mut hs, rows, h)?;
        be.rmsnorm1p_fwd(s, &hs, &t.weights, input_norm(t, 0), &mut sc.xn, rows, h, t.shape.eps)?;
        let layers = cache.layers.len();
        let mut undo = ExtendUndo { rows, layers: Vec::with_capacity(layers) };
        for (l, lc) in cache.layers.iter_mut().enumerate() {
            let mut u = None;
            let run = Run::Extend { cache: lc, start: x.start, one_seq: &one_seq, win_seq: &win_seq, undo: &mut u };
            let next = (l + 1 < layers).then(|| input_norm(t, l + 1));
            layer(t, be, s, l, &mut hs, &mut sc, &pos, run, next)?;
            undo.layers.push(u);
            if let Some(taps) = x.taps_out.as_deref_mut() {
                t.copy_taps(be, s, l, &hs, rows, taps)?;
            }
        }
        t.extend_logits(be, s, &hs, &x, true, logits)?;
        Ok(undo)
    }
}

/// How a layer runs: over a packed batch (taps), one token per sequence over a cache, or
/// consecutive rows of one sequence over a batch-1 cache.
enum Run<'a, B: Backend> {
    Packed {
        seq_starts: &'a B::Ids,
    },
    Decode {
        cache: &'a mut LayerCache<B>,
        step: usize,
        max_len: usize,
        /// `[batch * kernel, conv channels]`: each sequence's last `kernel` convolution inputs.
        win: &'a mut B::Buf,
        win_out: &'a mut B::Buf,
        win_starts: &'a B::Ids,
        one_starts: &'a B::Ids,
    },
    Extend {
        cache: &'a mut LayerCache<B>,
        start: usize,
        /// `[0, rows]`: the rows as one sequence.
        one_seq: &'a B::Ids,
        /// `[0, kernel - 1 + rows]`: the convolution window (earlier inputs, then the rows).
        win_seq: &'a B::Ids,
        /// Set by a Gated DeltaNet layer: its state before these rows and their delta-rule inputs.
        undo: &'a mut Option<LinearUndo<B>>,
    },
}

/// One decoder layer on `x [rows, hidden]` (QWEN35.md section 5), from `sc.xn` holding its input
/// norm of `x`. The token mixer's and the MLP's output projections add themselves to `x` (the
/// residual adds ride on their GEMMs, [`add_projection`]: `x` and `sc.x2` trade places twice, so
/// `x` is the caller's buffer again after the layer); the post-attention norm, then `next_norm` (the next
/// layer's input norm, or the final norm) write `sc.xn`.
#[allow(clippy::too_many_arguments)]
fn layer<B: Backend>(
    t: &Target<B>,
    be: &B,
    s: &B::Stream,
    l: usize,
    x: &mut B::Buf,
    sc: &mut Scratch<B>,
    pos: &B::Ids,
    run: Run<'_, B>,
    next_norm: Option<usize>,
) -> Result<()> {
    let sh = &t.shape;
    let (rows, h) = (sc.rows, sh.hidden);
    let w = &t.weights;
    let off = |part: &str| t.table.off(&names::layer(l, part));
    match hybrid(sh).layer_types[l] {
        LayerType::Full => gated_attention(t, be, s, l, x, sc, pos, run)?,
        LayerType::Linear => gated_delta_net(t, be, s, l, x, sc, run)?,
    }
    let post = off("post_attention_layernorm.weight");
    be.rmsnorm1p_fwd(s, x, w, post, &mut sc.xn, rows, h, sh.eps)?;
    be.mlp_gate_up_act(s, &sc.xn, w, off("mlp.gate_proj.weight"), &mut sc.act, None, rows, sh.inter, h)?;
    add_projection(be, s, (rows, h, sh.inter), &sc.act, w, off("mlp.down_proj.weight"), x, &mut sc.x2)?;
    match next_norm {
        Some(norm) => be.rmsnorm1p_fwd(s, x, w, norm, &mut sc.xn, rows, h, sh.eps),
        None => Ok(()),
    }
}

/// Gated full attention (QWEN35.md section 3) on `sc.xn`, added to `x`.
#[allow(clippy::too_many_arguments)]
fn gated_attention<B: Backend>(
    t: &Target<B>,
    be: &B,
    s: &B::Stream,
    l: usize,
    x: &mut B::Buf,
    sc: &mut Scratch<B>,
    pos: &B::Ids,
    run: Run<'_, B>,
) -> Result<()> {
    let sh = &t.shape;
    let (rows, h, qw, kw) = (sc.rows, sh.hidden, sh.q_width(), sh.kv_width());
    let (heads, kv_heads, hd) = (sh.heads, sh.kv_heads, sh.head_dim);
    let rot = hybrid(sh).rotary_dim(hd);
    let w = &t.weights;
    let off = |part: &str| t.table.off(&names::layer(l, part));
    // q_proj rows are head-major [q_0 | gate_0 | q_1 | gate_1 | ...]: the query halves are
    // normalised and rotated where they lie, the gate halves read in place by the output gate.
    be.gemm(s, &Gemm::linear(rows, 2 * qw, h), &sc.xn, 0, w, off("self_attn.q_proj.weight"), &mut sc.qg, 0)?;
    be.gemm(s, &Gemm::linear(rows, kw, h), &sc.xn, 0, w, off("self_attn.k_proj.weight"), &mut sc.k_pre, 0)?;
    be.gemm(s, &Gemm::linear(rows, kw, h), &sc.xn, 0, w, off("self_attn.v_proj.weight"), &mut sc.v, 0)?;
    let norm_rope = |heads: usize, x_stride: usize, w_off: usize| NormRope {
        rows,
        heads,
        head_dim: hd,
        rot_dim: rot,
        theta: sh.rope_theta,
        eps: sh.eps,
        x_off: 0,
        x_stride,
        w_off,
    };
    let q_nr = norm_rope(heads, 2 * hd, off("self_attn.q_norm.weight"));
    be.rmsnorm1p_rope_partial(s, &q_nr, &sc.qg, w, &mut sc.q, pos)?;
    let k_nr = norm_rope(kv_heads, hd, off("self_attn.k_norm.weight"));
    be.rmsnorm1p_rope_partial(s, &k_nr, &sc.k_pre, w, &mut sc.k, pos)?;
    let mut how = match run {
        Run::Packed { seq_starts } => Attend::Causal(seq_starts),
        Run::Decode { cache: LayerCache::Attention { k, v }, step, max_len, .. } => {
            Attend::Cached { k, v, max_len, step }
        }
        Run::Extend { cache: LayerCache::Attention { k, v }, start, .. } => Attend::Extend { k, v, start },
        Run::Decode { .. } | Run::Extend { .. } => unreachable!("a full-attention layer has an attention cache"),
    };
    place_kv(be, s, &mut how, sh, rows, &sc.k, &sc.v)?;
    // The output gate: head row i's gate half of q_proj, read in place.
    let gate = OutGate { buf: &sc.qg, off: hd, stride: 2 * hd };
    match how {
        // A packed batch: the gate rides on the attention kernel's epilogue where it can.
        Attend::Causal(seq_starts) => {
            be.attn_causal_gated_fwd(s, &sc.q, &sc.k, &sc.v, &mut sc.o, seq_starts, rows, heads, kv_heads, hd, gate)?
        }
        how => {
            attend(be, s, how, sh, rows, &sc.q, &sc.k, &sc.v, &mut sc.o, &mut sc.lse)?;
            be.sigmoid_mul_strided(s, &mut sc.o, gate.buf, gate.off, gate.stride, rows * heads, hd)?;
        }
    }
    add_projection(be, s, (rows, h, qw), &sc.o, w, off("self_attn.o_proj.weight"), x, &mut sc.x2)
}

/// Gated DeltaNet (QWEN35.md section 4) on `sc.xn`, added to `x`: chunked over a packed batch,
/// one recurrent step per sequence when decoding.
fn gated_delta_net<B: Backend>(
    t: &Target<B>,
    be: &B,
    s: &B::Stream,
    l: usize,
    x: &mut B::Buf,
    sc: &mut Scratch<B>,
    run: Run<'_, B>,
) -> Result<()> {
    let (sh, hy) = (&t.shape, hybrid(&t.shape));
    let (rows, h) = (sc.rows, sh.hidden);
    let (c, kd, vd, kernel) = (hy.conv_dim(), hy.key_dim(), hy.value_dim(), hy.linear_conv_kernel_dim);
    let (hk, hv, dk, dv) =
        (hy.linear_num_key_heads, hy.linear_num_value_heads, hy.linear_key_head_dim, hy.linear_value_head_dim);
    let w = &t.weights;
    let off = |part: &str| t.table.off(&names::layer(l, part));
    be.gemm(s, &Gemm::linear(rows, c, h), &sc.xn, 0, w, off("linear_attn.in_proj_qkv.weight"), &mut sc.qkv, 0)?;
    be.gemm(s, &Gemm::linear(rows, vd, h), &sc.xn, 0, w, off("linear_attn.in_proj_z.weight"), &mut sc.z, 0)?;
    // b | a per row: in_proj_a's weights follow in_proj_b's (param_table).
    be.gemm(s, &Gemm::linear(rows, 2 * hv, h), &sc.xn, 0, w, off("linear_attn.in_proj_b.weight"), &mut sc.ba, 0)?;
    let conv_w = off("linear_attn.conv1d.weight");
    let gsh = GdnShape { rows, k_heads: hk, v_heads: hv, k_dim: dk, v_dim: dv };
    let q_scale = 1.0 / (dk as f32).sqrt();
    // The convolution, the split and the norms; then the gates; then the delta rule.
    let core = match run {
        Run::Packed { seq_starts } => {
            let cq = GdnConvQkv {
                rows,
                k_heads: hk,
                k_dim: dk,
                value_dim: vd,
                kernel,
                w_off: conv_w,
                eps: L2NORM_EPS,
                q_scale,
            };
            be.gdn_conv_qkv(s, &cq, &sc.qkv, w, seq_starts, &mut sc.qn, &mut sc.kn, &mut sc.lv)?;
            Core::<B>::Chunked(seq_starts)
        }
        Run::Decode {
            cache: LayerCache::Linear { qkv, state },
            step,
            max_len,
            win,
            win_out,
            win_starts,
            one_starts,
            ..
        } => {
            // Append this token's inputs, gather each sequence's last `kernel` inputs (zeros
            // before its start), convolve them, keep the last row.
            // One strided copy per window slot over all sequences (row b at b * max_len).
            be.copy_strided(s, &sc.qkv, 0, c, qkv, step * c, max_len * c, rows, c)?;
            be.fill(s, win, 0.0)?;
            for j in 0..kernel {
                if step + 1 + j >= kernel {
                    let p = step + 1 + j - kernel;
                    be.copy_strided(s, qkv, p * c, max_len * c, win, j * c, kernel * c, rows, c)?;
                }
            }
            be.causal_conv1d_silu(s, win, w, conv_w, win_out, win_starts, rows * kernel, c, kernel)?;
            let conv = sc.conv.as_mut().expect("a cached run's scratch has the convolution's rows");
            be.copy_strided(s, win_out, (kernel - 1) * c, kernel * c, conv, 0, c, rows, c)?;
            Core::Recurrent(state, one_starts)
        }
        Run::Extend { cache: LayerCache::Linear { qkv, state }, start, one_seq, win_seq, undo, .. } => {
            // Append the rows' inputs; convolve them after the `kernel - 1` inputs before
            // `start` (zeros before the sequence start), keep the rows' outputs.
            let pad = kernel - 1;
            be.copy(s, &sc.qkv, 0, qkv, start * c, rows * c)?;
            let first = start.saturating_sub(pad);
            let mut win = be.alloc(s, DType::F32, (pad + rows) * c)?;
            be.copy(s, qkv, first * c, &mut win, (pad - (start - first)) * c, (start + rows - first) * c)?;
            let mut win_out = be.alloc(s, DType::F32, (pad + rows) * c)?;
            be.causal_conv1d_silu(s, &win, w, conv_w, &mut win_out, win_seq, pad + rows, c, kernel)?;
            let conv = sc.conv.as_mut().expect("a cached run's scratch has the convolution's rows");
            be.copy(s, &win_out, pad * c, conv, 0, rows * c)?;
            Core::Carried { state, seq: one_seq, undo }
        }
        Run::Decode { .. } | Run::Extend { .. } => unreachable!("a linear-attention layer has a recurrent cache"),
    };
    if let Some(conv) = &sc.conv {
        // The cached runs' split and norms (the packed run's came with its convolution).
        let raw = sc.raw.as_mut().expect("a cached run's scratch has the split's rows");
        be.copy_strided(s, conv, 0, c, raw, 0, kd, rows, kd)?;
        be.l2norm_fwd(s, raw, &mut sc.qn, rows * hk, dk, L2NORM_EPS, q_scale)?;
        be.copy_strided(s, conv, kd, c, raw, 0, kd, rows, kd)?;
        be.l2norm_fwd(s, raw, &mut sc.kn, rows * hk, dk, L2NORM_EPS, 1.0)?;
        be.copy_strided(s, conv, 2 * kd, c, &mut sc.lv, 0, vd, rows, vd)?;
    }
    let (a_log, dt_bias) = (off("linear_attn.A_log"), off("linear_attn.dt_bias"));
    be.gdn_gates_ba(s, &sc.ba, w, a_log, dt_bias, &mut sc.beta, &mut sc.g, rows, hv)?;
    let (q, k, v, g, beta) = (&sc.qn, &sc.kn, &sc.lv, &sc.g, &sc.beta);
    let norm_w = off("linear_attn.norm.weight");
    let normed = match core {
        Core::Chunked(seq_starts) => {
            // The delta rule and its gated output norm in one call (fused where the backend can).
            let norm = GdnOutNorm { w_off: norm_w, eps: sh.eps };
            let qkvgb = [q, k, v, g, beta];
            be.gdn_chunked_norm_fwd(s, &gsh, qkvgb, seq_starts, None, &sc.z, w, &norm, &mut sc.core, &mut sc.y)?;
            true
        }
        Core::Recurrent(state, starts) => {
            be.gdn_recurrent_fwd(s, &gsh, q, k, v, g, beta, starts, &mut sc.core, Some(state))?;
            false
        }
        Core::Carried { state, seq, undo } => {
            let keep = |x: &B::Buf| -> Result<B::Buf> {
                let mut c = be.alloc(s, be.dtype(x), be.len(x))?;
                be.copy(s, x, 0, &mut c, 0, be.len(x))?;
                Ok(c)
            };
            *undo = Some(LinearUndo {
                shape: gsh,
                state: keep(state)?,
                q: keep(q)?,
                k: keep(k)?,
                v: keep(v)?,
                g: keep(g)?,
                beta: keep(beta)?,
            });
            // Below one chunk the recurrent form is the same work, and it is the step decoding
            // runs: a verified block then equals token-by-token decoding bit for bit.
            if rows < GDN_CHUNK {
                be.gdn_recurrent_fwd(s, &gsh, q, k, v, g, beta, seq, &mut sc.core, Some(state))?
            } else {
                be.gdn_chunked_fwd(s, &gsh, q, k, v, g, beta, seq, &mut sc.core, Some(state))?
            }
            false
        }
    };
    if !normed {
        be.gated_rmsnorm_fwd(s, &sc.core, &sc.z, w, norm_w, &mut sc.y, rows * hv, dv, sh.eps)?;
    }
    add_projection(be, s, (rows, h, vd), &sc.y, w, off("linear_attn.out_proj.weight"), x, &mut sc.x2)
}

/// Which form of the delta rule a Gated DeltaNet layer runs.
enum Core<'a, B: Backend> {
    /// Chunked over the packed batch's sequences, from a zero state.
    Chunked(&'a B::Ids),
    /// One token per sequence from the cached state (updated in place).
    Recurrent(&'a mut B::Buf, &'a B::Ids),
    /// Rows of one sequence from the cached state (updated in place), keeping what a rewind needs.
    Carried { state: &'a mut B::Buf, seq: &'a B::Ids, undo: &'a mut Option<LinearUndo<B>> },
}

/// Per-layer temporaries for either layer type, allocated once per forward.
struct Scratch<B: Backend> {
    rows: usize,
    xn: B::Buf,
    /// `[rows, hidden]`: the residual stream's second buffer ([`add_projection`]).
    x2: B::Buf,
    act: B::Buf,
    // Gated attention.
    qg: B::Buf,
    q: B::Buf,
    k_pre: B::Buf,
    k: B::Buf,
    v: B::Buf,
    o: B::Buf,
    lse: B::Buf,
    // Gated DeltaNet.
    qkv: B::Buf,
    /// The convolution's output and one key-width split of it: cached runs only (their
    /// convolution runs over windows; a packed run's convolution writes q, k, v directly).
    conv: Option<B::Buf>,
    raw: Option<B::Buf>,
    z: B::Buf,
    /// `[rows, 2 * value heads]`: `in_proj_b`'s outputs, then `in_proj_a`'s, per row.
    ba: B::Buf,
    lv: B::Buf,
    qn: B::Buf,
    kn: B::Buf,
    beta: B::Buf,
    g: B::Buf,
    core: B::Buf,
    y: B::Buf,
}

impl<B: Backend> Scratch<B> {
    fn new(be: &B, s: &B::Stream, sh: &TargetShape, t: usize, cached: bool) -> Result<Self> {
        let hy = hybrid(sh);
        // Every buffer is written in full before it is read (each layer's GEMMs and kernels write
        // all rows of what they produce). The kernels' outputs are left uninitialised; the GEMMs'
        // (`gemm`) are zero-filled, because compute-sanitizer's initcheck does not see every
        // cuBLASLt store (the f32-output GEMM's, scripts/sanitize.sh, and on the H200 the b | a
        // projection's too) and would report their readers. The MLP's gate | up output is not
        // among them (qwen3.rs says why).
        let bf = |n: usize| be.alloc_uninit(s, DType::BF16, n);
        let f32 = |n: usize| be.alloc_uninit(s, DType::F32, n);
        let gemm = |dt: DType, n: usize| be.alloc(s, dt, n);
        let (qw, kw, hv) = (sh.q_width(), sh.kv_width(), hy.linear_num_value_heads);
        Ok(Scratch {
            rows: t,
            xn: bf(t * sh.hidden)?,
            x2: gemm(DType::BF16, t * sh.hidden)?,
            act: bf(t * sh.inter)?,
            qg: gemm(DType::BF16, t * 2 * qw)?,
            q: bf(t * qw)?,
            k_pre: gemm(DType::BF16, t * kw)?,
            k: bf(t * kw)?,
            v: gemm(DType::BF16, t * kw)?,
            o: bf(t * qw)?,
            lse: f32(t * sh.heads)?,
            // The Gated DeltaNet's input projection, its convolution and the q/k/v split stay f32
            // (transformers rounds each to bf16): these roundings are the largest error of the
            // layer, and no GEMM reads them.
            qkv: gemm(DType::F32, t * hy.conv_dim())?,
            conv: if cached { Some(f32(t * hy.conv_dim())?) } else { None },
            raw: if cached { Some(f32(t * hy.key_dim())?) } else { None },
            z: gemm(DType::BF16, t * hy.value_dim())?,
            ba: gemm(DType::BF16, t * 2 * hv)?,
            lv: f32(t * hy.value_dim())?,
            // L2-normalised q and k stay f32, as inside flash-linear-attention's kernel.
            qn: f32(t * hy.key_dim())?,
            kn: f32(t * hy.key_dim())?,
            beta: bf(t * hv)?,
            g: f32(t * hv)?,
            core: bf(t * hy.value_dim())?,
            y: bf(t * hy.value_dim())?,
        })
    }
}
