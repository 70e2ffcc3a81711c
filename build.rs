//! Compiles every `kernels/*.cu` to an sm_90a cubin with nvcc and embeds the cubins in the crate
//! (`src/kernels.rs` includes the generated `$OUT_DIR/kernels.rs`).
//!
//! nvcc is looked for in this order: `$NVCC`, `$CUDA_HOME/bin/nvcc`, the project-local toolchain
//! that `scripts/install-cuda-toolchain.sh` installs (`.toolchain/py/nvidia/cu13/bin/nvcc`),
//! `nvcc` on `PATH`, `/usr/local/cuda/bin/nvcc`.
//! - No nvcc anywhere: a warning, and a CPU-only build (`KERNELS_BUILT = false`, no cubins), so the
//!   CPU reference backend builds and tests on any machine.
//! - `DFLASH_REQUIRE_KERNELS=1` and no nvcc, or any nvcc failure: the build fails with nvcc's
//!   output. A kernel that does not compile is never silently dropped.
//! - `$NVCC` set but not an executable: the build fails. Whoever sets it asked for that compiler;
//!   falling back to another one (or to CPU-only) would hide the typo. Unset it to search.
//! - `DFLASH_PTXAS_VERBOSE=1`: ptxas register, stack and spill counts per kernel as warnings.
//!
//! Cargo reruns this script when a kernel source or header changes, when one of the environment
//! variables above changes, or when the nvcc that was used changes. Cargo cannot notice an nvcc
//! appearing after a CPU-only build (watching a missing path reruns the script on every build), so
//! the install script touches build.rs; after installing nvcc another way, `touch build.rs`.

use std::env;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;

/// The one GPU target: wgmma and the other Hopper-only instructions need the `a` variant.
const CUBIN_ARCH: &str = "sm_90a";
const GENCODE: &str = "-gencode=arch=compute_90a,code=sm_90a";
/// Flags for every kernel. No --use_fast_math: denormals and IEEE division/sqrt stay as on the
/// CPU reference, which bit-exact tests (pack, noise) depend on.
const NVCC_FLAGS: &[&str] = &["-cubin", GENCODE, "-O3", "-std=c++17"];
/// Where `scripts/install-cuda-toolchain.sh` puts nvcc, relative to the crate root.
const LOCAL_NVCC: &str = ".toolchain/py/nvidia/cu13/bin/nvcc";
const INSTALL_HINT: &str = "scripts/install-cuda-toolchain.sh (pip wheels, no GPU needed)";

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels_dir = manifest_dir.join("kernels");

    println!("cargo::rustc-check-cfg=cfg(dflash_kernels)");
    for var in ["NVCC", "CUDA_HOME", "DFLASH_REQUIRE_KERNELS", "DFLASH_PTXAS_VERBOSE"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    println!("cargo::rerun-if-changed={}", kernels_dir.display());
    let (sources, headers) = list_kernel_files(&kernels_dir);
    for path in sources.iter().chain(&headers) {
        println!("cargo::rerun-if-changed={}", path.display());
    }

    let require = env_flag("DFLASH_REQUIRE_KERNELS");
    let Some(nvcc) = find_nvcc(&manifest_dir) else {
        if require {
            panic!(
                "DFLASH_REQUIRE_KERNELS is set but no nvcc was found ($NVCC, $CUDA_HOME/bin, \
                 {LOCAL_NVCC}, PATH, /usr/local/cuda/bin). Install one with {INSTALL_HINT}."
            );
        }
        println!(
            "cargo::warning=nvcc not found: building CPU-only (no CUDA kernels embedded). To build \
             the kernels, run {INSTALL_HINT} and rebuild (nvcc installed another way: `touch build.rs`)."
        );
        write_generated(&out_dir, false, &[]);
        return;
    };
    println!("cargo::rerun-if-changed={}", nvcc.display());

    let cubin_dir = out_dir.join("cubins");
    fs::create_dir_all(&cubin_dir).unwrap_or_else(|e| panic!("creating {}: {e}", cubin_dir.display()));
    let verbose = env_flag("DFLASH_PTXAS_VERBOSE");
    let results = compile_all(&nvcc, &kernels_dir, &cubin_dir, &sources, verbose);

    let mut failures = String::new();
    let mut cubins = Vec::new();
    for (source, result) in sources.iter().zip(results) {
        match result {
            Ok(built) => {
                for line in built.messages {
                    println!("cargo::warning={line}");
                }
                cubins.push((built.family, built.cubin));
            }
            Err(msg) => {
                let _ = writeln!(failures, "--- {} ---\n{msg}", source.display());
            }
        }
    }
    if !failures.is_empty() {
        panic!("nvcc ({}) failed:\n{failures}", nvcc.display());
    }
    write_generated(&out_dir, true, &cubins);
    println!("cargo::rustc-cfg=dflash_kernels");
}

