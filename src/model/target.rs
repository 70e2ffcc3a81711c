//! The frozen target: a Qwen3 dense decoder run forward up to the last tapped layer.
//!
//! Tap `k` is the residual stream after 0-based decoder layer `taps[k]`, before any final norm
//! (Hugging Face's `output_hidden_states[taps[k] + 1]`). Layers after the last tap, the final norm
//! and the logits are never computed: ground-truth-label training does not need them.

use super::ParamTable;
use crate::backend::{Backend, Gemm, Result};
use crate::config::LayerDims;
use crate::tensor::DType;
use crate::weights::LayerTensor;

/// The shape numbers the forward needs, taken from a `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetShape {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    pub vocab: usize,
    pub eps: f32,
    pub rope_theta: f32,
    pub tied_embeddings: bool,
}

impl TargetShape {
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// Hugging Face tensor names (one definition, in `weights`), plus the per-layer prefix helper.
pub mod names {
    pub use crate::weights::names::{EMBED_TOKENS as EMBED, FINAL_NORM, LM_HEAD};
    pub fn layer(i: usize, part: &str) -> String {
        format!("model.layers.{i}.{part}")
    }
}

/// Appends one decoder layer's tensors named `{prefix}{suffix}` in `LayerTensor::ALL` order, with
/// up right after gate so the MLP's first projection is one `[2 * inter, hidden]` GEMM.
pub fn push_layer(
    t: &mut ParamTable,
    prefix: &str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
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
        if part == LayerTensor::UpProj {
            t.push_adjacent(name, &part.shape(&dims));
        } else {
            t.push(name, &part.shape(&dims));
        }
    }
}

/// The inputs of one target forward: a batch of sequences laid end to end.
pub struct TargetInputs<'a, B: Backend> {
    pub ids: &'a B::Ids,
    /// Position of each row inside its own sequence.
    pub pos: &'a B::Ids,
    /// `seq_starts[b]..seq_starts[b + 1]` are the rows of sequence `b` (causal attention stays inside).
    pub seq_starts: &'a B::Ids,
    pub rows: usize,
}

/// The loaded target: bf16 weights of layers `0..=max(taps)` plus the embedding (and the lm_head,
/// which the drafter borrows).
pub struct Target<B: Backend> {
    pub shape: TargetShape,
    pub taps: Vec<usize>,
    pub table: ParamTable,
    pub weights: B::Buf,
    /// Layers `0..loaded_layers` are on the device.
    pub loaded_layers: usize,
}

