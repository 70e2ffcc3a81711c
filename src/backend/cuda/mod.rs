//! The CUDA backend: every op of `Backend` as a hand-written kernel (kernels/*.cu, embedded as
//! sm_90a cubins by build.rs) or a cuBLASLt GEMM, memory from our stream-aware caching allocator.
//!
//! Start-up loads every cubin and resolves every kernel, so a missing symbol fails the first test,
//! not step 40,000. Launchers validate shapes and return an error before launching. Buffers record
//! their owner stream; a use on another stream is recorded (`hand_over`), so a freed block is not
//! reused while that stream may still read it (DESIGN.md section 2).

pub mod alloc;
pub mod blas;
mod device;
mod fc;
pub mod launch;
mod mlp;
mod nccl;
mod nvml;
mod tma;
mod transport;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as cu, sys, CudaContext, CudaStream, DriverError};
use rayon::prelude::*;

use super::profile::{self, Phase, StepPhases, Timed, Work};
use super::{
    check_causal_attn, check_len, fused, AdamStep, Backend, BackendError, DecodeAttnShape, DraftAttnShape, GdnShape,
    Gemm, OutGate, QkNormRope, QkRstd, Result, Rows, StartError,
};
use crate::kernels::launch::{
    ARGMAX_BLOCK, ATTN_CAUSAL_KEYS, ATTN_CAUSAL_ROWS, ATTN_CAUSAL_ROWS_HD256, ATTN_CAUSAL_WARPS, ATTN_DRAFT_MAX_ROWS,
    ATTN_KEYS, ATTN_KV_CHUNK, ATTN_KV_ROWS, ATTN_KV_TILES, ATTN_KV_WARPS, ATTN_LD_PAD, ATTN_MAX_BLOCK_KEYS,
    ATTN_WARP_ROWS, CEC_BLOCK, CEC_CHUNKS, CEC_CTAS, CEC_STAGES, CEC_WIDE_CHUNKS, CE_BLOCK, MAX_TAPS, PACK_MAX_BLOCK,
    PACK_UNITS, PACK_VEC_MAX_HIDDEN, RMS_BLOCK, RMS_BWD_TARGET_PARTS, RMS_CHUNKS_PER_LANE, RMS_SLAB_PAD,
    RMS_WARP_TEAM_MAX_DIM, SUMSQ_BLOCK, SUMSQ_PARTS,
};
use crate::kernels::launch::{
    ATTN_WG_ALIGN, ATTN_WG_BLOCK_KEYS, ATTN_WG_BWD_KEYS, ATTN_WG_BWD_KV_ROWS, ATTN_WG_BWD_K_STAGES,
    ATTN_WG_BWD_V_STAGES, ATTN_WG_KEYS_HD128, ATTN_WG_KEYS_HD256, ATTN_WG_K_STAGES, ATTN_WG_ROWS, ATTN_WG_THREADS,
    ATTN_WG_V_STAGES, ATTN_WS_BAR_BYTES, ATTN_WS_BWD_KEYS, ATTN_WS_BWD_K_STAGES, ATTN_WS_BWD_Q_STAGES,
    ATTN_WS_BWD_V_STAGES, ATTN_WS_DRAFT_K_STAGES, ATTN_WS_DRAFT_V_STAGES, ATTN_WS_K_STAGES_HD128,
    ATTN_WS_K_STAGES_HD256, ATTN_WS_THREADS, ATTN_WS_V_STAGES,
};
use crate::kernels::launch::{
    DEC_KEYS, DEC_MMA_MAX_WARPS, GDN_CHUNK, GDN_FAST_BV, GDN_FAST_OUT_BV, GDN_FAST_OUT_THREADS, GDN_FAST_PAD,
    GDN_FAST_STATE_THREADS, GDN_SPLIT_BV, GDN_SPLIT_OUT_BV, GDN_SPLIT_STATE_THREADS, GDN_TC_PAD, GDN_THREADS,
    HYB_BLOCK, HYB_CONV_MAX_K, HYB_CONV_QKV_STEPS, HYB_CONV_QKV_WINDOW, HYB_CONV_ROWS, HYB_NORM_ROPE_HEADS, QKR_HEADS,
    QKR_WARPS,
};
use crate::tensor::{self, DType};
use alloc::{AllocError, BlockId, CachingAllocator, Mode};
pub use device::CudaMem;
pub use fc::FcPath;
use launch::{variant, DevPtr, Elem, Kernel, KernelArgs, Kernels, LaunchCfg, TapPtrs};
pub use mlp::MlpForm;
pub use transport::{CudaEvent, CudaHostMem, CudaReadback, PinnedSlot};

/// A failed driver call while doing `what` (out of memory becomes [`BackendError::OutOfMemory`]).
fn drv(what: impl Into<String>, e: DriverError) -> BackendError {
    BackendError::driver(what, None, e)
}

/// Whether the CUDA backend can start here: the number of visible devices, or why not (with what
/// to do about it).
pub fn probe() -> std::result::Result<usize, StartError> {
    // SAFETY: only asks the dynamic loader whether libcuda can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(StartError::NoDriver);
    }
    if !crate::kernels::built() {
        return Err(StartError::NoKernels);
    }
    cu::init().map_err(StartError::DriverInit)?;
    let n = cu::device::get_count().map_err(StartError::DriverInit)?;
    match usize::try_from(n) {
        Ok(0) | Err(_) => Err(StartError::NoDevices),
        Ok(n) => Ok(n),
    }
}

/// A device buffer: a block of our allocator plus what it holds.
pub struct CudaBuf {
    ptr: u64,
    len: usize,
    dtype: DType,
    block: BlockId,
    pool: Arc<Mutex<CachingAllocator<CudaMem>>>,
}

/// i32 device storage.
pub struct CudaIds {
    ptr: u64,
    len: usize,
    block: BlockId,
    pool: Arc<Mutex<CachingAllocator<CudaMem>>>,
}

/// Set once a device-drawn random init differed from the host's (`fill_init`): presets are then
/// drawn on the host for the rest of the process.
static DEVICE_INIT_OFF: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Little-endian u64 words downloaded as i32 pairs (`CudaBackend::u64_scratch`).
fn u64_words(w: &[i32]) -> impl Iterator<Item = u64> + '_ {
    w.chunks_exact(2).map(|p| u64::from(p[0] as u32) | (u64::from(p[1] as u32) << 32))
}

impl Drop for CudaBuf {
    fn drop(&mut self) {
        if let Ok(mut p) = self.pool.lock() {
            p.free(self.block);
        }
    }
}

impl Drop for CudaIds {
    fn drop(&mut self) {
        if let Ok(mut p) = self.pool.lock() {
            p.free(self.block);
        }
    }
}

impl CudaBuf {
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Elements `off..` as a kernel argument of element type `T`, which must be the buffer's dtype.
    fn at<T: Elem>(&self, op: &'static str, off: usize) -> Result<DevPtr<T>> {
        if self.dtype != T::DTYPE {
            return Err(BackendError::DType { op, expected: T::DTYPE.name(), found: self.dtype.name() });
        }
        check_len(op, "offset", self.len, off, 0)?;
        Ok(DevPtr::new(off_ptr(self, off)))
    }
}

impl CudaIds {
    /// Elements `off..` as a kernel argument.
    fn at(&self, op: &'static str, off: usize) -> Result<DevPtr<i32>> {
        check_len(op, "offset", self.len, off, 0)?;
        Ok(DevPtr::new(self.ptr + 4 * off as u64))
    }
}

/// A stream handle (cheap to clone). Its id is unique for the process's lifetime: the allocator
/// names streams by it, so a stream created after another was dropped never inherits that one's
/// cached memory or pending uses, whatever address the driver gives its handle.
#[derive(Clone)]
pub struct Stream {
    id: u64,
    inner: Arc<CudaStream>,
}

/// Ids handed to streams at creation; never reused.
static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(0);

impl Stream {
    fn new(inner: Arc<CudaStream>) -> Self {
        Stream { id: NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed), inner }
    }
    fn raw(&self) -> sys::CUstream {
        self.inner.cu_stream()
    }
    fn id(&self) -> u64 {
        self.id
    }
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.inner
    }
}

/// An on-chip cross-entropy kernel (kernels/cross_entropy.cu): a cluster of `CEC_CTAS` CTAs per
/// row, CTAs of `CEC_BLOCK` threads, each thread owning `chunks` chunks of 8 of the row,
/// `CEC_STAGES` row shares in each CTA's ring; vocab % 8 == 0 from `min_vocab` (below 32,768 a
/// row stays in L2 between the streaming kernel's two passes anyway) to CTAs x block x chunks x 8.
#[derive(Clone, Copy, Debug)]
struct CeCluster {
    kernel: Kernel,
    chunks: usize,
    min_vocab: usize,
}
/// The cluster kernels: a vocabulary takes the first one that takes it. Up to 163,840 two CTAs
/// fit on an SM; over it a CTA's 64 KB stages fit only one CTA per SM.
const CE_CLUSTERS: [CeCluster; 2] = [
    CeCluster { kernel: Kernel::CrossEntropyClusterBf16, chunks: CEC_CHUNKS, min_vocab: 32_768 },
    CeCluster { kernel: Kernel::CrossEntropyClusterWideBf16, chunks: CEC_WIDE_CHUNKS, min_vocab: 163_848 },
];
impl CeCluster {
    fn max_vocab(&self) -> usize {
        CEC_CTAS * CEC_BLOCK * self.chunks * 8
    }
    /// Dynamic shared memory: `CEC_STAGES` stages of a row share (chunks x block x 16 bytes).
    fn smem(&self) -> usize {
        CEC_STAGES * self.chunks * CEC_BLOCK * 16
    }
    fn takes(&self, vocab: usize) -> bool {
        vocab % 8 == 0 && (self.min_vocab..=self.max_vocab()).contains(&vocab)
    }
}

pub struct CudaBackend {
    /// Cached RoPE inverse frequencies per (head_dim, theta bits), owned by `main`. (The allocator
    /// keeps every stream it names alive, so field order does not matter for their frees.)
    inv_freq: Mutex<HashMap<(usize, u32), CudaBuf>>,
    ctx: Arc<CudaContext>,
    main: Stream,
    pool: Arc<Mutex<CachingAllocator<CudaMem>>>,
    kernels: Kernels,
    blas: blas::Lt,
    sm_count: usize,
    /// Shared memory one CTA may use (static and dynamic), bytes: the device's opt-in limit.
    smem_optin: usize,
    /// The cross-entropy cluster kernels this GPU runs, each with its co-resident cluster count
    /// (the grid it is launched with), in order of preference.
    ce_clusters: Vec<(CeCluster, usize)>,
    /// Contexts (by address) whose memory this device's peer copies may read directly.
    peers: Mutex<Vec<usize>>,
    name: String,
    /// `--profile`: every launch, GEMM and copy timed by phase (see `backend::profile`).
    profiling: std::sync::atomic::AtomicBool,
    /// The timed launches and step markers, in enqueue order, not yet taken.
    timed: Mutex<Vec<profile::Timed<CudaEvent>>>,
    /// Pinned slots of finished `read_async` reads, kept for the next one.
    readback_slots: Arc<Mutex<Vec<PinnedSlot>>>,
    /// The form `mlp_gate_up_act` runs (`DFLASH_MLP_KERNEL`, read at start-up).
    mlp_form: MlpForm,
}

impl CudaBackend {
    /// The kernel `cross_entropy` runs for rows of `vocab` (16-byte aligned logits), with the
    /// number of clusters it launches (None: the streaming kernel, one CTA per row).
    pub fn cross_entropy_kernel(&self, vocab: usize) -> (&'static str, Option<usize>) {
        self.ce_cluster_for(vocab)
            .map_or((Kernel::CrossEntropyBf16.symbol(), None), |(ce, n)| (ce.kernel.symbol(), Some(n)))
    }

    fn ce_cluster_for(&self, vocab: usize) -> Option<(CeCluster, usize)> {
        self.ce_clusters.iter().copied().find(|(ce, _)| ce.takes(vocab))
    }

    /// Starts the backend on device `ordinal`: checks the driver, the device's compute
    /// capability (9.0 or newer: the kernels are sm_90a), loads every kernel.
    pub fn new(ordinal: usize, mode: Mode) -> std::result::Result<Self, StartError> {
        let count = probe()?;
        if ordinal >= count {
            return Err(StartError::NoSuchDevice { ordinal, count });
        }
        let start = |source: BackendError| StartError::Backend { ordinal, source };
        let ctx = CudaContext::new(ordinal).map_err(|e| start(drv("opening the context", e)))?;
        // Our allocator and streams do the bookkeeping; cudarc's per-slice events would only cost.
        // SAFETY: we never use cudarc's CudaSlice cross-stream tracking.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(|e| start(drv("reading the compute capability", e)))?;
        if major < 9 {
            return Err(StartError::TooOld { ordinal, major, minor });
        }
        if major != 9 {
            let cubin_arch = crate::kernels::CUBIN_ARCH;
            return Err(StartError::UnsupportedArch { ordinal, major, minor, cubin_arch });
        }
        let attribute = |a: sys::CUdevice_attribute, what: &str| {
            ctx.attribute(a).map_err(|e| start(drv(format!("reading the {what}"), e)))
        };
        let sm_count = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SM count")?;
        let sm_count = usize::try_from(sm_count)
            .map_err(|_| start(BackendError::Unsupported(format!("the driver reports {sm_count} SMs"))))?;
        let smem_optin = attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "opt-in shared memory per block",
        )?;
        let name = format!("cuda:{ordinal} (sm_{major}{minor}, {sm_count} SMs)");
        // The compute stream runs at the device's highest stream priority, every other stream
        // (a target's beside a drafter on the same GPU, the transports' copy streams) at the
        // default, lowest: when a target's forward and the drafter's step share one GPU, the
        // block scheduler fills SMs with the drafter's work first and the target's work takes
        // what is left (kernel tails, the gaps between launches) instead of both slowing each
        // other down. Priorities change the order blocks start in, never a result.
        ctx.bind_to_thread().map_err(|e| start(drv("binding the context", e)))?;
        let (_, greatest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(|e| start(drv("reading the stream priority range", e)))?;
        let main = Stream::new(
            ctx.new_stream_with_priority(greatest).map_err(|e| start(drv("creating the compute stream", e)))?,
        );
        ctx.bind_to_thread().map_err(|e| start(drv("binding the context", e)))?;
        let kernels = Kernels::load(smem_optin)?;
        // How many clusters of each cross-entropy cluster kernel are resident at once: it runs
        // exactly that many, each streaming rows with the next row's loads in flight.
        // DFLASH_CE_KERNEL=<name> keeps only that kernel (cross_entropy_bf16: none), to compare
        // them on the same shapes.
        let only = std::env::var("DFLASH_CE_KERNEL").ok();
        let streaming = Kernel::CrossEntropyBf16.symbol();
        if let Some(k) = &only {
            if k != streaming && !CE_CLUSTERS.iter().any(|c| c.kernel.symbol() == k) {
                let names: Vec<_> = CE_CLUSTERS.iter().map(|c| c.kernel.symbol()).collect();
                let known = format!("{streaming}, {}", names.join(", "));
                return Err(StartError::UnknownCeKernel { value: k.clone(), known });
            }
        }
        let mut ce_clusters = Vec::new();
        for ce in CE_CLUSTERS.iter().filter(|c| only.as_deref().is_none_or(|k| k == c.kernel.symbol())) {
            match ce_resident_clusters(kernels.get(ce.kernel), ce).map_err(start)? {
                0 => {} // fits no cluster on this GPU: its vocabularies take the next one
                n => ce_clusters.push((*ce, n)),
            }
        }
        // The target's gate | up projection and SwiGLU run as one kernel (kernels/mlp.cu) unless
        // DFLASH_MLP_KERNEL=gemm asks for cuBLASLt's GEMM and swiglu_fwd.
        let mlp_form = match std::env::var("DFLASH_MLP_KERNEL") {
            Err(_) => MlpForm::Fused,
            Ok(v) => MlpForm::from_env_value(&v).ok_or(StartError::UnknownMlpKernel { value: v })?,
        };
        let pool = Arc::new(Mutex::new(CachingAllocator::new(CudaMem::new(ctx.clone()), mode)));
        let blas = blas::Lt::new()?;
        Ok(CudaBackend {
            ctx,
            main,
            pool,
            kernels,
            blas,
            sm_count,
            smem_optin: usize::try_from(smem_optin).unwrap_or(0),
            ce_clusters,
            peers: Mutex::new(Vec::new()),
            name,
            inv_freq: Mutex::new(HashMap::new()),
            profiling: std::sync::atomic::AtomicBool::new(false),
            timed: Mutex::new(Vec::new()),
            readback_slots: Arc::new(Mutex::new(Vec::new())),
            mlp_form,
        })
    }

    pub fn allocator_stats(&self) -> alloc::AllocStats {
        self.pool.lock().map(|p| p.stats()).unwrap_or_default()
    }

