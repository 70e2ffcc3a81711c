//! A bounded pool of pinned host staging slots for the host-staged transport (DESIGN.md section 1):
//! when target and drafter sit on two GPUs without a peer path, a packed batch travels
//! target GPU -> D2H into a pinned slot -> H2D to the drafter GPU.
//!
//! The pool enforces DESIGN.md section 2, rule 5: a slot is acquired before its D2H is enqueued,
//! is owned by a [`SlotGuard`] from then on, and returns to the pool only after every copy that
//! reads or writes it has completed (the events given to [`SlotGuard::release_after`], normally
//! the consumer's H2D). That holds on every path: success, error, panic unwinding and shutdown,
//! because the only way a slot goes back is the guard's `Drop`. A slot is never reused while a
//! copy may still touch it; a slot whose copy can no longer be confirmed complete is leaked, never
//! reused or freed. The pool is bounded: `acquire` blocks (with a timeout) instead of allocating,
//! and shutdown wakes every blocked caller, so a failed `put` can neither leak a slot nor deadlock.
//!
//! The pool is generic over the memory and event primitives ([`SlotMemory`]), so its logic is
//! tested here with a simulated memory whose events complete when the test says so. The CUDA
//! implementation allocates slots with `cuMemHostAlloc` *without* `CU_MEMHOSTALLOC_WRITECOMBINED`
//! (write-combined memory is very slow for the host to read, DESIGN.md section 7), and its events
//! are `cuEventRecord`s made right after the H2D on the consumer's stream.

use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

pub use crate::backend::slots::{SlotError, SlotMemory};

/// How often a blocked `acquire` re-queries release events while every unavailable slot is waiting
/// for one. Events complete on the device, which cannot signal our condvar, so a waiter polls them
/// (a guard returned without an event still wakes it at once). 100 us is small next to a staged H2D
/// of a micro-batch (megabytes at tens of GB/s), and a poll is one non-blocking query per slot.
const RELEASE_POLL: Duration = Duration::from_micros(100);

/// What the pool looks like now. `free + in_flight + lost == capacity` at all times.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotStats {
    pub capacity: usize,
    /// Slots ready to be handed out.
    pub free: usize,
    /// Guards alive plus slots returned whose release events have not completed yet.
    pub in_flight: usize,
    /// Slots whose release event could not be waited for at shutdown: leaked, never reused.
    pub lost: usize,
    /// Successful `acquire` calls.
    pub acquires: u64,
    /// `acquire` calls that found no free slot and had to block (whether they got one or not).
    pub waits: u64,
    /// The most slots in flight at once.
    pub max_in_use: usize,
}

/// Bookkeeping behind the pool's mutex.
struct Inner<S, E> {
    free: Vec<S>,
    /// Returned by their guard, waiting for every one of their release events.
    pending: Vec<(S, Vec<E>)>,
    /// Guards alive.
    in_use: usize,
    /// Taken out of `pending` by `shutdown` while it waits for their events.
    draining: usize,
    lost: usize,
    closed: bool,
    acquires: u64,
    waits: u64,
    max_in_use: usize,
}

impl<S, E> Inner<S, E> {
    fn in_flight(&self) -> usize {
        self.in_use + self.pending.len() + self.draining
    }
}

/// `capacity` pinned host slots of `bytes` each, all allocated up front.
pub struct SlotPool<M: SlotMemory> {
    mem: Arc<M>,
    capacity: usize,
    bytes: usize,
    inner: Mutex<Inner<M::Slot, M::Event>>,
    /// Signalled when a guard returns a slot, and at shutdown.
    returned: Condvar,
}

