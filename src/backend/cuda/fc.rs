//! The FC projection `y[rows, h] = x[rows, k] W[h, k]^T` as our own kernels (kernels/fc.cu).
//!
//! Two paths: `fc_wgmma_bf16` (TMA + wgmma, warp-specialised, persistent; the one training runs)
//! whenever the shape and the pointers allow it, and `fc_simple_bf16` (a plain tiled kernel on CUDA
//! cores) for everything else. The choice is [`fast_path_blocker`]; falling back is logged once.
//! [`CudaBackend::fc_project_with`] forces either path, so tests and benches can run both.

use std::sync::atomic::{AtomicBool, Ordering};

use super::launch::{self, DevPtr};
use super::tma::{tensor_map_2d, SWIZZLE_ROW};
use super::{CudaBackend, CudaBuf, Stream};
use crate::backend::{check_len, BackendError, Result};
use crate::kernels::launch::{FC_BK, FC_BM, FC_BN, FC_SMEM_BYTES, FC_S_THREADS, FC_S_TILE, FC_THREADS};

/// Which kernel of kernels/fc.cu computes the projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FcPath {
    /// `fc_wgmma_bf16`: k and h multiples of 8, x and W 16-byte aligned, y 4-byte aligned, k >= 1
    /// (anything else is an error when this path is forced).
    Fast,
    /// `fc_simple_bf16`: any shape and alignment, on CUDA cores (slow).
    Simple,
}

// fc_wgmma_bf16 traps on a block of other than FC_THREADS threads or less than FC_SMEM_BYTES of
// shared memory; fc_simple_bf16 on other than FC_S_THREADS threads (kernels/launch.cuh).
/// The bulk tensor copy engine wants 16-byte aligned base addresses and row pitches.
const TMA_ALIGN: u64 = 16;

/// Set once the automatic choice has fallen back to the slow kernel (STYLE.md rule 8: log once).
static FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

/// Why `fc_wgmma_bf16` cannot run on these operands (`None`: it can). Pointers are byte addresses
/// of x, of W's first element (offset already applied) and of y.
fn fast_path_blocker(x: u64, w: u64, y: u64, w_off: usize, h: usize, k: usize) -> Option<String> {
    tma_gemm_blocker([("x", x), ("y", y)], w, w_off, ("h", h), k)
}

/// Why a TMA + wgmma kernel reading `x [rows, k]` and `W [n, k]` by TMA and storing bf16 pairs
/// cannot run (`None`: it can): k and n multiples of 8 (16-byte TMA row pitch, whole pairs), x and
/// W 16-byte aligned, the output 4-byte aligned. `ptrs` names x and the output with their byte
/// addresses, `w` is W's first element's (offset `w_off` applied), `n` names the output width.
/// fc.cu's kernel and mlp.cu's share it.
pub(super) fn tma_gemm_blocker(
    ptrs: [(&str, u64); 2],
    w: u64,
    w_off: usize,
    n: (&str, usize),
    k: usize,
) -> Option<String> {
    let [(x_name, x), (y_name, y)] = ptrs;
    let (n_name, n) = n;
    if k == 0 {
        Some("k = 0 (nothing to load)".into())
    } else if k % 8 != 0 {
        Some(format!("k = {k} is not a multiple of 8 (TMA rows must be a multiple of 16 bytes)"))
    } else if n % 8 != 0 {
        Some(format!("{n_name} = {n} is not a multiple of 8"))
    } else if x % TMA_ALIGN != 0 {
        Some(format!("{x_name} at {x:#x} is not 16-byte aligned"))
    } else if w % TMA_ALIGN != 0 {
        Some(format!("W at element offset {w_off} is not 16-byte aligned"))
    } else if y % 4 != 0 {
        Some(format!("{y_name} at {y:#x} is not 4-byte aligned"))
    } else {
        None
    }
}

const _: () = assert!(FC_BK == SWIZZLE_ROW, "fc.cu's k-block is one swizzle row");