    pub fn empty_cache(&self) {
        if let Ok(mut p) = self.pool.lock() {
            p.empty_cache();
        }
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| drv(format!("binding {}'s context to this thread", self.name), e))
    }

    /// `bytes` of device memory owned by `s`; `what` says what for (in an out-of-memory error).
    fn raw_alloc(&self, s: &Stream, bytes: usize, what: impl FnOnce() -> String) -> Result<(u64, BlockId)> {
        self.bind()?;
        let mut p = self.pool.lock().map_err(|_| BackendError::Poisoned("allocator"))?;
        p.device().register(s.id(), &s.inner);
        match p.alloc(s.id(), bytes.max(1)) {
            Ok(b) => Ok((p.ptr(b), b)),
            Err(e) => {
                drop(p);
                Err(alloc_error(e, format!("{} on {}", what(), self.name), cu::mem_get_info().ok()))
            }
        }
    }

    /// Runs `f` (which enqueues `work` on `s`); when profiling, between two timed events filed
    /// under the phase of the calling thread's region.
    fn timed<T>(&self, s: &Stream, work: Work, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.timed_as(s, work, || None, f)
    }

    /// [`Self::timed`], with the operation's label in the per-operation table given by `label`
    /// (default: the kernel's symbol, `gemm` or `copy`); called only when profiling.
    fn timed_as<T>(
        &self,
        s: &Stream,
        work: Work,
        label: impl FnOnce() -> Option<String>,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if !self.profiling.load(std::sync::atomic::Ordering::Relaxed) {
            return f();
        }
        let a = device::Event::record_timed(s.raw()).map_err(|e| drv("profile event", e))?;
        let r = f()?;
        let b = device::Event::record_timed(s.raw()).map_err(|e| drv("profile event", e))?;
        let phase = Phase::of(profile::current(), work);
        let op = label().unwrap_or_else(|| match work {
            Work::Gemm => "gemm".into(),
            Work::Kernel { symbol, .. } => symbol.into(),
            Work::Copy => "copy".into(),
        });
        let (start, end) = (Arc::new(a), Arc::new(b));
        self.timed.lock().map_err(|_| BackendError::Poisoned("profile"))?.push(Timed::Launch { phase, op, start, end });
        Ok(r)
    }

    /// Launches `kernel` with `args` (checked by the generated launcher before the launch).
    fn launch<A: KernelArgs>(&self, s: &Stream, kernel: Kernel, cfg: (usize, usize, usize), args: A) -> Result<()> {
        let work = Work::Kernel { family: kernel.family(), symbol: kernel.symbol() };
        self.timed(s, work, || self.launch_untimed(s, kernel, cfg, args))
    }

    fn launch_untimed<A: KernelArgs>(
        &self,
        s: &Stream,
        kernel: Kernel,
        cfg: (usize, usize, usize),
        args: A,
    ) -> Result<()> {
        if !A::takes(kernel) {
            return Err(BackendError::Unsupported(format!(
                "{} was given the arguments of another signature ({})",
                kernel.symbol(),
                kernel.signature()
            )));
        }
        let cfg = LaunchCfg::new(kernel, cfg.0, cfg.1, cfg.2)?;
        self.bind()?;
        args.launch_raw(kernel, self.kernels.get(kernel), &cfg, s.raw())
    }

    /// `n` u64 words of device scratch (a kernel's counters or lists), read back with
    /// [`u64_words`]; `zeroed` clears them on `s` first.
    fn u64_scratch(&self, s: &Stream, n: usize, zeroed: bool, what: impl FnOnce() -> String) -> Result<CudaIds> {
        let (ptr, block) = self.raw_alloc(s, 8 * n, what)?;
        let ids = CudaIds { ptr, len: 2 * n, block, pool: self.pool.clone() };
        if zeroed {
            // SAFETY: 8 * n bytes allocated.
            unsafe { cu::memset_d8_async(ptr, 0, 8 * n, s.raw()) }.map_err(|e| drv("zeroing u64 scratch", e))?;
        }
        Ok(ids)
    }

    /// Whether `fill_init` draws on the device: until a sampled element differs from the host's,
    /// and not under `DFLASH_INIT=host`.
    fn device_init_ok(&self) -> bool {
        static HOST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let host = *HOST.get_or_init(|| std::env::var("DFLASH_INIT").is_ok_and(|v| v == "host"));
        !host && !DEVICE_INIT_OFF.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Grid for a grid-stride elementwise kernel over `n` elements, 8 per thread.
    fn ew_grid(&self, n: usize) -> usize {
        n.div_ceil(8 * 256).clamp(1, 16 * self.sm_count)
    }

    fn inv_freq(&self, s: &Stream, head_dim: usize, theta: f32) -> Result<DevPtr<f32>> {
        let key = (head_dim, theta.to_bits());
        let mut cache = self.inv_freq.lock().map_err(|_| BackendError::Poisoned("rope cache"))?;
        if let Some(b) = cache.get(&key) {
            return b.at("rope", 0);
        }
        // As Hugging Face (and cpu.rs) compute it: 1 / theta^(2i / d) in f32.
        let host: Vec<f32> = (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect();
        // Owned by the backend's own stream (which lives as long as the cache), not by the
        // caller's: the caller's stream may be gone before the cache is.
        let _ = s;
        let main = self.main.clone();
        let mut b = self.alloc(&main, DType::F32, host.len())?;
        self.upload(&main, &host, &mut b, 0)?;
        // Cached for every stream: the host waits once so no stream can read it early.
        self.synchronize(&main)?;
        let p = b.at("rope", 0)?;
        cache.insert(key, b);
        Ok(p)
    }

    /// Device memory owned by `s` that is not zero-filled, named `what` in an out-of-memory
    /// error: only for buffers the next kernel writes in full before anything reads them.
    fn uninit_buf(&self, s: &Stream, dtype: DType, len: usize, what: &str) -> Result<CudaBuf> {
        let bytes = len.checked_mul(dtype.size_bytes()).ok_or_else(|| BackendError::Shape {
            op: "alloc",
            what: format!("{len} {} elements overflow a byte count", dtype.name()),
        })?;
        let (ptr, block) = self.raw_alloc(s, bytes, || format!("{what} ({len} {} elements)", dtype.name()))?;
        Ok(CudaBuf { ptr, len, dtype, block, pool: self.pool.clone() })
    }

    fn scratch(&self, s: &Stream, n: usize) -> Result<CudaBuf> {
        self.alloc(s, DType::F32, n)
    }

    /// The kernel of an attention family for `head_dim` (one is compiled per supported head dim).
    fn attn_kernel(op: &'static str, variants: &[(&'static str, Kernel)], head_dim: usize) -> Result<Kernel> {
        variant(variants, &head_dim.to_string()).ok_or_else(|| {
            let dims: Vec<&str> = variants.iter().map(|(d, _)| *d).collect();
            BackendError::Shape { op, what: format!("head_dim {head_dim} is not one of the compiled {dims:?}") }
        })
    }

    /// `gemm` with cuBLASLt's `index`-th heuristic algorithm for this shape (the trait's `gemm`
    /// runs the first); `Ok(false)` (nothing enqueued) when the heuristic offered fewer. The
    /// bench times every candidate with it. `c_in` (when given: `[m, n]` from its start, `c`'s
    /// dtype) is the C that `beta` scales, and `c[c_off..]` only the output (`gemm_residual`).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_with(
        &self,
        s: &Stream,
        g: &Gemm,
        a: &CudaBuf,
        a_off: usize,
        b: &CudaBuf,
        b_off: usize,
        c_in: Option<&CudaBuf>,
        c: &mut CudaBuf,
        c_off: usize,
        index: usize,
    ) -> Result<bool> {
        check_len("gemm", "A", a.len, a_off, g.m * g.k)?;
        check_len("gemm", "B", b.len, b_off, g.k * g.n)?;
        check_len("gemm", "C", c.len, c_off, g.m * g.n)?;
        Self::need_bf16("gemm A", a)?;
        Self::need_bf16("gemm B", b)?;
        if let Some(r) = c_in {
            check_len("gemm", "C in", r.len, 0, g.m * g.n)?;
            if r.dtype != c.dtype {
                return Err(BackendError::DType { op: "gemm C in", expected: c.dtype.name(), found: r.dtype.name() });
            }
        }
        if g.m == 0 || g.n == 0 {
            return Ok(true);
        }
        self.bind()?;
        let ws_bytes = blas::WORKSPACE_BYTES;
        // cuBLASLt's workspace is scratch it writes before reading: not zero-filled (a 32 MiB
        // memset per GEMM cost more than the GEMM itself when decoding).
        let ws = self.uninit_buf(s, DType::F32, ws_bytes / 4, "the cuBLASLt workspace")?;
        self.timed_as(
            s,
            Work::Gemm,
            || Some(profile::gemm_label(g.m, g.n, g.k)),
            || {
                let (a, b, d) = (off_ptr(a, a_off), off_ptr(b, b_off), off_ptr(c, c_off));
                let c_ptr = c_in.map_or(d, |r| r.ptr);
                self.blas.matmul(g, a, b, c_ptr, d, c.dtype, ws.ptr, ws_bytes, s.raw(), index)
            },
        )
    }

    /// What `gemm_with`'s `index`-th candidate for this GEMM is (`None` past the heuristic's list):
    /// the bench prints it beside the candidate's time.
    pub fn gemm_candidate(&self, g: &Gemm, c_dtype: DType, index: usize) -> Result<Option<blas::AlgoConfig>> {
        self.bind()?;
        self.blas.describe(g, c_dtype, index)
    }

    /// The causal forward with an explicit kernel form (the trait methods take
    /// `AttnForm::pick_causal`); benches and tests compare the forms with it. `gate`: the output
    /// gate of `Backend::attn_causal_gated_fwd`, which the warp-specialised kernel applies in its
    /// epilogue where the gate allows 16-byte loads; the other forms (and other gates) run
    /// `sigmoid_mul_strided` after the kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_causal_fwd_with(
        &self,
        form: AttnForm,
        s: &Stream,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        o: &mut CudaBuf,
        seq_starts: &CudaIds,
        rows: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        gate: Option<OutGate<'_, CudaBuf>>,
    ) -> Result<()> {
        check_causal_attn(q.len, k.len, v.len, o.len, rows, heads, kv_heads, head_dim)?;
        if let Some(g) = gate {
            check_len(
                "attn_causal_gated_fwd",
                "gate",
                g.buf.len,
                g.off + (rows * heads).saturating_sub(1) * g.stride,
                head_dim,
            )?;
            Self::need_bf16("attn_causal_gated_fwd", g.buf)?;
        }
        // The epilogue reads the gate 8 elements (16 bytes) at a time.
        let aligned = |g: &OutGate<'_, CudaBuf>| {
            g.stride % 8 == 0
                && g.buf.at::<half::bf16>("attn_causal_gated_fwd", g.off).is_ok_and(|p| p.addr() % 16 == 0)
        };
        let fused_gate = gate.filter(|g| form == AttnForm::WarpSpecialized && aligned(g));
        if let (Some(g), None) = (gate, fused_gate) {
            self.attn_causal_fwd_with(form, s, q, k, v, o, seq_starts, rows, heads, kv_heads, head_dim, None)?;
            return self.sigmoid_mul_strided(s, o, g.buf, g.off, g.stride, rows * heads, head_dim);
        }
        if rows == 0 {
            // Nothing to attend; the warp-specialised kernel's exact-grid check and its TMA
            // descriptors (dimensions >= 1) need at least one row.
            return Ok(());
        }
        // Keys per K/V tile of the wgmma and warp-specialised forms (kernels/attention_wgmma.cu).
        let keys = if head_dim > 128 { ATTN_WG_KEYS_HD256 } else { ATTN_WG_KEYS_HD128 };
        let (kernel, cta_rows, threads, smem) = match form {
            AttnForm::Mma => {
                let kernel = Self::attn_kernel("attn_causal_fwd", &launch::AttnCausalFwdBf16Hd::VARIANTS, head_dim)?;
                // A CTA owns ATTN_CAUSAL_ROWS query rows of one head (ATTN_CAUSAL_ROWS_HD256 at
                // head_dim 256); shared memory holds them and ATTN_KV_TILES K/V tiles of
                // ATTN_CAUSAL_KEYS keys, rows of head_dim + pad bf16.
                let cta_rows = if head_dim > 128 { ATTN_CAUSAL_ROWS_HD256 } else { ATTN_CAUSAL_ROWS };
                let ld = head_dim + ATTN_LD_PAD;
                (kernel, cta_rows, ATTN_CAUSAL_WARPS * 32, (cta_rows + ATTN_KV_TILES * ATTN_CAUSAL_KEYS) * ld * 2)
            }
            AttnForm::Wgmma => {
                let kernel = Self::attn_kernel("attn_causal_fwd", &launch::AttnCausalFwdWgBf16Hd::VARIANTS, head_dim)?;
                // kernels/attention_wgmma.cu: ATTN_WG_ROWS query rows of one head per CTA, and
                // ATTN_WG_K_STAGES K and ATTN_WG_V_STAGES V tiles of the head dim's key count,
                // unpadded (swizzled).
                let tiles = ATTN_WG_ROWS + (ATTN_WG_K_STAGES + ATTN_WG_V_STAGES) * keys;
                let smem = tiles * head_dim * 2 + ATTN_WG_ALIGN;
                (kernel, ATTN_WG_ROWS, ATTN_WG_THREADS, smem)
            }
            AttnForm::WarpSpecialized => {
                let kernel = Self::attn_kernel("attn_causal_fwd", &launch::AttnCausalFwdWsBf16Hd::VARIANTS, head_dim)?;
                // kernels/attention_wgmma.cu section 5: the rows and key tiles of the wgmma form, its
                // own K/V stage counts, and the ring's mbarriers.
                let k_stages = if head_dim > 128 { ATTN_WS_K_STAGES_HD256 } else { ATTN_WS_K_STAGES_HD128 };
                let tiles = ATTN_WG_ROWS + (k_stages + ATTN_WS_V_STAGES) * keys;
                let smem = tiles * head_dim * 2 + ATTN_WS_BAR_BYTES + ATTN_WG_ALIGN;
                (kernel, ATTN_WG_ROWS, ATTN_WS_THREADS, smem)
            }
        };
        // One CTA per (query tile, head): the warp-specialised kernel traps on any other grid.
        let grid = rows.div_ceil(cta_rows) * heads;
        let num_seqs = seq_starts.len.checked_sub(1).ok_or_else(|| BackendError::Shape {
            op: "attn_causal_fwd",
            what: "seq_starts is empty (it holds num_seqs + 1 offsets)".into(),
        })?;
        // The mma.sync and wgmma forms take the same arguments (kernels/attention_wgmma.cu repeats
        // attention.cu's signature); the warp-specialised one takes TMA descriptors (below).
        macro_rules! args {
            ($ty:ident) => {
                launch::$ty {
                    q: q.at("attn_causal_fwd", 0)?,
                    k: k.at("attn_causal_fwd", 0)?,
                    v: v.at("attn_causal_fwd", 0)?,
                    o: o.at("attn_causal_fwd", 0)?,
                    seq_starts: seq_starts.at("attn_causal_fwd", 0)?,
                    num_seqs,
                    rows,
                    heads,
                    kv_heads,
                    scale: 1.0f32 / (head_dim as f32).sqrt(),
                }
            };
        }
        match form {
            AttnForm::Mma => self.launch(s, kernel, (grid, threads, smem), args!(AttnCausalFwdBf16Hd)),
            AttnForm::Wgmma => self.launch(s, kernel, (grid, threads, smem), args!(AttnCausalFwdWgBf16Hd)),
            AttnForm::WarpSpecialized => {
                // TMA descriptors: q in boxes of the 128-row query tile, k and v of the key tile,
                // each box one 128-byte swizzle row (64 columns) wide.
                const OP: &str = "attn_causal_fwd";
                let (qp, kp, vp) = (q.at::<half::bf16>(OP, 0)?, k.at::<half::bf16>(OP, 0)?, v.at::<half::bf16>(OP, 0)?);
                let args = launch::AttnCausalFwdWsBf16Hd {
                    map_q: tma::tensor_map_2d(OP, qp.addr(), heads * head_dim, rows, ATTN_WG_ROWS)?,
                    map_k: tma::tensor_map_2d(OP, kp.addr(), kv_heads * head_dim, rows, keys)?,
                    map_v: tma::tensor_map_2d(OP, vp.addr(), kv_heads * head_dim, rows, keys)?,
                    k: kp,
                    v: vp,
                    o: o.at(OP, 0)?,
                    // Without a gate, a live pointer the kernel never reads (gated 0).
                    gate: match fused_gate {
                        Some(g) => g.buf.at(OP, g.off)?,
                        None => kp,
                    },
                    gate_stride: fused_gate.map_or(0, |g| g.stride),
                    gated: usize::from(fused_gate.is_some()),
                    seq_starts: seq_starts.at(OP, 0)?,
                    num_seqs,
                    rows,
                    heads,
                    kv_heads,
                    scale: 1.0f32 / (head_dim as f32).sqrt(),
                };
                self.launch(s, kernel, (grid, threads, smem), args)
            }
        }
    }

    /// The drafter forward with an explicit kernel form (the trait method takes
    /// `AttnForm::pick_draft`); tests and benches compare the forms with it.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_draft_fwd_with(
        &self,
        form: AttnForm,
        s: &Stream,
        sh: &DraftAttnShape,
        q: &CudaBuf,
        kc: &CudaBuf,
        vc: &CudaBuf,
        kb: &CudaBuf,
        vb: &CudaBuf,
        anchors: &CudaIds,
        ctx_start: &CudaIds,
        o: &mut CudaBuf,
        lse: &mut CudaBuf,
    ) -> Result<()> {
        let g = draft_geom("attn_draft_fwd", sh, q, kc, vc, kb, vb, anchors, ctx_start)?;
        check_len("attn_draft_fwd", "o", o.len, 0, sh.q_rows() * g.qw)?;
        check_len("attn_draft_fwd", "lse", lse.len, 0, sh.q_rows() * sh.heads)?;
        const OP: &str = "attn_draft_fwd";
        // Every form's arguments: the mma.sync and plain warpgroup forms take q, kb and vb as
        // pointers (`args!(Ty)`), the warp-specialised form as TMA descriptors in front
        // (`args!(Ty, map_q: .., ..)`).
        macro_rules! args {
            ($ty:ident) => {
                args!($ty, q: q.at(OP, 0)?, kb: kb.at(OP, 0)?, vb: vb.at(OP, 0)?)
            };
            ($ty:ident, $($f:ident: $e:expr),+) => {
                launch::$ty {
                    $($f: $e,)+
                    kc: kc.at(OP, 0)?,
                    vc: vc.at(OP, 0)?,
                    o: o.at(OP, 0)?,
                    lse: lse.at(OP, 0)?,
                    anchors: anchors.at(OP, 0)?,
                    ctx_start: ctx_start.at(OP, 0)?,
                    num_blocks: sh.num_blocks,
                    block_size: sh.block_size,
                    ctx_rows: sh.ctx_rows,
                    heads: sh.heads,
                    kv_heads: sh.kv_heads,
                    scale: sh.scale(),
                    window: sh.window.unwrap_or(0),
                }
            };
        }
        match form {
            AttnForm::Mma => {
                let kernel = Self::attn_kernel(OP, &launch::AttnDraftFwdBf16Hd::VARIANTS, sh.head_dim)?;
                // Shared memory: the query tile (w warps of ATTN_WARP_ROWS rows) and ATTN_KV_TILES
                // K/V tiles of ATTN_KEYS keys.
                let smem = (ATTN_WARP_ROWS * g.w + ATTN_KV_TILES * ATTN_KEYS) * g.ld * 2;
                let grid = sh.num_blocks * sh.kv_heads;
                self.launch(s, kernel, (grid, 32 * g.w, smem), args!(AttnDraftFwdBf16Hd))
            }
            AttnForm::Wgmma | AttnForm::WarpSpecialized => {
                if !form.takes_draft(sh) {
                    return Err(BackendError::Shape {
                        op: OP,
                        what: format!(
                            "the warpgroup kernels take head_dim 128, block_size <= {ATTN_WG_BLOCK_KEYS} and \
                             block_size * heads / kv_heads <= 64 (the warp-specialised one also ctx_rows >= 1), \
                             not head_dim {}, block_size {}, {}/{} heads, {} context rows",
                            sh.head_dim, sh.block_size, sh.heads, sh.kv_heads, sh.ctx_rows
                        ),
                    });
                }
                let grid = sh.num_blocks.div_ceil(2) * sh.kv_heads;
                if form == AttnForm::WarpSpecialized {
                    // kernels/attention_wgmma.cu section 6: section 2's layout with its own stage
                    // counts and the mbarrier ring; K/V context tiles by TMA.
                    let keys = ATTN_WG_KEYS_HD128;
                    let tiles = ATTN_WG_ROWS
                        + (ATTN_WS_DRAFT_K_STAGES + ATTN_WS_DRAFT_V_STAGES) * keys
                        + 4 * ATTN_WG_BLOCK_KEYS;
                    let smem = tiles * sh.head_dim * 2 + ATTN_WS_BAR_BYTES + ATTN_WG_ALIGN;
                    let (kcp, vcp) = (kc.at::<half::bf16>(OP, 0)?, vc.at::<half::bf16>(OP, 0)?);
                    let (qp, kbp, vbp) =
                        (q.at::<half::bf16>(OP, 0)?, kb.at::<half::bf16>(OP, 0)?, vb.at::<half::bf16>(OP, 0)?);
                    let (hd, gq, q_rows) = (sh.head_dim, sh.heads / sh.kv_heads, sh.q_rows());
                    // q read as {column, row, head}: one box is one block's slots of the kv
                    // head's gq q heads, tile row hh * block_size + r.
                    let args = args!(
                        AttnDraftFwdWsBf16Hd128,
                        map_q: tma::tensor_map_3d(
                            OP,
                            qp.addr(),
                            [hd, q_rows, sh.heads],
                            [g.qw * 2, hd * 2],
                            sh.block_size,
                            gq
                        )?,
                        map_kb: tma::tensor_map_2d(OP, kbp.addr(), g.kw, q_rows, sh.block_size)?,
                        map_vb: tma::tensor_map_2d(OP, vbp.addr(), g.kw, q_rows, sh.block_size)?,
                        map_k: tma::tensor_map_2d(OP, kcp.addr(), g.kw, sh.ctx_rows, keys)?,
                        map_v: tma::tensor_map_2d(OP, vcp.addr(), g.kw, sh.ctx_rows, keys)?
                    );
                    let kernel = launch::Kernel::AttnDraftFwdWsBf16Hd128;
                    return self.launch(s, kernel, (grid, ATTN_WS_THREADS, smem), args);
                }
                // kernels/attention_wgmma.cu draft_fwd_wg: two blocks per CTA, the causal layout
                // (128 query rows, K/V stages of ATTN_WG_KEYS_HD128 keys) plus a 16-row K and V
                // tile of block keys per warpgroup.
                let keys = ATTN_WG_KEYS_HD128;
                let tiles = ATTN_WG_ROWS + (ATTN_WG_K_STAGES + ATTN_WG_V_STAGES) * keys + 4 * ATTN_WG_BLOCK_KEYS;
                let smem = tiles * sh.head_dim * 2 + ATTN_WG_ALIGN;
                let kernel = launch::Kernel::AttnDraftFwdWgBf16Hd128;
                self.launch(s, kernel, (grid, ATTN_WG_THREADS, smem), args!(AttnDraftFwdWgBf16Hd128))
            }
        }
    }

    /// The drafter backward with an explicit kernel form (the trait method takes
    /// `AttnForm::pick_draft_bwd`): `Wgmma` runs `attn_draft_bwd_q_wg_bf16_hd128` (dq, dkb, dvb)
    /// and `attn_draft_bwd_kv_wg_bf16_hd128` (dkc, dvc). Tests and benches compare the forms
    /// with it.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_draft_bwd_with(
        &self,
        form: AttnForm,
        s: &Stream,
        sh: &DraftAttnShape,
        q: &CudaBuf,
        kc: &CudaBuf,
        vc: &CudaBuf,
        kb: &CudaBuf,
        vb: &CudaBuf,
        anchors: &CudaIds,
        ctx_start: &CudaIds,
        o: &CudaBuf,
        lse: &CudaBuf,
        d_o: &CudaBuf,
        grads: [&mut CudaBuf; 5],
    ) -> Result<()> {
        let g = draft_geom("attn_draft_bwd", sh, q, kc, vc, kb, vb, anchors, ctx_start)?;
        let [dq, dkc, dvc, dkb, dvb] = grads;
        let qn = sh.q_rows() * g.qw;
        for (n, l) in [("o", o.len), ("d_o", d_o.len), ("dq", dq.len)] {
            check_len("attn_draft_bwd", n, l, 0, qn)?;
        }
        check_len("attn_draft_bwd", "dkc", dkc.len, 0, sh.ctx_rows * g.kw)?;
        check_len("attn_draft_bwd", "dvc", dvc.len, 0, sh.ctx_rows * g.kw)?;
        check_len("attn_draft_bwd", "dkb", dkb.len, 0, sh.q_rows() * g.kw)?;
        check_len("attn_draft_bwd", "dvb", dvb.len, 0, sh.q_rows() * g.kw)?;
        if sh.block_size > ATTN_MAX_BLOCK_KEYS {
            return Err(BackendError::Shape {
                op: "attn_draft_bwd",
                what: format!("block size {} (the kernel supports up to {ATTN_MAX_BLOCK_KEYS})", sh.block_size),
            });
        }
        const OP: &str = "attn_draft_bwd";
        // Before any launch: the warpgroup forms' own limits.
        if form != AttnForm::Mma && !form.takes_draft(sh) {
            return Err(BackendError::Shape {
                op: OP,
                what: format!(
                    "the warpgroup kernels take head_dim 128, block_size <= {ATTN_WG_BLOCK_KEYS} and \
                     block_size * heads / kv_heads <= 64 (the warp-specialised one also ctx_rows >= 1), not \
                     head_dim {}, block_size {}, {}/{} heads, {} context rows",
                    sh.head_dim, sh.block_size, sh.heads, sh.kv_heads, sh.ctx_rows
                ),
            });
        }
        let hd = sh.head_dim;
        let dsum = self.scratch(s, sh.q_rows() * sh.heads)?;
        let prep = Self::attn_kernel(OP, &launch::AttnDraftBwdPrepBf16Hd::VARIANTS, hd)?;
        let args = launch::AttnDraftBwdPrepBf16Hd {
            o: o.at(OP, 0)?,
            d_o: d_o.at(OP, 0)?,
            dsum: dsum.at(OP, 0)?,
            q_rows: sh.q_rows(),
            heads: sh.heads,
        };
        self.launch(s, prep, ((qn / 8).div_ceil(256), 256, 0), args)?;
        if form == AttnForm::WarpSpecialized {
            return self.attn_draft_bwd_ws(
                s,
                sh,
                &g,
                [q, kc, vc, kb, vb, d_o],
                anchors,
                ctx_start,
                lse,
                &dsum,
                [dq, dkc, dvc, dkb, dvb],
            );
        }
        macro_rules! q_args {
            ($ty:ident) => {
                launch::$ty {
                    q: q.at(OP, 0)?,
                    kc: kc.at(OP, 0)?,
                    vc: vc.at(OP, 0)?,
                    kb: kb.at(OP, 0)?,
                    vb: vb.at(OP, 0)?,
                    lse: lse.at(OP, 0)?,
                    dsum: dsum.at(OP, 0)?,
                    d_o: d_o.at(OP, 0)?,
                    dq: dq.at(OP, 0)?,
                    dkb: dkb.at(OP, 0)?,
                    dvb: dvb.at(OP, 0)?,
                    anchors: anchors.at(OP, 0)?,
                    ctx_start: ctx_start.at(OP, 0)?,
                    num_blocks: sh.num_blocks,
                    block_size: sh.block_size,
                    ctx_rows: sh.ctx_rows,
                    heads: sh.heads,
                    kv_heads: sh.kv_heads,
                    scale: sh.scale(),
                    window: sh.window.unwrap_or(0),
                }
            };
        }
        match form {
            AttnForm::Mma => {
                let nq = Self::attn_kernel(OP, &launch::AttnDraftBwdQBf16Hd::VARIANTS, hd)?;
                // Shared memory: Q and dO tiles (w warps of ATTN_WARP_ROWS rows each), ATTN_KV_TILES
                // K/V tiles, and the f32 P and dS side buffers of the block keys.
                let smem = (2 * ATTN_WARP_ROWS * g.w + ATTN_KV_TILES * ATTN_KEYS) * g.ld * 2
                    + 2 * ATTN_WARP_ROWS * g.w * ATTN_MAX_BLOCK_KEYS * 4;
                self.launch(s, nq, (sh.num_blocks * sh.kv_heads, 32 * g.w, smem), q_args!(AttnDraftBwdQBf16Hd))?;
            }
            AttnForm::WarpSpecialized => unreachable!("the warp-specialised backward returned above"),
            AttnForm::Wgmma => {
                // kernels/attention_wgmma.cu draft_bwd_q_wg: two blocks per CTA; Q and dO tiles of
                // ATTN_WG_ROWS rows, K and V stages of ATTN_WG_BWD_KEYS keys, a 16-row K and V tile
                // of block keys per warpgroup, and per warpgroup the f32 P and dS of its block keys
                // (64 rows x ATTN_WG_BLOCK_KEYS).
                let tiles = 2 * ATTN_WG_ROWS
                    + (ATTN_WG_BWD_K_STAGES + ATTN_WG_BWD_V_STAGES) * ATTN_WG_BWD_KEYS
                    + 4 * ATTN_WG_BLOCK_KEYS;
                let smem = tiles * sh.head_dim * 2 + 4 * 64 * ATTN_WG_BLOCK_KEYS * 4 + ATTN_WG_ALIGN;
                let grid = sh.num_blocks.div_ceil(2) * sh.kv_heads;
                let kernel = launch::Kernel::AttnDraftBwdQWgBf16Hd128;
                self.launch(s, kernel, (grid, ATTN_WG_THREADS, smem), q_args!(AttnDraftBwdQWgBf16Hd128))?;
            }
        }
        let [db, de] = self.draft_kv_ranges(s, sh, ctx_start)?;
        macro_rules! kv_args {
            ($ty:ident) => {
                launch::$ty {
                    q: q.at(OP, 0)?,
                    kc: kc.at(OP, 0)?,
                    vc: vc.at(OP, 0)?,
                    lse: lse.at(OP, 0)?,
                    dsum: dsum.at(OP, 0)?,
                    d_o: d_o.at(OP, 0)?,
                    dkc: dkc.at(OP, 0)?,
                    dvc: dvc.at(OP, 0)?,
                    anchors: anchors.at(OP, 0)?,
                    ctx_start: ctx_start.at(OP, 0)?,
                    num_blocks: sh.num_blocks,
                    block_size: sh.block_size,
                    ctx_rows: sh.ctx_rows,
                    heads: sh.heads,
                    kv_heads: sh.kv_heads,
                    scale: sh.scale(),
                    ctx_block_begin: db.at(OP, 0)?,
                    ctx_block_end: de.at(OP, 0)?,
                    window: sh.window.unwrap_or(0),
                }
            };
        }
        match form {
            AttnForm::Mma => {
                let nkv = Self::attn_kernel(OP, &launch::AttnDraftBwdKvBf16Hd::VARIANTS, hd)?;
                // Query rows of a block (all heads of a KV head), padded to chunks of ATTN_KV_CHUNK.
                let m = sh.block_size * (sh.heads / sh.kv_heads);
                let mp = ATTN_KV_CHUNK * m.div_ceil(ATTN_KV_CHUNK);
                // Shared memory: the CTA's K and V rows, 2 stages of Q and dO chunks, and 2 stages
                // of the f32 lse and dsum of every padded row.
                let smem = (2 * ATTN_KV_ROWS + 4 * mp) * g.ld * 2 + 4 * mp * 4;
                let grid = sh.ctx_rows.div_ceil(ATTN_KV_ROWS).max(1) * sh.kv_heads;
                self.launch(s, nkv, (grid, ATTN_KV_WARPS * 32, smem), kv_args!(AttnDraftBwdKvBf16Hd))
            }
            AttnForm::WarpSpecialized => unreachable!("the warp-specialised backward returned above"),
            AttnForm::Wgmma => {
                // kernels/attention_wgmma.cu draft_bwd_kv_wg: ATTN_WG_BWD_KV_ROWS context rows per
                // CTA (K and V), 2 stages of a block's 64-row Q and dO tiles and of its 64 lse and
                // dsum values.
                let smem = (2 * ATTN_WG_BWD_KV_ROWS + 4 * 64) * sh.head_dim * 2 + 4 * 64 * 4 + ATTN_WG_ALIGN;
                let grid = sh.ctx_rows.div_ceil(ATTN_WG_BWD_KV_ROWS).max(1) * sh.kv_heads;
                let kernel = launch::Kernel::AttnDraftBwdKvWgBf16Hd128;
                self.launch(s, kernel, (grid, ATTN_WG_THREADS, smem), kv_args!(AttnDraftBwdKvWgBf16Hd128))
            }
        }
    }

    /// Each context row's range of candidate blocks of the drafter backward over context keys
    /// (`attn_draft_kv_ranges`), on the device: no host round trip.
    fn draft_kv_ranges(&self, s: &Stream, sh: &DraftAttnShape, ctx_start: &CudaIds) -> Result<[CudaIds; 2]> {
        const OP: &str = "attn_draft_bwd";
        let db = self.alloc_ids(s, sh.ctx_rows)?;
        let de = self.alloc_ids(s, sh.ctx_rows)?;
        if sh.ctx_rows > 0 {
            let args = launch::AttnDraftKvRanges {
                ctx_start: ctx_start.at(OP, 0)?,
                num_blocks: sh.num_blocks,
                ctx_rows: sh.ctx_rows,
                ctx_block_begin: db.at(OP, 0)?,
                ctx_block_end: de.at(OP, 0)?,
            };
            let grid = sh.ctx_rows.div_ceil(256).min(16 * self.sm_count);
            self.launch(s, launch::AttnDraftKvRanges::KERNEL, (grid, 256, 0), args)?;
        }
        Ok([db, de])
    }

    /// The warp-specialised drafter backward (kernels/attention_wgmma.cu sections 7 and 8) after
    /// the prep kernel's dsum: both kernels in one launch, `attn_draft_bwd_ws_bf16_hd128`, the
    /// context-key CTAs first. Shared memory: the larger of the two layouts (WsBwdKvGeo: the
    /// CTA's K and V rows and a ring of ATTN_WS_BWD_Q_STAGES stages of a block's Q and dO tiles,
    /// lse, dsum and descriptor; WsBwdQGeo: section 3's tiles with ATTN_WS_BWD_K_STAGES K and
    /// ATTN_WS_BWD_V_STAGES V stages of ATTN_WS_BWD_KEYS keys), plus the mbarriers. Q and dO by 3-D
    /// TMA boxes as the warp-specialised forward's Q, the block keys and the context rows by 2-D
    /// boxes (ATTN_WS_BWD_KEYS rows for section 8, ATTN_WG_BWD_KV_ROWS for section 7).
    #[allow(clippy::too_many_arguments)]
    fn attn_draft_bwd_ws(
        &self,
        s: &Stream,
        sh: &DraftAttnShape,
        g: &DraftGeom,
        [q, kc, vc, kb, vb, d_o]: [&CudaBuf; 6],
        anchors: &CudaIds,
        ctx_start: &CudaIds,
        lse: &CudaBuf,
        dsum: &CudaBuf,
        [dq, dkc, dvc, dkb, dvb]: [&mut CudaBuf; 5],
    ) -> Result<()> {
        const OP: &str = "attn_draft_bwd";
        let [db, de] = self.draft_kv_ranges(s, sh, ctx_start)?;
        let (hd, keys, kr) = (sh.head_dim, ATTN_WS_BWD_KEYS, ATTN_WG_BWD_KV_ROWS);
        let q_tiles = 2 * ATTN_WG_ROWS + (ATTN_WS_BWD_K_STAGES + ATTN_WS_BWD_V_STAGES) * keys + 4 * ATTN_WG_BLOCK_KEYS;
        let q_smem = q_tiles * hd * 2 + 4 * 64 * ATTN_WG_BLOCK_KEYS * 4;
        let kv_smem = 2 * kr * hd * 2 + ATTN_WS_BWD_Q_STAGES * (2 * 64 * hd * 2 + 2 * 64 * 4 + 16);
        let (q_grid, kv_grid) = (sh.num_blocks.div_ceil(2) * sh.kv_heads, sh.ctx_rows.div_ceil(kr) * sh.kv_heads);
        let (gq, q_rows) = (sh.heads / sh.kv_heads, sh.q_rows());
        let by_head = |p: u64| tma::tensor_map_3d(OP, p, [hd, q_rows, sh.heads], [g.qw * 2, hd * 2], sh.block_size, gq);
        let (kcp, vcp) = (kc.at::<half::bf16>(OP, 0)?, vc.at::<half::bf16>(OP, 0)?);
        let rows = |p: u64, n: usize, box_rows: usize| tma::tensor_map_2d(OP, p, g.kw, n, box_rows);
        let (map_q, map_do) =
            (by_head(q.at::<half::bf16>(OP, 0)?.addr())?, by_head(d_o.at::<half::bf16>(OP, 0)?.addr())?);
        let map_kb = rows(kb.at::<half::bf16>(OP, 0)?.addr(), q_rows, sh.block_size)?;
        let map_vb = rows(vb.at::<half::bf16>(OP, 0)?.addr(), q_rows, sh.block_size)?;
        let (map_k, map_v) = (rows(kcp.addr(), sh.ctx_rows, keys)?, rows(vcp.addr(), sh.ctx_rows, keys)?);
        let (map_kc_rows, map_vc_rows) = (rows(kcp.addr(), sh.ctx_rows, kr)?, rows(vcp.addr(), sh.ctx_rows, kr)?);
        let args = launch::AttnDraftBwdWsBf16Hd128 {
            map_q,
            map_do,
            map_kb,
            map_vb,
            map_k,
            map_v,
            map_kc_rows,
            map_vc_rows,
            kc: kcp,
            vc: vcp,
            lse: lse.at(OP, 0)?,
            dsum: dsum.at(OP, 0)?,
            dq: dq.at(OP, 0)?,
            dkb: dkb.at(OP, 0)?,
            dvb: dvb.at(OP, 0)?,
            dkc: dkc.at(OP, 0)?,
            dvc: dvc.at(OP, 0)?,
            anchors: anchors.at(OP, 0)?,
            ctx_start: ctx_start.at(OP, 0)?,
            num_blocks: sh.num_blocks,
            block_size: sh.block_size,
            ctx_rows: sh.ctx_rows,
            heads: sh.heads,
            kv_heads: sh.kv_heads,
            scale: sh.scale(),
            ctx_block_begin: db.at(OP, 0)?,
            ctx_block_end: de.at(OP, 0)?,
            window: sh.window.unwrap_or(0),
        };
        let smem = q_smem.max(kv_smem) + ATTN_WS_BAR_BYTES + ATTN_WG_ALIGN;
        self.launch(s, launch::Kernel::AttnDraftBwdWsBf16Hd128, (kv_grid + q_grid, ATTN_WS_THREADS, smem), args)
    }

    fn need_bf16(op: &'static str, b: &CudaBuf) -> Result<()> {
        if b.dtype != DType::BF16 {
            return Err(BackendError::DType { op, expected: "bf16", found: b.dtype.name() });
        }
        Ok(())
    }

    fn need_f32(op: &'static str, b: &CudaBuf) -> Result<()> {
        if b.dtype != DType::F32 {
            return Err(BackendError::DType { op, expected: "f32", found: b.dtype.name() });
        }
        Ok(())
    }
}

