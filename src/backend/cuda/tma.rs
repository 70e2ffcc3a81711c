//! TMA descriptors (the host side of kernels/tma.cuh) for the kernels that load shared-memory
//! tiles with the Tensor Memory Accelerator: fc.cu's GEMM and attention_wgmma.cu's
//! warp-specialised attention.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::drv;
use crate::backend::Result;

/// bf16 elements in one 128-byte swizzle row: the inner box size of every TMA descriptor here.
pub(super) const SWIZZLE_ROW: usize = 64;

/// A 2-D TMA descriptor over a row-major bf16 matrix `[outer, inner]` at `ptr`, read in boxes of
/// 64 x `box_outer` elements (one 128-byte row by `box_outer` rows) with the 128-byte swizzle the
/// kernels' wgmma descriptors expect; out-of-bounds box elements read as zero. `op` names the
/// caller in the error.
pub(super) fn tensor_map_2d(
    op: &'static str,
    ptr: u64,
    inner: usize,
    outer: usize,
    box_outer: usize,
) -> Result<sys::CUtensorMap> {
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let dims: [u64; 2] = [inner as u64, outer as u64];
    let pitch: [u64; 1] = [inner as u64 * 2];
    let tile = |n: usize| u32::try_from(n).expect("launch.cuh's tiles are small");
    let boxes: [u32; 2] = [tile(SWIZZLE_ROW), tile(box_outer)];
    let element_strides: [u32; 2] = [1, 1];
    // SAFETY: every array has the length rank 2 asks for (strides: rank - 1) and outlives the
    // call; `map` is a writable CUtensorMap. The call only encodes a descriptor on the host.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            ptr as *mut c_void,
            dims.as_ptr(),
            pitch.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(|e| drv(format!("{op}: cuTensorMapEncodeTiled for a {outer} x {inner} bf16 matrix"), e))?;
    Ok(map)
}
