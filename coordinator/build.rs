//! Embeds libtorch's library folder as an rpath, so `batchfleet` — whose
//! `run --local` scores items in-process — runs without LD_LIBRARY_PATH.
//! torch-sys exports the folder to crates that depend on it directly, as
//! DEP_TCH_LIBTORCH_LIB.
#[path = "../shared/build_support/rust_lld.rs"]
mod rust_lld;

fn main() {
    rust_lld::prefer_rust_lld();
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        // And libtorch beside the binary, for the release tarball (`make dist`:
        // bin/ and lib/batchfleet/torch/lib, with the CUDA libraries its own
        // rpath finds at lib/batchfleet/nvidia). `$ORIGIN` reaches the linker as it is.
        println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../lib/batchfleet/torch/lib");
        // Where batchfleet_shared::cuda finds libtorch_cuda.so at start-up.
        println!("cargo:rustc-env=BATCHFLEET_LIBTORCH_LIB={dir}");
        // The torch release it is (`torch/version.py` beside `torch/lib`),
        // which validation names when a model says another wrote it.
        let version_py = std::path::Path::new(&dir).join("../version.py");
        println!("cargo:rerun-if-changed={}", version_py.display());
        if let Some(version) = std::fs::read_to_string(&version_py).ok().and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("__version__ = "))
                .map(|v| v.trim().trim_matches(['\'', '"']).to_owned())
        }) {
            println!("cargo:rustc-env=BATCHFLEET_LIBTORCH_VERSION={version}");
        }
    }
}
