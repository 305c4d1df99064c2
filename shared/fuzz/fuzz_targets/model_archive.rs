//! The model-archive reader (`shared/src/model_file.rs`) on any bytes: a
//! manifest names any file and a worker reads what a message names, so
//! every input must end with an answer — no panic, no hang, no allocation
//! beyond the reader's caps. The module is compiled in by path, so the
//! target builds with `miniz_oxide` alone rather than the whole crate.
#![no_main]

#[allow(dead_code)]
#[path = "../../src/model_file.rs"]
mod model_file;

use libfuzzer_sys::fuzz_target;
use std::io::Cursor;

fuzz_target!(|data: &[u8]| {
    let kind = model_file::inspect_bytes(data);
    // Without the end record nothing passes for a runnable model.
    if data.len() < 22 {
        assert!(!kind.is_runnable());
    }
    let _ = model_file::provenance(&mut Cursor::new(data));
    let _ = model_file::forward_params_from(&mut Cursor::new(data));
});
