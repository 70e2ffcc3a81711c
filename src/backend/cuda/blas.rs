//! cuBLASLt GEMMs: bf16 operands, f32 accumulation, bf16 or f32 output, one plan per shape with
//! the algorithm fixed at first use (so a run's results are deterministic).
//!
//! Row-major `C[m, n] = op(A) op(B)` is computed as the column-major `C^T = op(B)^T op(A)^T`:
//! our B is cuBLAS's first operand, our A its second.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::{result as lt, sys};

use crate::backend::{BackendError, Gemm, Result, StartError};
use crate::tensor::DType;

/// cuBLASLt workspace per call (32 MiB: what Hopper's heuristics ask for at large shapes).
pub const WORKSPACE_BYTES: usize = 32 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    f32_out: bool,
}

impl Key {
    fn of(g: &Gemm, c_dtype: DType) -> Self {
        Key { m: g.m, n: g.n, k: g.k, ta: g.ta, tb: g.tb, f32_out: c_dtype == DType::F32 }
    }
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    /// What the heuristic offers, best first; `matmul` runs the first.
    algos: Vec<sys::cublasLtMatmulAlgo_t>,
}

/// A cuBLASLt algorithm's configuration: cuBLASLt's enum values (`None`: not readable), e.g.
/// `algo 66 tile 24 stages 35 split-k 1 swizzle 0` (tile 24 is 256x128).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AlgoConfig {
    pub algo: Option<u32>,
    pub tile: Option<u32>,
    pub stages: Option<u32>,
    pub split_k: Option<u32>,
    pub swizzle: Option<u32>,
}

impl std::fmt::Display for AlgoConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = |x: Option<u32>| x.map_or("?".to_string(), |v| v.to_string());
        write!(
            f,
            "algo {} tile {} stages {} split-k {} swizzle {}",
            v(self.algo),
            v(self.tile),
            v(self.stages),
            v(self.split_k),
            v(self.swizzle)
        )
    }
}

/// How many algorithms a plan keeps from cuBLASLt's heuristic (the bench times each of them).
pub const CANDIDATES: usize = 8;

pub struct Lt {
    handle: sys::cublasLtHandle_t,
    plans: Mutex<HashMap<Key, Plan>>,
}

// SAFETY: the handle is used for matmuls from several threads; cuBLASLt handles are thread-safe
// for that, and the plan cache is behind a mutex.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

/// A failed cuBLASLt call while doing `what` for the GEMM `key`.
fn err(what: &'static str, key: Key) -> impl FnOnce(lt::CublasError) -> BackendError {
    move |e| {
        let out = if key.f32_out { "f32" } else { "bf16" };
        let shape = format!("m {} n {} k {} ta {} tb {}, {out} out", key.m, key.n, key.k, key.ta, key.tb);
        BackendError::blas(format!("cuBLASLt {what} (gemm {shape})"), e)
    }
}

