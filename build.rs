//! Compiles every `kernels/*.cu` to an sm_90a cubin with nvcc and embeds the cubins in the crate
//! (`src/kernels.rs` includes the generated `$OUT_DIR/kernels.rs`).
//!
//! Also generated, from the sources alone (so CPU-only builds have them too):
//! - `$OUT_DIR/launch_consts.rs`: kernels/launch.cuh, the launch geometry the kernels and their
//!   launchers share, as Rust constants (`crate::kernels::launch`);
//! - `$OUT_DIR/kernel_table.rs`: every `extern "C"` kernel of kernels/*.cu (macro-stamped ones
//!   expanded) as a `Kernel` variant with its family, and one typed argument struct per signature
//!   whose launcher checks and converts each argument in the kernel's order
//!   (`src/backend/cuda/launch.rs` includes it). A parameter type without a Rust mapping fails the
//!   build (see `rust_param`).
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

    // Generated from the sources, with or without nvcc: the launch constants and the kernel table
    // (the Rust launchers compile, and are checked against the sources, in CPU-only builds too).
    write_launch_consts(&out_dir, &parse_launch_consts(&kernels_dir.join("launch.cuh")));
    let mut kernels = Vec::new();
    for source in &sources {
        let family = source.file_stem().and_then(|s| s.to_str()).expect("UTF-8 kernel file names");
        let text = fs::read_to_string(source).unwrap_or_else(|e| panic!("reading {}: {e}", source.display()));
        kernels.extend(parse_kernels(family, &text));
    }
    kernels.sort_by(|a, b| a.symbol.cmp(&b.symbol));
    for pair in kernels.windows(2) {
        assert!(pair[0].symbol != pair[1].symbol, "kernel {} is defined twice", pair[0].symbol);
    }
    write_kernel_table(&out_dir, &kernels);

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

// ---- launch constants: kernels/launch.cuh -> $OUT_DIR/launch_consts.rs -------------------------

/// One `constexpr` of kernels/launch.cuh: its name, value, and the comment lines above it.
struct LaunchConst {
    name: String,
    value: i64,
    doc: Vec<String>,
}

/// Parses kernels/launch.cuh (format in its header comment). Anything else on a line that is not a
/// comment, blank, or `#pragma once` fails the build: the file must stay readable by this parser.
fn parse_launch_consts(path: &Path) -> Vec<LaunchConst> {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut consts: Vec<LaunchConst> = Vec::new();
    let mut doc = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let at = || format!("{}:{}", path.display(), i + 1);
        if let Some(c) = line.strip_prefix("//") {
            doc.push(c.trim().to_string());
            continue;
        }
        if line.is_empty() || line == "#pragma once" {
            doc.clear();
            continue;
        }
        let body = line
            .strip_prefix("constexpr ")
            .and_then(|r| r.strip_suffix(';'))
            .unwrap_or_else(|| panic!("{}: expected `constexpr <int type> NAME = <expr>;`, found {line:?}", at()));
        let (decl, expr) = body.split_once('=').unwrap_or_else(|| panic!("{}: no `=` in {line:?}", at()));
        let mut words: Vec<&str> = decl.split_whitespace().collect();
        let name = words.pop().unwrap_or_else(|| panic!("{}: no name in {line:?}", at())).to_string();
        let ty = words.join(" ");
        if !matches!(ty.as_str(), "int" | "long long" | "unsigned" | "uint32_t") {
            panic!("{}: {name} has type {ty:?}; launch.cuh holds integers (int, long long, unsigned)", at());
        }
        let known = |n: &str| consts.iter().find(|c| c.name == n).map(|c| c.value);
        let value = eval_const_expr(expr, &known).unwrap_or_else(|e| panic!("{}: {name}: {e}", at()));
        if value < 0 {
            panic!("{}: {name} = {value}: launch constants are sizes and counts (>= 0)", at());
        }
        consts.push(LaunchConst { name, value, doc: std::mem::take(&mut doc) });
    }
    consts
}

/// Evaluates `+ - * / <<` and parentheses over integer literals (C suffixes allowed) and names.
fn eval_const_expr(expr: &str, known: &dyn Fn(&str) -> Option<i64>) -> Result<i64, String> {
    let mut tokens = Vec::new();
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            tokens.push(chars[start..i].iter().collect::<String>());
        } else if c == '<' && chars.get(i + 1) == Some(&'<') {
            tokens.push("<<".into());
            i += 2;
        } else if "+-*/()".contains(c) {
            tokens.push(c.to_string());
            i += 1;
        } else {
            return Err(format!("unexpected {c:?} in {expr:?}"));
        }
    }
    let mut pos = 0;
    let v = eval_shift(&tokens, &mut pos, known)?;
    if pos != tokens.len() {
        return Err(format!("trailing {:?} in {expr:?}", &tokens[pos..]));
    }
    Ok(v)
}

