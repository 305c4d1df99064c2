//! Text input: a Hugging Face `tokenizer.json` loaded with the `tokenizers`
//! crate — the library behind Python's `tokenizers` and `transformers` fast
//! tokenizers, so the same file gives the same ids — used the same way by
//! validation (does it load, what is its pad id) and by workers (every row
//! of an item encoded).
//!
//! Rows are encoded one by one with special tokens added, truncated at
//! `max_length` and not padded: the worker pads each mini-batch itself, to
//! its longest row ([`TextEncoder`] leaves padding and truncation settings
//! of the file aside and applies the job's).

use std::path::Path;
use tokenizers::tokenizer::{Tokenizer, TruncationParams};

/// Tokens per row when neither the manifest nor the tokenizer file says (BERT's).
pub const DEFAULT_MAX_LENGTH: u32 = 512;

/// A loaded tokenizer with the job's truncation.
pub struct TextEncoder {
    tokenizer: Tokenizer,
    pad_id: i64,
}

impl std::fmt::Debug for TextEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextEncoder")
            .field("vocab", &self.tokenizer.get_vocab_size(true))
            .field("pad_id", &self.pad_id)
            .finish()
    }
}

impl TextEncoder {
    /// Parses a `tokenizer.json` held in `bytes`; `max_length`: tokens per
    /// row at most (special tokens included), `None` for the file's own
    /// truncation or [`DEFAULT_MAX_LENGTH`].
    pub fn from_bytes(bytes: &[u8], max_length: Option<u32>) -> Result<Self, String> {
        let mut tokenizer = Tokenizer::from_bytes(bytes).map_err(|e| {
            format!("is not a Hugging Face tokenizer.json that this version reads: {e}")
        })?;
        let max_length = max_length
            .map(|m| m as usize)
            .or_else(|| tokenizer.get_truncation().map(|t| t.max_length))
            .unwrap_or(DEFAULT_MAX_LENGTH as usize);
        // The file's padding would pad every row to its own rule; the worker
        // pads per mini-batch instead, with the file's pad id when it has one.
        let pad_id = tokenizer
            .get_padding()
            .map(|p| i64::from(p.pad_id))
            .or_else(|| {
                ["[PAD]", "<pad>", "<|pad|>"]
                    .iter()
                    .find_map(|t| tokenizer.token_to_id(t))
                    .map(i64::from)
            })
            .unwrap_or(0);
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length,
                ..TruncationParams::default()
            }))
            .map_err(|e| format!("cannot truncate at {max_length} tokens: {e}"))?;
        Ok(Self { tokenizer, pad_id })
    }

    /// Reads and parses the file at `path` (see [`TextEncoder::from_bytes`]).
    pub fn load(path: &Path, max_length: Option<u32>) -> Result<Self, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
        Self::from_bytes(&bytes, max_length)
    }

    /// The tokenizer file's own truncation length, if it sets one.
    pub fn file_max_length(bytes: &[u8]) -> Option<u32> {
        let tokenizer = Tokenizer::from_bytes(bytes).ok()?;
        tokenizer.get_truncation().map(|t| t.max_length as u32)
    }

    /// The id padded positions take (the file's padding id, else its
    /// `[PAD]`-like token, else 0); the attention mask is 0 there.
    pub fn pad_id(&self) -> i64 {
        self.pad_id
    }

    /// Tokens in the vocabulary, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Appends the ids of `text` (special tokens added, truncated) to `out`.
    pub fn encode_into(&self, text: &str, out: &mut Vec<i64>) -> Result<(), String> {
        self.encode_with_types(text, out, None)
    }

    /// [`TextEncoder::encode_into`], also appending each id's type
    /// (segment) id to `types` when given: `token_type_ids`.
    pub fn encode_with_types(
        &self,
        text: &str,
        out: &mut Vec<i64>,
        types: Option<&mut Vec<i64>>,
    ) -> Result<(), String> {
        let encoding = self
            .tokenizer
            .encode_fast(text, true)
            .map_err(|e| format!("the tokenizer cannot encode it: {e}"))?;
        out.extend(encoding.get_ids().iter().map(|&id| i64::from(id)));
        if let Some(types) = types {
            types.extend(encoding.get_type_ids().iter().map(|&t| i64::from(t)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer.json written by hand (Python's `tokenizers`
    /// saves the same shape), with `[CLS] $A [SEP]` around each row.
    pub(crate) const WORDS: &str = r#"{
      "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
      "normalizer": {"type": "Lowercase"},
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]}, "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
      "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "good": 4, "bad": 5, "film": 6}, "unk_token": "[UNK]"}
    }"#;

    #[test]
    fn encodes_with_special_tokens_truncates_and_finds_the_pad_id() {
        let enc = TextEncoder::from_bytes(WORDS.as_bytes(), None).unwrap();
        assert_eq!(enc.pad_id(), 0);
        let mut ids = Vec::new();
        enc.encode_into("Good film", &mut ids).unwrap();
        assert_eq!(ids, [2, 4, 6, 3]);
        ids.clear();
        enc.encode_into("", &mut ids).unwrap();
        assert_eq!(ids, [2, 3]);
        let (mut ids, mut types) = (Vec::new(), Vec::new());
        enc.encode_with_types("bad film", &mut ids, Some(&mut types))
            .unwrap();
        assert_eq!((ids.len(), types), (4, vec![0; 4]));
        let short = TextEncoder::from_bytes(WORDS.as_bytes(), Some(3)).unwrap();
        ids.clear();
        short.encode_into("good bad film zzz", &mut ids).unwrap();
        assert_eq!(ids, [2, 4, 3], "truncated to 3 tokens, special ones kept");
    }

    #[test]
    fn a_file_that_is_not_a_tokenizer_is_named() {
        let err = TextEncoder::from_bytes(b"{\"model\": 3}", None).unwrap_err();
        assert!(
            err.contains("is not a Hugging Face tokenizer.json"),
            "{err}"
        );
        assert!(TextEncoder::from_bytes(b"not json", None).is_err());
    }
}
