//! This machine: its name (the first part of worker and follower ids), its
//! wall clock in the unit Redis and summaries use, and the memory its
//! processes hold.

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

/// A memory figure of a process from `/proc/<pid>/status` — `VmRSS` (what
/// it holds now), `VmHWM` (the most it has held) — in bytes; `pid` `None`:
/// this process. `None` when it cannot be read (no such process, not Linux).
pub fn process_memory(pid: Option<u32>, field: &str) -> Option<u64> {
    let path = pid.map_or_else(
        || "/proc/self/status".to_owned(),
        |p| format!("/proc/{p}/status"),
    );
    let status = std::fs::read_to_string(path).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib << 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_holds_memory_and_its_peak_is_at_least_that() {
        let now = process_memory(None, "VmRSS").expect("VmRSS");
        let peak = process_memory(Some(std::process::id()), "VmHWM").expect("VmHWM");
        assert!(now > 0 && peak >= now, "{now} {peak}");
        assert_eq!(process_memory(None, "VmNoSuchField"), None);
    }
}
