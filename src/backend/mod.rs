//! The ops the models need, as one trait with a CPU reference and (later) a CUDA implementation.
//!
//! Shaped for the GPU from the start (DESIGN.md section 4):
//! - every op writes into output buffers the caller passes: no op allocates behind the caller;
//! - every op takes the stream it runs on (a no-op handle on the CPU);
//! - the model never waits for the device: only `download*` returns data to the host, and only the
//!   pipeline and tests call it.
//!
//! Layouts are row-major. A "rows x dim" tensor is a buffer of `rows * dim` elements. Weight
//! tensors live inside one flat parameter buffer and are addressed by element offsets.

pub mod clocks;
pub mod cpu;
pub mod cuda;
pub(crate) mod error;
pub mod fused;
pub mod profile;
pub mod slots;

use std::sync::Arc;

use crate::tensor::DType;
pub use error::{BackendError, NcclFailure, StartError};
pub use slots::{SlotError, SlotMemory};

pub type Result<T> = std::result::Result<T, BackendError>;

/// Checks that a buffer holds at least `need` elements from `off`; the message names the op and
/// the operand so a shape bug reads as one.
pub fn check_len(op: &'static str, operand: &str, have: usize, off: usize, need: usize) -> Result<()> {
    match off.checked_add(need) {
        Some(end) if end <= have => Ok(()),
        _ => Err(BackendError::Shape {
            op,
            what: format!("{operand}: needs elements {off}..{} but the buffer has {have}", off + need),
        }),
    }
}

/// The shape checks of `attn_causal_fwd`, the same on every backend: q and o hold `rows` rows of
/// `heads * head_dim`, k and v of `kv_heads * head_dim` (buffer lengths in that order), and the
/// query heads split evenly over at least one kv head.
#[allow(clippy::too_many_arguments)]
pub fn check_causal_attn(
    q: usize,
    k: usize,
    v: usize,
    o: usize,
    rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<()> {
    const OP: &str = "attn_causal_fwd";
    let (qw, kw) = (heads * head_dim, kv_heads * head_dim);
    check_len(OP, "q", q, 0, rows * qw)?;
    check_len(OP, "k", k, 0, rows * kw)?;
    check_len(OP, "v", v, 0, rows * kw)?;
    check_len(OP, "o", o, 0, rows * qw)?;
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(BackendError::Shape { op: OP, what: format!("{heads} heads over {kv_heads} kv heads") });
    }
    Ok(())
}

/// `bufs` of `from`'s device as buffers of `to`'s device (the same buffers when `to` is `from`).
/// The host waits for the sources' last writes before the copies and for the copies after, so
/// the sources may be dropped on return. For set-up, not for the step loop.
pub fn move_bufs<B: Backend, const N: usize>(
    from: &B,
    to: &B,
    s_to: &B::Stream,
    bufs: [B::Buf; N],
) -> Result<[B::Buf; N]> {
    if std::ptr::eq(from, to) {
        return Ok(bufs);
    }
    copy_bufs(from, to, s_to, bufs.each_ref())
}

/// Copies of `bufs` (on `from`'s device, written on its compute stream) on `to`'s device, ready
/// on `s_to` (a plain device copy when `from` and `to` are the same backend). The host waits for
/// both sides, so the sources may be dropped afterwards.
pub fn copy_bufs<B: Backend, const N: usize>(
    from: &B,
    to: &B,
    s_to: &B::Stream,
    bufs: [&B::Buf; N],
) -> Result<[B::Buf; N]> {
    from.synchronize(&from.compute_stream())?;
    let mut out = Vec::with_capacity(N);
    for b in bufs {
        let mut o = to.alloc(s_to, from.dtype(b), from.len(b))?;
        to.copy_from_peer(s_to, from, b, &mut o)?;
        out.push(o);
    }
    to.synchronize(s_to)?;
    Ok(out.try_into().unwrap_or_else(|_| unreachable!("one output per input")))
}

/// `Backend::set_master` for f32 masters: each value moved off a bf16 tie, then uploaded to the
/// masters and (rounded) to the bf16 weights.
pub fn set_f32_master<B: Backend + ?Sized>(
    be: &B,
    s: &B::Stream,
    host: &[f32],
    master: &mut B::Buf,
    weights: &mut B::Buf,
) -> Result<()> {
    let host: Vec<f32> = host.iter().map(|&x| crate::tensor::master_off_tie(x)).collect();
    be.upload(s, &host, master, 0)?;
    be.upload(s, &host, weights, 0)
}

/// `C[m, n] = alpha * op(A) op(B) + beta * C`, `op(A)` is `m x k` (stored `[k, m]` when `ta`),
/// `op(B)` is `k x n` (stored `[n, k]` when `tb`). f32 accumulation on every backend.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ta: bool,
    pub tb: bool,
    pub alpha: f32,
    pub beta: f32,
}

impl Gemm {
    /// `Y[m, n] = X[m, k] W[n, k]^T` (a linear layer).
    pub fn linear(m: usize, n: usize, k: usize) -> Self {
        Gemm { m, n, k, ta: false, tb: true, alpha: 1.0, beta: 0.0 }
    }
    /// `dX[m, k] (+)= dY[m, n] W[n, k]`.
    pub fn linear_dx(m: usize, n: usize, k: usize, accumulate: bool) -> Self {
        Gemm { m, n: k, k: n, ta: false, tb: false, alpha: 1.0, beta: if accumulate { 1.0 } else { 0.0 } }
    }
    /// `dW[n, k] += dY[m, n]^T X[m, k]` (weight gradients always accumulate).
    pub fn linear_dw(m: usize, n: usize, k: usize) -> Self {
        Gemm { m: n, n: k, k: m, ta: true, tb: false, alpha: 1.0, beta: 1.0 }
    }
}

/// The drafter attention's block geometry (DFLASH.md section 3): block `j` has `block_size`
/// query rows starting at row `j * block_size`; it sees context rows `ctx_start[j] + [0, anchor[j])`
/// and its own block's keys. `anchor[j] < 0` marks a padded block: zero output, zero gradient.
/// `window: Some(W)` makes it a sliding-window layer (DFLASH.md section 3, "Per-layer attention
/// kind"): slot `r` sees context rows `a + r - (W - 1) <= t < a` and the block slots `<= r`.
/// Attention of `rows` query rows over a KV cache (decoding a batch, verifying a block): row `r`
/// sees the cache rows `r * row_stride + [0, len0 + r * len_inc)`, its own key and value among
/// them (written to the cache before). Decoding `B` sequences at step `t`: `row_stride` = the
/// cache's `max_len`, `len0 = t + 1`, `len_inc = 0`; verifying rows `start..` of one sequence:
/// `row_stride = 0`, `len0 = start + 1`, `len_inc = 1` (causal).
#[derive(Clone, Copy, Debug)]
pub struct DecodeAttnShape {
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub row_stride: usize,
    pub len0: usize,
    pub len_inc: usize,
}