/// An allocator error as a backend error, `context` saying what asked; out of memory carries the
/// device's (free, total) bytes when known.
fn alloc_error(e: AllocError, context: String, device: Option<(usize, usize)>) -> BackendError {
    match e {
        AllocError::OutOfMemory { requested, reserved, allocated } => BackendError::OutOfMemory {
            context,
            requested: Some(requested),
            held: Some((reserved, allocated)),
            device,
            source: None,
        },
        AllocError::Driver { call, bytes, source } => {
            BackendError::driver(format!("{context}: {call}"), Some(bytes), source).with_device_memory(device)
        }
    }
}

/// Co-resident clusters of a cross-entropy cluster kernel on this GPU (0: none fits).
fn ce_resident_clusters(func: sys::CUfunction, ce: &CeCluster) -> Result<usize> {
    let cfg = LaunchCfg::new(ce.kernel, CEC_CTAS, CEC_BLOCK, ce.smem())?;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid(),
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: cfg.block(),
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: cfg.smem(),
        hStream: std::ptr::null_mut(),
        attrs: std::ptr::null_mut(),
        numAttrs: 0,
    };
    let mut n: std::ffi::c_int = 0;
    // SAFETY: a valid function handle of the current context and a fully initialised config (the
    // cluster shape is compiled into the kernel, so no attributes).
    unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, func, &config) }
        .result()
        .map_err(|e| drv(format!("occupancy of {}", ce.kernel.symbol()), e))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

fn off_ptr(b: &CudaBuf, off: usize) -> u64 {
    b.ptr + (off * b.dtype.size_bytes()) as u64
}

/// rmsnorm's team size T(dim), forward and backward (see kernels/rmsnorm.cu): warp teams up to
/// dim 1024, then the whole block owns a row.
fn rms_team(dim: usize) -> usize {
    if dim > RMS_WARP_TEAM_MAX_DIM {
        return RMS_BLOCK;
    }
    let chunks = dim.div_ceil(8).div_ceil(RMS_CHUNKS_PER_LANE).max(1);
    chunks.next_power_of_two().min(32)
}

/// rmsnorm_bwd's rows per part: R = RMS_BLOCK / T(dim) rows at least, else about
/// RMS_BWD_TARGET_PARTS parts. A function of rows and dim only, so dw's summation order (and bits)
/// never depend on the device.
fn rms_bwd_rows_per_part(rows: usize, dim: usize) -> usize {
    (RMS_BLOCK / rms_team(dim)).max(rows.div_ceil(RMS_BWD_TARGET_PARTS))
}

/// How many f32 dw partial sums rows (of `dim`) `rmsnorm_bwd` writes and then reduces: its scratch
/// traffic is 2 * parts * dim * 4 bytes, which an honest bandwidth figure counts.
pub fn rmsnorm_bwd_parts(rows: usize, dim: usize) -> usize {
    rows.div_ceil(rms_bwd_rows_per_part(rows, dim))
}

impl CudaBackend {
    /// The phases of all the profiled work since the last take, as one step (the host waits for
    /// it); step markers among it are ignored (a bench's forward has none).
    fn take_profile(&self) -> Result<Option<StepPhases>> {
        if !self.profiling.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let iv: Vec<_> = std::mem::take(&mut *self.timed.lock().map_err(|_| BackendError::Poisoned("profile"))?)
            .into_iter()
            .filter_map(|t| match t {
                Timed::Launch { phase, op, start, end } => Some((phase, op, start, end)),
                Timed::Marker(_) => None,
            })
            .collect();
        let Some(origin) = iv.first().map(|(_, _, a, _)| a.clone()) else { return Ok(Some(StepPhases::default())) };
        self.bind()?;
        for (_, _, _, b) in &iv {
            b.synchronize().map_err(|e| drv("profile event", e))?;
        }
        let mut spans = Vec::with_capacity(iv.len());
        let mut ops = Vec::with_capacity(iv.len());
        for (p, op, a, b) in &iv {
            let (a, b) = (event_secs(&origin, a)?, event_secs(&origin, b)?);
            spans.push((*p, a, b));
            ops.push((op.clone(), b - a));
        }
        let mut step = profile::fold(spans);
        step.by_op = profile::by_op(ops);
        Ok(Some(step))
    }

    /// The profiled steps complete so far, split at the step markers (`wait`: all of them, the
    /// host waiting for the stream first; the work after the last marker is dropped then).
    fn take_steps(&self, wait: bool) -> Result<Vec<StepPhases>> {
        if !self.profiling.load(Ordering::Relaxed) {
            return Ok(Vec::new());
        }
        self.bind()?;
        let work = {
            let mut timed = self.timed.lock().map_err(|_| BackendError::Poisoned("profile"))?;
            if wait {
                for t in timed.iter() {
                    let ev = match t {
                        Timed::Launch { end, .. } => end,
                        Timed::Marker(e) => e,
                    };
                    ev.synchronize().map_err(|e| drv("profile event", e))?;
                }
            }
            let work = profile::take_complete_steps(&mut timed, wait, |e| e.done());
            if wait {
                timed.clear();
            }
            work
        };
        // Seconds from each step's own opening marker: small values keep the f32 milliseconds
        // of the event timer exact to well under a microsecond.
        work.iter().map(|w| profile::time_step(w, |e| event_secs(&w.start, e))).collect()
    }
}

/// Seconds from `origin` to `e`, both completed timed events.
fn event_secs(origin: &device::Event, e: &device::Event) -> Result<f64> {
    Ok(f64::from(device::Event::elapsed_ms(origin, e).map_err(|e| drv("profile event time", e))?) / 1e3)
}

