//! The CPU reference backend: plain loops, the oracle every CUDA kernel is tested against.
//!
//! `CpuBackend<f32>` is the product's CPU path: f32 math with bf16 storage rounded where the GPU
//! rounds (every write into a bf16 buffer). `CpuBackend<f64>` with rounding off is the exact
//! backend the finite-difference tests differentiate. Rows are split across threads with rayon;
//! each output element is still computed by one thread in a fixed order, so results do not depend
//! on the thread count.

use std::marker::PhantomData;

use rayon::prelude::*;

use super::slots::{SlotError, SlotMemory};
use super::{
    check_causal_attn, check_len, AdamStep, Backend, BackendError, DecodeAttnShape, DraftAttnShape, GdnShape, Gemm,
    QkNormRope, QkRstd, Result, Rows, GDN_CHUNK,
};
use crate::rng;
use crate::tensor::{round_bf16, DType};

/// The scalar the reference computes in: f32 (product) or f64 (finite differences).
pub trait Real:
    Copy
    + Send
    + Sync
    + 'static
    + PartialOrd
    + std::fmt::Debug
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
{
    const ZERO: Self;
    const ONE: Self;
    const NAN: Self;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn is_finite(self) -> bool;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NAN: Self = <$t>::NAN;
            #[inline]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn from_f32(x: f32) -> Self {
                x as $t
            }
            #[inline]
            fn to_f32(self) -> f32 {
                self as f32
            }
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// A float buffer: values are kept as `F`; a bf16 buffer only ever holds bf16-representable values
/// (when rounding is on).
#[derive(Clone, Debug)]
pub struct CpuBuf<F> {
    pub dtype: DType,
    pub data: Vec<F>,
}

/// The CPU has one in-order "stream"; the handle exists so model code is the same on every backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuStream;

/// A CPU "device group" for data-parallel ranks on host threads: the last rank to arrive sums
/// the contributions in rank order (deterministic), every rank copies the result.
pub struct CpuComm {
    rank: usize,
    group: std::sync::Arc<CpuGroup>,
}

struct CpuGroup {
    n: usize,
    state: std::sync::Mutex<GroupState>,
    cv: std::sync::Condvar,
}

#[derive(Default)]
struct GroupState {
    /// Completed reductions.
    round: u64,
    parts: Vec<Option<Vec<f64>>>,
    result: std::sync::Arc<Vec<f64>>,
    aborted: bool,
}

impl CpuGroup {
    fn reduce(&self, rank: usize, mine: Vec<f64>) -> Result<std::sync::Arc<Vec<f64>>> {
        let gone = || BackendError::GroupAborted { op: "all_reduce_sum" };
        let mut st = self.state.lock().map_err(|_| gone())?;
        if st.aborted {
            return Err(gone());
        }
        if st.parts.len() != self.n {
            st.parts = vec![None; self.n];
        }
        st.parts[rank] = Some(mine);
        let round = st.round;
        if st.parts.iter().all(Option::is_some) {
            let parts: Vec<Vec<f64>> = st.parts.iter_mut().map(|p| p.take().unwrap_or_default()).collect();
            let mut sum = parts[0].clone();
            for p in &parts[1..] {
                if p.len() != sum.len() {
                    return Err(BackendError::Shape {
                        op: "all_reduce_sum",
                        what: format!("ranks passed buffers of different lengths ({} and {})", sum.len(), p.len()),
                    });
                }
                for (a, b) in sum.iter_mut().zip(p) {
                    *a += b;
                }
            }
            st.result = std::sync::Arc::new(sum);
            st.round += 1;
            self.cv.notify_all();
            return Ok(st.result.clone());
        }
        while st.round == round && !st.aborted {
            st = self.cv.wait(st).map_err(|_| gone())?;
        }
        if st.round == round {
            return Err(gone());
        }
        Ok(st.result.clone())
    }

    fn abort(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.aborted = true;
        }
        self.cv.notify_all();
    }
}

/// "Pinned" host slots of the CPU backend: plain vectors holding values exactly (f64 holds every
/// f32 and f64 bit pattern), so staged transports copy bit for bit. CPU copies complete at once,
/// so its events are always done.
#[derive(Debug, Default)]
pub struct CpuHostMem;