fn eval_shift(t: &[String], pos: &mut usize, known: &dyn Fn(&str) -> Option<i64>) -> Result<i64, String> {
    let mut v = eval_sum(t, pos, known)?;
    while t.get(*pos).map(String::as_str) == Some("<<") {
        *pos += 1;
        let r = eval_sum(t, pos, known)?;
        v = u32::try_from(r).ok().and_then(|r| v.checked_shl(r)).ok_or("shift out of range")?;
    }
    Ok(v)
}

fn eval_sum(t: &[String], pos: &mut usize, known: &dyn Fn(&str) -> Option<i64>) -> Result<i64, String> {
    let mut v = eval_product(t, pos, known)?;
    while let Some(op) = t.get(*pos).filter(|o| *o == "+" || *o == "-").cloned() {
        *pos += 1;
        let r = eval_product(t, pos, known)?;
        v = if op == "+" { v.checked_add(r) } else { v.checked_sub(r) }.ok_or("overflow")?;
    }
    Ok(v)
}

fn eval_product(t: &[String], pos: &mut usize, known: &dyn Fn(&str) -> Option<i64>) -> Result<i64, String> {
    let mut v = eval_atom(t, pos, known)?;
    while let Some(op) = t.get(*pos).filter(|o| *o == "*" || *o == "/").cloned() {
        *pos += 1;
        let r = eval_atom(t, pos, known)?;
        v = if op == "*" { v.checked_mul(r) } else { v.checked_div(r) }.ok_or("overflow or division by 0")?;
    }
    Ok(v)
}

fn eval_atom(t: &[String], pos: &mut usize, known: &dyn Fn(&str) -> Option<i64>) -> Result<i64, String> {
    let tok = t.get(*pos).ok_or("expression ends early")?.clone();
    *pos += 1;
    if tok == "(" {
        let v = eval_shift(t, pos, known)?;
        if t.get(*pos).map(String::as_str) != Some(")") {
            return Err("missing `)`".into());
        }
        *pos += 1;
        return Ok(v);
    }
    if tok.starts_with(|c: char| c.is_ascii_digit()) {
        let digits = tok.trim_end_matches(['u', 'U', 'l', 'L']);
        return digits.parse().map_err(|_| format!("bad literal {tok:?}"));
    }
    known(&tok).ok_or_else(|| format!("{tok:?} is not defined above it in launch.cuh"))
}

/// `$OUT_DIR/launch_consts.rs`: each constant as a `usize`, with its comment.
fn write_launch_consts(out_dir: &Path, consts: &[LaunchConst]) {
    let mut src = String::from("// @generated by build.rs from kernels/launch.cuh. Do not edit.\n\n");
    for c in consts {
        for d in &c.doc {
            let _ = writeln!(src, "/// {d}");
        }
        let _ = writeln!(src, "pub const {}: usize = {};", c.name, c.value);
    }
    write_if_changed(&out_dir.join("launch_consts.rs"), &src);
}

fn write_if_changed(dest: &Path, src: &str) {
    // Rewrite only on change, so an unchanged file does not look modified.
    if fs::read_to_string(dest).ok().as_deref() != Some(src) {
        fs::write(dest, src).unwrap_or_else(|e| panic!("writing {}: {e}", dest.display()));
    }
}

// ---- the kernel table: extern "C" kernels of kernels/*.cu -> $OUT_DIR/kernel_table.rs ----------

/// One `extern "C" __global__` kernel as its source declares it.
struct KernelDecl {
    symbol: String,
    family: String,
    /// `(C type without const/__restrict__/__grid_constant__, parameter name)`, in order.
    params: Vec<(String, String)>,
    /// The argument struct it launches with: kernels stamped out by one macro from one name
    /// template (`attn_causal_fwd_bf16_hd##D`) share one, and are its variants.
    group: String,
    /// The macro argument that made this symbol (`"64"` for `..._hd64`); None outside macros.
    variant: Option<String>,
}

/// Comments removed (they may mention `extern "C"`), line continuations joined.
fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let b = src.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'\\' && b.get(i + 1) == Some(&b'\n') {
            out.push(' ');
            i += 2;
        } else {
            let ch_len = src[i..].chars().next().map_or(1, char::len_utf8);
            out.push_str(&src[i..i + ch_len]);
            i += ch_len;
        }
    }
    out
}