impl CudaBackend {
    /// AdamW, plain or with a device update plan, on f32 masters (`master` is f32) or split
    /// masters (`master` holds the low halves: `alloc_master`), over the `m.len` parameters from
    /// `off` on (`Backend::adamw`).
    #[allow(clippy::too_many_arguments)]
    fn adamw_launch(
        &self,
        s: &Stream,
        master: &mut CudaBuf,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        weights: &mut CudaBuf,
        off: usize,
        hp: &AdamStep,
        plan: Option<&CudaBuf>,
    ) -> Result<()> {
        let n = m.len;
        check_len("adamw", "v", v.len, 0, n)?;
        for (name, len) in [("master", master.len), ("grad", grad.len), ("weights", weights.len)] {
            check_len("adamw", name, len, off, n)?;
        }
        for b in [grad, &*m, &*v] {
            Self::need_f32("adamw", b)?;
        }
        let bc1 = (1.0 - f64::from(hp.beta1).powi(hp.t as i32)) as f32;
        let bc2 = (1.0 - f64::from(hp.beta2).powi(hp.t as i32)) as f32;
        let grid = (n.div_ceil(4 * 256).clamp(1, 16 * self.sm_count), 256, 0);
        macro_rules! go {
            ($k:ident, $last:ident: $val:expr) => {
                self.launch(
                    s,
                    launch::$k::KERNEL,
                    grid,
                    launch::$k {
                        master: master.at("adamw", off)?,
                        grad: grad.at("adamw", off)?,
                        m: m.at("adamw", 0)?,
                        v: v.at("adamw", 0)?,
                        w: weights.at("adamw", off)?,
                        n,
                        lr: hp.lr,
                        beta1: hp.beta1,
                        beta2: hp.beta2,
                        eps: hp.eps,
                        wd: hp.weight_decay,
                        bc1,
                        bc2,
                        $last: $val,
                    },
                )
            };
        }
        match (master.dtype, plan) {
            (DType::F32, None) => go!(AdamwF32, grad_scale: hp.grad_scale),
            (DType::BF16, None) => go!(AdamwSplitF32, grad_scale: hp.grad_scale),
            (DType::F32, Some(p)) => go!(AdamwPlannedF32, plan: p.at("adamw_planned", 0)?),
            (DType::BF16, Some(p)) => go!(AdamwPlannedSplitF32, plan: p.at("adamw_planned", 0)?),
        }
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Ids = CudaIds;
    type Stream = Stream;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn compute_stream(&self) -> Stream {
        self.main.clone()
    }

    fn new_stream(&self) -> Result<Stream> {
        self.bind()?;
        Ok(Stream::new(self.ctx.new_stream().map_err(|e| drv("creating a stream", e))?))
    }

    fn hand_over(&self, from: &Stream, to: &Stream, bufs: &[&CudaBuf]) -> Result<()> {
        if from.id() == to.id() {
            return Ok(());
        }
        self.bind()?;
        let ev = device::Event::record(from.raw()).map_err(|e| drv("hand_over: recording an event", e))?;
        ev.wait_on(to.raw()).map_err(|e| drv("hand_over: waiting on an event", e))?;
        let mut p = self.pool.lock().map_err(|_| BackendError::Poisoned("allocator"))?;
        p.device().register(to.id(), &to.inner);
        for b in bufs {
            p.record_use(b.block, to.id());
        }
        Ok(())
    }

    type Event = CudaEvent;
    type HostMem = CudaHostMem;

    fn record_event(&self, s: &Stream) -> Result<CudaEvent> {
        self.record_event_impl(s)
    }

    fn wait_event(&self, s: &Stream, ev: &CudaEvent) -> Result<()> {
        self.bind()?;
        ev.wait_on(s.raw()).map_err(|e| drv("wait_event", e))
    }

    fn wait_flag(&self, s: &Stream, flag: &CudaBuf, value: u32) -> Result<()> {
        self.bind()?;
        check_len("wait_flag", "flag", flag.len, 0, 1)?;
        // SAFETY: `flag` is a live device allocation of at least 4 bytes (checked above) that
        // outlives the wait (the caller keeps it until the streams are joined); the stream is live.
        let r = unsafe {
            sys::cuStreamWaitValue32_v2(
                s.raw(),
                flag.ptr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        };
        r.result().map_err(|e| drv("cuStreamWaitValue32", e))
    }

    fn signal_flag(&self, s: &Stream, flag: &CudaBuf, value: u32) -> Result<()> {
        self.bind()?;
        check_len("signal_flag", "flag", flag.len, 0, 1)?;
        // SAFETY: as in `wait_flag`.
        let r = unsafe {
            sys::cuStreamWriteValue32_v2(
                s.raw(),
                flag.ptr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        };
        r.result().map_err(|e| drv("cuStreamWriteValue32", e))
    }

    fn sync_event(&self, ev: &CudaEvent) -> Result<()> {
        ev.synchronize().map_err(|e| drv("sync_event", e))
    }

    fn record_use(&self, s: &Stream, bufs: &[&CudaBuf]) -> Result<()> {
        let mut p = self.pool.lock().map_err(|_| BackendError::Poisoned("allocator"))?;
        p.device().register(s.id(), &s.inner);
        for b in bufs {
            if !Arc::ptr_eq(&b.pool, &self.pool) {
                return Err(BackendError::Unsupported(format!(
                    "record_use on {}: a buffer of another device (copy it over first)",
                    self.name
                )));
            }
            p.record_use(b.block, s.id());
        }
        Ok(())
    }

    fn host_mem(&self) -> Arc<CudaHostMem> {
        self.host_mem_impl()
    }

    fn copy_to_host(&self, s: &Stream, src: &CudaBuf, dst: &mut PinnedSlot) -> Result<()> {
        self.copy_to_host_impl(s, src, dst)
    }

    fn copy_from_host(&self, s: &Stream, src: &PinnedSlot, dst: &mut CudaBuf) -> Result<()> {
        self.copy_from_host_impl(s, src, dst)
    }

    fn copy_from_peer(&self, s: &Stream, src_be: &Self, src: &CudaBuf, dst: &mut CudaBuf) -> Result<()> {
        self.copy_from_peer_impl(s, src_be, src, dst)
    }

    fn is_peer(&self, other: &Self) -> bool {
        self.is_peer_impl(other)
    }

    type Comm = nccl::NcclComm;

    fn comm_group(group: &[&Self]) -> Result<Vec<nccl::NcclComm>> {
        nccl::comm_group(group)
    }

    fn all_reduce_sum(&self, s: &Stream, comm: &nccl::NcclComm, buf: &mut CudaBuf) -> Result<()> {
        self.all_reduce_impl(s, comm, buf)
    }

    fn comm_abort(&self, comm: &nccl::NcclComm) {
        self.comm_abort_impl(comm)
    }

    fn start_profile(&self) -> bool {
        self.profiling.store(true, Ordering::Relaxed);
        true
    }

    fn take_profile_step(&self) -> Result<Option<StepPhases>> {
        self.take_profile()
    }

    fn take_profile_steps(&self, wait: bool) -> Result<Vec<StepPhases>> {
        self.take_steps(wait)
    }

    fn mark_step(&self, s: &Stream) -> Result<Option<CudaEvent>> {
        let Some(ev) = self.record_timed(s)? else { return Ok(None) };
        if self.profiling.load(Ordering::Relaxed) {
            self.timed.lock().map_err(|_| BackendError::Poisoned("profile"))?.push(Timed::Marker(ev.clone()));
        }
        Ok(Some(ev))
    }

    fn record_timed(&self, s: &Stream) -> Result<Option<CudaEvent>> {
        self.bind()?;
        Ok(Some(Arc::new(device::Event::record_timed(s.raw()).map_err(|e| drv("record_timed", e))?)))
    }

    fn elapsed_secs(&self, start: &CudaEvent, end: &CudaEvent) -> Option<f64> {
        end.synchronize().ok()?;
        device::Event::elapsed_ms(start, end).ok().map(|ms| f64::from(ms) / 1e3)
    }

    /// Bytes handed out to callers; the backend's own constant caches (RoPE tables) excluded.
    fn allocated_bytes(&self) -> Option<usize> {
        let cache = self.inv_freq.lock().ok()?;
        let pool = self.pool.lock().ok()?;
        let cached: usize = cache.values().map(|b| pool.size(b.block)).sum();
        Some(pool.stats().allocated - cached)
    }

    fn clock_monitor(&self) -> Option<std::result::Result<crate::backend::clocks::ClockMonitor, String>> {
        use sys::CUdevice_attribute as A;
        let open = || -> std::result::Result<crate::backend::clocks::ClockMonitor, String> {
            let attr = |a: A| self.ctx.attribute(a).map_err(|e| format!("reading the PCI location: {e}"));
            let bus = format!(
                "{:08x}:{:02x}:{:02x}.0",
                attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
                attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
                attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
            );
            let dev = nvml::open(&bus)?;
            let (max_mhz, limit_mw) = (dev.max_mhz, dev.limit_mw);
            // Every 100 ms: a step of the 8B recipe spans 8 samples, a 27B forward 10.
            let every = std::time::Duration::from_millis(100);
            crate::backend::clocks::ClockMonitor::start(self.name.clone(), max_mhz, limit_mw, every, dev)
                .map_err(|e| format!("starting the sampler thread: {e}"))
        };
        Some(open())
    }

    fn max_block_size(&self) -> Option<usize> {
        // The backward's limit (kernels/attention.cu holds a block's keys in one tile); the
        // warpgroup forms take no more, and training needs the backward.
        Some(ATTN_MAX_BLOCK_KEYS)
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        self.bind().ok()?;
        cu::mem_get_info().ok()
    }

    fn memory_report(&self) -> Option<String> {
        let st = self.allocator_stats();
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        Some(format!(
            "{:.2} GiB peak allocated (reached {}), {:.2} GiB reserved now ({} segments; {} cache hits, {} misses, {} deferred frees)",
            gib(st.peak_allocated),
            st.peak_region.place(),
            gib(st.reserved),
            st.segments,
            st.hits,
            st.misses,
            st.deferred_frees
        ))
    }

    fn synchronize(&self, s: &Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: a live stream.
        unsafe { cu::stream::synchronize(s.raw()) }.map_err(|e| drv(format!("synchronize on {}", self.name), e))
    }

    fn alloc(&self, s: &Stream, dtype: DType, len: usize) -> Result<CudaBuf> {
        let b = self.alloc_uninit(s, dtype, len)?;
        // Zero-filled, as the trait promises (an async memset on the owner stream; device time
        // the profile shows as its own operation, not as idle).
        self.timed_as(
            s,
            Work::Copy,
            || Some("zero-fill (alloc)".into()),
            || {
                // SAFETY: the block holds at least len * size bytes (alloc_uninit checked the count).
                unsafe { cu::memset_d8_async(b.ptr, 0, (len * dtype.size_bytes()).max(1), s.raw()) }
                    .map_err(|e| drv("alloc: zero-filling", e))
            },
        )?;
        Ok(b)
    }

    fn alloc_uninit(&self, s: &Stream, dtype: DType, len: usize) -> Result<CudaBuf> {
        self.uninit_buf(s, dtype, len, "alloc")
    }

    fn alloc_ids(&self, s: &Stream, len: usize) -> Result<CudaIds> {
        let bytes = len.checked_mul(4).ok_or_else(|| BackendError::Shape {
            op: "alloc_ids",
            what: format!("{len} i32 elements overflow a byte count"),
        })?;
        let (ptr, block) = self.raw_alloc(s, bytes, || format!("alloc_ids of {len} i32 elements"))?;
        // Owned before the fill, so a failed fill frees the block.
        let ids = CudaIds { ptr, len, block, pool: self.pool.clone() };
        self.timed_as(
            s,
            Work::Copy,
            || Some("zero-fill (alloc)".into()),
            || {
                // SAFETY: the block holds at least len * 4 bytes.
                unsafe { cu::memset_d8_async(ptr, 0, bytes.max(1), s.raw()) }
                    .map_err(|e| drv("alloc_ids: zero-filling", e))
            },
        )?;
        Ok(ids)
    }

    fn len(&self, b: &CudaBuf) -> usize {
        b.len
    }

    fn dtype(&self, b: &CudaBuf) -> DType {
        b.dtype
    }

    // Uploads never make the host wait for the stream: an async copy from pageable host memory
    // stages the source before it returns (CUDA's documented behaviour for pageable H2D), so the
    // host vector may be dropped at once while the stream keeps its order.
    fn upload(&self, s: &Stream, host: &[f32], dst: &mut CudaBuf, off: usize) -> Result<()> {
        check_len("upload", "dst", dst.len, off, host.len())?;
        self.bind()?;
        match dst.dtype {
            DType::F32 => {
                // SAFETY: dst has room (checked); pageable memory is staged before the call returns.
                self.timed(s, Work::Copy, || {
                    unsafe { cu::memcpy_htod_async(off_ptr(dst, off), host, s.raw()) }
                        .map_err(|e| drv(format!("upload of {} f32", host.len()), e))
                })
            }
            DType::BF16 => {
                // Across cores: a Qwen3-8B-sized target is 8 billion conversions at load.
                let h: Vec<half::bf16> = host.par_iter().map(|&x| half::bf16::from_f32(x)).collect();
                // SAFETY: as above.
                self.timed(s, Work::Copy, || {
                    unsafe { cu::memcpy_htod_async(off_ptr(dst, off), &h, s.raw()) }
                        .map_err(|e| drv(format!("upload of {} bf16", h.len()), e))
                })
            }
        }
    }

    fn upload_ids(&self, s: &Stream, host: &[i32], dst: &mut CudaIds) -> Result<()> {
        check_len("upload_ids", "dst", dst.len, 0, host.len())?;
        self.bind()?;
        // SAFETY: dst has room; pageable memory is staged before the call returns.
        self.timed(s, Work::Copy, || {
            unsafe { cu::memcpy_htod_async(dst.ptr, host, s.raw()) }
                .map_err(|e| drv(format!("upload_ids of {} i32", host.len()), e))
        })
    }

    fn download(&self, s: &Stream, src: &CudaBuf) -> Result<Vec<f32>> {
        self.bind()?;
        match src.dtype {
            DType::F32 => {
                let mut out = vec![0f32; src.len];
                // SAFETY: out has src.len elements; synchronised before reading.
                self.timed(s, Work::Copy, || {
                    unsafe { cu::memcpy_dtoh_async(&mut out, src.ptr, s.raw()) }
                        .map_err(|e| drv(format!("download of {} elements", src.len), e))
                })?;
                self.synchronize(s)?;
                Ok(out)
            }
            DType::BF16 => {
                let mut out = vec![half::bf16::ZERO; src.len];
                // SAFETY: as above.
                self.timed(s, Work::Copy, || {
                    unsafe { cu::memcpy_dtoh_async(&mut out, src.ptr, s.raw()) }
                        .map_err(|e| drv(format!("download of {} elements", src.len), e))
                })?;
                self.synchronize(s)?;
                Ok(out.par_iter().map(|x| x.to_f32()).collect())
            }
        }
    }

    type Readback = CudaReadback;

    fn read_async(&self, s: &Stream, bufs: &[&CudaBuf], ids: &[&CudaIds]) -> Result<CudaReadback> {
        self.read_async_impl(s, bufs, ids)
    }

    fn read_wait(&self, r: CudaReadback) -> Result<crate::backend::ReadValues> {
        self.read_wait_impl(r)
    }

    fn download_ids(&self, s: &Stream, src: &CudaIds) -> Result<Vec<i32>> {
        self.bind()?;
        let mut out = vec![0i32; src.len];
        // SAFETY: out has src.len elements; synchronised before reading.
        self.timed(s, Work::Copy, || {
            unsafe { cu::memcpy_dtoh_async(&mut out, src.ptr, s.raw()) }
                .map_err(|e| drv(format!("download_ids of {} i32", src.len), e))
        })?;
        self.synchronize(s)?;
        Ok(out)
    }

    fn copy(
        &self,
        s: &Stream,
        src: &CudaBuf,
        src_off: usize,
        dst: &mut CudaBuf,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        check_len("copy", "src", src.len, src_off, n)?;
        check_len("copy", "dst", dst.len, dst_off, n)?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        match (src.dtype, dst.dtype) {
            (a, b) if a == b => {
                // SAFETY: both ranges checked above.
                self.timed(s, Work::Copy, || {
                    unsafe {
                        cu::memcpy_dtod_async(off_ptr(dst, dst_off), off_ptr(src, src_off), n * a.size_bytes(), s.raw())
                    }
                    .map_err(|e| drv(format!("copy of {n} {} elements", a.name()), e))
                })
            }
            (DType::F32, DType::BF16) => {
                let args = launch::ConvertF32ToBf16 { src: src.at("copy", src_off)?, dst: dst.at("copy", dst_off)?, n };
                self.launch(s, launch::ConvertF32ToBf16::KERNEL, (self.ew_grid(n), 256, 0), args)
            }
            (DType::BF16, DType::F32) => {
                let args = launch::ConvertBf16ToF32 { src: src.at("copy", src_off)?, dst: dst.at("copy", dst_off)?, n };
                self.launch(s, launch::ConvertBf16ToF32::KERNEL, (self.ew_grid(n), 256, 0), args)
            }
            _ => unreachable!("two dtypes"),
        }
    }

    fn fill(&self, s: &Stream, dst: &mut CudaBuf, value: f32) -> Result<()> {
        let cfg = (self.ew_grid(dst.len), 256, 0);
        match dst.dtype {
            DType::F32 => {
                let args = launch::FillF32 { x: dst.at("fill", 0)?, n: dst.len, v: value };
                self.launch(s, launch::FillF32::KERNEL, cfg, args)
            }
            DType::BF16 => {
                let args = launch::FillBf16 { x: dst.at("fill", 0)?, n: dst.len, v: value };
                self.launch(s, launch::FillBf16::KERNEL, cfg, args)
            }
        }
    }

    fn fill_init(
        &self,
        s: &Stream,
        dst: &mut CudaBuf,
        off: usize,
        n: usize,
        draw: &crate::weights::InitDraw,
    ) -> Result<()> {
        const OP: &str = "fill_init";
        check_len(OP, "dst", dst.len, off, n)?;
        let host = |be: &Self, dst: &mut CudaBuf| crate::backend::fill_init_on_host(be, s, dst, off, n, draw);
        let scale = crate::weights::init_normal_scale(draw.role, draw.std);
        let (Some(scale), DType::BF16, true) = (scale, dst.dtype, n > 0 && self.device_init_ok()) else {
            return host(self, dst);
        };
        // kernels/init.cu: the host's bits except for the few elements whose f32 rounding the
        // two libms could decide differently, which it lists (`suspects`) for the host to redo.
        const CAP: usize = 4096;
        let count = self.u64_scratch(s, 1, true, || format!("{OP}: its counter"))?;
        let suspects = self.u64_scratch(s, CAP, false, || format!("{OP}: its suspects"))?;
        let args = launch::InitNormalBf16 {
            x: dst.at(OP, off)?,
            n,
            first: draw.first,
            seed: draw.seed,
            philox_stream: draw.stream,
            scale_bits: scale.to_bits(),
            suspects: DevPtr::<u64>::new(suspects.ptr),
            count: DevPtr::<u64>::new(count.ptr),
            cap: CAP,
        };
        self.launch(s, launch::InitNormalBf16::KERNEL, (self.ew_grid(n), 256, 0), args)?;
        let listed = u64_words(&self.download_ids(s, &count)?).next().unwrap_or(0) as usize;
        if listed > CAP {
            return host(self, dst);
        }
        if listed > 0 {
            for i in u64_words(&self.download_ids(s, &suspects)?).take(listed) {
                let i = i as usize;
                self.upload(s, &[draw.value(i).to_f32()], dst, off + i)?;
            }
        }
        // A sample checked against the host: 16 elements spread over the tensor. A difference
        // (a libm outside the bounds init.cu relies on) turns the device path off for the
        // process, with a note, and this tensor is drawn again on the host.
        let m = n.min(16);
        let picks: Vec<usize> = (0..m).map(|j| if m == 1 { 0 } else { j * (n - 1) / (m - 1) }).collect();
        let mut got = self.alloc(s, DType::BF16, picks.len())?;
        for (j, &i) in picks.iter().enumerate() {
            self.copy(s, dst, off + i, &mut got, j, 1)?;
        }
        let got = self.download(s, &got)?;
        if let Some((&i, g)) = picks.iter().zip(&got).find(|(&i, &g)| g.to_bits() != draw.value(i).to_f32().to_bits()) {
            eprintln!(
                "note: the device's random init differs from the host's at element {} of a tensor ({g} against {}); drawing presets on the host from here on",
                draw.first + i as u64,
                draw.value(i)
            );
            DEVICE_INIT_OFF.store(true, std::sync::atomic::Ordering::Relaxed);
            return host(self, dst);
        }
        Ok(())
    }

    fn gemm(
        &self,
        s: &Stream,
        g: &Gemm,
        a: &CudaBuf,
        a_off: usize,
        b: &CudaBuf,
        b_off: usize,
        c: &mut CudaBuf,
        c_off: usize,
    ) -> Result<()> {
        self.gemm_with(s, g, a, a_off, b, b_off, None, c, c_off, 0).map(|_| ())
    }

    fn gemm_residual(
        &self,
        s: &Stream,
        g: &Gemm,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        r: &CudaBuf,
        d: &mut CudaBuf,
    ) -> Result<()> {
        self.gemm_with(s, &Gemm { beta: 1.0, ..*g }, x, 0, w, w_off, Some(r), d, 0, 0).map(|_| ())
    }

    fn fc_project(
        &self,
        s: &Stream,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        y: &mut CudaBuf,
        rows: usize,
        h: usize,
        k: usize,
    ) -> Result<()> {
        self.fc_kernel(s, x, w, w_off, y, rows, h, k)
    }

    fn rmsnorm_fwd(
        &self,
        s: &Stream,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        y: &mut CudaBuf,
        rstd: &mut CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        check_len("rmsnorm_fwd", "x", x.len, 0, rows * dim)?;
        check_len("rmsnorm_fwd", "w", w.len, w_off, dim)?;
        check_len("rmsnorm_fwd", "y", y.len, 0, rows * dim)?;
        check_len("rmsnorm_fwd", "rstd", rstd.len, 0, rows)?;
        Self::need_f32("rmsnorm_fwd rstd", rstd)?;
        let r = RMS_BLOCK / rms_team(dim);
        let mut grid = rows.div_ceil(r).max(1);
        if r == 1 {
            // Block teams (dim > 1024) grid-stride over rows with the next row's loads issued
            // before this row's sum (kernels/rmsnorm.cu): one block per resident slot, so each
            // streams ~rows / slots rows. Warp teams: one row group per block, and the block
            // scheduler balances the tail.
            let f = self.kernels.get(launch::RmsnormFwdBf16::KERNEL);
            self.bind()?;
            let block = i32::try_from(RMS_BLOCK).expect("launch.cuh's RMS_BLOCK is a block size");
            // SAFETY: `f` is a kernel of this context's loaded module; no dynamic shared memory.
            let per_sm = unsafe { cu::occupancy::max_active_block_per_multiprocessor(f, block, 0) }
                .map_err(|e| drv("occupancy of rmsnorm_fwd_bf16", e))?;
            let slots = usize::try_from(per_sm).unwrap_or(1).max(1) * self.sm_count;
            grid = grid.min(slots);
        }
        let args = launch::RmsnormFwdBf16 {
            x: x.at("rmsnorm_fwd", 0)?,
            w: w.at("rmsnorm_fwd", w_off)?,
            y: y.at("rmsnorm_fwd", 0)?,
            rstd: rstd.at("rmsnorm_fwd", 0)?,
            rows,
            dim,
            eps,
        };
        self.launch(s, launch::RmsnormFwdBf16::KERNEL, (grid, RMS_BLOCK, 0), args)
    }

    fn rmsnorm_bwd(
        &self,
        s: &Stream,
        dy: &CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        rstd: &CudaBuf,
        dx: &mut CudaBuf,
        accumulate_dx: bool,
        dw: &mut CudaBuf,
        dw_off: usize,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        for (n, l) in [("dy", dy.len), ("x", x.len), ("dx", dx.len)] {
            check_len("rmsnorm_bwd", n, l, 0, rows * dim)?;
        }
        check_len("rmsnorm_bwd", "w", w.len, w_off, dim)?;
        check_len("rmsnorm_bwd", "dw", dw.len, dw_off, dim)?;
        check_len("rmsnorm_bwd", "rstd", rstd.len, 0, rows)?;
        Self::need_f32("rmsnorm_bwd dw", dw)?;
        if rows == 0 {
            return Ok(());
        }
        let r = RMS_BLOCK / rms_team(dim);
        let rows_per_part = rms_bwd_rows_per_part(rows, dim);
        let parts = rmsnorm_bwd_parts(rows, dim);
        // Not zero-filled (unlike `scratch`): the kernel writes every part's dim sums, and a memset
        // would move another parts * dim * 4 bytes (16 MB at 32768 x 4096).
        let (ptr, block) =
            self.raw_alloc(s, parts * dim * 4, || format!("rmsnorm_bwd: {parts} x {dim} f32 partial sums"))?;
        let partial = CudaBuf { ptr, len: parts * dim, dtype: DType::F32, block, pool: self.pool.clone() };
        let smem = r * (dim + RMS_SLAB_PAD) * 4;
        let args = launch::RmsnormBwdBf16 {
            dy: dy.at("rmsnorm_bwd", 0)?,
            x: x.at("rmsnorm_bwd", 0)?,
            w: w.at("rmsnorm_bwd", w_off)?,
            rstd: rstd.at("rmsnorm_bwd", 0)?,
            dx: dx.at("rmsnorm_bwd", 0)?,
            accumulate_dx: usize::from(accumulate_dx),
            dw_partial: partial.at("rmsnorm_bwd", 0)?,
            rows,
            dim,
            rows_per_part,
        };
        self.launch(s, launch::RmsnormBwdBf16::KERNEL, (parts, RMS_BLOCK, smem), args)?;
        let args = launch::RmsnormDwReduceF32 {
            dw_partial: partial.at("rmsnorm_bwd", 0)?,
            parts,
            dw: dw.at("rmsnorm_bwd", dw_off)?,
            dim,
        };
        self.launch(s, launch::RmsnormDwReduceF32::KERNEL, (dim.div_ceil(32), RMS_BLOCK, 0), args)
    }

    fn rope(
        &self,
        s: &Stream,
        x: &mut CudaBuf,
        pos: &CudaIds,
        rows: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
        inverse: bool,
    ) -> Result<()> {
        check_len("rope", "x", x.len, 0, rows * heads * head_dim)?;
        check_len("rope", "pos", pos.len, 0, rows)?;
        if head_dim % 2 != 0 {
            return Err(BackendError::Shape { op: "rope", what: format!("head_dim {head_dim} is odd") });
        }
        let inv = self.inv_freq(s, head_dim, theta)?;
        let grid = (rows * heads * head_dim / 2).div_ceil(8 * 256).clamp(1, 16 * self.sm_count);
        let args = launch::RopeBf16 {
            x: x.at("rope", 0)?,
            pos: pos.at("rope", 0)?,
            inv_freq: inv,
            rows,
            heads,
            head_dim,
            inverse: usize::from(inverse),
        };
        self.launch(s, launch::RopeBf16::KERNEL, (grid, 256, 0), args)
    }

    fn swiglu_fwd(&self, s: &Stream, gu: &CudaBuf, out: &mut CudaBuf, rows: usize, inter: usize) -> Result<()> {
        check_len("swiglu_fwd", "gu", gu.len, 0, rows * 2 * inter)?;
        check_len("swiglu_fwd", "out", out.len, 0, rows * inter)?;
        let args = launch::SwigluFwdBf16 { gu: gu.at("swiglu_fwd", 0)?, out: out.at("swiglu_fwd", 0)?, rows, inter };
        self.launch(s, launch::SwigluFwdBf16::KERNEL, (self.ew_grid(rows * inter), 256, 0), args)
    }

    fn mlp_gate_up_act(
        &self,
        s: &Stream,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        act: &mut CudaBuf,
        gu: Option<&mut CudaBuf>,
        rows: usize,
        inter: usize,
        h: usize,
    ) -> Result<()> {
        let form = self.mlp_form_for(x, w, w_off, act, gu.as_deref(), [rows, inter, h]);
        self.mlp_gate_up_act_with(s, x, w, w_off, act, gu, rows, inter, h, form)
    }

    fn swiglu_bwd(&self, s: &Stream, dact: &mut CudaBuf, gu: &mut CudaBuf, rows: usize, inter: usize) -> Result<()> {
        check_len("swiglu_bwd", "dact", dact.len, 0, rows * inter)?;
        check_len("swiglu_bwd", "gu", gu.len, 0, rows * 2 * inter)?;
        let args = launch::SwigluBwdBf16 { dact: dact.at("swiglu_bwd", 0)?, gu: gu.at("swiglu_bwd", 0)?, rows, inter };
        self.launch(s, launch::SwigluBwdBf16::KERNEL, (self.ew_grid(rows * inter), 256, 0), args)
    }

    fn embed(
        &self,
        s: &Stream,
        table: &CudaBuf,
        off: usize,
        ids: &CudaIds,
        out: &mut CudaBuf,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        check_len("embed", "ids", ids.len, 0, rows)?;
        check_len("embed", "out", out.len, 0, rows * dim)?;
        let vocab = table.len.saturating_sub(off) / dim.max(1);
        let grid = (rows * dim.div_ceil(8)).div_ceil(256).clamp(1, 16 * self.sm_count);
        let args = launch::EmbedBf16 {
            table: table.at("embed", off)?,
            ids: ids.at("embed", 0)?,
            out: out.at("embed", 0)?,
            rows,
            dim,
            vocab,
        };
        self.launch(s, launch::EmbedBf16::KERNEL, (grid, 256, 0), args)
    }

    fn pack_taps(
        &self,
        s: &Stream,
        taps: &[&CudaBuf],
        out: &mut CudaBuf,
        rows: usize,
        hidden: usize,
        n_valid: usize,
        noise_std: f32,
        seed: u64,
        step: u32,
    ) -> Result<()> {
        if taps.is_empty() || taps.len() > MAX_TAPS {
            return Err(BackendError::Shape {
                op: "pack_taps",
                what: format!("{} taps (1..={MAX_TAPS} supported)", taps.len()),
            });
        }
        if !(noise_std.is_finite() && noise_std >= 0.0) {
            return Err(BackendError::Shape { op: "pack_taps", what: format!("noise std {noise_std}") });
        }
        check_len("pack_taps", "out", out.len, 0, rows * taps.len() * hidden)?;
        let mut ptrs = TapPtrs { p: [0; MAX_TAPS] };
        for (k, t) in taps.iter().enumerate() {
            check_len("pack_taps", "tap", t.len, 0, n_valid.min(rows) * hidden)?;
            ptrs.p[k] = t.at::<half::bf16>("pack_taps", 0)?.addr();
        }
        // kernels/pack.cu's fast path (hidden % 8 == 0, 16-byte aligned pointers): a block owns
        // one (row, tap) segment of hidden / 8 units, PACK_UNITS per thread, and the grid has one
        // work item per block, so the block scheduler balances the tail. The scalar path (ragged
        // or offset views) is a grid-stride loop over elements.
        let vec = hidden % 8 == 0
            && hidden <= PACK_VEC_MAX_HIDDEN
            && out.ptr % 16 == 0
            && ptrs.p[..taps.len()].iter().all(|p| p % 16 == 0);
        let (grid, block) = if vec {
            let units = (hidden / 8).max(1);
            let block = (units.div_ceil(PACK_UNITS).div_ceil(32) * 32).clamp(32, PACK_MAX_BLOCK);
            let items = rows * taps.len() * units.div_ceil(block * PACK_UNITS);
            (items.clamp(1, i32::MAX as usize), block)
        } else {
            (self.ew_grid(rows * taps.len() * hidden), PACK_MAX_BLOCK)
        };
        let args = launch::PackTapsNoiseBf16 {
            taps: ptrs,
            num_taps: taps.len(),
            out: out.at("pack_taps", 0)?,
            rows,
            hidden,
            n_valid,
            noise_std,
            seed,
            step,
        };
        self.launch(s, launch::PackTapsNoiseBf16::KERNEL, (grid, block, 0), args)
    }

    fn attn_causal_fwd(
        &self,
        s: &Stream,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        o: &mut CudaBuf,
        seq_starts: &CudaIds,
        rows: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let form = AttnForm::pick_causal(head_dim);
        self.attn_causal_fwd_with(form, s, q, k, v, o, seq_starts, rows, heads, kv_heads, head_dim, None)
    }

    fn attn_causal_gated_fwd(
        &self,
        s: &Stream,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        o: &mut CudaBuf,
        seq_starts: &CudaIds,
        rows: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        gate: OutGate<'_, CudaBuf>,
    ) -> Result<()> {
        let form = AttnForm::pick_causal(head_dim);
        let in_epilogue = AttnForm::gate_in_epilogue().then_some(gate);
        self.attn_causal_fwd_with(form, s, q, k, v, o, seq_starts, rows, heads, kv_heads, head_dim, in_epilogue)?;
        match in_epilogue {
            Some(_) => Ok(()),
            None => self.sigmoid_mul_strided(s, o, gate.buf, gate.off, gate.stride, rows * heads, head_dim),
        }
    }

    fn attn_draft_fwd(
        &self,
        s: &Stream,
        sh: &DraftAttnShape,
        q: &CudaBuf,
        kc: &CudaBuf,
        vc: &CudaBuf,
        kb: &CudaBuf,
        vb: &CudaBuf,
        anchors: &CudaIds,
        ctx_start: &CudaIds,
        o: &mut CudaBuf,
        lse: &mut CudaBuf,
    ) -> Result<()> {
        let form = AttnForm::pick_draft(sh);
        self.attn_draft_fwd_with(form, s, sh, q, kc, vc, kb, vb, anchors, ctx_start, o, lse)
    }

    fn qk_norm_rope(
        &self,
        s: &Stream,
        sh: &QkNormRope,
        q_in: &CudaBuf,
        k_in: &CudaBuf,
        w: &CudaBuf,
        q_out: &mut CudaBuf,
        k_out: &mut CudaBuf,
        pos: &CudaIds,
        rstd: Option<QkRstd<'_, CudaBuf>>,
    ) -> Result<()> {
        const OP: &str = "qk_norm_rope";
        let hd = sh.head_dim;
        if sh.rows == 0 {
            return Ok(());
        }
        let Some(kernel) = variant(&launch::QkNormRopeBf16Hd::VARIANTS, &hd.to_string()) else {
            let dims: Vec<&str> = launch::QkNormRopeBf16Hd::VARIANTS.iter().map(|(d, _)| *d).collect();
            return Err(BackendError::Shape {
                op: OP,
                what: format!("head_dim {hd} is not one of the compiled {dims:?}"),
            });
        };
        let last = |r: Rows| r.off + (sh.rows - 1) * r.stride;
        for (n, b, r, heads) in [("q_in", q_in, sh.q_in, sh.heads), ("k_in", k_in, sh.k_in, sh.kv_heads)] {
            check_len(OP, n, b.len, last(r), heads * hd)?;
            Self::need_bf16(OP, b)?;
        }
        for (n, b, r, heads) in [("q_out", &*q_out, sh.q_out, sh.heads), ("k_out", &*k_out, sh.k_out, sh.kv_heads)] {
            check_len(OP, n, b.len, last(r), heads * hd)?;
            Self::need_bf16(OP, b)?;
        }
        check_len(OP, "w", w.len, sh.wq_off.max(sh.wk_off), hd)?;
        check_len(OP, "pos", pos.len, 0, sh.rows)?;
        // Each lane loads head_dim / 32 elements (at least 1) at once: every row and weight must
        // start on such a boundary.
        let v = (hd / 32).max(1);
        let offs = [sh.q_in, sh.k_in, sh.q_out, sh.k_out].into_iter().flat_map(|r| [r.off, r.stride]);
        if let Some(bad) = offs.chain([sh.wq_off, sh.wk_off]).find(|x| x % v != 0) {
            return Err(BackendError::Shape {
                op: OP,
                what: format!("offset or stride {bad} is not a multiple of {v} elements (head_dim {hd} / 32)"),
            });
        }
        let inv = self.inv_freq(s, hd, sh.theta)?;
        // The rstd outputs: with `rstd`, every side that has heads needs its buffer; a side
        // without heads (or no `rstd`) gets a live pointer the kernel never writes.
        let (q_rstd, k_rstd, keep_rstd) = match rstd {
            None => (inv, inv, 0),
            Some(QkRstd { q, k }) => {
                let ptr = |n: &str, b: Option<&mut CudaBuf>, heads: usize| -> Result<DevPtr<f32>> {
                    match b {
                        Some(b) => {
                            check_len(OP, n, b.len, 0, sh.rows * heads)?;
                            Self::need_f32(OP, b)?;
                            b.at(OP, 0)
                        }
                        None if heads == 0 => Ok(inv),
                        None => Err(BackendError::Shape {
                            op: OP,
                            what: format!("{n}: {heads} heads whose rstd is asked for but given no buffer"),
                        }),
                    }
                };
                (ptr("q rstd", q, sh.heads)?, ptr("k rstd", k, sh.kv_heads)?, 1)
            }
        };
        let args = launch::QkNormRopeBf16Hd {
            q_in: q_in.at(OP, sh.q_in.off)?,
            q_in_stride: sh.q_in.stride,
            k_in: k_in.at(OP, sh.k_in.off)?,
            k_in_stride: sh.k_in.stride,
            wq: w.at(OP, sh.wq_off)?,
            wk: w.at(OP, sh.wk_off)?,
            q_out: q_out.at(OP, sh.q_out.off)?,
            q_out_stride: sh.q_out.stride,
            k_out: k_out.at(OP, sh.k_out.off)?,
            k_out_stride: sh.k_out.stride,
            pos: pos.at(OP, 0)?,
            inv_freq: inv,
            q_rstd,
            k_rstd,
            keep_rstd,
            rows: sh.rows,
            heads: sh.heads,
            kv_heads: sh.kv_heads,
            eps: sh.eps,
        };
        // A warp per QKR_HEADS heads of a row.
        let warps = sh.rows * (sh.heads + sh.kv_heads).div_ceil(QKR_HEADS);
        self.launch(s, kernel, (warps.div_ceil(QKR_WARPS), QKR_WARPS * 32, 0), args)
    }

    fn attn_decode(
        &self,
        s: &Stream,
        sh: &DecodeAttnShape,
        q: &CudaBuf,
        kc: &CudaBuf,
        vc: &CudaBuf,
        o: &mut CudaBuf,
        lse: &mut CudaBuf,
    ) -> Result<()> {
        self.attn_decode_with(s, sh, q, kc, vc, o, lse, DecodeTuning::for_head_dim(sh.head_dim))
    }

    fn attn_draft_bwd(
        &self,
        s: &Stream,
        sh: &DraftAttnShape,
        q: &CudaBuf,
        kc: &CudaBuf,
        vc: &CudaBuf,
        kb: &CudaBuf,
        vb: &CudaBuf,
        anchors: &CudaIds,
        ctx_start: &CudaIds,
        o: &CudaBuf,
        lse: &CudaBuf,
        d_o: &CudaBuf,
        grads: [&mut CudaBuf; 5],
    ) -> Result<()> {
        let form = AttnForm::pick_draft_bwd(sh);
        self.attn_draft_bwd_with(form, s, sh, q, kc, vc, kb, vb, anchors, ctx_start, o, lse, d_o, grads)
    }

    fn cross_entropy(
        &self,
        s: &Stream,
        logits: &mut CudaBuf,
        labels: &CudaIds,
        weights: &CudaBuf,
        w_off: usize,
        rows: usize,
        vocab: usize,
        grad_scale: f32,
        loss: &mut CudaBuf,
        loss_off: usize,
        argmax: &mut CudaIds,
        argmax_off: usize,
    ) -> Result<()> {
        check_len("cross_entropy", "logits", logits.len, 0, rows * vocab)?;
        check_len("cross_entropy", "labels", labels.len, w_off, rows)?;
        check_len("cross_entropy", "weights", weights.len, w_off, rows)?;
        check_len("cross_entropy", "loss", loss.len, loss_off, rows)?;
        check_len("cross_entropy", "argmax", argmax.len, argmax_off, rows)?;
        Self::need_bf16("cross_entropy logits", logits)?;
        if rows == 0 {
            return Ok(());
        }
        // A cluster kernel reads each row once; it needs 16-byte rows. Every kernel strides over
        // rows: a cluster kernel runs one cluster per resident slot.
        const OP: &str = "cross_entropy";
        let (logits, labels, weights) = (logits.at(OP, 0)?, labels.at(OP, w_off)?, weights.at(OP, w_off)?);
        let (loss, argmax) = (loss.at(OP, loss_off)?, argmax.at(OP, argmax_off)?);
        match self.ce_cluster_for(vocab) {
            Some((ce, resident)) if logits.addr() % 16 == 0 => {
                let args = launch::CecKernel { logits, labels, weights, rows, vocab, grad_scale, loss, argmax };
                self.launch(s, ce.kernel, (rows.min(resident) * CEC_CTAS, CEC_BLOCK, ce.smem()), args)
            }
            _ => {
                let args = launch::CrossEntropyBf16 { logits, labels, weights, rows, vocab, grad_scale, loss, argmax };
                self.launch(s, launch::CrossEntropyBf16::KERNEL, (rows.min(i32::MAX as usize), CE_BLOCK, 0), args)
            }
        }
    }

    fn argmax_rows(
        &self,
        s: &Stream,
        x: &CudaBuf,
        stride: usize,
        rows: usize,
        cols: usize,
        out: &mut CudaIds,
    ) -> Result<()> {
        const OP: &str = "argmax_rows";
        if rows == 0 {
            return Ok(());
        }
        if cols == 0 || cols > stride {
            return Err(BackendError::Shape { op: OP, what: format!("{cols} columns in rows of {stride}") });
        }
        check_len(OP, "x", x.len, (rows - 1) * stride, cols)?;
        check_len(OP, "out", out.len, 0, rows)?;
        let cfg = (rows, ARGMAX_BLOCK, 0);
        match x.dtype {
            DType::F32 => {
                let args = launch::ArgmaxRowsF32 { x: x.at(OP, 0)?, stride, cols, out: out.at(OP, 0)? };
                self.launch(s, launch::ArgmaxRowsF32::KERNEL, cfg, args)
            }
            DType::BF16 => {
                let args = launch::ArgmaxRowsBf16 { x: x.at(OP, 0)?, stride, cols, out: out.at(OP, 0)? };
                self.launch(s, launch::ArgmaxRowsBf16::KERNEL, cfg, args)
            }
        }
    }

    fn sum_squares(&self, s: &Stream, x: &CudaBuf, out: &mut CudaBuf) -> Result<()> {
        Self::need_f32("sum_squares", x)?;
        check_len("sum_squares", "out", out.len, 0, 1)?;
        let partial = self.scratch(s, SUMSQ_PARTS)?;
        let args = launch::SumSquaresPartialF32 {
            x: x.at("sum_squares", 0)?,
            n: x.len,
            partial: partial.at("sum_squares", 0)?,
        };
        self.launch(s, launch::SumSquaresPartialF32::KERNEL, (SUMSQ_PARTS, SUMSQ_BLOCK, 0), args)?;
        let args = launch::SumPartialsF32 {
            partial: partial.at("sum_squares", 0)?,
            parts: SUMSQ_PARTS,
            out: out.at("sum_squares", 0)?,
        };
        self.launch(s, launch::SumPartialsF32::KERNEL, (1, SUMSQ_BLOCK, 0), args)
    }

    fn adamw(
        &self,
        s: &Stream,
        master: &mut CudaBuf,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        weights: &mut CudaBuf,
        off: usize,
        hp: &AdamStep,
    ) -> Result<()> {
        self.adamw_launch(s, master, grad, m, v, weights, off, hp, None)
    }

    fn update_plan(
        &self,
        s: &Stream,
        body_sumsq: &CudaBuf,
        fc_sumsq: &CudaBuf,
        loss: &CudaBuf,
        weighted: bool,
        clip: f32,
        plan: &mut CudaBuf,
    ) -> Result<()> {
        for b in [body_sumsq, fc_sumsq, loss, &*plan] {
            Self::need_f32("update_plan", b)?;
        }
        check_len("update_plan", "body_sumsq", body_sumsq.len, 0, 1)?;
        check_len("update_plan", "fc_sumsq", fc_sumsq.len, 0, 1)?;
        check_len("update_plan", "plan", plan.len, 0, 2)?;
        let args = launch::UpdatePlanF32 {
            body_sumsq: body_sumsq.at("update_plan", 0)?,
            fc_sumsq: fc_sumsq.at("update_plan", 0)?,
            loss: loss.at("update_plan", 0)?,
            n_loss: loss.len,
            weighted: usize::from(weighted),
            clip,
            plan: plan.at("update_plan", 0)?,
        };
        self.launch(s, launch::UpdatePlanF32::KERNEL, (1, 256, 0), args)
    }

    fn adamw_planned(
        &self,
        s: &Stream,
        master: &mut CudaBuf,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        weights: &mut CudaBuf,
        off: usize,
        hp: &AdamStep,
        plan: &CudaBuf,
    ) -> Result<()> {
        Self::need_f32("adamw_planned", plan)?;
        check_len("adamw_planned", "plan", plan.len, 0, 2)?;
        self.adamw_launch(s, master, grad, m, v, weights, off, hp, Some(plan))
    }

    /// Split masters (`tensor::master_split`): 2 bytes each, the low halves; the bf16 weights
    /// carry the upper halves.
    fn alloc_master(&self, s: &Stream, n: usize) -> Result<CudaBuf> {
        self.alloc(s, DType::BF16, n)
    }

    fn set_master(&self, s: &Stream, host: &[f32], master: &mut CudaBuf, weights: &mut CudaBuf) -> Result<()> {
        if master.dtype == DType::F32 {
            return crate::backend::set_f32_master(self, s, host, master, weights);
        }
        check_len("set_master", "master", master.len, 0, host.len())?;
        check_len("set_master", "weights", weights.len, 0, host.len())?;
        let (w, lo): (Vec<u16>, Vec<u16>) =
            host.par_iter().map(|&x| tensor::master_split(tensor::master_off_tie(x))).unzip();
        self.bind()?;
        for (dst, bits) in [(&*weights, &w), (&*master, &lo)] {
            // SAFETY: dst has room (checked); pageable memory is staged before the call returns.
            self.timed(s, Work::Copy, || {
                unsafe { cu::memcpy_htod_async(dst.ptr, bits.as_slice(), s.raw()) }
                    .map_err(|e| drv(format!("set_master: upload of {} halves", bits.len()), e))
            })?;
        }
        Ok(())
    }

    fn get_master(&self, s: &Stream, master: &CudaBuf, weights: &CudaBuf) -> Result<Vec<f32>> {
        if master.dtype == DType::F32 {
            return self.download(s, master);
        }
        check_len("get_master", "weights", weights.len, 0, master.len)?;
        self.bind()?;
        let (mut w, mut lo) = (vec![0u16; master.len], vec![0u16; master.len]);
        for (src, bits) in [(weights, &mut w), (master, &mut lo)] {
            // SAFETY: bits has master.len elements; synchronised before reading.
            self.timed(s, Work::Copy, || {
                unsafe { cu::memcpy_dtoh_async(bits.as_mut_slice(), src.ptr, s.raw()) }
                    .map_err(|e| drv(format!("get_master: download of {} halves", bits.len()), e))
            })?;
        }
        self.synchronize(s)?;
        Ok(w.par_iter().zip(&lo).map(|(&w, &lo)| tensor::master_join(w, lo)).collect())
    }

    fn count_nonfinite(&self, s: &Stream, x: &CudaBuf) -> Result<u64> {
        let counter = self.u64_scratch(s, 1, true, || "count_nonfinite: its counter".into())?;
        let (cfg, out) = ((self.ew_grid(x.len), 256, 0), DevPtr::<u64>::new(counter.ptr));
        match x.dtype {
            DType::F32 => {
                let args = launch::CountNonfiniteF32 { x: x.at("count_nonfinite", 0)?, n: x.len, out };
                self.launch(s, launch::CountNonfiniteF32::KERNEL, cfg, args)?;
            }
            DType::BF16 => {
                let args = launch::CountNonfiniteBf16 { x: x.at("count_nonfinite", 0)?, n: x.len, out };
                self.launch(s, launch::CountNonfiniteBf16::KERNEL, cfg, args)?;
            }
        }
        Ok(u64_words(&self.download_ids(s, &counter)?).next().unwrap_or(0))
    }

    fn rmsnorm1p_fwd(
        &self,
        s: &Stream,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        y: &mut CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rmsnorm1p_fwd";
        check_len(OP, "x", x.len, 0, rows * dim)?;
        check_len(OP, "w", w.len, w_off, dim)?;
        check_len(OP, "y", y.len, 0, rows * dim)?;
        if rows == 0 {
            return Ok(());
        }
        // A block per row (variant VPT) where the row is whole 16-byte groups of VPT per thread over
        // 32..=256 threads (hidden a multiple of 1280 up to 10240, or of 1024 up to 8192) and every
        // row starts 16-byte aligned; a warp per row (variant 0) otherwise.
        let aligned = [off_ptr(x, 0), off_ptr(w, w_off), off_ptr(y, 0)].iter().all(|p| p % 16 == 0);
        let vpt = rmsnorm1p_vpt(dim, aligned);
        let cfg = match vpt {
            Some(v) => (rows.min(i32::MAX as usize), dim / (8 * v), 0),
            None => (hyb_row_grid(rows), HYB_BLOCK, 0),
        };
        let name = vpt.unwrap_or(0).to_string();
        let kernel = variant(&launch::Rmsnorm1pFwdBf16V::VARIANTS, &name)
            .ok_or_else(|| BackendError::Shape { op: OP, what: format!("no rmsnorm1p_fwd_bf16_v{name} kernel") })?;
        let args = launch::Rmsnorm1pFwdBf16V { x: x.at(OP, 0)?, w: w.at(OP, w_off)?, y: y.at(OP, 0)?, rows, dim, eps };
        self.launch(s, kernel, cfg, args)
    }

    fn gated_rmsnorm_fwd(
        &self,
        s: &Stream,
        x: &CudaBuf,
        z: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        y: &mut CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "gated_rmsnorm_fwd";
        check_len(OP, "x", x.len, 0, rows * dim)?;
        check_len(OP, "z", z.len, 0, rows * dim)?;
        check_len(OP, "w", w.len, w_off, dim)?;
        check_len(OP, "y", y.len, 0, rows * dim)?;
        let args = launch::GatedRmsnormFwdBf16 {
            x: x.at(OP, 0)?,
            z: z.at(OP, 0)?,
            w: w.at(OP, w_off)?,
            y: y.at(OP, 0)?,
            rows,
            dim,
            eps,
        };
        self.launch(s, launch::GatedRmsnormFwdBf16::KERNEL, (hyb_row_grid(rows), HYB_BLOCK, 0), args)
    }

    fn rope_partial(
        &self,
        s: &Stream,
        x: &mut CudaBuf,
        pos: &CudaIds,
        rows: usize,
        heads: usize,
        head_dim: usize,
        rot_dim: usize,
        theta: f32,
    ) -> Result<()> {
        const OP: &str = "rope_partial";
        check_len(OP, "x", x.len, 0, rows * heads * head_dim)?;
        check_len(OP, "pos", pos.len, 0, rows)?;
        if rot_dim % 2 != 0 || rot_dim == 0 || rot_dim > head_dim {
            return Err(BackendError::Shape {
                op: OP,
                what: format!("rot_dim {rot_dim} must be even, positive and at most head_dim {head_dim}"),
            });
        }
        // The table of a rot_dim-wide RoPE: 1 / theta^(2i / rot_dim), as cpu.rs computes it.
        let inv = self.inv_freq(s, rot_dim, theta)?;
        let args = launch::RopePartialBf16 {
            x: x.at(OP, 0)?,
            pos: pos.at(OP, 0)?,
            inv_freq: inv,
            rows,
            heads,
            head_dim,
            rot_dim,
        };
        self.launch(s, launch::RopePartialBf16::KERNEL, (self.hyb_grid(rows * heads * rot_dim / 2), HYB_BLOCK, 0), args)
    }

    fn copy_strided(
        &self,
        s: &Stream,
        src: &CudaBuf,
        src_off: usize,
        src_stride: usize,
        dst: &mut CudaBuf,
        dst_off: usize,
        dst_stride: usize,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        const OP: &str = "copy_strided";
        if rows == 0 || width == 0 {
            return Ok(());
        }
        check_len(OP, "src", src.len, src_off + (rows - 1) * src_stride, width)?;
        check_len(OP, "dst", dst.len, dst_off + (rows - 1) * dst_stride, width)?;
        // A CTA per row (kernels/hybrid.cu), grid-stride past 32 CTAs per SM.
        let cfg = (rows.clamp(1, 32 * self.sm_count), HYB_BLOCK, 0);
        match (src.dtype, dst.dtype) {
            (DType::BF16, DType::BF16) => {
                let args = launch::CopyStridedBf16 {
                    src: src.at(OP, src_off)?,
                    src_stride,
                    dst: dst.at(OP, dst_off)?,
                    dst_stride,
                    rows,
                    width,
                };
                self.launch(s, launch::CopyStridedBf16::KERNEL, cfg, args)
            }
            (DType::F32, DType::F32) => {
                let args = launch::CopyStridedF32 {
                    src: src.at(OP, src_off)?,
                    src_stride,
                    dst: dst.at(OP, dst_off)?,
                    dst_stride,
                    rows,
                    width,
                };
                self.launch(s, launch::CopyStridedF32::KERNEL, cfg, args)
            }
            (a, _) => Err(BackendError::DType { op: OP, expected: a.name(), found: dst.dtype.name() }),
        }
    }

    fn sigmoid_mul(&self, s: &Stream, x: &mut CudaBuf, gate: &CudaBuf) -> Result<()> {
        const OP: &str = "sigmoid_mul";
        check_len(OP, "gate", gate.len, 0, x.len)?;
        let n = x.len;
        let args = launch::SigmoidMulBf16 { x: x.at(OP, 0)?, gate: gate.at(OP, 0)?, n };
        self.launch(s, launch::SigmoidMulBf16::KERNEL, (self.hyb_grid(n), HYB_BLOCK, 0), args)
    }

    fn causal_conv1d_silu(
        &self,
        s: &Stream,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        y: &mut CudaBuf,
        seq_starts: &CudaIds,
        rows: usize,
        channels: usize,
        kernel: usize,
    ) -> Result<()> {
        const OP: &str = "causal_conv1d_silu";
        check_len(OP, "x", x.len, 0, rows * channels)?;
        check_len(OP, "w", w.len, w_off, channels * kernel)?;
        check_len(OP, "y", y.len, 0, rows * channels)?;
        if seq_starts.len == 0 {
            return Err(BackendError::Shape { op: OP, what: "seq_starts is empty (it starts with 0)".into() });
        }
        if kernel == 0 || kernel > HYB_CONV_MAX_K {
            return Err(BackendError::Shape {
                op: OP,
                what: format!("kernel size {kernel}: the CUDA kernel takes 1 to {HYB_CONV_MAX_K}"),
            });
        }
        let cfg = (self.hyb_grid(rows.div_ceil(HYB_CONV_ROWS) * channels), HYB_BLOCK, 0);
        macro_rules! args {
            ($ty:ident) => {
                launch::$ty {
                    x: x.at(OP, 0)?,
                    w: w.at(OP, w_off)?,
                    y: y.at(OP, 0)?,
                    seq_starts: seq_starts.at(OP, 0)?,
                    n_starts: seq_starts.len,
                    rows,
                    channels,
                    kernel_size: kernel,
                }
            };
        }
        match (x.dtype, y.dtype) {
            (DType::BF16, DType::BF16) => {
                self.launch(s, launch::CausalConv1dSiluBf16::KERNEL, cfg, args!(CausalConv1dSiluBf16))
            }
            (DType::F32, DType::F32) => {
                self.launch(s, launch::CausalConv1dSiluF32::KERNEL, cfg, args!(CausalConv1dSiluF32))
            }
            (a, b) => Err(BackendError::Unsupported(format!(
                "{OP} from {} to {}: input and output are both bf16 or both f32",
                a.name(),
                b.name()
            ))),
        }
    }

    fn gdn_gates(
        &self,
        s: &Stream,
        b: &CudaBuf,
        a: &CudaBuf,
        w: &CudaBuf,
        a_log_off: usize,
        dt_bias_off: usize,
        beta: &mut CudaBuf,
        g: &mut CudaBuf,
        rows: usize,
        heads: usize,
    ) -> Result<()> {
        const OP: &str = "gdn_gates";
        let n = rows * heads;
        for (name, len) in [("b", b.len), ("a", a.len), ("beta", beta.len), ("g", g.len)] {
            check_len(OP, name, len, 0, n)?;
        }
        check_len(OP, "A_log", w.len, a_log_off, heads)?;
        check_len(OP, "dt_bias", w.len, dt_bias_off, heads)?;
        let args = launch::GdnGatesBf16 {
            b: b.at(OP, 0)?,
            a: a.at(OP, 0)?,
            a_log: w.at(OP, a_log_off)?,
            dt_bias: w.at(OP, dt_bias_off)?,
            beta: beta.at(OP, 0)?,
            g: g.at(OP, 0)?,
            rows,
            heads,
        };
        self.launch(s, launch::GdnGatesBf16::KERNEL, (self.hyb_grid(n), HYB_BLOCK, 0), args)
    }

    // ---- Fused hybrid ops (kernels/hybrid.cu); shapes a fused kernel does not take run the
    // unfused ops (backend::fused).

    fn gdn_conv_qkv(
        &self,
        s: &Stream,
        sh: &fused::GdnConvQkv,
        x: &CudaBuf,
        w: &CudaBuf,
        seq_starts: &CudaIds,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &mut CudaBuf,
    ) -> Result<()> {
        const OP: &str = "gdn_conv_qkv";
        let (rows, kd, vd, c) = (sh.rows, sh.key_dim(), sh.value_dim, sh.channels());
        check_len(OP, "x", x.len, 0, rows * c)?;
        check_len(OP, "w", w.len, sh.w_off, c * sh.kernel)?;
        check_len(OP, "q", q.len, 0, rows * kd)?;
        check_len(OP, "k", k.len, 0, rows * kd)?;
        check_len(OP, "v", v.len, 0, rows * vd)?;
        if seq_starts.len == 0 {
            return Err(BackendError::Shape { op: OP, what: "seq_starts is empty (it starts with 0)".into() });
        }
        if sh.kernel == 0 || sh.kernel > HYB_CONV_MAX_K {
            return Err(BackendError::Shape {
                op: OP,
                what: format!("kernel size {}: the CUDA kernel takes 1 to {HYB_CONV_MAX_K}", sh.kernel),
            });
        }
        // The fused kernel moves four f32 channels a lane (16-byte accesses) and sums a key
        // head's squares over k_dim / 4 lanes of one warp.
        let lanes = sh.k_dim / 4;
        let fits = sh.k_dim % 4 == 0
            && lanes.is_power_of_two()
            && lanes <= 32
            && vd % 4 == 0
            && [x, &*q, &*k, &*v].iter().all(|b| b.dtype == DType::F32);
        if !fits {
            return fused::gdn_conv_qkv(self, s, sh, x, w, seq_starts, q, k, v);
        }
        if rows == 0 {
            return Ok(());
        }
        // A warp per run of HYB_CONV_QKV_STEPS steps of HYB_CONV_QKV_WINDOW + 1 - kernel rows
        // (at least 1) and 32 channel groups.
        let padded = (c / 4).div_ceil(32) * 32;
        let run = HYB_CONV_QKV_STEPS * (HYB_CONV_QKV_WINDOW + 1).saturating_sub(sh.kernel).max(1);
        let cfg = (self.hyb_grid(rows.div_ceil(run) * padded), HYB_BLOCK, 0);
        let args = launch::GdnConvQkvF32 {
            x: x.at(OP, 0)?,
            w: w.at(OP, sh.w_off)?,
            q: q.at(OP, 0)?,
            k: k.at(OP, 0)?,
            v: v.at(OP, 0)?,
            seq_starts: seq_starts.at(OP, 0)?,
            n_starts: seq_starts.len,
            rows,
            key_dim: kd,
            value_dim: vd,
            head_lanes: lanes,
            kernel_size: sh.kernel,
            eps: sh.eps,
            q_scale: sh.q_scale,
        };
        self.launch(s, launch::GdnConvQkvF32::KERNEL, cfg, args)
    }

    fn rmsnorm1p_rope_partial(
        &self,
        s: &Stream,
        sh: &fused::NormRope,
        x: &CudaBuf,
        w: &CudaBuf,
        y: &mut CudaBuf,
        pos: &CudaIds,
    ) -> Result<()> {
        const OP: &str = "rmsnorm1p_rope_partial";
        let (n, hd, rot) = (sh.rows * sh.heads, sh.head_dim, sh.rot_dim);
        if rot % 2 != 0 || rot == 0 || rot > hd {
            return Err(BackendError::Shape {
                op: OP,
                what: format!("rot_dim {rot} must be even, positive and at most head_dim {hd}"),
            });
        }
        if n == 0 {
            return Ok(());
        }
        check_len(OP, "x", x.len, sh.x_off + (n - 1) * sh.x_stride, hd)?;
        check_len(OP, "w", w.len, sh.w_off, hd)?;
        check_len(OP, "y", y.len, 0, n * hd)?;
        check_len(OP, "pos", pos.len, 0, sh.rows)?;
        // head_dim / 32 elements a lane (one below 32): the rows, the weight
        // and the rotation's halves start on such a boundary.
        let v = (hd / 32).max(1);
        let kernel = variant(&launch::Rmsnorm1pRopePartialBf16Hd::VARIANTS, &hd.to_string());
        let aligned = [sh.x_off, sh.x_stride, sh.w_off, rot / 2].iter().all(|a| a % v == 0);
        let bf16 = [x, w, &*y].iter().all(|b| b.dtype == DType::BF16);
        let Some(kernel) = kernel.filter(|_| aligned && bf16 && sh.heads > 0) else {
            return fused::rmsnorm1p_rope_partial(self, s, sh, x, w, y, pos);
        };
        // The table of a rot_dim-wide RoPE, as rope_partial's.
        let inv = self.inv_freq(s, rot, sh.theta)?;
        let args = launch::Rmsnorm1pRopePartialBf16Hd {
            x: x.at(OP, sh.x_off)?,
            x_stride: sh.x_stride,
            w: w.at(OP, sh.w_off)?,
            y: y.at(OP, 0)?,
            pos: pos.at(OP, 0)?,
            inv_freq: inv,
            n,
            heads: sh.heads,
            rot_dim: rot,
            eps: sh.eps,
        };
        // A warp per HYB_NORM_ROPE_HEADS heads of a row.
        let items = sh.rows * sh.heads.div_ceil(HYB_NORM_ROPE_HEADS);
        self.launch(s, kernel, (hyb_row_grid(items), HYB_BLOCK, 0), args)
    }

    fn sigmoid_mul_strided(
        &self,
        s: &Stream,
        x: &mut CudaBuf,
        gate: &CudaBuf,
        gate_off: usize,
        gate_stride: usize,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        const OP: &str = "sigmoid_mul_strided";
        if rows == 0 || width == 0 {
            return Ok(());
        }
        check_len(OP, "x", x.len, 0, rows * width)?;
        check_len(OP, "gate", gate.len, gate_off + (rows - 1) * gate_stride, width)?;
        Self::need_bf16(OP, x)?;
        Self::need_bf16(OP, gate)?;
        let args =
            launch::SigmoidMulStridedBf16 { x: x.at(OP, 0)?, gate: gate.at(OP, gate_off)?, gate_stride, rows, width };
        self.launch(s, launch::SigmoidMulStridedBf16::KERNEL, (self.hyb_grid(rows * width / 8 + 1), HYB_BLOCK, 0), args)
    }

    fn gdn_gates_ba(
        &self,
        s: &Stream,
        ba: &CudaBuf,
        w: &CudaBuf,
        a_log_off: usize,
        dt_bias_off: usize,
        beta: &mut CudaBuf,
        g: &mut CudaBuf,
        rows: usize,
        heads: usize,
    ) -> Result<()> {
        const OP: &str = "gdn_gates_ba";
        let n = rows * heads;
        check_len(OP, "ba", ba.len, 0, 2 * n)?;
        check_len(OP, "beta", beta.len, 0, n)?;
        check_len(OP, "g", g.len, 0, n)?;
        check_len(OP, "A_log", w.len, a_log_off, heads)?;
        check_len(OP, "dt_bias", w.len, dt_bias_off, heads)?;
        if n == 0 {
            return Ok(());
        }
        let args = launch::GdnGatesBaBf16 {
            ba: ba.at(OP, 0)?,
            a_log: w.at(OP, a_log_off)?,
            dt_bias: w.at(OP, dt_bias_off)?,
            beta: beta.at(OP, 0)?,
            g: g.at(OP, 0)?,
            rows,
            heads,
        };
        self.launch(s, launch::GdnGatesBaBf16::KERNEL, (self.hyb_grid(n), HYB_BLOCK, 0), args)
    }

    fn l2norm_fwd(
        &self,
        s: &Stream,
        x: &CudaBuf,
        y: &mut CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
        scale: f32,
    ) -> Result<()> {
        const OP: &str = "l2norm_fwd";
        check_len(OP, "x", x.len, 0, rows * dim)?;
        check_len(OP, "y", y.len, 0, rows * dim)?;
        let cfg = (hyb_row_grid(rows), HYB_BLOCK, 0);
        match x.dtype {
            DType::BF16 => {
                let args = launch::L2normFwdBf16F32 { x: x.at(OP, 0)?, y: y.at(OP, 0)?, rows, dim, eps, scale };
                self.launch(s, launch::L2normFwdBf16F32::KERNEL, cfg, args)
            }
            DType::F32 => {
                let args = launch::L2normFwdF32F32 { x: x.at(OP, 0)?, y: y.at(OP, 0)?, rows, dim, eps, scale };
                self.launch(s, launch::L2normFwdF32F32::KERNEL, cfg, args)
            }
        }
    }

    fn gdn_recurrent_fwd(
        &self,
        s: &Stream,
        sh: &GdnShape,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        g: &CudaBuf,
        beta: &CudaBuf,
        seq_starts: &CudaIds,
        o: &mut CudaBuf,
        state: Option<&mut CudaBuf>,
    ) -> Result<()> {
        self.gdn_launch(GdnForm::Recurrent, s, sh, [q, k, v, g, beta], seq_starts, o, state)
    }

    fn gdn_chunked_fwd(
        &self,
        s: &Stream,
        sh: &GdnShape,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        g: &CudaBuf,
        beta: &CudaBuf,
        seq_starts: &CudaIds,
        o: &mut CudaBuf,
        state: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let form = self.gdn_chunked_form(sh);
        self.gdn_launch(form, s, sh, [q, k, v, g, beta], seq_starts, o, state)
    }

    fn gdn_chunked_norm_fwd(
        &self,
        s: &Stream,
        sh: &GdnShape,
        qkvgb: [&CudaBuf; 5],
        seq_starts: &CudaIds,
        state: Option<&mut CudaBuf>,
        z: &CudaBuf,
        w: &CudaBuf,
        norm: &fused::GdnOutNorm,
        core: &mut CudaBuf,
        y: &mut CudaBuf,
    ) -> Result<()> {
        const OP: &str = "gdn_chunked_norm_fwd";
        // The fast form's constant-shape output pass applies the norm itself where one CTA holds
        // whole value heads (dk = dv = 128, every Qwen3.5/3.6 config): the core output never
        // leaves the chip. Elsewhere the two ops run one after the other.
        let bf = [z, w, &*y].iter().all(|b| b.dtype == DType::BF16);
        if !(fast_out_nk8(sh.k_dim, sh.v_dim)
            && bf
            && norm.w_off % 4 == 0
            && self.gdn_chunked_form(sh) == GdnForm::ChunkedFast)
        {
            return fused::gdn_chunked_norm_fwd(self, s, sh, qkvgb, seq_starts, state, z, w, norm, core, y);
        }
        let n = sh.rows * sh.v_heads * sh.v_dim;
        check_len(OP, "z", z.len, 0, n)?;
        check_len(OP, "w", w.len, norm.w_off, sh.v_dim)?;
        check_len(OP, "core", core.len, 0, n)?;
        let out_norm = OutNorm { z: z.at(OP, 0)?, w: w.at(OP, norm.w_off)?, eps: norm.eps };
        self.gdn_launch_with(GdnForm::ChunkedFast, s, sh, qkvgb, seq_starts, y, state, Some(out_norm))
    }
}

/// The gated RMSNorm the fast form's output pass applies (`gdn_chunked_norm_fwd`).
#[derive(Clone, Copy)]
struct OutNorm {
    z: DevPtr<half::bf16>,
    w: DevPtr<half::bf16>,
    eps: f32,
}

impl CudaBackend {
    /// The chunked form `gdn_chunked_fwd` runs at this shape.
    fn gdn_chunked_form(&self, sh: &GdnShape) -> GdnForm {
        // The fast split kernels (bf16 scratch and operands) where the head dims tile by 16 and
        // dk <= 128 (every Qwen3.5/3.6 config), else the f32 split kernels, else the
        // one-CTA-per-sequence tensor-core kernel, else the CUDA-core kernel, said once.
        let fits = |f: GdnForm| f.takes(sh.k_dim, sh.v_dim) && f.smem_bytes(sh.k_dim, sh.v_dim) <= self.smem_optin;
        // DFLASH_GDN_FORM=fast|split|tc|simt picks a form instead (where it fits), for comparing
        // them inside a whole forward.
        static PICKED: std::sync::OnceLock<Option<GdnForm>> = std::sync::OnceLock::new();
        let picked = *PICKED.get_or_init(|| {
            let v = std::env::var("DFLASH_GDN_FORM").ok()?;
            let f = match v.as_str() {
                "fast" => GdnForm::ChunkedFast,
                "split" => GdnForm::ChunkedSplit,
                "tc" => GdnForm::ChunkedTc,
                "simt" => GdnForm::ChunkedSimt,
                _ => {
                    eprintln!("note: DFLASH_GDN_FORM={v} is not fast, split, tc or simt; using the default");
                    return None;
                }
            };
            Some(f)
        });
        if let Some(f) = picked.filter(|&f| f == GdnForm::ChunkedSimt || fits(f)) {
            f
        } else if fits(GdnForm::ChunkedFast) {
            GdnForm::ChunkedFast
        } else if fits(GdnForm::ChunkedSplit) {
            GdnForm::ChunkedSplit
        } else if fits(GdnForm::ChunkedTc) {
            GdnForm::ChunkedTc
        } else {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                eprintln!(
                    "note: gdn_chunked_fwd: head dims {} x {} are not multiples of 16; using the CUDA-core kernel",
                    sh.k_dim, sh.v_dim
                )
            });
            GdnForm::ChunkedSimt
        }
    }
}

/// Grid of a hybrid.cu row kernel: one row per warp, HYB_BLOCK / 32 warps per block.
fn hyb_row_grid(rows: usize) -> usize {
    rows.div_ceil(HYB_BLOCK / 32).clamp(1, i32::MAX as usize)
}

/// How `attn_decode` splits the keys; the trait method takes `DecodeTuning::for_head_dim`, the
/// benches compare settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeTuning {
    /// CTAs per SM the key split aims at (more: finer splits, fewer warps per CTA and more
    /// partial-result traffic).
    pub ctas_per_sm: usize,
}

