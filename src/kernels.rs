//! The CUDA kernels, as cubins compiled by `build.rs` from `kernels/*.cu` and embedded in the
//! binary, so a binary built here runs on the GPU machine with nothing else to carry.
//!
//! One entry per kernel family (file stem of `kernels/<family>.cu`, e.g. `pack`); the CUDA
//! backend loads each with `load_module(Ptx::from_binary(bytes))` at start-up and looks up its
//! `extern "C"` symbols. On a machine without nvcc the build is CPU-only: [`built`] is false and
//! there are no cubins (`cfg(dflash_kernels)` is set only when they were built).

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// Launch geometry shared with the kernels, parsed by build.rs from kernels/launch.cuh (the one
/// place these numbers are written down).
pub mod launch {
    include!(concat!(env!("OUT_DIR"), "/launch_consts.rs"));
}

/// True when the kernels were compiled and embedded (nvcc was found at build time).
pub fn built() -> bool {
    KERNELS_BUILT
}

/// The cubin of kernel family `family` (`"pack"` for `kernels/pack.cu`), if it was built.
pub fn cubin(family: &str) -> Option<&'static [u8]> {
    CUBINS.iter().find(|(name, _)| *name == family).map(|(_, bytes)| *bytes)
}

/// Every embedded kernel family, sorted by name.
pub fn families() -> impl Iterator<Item = &'static str> {
    CUBINS.iter().map(|(name, _)| *name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const ELF_MAGIC: &[u8] = b"\x7fELF";

    /// Kernel families in the source tree: the stems of `kernels/*.cu`, sorted.
    fn source_families() -> Vec<String> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut families: Vec<String> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|entry| entry.expect("directory entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "cu"))
            .map(|path| path.file_stem().expect("a .cu file has a stem").to_string_lossy().into_owned())
            .collect();
        families.sort();
        families
    }

    #[test]
    fn every_kernel_source_has_an_embedded_cubin() {
        let sources = source_families();
        assert!(sources.iter().any(|f| f == "pack"), "kernels/pack.cu missing from {sources:?}");
        assert_eq!(cfg!(dflash_kernels), built(), "cfg(dflash_kernels) disagrees with KERNELS_BUILT");
        if !built() {
            // CPU-only build: nothing may be embedded.
            assert!(CUBINS.is_empty());
            eprintln!("CPU-only build (no nvcc): skipped the cubin checks");
            return;
        }
        let embedded: Vec<&str> = families().collect();
        assert_eq!(embedded, sources, "embedded families differ from kernels/*.cu (stale build?)");
        for family in &sources {
            let bytes = cubin(family).unwrap_or_else(|| panic!("no cubin for kernels/{family}.cu"));
            assert!(bytes.len() > ELF_MAGIC.len(), "kernels/{family}.cu: cubin is {} bytes", bytes.len());
            assert_eq!(&bytes[..4], ELF_MAGIC, "kernels/{family}.cu: cubin is not an ELF file");
        }
        // The symbol table names every extern "C" entry point; start-up resolves every kernel of
        // the generated table (parsed from the sources) in its family's cubin.
        for kernel in crate::backend::cuda::launch::Kernel::ALL {
            let bytes = cubin(kernel.family()).unwrap_or_else(|| panic!("no cubin for {kernel:?}"));
            let symbol = kernel.symbol().as_bytes();
            assert!(
                bytes.windows(symbol.len()).any(|w| w == symbol),
                "kernels/{}.cu's cubin lacks {}",
                kernel.family(),
                kernel.symbol()
            );
        }
    }

    #[test]
    fn unknown_family_has_no_cubin() {
        assert_eq!(cubin("no_such_kernel_family"), None);
    }
}