/// Identifier characters, `#` included so a macro's name template (`name##D`) reads as one.
fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '#'
}

/// The text inside the parentheses that open at `open` (an index of `(`), and the index after them.
fn balanced(text: &str, open: usize) -> Option<(&str, usize)> {
    let mut depth = 0usize;
    for (i, c) in text[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some((&text[open + 1..open + i], open + i + 1));
                }
            }
            _ => {}
        }
    }
    None
}

/// Splits on commas outside parentheses.
fn split_args(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let (mut depth, mut cur) = (0usize, String::new());
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_string());
    }
    out
}

/// Every `extern "C" __global__ void [attributes] NAME(params)` in `text`: (name, params).
fn kernel_decls(text: &str, at: &str) -> Vec<(String, Vec<(String, String)>)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(k) = text[from..].find("extern \"C\"") {
        let mut i = from + k + "extern \"C\"".len();
        let rest = &text[i..];
        let Some(v) = rest.find("void") else { panic!("{at}: extern \"C\" without `void`") };
        assert!(rest[..v].contains("__global__"), "{at}: an extern \"C\" function that is not __global__");
        i += v + 4;
        // Skip attributes with arguments (__launch_bounds__(..), __cluster_dims__(..)); the next
        // identifier followed by `(` is the kernel's name.
        let (name, open) = loop {
            let t = &text[i..];
            let start = i + t.find(|c: char| is_ident_char(c)).unwrap_or_else(|| panic!("{at}: no kernel name"));
            let len = text[start..].find(|c: char| !is_ident_char(c)).unwrap_or(text.len() - start);
            let ident = &text[start..start + len];
            let after = start + len + (text[start + len..].len() - text[start + len..].trim_start().len());
            if !text[after..].starts_with('(') {
                panic!("{at}: expected `(` after {ident}");
            }
            if ident.starts_with("__") {
                i = balanced(text, after).unwrap_or_else(|| panic!("{at}: unbalanced {ident}(")).1;
                continue;
            }
            break (ident.to_string(), after);
        };
        let (params, end) = balanced(text, open).unwrap_or_else(|| panic!("{at}: unbalanced parameters of {name}"));
        let params = split_args(params).iter().map(|p| parse_param(p, &name, at)).collect();
        out.push((name, params));
        from = end;
    }
    out
}

/// `const __nv_bfloat16* __restrict__ x` -> ("__nv_bfloat16*", "x").
fn parse_param(p: &str, kernel: &str, at: &str) -> (String, String) {
    let spaced = p.replace('*', " * ");
    let words: Vec<&str> =
        spaced.split_whitespace().filter(|w| !matches!(*w, "const" | "__restrict__" | "__grid_constant__")).collect();
    let (name, ty) = words.split_last().unwrap_or_else(|| panic!("{at}: empty parameter of {kernel}"));
    (ty.join(" ").replace(" *", "*"), name.to_string())
}

/// The kernels of one `kernels/<family>.cu`: plain declarations, and the ones stamped out by
/// function-like macros (`#define M(A, B) ... extern "C" ... name##A(...) ...` plus `M(x, y)` lines).
fn parse_kernels(family: &str, source: &str) -> Vec<KernelDecl> {
    let text = strip_comments(source);
    let at = format!("kernels/{family}.cu");
    let mut plain = String::new();
    let mut macros: Vec<(String, Vec<String>, String)> = Vec::new();
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(def) = t.strip_prefix("#define") {
            let def = def.trim_start();
            let name_len = def.find(|c: char| !is_ident_char(c)).unwrap_or(def.len());
            if def[name_len..].starts_with('(') && def.contains("extern \"C\"") {
                let (params, end) = balanced(def, name_len).expect("a macro's parameter list closes");
                let params = split_args(params);
                macros.push((def[..name_len].to_string(), params, def[end..].to_string()));
            }
            continue;
        }
        plain.push_str(line);
        plain.push('\n');
    }
    let mut out = Vec::new();
    for (symbol, params) in kernel_decls(&plain, &at) {
        out.push(KernelDecl { group: symbol.clone(), symbol, family: family.into(), params, variant: None });
    }
    for (mname, mparams, body) in &macros {
        // The name template of each kernel in the body, and which macro parameter varies it.
        let templates: Vec<(String, Vec<(String, String)>)> = kernel_decls(body, &at);
        let mut from = 0;
        while let Some(k) = plain[from..].find(mname.as_str()) {
            let start = from + k;
            let open = start + mname.len();
            from = open;
            let boundary = start == 0 || !plain[..start].ends_with(is_ident_char);
            if !boundary || !plain[open..].starts_with('(') {
                continue;
            }
            let (args, end) = balanced(&plain, open).unwrap_or_else(|| panic!("{at}: unbalanced {mname}("));
            from = end;
            let args = split_args(args);
            assert_eq!(args.len(), mparams.len(), "{at}: {mname} takes {} arguments", mparams.len());
            for (template, params) in &templates {
                let mut symbol = template.replace("##", "");
                let mut group = symbol.clone();
                let mut variant = None;
                for (p, a) in mparams.iter().zip(&args) {
                    if template.contains(&format!("##{p}")) {
                        symbol = template.replace(&format!("##{p}"), a).replace("##", "");
                        group = template.replace(&format!("##{p}"), "");
                        variant = Some(a.clone());
                    } else if template == p {
                        symbol = a.clone();
                        group = mname.to_ascii_lowercase();
                        variant = Some(a.clone());
                    }
                }
                out.push(KernelDecl { symbol, family: family.into(), params: params.clone(), group, variant });
            }
        }
    }
    out.sort_by(|a, b| a.symbol.cmp(&b.symbol));
    out
}