impl<B: Backend> Target<B> {
    /// The flat layout for a target that runs up to layer `last` (the final norm and lm_head are
    /// always there: the drafter borrows the head, and generation needs both).
    pub fn param_table(shape: &TargetShape, last: usize) -> ParamTable {
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
            );
        }
        t.push(names::FINAL_NORM, &[shape.hidden]);
        t.push(names::LM_HEAD, &[shape.vocab, shape.hidden]);
        t
    }

    /// Builds the target on `be` from a tensor source (`name, shape -> f32 values`): a safetensors
    /// checkpoint or an in-memory preset. A tied checkpoint's lm_head is its embedding. Only layers
    /// up to the last tap are loaded, unless `all_layers` (generation needs every layer).
    pub fn load<E>(
        be: &B,
        shape: TargetShape,
        taps: Vec<usize>,
        all_layers: bool,
        mut get: impl FnMut(&str, &[usize]) -> std::result::Result<Vec<f32>, E>,
    ) -> std::result::Result<Self, E>
    where
        E: From<crate::backend::BackendError>,
    {
        let last_tap = *taps.iter().max().expect("at least one tap layer");
        let last = if all_layers { shape.layers - 1 } else { last_tap };
        let table = Self::param_table(&shape, last);
        let s = be.compute_stream();
        let mut weights = be.alloc(&s, DType::BF16, table.total())?;
        for e in table.entries() {
            let src = if e.name == names::LM_HEAD && shape.tied_embeddings { names::EMBED } else { e.name.as_str() };
            let host = get(src, &e.shape)?;
            be.upload(&s, &host, &mut weights, e.offset)?;
        }
        Ok(Target { shape, taps, table, weights, loaded_layers: last + 1 })
    }

    pub fn last_layer(&self) -> usize {
        *self.taps.iter().max().expect("at least one tap layer")
    }

    /// Runs layers `0..=max(taps)` and writes tap `k` into `taps_out[k]` (`[rows, hidden]`, bf16).
    pub fn forward_taps(
        &self,
        be: &B,
        s: &B::Stream,
        inp: &TargetInputs<'_, B>,
        taps_out: &mut [B::Buf],
    ) -> Result<()> {
        let (t, h) = (inp.rows, self.shape.hidden);
        let mut sc = Scratch::new(be, s, &self.shape, t)?;
        let mut x = be.alloc(s, DType::BF16, t * h)?;
        be.embed(s, &self.weights, self.table.off(names::EMBED), inp.ids, &mut x, t, h)?;
        for l in 0..=self.last_layer() {
            self.layer(be, s, l, &mut x, &mut sc, inp.pos, Attend::Causal(inp.seq_starts))?;
            for (k_idx, &tap) in self.taps.iter().enumerate() {
                if tap == l {
                    be.copy(s, &x, 0, &mut taps_out[k_idx], 0, t * h)?;
                }
            }
        }
        Ok(())
    }

    /// One decoder layer on `x [rows, hidden]` in place.
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        be: &B,
        s: &B::Stream,
        l: usize,
        x: &mut B::Buf,
        sc: &mut Scratch<B>,
        pos: &B::Ids,
        attend: Attend<'_, B>,
    ) -> Result<()> {
        let sh = &self.shape;
        let (t, h, qw, kw) = (sc.rows, sh.hidden, sh.q_width(), sh.kv_width());
        let w = &self.weights;
        let off = |part: &str| self.table.off(&names::layer(l, part));
        be.rmsnorm_fwd(s, x, w, off("input_layernorm.weight"), &mut sc.xn, &mut sc.rstd, t, h, sh.eps)?;
        be.gemm(s, &Gemm::linear(t, qw, h), &sc.xn, 0, w, off("self_attn.q_proj.weight"), &mut sc.q_pre, 0)?;
        be.gemm(s, &Gemm::linear(t, kw, h), &sc.xn, 0, w, off("self_attn.k_proj.weight"), &mut sc.k_pre, 0)?;
        be.gemm(s, &Gemm::linear(t, kw, h), &sc.xn, 0, w, off("self_attn.v_proj.weight"), &mut sc.v, 0)?;
        be.rmsnorm_fwd(
            s,
            &sc.q_pre,
            w,
            off("self_attn.q_norm.weight"),
            &mut sc.q,
            &mut sc.rstd,
            t * sh.heads,
            sh.head_dim,
            sh.eps,
        )?;
        be.rmsnorm_fwd(
            s,
            &sc.k_pre,
            w,
            off("self_attn.k_norm.weight"),
            &mut sc.k,
            &mut sc.rstd,
            t * sh.kv_heads,
            sh.head_dim,
            sh.eps,
        )?;
        be.rope(s, &mut sc.q, pos, t, sh.heads, sh.head_dim, sh.rope_theta, false)?;
        be.rope(s, &mut sc.k, pos, t, sh.kv_heads, sh.head_dim, sh.rope_theta, false)?;
        match attend {
            Attend::Causal(seq_starts) => be.attn_causal_fwd(
                s,
                &sc.q,
                &sc.k,
                &sc.v,
                &mut sc.o,
                seq_starts,
                t,
                sh.heads,
                sh.kv_heads,
                sh.head_dim,
            )?,
            Attend::Cached { cache, step, anchors, ctx_start } => {
                let ash = crate::backend::DraftAttnShape {
                    num_blocks: t,
                    block_size: 1,
                    ctx_rows: t * cache.max_len,
                    heads: sh.heads,
                    kv_heads: sh.kv_heads,
                    head_dim: sh.head_dim,
                };
                be.attn_draft_fwd(
                    s,
                    &ash,
                    &sc.q,
                    &cache.k[l],
                    &cache.v[l],
                    &sc.k,
                    &sc.v,
                    anchors,
                    ctx_start,
                    &mut sc.o,
                    &mut sc.lse,
                )?;
                for b in 0..t {
                    be.copy(s, &sc.k, b * kw, &mut cache.k[l], (b * cache.max_len + step) * kw, kw)?;
                    be.copy(s, &sc.v, b * kw, &mut cache.v[l], (b * cache.max_len + step) * kw, kw)?;
                }
            }
        }
        // Projection then residual add, each rounded to bf16, as a bf16 Hugging Face forward does.
        be.gemm(s, &Gemm::linear(t, h, qw), &sc.o, 0, w, off("self_attn.o_proj.weight"), &mut sc.tmp, 0)?;
        be.add_inplace(s, x, &sc.tmp)?;
        be.rmsnorm_fwd(s, x, w, off("post_attention_layernorm.weight"), &mut sc.xn, &mut sc.rstd, t, h, sh.eps)?;
        be.gemm(s, &Gemm::linear(t, 2 * sh.inter, h), &sc.xn, 0, w, off("mlp.gate_proj.weight"), &mut sc.gu, 0)?;
        be.swiglu_fwd(s, &sc.gu, &mut sc.act, t, sh.inter)?;
        be.gemm(s, &Gemm::linear(t, h, sh.inter), &sc.act, 0, w, off("mlp.down_proj.weight"), &mut sc.tmp, 0)?;
        be.add_inplace(s, x, &sc.tmp)
    }
}

