//! The DFlash drafter: Qwen3-style layers whose keys and values also see the target's context
//! (KV injection), trained with a hand-written backward (DFLASH.md section 3).
//!
//! Parameters live in two groups so that split-FC can move one of them to the target side without
//! changing a single bit of the arithmetic: the `fc` group (`fc.weight`, `[H, K*H]`) and the `body`
//! group (everything else). The global grad norm is always `sumsq(fc) + sumsq(body)`, and AdamW
//! is elementwise, so where a group lives does not change the result.

use std::sync::Arc;

use rayon::prelude::*;

use super::park::{Parked, Parking, Returning, RESTORE_LEAD, SETTLE_LAG};
use super::target::push_layer;
use super::ParamTable;
use crate::backend::profile::{self, Region};
use crate::backend::{AdamStep, Backend, DraftAttnShape, Gemm, QkNormRope, QkRstd, Result, Rows};
use crate::model::moments::Moments;
use crate::rng::{self, Philox};
use crate::tensor::DType;

/// The drafter's dimensions: its own attention geometry, depth, per-layer attention kind and
/// block size; the target's hidden size and vocabulary.
#[derive(Clone, Debug, PartialEq)]
pub struct DrafterShape {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    pub vocab: usize,
    pub num_taps: usize,
    pub block_size: usize,
    /// The config's `rms_norm_eps`: every norm of the drafter (layer norms, QK norms,
    /// `hidden_norm` and the final `norm`; DFLASH.md section 2).
    pub eps: f32,
    pub rope_theta: f32,
    /// Per layer: `None` for full attention, `Some(W)` for a sliding window of `W`.
    pub windows: Vec<Option<usize>>,
    pub mask_token_id: u32,
    /// Rows of logits materialised at once by the chunked lm_head + cross-entropy.
    pub logits_chunk_rows: usize,
    /// What the backward rebuilds instead of keeping it from the forward.
    pub recompute: Recompute,
    /// The first this many layers' gate|up products wait in pinned host memory between the
    /// forward and the backward ([`super::park`]); 0 keeps every one on the device.
    pub offload_layers: usize,
}

/// What the drafter's backward recomputes instead of keeping from the forward. Every level
/// gives bit-identical results: a recomputed buffer comes from the same kernels on the same
/// inputs as the forward's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// What one elementwise kernel rebuilds from what is kept: the normed inputs, the normed
    /// and rotated queries and keys, the MLP's normed input and its activation.
    #[default]
    Norms,
    /// Also the residual after attention (`x_in + o Wo^T`) and the query projection
    /// (`norm(x_in) Wq^T`): two `[rows, hidden]` bf16 buffers less per layer (2.5 GiB at the
    /// Qwen3-8B recipe) for two GEMMs per layer (about 2% of that step).
    Projections,
}

impl DrafterShape {
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    pub fn fc_in(&self) -> usize {
        self.num_taps * self.hidden
    }
    /// Elements of a layer's kept gate|up product over `rows` block rows (bf16).
    pub fn gate_up_len(&self, rows: usize) -> usize {
        rows * 2 * self.inter
    }

    pub fn fc_table(&self) -> ParamTable {
        let mut t = ParamTable::default();
        t.push("fc.weight", &[self.hidden, self.fc_in()]);
        t
    }

    /// Names as public DFlash drafter checkpoints spell them.
    pub fn body_table(&self) -> ParamTable {
        let mut t = ParamTable::default();
        t.push("hidden_norm.weight", &[self.hidden]);
        for l in 0..self.layers {
            push_layer(
                &mut t,
                &format!("layers.{l}."),
                self.hidden,
                self.heads,
                self.kv_heads,
                self.head_dim,
                self.inter,
                false,
            );
        }
        t.push("norm.weight", &[self.hidden]);
        t
    }
}

/// One group of trained parameters: bf16 weights for compute, the masters (f32 values; a backend
/// may store them split beside the weights, `Backend::alloc_master`), f32 gradients and the two
/// AdamW moments (on the device, or in host memory: [`Moments`]), all flat with the same layout.
pub struct ParamGroup<B: Backend> {
    pub table: ParamTable,
    pub weights: B::Buf,
    pub master: B::Buf,
    pub grad: B::Buf,
    pub moments: Moments<B>,
}

impl<B: Backend> ParamGroup<B> {
    pub fn new(be: &B, s: &B::Stream, table: ParamTable) -> Result<Self> {
        let n = table.total();
        Ok(ParamGroup {
            weights: be.alloc(s, DType::BF16, n)?,
            master: be.alloc_master(s, n)?,
            grad: be.alloc(s, DType::F32, n)?,
            moments: Moments::device(be, s, n)?,
            table,
        })
    }

    /// This group on another device (itself when `to` is `from`): every buffer copied over, the
    /// host waiting until the copies are done. Moments move before they are offloaded only.
    pub fn move_to(self, from: &B, to: &B, s_to: &B::Stream) -> Result<Self> {
        let Moments::Device { m, v } = self.moments else {
            return Err(crate::backend::BackendError::Shape {
                op: "ParamGroup::move_to",
                what: "the group's moments are in host memory already: place the group, then offload them".into(),
            });
        };
        let [weights, master, grad, m, v] =
            crate::backend::move_bufs(from, to, s_to, [self.weights, self.master, self.grad, m, v])?;
        Ok(ParamGroup { weights, master, grad, moments: Moments::Device { m, v }, table: self.table })
    }

    /// Keeps the AdamW moments in pinned host memory from now on (`--offload-optimizer`), in
    /// chunks of `chunk` parameters (`moments::CHUNK`); returns the bytes pinned.
    pub fn offload_moments(&mut self, be: &B, s: &B::Stream, chunk: usize) -> Result<usize> {
        self.moments.offload(be, s, chunk)
    }

    /// DFLASH.md init: linear weights ~ N(0, 0.02), norms = 1; each tensor its own Philox stream.
    /// Element j of a tensor is its stream's j-th normal (one Philox block each), so the tensor
    /// is filled across cores in chunks with the same values as one sequential pass (the
    /// Qwen3-8B recipe's drafter is ~1 billion normals: ~40 s on one core).
    pub fn init_host(table: &ParamTable, seed: u64, stream_base: u32) -> Vec<f32> {
        const PER_TASK: usize = 1 << 16;
        let mut host = vec![0.0f32; table.total()];
        for (i, e) in table.entries().iter().enumerate() {
            let dst = &mut host[e.offset..e.offset + e.numel];
            if e.shape.len() == 1 {
                dst.iter_mut().for_each(|x| *x = 1.0);
            } else {
                let stream = [stream_base + i as u32, rng::domain::INIT];
                dst.par_chunks_mut(PER_TASK).enumerate().for_each(|(c, part)| {
                    let mut r = Philox::at_block(seed, stream, (c * PER_TASK) as u64);
                    part.iter_mut().for_each(|x| *x = (0.02 * r.normal()) as f32);
                });
            }
        }
        host
    }

