//! Activations that wait in pinned host memory between a layer's forward and its backward.
//!
//! The drafter's backward reads each layer's gate|up product (`[rows, 2 x intermediate]` bf16,
//! 1.5 GiB a layer at the Qwen3-8B recipe), and the first layers' wait longest: through every
//! later layer's forward, the lm_head + cross-entropy and every later layer's backward, which is
//! where the step's device peak sits. Parked on the host they cost no device time: the copies run
//! on a stream of their own while the compute stream goes on, a parked buffer's device memory is
//! given back [`SETTLE_LAG`] layers later, and it comes back [`RESTORE_LEAD`] layers ahead of the
//! backward that reads it. A copy that has not finished by then shows as idle compute time in
//! the step's phase table.
//!
//! Ordering (DESIGN.md section 2): the copy stream carries copies only (rule 4), and every hand-off
//! is an event one stream records and the other waits on (rule 3):
//! - [`Parking::park`]: the copy stream waits for the compute stream's work so far (the buffer's
//!   writes), then copies the buffer to a pinned slot.
//! - [`Parking::settle`]: the compute stream waits for that copy, then frees the buffer. The free
//!   is on the buffer's own stream, after a wait that orders the copy before any later use of the
//!   memory there, so the allocator may hand it out again at once (rule 1). Recording the copy
//!   stream's use instead (rule 2) would be as safe but would defer the memory until the host saw
//!   the copy finish; the host runs a step ahead of the device, so the step's later allocations
//!   would come from new memory and the device would hold more, not less.
//! - [`Parking::unpark`]: a new buffer from the compute stream's pool; the copy stream waits for
//!   the compute stream's work so far (the memory's previous users), then fills it from the slot.
//!   [`Returning::take`] makes the compute stream wait for that copy before it reads the buffer.
//! - A slot is written again only by a later park, on the same copy stream, so stream order puts
//!   its last read before that write. Slots are freed only after the host has waited for their
//!   last copy, and a [`Parked`] or [`Returning`] dropped on an error path waits for its copy
//!   before it gives up its device buffer or slot.

use std::sync::Arc;

use crate::backend::slots::{SlotError, SlotMemory};
use crate::backend::{Backend, BackendError, Result};
pub use crate::faults::ParkFault;
use crate::tensor::DType;

/// A parked buffer's device memory is freed this many layers after it was parked: the compute
/// stream then waits for its device-to-host copy. The copies of consecutive layers queue on one
/// stream and each takes longer than a layer's forward (on the H200 at the Qwen3-8B recipe: 1.5
/// GiB at about 53 GB/s, 30 ms, against about 24 ms a layer), so with a lag of 2 the compute
/// stream waited 12.8 ms a step for them; with 3 the second layer's copy still has 12 ms to spare.
/// The drafter frees whatever is parked before the lm_head at the latest, where its peak is.
pub const SETTLE_LAG: usize = 3;
/// A parked buffer's host-to-device copy starts when the backward reaches the layer this many
/// above it: two layers' backward (about 100 ms at the Qwen3-8B recipe) to finish in, after the
/// memory of at least one later layer was freed.
pub const RESTORE_LEAD: usize = 2;

type Slot<B> = <<B as Backend>::HostMem as SlotMemory>::Slot;

/// A pinned slot, its size in bytes, and the last copy that touched it. Dropping it waits for that
/// copy first; if the wait fails (the device is lost) the slot is leaked rather than freed under a
/// copy that may still run (as `CudaReadback` does).
struct SlotEntry<B: Backend> {
    slot: Option<Slot<B>>,
    bytes: usize,
    /// None for a new slot that no copy has touched yet.
    last: Option<B::Event>,
    mem: Arc<B::HostMem>,
}

impl<B: Backend> SlotEntry<B> {
    fn slot(&self) -> &Slot<B> {
        self.slot.as_ref().expect("a slot entry holds its slot until dropped")
    }
}

impl<B: Backend> Drop for SlotEntry<B> {
    fn drop(&mut self) {
        if !finished::<B>(&self.mem, self.last.as_ref()) {
            std::mem::forget(self.slot.take());
        }
    }
}

/// The copy stream and the pinned slots of one drafter. Slots are reused from step to step.
pub struct Parking<B: Backend> {
    copy: B::Stream,
    mem: Arc<B::HostMem>,
    free: Vec<SlotEntry<B>>,
    /// The NaN suite's forced hazard (`faults::ParkFault`): each copy to the host waits for the
    /// flag to reach its number, which the compute stream writes when it settles that copy.
    fault: ParkFault,
    flag: Option<B::Buf>,
    held: u32,
}