/// How a layer's queries attend: causally within sequences, or over a KV cache (decoding).
enum Attend<'a, B: Backend> {
    Causal(&'a B::Ids),
    Cached { cache: &'a mut KvCache<B>, step: usize, anchors: &'a B::Ids, ctx_start: &'a B::Ids },
}

/// Per-layer temporaries, allocated once per forward and reused by every layer.
struct Scratch<B: Backend> {
    rows: usize,
    xn: B::Buf,
    rstd: B::Buf,
    q_pre: B::Buf,
    q: B::Buf,
    k_pre: B::Buf,
    k: B::Buf,
    v: B::Buf,
    o: B::Buf,
    lse: B::Buf,
    gu: B::Buf,
    act: B::Buf,
    tmp: B::Buf,
}

impl<B: Backend> Scratch<B> {
    fn new(be: &B, s: &B::Stream, sh: &TargetShape, t: usize) -> Result<Self> {
        let bf = |n: usize| be.alloc(s, DType::BF16, n);
        Ok(Scratch {
            rows: t,
            xn: bf(t * sh.hidden)?,
            rstd: be.alloc(s, DType::F32, t * sh.heads.max(1))?,
            q_pre: bf(t * sh.q_width())?,
            q: bf(t * sh.q_width())?,
            k_pre: bf(t * sh.kv_width())?,
            k: bf(t * sh.kv_width())?,
            v: bf(t * sh.kv_width())?,
            o: bf(t * sh.q_width())?,
            lse: be.alloc(s, DType::F32, t * sh.heads)?,
            gu: bf(t * 2 * sh.inter)?,
            act: bf(t * sh.inter)?,
            tmp: bf(t * sh.hidden)?,
        })
    }
}

/// Keys and values of every layer for `batch` sequences of up to `max_len` tokens, laid out
/// `[batch * max_len, kv_width]` so that sequence `b`'s cache is rows `b * max_len ..`.
pub struct KvCache<B: Backend> {
    pub k: Vec<B::Buf>,
    pub v: Vec<B::Buf>,
    pub batch: usize,
    pub max_len: usize,
}

impl<B: Backend> Target<B> {
    pub fn new_cache(&self, be: &B, s: &B::Stream, batch: usize, max_len: usize) -> Result<KvCache<B>> {
        let n = batch * max_len * self.shape.kv_width();
        let mut k = Vec::new();
        let mut v = Vec::new();
        for _ in 0..self.loaded_layers {
            k.push(be.alloc(s, DType::BF16, n)?);
            v.push(be.alloc(s, DType::BF16, n)?);
        }
        Ok(KvCache { k, v, batch, max_len })
    }

    /// One decoding step for every sequence: token `tokens[b]` at position `t`, attending to the
    /// cached positions `0..t` and itself; writes next-token logits `[batch, vocab]`. The causal
    /// attention over the cache is the drafter attention with blocks of one slot whose anchor is
    /// `t`: the same kernel, no second implementation. Needs every layer loaded.
    pub fn decode_step(
        &self,
        be: &B,
        s: &B::Stream,
        cache: &mut KvCache<B>,
        tokens: &B::Ids,
        t: usize,
        logits: &mut B::Buf,
    ) -> Result<()> {
        let sh = &self.shape;
        assert_eq!(self.loaded_layers, sh.layers, "decode_step needs every layer loaded");
        let (n, h) = (cache.batch, sh.hidden);
        let w = &self.weights;
        let t_i32 = i32::try_from(t)
            .map_err(|_| crate::backend::BackendError::Shape { op: "decode_step", what: format!("position {t}") })?;
        let mut pos = be.alloc_ids(s, n)?;
        be.upload_ids(s, &vec![t_i32; n], &mut pos)?;
        let mut anchors = be.alloc_ids(s, n)?;
        be.upload_ids(s, &vec![t_i32; n], &mut anchors)?;
        let starts: Vec<i32> = (0..n).map(|b| i32::try_from(b * cache.max_len).unwrap_or(i32::MAX)).collect();
        let mut ctx_start = be.alloc_ids(s, n)?;
        be.upload_ids(s, &starts, &mut ctx_start)?;
        let mut sc = Scratch::new(be, s, sh, n)?;
        let mut x = be.alloc(s, DType::BF16, n * h)?;
        be.embed(s, w, self.table.off(names::EMBED), tokens, &mut x, n, h)?;
        for l in 0..sh.layers {
            self.layer(
                be,
                s,
                l,
                &mut x,
                &mut sc,
                &pos,
                Attend::Cached { cache: &mut *cache, step: t, anchors: &anchors, ctx_start: &ctx_start },
            )?;
        }
        be.rmsnorm_fwd(s, &x, w, self.table.off(names::FINAL_NORM), &mut sc.xn, &mut sc.rstd, n, h, sh.eps)?;
        be.gemm(s, &Gemm::linear(n, sh.vocab, h), &sc.xn, 0, w, self.table.off(names::LM_HEAD), logits, 0)
    }
}

impl From<&crate::config::TargetConfig> for TargetShape {
    fn from(c: &crate::config::TargetConfig) -> Self {
        TargetShape {
            hidden: c.hidden_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            inter: c.intermediate_size,
            vocab: c.vocab_size,
            eps: c.rms_norm_eps as f32,
            rope_theta: c.rope_theta as f32,
            tied_embeddings: c.tie_word_embeddings,
        }
    }
}
