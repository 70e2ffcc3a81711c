//! The drafter at inference: one block per speculative-decoding round, with the same attention
//! semantics as training (DFLASH.md section 3) so that what training measured is what decoding
//! gets.
//!
//! The context is every accepted token's packed taps through `fc` and `hidden_norm`; each layer's
//! context keys (k-normed, rotated at their positions) and values are computed once, when the
//! tokens are accepted, and appended to a cache, never recomputed. A round's block is slot 0 =
//! the last token the target produced (the anchor, at position `a`), slots `1..bs` the mask
//! token at `a + r`; it sees context positions `t < a` (every accepted token before the anchor:
//! exactly the cache) and its own block bidirectionally. Slot `r` predicts the token at `a + r`.
//! The arithmetic is the training forward's, op for op: the only difference is that training
//! computes every block of a sequence at once.

use super::drafter::{Drafter, DrafterShape, Frozen, ParamGroup};
use super::ParamTable;
use crate::backend::{Backend, BackendError, DraftAttnShape, Gemm, QkNormRope, Result, Rows};
use crate::tensor::DType;

/// The weights a drafter runs with, borrowed: the body (`hidden_norm`, layers, `norm`), the fc
/// projection and the target's frozen embedding and lm_head.
pub struct DraftWeights<'a, B: Backend> {
    pub shape: &'a DrafterShape,
    pub body_table: &'a ParamTable,
    pub body: &'a B::Buf,
    pub fc: &'a B::Buf,
    /// Offset of `fc.weight` inside `fc`.
    pub fc_off: usize,
    pub embed: &'a Frozen<B>,
    pub lm_head: &'a Frozen<B>,
}

impl<B: Backend> Drafter<B> {
    /// The trained drafter's weights for inference (the bf16 copies the training forward uses).
    pub fn weights_for_inference<'a>(&'a self, fc: &'a ParamGroup<B>) -> DraftWeights<'a, B> {
        DraftWeights {
            shape: &self.shape,
            body_table: &self.body.table,
            body: &self.body.weights,
            fc: &fc.weights,
            fc_off: fc.table.off("fc.weight"),
            embed: &self.embed,
            lm_head: &self.lm_head,
        }
    }
}

/// A drafter's weights on a device, for inference only (no masters, gradients or moments).
pub struct InferenceDrafter<B: Backend> {
    pub shape: DrafterShape,
    pub body_table: ParamTable,
    pub body: B::Buf,
    pub fc_table: ParamTable,
    pub fc: B::Buf,
    pub embed: Frozen<B>,
    pub lm_head: Frozen<B>,
}

impl<B: Backend> InferenceDrafter<B> {
    /// Uploads every tensor from `get(name, shape) -> f32 values` (a checkpoint, or an init).
    pub fn load<E>(
        be: &B,
        s: &B::Stream,
        shape: DrafterShape,
        embed: Frozen<B>,
        lm_head: Frozen<B>,
        mut get: impl FnMut(&str, &[usize]) -> std::result::Result<Vec<f32>, E>,
    ) -> std::result::Result<Self, E>
    where
        E: From<BackendError>,
    {
        let (body_table, fc_table) = (shape.body_table(), shape.fc_table());
        let mut upload = |table: &ParamTable| -> std::result::Result<B::Buf, E> {
            let mut buf = be.alloc(s, DType::BF16, table.total())?;
            for e in table.entries() {
                be.upload(s, &get(&e.name, &e.shape)?, &mut buf, e.offset)?;
            }
            Ok(buf)
        };
        let body = upload(&body_table)?;
        let fc = upload(&fc_table)?;
        Ok(InferenceDrafter { shape, body_table, body, fc_table, fc, embed, lm_head })
    }

    pub fn weights(&self) -> DraftWeights<'_, B> {
        DraftWeights {
            shape: &self.shape,
            body_table: &self.body_table,
            body: &self.body,
            fc: &self.fc,
            fc_off: self.fc_table.off("fc.weight"),
            embed: &self.embed,
            lm_head: &self.lm_head,
        }
    }
}

/// The drafter's context cache: per layer, the keys (k-normed and rotated) and values of every
/// accepted token's context row, `[max_len, kv_width]`; rows `0..len` are filled.
pub struct DraftCache<B: Backend> {
    k: Vec<B::Buf>,
    v: Vec<B::Buf>,
    pub len: usize,
    pub max_len: usize,
}

impl<B: Backend> DraftCache<B> {
    pub fn new(be: &B, s: &B::Stream, shape: &DrafterShape, max_len: usize) -> Result<Self> {
        let n = max_len * shape.kv_width();
        let mut k = Vec::with_capacity(shape.layers);
        let mut v = Vec::with_capacity(shape.layers);
        for _ in 0..shape.layers {
            k.push(be.alloc(s, DType::BF16, n)?);
            v.push(be.alloc(s, DType::BF16, n)?);
        }
        Ok(DraftCache { k, v, len: 0, max_len })
    }
}