impl DecodeTuning {
    /// The split target for `head_dim`: 2 CTAs per SM, 1 at head_dim 256 (one 143 KB CTA of 4
    /// warps fills an SM's shared memory). H200, benches/kernels.rs: at 64 x 288 keys, hd 128
    /// (32/8 heads) 35 us at c1 and c2, 38 at c4; 1 x 32768 keys 46 us at c2, 48 at c1; hd 256
    /// (24/4) 42 us at c1, 57 at c2, 68 at c4.
    pub fn for_head_dim(head_dim: usize) -> Self {
        Self { ctas_per_sm: if head_dim >= 256 { 1 } else { 2 } }
    }
}

impl CudaBackend {
    /// `Backend::attn_decode` with an explicit split target.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode_with(
        &self,
        s: &Stream,
        sh: &DecodeAttnShape,
        q: &CudaBuf,
        kc: &CudaBuf,
        vc: &CudaBuf,
        o: &mut CudaBuf,
        lse: &mut CudaBuf,
        tuning: DecodeTuning,
    ) -> Result<()> {
        const OP: &str = "attn_decode";
        let (hd, heads) = (sh.head_dim, sh.heads);
        if sh.rows == 0 {
            return Ok(());
        }
        let max_group = ATTN_WARP_ROWS;
        if sh.kv_heads == 0 || heads % sh.kv_heads != 0 || heads / sh.kv_heads > max_group || sh.len0 == 0 {
            return Err(BackendError::Shape {
                op: OP,
                what: format!(
                    "{heads} heads over {} kv heads (at most {max_group} per kv head), {} keys in the first row",
                    sh.kv_heads, sh.len0
                ),
            });
        }
        let (qw, kw) = (heads * hd, sh.kv_heads * hd);
        for (n, b) in [("q", q), ("o", &*o)] {
            check_len(OP, n, b.len, 0, sh.rows * qw)?;
            Self::need_bf16(OP, b)?;
        }
        for (n, b) in [("kc", kc), ("vc", vc)] {
            check_len(OP, n, b.len, 0, sh.cache_rows() * kw)?;
            Self::need_bf16(OP, b)?;
        }
        check_len(OP, "lse", lse.len, 0, sh.rows * heads)?;
        Self::need_f32(OP, lse)?;
        let no_kernel = || {
            let dims: Vec<&str> = launch::AttnDecodeCombineHd::VARIANTS.iter().map(|(d, _)| *d).collect();
            BackendError::Shape { op: OP, what: format!("head_dim {hd} is not one of the compiled {dims:?}") }
        };
        let comb = variant(&launch::AttnDecodeCombineHd::VARIANTS, &hd.to_string()).ok_or_else(no_kernel)?;
        // Splits of the longest row's keys (multiples of DEC_KEYS) so rows * kv_heads * splits is
        // about `ctas_per_sm` CTAs per SM; one warp per tile of a split, up to DEC_MMA_MAX_WARPS.
        let longest = sh.len0.max(sh.len(sh.rows - 1));
        let want = (tuning.ctas_per_sm.max(1) * self.sm_count).div_ceil(sh.rows * sh.kv_heads).max(1);
        let split_keys = longest.div_ceil(want).next_multiple_of(DEC_KEYS).max(DEC_KEYS);
        let splits = longest.div_ceil(split_keys);
        let warps = (split_keys / DEC_KEYS).clamp(1, DEC_MMA_MAX_WARPS);
        let parts = sh.rows * heads * splits;
        let part_o = self.uninit_buf(s, DType::F32, parts * hd, "attn_decode's partial outputs")?;
        let part_ml = self.uninit_buf(s, DType::F32, parts * 2, "attn_decode's partial statistics")?;
        let split = variant(&launch::AttnDecodeMmaBf16Hd::VARIANTS, &hd.to_string()).ok_or_else(no_kernel)?;
        let args = launch::AttnDecodeMmaBf16Hd {
            q: q.at(OP, 0)?,
            kc: kc.at(OP, 0)?,
            vc: vc.at(OP, 0)?,
            part_o: part_o.at(OP, 0)?,
            part_ml: part_ml.at(OP, 0)?,
            rows: sh.rows,
            heads,
            kv_heads: sh.kv_heads,
            row_stride: sh.row_stride,
            len0: sh.len0,
            len_inc: sh.len_inc,
            split_keys,
            splits,
            scale: sh.scale(),
        };
        let smem = (ATTN_WARP_ROWS + 4 * DEC_KEYS * warps) * (hd + ATTN_LD_PAD) * 2;
        self.launch(s, split, (splits * sh.kv_heads * sh.rows, warps * 32, smem), args)?;
        let args = launch::AttnDecodeCombineHd {
            part_o: part_o.at(OP, 0)?,
            part_ml: part_ml.at(OP, 0)?,
            o: o.at(OP, 0)?,
            lse: lse.at(OP, 0)?,
            splits,
        };
        self.launch(s, comb, (sh.rows * heads, hd, 0), args)
    }
}