    /// Sets masters (and the bf16 weights from them); zeroes gradients and moments.
    pub fn set_masters(&mut self, be: &B, s: &B::Stream, host: &[f32]) -> Result<()> {
        be.set_master(s, host, &mut self.master, &mut self.weights)?;
        be.fill(s, &mut self.grad, 0.0)?;
        self.moments.fill(be, s, 0.0)
    }

    /// The masters as f32 values.
    pub fn masters(&self, be: &B, s: &B::Stream) -> Result<Vec<f32>> {
        be.get_master(s, &self.master, &self.weights)
    }

    pub fn zero_grad(&mut self, be: &B, s: &B::Stream) -> Result<()> {
        be.fill(s, &mut self.grad, 0.0)
    }

    /// Sum of squared gradients into `out[0]`.
    pub fn grad_sumsq(&self, be: &B, s: &B::Stream, out: &mut B::Buf) -> Result<()> {
        be.sum_squares(s, &self.grad, out)
    }

    pub fn adamw(&mut self, be: &B, s: &B::Stream, hp: &AdamStep) -> Result<()> {
        let ParamGroup { master, grad, weights, moments, .. } = self;
        moments.update(be, s, |off, m, v| be.adamw(s, master, grad, m, v, weights, off, hp))
    }

    /// AdamW with the clip factor and the skip flag of a device update plan (`Backend::update_plan`).
    pub fn adamw_planned(&mut self, be: &B, s: &B::Stream, hp: &AdamStep, plan: &B::Buf) -> Result<()> {
        let ParamGroup { master, grad, weights, moments, .. } = self;
        moments.update(be, s, |off, m, v| be.adamw_planned(s, master, grad, m, v, weights, off, hp, plan))
    }
}

/// `(offset, hidden, K*H)` of the fc group's one tensor.
fn fc_dims<B: Backend>(fc: &ParamGroup<B>) -> (usize, usize, usize) {
    let e = fc.table.get("fc.weight").expect("the fc group holds fc.weight");
    (e.offset, e.shape[0], e.shape[1])
}

/// `Y = X Wfc^T`: the context projection before `hidden_norm` (runs wherever the fc group lives).
pub fn fc_forward<B: Backend>(
    be: &B,
    s: &B::Stream,
    fc: &ParamGroup<B>,
    x: &B::Buf,
    y: &mut B::Buf,
    rows: usize,
) -> Result<()> {
    let (off, h, k) = fc_dims(fc);
    be.fc_project(s, x, &fc.weights, off, y, rows, h, k)
}

/// `dWfc += dY^T X`.
pub fn fc_backward<B: Backend>(
    be: &B,
    s: &B::Stream,
    fc: &mut ParamGroup<B>,
    dy: &B::Buf,
    x: &B::Buf,
    rows: usize,
) -> Result<()> {
    let (off, h, k) = fc_dims(fc);
    be.gemm(s, &Gemm::linear_dw(rows, h, k), dy, 0, x, 0, &mut fc.grad, off)
}

/// Device-side inputs of one drafter micro-batch (built on the host by `train::batch`).
pub struct DraftInputs<'a, B: Backend> {
    pub ctx_rows: usize,
    pub num_blocks: usize,
    /// Position of each context row inside its sequence.
    pub ctx_pos: &'a B::Ids,
    /// Block slot tokens: the anchor token in slot 0, `mask_token_id` elsewhere (padded blocks
    /// too). Layer 0 projects the mask slots once for all of them (`SharedRows`).
    pub block_ids: &'a B::Ids,
    /// Absolute position `anchor + r` of each block slot.
    pub block_pos: &'a B::Ids,
    /// Anchor position inside its sequence, `-1` for a padded block.
    pub anchors: &'a B::Ids,
    /// First context row of the block's sequence.
    pub ctx_start: &'a B::Ids,
    /// Label of each predicted slot (`-1` where unsupervised) and its loss weight (f32): slots
    /// `1..block_size` of each block, block after block (`HostBatch::predicted`).
    pub labels: &'a B::Ids,
    pub weights: &'a B::Buf,
}

/// Per-slot results a step hands back: weighted CE and the argmax token, for the predicted slots
/// (`1..block_size` of each block, as `DraftInputs::labels`).
pub struct DraftOutputs<B: Backend> {
    pub loss: B::Buf,
    pub argmax: B::Ids,
}

/// Activations one layer's backward needs, named, kept from its forward, dropped after its
/// backward.
struct LayerActs<B: Backend> {
    /// The layer's input; None for layer 0, whose input the backward embeds again.
    x_in: Option<B::Buf>,
    /// The input norm's rstd, of every block row (layer 0: of its `SharedRows`).
    rstd_in: B::Buf,
    /// Kept unless `Recompute::Projections` (then the backward rebuilds it, as `x_mid`).
    q_pre: Option<B::Buf>,
    q_rstd: B::Buf,
    keys: KeyProj<B>,
    vc: B::Buf,
    vb: B::Buf,
    o: B::Buf,
    lse: B::Buf,
    x_mid: Option<B::Buf>,
    rstd_post: B::Buf,
    gu: GateUp<B>,
}

/// Where a layer's gate|up product is between its forward and its backward.
enum GateUp<B: Backend> {
    Device(B::Buf),
    Parked(Parked<B>),
    Returning(Returning<B>),
    /// Only while it changes state (and after an error there).
    Moving,
}

impl<B: Backend> GateUp<B> {
    /// Frees the device copy of a parked product once its host copy is done (see `park`).
    fn settle(&mut self, be: &B, s: &B::Stream, parking: &mut Option<Parking<B>>) -> Result<()> {
        match self {
            GateUp::Parked(p) => parked_with(parking).settle(be, s, p),
            _ => Ok(()),
        }
    }

