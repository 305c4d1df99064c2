//! `[model] tf32`: libtorch's process-wide switch that lets CUDA matrix
//! multiplications run in TF32 (10 bits of mantissa instead of 23, on
//! tensor cores of compute capability 8.0 and newer) — PyTorch's
//! `torch.backends.cuda.matmul.allow_tf32`. `tch` does not bind it: a C
//! shim (`worker/cpp/precision.cpp`, built by `build.rs` beside the
//! AOTInductor one) sets it. It has no effect on the CPU.
//!
//! The switch is the process's, not the model's: the runner sets it to the
//! model's setting before each of its calls where it differs from what was
//! last set (one atomic store in libtorch), so a worker running jobs with
//! and without it gives each its own. Two pipelines of one `run --local`
//! process running jobs with different settings at once share it (the
//! last set wins for calls in flight).
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};

extern "C" {
    fn bf_set_allow_tf32_matmul(on: c_int);
    #[cfg(test)]
    fn bf_allow_tf32_matmul() -> c_int;
}

/// What batchfleet last set the switch to (libtorch's default: off).
static SET: AtomicBool = AtomicBool::new(false);

/// Sets whether CUDA matrix multiplications may run in TF32, unless it was
/// left so already: a process none of whose models asks for TF32 never
/// touches libtorch's global context for it. (Touching it from every call
/// made a worker that had abandoned runners to hung `forward` calls abort
/// now and then at exit, as libtorch tore that context down under them.)
pub fn set_tf32(on: bool) {
    if SET.swap(on, Ordering::SeqCst) != on {
        // SAFETY: sets a flag in libtorch's global context (an atomic
        // bool); no pointers cross.
        unsafe { bf_set_allow_tf32_matmul(c_int::from(on)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tf32() -> bool {
        // SAFETY: reads the flag set above.
        unsafe { bf_allow_tf32_matmul() != 0 }
    }

    #[test]
    fn the_switch_is_libtorch_s_own_and_reads_back_as_set() {
        set_tf32(true);
        assert!(tf32());
        set_tf32(true);
        assert!(tf32());
        set_tf32(false);
        assert!(!tf32());
    }
}