/// A buffer whose contents are on their way to, or in, a pinned host slot. Dropped before it was
/// unparked (an error path), it waits for its copy before the buffer and the slot are freed.
pub struct Parked<B: Backend> {
    /// The device buffer until [`Parking::settle`] frees it.
    dev: Option<B::Buf>,
    slot: Option<SlotEntry<B>>,
    dtype: DType,
    len: usize,
    /// Under `ParkFault::Held*`: the flag value that releases this buffer's copy.
    held: Option<u32>,
}

/// A parked buffer on its way back to the device. Dropped before it was taken (an error path), it
/// waits for its copy before the buffer is freed.
pub struct Returning<B: Backend> {
    buf: Option<B::Buf>,
    h2d: B::Event,
    mem: Arc<B::HostMem>,
}

impl<B: Backend> Parking<B> {
    /// `fault` is `ParkFault::None` except in the NaN suite's hazard tests.
    pub fn new(be: &B, fault: ParkFault) -> Result<Self> {
        Ok(Parking { copy: be.new_stream()?, mem: be.host_mem(), free: Vec::new(), fault, flag: None, held: 0 })
    }

    /// Pins `count` slots of `bytes` each now, so that the first step does not stop to do it
    /// (pinning took the H200 machine's host about 0.45 s a GiB, while the device waited).
    pub fn reserve(&mut self, count: usize, bytes: usize) -> Result<()> {
        for _ in 0..count {
            let slot = self.mem.alloc_slot(bytes).map_err(slot_error)?;
            self.free.push(SlotEntry { slot: Some(slot), bytes, last: None, mem: self.mem.clone() });
        }
        Ok(())
    }

    /// Starts copying `buf` (written on `s`) to a pinned slot. Its device memory stays in use
    /// until [`Parking::settle`].
    pub fn park(&mut self, be: &B, s: &B::Stream, buf: B::Buf) -> Result<Parked<B>> {
        let (dtype, len) = (be.dtype(&buf), be.len(&buf));
        let bytes = len * dtype.size_bytes();
        let mut entry = self.slot(bytes)?;
        let held = self.hold(be, s)?;
        let written = be.record_event(s)?;
        be.wait_event(&self.copy, &written)?;
        if let (Some(n), Some(flag)) = (held, &self.flag) {
            be.wait_flag(&self.copy, flag, n)?;
        }
        let mut slot = entry.slot.take().expect("a free slot entry holds its slot");
        let copied = be.copy_to_host(&self.copy, &buf, &mut slot).and_then(|()| be.record_event(&self.copy));
        entry.slot = Some(slot);
        match copied {
            Ok(d2h) => {
                entry.last = Some(d2h);
                Ok(Parked { dev: Some(buf), slot: Some(entry), dtype, len, held })
            }
            Err(e) => Err(self.quiesce(be, e, buf, entry)),
        }
    }

    /// The compute stream `s` waits for the parked copy, and the device buffer is freed (reusable
    /// at once on `s`, after that wait). Idempotent.
    pub fn settle(&mut self, be: &B, s: &B::Stream, p: &mut Parked<B>) -> Result<()> {
        if p.dev.is_none() {
            return Ok(());
        }
        if self.fault == ParkFault::HeldUnordered {
            // The defect the hazard test must see: the buffer freed (and, under poison-on-free,
            // filled with NaN on `s`) without waiting for its copy, which is released only then.
            p.dev = None;
            return self.release(be, s, p);
        }
        self.release(be, s, p)?;
        if let Some(d2h) = p.slot.as_ref().and_then(|e| e.last.as_ref()) {
            be.wait_event(s, d2h)?;
        }
        p.dev = None;
        Ok(())
    }

    /// Under `ParkFault::Held*`: the flag for a new held copy (made and zeroed on `s` at the
    /// first) and its number.
    fn hold(&mut self, be: &B, s: &B::Stream) -> Result<Option<u32>> {
        if self.fault == ParkFault::None {
            return Ok(None);
        }
        if self.flag.is_none() {
            let flag = be.alloc(s, DType::F32, 1)?;
            be.record_use(&self.copy, &[&flag])?;
            self.flag = Some(flag);
        }
        self.held += 1;
        Ok(Some(self.held))
    }

