//! The two models, written once against `backend::Backend`: the frozen Qwen3 target (forward with
//! taps, cached decoding and multi-token extend) and the DFlash drafter (forward and hand-written
//! backward; `drafting` is its inference path).

pub mod drafter;
pub mod drafting;
pub mod moments;
pub mod park;
pub mod target;

use std::collections::HashMap;

/// Element offsets of named tensors inside one flat buffer. One flat buffer per role (weights,
/// masters, gradients, Adam moments) makes the optimizer, the grad norm and checkpointing one
/// call each, and keeps every tensor at a fixed address for the whole run.
#[derive(Clone, Debug, Default)]
pub struct ParamTable {
    entries: Vec<ParamEntry>,
    index: HashMap<String, usize>,
    total: usize,
}

#[derive(Clone, Debug)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub numel: usize,
}

/// Every tensor starts on a multiple of this many elements: 128 bytes for bf16, so GEMM operands
/// meet any vector-width or TMA alignment rule on the GPU.
pub const PARAM_ALIGN: usize = 64;

impl ParamTable {
    pub fn push(&mut self, name: impl Into<String>, shape: &[usize]) -> usize {
        let name = name.into();
        let numel = shape.iter().product();
        let offset = self.total.div_ceil(PARAM_ALIGN) * PARAM_ALIGN;
        self.total = offset + numel;
        self.index.insert(name.clone(), self.entries.len());
        self.entries.push(ParamEntry { name, shape: shape.to_vec(), offset, numel });
        offset
    }

    /// Appends a tensor right after the previous one, with no alignment gap, so the two can be
    /// read as one operand (gate and up projections as one `[2 * inter, hidden]` GEMM).
    pub fn push_adjacent(&mut self, name: impl Into<String>, shape: &[usize]) -> usize {
        let name = name.into();
        let numel = shape.iter().product();
        let offset = self.total;
        self.total = offset + numel;
        self.index.insert(name.clone(), self.entries.len());
        self.entries.push(ParamEntry { name, shape: shape.to_vec(), offset, numel });
        offset
    }

    /// Offset of a tensor that must exist (the model built the table: a miss is a bug).
    pub fn off(&self, name: &str) -> usize {
        self.get(name).unwrap_or_else(|| panic!("parameter {name} not in table")).offset
    }

    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.index.get(name).map(|&i| &self.entries[i])
    }

    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    /// Total elements including alignment gaps (which stay zero forever).
    pub fn total(&self) -> usize {
        self.total
    }

    /// Elements that are real parameters.
    pub fn numel(&self) -> usize {
        self.entries.iter().map(|e| e.numel).sum()
    }
}