/// Which kernel runs an attention op: the target's causal forward, the drafter's block forward
/// and backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnForm {
    /// kernels/attention.cu (`attn_causal_fwd_bf16_hd*`, `attn_draft_fwd_bf16_hd*`): mma.sync,
    /// every compiled head dim and block shape.
    Mma,
    /// kernels/attention_wgmma.cu (`attn_causal_fwd_wg_bf16_hd*` at head_dim 128 and 256,
    /// `attn_draft_fwd_wg_bf16_hd128`, `attn_draft_bwd_q_wg_bf16_hd128` and
    /// `attn_draft_bwd_kv_wg_bf16_hd128` at block_size <= 16 and block_size * G <= 64): Hopper
    /// warpgroup MMAs.
    Wgmma,
    /// kernels/attention_wgmma.cu sections 5 to 8 (`attn_causal_fwd_ws_bf16_hd*` at head_dim 128
    /// and 256; `attn_draft_fwd_ws_bf16_hd128` and the backward `attn_draft_bwd_ws_bf16_hd128` at
    /// the `Wgmma` drafter shapes with a context): warp-specialised (a producer warpgroup loads by
    /// TMA into an mbarrier ring, two consumer warpgroups run the wgmma form's pipeline). Same
    /// results as `Wgmma` to rounding (the drafter backward bit for bit: the same products in the
    /// same order); the default where it is compiled.
    WarpSpecialized,
}

