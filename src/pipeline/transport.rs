//! How a buffer crosses from one side of the pipeline to the other (DESIGN.md sections 1-2).
//!
//! - `same`: one device. Hand-off only: the receiving stream waits on the sender's event and the
//!   buffer records its use there (rules 2-3). No copy.
//! - `p2p`: a device-to-device copy into a buffer of the receiving device, on the receiving
//!   device's copy stream (over NVLink between peer GPUs; a plain D2D copy on one GPU).
//! - `host`: D2H into a pinned slot on the sender's copy stream, then H2D on the receiver's copy
//!   stream. The slot is acquired before the D2H, held by its guard, and returns to the pool only
//!   after the H2D's event (rule 5), on every path.
//!
//! The sending stream never waits for a copy: copies wait for the sender's event on copy
//! streams, and only copies run there (rule 4). `send` runs on the sending thread, `settle` on the
//! publisher thread (the host waits for the copy, then the source buffer is released), `receive`
//! on the receiving thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::backend::{Backend, BackendError, Result};
use crate::faults::FaultPlan;
use crate::pipeline::slots::{SlotGuard, SlotPool, SlotStats};
use crate::tensor::DType;

/// One timed copy: whether it ran on the sender's copy stream, and its start and end events.
type CopyTiming<E> = (bool, E, E);

/// How batches travel between the target and the drafter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    Same,
    Peer,
    Host,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Same => "same",
            Transport::Peer => "p2p",
            Transport::Host => "host",
        }
    }

    pub fn parse(s: &str) -> std::result::Result<Option<Transport>, String> {
        match s {
            "auto" => Ok(None),
            "same" => Ok(Some(Transport::Same)),
            "p2p" | "peer" => Ok(Some(Transport::Peer)),
            "host" => Ok(Some(Transport::Host)),
            other => Err(format!("--transport {other}: use auto, same, p2p or host")),
        }
    }

    /// `auto`: hand-off on one device, peer copies between peers, host staging otherwise.
    pub fn auto<B: Backend>(src: &B, dst: &B) -> Transport {
        if std::ptr::eq(src, dst) {
            Transport::Same
        } else if src.is_peer(dst) {
            Transport::Peer
        } else {
            Transport::Host
        }
    }
}

/// A buffer in transit.
pub enum Parcel<B: Backend> {
    /// On the same device: the buffer and the event after its last write.
    Local { buf: B::Buf, ready: B::Event },
    /// Copied into a buffer of the receiving device; the source stays alive until `ready`.
    Copied { buf: B::Buf, ready: B::Event, source: Option<B::Buf> },
    /// In a pinned host slot; `ready` completes with the D2H.
    Staged { slot: SlotGuard<B::HostMem>, ready: B::Event, dtype: DType, len: usize },
}

/// How long a sender waits for a free pinned slot before the run fails with a clear error
/// (the pool is sized so this only happens when the receiving side stopped returning slots).
const SLOT_TIMEOUT: Duration = Duration::from_secs(120);

/// One direction of transport: from `src`'s device to `dst`'s.
pub struct Link<'a, B: Backend> {
    pub kind: Transport,
    src: &'a B,
    dst: &'a B,
    /// The sender's copy stream (D2H of the host transport).
    src_copy: B::Stream,
    /// The receiver's copy stream (peer copies, H2D).
    dst_copy: B::Stream,
    pool: Option<Arc<SlotPool<B::HostMem>>>,
    bytes: AtomicU64,
    /// Device timestamps around every copy (backend, start, end), for the copy rate.
    timed: Mutex<Vec<CopyTiming<B::Event>>>,
}

impl<'a, B: Backend> Link<'a, B> {
    /// A link for buffers of at most `max_bytes`; the host transport pre-allocates `slots` pinned
    /// slots of that size.
    pub fn new(kind: Transport, src: &'a B, dst: &'a B, max_bytes: usize, slots: usize) -> Result<Self> {
        if kind == Transport::Same && !std::ptr::eq(src, dst) {
            return Err(BackendError::Unsupported(
                "--transport same needs the target and the drafter on one GPU: use p2p or host".into(),
            ));
        }
        let pool = match kind {
            Transport::Host => Some(SlotPool::new(src.host_mem(), slots.max(1), max_bytes.max(1))?),
            _ => None,
        };
        Ok(Link {
            kind,
            src,
            dst,
            src_copy: src.new_stream()?,
            dst_copy: dst.new_stream()?,
            pool,
            bytes: AtomicU64::new(0),
            timed: Mutex::new(Vec::new()),
        })
    }

    /// The sender's copy stream.
    pub fn src_stream(&self) -> &B::Stream {
        &self.src_copy
    }

    /// The receiver's copy stream.
    pub fn dst_stream(&self) -> &B::Stream {
        &self.dst_copy
    }

