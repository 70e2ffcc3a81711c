//! What the pipeline's transports need from a CUDA device (DESIGN.md sections 1-2): events that
//! other streams and devices can wait on, pinned host slots that are not write-combined, and
//! async copies device -> host, host -> device and device -> device across peers.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext};

use super::{device, drv, CudaBackend, CudaBuf, Stream};
use crate::backend::error::cu_name;
use crate::backend::slots::{SlotError, SlotMemory};
use crate::backend::{check_len, BackendError, Result};

/// A recorded CUDA event, shared: the same completion can release a pinned slot and order a stream.
pub type CudaEvent = Arc<device::Event>;

/// A pinned host buffer from `cuMemHostAlloc(PORTABLE)`: usable by every context, and *not*
/// write-combined (the host reads staged batches; write-combined reads are very slow).
pub struct PinnedSlot {
    ptr: *mut c_void,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: pinned host memory is plain host memory; the slot pool hands a slot to one owner at a time.
unsafe impl Send for PinnedSlot {}

impl PinnedSlot {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PinnedSlot {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc and freed once; the slot pool drops a slot only after
        // every copy that touched it completed.
        let _ = unsafe { cu::free_host(self.ptr) };
    }
}

/// Pinned slots and event queries for `pipeline::slots::SlotPool`.
pub struct CudaHostMem {
    ctx: Arc<CudaContext>,
}

impl SlotMemory for CudaHostMem {
    type Slot = PinnedSlot;
    type Event = CudaEvent;

    fn alloc_slot(&self, bytes: usize) -> std::result::Result<PinnedSlot, SlotError> {
        self.ctx.bind_to_thread().map_err(|e| SlotError::Alloc(format!("binding the context: {}", cu_name(&e))))?;
        // SAFETY: a plain pinned allocation, freed by PinnedSlot's Drop. PORTABLE (every context
        // may use it), deliberately without WRITECOMBINED.
        let ptr = unsafe { cu::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(|e| {
            SlotError::Alloc(format!("cuMemHostAlloc of {bytes} bytes failed ({}): lower --max-inflight", cu_name(&e)))
        })?;
        Ok(PinnedSlot { ptr, bytes, ctx: self.ctx.clone() })
    }

    fn done(&self, ev: &CudaEvent) -> bool {
        ev.done()
    }

    fn wait(&self, ev: &CudaEvent) -> std::result::Result<(), SlotError> {
        ev.synchronize().map_err(|e| SlotError::Event(cu_name(&e)))
    }
}

impl CudaBackend {
    pub(super) fn record_event_impl(&self, s: &Stream) -> Result<CudaEvent> {
        self.bind()?;
        Ok(Arc::new(device::Event::record(s.raw()).map_err(|e| drv("record_event", e))?))
    }

    pub(super) fn host_mem_impl(&self) -> Arc<CudaHostMem> {
        Arc::new(CudaHostMem { ctx: self.ctx.clone() })
    }

    fn bytes_of(b: &CudaBuf) -> usize {
        b.len * b.dtype.size_bytes()
    }

    pub(super) fn copy_to_host_impl(&self, s: &Stream, src: &CudaBuf, dst: &mut PinnedSlot) -> Result<()> {
        let n = Self::bytes_of(src);
        check_len("copy_to_host", "pinned slot (bytes)", dst.bytes, 0, n)?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the slot holds at least n bytes (checked) and stays alive until the copy's event
        // completed (the slot pool's rule); src is a live buffer of n bytes.
        let host = unsafe { std::slice::from_raw_parts_mut(dst.ptr as *mut u8, n) };
        unsafe { cu::memcpy_dtoh_async(host, src.ptr, s.raw()) }
            .map_err(|e| drv(format!("copy_to_host of {n} bytes"), e))
    }