    /// Starts bringing a parked product back.
    fn start_return(&mut self, be: &B, s: &B::Stream, parking: &mut Option<Parking<B>>) -> Result<()> {
        match std::mem::replace(self, GateUp::Moving) {
            GateUp::Parked(p) => *self = GateUp::Returning(parked_with(parking).unpark(be, s, p)?),
            other => *self = other,
        }
        Ok(())
    }

    /// The product on the device, for the backward on `s`.
    fn into_device(mut self, be: &B, s: &B::Stream, parking: &mut Option<Parking<B>>) -> Result<B::Buf> {
        self.start_return(be, s, parking)?;
        match self {
            GateUp::Device(b) => Ok(b),
            GateUp::Returning(r) => r.take(be, s),
            GateUp::Parked(_) | GateUp::Moving => unreachable!("start_return leaves a product on its way back"),
        }
    }
}

/// The drafter's parking, which exists whenever a product was parked.
fn parked_with<B: Backend>(parking: &mut Option<Parking<B>>) -> &mut Parking<B> {
    parking.as_mut().expect("a parked product implies the drafter's parking")
}

/// A frozen `[vocab, hidden]` bf16 table the drafter borrows from the target (`embed_tokens`,
/// `lm_head`): on the target's own device it is the target's tensor itself, shared, at its offset
/// in the target's weights (at the Qwen3-8B shape the two tables are 2.3 GiB, at Qwen3.6-27B
/// 4.7 GiB that a copy would hold twice); on another device, a copy of its own.
pub struct Frozen<B: Backend> {
    pub buf: Arc<B::Buf>,
    pub off: usize,
}

impl<B: Backend> Frozen<B> {
    /// A table in a buffer of its own (offset 0).
    pub fn owned(buf: B::Buf) -> Self {
        Frozen { buf: Arc::new(buf), off: 0 }
    }

    /// The table named `name` inside the target's weights, shared (no copy).
    pub fn of_target(target: &super::target::Target<B>, name: &str) -> Self {
        Frozen { buf: target.weights.clone(), off: target.table.off(name) }
    }
}

impl<B: Backend> Clone for Frozen<B> {
    fn clone(&self) -> Self {
        Frozen { buf: self.buf.clone(), off: self.off }
    }
}

/// A layer's context and block keys before their norm and rotation, and the norm's rstd.
struct KeyProj<B: Backend> {
    kc_pre: B::Buf,
    kc_rstd: B::Buf,
    kb_pre: B::Buf,
    kb_rstd: B::Buf,
}

impl<B: Backend> KeyProj<B> {
    /// The queries and the context and block keys, each head normed (`q_norm` at `qn`, `k_norm`
    /// at `kn` in `w`; the rstd kept for the norms' backward) and rotated, in two passes: the
    /// block rows' queries and keys share their positions, the context keys have their own. The
    /// forward and the backward both call it, so the backward's queries and keys are the
    /// forward's bit for bit without being kept.
    #[allow(clippy::too_many_arguments)]
    fn rotated(
        &mut self,
        be: &B,
        s: &B::Stream,
        sh: &DrafterShape,
        w: &B::Buf,
        [qn, kn]: [usize; 2],
        q_pre: &B::Buf,
        q_rstd: &mut B::Buf,
        inp: &DraftInputs<'_, B>,
    ) -> Result<[B::Buf; 3]> {
        let (tc, tb, qw, kw) = (inp.ctx_rows, inp.num_blocks * sh.block_size, sh.q_width(), sh.kv_width());
        let mut q = be.alloc_uninit(s, DType::BF16, tb * qw)?;
        let mut kc = be.alloc_uninit(s, DType::BF16, tc * kw)?;
        let mut kb = be.alloc_uninit(s, DType::BF16, tb * kw)?;
        let rows = |stride| Rows { off: 0, stride };
        let mut nr = QkNormRope {
            rows: tb,
            heads: sh.heads,
            kv_heads: sh.kv_heads,
            head_dim: sh.head_dim,
            eps: sh.eps,
            theta: sh.rope_theta,
            q_in: rows(qw),
            k_in: rows(kw),
            q_out: rows(qw),
            k_out: rows(kw),
            wq_off: qn,
            wk_off: kn,
        };
        let rstd = QkRstd { q: Some(q_rstd), k: Some(&mut self.kb_rstd) };
        be.qk_norm_rope(s, &nr, q_pre, &self.kb_pre, w, &mut q, &mut kb, inp.block_pos, Some(rstd))?;
        // The context rows: keys only (no query heads, so q is neither read nor written).
        (nr.rows, nr.heads, nr.q_in, nr.q_out) = (tc, 0, rows(0), rows(0));
        let rstd = QkRstd { q: None, k: Some(&mut self.kc_rstd) };
        be.qk_norm_rope(s, &nr, &self.kc_pre, &self.kc_pre, w, &mut q, &mut kc, inp.ctx_pos, Some(rstd))?;
        Ok([q, kc, kb])
    }
}

/// The drafter body plus the frozen tensors it borrows from the target.
pub struct Drafter<B: Backend> {
    pub shape: DrafterShape,
    pub body: ParamGroup<B>,
    /// The target's `embed_tokens`.
    pub embed: Frozen<B>,
    /// The target's `lm_head`.
    pub lm_head: Frozen<B>,
    /// The copy stream and pinned slots for `shape.offload_layers` (made at the first step).
    parking: Option<Parking<B>>,
    /// The NaN suite's forced hazard for parked activations (test-only; set before the first
    /// step).
    pub park_fault: super::park::ParkFault,
}

/// Layer 0's block rows hold two kinds of input only: slot 0 of block `j` embeds its anchor's
/// token, and every other slot of every block embeds `mask_token_id` (`DraftInputs::block_ids`).
/// What the layer computes before its attention is row by row (the input norm, the query, key
/// and value projections), so it needs `nb + 1` distinct rows: row `j < nb` is block `j`'s slot
/// 0, row `nb` the mask row. The projections run on those rows and are then spread to every
/// slot; the backward sums the mask slots' gradients into row `nb` before the weight and input
/// gradients, so three GEMMs of `nb * bs` rows forward, and six backward, shrink to `nb + 1`.
/// The values are the same up to f32 summation order and the one bf16 rounding of that sum.
struct SharedRows {
    nb: usize,
    bs: usize,
}

impl SharedRows {
    /// For layer 0 of a batch whose blocks have mask slots (a block size of 1 has none).
    fn of(layer: usize, nb: usize, bs: usize) -> Option<Self> {
        (layer == 0 && bs > 1 && nb > 0).then_some(SharedRows { nb, bs })
    }

