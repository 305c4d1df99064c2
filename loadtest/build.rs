//! Embeds libtorch's library folder as an rpath, so `batchfleet-worker` runs
//! without LD_LIBRARY_PATH. torch-sys exports the folder to crates that depend
//! on it directly, as DEP_TCH_LIBTORCH_LIB.
#[path = "../shared/build_support/rust_lld.rs"]
mod rust_lld;

fn main() {
    rust_lld::prefer_rust_lld();
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        // Where batchfleet_shared::cuda finds libtorch_cuda.so at start-up.
        println!("cargo:rustc-env=BATCHFLEET_LIBTORCH_LIB={dir}");
    }
}
