//! This machine: its name (the first part of worker and follower ids) and
//! its wall clock in the unit Redis and summaries use.

/// This machine's host name (`/proc/sys/kernel/hostname`), `None` when it
/// cannot be read: the first part of worker and follower ids.
pub fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
}

/// Milliseconds since the Unix epoch, the timestamp unit used in Redis and summaries.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