    fn rows(&self) -> usize {
        self.nb + 1
    }

    /// The distinct rows of `full` (`[nb * bs, width]`) into `out` (`[nb + 1, width]`): the slot-0
    /// rows, then slot 1 of block 0 as the mask row.
    fn gather<B: Backend>(&self, be: &B, s: &B::Stream, full: &B::Buf, out: &mut B::Buf, width: usize) -> Result<()> {
        be.copy_strided(s, full, 0, self.bs * width, out, 0, width, self.nb, width)?;
        be.copy(s, full, width, out, self.nb * width, width)
    }

    /// `gather` into a new buffer.
    fn gathered<B: Backend>(&self, be: &B, s: &B::Stream, full: &B::Buf, width: usize) -> Result<B::Buf> {
        let mut out = be.alloc_uninit(s, be.dtype(full), self.rows() * width)?;
        self.gather(be, s, full, &mut out, width)?;
        Ok(out)
    }

    /// `full` (`[nb * bs, width]`) from the distinct rows `c`: slot 0 of block `j` gets row `j`,
    /// every other slot row `nb`.
    fn spread<B: Backend>(&self, be: &B, s: &B::Stream, c: &B::Buf, full: &mut B::Buf, width: usize) -> Result<()> {
        let (nb, bs) = (self.nb, self.bs);
        be.copy_strided(s, c, 0, width, full, 0, bs * width, nb, width)?;
        // One block's mask slots, then that tile into every block.
        let mut tile = be.alloc_uninit(s, be.dtype(c), (bs - 1) * width)?;
        be.copy_strided(s, c, nb * width, 0, &mut tile, 0, width, bs - 1, width)?;
        be.copy_strided(s, &tile, 0, 0, full, width, bs * width, nb, (bs - 1) * width)
    }

    /// A bf16 `[nb * bs]` vector: 1 at the mask slots, 0 at slot 0 (the weights of `reduce`'s sum).
    fn mask_slots<B: Backend>(&self, be: &B, s: &B::Stream) -> Result<B::Buf> {
        let mut v = be.alloc(s, DType::BF16, self.nb * self.bs)?;
        be.fill(s, &mut v, 1.0)?;
        let zero = be.alloc(s, DType::BF16, 1)?;
        be.copy_strided(s, &zero, 0, 0, &mut v, 0, self.bs, self.nb, 1)?;
        Ok(v)
    }

    /// The gradient of the distinct rows from that of every slot (`d_full`, `[nb * bs, width]`):
    /// row `j` is slot 0 of block `j`, row `nb` the sum over the mask slots (a GEMV with the
    /// `mask_slots` weights, f32 accumulation, rounded once to bf16).
    fn reduce<B: Backend>(
        &self,
        be: &B,
        s: &B::Stream,
        d_full: &B::Buf,
        mask_slots: &B::Buf,
        width: usize,
    ) -> Result<B::Buf> {
        let (nb, bs) = (self.nb, self.bs);
        let mut out = be.alloc_uninit(s, DType::BF16, self.rows() * width)?;
        be.copy_strided(s, d_full, 0, bs * width, &mut out, 0, width, nb, width)?;
        let sum = Gemm { m: 1, n: width, k: nb * bs, ta: false, tb: false, alpha: 1.0, beta: 0.0 };
        be.gemm(s, &sum, mask_slots, 0, d_full, 0, &mut out, nb * width)?;
        Ok(out)
    }
}

/// `out = xn W^T` for the block rows of a projection of width `width`: `xn` holds every row, or
/// under `shared` (layer 0) its distinct rows, whose products are then spread to every slot.
#[allow(clippy::too_many_arguments)]
fn project<B: Backend>(
    be: &B,
    s: &B::Stream,
    shared: Option<&SharedRows>,
    xn: &B::Buf,
    tb: usize,
    hidden: usize,
    w: &B::Buf,
    w_off: usize,
    out: &mut B::Buf,
    width: usize,
) -> Result<()> {
    match shared {
        None => be.gemm(s, &Gemm::linear(tb, width, hidden), xn, 0, w, w_off, out, 0),
        Some(sr) => {
            let mut c = be.alloc_uninit(s, DType::BF16, sr.rows() * width)?;
            be.gemm(s, &Gemm::linear(sr.rows(), width, hidden), xn, 0, w, w_off, &mut c, 0)?;
            sr.spread(be, s, &c, out, width)
        }
    }
}

/// `x_mid = x_in + o Wo^T`, the residual after attention (one GEMM with the add in its
/// epilogue). The forward builds it here, and so does the backward under
/// `Recompute::Projections`: the same kernel on the same inputs, so both are bit-identical.
#[allow(clippy::too_many_arguments)]
fn residual_after_attention<B: Backend>(
    be: &B,
    s: &B::Stream,
    sh: &DrafterShape,
    tb: usize,
    w: &B::Buf,
    wo: usize,
    x_in: &B::Buf,
    o: &B::Buf,
) -> Result<B::Buf> {
    let mut x_mid = be.alloc_uninit(s, DType::BF16, tb * sh.hidden)?;
    be.gemm_residual(s, &Gemm::linear(tb, sh.hidden, sh.q_width()), o, w, wo, x_in, &mut x_mid)?;
    Ok(x_mid)
}

impl<B: Backend> Drafter<B> {
    fn attn_shape(&self, inp: &DraftInputs<'_, B>, layer: usize) -> DraftAttnShape {
        let sh = &self.shape;
        DraftAttnShape {
            window: sh.windows.get(layer).copied().flatten(),
            num_blocks: inp.num_blocks,
            block_size: sh.block_size,
            ctx_rows: inp.ctx_rows,
            heads: sh.heads,
            kv_heads: sh.kv_heads,
            head_dim: sh.head_dim,
        }
    }

