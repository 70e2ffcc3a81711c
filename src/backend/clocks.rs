//! What the GPU's clocks and power did during a run or a bench: a thread samples the SM clock,
//! the board power and the reasons the driver holds the clocks down (NVML on CUDA, see
//! `cuda::nvml`), and the summary says how much of the busy time the power cap set the pace.
//!
//! Why a run needs this: an H200 running bf16 GEMMs back to back draws its whole 700 W and the
//! driver lowers the SM clock to 1425-1500 MHz (from 1980) to stay under it. A GEMM timed alone
//! runs at 780-800 TFLOP/s; the same GEMMs back to back, as in a model's forward, at 680-690.
//! A step's time then follows the power cap, not the kernels, and this line says so.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

/// One reading of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockSample {
    pub sm_mhz: u32,
    pub power_mw: u32,
    /// NVML's clock event (throttle) reasons, a bit mask ([`reason`]).
    pub reasons: u64,
}

/// NVML's clock event reason bits (`nvmlClocksEventReason*`).
pub mod reason {
    /// Nothing runs: the clocks are down because the GPU is idle.
    pub const IDLE: u64 = 0x1;
    /// The driver holds the clocks down to keep the board under its power limit.
    pub const SW_POWER_CAP: u64 = 0x4;
    /// Hardware slowdown: the board's own protection (thermal or power, fast-acting) or the
    /// power brake signal.
    pub const HW_SLOWDOWN: u64 = 0x8 | 0x80;
    /// Software or hardware thermal slowdown.
    pub const THERMAL: u64 = 0x20 | 0x40;
}

/// Where the samples come from (NVML on CUDA, a stub in tests).
pub trait ClockSource: Send + 'static {
    /// One reading, or `None` if this one failed (skipped).
    fn sample(&mut self) -> Option<ClockSample>;
}

/// A running sampler of one device; [`ClockMonitor::finish`] stops it and summarises.
pub struct ClockMonitor {
    name: String,
    max_mhz: Option<u32>,
    limit_mw: Option<u32>,
    stop: mpsc::Sender<()>,
    thread: JoinHandle<Vec<ClockSample>>,
}

impl ClockMonitor {
    /// Starts sampling `source` every `every` on a thread of its own. `max_mhz` (the device's
    /// highest SM clock) and `limit_mw` (its enforced power limit) go into the report as read
    /// (`None`: the device did not say).
    pub fn start(
        name: String,
        max_mhz: Option<u32>,
        limit_mw: Option<u32>,
        every: Duration,
        mut source: impl ClockSource,
    ) -> std::io::Result<Self> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new().name("clock-monitor".into()).spawn(move || {
            let mut samples = Vec::new();
            loop {
                if let Some(s) = source.sample() {
                    samples.push(s);
                }
                // A message or a dropped sender ends the sampling; a timeout takes the next one.
                match stopped.recv_timeout(every) {
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    _ => return samples,
                }
            }
        })?;
        Ok(ClockMonitor { name, max_mhz, limit_mw, stop, thread })
    }

    /// Stops the sampler and summarises what it read.
    pub fn finish(self) -> ClockReport {
        let _ = self.stop.send(());
        // A sampler that panicked read nothing we can use.
        let samples = self.thread.join().unwrap_or_default();
        ClockReport::from_samples(self.name, self.max_mhz, self.limit_mw, &samples)
    }
}

/// The summary of a device's samples; the busy ones (not flagged idle) are the ones that count.
#[derive(Clone, Debug, PartialEq)]
pub struct ClockReport {
    pub name: String,
    pub max_mhz: Option<u32>,
    pub limit_w: Option<f64>,
    pub samples: usize,
    pub busy: usize,
    pub sm_mhz_median: u32,
    pub sm_mhz_min: u32,
    pub power_w_mean: f64,
    /// Fractions of the busy samples with the power cap, thermal and hardware slowdown reasons.
    pub power_capped: f64,
    pub thermal: f64,
    pub hw_slowdown: f64,
}

impl ClockReport {
    pub fn from_samples(name: String, max_mhz: Option<u32>, limit_mw: Option<u32>, samples: &[ClockSample]) -> Self {
        let busy: Vec<&ClockSample> = samples.iter().filter(|s| s.reasons & reason::IDLE == 0).collect();
        let mut mhz: Vec<u32> = busy.iter().map(|s| s.sm_mhz).collect();
        mhz.sort_unstable();
        let frac = |bits: u64| {
            if busy.is_empty() {
                0.0
            } else {
                busy.iter().filter(|s| s.reasons & bits != 0).count() as f64 / busy.len() as f64
            }
        };
        let power_w_mean = if busy.is_empty() {
            0.0
        } else {
            busy.iter().map(|s| f64::from(s.power_mw)).sum::<f64>() / busy.len() as f64 / 1e3
        };
        ClockReport {
            name,
            max_mhz,
            limit_w: limit_mw.map(|mw| f64::from(mw) / 1e3),
            samples: samples.len(),
            busy: busy.len(),
            sm_mhz_median: mhz.get(mhz.len() / 2).copied().unwrap_or(0),
            sm_mhz_min: mhz.first().copied().unwrap_or(0),
            power_w_mean,
            power_capped: frac(reason::SW_POWER_CAP),
            thermal: frac(reason::THERMAL),
            hw_slowdown: frac(reason::HW_SLOWDOWN),
        }
    }