    /// Under `ParkFault::Held*`: `s` releases `p`'s held copy.
    fn release(&self, be: &B, s: &B::Stream, p: &mut Parked<B>) -> Result<()> {
        match (p.held.take(), &self.flag) {
            (Some(n), Some(flag)) => be.signal_flag(s, flag, n),
            _ => Ok(()),
        }
    }

    /// Starts bringing a parked buffer back into a new buffer of the compute stream `s`.
    pub fn unpark(&mut self, be: &B, s: &B::Stream, mut p: Parked<B>) -> Result<Returning<B>> {
        self.settle(be, s, &mut p)?;
        let mut buf = be.alloc_uninit(s, p.dtype, p.len)?;
        let freed = be.record_event(s)?;
        be.wait_event(&self.copy, &freed)?;
        let mut entry = p.slot.take().expect("a parked buffer holds its slot until it is unparked");
        let copied = be.copy_from_host(&self.copy, entry.slot(), &mut buf).and_then(|()| be.record_event(&self.copy));
        match copied {
            Ok(h2d) => {
                entry.last = Some(h2d.clone());
                self.free.push(entry);
                Ok(Returning { buf: Some(buf), h2d, mem: self.mem.clone() })
            }
            Err(e) => Err(self.quiesce(be, e, buf, entry)),
        }
    }

    /// A copy of `buf` to or from `entry` may have been enqueued without an event to wait for: the
    /// host waits for the whole copy stream before both are freed, or leaks them if it cannot.
    fn quiesce(&mut self, be: &B, e: BackendError, buf: B::Buf, entry: SlotEntry<B>) -> BackendError {
        if be.synchronize(&self.copy).is_err() {
            std::mem::forget(buf);
            std::mem::forget(entry);
        }
        e
    }

    /// A free slot of at least `bytes` (the smallest such), or a new one. Free slots too small
    /// for the request are given back first (each waits for its last copy as it goes), so a
    /// growing shape does not pile them up.
    fn slot(&mut self, bytes: usize) -> Result<SlotEntry<B>> {
        let best = (0..self.free.len()).filter(|&i| self.free[i].bytes >= bytes).min_by_key(|&i| self.free[i].bytes);
        if let Some(i) = best {
            return Ok(self.free.swap_remove(i));
        }
        self.free.clear();
        // Room to grow by an eighth before the next reallocation (micro-batches of slightly
        // different sizes share a slot).
        let want = bytes + bytes / 8;
        let slot = self.mem.alloc_slot(want).map_err(slot_error)?;
        Ok(SlotEntry { slot: Some(slot), bytes: want, last: None, mem: self.mem.clone() })
    }
}

/// A failed pinned allocation, with what the memory was for and how to do without it.
fn slot_error(e: SlotError) -> SlotError {
    match e {
        SlotError::Alloc(why) => SlotError::Alloc(format!(
            "{why}; these are the activations the drafter parks in host memory: \
             a lower --offload-activations needs less (0: none)"
        )),
        other => other,
    }
}

/// Whether the copy behind `ev` (if any) has finished, the host waiting for it. Only drops use
/// it; false means the wait failed, i.e. the device is lost, which the step reports on its own.
fn finished<B: Backend>(mem: &B::HostMem, ev: Option<&B::Event>) -> bool {
    ev.is_none_or(|ev| mem.wait(ev).is_ok())
}

impl<B: Backend> Returning<B> {
    /// The buffer, once the compute stream `s` waits for its copy.
    pub fn take(mut self, be: &B, s: &B::Stream) -> Result<B::Buf> {
        be.wait_event(s, &self.h2d)?;
        Ok(self.buf.take().expect("taken once"))
    }
}

impl<B: Backend> Drop for Returning<B> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            if !finished::<B>(&self.mem, Some(&self.h2d)) {
                std::mem::forget(buf);
            }
        }
    }
}

impl<B: Backend> Drop for Parked<B> {
    fn drop(&mut self) {
        if let Some(buf) = self.dev.take() {
            let d2h = self.slot.as_ref().and_then(|e| e.last.as_ref());
            if !self.slot.as_ref().is_none_or(|e| finished::<B>(&e.mem, d2h)) {
                std::mem::forget(buf);
            }
        }
        // The slot entry, if still here, waits for its last copy as it drops.
    }
}
