//! The fused passes of the Qwen3.5/3.6 target's forward, as compositions of the unfused ops: the
//! default of each fused [`Backend`] method (the CPU reference runs these, so its results are
//! those of the unfused ops bit for bit), and what a backend falls back to for a shape its fused
//! kernel does not take.

use super::{Backend, GdnShape, Result};

/// The Gated DeltaNet's convolution over its `q | k | v` projection, then the split and the
/// per-head L2 norms (`Backend::gdn_conv_qkv`).
#[derive(Clone, Copy, Debug)]
pub struct GdnConvQkv {
    pub rows: usize,
    /// Key heads and their dim: q and k are `[rows, k_heads * k_dim]`.
    pub k_heads: usize,
    pub k_dim: usize,
    /// `v_heads * v_dim`: v is `[rows, value_dim]`.
    pub value_dim: usize,
    /// The convolution's kernel size and the offset of its `[channels, 1, kernel]` weights.
    pub kernel: usize,
    pub w_off: usize,
    /// The L2 norms' eps, and the factor on the normalised q (`k_dim^-0.5`).
    pub eps: f32,
    pub q_scale: f32,
}

impl GdnConvQkv {
    pub fn key_dim(&self) -> usize {
        self.k_heads * self.k_dim
    }
    /// Channels of the convolution: `2 * key_dim + value_dim`.
    pub fn channels(&self) -> usize {
        2 * self.key_dim() + self.value_dim
    }
}

/// A per-head `1 + w` RMSNorm then partial RoPE (`Backend::rmsnorm1p_rope_partial`) over
/// `rows * heads` heads, head `i` read at `x_off + i * x_stride`.
#[derive(Clone, Copy, Debug)]
pub struct NormRope {
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rot_dim: usize,
    pub theta: f32,
    pub eps: f32,
    pub x_off: usize,
    pub x_stride: usize,
    /// The norm weight's offset in the weight buffer.
    pub w_off: usize,
}

/// The Gated DeltaNet's output norm after its delta rule (`Backend::gdn_chunked_norm_fwd`):
/// `gated_rmsnorm_fwd` over each value head, its weight (`v_dim` values) at `w_off`.
#[derive(Clone, Copy, Debug)]
pub struct GdnOutNorm {
    pub w_off: usize,
    pub eps: f32,
}

/// `gdn_chunked_fwd` into `core`, then `gated_rmsnorm_fwd(core, z)` into `y`.
#[allow(clippy::too_many_arguments)]
pub fn gdn_chunked_norm_fwd<B: Backend + ?Sized>(
    be: &B,
    s: &B::Stream,
    sh: &GdnShape,
    [q, k, v, g, beta]: [&B::Buf; 5],
    seq_starts: &B::Ids,
    state: Option<&mut B::Buf>,
    z: &B::Buf,
    w: &B::Buf,
    norm: &GdnOutNorm,
    core: &mut B::Buf,
    y: &mut B::Buf,
) -> Result<()> {
    be.gdn_chunked_fwd(s, sh, q, k, v, g, beta, seq_starts, core, state)?;
    be.gated_rmsnorm_fwd(s, core, z, w, norm.w_off, y, sh.rows * sh.v_heads, sh.v_dim, norm.eps)
}

/// `causal_conv1d_silu`, three `copy_strided` splits and two `l2norm_fwd`.
#[allow(clippy::too_many_arguments)]
pub fn gdn_conv_qkv<B: Backend + ?Sized>(
    be: &B,
    s: &B::Stream,
    sh: &GdnConvQkv,
    x: &B::Buf,
    w: &B::Buf,
    seq_starts: &B::Ids,
    q: &mut B::Buf,
    k: &mut B::Buf,
    v: &mut B::Buf,
) -> Result<()> {
    let (rows, kd, vd, c) = (sh.rows, sh.key_dim(), sh.value_dim, sh.channels());
    let dt = be.dtype(x);
    let mut conv = be.alloc(s, dt, rows * c)?;
    be.causal_conv1d_silu(s, x, w, sh.w_off, &mut conv, seq_starts, rows, c, sh.kernel)?;
    let mut raw = be.alloc(s, dt, rows * kd)?;
    be.copy_strided(s, &conv, 0, c, &mut raw, 0, kd, rows, kd)?;
    be.l2norm_fwd(s, &raw, q, rows * sh.k_heads, sh.k_dim, sh.eps, sh.q_scale)?;
    be.copy_strided(s, &conv, kd, c, &mut raw, 0, kd, rows, kd)?;
    be.l2norm_fwd(s, &raw, k, rows * sh.k_heads, sh.k_dim, sh.eps, 1.0)?;
    be.copy_strided(s, &conv, 2 * kd, c, v, 0, vd, rows, vd)
}

/// `copy_strided` of the heads, `rmsnorm1p_fwd`, `rope_partial`.
pub fn rmsnorm1p_rope_partial<B: Backend + ?Sized>(
    be: &B,
    s: &B::Stream,
    sh: &NormRope,
    x: &B::Buf,
    w: &B::Buf,
    y: &mut B::Buf,
    pos: &B::Ids,
) -> Result<()> {
    let (n, hd) = (sh.rows * sh.heads, sh.head_dim);
    let mut tmp = be.alloc(s, be.dtype(x), n * hd)?;
    be.copy_strided(s, x, sh.x_off, sh.x_stride, &mut tmp, 0, hd, n, hd)?;
    be.rmsnorm1p_fwd(s, &tmp, w, sh.w_off, y, n, hd, sh.eps)?;
    be.rope_partial(s, y, pos, sh.rows, sh.heads, hd, sh.rot_dim, sh.theta)
}

/// `copy_strided` of the gate, then `sigmoid_mul`.
#[allow(clippy::too_many_arguments)]
pub fn sigmoid_mul_strided<B: Backend + ?Sized>(
    be: &B,
    s: &B::Stream,
    x: &mut B::Buf,
    gate: &B::Buf,
    gate_off: usize,
    gate_stride: usize,
    rows: usize,
    width: usize,
) -> Result<()> {
    let mut g = be.alloc(s, be.dtype(gate), rows * width)?;
    be.copy_strided(s, gate, gate_off, gate_stride, &mut g, 0, width, rows, width)?;
    be.sigmoid_mul(s, x, &g)
}

/// Two `copy_strided` splits of `b | a`, then `gdn_gates`.
#[allow(clippy::too_many_arguments)]
pub fn gdn_gates_ba<B: Backend + ?Sized>(
    be: &B,
    s: &B::Stream,
    ba: &B::Buf,
    w: &B::Buf,
    a_log_off: usize,
    dt_bias_off: usize,
    beta: &mut B::Buf,
    g: &mut B::Buf,
    rows: usize,
    heads: usize,
) -> Result<()> {
    let dt = be.dtype(ba);
    let (mut b, mut a) = (be.alloc(s, dt, rows * heads)?, be.alloc(s, dt, rows * heads)?);
    be.copy_strided(s, ba, 0, 2 * heads, &mut b, 0, heads, rows, heads)?;
    be.copy_strided(s, ba, heads, 2 * heads, &mut a, 0, heads, rows, heads)?;
    be.gdn_gates(s, &b, &a, w, a_log_off, dt_bias_off, beta, g, rows, heads)
}
