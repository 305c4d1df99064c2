//! libtorch's CUDA support, loaded at start-up where a GPU can use it.
//!
//! libtorch keeps its CUDA kernels in `libtorch_cuda.so`, which registers
//! them with the dispatcher when it is loaded. The binaries take symbols from
//! `libtorch_cpu.so` only, and the linker drops a library nothing is taken
//! from, so without this a `cuda:N` device would be unavailable. Linking it
//! always costs every process, CPU-only ones too, about 0.1 s at start and
//! 400 MB of mapped pages; so each binary loads it first thing (before any
//! libtorch call: libtorch caches its CUDA hooks on first use) where an
//! NVIDIA driver is present, or where `BATCHFLEET_CUDA=1` asks for it.
//! `BATCHFLEET_CUDA=0` never loads it. A CPU-only libtorch has no such
//! library, and nothing changes.

use std::path::{Path, PathBuf};

/// The environment variable that overrides the automatic choice.
pub const ENV: &str = "BATCHFLEET_CUDA";

/// Whether to load CUDA support.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Where an NVIDIA driver is present.
    Auto,
    /// Always (`BATCHFLEET_CUDA=1`).
    Always,
    /// Never (`BATCHFLEET_CUDA=0`).
    Never,
}

impl Want {
    /// From [`ENV`]: `1`/`true`/`yes`, `0`/`false`/`no`, unset or anything else: auto.
    pub fn from_env() -> Self {
        match std::env::var(ENV)
            .unwrap_or_default()
            .to_ascii_lowercase()
            .as_str()
        {
            "1" | "true" | "yes" => Want::Always,
            "0" | "false" | "no" => Want::Never,
            _ => Want::Auto,
        }
    }
}

/// What [`load`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaSupport {
    /// Loaded from this file: `cuda:N` devices work where the driver sees a GPU.
    Loaded(PathBuf),
    /// Not asked for (no NVIDIA driver here, or `BATCHFLEET_CUDA=0`).
    NotWanted,
    /// This libtorch is built without CUDA (no `libtorch_cuda.so` in its folder).
    NotBuilt(PathBuf),
    /// Asked for but could not be loaded: why.
    Failed(String),
}

/// Whether this machine has an NVIDIA driver loaded.
pub fn driver_present() -> bool {
    Path::new("/proc/driver/nvidia/version").exists() || Path::new("/dev/nvidiactl").exists()
}

/// Where libtorch's libraries are: the folder of the `libtorch_cpu.so` this
/// process runs (wherever the dynamic linker found it through the rpath:
/// the build's PyTorch, the release tarball's `lib/batchfleet/torch/lib`,
/// or the `torch` package beside the wheel's `batchfleet/_bin/`); failing
/// that, the folder the binary was linked against (`compiled`) when it
/// exists, else `lib/batchfleet/torch/lib` beside the binary's `bin/`.
pub fn libtorch_dir(compiled: Option<&str>) -> Option<PathBuf> {
    let bundled = || {
        let exe = std::env::current_exe().ok()?;
        let dir = exe.parent()?.parent()?.join("lib/batchfleet/torch/lib");
        dir.is_dir().then_some(dir)
    };
    if let Some(dir) = loaded_libtorch_dir() {
        return Some(dir);
    }
    match compiled.map(PathBuf::from) {
        Some(dir) if dir.is_dir() => Some(dir),
        _ => bundled(),
    }
}

/// The folder of the `libtorch_cpu.so` mapped into this process, read from
/// `/proc/self/maps` (none where libtorch is not linked).
fn loaded_libtorch_dir() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libtorch_cpu.so"))
        .and_then(|path| Path::new(path).parent().map(Path::to_path_buf))
}

/// Loads `libtorch_cuda.so` from libtorch's folder ([`libtorch_dir`] of
/// `libtorch_lib`, the folder the binary was linked against) as
/// [`Want::from_env`] says. Call it before any libtorch call.
pub fn load(libtorch_lib: Option<&str>) -> CudaSupport {
    let Some(dir) = libtorch_dir(libtorch_lib) else {
        return CudaSupport::NotBuilt(PathBuf::new());
    };
    load_from(&dir, Want::from_env())
}

