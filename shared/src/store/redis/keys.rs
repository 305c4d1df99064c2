//! The Redis key layout: every key of a job under `P:job:{<id>}` (the id
//! a Redis Cluster hash tag, so one job's keys share one slot), the job
//! index and each pool's active jobs. The table of what each key holds is
//! in [`crate::store`].

/// The key of one part of a job's state: `P:job:{<id>}` and
/// `P:job:{<id>}:done` etc. The braces are a Redis Cluster hash tag: only
/// the id is hashed, so every key of one job lives in one slot and the
/// commit scripts, which touch several of them at once, may run on a
/// cluster.
pub fn job_scoped(prefix: &str, id: &str, suffix: &str) -> String {
    format!("{prefix}:job:{{{id}}}{suffix}")
}

/// A `SCAN` pattern for every key of the jobs whose id starts with
/// `id_stem` (`P:job:{<stem>*`).
pub fn job_keys_pattern(prefix: &str, id_stem: &str) -> String {
    format!("{prefix}:job:{{{id_stem}*")
}

/// The job id in one of its keys, and whether the key is the job's record
/// (`P:job:{<id>}`) rather than one of its parts (`P:job:{<id>}:done` …).
pub fn job_of_key<'k>(prefix: &str, key: &'k str) -> Option<(&'k str, bool)> {
    let rest = key.strip_prefix(prefix)?.strip_prefix(":job:{")?;
    let (id, after) = rest.split_once('}')?;
    Some((id, after.is_empty()))
}

/// Every key one job has, its record's first.
pub(super) fn job_keys(prefix: &str, id: &str) -> [String; 16] {
    [
        "",
        ":done",
        ":donebits",
        ":stats",
        ":failed",
        ":leases",
        ":beats",
        ":redispatched",
        ":work",
        ":hist",
        ":copies",
        ":crashes",
        ":unable",
        ":inputs",
        ":tasks",
        ":follower",
    ]
    .map(|suffix| job_scoped(prefix, id, suffix))
}

/// The keys under one prefix.
#[derive(Debug, Clone)]
pub(super) struct Keys {
    prefix: String,
}

impl Keys {
    /// The keys under `prefix`.
    pub(super) fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
        }
    }

    /// The prefix.
    pub(super) fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(super) fn job_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, "")
    }
    pub(super) fn done_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":done")
    }
    pub(super) fn done_bits_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":donebits")
    }
    pub(super) fn stats_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":stats")
    }
    pub(super) fn failed_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":failed")
    }
    pub(super) fn leases_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":leases")
    }
    pub(super) fn beats_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":beats")
    }
    pub(super) fn redispatched_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":redispatched")
    }
    pub(super) fn hist_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":hist")
    }
    pub(super) fn work_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":work")
    }
    pub(super) fn copies_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":copies")
    }
    pub(super) fn crashes_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":crashes")
    }
    pub(super) fn unable_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":unable")
    }
    pub(super) fn inputs_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":inputs")
    }
    pub(super) fn tasks_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":tasks")
    }
    pub(super) fn follower_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":follower")
    }
    pub(super) fn sweeping_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":sweeping")
    }
    pub(super) fn jobs_key(&self) -> String {
        format!("{}:jobs", self.prefix)
    }
    pub(super) fn pool_jobs_key(&self, pool: &str) -> String {
        format!("{}:pool:{pool}:jobs", self.prefix)
    }
    pub(super) fn pool_retired_key(&self, pool: &str) -> String {
        format!("{}:pool:{pool}:retired", self.prefix)
    }

    /// Every key of a job's state: what expires with it and is kept when it
    /// runs again (not its follower lease, which has a time to live of its
    /// own that neither may change).
    pub(super) fn state_keys(&self, id: &str) -> [String; 15] {
        let [state @ .., _follower] = self.keys_of(id);
        state
    }

    /// Every key one job has.
    pub(super) fn keys_of(&self, id: &str) -> [String; 16] {
        job_keys(&self.prefix, id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Redis Cluster slot of a key: CRC16/XMODEM of its hash tag (the
    /// text between the first `{` and the next `}`, when not empty) or of
    /// the whole key, modulo 16384 — as the cluster specification defines.
    fn slot(key: &str) -> u16 {
        let bytes = key.as_bytes();
        let hashed = match key.find('{') {
            Some(open) => match key[open + 1..].find('}') {
                Some(len) if len > 0 => &bytes[open + 1..open + 1 + len],
                _ => bytes,
            },
            None => bytes,
        };
        let mut crc: u16 = 0;
        for &b in hashed {
            crc ^= u16::from(b) << 8;
            for _ in 0..8 {
                crc = if crc & 0x8000 != 0 {
                    (crc << 1) ^ 0x1021
                } else {
                    crc << 1
                };
            }
        }
        crc % 16384
    }

    #[test]
    fn the_slot_function_matches_the_cluster_specification() {
        // The specification's check value: CRC16("123456789") = 0x31C3.
        assert_eq!(slot("123456789"), 0x31C3); // below 16384: the slot is the CRC
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        // An empty tag does not count: the whole key is hashed.
        assert_ne!(slot("foo{}{bar}"), slot("bar"));
        assert_ne!(slot("foo{}{bar}"), slot(""));
    }

    #[test]
    fn every_key_of_one_job_hashes_to_one_slot() {
        for (prefix, id) in [
            ("bf", "20261204-120000-a1b2c3"),
            ("batchfleet:prod", "j-1"),
            ("t", "x"),
        ] {
            let keys = job_keys(prefix, id);
            assert_eq!(keys.len(), 16);
            let first = slot(&keys[0]);
            for k in &keys {
                assert!(k.starts_with(&format!("{prefix}:job:{{{id}}}")), "{k}");
                assert_eq!(slot(k), first, "{k} is in another slot than {}", keys[0]);
            }
            // The slot is the id's: two jobs spread over the cluster.
            assert_eq!(first, slot(id));
        }
        // Each key names its job, and only the first is the record.
        let keys = job_keys("bf", "j-1");
        assert_eq!(job_of_key("bf", &keys[0]), Some(("j-1", true)));
        assert!(keys[1..]
            .iter()
            .all(|k| job_of_key("bf", k) == Some(("j-1", false))));
        assert_eq!(job_of_key("other", &keys[0]), None);
        assert_eq!(job_keys_pattern("bf", "j-"), "bf:job:{j-*");
        let a = job_keys("bf", "job-a");
        let b = job_keys("bf", "job-b");
        assert_ne!(slot(&a[0]), slot(&b[0]));
        // Keys differ per part, so no two parts collide.
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert_eq!(distinct.len(), a.len());
    }
}
