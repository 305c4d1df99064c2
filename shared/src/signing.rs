//! Signed work messages: with a key configured, the coordinator signs every
//! work item (HMAC-SHA256 over the message body, hex, in the header
//! [`SIGNATURE_HEADER`]) and workers refuse a message that is unsigned or
//! whose signature does not match — anyone who can publish to the broker but
//! does not hold the key cannot make a worker read a file or run a model.
//!
//! The key comes from `BATCHFLEET_SIGNING_KEY` (the key itself) or
//! `BATCHFLEET_SIGNING_KEY_FILE` / `--signing-key-file` (a file holding it,
//! e.g. a mounted secret); coordinator and workers must hold the same key. It
//! never appears in `Debug` output, logs or errors.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// Header carrying the hex HMAC-SHA256 of the body.
pub const SIGNATURE_HEADER: &str = "x-bf-signature";

/// Environment variable holding the key itself.
pub const KEY_ENV: &str = "BATCHFLEET_SIGNING_KEY";

/// Shortest key accepted, in bytes.
pub const MIN_KEY_BYTES: usize = 16;

/// A message-signing key. Cheap to clone; prints as `SigningKey(***)`.
#[derive(Clone)]
pub struct SigningKey(Arc<[u8]>);

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SigningKey(***)")
    }
}

/// Why a key could not be loaded. Never holds the key.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key file could not be read.
    #[error("cannot read the signing key file {path}: {reason}")]
    Unreadable {
        /// The file.
        path: String,
        /// The I/O error.
        reason: String,
    },
    /// The key is too short to be a secret.
    #[error("the signing key from {source_name} is {len} bytes; use at least {MIN_KEY_BYTES} random bytes (e.g. `openssl rand -hex 32`)")]
    TooShort {
        /// Where it came from.
        source_name: String,
        /// Its length.
        len: usize,
    },
}

impl SigningKey {
    /// A key from raw bytes (surrounding whitespace, as a file's trailing
    /// newline, is not part of it).
    pub fn new(bytes: &[u8], source_name: &str) -> Result<Self, KeyError> {
        let key = bytes.trim_ascii();
        if key.len() < MIN_KEY_BYTES {
            return Err(KeyError::TooShort {
                source_name: source_name.to_owned(),
                len: key.len(),
            });
        }
        Ok(Self(Arc::from(key)))
    }

    /// The configured key: the file if given, else `BATCHFLEET_SIGNING_KEY`;
    /// `None` when neither is set (messages are then neither signed nor checked).
    pub fn configured(file: Option<&Path>) -> Result<Option<Self>, KeyError> {
        if let Some(path) = file {
            let bytes = std::fs::read(path).map_err(|e| KeyError::Unreadable {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
            return Self::new(&bytes, &path.display().to_string()).map(Some);
        }
        match std::env::var_os(KEY_ENV) {
            Some(v) if !v.is_empty() => Self::new(v.as_encoded_bytes(), KEY_ENV).map(Some),
            _ => Ok(None),
        }
    }

    fn mac(&self) -> Hmac<Sha256> {
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }

    /// The signature of `body`, lower-case hex.
    pub fn sign(&self, body: &[u8]) -> String {
        let mut mac = self.mac();
        mac.update(body);
        hex::encode(mac.finalize().into_bytes())
    }

    /// Whether `signature` (hex) is the signature of `body`; compared in constant time.
    pub fn verify(&self, body: &[u8], signature: &str) -> bool {
        let Ok(sig) = hex::decode(signature.trim()) else {
            return false;
        };
        let mut mac = self.mac();
        mac.update(body);
        mac.verify_slice(&sig).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_verify_only_for_the_same_key_and_body() {
        let key = SigningKey::new(b"0123456789abcdef-secret\n", "test").unwrap();
        let sig = key.sign(b"body");
        assert_eq!(sig.len(), 64);
        assert!(key.verify(b"body", &sig));
        assert!(!key.verify(b"body!", &sig));
        assert!(!key.verify(b"body", "zz"));
        let other = SigningKey::new(b"another-key-0123456789", "test").unwrap();
        assert!(!other.verify(b"body", &sig));
        // The trailing newline of a key file is not part of the key.
        let same = SigningKey::new(b"0123456789abcdef-secret", "test").unwrap();
        assert!(same.verify(b"body", &sig));
    }

    #[test]
    fn short_keys_are_refused_and_keys_never_print() {
        let err = SigningKey::new(b"short", "BATCHFLEET_SIGNING_KEY").unwrap_err();
        assert!(err.to_string().contains("at least 16"), "{err}");
        assert!(!err.to_string().contains("short"), "{err}");
        let key = SigningKey::new(b"0123456789abcdef-secret", "t").unwrap();
        assert_eq!(format!("{key:?}"), "SigningKey(***)");
    }

    #[test]
    fn a_key_file_is_read_and_a_missing_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "0123456789abcdef-from-file\n").unwrap();
        let key = SigningKey::configured(Some(&path)).unwrap().unwrap();
        assert!(key.verify(b"x", &key.sign(b"x")));
        let err = SigningKey::configured(Some(&dir.path().join("nope"))).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }
}