fn ids<B: Backend>(be: &B, s: &B::Stream, v: &[i32]) -> Result<B::Ids> {
    let mut b = be.alloc_ids(s, v.len())?;
    be.upload_ids(s, v, &mut b)?;
    Ok(b)
}

fn pos_i32(p: usize) -> Result<i32> {
    i32::try_from(p).map_err(|_| BackendError::Shape { op: "draft", what: format!("position {p}") })
}

impl<B: Backend> DraftWeights<'_, B> {
    /// Appends `rows` accepted tokens (positions `cache.len..`) to the context: `taps[k]` holds
    /// their tap `k` (`[rows, hidden]`, row 0 first). Packed (no noise), projected by `fc`,
    /// normed by `hidden_norm`, then each layer's keys and values are written to the cache.
    pub fn append_context(
        &self,
        be: &B,
        s: &B::Stream,
        cache: &mut DraftCache<B>,
        taps: &[&B::Buf],
        rows: usize,
    ) -> Result<()> {
        let sh = self.shape;
        if taps.len() != sh.num_taps {
            return Err(BackendError::Shape {
                op: "append_context",
                what: format!("{} taps for a drafter of {}", taps.len(), sh.num_taps),
            });
        }
        if cache.len + rows > cache.max_len {
            return Err(BackendError::Shape {
                op: "append_context",
                what: format!("{} + {rows} context rows past the cache's {}", cache.len, cache.max_len),
            });
        }
        if rows == 0 {
            return Ok(());
        }
        let (h, kw, hd, kvh) = (sh.hidden, sh.kv_width(), sh.head_dim, sh.kv_heads);
        let (t, w) = (self.body_table, self.body);
        let mut packed = be.alloc(s, DType::BF16, rows * sh.fc_in())?;
        be.pack_taps(s, taps, &mut packed, rows, h, rows, 0.0, 0, 0)?;
        let mut y = be.alloc(s, DType::BF16, rows * h)?;
        be.fc_project(s, &packed, self.fc, self.fc_off, &mut y, rows, h, sh.fc_in())?;
        let mut ctx = be.alloc(s, DType::BF16, rows * h)?;
        let mut rstd = be.alloc(s, DType::F32, rows)?;
        be.rmsnorm_fwd(s, &y, w, t.off("hidden_norm.weight"), &mut ctx, &mut rstd, rows, h, sh.eps)?;
        let pos: Vec<i32> = (cache.len..cache.len + rows).map(pos_i32).collect::<Result<_>>()?;
        let pos = ids(be, s, &pos)?;
        let (mut k_pre, mut v) = (be.alloc(s, DType::BF16, rows * kw)?, be.alloc(s, DType::BF16, rows * kw)?);
        // Keys only (no query heads: the query side is neither read nor written), normed and
        // rotated straight into the cache, as training's context keys (KeyProj::rotated).
        let mut unused_q = be.alloc(s, DType::BF16, 1)?;
        for l in 0..sh.layers {
            let off = |part: &str| t.off(&format!("layers.{l}.{part}"));
            be.gemm(s, &Gemm::linear(rows, kw, h), &ctx, 0, w, off("self_attn.k_proj.weight"), &mut k_pre, 0)?;
            be.gemm(s, &Gemm::linear(rows, kw, h), &ctx, 0, w, off("self_attn.v_proj.weight"), &mut v, 0)?;
            let nr = QkNormRope {
                rows,
                heads: 0,
                kv_heads: kvh,
                head_dim: hd,
                eps: sh.eps,
                theta: sh.rope_theta,
                q_in: Rows { off: 0, stride: 0 },
                k_in: Rows { off: 0, stride: kw },
                q_out: Rows { off: 0, stride: 0 },
                k_out: Rows { off: cache.len * kw, stride: kw },
                wq_off: off("self_attn.k_norm.weight"),
                wk_off: off("self_attn.k_norm.weight"),
            };
            be.qk_norm_rope(s, &nr, &k_pre, &k_pre, w, &mut unused_q, &mut cache.k[l], &pos, None)?;
            be.copy(s, &v, 0, &mut cache.v[l], cache.len * kw, rows * kw)?;
        }
        cache.len += rows;
        Ok(())
    }

    /// Drafts one block after the context: slot 0 is `anchor_token` at position `cache.len`,
    /// slots `1..bs` the mask token. Writes the argmax token of slots `1..bs` into `drafts`
    /// (`bs - 1` ids: the guesses for positions `cache.len + 1 ..`), computed from bf16 logits
    /// as the training step's argmax is.
    pub fn draft_block(
        &self,
        be: &B,
        s: &B::Stream,
        cache: &DraftCache<B>,
        anchor_token: u32,
        drafts: &mut B::Ids,
    ) -> Result<()> {
        let sh = self.shape;
        let (bs, h, qw, kw, inter) = (sh.block_size, sh.hidden, sh.q_width(), sh.kv_width(), sh.inter);
        let (hd, nh, kvh) = (sh.head_dim, sh.heads, sh.kv_heads);
        let (t, w) = (self.body_table, self.body);
        let a = cache.len;
        let mut block = vec![pos_i32(sh.mask_token_id as usize)?; bs];
        block[0] = pos_i32(anchor_token as usize)?;
        let block_ids = ids(be, s, &block)?;
        let block_pos = ids(be, s, &(a..a + bs).map(pos_i32).collect::<Result<Vec<_>>>()?)?;
        let anchors = ids(be, s, &[pos_i32(a)?])?;
        let ctx_start = ids(be, s, &[0])?;
        // Per layer: a sliding layer sees the last `W` positions only, as in training.
        let ash = |l: usize| DraftAttnShape {
            window: sh.windows.get(l).copied().flatten(),
            num_blocks: 1,
            block_size: bs,
            ctx_rows: cache.max_len,
            heads: nh,
            kv_heads: kvh,
            head_dim: hd,
        };
        let bf = |n: usize| be.alloc(s, DType::BF16, n);
        let mut x = bf(bs * h)?;
        be.embed(s, &self.embed.buf, self.embed.off, &block_ids, &mut x, bs, h)?;
        let (mut xn, mut q_pre, mut q, mut kb_pre, mut kb, mut vb) =
            (bf(bs * h)?, bf(bs * qw)?, bf(bs * qw)?, bf(bs * kw)?, bf(bs * kw)?, bf(bs * kw)?);
        let (mut o, mut h2, mut act) = (bf(bs * qw)?, bf(bs * h)?, bf(bs * inter)?);
        // The residual stream's other buffer: each residual GEMM reads `x` and writes `x_next`
        // (as training's `gemm_residual` does; in place, cuBLASLt may round once more at these
        // few rows), then the two swap.
        let mut x_next = bf(bs * h)?;
        let mut rstd = be.alloc(s, DType::F32, bs)?;
        let mut lse = be.alloc(s, DType::F32, bs * nh)?;
        for l in 0..sh.layers {
            let off = |part: &str| t.off(&format!("layers.{l}.{part}"));
            be.rmsnorm_fwd(s, &x, w, off("input_layernorm.weight"), &mut xn, &mut rstd, bs, h, sh.eps)?;
            be.gemm(s, &Gemm::linear(bs, qw, h), &xn, 0, w, off("self_attn.q_proj.weight"), &mut q_pre, 0)?;
            be.gemm(s, &Gemm::linear(bs, kw, h), &xn, 0, w, off("self_attn.k_proj.weight"), &mut kb_pre, 0)?;
            be.gemm(s, &Gemm::linear(bs, kw, h), &xn, 0, w, off("self_attn.v_proj.weight"), &mut vb, 0)?;
            // The block's queries and keys, normed and rotated in one pass, as training's.
            let nr = QkNormRope {
                rows: bs,
                heads: nh,
                kv_heads: kvh,
                head_dim: hd,
                eps: sh.eps,
                theta: sh.rope_theta,
                q_in: Rows { off: 0, stride: qw },
                k_in: Rows { off: 0, stride: kw },
                q_out: Rows { off: 0, stride: qw },
                k_out: Rows { off: 0, stride: kw },
                wq_off: off("self_attn.q_norm.weight"),
                wk_off: off("self_attn.k_norm.weight"),
            };
            be.qk_norm_rope(s, &nr, &q_pre, &kb_pre, w, &mut q, &mut kb, &block_pos, None)?;
            be.attn_draft_fwd(
                s,
                &ash(l),
                &q,
                &cache.k[l],
                &cache.v[l],
                &kb,
                &vb,
                &anchors,
                &ctx_start,
                &mut o,
                &mut lse,
            )?;
            // x_mid = x + o Wo^T; x = x_mid + down(swiglu(post_norm(x_mid))), rounded as training does.
            be.gemm_residual(s, &Gemm::linear(bs, h, qw), &o, w, off("self_attn.o_proj.weight"), &x, &mut x_next)?;
            std::mem::swap(&mut x, &mut x_next);
            be.rmsnorm_fwd(s, &x, w, off("post_attention_layernorm.weight"), &mut h2, &mut rstd, bs, h, sh.eps)?;
            be.mlp_gate_up_act(s, &h2, w, off("mlp.gate_proj.weight"), &mut act, None, bs, inter, h)?;
            be.gemm_residual(s, &Gemm::linear(bs, h, inter), &act, w, off("mlp.down_proj.weight"), &x, &mut x_next)?;
            std::mem::swap(&mut x, &mut x_next);
        }
        // Final norm, lm_head over slots 1..bs, argmax on the device (the first maximum on ties,
        // the tie rule of training's accuracy).
        let n = bs - 1;
        let mut hn = bf(bs * h)?;
        be.rmsnorm_fwd(s, &x, w, t.off("norm.weight"), &mut hn, &mut rstd, bs, h, sh.eps)?;
        let mut logits = bf(n * sh.vocab)?;
        be.gemm(s, &Gemm::linear(n, sh.vocab, h), &hn, h, &self.lm_head.buf, self.lm_head.off, &mut logits, 0)?;
        be.argmax_rows(s, &logits, sh.vocab, n, sh.vocab, drafts)
    }
}
