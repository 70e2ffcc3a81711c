//! The backend's errors: what an op reports before it runs (shapes, dtypes, arguments) and while it
//! runs (the CUDA driver, cuBLASLt, NCCL, the allocator), and why the CUDA backend could not start.
//!
//! Library errors keep the failing call's own error as their `source` and say what was being done
//! (the kernel, the shapes, the bytes). Out of memory is its own variant, whichever layer noticed it
//! (our allocator, or the driver's CUDA_ERROR_OUT_OF_MEMORY), and its message says what to reduce.
//!
//! Messages print the CUDA status by its code name (`CUDA_ERROR_INVALID_VALUE`), never through
//! cudarc's `Debug`, which asks libcuda for the text and so panics where no driver is installed.

use cudarc::cublaslt::result::CublasError;
use cudarc::cublaslt::sys::cublasStatus_t;
use cudarc::driver::{sys::CUresult, DriverError};
use cudarc::nccl::sys::ncclResult_t;

use crate::backend::slots::SlotError;

/// Errors an op reports before it runs (shapes, lengths, arguments) or while it runs.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{op}: {what}")]
    Shape { op: &'static str, what: String },
    #[error("{op}: buffer is {found}, expected {expected}")]
    DType { op: &'static str, expected: &'static str, found: &'static str },
    /// A kernel argument its launcher rejected before launching (null, misaligned, out of range).
    #[error("kernel {kernel}: argument `{param}` {what}")]
    Argument { kernel: &'static str, param: &'static str, what: String },
    /// The device (or the allocator in front of it) could not provide the memory asked for.
    #[error("{}", oom_message(context, *requested, *held, *device))]
    OutOfMemory {
        /// What asked, e.g. "alloc of 4096 bf16 elements on cuda:0".
        context: String,
        /// Bytes asked for (None where the failing call does not say, e.g. a cuBLASLt plan).
        requested: Option<usize>,
        /// Our allocator's holdings when it gave up: (reserved, in live buffers), in bytes.
        held: Option<(usize, usize)>,
        /// The device's (free, total) bytes as the driver reported them after the failure.
        device: Option<(usize, usize)>,
        /// The driver's error, when the driver (not our allocator) said so.
        #[source]
        source: Option<DriverError>,
    },
    /// The host could not provide a buffer of the CPU backend (which keeps every buffer in host
    /// memory at its working precision).
    #[error(
        "out of host memory: {context} asked for {requested} bytes ({}); the CPU backend keeps every buffer, the target's weights included, in host memory at {elem_bytes} bytes an element: use a smaller target or drafter, shorter or fewer sequences (--seq-len, --batch-size), or a GPU (--device cuda)",
        mib(*.requested)
    )]
    HostOutOfMemory { context: String, requested: usize, elem_bytes: usize },
    /// Any other failed CUDA driver call.
    #[error("{context}: CUDA driver error {}", cu_name(.source))]
    Driver {
        context: String,
        #[source]
        source: DriverError,
    },
    /// A failed cuBLASLt call.
    #[error("{context}: cuBLASLt error {:?}", .source.0)]
    Blas {
        context: String,
        #[source]
        source: CublasError,
    },
    /// A failed NCCL call.
    #[error("{context}: {source}")]
    Nccl {
        context: String,
        #[source]
        source: NcclFailure,
    },
    /// Data-parallel training on several drafter GPUs without a loadable libnccl.so.
    #[error(
        "data-parallel training on {ranks} drafter GPUs needs NCCL, and no libnccl.so was found. Install it \
         (`pip install nvidia-nccl-cu13`, or the libnccl2 package) and put the folder holding libnccl.so on \
         LD_LIBRARY_PATH (a pip install ships libnccl.so.2: link libnccl.so to it), or give one drafter GPU"
    )]
    NcclMissing { ranks: usize },
    /// A collective whose group was aborted because another rank stopped.
    #[error("{op}: the group was aborted (another rank stopped)")]
    GroupAborted { op: &'static str },
    /// A request the configuration cannot serve (the message names the option to change).
    #[error("{0}")]
    Unsupported(String),
    /// A thread panicked while holding one of the backend's locks; the state behind it is unknown.
    #[error("the {0} lock is poisoned (another thread panicked while holding it)")]
    Poisoned(&'static str),
    /// The pinned host slot pool of the host-staged transport.
    #[error(transparent)]
    Slot(#[from] SlotError),
    /// A fault a test asked for (the copy-error hooks), so that error paths run on purpose.
    #[error("injected fault: {0}")]
    Injected(String),
}

impl BackendError {
    /// True when the device ran out of memory (our allocator or the driver said so): the caller
    /// may retry with smaller batches instead of treating it as a bug.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, BackendError::OutOfMemory { .. })
    }

    /// A failed driver call, as [`BackendError::OutOfMemory`] when the driver said
    /// CUDA_ERROR_OUT_OF_MEMORY (with `requested` bytes when the call says how many).
    pub fn driver(context: impl Into<String>, requested: Option<usize>, source: DriverError) -> Self {
        let context = context.into();
        if source.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return BackendError::OutOfMemory { context, requested, held: None, device: None, source: Some(source) };
        }
        BackendError::Driver { context, source }
    }

    /// A failed cuBLASLt call; CUBLAS_STATUS_ALLOC_FAILED is out of memory.
    pub fn blas(context: impl Into<String>, source: CublasError) -> Self {
        let context = context.into();
        if source.0 == cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED {
            return BackendError::OutOfMemory { context, requested: None, held: None, device: None, source: None };
        }
        BackendError::Blas { context, source }
    }

    /// Fills in the device's (free, total) bytes of an out-of-memory error (other errors unchanged).
    pub fn with_device_memory(mut self, free_total: Option<(usize, usize)>) -> Self {
        if let BackendError::OutOfMemory { device, .. } = &mut self {
            *device = device.or(free_total);
        }
        self
    }
}

