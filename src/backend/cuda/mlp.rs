//! The gated MLP's gate | up projection and SwiGLU as one kernel (kernels/mlp.cu), or as
//! cuBLASLt's GEMM followed by `swiglu_fwd`.
//!
//! `DFLASH_MLP_KERNEL` picks the form `Backend::mlp_gate_up_act` runs: unset or `fused`,
//! `mlp_swiglu_wgmma_bf16` wherever [`fused_blocker`] allows it (the two steps elsewhere, logged
//! once); `gemm`, the two steps. [`CudaBackend::mlp_gate_up_act_with`] forces either, for the
//! tests and the bench. The fused kernel is the default: on an H100 it gave the same bits as the
//! two steps at 1.075x (8B shape) and 1.071x (27B shape) of their throughput under sustained
//! load (the bench's `mlp` group), and 1.12x inside the 8B step (kernels/mlp.cu).

use std::sync::atomic::{AtomicBool, Ordering};

use super::fc::tma_gemm_blocker;
use super::launch::{self, DevPtr};
use super::tma::tensor_map_2d;
use super::{CudaBackend, CudaBuf, Stream};
use crate::backend::profile::{self, Work};
use crate::backend::{check_len, mlp_two_step, BackendError, Result};
use crate::kernels::launch::{FC_BK, FC_BM, FC_THREADS, MLP_BN, MLP_SMEM_BYTES};

/// Which form computes `act = swiglu(x [Wg; Wu]^T)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpForm {
    /// cuBLASLt's GEMM into the `[rows, 2 * inter]` scratch, then `swiglu_fwd_bf16`.
    Gemm,
    /// `mlp_swiglu_wgmma_bf16`: k and inter multiples of 8, x and W 16-byte aligned, act 4-byte
    /// aligned (anything else is an error when this form is forced).
    Fused,
}

impl MlpForm {
    /// The form `DFLASH_MLP_KERNEL` names (`None`: a name of neither).
    pub fn from_env_value(v: &str) -> Option<MlpForm> {
        match v {
            "gemm" => Some(MlpForm::Gemm),
            "fused" => Some(MlpForm::Fused),
            _ => None,
        }
    }
}

/// Set once the fused form has fallen back to the two steps (STYLE.md rule 8: log once).
static FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

/// Why `mlp_swiglu_wgmma_bf16` cannot run on these operands (`None`: it can). Pointers are byte
/// addresses of x, of W's first element (offset applied), of act and of the kept gu (act's
/// when none is kept: the kernel then never touches it).
fn fused_blocker(x: u64, w: u64, act: u64, gu: u64, w_off: usize, inter: usize, k: usize) -> Option<String> {
    let blocker = tma_gemm_blocker([("x", x), ("act", act)], w, w_off, ("inter", inter), k);
    // gu takes the same bf16x2 stores as act (its row pitch, 2 * inter, is a multiple of 16).
    let gu_blocker = || (gu % 4 != 0).then(|| format!("gu at {gu:#x} is not 4-byte aligned"));
    blocker.or_else(gu_blocker).or_else(|| {
        // The up box's row coordinate, inter + n0, is an i32 on the device.
        (i32::try_from(2 * inter).is_err() || i32::try_from(k).is_err())
            .then(|| format!("inter = {inter} or k = {k} is past the kernel's 32-bit coordinates"))
    })
}