impl DecodeAttnShape {
    /// Keys row `r` sees.
    pub fn len(&self, r: usize) -> usize {
        self.len0 + r * self.len_inc
    }
    /// Cache rows a buffer must hold: past the last key of the first and of the last row.
    pub fn cache_rows(&self) -> usize {
        match self.rows {
            0 => 0,
            n => self.len(0).max((n - 1) * self.row_stride + self.len(n - 1)),
        }
    }
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// Rows of a buffer: row `r` starts at `off + r * stride`.
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    pub off: usize,
    pub stride: usize,
}

/// The Qwen3 attention's q/k normalisation and rotation in one pass (`Backend::qk_norm_rope`):
/// `rows` rows of `heads` query heads and `kv_heads` key heads of `head_dim`, read and written
/// where the [`Rows`] say, the norms' weights at `wq_off` / `wk_off` of the weight buffer.
#[derive(Clone, Copy, Debug)]
pub struct QkNormRope {
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
    pub theta: f32,
    pub q_in: Rows,
    pub k_in: Rows,
    pub q_out: Rows,
    pub k_out: Rows,
    pub wq_off: usize,
    pub wk_off: usize,
}

/// The output gate of `Backend::attn_causal_gated_fwd`: head row `i` (row `r`, head `h`, `i = r
/// * heads + h`) of the attention output is multiplied by the sigmoid of `buf[off + i * stride..]`.
pub struct OutGate<'a, T> {
    pub buf: &'a T,
    pub off: usize,
    pub stride: usize,
}

// By hand: derive would ask T: Copy, and only the reference is copied.
impl<T> Clone for OutGate<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for OutGate<'_, T> {}

/// Where `Backend::qk_norm_rope` keeps each head's rstd (`None`: a side without heads).
pub struct QkRstd<'a, T> {
    pub q: Option<&'a mut T>,
    pub k: Option<&'a mut T>,
}

#[derive(Clone, Copy, Debug)]
pub struct DraftAttnShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub ctx_rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `None`: full attention; `Some(W)`: sliding window of `W` positions (the draft token
    /// itself takes one of them), causal inside the block.
    pub window: Option<usize>,
}

impl DraftAttnShape {
    pub fn q_rows(&self) -> usize {
        self.num_blocks * self.block_size
    }
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
    /// The first context position (relative to the sequence) that slot `r` of a block anchored
    /// at `a` sees: 0 in a full layer, `max(0, a + r - (W - 1))` in a sliding one.
    pub fn ctx_lo(&self, a: usize, r: usize) -> usize {
        self.window.map_or(0, |w| (a + r + 1).saturating_sub(w))
    }
    /// Whether slot `r` sees block slot `c` of its own block: always in a full layer, `c <= r`
    /// (causal) in a sliding one.
    pub fn sees_slot(&self, r: usize, c: usize) -> bool {
        self.window.is_none() || c <= r
    }
}

/// Tokens per chunk of the chunked gated delta rule (QWEN35.md section 4; flash-linear-attention's
/// `chunk_gated_delta_rule` uses the same): the intra-chunk system is a 64 x 64 unit
/// lower-triangular solve per (chunk, value head).
pub const GDN_CHUNK: usize = 64;

/// The shapes of one gated-delta-rule call (QWEN35.md section 4): `q, k [rows, k_heads * k_dim]`
/// (already L2-normalised, `q` scaled by `k_dim^-0.5`), `v, o [rows, v_heads * v_dim]`,
/// `g, beta [rows, v_heads]`; value head `h` reads query/key head `h / (v_heads / k_heads)`. The
/// optional state is f32 `[sequences, v_heads, k_dim, v_dim]`: the state each sequence starts from
/// (zero when absent), overwritten with the state after its last token.
#[derive(Clone, Copy, Debug)]
pub struct GdnShape {
    pub rows: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

/// The error of an op that only the CPU reference implements so far.
pub fn no_kernel(op: &str) -> BackendError {
    BackendError::Unsupported(format!("{op} has no CUDA kernel yet: use --device cpu"))
}

/// The values of a finished `Backend::read_async`: the f32 buffers', then the id buffers', each
/// in the order asked.
pub type ReadValues = (Vec<Vec<f32>>, Vec<Vec<i32>>);

/// One AdamW update on f32 masters (DFLASH.md section 4).
#[derive(Clone, Copy, Debug)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step count for bias correction.
    pub t: u32,
    /// Multiplies the gradient first (the global-norm clip factor).
    pub grad_scale: f32,
}

/// `Backend::mlp_gate_up_act` in two steps: the GEMM into `gu` (or, without one, a `rows x 2 *
/// inter` scratch of its own), then `swiglu_fwd` (`shape`: rows, inter, h). The scratch is left
/// unfilled: the GEMM writes every element before `swiglu_fwd` reads it (initcheck, which does not
/// see every cuBLASLt store, may say otherwise on CUDA).
#[allow(clippy::too_many_arguments)]
pub fn mlp_two_step<B: Backend + ?Sized>(
    be: &B,
    s: &B::Stream,
    x: &B::Buf,
    w: &B::Buf,
    w_off: usize,
    act: &mut B::Buf,
    gu: Option<&mut B::Buf>,
    shape: [usize; 3],
) -> Result<()> {
    let [rows, inter, h] = shape;
    let mut scratch = None;
    let gu = match gu {
        Some(gu) => gu,
        None => scratch.insert(be.alloc_uninit(s, DType::BF16, rows * 2 * inter)?),
    };
    be.gemm(s, &Gemm::linear(rows, 2 * inter, h), x, 0, w, w_off, gu, 0)?;
    be.swiglu_fwd(s, gu, act, rows, inter)
}

