//! Stream-aware caching allocator for device memory (DESIGN.md section 2, rules 1, 2 and 6).
//!
//! Why it exists: a caching allocator that ignores streams hands memory that a side stream is
//! still reading to the next kernel on another stream; the result is silent NaNs, not a crash.
//! The state machine here is generic over [`DeviceMem`], so the same code runs on the GPU and is
//! tested on the CPU against simulated streams and events.
//!
//! Rules:
//! - A block belongs to the stream it was allocated on (its *owner*). Segments belong to the
//!   stream that caused their `raw_alloc`, so every block carved from one has the same owner.
//! - `free` of a block with no foreign uses puts it straight into its owner's free pool; only
//!   allocations on the owner stream take from that pool, and stream order makes that safe.
//! - A block used on another stream must be told so with [`CachingAllocator::record_use`] (the
//!   analogue of PyTorch's `record_stream`). At `free`, one event is recorded on each foreign
//!   stream, and the block is *deferred*: nobody reuses it until all those events are done.
//!   Every allocation first sweeps completed deferrals back into the pools.
//! - Memory changes stream only by going back to the device (`empty_cache`) and coming out of a
//!   new `raw_alloc`; [`DeviceMem::raw_free`] must wait for queued work (as `cuMemFree` does).
//! - Sizes: requests round up to [`MIN_BLOCK`]; requests up to [`SMALL_REQUEST`] carve from
//!   [`SEGMENT_ROUND`] segments, larger ones from segments rounded up to [`SEGMENT_ROUND`]. Small
//!   and large segments live in separate pools, best fit by `(size, ptr)`; a block is split when
//!   the rest is at least [`MIN_BLOCK`] (small) or [`LARGE_SPLIT_MIN`] (large), and a freed block
//!   merges with free neighbours of its segment (never with a deferred one).
//! - Out of memory: return wholly free cached segments to the device, retry once, then fail with
//!   [`AllocError::OutOfMemory`], which says what was asked, what is held, and what to do.
//!
//! Modes ([`Mode`]): `Normal`; `PoisonOnFree` fills each freed block with 0xFF (NaN in f32 and
//! bf16) on its owner stream when it becomes reusable, so a use-after-free shows up as a NaN, and
//! each new segment the same way when it is reserved, so a read of memory nothing wrote shows up
//! too, whoever's stores wrote the rest (compute-sanitizer's initcheck does not see every
//! cuBLASLt store);
//! `UnsafeReuse` (tests only) ignores foreign uses and reproduces the corruption the rules
//! prevent; `FreeAsync` caches nothing and maps every alloc/free to the driver's stream-ordered
//! `cuMemAllocAsync`/`cuMemFreeAsync` on the owner stream, after making it wait on events for the
//! recorded foreign uses, so `compute-sanitizer --track-stream-ordered-races` checks the
//! bookkeeping of the callers.
//!
//! Misuse of a `BlockId` (double free, use after free) is a bug in the engine, not user input,
//! so it panics with a message that names the id.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Requests round up to a multiple of this: every block stays aligned for 128-bit vector loads
/// and cuBLASLt's 256-byte preference, and the number of distinct sizes stays small.
pub const MIN_BLOCK: usize = 512;
/// Requests up to this size are "small" and share 2 MiB segments, so a few-KiB tensor does not
/// cost a `cuMemAlloc` (which synchronizes the device) of its own.
pub const SMALL_REQUEST: usize = 1 << 20;
/// Segment granularity: the driver maps device memory in 2 MiB pages, so a smaller raw
/// allocation would waste the rest of its page anyway.
pub const SEGMENT_ROUND: usize = 2 << 20;
/// A large block is split only when at least this much is left over; smaller tails of large
/// segments would be unusable slivers that fragment the large pool (PyTorch uses the same bound).
pub const LARGE_SPLIT_MIN: usize = 1 << 20;

/// Errors from the allocator and from the device behind it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// `raw_alloc`/`alloc_async` failed even after the cache was emptied. A `DeviceMem`
    /// implementation returns this with `reserved` and `allocated` 0; the allocator fills them.
    #[error(
        "out of device memory: asked for {requested} bytes ({}) while this allocator holds {reserved} bytes ({}) of which {allocated} bytes ({}) are in live buffers; lower the batch size or the sequence length (--batch-size, --seq-len, --logits-chunk, --pad-to-tokens), or stop other users of this GPU",
        mib(*.requested),
        mib(*.reserved),
        mib(*.allocated)
    )]
    OutOfMemory { requested: usize, reserved: usize, allocated: usize },
    /// Any other driver failure of a device-memory call.
    #[error("device memory: {call} of {bytes} bytes failed ({})", crate::backend::error::cu_name(.source))]
    Driver {
        call: &'static str,
        bytes: usize,
        #[source]
        source: cudarc::driver::DriverError,
    },
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// What the allocator needs from a device. The CUDA implementation wraps the driver calls named
/// on each method; the tests implement it with simulated streams and events.
pub trait DeviceMem {
    type Stream: Copy + Eq + std::hash::Hash + std::fmt::Debug;
    type Event;
    /// Reserve `bytes` of raw device memory (cuMemAlloc). Err = out of memory.
    fn raw_alloc(&mut self, bytes: usize) -> Result<u64, AllocError>;
    /// Give a segment back (cuMemFree). Must not return before queued work that may touch the
    /// range has finished; cuMemFree synchronizes the device, which is what makes this hold.
    fn raw_free(&mut self, ptr: u64);
    /// Record an event on `stream` now (captures all work enqueued on it so far).
    fn record(&mut self, stream: Self::Stream) -> Self::Event;
    /// Has the event completed?
    fn done(&mut self, ev: &Self::Event) -> bool;
    /// Make `stream` wait for `ev` (GPU-side; used by the free-async mode).
    fn wait(&mut self, stream: Self::Stream, ev: &Self::Event);
    /// Enqueue a fill of `bytes` at `ptr` with 0xFF on `stream` (poison: NaN in f32 and bf16).
    fn poison(&mut self, ptr: u64, bytes: usize, stream: Self::Stream);
    /// Stream-ordered allocation/free (cuMemAllocAsync/cuMemFreeAsync), for the sanitizer mode.
    fn alloc_async(&mut self, bytes: usize, stream: Self::Stream) -> Result<u64, AllocError>;
    fn free_async(&mut self, ptr: u64, stream: Self::Stream);
}

/// How freed memory is treated; see the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Normal,
    PoisonOnFree,
    /// Test-only: no cross-stream deferral, reproduces the corruption.
    UnsafeReuse,
    /// Every alloc/free maps to alloc_async/free_async on the owner stream after waiting for
    /// recorded foreign uses, so compute-sanitizer --track-stream-ordered-races can check it.
    FreeAsync,
}

/// Handle to a live block. Ids are never reused, so a stale id is always caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(u64);