    /// Forward and backward of one micro-batch. `y` is the context projection `X Wfc^T`
    /// (`[ctx_rows, hidden]`); on return `dy` holds its gradient, so the caller (or the target
    /// side under split-FC) finishes with `fc_backward`. Body gradients accumulate into
    /// `self.body.grad`; `grad_scale` is `1 / sum(w)` over the whole optimizer step.
    pub fn forward_backward(
        &mut self,
        be: &B,
        s: &B::Stream,
        inp: &DraftInputs<'_, B>,
        y: &B::Buf,
        grad_scale: f32,
        dy: &mut B::Buf,
    ) -> Result<DraftOutputs<B>> {
        let sh = self.shape.clone();
        let (h, qw, kw, inter) = (sh.hidden, sh.q_width(), sh.kv_width(), sh.inter);
        let (tc, tb) = (inp.ctx_rows, inp.num_blocks * sh.block_size);
        let ash: Vec<DraftAttnShape> = (0..sh.layers).map(|l| self.attn_shape(inp, l)).collect();
        let offload = sh.offload_layers.min(sh.layers);
        if offload > 0 {
            self.parking(be)?;
        }
        let table = &self.body.table;
        let w = &self.body.weights;
        let _region = profile::enter(Region::Drafter);
        let parking = &mut self.parking;

        // Context: ctx = hidden_norm(Y), shared by every layer.
        let mut ctx = be.alloc_uninit(s, DType::BF16, tc * h)?;
        let mut rstd_h = be.alloc_uninit(s, DType::F32, tc)?;
        be.rmsnorm_fwd(s, y, w, table.off("hidden_norm.weight"), &mut ctx, &mut rstd_h, tc, h, sh.eps)?;

        // Block stream: anchor token + mask tokens, embedded with the frozen target embedding.
        let mut x = be.alloc_uninit(s, DType::BF16, tb * h)?;
        be.embed(s, &self.embed.buf, self.embed.off, inp.block_ids, &mut x, tb, h)?;

        let mut saved: Vec<LayerActs<B>> = Vec::with_capacity(sh.layers);
        for l in 0..sh.layers {
            for a in saved.iter_mut().take((l + 1).saturating_sub(SETTLE_LAG)) {
                a.gu.settle(be, s, parking)?;
            }
            let off = |part: &str| table.off(&format!("layers.{l}.{part}"));
            let shared = SharedRows::of(l, inp.num_blocks, sh.block_size);
            // Rows of the normed input the projections read: every block row, or layer 0's distinct ones.
            let in_rows = shared.as_ref().map_or(tb, SharedRows::rows);
            let mut a = LayerActs::<B> {
                rstd_in: be.alloc_uninit(s, DType::F32, in_rows)?,
                q_pre: None,
                q_rstd: be.alloc_uninit(s, DType::F32, tb * sh.heads)?,
                keys: KeyProj {
                    kc_pre: be.alloc_uninit(s, DType::BF16, tc * kw)?,
                    kc_rstd: be.alloc_uninit(s, DType::F32, tc * sh.kv_heads)?,
                    kb_pre: be.alloc_uninit(s, DType::BF16, tb * kw)?,
                    kb_rstd: be.alloc_uninit(s, DType::F32, tb * sh.kv_heads)?,
                },
                vc: be.alloc_uninit(s, DType::BF16, tc * kw)?,
                vb: be.alloc_uninit(s, DType::BF16, tb * kw)?,
                o: be.alloc(s, DType::BF16, tb * qw)?,
                lse: be.alloc(s, DType::F32, tb * sh.heads)?,
                x_mid: None,
                rstd_post: be.alloc_uninit(s, DType::F32, tb)?,
                gu: GateUp::Moving,
                x_in: Some(x),
            };
            let x_in = a.x_in.as_ref().expect("the forward keeps its input");
            // xn, q, the normed and rotated keys, h2 and act are not kept for the backward: it
            // recomputes them from x_in, q_pre, kc_pre / kb_pre, x_mid and gu with the same kernels
            // (bit-identical, ~1% of the step), which saves six buffers per layer.
            let (wq, wk, wv) =
                (off("self_attn.q_proj.weight"), off("self_attn.k_proj.weight"), off("self_attn.v_proj.weight"));
            let xc = shared.as_ref().map(|sr| sr.gathered(be, s, x_in, h)).transpose()?;
            let mut xn = be.alloc_uninit(s, DType::BF16, in_rows * h)?;
            let inn = off("input_layernorm.weight");
            be.rmsnorm_fwd(s, xc.as_ref().unwrap_or(x_in), w, inn, &mut xn, &mut a.rstd_in, in_rows, h, sh.eps)?;
            drop(xc);
            // Queries from the block stream only; keys and values from [ctx ; xn] with the same
            // Wk / Wv.
            let mut q_pre = be.alloc_uninit(s, DType::BF16, tb * qw)?;
            project(be, s, shared.as_ref(), &xn, tb, h, w, wq, &mut q_pre, qw)?;
            project(be, s, shared.as_ref(), &xn, tb, h, w, wk, &mut a.keys.kb_pre, kw)?;
            project(be, s, shared.as_ref(), &xn, tb, h, w, wv, &mut a.vb, kw)?;
            drop(xn);
            be.gemm(s, &Gemm::linear(tc, kw, h), &ctx, 0, w, wk, &mut a.keys.kc_pre, 0)?;
            be.gemm(s, &Gemm::linear(tc, kw, h), &ctx, 0, w, wv, &mut a.vc, 0)?;
            let qk_norms = [off("self_attn.q_norm.weight"), off("self_attn.k_norm.weight")];
            let [q, kc, kb] = a.keys.rotated(be, s, &sh, w, qk_norms, &q_pre, &mut a.q_rstd, inp)?;
            be.attn_draft_fwd(
                s,
                &ash[l],
                &q,
                &kc,
                &a.vc,
                &kb,
                &a.vb,
                inp.anchors,
                inp.ctx_start,
                &mut a.o,
                &mut a.lse,
            )?;
            drop((q, kc, kb));
            let keep = sh.recompute == Recompute::Norms;
            a.q_pre = keep.then_some(q_pre);
            let x_mid = residual_after_attention(be, s, &sh, tb, w, off("self_attn.o_proj.weight"), x_in, &a.o)?;
            // MLP
            let mut h2 = be.alloc_uninit(s, DType::BF16, tb * h)?;
            be.rmsnorm_fwd(
                s,
                &x_mid,
                w,
                off("post_attention_layernorm.weight"),
                &mut h2,
                &mut a.rstd_post,
                tb,
                h,
                sh.eps,
            )?;
            // gate | up and SwiGLU in one pass (one kernel on CUDA), gate | up kept for the backward.
            let mut gu = be.alloc_uninit(s, DType::BF16, sh.gate_up_len(tb))?;
            let mut act = be.alloc_uninit(s, DType::BF16, tb * inter)?;
            be.mlp_gate_up_act(s, &h2, w, off("mlp.gate_proj.weight"), &mut act, Some(&mut gu), tb, inter, h)?;
            drop(h2);
            x = be.alloc_uninit(s, DType::BF16, tb * h)?;
            be.gemm_residual(s, &Gemm::linear(tb, h, inter), &act, w, off("mlp.down_proj.weight"), &x_mid, &mut x)?;
            drop(act);
            a.x_mid = keep.then_some(x_mid);
            a.gu = match parking.as_mut() {
                Some(p) if l < offload => GateUp::Parked(p.park(be, s, gu)?),
                _ => GateUp::Device(gu),
            };
            if l == 0 {
                // The embedded block tokens: the backward embeds them again (a gather) instead.
                a.x_in = None;
            }
            saved.push(a);
        }
        for a in saved.iter_mut() {
            a.gu.settle(be, s, parking)?;
        }

        // Final norm, then the chunked lm_head + cross-entropy, forward and backward per chunk of
        // whole blocks, on the predicted slots only: slot 0 (the anchor) has no label, so its
        // rows are left out of both lm_head GEMMs (1/block_size of their work) and their
        // gradient stays zero.
        let mut hn = be.alloc_uninit(s, DType::BF16, tb * h)?;
        let mut rstd_f = be.alloc_uninit(s, DType::F32, tb)?;
        be.rmsnorm_fwd(s, &x, w, table.off("norm.weight"), &mut hn, &mut rstd_f, tb, h, sh.eps)?;
        let (bs, nb) = (sh.block_size, inp.num_blocks);
        let per = bs - 1;
        let mut out = DraftOutputs {
            loss: be.alloc(s, DType::F32, (nb * per).max(1))?,
            argmax: be.alloc_ids(s, (nb * per).max(1))?,
        };
        let chunk_blocks = (sh.logits_chunk_rows / per.max(1)).clamp(1, nb.max(1));
        let chunk = chunk_blocks * per;
        let mut logits = be.alloc_uninit(s, DType::BF16, chunk.max(1) * sh.vocab)?;
        let mut hc = be.alloc_uninit(s, DType::BF16, chunk.max(1) * h)?;
        let mut dc = be.alloc_uninit(s, DType::BF16, chunk.max(1) * h)?;
        let loss_region = profile::enter(Region::Loss);
        let mut b0 = 0;
        while per > 0 && b0 < nb {
            let blocks = chunk_blocks.min(nb - b0);
            let (rows, c0) = (blocks * per, b0 * per);
            be.copy_strided(s, &hn, (b0 * bs + 1) * h, bs * h, &mut hc, 0, per * h, blocks, per * h)?;
            be.gemm(s, &Gemm::linear(rows, sh.vocab, h), &hc, 0, &self.lm_head.buf, self.lm_head.off, &mut logits, 0)?;
            be.cross_entropy(
                s,
                &mut logits,
                inp.labels,
                inp.weights,
                c0,
                rows,
                sh.vocab,
                grad_scale,
                &mut out.loss,
                c0,
                &mut out.argmax,
                c0,
            )?;
            let dx_of_logits = Gemm::linear_dx(rows, sh.vocab, h, false);
            be.gemm(s, &dx_of_logits, &logits, 0, &self.lm_head.buf, self.lm_head.off, &mut dc, 0)?;
            // The chunk's gradient goes where its normed rows were (read above, on this stream):
            // `hn` becomes the final norm's output gradient without a buffer of its own.
            be.copy_strided(s, &dc, 0, per * h, &mut hn, (b0 * bs + 1) * h, bs * h, blocks, per * h)?;
            b0 += blocks;
        }
        drop((logits, hc, dc));
        // Slot 0 (the anchor) is not predicted: its rows' gradient is zero.
        let zero = be.alloc(s, DType::BF16, h)?;
        be.copy_strided(s, &zero, 0, 0, &mut hn, 0, bs * h, nb, h)?;
        let dhn = hn;
        drop(loss_region);

        // Backward. `dx` is the gradient of the residual stream; `dctx` collects every layer's
        // K/V-injection gradient.
        let wgrad = &mut self.body.grad;
        let mut dx = be.alloc_uninit(s, DType::BF16, tb * h)?;
        be.rmsnorm_bwd(
            s,
            &dhn,
            &x,
            w,
            table.off("norm.weight"),
            &rstd_f,
            &mut dx,
            false,
            wgrad,
            table.off("norm.weight"),
            tb,
            h,
        )?;
        drop((dhn, x));
        let mut dctx = be.alloc_uninit(s, DType::BF16, tc * h)?;
        for l in (0..sh.layers).rev() {
            let mut a = saved.pop().expect("one saved layer per forward layer");
            for b in saved.iter_mut().skip(l.saturating_sub(RESTORE_LEAD)) {
                b.gu.start_return(be, s, parking)?;
            }
            let mut gu = std::mem::replace(&mut a.gu, GateUp::Moving).into_device(be, s, parking)?;
            let x_in = match a.x_in.take() {
                Some(x_in) => x_in,
                None => {
                    let mut x_in = be.alloc_uninit(s, DType::BF16, tb * h)?;
                    be.embed(s, &self.embed.buf, self.embed.off, inp.block_ids, &mut x_in, tb, h)?;
                    x_in
                }
            };
            let off = |part: &str| table.off(&format!("layers.{l}.{part}"));
            let shared = SharedRows::of(l, inp.num_blocks, sh.block_size);
            let in_rows = shared.as_ref().map_or(tb, SharedRows::rows);
            // MLP: x_out = x_mid + act Wd^T. One [block rows, inter] buffer (dact, then act), and
            // gate|up turns into its own gradient in place: the MLP's backward adds one such
            // buffer to what the forward kept, not three. swiglu_bwd recomputes act over dact in
            // the same pass (the forward's bits), for the down projection's weight gradient.
            let wd = off("mlp.down_proj.weight");
            let mut dact = be.alloc_uninit(s, DType::BF16, tb * inter)?;
            be.gemm(s, &Gemm::linear_dx(tb, h, inter, false), &dx, 0, w, wd, &mut dact, 0)?;
            be.swiglu_bwd(s, &mut dact, &mut gu, tb, inter)?;
            let act = dact;
            be.gemm(s, &Gemm::linear_dw(tb, h, inter), &dx, 0, &act, 0, wgrad, wd)?;
            drop(act);
            let dgu = gu;
            let wg = off("mlp.gate_proj.weight");
            let mut dh2 = be.alloc_uninit(s, DType::BF16, tb * h)?;
            be.gemm(s, &Gemm::linear_dx(tb, 2 * inter, h, false), &dgu, 0, w, wg, &mut dh2, 0)?;
            let pn = off("post_attention_layernorm.weight");
            let wo = off("self_attn.o_proj.weight");
            let x_mid = match a.x_mid.take() {
                Some(x_mid) => x_mid,
                None => residual_after_attention(be, s, &sh, tb, w, wo, &x_in, &a.o)?,
            };
            let mut h2 = be.alloc_uninit(s, DType::BF16, tb * h)?;
            let mut rstd = be.alloc_uninit(s, DType::F32, tb * sh.heads.max(1))?;
            be.rmsnorm_fwd(s, &x_mid, w, pn, &mut h2, &mut rstd, tb, h, sh.eps)?;
            be.gemm(s, &Gemm::linear_dw(tb, 2 * inter, h), &dgu, 0, &h2, 0, wgrad, wg)?;
            drop((dgu, h2));
            be.rmsnorm_bwd(s, &dh2, &x_mid, w, pn, &a.rstd_post, &mut dx, true, wgrad, pn, tb, h)?;
            drop((dh2, x_mid));
            // Attention: x_mid = x_in + o Wo^T
            let mut d_o = be.alloc_uninit(s, DType::BF16, tb * qw)?;
            be.gemm(s, &Gemm::linear_dx(tb, h, qw, false), &dx, 0, w, wo, &mut d_o, 0)?;
            be.gemm(s, &Gemm::linear_dw(tb, h, qw), &dx, 0, &a.o, 0, wgrad, wo)?;
            // The attention backward writes every element of its gradients: nothing to zero.
            let mut dq = be.alloc_uninit(s, DType::BF16, tb * qw)?;
            let mut dkc = be.alloc_uninit(s, DType::BF16, tc * kw)?;
            let mut dvc = be.alloc_uninit(s, DType::BF16, tc * kw)?;
            let mut dkb = be.alloc_uninit(s, DType::BF16, tb * kw)?;
            let mut dvb = be.alloc_uninit(s, DType::BF16, tb * kw)?;
            let (qn, kn) = (off("self_attn.q_norm.weight"), off("self_attn.k_norm.weight"));
            let (wq, wk, wv) =
                (off("self_attn.q_proj.weight"), off("self_attn.k_proj.weight"), off("self_attn.v_proj.weight"));
            // The normed input (layer 0: its distinct rows): for the projections' weight
            // gradients below, and for the queries' projection when it was not kept.
            let inn = off("input_layernorm.weight");
            let x_in = match &shared {
                Some(sr) => sr.gathered(be, s, &x_in, h)?,
                None => x_in,
            };
            let mut xn = be.alloc_uninit(s, DType::BF16, in_rows * h)?;
            be.rmsnorm_fwd(s, &x_in, w, inn, &mut xn, &mut rstd, in_rows, h, sh.eps)?;
            let q_pre = match a.q_pre.take() {
                Some(q_pre) => q_pre,
                None => {
                    let mut q_pre = be.alloc_uninit(s, DType::BF16, tb * qw)?;
                    project(be, s, shared.as_ref(), &xn, tb, h, w, wq, &mut q_pre, qw)?;
                    q_pre
                }
            };
            // The recomputed rstd of q goes to scratch: the forward's, a.q_rstd, has the same bits.
            let [q, kc, kb] = a.keys.rotated(be, s, &sh, w, [qn, kn], &q_pre, &mut rstd, inp)?;
            be.attn_draft_bwd(
                s,
                &ash[l],
                &q,
                &kc,
                &a.vc,
                &kb,
                &a.vb,
                inp.anchors,
                inp.ctx_start,
                &a.o,
                &a.lse,
                &d_o,
                [&mut dq, &mut dkc, &mut dvc, &mut dkb, &mut dvb],
            )?;
            drop((d_o, q, kc, kb));
            be.rope(s, &mut dq, inp.block_pos, tb, sh.heads, sh.head_dim, sh.rope_theta, true)?;
            be.rope(s, &mut dkc, inp.ctx_pos, tc, sh.kv_heads, sh.head_dim, sh.rope_theta, true)?;
            be.rope(s, &mut dkb, inp.block_pos, tb, sh.kv_heads, sh.head_dim, sh.rope_theta, true)?;
            // QK-norm backward (the norm weights collect from queries, or from both key sources).
            let mut dq_pre = be.alloc_uninit(s, DType::BF16, tb * qw)?;
            be.rmsnorm_bwd(
                s,
                &dq,
                &q_pre,
                w,
                qn,
                &a.q_rstd,
                &mut dq_pre,
                false,
                wgrad,
                qn,
                tb * sh.heads,
                sh.head_dim,
            )?;
            let mut dkc_pre = be.alloc_uninit(s, DType::BF16, tc * kw)?;
            be.rmsnorm_bwd(
                s,
                &dkc,
                &a.keys.kc_pre,
                w,
                kn,
                &a.keys.kc_rstd,
                &mut dkc_pre,
                false,
                wgrad,
                kn,
                tc * sh.kv_heads,
                sh.head_dim,
            )?;
            let mut dkb_pre = be.alloc_uninit(s, DType::BF16, tb * kw)?;
            be.rmsnorm_bwd(
                s,
                &dkb,
                &a.keys.kb_pre,
                w,
                kn,
                &a.keys.kb_rstd,
                &mut dkb_pre,
                false,
                wgrad,
                kn,
                tb * sh.kv_heads,
                sh.head_dim,
            )?;
            drop((dq, dkc, dkb, q_pre));
            // The block rows' projection gradients, as rows of `xn` (layer 0: its distinct rows,
            // the mask slots summed).
            let [dq_pre, dkb_pre, dvb] = match &shared {
                None => [dq_pre, dkb_pre, dvb],
                Some(sr) => {
                    let mask = sr.mask_slots(be, s)?;
                    [
                        sr.reduce(be, s, &dq_pre, &mask, qw)?,
                        sr.reduce(be, s, &dkb_pre, &mask, kw)?,
                        sr.reduce(be, s, &dvb, &mask, kw)?,
                    ]
                }
            };
            // Projection weights: block rows and context rows share Wk / Wv.
            be.gemm(s, &Gemm::linear_dw(in_rows, qw, h), &dq_pre, 0, &xn, 0, wgrad, wq)?;
            be.gemm(s, &Gemm::linear_dw(tc, kw, h), &dkc_pre, 0, &ctx, 0, wgrad, wk)?;
            be.gemm(s, &Gemm::linear_dw(in_rows, kw, h), &dkb_pre, 0, &xn, 0, wgrad, wk)?;
            be.gemm(s, &Gemm::linear_dw(tc, kw, h), &dvc, 0, &ctx, 0, wgrad, wv)?;
            be.gemm(s, &Gemm::linear_dw(in_rows, kw, h), &dvb, 0, &xn, 0, wgrad, wv)?;
            drop(xn);
            // dxn = dq Wq + dkb Wk + dvb Wv ; dctx += dkc Wk + dvc Wv
            let mut dxn = be.alloc_uninit(s, DType::BF16, in_rows * h)?;
            be.gemm(s, &Gemm::linear_dx(in_rows, qw, h, false), &dq_pre, 0, w, wq, &mut dxn, 0)?;
            be.gemm(s, &Gemm::linear_dx(in_rows, kw, h, true), &dkb_pre, 0, w, wk, &mut dxn, 0)?;
            be.gemm(s, &Gemm::linear_dx(in_rows, kw, h, true), &dvb, 0, w, wv, &mut dxn, 0)?;
            let first = l + 1 == sh.layers;
            be.gemm(s, &Gemm::linear_dx(tc, kw, h, !first), &dkc_pre, 0, w, wk, &mut dctx, 0)?;
            be.gemm(s, &Gemm::linear_dx(tc, kw, h, true), &dvc, 0, w, wv, &mut dctx, 0)?;
            if shared.is_some() {
                // The embedding is frozen: layer 0's input gradient only feeds its norm's weight.
                let mut unused = be.alloc_uninit(s, DType::BF16, in_rows * h)?;
                be.rmsnorm_bwd(s, &dxn, &x_in, w, inn, &a.rstd_in, &mut unused, false, wgrad, inn, in_rows, h)?;
            } else {
                be.rmsnorm_bwd(s, &dxn, &x_in, w, inn, &a.rstd_in, &mut dx, true, wgrad, inn, tb, h)?;
            }
        }
        // The input embedding is frozen: dx stops here. Context: Y -> hidden_norm -> ctx.
        let hnorm = table.off("hidden_norm.weight");
        be.rmsnorm_bwd(s, &dctx, y, w, hnorm, &rstd_h, dy, false, wgrad, hnorm, tc, h)?;
        Ok(out)
    }
}

