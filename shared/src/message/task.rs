//! A job's task stored once, and the version 3 message that names it.
//!
//! Every item of a job shares one [`TaskSpec`] (model, layout, output,
//! policy: about a kilobyte). Version 3 of the work message carries the
//! item alone — job id, item number, input slice, file versions — and the
//! SHA-256 of the task's encoding ([`ItemRef`]); the coordinator stores the
//! task bytes once per job under that digest ([`StoredTask`], in the job's
//! `:tasks` hash), and a worker fetches them once per job and keeps them.
//! The digest travels inside the signed body, so a task read from Redis is
//! believed only when its bytes hash to what the signed message names.

use super::{Bundle, InputSlice, TaskSpec, WorkItem};
use serde::{Deserialize, Serialize};

/// A task as stored once per job: its encoding and that encoding's digest.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredTask {
    /// The task, encoded with named fields (rmp-serde).
    pub bytes: Vec<u8>,
    /// Hex SHA-256 of `bytes`: the key it is stored under and the name a
    /// version 3 message gives it.
    pub sha256: String,
}

impl std::fmt::Debug for StoredTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredTask")
            .field("sha256", &self.sha256)
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

/// Why stored task bytes were not taken.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// The bytes do not hash to the digest the message names.
    #[error("the stored task hashes to {found}, not to the {named} the message names (altered in Redis?)")]
    Digest {
        /// The digest the message names.
        named: String,
        /// The digest of the bytes found.
        found: String,
    },
    /// The bytes are not a task this worker understands.
    #[error("the stored task {sha256} does not decode ({reason}); is this worker older than the coordinator that stored it?")]
    Undecodable {
        /// Its digest.
        sha256: String,
        /// The decoder's error.
        reason: String,
    },
}

impl StoredTask {
    /// `task` encoded (named fields) and hashed.
    pub fn of(task: &TaskSpec) -> Self {
        let bytes = rmp_serde::to_vec_named(task).expect("tasks always serialize");
        let sha256 = crate::fsutil::sha256_bytes(&bytes);
        Self { bytes, sha256 }
    }

    /// The task in `bytes`, taken only if they hash to `sha256`.
    pub fn open(bytes: &[u8], sha256: &str) -> Result<TaskSpec, TaskError> {
        let found = crate::fsutil::sha256_bytes(bytes);
        if !found.eq_ignore_ascii_case(sha256) {
            return Err(TaskError::Digest {
                named: sha256.to_owned(),
                found,
            });
        }
        rmp_serde::from_slice(bytes).map_err(|e| TaskError::Undecodable {
            sha256: found,
            reason: e.to_string(),
        })
    }
}

/// Version 3 of the work message: one item of a job, naming its job's
/// stored task by digest instead of carrying it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ItemRef {
    /// Stable job id.
    pub job_id: String,
    /// Item number within the job.
    pub seq: u32,
    /// The slice of input this item covers.
    pub input: InputSlice,
    /// Each input file's version when the job was planned (see
    /// [`WorkItem::versions`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<String>,
    /// Hex SHA-256 of the job's stored task ([`StoredTask::sha256`]).
    #[serde(rename = "task")]
    pub task_sha256: String,
}

impl ItemRef {
    /// The whole item, with the task its digest names.
    pub fn with_task(self, task: TaskSpec) -> WorkItem {
        WorkItem {
            job_id: self.job_id,
            seq: self.seq,
            input: self.input,
            task,
            versions: self.versions,
            task_sha256: Some(self.task_sha256),
        }
    }
}

impl WorkItem {
    /// The item as a version 3 message names it, when its task is stored
    /// (its digest known).
    pub fn to_ref(&self) -> Option<ItemRef> {
        let sha = self.task_sha256.clone()?;
        Some(ItemRef {
            job_id: self.job_id.clone(),
            seq: self.seq,
            input: self.input.clone(),
            versions: self.versions.clone(),
            task_sha256: sha,
        })
    }
}

/// A message opened: a whole item (versions 1 and 2), an item whose
/// task is still to be fetched (version 3), or several such items
/// (version 4).
#[derive(Debug, Clone, PartialEq)]
// Made once per message and taken apart at once: boxing would only add an
// allocation.
#[allow(clippy::large_enum_variant)]
pub enum Opened {
    /// The item with its task.
    Whole(WorkItem),
    /// The item naming its job's stored task.
    Ref(ItemRef),
    /// Items of one job naming its stored task.
    Bundle(Bundle),
}

impl Opened {
    /// The job the message claims.
    pub fn job_id(&self) -> &str {
        match self {
            Opened::Whole(i) => &i.job_id,
            Opened::Ref(r) => &r.job_id,
            Opened::Bundle(b) => &b.job_id,
        }
    }

    /// The item number the message claims (a bundle's first).
    pub fn seq(&self) -> u32 {
        match self {
            Opened::Whole(i) => i.seq,
            Opened::Ref(r) => r.seq,
            Opened::Bundle(b) => b.first_seq(),
        }
    }

    /// Every item number the message claims, in order.
    pub fn seqs(&self) -> Vec<u32> {
        match self {
            Opened::Bundle(b) => b.items.iter().map(|m| m.seq).collect(),
            other => vec![other.seq()],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::sample_item;
    use super::*;

    #[test]
    fn a_stored_task_opens_only_under_its_own_digest() {
        let task = sample_item().task;
        let stored = StoredTask::of(&task);
        assert_eq!(stored.sha256.len(), 64);
        assert_eq!(
            StoredTask::open(&stored.bytes, &stored.sha256).unwrap(),
            task
        );
        let mut other = task.clone();
        other.batch_size += 1;
        let altered = StoredTask::of(&other);
        let e = StoredTask::open(&altered.bytes, &stored.sha256).unwrap_err();
        assert!(matches!(e, TaskError::Digest { .. }), "{e}");
        let junk = b"not a task".to_vec();
        let sha = crate::fsutil::sha256_bytes(&junk);
        assert!(matches!(
            StoredTask::open(&junk, &sha),
            Err(TaskError::Undecodable { .. })
        ));
    }

    #[test]
    fn a_ref_and_its_task_make_the_item_again() {
        let mut item = sample_item();
        assert_eq!(item.to_ref(), None, "no stored task, no reference");
        let stored = StoredTask::of(&item.task);
        item.task_sha256 = Some(stored.sha256.clone());
        let r = item.to_ref().unwrap();
        assert_eq!(r.task_sha256, stored.sha256);
        assert_eq!(r.with_task(item.task.clone()), item);
    }
}