/// Counters, in bytes and in events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocStats {
    /// Bytes held from the device: all segments (FreeAsync: the live blocks; the driver's own
    /// pool is not visible from here).
    pub reserved: usize,
    /// Bytes in live blocks (block sizes, i.e. after rounding).
    pub allocated: usize,
    pub peak_allocated: usize,
    /// The step region (`profile::Region`) the thread that reached `peak_allocated` was in.
    pub peak_region: crate::backend::profile::Region,
    /// Allocations served from a free pool.
    pub hits: u64,
    /// Allocations that needed new device memory.
    pub misses: u64,
    /// Frees that had to wait for foreign-stream events (cumulative).
    pub deferred_frees: u64,
    /// Freed blocks still waiting for their events.
    pub pending_deferred: usize,
    /// Segments held (0 in FreeAsync).
    pub segments: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChunkState {
    Live,
    Free,
    Deferred,
}

#[derive(Debug)]
struct Chunk {
    size: usize,
    state: ChunkState,
}

/// One raw allocation; its chunks tile it exactly, keyed by address.
struct Segment<S> {
    size: usize,
    owner: S,
    small: bool,
    chunks: BTreeMap<u64, Chunk>,
}

struct LiveBlock<S> {
    ptr: u64,
    size: usize,
    owner: S,
    /// Base of the segment it was carved from (unused in FreeAsync).
    seg: u64,
    /// Foreign streams it was used on; a Vec because there are a handful of streams at most.
    uses: Vec<S>,
}

struct DeferredFree<E> {
    seg: u64,
    ptr: u64,
    events: Vec<E>,
}

/// Free pools are keyed by (owner stream, small?) and ordered by (size, ptr) for best fit.
type PoolKey<S> = (S, bool);

pub struct CachingAllocator<D: DeviceMem> {
    dev: D,
    mode: Mode,
    next_id: u64,
    live: HashMap<BlockId, LiveBlock<D::Stream>>,
    segments: BTreeMap<u64, Segment<D::Stream>>,
    pools: HashMap<PoolKey<D::Stream>, BTreeSet<(usize, u64)>>,
    deferred: Vec<DeferredFree<D::Event>>,
    stats: AllocStats,
}

/// Request size rounded up to the block granularity; zero bytes still get a distinct block.
fn round_request(bytes: usize) -> Option<usize> {
    Some(bytes.max(1).checked_add(MIN_BLOCK - 1)? / MIN_BLOCK * MIN_BLOCK)
}

/// Raw allocation size for a (rounded) request.
fn segment_size(size: usize) -> Option<usize> {
    if size <= SMALL_REQUEST {
        Some(SEGMENT_ROUND)
    } else {
        Some(size.checked_add(SEGMENT_ROUND - 1)? / SEGMENT_ROUND * SEGMENT_ROUND)
    }
}

