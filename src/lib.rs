//! dflash-engine: trains DFlash speculative-decoding drafters against a frozen target LLM.
//!
//! Module map (one line each; DESIGN.md section 3 is the long form):
pub mod backend; // the op trait; cpu/ is the reference, cuda/ the product
pub mod bench; // `bench-pipeline`: sync vs async per transport, target idle, peer copy rate
pub mod config; // HF config.json subset (Qwen3), presets, drafter config, tap-layer rule
pub mod data; // pre-tokenized JSON Lines: parsing, validation, the order of samples per step
pub mod eval; // `eval`: real speculative decoding with a drafter checkpoint: acceptance, speedup, lossless check
pub mod faults; // the fault plan of the failure tests, built at the edge
pub mod kernels; // cubins compiled by build.rs from kernels/*.cu, embedded
pub mod model; // target forward with taps; drafter forward and hand-written backward
pub mod pipeline; // target -> drafter: producer thread, bounded queue, split-FC protocol
pub mod plot; // `plot`: loss, accuracy, acceptance length and tokens/s of runs from their metrics.jsonl
pub mod prepare; // `prepare-data`: chat JSON Lines through the chat template and tokenizer, --regenerate
pub mod rng; // Philox4x32-10, bit-identical to kernels/philox.cuh
pub mod session; // `run` as wiring: options, setup, the step log and summary; inspect, gen-data
pub mod tensor; // DType and the bf16 rounding rule
pub mod tensorboard; // TensorBoard event files by hand: TFRecord framing, crc32c, Event/Summary protobuf
#[cfg(test)]
mod testutil; // TempDir for the unit tests
pub mod train; // anchors and batches, AdamW schedule, the step, the metrics log
pub mod weights; // safetensors via memmap2, HF tensor names, atomic writes, random-init target