    pub fn bytes_moved(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Device seconds the copies took (start to end of each copy on its copy stream; None
    /// without device timestamps). The host waits for the last copy.
    pub fn copy_seconds(&self) -> Option<f64> {
        let timed = self.timed.lock().ok()?;
        if timed.is_empty() {
            return None;
        }
        timed
            .iter()
            .map(|(on_src, a, b)| if *on_src { self.src.elapsed_secs(a, b) } else { self.dst.elapsed_secs(a, b) })
            .sum()
    }

    /// Brackets one copy with device timestamps (`on_src`: on the sender's copy stream).
    fn timed<T>(&self, on_src: bool, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let (be, s) = if on_src { (self.src, &self.src_copy) } else { (self.dst, &self.dst_copy) };
        let a = be.record_timed(s)?;
        let out = f()?;
        if let (Some(a), Some(b)) = (a, be.record_timed(s)?) {
            if let Ok(mut t) = self.timed.lock() {
                t.push((on_src, a, b));
            }
        }
        Ok(out)
    }

    pub fn slot_stats(&self) -> Option<SlotStats> {
        self.pool.as_ref().map(|p| p.stats())
    }

    /// Wakes anyone blocked on a slot and stops handing out new ones (shutdown on error).
    pub fn shutdown(&self) {
        if let Some(p) = &self.pool {
            p.shutdown();
        }
    }

    /// Sends `buf` (micro-batch `micro` of step `step`), last written on the sender's stream `s`.
    /// Enqueues work only; `s` never waits. The fault plan's `copy_error_at` makes the copy of a
    /// step's first micro-batch fail after its resources were taken (the copy-error test).
    pub fn send(&self, s: &B::Stream, buf: B::Buf, step: u32, micro: usize, faults: &FaultPlan) -> Result<Parcel<B>> {
        let fault = faults.copy_error_at == Some(step) && micro == 0;
        let ready = self.src.record_event(s)?;
        let (dtype, len) = (self.src.dtype(&buf), self.src.len(&buf));
        let bytes = (len * dtype.size_bytes()) as u64;
        let injected = || BackendError::Injected(format!("the {} copy failed", self.kind.name()));
        let parcel = match self.kind {
            Transport::Same => {
                if fault {
                    return Err(injected());
                }
                return Ok(Parcel::Local { buf, ready });
            }
            Transport::Peer => {
                self.dst.wait_event(&self.dst_copy, &ready)?;
                let mut out = self.dst.alloc(&self.dst_copy, dtype, len)?;
                if fault {
                    return Err(injected());
                }
                self.timed(false, || self.dst.copy_from_peer(&self.dst_copy, self.src, &buf, &mut out))?;
                let done = self.dst.record_event(&self.dst_copy)?;
                Parcel::Copied { buf: out, ready: done, source: Some(buf) }
            }
            Transport::Host => {
                let pool = self.pool.as_ref().expect("the host transport has a slot pool");
                // Rule 5: the slot is ours (guarded) before its D2H is enqueued.
                let mut slot = pool.acquire(SLOT_TIMEOUT)?;
                if fault {
                    return Err(injected()); // the guard returns the slot: nothing was enqueued
                }
                self.src.wait_event(&self.src_copy, &ready)?;
                self.timed(true, || self.src.copy_to_host(&self.src_copy, &buf, slot.slot_mut()))?;
                // The source may be freed now: its memory waits for the copy stream (rule 2).
                self.src.record_use(&self.src_copy, &[&buf])?;
                let done = self.src.record_event(&self.src_copy)?;
                // Should the parcel never reach the receiver, the slot still waits for its D2H.
                slot.release_after(done.clone());
                Parcel::Staged { slot, ready: done, dtype, len }
            }
        };
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(parcel)
    }

    /// On the publisher thread: the host waits until the parcel's copy has completed, and the
    /// source buffer of a peer copy is released. A local hand-off needs no wait.
    pub fn settle(&self, p: &mut Parcel<B>) -> Result<()> {
        match p {
            Parcel::Local { .. } => Ok(()),
            Parcel::Copied { ready, source, .. } => {
                self.dst.sync_event(ready)?;
                source.take();
                Ok(())
            }
            Parcel::Staged { ready, .. } => self.src.sync_event(ready),
        }
    }

    /// On the receiving thread: the buffer on the receiving device, with `s` ordered after its
    /// arrival and the use on `s` recorded. An unsettled peer copy's source goes to `hold`: the
    /// caller drops it once it knows `s` has passed this point (no host wait here).
    pub fn receive(&self, s: &B::Stream, p: Parcel<B>, hold: &mut Vec<B::Buf>) -> Result<B::Buf> {
        match p {
            Parcel::Local { buf, ready } => {
                self.dst.wait_event(s, &ready)?;
                self.dst.record_use(s, &[&buf])?;
                Ok(buf)
            }
            Parcel::Copied { buf, ready, source } => {
                self.dst.wait_event(s, &ready)?;
                self.dst.record_use(s, &[&buf])?;
                hold.extend(source);
                Ok(buf)
            }
            Parcel::Staged { mut slot, ready, dtype, len } => {
                let mut out = self.dst.alloc(&self.dst_copy, dtype, len)?;
                self.dst.wait_event(&self.dst_copy, &ready)?;
                self.timed(false, || self.dst.copy_from_host(&self.dst_copy, slot.slot(), &mut out))?;
                let done = self.dst.record_event(&self.dst_copy)?;
                // Rule 5: back to the pool only after this H2D completed.
                slot.release_after(done.clone());
                drop(slot);
                self.dst.wait_event(s, &done)?;
                self.dst.record_use(s, &[&out])?;
                Ok(out)
            }
        }
    }
}
