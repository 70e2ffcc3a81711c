//! Training: batches and anchors, the optimizer schedule, the step pieces.

pub mod batch;
pub mod checkpoint;
pub mod flops;
pub mod generate;
pub mod metrics;
pub mod optim;
pub mod step;
