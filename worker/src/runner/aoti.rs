//! AOTInductor packages (`.pt2` from `torch._inductor.aoti_compile_and_package`)
//! through libtorch's own loader, `torch::inductor::AOTIModelPackageLoader`,
//! which the `tch` crate does not bind: a small C++ shim (`worker/cpp/aoti.cpp`,
//! built by `build.rs` against the same libtorch) exposes load, run and free.
//! A package carries the compiled model for the device it was compiled for
//! (a shared library inside it), so no compiler is needed here. Tensors cross
//! as `tch` handles; every C++ exception comes back as an error string.
//!
//! The one module of the worker with `unsafe`: the calls into the shim.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};

extern "C" {
    fn bf_aoti_load(
        path: *const c_char,
        model_name: *const c_char,
        device_index: c_int,
        error: *mut *mut c_char,
    ) -> *mut c_void;
    fn bf_aoti_free(loader: *mut c_void);
    fn bf_aoti_run(
        loader: *mut c_void,
        inputs: *const *mut torch_sys::C_tensor,
        n: c_int,
        outputs: *mut *mut torch_sys::C_tensor,
        max: c_int,
        error: *mut *mut c_char,
    ) -> c_int;
    fn bf_aoti_free_error(error: *mut c_char);
}

/// Outputs one package call may return at most.
const MAX_OUTPUTS: usize = 64;

/// The error string the shim set, taken and freed.
fn take_error(error: *mut c_char) -> String {
    if error.is_null() {
        return "unknown error".into();
    }
    // SAFETY: the shim sets `error` to a NUL-terminated malloc'd copy, freed here once.
    let text = unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: as above; not used after this.
    unsafe { bf_aoti_free_error(error) };
    text
}

/// A package's `.so` names `libtorch.so` as a dependency, which this binary
/// (linked to libtorch_cpu) may not have loaded: load it from the folder the
/// binary was built against, once, before the first package.
fn libtorch_loaded() -> Result<(), String> {
    static LOADED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    LOADED
        .get_or_init(|| {
            match batchfleet_shared::cuda::libtorch_dir(option_env!("BATCHFLEET_LIBTORCH_LIB")) {
                Some(dir) => batchfleet_shared::cuda::load_global(&dir.join("libtorch.so")),
                None => Ok(()),
            }
        })
        .clone()
}

/// A loaded AOTInductor package.
pub struct Package {
    loader: *mut c_void,
}

impl std::fmt::Debug for Package {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Package").finish_non_exhaustive()
    }
}

impl Package {
    /// Loads the package at `path` (its model `model`) for CUDA device
    /// `cuda_index`, or the CPU (`None`). The loader extracts the package
    /// into a temporary folder of its own and loads its shared library.
    pub fn load(path: &std::path::Path, cuda_index: Option<usize>) -> Result<Self, String> {
        libtorch_loaded()?;
        let c_path = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| "the path holds a NUL byte".to_owned())?;
        let name = CString::new("model").expect("no NUL");
        let mut error: *mut c_char = std::ptr::null_mut();
        let index = cuda_index.map_or(-1, |i| i as c_int);
        // SAFETY: both strings live across the call; `error` is an out-pointer.
        let loader = unsafe { bf_aoti_load(c_path.as_ptr(), name.as_ptr(), index, &mut error) };
        if loader.is_null() {
            return Err(take_error(error));
        }
        Ok(Self { loader })
    }

    /// Runs the package on `inputs` (on its device); its outputs in order.
    pub fn run(&self, inputs: &[tch::Tensor]) -> Result<Vec<tch::Tensor>, String> {
        let handles: Vec<*mut torch_sys::C_tensor> =
            inputs.iter().map(|t| t.as_ptr().cast_mut()).collect();
        let mut outputs: Vec<*mut torch_sys::C_tensor> = vec![std::ptr::null_mut(); MAX_OUTPUTS];
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: the handles are live tensors borrowed for the call (the shim
        // copies them); `outputs` has room for MAX_OUTPUTS handles.
        let n = unsafe {
            bf_aoti_run(
                self.loader,
                handles.as_ptr(),
                handles.len() as c_int,
                outputs.as_mut_ptr(),
                MAX_OUTPUTS as c_int,
                &mut error,
            )
        };
        if n < 0 {
            return Err(take_error(error));
        }
        Ok(outputs[..n as usize]
            .iter()
            // SAFETY: each is a new heap tensor the shim made for us; tch frees it.
            .map(|p| unsafe { tch::Tensor::from_ptr(*p) })
            .collect())
    }
}

impl Drop for Package {
    fn drop(&mut self) {
        // SAFETY: made by bf_aoti_load, freed once.
        unsafe { bf_aoti_free(self.loader) }
    }
}
