//! Text input turned into model inputs: each row's text encoded by the
//! job's tokenizer ([`batchfleet_shared::text::TextEncoder`]) into token ids,
//! on the reading thread, so tokenizing overlaps the model like parsing does.
//!
//! Tokenizers are loaded once per worker and kept by (file, digest,
//! `max_length`). A tokenizer file whose digest is not the one the job was
//! planned with, or that no longer loads, fails the job (nobody can run it),
//! as a changed model does.

use crate::batch::{Batch, Tokens};
use crate::error::ItemError;
use batchfleet_shared::message::TextSpec;
use batchfleet_shared::text::TextEncoder;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

type Key = (String, String, u32);

/// Tokenizers loaded so far, by (path, sha256, max_length).
fn loaded() -> &'static Mutex<HashMap<Key, Arc<TextEncoder>>> {
    static LOADED: OnceLock<Mutex<HashMap<Key, Arc<TextEncoder>>>> = OnceLock::new();
    LOADED.get_or_init(Mutex::default)
}

/// The job's tokenizer, loaded (and its digest checked) on first use.
pub fn encoder(spec: &TextSpec) -> Result<Arc<TextEncoder>, ItemError> {
    let key = (
        spec.tokenizer.path.clone(),
        spec.tokenizer.sha256.clone(),
        spec.max_length,
    );
    if let Some(e) = loaded().lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(e.clone());
    }
    let path = &spec.tokenizer.path;
    // As for a model: a file this worker cannot read is this worker's
    // problem (another may have it mounted); one that is not the job's,
    // or does not load, is the job's.
    use batchfleet_shared::pinned::PinnedError;
    let bytes = match batchfleet_shared::pinned::read(path, &spec.tokenizer.sha256) {
        Ok(bytes) => bytes,
        Err(PinnedError::Unreadable(e)) => return Err(ItemError::unable(format!(
            "cannot read tokenizer {path} on this worker: {e}; it must be readable by every worker at the path the job was planned with"
        ))),
        Err(PinnedError::Changed { actual, .. }) => return Err(ItemError::unrunnable(format!(
            "tokenizer {path} has sha256 {actual} but the job expects {}; the file changed after the job was planned — restore it, or run the manifest again to start a job with the new tokenizer",
            spec.tokenizer.sha256
        ))),
    };
    let encoder = TextEncoder::from_bytes(&bytes, Some(spec.max_length))
        .map(Arc::new)
        .map_err(|e| ItemError::unrunnable(format!("tokenizer {path} {e}")))?;
    let mut map = loaded().lock().unwrap_or_else(|p| p.into_inner());
    // A worker runs few jobs at once; a long-lived one forgets old tokenizers.
    if map.len() >= 16 {
        map.clear();
    }
    map.insert(key, encoder.clone());
    Ok(encoder)
}

/// Encodes every row's text of `batch` into [`Batch::tokens`], with type
/// ids when `type_ids` (the model takes `token_type_ids`). Blocking.
pub fn tokenize(batch: &mut Batch, spec: &TextSpec, type_ids: bool) -> Result<(), ItemError> {
    let encoder = encoder(spec)?;
    let started = std::time::Instant::now();
    let mut tokens = Tokens {
        ids: Vec::with_capacity(batch.rows() * 32),
        ends: Vec::with_capacity(batch.rows()),
        types: Vec::new(),
        pad_id: encoder.pad_id(),
        multiple: spec.pad_to_multiple_of as usize,
        max_batch_tokens: spec.max_batch_tokens as usize,
    };
    for i in 0..batch.rows() {
        let types = type_ids.then_some(&mut tokens.types);
        encoder
            .encode_with_types(batch.text(i), &mut tokens.ids, types)
            .map_err(|e| {
                ItemError::poison(format!("{} line {}: {e}", batch.file, batch.line(i)))
            })?;
        tokens.ends.push(tokens.ids.len());
    }
    metrics::histogram!(batchfleet_shared::metrics::names::WORKER_TOKENIZE)
        .record(started.elapsed().as_secs_f64());
    batch.tokens = Some(tokens);
    Ok(())
}