impl<B: Backend> Drafter<B> {
    /// Pins host memory for the parked gate|up products of micro-batches of up to `max_blocks`
    /// blocks (`shape.offload_layers` slots), before the first step needs it. Returns the bytes
    /// pinned.
    pub fn reserve_parking(&mut self, be: &B, max_blocks: usize) -> Result<usize> {
        let sh = &self.shape;
        let layers = sh.offload_layers.min(sh.layers);
        if layers == 0 {
            return Ok(0);
        }
        let bytes = sh.gate_up_len(max_blocks * sh.block_size) * DType::BF16.size_bytes();
        self.parking(be)?.reserve(layers, bytes)?;
        Ok(layers * bytes)
    }

    /// The drafter's parking, made on first use.
    fn parking(&mut self, be: &B) -> Result<&mut Parking<B>> {
        match &mut self.parking {
            Some(p) => Ok(p),
            none => Ok(none.insert(Parking::new(be, self.park_fault)?)),
        }
    }

    /// A freshly initialised drafter (DFLASH.md init) and its fc group. `embed` and `lm_head` are
    /// the frozen `[vocab, hidden]` tensors borrowed from the target.
    pub fn new(
        be: &B,
        s: &B::Stream,
        shape: DrafterShape,
        embed: Frozen<B>,
        lm_head: Frozen<B>,
        seed: u64,
    ) -> Result<(Self, ParamGroup<B>)> {
        let mut fc = ParamGroup::new(be, s, shape.fc_table())?;
        fc.set_masters(be, s, &ParamGroup::<B>::init_host(&fc.table, seed, 0))?;
        let mut body = ParamGroup::new(be, s, shape.body_table())?;
        // Streams 1.. for the body so no tensor shares the fc's stream.
        body.set_masters(be, s, &ParamGroup::<B>::init_host(&body.table, seed, 1))?;
        Ok((Drafter { shape, body, embed, lm_head, parking: None, park_fault: Default::default() }, fc))
    }