/// The CUDA status's code name, without asking the driver.
pub(crate) fn cu_name(e: &DriverError) -> String {
    format!("{:?}", e.0)
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn oom_message(
    context: &str,
    requested: Option<usize>,
    held: Option<(usize, usize)>,
    device: Option<(usize, usize)>,
) -> String {
    let mut m = format!("out of device memory: {context}");
    if let Some(r) = requested {
        m += &format!(" asked for {r} bytes ({})", mib(r));
    }
    if let Some((reserved, live)) = held {
        m += &format!("; this process's allocator holds {} of which {} are in live buffers", mib(reserved), mib(live));
    }
    if let Some((free, total)) = device {
        m += &format!("; the device has {} free of {}", mib(free), mib(total));
    }
    m + ". Split each step into more micro-batches (halve --batch-size and double --grad-accum: the same \
         sequences per step, about half the drafter's activations), or reduce --seq-len, --logits-chunk or \
         --pad-to-tokens; with a large drafter beside its target, run --sync (no second step's target \
         forward in flight) and keep the drafter's AdamW moments in host memory (--offload-optimizer: 8 bytes \
         per drafter parameter off the device); or stop other users of this GPU"
}

/// An NCCL status as an error (cudarc's `NcclError` implements neither `Display` nor `Error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("NCCL error {0:?}")]
pub struct NcclFailure(pub ncclResult_t);

/// Why the CUDA backend could not start, each with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("no CUDA driver (libcuda.so) found: install the NVIDIA driver, or use --device cpu")]
    NoDriver,
    #[error(
        "this binary was built without CUDA kernels (no nvcc at build time): run \
         scripts/install-cuda-toolchain.sh and rebuild, or use --device cpu"
    )]
    NoKernels,
    #[error("the CUDA driver failed to initialise ({}): check nvidia-smi", cu_name(.0))]
    DriverInit(#[source] DriverError),
    #[error("no CUDA device visible: check nvidia-smi and CUDA_VISIBLE_DEVICES, or use --device cpu")]
    NoDevices,
    #[error(
        "no CUDA device {ordinal} ({count} device(s) present, numbered from 0): pick another \
         --drafter-gpus/--device ordinal, or check CUDA_VISIBLE_DEVICES"
    )]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error(
        "CUDA device {ordinal} is too old: the kernels need sm_90 (Hopper), found sm_{major}{minor}. \
         Run on an H100/H200-class GPU, or use --device cpu"
    )]
    TooOld { ordinal: usize, major: i32, minor: i32 },
    #[error(
        "CUDA device {ordinal} is sm_{major}{minor}, but the embedded cubins are {cubin_arch} only: add the \
         target to build.rs's gencode and rebuild, or use --device cpu"
    )]
    UnsupportedArch { ordinal: usize, major: i32, minor: i32, cubin_arch: &'static str },
    #[error("kernels/{family}.cu's cubin failed to load ({}): the driver may be too old for CUDA 13.0 cubins (update it)", cu_name(.source))]
    KernelLoad {
        family: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("kernel {symbol} is missing from kernels/{family}.cu's cubin ({}): rebuild (a stale build?)", cu_name(.source))]
    MissingKernel {
        symbol: &'static str,
        family: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("kernels/{0}.cu was not embedded in this binary: rebuild with nvcc available")]
    MissingFamily(&'static str),
    #[error("cuBLASLt: {source}")]
    Blas {
        #[source]
        source: BackendError,
    },
    #[error(
        "libcublasLt.so not found: install the CUDA 13 cuBLAS runtime (pip install nvidia-cublas), or use --device cpu"
    )]
    NoCublasLt,
    #[error("DFLASH_CE_KERNEL={value} names no cross-entropy kernel: use one of {known}, or unset it")]
    UnknownCeKernel { value: String, known: String },
    #[error("DFLASH_MLP_KERNEL={value} names no MLP form: use fused (kernels/mlp.cu, the default) or gemm (cuBLASLt's GEMM, then swiglu_fwd), or unset it")]
    UnknownMlpKernel { value: String },
    /// A start-up call failed (a driver, cuBLASLt or occupancy query).
    #[error("starting CUDA device {ordinal}: {source}")]
    Backend {
        ordinal: usize,
        #[source]
        source: BackendError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn driver_out_of_memory_becomes_the_out_of_memory_variant() {
        let e = BackendError::driver(
            "alloc of 1024 bf16 elements on cuda:0",
            Some(2048),
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        )
        .with_device_memory(Some((1 << 20, 80 << 30)));
        assert!(e.is_out_of_memory());
        assert!(e.source().is_some(), "the driver error is kept as the source");
        let m = e.to_string();
        for part in [
            "alloc of 1024 bf16",
            "2048 bytes",
            "1.0 MiB free of 81920.0 MiB",
            "--batch-size",
            "--grad-accum",
            "--seq-len",
        ] {
            assert!(m.contains(part), "{part:?} missing from {m}");
        }
    }

    /// A CPU-backend buffer larger than the host can give is an error that names its size and the
    /// way out, not an abort of the process.
    #[test]
    fn cpu_allocations_beyond_the_host_are_errors() {
        use crate::backend::cpu::{CpuBackend, CpuStream};
        use crate::backend::Backend as _;
        let be = CpuBackend::new();
        for len in [1usize << 50, usize::MAX / 2] {
            let Err(e) = be.alloc(&CpuStream, crate::tensor::DType::BF16, len) else {
                panic!("{len} elements allocated")
            };
            let m = e.to_string();
            assert!(matches!(e, BackendError::HostOutOfMemory { elem_bytes: 4, .. }), "{m}");
            for part in [format!("alloc of {len} bf16 elements on the cpu"), "--device cuda".into()] {
                assert!(m.contains(&part), "{part:?} missing from {m}");
            }
        }
        assert_eq!(be.len(&be.alloc_uninit(&CpuStream, crate::tensor::DType::F32, 3).unwrap()), 3);
    }

    #[test]
    fn other_driver_errors_keep_their_code_and_context() {
        let e = BackendError::driver("launching rope_bf16", None, DriverError(CUresult::CUDA_ERROR_INVALID_VALUE));
        assert!(!e.is_out_of_memory());
        assert!(matches!(e, BackendError::Driver { .. }));
        assert_eq!(e.to_string(), "launching rope_bf16: CUDA driver error CUDA_ERROR_INVALID_VALUE");
        assert!(e.source().is_some());
    }

    #[test]
    fn cublas_alloc_failure_is_out_of_memory() {
        let oom = BackendError::blas("gemm plan", CublasError(cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED));
        assert!(oom.is_out_of_memory());
        let other = BackendError::blas("gemm 8 x 8 x 8", CublasError(cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE));
        assert!(!other.is_out_of_memory());
        assert_eq!(other.to_string(), "gemm 8 x 8 x 8: cuBLASLt error CUBLAS_STATUS_INVALID_VALUE");
    }

    #[test]
    fn start_errors_name_the_fix() {
        let e = StartError::NoSuchDevice { ordinal: 3, count: 2 };
        assert!(e.to_string().contains("no CUDA device 3 (2 device(s) present"), "{e}");
        let e = StartError::TooOld { ordinal: 0, major: 8, minor: 0 };
        assert!(e.to_string().contains("need sm_90 (Hopper), found sm_80"), "{e}");
        assert!(StartError::NoDriver.to_string().contains("--device cpu"));
        let e = StartError::Backend { ordinal: 1, source: BackendError::Poisoned("allocator") };
        assert!(e.source().is_some());
        let e = BackendError::Nccl {
            context: "ncclAllReduce of 4 f32".into(),
            source: NcclFailure(ncclResult_t::ncclUnhandledCudaError),
        };
        assert_eq!(e.to_string(), "ncclAllReduce of 4 f32: NCCL error ncclUnhandledCudaError");
    }
}
