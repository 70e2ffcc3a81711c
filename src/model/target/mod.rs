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
use crate::backend::{Backend, BackendError, DecodeAttnShape, GdnShape, Gemm, Result};
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
    /// Shared with the drafter on the same device, which borrows the embedding and lm_head.
    pub weights: std::sync::Arc<B::Buf>,
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
    /// [`Target::extend`] after its checks.
    fn extend(
        &self,
        t: &Target<B>,
        be: &B,
        s: &B::Stream,
        cache: &mut KvCache<B>,
        x: Extend<'_, B>,
        logits: &mut B::Buf,
    ) -> Result<ExtendUndo<B>>;
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
        let s = be.compute_stream();
        Self::load_with(be, shape, taps, all_layers, |name, dims, weights, off| {
            let host = get(name, dims)?;
            Ok(be.upload(&s, &host, weights, off)?)
        })
    }

    /// `load` with a source that writes each tensor into the weights itself (`name, shape,
    /// weights, offset`): a preset draws its tensors there (`Backend::fill_init`).
    pub fn load_with<E>(
        be: &B,
        shape: TargetShape,
        taps: Vec<usize>,
        all_layers: bool,
        mut put: impl FnMut(&str, &[usize], &mut B::Buf, usize) -> std::result::Result<(), E>,
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
            put(src, &e.shape, &mut weights, e.offset)?;
        }
        Ok(Target { shape, taps, table, weights: std::sync::Arc::new(weights), loaded_layers: last + 1 })
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
        // Every caller (training, bench-target, eval) profiles it as the target's phase.
        let _region = crate::backend::profile::enter(crate::backend::profile::Region::Target);
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

    /// Runs `rows` tokens of the one sequence of a batch-1 `cache` at positions `start..start +
    /// rows` in one forward (a prompt's prefill, or a speculative block's verification): row `i`
    /// attends to (or carries the state of) positions `0..start + i`, exactly as `rows` calls of
    /// [`Target::decode_step`] would, and its keys, values and convolution inputs are written to
    /// the cache. Writes tap `k` of every row into `taps_out[k]` (`[rows, hidden]`) when given,
    /// and the next-token logits of the last `logit_rows` rows into `logits` (f32 `[logit_rows,
    /// vocab]`). Returns what [`Target::rewind`] needs to keep only a prefix of these rows.
    /// Needs every layer loaded.
    #[allow(clippy::too_many_arguments)]
    pub fn extend(
        &self,
        be: &B,
        s: &B::Stream,
        cache: &mut KvCache<B>,
        tokens: &B::Ids,
        start: usize,
        rows: usize,
        taps_out: Option<&mut [B::Buf]>,
        logits: &mut B::Buf,
        logit_rows: usize,
    ) -> Result<ExtendUndo<B>> {
        let bad = |what: String| Err(BackendError::Shape { op: "extend", what });
        if self.loaded_layers != self.shape.layers {
            return bad(format!(
                "{} of {} layers loaded: extending a sequence needs every layer (load the target with all_layers)",
                self.loaded_layers, self.shape.layers
            ));
        }
        if cache.batch != 1 {
            return bad(format!("a cache of {} sequences: extend runs one sequence (a cache of batch 1)", cache.batch));
        }
        if rows == 0 || logit_rows == 0 || logit_rows > rows {
            return bad(format!("{rows} rows with logits for the last {logit_rows}: need 1 <= logit rows <= rows"));
        }
        if start + rows > cache.max_len {
            return bad(format!("positions {start}..{} past the cache's {} positions", start + rows, cache.max_len));
        }
        if let Some(t) = &taps_out {
            if t.len() != self.taps.len() {
                return bad(format!("{} tap buffers for {} taps", t.len(), self.taps.len()));
            }
        }
        let x = Extend { tokens, start, rows, logit_rows, taps_out };
        family::<B>(&self.shape.arch).extend(self, be, s, cache, x, logits)
    }

    /// Keeps only the first `keep` rows of the extend that returned `undo` (the last one on this
    /// cache): afterwards the cache is exactly what extending by those `keep` rows alone would
    /// have left. Attention caches are indexed by position, so the rejected rows' keys and values
    /// are simply overwritten later; a Gated DeltaNet layer's recurrent state is put back to its
    /// value before the extend and re-advanced over the kept rows (the same recurrent step, on
    /// the same inputs, that decoding runs). Its convolution inputs are indexed by position too.
    pub fn rewind(
        &self,
        be: &B,
        s: &B::Stream,
        cache: &mut KvCache<B>,
        undo: ExtendUndo<B>,
        keep: usize,
    ) -> Result<()> {
        if keep > undo.rows {
            return Err(BackendError::Shape {
                op: "rewind",
                what: format!("keep {keep} rows of an extend of {}", undo.rows),
            });
        }
        if keep == undo.rows {
            return Ok(());
        }
        let mut starts = be.alloc_ids(s, 2)?;
        be.upload_ids(s, &[0, to_i32("rewind", keep)?], &mut starts)?;
        for (lc, u) in cache.layers.iter_mut().zip(undo.layers) {
            let (LayerCache::Linear { state, .. }, Some(u)) = (lc, u) else { continue };
            let n = be.len(&u.state);
            be.copy(s, &u.state, 0, state, 0, n)?;
            if keep > 0 {
                let gsh = GdnShape { rows: keep, ..u.shape };
                let mut o = be.alloc(s, DType::BF16, keep * gsh.v_heads * gsh.v_dim)?;
                be.gdn_recurrent_fwd(s, &gsh, &u.q, &u.k, &u.v, &u.g, &u.beta, &starts, &mut o, Some(state))?;
            }
        }
        Ok(())
    }

    /// Final norm then lm_head over the last `x.logit_rows` rows of the residual stream `h`.
    fn extend_logits(
        &self,
        be: &B,
        s: &B::Stream,
        h: &B::Buf,
        x: &Extend<'_, B>,
        one_plus_w: bool,
        logits: &mut B::Buf,
    ) -> Result<()> {
        let (sh, w, n) = (&self.shape, &self.weights, x.logit_rows);
        let mut last = be.alloc(s, DType::BF16, n * sh.hidden)?;
        be.copy(s, h, (x.rows - n) * sh.hidden, &mut last, 0, n * sh.hidden)?;
        let mut xn = be.alloc(s, DType::BF16, n * sh.hidden)?;
        let norm = self.table.off(names::FINAL_NORM);
        if one_plus_w {
            be.rmsnorm1p_fwd(s, &last, w, norm, &mut xn, n, sh.hidden, sh.eps)?;
        } else {
            let mut rstd = be.alloc(s, DType::F32, n)?;
            be.rmsnorm_fwd(s, &last, w, norm, &mut xn, &mut rstd, n, sh.hidden, sh.eps)?;
        }
        be.gemm(s, &Gemm::linear(n, sh.vocab, sh.hidden), &xn, 0, w, self.table.off(names::LM_HEAD), logits, 0)
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

/// One [`Target::extend`] call as the families see it.
struct Extend<'a, B: Backend> {
    tokens: &'a B::Ids,
    start: usize,
    rows: usize,
    logit_rows: usize,
    taps_out: Option<&'a mut [B::Buf]>,
}

