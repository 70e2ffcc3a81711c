//! The CUDA side of the allocator's `DeviceMem`: raw allocations, events, poison fills.

use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext, DriverError};

use super::alloc::{AllocError, DeviceMem};

/// A recorded CUDA event, destroyed on drop (the driver releases it once it completes).
pub struct Event(sys::CUevent);

// SAFETY: a CUevent is a driver handle usable from any thread with the context bound; record,
// query, wait and synchronize are thread-safe driver calls.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    /// Records an event on `stream` now.
    pub fn record(stream: sys::CUstream) -> Result<Event, DriverError> {
        let ev = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        // SAFETY: a fresh event and a live stream.
        unsafe { cu::event::record(ev, stream) }?;
        Ok(Event(ev))
    }

    /// Records an event that also takes a GPU timestamp (for `elapsed`).
    pub fn record_timed(stream: sys::CUstream) -> Result<Event, DriverError> {
        let ev = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)?;
        // SAFETY: a fresh event and a live stream.
        unsafe { cu::event::record(ev, stream) }?;
        Ok(Event(ev))
    }

    /// Milliseconds between two completed timed events.
    pub fn elapsed_ms(start: &Event, end: &Event) -> Result<f32, DriverError> {
        // SAFETY: two live events.
        unsafe { cu::event::elapsed(start.0, end.0) }
    }

    /// Makes `stream` wait (on the GPU) until this event completes.
    pub fn wait_on(&self, stream: sys::CUstream) -> Result<(), DriverError> {
        // SAFETY: a live event and stream.
        unsafe { cu::stream::wait_event(stream, self.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
    }

    /// The host blocks until the event completed.
    pub fn synchronize(&self) -> Result<(), DriverError> {
        // SAFETY: a live event.
        unsafe { cu::event::synchronize(self.0) }
    }

    pub fn done(&self) -> bool {
        // SAFETY: a live event.
        unsafe { cu::event::query(self.0) }.is_ok()
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the driver defers the release until the event completes.
        let _ = unsafe { cu::event::destroy(self.0) };
    }
}

/// The allocator's view of a failed allocation: out of memory (which it answers by emptying its
/// cache and retrying once) or another driver failure (which it passes on).
fn alloc_error(call: &'static str, bytes: usize, e: DriverError) -> AllocError {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        AllocError::OutOfMemory { requested: bytes, reserved: 0, allocated: 0 }
    } else {
        AllocError::Driver { call, bytes, source: e }
    }
}

/// Raw device memory of one context; streams are named by their `CUstream` address.
pub struct CudaMem {
    ctx: Arc<CudaContext>,
}

impl CudaMem {
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        CudaMem { ctx }
    }
    fn bind(&self) {
        let _ = self.ctx.bind_to_thread();
    }
}

// SAFETY: the context handle is shared and thread-safe; every call binds it first.
unsafe impl Send for CudaMem {}

impl DeviceMem for CudaMem {
    type Stream = usize;
    type Event = Option<Event>;

    fn raw_alloc(&mut self, bytes: usize) -> Result<u64, AllocError> {
        self.bind();
        // SAFETY: a plain device allocation; freed by raw_free.
        unsafe { cu::malloc_sync(bytes) }.map_err(|e| alloc_error("cuMemAlloc", bytes, e))
    }

    fn raw_free(&mut self, ptr: u64) {
        self.bind();
        // SAFETY: `ptr` came from raw_alloc and is freed once (the allocator's contract).
        let _ = unsafe { cu::free_sync(ptr) };
    }

    fn record(&mut self, stream: usize) -> Option<Event> {
        self.bind();
        Event::record(stream as sys::CUstream).ok()
    }

    fn done(&mut self, ev: &Option<Event>) -> bool {
        ev.as_ref().is_none_or(|e| e.done())
    }

    fn wait(&mut self, stream: usize, ev: &Option<Event>) {
        if let Some(e) = ev {
            self.bind();
            let _ = e.wait_on(stream as sys::CUstream);
        }
    }

    fn poison(&mut self, ptr: u64, bytes: usize, stream: usize) {
        self.bind();
        // SAFETY: the allocator poisons only blocks it owns and no one uses.
        let _ = unsafe { cu::memset_d8_async(ptr, 0xFF, bytes, stream as sys::CUstream) };
    }

    fn alloc_async(&mut self, bytes: usize, stream: usize) -> Result<u64, AllocError> {
        self.bind();
        // SAFETY: stream-ordered allocation, freed by free_async.
        unsafe { cu::malloc_async(stream as sys::CUstream, bytes) }
            .map_err(|e| alloc_error("cuMemAllocAsync", bytes, e))
    }

    fn free_async(&mut self, ptr: u64, stream: usize) {
        self.bind();
        // SAFETY: `ptr` came from alloc_async; freed once, stream-ordered.
        let _ = unsafe { cu::free_async(ptr, stream as sys::CUstream) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_drivers_out_of_memory_is_out_of_memory_for_the_allocator() {
        let oom = alloc_error("cuMemAlloc", 1 << 30, DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        // The allocator answers this one by emptying its cache and retrying once.
        assert_eq!(oom, AllocError::OutOfMemory { requested: 1 << 30, reserved: 0, allocated: 0 });
        let other = alloc_error("cuMemAlloc", 64, DriverError(sys::CUresult::CUDA_ERROR_NOT_INITIALIZED));
        assert!(matches!(other, AllocError::Driver { call: "cuMemAlloc", bytes: 64, .. }), "{other:?}");
        assert!(other.to_string().contains("cuMemAlloc of 64 bytes failed (CUDA_ERROR_NOT_INITIALIZED)"), "{other}");
    }
}
