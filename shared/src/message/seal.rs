//! Sealing and opening a work message, as one pair: what a publisher (the
//! coordinator, a worker carrying an item on) does to an item before it
//! goes on the wire, and what a reader does before believing one.
//!
//! Sealing encodes the item — as version 3 when its job's task is stored
//! (the item knows its digest), else whole as version 2 — and, with a
//! signing key, signs the body ([`crate::signing`]). Opening checks the signature first,
//! when a key is configured, and decodes only a body that passed: nothing
//! is read out of a message that anyone without the key could have written.

use super::{Bundle, Envelope, ItemRef, Opened, WorkItem};
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

/// Encodes `item` — version 3 when it names a stored task
/// ([`WorkItem::task_sha256`]), version 2 otherwise — and signs it with
/// `key` when given.
pub fn seal(item: &WorkItem, key: Option<&SigningKey>) -> Sealed {
    match item.to_ref() {
        Some(r) => seal_envelope(&Envelope::V3(r), key),
        None => seal_envelope(&Envelope::V2(item.clone()), key),
    }
}

/// Encodes `item` as version 3 and signs it with `key` when given.
pub fn seal_ref(item: &ItemRef, key: Option<&SigningKey>) -> Sealed {
    seal_envelope(&Envelope::V3(item.clone()), key)
}

/// Encodes `bundle` as version 4 and signs it with `key` when given.
pub fn seal_bundle(bundle: Bundle, key: Option<&SigningKey>) -> Sealed {
    seal_envelope(&Envelope::V4(bundle), key)
}

fn seal_envelope(envelope: &Envelope, key: Option<&SigningKey>) -> Sealed {
    let body = envelope.encode_packed();
    let signature = key.map(|k| k.sign(&body));
    Sealed {
        body,
        kind: envelope.kind(),
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
/// then decodes the work item of any known version (version 3: the item
/// naming its job's task, to be fetched and checked against the digest).
pub fn open(
    body: &[u8],
    signature: Option<&str>,
    key: Option<&SigningKey>,
) -> Result<Opened, OpenError> {
    if let Some(key) = key {
        match signature {
            None => return Err(OpenError::Unsigned),
            Some(sig) if !key.verify(body, sig) => return Err(OpenError::BadSignature),
            Some(_) => {}
        }
    }
    Ok(Envelope::decode(body)?.into_opened())
}

#[cfg(test)]
mod tests {
    use super::super::{sample_item, StoredTask, MESSAGE_TYPE_V2, MESSAGE_TYPE_V3};
    use super::*;

    fn key(k: &str) -> SigningKey {
        SigningKey::new(k.as_bytes(), "test").expect("a long enough key")
    }

    #[test]
    fn an_item_sealed_with_a_key_opens_only_with_that_key() {
        let (item, k) = (sample_item(), key("0123456789abcdef0123"));
        let sealed = seal(&item, Some(&k));
        let sig = sealed.signature.as_deref();
        assert_eq!(
            open(&sealed.body, sig, Some(&k)).unwrap(),
            Opened::Whole(item)
        );
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
        assert_eq!(
            open(&sealed.body, Some("anything"), None).unwrap(),
            Opened::Whole(item)
        );
        assert!(matches!(
            open(b"not msgpack", None, None),
            Err(OpenError::Undecodable(_))
        ));
    }

    #[test]
    fn an_item_of_a_stored_task_is_sealed_small_and_opens_as_a_reference() {
        let mut item = sample_item();
        let whole = seal(&item, None);
        item.task_sha256 = Some(StoredTask::of(&item.task).sha256);
        let k = key("0123456789abcdef0123");
        let sealed = seal(&item, Some(&k));
        assert_eq!(sealed.kind, MESSAGE_TYPE_V3);
        let sig = sealed.signature.as_deref();
        let Opened::Ref(r) = open(&sealed.body, sig, Some(&k)).unwrap() else {
            panic!("a version 3 message opens as a reference");
        };
        assert_eq!(r, item.to_ref().unwrap());
        // The task (0.4 KB here, more with a real layout) is gone
        // from the body: what is left is the item and the digest.
        assert!(
            sealed.body.len() < 260 && whole.body.len() > 2 * sealed.body.len(),
            "v3 {} bytes, v2 {} bytes",
            sealed.body.len(),
            whole.body.len()
        );
        assert_eq!(seal_ref(&r, Some(&k)), sealed);
    }
}
