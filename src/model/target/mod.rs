//! The frozen target: a decoder run forward up to the last tapped layer, one type over the
//! architecture families the engine supports. Each family is one file beside this one
//! (`qwen3.rs`: Qwen3 dense; `qwen35.rs`: the Qwen3.5/3.6 hybrid) implementing [`Family`]; the
//! rest of the engine only sees [`Target`].
//!
//! Tap `k` is the residual stream after 0-based decoder layer `taps[k]`, before any final norm
//! (Hugging Face's `output_hidden_states[taps[k] + 1]`). Layers after the last tap, the final norm
//! and the logits are never computed: ground-truth-label training does not need them.

mod qwen3;
mod qwen35;

pub use qwen3::push_layer;

use super::ParamTable;
use crate::backend::{Backend, DraftAttnShape, Result};
use crate::config::{Arch, LayerDims};
use crate::tensor::DType;

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
    /// The architecture family (and, for the hybrid, its linear-attention shape).
    pub arch: Arch,
}

impl TargetShape {
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    pub fn layer_dims(&self) -> LayerDims {
        LayerDims {
            hidden_size: self.hidden,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            head_dim: self.head_dim,
            intermediate_size: self.inter,
        }
    }
}

/// Hugging Face tensor names (one definition, in `weights`), plus the per-layer prefix helper.
pub mod names {
    pub use crate::weights::names::{EMBED_TOKENS as EMBED, FINAL_NORM, LM_HEAD};
    pub fn layer(i: usize, part: &str) -> String {
        format!("model.layers.{i}.{part}")
    }
}

/// The inputs of one target forward: a batch of sequences laid end to end.
pub struct TargetInputs<'a, B: Backend> {
    pub ids: &'a B::Ids,
    /// Position of each row inside its own sequence.
    pub pos: &'a B::Ids,
    /// `seq_starts[b]..seq_starts[b + 1]` are the rows of sequence `b` (attention, convolution and
    /// recurrent state all stay inside).
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

/// What one architecture family provides behind [`Target`]: its parameter layout, its forward
/// with taps, and one decoding step over a cache.
trait Family<B: Backend>: Sync {
    /// Embedding, layers `0..=last`, final norm, lm_head (names as in `weights`).
    fn param_table(&self, shape: &TargetShape, last: usize) -> ParamTable;
    fn forward_taps(
        &self,
        t: &Target<B>,
        be: &B,
        s: &B::Stream,
        inp: &TargetInputs<'_, B>,
        taps_out: &mut [B::Buf],
    ) -> Result<()>;
    fn new_cache(&self, t: &Target<B>, be: &B, s: &B::Stream, batch: usize, max_len: usize) -> Result<KvCache<B>>;
    #[allow(clippy::too_many_arguments)]
    fn decode_step(
        &self,
        t: &Target<B>,
        be: &B,
        s: &B::Stream,
        cache: &mut KvCache<B>,
        tokens: &B::Ids,
        pos: usize,
        logits: &mut B::Buf,
    ) -> Result<()>;
}

/// The family that runs `arch`.
fn family<B: Backend>(arch: &Arch) -> &'static dyn Family<B> {
    match arch {
        Arch::Qwen3 => &qwen3::Qwen3,
        Arch::Qwen35(_) => &qwen35::Qwen35,
    }
}

impl<B: Backend> Target<B> {
    /// The flat layout for a target that runs up to layer `last` (the final norm and lm_head are
    /// always there: the drafter borrows the head, and generation needs both).
    pub fn param_table(shape: &TargetShape, last: usize) -> ParamTable {
        family::<B>(&shape.arch).param_table(shape, last)
    }

    /// Builds the target on `be` from a tensor source (`name, shape -> f32 values`, one tensor at
    /// a time, so the host never holds the whole model in f32): a safetensors checkpoint or an
    /// in-memory preset. A tied checkpoint's lm_head is its embedding. Only layers up to the last
    /// tap are loaded, unless `all_layers` (generation needs every layer).
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
        family::<B>(&self.shape.arch).forward_taps(self, be, s, inp, taps_out)
    }

    /// The decoding state of every loaded layer for `batch` sequences of up to `max_len` tokens.
    pub fn new_cache(&self, be: &B, s: &B::Stream, batch: usize, max_len: usize) -> Result<KvCache<B>> {
        family::<B>(&self.shape.arch).new_cache(self, be, s, batch, max_len)
    }

    /// One decoding step for every sequence: token `tokens[b]` at position `t`, attending to (or
    /// carrying the state of) positions `0..t`; writes next-token logits `[batch, vocab]`. Needs
    /// every layer loaded.
    pub fn decode_step(
        &self,
        be: &B,
        s: &B::Stream,
        cache: &mut KvCache<B>,
        tokens: &B::Ids,
        t: usize,
        logits: &mut B::Buf,
    ) -> Result<()> {
        assert_eq!(self.loaded_layers, self.shape.layers, "decode_step needs every layer loaded");
        family::<B>(&self.shape.arch).decode_step(self, be, s, cache, tokens, t, logits)
    }

    /// Writes tap `k` for every `taps[k] == layer` (called after each layer).
    fn copy_taps(
        &self,
        be: &B,
        s: &B::Stream,
        layer: usize,
        x: &B::Buf,
        rows: usize,
        taps_out: &mut [B::Buf],
    ) -> Result<()> {
        for (k_idx, &tap) in self.taps.iter().enumerate() {
            if tap == layer {
                be.copy(s, x, 0, &mut taps_out[k_idx], 0, rows * self.shape.hidden)?;
            }
        }
        Ok(())
    }
}