impl<M: SlotMemory> SlotPool<M> {
    pub fn new(mem: Arc<M>, slots: usize, bytes: usize) -> Result<Arc<Self>, SlotError> {
        if slots == 0 {
            return Err(SlotError::Alloc("a slot pool needs at least one slot (got 0)".into()));
        }
        if bytes == 0 {
            return Err(SlotError::Alloc("slots of 0 bytes: size them for the largest staged micro-batch".into()));
        }
        let mut free = Vec::with_capacity(slots);
        for i in 0..slots {
            // Slots allocated so far are dropped (freed) on failure: no copy has touched them yet.
            let slot = mem.alloc_slot(bytes).map_err(|e| match e {
                SlotError::Alloc(m) => SlotError::Alloc(format!("slot {i} of {slots} ({bytes} bytes each): {m}")),
                e => e,
            })?;
            free.push(slot);
        }
        Ok(Arc::new(Self {
            mem,
            capacity: slots,
            bytes,
            inner: Mutex::new(Inner {
                free,
                // Reserved up front: a guard's drop never allocates.
                pending: Vec::with_capacity(slots),
                in_use: 0,
                draining: 0,
                lost: 0,
                closed: false,
                acquires: 0,
                waits: 0,
                max_in_use: 0,
            }),
            returned: Condvar::new(),
        }))
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Blocks until a slot is free (or `timeout` passes -> `SlotError::Timeout`, or the pool is
    /// shut down -> `SlotError::Closed`). `Duration::ZERO` only tries once.
    pub fn acquire(self: &Arc<Self>, timeout: Duration) -> Result<SlotGuard<M>, SlotError> {
        let start = Instant::now();
        // `None`: the timeout is too far away to represent, i.e. wait for ever.
        let deadline = start.checked_add(timeout);
        let mut blocked = false;
        let mut inner = self.lock();
        loop {
            if inner.closed {
                return Err(SlotError::Closed);
            }
            self.reap(&mut inner);
            if let Some(slot) = inner.free.pop() {
                inner.in_use += 1;
                inner.acquires += 1;
                inner.max_in_use = inner.max_in_use.max(inner.in_flight());
                return Ok(SlotGuard { pool: Arc::clone(self), slot: Some(slot), release: Vec::new() });
            }
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::MAX,
            };
            if left.is_zero() {
                return Err(SlotError::Timeout { waited: start.elapsed() });
            }
            if !blocked {
                blocked = true;
                inner.waits += 1;
            }
            inner = if !inner.pending.is_empty() {
                self.returned.wait_timeout(inner, left.min(RELEASE_POLL)).unwrap_or_else(PoisonError::into_inner).0
            } else if deadline.is_some() {
                self.returned.wait_timeout(inner, left).unwrap_or_else(PoisonError::into_inner).0
            } else {
                self.returned.wait(inner).unwrap_or_else(PoisonError::into_inner)
            };
        }
    }

    /// Closes the pool: every blocked `acquire` returns `Closed` at once, and so does every later
    /// one. Then waits (host-blocking) for the release events of the slots returned so far, so
    /// their memory is idle when this returns. Guards still alive return their slots as usual.
    pub fn shutdown(&self) {
        self.lock().closed = true;
        self.returned.notify_all();
        // One slot at a time, so a guard dropped meanwhile is waited for too; the loop ends
        // because no new guards are handed out.
        loop {
            let (slot, events) = {
                let mut inner = self.lock();
                match inner.pending.pop() {
                    Some(p) => {
                        inner.draining += 1;
                        p
                    }
                    None => break,
                }
            };
            // Leaked, not freed, should `wait` panic: a copy may still be using it.
            let slot = ManuallyDrop::new(slot);
            let idle = events.iter().all(|ev| self.mem.wait(ev).is_ok());
            let mut inner = self.lock();
            inner.draining -= 1;
            if idle {
                inner.free.push(ManuallyDrop::into_inner(slot));
            } else {
                inner.lost += 1;
            }
        }
    }

    pub fn stats(&self) -> SlotStats {
        let mut inner = self.lock();
        self.reap(&mut inner);
        SlotStats {
            capacity: self.capacity,
            free: inner.free.len(),
            in_flight: inner.in_flight(),
            lost: inner.lost,
            acquires: inner.acquires,
            waits: inner.waits,
            max_in_use: inner.max_in_use,
        }
    }

    /// Every critical section leaves `Inner` consistent even if a `SlotMemory` call panics inside
    /// it (`reap` moves a slot only after `done` returned), so a poisoned lock is still sound, and
    /// a guard dropped while unwinding must still return its slot rather than panic again.
    fn lock(&self) -> MutexGuard<'_, Inner<M::Slot, M::Event>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the pending slots whose release events have all completed back to `free`.
    fn reap(&self, inner: &mut Inner<M::Slot, M::Event>) {
        let mut i = 0;
        while i < inner.pending.len() {
            if inner.pending[i].1.iter().all(|ev| self.mem.done(ev)) {
                let (slot, _events) = inner.pending.swap_remove(i);
                inner.free.push(slot);
            } else {
                i += 1;
            }
        }
    }

    /// The only way a slot comes back: a guard's `Drop`.
    fn give_back(&self, slot: M::Slot, release: Vec<M::Event>) {
        let mut inner = self.lock();
        inner.in_use -= 1;
        if release.is_empty() {
            inner.free.push(slot);
        } else {
            inner.pending.push((slot, release));
        }
        drop(inner);
        self.returned.notify_all();
    }
}

impl<M: SlotMemory> Drop for SlotPool<M> {
    /// No guard is alive (each holds the pool). Slots whose copies may still run are freed only
    /// after their events complete; one whose event cannot be waited for is leaked instead.
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner);
        for (slot, events) in inner.pending.drain(..) {
            let slot = ManuallyDrop::new(slot);
            if events.iter().all(|ev| self.mem.wait(ev).is_ok()) {
                drop(ManuallyDrop::into_inner(slot));
            }
        }
    }
}