    /// One line for a summary, e.g. `cuda:0: SM clock 1455 MHz median (lowest 1245, the
    /// device's highest 1980) over 612 busy samples; power 692 W mean, limit 700 W; the power
    /// cap held the clocks down in 94% of them`.
    pub fn describe(&self) -> String {
        if self.busy == 0 {
            return format!("{}: no busy sample ({} taken)", self.name, self.samples);
        }
        let pct = |f: f64| format!("{:.0}%", 100.0 * f);
        let max = self.max_mhz.map_or("unknown".to_string(), |m| m.to_string());
        let limit = self.limit_w.map_or("unknown".to_string(), |w| format!("{w:.0} W"));
        let mut s = format!(
            "{}: SM clock {} MHz median (lowest {}, the device's highest {max}) over {} busy samples; power {:.0} W mean, limit {limit}; the power cap held the clocks down in {} of them",
            self.name,
            self.sm_mhz_median,
            self.sm_mhz_min,
            self.busy,
            self.power_w_mean,
            pct(self.power_capped)
        );
        if self.thermal > 0.0 {
            s += &format!(", thermal slowdown in {}", pct(self.thermal));
        }
        if self.hw_slowdown > 0.0 {
            s += &format!(", hardware slowdown in {}", pct(self.hw_slowdown));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(sm_mhz: u32, power_mw: u32, reasons: u64) -> ClockSample {
        ClockSample { sm_mhz, power_mw, reasons }
    }

    #[test]
    fn the_report_counts_busy_samples_only() {
        let samples = [
            s(345, 77_000, reason::IDLE),
            s(1980, 300_000, 0),
            s(1500, 690_000, reason::SW_POWER_CAP),
            s(1440, 694_000, reason::SW_POWER_CAP),
            s(1470, 692_000, reason::SW_POWER_CAP | 0x40),
            s(345, 80_000, reason::IDLE),
        ];
        let r = ClockReport::from_samples("gpu".into(), Some(1980), Some(700_000), &samples);
        assert_eq!((r.samples, r.busy), (6, 4));
        // Sorted busy clocks 1440 1470 1500 1980: the median is the upper middle.
        assert_eq!((r.sm_mhz_median, r.sm_mhz_min), (1500, 1440));
        assert!((r.power_w_mean - (300.0 + 690.0 + 694.0 + 692.0) / 4.0).abs() < 1e-9);
        assert!((r.power_capped - 0.75).abs() < 1e-12);
        assert!((r.thermal - 0.25).abs() < 1e-12);
        assert_eq!(r.hw_slowdown, 0.0);
        assert_eq!(r.limit_w, Some(700.0));
        let line = r.describe();
        assert!(line.contains("1500 MHz median") && line.contains("in 75% of them"), "{line}");
        assert!(line.contains("highest 1980)") && line.contains("limit 700 W;"), "{line}");
        assert!(line.contains("thermal slowdown in 25%") && !line.contains("hardware"), "{line}");
        // What the device did not say is printed as unknown, not as 0.
        let line = ClockReport::from_samples("gpu".into(), None, None, &samples).describe();
        assert!(line.contains("highest unknown)") && line.contains("limit unknown;"), "{line}");
    }

    #[test]
    fn a_report_without_busy_samples_says_so() {
        let r = ClockReport::from_samples("gpu".into(), Some(1980), Some(700_000), &[s(345, 70_000, reason::IDLE)]);
        assert_eq!(r.busy, 0);
        assert_eq!(r.describe(), "gpu: no busy sample (1 taken)");
    }

    /// Readings 1001, 1002, (a failure), 1004, 1005, (a failure), ...; `tries` counts them all.
    struct Counting(std::sync::Arc<std::sync::atomic::AtomicU32>);
    impl ClockSource for Counting {
        fn sample(&mut self) -> Option<ClockSample> {
            let n = self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            (n % 3 != 0).then_some(ClockSample { sm_mhz: 1000 + n, power_mw: 1000, reasons: 0 })
        }
    }

    #[test]
    fn the_monitor_samples_until_finished_and_skips_failed_readings() {
        let tries = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let every = Duration::from_millis(2);
        let m = ClockMonitor::start("dev".into(), Some(2000), Some(1_000), every, Counting(tries.clone())).unwrap();
        // Until the third reading (the first failure) has been taken.
        while tries.load(std::sync::atomic::Ordering::SeqCst) < 3 {
            std::thread::sleep(every);
        }
        let r = m.finish();
        let tries = tries.load(std::sync::atomic::Ordering::SeqCst);
        // Every try but the failed ones (each third) is a sample; the sampler stopped.
        assert_eq!(r.samples as u32, tries - tries / 3, "{r:?}");
        assert_eq!(r.sm_mhz_min, 1001, "{r:?}");
        assert!(r.sm_mhz_median > r.sm_mhz_min, "{r:?}");
    }
}