impl AttnForm {
    /// DFLASH_ATTN_FORM=mma picks mma.sync everywhere, =wgmma the warpgroup kernels without the
    /// warp-specialised causal one, for comparisons inside a whole run.
    fn forced() -> Option<AttnForm> {
        static FORCED: std::sync::OnceLock<Option<AttnForm>> = std::sync::OnceLock::new();
        *FORCED.get_or_init(|| match std::env::var("DFLASH_ATTN_FORM").ok().as_deref() {
            None => None,
            Some("mma") => Some(AttnForm::Mma),
            Some("wgmma") => Some(AttnForm::Wgmma),
            Some(v) => {
                eprintln!("note: DFLASH_ATTN_FORM={v} is not mma or wgmma; using the default");
                None
            }
        })
    }

    /// DFLASH_ATTN_GATE=epilogue applies the Qwen3.5 output gate in the warp-specialised causal
    /// kernel's epilogue (`attn_causal_fwd_with`'s `gate`); by default the attention runs, then
    /// `sigmoid_mul_strided`. The epilogue runs while its SM holds no other CTA, so its gate loads
    /// and arithmetic are not hidden: on an H100 at the 27B shape it took the kernel from 934 to
    /// 1,402 us a call against the separate pass's 157 us (each lane loads its gate chunks one at
    /// a time, each load's latency in the CTA's way out). The `gated-attention` bench group times
    /// the two ways side by side; the epilogue becomes the default once it measures faster there.
    fn gate_in_epilogue() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| match std::env::var("DFLASH_ATTN_GATE").ok().as_deref() {
            None | Some("") | Some("separate") => false,
            Some("epilogue") => true,
            Some(v) => {
                eprintln!("note: DFLASH_ATTN_GATE={v} is not epilogue or separate; using the separate pass");
                false
            }
        })
    }

    /// The causal forward's kernel: the warp-specialised one where it is compiled, else the
    /// warpgroup one, else mma.sync.
    pub fn pick_causal(head_dim: usize) -> AttnForm {
        let forced = Self::forced();
        [AttnForm::WarpSpecialized, AttnForm::Wgmma]
            .into_iter()
            .filter(|&f| forced.is_none_or(|x| x == f))
            .find(|f| f.takes_causal(head_dim))
            .unwrap_or(AttnForm::Mma)
    }

    /// The drafter forward's kernel: the warp-specialised one where it takes the shape, else the
    /// warpgroup one, where there are at least two blocks (both pair them per CTA; a lone block,
    /// as in speculative decoding at batch 1, would leave half of each CTA computing masked
    /// tiles), else mma.sync.
    pub fn pick_draft(sh: &DraftAttnShape) -> AttnForm {
        let forced = Self::forced();
        [AttnForm::WarpSpecialized, AttnForm::Wgmma]
            .into_iter()
            .filter(|&f| forced.is_none_or(|x| x == f))
            .find(|f| sh.num_blocks >= 2 && f.takes_draft(sh))
            .unwrap_or(AttnForm::Mma)
    }

    /// The drafter backward's kernels, under the forward's conditions (the query-side kernels
    /// pair blocks per CTA the same way): the warp-specialised ones where they take the shape,
    /// else the warpgroup ones, else mma.sync.
    pub fn pick_draft_bwd(sh: &DraftAttnShape) -> AttnForm {
        Self::pick_draft(sh)
    }

    /// Whether this form has a causal kernel for `head_dim`.
    pub fn takes_causal(self, head_dim: usize) -> bool {
        let variants: &[(&str, launch::Kernel)] = match self {
            AttnForm::Mma => &launch::AttnCausalFwdBf16Hd::VARIANTS,
            AttnForm::Wgmma => &launch::AttnCausalFwdWgBf16Hd::VARIANTS,
            AttnForm::WarpSpecialized => &launch::AttnCausalFwdWsBf16Hd::VARIANTS,
        };
        variant(variants, &head_dim.to_string()).is_some()
    }

    /// Whether this form has a drafter forward for the shape (the mma.sync kernel: every compiled
    /// head dim; its own limits are checked by the launcher). The warp-specialised one also needs
    /// a context (its TMA descriptors span at least one row) and query rows its 32-bit TMA
    /// coordinates reach.
    pub fn takes_draft(self, sh: &DraftAttnShape) -> bool {
        let g = sh.heads.checked_div(sh.kv_heads).unwrap_or(0);
        let wg_shape = sh.head_dim == 128 && sh.block_size <= ATTN_WG_BLOCK_KEYS && g > 0 && sh.block_size * g <= 64;
        match self {
            AttnForm::Mma => variant(&launch::AttnDraftFwdBf16Hd::VARIANTS, &sh.head_dim.to_string()).is_some(),
            AttnForm::Wgmma => wg_shape,
            AttnForm::WarpSpecialized => {
                wg_shape && sh.ctx_rows > 0 && (sh.num_blocks + 1) * sh.block_size < i32::MAX as usize
            }
        }
    }
}

/// Which gated-delta-rule kernel of kernels/gdn.cu runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnForm {
    /// `gdn_recurrent_fwd`: token by token (decode).
    Recurrent,
    /// `gdn_chunked_fwd_simt`: chunks of GDN_CHUNK, products on CUDA cores.
    ChunkedSimt,
    /// `gdn_chunked_fwd_tc`: chunks of GDN_CHUNK, products on tensor cores (TF32 wmma); head
    /// dims multiples of 16.
    ChunkedTc,
    /// `gdn_split_prep`, `gdn_split_state`, `gdn_split_out`: the chunked form split so only the
    /// state recurrence is sequential (chunk-local work parallel over every chunk, the state pass
    /// over value-column blocks); tensor cores, head dims multiples of 16, f32 scratch in device
    /// memory (kernels/gdn.cu's header has the bytes).
    ChunkedSplit,
    /// `gdn_fast_prep_nk*`, `gdn_fast_state_nk*`, `gdn_fast_out_nk*`: the split form with bf16 scratch (W,
    /// U/V', the chunk states) and bf16 tensor-core operands (mma.sync, f32 accumulators), the
    /// state block in registers; head dims multiples of 16, dk <= 128.
    ChunkedFast,
}

impl GdnForm {
    /// Dynamic shared memory in bytes (kernels/gdn.cu's header has the layouts); for the split
    /// form the largest of its three kernels'.
    pub fn smem_bytes(self, dk: usize, dv: usize) -> usize {
        let c = GDN_CHUNK;
        if self == GdnForm::ChunkedSplit {
            return split_smem(dk, dv).into_iter().max().unwrap_or(0);
        }
        if self == GdnForm::ChunkedFast {
            return fast_smem(dk, dv).into_iter().max().unwrap_or(0);
        }
        4 * match self {
            GdnForm::Recurrent => dk * dv + 2 * dk,
            GdnForm::ChunkedSimt => dk * dv + 2 * c * dk + c * dv + c * c + 3 * c,
            GdnForm::ChunkedTc => {
                let (lk, lv, la) = (dk + GDN_TC_PAD, dv + GDN_TC_PAD, c + GDN_TC_PAD);
                dk * lv + 2 * c * lk + c * lv + c * la + 3 * c + (GDN_THREADS / 32) * 16 * 16
            }
            GdnForm::ChunkedSplit | GdnForm::ChunkedFast => unreachable!("returned above"),
        }
    }

    /// Whether this form's kernel takes these head dims.
    pub fn takes(self, dk: usize, dv: usize) -> bool {
        match self {
            GdnForm::Recurrent | GdnForm::ChunkedSimt => true,
            GdnForm::ChunkedTc | GdnForm::ChunkedSplit => dk % 16 == 0 && dv % 16 == 0,
            GdnForm::ChunkedFast => dk % 16 == 0 && dv % 16 == 0 && dk <= 32 * (GDN_FAST_STATE_THREADS / 32),
        }
    }
}

/// Dynamic shared memory in bytes of gdn_split_prep, gdn_split_state and gdn_split_out
/// (kernels/gdn.cu's split-form header has the layouts).
pub fn split_smem(dk: usize, dv: usize) -> [usize; 3] {
    let (c, p) = (GDN_CHUNK, GDN_TC_PAD);
    let (lk, lv, la) = (dk + p, dv + p, c + p);
    let (lb, lo) = (GDN_SPLIT_BV + p, GDN_SPLIT_OUT_BV + p);
    [
        4 * (c * lk + c * lv + c * la + 2 * c),
        4 * (2 * c * lk + (dk + c) * lb + c),
        4 * (c * lk.max(lo) + (c * lk).max(dk * lo) + c * la + c * lo + c),
    ]
}

/// Dynamic shared memory in bytes of gdn_fast_prep_nk*, gdn_fast_state_nk* and gdn_fast_out_nk*
/// (kernels/gdn.cu's fast-form header has the layouts).
pub fn fast_smem(dk: usize, dv: usize) -> [usize; 3] {
    let (c, p) = (GDN_CHUNK, GDN_FAST_PAD);
    let (lk, lb, lo) = (dk + p, GDN_FAST_BV + p, GDN_FAST_OUT_BV + p);
    [
        2 * (2 * c * lk + 2 * c * (dv + p)) + 4 * (2 * c * (c + 4) + 3 * 256 + 4 * c),
        // 2 stages of U | S_c | V' (W and Ke^T go straight to registers).
        2 * (2 * c * lb + dk * lb + c * lb),
        // Q hi + lo | K hi + lo, then V' and A (then the output tile) | S_c | G of two heads.
        2 * (2 * c * lk + (2 * c * lk).max(2 * c * lo) + dk * lo) + 4 * 2 * c,
    ]
}

/// Whether the fast form's prep and output passes run their constant-shape bodies (`_nk8`,
/// dk = dv = 128: one output CTA, GDN_FAST_OUT_BV = 128 columns (kernels/gdn.cu asserts it), holds
/// whole value heads, so it can also apply the output norm).
fn fast_out_nk8(dk: usize, dv: usize) -> bool {
    dk == 128 && dv == 128
}

/// Bytes of the fast form's scratch (W, Ke, U then V', the chunk-start states in bf16; G in f32).
pub fn fast_scratch_bytes(rows: usize, n_starts: usize, v_heads: usize, dk: usize, dv: usize) -> usize {
    let c = GDN_CHUNK;
    split_slots(rows, n_starts) * v_heads * (2 * c * (2 * dk + dv) + 4 * c + 2 * dk * dv)
}

/// Chunk slots of the split form's scratch: every chunk of every sequence has its own below this
/// (kernels/gdn.cu's split-form header).
pub fn split_slots(rows: usize, n_starts: usize) -> usize {
    rows.div_ceil(GDN_CHUNK) + n_starts
}

/// Bytes of the split form's f32 scratch (W, U then V', G, the chunk-start states).
pub fn split_scratch_bytes(rows: usize, n_starts: usize, v_heads: usize, dk: usize, dv: usize) -> usize {
    let c = GDN_CHUNK;
    4 * split_slots(rows, n_starts) * v_heads * (c * (dk + dv + 1) + dk * dv)
}

impl CudaBackend {
    /// Grid of a grid-stride hybrid.cu kernel over `n` items, one per thread per pass.
    fn hyb_grid(&self, n: usize) -> usize {
        n.div_ceil(HYB_BLOCK).clamp(1, 32 * self.sm_count)
    }

    /// The gated delta rule with `form`'s kernel, shapes and dtypes checked (kernels/gdn.cu):
    /// q, k, g f32; v, beta, o bf16; state f32.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_launch(
        &self,
        form: GdnForm,
        s: &Stream,
        sh: &GdnShape,
        qkvgb: [&CudaBuf; 5],
        seq_starts: &CudaIds,
        o: &mut CudaBuf,
        state: Option<&mut CudaBuf>,
    ) -> Result<()> {
        self.gdn_launch_with(form, s, sh, qkvgb, seq_starts, o, state, None)
    }

    /// `gdn_launch`, with the fast form's output pass writing the gated norm of its output
    /// (`norm`; the caller checked the shape: dk = dv = 128) instead of the output itself.
    #[allow(clippy::too_many_arguments)]
    fn gdn_launch_with(
        &self,
        form: GdnForm,
        s: &Stream,
        sh: &GdnShape,
        [q, k, v, g, beta]: [&CudaBuf; 5],
        seq_starts: &CudaIds,
        o: &mut CudaBuf,
        state: Option<&mut CudaBuf>,
        norm: Option<OutNorm>,
    ) -> Result<()> {
        let op = match form {
            GdnForm::Recurrent => "gdn_recurrent_fwd",
            GdnForm::ChunkedSimt | GdnForm::ChunkedTc | GdnForm::ChunkedSplit | GdnForm::ChunkedFast => {
                "gdn_chunked_fwd"
            }
        };
        let GdnShape { rows, k_heads, v_heads, k_dim: dk, v_dim: dv } = *sh;
        if k_heads == 0 || v_heads % k_heads != 0 || dk == 0 || dv == 0 {
            return Err(BackendError::Shape {
                op,
                what: format!("{v_heads} value heads over {k_heads} key heads, dims {dk} x {dv}"),
            });
        }
        let (kw, vw) = (k_heads * dk, v_heads * dv);
        check_len(op, "q", q.len, 0, rows * kw)?;
        check_len(op, "k", k.len, 0, rows * kw)?;
        check_len(op, "v", v.len, 0, rows * vw)?;
        check_len(op, "g", g.len, 0, rows * v_heads)?;
        check_len(op, "beta", beta.len, 0, rows * v_heads)?;
        check_len(op, "o", o.len, 0, rows * vw)?;
        let n_starts = seq_starts.len;
        if n_starts == 0 {
            return Err(BackendError::Shape { op, what: "seq_starts is empty (it starts with 0)".into() });
        }
        let per_state = v_heads * dk * dv;
        let (state_ptr, state_seqs) = match state {
            Some(st) => {
                check_len(op, "state", st.len, 0, (n_starts - 1) * per_state)?;
                (st.at::<f32>(op, 0)?, st.len / per_state)
            }
            // Never read (state_seqs 0), but a launch argument must be a live pointer.
            None => (q.at::<f32>(op, 0)?, 0),
        };
        if !form.takes(dk, dv) {
            return Err(BackendError::Shape {
                op,
                what: format!(
                    "{form:?} needs head dims that are multiples of 16 (dk <= 128 for ChunkedFast), not {dk} x {dv}"
                ),
            });
        }
        let smem = form.smem_bytes(dk, dv);
        if smem > self.smem_optin {
            return Err(BackendError::Shape {
                op,
                what: format!(
                    "key/value head dims {dk} x {dv} need {smem} bytes of shared memory per CTA; this GPU allows {}",
                    self.smem_optin
                ),
            });
        }
        if rows == 0 {
            return Ok(());
        }
        if form == GdnForm::ChunkedSplit {
            return self.gdn_split(s, sh, [q, k, v, g, beta], seq_starts, o, state_ptr, state_seqs);
        }
        if form == GdnForm::ChunkedFast {
            return self.gdn_fast(s, sh, [q, k, v, g, beta], seq_starts, o, state_ptr, state_seqs, norm);
        }
        if norm.is_some() {
            return Err(BackendError::Shape { op, what: format!("{form:?} has no fused output norm") });
        }
        macro_rules! args {
            ($ty:ident) => {
                launch::$ty {
                    q: q.at(op, 0)?,
                    k: k.at(op, 0)?,
                    v: v.at(op, 0)?,
                    g: g.at(op, 0)?,
                    beta: beta.at(op, 0)?,
                    o: o.at(op, 0)?,
                    state: state_ptr,
                    state_seqs,
                    seq_starts: seq_starts.at(op, 0)?,
                    n_starts,
                    rows,
                    k_heads,
                    v_heads,
                    dk,
                    dv,
                }
            };
        }
        let cfg = (n_starts * v_heads, GDN_THREADS, smem);
        match form {
            GdnForm::Recurrent => self.launch(s, launch::GdnRecurrentFwd::KERNEL, cfg, args!(GdnRecurrentFwd)),
            GdnForm::ChunkedSimt => self.launch(s, launch::GdnChunkedFwdSimt::KERNEL, cfg, args!(GdnChunkedFwdSimt)),
            GdnForm::ChunkedTc => self.launch(s, launch::GdnChunkedFwdTc::KERNEL, cfg, args!(GdnChunkedFwdTc)),
            GdnForm::ChunkedSplit | GdnForm::ChunkedFast => unreachable!("launched above"),
        }
    }

    /// The split chunked form (shapes checked by `gdn_launch`): prep over every chunk, the state
    /// pass over (sequence, head, value block), the output over (chunk, head, value block); the
    /// scratch is stream-ordered and freed when the three launches are queued.
    #[allow(clippy::too_many_arguments)]
    fn gdn_split(
        &self,
        s: &Stream,
        sh: &GdnShape,
        [q, k, v, g, beta]: [&CudaBuf; 5],
        seq_starts: &CudaIds,
        o: &mut CudaBuf,
        state: DevPtr<f32>,
        state_seqs: usize,
    ) -> Result<()> {
        const OP: &str = "gdn_chunked_fwd";
        let GdnShape { rows, k_heads, v_heads, k_dim: dk, v_dim: dv } = *sh;
        let n_starts = seq_starts.len;
        let slots = split_slots(rows, n_starts);
        let c = GDN_CHUNK;
        let w = self.uninit_buf(s, DType::F32, slots * v_heads * c * dk, "gdn_chunked_fwd's W scratch")?;
        let uv = self.uninit_buf(s, DType::F32, slots * v_heads * c * dv, "gdn_chunked_fwd's U/V' scratch")?;
        let gs = self.uninit_buf(s, DType::F32, slots * v_heads * c, "gdn_chunked_fwd's G scratch")?;
        let st = self.uninit_buf(s, DType::F32, slots * v_heads * dk * dv, "gdn_chunked_fwd's chunk states")?;
        let [sm_prep, sm_state, sm_out] = split_smem(dk, dv);
        let prep = launch::GdnSplitPrep {
            k: k.at(OP, 0)?,
            v: v.at(OP, 0)?,
            g: g.at(OP, 0)?,
            beta: beta.at(OP, 0)?,
            w_out: w.at(OP, 0)?,
            u_out: uv.at(OP, 0)?,
            g_out: gs.at(OP, 0)?,
            seq_starts: seq_starts.at(OP, 0)?,
            n_starts,
            rows,
            k_heads,
            v_heads,
            dk,
            dv,
        };
        self.launch(s, launch::GdnSplitPrep::KERNEL, (slots * v_heads, GDN_THREADS, sm_prep), prep)?;
        let state_args = launch::GdnSplitState {
            k: k.at(OP, 0)?,
            w_in: w.at(OP, 0)?,
            u_v: uv.at(OP, 0)?,
            g_in: gs.at(OP, 0)?,
            s_out: st.at(OP, 0)?,
            state,
            state_seqs,
            seq_starts: seq_starts.at(OP, 0)?,
            n_starts,
            rows,
            k_heads,
            v_heads,
            dk,
            dv,
        };
        let blocks = dv.div_ceil(GDN_SPLIT_BV);
        let cfg = (n_starts * v_heads * blocks, GDN_SPLIT_STATE_THREADS, sm_state);
        self.launch(s, launch::GdnSplitState::KERNEL, cfg, state_args)?;
        let out = launch::GdnSplitOut {
            q: q.at(OP, 0)?,
            k: k.at(OP, 0)?,
            vp: uv.at(OP, 0)?,
            g_in: gs.at(OP, 0)?,
            s_in: st.at(OP, 0)?,
            o: o.at(OP, 0)?,
            seq_starts: seq_starts.at(OP, 0)?,
            n_starts,
            rows,
            k_heads,
            v_heads,
            dk,
            dv,
        };
        let blocks = dv.div_ceil(GDN_SPLIT_OUT_BV);
        self.launch(s, launch::GdnSplitOut::KERNEL, (slots * v_heads * blocks, GDN_THREADS, sm_out), out)
    }
}

