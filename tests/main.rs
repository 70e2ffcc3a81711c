//! The integration tests: one binary, one module per area.
//!
//! - `common`: shared helpers: random inputs, finite differences, small drafters, checkpoint readers,
//!   scratch folders removed when a test ends (`Scratch`)
//! - `ops_fd`: every op's backward against f64 finite differences (CPU exact backend)
//! - `drafter_fd`: one whole drafter step, every parameter, against finite differences
//! - `pitfalls`: one regression test per DFLASH.md section 6 pitfall
//! - `run`: `dflash-engine run` end to end on the CPU (learning, resume, crash safety, split-FC, faults)
//! - `metrics`: metrics.jsonl across stop and resume, TensorBoard event files, `plot`, `inspect`
//! - `qwen35`: the Qwen3.5/3.6 hybrid target: each op against its formula, chunked == recurrent
//!   gated delta rule, packed == separate sequences, decoding, and a CPU run that learns
//! - `recipe`: the drafter recipe: sliding-window masks, drafter configs and recipes, the written
//!   checkpoint, --init-from, --loss-gamma, the config's norm eps, a sliding run that learns
//! - `prepare`: `prepare-data`: the loss mask on a built-in BPE tokenizer and Qwen-style template, both
//!   layouts, truncation, bad lines, training on the output, `--regenerate` (greedy answers, kill + resume)
//! - `nan_suite`: async == sync bit for bit (transports, splits, topologies); allocator debug modes; faults
//! - `eval`: speculative decoding: lossless (Qwen3, hybrid), drafter inference == training forward,
//!   train then eval on held-out prompts, a random drafter
//! - `user_errors`: one regression test per bad input or misleading message a new user hit
//! - `scripts`: the GPU machine's scripts where their logic needs no GPU (sanitize.sh's shards)
//! - `flops`: the MFU column's FLOP model == the GEMM FLOPs the target forward and a drafter step run
//! - `host_sync`: the device update plan == the host's decision; metrics one step late == the
//!   host-decided step's, bit for bit (a NaN step skipped)
//! - `gpu`: each kernel family vs the CPU (tests/gpu/), CUDA training vs the CPU, the HF and PyTorch oracles
//!
//! GPU tests are named `gpu_*` and those that need two GPUs contain `two_gpu` (`--skip two_gpu`
//! leaves them out on a one-GPU machine; scripts/gpu-run.sh does).

mod common;
mod drafter_fd;
mod eval;
mod flops;
mod gpu;
mod host_sync;
mod metrics;
mod nan_suite;
mod ops_fd;
mod pitfalls;
mod prepare;
mod qwen35;
mod recipe;
mod run;
mod scripts;
mod user_errors;
