//! Version 4 of the work message: several consecutive items of one job in
//! one message (a bundle).
//!
//! Where items are short, the broker's cost per message — a publish, a
//! delivery, an acknowledgement, each with its frames and its confirm — is
//! most of what an item costs the control plane. A bundle carries up to
//! [`MAX_BUNDLE`] items of one job, each with its own item number, input
//! slice and file versions, and names the job's stored task by digest once
//! for all of them ([`super::ItemRef`] is the one-item form).
//!
//! The unit of retry, commit, output and dead-lettering stays the item: a
//! worker opens a bundle into its members, each one handled as the version
//! 3 message it stands for (its own checks, lease, part file, commit,
//! retry or dead letter), and acknowledges the bundle once every member is
//! settled. A bundle that comes back (a worker died holding it) is not
//! worked as a bundle again: it is split into its members, each published
//! alone and checked against the done set, so an item that kills workers
//! costs only itself.

use super::{InputSlice, ItemRef};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// Most items in one bundle (a message with more is refused whole).
pub const MAX_BUNDLE: usize = 64;

/// One item of a bundle: what a version 3 message of it would carry
/// besides its job and task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Member {
    /// Item number within the job.
    pub seq: u32,
    /// The slice of input it covers.
    pub input: InputSlice,
    /// Each input file's version when the job was planned (see
    /// [`super::WorkItem::versions`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<String>,
}

/// Version 4 of the work message: items of one job, naming its stored task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bundle {
    /// Stable job id.
    pub job_id: String,
    /// Hex SHA-256 of the job's stored task ([`super::StoredTask::sha256`]).
    #[serde(rename = "task")]
    pub task_sha256: String,
    /// The items, in the order they are worked.
    pub items: Vec<Member>,
}

impl Bundle {
    /// Items `refs` (all of one job and task, which the first names) as one
    /// bundle; `None` when there are none.
    pub fn of(refs: &[ItemRef]) -> Option<Self> {
        let first = refs.first()?;
        Some(Self {
            job_id: first.job_id.clone(),
            task_sha256: first.task_sha256.clone(),
            items: refs
                .iter()
                .map(|r| Member {
                    seq: r.seq,
                    input: r.input.clone(),
                    versions: r.versions.clone(),
                })
                .collect(),
        })
    }

    /// Whether the bundle is well formed: one item at least, at most
    /// [`MAX_BUNDLE`], no item number twice. `Err` says what is wrong.
    pub fn check(&self) -> Result<(), String> {
        if self.items.is_empty() {
            return Err("a bundle with no items".into());
        }
        if self.items.len() > MAX_BUNDLE {
            return Err(format!(
                "a bundle of {} items (at most {MAX_BUNDLE})",
                self.items.len()
            ));
        }
        let mut seen = HashSet::with_capacity(self.items.len());
        if let Some(m) = self.items.iter().find(|m| !seen.insert(m.seq)) {
            return Err(format!("item {} twice in one bundle", m.seq));
        }
        Ok(())
    }

    /// The first item number (what names the bundle in logs).
    pub fn first_seq(&self) -> u32 {
        self.items.first().map_or(0, |m| m.seq)
    }

    /// Each item as the version 3 message it stands for.
    pub fn members(&self) -> impl Iterator<Item = ItemRef> + '_ {
        self.items.iter().map(|m| ItemRef {
            job_id: self.job_id.clone(),
            seq: m.seq,
            input: m.input.clone(),
            versions: m.versions.clone(),
            task_sha256: self.task_sha256.clone(),
        })
    }

    /// The message id a bundle is published under: `<job>/<first>+<count>`.
    pub fn message_id(&self) -> String {
        format!("{}/{}+{}", self.job_id, self.first_seq(), self.items.len())
    }
}

/// How many items the coordinator puts in one message, for a job of
/// `items` items averaging `rows_per_item` rows, with at most `most` per
/// message: several only where items are short (a bundle holds about
/// [`BUNDLE_ROWS`] rows at most) and the job has items enough to keep
/// [`MIN_MESSAGES`] messages — a short job is not folded into a few
/// messages that leave workers idle.
pub fn bundle_size(items: usize, rows_per_item: u64, most: usize) -> usize {
    let by_rows = (BUNDLE_ROWS / rows_per_item.max(1)) as usize;
    let by_spread = items / MIN_MESSAGES;
    most.min(MAX_BUNDLE).min(by_rows).min(by_spread).max(1)
}

/// Rows a bundle holds at most (see [`bundle_size`]).
pub const BUNDLE_ROWS: u64 = 4_096;
/// Messages a bundled job keeps at least (see [`bundle_size`]).
pub const MIN_MESSAGES: usize = 64;
/// Items per message by default (`--bundle`).
pub const DEFAULT_BUNDLE: usize = 16;

