//! The CUDA side of the allocator's `DeviceMem`: raw allocations, events, poison fills.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext, CudaStream, DriverError};

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

/// Raw device memory of one context. Streams are named by their unique id (`Stream::id`), never
/// by the handle's address, which the driver reuses after a stream is destroyed; every stream the
/// allocator has been told about is kept alive here, because it may still enqueue poison fills,
/// event records and stream-ordered frees on it until the allocator itself is dropped.
pub struct CudaMem {
    ctx: Arc<CudaContext>,
    streams: HashMap<u64, Arc<CudaStream>>,
}

impl CudaMem {
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        CudaMem { ctx, streams: HashMap::new() }
    }

    /// Makes stream `id` known (and kept alive) before the allocator is given its id.
    pub fn register(&mut self, id: u64, stream: &Arc<CudaStream>) {
        self.streams.entry(id).or_insert_with(|| stream.clone());
    }

    fn bind(&self) {
        let _ = self.ctx.bind_to_thread();
    }

    /// The handle of stream `id`. Every id reaches the allocator through a call that registered
    /// it first, so a miss is a bug in the backend (the allocator's policy: misuse panics).
    fn raw(&self, id: u64) -> sys::CUstream {
        self.streams
            .get(&id)
            .unwrap_or_else(|| panic!("CudaMem: stream {id} was never registered with the allocator"))
            .cu_stream()
    }
}

// SAFETY: the context handle is shared and thread-safe; every call binds it first.
unsafe impl Send for CudaMem {}

impl DeviceMem for CudaMem {
    type Stream = u64;
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

    fn record(&mut self, stream: u64) -> Option<Event> {
        self.bind();
        Event::record(self.raw(stream)).ok()
    }

    fn done(&mut self, ev: &Option<Event>) -> bool {
        ev.as_ref().is_none_or(|e| e.done())
    }

    fn wait(&mut self, stream: u64, ev: &Option<Event>) {
        if let Some(e) = ev {
            self.bind();
            let _ = e.wait_on(self.raw(stream));
        }
    }

    fn poison(&mut self, ptr: u64, bytes: usize, stream: u64) {
        self.bind();
        // SAFETY: the allocator poisons only blocks it owns and no one uses; the stream is alive
        // (registered streams are kept until the allocator is dropped).
        let _ = unsafe { cu::memset_d8_async(ptr, 0xFF, bytes, self.raw(stream)) };
    }

    fn alloc_async(&mut self, bytes: usize, stream: u64) -> Result<u64, AllocError> {
        self.bind();
        // SAFETY: stream-ordered allocation on a live stream, freed by free_async.
        unsafe { cu::malloc_async(self.raw(stream), bytes) }.map_err(|e| alloc_error("cuMemAllocAsync", bytes, e))
    }

    fn free_async(&mut self, ptr: u64, stream: u64) {
        self.bind();
        // SAFETY: `ptr` came from alloc_async; freed once, stream-ordered on a live stream.
        let _ = unsafe { cu::free_async(ptr, self.raw(stream)) };
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
