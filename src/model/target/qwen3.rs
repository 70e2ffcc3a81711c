//! Qwen3 dense: plain-`w` RMSNorm, GQA attention with per-head QK-norm and full rotate-half RoPE,
//! SwiGLU MLP, no biases.

use super::{
    add_projection, attend, input_norm, names, positions, Attend, Extend, ExtendUndo, Family, KvCache, LayerCache,
    Target, TargetInputs, TargetShape,
};
use crate::backend::{Backend, Gemm, QkNormRope, Result, Rows};
use crate::config::LayerDims;
use crate::model::ParamTable;
use crate::tensor::DType;
use crate::weights::LayerTensor;

pub(super) struct Qwen3;

/// Appends one decoder layer's tensors named `{prefix}{suffix}` in `LayerTensor::ALL` order, with
/// up right after gate so the MLP's first projection is one `[2 * inter, hidden]` GEMM, and with
/// `fuse_qkv` k and v right after q (one `[q + 2 kv width, hidden]` GEMM).
#[allow(clippy::too_many_arguments)]
pub fn push_layer(
    t: &mut ParamTable,
    prefix: &str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
    fuse_qkv: bool,
) {
    let dims = LayerDims {
        hidden_size: hidden,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        intermediate_size: inter,
    };
    for part in LayerTensor::ALL {
        let name = format!("{prefix}{}", part.suffix());
        let adjacent = match part {
            LayerTensor::UpProj => true,
            LayerTensor::KProj | LayerTensor::VProj => fuse_qkv,
            _ => false,
        };
        if adjacent {
            t.push_adjacent(name, &part.shape(&dims));
        } else {
            t.push(name, &part.shape(&dims));
        }
    }
}

