//! Host-side meeting points of the pipeline's threads: an all-gather between the drafter's
//! data-parallel ranks (metric sums, the stop decision), and the lockstep gate of the synchronous
//! reference mode. Both can be aborted, so a rank that stops never leaves another one waiting.

use std::sync::{Arc, Condvar, Mutex};

/// Every rank contributes one value per round and receives all of them, in rank order.
pub struct Exchange<T> {
    n: usize,
    state: Mutex<ExState<T>>,
    cv: Condvar,
}

struct ExState<T> {
    round: u64,
    parts: Vec<Option<T>>,
    result: Arc<Vec<T>>,
    aborted: bool,
}

/// Another rank stopped: the round will never complete.
#[derive(Debug)]
pub struct Aborted;

impl<T: Clone> Exchange<T> {
    pub fn new(n: usize) -> Self {
        Exchange {
            n,
            state: Mutex::new(ExState { round: 0, parts: Vec::new(), result: Arc::new(Vec::new()), aborted: false }),
            cv: Condvar::new(),
        }
    }

    /// Blocks until every rank contributed to this round.
    pub fn all_gather(&self, rank: usize, value: T) -> Result<Arc<Vec<T>>, Aborted> {
        if self.n == 1 {
            return Ok(Arc::new(vec![value]));
        }
        let mut st = self.state.lock().map_err(|_| Aborted)?;
        if st.aborted {
            return Err(Aborted);
        }
        if st.parts.len() != self.n {
            st.parts = vec![None; self.n];
        }
        st.parts[rank] = Some(value);
        let round = st.round;
        if st.parts.iter().all(Option::is_some) {
            let all: Vec<T> = st.parts.iter_mut().filter_map(Option::take).collect();
            st.result = Arc::new(all);
            st.round += 1;
            self.cv.notify_all();
            return Ok(st.result.clone());
        }
        while st.round == round && !st.aborted {
            st = self.cv.wait(st).map_err(|_| Aborted)?;
        }
        if st.round == round {
            return Err(Aborted);
        }
        Ok(st.result.clone())
    }

    pub fn abort(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.aborted = true;
        }
        self.cv.notify_all();
    }
}

/// Lockstep mode: the target side starts step k only after the drafter side finished step k - 1.
pub struct Gate {
    state: Mutex<(u32, bool)>,
    cv: Condvar,
}

impl Gate {
    pub fn new(done: u32) -> Self {
        Gate { state: Mutex::new((done, false)), cv: Condvar::new() }
    }

    /// Steps before `done` are finished.
    pub fn advance(&self, done: u32) {
        if let Ok(mut st) = self.state.lock() {
            st.0 = st.0.max(done);
        }
        self.cv.notify_all();
    }

    /// Waits until every step before `step` is finished.
    pub fn wait_for(&self, step: u32) -> Result<(), Aborted> {
        let mut st = self.state.lock().map_err(|_| Aborted)?;
        while st.0 < step && !st.1 {
            st = self.cv.wait(st).map_err(|_| Aborted)?;
        }
        if st.0 < step {
            return Err(Aborted);
        }
        Ok(())
    }

    pub fn abort(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.1 = true;
        }
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_gather_returns_every_rank_in_order_each_round() {
        let ex = Exchange::new(3);
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let ex = &ex;
                    s.spawn(move || {
                        (0..50).map(|round| ex.all_gather(r, r * 100 + round).unwrap().to_vec()).collect::<Vec<_>>()
                    })
                })
                .collect();
            for h in hs {
                for (round, got) in h.join().unwrap().into_iter().enumerate() {
                    assert_eq!(got, vec![round, 100 + round, 200 + round]);
                }
            }
        });
    }

    #[test]
    fn abort_releases_waiting_ranks() {
        let ex = Exchange::<u32>::new(2);
        let gate = Gate::new(0);
        std::thread::scope(|s| {
            let a = s.spawn(|| ex.all_gather(0, 1));
            let b = s.spawn(|| gate.wait_for(5));
            std::thread::sleep(std::time::Duration::from_millis(20));
            ex.abort();
            gate.abort();
            assert!(a.join().unwrap().is_err());
            assert!(b.join().unwrap().is_err());
        });
        assert!(ex.all_gather(1, 2).is_err(), "an aborted exchange stays aborted");
    }

    #[test]
    fn gate_opens_in_order() {
        let gate = Gate::new(3);
        assert!(gate.wait_for(3).is_ok());
        std::thread::scope(|s| {
            let w = s.spawn(|| gate.wait_for(5));
            gate.advance(4);
            std::thread::sleep(std::time::Duration::from_millis(10));
            assert!(!w.is_finished(), "step 4 finished is not enough for step 5");
            gate.advance(5);
            assert!(w.join().unwrap().is_ok());
        });
    }
}