/// One layer's decoding state: keys and values of an attention layer, or the pre-convolution
/// inputs and the recurrent state of a Gated DeltaNet layer.
pub enum LayerCache<B: Backend> {
    /// `[batch * max_len, kv_width]` each; sequence `b`'s rows start at `b * max_len`.
    Attention { k: B::Buf, v: B::Buf },
    /// `qkv [batch * max_len, conv channels]` (the convolution's inputs so far) and the f32 state
    /// `[batch, value heads, key dim, value dim]`.
    Linear { qkv: B::Buf, state: B::Buf },
}

/// The decoding state of every loaded layer for `batch` sequences of up to `max_len` tokens.
pub struct KvCache<B: Backend> {
    pub layers: Vec<LayerCache<B>>,
    pub batch: usize,
    pub max_len: usize,
}

/// How a layer's queries attend: causally within sequences, or over a KV cache (decoding).
enum Attend<'a, B: Backend> {
    Causal(&'a B::Ids),
    Cached {
        k: &'a mut B::Buf,
        v: &'a mut B::Buf,
        max_len: usize,
        step: usize,
        anchors: &'a B::Ids,
        ctx_start: &'a B::Ids,
    },
}

/// `o = attention(q, k, v)` for `rows` query rows as `how` says. Decoding is the drafter attention
/// with blocks of one slot whose anchor is the position: the same kernel, no second
/// implementation; the new keys and values are then appended to the cache.
#[allow(clippy::too_many_arguments)]
fn attend<B: Backend>(
    be: &B,
    s: &B::Stream,
    how: Attend<'_, B>,
    sh: &TargetShape,
    rows: usize,
    q: &B::Buf,
    k: &B::Buf,
    v: &B::Buf,
    o: &mut B::Buf,
    lse: &mut B::Buf,
) -> Result<()> {
    match how {
        Attend::Causal(seq_starts) => {
            be.attn_causal_fwd(s, q, k, v, o, seq_starts, rows, sh.heads, sh.kv_heads, sh.head_dim)
        }
        Attend::Cached { k: kc, v: vc, max_len, step, anchors, ctx_start } => {
            let kw = sh.kv_width();
            let ash = DraftAttnShape {
                num_blocks: rows,
                block_size: 1,
                ctx_rows: rows * max_len,
                heads: sh.heads,
                kv_heads: sh.kv_heads,
                head_dim: sh.head_dim,
                window: None,
            };
            be.attn_draft_fwd(s, &ash, q, kc, vc, k, v, anchors, ctx_start, o, lse)?;
            for b in 0..rows {
                be.copy(s, k, b * kw, kc, (b * max_len + step) * kw, kw)?;
                be.copy(s, v, b * kw, vc, (b * max_len + step) * kw, kw)?;
            }
            Ok(())
        }
    }
}

/// The per-step id buffers of a decoding step: positions (all `t`), anchors (all `t`: the cache
/// rows `0..t` are visible) and each sequence's first cache row.
struct DecodeIds<B: Backend> {
    pos: B::Ids,
    anchors: B::Ids,
    ctx_start: B::Ids,
}

impl<B: Backend> DecodeIds<B> {
    fn new(be: &B, s: &B::Stream, n: usize, t: usize, max_len: usize) -> Result<Self> {
        let t_i32 = i32::try_from(t)
            .map_err(|_| crate::backend::BackendError::Shape { op: "decode_step", what: format!("position {t}") })?;
        let mut pos = be.alloc_ids(s, n)?;
        be.upload_ids(s, &vec![t_i32; n], &mut pos)?;
        let mut anchors = be.alloc_ids(s, n)?;
        be.upload_ids(s, &vec![t_i32; n], &mut anchors)?;
        let starts: Vec<i32> = (0..n)
            .map(|b| {
                i32::try_from(b * max_len).map_err(|_| crate::backend::BackendError::Shape {
                    op: "decode_step",
                    what: format!("cache of {n} x {max_len} rows"),
                })
            })
            .collect::<Result<_>>()?;
        let mut ctx_start = be.alloc_ids(s, n)?;
        be.upload_ids(s, &starts, &mut ctx_start)?;
        Ok(DecodeIds { pos, anchors, ctx_start })
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
            arch: c.arch.clone(),
        }
    }
}
