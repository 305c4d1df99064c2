//! What a message must pass before a worker does anything for it: a
//! message is data from the network, not an instruction.
//!
//! In order, with nothing read, written or allocated by the message's say-so
//! until all pass:
//! 1. **Signature** — with a signing key configured, the header
//!    `x-bf-signature` must be the HMAC-SHA256 of the body.
//! 2. **Decoding** — a known message version. A version 3 message names
//!    its job's task by digest: the task is fetched (once per job and
//!    worker, [`super::task`]) and taken only if it hashes to that digest.
//! 3. **Sanity and caps** — [`WorkItem::check`]: indices inside the layout,
//!    a byte range inside the file length it names, sizes under the caps.
//! 4. **Paths** — every input file, the model and the output folder under
//!    this worker's data roots (symlinks resolved).
//! 5. **Facts** — a local byte range must end inside the file as it is now
//!    (its length, from `stat`; nothing is read).
//!
//! Then `Store::start_item` checks the message against the job record (the
//! job exists and runs; model, digest, output folder, pool and item number
//! agree) in the same round trip that starts the lease. A message failing
//! any check is dead-lettered as `rejected` with its reason, touching no item.

use batchfleet_shared::broker::Headers;
use batchfleet_shared::message::{self, ItemLimits, OpenError, Opened, WorkItem};
use batchfleet_shared::paths::DataRoots;
use batchfleet_shared::signing::{SigningKey, SIGNATURE_HEADER};
use std::path::Path;

/// What a message must pass before anything is read or written for it.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// The signing key: with one, unsigned or forged messages are rejected.
    pub key: Option<SigningKey>,
    /// Caps on what one item may ask for.
    pub limits: ItemLimits,
    /// Where an item's paths must stay (queue contents are not trusted).
    pub roots: DataRoots,
}

/// Why a message was refused, and what went wrong with it (for metrics: a
/// bounded label).
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// What it decoded to, if it decoded.
    pub claimed: Option<Box<WorkItem>>,
    /// Why, naming the field.
    pub reason: String,
    /// `signature`, `undecodable`, `limits` or `paths`.
    pub label: &'static str,
}

/// Checks a message's signature and decodes it: a whole item (versions 1
/// and 2), or one naming its job's stored task (version 3), to be fetched
/// ([`super::task`]) before [`check`].
pub fn open(body: &[u8], headers: &Headers, guard: &Guard) -> Result<Opened, Refusal> {
    message::open(body, headers.str(SIGNATURE_HEADER), guard.key.as_ref()).map_err(|e| {
        let label = match e {
            OpenError::Unsigned | OpenError::BadSignature => "signature",
            OpenError::Undecodable(_) => "undecodable",
        };
        Refusal {
            claimed: None,
            reason: e.to_string(),
            label,
        }
    })
}

/// Checks a whole item against the caps and this worker's data roots.
pub fn check(item: WorkItem, guard: &Guard) -> Result<WorkItem, Refusal> {
    let refuse = |item: WorkItem, reason: String, label| Refusal {
        claimed: Some(Box::new(item)),
        reason,
        label,
    };
    if let Err(why) = item.check(&guard.limits) {
        return Err(refuse(
            item,
            format!("impossible work item: {why}"),
            "limits",
        ));
    }
    if let Err(why) = check_paths(&guard.roots, &item) {
        return Err(refuse(item, why, "paths"));
    }
    if let Err(why) = check_range_end(&item) {
        return Err(refuse(item, why, "limits"));
    }
    Ok(item)
}

/// Refuses a byte range that ends past the end of its (local) file as it is
/// now: no real item asks for bytes a file does not have. (A file whose
/// length merely changed is the item's problem, found by the reader.)
fn check_range_end(item: &WorkItem) -> Result<(), String> {
    use batchfleet_shared::message::InputSlice;
    let (InputSlice::CsvRange(r) | InputSlice::JsonlRange(r)) = &item.input else {
        return Ok(());
    };
    if batchfleet_shared::source::is_url(Path::new(&r.path)) {
        return Ok(()); // the reader checks the object's length, in the same request
    }
    match std::fs::metadata(&r.path) {
        Ok(m) if r.end > m.len() => Err(format!(
            "byte range {}..{} ends past the end of {} ({} bytes)",
            r.start,
            r.end,
            r.path,
            m.len()
        )),
        // Missing or unreadable: the reader names it (the item's problem).
        _ => Ok(()),
    }
}

