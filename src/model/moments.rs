//! AdamW's two moments of a parameter group: on the device beside the parameters, or
//! (`--offload-optimizer`) in pinned host memory, brought through the device a chunk at a time for
//! each update.
//!
//! A trained parameter holds 16 bytes on the device: its bf16 weight, its master's low half, its
//! f32 gradient and the f32 moments `m` and `v`. The moments are half of that and are read only by
//! the update, once a step, so they are the cheapest bytes to move off the device: at the
//! Qwen3.6-27B recipe (1.7 billion drafter parameters) they are 12.9 GiB, what the 27B target's
//! layers, the drafter and its activations are over an 80 GB card. Offloaded, each update moves
//! them in and out over PCIe (`m` and `v` both ways: 16 bytes a parameter), with the two
//! directions on streams of their own so that they overlap, and the update of one chunk overlaps
//! the next chunk's copy in. Values are the same bit for bit as on the device: the update is the
//! same kernel on the same f32 values, one chunk at a time.
//!
//! Ordering (DESIGN.md section 2): the two copy streams carry copies only (rule 4), and every
//! hand-off is an event one stream records and another waits on (rule 3). `s` below is the stream
//! the update runs on: the compute stream, or with `--sync` on one device the update's own stream
//! (`DrafterSide::overlap_updates`), whose pool then keeps the staging buffers between steps.
//! - **fetch**: staging buffers from `s`'s pool; the `up` stream waits for `s`'s work so far (the
//!   memory's earlier users) and for the chunk's last copy (its slots' last writer), then fills
//!   them from the chunk's slots.
//! - **update**: `s` waits for the fetch and runs AdamW on the chunk's range.
//! - **store**: the `down` stream waits for the update and copies the staging buffers back to the
//!   slots; `s` waits for that copy before the buffers go back to its pool (as `Parking::settle`
//!   frees a parked buffer), so the allocator may hand them out again at once.
//!
//! While chunk `c` is updated and stored, chunk `c + 1` is fetched: two chunks' staging buffers
//! (`2 x 2 x CHUNK` f32) are the device memory this costs. A chunk's slots are freed only after
//! the host has waited for their last copy.

use std::sync::Arc;

use crate::backend::slots::{SlotError, SlotMemory};
use crate::backend::{Backend, BackendError, Result};
use crate::tensor::DType;

/// Parameters per chunk: 128 MiB per moment, a chunk's m and v about 5.4 ms of PCIe each way at
/// 50 GB/s (the H100 measured ~49 GB/s per direction with both directions busy).
pub const CHUNK: usize = 1 << 25;

type Slot<B> = <<B as Backend>::HostMem as SlotMemory>::Slot;

/// Where a group's moments live.
pub enum Moments<B: Backend> {
    /// Device buffers of the group's length.
    Device { m: B::Buf, v: B::Buf },
    /// Pinned host slots, a chunk at a time.
    Host(HostMoments<B>),
}

/// One chunk's place in the group, its pinned slots and the last copy that touched them.
struct HostChunk<B: Backend> {
    off: usize,
    len: usize,
    m: Option<Slot<B>>,
    v: Option<Slot<B>>,
    last: Option<B::Event>,
    mem: Arc<B::HostMem>,
}

impl<B: Backend> HostChunk<B> {
    fn slots(&self) -> (&Slot<B>, &Slot<B>) {
        match (self.m.as_ref(), self.v.as_ref()) {
            (Some(m), Some(v)) => (m, v),
            _ => unreachable!("a chunk holds its slots until dropped"),
        }
    }

    fn slots_mut(&mut self) -> (&mut Slot<B>, &mut Slot<B>) {
        match (self.m.as_mut(), self.v.as_mut()) {
            (Some(m), Some(v)) => (m, v),
            _ => unreachable!("a chunk holds its slots until dropped"),
        }
    }
}

impl<B: Backend> Drop for HostChunk<B> {
    fn drop(&mut self) {
        // A copy may still read or write the slots: wait for it, or leak them if the wait fails
        // (the device is lost) rather than free memory a copy may still touch.
        if let Some(ev) = &self.last {
            if self.mem.wait(ev).is_err() {
                std::mem::forget(self.m.take());
                std::mem::forget(self.v.take());
            }
        }
    }
}

/// A chunk's moments in staging buffers on the device. Dropped before [`Staged::settle`] (an
/// error path), the host waits for its last copy before the buffers are freed.
struct Staged<B: Backend> {
    chunk: usize,
    bufs: Option<(B::Buf, B::Buf)>,
    last: B::Event,
    mem: Arc<B::HostMem>,
}

impl<B: Backend> Staged<B> {
    fn bufs(&mut self) -> &mut (B::Buf, B::Buf) {
        self.bufs.as_mut().expect("staged buffers are present until settled")
    }