impl<M: SlotMemory> fmt::Debug for SlotPool<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotPool").field("bytes", &self.bytes).field("stats", &self.stats()).finish()
    }
}

/// Owns one slot from acquire on. Dropping it returns the slot, but if release events were set
/// (the consumer's H2D that reads the slot; or the D2H into it, if the batch never reaches the
/// consumer), the slot goes back to the pool only once all of them are done: checked lazily by
/// later `acquire`s and `stats`, or waited for at shutdown and pool drop. Whoever enqueues a copy
/// that touches the slot must hand its event to `release_after` before the guard can drop.
pub struct SlotGuard<M: SlotMemory> {
    pool: Arc<SlotPool<M>>,
    /// `Some` until `Drop` gives it back.
    slot: Option<M::Slot>,
    release: Vec<M::Event>,
}

impl<M: SlotMemory> SlotGuard<M> {
    pub fn slot(&self) -> &M::Slot {
        self.slot.as_ref().expect("a live SlotGuard always holds its slot")
    }

    pub fn slot_mut(&mut self) -> &mut M::Slot {
        self.slot.as_mut().expect("a live SlotGuard always holds its slot")
    }

    pub fn bytes(&self) -> usize {
        self.pool.bytes
    }

    /// The slot may not be reused until `ev` has completed. Events add up: after several calls
    /// the slot waits for all of them.
    pub fn release_after(&mut self, ev: M::Event) {
        self.release.push(ev);
    }
}

impl<M: SlotMemory> Drop for SlotGuard<M> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.pool.give_back(slot, std::mem::take(&mut self.release));
        }
    }
}