/// `kernels/*.cu` (compiled) and `kernels/*.cuh` (tracked for reruns), each sorted so the
/// generated table does not depend on directory order.
fn list_kernel_files(dir: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut sources = Vec::new();
    let mut headers = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return (sources, headers),
        Err(e) => panic!("reading {}: {e}", dir.display()),
    };
    for entry in entries {
        let path = entry.unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())).path();
        match path.extension().and_then(|x| x.to_str()) {
            Some("cu") => sources.push(path),
            Some("cuh") => headers.push(path),
            _ => {}
        }
    }
    sources.sort();
    headers.sort();
    (sources, headers)
}

/// True for `1`, `true`, `yes`, `on` (any case); unset, empty, `0`, `false`, `no`, `off` are false.
fn env_flag(name: &str) -> bool {
    match env::var(name) {
        Ok(v) => !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false" | "no" | "off"),
        Err(_) => false,
    }
}

fn is_executable_file(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::metadata(path).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
    }
    #[cfg(not(unix))]
    {
        path.is_file()
    }
}

fn search_path(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path).map(|dir| dir.join(name)).find(|p| is_executable_file(p))
}

fn find_nvcc(manifest_dir: &Path) -> Option<PathBuf> {
    if let Some(explicit) = env::var_os("NVCC").filter(|v| !v.is_empty()) {
        return Some(explicit_nvcc(explicit));
    }
    if let Some(home) = env::var_os("CUDA_HOME").filter(|v| !v.is_empty()) {
        let candidate = PathBuf::from(&home).join("bin").join("nvcc");
        if is_executable_file(&candidate) {
            return Some(candidate);
        }
        println!("cargo::warning=CUDA_HOME={} has no bin/nvcc; looking elsewhere", PathBuf::from(home).display());
    }
    let local = manifest_dir.join(LOCAL_NVCC);
    if is_executable_file(&local) {
        return Some(local);
    }
    if let Some(found) = search_path("nvcc") {
        return Some(found);
    }
    let system = PathBuf::from("/usr/local/cuda/bin/nvcc");
    is_executable_file(&system).then_some(system)
}

/// `$NVCC` is a path, or a bare name looked up on PATH. Not finding it is an error (module doc).
fn explicit_nvcc(value: OsString) -> PathBuf {
    let path = PathBuf::from(&value);
    let resolved =
        if path.components().count() == 1 { search_path(&value.to_string_lossy()) } else { Some(path.clone()) };
    match resolved {
        Some(p) if is_executable_file(&p) => p,
        _ => panic!(
            "NVCC={}: no such executable (NVCC takes a path, or a name found on PATH). Point it at \
             nvcc, or unset it to search $CUDA_HOME/bin, {LOCAL_NVCC}, PATH and /usr/local/cuda/bin.",
            path.display()
        ),
    }
}

struct BuiltKernel {
    family: String,
    cubin: PathBuf,
    /// Lines to show as cargo warnings: nvcc warnings, and ptxas statistics when asked for.
    messages: Vec<String>,
}

/// Compiles the sources on up to `NUM_JOBS` threads (cargo's -j), one nvcc process per file.
fn compile_all(
    nvcc: &Path,
    kernels_dir: &Path,
    cubin_dir: &Path,
    sources: &[PathBuf],
    verbose: bool,
) -> Vec<Result<BuiltKernel, String>> {
    let jobs = env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse::<usize>().ok())
        .or_else(|| thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1)
        .clamp(1, sources.len().max(1));
    let next = AtomicUsize::new(0);
    let results: Vec<Mutex<Option<Result<BuiltKernel, String>>>> = sources.iter().map(|_| Mutex::new(None)).collect();
    thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(source) = sources.get(i) else { break };
                let result = compile_one(nvcc, kernels_dir, cubin_dir, source, verbose);
                *results[i].lock().expect("no other thread panics while holding it") = Some(result);
            });
        }
    });
    results.into_iter().map(|slot| slot.into_inner().expect("not poisoned").expect("every index was claimed")).collect()
}