    /// The buffers, once a stream of their pool has waited for `last` (no host wait).
    fn settle(mut self) -> (B::Buf, B::Buf) {
        self.bufs.take().expect("settled once")
    }
}

impl<B: Backend> Drop for Staged<B> {
    fn drop(&mut self) {
        if let Some(bufs) = self.bufs.take() {
            if self.mem.wait(&self.last).is_err() {
                std::mem::forget(bufs);
            }
        }
    }
}

/// A group's moments in pinned host memory, in chunks of [`CHUNK`] parameters.
pub struct HostMoments<B: Backend> {
    n: usize,
    up: B::Stream,
    down: B::Stream,
    mem: Arc<B::HostMem>,
    chunks: Vec<HostChunk<B>>,
}

impl<B: Backend> HostMoments<B> {
    /// Pins slots for `n` parameters' moments (`chunk` parameters a chunk; [`CHUNK`] outside
    /// tests). Their contents are set by [`HostMoments::write`] before any update reads them.
    pub fn new(be: &B, n: usize, chunk: usize) -> Result<Self> {
        let mem = be.host_mem();
        let chunk = chunk.max(1);
        let mut chunks = Vec::with_capacity(n.div_ceil(chunk));
        for start in (0..n).step_by(chunk) {
            let len = chunk.min(n - start);
            let bytes = len * DType::F32.size_bytes();
            let m = mem.alloc_slot(bytes).map_err(slot_error)?;
            let v = mem.alloc_slot(bytes).map_err(slot_error)?;
            chunks.push(HostChunk { off: start, len, m: Some(m), v: Some(v), last: None, mem: mem.clone() });
        }
        Ok(HostMoments { n, up: be.new_stream()?, down: be.new_stream()?, mem, chunks })
    }

    /// Bytes of pinned host memory held.
    pub fn pinned_bytes(&self) -> usize {
        2 * self.n * DType::F32.size_bytes()
    }

    /// Starts bringing chunk `c` into new staging buffers of the compute stream `s`. The caller
    /// records the copy as the chunk's last (`update`), or waits for it before the slots can be
    /// touched again (`download`: the host waits for `s`, which waits for the copy).
    fn fetch(&self, be: &B, s: &B::Stream, c: usize) -> Result<Staged<B>> {
        let ch = &self.chunks[c];
        let mut bm = be.alloc_uninit(s, DType::F32, ch.len)?;
        let mut bv = be.alloc_uninit(s, DType::F32, ch.len)?;
        let freed = be.record_event(s)?;
        be.wait_event(&self.up, &freed)?;
        if let Some(last) = &ch.last {
            be.wait_event(&self.up, last)?;
        }
        let (sm, sv) = ch.slots();
        let copied = be
            .copy_from_host(&self.up, sm, &mut bm)
            .and_then(|()| be.copy_from_host(&self.up, sv, &mut bv))
            .and_then(|()| be.record_event(&self.up));
        match copied {
            Ok(h2d) => Ok(Staged { chunk: c, bufs: Some((bm, bv)), last: h2d, mem: self.mem.clone() }),
            Err(e) => Err(self.quiesce(be, e, (bm, bv))),
        }
    }

    /// Copies a staged chunk (written on `s`) to its slots; `s` waits for the copy, and the
    /// staging buffers go back to `s`'s pool.
    fn store(&mut self, be: &B, s: &B::Stream, mut st: Staged<B>) -> Result<()> {
        let written = be.record_event(s)?;
        be.wait_event(&self.down, &written)?;
        let ch = &mut self.chunks[st.chunk];
        if let Some(last) = &ch.last {
            be.wait_event(&self.down, last)?;
        }
        let (sm, sv) = ch.slots_mut();
        let (bm, bv) = st.bufs();
        let copied = be
            .copy_to_host(&self.down, bm, sm)
            .and_then(|()| be.copy_to_host(&self.down, bv, sv))
            .and_then(|()| be.record_event(&self.down));
        match copied {
            Ok(d2h) => {
                ch.last = Some(d2h.clone());
                st.last = d2h.clone();
                be.wait_event(s, &d2h)?;
                drop(st.settle());
                Ok(())
            }
            Err(e) => {
                let bufs = st.settle();
                Err(self.quiesce(be, e, bufs))
            }
        }
    }

    /// A copy of the staging buffers may have been enqueued without an event to wait for: the
    /// host waits for both copy streams before the buffers are freed, or leaks them if it cannot.
    fn quiesce(&self, be: &B, e: BackendError, bufs: (B::Buf, B::Buf)) -> BackendError {
        if be.synchronize(&self.up).is_err() || be.synchronize(&self.down).is_err() {
            std::mem::forget(bufs);
        }
        e
    }