/// What [`Target::rewind`] needs after an extend: per Gated DeltaNet layer (None for attention
/// layers) the recurrent state before the extend and the delta rule's inputs of its rows.
pub struct ExtendUndo<B: Backend> {
    rows: usize,
    layers: Vec<Option<LinearUndo<B>>>,
}

struct LinearUndo<B: Backend> {
    shape: GdnShape,
    state: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    g: B::Buf,
    beta: B::Buf,
}

fn to_i32(op: &'static str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| BackendError::Shape { op, what: format!("{x} does not fit an i32 index") })
}

/// The offset of layer `l`'s input norm weight.
fn input_norm<B: Backend>(t: &Target<B>, l: usize) -> usize {
    t.table.off(&names::layer(l, "input_layernorm.weight"))
}

/// Each row's position (RoPE's input) on the device: `start..` for an extend, all `t` for a
/// decoding step.
fn positions<B: Backend>(
    be: &B,
    s: &B::Stream,
    op: &'static str,
    pos: impl ExactSizeIterator<Item = usize>,
) -> Result<B::Ids> {
    let host: Vec<i32> = pos.map(|p| to_i32(op, p)).collect::<Result<_>>()?;
    let mut d = be.alloc_ids(s, host.len())?;
    be.upload_ids(s, &host, &mut d)?;
    Ok(d)
}

