//! Sealing and opening a work message, as one pair: what a publisher (the
//! coordinator, a worker carrying an item on) does to an item before it
//! goes on the wire, and what a reader does before believing one.
//!
//! Sealing encodes the item in the newest version and, with a signing key,
//! signs the body ([`crate::signing`]). Opening checks the signature first,
//! when a key is configured, and decodes only a body that passed: nothing
//! is read out of a message that anyone without the key could have written.

use super::{Envelope, WorkItem, MESSAGE_TYPE_V2};
use crate::signing::SigningKey;

/// A sealed work item: its body and, when a key is configured, the body's
/// signature (the `x-bf-signature` header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    /// The encoded item.
    pub body: Vec<u8>,
    /// The AMQP `type` of the body's version.
    pub kind: &'static str,
    /// The hex HMAC-SHA256 of the body.
    pub signature: Option<String>,
}

/// Encodes `item` (newest version) and signs it with `key` when given.
pub fn seal(item: &WorkItem, key: Option<&SigningKey>) -> Sealed {
    let body = Envelope::V2(item.clone()).encode();
    let signature = key.map(|k| k.sign(&body));
    Sealed {
        body,
        kind: MESSAGE_TYPE_V2,
        signature,
    }
}

/// Why a message could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// A key is configured and the message carries no signature.
    #[error("unsigned message: this worker holds a signing key and takes only messages signed with it (is the coordinator configured with the same BATCHFLEET_SIGNING_KEY?)")]
    Unsigned,
    /// The signature does not match the body under the configured key.
    #[error("bad signature: the message was not signed with this worker's signing key (forged, altered, or signed with another key)")]
    BadSignature,
    /// The body is not a work item of a known version.
    #[error(transparent)]
    Undecodable(#[from] super::DecodeError),
}

/// Checks `body`'s `signature` against `key` (when one is configured),
/// then decodes the work item of any known version.
pub fn open(
    body: &[u8],
    signature: Option<&str>,
    key: Option<&SigningKey>,
) -> Result<WorkItem, OpenError> {
    if let Some(key) = key {
        match signature {
            None => return Err(OpenError::Unsigned),
            Some(sig) if !key.verify(body, sig) => return Err(OpenError::BadSignature),
            Some(_) => {}
        }
    }
    Ok(Envelope::decode(body)?.into_item())
}

#[cfg(test)]
mod tests {
    use super::super::sample_item;
    use super::*;

    fn key(k: &str) -> SigningKey {
        SigningKey::new(k.as_bytes(), "test").expect("a long enough key")
    }

    #[test]
    fn an_item_sealed_with_a_key_opens_only_with_that_key() {
        let (item, k) = (sample_item(), key("0123456789abcdef0123"));
        let sealed = seal(&item, Some(&k));
        let sig = sealed.signature.as_deref();
        assert_eq!(open(&sealed.body, sig, Some(&k)).unwrap(), item);
        assert!(matches!(
            open(&sealed.body, sig, Some(&key("another key, also long"))),
            Err(OpenError::BadSignature)
        ));
        assert!(matches!(
            open(&sealed.body, None, Some(&k)),
            Err(OpenError::Unsigned)
        ));
        let mut altered = sealed.body.clone();
        *altered.last_mut().unwrap() ^= 1;
        assert!(matches!(
            open(&altered, sig, Some(&k)),
            Err(OpenError::BadSignature)
        ));
    }

    #[test]
    fn without_a_key_nothing_is_signed_or_checked() {
        let item = sample_item();
        let sealed = seal(&item, None);
        assert_eq!(sealed.signature, None);
        assert_eq!(sealed.kind, MESSAGE_TYPE_V2);
        assert_eq!(open(&sealed.body, Some("anything"), None).unwrap(), item);
        assert!(matches!(
            open(b"not msgpack", None, None),
            Err(OpenError::Undecodable(_))
        ));
    }
}