    /// Runs `update(off, m, v)` on the compute stream `s` for every chunk in order, with the
    /// chunk's moments on the device (`m`, `v`: the chunk's length; `off`: its first parameter),
    /// and keeps what it leaves in them. The next chunk is fetched while one is updated.
    pub fn update(
        &mut self,
        be: &B,
        s: &B::Stream,
        mut update: impl FnMut(usize, &mut B::Buf, &mut B::Buf) -> Result<()>,
    ) -> Result<()> {
        let count = self.chunks.len();
        let mut next = if count > 0 { Some(self.fetch_next(be, s, 0)?) } else { None };
        for c in 0..count {
            let mut st = next.take().expect("each chunk is fetched before its update");
            if c + 1 < count {
                next = Some(self.fetch_next(be, s, c + 1)?);
            }
            be.wait_event(s, &st.last)?;
            let (m, v) = st.bufs();
            update(self.chunks[c].off, m, v)?;
            self.store(be, s, st)?;
        }
        Ok(())
    }

    /// `fetch`, the copy recorded as the chunk's last.
    fn fetch_next(&mut self, be: &B, s: &B::Stream, c: usize) -> Result<Staged<B>> {
        let st = self.fetch(be, s, c)?;
        self.chunks[c].last = Some(st.last.clone());
        Ok(st)
    }

    /// Sets every chunk's moments: `set(off, m, v)` fills new staging buffers of the chunk's
    /// length on `s` (`off`: the chunk's first parameter), which then go to the chunk's slots.
    fn set_chunks(
        &mut self,
        be: &B,
        s: &B::Stream,
        mut set: impl FnMut(usize, &mut B::Buf, &mut B::Buf) -> Result<()>,
    ) -> Result<()> {
        for c in 0..self.chunks.len() {
            let (off, len) = (self.chunks[c].off, self.chunks[c].len);
            let mut bm = be.alloc_uninit(s, DType::F32, len)?;
            let mut bv = be.alloc_uninit(s, DType::F32, len)?;
            set(off, &mut bm, &mut bv)?;
            let last = be.record_event(s)?;
            self.store(be, s, Staged { chunk: c, bufs: Some((bm, bv)), last, mem: self.mem.clone() })?;
        }
        Ok(())
    }

    /// Sets the moments from device buffers of the group's length (on `s`).
    pub fn write(&mut self, be: &B, s: &B::Stream, m: &B::Buf, v: &B::Buf) -> Result<()> {
        self.set_chunks(be, s, |off, bm, bv| {
            let len = be.len(bm);
            be.copy(s, m, off, bm, 0, len)?;
            be.copy(s, v, off, bv, 0, len)
        })
    }

    /// Sets every moment to `value` (on `s`).
    pub fn fill(&mut self, be: &B, s: &B::Stream, value: f32) -> Result<()> {
        self.set_chunks(be, s, |_, bm, bv| {
            be.fill(s, bm, value)?;
            be.fill(s, bv, value)
        })
    }

    /// Sets the moments from host values (`m`, `v`: the group's length).
    pub fn upload(&mut self, be: &B, s: &B::Stream, m: &[f32], v: &[f32]) -> Result<()> {
        for (name, have) in [("m", m.len()), ("v", v.len())] {
            crate::backend::check_len("HostMoments::upload", name, have, 0, self.n)?;
        }
        self.set_chunks(be, s, |off, bm, bv| {
            let len = be.len(bm);
            be.upload(s, &m[off..off + len], bm, 0)?;
            be.upload(s, &v[off..off + len], bv, 0)
        })
    }

    /// The moments as host values (for a checkpoint): each chunk through the device (`s`).
    pub fn download(&self, be: &B, s: &B::Stream) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut m, mut v) = (Vec::with_capacity(self.n), Vec::with_capacity(self.n));
        for c in 0..self.chunks.len() {
            let mut st = self.fetch(be, s, c)?;
            be.wait_event(s, &st.last)?;
            let (bm, bv) = st.bufs();
            m.extend(be.download(s, bm)?);
            v.extend(be.download(s, bv)?);
            // The host has waited for `s`, which waited for the copy: nothing is in flight.
            drop(st.settle());
        }
        Ok((m, v))
    }
}

/// A failed pinned allocation, with what the memory was for and how to do without it.
fn slot_error(e: SlotError) -> SlotError {
    match e {
        SlotError::Alloc(why) => SlotError::Alloc(format!(
            "{why}; this is the AdamW moments' host memory (--offload-optimizer: 8 bytes per drafter \
             parameter): leave the flag off to keep them on the device"
        )),
        other => other,
    }
}

impl<B: Backend> Moments<B> {
    /// Zeroed device moments for `n` parameters.
    pub fn device(be: &B, s: &B::Stream, n: usize) -> Result<Self> {
        Ok(Moments::Device { m: be.alloc(s, DType::F32, n)?, v: be.alloc(s, DType::F32, n)? })
    }