    pub(super) fn copy_from_host_impl(&self, s: &Stream, src: &PinnedSlot, dst: &mut CudaBuf) -> Result<()> {
        let n = Self::bytes_of(dst);
        check_len("copy_from_host", "pinned slot (bytes)", src.bytes, 0, n)?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: as above; pinned memory makes this a true async DMA, so the slot must outlive
        // the copy: its guard is released only after this stream's event.
        let host = unsafe { std::slice::from_raw_parts(src.ptr as *const u8, n) };
        unsafe { cu::memcpy_htod_async(dst.ptr, host, s.raw()) }
            .map_err(|e| drv(format!("copy_from_host of {n} bytes"), e))
    }

    pub(super) fn copy_from_peer_impl(
        &self,
        s: &Stream,
        src_be: &CudaBackend,
        src: &CudaBuf,
        dst: &mut CudaBuf,
    ) -> Result<()> {
        let n = Self::bytes_of(src);
        check_len("copy_from_peer", "dst (bytes)", Self::bytes_of(dst), 0, n)?;
        if n == 0 {
            return Ok(());
        }
        let same = Arc::ptr_eq(&self.ctx, &src_be.ctx);
        // Without peer access the driver would still copy, staged through host memory at a tenth
        // of the NVLink rate (37 against 391 GB/s measured on the H200 pair): never silently.
        if !same && !self.peer_access(src_be) {
            return Err(BackendError::Unsupported(format!(
                "copy from {} to {}: the GPUs cannot access each other's memory (no peer access): use --transport host or auto",
                src_be.name, self.name
            )));
        }
        self.bind()?;
        if same {
            // SAFETY: two live buffers of at least n bytes on this device.
            unsafe { cu::memcpy_dtod_async(dst.ptr, src.ptr, n, s.raw()) }
                .map_err(|e| drv(format!("copy_from_peer on one device, {n} bytes"), e))
        } else {
            // SAFETY: live buffers on their own devices; the caller made `s` wait for the source's
            // last write and keeps the source alive until this copy's event completed.
            unsafe { cu::memcpy_peer_async(self.ctx.cu_ctx(), dst.ptr, src_be.ctx.cu_ctx(), src.ptr, n, s.raw()) }
                .map_err(|e| drv(format!("copy_from_peer {} -> {}, {n} bytes", src_be.name, self.name), e))
        }
    }

    /// is_peer_impl, asked once per peer context (its answer cached): enables the access a direct
    /// peer copy needs.
    fn peer_access(&self, other: &CudaBackend) -> bool {
        let key = Arc::as_ptr(&other.ctx) as usize;
        let Ok(mut known) = self.peers.lock() else { return false };
        if known.contains(&key) {
            return true;
        }
        let ok = self.is_peer_impl(other);
        if ok {
            known.push(key);
        }
        ok
    }

    /// Whether `other`'s memory is directly readable from here; enables peer access both ways the
    /// first time (cuMemcpyPeerAsync then goes over NVLink instead of through the host).
    pub(super) fn is_peer_impl(&self, other: &CudaBackend) -> bool {
        if Arc::ptr_eq(&self.ctx, &other.ctx) {
            return true;
        }
        let (a, b) = (self.ctx.cu_device(), other.ctx.cu_device());
        let mut can = 0i32;
        // SAFETY: two valid device handles.
        let ok = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) } == sys::CUresult::CUDA_SUCCESS;
        if !ok || can == 0 {
            return false;
        }
        for (from, to) in [(self, other), (other, self)] {
            if from.bind().is_err() {
                return false;
            }
            // SAFETY: enabling access from the bound context to a live peer context.
            let r = unsafe { sys::cuCtxEnablePeerAccess(to.ctx.cu_ctx(), 0) };
            if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                return false;
            }
        }
        true
    }
}

/// A device -> host read in flight (`Backend::read_async`): the pinned slot its copies land in,
/// the event after them, and where each part lies in the slot. Dropped unread, it first waits
/// for its copies (the slot must outlive them).
pub struct CudaReadback {
    slot: Option<PinnedSlot>,
    event: device::Event,
    /// `(is_ids, byte offset, elements)` per part, in the order asked.
    parts: Vec<(bool, usize, usize)>,
    /// Where the slot goes back for the next read.
    free: Arc<std::sync::Mutex<Vec<PinnedSlot>>>,
}