fn compile_one(
    nvcc: &Path,
    kernels_dir: &Path,
    cubin_dir: &Path,
    source: &Path,
    verbose: bool,
) -> Result<BuiltKernel, String> {
    let family = source
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| format!("{}: kernel file names must be UTF-8", source.display()))?
        .to_string();
    let cubin = cubin_dir.join(format!("{family}.cubin"));
    let mut cmd = Command::new(nvcc);
    cmd.args(NVCC_FLAGS).arg("-I").arg(kernels_dir);
    if verbose {
        cmd.args(["-Xptxas", "-v"]);
    }
    cmd.arg("-o").arg(&cubin).arg(source);
    let output = cmd.output().map_err(|e| format!("could not run {}: {e}", nvcc.display()))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!("{:?} exited with {}\n{stdout}{stderr}", cmd, output.status));
    }
    let bytes = fs::metadata(&cubin).map(|m| m.len()).unwrap_or(0);
    if bytes == 0 {
        return Err(format!("{:?} succeeded but wrote no cubin at {}", cmd, cubin.display()));
    }
    let messages =
        stdout.lines().chain(stderr.lines()).filter_map(|line| filter_nvcc_line(&family, line, verbose)).collect();
    Ok(BuiltKernel { family, cubin, messages })
}

/// Which nvcc output lines become cargo warnings. ptxas `info` lines (only present with -v):
/// the entry-function name and the register / stack / spill counts; everything else nvcc prints
/// on success is a real compiler warning and is always shown.
fn filter_nvcc_line(family: &str, line: &str, verbose: bool) -> Option<String> {
    let trimmed = line.trim();
    if trimmed.is_empty() {
        return None;
    }
    let is_stat =
        trimmed.starts_with("ptxas info") || trimmed.contains("bytes stack frame") || trimmed.contains("spill");
    if is_stat {
        let wanted = verbose
            && (trimmed.contains("Compiling entry function")
                || trimmed.contains("registers")
                || trimmed.contains("spill"));
        return wanted.then(|| format!("{family}.cu: {trimmed}"));
    }
    Some(format!("{family}.cu: {trimmed}"))
}

/// Writes `$OUT_DIR/kernels.rs`, included by `src/kernels.rs`.
fn write_generated(out_dir: &Path, built: bool, cubins: &[(String, PathBuf)]) {
    let mut src = String::new();
    src.push_str("// @generated by build.rs: the cubins compiled from kernels/*.cu. Do not edit.\n\n");
    let _ = writeln!(
        src,
        "/// True when build.rs found nvcc and compiled every `kernels/*.cu`; false for a CPU-only build.\n\
         pub const KERNELS_BUILT: bool = {built};\n"
    );
    let _ = writeln!(
        src,
        "/// The GPU architecture the cubins are compiled for (load them only on such a device).\n\
         pub const CUBIN_ARCH: &str = {CUBIN_ARCH:?};\n"
    );
    src.push_str(
        "/// `(family, cubin)` per kernel file, sorted by family: family = the file stem of \
         `kernels/<family>.cu`.\n",
    );
    src.push_str("pub static CUBINS: &[(&str, &[u8])] = &[\n");
    for (family, cubin) in cubins {
        let path = cubin.to_str().unwrap_or_else(|| panic!("OUT_DIR path is not UTF-8: {}", cubin.display()));
        let _ = writeln!(src, "    ({family:?}, include_bytes!({path:?})),");
    }
    src.push_str("];\n");
    let dest = out_dir.join("kernels.rs");
    // Rewrite only on change, so an unchanged table does not look modified.
    if fs::read_to_string(&dest).ok().as_deref() != Some(src.as_str()) {
        fs::write(&dest, src).unwrap_or_else(|e| panic!("writing {}: {e}", dest.display()));
    }
}