impl CudaBackend {
    /// `Backend::fc_project` on CUDA: the fast kernel when [`fast_path_blocker`] allows it, else
    /// the simple one (logged once per process).
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
        let wp = w.ptr + (w_off * w.dtype.size_bytes()) as u64;
        let path = match fast_path_blocker(x.ptr, wp, y.ptr, w_off, h, k) {
            Some(why) if rows > 0 && h > 0 => {
                if !FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
                    eprintln!(
                        "note      fc_project ({rows} x {h} x {k}): {why}; running the slow fc_simple_bf16 kernel \
                         (logged once)"
                    );
                }
                FcPath::Simple
            }
            Some(_) => FcPath::Simple,
            None => FcPath::Fast,
        };
        self.fc_project_with(s, x, w, w_off, y, rows, h, k, path)
    }

    /// `y[rows, h] = x[rows, k] w[w_off..][h, k]^T` (bf16, f32 accumulation, one rounding) on the
    /// kernel `path` names. Forcing [`FcPath::Fast`] on operands it cannot take is an error, not a
    /// silent fallback.
    #[allow(clippy::too_many_arguments)]
    pub fn fc_project_with(
        &self,
        s: &Stream,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        y: &mut CudaBuf,
        rows: usize,
        h: usize,
        k: usize,
        path: FcPath,
    ) -> Result<()> {
        const OP: &str = "fc_project";
        check_len(OP, "x", x.len, 0, rows * k)?;
        check_len(OP, "w", w.len, w_off, h * k)?;
        check_len(OP, "y", y.len, 0, rows * h)?;
        let (xp, wp, yp): (DevPtr<half::bf16>, DevPtr<half::bf16>, DevPtr<half::bf16>) =
            (x.at(OP, 0)?, w.at(OP, w_off)?, y.at(OP, 0)?);
        if rows == 0 || h == 0 {
            return Ok(());
        }
        match path {
            FcPath::Fast => {
                if let Some(why) = fast_path_blocker(xp.addr(), wp.addr(), yp.addr(), w_off, h, k) {
                    return Err(BackendError::Shape { op: OP, what: format!("fc_wgmma_bf16 cannot run: {why}") });
                }
                let map_x = tensor_map_2d(OP, xp.addr(), k, rows, FC_BM)?;
                let map_w = tensor_map_2d(OP, wp.addr(), k, h, FC_BN)?;
                let tiles = rows.div_ceil(FC_BM) * h.div_ceil(FC_BN);
                // Persistent: one CTA per SM at most (197 KB of shared memory each), >= 1 here.
                let grid = tiles.min(self.sm_count);
                let args = launch::FcWgmmaBf16 { map_x, map_w, y: yp, rows, h, k };
                self.launch(s, launch::FcWgmmaBf16::KERNEL, (grid, FC_THREADS, FC_SMEM_BYTES), args)
            }
            FcPath::Simple => {
                let tiles = rows.div_ceil(FC_S_TILE) * h.div_ceil(FC_S_TILE);
                let args = launch::FcSimpleBf16 { x: xp, w: wp, y: yp, rows, h, k };
                self.launch(s, launch::FcSimpleBf16::KERNEL, (tiles, FC_S_THREADS, 0), args)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_path_takes_aligned_multiples_of_8_only() {
        let a = 0x7f00_0000_0000u64; // a 256-byte aligned device address
        assert_eq!(fast_path_blocker(a, a + 128, a, 64, 4096, 20480), None);
        assert_eq!(fast_path_blocker(a, a, a, 0, 64, 192), None);
        assert!(fast_path_blocker(a, a + 6, a, 3, 4096, 20480).unwrap().contains("element offset 3"));
        assert!(fast_path_blocker(a, a, a, 0, 4096, 100).unwrap().contains("k = 100"));
        assert!(fast_path_blocker(a, a, a, 0, 100, 64).unwrap().contains("h = 100"));
        assert!(fast_path_blocker(a, a, a, 0, 64, 0).unwrap().contains("k = 0"));
        assert!(fast_path_blocker(a + 8, a, a, 0, 64, 64).unwrap().contains("x at"));
        assert!(fast_path_blocker(a, a, a + 2, 0, 64, 64).unwrap().contains("y at"));
    }
}
