//! The FC projection `Y = X W^T` as our own kernel (kernels/fc.cu).
//!
//! Placeholder until kernels/fc.cu lands: runs the cuBLASLt GEMM.

use super::{CudaBackend, CudaBuf, Stream};
use crate::backend::{Backend, Gemm, Result};

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fc_kernel(
        &self,
        s: &Stream,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        y: &mut CudaBuf,
        rows: usize,
        h: usize,
        k: usize,
    ) -> Result<()> {
        self.gemm(s, &Gemm::linear(rows, h, k), x, 0, w, w_off, y, 0)
    }
}
