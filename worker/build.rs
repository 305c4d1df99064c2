//! Embeds libtorch's library folder as an rpath, so `batchfleet-worker` runs
//! without LD_LIBRARY_PATH (torch-sys exports the folder to crates that
//! depend on it directly, as DEP_TCH_LIBTORCH_LIB), and builds the C++ shims
//! over libtorch's AOTInductor package loader (`cpp/aoti.cpp`, see
//! `src/runner/aoti.rs`) and its TF32 switch (`cpp/precision.cpp`, see
//! `src/runner/precision.rs`) against the headers next to that folder.
use std::path::PathBuf;

#[path = "../shared/build_support/rust_lld.rs"]
mod rust_lld;

fn main() {
    rust_lld::prefer_rust_lld();
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-changed=cpp/aoti.cpp");
    println!("cargo:rerun-if-changed=cpp/precision.cpp");
    let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB); build with LIBTORCH_USE_PYTORCH=1 or LIBTORCH set");
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    // And libtorch beside the binary, for the release tarball (`make dist`:
    // bin/ and lib/batchfleet/torch/lib, with the CUDA libraries its own
    // rpath finds at lib/batchfleet/nvidia). `$ORIGIN` reaches the linker as it is.
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../lib/batchfleet/torch/lib");
    // Where batchfleet_shared::cuda finds libtorch_cuda.so at start-up.
    println!("cargo:rustc-env=BATCHFLEET_LIBTORCH_LIB={dir}");
    // libtorch's layout, from pip's torch package or a libtorch download:
    // lib/ beside include/ and include/torch/csrc/api/include.
    let root = PathBuf::from(&dir)
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    let include = root.join("include");
    // PyTorch wheels and libtorch downloads since 2.x use the C++11 ABI.
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .file("cpp/aoti.cpp")
        .file("cpp/precision.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .warnings(false)
        .compile("batchfleet_aoti");
}