#[cfg(test)]
mod tests {
    use super::super::{sample_item, Envelope, Opened, StoredTask};
    use super::*;

    fn refs(n: u32) -> Vec<ItemRef> {
        let mut item = sample_item();
        item.task_sha256 = Some(StoredTask::of(&item.task).sha256);
        (0..n)
            .map(|i| {
                let mut it = item.clone();
                it.seq = 100 + i;
                it.to_ref().unwrap()
            })
            .collect()
    }

    #[test]
    fn a_bundle_round_trips_and_opens_into_the_items_it_was_made_of() {
        let items = refs(5);
        let bundle = Bundle::of(&items).unwrap();
        bundle.check().unwrap();
        assert_eq!(bundle.message_id(), "scores-1a2b3c4d/100+5");
        let env = Envelope::V4(bundle.clone());
        let bytes = env.encode();
        let back = Envelope::decode(&bytes).unwrap();
        assert_eq!(back, env);
        let Opened::Bundle(b) = back.into_opened() else {
            panic!("a bundle opens as a bundle")
        };
        assert_eq!(b.members().collect::<Vec<_>>(), items);
        // The task digest is named once, not per item: five items cost
        // less than five messages' bodies.
        let one = Envelope::V3(items[0].clone()).encode().len();
        assert!(bytes.len() < 5 * one, "{} vs 5 × {one}", bytes.len());
    }

    #[test]
    fn a_bundle_travels_packed_and_a_packed_body_must_be_a_bundle_of_bounded_size() {
        let items = refs(16);
        let env = Envelope::V4(Bundle::of(&items).unwrap());
        let (plain, packed) = (env.encode(), env.encode_packed());
        assert!(
            packed.len() * 3 < plain.len(),
            "16 items of one file pack to a fraction: {} of {}",
            packed.len(),
            plain.len()
        );
        assert_eq!(Envelope::decode(&packed).unwrap(), env);
        // Sealed (and signed) packed: opened as the same bundle.
        let key = crate::signing::SigningKey::new(b"0123456789abcdef0123", "test").unwrap();
        let sealed = super::super::seal_bundle(Bundle::of(&items).unwrap(), Some(&key));
        assert_eq!(sealed.body, packed);
        let opened =
            super::super::open(&sealed.body, sealed.signature.as_deref(), Some(&key)).unwrap();
        assert_eq!(opened, Opened::Bundle(Bundle::of(&items).unwrap()));
        // One item alone is never packed; packed, it is refused.
        let one = Envelope::V3(items[0].clone());
        assert_eq!(one.encode_packed(), one.encode());
        let forced = zstd::bulk::compress(&one.encode(), 3).unwrap();
        let e = Envelope::decode(&forced).unwrap_err().to_string();
        assert!(e.contains("only bundles are packed"), "{e}");
        // A small body that unpacks past the bound is refused, not unpacked.
        let bomb = zstd::bulk::compress(&vec![0u8; super::super::MAX_UNPACKED + 1], 3).unwrap();
        assert!(bomb.len() < 4096);
        let e = Envelope::decode(&bomb).unwrap_err().to_string();
        assert!(e.contains("does not unpack to at most"), "{e}");
    }

    #[test]
    fn malformed_bundles_are_refused_whole() {
        assert!(Bundle::of(&[]).is_none());
        let mut b = Bundle::of(&refs(3)).unwrap();
        b.items[2].seq = b.items[0].seq;
        assert!(b.check().unwrap_err().contains("twice"));
        b.items.clear();
        assert!(b.check().unwrap_err().contains("no items"));
        let big = Bundle::of(&refs(MAX_BUNDLE as u32 + 1)).unwrap();
        assert!(big.check().unwrap_err().contains("at most"));
    }

    #[test]
    fn only_short_items_of_jobs_with_many_items_are_bundled() {
        // A million one-row items: the default.
        assert_eq!(bundle_size(1_000_000, 1, DEFAULT_BUNDLE), 16);
        // `--bundle 1`: one item per message.
        assert_eq!(bundle_size(1_000_000, 1, 1), 1);
        // Long items are not bundled; 1,000-row items four at a time.
        assert_eq!(bundle_size(1_000_000, 10_000, 16), 1);
        assert_eq!(bundle_size(1_000_000, 1_000, 16), 4);
        // A short job keeps its messages spread over the fleet.
        assert_eq!(bundle_size(100, 1, 16), 1);
        assert_eq!(bundle_size(400, 1, 16), 6);
        // Never more than a bundle may hold.
        assert_eq!(bundle_size(1_000_000, 1, 1_000), MAX_BUNDLE);
    }
}