fn camel(snake: &str) -> String {
    snake
        .split('_')
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut c = w.chars();
            c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
        })
        .collect()
}

/// How a C parameter type crosses into Rust: (Rust field type, expression that turns field `f`
/// into the value passed to the kernel, given the kernel and parameter names for errors).
fn rust_param(ty: &str, kernel: &str, name: &str) -> (&'static str, String) {
    match ty {
        "__nv_bfloat16*" => ("DevPtr<half::bf16>", format!("self.{name}.arg(\"{kernel}\", \"{name}\")?")),
        "float*" => ("DevPtr<f32>", format!("self.{name}.arg(\"{kernel}\", \"{name}\")?")),
        "int*" => ("DevPtr<i32>", format!("self.{name}.arg(\"{kernel}\", \"{name}\")?")),
        "unsigned long long*" => ("DevPtr<u64>", format!("self.{name}.arg(\"{kernel}\", \"{name}\")?")),
        "int" => ("usize", format!("arg_i32(\"{kernel}\", \"{name}\", self.{name})?")),
        "long long" => ("usize", format!("arg_i64(\"{kernel}\", \"{name}\", self.{name})?")),
        "unsigned int" => ("u32", format!("self.{name}")),
        "unsigned long long" => ("u64", format!("self.{name}")),
        "float" => ("f32", format!("self.{name}")),
        "CUtensorMap" => ("sys::CUtensorMap", format!("self.{name}")),
        "TapPtrs" => ("TapPtrs", format!("self.{name}.arg(\"{kernel}\", \"{name}\")?")),
        other => panic!(
            "kernel {kernel}: parameter {name} has type {other:?}, which build.rs does not map to Rust; add it to \
             rust_param (and, for a struct, a repr(C) twin in src/backend/cuda/launch.rs)"
        ),
    }
}