impl CudaBackend {
    /// The fast split form (shapes checked by `gdn_launch`): as `gdn_split`, with bf16 scratch.
    #[allow(clippy::too_many_arguments)]
    fn gdn_fast(
        &self,
        s: &Stream,
        sh: &GdnShape,
        [q, k, v, g, beta]: [&CudaBuf; 5],
        seq_starts: &CudaIds,
        o: &mut CudaBuf,
        state: DevPtr<f32>,
        state_seqs: usize,
        norm: Option<OutNorm>,
    ) -> Result<()> {
        const OP: &str = "gdn_chunked_fwd";
        let GdnShape { rows, k_heads, v_heads, k_dim: dk, v_dim: dv } = *sh;
        if norm.is_some() && !fast_out_nk8(dk, dv) {
            return Err(BackendError::Shape {
                op: OP,
                what: format!("the fused output norm needs dk = dv = 128, not {dk} x {dv}"),
            });
        }
        let n_starts = seq_starts.len;
        let slots = split_slots(rows, n_starts);
        let c = GDN_CHUNK;
        let w = self.uninit_buf(s, DType::BF16, slots * v_heads * c * dk, "gdn_chunked_fwd's W scratch")?;
        let ke = self.uninit_buf(s, DType::BF16, slots * v_heads * c * dk, "gdn_chunked_fwd's decayed K scratch")?;
        let uv = self.uninit_buf(s, DType::BF16, slots * v_heads * c * dv, "gdn_chunked_fwd's U/V' scratch")?;
        let gs = self.uninit_buf(s, DType::F32, slots * v_heads * c, "gdn_chunked_fwd's G scratch")?;
        let st = self.uninit_buf(s, DType::BF16, slots * v_heads * dk * dv, "gdn_chunked_fwd's chunk states")?;
        let [sm_prep, sm_state, sm_out] = fast_smem(dk, dv);
        let prep = launch::GdnFastPrepNk {
            k: k.at(OP, 0)?,
            v: v.at(OP, 0)?,
            g: g.at(OP, 0)?,
            beta: beta.at(OP, 0)?,
            w_out: w.at(OP, 0)?,
            u_out: uv.at(OP, 0)?,
            ke_out: ke.at(OP, 0)?,
            g_out: gs.at(OP, 0)?,
            seq_starts: seq_starts.at(OP, 0)?,
            n_starts,
            rows,
            k_heads,
            v_heads,
            dk,
            dv,
        };
        // The constant-shape bodies where dk = dv = 128 (the 27B shape), state: dk = 128 and whole
        // value blocks.
        let (prep_k, out_k) = if fast_out_nk8(dk, dv) {
            (launch::Kernel::GdnFastPrepNk8, launch::Kernel::GdnFastOutNk8)
        } else {
            (launch::Kernel::GdnFastPrepNk0, launch::Kernel::GdnFastOutNk0)
        };
        // One CTA per (chunk slot, key head) in the prep and output passes: each takes the key
        // head's value heads in turn, sharing k (and q) and their products.
        self.launch(s, prep_k, (slots * k_heads, GDN_THREADS, sm_prep), prep)?;
        let state_args = launch::GdnFastStateNk {
            w_in: w.at(OP, 0)?,
            ke_in: ke.at(OP, 0)?,
            u_v: uv.at(OP, 0)?,
            g_in: gs.at(OP, 0)?,
            s_out: st.at(OP, 0)?,
            state,
            state_seqs,
            seq_starts: seq_starts.at(OP, 0)?,
            n_starts,
            rows,
            k_heads,
            v_heads,
            dk,
            dv,
        };
        let blocks = dv.div_ceil(GDN_FAST_BV);
        let cfg = (n_starts * v_heads * blocks, GDN_FAST_STATE_THREADS, sm_state);
        // The constant-shape body where dk = 128 and the value blocks are whole (the 27B shape).
        let kernel = if dk == 128 && dv % GDN_FAST_BV == 0 {
            launch::Kernel::GdnFastStateNk8
        } else {
            launch::Kernel::GdnFastStateNk0
        };
        self.launch(s, kernel, cfg, state_args)?;
        let (nz, nw) = match norm {
            Some(n) => (n.z, n.w),
            // Never read (norm 0), but a launch argument must be a live pointer.
            None => (o.at(OP, 0)?, o.at(OP, 0)?),
        };
        let out = launch::GdnFastOutNk {
            q: q.at(OP, 0)?,
            k: k.at(OP, 0)?,
            vp: uv.at(OP, 0)?,
            g_in: gs.at(OP, 0)?,
            s_in: st.at(OP, 0)?,
            o: o.at(OP, 0)?,
            z: nz,
            nw,
            eps: norm.map_or(0.0, |n| n.eps),
            norm: norm.is_some() as usize,
            seq_starts: seq_starts.at(OP, 0)?,
            n_starts,
            rows,
            k_heads,
            v_heads,
            dk,
            dv,
        };
        let blocks = dv.div_ceil(GDN_FAST_OUT_BV);
        self.launch(s, out_k, (slots * k_heads * blocks, GDN_FAST_OUT_THREADS, sm_out), out)
    }
}

/// Validated drafter-attention geometry and the launch numbers the kernels fix.
struct DraftGeom {
    qw: usize,
    kw: usize,
    /// Shared-memory row pitch in bf16 elements.
    ld: usize,
    /// Warps of the query tile (ATTN_WARP_ROWS rows each).
    w: usize,
}

#[allow(clippy::too_many_arguments)]
fn draft_geom(
    op: &'static str,
    sh: &DraftAttnShape,
    q: &CudaBuf,
    kc: &CudaBuf,
    vc: &CudaBuf,
    kb: &CudaBuf,
    vb: &CudaBuf,
    anchors: &CudaIds,
    ctx_start: &CudaIds,
) -> Result<DraftGeom> {
    if sh.kv_heads == 0 || sh.heads % sh.kv_heads != 0 {
        return Err(BackendError::Shape { op, what: format!("{} heads over {} kv heads", sh.heads, sh.kv_heads) });
    }
    if sh.window == Some(0) {
        return Err(BackendError::Shape {
            op,
            what: "sliding window 0 (a window holds at least the draft token)".into(),
        });
    }
    let m = sh.block_size * (sh.heads / sh.kv_heads);
    if m > ATTN_DRAFT_MAX_ROWS {
        return Err(BackendError::Shape { op, what: format!("block_size x group = {m} > {ATTN_DRAFT_MAX_ROWS}") });
    }
    let (qw, kw) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
    check_len(op, "q", q.len, 0, sh.q_rows() * qw)?;
    check_len(op, "kc", kc.len, 0, sh.ctx_rows * kw)?;
    check_len(op, "vc", vc.len, 0, sh.ctx_rows * kw)?;
    check_len(op, "kb", kb.len, 0, sh.q_rows() * kw)?;
    check_len(op, "vb", vb.len, 0, sh.q_rows() * kw)?;
    check_len(op, "anchors", anchors.len, 0, sh.num_blocks)?;
    check_len(op, "ctx_start", ctx_start.len, 0, sh.num_blocks)?;
    Ok(DraftGeom { qw, kw, ld: sh.head_dim + ATTN_LD_PAD, w: m.div_ceil(ATTN_WARP_ROWS) })
}

/// `rmsnorm1p_fwd`'s block-per-row variant for rows of `dim` bf16 values: VPT 16-byte groups
/// (8 values each) per thread over 32..=256 threads, VPT 5 before 4; `None` (the warp-per-row
/// variant 0) where no VPT fits or a pointer is not 16-byte aligned.
fn rmsnorm1p_vpt(dim: usize, aligned: bool) -> Option<usize> {
    [5usize, 4].into_iter().find(|v| aligned && dim % (256 * v) == 0 && dim / (8 * v) <= 256)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shapes `gpu_hybrid_norms_match_cpu` runs take the variants its comment says: a test
    /// that passes on the warp kernel alone would not show the block kernels right.
    #[test]
    fn rmsnorm1p_picks_the_block_kernel_where_it_fits() {
        for (dim, want) in [(5120, Some(5)), (2560, Some(5)), (4096, Some(4)), (10240, Some(5)), (8192, Some(4))] {
            assert_eq!(rmsnorm1p_vpt(dim, true), want, "dim {dim}");
            assert_eq!(rmsnorm1p_vpt(dim, false), None, "dim {dim} unaligned");
        }
        // 12288 = 9.6 x 1280 and 384 threads of 4: no block variant; nor below 1024.
        for dim in [12288, 16, 100, 128, 256, 1000, 33] {
            assert_eq!(rmsnorm1p_vpt(dim, true), None, "dim {dim}");
        }
    }

    /// Streams were once named by their handle's address, which the driver reuses: a new stream
    /// could inherit the cached blocks (and recorded uses) of a dropped one.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_new_stream_never_inherits_a_dropped_streams_memory() {
        let be = CudaBackend::new(0, Mode::Normal).unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
        let s1 = be.new_stream().expect("a stream");
        let b = be.alloc(&s1, DType::F32, 1024).expect("memory");
        let (p1, id1) = (b.ptr, s1.id());
        drop(b); // cached in s1's pool
        be.synchronize(&s1).expect("sync");
        drop(s1);
        let s2 = be.new_stream().expect("a stream");
        assert_ne!(s2.id(), id1);
        let b2 = be.alloc(&s2, DType::F32, 1024).expect("memory");
        assert_ne!(b2.ptr, p1, "a new stream took memory cached for a dropped one");
        be.synchronize(&s2).expect("sync");
    }

    /// The warpgroup kernels take head_dim 128 and 256 (Qwen3, Qwen3.5/3.6; the warp-specialised
    /// one by default), mma.sync the rest.
    #[test]
    fn attention_picks_the_warpgroup_kernels_where_they_take_the_shape() {
        assert!(AttnForm::Wgmma.takes_causal(128) && AttnForm::Wgmma.takes_causal(256));
        assert!(!AttnForm::Wgmma.takes_causal(64) && !AttnForm::Wgmma.takes_causal(16));
        for hd in [16, 32, 64, 128, 256] {
            assert!(AttnForm::Mma.takes_causal(hd), "mma.sync has every head dim ({hd})");
        }
        assert!(!AttnForm::Mma.takes_causal(96) && !AttnForm::Wgmma.takes_causal(96));
        // The drafter's warpgroup kernel: head_dim 128, block_size <= 16, block_size * G <= 64.
        let sh = |hd, bs, heads, kv_heads| DraftAttnShape {
            num_blocks: 4,
            block_size: bs,
            ctx_rows: 64,
            heads,
            kv_heads,
            head_dim: hd,
            window: None,
        };
        assert!(AttnForm::Wgmma.takes_draft(&sh(128, 16, 32, 8)));
        assert!(!AttnForm::Wgmma.takes_draft(&sh(128, 16, 32, 4)), "M = 128");
        assert!(!AttnForm::Wgmma.takes_draft(&sh(64, 16, 32, 8)));
        assert!(!AttnForm::Wgmma.takes_draft(&sh(128, 32, 8, 8)), "block_size 32");
        assert!(AttnForm::Mma.takes_draft(&sh(64, 16, 32, 8)));
        // The warp-specialised forwards: the same head dims and drafter shapes (with a context),
        // the default there, and no drafter backward.
        let ws = AttnForm::WarpSpecialized;
        assert!(ws.takes_causal(128) && ws.takes_causal(256));
        assert!(!ws.takes_causal(64) && !ws.takes_causal(96));
        assert!(ws.takes_draft(&sh(128, 16, 32, 8)));
        assert!(!ws.takes_draft(&sh(128, 16, 32, 4)) && !ws.takes_draft(&sh(64, 16, 32, 8)));
        assert!(!ws.takes_draft(&DraftAttnShape { ctx_rows: 0, ..sh(128, 16, 32, 8) }), "no context");
        if std::env::var_os("DFLASH_ATTN_FORM").is_none() {
            assert_eq!(AttnForm::pick_causal(128), ws);
            assert_eq!(AttnForm::pick_causal(256), ws);
            assert_eq!(AttnForm::pick_causal(64), AttnForm::Mma);
        }
        // The forward and the backward pick the warp-specialised kernels where they take the shape
        // and there are two blocks to pair.
        if std::env::var_os("DFLASH_ATTN_FORM").is_none() {
            assert_eq!(AttnForm::pick_draft(&sh(128, 16, 32, 8)), ws);
            assert_eq!(AttnForm::pick_draft(&sh(128, 16, 32, 4)), AttnForm::Mma);
            let lone = DraftAttnShape { num_blocks: 1, ..sh(128, 16, 32, 8) };
            assert_eq!(AttnForm::pick_draft(&lone), AttnForm::Mma);
            assert_eq!(AttnForm::pick_draft_bwd(&sh(128, 16, 32, 8)), ws);
            assert_eq!(AttnForm::pick_draft_bwd(&sh(128, 16, 32, 4)), AttnForm::Mma);
            assert_eq!(AttnForm::pick_draft_bwd(&sh(64, 16, 32, 8)), AttnForm::Mma);
            let lone = DraftAttnShape { num_blocks: 1, ..sh(128, 16, 32, 8) };
            assert_eq!(AttnForm::pick_draft_bwd(&lone), AttnForm::Mma);
        }
    }

    #[test]
    fn allocator_out_of_memory_becomes_a_typed_error_that_says_what_to_reduce() {
        let e = AllocError::OutOfMemory { requested: 3 << 30, reserved: 70 << 30, allocated: 69 << 30 };
        let e = alloc_error(e, "alloc of 1610612736 bf16 elements on cuda:0".into(), Some((512 << 20, 141 << 30)));
        assert!(e.is_out_of_memory());
        let m = e.to_string();
        for part in [
            "alloc of 1610612736 bf16 elements on cuda:0 asked for 3221225472 bytes (3072.0 MiB)",
            "holds 71680.0 MiB of which 70656.0 MiB are in live buffers",
            "512.0 MiB free of 144384.0 MiB",
            "halve --batch-size and double --grad-accum",
            "--seq-len, --logits-chunk or --pad-to-tokens",
            "run --sync",
            "--offload-optimizer",
        ] {
            assert!(m.contains(part), "{part:?} missing from {m}");
        }
    }

    #[test]
    fn driver_failures_of_the_allocator_keep_their_cause() {
        use std::error::Error as _;
        // What CudaMem returns for a cuMemAlloc that failed for another reason than memory.
        let bad = DriverError(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        let e = alloc_error(AllocError::Driver { call: "cuMemAlloc", bytes: 4096, source: bad }, "alloc".into(), None);
        assert!(!e.is_out_of_memory());
        assert_eq!(e.to_string(), "alloc: cuMemAlloc: CUDA driver error CUDA_ERROR_ILLEGAL_ADDRESS");
        assert!(e.source().is_some());
        // A driver OOM reported as a Driver error of the allocator still reads as out of memory.
        let oom = DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let e = alloc_error(AllocError::Driver { call: "cuMemAllocAsync", bytes: 64, source: oom }, "x".into(), None);
        assert!(e.is_out_of_memory());
    }

    #[test]
    fn the_gdn_kernels_chunk_as_the_cpu_reference_does_and_fit_the_27b_head_dims() {
        assert_eq!(GDN_CHUNK, crate::backend::GDN_CHUNK);
        // dk = dv = 128 (Qwen3.6-27B) within Hopper's 227 KB per CTA, one CTA per SM.
        assert_eq!(GdnForm::ChunkedSimt.smem_bytes(128, 128), 180_992);
        assert_eq!(GdnForm::Recurrent.smem_bytes(128, 128), 66_560);
        assert_eq!(GdnForm::ChunkedTc.smem_bytes(128, 128), 195_328);
        assert!(GdnForm::ChunkedTc.smem_bytes(128, 128) <= 227 * 1024);
        assert!(GdnForm::ChunkedTc.takes(128, 128) && GdnForm::ChunkedTc.takes(16, 32));
        assert!(!GdnForm::ChunkedTc.takes(24, 128) && GdnForm::ChunkedSimt.takes(24, 100));
        assert!(GdnForm::ChunkedSimt.smem_bytes(128, 128) <= 227 * 1024);
        // The split form's kernels (prep, state pass, output) as its header says, each small
        // enough for two CTAs per SM (228 KB per SM, 1 KB reserved per CTA).
        assert_eq!(split_smem(128, 128), [85_504, 95_488, 103_680]);
        assert_eq!(GdnForm::ChunkedSplit.smem_bytes(128, 128), 103_680);
        assert!(split_smem(128, 128).iter().all(|&b| 2 * (b + 1024) <= 228 * 1024));
        assert!(GdnForm::ChunkedSplit.takes(128, 128) && GdnForm::ChunkedSplit.takes(16, 48));
        assert!(!GdnForm::ChunkedSplit.takes(24, 128) && !GdnForm::ChunkedSplit.takes(128, 40));
        // Its scratch at the 27B shape (48 value heads, 128/128), as the header says.
        assert_eq!(split_slots(4 * 3072, 5), 197);
        assert_eq!(split_scratch_bytes(4 * 3072, 5, 48, 128, 128), 1_241_837_568);
        assert_eq!(split_scratch_bytes(4096, 2, 48, 128, 128), 416_047_104);
        // The fast form (bf16 scratch and operands), as its header says: each kernel at least
        // two CTAs per SM, the state pass three (its registers decide); dk up to 128.
        assert_eq!(fast_smem(128, 128), [108_544, 25_600, 104_960]);
        assert!(3 * (fast_smem(128, 128)[1] + 1024) <= 228 * 1024);
        assert_eq!(GdnForm::ChunkedFast.smem_bytes(128, 128), 108_544);
        assert!(fast_smem(128, 128).iter().all(|&b| 2 * (b + 1024) <= 228 * 1024));
        assert!(GdnForm::ChunkedFast.takes(128, 128) && GdnForm::ChunkedFast.takes(16, 48));
        assert!(!GdnForm::ChunkedFast.takes(144, 128) && !GdnForm::ChunkedFast.takes(24, 128));
        assert_eq!(fast_scratch_bytes(4 * 3072, 5, 48, 128, 128), 777_056_256);
        // The forward substitution gives each thread one column of [W | U] at the 27B dims.
        assert_eq!(GDN_THREADS, 128 + 128);
    }

    #[test]
    fn cross_entropy_cluster_kernels_take_adjacent_vocab_ranges() {
        let (a, b) = (&CE_CLUSTERS[0], &CE_CLUSTERS[1]);
        assert_eq!((a.max_vocab(), b.max_vocab()), (163_840, 262_144));
        // The wide kernel starts one chunk of 8 past the first one's end; neither takes a
        // vocabulary that is not a multiple of 8 or lies outside its range.
        assert_eq!(b.min_vocab, a.max_vocab() + 8);
        assert_eq!(launch::CecKernel::VARIANTS.map(|(_, k)| k), [a.kernel, b.kernel]);
        for v in [32_768, 151_936, 163_840] {
            assert!(a.takes(v) && !b.takes(v), "{v}");
        }
        for v in [163_848, 256_000, 262_144] {
            assert!(!a.takes(v) && b.takes(v), "{v}");
        }
        for v in [32_760, 151_937, 262_152, 327_680] {
            assert!(!a.takes(v) && !b.takes(v), "{v}");
        }
        // Shared memory per SM on Hopper: 228 KB, of which a CTA may opt into 227 KB (1 KB of each
        // CTA is reserved); each kernel's static shared memory is under 1 KB. Two CTAs of the
        // first kernel fit; one of the wide kernel.
        assert!(2 * (a.smem() + 1024 + 1024) <= 228 * 1024, "{}", a.smem());
        assert!(b.smem() + 1024 + 1024 <= 227 * 1024 && 2 * b.smem() > 228 * 1024, "{}", b.smem());
    }
}