impl<D: DeviceMem> CachingAllocator<D> {
    pub fn new(dev: D, mode: Mode) -> Self {
        Self {
            dev,
            mode,
            next_id: 0,
            live: HashMap::new(),
            segments: BTreeMap::new(),
            pools: HashMap::new(),
            deferred: Vec::new(),
            stats: AllocStats::default(),
        }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// A block of at least `bytes` bytes owned by `stream`.
    pub fn alloc(&mut self, stream: D::Stream, bytes: usize) -> Result<BlockId, AllocError> {
        let size = round_request(bytes).ok_or_else(|| self.oom(bytes))?;
        if self.mode == Mode::FreeAsync {
            return self.alloc_stream_ordered(stream, bytes, size);
        }
        self.sweep_deferred();
        let small = size <= SMALL_REQUEST;
        let (seg, ptr) = match self.take_best_fit(stream, small, size) {
            Some(ptr) => {
                self.stats.hits += 1;
                (self.segment_base(ptr), ptr)
            }
            None => {
                self.stats.misses += 1;
                let base = self.new_segment(stream, small, size, bytes)?;
                (base, base)
            }
        };
        let size = self.carve(seg, ptr, size);
        Ok(self.register(LiveBlock { ptr, size, owner: stream, seg, uses: Vec::new() }))
    }

    /// Device address of a live block.
    pub fn ptr(&self, b: BlockId) -> u64 {
        self.live_block(b, "ptr").ptr
    }

    /// Usable bytes at `ptr(b)`: the request rounded up to `MIN_BLOCK`, or more when the rest of
    /// the chunk was too small to split off.
    pub fn size(&self, b: BlockId) -> usize {
        self.live_block(b, "size").size
    }

    /// The stream the block was allocated on.
    pub fn owner(&self, b: BlockId) -> D::Stream {
        self.live_block(b, "owner").owner
    }

    /// Note that work on `stream` uses the block; no-op for the owner (stream order covers it).
    pub fn record_use(&mut self, b: BlockId, stream: D::Stream) {
        let unsafe_reuse = self.mode == Mode::UnsafeReuse;
        let blk = self.live_block_mut(b, "record_use");
        // UnsafeReuse exists to show what forgetting this costs, so it forgets it.
        if stream != blk.owner && !unsafe_reuse && !blk.uses.contains(&stream) {
            blk.uses.push(stream);
        }
    }

    /// Return a block. Reusable at once by its owner if it had no foreign uses, else deferred.
    pub fn free(&mut self, b: BlockId) {
        let blk = self.live.remove(&b).unwrap_or_else(|| {
            panic!("CachingAllocator::free: {b:?} is not live (double free, or an id from another allocator)")
        });
        self.stats.allocated -= blk.size;
        // One event per foreign stream captures everything it enqueued so far, including the
        // last use of this block: once all are done, only the owner can still touch it.
        let events: Vec<D::Event> = blk.uses.iter().map(|&s| self.dev.record(s)).collect();
        if self.mode == Mode::FreeAsync {
            for ev in &events {
                self.dev.wait(blk.owner, ev);
            }
            self.dev.free_async(blk.ptr, blk.owner);
            self.stats.reserved -= blk.size;
            return;
        }
        if events.is_empty() {
            self.release(blk.seg, blk.ptr);
        } else {
            self.set_state(blk.seg, blk.ptr, ChunkState::Deferred);
            self.deferred.push(DeferredFree { seg: blk.seg, ptr: blk.ptr, events });
            self.stats.deferred_frees += 1;
        }
    }

    /// Return every wholly free segment to the device (after sweeping finished deferrals).
    pub fn empty_cache(&mut self) {
        self.release_free_segments();
    }

    pub fn stats(&self) -> AllocStats {
        AllocStats { pending_deferred: self.deferred.len(), segments: self.segments.len(), ..self.stats }
    }

    pub fn device(&mut self) -> &mut D {
        &mut self.dev
    }

    // ---- internals ----

    fn oom(&self, requested: usize) -> AllocError {
        AllocError::OutOfMemory { requested, reserved: self.stats.reserved, allocated: self.stats.allocated }
    }

    fn register(&mut self, blk: LiveBlock<D::Stream>) -> BlockId {
        let id = BlockId(self.next_id);
        self.next_id += 1;
        self.stats.allocated += blk.size;
        if self.stats.allocated > self.stats.peak_allocated {
            self.stats.peak_allocated = self.stats.allocated;
            self.stats.peak_region = crate::backend::profile::current();
        }
        self.live.insert(id, blk);
        id
    }

    fn live_block(&self, b: BlockId, what: &str) -> &LiveBlock<D::Stream> {
        self.live.get(&b).unwrap_or_else(|| panic!("CachingAllocator::{what}: {b:?} is not live (used after free)"))
    }

    fn live_block_mut(&mut self, b: BlockId, what: &str) -> &mut LiveBlock<D::Stream> {
        self.live.get_mut(&b).unwrap_or_else(|| panic!("CachingAllocator::{what}: {b:?} is not live (used after free)"))
    }

    fn alloc_stream_ordered(&mut self, stream: D::Stream, bytes: usize, size: usize) -> Result<BlockId, AllocError> {
        self.stats.misses += 1;
        let ptr = match self.dev.alloc_async(size, stream) {
            Ok(ptr) => ptr,
            // Nothing is cached here to give back, so there is nothing to retry with.
            Err(AllocError::OutOfMemory { .. }) => return Err(self.oom(bytes)),
            Err(e) => return Err(e),
        };
        self.stats.reserved += size;
        Ok(self.register(LiveBlock { ptr, size, owner: stream, seg: 0, uses: Vec::new() }))
    }

    fn segment_base(&self, ptr: u64) -> u64 {
        match self.segments.range(..=ptr).next_back() {
            Some((&base, seg)) if ptr < base + seg.size as u64 => base,
            _ => panic!("CachingAllocator: no segment holds {ptr:#x} (internal bookkeeping bug)"),
        }
    }

    /// Smallest free chunk of the stream's pool that fits, lowest address on ties; removed from
    /// the pool (still `Free` in its segment until `carve`).
    fn take_best_fit(&mut self, stream: D::Stream, small: bool, size: usize) -> Option<u64> {
        let pool = self.pools.get_mut(&(stream, small))?;
        let &(found, ptr) = pool.range((size, 0)..).next()?;
        pool.remove(&(found, ptr));
        Some(ptr)
    }

    /// A new segment holding one free chunk (not in any pool), for a request of `size` bytes.
    fn new_segment(
        &mut self,
        stream: D::Stream,
        small: bool,
        size: usize,
        requested: usize,
    ) -> Result<u64, AllocError> {
        let seg_size = segment_size(size).ok_or_else(|| self.oom(requested))?;
        let base = match self.dev.raw_alloc(seg_size) {
            Ok(base) => base,
            Err(AllocError::OutOfMemory { .. }) => {
                // Retrying is only worth a driver call if emptying the cache gave something back.
                if self.release_free_segments() == 0 {
                    return Err(self.oom(requested));
                }
                match self.dev.raw_alloc(seg_size) {
                    Ok(base) => base,
                    Err(AllocError::OutOfMemory { .. }) => return Err(self.oom(requested)),
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        self.stats.reserved += seg_size;
        if self.mode == Mode::PoisonOnFree {
            // Fresh memory reads as NaN too, not as whatever the driver left there. On the owner
            // stream, before the first block of it is handed out.
            self.dev.poison(base, seg_size, stream);
        }
        let mut chunks = BTreeMap::new();
        chunks.insert(base, Chunk { size: seg_size, state: ChunkState::Free });
        self.segments.insert(base, Segment { size: seg_size, owner: stream, small, chunks });
        Ok(base)
    }

    /// Mark the free chunk at `ptr` live for a `size`-byte request, splitting off the rest into
    /// the pool when it is big enough. Returns the block's size.
    fn carve(&mut self, seg_base: u64, ptr: u64, size: usize) -> usize {
        let seg = self.segments.get_mut(&seg_base).expect("carve: segment exists");
        let chunk = seg.chunks.get_mut(&ptr).expect("carve: chunk exists");
        debug_assert_eq!(chunk.state, ChunkState::Free);
        let rest = chunk.size - size;
        let min_rest = if seg.small { MIN_BLOCK } else { LARGE_SPLIT_MIN };
        chunk.state = ChunkState::Live;
        if rest < min_rest {
            return chunk.size;
        }
        chunk.size = size;
        let rest_ptr = ptr + size as u64;
        seg.chunks.insert(rest_ptr, Chunk { size: rest, state: ChunkState::Free });
        self.pools.entry((seg.owner, seg.small)).or_default().insert((rest, rest_ptr));
        size
    }

    fn set_state(&mut self, seg_base: u64, ptr: u64, state: ChunkState) {
        let seg = self.segments.get_mut(&seg_base).expect("set_state: segment exists");
        seg.chunks.get_mut(&ptr).expect("set_state: chunk exists").state = state;
    }

    /// The chunk at `ptr` becomes reusable by its owner: poison it (if asked), merge it with free
    /// neighbours, put the result in the owner's pool.
    fn release(&mut self, seg_base: u64, ptr: u64) {
        let seg = self.segments.get_mut(&seg_base).expect("release: segment exists");
        let pool = self.pools.entry((seg.owner, seg.small)).or_default();
        let own = seg.chunks[&ptr].size;
        if self.mode == Mode::PoisonOnFree {
            // Only this chunk: its free neighbours were poisoned when they were freed. Enqueued on
            // the owner stream, so it runs after the owner's last use and before its next one.
            self.dev.poison(ptr, own, seg.owner);
        }
        let (mut start, mut size) = (ptr, own);
        // Chunks tile the segment, so the nearest chunks below and above are the neighbours.
        let prev = seg.chunks.range(..ptr).next_back().map(|(&p, c)| (p, c.size, c.state));
        if let Some((p, psize, ChunkState::Free)) = prev {
            pool.remove(&(psize, p));
            seg.chunks.remove(&ptr);
            start = p;
            size += psize;
        }
        let end = ptr + own as u64;
        if let Some(next) = seg.chunks.get(&end) {
            if next.state == ChunkState::Free {
                pool.remove(&(next.size, end));
                size += next.size;
                seg.chunks.remove(&end);
            }
        }
        let chunk = seg.chunks.get_mut(&start).expect("release: merged chunk exists");
        chunk.size = size;
        chunk.state = ChunkState::Free;
        pool.insert((size, start));
    }

    /// Move deferred blocks whose events have all completed into their owners' pools.
    fn sweep_deferred(&mut self) {
        if self.deferred.is_empty() {
            return;
        }
        let dev = &mut self.dev;
        let mut ready = Vec::new();
        self.deferred.retain_mut(|d| {
            // Drop each event once it is seen done, so later sweeps query only the pending ones.
            d.events.retain(|ev| !dev.done(ev));
            if d.events.is_empty() {
                ready.push((d.seg, d.ptr));
            }
            !d.events.is_empty()
        });
        for (seg, ptr) in ready {
            self.release(seg, ptr);
        }
    }

    /// `empty_cache`'s body; returns the bytes given back.
    fn release_free_segments(&mut self) -> usize {
        if self.mode == Mode::FreeAsync {
            return 0;
        }
        self.sweep_deferred();
        let wholly_free: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| s.chunks.len() == 1 && s.chunks.values().all(|c| c.state == ChunkState::Free))
            .map(|(&base, _)| base)
            .collect();
        let mut freed = 0;
        for base in wholly_free {
            let seg = self.segments.remove(&base).expect("segment listed above");
            if let Some(pool) = self.pools.get_mut(&(seg.owner, seg.small)) {
                pool.remove(&(seg.size, base));
            }
            self.dev.raw_free(base);
            self.stats.reserved -= seg.size;
            freed += seg.size;
        }
        freed
    }
}

impl<D: DeviceMem> Drop for CachingAllocator<D> {
    fn drop(&mut self) {
        // Cached memory would otherwise stay reserved until the context dies. raw_free waits for
        // queued work, so this is safe even with deferrals pending or blocks still live.
        if self.mode == Mode::FreeAsync {
            let ids: Vec<BlockId> = self.live.keys().copied().collect();
            for id in ids {
                self.free(id);
            }
        }
        self.deferred.clear();
        for base in std::mem::take(&mut self.segments).into_keys() {
            self.dev.raw_free(base);
        }
    }
}

#[cfg(test)]
impl<D: DeviceMem> CachingAllocator<D> {
    /// Free chunks of one pool as (ptr, size), by address.
    fn free_blocks(&self, stream: D::Stream, small: bool) -> Vec<(u64, usize)> {
        let mut v: Vec<(u64, usize)> =
            self.pools.get(&(stream, small)).map(|p| p.iter().map(|&(s, p)| (p, s)).collect()).unwrap_or_default();
        v.sort_unstable();
        v
    }

    /// The bookkeeping agrees with itself: chunks tile their segments, no two free chunks are
    /// adjacent (merging is complete), pools hold exactly the free chunks, counters add up.
    fn check_invariants(&self) -> Result<(), String> {
        let (mut free_chunks, mut deferred_chunks, mut live_chunks) = (0usize, 0usize, BTreeMap::new());
        for (&base, seg) in &self.segments {
            let (mut at, mut prev_free) = (base, false);
            for (&p, c) in &seg.chunks {
                if p != at || c.size == 0 || c.size % MIN_BLOCK != 0 {
                    return Err(format!("segment {base:#x}: chunk {p:#x}+{} does not continue at {at:#x}", c.size));
                }
                match c.state {
                    ChunkState::Free => {
                        if prev_free {
                            return Err(format!(
                                "segment {base:#x}: free chunk {p:#x} not merged with its free neighbour"
                            ));
                        }
                        if !self.pools.get(&(seg.owner, seg.small)).is_some_and(|pool| pool.contains(&(c.size, p))) {
                            return Err(format!("free chunk {p:#x}+{} missing from its owner's pool", c.size));
                        }
                        free_chunks += 1;
                    }
                    ChunkState::Deferred => deferred_chunks += 1,
                    ChunkState::Live => {
                        live_chunks.insert(p, (c.size, base, seg.owner));
                    }
                }
                prev_free = c.state == ChunkState::Free;
                at = p + c.size as u64;
            }
            if at != base + seg.size as u64 {
                return Err(format!("segment {base:#x}: chunks end at {at:#x}, not at its end"));
            }
        }
        let pooled: usize = self.pools.values().map(BTreeSet::len).sum();
        if pooled != free_chunks {
            return Err(format!("{pooled} pool entries but {free_chunks} free chunks"));
        }
        if deferred_chunks != self.deferred.len() {
            return Err(format!("{deferred_chunks} deferred chunks but {} deferred entries", self.deferred.len()));
        }
        if self.mode != Mode::FreeAsync {
            if live_chunks.len() != self.live.len() {
                return Err(format!("{} live chunks but {} live blocks", live_chunks.len(), self.live.len()));
            }
            for (id, b) in &self.live {
                if live_chunks.get(&b.ptr) != Some(&(b.size, b.seg, b.owner)) {
                    return Err(format!("{id:?} at {:#x}+{} has no matching live chunk", b.ptr, b.size));
                }
            }
            let held: usize = self.segments.values().map(|s| s.size).sum();
            if held != self.stats.reserved {
                return Err(format!("segments hold {held} bytes, stats.reserved says {}", self.stats.reserved));
            }
        }
        let live_bytes: usize = self.live.values().map(|b| b.size).sum();
        if live_bytes != self.stats.allocated {
            return Err(format!("live blocks hold {live_bytes} bytes, stats.allocated says {}", self.stats.allocated));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    const MIB: usize = 1 << 20;

    /// An event: the count of work items enqueued on `stream` when it was recorded.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct SimEvent {
        stream: usize,
        count: u64,
    }

    #[derive(Clone, Debug, PartialEq, Eq)]
    enum Call {
        RawAlloc {
            bytes: usize,
            ok: bool,
        },
        RawFree {
            ptr: u64,
        },
        Record {
            stream: usize,
        },
        Wait {
            stream: usize,
            ev: SimEvent,
        },
        /// `after`: the stream's enqueued count once the fill is queued (done when completed >= it).
        Poison {
            ptr: u64,
            bytes: usize,
            stream: usize,
            after: u64,
        },
        AllocAsync {
            bytes: usize,
            stream: usize,
        },
        FreeAsync {
            ptr: u64,
            stream: usize,
        },
    }

    /// Streams are indices, each with an enqueued and a completed counter; the test moves
    /// `completed` forward (never past `enqueued`). Raw memory is first fit below a capacity, so
    /// addresses do get reused after `raw_free`.
    struct SimDevice {
        enqueued: Vec<u64>,
        completed: Vec<u64>,
        capacity: usize,
        raw: BTreeMap<u64, usize>,
        asyncs: BTreeMap<u64, usize>,
        next_async: u64,
        log: Vec<Call>,
    }

    const RAW_BASE: u64 = 1 << 32;
    const ASYNC_BASE: u64 = 1 << 44;

    impl SimDevice {
        fn new(streams: usize, capacity: usize) -> Self {
            Self {
                enqueued: vec![0; streams],
                completed: vec![0; streams],
                capacity,
                raw: BTreeMap::new(),
                asyncs: BTreeMap::new(),
                next_async: ASYNC_BASE,
                log: Vec::new(),
            }
        }
        fn enqueue(&mut self, stream: usize, n: u64) {
            self.enqueued[stream] += n;
        }
        fn progress(&mut self, stream: usize, n: u64) {
            self.completed[stream] = (self.completed[stream] + n).min(self.enqueued[stream]);
        }
        fn complete_all(&mut self) {
            self.completed.clone_from(&self.enqueued);
        }
        fn raw_bytes(&self) -> usize {
            self.raw.values().sum()
        }
        fn async_bytes(&self) -> usize {
            self.asyncs.values().sum()
        }
        /// Is [ptr, ptr+size) inside one allocation the device handed out?
        fn holds(&self, ptr: u64, size: usize) -> bool {
            [&self.raw, &self.asyncs]
                .iter()
                .any(|m| m.range(..=ptr).next_back().is_some_and(|(&p, &s)| ptr + size as u64 <= p + s as u64))
        }
    }

    impl DeviceMem for SimDevice {
        type Stream = usize;
        type Event = SimEvent;
        fn raw_alloc(&mut self, bytes: usize) -> Result<u64, AllocError> {
            let ok = self.raw_bytes().checked_add(bytes).is_some_and(|t| t <= self.capacity);
            self.log.push(Call::RawAlloc { bytes, ok });
            if !ok {
                return Err(AllocError::OutOfMemory { requested: bytes, reserved: 0, allocated: 0 });
            }
            let mut at = RAW_BASE;
            for (&p, &s) in &self.raw {
                if p - at >= bytes as u64 {
                    break;
                }
                at = p + s as u64;
            }
            self.raw.insert(at, bytes);
            Ok(at)
        }
        fn raw_free(&mut self, ptr: u64) {
            assert!(self.raw.remove(&ptr).is_some(), "raw_free of {ptr:#x}, which is not a raw allocation");
            self.log.push(Call::RawFree { ptr });
            // cuMemFree synchronizes the device: all queued work finishes first.
            self.complete_all();
        }
        fn record(&mut self, stream: usize) -> SimEvent {
            self.log.push(Call::Record { stream });
            SimEvent { stream, count: self.enqueued[stream] }
        }
        fn done(&mut self, ev: &SimEvent) -> bool {
            self.completed[ev.stream] >= ev.count
        }
        fn wait(&mut self, stream: usize, ev: &SimEvent) {
            self.log.push(Call::Wait { stream, ev: *ev });
        }
        fn poison(&mut self, ptr: u64, bytes: usize, stream: usize) {
            self.enqueue(stream, 1); // the fill is work on that stream
            self.log.push(Call::Poison { ptr, bytes, stream, after: self.enqueued[stream] });
        }
        fn alloc_async(&mut self, bytes: usize, stream: usize) -> Result<u64, AllocError> {
            if self.async_bytes() + bytes > self.capacity {
                return Err(AllocError::OutOfMemory { requested: bytes, reserved: 0, allocated: 0 });
            }
            self.log.push(Call::AllocAsync { bytes, stream });
            // Never reused: the driver's stream-ordered pool is not what is under test here.
            let ptr = self.next_async;
            self.next_async += bytes as u64;
            self.asyncs.insert(ptr, bytes);
            Ok(ptr)
        }
        fn free_async(&mut self, ptr: u64, stream: usize) {
            assert!(self.asyncs.remove(&ptr).is_some(), "free_async of {ptr:#x}, which is not live");
            self.log.push(Call::FreeAsync { ptr, stream });
        }
    }

    // ---- randomized model check ----

    const STREAMS: usize = 5;
    const CAPACITY: usize = 48 * MIB; // small enough that the OOM-retry path runs in most sequences

    #[derive(Clone, Debug)]
    enum Op {
        Alloc {
            stream: usize,
            bytes: usize,
        },
        /// Owner-side (or any) work enqueued on a stream.
        Work {
            stream: usize,
            n: u64,
        },
        /// Use of a live block (picked modulo the live count) on a foreign stream.
        Use {
            pick: usize,
            stream: usize,
            n: u64,
        },
        Free {
            pick: usize,
        },
        Progress {
            stream: usize,
            n: u64,
        },
        EmptyCache,
    }

    fn op_strategy() -> impl Strategy<Value = Op> {
        let bytes = prop_oneof![
            1 => Just(0usize),
            4 => 1usize..=4096,
            3 => 4097usize..=SMALL_REQUEST,
            2 => SMALL_REQUEST + 1..=12 * MIB,
        ];
        // EmptyCache is rare because raw_free completes all work, which would hide deferrals.
        prop_oneof![
            24 => (0..STREAMS, bytes).prop_map(|(stream, bytes)| Op::Alloc { stream, bytes }),
            8 => (0..STREAMS, 1u64..4).prop_map(|(stream, n)| Op::Work { stream, n }),
            12 => (any::<usize>(), 0..STREAMS, 1u64..4).prop_map(|(pick, stream, n)| Op::Use { pick, stream, n }),
            24 => any::<usize>().prop_map(|pick| Op::Free { pick }),
            12 => (0..STREAMS, 0u64..6).prop_map(|(stream, n)| Op::Progress { stream, n }),
            1 => Just(Op::EmptyCache),
        ]
    }

    #[derive(Debug)]
    enum Violation {
        /// Memory handed to (or poisoned on) a stream while another stream's work on it is pending.
        Hazard(String),
        /// Anything else: overlap, wrong accounting, broken bookkeeping.
        Broken(String),
    }

    struct LiveRec {
        id: BlockId,
        ptr: u64,
        size: usize,
        owner: usize,
        uses: Vec<usize>,
    }

    /// A freed range and, per stream that touched it, the work count that must complete before a
    /// different stream may touch it again.
    struct FreedRange {
        ptr: u64,
        size: usize,
        pending: Vec<(usize, u64)>,
    }

    /// Drives the allocator and keeps its own model of the truth (which streams touched what).
    struct Harness {
        a: CachingAllocator<SimDevice>,
        live: Vec<LiveRec>,
        freed: Vec<FreedRange>,
        frees: usize,
        poisons: usize,
        log_seen: usize,
        /// Block handed out by this step, if any: a sweep inside that `alloc` may poison it just
        /// before handing it out, which is fine when the poison is on the same stream.
        fresh: Option<BlockId>,
    }

    impl Harness {
        fn new(mode: Mode) -> Self {
            let a = CachingAllocator::new(SimDevice::new(STREAMS, CAPACITY), mode);
            Self { a, live: Vec::new(), freed: Vec::new(), frees: 0, poisons: 0, log_seen: 0, fresh: None }
        }

        fn caching(&self) -> bool {
            self.a.mode() != Mode::FreeAsync
        }

        /// Stream `stream` is about to write [ptr, ptr+size): every other stream's recorded work
        /// on any overlapping freed range must have completed.
        fn hazard(&self, ptr: u64, size: usize, stream: usize, what: &str) -> Result<(), Violation> {
            let completed = &self.a.dev.completed;
            for f in &self.freed {
                if ptr < f.ptr + f.size as u64 && f.ptr < ptr + size as u64 {
                    for &(x, c) in &f.pending {
                        if x != stream && completed[x] < c {
                            return Err(Violation::Hazard(format!(
                                "{what} of {ptr:#x}+{size} on stream {stream} while stream {x} has work \
                                 pending on it (completed {} < {c}; freed range {:#x}+{})",
                                completed[x], f.ptr, f.size
                            )));
                        }
                    }
                }
            }
            Ok(())
        }

        fn apply(&mut self, op: &Op) -> Result<(), Violation> {
            match *op {
                Op::Alloc { stream, bytes } => match self.a.alloc(stream, bytes) {
                    Ok(id) => {
                        let (ptr, size, owner) = (self.a.ptr(id), self.a.size(id), self.a.owner(id));
                        if owner != stream || size < bytes.max(1) || size % MIN_BLOCK != 0 {
                            return Err(Violation::Broken(format!(
                                "alloc({stream}, {bytes}) gave {ptr:#x}+{size} on {owner}"
                            )));
                        }
                        self.hazard(ptr, size, stream, "alloc")?;
                        self.live.push(LiveRec { id, ptr, size, owner, uses: Vec::new() });
                        self.fresh = Some(id);
                    }
                    Err(AllocError::OutOfMemory { requested, .. }) => {
                        let dev = &self.a.dev;
                        let need = round_request(bytes).and_then(segment_size).unwrap_or(usize::MAX);
                        let fits = if self.caching() {
                            dev.raw_bytes() + need <= CAPACITY
                        } else {
                            dev.async_bytes() + round_request(bytes).unwrap_or(usize::MAX) <= CAPACITY
                        };
                        if requested != bytes || fits {
                            return Err(Violation::Broken(format!("OOM for {bytes} (reported {requested}) that fits")));
                        }
                    }
                    Err(e) => return Err(Violation::Broken(format!("unexpected error {e}"))),
                },
                Op::Work { stream, n } => self.a.dev.enqueue(stream, n),
                Op::Use { pick, stream, n } => {
                    if self.live.is_empty() {
                        return Ok(());
                    }
                    let len = self.live.len();
                    let r = &mut self.live[pick % len];
                    let s = (r.owner + 1 + stream % (STREAMS - 1)) % STREAMS; // always foreign
                    self.a.record_use(r.id, s);
                    self.a.dev.enqueue(s, n);
                    if !r.uses.contains(&s) {
                        r.uses.push(s);
                    }
                }
                Op::Free { pick } => {
                    if self.live.is_empty() {
                        return Ok(());
                    }
                    let len = self.live.len();
                    let r = self.live.swap_remove(pick % len);
                    let enq = self.a.dev.enqueued.clone();
                    let mark = self.a.dev.log.len();
                    self.a.free(r.id);
                    self.frees += 1;
                    if !self.caching() {
                        self.check_free_async(&r, &enq, mark)?;
                    }
                    let pending = std::iter::once(r.owner).chain(r.uses.iter().copied()).map(|s| (s, enq[s])).collect();
                    self.freed.push(FreedRange { ptr: r.ptr, size: r.size, pending });
                }
                Op::Progress { stream, n } => self.a.dev.progress(stream, n),
                Op::EmptyCache => self.a.empty_cache(),
            }
            Ok(())
        }

        /// FreeAsync: the owner stream waited, before free_async, on an event covering each
        /// foreign use.
        fn check_free_async(&self, r: &LiveRec, enq: &[u64], mark: usize) -> Result<(), Violation> {
            let calls = &self.a.dev.log[mark..];
            let Some(k) = calls.iter().position(|c| *c == Call::FreeAsync { ptr: r.ptr, stream: r.owner }) else {
                return Err(Violation::Broken(format!("free of {:#x} did not call free_async on its owner", r.ptr)));
            };
            for &u in &r.uses {
                let waited = calls[..k].iter().any(|c| {
                    matches!(c, Call::Wait { stream, ev } if *stream == r.owner && ev.stream == u && ev.count >= enq[u])
                });
                if !waited {
                    return Err(Violation::Hazard(format!("free_async of {:#x} without waiting on stream {u}", r.ptr)));
                }
            }
            Ok(())
        }

        /// Invariants that hold after every step.
        fn check(&mut self) -> Result<(), Violation> {
            let fresh = self.fresh.take();
            let new_calls = self.a.dev.log[self.log_seen..].to_vec();
            self.log_seen = self.a.dev.log.len();
            for c in new_calls {
                if let Call::Poison { ptr, bytes, stream, after } = c {
                    self.poisons += 1;
                    self.hazard(ptr, bytes, stream, "poison")?;
                    // A fill overlapping a live block is a bug unless it finished before the block
                    // could be used (a raw_free in between waits for it), or it was queued on the
                    // owner just before this step handed the block out.
                    let finished = self.a.dev.completed[stream] >= after;
                    let overlaps = |r: &&LiveRec| ptr < r.ptr + r.size as u64 && r.ptr < ptr + bytes as u64;
                    let ordered_before_use = |r: &&LiveRec| Some(r.id) == fresh && r.owner == stream;
                    if !finished && self.live.iter().filter(overlaps).any(|r| !ordered_before_use(&r)) {
                        return Err(Violation::Broken(format!(
                            "poisoned {ptr:#x}+{bytes}, which overlaps a live block"
                        )));
                    }
                }
            }
            let mut spans: Vec<(u64, usize)> = self.live.iter().map(|r| (r.ptr, r.size)).collect();
            spans.sort_unstable();
            for w in spans.windows(2) {
                if w[0].0 + w[0].1 as u64 > w[1].0 {
                    return Err(Violation::Broken(format!(
                        "live blocks overlap: {:#x}+{} and {:#x}",
                        w[0].0, w[0].1, w[1].0
                    )));
                }
            }
            for r in &self.live {
                if (self.a.ptr(r.id), self.a.size(r.id), self.a.owner(r.id)) != (r.ptr, r.size, r.owner) {
                    return Err(Violation::Broken(format!("{:?} changed under its user", r.id)));
                }
                if !self.a.dev.holds(r.ptr, r.size) {
                    return Err(Violation::Broken(format!(
                        "live block {:#x}+{} is outside device memory",
                        r.ptr, r.size
                    )));
                }
            }
            let st = self.a.stats();
            let live_bytes: usize = self.live.iter().map(|r| r.size).sum();
            if st.allocated != live_bytes || st.reserved < st.allocated || st.peak_allocated < st.allocated {
                return Err(Violation::Broken(format!("stats {st:?} but live blocks hold {live_bytes}")));
            }
            if self.caching() && (st.reserved != self.a.dev.raw_bytes() || st.segments != self.a.dev.raw.len()) {
                return Err(Violation::Broken(format!("stats {st:?} disagree with the device's raw allocations")));
            }
            self.a.check_invariants().map_err(Violation::Broken)?;
            let completed = &self.a.dev.completed;
            self.freed.retain(|f| f.pending.iter().any(|&(x, c)| completed[x] < c));
            Ok(())
        }

        /// Free everything, let all work finish, empty the cache: nothing may be left.
        fn finish(mut self) -> Result<(), Violation> {
            while !self.live.is_empty() {
                self.apply(&Op::Free { pick: 0 })?;
                self.check()?;
            }
            self.a.dev.complete_all();
            self.a.empty_cache();
            self.check()?;
            let st = self.a.stats();
            let clean = st.reserved == 0 && st.allocated == 0 && st.pending_deferred == 0 && st.segments == 0;
            if !clean || !self.a.dev.raw.is_empty() || !self.a.dev.asyncs.is_empty() {
                return Err(Violation::Broken(format!("left over after everything was freed: {st:?}")));
            }
            // One fill per free and one per segment reserved.
            let segments = self.a.dev.log.iter().filter(|c| matches!(c, Call::RawAlloc { ok: true, .. })).count();
            let want = if self.a.mode() == Mode::PoisonOnFree { self.frees + segments } else { 0 };
            if self.poisons != want {
                return Err(Violation::Broken(format!(
                    "{} poisons for {} frees and {segments} segments",
                    self.poisons, self.frees
                )));
            }
            Ok(())
        }
    }

    fn run_ops(mode: Mode, ops: &[Op]) -> Result<(), Violation> {
        let mut h = Harness::new(mode);
        for (i, op) in ops.iter().enumerate() {
            h.apply(op).and_then(|()| h.check()).map_err(|v| match v {
                Violation::Hazard(m) => Violation::Hazard(format!("step {i} {op:?}: {m}")),
                Violation::Broken(m) => Violation::Broken(format!("step {i} {op:?}: {m}")),
            })?;
        }
        h.finish()
    }

    fn config() -> ProptestConfig {
        // No regression files next to the source: a failure prints its shrunk op list instead.
        ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() }
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn random_ops_keep_every_invariant_normal(ops in proptest::collection::vec(op_strategy(), 1..800)) {
            run_ops(Mode::Normal, &ops).map_err(|v| TestCaseError::fail(format!("{v:?}")))?;
        }

        #[test]
        fn random_ops_keep_every_invariant_poison_on_free(ops in proptest::collection::vec(op_strategy(), 1..800)) {
            run_ops(Mode::PoisonOnFree, &ops).map_err(|v| TestCaseError::fail(format!("{v:?}")))?;
        }

        #[test]
        fn random_ops_keep_every_invariant_free_async(ops in proptest::collection::vec(op_strategy(), 1..800)) {
            run_ops(Mode::FreeAsync, &ops).map_err(|v| TestCaseError::fail(format!("{v:?}")))?;
        }
    }

    /// The checker has teeth: the same random sequences that are clean in Normal mode make
    /// UnsafeReuse hand out memory a foreign stream is still using, and nothing else goes wrong.
    #[test]
    fn unsafe_reuse_reproduces_the_cross_stream_corruption() {
        let script = [
            Op::Alloc { stream: 0, bytes: 4096 },
            Op::Use { pick: 0, stream: 0, n: 1 }, // stream 1 reads it
            Op::Free { pick: 0 },
            Op::Alloc { stream: 0, bytes: 4096 }, // stream 0 writes it while stream 1 may still read
        ];
        run_ops(Mode::Normal, &script).unwrap();
        assert!(matches!(run_ops(Mode::UnsafeReuse, &script), Err(Violation::Hazard(_))));

        let mut runner = TestRunner::deterministic();
        let strategy = proptest::collection::vec(op_strategy(), 200..400);
        let mut hazards = 0;
        for _ in 0..50 {
            let ops = strategy.new_tree(&mut runner).unwrap().current();
            run_ops(Mode::Normal, &ops).unwrap();
            match run_ops(Mode::UnsafeReuse, &ops) {
                Ok(()) => {}
                Err(Violation::Hazard(_)) => hazards += 1,
                Err(v @ Violation::Broken(_)) => panic!("UnsafeReuse broke something other than stream order: {v:?}"),
            }
        }
        assert!(hazards >= 10, "UnsafeReuse produced only {hazards} hazards in 50 random runs");
    }

    fn allocator(mode: Mode, streams: usize, capacity: usize) -> CachingAllocator<SimDevice> {
        CachingAllocator::new(SimDevice::new(streams, capacity), mode)
    }

    #[test]
    fn same_stream_reuse_is_immediate_foreign_use_waits_for_its_event() {
        let mut a = allocator(Mode::Normal, 2, 64 * MIB);
        let x = a.alloc(0, 4096).unwrap();
        let px = a.ptr(x);
        a.free(x);
        let y = a.alloc(0, 4096).unwrap();
        assert_eq!(a.ptr(y), px, "the owner stream gets its freed block back at once");
        assert_eq!((a.stats().hits, a.stats().misses), (1, 1));
        let z = a.alloc(1, 4096).unwrap();
        assert!(a.ptr(z) >= px + SEGMENT_ROUND as u64, "another stream never takes from stream 0's pool");
        assert_eq!(a.stats().misses, 2);
        a.free(y);
        a.free(z);

        // Fill stream 0's segment with two 1 MiB blocks; the second is read on stream 1.
        let f = a.alloc(0, MIB).unwrap();
        let g = a.alloc(0, MIB).unwrap();
        assert_eq!((a.ptr(f), a.ptr(g)), (px, px + MIB as u64));
        let pg = a.ptr(g);
        a.record_use(g, 1);
        a.device().enqueue(1, 1);
        a.free(g);
        assert_eq!((a.stats().deferred_frees, a.stats().pending_deferred), (1, 1));
        let h = a.alloc(0, MIB).unwrap();
        let k = a.alloc(1, MIB).unwrap();
        for b in [h, k] {
            assert!(a.ptr(b) + MIB as u64 <= pg || a.ptr(b) >= pg + MIB as u64, "deferred block reused early");
        }
        assert_eq!(a.stats().pending_deferred, 1);
        a.device().progress(1, 1);
        let m = a.alloc(0, MIB).unwrap();
        assert_eq!(a.ptr(m), pg, "reusable once stream 1's event completed");
        assert_eq!(a.stats().pending_deferred, 0);
        a.check_invariants().unwrap();
    }

    #[test]
    fn memory_changes_stream_only_through_the_device_after_its_events() {
        let mut a = allocator(Mode::Normal, 2, 64 * MIB);
        let g = a.alloc(0, MIB).unwrap();
        let base = a.ptr(g);
        a.record_use(g, 1);
        a.device().enqueue(1, 1);
        a.free(g);
        a.empty_cache();
        assert_eq!(a.stats().reserved, SEGMENT_ROUND, "a segment with a pending deferral stays");
        let k = a.alloc(1, MIB).unwrap();
        assert!(a.ptr(k) >= base + SEGMENT_ROUND as u64);
        a.device().progress(1, 1);
        a.empty_cache();
        assert_eq!(a.stats().reserved, SEGMENT_ROUND, "only stream 1's segment is left");
        let n = a.alloc(1, 2 * MIB).unwrap();
        assert_eq!((a.ptr(n), a.owner(n)), (base, 1), "the old address comes back from the device to stream 1");
    }

    #[test]
    fn split_and_merge_restore_one_block_in_any_free_order() {
        for order in [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]] {
            let mut a = allocator(Mode::Normal, 1, 64 * MIB);
            let ids = [a.alloc(0, 512).unwrap(), a.alloc(0, 4096).unwrap(), a.alloc(0, 100_000).unwrap()];
            let base = a.ptr(ids[0]);
            assert_eq!((a.ptr(ids[1]), a.ptr(ids[2])), (base + 512, base + 512 + 4096), "carved back to back");
            assert_eq!(a.size(ids[2]), 100_352, "rounded up to 512");
            assert_eq!((a.stats().misses, a.stats().hits, a.stats().segments), (1, 2, 1));
            for i in order {
                a.free(ids[i]);
                a.check_invariants().unwrap();
            }
            assert_eq!(a.free_blocks(0, true), vec![(base, SEGMENT_ROUND)], "order {order:?}");
        }
    }

    #[test]
    fn merge_waits_for_a_deferred_neighbour() {
        let mut a = allocator(Mode::Normal, 2, 64 * MIB);
        let ids = [a.alloc(0, 4096).unwrap(), a.alloc(0, 4096).unwrap(), a.alloc(0, 4096).unwrap()];
        let base = a.ptr(ids[0]);
        a.record_use(ids[1], 1);
        a.device().enqueue(1, 1);
        for id in ids {
            a.free(id);
        }
        let rest = SEGMENT_ROUND - 2 * 4096;
        assert_eq!(a.free_blocks(0, true), vec![(base, 4096), (base + 2 * 4096, rest)]);
        a.device().progress(1, 1);
        a.empty_cache(); // sweeps, merges into one block, and that whole segment goes back
        assert_eq!((a.stats().reserved, a.stats().segments), (0, 0));
    }

    #[test]
    fn large_requests_split_only_big_remainders_and_stay_out_of_the_small_pool() {
        let mut a = allocator(Mode::Normal, 1, 64 * MIB);
        let x = a.alloc(0, 3 * MIB).unwrap();
        assert_eq!(a.size(x), 3 * MIB);
        assert_eq!(a.free_blocks(0, false), vec![(a.ptr(x) + 3 * MIB as u64, MIB)], "1 MiB rest is split off");
        let y = a.alloc(0, 3 * MIB + MIB / 2).unwrap();
        assert_eq!(a.size(y), 4 * MIB, "a 0.5 MiB rest is not worth a block");
        let s = a.alloc(0, 4096).unwrap();
        assert_eq!((a.stats().misses, a.stats().reserved), (3, 10 * MIB), "small requests get their own segment");
        for id in [x, y, s] {
            a.free(id);
        }
        assert_eq!(a.free_blocks(0, false).iter().map(|b| b.1).collect::<Vec<_>>(), vec![4 * MIB, 4 * MIB]);
        a.check_invariants().unwrap();
    }

    #[test]
    fn zero_byte_and_odd_requests_get_distinct_rounded_blocks() {
        let mut a = allocator(Mode::Normal, 1, 64 * MIB);
        let (z0, z1, odd) = (a.alloc(0, 0).unwrap(), a.alloc(0, 0).unwrap(), a.alloc(0, 513).unwrap());
        assert_ne!(a.ptr(z0), a.ptr(z1));
        assert_eq!((a.size(z0), a.size(z1), a.size(odd)), (512, 512, 1024));
        assert_eq!(a.stats().allocated, 2048);
    }

    #[test]
    fn out_of_memory_empties_the_cache_retries_once_then_explains() {
        let mut a = allocator(Mode::Normal, 2, 8 * MIB);
        let x = a.alloc(0, 6 * MIB).unwrap();
        let seg0 = a.ptr(x);
        a.free(x); // cached on stream 0
        let mark = a.device().log.len();
        let y = a.alloc(1, 4 * MIB).unwrap();
        let raw_calls: Vec<Call> =
            a.device().log[mark..].iter().filter(|c| !matches!(c, Call::Record { .. })).cloned().collect();
        assert_eq!(
            raw_calls,
            vec![
                Call::RawAlloc { bytes: 4 * MIB, ok: false },
                Call::RawFree { ptr: seg0 },
                Call::RawAlloc { bytes: 4 * MIB, ok: true },
            ]
        );
        assert_eq!((a.stats().reserved, a.stats().segments), (4 * MIB, 1));

        // Nothing cached to give back: one attempt, then the error.
        let mark = a.device().log.len();
        let err = a.alloc(0, 6 * MIB).unwrap_err();
        assert_eq!(a.device().log[mark..], [Call::RawAlloc { bytes: 6 * MIB, ok: false }]);
        assert_eq!(err, AllocError::OutOfMemory { requested: 6 * MIB, reserved: 4 * MIB, allocated: 4 * MIB });
        let text = err.to_string();
        for want in [
            "asked for 6291456 bytes (6.0 MiB)",
            "holds 4194304 bytes (4.0 MiB)",
            "lower the batch size or the sequence length",
        ] {
            assert!(text.contains(want), "{text:?} lacks {want:?}");
        }

        // A segment whose block is deferred is not given back until its event completes.
        a.record_use(y, 0);
        a.device().enqueue(0, 1);
        a.free(y);
        assert!(a.alloc(0, 6 * MIB).is_err());
        a.device().progress(0, 1);
        let w = a.alloc(0, 6 * MIB).unwrap();
        assert_eq!((a.size(w), a.stats().reserved), (6 * MIB, 6 * MIB));

        let huge = a.alloc(0, usize::MAX).unwrap_err();
        assert!(matches!(huge, AllocError::OutOfMemory { requested: usize::MAX, .. }));
    }

    #[test]
    fn poison_on_free_fills_each_block_once_when_it_becomes_reusable() {
        let mut a = allocator(Mode::PoisonOnFree, 2, 64 * MIB);
        // (ptr, bytes, stream) of every fill so far.
        let poisons = |a: &mut CachingAllocator<SimDevice>| -> Vec<(u64, usize, usize)> {
            let log = &a.device().log;
            log.iter()
                .filter_map(|c| match *c {
                    Call::Poison { ptr, bytes, stream, .. } => Some((ptr, bytes, stream)),
                    _ => None,
                })
                .collect()
        };
        let x = a.alloc(0, 4096).unwrap();
        let px = a.ptr(x);
        a.free(x);
        // The new segment when it is reserved, then the block at once when freed, on the owner.
        assert_eq!(poisons(&mut a), vec![(px, SEGMENT_ROUND, 0), (px, 4096, 0)]);

        let y = a.alloc(0, 4096).unwrap();
        assert_eq!(a.ptr(y), px);
        a.record_use(y, 1);
        a.device().enqueue(1, 2);
        a.free(y);
        assert_eq!(poisons(&mut a).len(), 2, "not while stream 1 may still read it");
        a.device().progress(1, 1);
        let s = a.alloc(1, 512).unwrap(); // sweeps; the event is not done yet
        let ps = a.ptr(s);
        assert_eq!(poisons(&mut a)[2..], [(ps, SEGMENT_ROUND, 1)], "only stream 1's new segment");
        a.device().progress(1, 1);
        a.free(s);
        let _t = a.alloc(1, 512).unwrap(); // sweeps: y's block is reusable now, so it is poisoned
        a.empty_cache();
        let _u = a.alloc(1, 512).unwrap();
        assert_eq!(
            poisons(&mut a),
            vec![(px, SEGMENT_ROUND, 0), (px, 4096, 0), (ps, SEGMENT_ROUND, 1), (ps, 512, 1), (px, 4096, 0)],
            "once per segment and once per free, no more"
        );
    }

    #[test]
    fn free_async_waits_for_foreign_uses_then_frees_on_the_owner() {
        let mut a = allocator(Mode::FreeAsync, 3, 64 * MIB);
        let x = a.alloc(0, 1000).unwrap();
        assert_eq!(a.device().log, vec![Call::AllocAsync { bytes: 1024, stream: 0 }]);
        let px = a.ptr(x);
        a.record_use(x, 1);
        a.device().enqueue(1, 3);
        a.record_use(x, 2);
        a.device().enqueue(2, 1);
        a.record_use(x, 0); // the owner: nothing to record
        a.free(x);
        assert_eq!(
            a.device().log[1..],
            [
                Call::Record { stream: 1 },
                Call::Record { stream: 2 },
                Call::Wait { stream: 0, ev: SimEvent { stream: 1, count: 3 } },
                Call::Wait { stream: 0, ev: SimEvent { stream: 2, count: 1 } },
                Call::FreeAsync { ptr: px, stream: 0 },
            ]
        );
        let st = a.stats();
        assert_eq!((st.reserved, st.allocated, st.peak_allocated, st.hits, st.misses), (0, 0, 1024, 0, 1));
        a.empty_cache();
        assert!(!a
            .device()
            .log
            .iter()
            .any(|c| matches!(c, Call::RawAlloc { .. } | Call::RawFree { .. } | Call::Poison { .. })));
    }

    #[test]
    #[should_panic(expected = "is not live (double free")]
    fn double_free_panics() {
        let mut a = allocator(Mode::Normal, 1, 64 * MIB);
        let x = a.alloc(0, 64).unwrap();
        a.free(x);
        a.free(x);
    }

    #[test]
    #[should_panic(expected = "is not live (used after free)")]
    fn use_after_free_panics() {
        let mut a = allocator(Mode::Normal, 2, 64 * MIB);
        let x = a.alloc(0, 64).unwrap();
        a.free(x);
        a.record_use(x, 1);
    }
}
