//! The drafter's data-parallel gradient all-reduce across GPUs, through NCCL (loaded at run time
//! like the other CUDA libraries, so a build without NCCL still runs on one drafter GPU).
//!
//! Communicators come from `ncclCommInitAll` (one process drives every rank, one thread per
//! rank); a collective is enqueued on the rank's compute stream like any kernel. With one rank no
//! NCCL is needed or loaded.

use std::sync::RwLock;

use cudarc::nccl::{result as nc, sys as ncs};

use super::{CudaBackend, CudaBuf, Stream};
use crate::backend::{BackendError, NcclFailure, Result};
use crate::tensor::DType;

/// One rank's communicator (null for a group of one).
pub struct NcclComm {
    /// Null once aborted (an aborted communicator is freed by the abort). Enqueueing holds the
    /// read lock, so an abort from another thread never frees it under an enqueue.
    comm: RwLock<ncs::ncclComm_t>,
    ranks: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; each rank's
// communicator is only used by that rank's thread.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let comm = match self.comm.get_mut() {
            Ok(c) => std::mem::replace(c, std::ptr::null_mut()),
            Err(p) => std::mem::replace(p.into_inner(), std::ptr::null_mut()),
        };
        if !comm.is_null() {
            // SAFETY: created by ncclCommInitAll, not aborted, destroyed once.
            let _ = unsafe { nc::comm_destroy(comm) };
        }
    }
}

pub(super) fn comm_group(group: &[&CudaBackend]) -> Result<Vec<NcclComm>> {
    let n = group.len();
    if n <= 1 {
        return Ok((0..n).map(|_| NcclComm { comm: RwLock::new(std::ptr::null_mut()), ranks: 1 }).collect());
    }
    // SAFETY: only probes whether the shared library loads.
    if !unsafe { ncs::is_culib_present() } {
        return Err(BackendError::NcclMissing { ranks: n });
    }
    let devs: Vec<i32> = group.iter().map(|b| b.ctx.ordinal() as i32).collect();
    let mut sorted = devs.clone();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.len() != n {
        return Err(BackendError::Unsupported(format!(
            "--drafter-gpus {devs:?}: each drafter rank needs its own GPU (a device is listed twice)"
        )));
    }
    let mut comms = vec![std::ptr::null_mut(); n];
    // SAFETY: `comms` has room for n communicators, `devs` lists n distinct valid ordinals.
    unsafe { nc::comm_init_all(comms.as_mut_ptr(), n as i32, devs.as_ptr()) }.map_err(|e| BackendError::Nccl {
        context: format!("ncclCommInitAll over GPUs {devs:?}"),
        source: NcclFailure(e.0),
    })?;
    // Our own calls bind their context; NCCL's initialisation changed this thread's device.
    let _ = group[0].bind();
    Ok(comms.into_iter().map(|comm| NcclComm { comm: RwLock::new(comm), ranks: n }).collect())
}

impl CudaBackend {
    pub(super) fn all_reduce_impl(&self, s: &Stream, comm: &NcclComm, buf: &mut CudaBuf) -> Result<()> {
        if comm.ranks <= 1 || buf.len == 0 {
            return Ok(());
        }
        if buf.dtype != DType::F32 {
            return Err(BackendError::DType { op: "all_reduce_sum", expected: "f32", found: buf.dtype.name() });
        }
        let guard = comm.comm.read().map_err(|_| BackendError::Poisoned("NCCL communicator"))?;
        let c = *guard;
        if c.is_null() {
            return Err(BackendError::GroupAborted { op: "all_reduce_sum" });
        }
        self.bind()?;
        let p = buf.ptr as *mut std::ffi::c_void;
        // SAFETY: `buf` is a live f32 device buffer of `len` elements on this rank's device; the
        // reduction is in place and ordered on `s`.
        unsafe {
            nc::all_reduce(
                p,
                p,
                buf.len,
                ncs::ncclDataType_t::ncclFloat32,
                ncs::ncclRedOp_t::ncclSum,
                c,
                s.raw() as ncs::cudaStream_t,
            )
        }
        .map_err(|e| BackendError::Nccl {
            context: format!("ncclAllReduce of {} f32 on {}", buf.len, self.name),
            source: NcclFailure(e.0),
        })?;
        Ok(())
    }

    pub(super) fn comm_abort_impl(&self, comm: &NcclComm) {
        let Ok(mut guard) = comm.comm.write() else { return };
        let c = std::mem::replace(&mut *guard, std::ptr::null_mut());
        if !c.is_null() {
            // SAFETY: a live communicator, aborted once, with no enqueue in progress (we hold the
            // write lock); abort makes collectives pending on the device return.
            let _ = unsafe { nc::comm_abort(c) };
        }
    }
}
