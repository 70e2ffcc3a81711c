//! dflash-engine: trains DFlash speculative-decoding drafters against a frozen target LLM.
//!
//! Module map (one line each; DESIGN.md section 3 is the long form):
pub mod rng; // Philox4x32-10, bit-identical to kernels/philox.cuh
pub mod kernels; // cubins compiled by build.rs from kernels/*.cu, embedded