impl Drop for CudaReadback {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            if self.event.synchronize().is_ok() {
                if let Ok(mut free) = self.free.lock() {
                    if free.len() < READBACK_SLOTS_KEPT {
                        free.push(slot);
                    }
                }
            } else {
                // The copies may still be running: leak the slot rather than free it under them.
                std::mem::forget(slot);
            }
        }
    }
}

/// Pinned readback slots kept for reuse (freeing pinned memory synchronises the device).
const READBACK_SLOTS_KEPT: usize = 4;

impl CudaBackend {
    pub(super) fn read_async_impl(
        &self,
        s: &Stream,
        bufs: &[&CudaBuf],
        ids: &[&super::CudaIds],
    ) -> Result<CudaReadback> {
        let mut parts = Vec::with_capacity(bufs.len() + ids.len());
        let mut bytes = 0usize;
        for b in bufs {
            if b.dtype != crate::tensor::DType::F32 {
                return Err(BackendError::Shape {
                    op: "read_async",
                    what: format!("a {} buffer (f32 only)", b.dtype.name()),
                });
            }
            parts.push((false, bytes, b.len));
            bytes += 4 * b.len;
        }
        for i in ids {
            parts.push((true, bytes, i.len));
            bytes += 4 * i.len;
        }
        let slot = {
            let mut free = self.readback_slots.lock().map_err(|_| BackendError::Poisoned("readback slots"))?;
            match free.iter().position(|x| x.bytes >= bytes) {
                Some(k) => free.swap_remove(k),
                None => self
                    .host_mem_impl()
                    .alloc_slot(bytes.max(256).next_power_of_two())
                    .map_err(|e| BackendError::Unsupported(format!("read_async: {e}")))?,
            }
        };
        self.bind()?;
        let srcs = bufs.iter().map(|b| b.ptr).chain(ids.iter().map(|i| i.ptr));
        for (src, &(_, off, n)) in srcs.zip(&parts) {
            if n == 0 {
                continue;
            }
            // SAFETY: the slot holds `bytes` >= off + 4 n bytes; it lives until the event below
            // completed (CudaReadback's Drop waits for it); src is a live buffer of 4 n bytes,
            // read in s's order.
            let host = unsafe { std::slice::from_raw_parts_mut((slot.ptr as *mut u8).add(off), 4 * n) };
            let r = self.timed(s, super::profile::Work::Copy, || {
                unsafe { cu::memcpy_dtoh_async(host, src, s.raw()) }
                    .map_err(|e| drv(format!("read_async of {} bytes", 4 * n), e))
            });
            if let Err(e) = r {
                // Copies enqueued before this one may still run into the slot: never free it.
                std::mem::forget(slot);
                return Err(e);
            }
        }
        let event = device::Event::record(s.raw()).map_err(|e| drv("read_async: its event", e))?;
        Ok(CudaReadback { slot: Some(slot), event, parts, free: self.readback_slots.clone() })
    }

    pub(super) fn read_wait_impl(&self, r: CudaReadback) -> Result<crate::backend::ReadValues> {
        r.event.synchronize().map_err(|e| drv("read_wait", e))?;
        let slot = r.slot.as_ref().expect("a readback holds its slot until dropped");
        let (mut f, mut ids) = (Vec::new(), Vec::new());
        for &(is_ids, off, n) in &r.parts {
            // SAFETY: the copies into the slot completed (the event above); off + 4 n <= bytes.
            let at = unsafe { (slot.ptr as *const u8).add(off) };
            if is_ids {
                let mut v = vec![0i32; n];
                unsafe { std::ptr::copy_nonoverlapping(at, v.as_mut_ptr() as *mut u8, 4 * n) };
                ids.push(v);
            } else {
                let mut v = vec![0f32; n];
                unsafe { std::ptr::copy_nonoverlapping(at, v.as_mut_ptr() as *mut u8, 4 * n) };
                f.push(v);
            }
        }
        Ok((f, ids))
    }
}