/// `$OUT_DIR/kernel_table.rs`, included by src/backend/cuda/launch.rs: the `Kernel` enum (one
/// variant per symbol), and one argument struct per kernel (or per macro-stamped family of
/// kernels with one signature) whose `launch` checks and converts every argument, in the kernel's
/// order, before it launches.
fn write_kernel_table(out_dir: &Path, kernels: &[KernelDecl]) {
    let mut src =
        String::from("// @generated by build.rs from the extern \"C\" kernels of kernels/*.cu. Do not edit.\n\n");
    src.push_str("/// Every kernel: one variant per `extern \"C\"` symbol of kernels/*.cu, sorted by symbol.\n");
    src.push_str("#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]\npub enum Kernel {\n");
    for k in kernels {
        let _ = writeln!(src, "    /// `{}` (kernels/{}.cu)\n    {},", k.symbol, k.family, camel(&k.symbol));
    }
    src.push_str("}\n\nimpl Kernel {\n");
    let _ = writeln!(src, "    pub const ALL: [Kernel; {}] = [", kernels.len());
    for k in kernels {
        let _ = writeln!(src, "        Kernel::{},", camel(&k.symbol));
    }
    src.push_str("    ];\n\n    /// The `extern \"C\"` symbol.\n    pub fn symbol(self) -> &'static str {\n        match self {\n");
    for k in kernels {
        let _ = writeln!(src, "            Kernel::{} => {:?},", camel(&k.symbol), k.symbol);
    }
    src.push_str("        }\n    }\n\n    /// The file it is defined in: `kernels/<family>.cu`.\n    pub fn family(self) -> &'static str {\n        match self {\n");
    for k in kernels {
        let _ = writeln!(src, "            Kernel::{} => {:?},", camel(&k.symbol), k.family);
    }
    src.push_str("        }\n    }\n\n    /// Its C parameter list, as the source declares it (types normalised).\n    pub fn signature(self) -> &'static str {\n        match self {\n");
    for k in kernels {
        let sig: Vec<String> = k.params.iter().map(|(t, n)| format!("{t} {n}")).collect();
        let _ = writeln!(src, "            Kernel::{} => {:?},", camel(&k.symbol), sig.join(", "));
    }
    src.push_str("        }\n    }\n}\n\n");

    let mut groups: Vec<&str> = kernels.iter().map(|k| k.group.as_str()).collect();
    groups.sort();
    groups.dedup();
    for group in groups {
        let members: Vec<&KernelDecl> = kernels.iter().filter(|k| k.group == group).collect();
        let first = members[0];
        for m in &members[1..] {
            assert_eq!(
                m.params, first.params,
                "{} and {} share an argument struct but not a signature",
                m.symbol, first.symbol
            );
        }
        let ty = camel(group);
        let names: Vec<&str> = members.iter().map(|m| m.symbol.as_str()).collect();
        let _ = writeln!(
            src,
            "/// The arguments of `{}` (kernels/{}.cu), in its order.\n#[derive(Clone, Copy)]\npub struct {ty} {{",
            names.join("`, `"),
            first.family
        );
        for (cty, name) in &first.params {
            let (rty, _) = rust_param(cty, &first.symbol, name);
            let _ = writeln!(src, "    /// `{cty} {name}`\n    pub {name}: {rty},");
        }
        src.push_str("}\n\n");
        let _ = writeln!(src, "impl {ty} {{");
        if members.len() == 1 && first.variant.is_none() {
            let _ = writeln!(src, "    pub const KERNEL: Kernel = Kernel::{};", camel(&first.symbol));
        } else {
            src.push_str("    /// `(macro argument, kernel)` of every kernel stamped out with this signature.\n");
            let _ = writeln!(src, "    pub const VARIANTS: [(&'static str, Kernel); {}] = [", members.len());
            for m in &members {
                let v = m.variant.as_deref().unwrap_or(&m.symbol);
                let _ = writeln!(src, "        ({v:?}, Kernel::{}),", camel(&m.symbol));
            }
            src.push_str("    ];\n");
        }
        src.push_str("}\n\n");
        let _ = writeln!(src, "impl KernelArgs for {ty} {{");
        src.push_str("    fn takes(kernel: Kernel) -> bool {\n        matches!(kernel, ");
        let pats: Vec<String> = members.iter().map(|m| format!("Kernel::{}", camel(&m.symbol))).collect();
        src.push_str(&pats.join(" | "));
        src.push_str(")\n    }\n\n");
        // f and stream are driver handles that only the driver dereferences (launch_params' contract);
        // clippy cannot tell a handle from a data pointer.
        src.push_str("    #[allow(clippy::not_unsafe_ptr_arg_deref)]\n");
        src.push_str("    fn launch_raw(&self, kernel: Kernel, f: sys::CUfunction, cfg: &LaunchCfg, stream: sys::CUstream) -> Result<()> {\n");
        src.push_str("        let symbol = kernel.symbol();\n");
        for (cty, name) in &first.params {
            let (_, conv) = rust_param(cty, "{symbol}", name);
            let conv = conv.replace("\"{symbol}\"", "symbol");
            let _ = writeln!(src, "        let mut {name} = {conv};");
        }
        let _ = writeln!(src, "        let mut params: [*mut std::ffi::c_void; {}] = [", first.params.len());
        for (_, name) in &first.params {
            let _ = writeln!(src, "            (&mut {name}) as *mut _ as *mut std::ffi::c_void,");
        }
        src.push_str("        ];\n");
        src.push_str(
            "        // SAFETY: `params` holds one pointer per kernel parameter, in the kernel's order, each to a\n        \
             // local of the parameter's C type (the table above maps them), alive until the call returns;\n        \
             // the pointers inside were checked non-null and aligned and come from live buffers the\n        \
             // caller borrows for the call.\n",
        );
        src.push_str("        unsafe { launch_params(kernel, f, cfg, stream, &mut params) }\n    }\n}\n\n");
    }
    write_if_changed(&out_dir.join("kernel_table.rs"), &src);
}