impl CudaBackend {
    /// The form `Backend::mlp_gate_up_act` runs on these operands: the one `DFLASH_MLP_KERNEL`
    /// picked at start-up, the fused kernel falling back to the two steps (logged once) where
    /// it cannot run.
    pub(super) fn mlp_form_for(
        &self,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        act: &CudaBuf,
        gu: Option<&CudaBuf>,
        shape: [usize; 3],
    ) -> MlpForm {
        let [rows, inter, h] = shape;
        if self.mlp_form == MlpForm::Fused {
            let wp = w.ptr + (w_off * w.dtype.size_bytes()) as u64;
            let gp = gu.map_or(act.ptr, |gu| gu.ptr);
            if let Some(why) = fused_blocker(x.ptr, wp, act.ptr, gp, w_off, inter, h) {
                if !FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
                    eprintln!(
                        "note      mlp_gate_up_act ({rows} x {inter} x {h}): {why}; running the GEMM and swiglu_fwd \
                         (logged once)"
                    );
                }
                return MlpForm::Gemm;
            }
        }
        self.mlp_form
    }

    /// `act[rows, inter] = swiglu(x[rows, h] w[w_off..][2 * inter, h]^T)` in the form `form`
    /// names, the projection kept in `gu` when given ([`MlpForm::Gemm`] without one: a `rows x 2 *
    /// inter` scratch of its own for the GEMM's output). Forcing [`MlpForm::Fused`] on operands it
    /// cannot take is an error, not a silent fallback.
    #[allow(clippy::too_many_arguments)]
    pub fn mlp_gate_up_act_with(
        &self,
        s: &Stream,
        x: &CudaBuf,
        w: &CudaBuf,
        w_off: usize,
        act: &mut CudaBuf,
        gu: Option<&mut CudaBuf>,
        rows: usize,
        inter: usize,
        h: usize,
        form: MlpForm,
    ) -> Result<()> {
        const OP: &str = "mlp_gate_up_act";
        match form {
            MlpForm::Gemm => mlp_two_step(self, s, x, w, w_off, act, gu, [rows, inter, h]),
            MlpForm::Fused => {
                check_len(OP, "x", x.len, 0, rows * h)?;
                check_len(OP, "w", w.len, w_off, 2 * inter * h)?;
                check_len(OP, "act", act.len, 0, rows * inter)?;
                if let Some(gu) = gu.as_deref() {
                    check_len(OP, "gu", gu.len, 0, rows * 2 * inter)?;
                }
                let (xp, wp, ap): (DevPtr<half::bf16>, DevPtr<half::bf16>, DevPtr<half::bf16>) =
                    (x.at(OP, 0)?, w.at(OP, w_off)?, act.at(OP, 0)?);
                // Without a gu to keep, act's address stands in (the kernel never touches it).
                let gp: DevPtr<half::bf16> = match gu.as_deref() {
                    Some(gu) => gu.at(OP, 0)?,
                    None => ap,
                };
                if rows == 0 || inter == 0 {
                    return Ok(());
                }
                if let Some(why) = fused_blocker(xp.addr(), wp.addr(), ap.addr(), gp.addr(), w_off, inter, h) {
                    return Err(BackendError::Shape {
                        op: OP,
                        what: format!("mlp_swiglu_wgmma_bf16 cannot run: {why}"),
                    });
                }
                let map_x = tensor_map_2d(OP, xp.addr(), h, rows, FC_BM)?;
                let map_w = tensor_map_2d(OP, wp.addr(), h, 2 * inter, MLP_BN)?;
                let tiles = rows.div_ceil(FC_BM) * inter.div_ceil(MLP_BN);
                // Persistent: one CTA per SM at most (MLP_SMEM_BYTES, 218,176 bytes of shared memory each).
                let grid = tiles.min(self.sm_count);
                let keep_gu = usize::from(gu.is_some());
                let args = launch::MlpSwigluWgmmaBf16 { map_x, map_w, act: ap, gu: gp, keep_gu, rows, inter, k: h };
                let kernel = launch::MlpSwigluWgmmaBf16::KERNEL;
                // Profiled as the GEMM it is (its FLOPs count with the GEMMs') under its own name.
                self.timed_as(
                    s,
                    Work::Kernel { family: kernel.family(), symbol: kernel.symbol() },
                    || Some(profile::fused_gemm_label(kernel.symbol(), rows, 2 * inter, h)),
                    || self.launch_untimed(s, kernel, (grid, FC_THREADS, MLP_SMEM_BYTES), args),
                )
            }
        }
    }
}

const _: () = assert!(FC_BK == super::tma::SWIZZLE_ROW, "mlp.cu's k-block is one swizzle row");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_form_takes_aligned_multiples_of_8_only() {
        assert_eq!(fused_blocker(0x1000, 0x2000, 0x3000, 0x4000, 0, 12288, 4096), None);
        assert!(fused_blocker(0x1000, 0x2000, 0x3000, 0x4000, 0, 12288, 0).unwrap().contains("k = 0"));
        assert!(fused_blocker(0x1000, 0x2000, 0x3000, 0x4000, 0, 12288, 4100).unwrap().contains("k = 4100"));
        assert!(fused_blocker(0x1000, 0x2000, 0x3000, 0x4000, 0, 100, 4096).unwrap().contains("inter = 100"));
        assert!(fused_blocker(0x1008, 0x2000, 0x3000, 0x4000, 0, 128, 64).unwrap().contains("x at 0x1008"));
        assert!(fused_blocker(0x1000, 0x2008, 0x3000, 0x4000, 4, 128, 64).unwrap().contains("element offset 4"));
        assert!(fused_blocker(0x1000, 0x2000, 0x3002, 0x4000, 0, 128, 64).unwrap().contains("act at 0x3002"));
        assert!(fused_blocker(0x1000, 0x2000, 0x3000, 0x4002, 0, 128, 64).unwrap().contains("gu at 0x4002"));
        // The second box's row coordinate, inter + n0, is an i32 on the device.
        assert!(fused_blocker(0x1000, 0x2000, 0x3000, 0x4000, 0, 1 << 30, 64).unwrap().contains("32-bit"));
    }

    #[test]
    fn the_env_names_each_form() {
        assert_eq!(MlpForm::from_env_value("gemm"), Some(MlpForm::Gemm));
        assert_eq!(MlpForm::from_env_value("fused"), Some(MlpForm::Fused));
        assert_eq!(MlpForm::from_env_value("Fused"), None);
    }
}