impl Lt {
    pub fn new() -> std::result::Result<Self, StartError> {
        // SAFETY: checks whether libcublasLt can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(StartError::NoCublasLt);
        }
        let handle = lt::create_handle()
            .map_err(|e| StartError::Blas { source: BackendError::blas("creating the cuBLASLt handle", e) })?;
        Ok(Lt { handle, plans: Mutex::new(HashMap::new()) })
    }

    /// The plan cache, holding `key`'s plan (made now if this is the shape's first use).
    fn plans_with(&self, key: Key) -> Result<std::sync::MutexGuard<'_, HashMap<Key, Plan>>> {
        let mut plans = self.plans.lock().map_err(|_| BackendError::Poisoned("cuBLASLt plan cache"))?;
        if let std::collections::hash_map::Entry::Vacant(e) = plans.entry(key) {
            e.insert(self.plan(key)?);
        }
        Ok(plans)
    }

    fn plan(&self, key: Key) -> Result<Plan> {
        let bf = sys::cudaDataType_t::CUDA_R_16BF;
        let out_t = if key.f32_out { sys::cudaDataType_t::CUDA_R_32F } else { bf };
        let desc =
            lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F)
                .map_err(err("creating the matmul descriptor", key))?;
        // cuBLAS operand 1 = our B: (n x k) after its op.
        // cublasOperation_t as i32: 0 = N, 1 = T.
        let op1: i32 = i32::from(key.tb);
        let op2: i32 = i32::from(key.ta);
        // SAFETY: a fresh descriptor; attribute sizes match their types.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &op1 as *const _ as *const c_void,
                std::mem::size_of_val(&op1),
            )
            .map_err(err("setting TRANSA", key))?;
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &op2 as *const _ as *const c_void,
                std::mem::size_of_val(&op2),
            )
            .map_err(err("setting TRANSB", key))?;
        }
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        // Stored shapes in column-major terms (rows, cols, ld).
        let a = if key.tb {
            lt::create_matrix_layout(bf, k, n, k as i64)
        } else {
            lt::create_matrix_layout(bf, n, k, n as i64)
        }
        .map_err(err("creating the A layout", key))?;
        let b = if key.ta {
            lt::create_matrix_layout(bf, m, k, m as i64)
        } else {
            lt::create_matrix_layout(bf, k, m, k as i64)
        }
        .map_err(err("creating the B layout", key))?;
        let c = lt::create_matrix_layout(out_t, n, m, n as i64).map_err(err("creating the C layout", key))?;
        let pref = lt::create_matmul_pref().map_err(err("creating the preference", key))?;
        let ws = WORKSPACE_BYTES as u64;
        // Reductions that add partial results in place are excluded: determinism first.
        let schemes: u32 = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32
            | sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE as u32;
        // SAFETY: a fresh preference; attribute sizes match.
        let algo = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const _ as *const c_void,
                8,
            )
            .map_err(err("setting the workspace size", key))?;
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                &schemes as *const _ as *const c_void,
                4,
            )
            .map_err(err("setting the reduction schemes", key))?;
            let mut found: Vec<sys::cublasLtMatmulHeuristicResult_t> = Vec::with_capacity(CANDIDATES);
            let mut count = 0i32;
            let h = sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                a,
                b,
                c,
                c,
                pref,
                CANDIDATES as i32,
                found.as_mut_ptr(),
                &mut count,
            )
            .result()
            .map_err(err("choosing an algorithm", key));
            let _ = lt::destroy_matmul_pref(pref);
            h?;
            // The heuristic wrote `count` results.
            found.set_len(count.clamp(0, CANDIDATES as i32) as usize);
            found
                .into_iter()
                .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|r| r.algo)
                .collect::<Vec<_>>()
        };
        if algo.is_empty() {
            return Err(err("choosing an algorithm", key)(lt::CublasError(
                sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
            )));
        }
        Ok(Plan { desc, a, b, c, algos: algo })
    }

    /// The `index`-th candidate's configuration for this GEMM (`None` past the heuristic's list),
    /// so that the bench's candidate sweeps say which configuration won.
    pub fn describe(&self, g: &Gemm, c_dtype: DType, index: usize) -> Result<Option<AlgoConfig>> {
        use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
        let key = Key::of(g, c_dtype);
        let plans = self.plans_with(key)?;
        let Some(algo) = plans[&key].algos.get(index) else { return Ok(None) };
        let read = |attr: A| -> Option<u32> {
            // Every attribute read here is a 32-bit integer.
            let (mut v, mut written) = (0u32, 0usize);
            // SAFETY: a valid algorithm from the heuristic; the buffer is 4 bytes, as these
            // attributes are.
            let st = unsafe {
                sys::cublasLtMatmulAlgoConfigGetAttribute(
                    algo,
                    attr,
                    &mut v as *mut u32 as *mut c_void,
                    4,
                    &mut written,
                )
            };
            (st == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(v)
        };
        Ok(Some(AlgoConfig {
            algo: read(A::CUBLASLT_ALGO_CONFIG_ID),
            tile: read(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
            stages: read(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
            split_k: read(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
            swizzle: read(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        }))
    }

    /// `D = alpha op(A) op(B) + beta C` on `stream` (pointers already offset; `c == d` for the
    /// usual in-place form, C and D share the layout) with the heuristic's `index`-th algorithm
    /// for this shape; `Ok(false)` (nothing enqueued) when it offered fewer.
    /// GEMMs run index 0, fixed per shape (a run's results are deterministic); the bench times
    /// every candidate against it.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        g: &Gemm,
        a: u64,
        b: u64,
        c: u64,
        d: u64,
        c_dtype: DType,
        ws: u64,
        ws_bytes: usize,
        stream: cudarc::driver::sys::CUstream,
        index: usize,
    ) -> Result<bool> {
        let key = Key::of(g, c_dtype);
        let plans = self.plans_with(key)?;
        let p = &plans[&key];
        let Some(algo) = p.algos.get(index) else { return Ok(false) };
        let (alpha, beta) = (g.alpha, g.beta);
        // SAFETY: the plan matches these shapes; the pointers hold the checked extents; alpha and
        // beta are host f32 (the default pointer mode); the workspace is ours for this call.
        unsafe {
            lt::matmul(
                self.handle,
                p.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                p.a,
                a as *const c_void,
                p.b,
                c as *const c_void,
                p.c,
                d as *mut c_void,
                p.c,
                algo,
                ws as *mut c_void,
                ws_bytes,
                stream as sys::cudaStream_t,
            )
        }
        .map_err(err("matmul", key))?;
        Ok(true)
    }
}