/// [`load`] with the folder and the choice given.
pub fn load_from(dir: &Path, want: Want) -> CudaSupport {
    let wanted = match want {
        Want::Always => true,
        Want::Never => false,
        Want::Auto => driver_present(),
    };
    if !wanted {
        return CudaSupport::NotWanted;
    }
    let file = dir.join("libtorch_cuda.so");
    if !file.is_file() {
        return CudaSupport::NotBuilt(file);
    }
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading runs the library's initialisers; libtorch_cuda.so's
    // register CUDA kernels and hooks with the libtorch this binary already
    // runs (the same folder), which is what they are for. RTLD_GLOBAL makes
    // its symbols visible to libtorch's later lookups.
    #[allow(unsafe_code)]
    let opened = unsafe { Library::open(Some(&file), RTLD_NOW | RTLD_GLOBAL) };
    match opened {
        Ok(lib) => {
            // Kept for the life of the process: unloading libtorch's kernels
            // while libtorch runs is never safe.
            std::mem::forget(lib);
            CudaSupport::Loaded(file)
        }
        Err(e) => CudaSupport::Failed(format!("cannot load {}: {e}", file.display())),
    }
}

/// Loads the shared library `file` with its symbols global, for the life
/// of the process (libtorch's own libraries, which later-loaded code such as
/// an AOTInductor package's `.so` resolves against).
pub fn load_global(file: &Path) -> Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: the file is one of the libtorch libraries this binary already
    // runs (the folder it was linked against): its initialisers have run or
    // run now against the same libtorch.
    #[allow(unsafe_code)]
    let opened = unsafe { Library::open(Some(file), RTLD_NOW | RTLD_GLOBAL) };
    opened
        .map(std::mem::forget)
        .map_err(|e| format!("cannot load {}: {e}", file.display()))
}

/// Logs what [`load`] did: loaded at debug level, a failure as a warning.
pub fn log(support: &CudaSupport) {
    match support {
        CudaSupport::Loaded(f) => {
            tracing::debug!(file = %f.display(), "libtorch CUDA support loaded")
        }
        CudaSupport::NotWanted | CudaSupport::NotBuilt(_) => {}
        CudaSupport::Failed(why) => {
            tracing::warn!("CUDA devices are unavailable: {why} (BATCHFLEET_CUDA=0 stops trying)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The project venv's libtorch folder, where tests build against it.
    fn venv_libtorch() -> Option<PathBuf> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/lib");
        std::fs::read_dir(root)
            .ok()?
            .flatten()
            .map(|e| e.path().join("site-packages/torch/lib"))
            .find(|p| p.join("libtorch_cpu.so").is_file())
    }

    #[test]
    fn cuda_support_is_loaded_when_asked_and_only_then() {
        let none = tempfile::tempdir().expect("tempdir");
        assert_eq!(load_from(none.path(), Want::Never), CudaSupport::NotWanted);
        assert_eq!(
            load_from(none.path(), Want::Always),
            CudaSupport::NotBuilt(none.path().join("libtorch_cuda.so"))
        );
        let Some(dir) = venv_libtorch() else {
            panic!("no libtorch in the project venv (.ci/ensure-venv.sh makes it)");
        };
        if !dir.join("libtorch_cuda.so").is_file() {
            // A CPU-only PyTorch: nothing to load; the case above covers it.
            return;
        }
        match load_from(&dir, Want::Always) {
            CudaSupport::Loaded(f) => assert_eq!(f, dir.join("libtorch_cuda.so")),
            other => panic!("expected libtorch_cuda.so loaded, got {other:?}"),
        }
        let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
        assert!(
            maps.contains("libtorch_cuda.so"),
            "not mapped after loading"
        );
    }
}
