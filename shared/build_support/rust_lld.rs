//! Included (`#[path]`) by the build scripts of the crates that link
//! libtorch — the worker, the coordinator and loadtest: links them with
//! rust-lld where the Rust toolchain carries it.
//!
//! torch-sys puts `libtorch_cuda.so` on the link line whenever the torch it
//! builds against has one, and relies on `--as-needed` to drop it. rust-lld,
//! the default linker for x86_64 Linux since Rust 1.90, drops it; GNU ld,
//! which Rust 1.89 still used, keeps it, and every process then maps the
//! CUDA libraries at start even with no GPU (an idle worker: 404 MiB resident
//! instead of about 140) although batchfleet loads `libtorch_cuda.so` itself
//! where a driver is present (`shared/src/cuda.rs`). So the build asks for
//! rust-lld on any toolchain that ships it; `BATCHFLEET_SYSTEM_LINKER=1`
//! keeps the toolchain's choice.
use std::path::PathBuf;

/// Emits the link arguments that select rust-lld, where it exists.
pub fn prefer_rust_lld() {
    println!("cargo:rerun-if-env-changed=BATCHFLEET_SYSTEM_LINKER");
    if std::env::var_os("BATCHFLEET_SYSTEM_LINKER").is_some() {
        return;
    }
    let target = std::env::var("TARGET").unwrap_or_default();
    if !target.ends_with("-linux-gnu") {
        return;
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let Ok(out) = std::process::Command::new(rustc)
        .args(["--print", "sysroot"])
        .output()
    else {
        return;
    };
    if !out.status.success() {
        return;
    }
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let gcc_ld = sysroot.join("lib/rustlib").join(&target).join("bin/gcc-ld");
    if gcc_ld.join("ld.lld").is_file() {
        println!("cargo:rustc-link-arg=-fuse-ld=lld");
        println!("cargo:rustc-link-arg=-B{}", gcc_ld.display());
    }
}