impl<M: SlotMemory> fmt::Debug for SlotGuard<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotGuard")
            .field("bytes", &self.pool.bytes)
            .field("release_events", &self.release.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use std::sync::mpsc::{self, RecvTimeoutError};
    use std::thread;

    /// Generous: only reached when something is broken.
    const LONG: Duration = Duration::from_secs(5);

    /// A host "pinned" memory whose events complete when the test calls `complete`.
    #[derive(Default)]
    struct SimMem {
        allocated: AtomicUsize,
        /// Ids of the slots whose memory was freed.
        freed: Arc<Mutex<Vec<usize>>>,
        fail_alloc_at: Option<usize>,
    }

    struct SimSlot {
        id: usize,
        /// Shared so a simulated copy can check nobody wrote into the slot while it ran.
        data: Arc<Mutex<Vec<u8>>>,
        freed: Arc<Mutex<Vec<usize>>>,
    }

    impl Drop for SimSlot {
        fn drop(&mut self) {
            self.freed.lock().unwrap_or_else(PoisonError::into_inner).push(self.id);
        }
    }

    #[derive(Clone, Default)]
    struct SimEvent {
        done: Arc<AtomicBool>,
        /// `wait` fails, like a CUDA event on a context that hit a sticky error.
        broken: bool,
    }

    impl SimEvent {
        fn complete(&self) {
            self.done.store(true, SeqCst);
        }
    }

    impl SlotMemory for SimMem {
        type Slot = SimSlot;
        type Event = SimEvent;
        fn alloc_slot(&self, bytes: usize) -> Result<SimSlot, SlotError> {
            let id = self.allocated.fetch_add(1, SeqCst);
            if self.fail_alloc_at == Some(id) {
                return Err(SlotError::Alloc("simulated cuMemHostAlloc failure".into()));
            }
            Ok(SimSlot { id, data: Arc::new(Mutex::new(vec![0; bytes])), freed: Arc::clone(&self.freed) })
        }
        fn done(&self, ev: &SimEvent) -> bool {
            ev.done.load(SeqCst)
        }
        fn wait(&self, ev: &SimEvent) -> Result<(), SlotError> {
            if ev.broken {
                return Err(SlotError::Event("simulated event failure".into()));
            }
            let t0 = Instant::now();
            while !ev.done.load(SeqCst) {
                if t0.elapsed() > LONG {
                    return Err(SlotError::Event("simulated event never completed".into()));
                }
                thread::sleep(Duration::from_micros(50));
            }
            Ok(())
        }
    }

    fn pool(slots: usize) -> Arc<SlotPool<SimMem>> {
        SlotPool::new(Arc::new(SimMem::default()), slots, 64).expect("a simulated pool")
    }

    /// What a waiter thread reports: the slot id it got (or the error), and the test's flag as
    /// it was when `acquire` returned.
    type WaiterReport = (Result<usize, String>, bool);

    /// Starts a thread that acquires once (with `LONG`) and reports the slot it got and whether
    /// `flag` was already set when `acquire` returned.
    fn spawn_waiter(
        pool: &Arc<SlotPool<SimMem>>,
        flag: &Arc<AtomicBool>,
    ) -> (thread::JoinHandle<()>, mpsc::Receiver<WaiterReport>) {
        let (tx, rx) = mpsc::channel();
        let (pool, flag) = (Arc::clone(pool), Arc::clone(flag));
        let h = thread::spawn(move || {
            let r = pool.acquire(LONG);
            let seen = flag.load(SeqCst);
            let _ = tx.send((r.map(|g| g.slot().id).map_err(|e| e.to_string()), seen));
        });
        (h, rx)
    }

    #[test]
    fn bounded_acquire_blocks_until_a_release_and_times_out_without_one() {
        let pool = pool(2);
        let g1 = pool.acquire(LONG).unwrap();
        let g2 = pool.acquire(LONG).unwrap();
        assert_ne!(g1.slot().id, g2.slot().id);

        let released = Arc::new(AtomicBool::new(false));
        let (waiter, rx) = spawn_waiter(&pool, &released);
        assert!(
            matches!(rx.recv_timeout(Duration::from_millis(150)), Err(RecvTimeoutError::Timeout)),
            "the third acquire returned while both slots were held"
        );
        let id1 = g1.slot().id;
        released.store(true, SeqCst);
        drop(g1);
        let (got, seen) = rx.recv_timeout(LONG).expect("the waiter was not woken by the release");
        assert_eq!(got, Ok(id1));
        assert!(seen, "acquire returned before the slot was released");
        waiter.join().unwrap();

        let _g3 = pool.acquire(LONG).unwrap();
        let t0 = Instant::now();
        match pool.acquire(Duration::from_millis(50)) {
            Err(SlotError::Timeout { waited }) => {
                assert!(waited >= Duration::from_millis(50), "timed out early: {waited:?}");
                assert!(t0.elapsed() < Duration::from_secs(1));
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(matches!(pool.acquire(Duration::ZERO), Err(SlotError::Timeout { .. })));
        let st = pool.stats();
        assert_eq!(st, SlotStats { capacity: 2, free: 0, in_flight: 2, lost: 0, acquires: 4, waits: 2, max_in_use: 2 });
    }

    #[test]
    fn slot_with_a_pending_release_event_is_not_handed_out_until_it_completes() {
        let pool = pool(1);
        let mut g = pool.acquire(LONG).unwrap();
        let id = g.slot().id;
        let h2d = SimEvent::default();
        g.release_after(h2d.clone());
        drop(g);
        let st = pool.stats();
        assert_eq!((st.free, st.in_flight), (0, 1));
        assert!(matches!(pool.acquire(Duration::from_millis(30)), Err(SlotError::Timeout { .. })));

        let completed = Arc::new(AtomicBool::new(false));
        let (waiter, rx) = spawn_waiter(&pool, &completed);
        assert!(
            matches!(rx.recv_timeout(Duration::from_millis(150)), Err(RecvTimeoutError::Timeout)),
            "a slot was handed out while its H2D was still reading it"
        );
        completed.store(true, SeqCst);
        h2d.complete();
        let (got, seen) = rx.recv_timeout(LONG).expect("the waiter did not see the event complete");
        assert_eq!(got, Ok(id));
        assert!(seen, "acquire returned before the release event completed");
        waiter.join().unwrap();

        // Several events: the slot waits for all of them.
        let (a, b) = (SimEvent::default(), SimEvent::default());
        let mut g = pool.acquire(LONG).unwrap();
        g.release_after(a.clone());
        g.release_after(b.clone());
        drop(g);
        a.complete();
        assert!(matches!(pool.acquire(Duration::from_millis(30)), Err(SlotError::Timeout { .. })));
        b.complete();
        assert_eq!(pool.acquire(LONG).unwrap().slot().id, id);
    }

    /// Stages one batch into a slot and then fails, as a producer whose D2H launch or publish
    /// returned an error would.
    fn stage_then_fail(pool: &Arc<SlotPool<SimMem>>, d2h: Option<SimEvent>) -> Result<(), SlotError> {
        let mut g = pool.acquire(LONG)?;
        g.slot_mut().data.lock().unwrap().fill(7);
        if let Some(ev) = d2h {
            g.release_after(ev);
        }
        Err(SlotError::Alloc("injected: the publish failed".into()))
    }

    #[test]
    fn failing_or_panicking_producer_does_not_leak_its_slot() {
        let pool = pool(4);
        assert!(stage_then_fail(&pool, None).is_err());
        let e1 = SimEvent::default();
        assert!(stage_then_fail(&pool, Some(e1.clone())).is_err());
        let e2 = SimEvent::default();
        for ev in [Some(e2.clone()), None] {
            let p = Arc::clone(&pool);
            let r = thread::spawn(move || {
                let mut g = p.acquire(LONG).unwrap();
                if let Some(ev) = ev {
                    g.release_after(ev);
                }
                panic!("injected producer panic while holding a slot");
            })
            .join();
            assert!(r.is_err());
        }
        let st = pool.stats();
        assert_eq!((st.free, st.in_flight), (2, 2), "slots with pending copies must wait: {st:?}");
        e1.complete();
        e2.complete();
        let st = pool.stats();
        assert_eq!((st.free, st.in_flight, st.lost), (4, 0, 0), "{st:?}");
        let all: Vec<_> = (0..4).map(|_| pool.acquire(Duration::ZERO).unwrap()).collect();
        assert_eq!(all.len(), 4);
    }

    #[test]
    fn shutdown_wakes_blocked_acquirers_with_closed_and_guards_still_return() {
        let pool = pool(3);
        let held = pool.acquire(LONG).unwrap();
        let mut held_ev = pool.acquire(LONG).unwrap();
        let h2d_held = SimEvent::default();
        held_ev.release_after(h2d_held.clone());
        let mut returned = pool.acquire(LONG).unwrap();
        let h2d_returned = SimEvent::default();
        returned.release_after(h2d_returned.clone());
        drop(returned);

        let (tx, rx) = mpsc::channel();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let (p, tx) = (Arc::clone(&pool), tx.clone());
                thread::spawn(move || {
                    let r = p.acquire(Duration::from_secs(30));
                    let _ = tx.send((matches!(r, Err(SlotError::Closed)), Instant::now()));
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(100));
        assert!(rx.try_recv().is_err(), "a waiter returned before shutdown");

        // Shutdown waits for the returned slot's H2D; it completes a little later.
        let completer = {
            let ev = h2d_returned.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(200));
                ev.complete();
            })
        };
        let t0 = Instant::now();
        pool.shutdown();
        for _ in 0..3 {
            let (closed, at) = rx.recv_timeout(Duration::from_secs(1)).expect("a waiter was not woken by shutdown");
            assert!(closed, "a waiter got something other than Closed");
            assert!(at.duration_since(t0) < Duration::from_secs(1));
        }
        for w in waiters {
            w.join().unwrap();
        }
        completer.join().unwrap();
        let st = pool.stats();
        assert_eq!((st.free, st.in_flight), (1, 2), "shutdown must have waited for the H2D: {st:?}");
        assert!(matches!(pool.acquire(Duration::ZERO), Err(SlotError::Closed)));
        assert!(matches!(pool.acquire(LONG), Err(SlotError::Closed)));

        drop(held);
        drop(held_ev);
        let st = pool.stats();
        assert_eq!((st.free, st.in_flight), (2, 1), "{st:?}");
        h2d_held.complete();
        let st = pool.stats();
        assert_eq!((st.free, st.in_flight, st.lost), (3, 0, 0), "{st:?}");
    }

    #[test]
    fn pool_drop_frees_a_slot_only_after_its_event_and_leaks_one_it_cannot_confirm() {
        let mem = Arc::new(SimMem::default());
        let freed = Arc::clone(&mem.freed);
        let pool = SlotPool::new(mem, 2, 64).unwrap();
        let mut g = pool.acquire(LONG).unwrap();
        let id = g.slot().id;
        let h2d = SimEvent::default();
        g.release_after(h2d.clone());
        drop(g);
        let mut g = pool.acquire(LONG).unwrap();
        g.release_after(SimEvent { broken: true, ..SimEvent::default() });
        drop(g);

        let early = Arc::new(AtomicBool::new(false));
        let completer = {
            let (freed, early) = (Arc::clone(&freed), Arc::clone(&early));
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(100));
                early.store(!freed.lock().unwrap().is_empty(), SeqCst);
                h2d.complete();
            })
        };
        drop(pool);
        completer.join().unwrap();
        assert!(!early.load(SeqCst), "a slot was freed while its H2D was still running");
        assert_eq!(*freed.lock().unwrap(), vec![id], "the unconfirmed slot must be leaked, the other freed");
    }

    #[test]
    fn new_rejects_empty_pools_and_names_the_slot_that_failed() {
        let e = SlotPool::new(Arc::new(SimMem::default()), 0, 64).unwrap_err();
        assert!(e.to_string().contains("at least one slot"), "{e}");
        let e = SlotPool::new(Arc::new(SimMem::default()), 2, 0).unwrap_err();
        assert!(e.to_string().contains("0 bytes"), "{e}");
        let mem = Arc::new(SimMem { fail_alloc_at: Some(2), ..SimMem::default() });
        let freed = Arc::clone(&mem.freed);
        let e = SlotPool::new(mem, 4, 64).unwrap_err();
        assert!(e.to_string().contains("slot 2 of 4 (64 bytes each)"), "{e}");
        assert_eq!(freed.lock().unwrap().len(), 2, "the slots allocated before the failure must be freed");
    }

    // ---- randomized stress: producers -> bounded channel -> consumer, copies complete later ----

    /// SplitMix64: a small deterministic generator, enough to pick random failures.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    const NO_OWNER: usize = usize::MAX;

    /// A simulated copy in flight: it reads (or writes) the slot until `complete`.
    struct InFlightCopy {
        id: usize,
        data: Arc<Mutex<Vec<u8>>>,
        tag: u8,
        ev: SimEvent,
    }

    struct World {
        owners: Vec<AtomicUsize>,
        copies: Mutex<Vec<InFlightCopy>>,
        problems: Mutex<Vec<String>>,
    }

    impl World {
        fn problem(&self, p: String) {
            self.problems.lock().unwrap_or_else(PoisonError::into_inner).push(p);
        }
        fn complete(&self, c: InFlightCopy) {
            if c.data.lock().unwrap().iter().any(|&b| b != c.tag) {
                self.problem(format!("slot {} was written while its copy was in flight", c.id));
            }
            // Ownership ends before the event reads as done: only then may the pool reuse it.
            self.owners[c.id].store(NO_OWNER, SeqCst);
            c.ev.complete();
        }
    }

    /// A guard plus ownership tracking: owning a slot that someone else owns is a double hand-out.
    struct Held {
        guard: SlotGuard<SimMem>,
        world: Arc<World>,
        has_copy: bool,
    }

    impl Held {
        fn new(guard: SlotGuard<SimMem>, world: &Arc<World>, me: usize) -> Self {
            let id = guard.slot().id;
            if let Err(other) = world.owners[id].compare_exchange(NO_OWNER, me, SeqCst, SeqCst) {
                world.problem(format!("slot {id} handed to {me} while {other} still owned it"));
            }
            Held { guard, world: Arc::clone(world), has_copy: false }
        }
        fn copy(&mut self, tag: u8) {
            let ev = SimEvent::default();
            self.guard.release_after(ev.clone());
            self.has_copy = true;
            let slot = self.guard.slot();
            let c = InFlightCopy { id: slot.id, data: Arc::clone(&slot.data), tag, ev };
            self.world.copies.lock().unwrap().push(c);
        }
    }

    impl Drop for Held {
        /// Runs before the guard (a field) drops, so the owner is cleared before the pool can
        /// hand the slot out again; with a copy in flight, the copy's completion clears it.
        fn drop(&mut self) {
            if !self.has_copy {
                self.world.owners[self.guard.slot().id].store(NO_OWNER, SeqCst);
            }
        }
    }

    const SLOTS: usize = 4;
    const PRODUCERS: usize = 3;
    const ITERS: usize = 300;

    /// Returns the problems found (empty when all is well).
    fn stress(seed: u64, consumer_dies_after: Option<usize>) -> Vec<String> {
        let pool = pool(SLOTS);
        let world = Arc::new(World {
            owners: (0..SLOTS).map(|_| AtomicUsize::new(NO_OWNER)).collect(),
            copies: Mutex::new(Vec::new()),
            problems: Mutex::new(Vec::new()),
        });
        let acquired = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = mpsc::sync_channel::<(Held, u8)>(2);

        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let (pool, world, acquired, tx) =
                    (Arc::clone(&pool), Arc::clone(&world), Arc::clone(&acquired), tx.clone());
                thread::spawn(move || {
                    let mut rng = Rng(seed * 1000 + p as u64);
                    for _ in 0..ITERS {
                        let guard = match pool.acquire(Duration::from_secs(2)) {
                            Ok(g) => g,
                            Err(e) => return world.problem(format!("producer {p}: {e}")),
                        };
                        acquired.fetch_add(1, SeqCst);
                        let mut held = Held::new(guard, &world, p);
                        let tag = rng.next() as u8;
                        held.guard.slot().data.lock().unwrap().fill(tag);
                        match rng.below(100) {
                            // The D2H failed to launch: drop the slot untouched.
                            0..=3 => drop(held),
                            // The D2H was enqueued, then publishing failed: wait for the D2H.
                            4..=7 => held.copy(tag),
                            // Panic while holding the slot, with and without a copy in flight.
                            8..=10 => {
                                let with_copy = rng.below(2) == 0;
                                let r = catch_unwind(AssertUnwindSafe(move || {
                                    if with_copy {
                                        held.copy(tag);
                                    }
                                    panic!("injected producer panic");
                                }));
                                assert!(r.is_err());
                            }
                            _ => {
                                if tx.send((held, tag)).is_err() {
                                    return; // The consumer is gone; the message and its slot were dropped.
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        drop(tx);

        let consumer = {
            let world = Arc::clone(&world);
            thread::spawn(move || {
                let mut rng = Rng(seed * 1000 + 999);
                let mut n = 0;
                loop {
                    let (mut held, tag) = match rx.recv_timeout(Duration::from_secs(2)) {
                        Ok(m) => m,
                        Err(RecvTimeoutError::Disconnected) => return,
                        Err(RecvTimeoutError::Timeout) => return world.problem("consumer starved".into()),
                    };
                    n += 1;
                    if held.guard.slot().data.lock().unwrap().iter().any(|&b| b != tag) {
                        world.problem(format!("slot {} reached the consumer corrupted", held.guard.slot().id));
                    }
                    if consumer_dies_after == Some(n) {
                        return; // Drops `held`, `rx` and every queued message.
                    }
                    match rng.below(100) {
                        // Failed before its H2D.
                        0..=4 => drop(held),
                        // Panic after enqueueing the H2D.
                        5..=6 => {
                            let r = catch_unwind(AssertUnwindSafe(move || {
                                held.copy(tag);
                                panic!("injected consumer panic");
                            }));
                            assert!(r.is_err());
                        }
                        // The H2D reads the slot; it completes later, on the copy engine.
                        _ => held.copy(tag),
                    }
                }
            })
        };

        // The copy engine: completes copies in random order at random times.
        let stop = Arc::new(AtomicBool::new(false));
        let engine = {
            let (world, stop) = (Arc::clone(&world), Arc::clone(&stop));
            thread::spawn(move || {
                let mut rng = Rng(seed * 1000 + 998);
                loop {
                    let c = {
                        let mut copies = world.copies.lock().unwrap();
                        if copies.is_empty() {
                            if stop.load(SeqCst) {
                                return;
                            }
                            None
                        } else if rng.below(100) < 60 {
                            let i = rng.below(copies.len() as u64) as usize;
                            Some(copies.swap_remove(i))
                        } else {
                            None
                        }
                    };
                    if let Some(c) = c {
                        world.complete(c);
                    }
                    thread::sleep(Duration::from_micros(rng.below(200)));
                }
            })
        };

        for p in producers {
            if p.join().is_err() {
                world.problem("a producer thread panicked outside the injected panics".into());
            }
        }
        if consumer.join().is_err() {
            world.problem("the consumer thread panicked outside the injected panics".into());
        }
        stop.store(true, SeqCst);
        if engine.join().is_err() {
            world.problem("the copy engine panicked".into());
        }

        let st = pool.stats();
        if (st.free, st.in_flight, st.lost) != (SLOTS, 0, 0) {
            world.problem(format!("not every slot came back: {st:?}"));
        }
        if st.acquires != acquired.load(SeqCst) as u64 || st.max_in_use > SLOTS {
            world.problem(format!("stats disagree with what happened: {st:?}"));
        }
        if world.owners.iter().any(|o| o.load(SeqCst) != NO_OWNER) {
            world.problem("a slot is still owned at the end".into());
        }
        let problems = std::mem::take(&mut *world.problems.lock().unwrap());
        problems
    }

    #[test]
    fn stress_producers_and_consumer_with_random_failures_never_deadlock_double_hand_out_or_leak() {
        let cases: Vec<(u64, Option<usize>)> = vec![(1, None), (2, None), (3, None), (4, Some(50)), (5, Some(1))];
        for (seed, dies) in cases {
            let (tx, rx) = mpsc::channel();
            thread::spawn(move || {
                let _ = tx.send(stress(seed, dies));
            });
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(problems) => assert!(problems.is_empty(), "seed {seed}, consumer dies {dies:?}: {problems:#?}"),
                Err(e) => panic!("seed {seed}, consumer dies {dies:?}: deadlock or crash ({e:?})"),
            }
        }
    }
}