impl SlotMemory for CpuHostMem {
    type Slot = Vec<f64>;
    type Event = ();
    fn alloc_slot(&self, bytes: usize) -> std::result::Result<Vec<f64>, SlotError> {
        // Room for `bytes / 2` elements: every device dtype is at least 2 bytes wide.
        Ok(vec![0.0; bytes / 2])
    }
    fn done(&self, _ev: &()) -> bool {
        true
    }
    fn wait(&self, _ev: &()) -> std::result::Result<(), SlotError> {
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
pub struct CpuBackend<F: Real = f32> {
    round: bool,
    _f: PhantomData<F>,
}

impl CpuBackend<f32> {
    /// The product backend: f32 math, bf16 storage rounded like the GPU.
    pub fn new() -> Self {
        CpuBackend { round: true, _f: PhantomData }
    }
}

impl Default for CpuBackend<f32> {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend<f64> {
    /// The exact backend for finite differences: f64 everywhere, no rounding.
    pub fn exact() -> Self {
        CpuBackend { round: false, _f: PhantomData }
    }
}

thread_local! {
    static GEMM_FLOPS: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

/// FLOPs (`2 m n k` each) of the GEMMs this thread has run on a CPU backend so far: what
/// `train::flops` is checked against (the CPU backend runs every operation on the calling thread).
pub fn thread_gemm_flops() -> f64 {
    GEMM_FLOPS.with(std::cell::Cell::get)
}

fn dtype_err(op: &'static str, expected: DType, found: DType) -> BackendError {
    BackendError::DType { op, expected: expected.name(), found: found.name() }
}

fn need_dtype<F>(op: &'static str, b: &CpuBuf<F>, dt: DType) -> Result<()> {
    if b.dtype == dt {
        Ok(())
    } else {
        Err(dtype_err(op, dt, b.dtype))
    }
}

/// A dot product with 8 independent accumulators: a fixed order, and fast enough for the
/// reference to train the tiny preset in seconds.
#[inline]
fn dot<F: Real>(a: &[F], b: &[F]) -> F {
    let n = a.len().min(b.len());
    let mut acc = [F::ZERO; 8];
    let chunks = n / 8;
    for c in 0..chunks {
        let o = c * 8;
        for l in 0..8 {
            acc[l] += a[o + l] * b[o + l];
        }
    }
    let mut tail = F::ZERO;
    for i in chunks * 8..n {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// SwiGLU's forward on one (gate, up) pair, `silu(g) * u` with `silu(g) = g / (1 + exp(-g))`: the
/// one formula `swiglu_fwd` and `swiglu_bwd`'s recomputed activation both run (kernels/swiglu.cuh
/// is its CUDA twin), so the two give the same bits.
#[inline]
fn swiglu_act<F: Real>(g: F, u: F) -> F {
    g / (F::ONE + (-g).exp()) * u
}

impl<F: Real> CpuBackend<F> {
    /// Rounds a value for storage in a buffer of `dt`.
    #[inline]
    fn st(&self, dt: DType, v: F) -> F {
        if !self.round {
            return v;
        }
        match dt {
            DType::BF16 => F::from_f32(round_bf16(v.to_f32())),
            DType::F32 => F::from_f32(v.to_f32()),
        }
    }

    fn rope_inv_freq(head_dim: usize, theta: f32) -> Vec<f32> {
        // As Hugging Face computes it: 1 / theta^(2i / d) in f32.
        (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect()
    }
}

/// `len` copies of `value`, or an error naming the size where the host cannot provide it (an
/// infallible `vec!` would abort the process instead).
fn host_vec<F: Real>(value: F, len: usize, dtype: DType) -> Result<Vec<F>> {
    let elem_bytes = std::mem::size_of::<F>();
    let oom = || BackendError::HostOutOfMemory {
        context: format!("alloc of {len} {} elements on the cpu", dtype.name()),
        requested: len.saturating_mul(elem_bytes),
        elem_bytes,
    };
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| oom())?;
    v.resize(len, value);
    Ok(v)
}

impl<F: Real> Backend for CpuBackend<F> {
    type Buf = CpuBuf<F>;
    type Ids = Vec<i32>;
    type Stream = CpuStream;

    fn name(&self) -> String {
        if self.round {
            format!("cpu ({} threads)", rayon::current_num_threads())
        } else {
            "cpu-exact (f64)".into()
        }
    }

    fn compute_stream(&self) -> CpuStream {
        CpuStream
    }

    fn memory_is_host(&self) -> bool {
        true
    }

    fn new_stream(&self) -> Result<CpuStream> {
        Ok(CpuStream)
    }

    /// One in-order host: nothing to order.
    fn hand_over(&self, _from: &CpuStream, _to: &CpuStream, _bufs: &[&CpuBuf<F>]) -> Result<()> {
        Ok(())
    }

    fn synchronize(&self, _s: &CpuStream) -> Result<()> {
        Ok(())
    }

    type Event = ();
    type HostMem = CpuHostMem;

    fn record_event(&self, _s: &CpuStream) -> Result<()> {
        Ok(())
    }
    fn wait_event(&self, _s: &CpuStream, _ev: &()) -> Result<()> {
        Ok(())
    }
    fn sync_event(&self, _ev: &()) -> Result<()> {
        Ok(())
    }
    fn record_use(&self, _s: &CpuStream, _bufs: &[&CpuBuf<F>]) -> Result<()> {
        Ok(())
    }
    fn host_mem(&self) -> std::sync::Arc<CpuHostMem> {
        std::sync::Arc::new(CpuHostMem)
    }
    fn copy_to_host(&self, _s: &CpuStream, src: &CpuBuf<F>, dst: &mut Vec<f64>) -> Result<()> {
        check_len("copy_to_host", "slot", dst.len(), 0, src.data.len())?;
        for (d, x) in dst.iter_mut().zip(&src.data) {
            *d = x.to_f64();
        }
        Ok(())
    }
    fn copy_from_host(&self, _s: &CpuStream, src: &Vec<f64>, dst: &mut CpuBuf<F>) -> Result<()> {
        check_len("copy_from_host", "slot", src.len(), 0, dst.data.len())?;
        for (d, &x) in dst.data.iter_mut().zip(src.iter()) {
            *d = F::from_f64(x);
        }
        Ok(())
    }
    fn copy_from_peer(&self, _s: &CpuStream, _src_be: &Self, src: &CpuBuf<F>, dst: &mut CpuBuf<F>) -> Result<()> {
        check_len("copy_from_peer", "dst", dst.data.len(), 0, src.data.len())?;
        dst.data[..src.data.len()].copy_from_slice(&src.data);
        Ok(())
    }
    fn is_peer(&self, _other: &Self) -> bool {
        true
    }

    type Comm = CpuComm;

    fn comm_group(group: &[&Self]) -> Result<Vec<CpuComm>> {
        let shared = std::sync::Arc::new(CpuGroup {
            n: group.len(),
            state: std::sync::Mutex::new(GroupState::default()),
            cv: std::sync::Condvar::new(),
        });
        Ok((0..group.len()).map(|rank| CpuComm { rank, group: shared.clone() }).collect())
    }

    fn all_reduce_sum(&self, _s: &CpuStream, comm: &CpuComm, buf: &mut CpuBuf<F>) -> Result<()> {
        let mine: Vec<f64> = buf.data.iter().map(|x| x.to_f64()).collect();
        let sum = comm.group.reduce(comm.rank, mine)?;
        check_len("all_reduce_sum", "buf", buf.data.len(), 0, sum.len())?;
        let dt = buf.dtype;
        for (d, &x) in buf.data.iter_mut().zip(sum.iter()) {
            *d = self.st(dt, F::from_f64(x));
        }
        Ok(())
    }

    fn comm_abort(&self, comm: &CpuComm) {
        comm.group.abort();
    }

    fn alloc(&self, _s: &CpuStream, dtype: DType, len: usize) -> Result<CpuBuf<F>> {
        Ok(CpuBuf { dtype, data: host_vec(F::ZERO, len, dtype)? })
    }

    fn alloc_uninit(&self, _s: &CpuStream, dtype: DType, len: usize) -> Result<CpuBuf<F>> {
        Ok(CpuBuf { dtype, data: host_vec(F::NAN, len, dtype)? })
    }

    fn alloc_ids(&self, _s: &CpuStream, len: usize) -> Result<Vec<i32>> {
        Ok(vec![0; len])
    }

    fn len(&self, b: &CpuBuf<F>) -> usize {
        b.data.len()
    }

    fn dtype(&self, b: &CpuBuf<F>) -> DType {
        b.dtype
    }

    fn upload(&self, _s: &CpuStream, host: &[f32], dst: &mut CpuBuf<F>, off: usize) -> Result<()> {
        check_len("upload", "dst", dst.data.len(), off, host.len())?;
        let dt = dst.dtype;
        for (d, &h) in dst.data[off..off + host.len()].iter_mut().zip(host) {
            *d = self.st(dt, F::from_f32(h));
        }
        Ok(())
    }

    fn upload_ids(&self, _s: &CpuStream, host: &[i32], dst: &mut Vec<i32>) -> Result<()> {
        check_len("upload_ids", "dst", dst.len(), 0, host.len())?;
        dst[..host.len()].copy_from_slice(host);
        Ok(())
    }

    fn download(&self, _s: &CpuStream, src: &CpuBuf<F>) -> Result<Vec<f32>> {
        Ok(src.data.iter().map(|x| x.to_f32()).collect())
    }

    fn download_ids(&self, _s: &CpuStream, src: &Vec<i32>) -> Result<Vec<i32>> {
        Ok(src.clone())
    }

    type Readback = crate::backend::ReadValues;

    fn read_async(&self, s: &CpuStream, bufs: &[&CpuBuf<F>], ids: &[&Vec<i32>]) -> Result<Self::Readback> {
        let f = bufs.iter().map(|b| self.download(s, b)).collect::<Result<Vec<_>>>()?;
        Ok((f, ids.iter().map(|i| i.to_vec()).collect()))
    }

    fn read_wait(&self, r: Self::Readback) -> Result<crate::backend::ReadValues> {
        Ok(r)
    }

    fn copy(
        &self,
        _s: &CpuStream,
        src: &CpuBuf<F>,
        src_off: usize,
        dst: &mut CpuBuf<F>,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        check_len("copy", "src", src.data.len(), src_off, n)?;
        check_len("copy", "dst", dst.data.len(), dst_off, n)?;
        let dt = dst.dtype;
        for i in 0..n {
            dst.data[dst_off + i] = self.st(dt, src.data[src_off + i]);
        }
        Ok(())
    }

    fn fill(&self, _s: &CpuStream, dst: &mut CpuBuf<F>, value: f32) -> Result<()> {
        let v = self.st(dst.dtype, F::from_f32(value));
        dst.data.iter_mut().for_each(|x| *x = v);
        Ok(())
    }

    fn gemm(
        &self,
        _s: &CpuStream,
        g: &Gemm,
        a: &CpuBuf<F>,
        a_off: usize,
        b: &CpuBuf<F>,
        b_off: usize,
        c: &mut CpuBuf<F>,
        c_off: usize,
    ) -> Result<()> {
        let (m, n, k) = (g.m, g.n, g.k);
        GEMM_FLOPS.with(|f| f.set(f.get() + 2.0 * (m * n * k) as f64));
        check_len("gemm", "A", a.data.len(), a_off, m * k)?;
        check_len("gemm", "B", b.data.len(), b_off, k * n)?;
        check_len("gemm", "C", c.data.len(), c_off, m * n)?;
        let a = &a.data[a_off..a_off + m * k];
        let b = &b.data[b_off..b_off + k * n];
        // A as rows of k; B as k rows of n, so each output row is a sum of scaled B rows (an axpy
        // over contiguous memory that the compiler vectorises), accumulated over p in order.
        let at: Vec<F>;
        let a_rows: &[F] = if g.ta {
            at = transpose(a, k, m);
            &at
        } else {
            a
        };
        let bt: Vec<F>;
        let b_kn: &[F] = if g.tb {
            bt = transpose(b, n, k);
            &bt
        } else {
            b
        };
        let (alpha, beta) = (F::from_f32(g.alpha), F::from_f32(g.beta));
        let dt = c.dtype;
        let cs = &mut c.data[c_off..c_off + m * n];
        cs.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, crow)| {
            let ar = &a_rows[i * k..(i + 1) * k];
            let mut acc = vec![F::ZERO; n];
            for (p, &av) in ar.iter().enumerate() {
                let br = &b_kn[p * n..(p + 1) * n];
                for (x, &bv) in acc.iter_mut().zip(br) {
                    *x += av * bv;
                }
            }
            for (cv, &x) in crow.iter_mut().zip(&acc) {
                let prev = if g.beta == 0.0 { F::ZERO } else { beta * *cv };
                *cv = self.st(dt, alpha * x + prev);
            }
        });
        Ok(())
    }

    fn rmsnorm_fwd(
        &self,
        _s: &CpuStream,
        x: &CpuBuf<F>,
        w: &CpuBuf<F>,
        w_off: usize,
        y: &mut CpuBuf<F>,
        rstd: &mut CpuBuf<F>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        check_len("rmsnorm_fwd", "x", x.data.len(), 0, rows * dim)?;
        check_len("rmsnorm_fwd", "w", w.data.len(), w_off, dim)?;
        check_len("rmsnorm_fwd", "y", y.data.len(), 0, rows * dim)?;
        check_len("rmsnorm_fwd", "rstd", rstd.data.len(), 0, rows)?;
        need_dtype("rmsnorm_fwd", rstd, DType::F32)?;
        let w = &w.data[w_off..w_off + dim];
        let (ydt, rdt) = (y.dtype, rstd.dtype);
        let eps = F::from_f32(eps);
        y.data[..rows * dim].par_chunks_mut(dim).zip(rstd.data[..rows].par_iter_mut()).enumerate().for_each(
            |(r, (yr, rs))| {
                let xr = &x.data[r * dim..(r + 1) * dim];
                let ms = dot(xr, xr) / F::from_f64(dim as f64);
                let inv = self.st(rdt, F::ONE / (ms + eps).sqrt());
                *rs = inv;
                for c in 0..dim {
                    yr[c] = self.st(ydt, xr[c] * inv * w[c]);
                }
            },
        );
        Ok(())
    }

    fn rmsnorm_bwd(
        &self,
        _s: &CpuStream,
        dy: &CpuBuf<F>,
        x: &CpuBuf<F>,
        w: &CpuBuf<F>,
        w_off: usize,
        rstd: &CpuBuf<F>,
        dx: &mut CpuBuf<F>,
        accumulate_dx: bool,
        dw: &mut CpuBuf<F>,
        dw_off: usize,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        for (name, len) in [("dy", dy.data.len()), ("x", x.data.len()), ("dx", dx.data.len())] {
            check_len("rmsnorm_bwd", name, len, 0, rows * dim)?;
        }
        check_len("rmsnorm_bwd", "w", w.data.len(), w_off, dim)?;
        check_len("rmsnorm_bwd", "dw", dw.data.len(), dw_off, dim)?;
        check_len("rmsnorm_bwd", "rstd", rstd.data.len(), 0, rows)?;
        need_dtype("rmsnorm_bwd", dw, DType::F32)?;
        let w = &w.data[w_off..w_off + dim];
        let dt = dx.dtype;
        let inv_dim = F::ONE / F::from_f64(dim as f64);
        dx.data[..rows * dim].par_chunks_mut(dim).enumerate().for_each(|(r, dxr)| {
            let xr = &x.data[r * dim..(r + 1) * dim];
            let dyr = &dy.data[r * dim..(r + 1) * dim];
            let inv = rstd.data[r];
            let mut gx = F::ZERO;
            for c in 0..dim {
                gx += dyr[c] * w[c] * xr[c];
            }
            let coef = gx * inv * inv * inv * inv_dim;
            for c in 0..dim {
                let g = inv * dyr[c] * w[c] - xr[c] * coef;
                dxr[c] = self.st(dt, if accumulate_dx { dxr[c] + g } else { g });
            }
        });
        // dw: column sums over rows, one column per task, rows in order.
        let dws = &mut dw.data[dw_off..dw_off + dim];
        dws.par_iter_mut().enumerate().for_each(|(c, dwc)| {
            let mut acc = F::ZERO;
            for r in 0..rows {
                acc += dy.data[r * dim + c] * x.data[r * dim + c] * rstd.data[r];
            }
            *dwc = self.st(DType::F32, *dwc + acc);
        });
        Ok(())
    }

    fn rope(
        &self,
        _s: &CpuStream,
        x: &mut CpuBuf<F>,
        pos: &Vec<i32>,
        rows: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
        inverse: bool,
    ) -> Result<()> {
        let width = heads * head_dim;
        check_len("rope", "x", x.data.len(), 0, rows * width)?;
        check_len("rope", "pos", pos.len(), 0, rows)?;
        if head_dim % 2 != 0 {
            return Err(BackendError::Shape { op: "rope", what: format!("head_dim {head_dim} is odd") });
        }
        let inv_freq = Self::rope_inv_freq(head_dim, theta);
        let half = head_dim / 2;
        let dt = x.dtype;
        x.data[..rows * width].par_chunks_mut(width).enumerate().for_each(|(r, xr)| {
            let p = pos[r] as f32;
            for i in 0..half {
                let ang = p * inv_freq[i];
                let (c, mut sn) = (F::from_f32(ang.cos()), F::from_f32(ang.sin()));
                if inverse {
                    sn = -sn;
                }
                for h in 0..heads {
                    let o = h * head_dim;
                    let (a, b) = (xr[o + i], xr[o + i + half]);
                    xr[o + i] = self.st(dt, a * c - b * sn);
                    xr[o + i + half] = self.st(dt, b * c + a * sn);
                }
            }
        });
        Ok(())
    }

    fn swiglu_fwd(&self, _s: &CpuStream, gu: &CpuBuf<F>, out: &mut CpuBuf<F>, rows: usize, inter: usize) -> Result<()> {
        check_len("swiglu_fwd", "gu", gu.data.len(), 0, rows * 2 * inter)?;
        check_len("swiglu_fwd", "out", out.data.len(), 0, rows * inter)?;
        let dt = out.dtype;
        out.data[..rows * inter].par_chunks_mut(inter).enumerate().for_each(|(r, or)| {
            let row = &gu.data[r * 2 * inter..(r + 1) * 2 * inter];
            for c in 0..inter {
                or[c] = self.st(dt, swiglu_act(row[c], row[inter + c]));
            }
        });
        Ok(())
    }

    fn swiglu_bwd(
        &self,
        _s: &CpuStream,
        dact: &mut CpuBuf<F>,
        gu: &mut CpuBuf<F>,
        rows: usize,
        inter: usize,
    ) -> Result<()> {
        check_len("swiglu_bwd", "dact", dact.data.len(), 0, rows * inter)?;
        check_len("swiglu_bwd", "gu", gu.data.len(), 0, rows * 2 * inter)?;
        let (dt, at) = (gu.dtype, dact.dtype);
        let gu_rows = gu.data[..rows * 2 * inter].par_chunks_mut(2 * inter);
        gu_rows.zip(dact.data[..rows * inter].par_chunks_mut(inter)).for_each(|(dr, ar)| {
            for c in 0..inter {
                let (g, u, d) = (dr[c], dr[inter + c], ar[c]);
                let sig = F::ONE / (F::ONE + (-g).exp());
                let silu = g * sig;
                dr[c] = self.st(dt, d * u * sig * (F::ONE + g * (F::ONE - sig)));
                dr[inter + c] = self.st(dt, d * silu);
                ar[c] = self.st(at, swiglu_act(g, u));
            }
        });
        Ok(())
    }

    fn embed(
        &self,
        _s: &CpuStream,
        table: &CpuBuf<F>,
        off: usize,
        ids: &Vec<i32>,
        out: &mut CpuBuf<F>,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        check_len("embed", "ids", ids.len(), 0, rows)?;
        check_len("embed", "out", out.data.len(), 0, rows * dim)?;
        let dt = out.dtype;
        for r in 0..rows {
            let id = usize::try_from(ids[r])
                .map_err(|_| BackendError::Shape { op: "embed", what: format!("negative id {} at row {r}", ids[r]) })?;
            check_len("embed", "table", table.data.len(), off + id * dim, dim)?;
            for c in 0..dim {
                out.data[r * dim + c] = self.st(dt, table.data[off + id * dim + c]);
            }
        }
        Ok(())
    }

    fn pack_taps(
        &self,
        _s: &CpuStream,
        taps: &[&CpuBuf<F>],
        out: &mut CpuBuf<F>,
        rows: usize,
        hidden: usize,
        n_valid: usize,
        noise_std: f32,
        seed: u64,
        step: u32,
    ) -> Result<()> {
        let nt = taps.len();
        let width = nt * hidden;
        check_len("pack_taps", "out", out.data.len(), 0, rows * width)?;
        for (k, t) in taps.iter().enumerate() {
            check_len("pack_taps", &format!("tap {k}"), t.data.len(), 0, rows * hidden)?;
        }
        let dt = out.dtype;
        out.data[..rows * width].par_chunks_mut(width).enumerate().for_each(|(t, orow)| {
            for k in 0..nt {
                for c in 0..hidden {
                    let j = k * hidden + c;
                    orow[j] = if t >= n_valid {
                        F::ZERO
                    } else if noise_std == 0.0 {
                        taps[k].data[t * hidden + c]
                    } else {
                        // f32 add of the f32 noise value, one rounding to bf16: as the kernel does.
                        let idx = (t * width + j) as u64;
                        let x = taps[k].data[t * hidden + c].to_f32() + rng::noise_at(seed, step, idx, noise_std);
                        self.st(dt, F::from_f32(x))
                    };
                }
            }
        });
        Ok(())
    }

    fn attn_causal_fwd(
        &self,
        _s: &CpuStream,
        q: &CpuBuf<F>,
        k: &CpuBuf<F>,
        v: &CpuBuf<F>,
        o: &mut CpuBuf<F>,
        seq_starts: &Vec<i32>,
        rows: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let (qw, kw) = (heads * head_dim, kv_heads * head_dim);
        check_causal_attn(q.data.len(), k.data.len(), v.data.len(), o.data.len(), rows, heads, kv_heads, head_dim)?;
        // Row -> start of its sequence.
        let mut start_of = vec![0usize; rows];
        for w in seq_starts.windows(2) {
            let (a, b) = (w[0] as usize, (w[1] as usize).min(rows));
            for r in a..b {
                start_of[r] = a;
            }
        }
        let group = heads / kv_heads;
        let scale = F::from_f64(1.0 / (head_dim as f64).sqrt());
        let dt = o.dtype;
        o.data[..rows * qw].par_chunks_mut(qw).enumerate().for_each(|(i, orow)| {
            let s0 = start_of[i];
            let mut sc = vec![F::ZERO; i + 1 - s0];
            for h in 0..heads {
                let g = h / group;
                let qh = &q.data[i * qw + h * head_dim..][..head_dim];
                let mut mx = F::from_f64(f64::NEG_INFINITY);
                for (t, s) in sc.iter_mut().enumerate() {
                    *s = scale * dot(qh, &k.data[(s0 + t) * kw + g * head_dim..][..head_dim]);
                    if *s > mx {
                        mx = *s;
                    }
                }
                let mut sum = F::ZERO;
                for s in sc.iter_mut() {
                    *s = (*s - mx).exp();
                    sum += *s;
                }
                let oh = &mut orow[h * head_dim..(h + 1) * head_dim];
                for c in 0..head_dim {
                    let mut acc = F::ZERO;
                    for (t, &p) in sc.iter().enumerate() {
                        acc += p * v.data[(s0 + t) * kw + g * head_dim + c];
                    }
                    oh[c] = self.st(dt, acc / sum);
                }
            }
        });
        Ok(())
    }

    fn attn_draft_fwd(
        &self,
        _s: &CpuStream,
        sh: &DraftAttnShape,
        q: &CpuBuf<F>,
        kc: &CpuBuf<F>,
        vc: &CpuBuf<F>,
        kb: &CpuBuf<F>,
        vb: &CpuBuf<F>,
        anchors: &Vec<i32>,
        ctx_start: &Vec<i32>,
        o: &mut CpuBuf<F>,
        lse: &mut CpuBuf<F>,
    ) -> Result<()> {
        let g = DraftGeom::new("attn_draft_fwd", sh, q, kc, vc, kb, vb, anchors, ctx_start)?;
        check_len("attn_draft_fwd", "o", o.data.len(), 0, sh.q_rows() * g.qw)?;
        check_len("attn_draft_fwd", "lse", lse.data.len(), 0, sh.q_rows() * sh.heads)?;
        need_dtype("attn_draft_fwd", lse, DType::F32)?;
        let (odt, ldt) = (o.dtype, lse.dtype);
        let bs = sh.block_size;
        let scale = F::from_f64(g.scale);
        o.data[..sh.q_rows() * g.qw]
            .par_chunks_mut(bs * g.qw)
            .zip(lse.data[..sh.q_rows() * sh.heads].par_chunks_mut(bs * sh.heads))
            .enumerate()
            .for_each(|(j, (oblk, lblk))| {
                for r in 0..bs {
                    let keys = g.keys(j, r, sh);
                    let row = j * bs + r;
                    for h in 0..sh.heads {
                        let oh = &mut oblk[r * g.qw + h * sh.head_dim..][..sh.head_dim];
                        if keys.is_empty() {
                            // Padded block: it attends to nothing, and says so with exact zeros.
                            oh.iter_mut().for_each(|x| *x = F::ZERO);
                            lblk[r * sh.heads + h] = F::ZERO;
                            continue;
                        }
                        let qh = &q.data[row * g.qw + h * sh.head_dim..][..sh.head_dim];
                        let kvh = h / g.group;
                        let sc: Vec<F> = keys.iter().map(|&key| scale * dot(qh, g.k(key, kvh, kc, kb))).collect();
                        let mx = sc.iter().copied().fold(sc[0], |a, b| if b > a { b } else { a });
                        let p: Vec<F> = sc.iter().map(|&s| (s - mx).exp()).collect();
                        let sum = p.iter().fold(F::ZERO, |a, &b| a + b);
                        for c in 0..sh.head_dim {
                            let mut acc = F::ZERO;
                            for (t, &key) in keys.iter().enumerate() {
                                acc += p[t] * g.v(key, kvh, vc, vb)[c];
                            }
                            oh[c] = self.st(odt, acc / sum);
                        }
                        lblk[r * sh.heads + h] = self.st(ldt, mx + sum.ln());
                    }
                }
            });
        Ok(())
    }

    fn qk_norm_rope(
        &self,
        _s: &CpuStream,
        sh: &QkNormRope,
        q_in: &CpuBuf<F>,
        k_in: &CpuBuf<F>,
        w: &CpuBuf<F>,
        q_out: &mut CpuBuf<F>,
        k_out: &mut CpuBuf<F>,
        pos: &Vec<i32>,
        rstd: Option<QkRstd<'_, CpuBuf<F>>>,
    ) -> Result<()> {
        const OP: &str = "qk_norm_rope";
        let hd = sh.head_dim;
        if hd % 2 != 0 || hd == 0 {
            return Err(BackendError::Shape { op: OP, what: format!("head_dim {hd} is odd") });
        }
        if sh.rows == 0 {
            return Ok(());
        }
        let last = |r: Rows| r.off + (sh.rows - 1) * r.stride;
        check_len(OP, "q_in", q_in.data.len(), last(sh.q_in), sh.heads * hd)?;
        check_len(OP, "k_in", k_in.data.len(), last(sh.k_in), sh.kv_heads * hd)?;
        check_len(OP, "q_out", q_out.data.len(), last(sh.q_out), sh.heads * hd)?;
        check_len(OP, "k_out", k_out.data.len(), last(sh.k_out), sh.kv_heads * hd)?;
        check_len(OP, "w", w.data.len(), sh.wq_off.max(sh.wk_off), hd)?;
        check_len(OP, "pos", pos.len(), 0, sh.rows)?;
        let (mut q_rstd, mut k_rstd) = match rstd {
            Some(QkRstd { q, k }) => (q, k),
            None => (None, None),
        };
        for (n, b, heads) in [("q rstd", &q_rstd, sh.heads), ("k rstd", &k_rstd, sh.kv_heads)] {
            if let Some(b) = b {
                check_len(OP, n, b.data.len(), 0, sh.rows * heads)?;
                need_dtype(OP, b, DType::F32)?;
            }
        }
        let inv_freq = Self::rope_inv_freq(hd, sh.theta);
        let (half, eps) = (hd / 2, F::from_f32(sh.eps));
        // As rmsnorm_fwd then rope: the normalised head rounded to the output's dtype, then
        // rotated and rounded again. Returns the head's rstd.
        let one = |x: &[F], wt: &[F], p: i32, dt: DType, out: &mut [F]| {
            let ms = dot(x, x) / F::from_f64(hd as f64);
            let inv = self.st(DType::F32, F::ONE / (ms + eps).sqrt());
            let y: Vec<F> = (0..hd).map(|c| self.st(dt, x[c] * inv * wt[c])).collect();
            let p = p as f32;
            for i in 0..half {
                let ang = p * inv_freq[i];
                let (c, sn) = (F::from_f32(ang.cos()), F::from_f32(ang.sin()));
                let (a, b) = (y[i], y[i + half]);
                out[i] = self.st(dt, a * c - b * sn);
                out[i + half] = self.st(dt, b * c + a * sn);
            }
            inv
        };
        let (wq, wk) = (&w.data[sh.wq_off..sh.wq_off + hd], &w.data[sh.wk_off..sh.wk_off + hd]);
        for (r, &p) in pos[..sh.rows].iter().enumerate() {
            for (heads, inp, rin, out, rout, wt, keep) in [
                (sh.heads, q_in, sh.q_in, &mut *q_out, sh.q_out, wq, &mut q_rstd),
                (sh.kv_heads, k_in, sh.k_in, &mut *k_out, sh.k_out, wk, &mut k_rstd),
            ] {
                let dt = out.dtype;
                for h in 0..heads {
                    let x = &inp.data[rin.off + r * rin.stride + h * hd..][..hd];
                    let mut o = vec![F::ZERO; hd];
                    let inv = one(x, wt, p, dt, &mut o);
                    out.data[rout.off + r * rout.stride + h * hd..][..hd].copy_from_slice(&o);
                    if let Some(b) = keep.as_deref_mut() {
                        b.data[r * heads + h] = inv;
                    }
                }
            }
        }
        Ok(())
    }

    fn attn_decode(
        &self,
        _s: &CpuStream,
        sh: &DecodeAttnShape,
        q: &CpuBuf<F>,
        kc: &CpuBuf<F>,
        vc: &CpuBuf<F>,
        o: &mut CpuBuf<F>,
        lse: &mut CpuBuf<F>,
    ) -> Result<()> {
        const OP: &str = "attn_decode";
        let (hd, heads) = (sh.head_dim, sh.heads);
        if sh.kv_heads == 0 || heads % sh.kv_heads != 0 || sh.len0 == 0 {
            return Err(BackendError::Shape {
                op: OP,
                what: format!("{heads} heads over {} kv heads, {} keys in the first row", sh.kv_heads, sh.len0),
            });
        }
        let (qw, kw, group) = (heads * hd, sh.kv_heads * hd, heads / sh.kv_heads);
        check_len(OP, "q", q.data.len(), 0, sh.rows * qw)?;
        check_len(OP, "o", o.data.len(), 0, sh.rows * qw)?;
        check_len(OP, "lse", lse.data.len(), 0, sh.rows * heads)?;
        check_len(OP, "kc", kc.data.len(), 0, sh.cache_rows() * kw)?;
        check_len(OP, "vc", vc.data.len(), 0, sh.cache_rows() * kw)?;
        need_dtype(OP, lse, DType::F32)?;
        let (odt, ldt) = (o.dtype, lse.dtype);
        let scale = F::from_f64(1.0 / (hd as f64).sqrt());
        o.data[..sh.rows * qw]
            .par_chunks_mut(qw)
            .zip(lse.data[..sh.rows * heads].par_chunks_mut(heads))
            .enumerate()
            .for_each(|(r, (orow, lrow))| {
                let base = r * sh.row_stride;
                for h in 0..heads {
                    let qh = &q.data[r * qw + h * hd..][..hd];
                    let col = (h / group) * hd;
                    let sc: Vec<F> =
                        (0..sh.len(r)).map(|t| scale * dot(qh, &kc.data[(base + t) * kw + col..][..hd])).collect();
                    let mx = sc.iter().copied().fold(sc[0], |a, b| if b > a { b } else { a });
                    let p: Vec<F> = sc.iter().map(|&x| (x - mx).exp()).collect();
                    let sum = p.iter().fold(F::ZERO, |a, &b| a + b);
                    for c in 0..hd {
                        let mut acc = F::ZERO;
                        for (t, &pt) in p.iter().enumerate() {
                            acc += pt * vc.data[(base + t) * kw + col + c];
                        }
                        orow[h * hd + c] = self.st(odt, acc / sum);
                    }
                    lrow[h] = self.st(ldt, mx + sum.ln());
                }
            });
        Ok(())
    }

    fn attn_draft_bwd(
        &self,
        _s: &CpuStream,
        sh: &DraftAttnShape,
        q: &CpuBuf<F>,
        kc: &CpuBuf<F>,
        vc: &CpuBuf<F>,
        kb: &CpuBuf<F>,
        vb: &CpuBuf<F>,
        anchors: &Vec<i32>,
        ctx_start: &Vec<i32>,
        o: &CpuBuf<F>,
        lse: &CpuBuf<F>,
        d_o: &CpuBuf<F>,
        grads: [&mut CpuBuf<F>; 5],
    ) -> Result<()> {
        let g = DraftGeom::new("attn_draft_bwd", sh, q, kc, vc, kb, vb, anchors, ctx_start)?;
        let [dq, dkc, dvc, dkb, dvb] = grads;
        let qn = sh.q_rows() * g.qw;
        for (name, len) in [("o", o.data.len()), ("d_o", d_o.data.len()), ("dq", dq.data.len())] {
            check_len("attn_draft_bwd", name, len, 0, qn)?;
        }
        check_len("attn_draft_bwd", "dkc", dkc.data.len(), 0, sh.ctx_rows * g.kw)?;
        check_len("attn_draft_bwd", "dvc", dvc.data.len(), 0, sh.ctx_rows * g.kw)?;
        check_len("attn_draft_bwd", "dkb", dkb.data.len(), 0, sh.q_rows() * g.kw)?;
        check_len("attn_draft_bwd", "dvb", dvb.data.len(), 0, sh.q_rows() * g.kw)?;
        let (bs, hd, heads) = (sh.block_size, sh.head_dim, sh.heads);
        let scale = F::from_f64(g.scale);
        // D = rowsum(dO * O) per (row, head).
        let dsum: Vec<F> = (0..sh.q_rows() * heads)
            .map(|i| dot(&d_o.data[i * hd..(i + 1) * hd], &o.data[i * hd..(i + 1) * hd]))
            .collect();
        // p and ds of query (row, head) against one key; accumulated in F, rounded once per
        // output element, like the kernels.
        let p_ds = |row: usize, h: usize, key: Key| -> (F, F) {
            let kvh = h / g.group;
            let qh = &q.data[row * g.qw + h * hd..][..hd];
            let doh = &d_o.data[row * g.qw + h * hd..][..hd];
            let p = (scale * dot(qh, g.k(key, kvh, kc, kb)) - lse.data[row * heads + h]).exp();
            (p, p * (dot(doh, g.v(key, kvh, vc, vb)) - dsum[row * heads + h]) * scale)
        };
        // Pass 1, one task per block: dq over every visible key; dk/dv of the block's own keys.
        let (dqt, dkbt, dvbt) = (dq.dtype, dkb.dtype, dvb.dtype);
        dq.data[..qn]
            .par_chunks_mut(bs * g.qw)
            .zip(dkb.data[..sh.q_rows() * g.kw].par_chunks_mut(bs * g.kw))
            .zip(dvb.data[..sh.q_rows() * g.kw].par_chunks_mut(bs * g.kw))
            .enumerate()
            .for_each(|(j, ((dqj, dkj), dvj))| {
                let mut acc_q = vec![F::ZERO; bs * g.qw];
                let mut acc_k = vec![F::ZERO; bs * g.kw];
                let mut acc_v = vec![F::ZERO; bs * g.kw];
                for r in 0..bs {
                    let keys = g.keys(j, r, sh);
                    let row = j * bs + r;
                    for h in 0..heads {
                        let kvh = h / g.group;
                        for &key in &keys {
                            let (p, ds) = p_ds(row, h, key);
                            let kk = g.k(key, kvh, kc, kb);
                            for c in 0..hd {
                                acc_q[r * g.qw + h * hd + c] += ds * kk[c];
                            }
                            if let Key::Blk(t) = key {
                                let lo = (t - j * bs) * g.kw + kvh * hd;
                                let qh = &q.data[row * g.qw + h * hd..][..hd];
                                let doh = &d_o.data[row * g.qw + h * hd..][..hd];
                                for c in 0..hd {
                                    acc_k[lo + c] += ds * qh[c];
                                    acc_v[lo + c] += p * doh[c];
                                }
                            }
                        }
                    }
                }
                dqj.iter_mut().zip(&acc_q).for_each(|(d, &x)| *d = self.st(dqt, x));
                dkj.iter_mut().zip(&acc_k).for_each(|(d, &x)| *d = self.st(dkbt, x));
                dvj.iter_mut().zip(&acc_v).for_each(|(d, &x)| *d = self.st(dvbt, x));
            });
        // Pass 2, one task per context row: the blocks that see it, in block order.
        let (dkct, dvct) = (dkc.dtype, dvc.dtype);
        dkc.data[..sh.ctx_rows * g.kw]
            .par_chunks_mut(g.kw)
            .zip(dvc.data[..sh.ctx_rows * g.kw].par_chunks_mut(g.kw))
            .enumerate()
            .for_each(|(t, (dkt, dvt))| {
                let mut acc_k = vec![F::ZERO; g.kw];
                let mut acc_v = vec![F::ZERO; g.kw];
                for j in 0..sh.num_blocks {
                    let (a, start) = (g.anchors[j], g.ctx_start[j] as usize);
                    if a < 0 || t < start || t >= start + a as usize {
                        continue;
                    }
                    for r in 0..bs {
                        // A sliding layer's slot r sees only the last W - 1 - r context rows.
                        if t < start + sh.ctx_lo(a as usize, r) {
                            continue;
                        }
                        let row = j * bs + r;
                        for h in 0..heads {
                            let kvh = h / g.group;
                            let (p, ds) = p_ds(row, h, Key::Ctx(t));
                            let qh = &q.data[row * g.qw + h * hd..][..hd];
                            let doh = &d_o.data[row * g.qw + h * hd..][..hd];
                            for c in 0..hd {
                                acc_k[kvh * hd + c] += ds * qh[c];
                                acc_v[kvh * hd + c] += p * doh[c];
                            }
                        }
                    }
                }
                dkt.iter_mut().zip(&acc_k).for_each(|(d, &x)| *d = self.st(dkct, x));
                dvt.iter_mut().zip(&acc_v).for_each(|(d, &x)| *d = self.st(dvct, x));
            });
        Ok(())
    }

    fn cross_entropy(
        &self,
        _s: &CpuStream,
        logits: &mut CpuBuf<F>,
        labels: &Vec<i32>,
        weights: &CpuBuf<F>,
        w_off: usize,
        rows: usize,
        vocab: usize,
        grad_scale: f32,
        loss: &mut CpuBuf<F>,
        loss_off: usize,
        argmax: &mut Vec<i32>,
        argmax_off: usize,
    ) -> Result<()> {
        check_len("cross_entropy", "logits", logits.data.len(), 0, rows * vocab)?;
        check_len("cross_entropy", "labels", labels.len(), w_off, rows)?;
        check_len("cross_entropy", "weights", weights.data.len(), w_off, rows)?;
        check_len("cross_entropy", "loss", loss.data.len(), loss_off, rows)?;
        check_len("cross_entropy", "argmax", argmax.len(), argmax_off, rows)?;
        let (ldt, gdt) = (loss.dtype, logits.dtype);
        let gs = F::from_f32(grad_scale);
        let loss_out = &mut loss.data[loss_off..loss_off + rows];
        let am_out = &mut argmax[argmax_off..argmax_off + rows];
        logits.data[..rows * vocab]
            .par_chunks_mut(vocab)
            .zip(loss_out.par_iter_mut())
            .zip(am_out.par_iter_mut())
            .enumerate()
            .for_each(|(r, ((lr, lo), am))| {
                let w = weights.data[w_off + r];
                let label = labels[w_off + r];
                let mut mx = lr[0];
                let mut arg = 0usize;
                for (c, &x) in lr.iter().enumerate() {
                    if x > mx {
                        mx = x;
                        arg = c;
                    }
                }
                *am = arg as i32;
                let sum = lr.iter().fold(F::ZERO, |a, &x| a + (x - mx).exp());
                let lse = mx + sum.ln();
                let supervised = w != F::ZERO && label >= 0 && (label as usize) < vocab;
                if supervised {
                    *lo = self.st(ldt, w * (lse - lr[label as usize]));
                    let coef = gs * w;
                    for (c, x) in lr.iter_mut().enumerate() {
                        let p = (*x - lse).exp();
                        let onehot = if c == label as usize { F::ONE } else { F::ZERO };
                        *x = self.st(gdt, coef * (p - onehot));
                    }
                } else {
                    *lo = F::ZERO;
                    lr.iter_mut().for_each(|x| *x = F::ZERO);
                }
            });
        Ok(())
    }

    fn argmax_rows(
        &self,
        _s: &CpuStream,
        x: &CpuBuf<F>,
        stride: usize,
        rows: usize,
        cols: usize,
        out: &mut Vec<i32>,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        if cols == 0 || cols > stride {
            return Err(BackendError::Shape { op: "argmax_rows", what: format!("{cols} columns in rows of {stride}") });
        }
        check_len("argmax_rows", "x", x.data.len(), (rows - 1) * stride, cols)?;
        check_len("argmax_rows", "out", out.len(), 0, rows)?;
        for (r, o) in out[..rows].iter_mut().enumerate() {
            let row = &x.data[r * stride..r * stride + cols];
            let arg = (0..cols).fold(0, |b, c| if row[c] > row[b] { c } else { b });
            *o = i32::try_from(arg)
                .map_err(|_| BackendError::Shape { op: "argmax_rows", what: format!("index {arg}") })?;
        }
        Ok(())
    }

    fn sum_squares(&self, _s: &CpuStream, x: &CpuBuf<F>, out: &mut CpuBuf<F>) -> Result<()> {
        check_len("sum_squares", "out", out.data.len(), 0, 1)?;
        // Fixed-size chunks summed in order: the same value for any thread count.
        const CHUNK: usize = 1 << 14;
        let parts: Vec<F> = x.data.par_chunks(CHUNK).map(|c| dot(c, c)).collect();
        let total = parts.iter().fold(F::ZERO, |a, &b| a + b);
        out.data[0] = self.st(out.dtype, total);
        Ok(())
    }

    fn adamw(
        &self,
        _s: &CpuStream,
        master: &mut CpuBuf<F>,
        grad: &CpuBuf<F>,
        m: &mut CpuBuf<F>,
        v: &mut CpuBuf<F>,
        weights: &mut CpuBuf<F>,
        off: usize,
        hp: &AdamStep,
    ) -> Result<()> {
        let n = m.data.len();
        check_len("adamw", "v", v.data.len(), 0, n)?;
        for (name, len) in [("master", master.data.len()), ("grad", grad.data.len()), ("weights", weights.data.len())] {
            check_len("adamw", name, len, off, n)?;
        }
        // Bias corrections in f64 on the host side of the formula, as the kernel receives them.
        let bc1 = F::from_f64(1.0 - f64::from(hp.beta1).powi(hp.t as i32));
        let bc2 = F::from_f64(1.0 - f64::from(hp.beta2).powi(hp.t as i32));
        let (b1, b2) = (F::from_f32(hp.beta1), F::from_f32(hp.beta2));
        let (lr, eps, wd, gs) =
            (F::from_f32(hp.lr), F::from_f32(hp.eps), F::from_f32(hp.weight_decay), F::from_f32(hp.grad_scale));
        let wdt = weights.dtype;
        let r = off..off + n;
        master.data[r.clone()]
            .par_iter_mut()
            .zip(m.data.par_iter_mut())
            .zip(v.data.par_iter_mut())
            .zip(weights.data[r.clone()].par_iter_mut())
            .zip(grad.data[r].par_iter())
            .for_each(|((((p, mm), vv), w), &g)| {
                let g = g * gs;
                *mm = self.st(DType::F32, b1 * *mm + (F::ONE - b1) * g);
                *vv = self.st(DType::F32, b2 * *vv + (F::ONE - b2) * g * g);
                let upd = (*mm / bc1) / ((*vv / bc2).sqrt() + eps) + wd * *p;
                *p = self.st(DType::F32, *p - lr * upd);
                // Masters stay off bf16 ties (tensor::master_off_tie), as on every backend.
                if self.round {
                    *p = F::from_f32(crate::tensor::master_off_tie(p.to_f32()));
                }
                *w = self.st(wdt, *p);
            });
        Ok(())
    }

    fn update_plan(
        &self,
        _s: &CpuStream,
        body_sumsq: &CpuBuf<F>,
        fc_sumsq: &CpuBuf<F>,
        loss: &CpuBuf<F>,
        weighted: bool,
        clip: f32,
        plan: &mut CpuBuf<F>,
    ) -> Result<()> {
        check_len("update_plan", "body_sumsq", body_sumsq.data.len(), 0, 1)?;
        check_len("update_plan", "fc_sumsq", fc_sumsq.data.len(), 0, 1)?;
        check_len("update_plan", "plan", plan.data.len(), 0, 2)?;
        // The host's arithmetic (train::step::global_norm, OptimConfig::clip_scale) on the values
        // as the host would download them (f32).
        let (body, fc) = (f64::from(body_sumsq.data[0].to_f32()), f64::from(fc_sumsq.data[0].to_f32()));
        let norm = (fc + body).sqrt();
        let loss_ok = !weighted || loss.data.iter().all(|x| x.to_f32().is_finite());
        let scale = if clip > 0.0 && norm > f64::from(clip) { (f64::from(clip) / (norm + 1e-6)) as f32 } else { 1.0 };
        plan.data[0] = F::from_f32(scale);
        plan.data[1] = if loss_ok && norm.is_finite() { F::ZERO } else { F::ONE };
        Ok(())
    }

    fn adamw_planned(
        &self,
        s: &CpuStream,
        master: &mut CpuBuf<F>,
        grad: &CpuBuf<F>,
        m: &mut CpuBuf<F>,
        v: &mut CpuBuf<F>,
        weights: &mut CpuBuf<F>,
        off: usize,
        hp: &AdamStep,
        plan: &CpuBuf<F>,
    ) -> Result<()> {
        check_len("adamw_planned", "plan", plan.data.len(), 0, 2)?;
        if plan.data[1] != F::ZERO {
            return Ok(());
        }
        let hp = AdamStep { grad_scale: plan.data[0].to_f32(), ..*hp };
        self.adamw(s, master, grad, m, v, weights, off, &hp)
    }

    fn count_nonfinite(&self, _s: &CpuStream, x: &CpuBuf<F>) -> Result<u64> {
        Ok(x.data.iter().filter(|v| !v.is_finite()).count() as u64)
    }

    fn rmsnorm1p_fwd(
        &self,
        _s: &CpuStream,
        x: &CpuBuf<F>,
        w: &CpuBuf<F>,
        w_off: usize,
        y: &mut CpuBuf<F>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        check_len("rmsnorm1p_fwd", "x", x.data.len(), 0, rows * dim)?;
        check_len("rmsnorm1p_fwd", "w", w.data.len(), w_off, dim)?;
        check_len("rmsnorm1p_fwd", "y", y.data.len(), 0, rows * dim)?;
        let w = &w.data[w_off..w_off + dim];
        let (ydt, eps) = (y.dtype, F::from_f32(eps));
        y.data[..rows * dim].par_chunks_mut(dim).enumerate().for_each(|(r, yr)| {
            let xr = &x.data[r * dim..(r + 1) * dim];
            let inv = F::ONE / (dot(xr, xr) / F::from_f64(dim as f64) + eps).sqrt();
            for c in 0..dim {
                yr[c] = self.st(ydt, xr[c] * inv * (F::ONE + w[c]));
            }
        });
        Ok(())
    }

    fn gated_rmsnorm_fwd(
        &self,
        _s: &CpuStream,
        x: &CpuBuf<F>,
        z: &CpuBuf<F>,
        w: &CpuBuf<F>,
        w_off: usize,
        y: &mut CpuBuf<F>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        check_len("gated_rmsnorm_fwd", "x", x.data.len(), 0, rows * dim)?;
        check_len("gated_rmsnorm_fwd", "z", z.data.len(), 0, rows * dim)?;
        check_len("gated_rmsnorm_fwd", "w", w.data.len(), w_off, dim)?;
        check_len("gated_rmsnorm_fwd", "y", y.data.len(), 0, rows * dim)?;
        let w = &w.data[w_off..w_off + dim];
        let (ydt, eps) = (y.dtype, F::from_f32(eps));
        y.data[..rows * dim].par_chunks_mut(dim).enumerate().for_each(|(r, yr)| {
            let xr = &x.data[r * dim..(r + 1) * dim];
            let zr = &z.data[r * dim..(r + 1) * dim];
            let inv = F::ONE / (dot(xr, xr) / F::from_f64(dim as f64) + eps).sqrt();
            for c in 0..dim {
                yr[c] = self.st(ydt, xr[c] * inv * w[c] * silu(zr[c]));
            }
        });
        Ok(())
    }

    fn rope_partial(
        &self,
        _s: &CpuStream,
        x: &mut CpuBuf<F>,
        pos: &Vec<i32>,
        rows: usize,
        heads: usize,
        head_dim: usize,
        rot_dim: usize,
        theta: f32,
    ) -> Result<()> {
        let width = heads * head_dim;
        check_len("rope_partial", "x", x.data.len(), 0, rows * width)?;
        check_len("rope_partial", "pos", pos.len(), 0, rows)?;
        if rot_dim % 2 != 0 || rot_dim == 0 || rot_dim > head_dim {
            return Err(BackendError::Shape {
                op: "rope_partial",
                what: format!("rot_dim {rot_dim} must be even, positive and at most head_dim {head_dim}"),
            });
        }
        // The inverse frequencies of a rot_dim-wide RoPE, as transformers computes them.
        let inv_freq = Self::rope_inv_freq(rot_dim, theta);
        let half = rot_dim / 2;
        let dt = x.dtype;
        x.data[..rows * width].par_chunks_mut(width).enumerate().for_each(|(r, xr)| {
            let p = pos[r] as f32;
            for i in 0..half {
                let ang = p * inv_freq[i];
                let (c, sn) = (F::from_f32(ang.cos()), F::from_f32(ang.sin()));
                for h in 0..heads {
                    let o = h * head_dim;
                    let (a, b) = (xr[o + i], xr[o + i + half]);
                    xr[o + i] = self.st(dt, a * c - b * sn);
                    xr[o + i + half] = self.st(dt, b * c + a * sn);
                }
            }
        });
        Ok(())
    }

    fn copy_strided(
        &self,
        _s: &CpuStream,
        src: &CpuBuf<F>,
        src_off: usize,
        src_stride: usize,
        dst: &mut CpuBuf<F>,
        dst_off: usize,
        dst_stride: usize,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        check_len("copy_strided", "src", src.data.len(), src_off + (rows - 1) * src_stride, width)?;
        check_len("copy_strided", "dst", dst.data.len(), dst_off + (rows - 1) * dst_stride, width)?;
        let dt = dst.dtype;
        for r in 0..rows {
            let (a, b) = (src_off + r * src_stride, dst_off + r * dst_stride);
            for c in 0..width {
                dst.data[b + c] = self.st(dt, src.data[a + c]);
            }
        }
        Ok(())
    }

    fn sigmoid_mul(&self, _s: &CpuStream, x: &mut CpuBuf<F>, gate: &CpuBuf<F>) -> Result<()> {
        check_len("sigmoid_mul", "gate", gate.data.len(), 0, x.data.len())?;
        let dt = x.dtype;
        x.data.par_iter_mut().zip(gate.data.par_iter()).for_each(|(v, &g)| {
            *v = self.st(dt, *v / (F::ONE + (-g).exp()));
        });
        Ok(())
    }

    fn causal_conv1d_silu(
        &self,
        _s: &CpuStream,
        x: &CpuBuf<F>,
        w: &CpuBuf<F>,
        w_off: usize,
        y: &mut CpuBuf<F>,
        seq_starts: &Vec<i32>,
        rows: usize,
        channels: usize,
        kernel: usize,
    ) -> Result<()> {
        check_len("causal_conv1d_silu", "x", x.data.len(), 0, rows * channels)?;
        check_len("causal_conv1d_silu", "w", w.data.len(), w_off, channels * kernel)?;
        check_len("causal_conv1d_silu", "y", y.data.len(), 0, rows * channels)?;
        let start_of = row_starts("causal_conv1d_silu", seq_starts, rows)?;
        let w = &w.data[w_off..w_off + channels * kernel];
        let dt = y.dtype;
        y.data[..rows * channels].par_chunks_mut(channels).enumerate().for_each(|(t, yr)| {
            // Taps before the sequence start read zeros (left padding restarts per sequence).
            let first = (t + 1).saturating_sub(kernel).max(start_of[t]);
            for c in 0..channels {
                let mut acc = F::ZERO;
                for src in first..=t {
                    acc += w[c * kernel + (kernel - 1 - (t - src))] * x.data[src * channels + c];
                }
                yr[c] = self.st(dt, silu(acc));
            }
        });
        Ok(())
    }

    fn gdn_gates(
        &self,
        _s: &CpuStream,
        b: &CpuBuf<F>,
        a: &CpuBuf<F>,
        w: &CpuBuf<F>,
        a_log_off: usize,
        dt_bias_off: usize,
        beta: &mut CpuBuf<F>,
        g: &mut CpuBuf<F>,
        rows: usize,
        heads: usize,
    ) -> Result<()> {
        let n = rows * heads;
        for (name, len) in [("b", b.data.len()), ("a", a.data.len()), ("beta", beta.data.len()), ("g", g.data.len())] {
            check_len("gdn_gates", name, len, 0, n)?;
        }
        check_len("gdn_gates", "A_log", w.data.len(), a_log_off, heads)?;
        check_len("gdn_gates", "dt_bias", w.data.len(), dt_bias_off, heads)?;
        let (bdt, gdt) = (beta.dtype, g.dtype);
        for i in 0..n {
            let h = i % heads;
            beta.data[i] = self.st(bdt, F::ONE / (F::ONE + (-b.data[i]).exp()));
            let decay_rate = w.data[a_log_off + h].exp();
            g.data[i] = self.st(gdt, -decay_rate * softplus(a.data[i] + w.data[dt_bias_off + h]));
        }
        Ok(())
    }

    fn l2norm_fwd(
        &self,
        _s: &CpuStream,
        x: &CpuBuf<F>,
        y: &mut CpuBuf<F>,
        rows: usize,
        dim: usize,
        eps: f32,
        scale: f32,
    ) -> Result<()> {
        check_len("l2norm_fwd", "x", x.data.len(), 0, rows * dim)?;
        check_len("l2norm_fwd", "y", y.data.len(), 0, rows * dim)?;
        let (dt, eps, scale) = (y.dtype, F::from_f32(eps), F::from_f32(scale));
        y.data[..rows * dim].par_chunks_mut(dim).enumerate().for_each(|(r, yr)| {
            let xr = &x.data[r * dim..(r + 1) * dim];
            let inv = scale / (dot(xr, xr) + eps).sqrt();
            for c in 0..dim {
                yr[c] = self.st(dt, xr[c] * inv);
            }
        });
        Ok(())
    }

    fn gdn_recurrent_fwd(
        &self,
        _s: &CpuStream,
        sh: &GdnShape,
        q: &CpuBuf<F>,
        k: &CpuBuf<F>,
        v: &CpuBuf<F>,
        g: &CpuBuf<F>,
        beta: &CpuBuf<F>,
        seq_starts: &Vec<i32>,
        o: &mut CpuBuf<F>,
        state: Option<&mut CpuBuf<F>>,
    ) -> Result<()> {
        self.gdn_fwd("gdn_recurrent_fwd", sh, [q, k, v, g, beta], seq_starts, o, state, gdn_head_recurrent)
    }

    fn gdn_chunked_fwd(
        &self,
        _s: &CpuStream,
        sh: &GdnShape,
        q: &CpuBuf<F>,
        k: &CpuBuf<F>,
        v: &CpuBuf<F>,
        g: &CpuBuf<F>,
        beta: &CpuBuf<F>,
        seq_starts: &Vec<i32>,
        o: &mut CpuBuf<F>,
        state: Option<&mut CpuBuf<F>>,
    ) -> Result<()> {
        self.gdn_fwd("gdn_chunked_fwd", sh, [q, k, v, g, beta], seq_starts, o, state, gdn_head_chunked)
    }
}

#[inline]
fn silu<F: Real>(x: F) -> F {
    x / (F::ONE + (-x).exp())
}

/// `ln(1 + e^x)`, linear above 20 as PyTorch's `softplus` (beta 1, threshold 20) is.
#[inline]
fn softplus<F: Real>(x: F) -> F {
    if x.to_f64() > 20.0 {
        x
    } else {
        (F::ONE + x.exp()).ln()
    }
}

/// Each row's sequence start from `seq_starts` (sequence `b` is rows `seq_starts[b]..
/// seq_starts[b+1]`); rows past the last listed end belong to the last sequence.
fn row_starts(op: &'static str, seq_starts: &[i32], rows: usize) -> Result<Vec<usize>> {
    let ranges = seq_ranges(op, seq_starts, rows)?;
    let mut start_of = vec![0usize; rows];
    for (a, b) in ranges {
        start_of[a..b].iter_mut().for_each(|s| *s = a);
    }
    Ok(start_of)
}

/// The sequences of a packed batch as row ranges covering `0..rows`.
fn seq_ranges(op: &'static str, seq_starts: &[i32], rows: usize) -> Result<Vec<(usize, usize)>> {
    let bad = |what: String| BackendError::Shape { op, what };
    let starts: Vec<usize> = seq_starts
        .iter()
        .map(|&s| usize::try_from(s).map_err(|_| bad(format!("negative sequence start {s}"))))
        .collect::<Result<_>>()?;
    if starts.first() != Some(&0) || starts.windows(2).any(|w| w[0] > w[1]) {
        return Err(bad(format!("seq_starts {seq_starts:?} must rise from 0")));
    }
    let mut ranges: Vec<(usize, usize)> =
        starts.windows(2).map(|w| (w[0].min(rows), w[1].min(rows))).filter(|(a, b)| a < b).collect();
    let end = ranges.last().map_or(0, |r| r.1);
    if end < rows {
        ranges.push((end, rows));
    }
    Ok(ranges)
}

/// One (sequence, value head) of the gated delta rule: `q, k` rows of `dk`, `v` rows of `dv`,
/// `g, beta` per row, the state `s [dk, dv]` in and out; returns the outputs, rows of `dv`.
type GdnHead<F> = fn(&[&[F]], &[&[F]], &[&[F]], &[F], &[F], &mut [F], usize) -> Vec<F>;

/// The definition, token by token (transformers' `torch_recurrent_gated_delta_rule`).
fn gdn_head_recurrent<F: Real>(
    q: &[&[F]],
    k: &[&[F]],
    v: &[&[F]],
    g: &[F],
    beta: &[F],
    s: &mut [F],
    dv: usize,
) -> Vec<F> {
    let dk = s.len() / dv;
    let mut out = vec![F::ZERO; q.len() * dv];
    let mut delta = vec![F::ZERO; dv];
    for t in 0..q.len() {
        let decay = g[t].exp();
        s.iter_mut().for_each(|x| *x = *x * decay);
        // delta = beta (v - S^T k)
        for c in 0..dv {
            let mut kv = F::ZERO;
            for i in 0..dk {
                kv += s[i * dv + c] * k[t][i];
            }
            delta[c] = beta[t] * (v[t][c] - kv);
        }
        for i in 0..dk {
            for c in 0..dv {
                s[i * dv + c] += k[t][i] * delta[c];
            }
        }
        for c in 0..dv {
            let mut acc = F::ZERO;
            for i in 0..dk {
                acc += s[i * dv + c] * q[t][i];
            }
            out[t * dv + c] = acc;
        }
    }
    out
}

/// The chunked form (flash-linear-attention's `chunk_gated_delta_rule`), chunks of
/// [`GDN_CHUNK`] from the sequence start. Within a chunk, with `G` the cumulative log decay from
/// the chunk start and `A[i][j] = beta_i (k_i . k_j) exp(G_i - G_j)` for `j < i`, the unit
/// lower-triangular systems `(I + A) W = diag(beta exp(G)) K` and `(I + A) U = diag(beta) V`
/// give the WY factors by forward substitution; then `V' = U - W S`,
/// `o_i = exp(G_i) q_i^T S + sum_{j<=i} (q_i . k_j) exp(G_i - G_j) V'_j` and
/// `S = exp(G_last) S + sum_j exp(G_last - G_j) k_j V'_j^T`.
fn gdn_head_chunked<F: Real>(
    q: &[&[F]],
    k: &[&[F]],
    v: &[&[F]],
    g: &[F],
    beta: &[F],
    s: &mut [F],
    dv: usize,
) -> Vec<F> {
    let dk = s.len() / dv;
    let n = q.len();
    let mut out = vec![F::ZERO; n * dv];
    let mut c0 = 0;
    while c0 < n {
        let len = GDN_CHUNK.min(n - c0);
        let (qc, kc, vc) = (&q[c0..c0 + len], &k[c0..c0 + len], &v[c0..c0 + len]);
        let mut cum = vec![F::ZERO; len];
        let mut acc = F::ZERO;
        for i in 0..len {
            acc += g[c0 + i];
            cum[i] = acc;
        }
        let b = &beta[c0..c0 + len];
        // Strictly lower A, row-major [len, len].
        let mut a = vec![F::ZERO; len * len];
        for i in 0..len {
            for j in 0..i {
                a[i * len + j] = b[i] * dot(kc[i], kc[j]) * (cum[i] - cum[j]).exp();
            }
        }
        // Forward substitution for W [len, dk] and U [len, dv].
        let mut w = vec![F::ZERO; len * dk];
        let mut u = vec![F::ZERO; len * dv];
        for i in 0..len {
            let (ei, bi) = (cum[i].exp(), b[i]);
            for d in 0..dk {
                w[i * dk + d] = bi * ei * kc[i][d];
            }
            for c in 0..dv {
                u[i * dv + c] = bi * vc[i][c];
            }
            for j in 0..i {
                let aij = a[i * len + j];
                for d in 0..dk {
                    let wj = w[j * dk + d];
                    w[i * dk + d] = w[i * dk + d] - aij * wj;
                }
                for c in 0..dv {
                    let uj = u[j * dv + c];
                    u[i * dv + c] = u[i * dv + c] - aij * uj;
                }
            }
        }
        // V' = U - W S.
        let mut vp = u;
        for i in 0..len {
            for c in 0..dv {
                let mut ws = F::ZERO;
                for d in 0..dk {
                    ws += w[i * dk + d] * s[d * dv + c];
                }
                vp[i * dv + c] = vp[i * dv + c] - ws;
            }
        }
        // Outputs: the state entering the chunk, plus the intra-chunk attention over V'.
        for i in 0..len {
            let ei = cum[i].exp();
            let qk: Vec<F> = (0..=i).map(|j| dot(qc[i], kc[j]) * (cum[i] - cum[j]).exp()).collect();
            for c in 0..dv {
                let mut qs = F::ZERO;
                for d in 0..dk {
                    qs += qc[i][d] * s[d * dv + c];
                }
                let mut intra = F::ZERO;
                for (j, &x) in qk.iter().enumerate() {
                    intra += x * vp[j * dv + c];
                }
                out[(c0 + i) * dv + c] = ei * qs + intra;
            }
        }
        // The state leaving the chunk.
        let last = cum[len - 1];
        let end_decay = last.exp();
        s.iter_mut().for_each(|x| *x = *x * end_decay);
        for j in 0..len {
            let e = (last - cum[j]).exp();
            for d in 0..dk {
                let kd = e * kc[j][d];
                for c in 0..dv {
                    s[d * dv + c] += kd * vp[j * dv + c];
                }
            }
        }
        c0 += len;
    }
    out
}

impl<F: Real> CpuBackend<F> {
    /// Shared driver of the two gated-delta-rule forms: checks shapes, runs every (sequence,
    /// value head) in parallel with `head`, writes the outputs (one rounding each) and the states.
    #[allow(clippy::too_many_arguments)]
    fn gdn_fwd(
        &self,
        op: &'static str,
        sh: &GdnShape,
        [q, k, v, g, beta]: [&CpuBuf<F>; 5],
        seq_starts: &[i32],
        o: &mut CpuBuf<F>,
        state: Option<&mut CpuBuf<F>>,
        head: GdnHead<F>,
    ) -> Result<()> {
        let GdnShape { rows, k_heads, v_heads, k_dim: dk, v_dim: dv } = *sh;
        if k_heads == 0 || v_heads % k_heads != 0 {
            return Err(BackendError::Shape { op, what: format!("{v_heads} value heads over {k_heads} key heads") });
        }
        let (kw, vw) = (k_heads * dk, v_heads * dv);
        check_len(op, "q", q.data.len(), 0, rows * kw)?;
        check_len(op, "k", k.data.len(), 0, rows * kw)?;
        check_len(op, "v", v.data.len(), 0, rows * vw)?;
        check_len(op, "g", g.data.len(), 0, rows * v_heads)?;
        check_len(op, "beta", beta.data.len(), 0, rows * v_heads)?;
        check_len(op, "o", o.data.len(), 0, rows * vw)?;
        let ranges = seq_ranges(op, seq_starts, rows)?;
        let per_state = dk * dv;
        if let Some(st) = &state {
            check_len(op, "state", st.data.len(), 0, ranges.len() * v_heads * per_state)?;
        }
        let init: Option<&[F]> = state.as_ref().map(|st| &st.data[..]);
        let group = v_heads / k_heads;
        let results: Vec<(Vec<F>, Vec<F>)> = (0..ranges.len() * v_heads)
            .into_par_iter()
            .map(|task| {
                let (b, h) = (task / v_heads, task % v_heads);
                let (r0, r1) = ranges[b];
                let kh = h / group;
                fn rows_of<F>(x: &[F], rows: std::ops::Range<usize>, width: usize, head: usize, d: usize) -> Vec<&[F]> {
                    rows.map(|t| &x[t * width + head * d..][..d]).collect()
                }
                let qs = rows_of(&q.data, r0..r1, kw, kh, dk);
                let ks = rows_of(&k.data, r0..r1, kw, kh, dk);
                let vs = rows_of(&v.data, r0..r1, vw, h, dv);
                let gs: Vec<F> = (r0..r1).map(|t| g.data[t * v_heads + h]).collect();
                let bs: Vec<F> = (r0..r1).map(|t| beta.data[t * v_heads + h]).collect();
                let mut s = match init {
                    Some(st) => st[task * per_state..(task + 1) * per_state].to_vec(),
                    None => vec![F::ZERO; per_state],
                };
                let out = head(&qs, &ks, &vs, &gs, &bs, &mut s, dv);
                (out, s)
            })
            .collect();
        let odt = o.dtype;
        for (task, (out, _)) in results.iter().enumerate() {
            let (b, h) = (task / v_heads, task % v_heads);
            let (r0, r1) = ranges[b];
            for (i, t) in (r0..r1).enumerate() {
                for c in 0..dv {
                    o.data[t * vw + h * dv + c] = self.st(odt, out[i * dv + c]);
                }
            }
        }
        if let Some(st) = state {
            let sdt = st.dtype;
            for (task, (_, s)) in results.iter().enumerate() {
                for (d, &x) in st.data[task * per_state..(task + 1) * per_state].iter_mut().zip(s) {
                    *d = self.st(sdt, x);
                }
            }
        }
        Ok(())
    }
}

fn transpose<F: Copy>(x: &[F], rows: usize, cols: usize) -> Vec<F> {
    let mut t = Vec::with_capacity(rows * cols);
    for c in 0..cols {
        for r in 0..rows {
            t.push(x[r * cols + c]);
        }
    }
    t
}

/// Which key a drafter query sees: a context row (global index) or a block row (global index).
#[derive(Clone, Copy, Debug)]
enum Key {
    Ctx(usize),
    Blk(usize),
}

/// Validated drafter-attention geometry shared by the forward and backward reference.
struct DraftGeom<'a> {
    qw: usize,
    kw: usize,
    group: usize,
    scale: f64,
    anchors: &'a [i32],
    ctx_start: &'a [i32],
    hd: usize,
}

impl<'a> DraftGeom<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new<F>(
        op: &'static str,
        sh: &DraftAttnShape,
        q: &CpuBuf<F>,
        kc: &CpuBuf<F>,
        vc: &CpuBuf<F>,
        kb: &CpuBuf<F>,
        vb: &CpuBuf<F>,
        anchors: &'a [i32],
        ctx_start: &'a [i32],
    ) -> Result<Self> {
        if sh.kv_heads == 0 || sh.heads % sh.kv_heads != 0 {
            return Err(BackendError::Shape { op, what: format!("{} heads over {} kv heads", sh.heads, sh.kv_heads) });
        }
        if sh.window == Some(0) {
            return Err(BackendError::Shape {
                op,
                what: "sliding window 0 (a window holds at least the draft token)".into(),
            });
        }
        let (qw, kw) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
        check_len(op, "q", q.data.len(), 0, sh.q_rows() * qw)?;
        check_len(op, "kc", kc.data.len(), 0, sh.ctx_rows * kw)?;
        check_len(op, "vc", vc.data.len(), 0, sh.ctx_rows * kw)?;
        check_len(op, "kb", kb.data.len(), 0, sh.q_rows() * kw)?;
        check_len(op, "vb", vb.data.len(), 0, sh.q_rows() * kw)?;
        check_len(op, "anchors", anchors.len(), 0, sh.num_blocks)?;
        check_len(op, "ctx_start", ctx_start.len(), 0, sh.num_blocks)?;
        for j in 0..sh.num_blocks {
            if anchors[j] >= 0 && ctx_start[j] as i64 + anchors[j] as i64 > sh.ctx_rows as i64 {
                return Err(BackendError::Shape {
                    op,
                    what: format!("block {j}: context {}..+{} past {} rows", ctx_start[j], anchors[j], sh.ctx_rows),
                });
            }
        }
        Ok(DraftGeom {
            qw,
            kw,
            group: sh.heads / sh.kv_heads,
            scale: 1.0 / (sh.head_dim as f64).sqrt(),
            anchors,
            ctx_start,
            hd: sh.head_dim,
        })
    }

    /// The keys slot `r` of block `j` sees: context `[start + lo, start + anchor)` (strictly
    /// before the anchor; `lo` = 0 in a full layer, the window's start in a sliding one), then
    /// its own block's rows (all of them, or slots `<= r` in a sliding layer). Nothing for a
    /// padded block.
    fn keys(&self, j: usize, r: usize, sh: &DraftAttnShape) -> Vec<Key> {
        let a = self.anchors[j];
        if a < 0 {
            return Vec::new();
        }
        let (a, start) = (a as usize, self.ctx_start[j] as usize);
        let lo = sh.ctx_lo(a, r).min(a);
        let mut keys: Vec<Key> = (start + lo..start + a).map(Key::Ctx).collect();
        let bs = sh.block_size;
        keys.extend((0..bs).filter(|&c| sh.sees_slot(r, c)).map(|c| Key::Blk(j * bs + c)));
        keys
    }

    fn k<'b, F>(&self, key: Key, kvh: usize, kc: &'b CpuBuf<F>, kb: &'b CpuBuf<F>) -> &'b [F] {
        match key {
            Key::Ctx(t) => &kc.data[t * self.kw + kvh * self.hd..][..self.hd],
            Key::Blk(t) => &kb.data[t * self.kw + kvh * self.hd..][..self.hd],
        }
    }

    fn v<'b, F>(&self, key: Key, kvh: usize, vc: &'b CpuBuf<F>, vb: &'b CpuBuf<F>) -> &'b [F] {
        self.k(key, kvh, vc, vb)
    }
}