/// Everything the target and drafter need from a device. Implemented by `cpu::CpuBackend` (the
/// reference) and by the CUDA backend.
pub trait Backend: Send + Sync + 'static {
    /// Float storage (f32 or bf16) on the device.
    type Buf: Send + Sync;
    /// i32 storage (token ids, positions, anchors, offsets, labels).
    type Ids: Send + Sync;
    /// A stream handle; ops on one stream run in order.
    type Stream: Clone + Send + Sync;

    fn name(&self) -> String;
    fn compute_stream(&self) -> Self::Stream;
    /// Another stream on the same device (the target side's, a copy stream).
    fn new_stream(&self) -> Result<Self::Stream>;
    /// Cross-stream hand-off (DESIGN.md rules 2-3): `to` waits for everything enqueued on `from`
    /// so far, and each buffer records its use on `to`, so its memory is not reused before `to`
    /// is done with it.
    fn hand_over(&self, from: &Self::Stream, to: &Self::Stream, bufs: &[&Self::Buf]) -> Result<()>;
    /// The host waits for everything enqueued on `s` (only the pipeline calls this).
    fn synchronize(&self, s: &Self::Stream) -> Result<()>;
    /// Whether this backend's buffers are host memory already (the CPU reference), so that
    /// parking activations in host memory would only copy them.
    fn memory_is_host(&self) -> bool {
        false
    }
    /// The largest drafter block (`block_size`) its drafter attention takes; `None`: any.
    fn max_block_size(&self) -> Option<usize> {
        None
    }
    /// Device memory in use, for the run summary (None where the host's resident set says it).
    fn memory_report(&self) -> Option<String> {
        None
    }
    /// The device's free and total memory in bytes, as the driver reports them now (None where
    /// buffers are host memory).
    fn device_memory(&self) -> Option<(usize, usize)> {
        None
    }
    /// Starts sampling the device's clocks and power for the run summary: `None` where there is
    /// no such device (the CPU), `Some(Err(why))` where it cannot be read.
    fn clock_monitor(&self) -> Option<std::result::Result<clocks::ClockMonitor, String>> {
        None
    }

    // ---- events and transports (DESIGN.md sections 1-2) ----
    /// A point in a stream's work (a CUDA event); the host or another stream can wait for it.
    type Event: Clone + Send + Sync + 'static;
    /// Pinned host memory for the host-staged transport, with this backend's events
    /// ([`slots`]; the pool over it is `pipeline::slots`).
    type HostMem: SlotMemory<Event = Self::Event>;

    /// Records the work enqueued on `s` so far.
    fn record_event(&self, s: &Self::Stream) -> Result<Self::Event>;
    /// `s` waits, on the device, until `ev` completed; `ev` may come from another device.
    fn wait_event(&self, s: &Self::Stream, ev: &Self::Event) -> Result<()>;
    /// The host waits until `ev` completed.
    fn sync_event(&self, ev: &Self::Event) -> Result<()>;
    /// Records that `bufs` are used on `s` (DESIGN.md rule 2): their memory is not reused before
    /// `s` is done with them.
    fn record_use(&self, s: &Self::Stream, bufs: &[&Self::Buf]) -> Result<()>;
    /// The pinned host memory provider for slot pools.
    fn host_mem(&self) -> Arc<Self::HostMem>;
    /// Async device -> pinned host copy of all of `src` on `s` (the slot must be large enough).
    fn copy_to_host(
        &self,
        s: &Self::Stream,
        src: &Self::Buf,
        dst: &mut <Self::HostMem as SlotMemory>::Slot,
    ) -> Result<()>;
    /// Async pinned host -> device copy filling all of `dst` on `s`.
    fn copy_from_host(
        &self,
        s: &Self::Stream,
        src: &<Self::HostMem as SlotMemory>::Slot,
        dst: &mut Self::Buf,
    ) -> Result<()>;
    /// Async copy of all of `src`, which lives on `src_be`'s device (this one or a peer), into
    /// `dst` on this device, on `s` (a stream of this backend).
    fn copy_from_peer(&self, s: &Self::Stream, src_be: &Self, src: &Self::Buf, dst: &mut Self::Buf) -> Result<()>;
    /// Whether this device reads `other`'s memory directly (NVLink / PCIe peer access). On CUDA
    /// it also enables that access both ways (copy_from_peer asks it itself before its first
    /// copy between two devices, and fails if the answer is no).
    fn is_peer(&self, other: &Self) -> bool;
    /// Starts timing every kernel, GEMM and copy by phase ([`profile`]); false where the backend
    /// has no device clock.
    fn start_profile(&self) -> bool {
        false
    }

    /// The phases of the work enqueued since the last call (the host waits for it to finish);
    /// None when not profiling.
    fn take_profile_step(&self) -> Result<Option<profile::StepPhases>> {
        Ok(None)
    }

    /// The phases of every profiled step completed since the last call, one per step, split at
    /// the markers of [`Self::mark_step`]: a step counts once every event up to its closing
    /// marker has completed (non-blocking queries; the training loop's host never waits for the
    /// device) and a partial one stays for the next call. With `wait` (the end of a run) the host
    /// waits for everything first and every step is taken; work after the last marker belongs to
    /// no step and is dropped. Empty when not profiling.
    fn take_profile_steps(&self, _wait: bool) -> Result<Vec<profile::StepPhases>> {
        Ok(Vec::new())
    }

    /// A timed event at a step boundary on `s` (the start of a step, or after the last): the
    /// step clock of the synchronous loop, and, when profiling, where the profiler splits its
    /// timed work into steps. None where the backend has no device clock.
    fn mark_step(&self, s: &Self::Stream) -> Result<Option<Self::Event>> {
        self.record_timed(s)
    }

    /// An event that also takes a device timestamp (None where the backend has no device clock).
    fn record_timed(&self, _s: &Self::Stream) -> Result<Option<Self::Event>> {
        Ok(None)
    }
    /// Seconds between two completed timed events (the host waits for `end`).
    fn elapsed_secs(&self, _start: &Self::Event, _end: &Self::Event) -> Option<f64> {
        None
    }
    /// The NaN suite's forced hazard: `s` waits, on the device, until the 32-bit word at the
    /// start of `flag` (zeroed by `fill`) is at least `value`, as written by `signal_flag` on
    /// another stream. The CPU backend runs every op in host order, so both are no-ops there.
    fn wait_flag(&self, _s: &Self::Stream, _flag: &Self::Buf, _value: u32) -> Result<()> {
        Ok(())
    }
    /// Writes `value` to the 32-bit word at the start of `flag`, in `s`'s order.
    fn signal_flag(&self, _s: &Self::Stream, _flag: &Self::Buf, _value: u32) -> Result<()> {
        Ok(())
    }
    /// Device memory currently handed out by the allocator, in bytes (None on the CPU).
    fn allocated_bytes(&self) -> Option<usize> {
        None
    }

    // ---- collectives (data-parallel drafter ranks) ----
    /// One rank's handle in a group of devices that sum gradients together.
    type Comm: Send + Sync;
    /// One communicator per backend of `group` (rank i is `group[i]`). Every rank must then call
    /// `all_reduce_sum` the same number of times, in the same order.
    fn comm_group(group: &[&Self]) -> Result<Vec<Self::Comm>>
    where
        Self: Sized;
    /// `buf` (f32) becomes the element-wise sum of every rank's `buf`, enqueued on `s`. The sum's
    /// order is fixed for a given group, so results are deterministic.
    fn all_reduce_sum(&self, s: &Self::Stream, comm: &Self::Comm, buf: &mut Self::Buf) -> Result<()>;
    /// Makes ranks blocked in (or later entering) `all_reduce_sum` of this group fail instead of
    /// waiting for a rank that has stopped.
    fn comm_abort(&self, _comm: &Self::Comm) {}

    // ---- memory ----
    /// A zero-filled buffer of `len` elements owned by `s`.
    fn alloc(&self, s: &Self::Stream, dtype: DType, len: usize) -> Result<Self::Buf>;
    /// A buffer of `len` elements owned by `s` whose contents are unspecified: for an output the
    /// next operation writes in full before anything reads it. It skips `alloc`'s zero fill, a
    /// device-wide write of the whole buffer (at the Qwen3-8B recipe the drafter's step
    /// allocates ~44 GiB, ~12 ms of fills). The CPU backend fills it with NaN, so a read before
    /// the write poisons the result its tests compare.
    fn alloc_uninit(&self, s: &Self::Stream, dtype: DType, len: usize) -> Result<Self::Buf> {
        self.alloc(s, dtype, len)
    }
    fn alloc_ids(&self, s: &Self::Stream, len: usize) -> Result<Self::Ids>;
    fn len(&self, b: &Self::Buf) -> usize;
    fn dtype(&self, b: &Self::Buf) -> DType;
    /// Host f32 -> device buffer at `off` (rounded to the buffer's dtype).
    fn upload(&self, s: &Self::Stream, host: &[f32], dst: &mut Self::Buf, off: usize) -> Result<()>;
    fn upload_ids(&self, s: &Self::Stream, host: &[i32], dst: &mut Self::Ids) -> Result<()>;
    /// Device -> host; the host waits for `s`.
    fn download(&self, s: &Self::Stream, src: &Self::Buf) -> Result<Vec<f32>>;
    /// A device -> host read in flight (pinned staging memory and the event after its copies on
    /// CUDA; the values themselves on the CPU).
    type Readback: Send;
    /// Enqueues async copies of `bufs` (f32) and `ids` into pinned host memory on `s` and records
    /// an event after them; the host does not wait. The buffers are read in `s`'s order.
    fn read_async(&self, s: &Self::Stream, bufs: &[&Self::Buf], ids: &[&Self::Ids]) -> Result<Self::Readback>;
    /// Waits for a read's copies and returns the values, in the order they were asked for.
    fn read_wait(&self, r: Self::Readback) -> Result<ReadValues>;
    fn download_ids(&self, s: &Self::Stream, src: &Self::Ids) -> Result<Vec<i32>>;
    /// `dst[dst_off..+n] = src[src_off..+n]` (with rounding to dst's dtype).
    #[allow(clippy::too_many_arguments)]
    fn copy(
        &self,
        s: &Self::Stream,
        src: &Self::Buf,
        src_off: usize,
        dst: &mut Self::Buf,
        dst_off: usize,
        n: usize,
    ) -> Result<()>;
    fn fill(&self, s: &Self::Stream, dst: &mut Self::Buf, value: f32) -> Result<()>;
    /// `dst[off..off + n]` = elements `0..n` of `draw` (`weights::init_value_bf16`, rounded to
    /// the buffer's dtype): a random-init preset's tensor. Drawn on the host, a slice at a time,
    /// and uploaded; CUDA draws the normal roles on the device, the same bits.
    fn fill_init(
        &self,
        s: &Self::Stream,
        dst: &mut Self::Buf,
        off: usize,
        n: usize,
        draw: &crate::weights::InitDraw,
    ) -> Result<()> {
        fill_init_on_host(self, s, dst, off, n, draw)
    }

    // ---- dense math ----
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        s: &Self::Stream,
        g: &Gemm,
        a: &Self::Buf,
        a_off: usize,
        b: &Self::Buf,
        b_off: usize,
        c: &mut Self::Buf,
        c_off: usize,
    ) -> Result<()>;
    /// `d[m, n] = r[m, n] + x[m, k] w[w_off..][n, k]^T` (`g` from `Gemm::linear`): a linear
    /// layer and the residual add after it, rounded once to `d`'s dtype, with `r` kept. The
    /// CUDA backend reads `r` in the GEMM's epilogue; the default copies it to `d` first.
    #[allow(clippy::too_many_arguments)]
    fn gemm_residual(
        &self,
        s: &Self::Stream,
        g: &Gemm,
        x: &Self::Buf,
        w: &Self::Buf,
        w_off: usize,
        r: &Self::Buf,
        d: &mut Self::Buf,
    ) -> Result<()> {
        // A copy into another dtype would round `r` before the add: refused, as the CUDA GEMM does.
        let (rt, dt) = (self.dtype(r), self.dtype(d));
        if rt != dt {
            return Err(BackendError::DType { op: "gemm_residual r", expected: dt.name(), found: rt.name() });
        }
        self.copy(s, r, 0, d, 0, g.m * g.n)?;
        self.gemm(s, &Gemm { beta: 1.0, ..*g }, x, 0, w, w_off, d, 0)
    }
    /// The FC projection (DFLASH.md section 2): `y[rows, h] = x[rows, k] w[w_off..][h, k]^T`, bf16
    /// in and out, f32 accumulation. The CUDA backend runs its own kernel (kernels/fc.cu); the
    /// default is the GEMM.
    #[allow(clippy::too_many_arguments)]
    fn fc_project(
        &self,
        s: &Self::Stream,
        x: &Self::Buf,
        w: &Self::Buf,
        w_off: usize,
        y: &mut Self::Buf,
        rows: usize,
        h: usize,
        k: usize,
    ) -> Result<()> {
        self.gemm(s, &Gemm::linear(rows, h, k), x, 0, w, w_off, y, 0)
    }
    // ---- normalisation ----
    /// `y = x * rstd * w`, `rstd = 1 / sqrt(mean(x^2) + eps)` per row of `dim`; saves `rstd` (f32).
    /// With `rows = tokens * heads`, `dim = head_dim` this is the per-head QK-norm.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_fwd(
        &self,
        s: &Self::Stream,
        x: &Self::Buf,
        w: &Self::Buf,
        w_off: usize,
        y: &mut Self::Buf,
        rstd: &mut Self::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// `dx (+)= d/dx`, `dw[w_off..] += sum over rows of dy * x * rstd` (f32 gradient buffer).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_bwd(
        &self,
        s: &Self::Stream,
        dy: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        w_off: usize,
        rstd: &Self::Buf,
        dx: &mut Self::Buf,
        accumulate_dx: bool,
        dw: &mut Self::Buf,
        dw_off: usize,
        rows: usize,
        dim: usize,
    ) -> Result<()>;

    // ---- position ----
    /// Rotate-half RoPE in place on `x[rows, heads * head_dim]`, row `i` at position `pos[i]`;
    /// `inverse` rotates back (the backward).
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        s: &Self::Stream,
        x: &mut Self::Buf,
        pos: &Self::Ids,
        rows: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
        inverse: bool,
    ) -> Result<()>;

    // ---- MLP ----
    /// `out[r, c] = silu(gu[r, c]) * gu[r, inter + c]` (gate and up side by side).
    fn swiglu_fwd(
        &self,
        s: &Self::Stream,
        gu: &Self::Buf,
        out: &mut Self::Buf,
        rows: usize,
        inter: usize,
    ) -> Result<()>;
    /// A gated MLP's first half on `x` (`rows x h`): `act = swiglu(x [Wg; Wu]^T)`, the fused gate |
    /// up weight at `w[w_off..]` (`2 * inter x h`, gate_proj's rows then up_proj's). With `gu`
    /// (`rows x 2 * inter`), the projection `act` came from is kept there too (what a backward
    /// needs); without, a backend that fuses the two never writes it. This provided
    /// implementation runs two steps (the GEMM into `gu` or a scratch of its own, then
    /// `swiglu_fwd`); CUDA runs one kernel by default (kernels/mlp.cu). The two agree to the GEMM's
    /// summation order, and `act` is always `swiglu_fwd` of the kept `gu`, bit for bit.
    #[allow(clippy::too_many_arguments)]
    fn mlp_gate_up_act(
        &self,
        s: &Self::Stream,
        x: &Self::Buf,
        w: &Self::Buf,
        w_off: usize,
        act: &mut Self::Buf,
        gu: Option<&mut Self::Buf>,
        rows: usize,
        inter: usize,
        h: usize,
    ) -> Result<()> {
        mlp_two_step(self, s, x, w, w_off, act, gu, [rows, inter, h])
    }
    /// The backward of `swiglu_fwd`, in place on both buffers: `gu` (gate and up) is overwritten
    /// by its gradient, and `dact` (the gradient of `act`) by `act = swiglu_fwd(gu)` itself, bit
    /// for bit, from `gu`'s values before the call: the down projection's weight gradient needs
    /// that activation, and this pass reads `gu` anyway, so the backward recomputes it without a
    /// pass of its own. The drafter's backward needs neither `gu` nor `dact` afterwards, so the
    /// largest activations of a layer are not held twice.
    fn swiglu_bwd(
        &self,
        s: &Self::Stream,
        dact: &mut Self::Buf,
        gu: &mut Self::Buf,
        rows: usize,
        inter: usize,
    ) -> Result<()>;

    // ---- embedding, packing ----
    /// `out[r] = table[off + ids[r] * dim ..][..dim]`.
    #[allow(clippy::too_many_arguments)]
    fn embed(
        &self,
        s: &Self::Stream,
        table: &Self::Buf,
        off: usize,
        ids: &Self::Ids,
        out: &mut Self::Buf,
        rows: usize,
        dim: usize,
    ) -> Result<()>;
    /// `out[t, k*H + c] = t < n_valid ? bf16(tap_k[t, c] + noise) : 0` (DFLASH.md section 2).
    #[allow(clippy::too_many_arguments)]
    fn pack_taps(
        &self,
        s: &Self::Stream,
        taps: &[&Self::Buf],
        out: &mut Self::Buf,
        rows: usize,
        hidden: usize,
        n_valid: usize,
        noise_std: f32,
        seed: u64,
        step: u32,
    ) -> Result<()>;

    // ---- attention ----
    /// Causal GQA over sequences `seq_starts[b]..seq_starts[b+1]` (target forward, no backward).
    #[allow(clippy::too_many_arguments)]
    fn attn_causal_fwd(
        &self,
        s: &Self::Stream,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        o: &mut Self::Buf,
        seq_starts: &Self::Ids,
        rows: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()>;
    /// Drafter block attention forward; saves the log-sum-exp per (row, head) in `lse` (f32).
    #[allow(clippy::too_many_arguments)]
    fn attn_draft_fwd(
        &self,
        s: &Self::Stream,
        sh: &DraftAttnShape,
        q: &Self::Buf,
        kc: &Self::Buf,
        vc: &Self::Buf,
        kb: &Self::Buf,
        vb: &Self::Buf,
        anchors: &Self::Ids,
        ctx_start: &Self::Ids,
        o: &mut Self::Buf,
        lse: &mut Self::Buf,
    ) -> Result<()>;
    /// Its backward: writes (not accumulates) every gradient. `grads = [dq, dkc, dvc, dkb, dvb]`.
    #[allow(clippy::too_many_arguments)]
    fn attn_draft_bwd(
        &self,
        s: &Self::Stream,
        sh: &DraftAttnShape,
        q: &Self::Buf,
        kc: &Self::Buf,
        vc: &Self::Buf,
        kb: &Self::Buf,
        vb: &Self::Buf,
        anchors: &Self::Ids,
        ctx_start: &Self::Ids,
        o: &Self::Buf,
        lse: &Self::Buf,
        d_o: &Self::Buf,
        grads: [&mut Self::Buf; 5],
    ) -> Result<()>;

    // ---- loss ----
    /// Weighted cross-entropy over a chunk of logits `[rows, vocab]`, forward and backward in one
    /// pass: `loss[r] = w[r] * (lse - logit[label])`, `argmax[r]`, and the logits are overwritten
    /// with `grad_scale * w[r] * (softmax - onehot)` (zero where `w[r] == 0`).
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy(
        &self,
        s: &Self::Stream,
        logits: &mut Self::Buf,
        labels: &Self::Ids,
        weights: &Self::Buf,
        w_off: usize,
        rows: usize,
        vocab: usize,
        grad_scale: f32,
        loss: &mut Self::Buf,
        loss_off: usize,
        argmax: &mut Self::Ids,
        argmax_off: usize,
    ) -> Result<()>;

    /// Per head of q and k: `rmsnorm_fwd` (weight `w[wq_off..]` / `w[wk_off..]`, bf16 result)
    /// then `rope` at `pos[r]`, the same arithmetic as those two ops, in one pass over rows read
    /// and written with strides ([`QkNormRope`]). `rstd`, where given, receives each head's
    /// `rmsnorm_fwd` rstd (f32, `[rows * heads]` for q, `[rows * kv_heads]` for k, head-minor),
    /// what the norm's backward reads; each side with heads needs its buffer.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(
        &self,
        s: &Self::Stream,
        sh: &QkNormRope,
        q_in: &Self::Buf,
        k_in: &Self::Buf,
        w: &Self::Buf,
        q_out: &mut Self::Buf,
        k_out: &mut Self::Buf,
        pos: &Self::Ids,
        rstd: Option<QkRstd<'_, Self::Buf>>,
    ) -> Result<()>;

    /// `o = softmax(scale q.k) v` and its log-sum-exp for query rows over a KV cache
    /// ([`DecodeAttnShape`]); `q`, `o`: `[rows, heads * head_dim]`, `kc`, `vc`: cache rows of
    /// `kv_heads * head_dim`, `lse`: f32 `[rows * heads]`.
    #[allow(clippy::too_many_arguments)]
    fn attn_decode(
        &self,
        s: &Self::Stream,
        sh: &DecodeAttnShape,
        q: &Self::Buf,
        kc: &Self::Buf,
        vc: &Self::Buf,
        o: &mut Self::Buf,
        lse: &mut Self::Buf,
    ) -> Result<()>;

    /// `out[r]` = the index of the largest of `x[r * stride ..][..cols]` (the first one on ties),
    /// for each of `rows` rows: greedy decoding's pick without downloading the logits.
    #[allow(clippy::too_many_arguments)]
    fn argmax_rows(
        &self,
        s: &Self::Stream,
        x: &Self::Buf,
        stride: usize,
        rows: usize,
        cols: usize,
        out: &mut Self::Ids,
    ) -> Result<()>;

    // ---- optimizer ----
    /// Masters for `n` parameters in this backend's layout: f32 by default; a backend may keep
    /// them split (`tensor::master_split`: only the low halves, the bf16 weights carrying the
    /// upper ones). Read and written only through `set_master`, `get_master` and the AdamW ops.
    fn alloc_master(&self, s: &Self::Stream, n: usize) -> Result<Self::Buf> {
        self.alloc(s, DType::F32, n)
    }
    /// Sets masters and the bf16 weights from `host` (each value first moved off a bf16 tie,
    /// `tensor::master_off_tie`, as AdamW keeps every master).
    fn set_master(
        &self,
        s: &Self::Stream,
        host: &[f32],
        master: &mut Self::Buf,
        weights: &mut Self::Buf,
    ) -> Result<()> {
        set_f32_master(self, s, host, master, weights)
    }
    /// The masters as f32 values (`weights`: the bf16 weights of the same parameters).
    fn get_master(&self, s: &Self::Stream, master: &Self::Buf, weights: &Self::Buf) -> Result<Vec<f32>> {
        let _ = weights;
        self.download(s, master)
    }
    /// `out[0] = sum(x^2)` in a fixed order (deterministic).
    fn sum_squares(&self, s: &Self::Stream, x: &Self::Buf, out: &mut Self::Buf) -> Result<()>;
    /// AdamW on the masters (f32, or split where `alloc_master` made them so); refreshes the bf16
    /// weights from the masters. The update covers `m.len()` parameters: `master`, `grad` and
    /// `weights` from element `off` on, `m` and `v` from 0 (the moments of a whole group at
    /// `off` 0, or one chunk of them brought from the host, `model::moments`).
    #[allow(clippy::too_many_arguments)]
    fn adamw(
        &self,
        s: &Self::Stream,
        master: &mut Self::Buf,
        grad: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        weights: &mut Self::Buf,
        off: usize,
        hp: &AdamStep,
    ) -> Result<()>;
    /// The update decision of a step on the device (`train::step::plan_update` without the host):
    /// from `body_sumsq[0]`, `fc_sumsq[0]` (f32 sums of squares) and every slot's loss of the
    /// step (`loss`, f32), writes `plan[0]` = the clip factor of the global norm
    /// `sqrt(f64(fc) + f64(body))` (`OptimConfig::clip_scale`, in f64) and `plan[1]` = 1 when the
    /// step is skipped (a non-finite norm, or a non-finite loss where `weighted`: the step has
    /// loss weight), else 0. `plan`: f32 `[2]`.
    #[allow(clippy::too_many_arguments)]
    fn update_plan(
        &self,
        s: &Self::Stream,
        body_sumsq: &Self::Buf,
        fc_sumsq: &Self::Buf,
        loss: &Self::Buf,
        weighted: bool,
        clip: f32,
        plan: &mut Self::Buf,
    ) -> Result<()>;
    /// `adamw` with `hp.grad_scale` replaced by `plan[0]`, and nothing done when `plan[1]` is not
    /// 0 (a skipped step): the update an `update_plan` decided, without the host reading it.
    #[allow(clippy::too_many_arguments)]
    fn adamw_planned(
        &self,
        s: &Self::Stream,
        master: &mut Self::Buf,
        grad: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        weights: &mut Self::Buf,
        off: usize,
        hp: &AdamStep,
        plan: &Self::Buf,
    ) -> Result<()>;
    /// Number of non-finite elements (the NaN checks).
    fn count_nonfinite(&self, s: &Self::Stream, x: &Self::Buf) -> Result<u64>;

    // ---- Qwen3.5/3.6 hybrid target (forward only; QWEN35.md). The defaults are for backends
    // without these kernels yet: they fail with a message naming the op. ----
    /// `y = x * rsqrt(mean(x^2) + eps) * (1 + w)` per row of `dim` (the zero-centred RMSNorm of
    /// every Qwen3.5/3.6 norm but the Gated DeltaNet output norm), f32 math, one rounding.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm1p_fwd(
        &self,
        _s: &Self::Stream,
        _x: &Self::Buf,
        _w: &Self::Buf,
        _w_off: usize,
        _y: &mut Self::Buf,
        _rows: usize,
        _dim: usize,
        _eps: f32,
    ) -> Result<()> {
        Err(no_kernel("rmsnorm1p_fwd"))
    }
    /// `y = x * rsqrt(mean(x^2) + eps) * w * silu(z)` per row of `dim` (the Gated DeltaNet output
    /// norm: plain `w`, gated by `z`).
    #[allow(clippy::too_many_arguments)]
    fn gated_rmsnorm_fwd(
        &self,
        _s: &Self::Stream,
        _x: &Self::Buf,
        _z: &Self::Buf,
        _w: &Self::Buf,
        _w_off: usize,
        _y: &mut Self::Buf,
        _rows: usize,
        _dim: usize,
        _eps: f32,
    ) -> Result<()> {
        Err(no_kernel("gated_rmsnorm_fwd"))
    }
    /// Partial rotate-half RoPE in place on `x[rows, heads * head_dim]`: dims `[0, rot_dim)` of
    /// each head rotate in pairs `(j, j + rot_dim/2)` with `inv_freq_j = theta^(-2j/rot_dim)`,
    /// dims `[rot_dim, head_dim)` pass through.
    #[allow(clippy::too_many_arguments)]
    fn rope_partial(
        &self,
        _s: &Self::Stream,
        _x: &mut Self::Buf,
        _pos: &Self::Ids,
        _rows: usize,
        _heads: usize,
        _head_dim: usize,
        _rot_dim: usize,
        _theta: f32,
    ) -> Result<()> {
        Err(no_kernel("rope_partial"))
    }
    /// `dst[dst_off + r*dst_stride ..][..width] = src[src_off + r*src_stride ..][..width]` for
    /// each of `rows` rows (splitting interleaved projections: query | gate, q | k | v).
    #[allow(clippy::too_many_arguments)]
    fn copy_strided(
        &self,
        _s: &Self::Stream,
        _src: &Self::Buf,
        _src_off: usize,
        _src_stride: usize,
        _dst: &mut Self::Buf,
        _dst_off: usize,
        _dst_stride: usize,
        _rows: usize,
        _width: usize,
    ) -> Result<()> {
        Err(no_kernel("copy_strided"))
    }
    /// `x *= sigmoid(gate)` elementwise over `x`'s length (the gated attention's output gate).
    fn sigmoid_mul(&self, _s: &Self::Stream, _x: &mut Self::Buf, _gate: &Self::Buf) -> Result<()> {
        Err(no_kernel("sigmoid_mul"))
    }
    /// Depthwise causal convolution then SiLU over `x[rows, channels]`, per sequence
    /// `seq_starts[b]..seq_starts[b+1]` with zero left padding at every sequence start:
    /// `y[t, c] = silu(sum_j w[c, j] * x[t - (kernel-1) + j, c])`, `w` at `w_off` laid out
    /// `[channels, 1, kernel]` as transformers stores `conv1d.weight`.
    #[allow(clippy::too_many_arguments)]
    fn causal_conv1d_silu(
        &self,
        _s: &Self::Stream,
        _x: &Self::Buf,
        _w: &Self::Buf,
        _w_off: usize,
        _y: &mut Self::Buf,
        _seq_starts: &Self::Ids,
        _rows: usize,
        _channels: usize,
        _kernel: usize,
    ) -> Result<()> {
        Err(no_kernel("causal_conv1d_silu"))
    }
    /// The Gated DeltaNet gates from `b, a [rows, heads]`: `beta = sigmoid(b)` and
    /// `g = -exp(A_log) * softplus(a + dt_bias)` (a log decay, `g <= 0`), with `A_log` and
    /// `dt_bias` (`[heads]` each) read from `w` at their offsets.
    #[allow(clippy::too_many_arguments)]
    fn gdn_gates(
        &self,
        _s: &Self::Stream,
        _b: &Self::Buf,
        _a: &Self::Buf,
        _w: &Self::Buf,
        _a_log_off: usize,
        _dt_bias_off: usize,
        _beta: &mut Self::Buf,
        _g: &mut Self::Buf,
        _rows: usize,
        _heads: usize,
    ) -> Result<()> {
        Err(no_kernel("gdn_gates"))
    }

    // ---- Fused hybrid ops: each is the composition of the ops above in `fused` (the default
    // here, and so the CPU reference), in one pass over memory where a backend fuses it, with the
    // same roundings.
    /// The Gated DeltaNet's convolution, split and L2 norms ([`fused::GdnConvQkv`]):
    /// `causal_conv1d_silu` of `x [rows, 2 * key_dim + value_dim]` (f32), then the columns
    /// `[0, key_dim)` L2-normalised per key head and scaled by `q_scale` into `q`,
    /// `[key_dim, 2 * key_dim)` L2-normalised into `k`, the rest into `v` (all f32).
    #[allow(clippy::too_many_arguments)]
    fn gdn_conv_qkv(
        &self,
        s: &Self::Stream,
        sh: &fused::GdnConvQkv,
        x: &Self::Buf,
        w: &Self::Buf,
        seq_starts: &Self::Ids,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &mut Self::Buf,
    ) -> Result<()> {
        fused::gdn_conv_qkv(self, s, sh, x, w, seq_starts, q, k, v)
    }
    /// Per head: `rmsnorm1p_fwd` (bf16 result) then `rope_partial` ([`fused::NormRope`]), head
    /// `i` of `rows * heads` read at `x[x_off + i * x_stride..]` (the query half of the gated
    /// attention's head-major `q | gate` projection: `x_stride = 2 * head_dim`), written
    /// contiguously to `y [rows, heads * head_dim]`.
    fn rmsnorm1p_rope_partial(
        &self,
        s: &Self::Stream,
        sh: &fused::NormRope,
        x: &Self::Buf,
        w: &Self::Buf,
        y: &mut Self::Buf,
        pos: &Self::Ids,
    ) -> Result<()> {
        fused::rmsnorm1p_rope_partial(self, s, sh, x, w, y, pos)
    }
    /// `attn_causal_fwd`, then `sigmoid_mul_strided` of its output's `rows * heads` head rows by
    /// `gate` (the Qwen3.5 full-attention layer's output gate), in one pass where the backend
    /// can (the same bits either way).
    #[allow(clippy::too_many_arguments)]
    fn attn_causal_gated_fwd(
        &self,
        s: &Self::Stream,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        o: &mut Self::Buf,
        seq_starts: &Self::Ids,
        rows: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        gate: OutGate<'_, Self::Buf>,
    ) -> Result<()> {
        self.attn_causal_fwd(s, q, k, v, o, seq_starts, rows, heads, kv_heads, head_dim)?;
        self.sigmoid_mul_strided(s, o, gate.buf, gate.off, gate.stride, rows * heads, head_dim)
    }
    /// `x[r, c] *= sigmoid(gate[gate_off + r * gate_stride + c])` over `x [rows, width]`
    /// (`sigmoid_mul` with the gate read in place from the head-major `q | gate` projection).
    #[allow(clippy::too_many_arguments)]
    fn sigmoid_mul_strided(
        &self,
        s: &Self::Stream,
        x: &mut Self::Buf,
        gate: &Self::Buf,
        gate_off: usize,
        gate_stride: usize,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        fused::sigmoid_mul_strided(self, s, x, gate, gate_off, gate_stride, rows, width)
    }
    /// `gdn_gates` from one `[rows, 2 * heads]` projection holding `b | a` per row (the
    /// `in_proj_b` and `in_proj_a` weights adjacent: one GEMM).
    #[allow(clippy::too_many_arguments)]
    fn gdn_gates_ba(
        &self,
        s: &Self::Stream,
        ba: &Self::Buf,
        w: &Self::Buf,
        a_log_off: usize,
        dt_bias_off: usize,
        beta: &mut Self::Buf,
        g: &mut Self::Buf,
        rows: usize,
        heads: usize,
    ) -> Result<()> {
        fused::gdn_gates_ba(self, s, ba, w, a_log_off, dt_bias_off, beta, g, rows, heads)
    }

    /// `y = scale * x * rsqrt(sum(x^2) + eps)` per row of `dim` (per-head L2 norm of the Gated
    /// DeltaNet's q and k; `scale = k_dim^-0.5` for q).
    #[allow(clippy::too_many_arguments)]
    fn l2norm_fwd(
        &self,
        _s: &Self::Stream,
        _x: &Self::Buf,
        _y: &mut Self::Buf,
        _rows: usize,
        _dim: usize,
        _eps: f32,
        _scale: f32,
    ) -> Result<()> {
        Err(no_kernel("l2norm_fwd"))
    }
    /// The gated delta rule token by token, the definition (see [`GdnShape`]): per value head,
    /// `S = exp(g_t) S; S += beta_t k_t (v_t - S^T k_t)^T; o_t = S^T q_t`, restarting at every
    /// sequence start.
    #[allow(clippy::too_many_arguments)]
    fn gdn_recurrent_fwd(
        &self,
        _s: &Self::Stream,
        _sh: &GdnShape,
        _q: &Self::Buf,
        _k: &Self::Buf,
        _v: &Self::Buf,
        _g: &Self::Buf,
        _beta: &Self::Buf,
        _seq_starts: &Self::Ids,
        _o: &mut Self::Buf,
        _state: Option<&mut Self::Buf>,
    ) -> Result<()> {
        Err(no_kernel("gdn_recurrent_fwd"))
    }
    /// The same outputs as [`Backend::gdn_recurrent_fwd`] in chunks of [`GDN_CHUNK`] tokens (WY
    /// form: a unit lower-triangular solve per chunk, then one pass over the chunks carrying `S`).
    #[allow(clippy::too_many_arguments)]
    fn gdn_chunked_fwd(
        &self,
        _s: &Self::Stream,
        _sh: &GdnShape,
        _q: &Self::Buf,
        _k: &Self::Buf,
        _v: &Self::Buf,
        _g: &Self::Buf,
        _beta: &Self::Buf,
        _seq_starts: &Self::Ids,
        _o: &mut Self::Buf,
        _state: Option<&mut Self::Buf>,
    ) -> Result<()> {
        Err(no_kernel("gdn_chunked_fwd"))
    }
    /// The Gated DeltaNet's delta rule and output norm: `gdn_chunked_fwd` of `q, k, v, g, beta`
    /// (its bf16 output) then `gated_rmsnorm_fwd` of it gated by `z` per value head, into `y`
    /// ([`fused::GdnOutNorm`]). A backend may apply the norm inside the delta rule's output pass,
    /// with the same roundings; `core` (`[rows, v_heads * v_dim]` bf16) is then scratch it may
    /// leave unwritten.
    #[allow(clippy::too_many_arguments)]
    fn gdn_chunked_norm_fwd(
        &self,
        s: &Self::Stream,
        sh: &GdnShape,
        qkvgb: [&Self::Buf; 5],
        seq_starts: &Self::Ids,
        state: Option<&mut Self::Buf>,
        z: &Self::Buf,
        w: &Self::Buf,
        norm: &fused::GdnOutNorm,
        core: &mut Self::Buf,
        y: &mut Self::Buf,
    ) -> Result<()> {
        fused::gdn_chunked_norm_fwd(self, s, sh, qkvgb, seq_starts, state, z, w, norm, core, y)
    }
}

/// `Backend::fill_init` drawn on the host, 2^24 elements at a time (the host holds one slice, not
/// the tensor), each slice uploaded.
pub fn fill_init_on_host<B: Backend + ?Sized>(
    be: &B,
    s: &B::Stream,
    dst: &mut B::Buf,
    off: usize,
    n: usize,
    draw: &crate::weights::InitDraw,
) -> Result<()> {
    const SLICE: usize = 1 << 24;
    for i0 in (0..n).step_by(SLICE) {
        let len = SLICE.min(n - i0);
        be.upload(s, &draw.values_f32(i0, len), dst, off + i0)?;
    }
    Ok(())
}