impl<B: Backend> Family<B> for Qwen3 {
    fn param_table(&self, shape: &TargetShape, last: usize) -> ParamTable {
        let mut t = ParamTable::default();
        t.push(names::EMBED, &[shape.vocab, shape.hidden]);
        for l in 0..=last {
            push_layer(
                &mut t,
                &names::layer(l, ""),
                shape.hidden,
                shape.heads,
                shape.kv_heads,
                shape.head_dim,
                shape.inter,
                true,
            );
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
        let (rows, h) = (inp.rows, t.shape.hidden);
        let mut sc = Scratch::new(be, s, &t.shape, rows)?;
        let (last, w) = (t.last_layer(), &t.weights);
        let mut x = be.alloc_uninit(s, DType::BF16, rows * h)?;
        be.embed(s, w, t.table.off(names::EMBED), inp.ids, &mut x, rows, h)?;
        be.rmsnorm_fwd(s, &x, w, input_norm(t, 0), &mut sc.xn, &mut sc.rstd, rows, h, t.shape.eps)?;
        for l in 0..=last {
            let next = (l < last).then(|| input_norm(t, l + 1));
            layer(t, be, s, l, &mut x, &mut sc, inp.pos, Attend::Causal(inp.seq_starts), next)?;
            t.copy_taps(be, s, l, &x, rows, taps_out)?;
        }
        Ok(())
    }

    fn new_cache(&self, t: &Target<B>, be: &B, s: &B::Stream, batch: usize, max_len: usize) -> Result<KvCache<B>> {
        let n = batch * max_len * t.shape.kv_width();
        let mut layers = Vec::new();
        for _ in 0..t.loaded_layers {
            layers.push(LayerCache::Attention { k: be.alloc(s, DType::BF16, n)?, v: be.alloc(s, DType::BF16, n)? });
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
        let sh = &t.shape;
        let (n, h, max_len) = (cache.batch, sh.hidden, cache.max_len);
        let w = &t.weights;
        let pos = positions(be, s, "decode_step", std::iter::repeat_n(step, n))?;
        let mut sc = Scratch::new(be, s, sh, n)?;
        let mut x = be.alloc(s, DType::BF16, n * h)?;
        be.embed(s, w, t.table.off(names::EMBED), tokens, &mut x, n, h)?;
        be.rmsnorm_fwd(s, &x, w, input_norm(t, 0), &mut sc.xn, &mut sc.rstd, n, h, sh.eps)?;
        let layers = cache.layers.len();
        for (l, lc) in cache.layers.iter_mut().enumerate() {
            let LayerCache::Attention { k, v } = lc else { unreachable!("a Qwen3 cache holds attention layers only") };
            let how = Attend::Cached { k, v, max_len, step };
            // After the last layer, the final norm (the logits' input).
            let next = if l + 1 < layers { input_norm(t, l + 1) } else { t.table.off(names::FINAL_NORM) };
            layer(t, be, s, l, &mut x, &mut sc, &pos, how, Some(next))?;
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
        let pos = positions(be, s, "extend", x.start..x.start + rows)?;
        let mut sc = Scratch::new(be, s, &t.shape, rows)?;
        let mut hs = be.alloc(s, DType::BF16, rows * h)?;
        be.embed(s, &t.weights, t.table.off(names::EMBED), x.tokens, &mut hs, rows, h)?;
        be.rmsnorm_fwd(s, &hs, &t.weights, input_norm(t, 0), &mut sc.xn, &mut sc.rstd, rows, h, t.shape.eps)?;
        let layers = cache.layers.len();
        for (l, lc) in cache.layers.iter_mut().enumerate() {
            let LayerCache::Attention { k, v } = lc else { unreachable!("a Qwen3 cache holds attention layers only") };
            let how = Attend::Extend { k, v, start: x.start };
            // No norm after the last layer: the logits norm only the rows they need.
            let next = (l + 1 < layers).then(|| input_norm(t, l + 1));
            layer(t, be, s, l, &mut hs, &mut sc, &pos, how, next)?;
            if let Some(taps) = x.taps_out.as_deref_mut() {
                t.copy_taps(be, s, l, &hs, rows, taps)?;
            }
        }
        t.extend_logits(be, s, &hs, &x, false, logits)?;
        Ok(ExtendUndo { rows, layers: cache.layers.iter().map(|_| None).collect() })
    }
}

/// One decoder layer on `x [rows, hidden]`, from `sc.xn` (and `sc.rstd`) holding its input norm
/// of `x`. The output projections add themselves to `x` (the residual adds ride on their GEMMs,
/// [`add_projection`]: `x` and `sc.x2` trade places twice, so `x` is the caller's buffer again
/// after the layer); the post-attention norm, then `next_norm` (the next layer's input norm, or the
/// final norm) write `sc.xn`. `x` is complete after the call (for taps).
///
/// q, k and v come from one GEMM (their weights are adjacent, [`push_layer`] with `fuse_qkv`);
/// the per-head norms and RoPE run as one op that writes the keys straight to where the attention
/// reads them (the scratch, or the KV cache when decoding), and the values are copied there from
/// the same GEMM's output.
#[allow(clippy::too_many_arguments)]
fn layer<B: Backend>(
    t: &Target<B>,
    be: &B,
    s: &B::Stream,
    l: usize,
    x: &mut B::Buf,
    sc: &mut Scratch<B>,
    pos: &B::Ids,
    mut how: Attend<'_, B>,
    next_norm: Option<usize>,
) -> Result<()> {
    let sh = &t.shape;
    let (rows, h, qw, kw) = (sc.rows, sh.hidden, sh.q_width(), sh.kv_width());
    let qkv_w = qw + 2 * kw;
    let w = &t.weights;
    let off = |part: &str| t.table.off(&names::layer(l, part));
    be.gemm(s, &Gemm::linear(rows, qkv_w, h), &sc.xn, 0, w, off("self_attn.q_proj.weight"), &mut sc.qkv, 0)?;
    let packed = |o: usize| Rows { off: o, stride: qkv_w };
    let mut norm_rope = QkNormRope {
        rows,
        heads: sh.heads,
        kv_heads: sh.kv_heads,
        head_dim: sh.head_dim,
        eps: sh.eps,
        theta: sh.rope_theta,
        q_in: packed(0),
        k_in: packed(qw),
        q_out: Rows { off: 0, stride: qw },
        k_out: Rows { off: 0, stride: kw },
        wq_off: off("self_attn.q_norm.weight"),
        wk_off: off("self_attn.k_norm.weight"),
    };
    match how.kv_dest(kw) {
        Some((kc, vc, at)) => {
            norm_rope.k_out = at;
            be.qk_norm_rope(s, &norm_rope, &sc.qkv, &sc.qkv, w, &mut sc.q, kc, pos, None)?;
            be.copy_strided(s, &sc.qkv, qw + kw, qkv_w, vc, at.off, at.stride, rows, kw)?;
        }
        None => {
            be.qk_norm_rope(s, &norm_rope, &sc.qkv, &sc.qkv, w, &mut sc.q, &mut sc.k, pos, None)?;
            be.copy_strided(s, &sc.qkv, qw + kw, qkv_w, &mut sc.v, 0, kw, rows, kw)?;
        }
    }
    attend(be, s, how, sh, rows, &sc.q, &sc.k, &sc.v, &mut sc.o, &mut sc.lse)?;
    // Each output projection adds itself to the residual stream in its GEMM's epilogue.
    add_projection(be, s, (rows, h, qw), &sc.o, w, off("self_attn.o_proj.weight"), x, &mut sc.x2)?;
    let post = off("post_attention_layernorm.weight");
    be.rmsnorm_fwd(s, x, w, post, &mut sc.xn, &mut sc.rstd, rows, h, sh.eps)?;
    be.mlp_gate_up_act(s, &sc.xn, w, off("mlp.gate_proj.weight"), &mut sc.act, None, rows, sh.inter, h)?;
    add_projection(be, s, (rows, h, sh.inter), &sc.act, w, off("mlp.down_proj.weight"), x, &mut sc.x2)?;
    match next_norm {
        Some(norm) => be.rmsnorm_fwd(s, x, w, norm, &mut sc.xn, &mut sc.rstd, rows, h, sh.eps),
        None => Ok(()),
    }
}

/// Per-layer temporaries, allocated once per forward and reused by every layer.
struct Scratch<B: Backend> {
    rows: usize,
    xn: B::Buf,
    rstd: B::Buf,
    /// `[rows, q | k | v]`: the fused projection's output.
    qkv: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    o: B::Buf,
    lse: B::Buf,
    act: B::Buf,
    /// `[rows, hidden]`: the residual stream's second buffer ([`add_projection`]).
    x2: B::Buf,
}

impl<B: Backend> Scratch<B> {
    fn new(be: &B, s: &B::Stream, sh: &TargetShape, t: usize) -> Result<Self> {
        // Every buffer is written in full before it is read (the norms, GEMMs and kernels of
        // each layer write all rows). The kernels' outputs are left uninitialised; the GEMMs'
        // (`gemm`: q | k | v, the residual's second buffer) are zero-filled, because
        // compute-sanitizer's initcheck does not see every cuBLASLt store and reported the
        // q/k norm's reads of the fused projection's output (the tiny preset, `run.sh initrun`),
        // as it did the hybrid target's (qwen35.rs). The fill is one memset per forward. The MLP's
        // gate | up output is not among them: the fused kernel writes none, and the two-step form
        // (`DFLASH_MLP_KERNEL=gemm`) allocates its own, unfilled, where initcheck may report
        // swiglu_fwd's reads of it.
        let bf = |n: usize| be.alloc_uninit(s, DType::BF16, n);
        let gemm = |n: usize| be.alloc(s, DType::BF16, n);
        Ok(Scratch {
            rows: t,
            xn: bf(t * sh.hidden)?,
            rstd: be.alloc_uninit(s, DType::F32, t * sh.heads.max(1))?,
            qkv: gemm(t * (sh.q_width() + 2 * sh.kv_width()))?,
            q: bf(t * sh.q_width())?,
            k: bf(t * sh.kv_width())?,
            v: bf(t * sh.kv_width())?,
            o: bf(t * sh.q_width())?,
            lse: be.alloc_uninit(s, DType::F32, t * sh.heads)?,
            act: bf(t * sh.inter)?,
            x2: gemm(t * sh.hidden)?,
        })
    }
}