/// Refuses an item whose input files (every one, for `files` items), model,
/// tokenizer or output folder is not under `roots`.
pub fn check_paths(roots: &DataRoots, item: &WorkItem) -> Result<(), String> {
    let inputs = item.input.input_files();
    let tokenizer = item
        .task
        .text
        .as_ref()
        .map(|t| Path::new(&t.tokenizer.path));
    let paths = inputs
        .iter()
        .map(|p| ("input file", p.as_path()))
        .chain([
            ("model", Path::new(&item.task.model.path)),
            ("output folder", Path::new(&item.task.output.dir)),
        ])
        .chain(tokenizer.map(|t| ("tokenizer", t)));
    for (what, p) in paths {
        if let Err(e) = roots.check(p) {
            return Err(format!(
                "refusing the item's {what} {e} (this worker's data roots: {})",
                if roots.is_confined() {
                    roots.describe()
                } else {
                    "none set".into()
                }
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfleet_shared::message::Envelope;

    /// A whole item's message opened and checked.
    fn admit(body: &[u8], headers: &Headers, guard: &Guard) -> Result<WorkItem, Refusal> {
        match open(body, headers, guard)? {
            Opened::Whole(item) => check(item, guard),
            other => panic!("a whole item was expected, not {other:?}"),
        }
    }

    fn body() -> (WorkItem, Vec<u8>) {
        let item = batchfleet_coordinator::planner::sample_item("j-00000000", 0);
        let body = Envelope::V2(item.clone()).encode();
        (item, body)
    }

    fn signed(key: &SigningKey, body: &[u8]) -> Headers {
        Headers::of([(SIGNATURE_HEADER, key.sign(body))], [])
    }

    #[test]
    fn signatures_are_required_once_a_key_is_set() {
        let (item, body) = body();
        let open = Guard::default();
        assert_eq!(admit(&body, &Headers::default(), &open).unwrap(), item);
        let key = SigningKey::new(b"0123456789abcdef-key", "test").unwrap();
        let guard = Guard {
            key: Some(key.clone()),
            ..Guard::default()
        };
        assert_eq!(admit(&body, &signed(&key, &body), &guard).unwrap(), item);
        let unsigned = admit(&body, &Headers::default(), &guard).unwrap_err();
        assert!(unsigned.reason.contains("unsigned message"), "{unsigned:?}");
        let mut altered = body.clone();
        *altered.last_mut().unwrap() ^= 1;
        let forged = admit(&altered, &signed(&key, &body), &guard).unwrap_err();
        assert_eq!(forged.label, "signature");
        assert!(
            forged.claimed.is_none(),
            "nothing is decoded before the signature passes"
        );
        let other = SigningKey::new(b"another-key-0123456789", "test").unwrap();
        let wrong = admit(&body, &signed(&other, &body), &guard).unwrap_err();
        assert!(wrong.reason.contains("bad signature"), "{wrong:?}");
    }

    #[test]
    fn a_version_1_message_is_admitted_as_the_same_item() {
        let (item, _) = body();
        let batchfleet_shared::message::Layout::Csv(csv) = item.task.layout.clone() else {
            unreachable!("a CSV sample")
        };
        let v1 = batchfleet_shared::message::v1::WorkItem {
            job_id: item.job_id.clone(),
            seq: item.seq,
            input: item.input.clone(),
            task: batchfleet_shared::message::v1::TaskSpec {
                model: item.task.model.clone(),
                csv,
                batch_size: item.task.batch_size,
                auto_batch: false,
                output: item.task.output.clone(),
                failure: item.task.failure.clone(),
                checkpoint_rows: item.task.checkpoint_rows,
                jsonl: None,
                parquet: None,
                image: None,
                text: None,
                shadow: None,
            },
        };
        let body = Envelope::V1(v1).encode();
        let key = SigningKey::new(b"0123456789abcdef-key", "test").unwrap();
        let guard = Guard {
            key: Some(key.clone()),
            ..Guard::default()
        };
        assert_eq!(admit(&body, &signed(&key, &body), &guard).unwrap(), item);
    }

    #[test]
    fn garbage_and_impossible_items_are_refused_with_the_field() {
        let g = Guard::default();
        let e = admit(b"\x00garbage", &Headers::default(), &g).unwrap_err();
        assert_eq!(e.label, "undecodable");
        let (mut item, _) = body();
        if let batchfleet_shared::message::Layout::Csv(l) = &mut item.task.layout {
            l.id_column = 99;
        }
        let e = admit(&Envelope::V2(item).encode(), &Headers::default(), &g).unwrap_err();
        assert_eq!(e.label, "limits");
        assert!(e.reason.contains("index 99"), "{e:?}");
        assert_eq!(e.claimed.unwrap().job_id, "j-00000000");
    }

    #[test]
    fn every_file_of_a_files_item_is_checked_against_the_roots() {
        let data = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(data.path()).unwrap();
        std::fs::write(root.join("ok.png"), b"x").unwrap();
        std::fs::write(elsewhere.path().join("secret.png"), b"x").unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("secret.png"), root.join("link.png"))
            .unwrap();
        let roots = DataRoots::new(std::slice::from_ref(&root)).unwrap();
        let item = |files: &[&str]| {
            let mut item = batchfleet_coordinator::planner::sample_item("j-00000000", 0);
            item.task.model.path = root.join("ok.png").to_string_lossy().into_owned();
            item.task.output.dir = root.to_string_lossy().into_owned();
            item.input = batchfleet_shared::message::InputSlice::Files {
                root: root.to_string_lossy().into_owned(),
                files: files.iter().map(|f| (*f).to_owned()).collect(),
                sizes: vec![1; files.len()],
                first_index: 0,
            };
            item
        };
        assert!(check_paths(&roots, &item(&["ok.png"])).is_ok());
        for (files, why) in [
            (&["ok.png", "../x.png"][..], "contains `..`"),
            (&["ok.png", "link.png"][..], "is outside the data roots"),
        ] {
            let e = check_paths(&roots, &item(files)).unwrap_err();
            assert!(
                e.contains("refusing the item's input file") && e.contains(why),
                "{e}"
            );
        }
        // An S3 output needs an s3:// root too: queue contents are not trusted.
        let mut to_s3 = item(&["ok.png"]);
        to_s3.task.output.dir = "s3://elsewhere/out".into();
        let e = check_paths(&roots, &to_s3).unwrap_err();
        assert!(
            e.contains("refusing the item's output folder s3://elsewhere/out"),
            "{e}"
        );
        let with_s3 = DataRoots::new(&[root.clone(), "s3://elsewhere/out".into()]).unwrap();
        assert!(check_paths(&with_s3, &to_s3).is_ok());
    }
}