/// How a layer's queries attend: causally within sequences, or over a KV cache (decoding).
enum Attend<'a, B: Backend> {
    Causal(&'a B::Ids),
    /// One row per sequence at position `step` of a batch cache (`max_len` rows a sequence):
    /// each row's key and value are appended at its sequence's row `step`, then the row attends
    /// to that sequence's rows `0..=step`.
    Cached {
        k: &'a mut B::Buf,
        v: &'a mut B::Buf,
        max_len: usize,
        step: usize,
    },
    /// Consecutive rows of one sequence from position `start` (batch-1 cache): their keys and
    /// values are written to the cache first, then row `i` attends to cache rows `0..=start + i`
    /// (causal, the earlier rows of the same call included).
    Extend {
        k: &'a mut B::Buf,
        v: &'a mut B::Buf,
        start: usize,
    },
}

impl<B: Backend> Attend<'_, B> {
    /// Where this layer's keys and values go, as (k, v, rows): the cache rows of the new tokens
    /// (`None` for a packed forward, whose keys stay in the layer's scratch).
    fn kv_dest(&mut self, kw: usize) -> Option<(&mut B::Buf, &mut B::Buf, crate::backend::Rows)> {
        use crate::backend::Rows;
        match self {
            Attend::Causal(_) => None,
            Attend::Cached { k, v, max_len, step } => {
                Some((&mut **k, &mut **v, Rows { off: *step * kw, stride: *max_len * kw }))
            }
            Attend::Extend { k, v, start } => Some((&mut **k, &mut **v, Rows { off: *start * kw, stride: kw })),
        }
    }
}

/// Writes the new keys and values (`[rows, kv width]` each) where `how` keeps them: the cache rows
/// of a decoding step or an extend; nothing for a packed forward.
fn place_kv<B: Backend>(
    be: &B,
    s: &B::Stream,
    how: &mut Attend<'_, B>,
    sh: &TargetShape,
    rows: usize,
    k: &B::Buf,
    v: &B::Buf,
) -> Result<()> {
    let kw = sh.kv_width();
    if let Some((kc, vc, at)) = how.kv_dest(kw) {
        be.copy_strided(s, k, 0, kw, kc, at.off, at.stride, rows, kw)?;
        be.copy_strided(s, v, 0, kw, vc, at.off, at.stride, rows, kw)?;
    }
    Ok(())
}

/// `x += a W^T` for an output projection (`w` at `w_off`, `[n, k]`), through a second residual
/// buffer: one GEMM writes `spare = x + a W^T`, reading `x` in its epilogue (one bf16 rounding of
/// the f32 sum, as the CPU reference rounds), then the two buffers trade places. The in-place form
/// (`C = D`) rounded twice on the H200 at some shapes (tests/gpu/gemm.rs).
#[allow(clippy::too_many_arguments)]
fn add_projection<B: Backend>(
    be: &B,
    s: &B::Stream,
    (rows, n, k): (usize, usize, usize),
    a: &B::Buf,
    w: &B::Buf,
    w_off: usize,
    x: &mut B::Buf,
    spare: &mut B::Buf,
) -> Result<()> {
    be.gemm_residual(s, &Gemm::linear(rows, n, k), a, w, w_off, x, spare)?;
    std::mem::swap(x, spare);
    Ok(())
}

/// `o = attention(q, k, v)` for `rows` query rows as `how` says, the keys and values already
/// placed ([`place_kv`]): a packed forward reads them from `k`, `v`; decoding and verification
/// from the cache, with the split-K decoding attention (`Backend::attn_decode`).
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
    let dec = |row_stride, len0, len_inc| DecodeAttnShape {
        rows,
        heads: sh.heads,
        kv_heads: sh.kv_heads,
        head_dim: sh.head_dim,
        row_stride,
        len0,
        len_inc,
    };
    match how {
        Attend::Causal(seq_starts) => {
            be.attn_causal_fwd(s, q, k, v, o, seq_starts, rows, sh.heads, sh.kv_heads, sh.head_dim)
        }
        Attend::Cached { k: kc, v: vc, max_len, step } => {
            be.attn_decode(s, &dec(max_len, step + 1, 0), q, kc, vc, o, lse)
        }
        Attend::Extend { k: kc, v: vc, start } => be.attn_decode(s, &dec(0, start + 1, 1), q, kc, vc, o, lse),
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
