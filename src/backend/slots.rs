//! What a pinned host slot pool needs from a backend: slots of pinned host memory and events
//! that say when a copy touching a slot has completed. The pool itself (`pipeline::slots`) is
//! written once against this trait and tested there with simulated memory and events; the CUDA
//! backend implements it with `cuMemHostAlloc` slots that are *not* write-combined (DESIGN.md
//! section 7) and CUDA events, the CPU backend with plain host vectors.

use std::time::Duration;

use thiserror::Error;

/// Why a slot pool could not hand out, or take back, a slot.
#[derive(Debug, Error)]
pub enum SlotError {
    #[error(
        "no pinned host slot became free within {waited:?}: every slot is held or waits for its H2D \
         (check that the consumer releases its slots; raise the slot count if it does)"
    )]
    Timeout { waited: Duration },
    #[error("the pinned slot pool is shut down: it hands out no more slots")]
    Closed,
    #[error("allocating pinned host slots failed: {0}")]
    Alloc(String),
    #[error("waiting for a pinned slot's release event failed: {0}")]
    Event(String),
}

/// The memory and event primitives a slot pool (`pipeline::slots::SlotPool`) needs. On CUDA: `Slot` is a pinned host buffer
/// (`cuMemHostAlloc` without the write-combined flag, freed by its `Drop`), `Event` a CUDA event
/// recorded after the copy that reads the slot.
pub trait SlotMemory: Send + Sync + 'static {
    /// A pinned host buffer (not write-combined on CUDA). Dropping it frees it.
    type Slot: Send;
    /// Completion of a copy enqueued on a stream.
    type Event: Send;
    fn alloc_slot(&self, bytes: usize) -> Result<Self::Slot, SlotError>;
    /// Non-blocking query. An error must read as "not done": the slot then stays out of use.
    fn done(&self, ev: &Self::Event) -> bool;
    /// The host blocks until the event has completed.
    fn wait(&self, ev: &Self::Event) -> Result<(), SlotError>;
}