    /// The target's embedding and lm_head, shared with it (the drafter runs on the target's
    /// device).
    pub fn frozen_from_target(target: &super::target::Target<B>) -> (Frozen<B>, Frozen<B>) {
        use super::target::names;
        (Frozen::of_target(target, names::EMBED), Frozen::of_target(target, names::LM_HEAD))
    }

    /// Copies of the target's embedding and lm_head in buffers of their own on the target's
    /// backend (for a drafter on another device, which `copy_bufs` then moves there).
    pub fn frozen_copies(be: &B, s: &B::Stream, target: &super::target::Target<B>) -> Result<[B::Buf; 2]> {
        use super::target::names;
        let n = target.shape.vocab * target.shape.hidden;
        let mut embed = be.alloc(s, DType::BF16, n)?;
        let mut lm_head = be.alloc(s, DType::BF16, n)?;
        be.copy(s, &target.weights, target.table.off(names::EMBED), &mut embed, 0, n)?;
        be.copy(s, &target.weights, target.table.off(names::LM_HEAD), &mut lm_head, 0, n)?;
        Ok([embed, lm_head])
    }
}

impl DrafterShape {
    /// The drafter of a config, with the lm_head + CE chunk of `logits_chunk_rows` rows.
    pub fn from_config(c: &crate::config::DrafterConfig, logits_chunk_rows: usize) -> Self {
        DrafterShape {
            hidden: c.hidden_size,
            layers: c.num_layers,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            inter: c.intermediate_size,
            vocab: c.vocab_size,
            num_taps: c.target_layer_ids.len(),
            block_size: c.block_size,
            eps: c.rms_norm_eps as f32,
            rope_theta: c.rope_theta as f32,
            windows: (0..c.num_layers).map(|l| c.layer_window(l)).collect(),
            mask_token_id: c.mask_token_id,
            logits_chunk_rows,
            recompute: Recompute::default(),
            offload_layers: 0,
        }
    }
}