    /// Moves device moments to pinned host memory in chunks of `chunk` parameters (nothing if
    /// they are there already); returns the bytes pinned.
    pub fn offload(&mut self, be: &B, s: &B::Stream, chunk: usize) -> Result<usize> {
        if let Moments::Device { m, v } = self {
            let mut host = HostMoments::new(be, be.len(m), chunk)?;
            host.write(be, s, m, v)?;
            // The device buffers are freed on `s`, after the copies that read them (the store
            // made `s` wait for them).
            *self = Moments::Host(host);
        }
        Ok(match self {
            Moments::Host(h) => h.pinned_bytes(),
            Moments::Device { .. } => 0,
        })
    }

    pub fn is_offloaded(&self) -> bool {
        matches!(self, Moments::Host(_))
    }

    pub fn fill(&mut self, be: &B, s: &B::Stream, value: f32) -> Result<()> {
        match self {
            Moments::Device { m, v } => {
                be.fill(s, m, value)?;
                be.fill(s, v, value)
            }
            Moments::Host(h) => h.fill(be, s, value),
        }
    }

    /// The moments as host values.
    pub fn download(&self, be: &B, s: &B::Stream) -> Result<(Vec<f32>, Vec<f32>)> {
        match self {
            Moments::Device { m, v } => Ok((be.download(s, m)?, be.download(s, v)?)),
            Moments::Host(h) => h.download(be, s),
        }
    }

    /// Sets the moments from host values.
    pub fn upload(&mut self, be: &B, s: &B::Stream, m: &[f32], v: &[f32]) -> Result<()> {
        match self {
            Moments::Device { m: dm, v: dv } => {
                be.upload(s, m, dm, 0)?;
                be.upload(s, v, dv, 0)
            }
            Moments::Host(h) => h.upload(be, s, m, v),
        }
    }

    /// Runs `update(off, m, v)` over the moments: once over the whole group on the device, or
    /// once per chunk ([`HostMoments::update`]).
    pub fn update(
        &mut self,
        be: &B,
        s: &B::Stream,
        mut update: impl FnMut(usize, &mut B::Buf, &mut B::Buf) -> Result<()>,
    ) -> Result<()> {
        match self {
            Moments::Device { m, v } => update(0, m, v),
            Moments::Host(h) => h.update(be, s, update),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::{CpuBackend, CpuStream};

    const S: CpuStream = CpuStream;

    fn buf(be: &CpuBackend, v: &[f32]) -> <CpuBackend as Backend>::Buf {
        let mut b = be.alloc(&S, DType::F32, v.len()).unwrap();
        be.upload(&S, v, &mut b, 0).unwrap();
        b
    }

    /// Every way of setting host moments lands each value in its place across chunks (the last
    /// one shorter), and the update sees each chunk once, in order, at its offset.
    #[test]
    fn host_moments_keep_every_value_in_place_across_chunks() {
        let be = CpuBackend::new();
        let n = 23;
        let (m, v): (Vec<f32>, Vec<f32>) = (0..n).map(|i| (i as f32, -(i as f32) - 0.5)).unzip();
        let mut dev = Moments::Device { m: buf(&be, &m), v: buf(&be, &v) };
        assert_eq!(dev.offload(&be, &S, 5).unwrap(), 8 * n);
        assert!(dev.is_offloaded());
        assert_eq!(dev.download(&be, &S).unwrap(), (m.clone(), v.clone()), "moved from the device");
        let mut seen = Vec::new();
        dev.update(&be, &S, |off, bm, bv| {
            seen.push((off, be.len(bm)));
            let (hm, hv) = (be.download(&S, bm)?, be.download(&S, bv)?);
            assert_eq!((hm.as_slice(), hv.as_slice()), (&m[off..off + hm.len()], &v[off..off + hv.len()]));
            be.fill(&S, bm, off as f32)?;
            be.fill(&S, bv, 1.0)
        })
        .unwrap();
        assert_eq!(seen, [(0, 5), (5, 5), (10, 5), (15, 5), (20, 3)]);
        let (um, uv) = dev.download(&be, &S).unwrap();
        assert_eq!(um, (0..n).map(|i| (i / 5 * 5) as f32).collect::<Vec<_>>(), "what the update left");
        assert!(uv.iter().all(|&x| x == 1.0));
        dev.fill(&be, &S, 0.0).unwrap();
        assert_eq!(dev.download(&be, &S).unwrap(), (vec![0.0; n], vec![0.0; n]));
        dev.upload(&be, &S, &v, &m).unwrap();
        assert_eq!(dev.download(&be, &S).unwrap(), (v.clone(), m.clone()), "set from the host");
        assert!(dev.upload(&be, &S, &v[1..], &m).is_err(), "a short host vector is refused");
    }
}
