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
    encode(ptr, &[inner, outer], &[inner * 2], &[SWIZZLE_ROW, box_outer])
        .map_err(|e| drv(format!("{op}: cuTensorMapEncodeTiled for a {outer} x {inner} bf16 matrix"), e))
}

/// A 3-D TMA descriptor over bf16 elements at `ptr`: dimension 0 of `dims[0]` contiguous
/// elements, dimensions 1 and 2 at `strides` bytes (any order of strides: a box then gathers,
/// e.g., the rows of several heads of a `[rows, heads * head_dim]` matrix into consecutive tile
/// rows), read in boxes of 64 x `box1` x `box2` elements with the 128-byte swizzle; out-of-bounds
/// box elements read as zero.
pub(super) fn tensor_map_3d(
    op: &'static str,
    ptr: u64,
    dims: [usize; 3],
    strides: [usize; 2],
    box1: usize,
    box2: usize,
) -> Result<sys::CUtensorMap> {
    encode(ptr, &dims, &strides, &[SWIZZLE_ROW, box1, box2]).map_err(|e| {
        drv(format!("{op}: cuTensorMapEncodeTiled for a {dims:?} bf16 tensor with byte strides {strides:?}"), e)
    })
}

fn encode(
    ptr: u64,
    dims: &[usize],
    strides: &[usize],
    boxes: &[usize],
) -> std::result::Result<sys::CUtensorMap, cudarc::driver::DriverError> {
    assert!(dims.len() == boxes.len() && strides.len() + 1 == dims.len() && dims.len() <= 5);
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let rank = dims.len() as u32;
    let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    let strides: Vec<u64> = strides.iter().map(|&d| d as u64).collect();
    let boxes: Vec<u32> = boxes.iter().map(|&b| u32::try_from(b).expect("launch.cuh's tiles are small")).collect();
    let element_strides = vec![1u32; dims.len()];
    // SAFETY: dims, boxes and element_strides have `rank` entries and strides rank - 1 (checked
    // above), all outliving the call; `map` is a writable CUtensorMap. The call only encodes a
    // descriptor on the host.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            rank,
            ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()?;
    Ok(map)
}
