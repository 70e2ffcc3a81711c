//! The integration tests: one binary, one module per area.
//!
//! - `ops_fd`: every op's backward against f64 finite differences (CPU exact backend)
//! - `drafter_fd`: one whole drafter step, every parameter, against finite differences
//! - `pitfalls`: one regression test per DFLASH.md section 6 pitfall
//! - `run`: `dflash-engine run` end to end on the CPU (learning, resume, crash safety, split-FC, faults)
//! - `metrics`: metrics.jsonl across stop and resume, TensorBoard event files, `plot`, `inspect`
//! - `nan_suite`: async == sync bit for bit over every transport, split, pad and depth; debug
//!   allocator modes; faults leave nothing behind

mod common;
mod drafter_fd;
mod gpu;
mod metrics;
mod nan_suite;
mod ops_fd;
mod pitfalls;
mod run;
