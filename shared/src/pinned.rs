//! Models and tokenizers read as the job pinned them: the bytes of a file
//! whose SHA-256 the job recorded at validation, checked on the very bytes
//! that are then loaded. A local (or shared) path is read where it is; an
//! `s3://` URL (any scheme [`crate::source`] reads) is downloaded once per
//! machine into a cache keyed by digest (`<cache>/sha256/<hex>`), verified,
//! and read from there afterwards — by every process on the machine that
//! uses the same cache folder (workers, validation, its model trial).
//!
//! The cache folder is `--cache-dir` of `batchfleet-worker`, else
//! `BATCHFLEET_CACHE_DIR`, else `$XDG_CACHE_HOME/batchfleet`, else
//! `~/.cache/batchfleet`; it holds at most `--cache-max`
//! (`BATCHFLEET_CACHE_MAX`, default 20 GiB): the least recently used files
//! go first, never the one just written. A cached file that does not hash
//! to its name (a damaged disk, a hand edit) is removed and downloaded
//! again; an object that no longer hashes to the job's digest is
//! [`PinnedError::Changed`], as a local file rewritten in place is.

use crate::fsutil::sha256_bytes;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The default bound of the cache (`BATCHFLEET_CACHE_MAX`).
pub const DEFAULT_CACHE_MAX: u64 = 20 << 30;

/// Why pinned bytes could not be had.
#[derive(Debug)]
pub enum PinnedError {
    /// This machine cannot read the file or object now (missing mount,
    /// network, credentials): another machine may.
    Unreadable(io::Error),
    /// It was read, and it is not the file the job pinned.
    Changed {
        /// The SHA-256 of what was read.
        actual: String,
        /// What was read (to say what the file is now).
        bytes: Vec<u8>,
    },
}

/// A cache of downloaded files, keyed by digest.
#[derive(Debug, Clone)]
pub struct Cache {
    dir: PathBuf,
    max_bytes: u64,
}

static CONFIGURED: OnceLock<Cache> = OnceLock::new();

/// Sets this process's cache (the worker's `--cache-dir`, `--cache-max`);
/// once, before the first use. Unset parts come from the environment.
pub fn configure(dir: Option<PathBuf>, max_bytes: Option<u64>) {
    let from_env = Cache::from_env();
    let _ = CONFIGURED.set(Cache {
        dir: dir.unwrap_or(from_env.dir),
        max_bytes: max_bytes.unwrap_or(from_env.max_bytes),
    });
}

/// This process's cache: as [`configure`] set it, else from the environment.
pub fn cache() -> &'static Cache {
    CONFIGURED.get_or_init(Cache::from_env)
}

/// The bytes of `path` (a local path or a URL), which must hash to
/// `sha256` (case-insensitive), through this process's [`cache`] for URLs.
pub fn read(path: &str, sha256: &str) -> Result<Vec<u8>, PinnedError> {
    if crate::source::is_url(Path::new(path)) {
        return cache().bytes(path, sha256);
    }
    let bytes = std::fs::read(path).map_err(PinnedError::Unreadable)?;
    let actual = sha256_bytes(&bytes);
    if actual.eq_ignore_ascii_case(sha256) {
        Ok(bytes)
    } else {
        Err(PinnedError::Changed { actual, bytes })
    }
}

/// A local file with the content of `path` pinned at `sha256`, to read as
/// a file (the model's code, its size): `path` itself when it is local,
/// else the cached copy where there is one (`None` otherwise).
pub fn local_file(path: &str, sha256: &str) -> Option<PathBuf> {
    if !crate::source::is_url(Path::new(path)) {
        return Some(PathBuf::from(path));
    }
    if !is_digest(sha256) {
        return None;
    }
    let file = cache().file_of(sha256);
    file.is_file().then_some(file)
}

/// Whether `s` is a SHA-256 in hex: the only names the cache reads, writes
/// or removes (a digest comes with a message, and a message is not trusted
/// to name a file).
fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl Cache {
    /// A cache in `dir` holding at most `max_bytes`.
    pub fn new(dir: PathBuf, max_bytes: u64) -> Self {
        Self { dir, max_bytes }
    }

    /// The cache the environment names (see the module docs).
    pub fn from_env() -> Self {
        let dir = std::env::var_os("BATCHFLEET_CACHE_DIR")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("XDG_CACHE_HOME")
                    .filter(|d| !d.is_empty())
                    .map(|d| PathBuf::from(d).join("batchfleet"))
            })
            .or_else(|| {
                std::env::var_os("HOME")
                    .filter(|d| !d.is_empty())
                    .map(|h| PathBuf::from(h).join(".cache/batchfleet"))
            })
            .unwrap_or_else(|| std::env::temp_dir().join("batchfleet-cache"));
        let max_bytes = std::env::var("BATCHFLEET_CACHE_MAX")
            .ok()
            .and_then(|v| crate::config::parse_size(&v).ok())
            .unwrap_or(DEFAULT_CACHE_MAX);
        Self { dir, max_bytes }
    }

    /// Its folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the file of digest `sha256` is kept.
    pub fn file_of(&self, sha256: &str) -> PathBuf {
        self.dir.join("sha256").join(sha256.to_ascii_lowercase())
    }

    /// The bytes of `url`, which must hash to `sha256`: from the cache when
    /// a good copy is there, else downloaded, checked and kept.
    pub fn bytes(&self, url: &str, sha256: &str) -> Result<Vec<u8>, PinnedError> {
        // Not a digest: nothing in the cache can be it (and no file named
        // after it is touched); the object read below will not match.
        let file = is_digest(sha256).then(|| self.file_of(sha256));
        if let Some(file) = &file {
            if let Ok(bytes) = std::fs::read(file) {
                if sha256_bytes(&bytes).eq_ignore_ascii_case(sha256) {
                    touch(file);
                    return Ok(bytes);
                }
                tracing::warn!(file = %file.display(), "a cached file does not hash to its name; downloading it again");
                let _ = std::fs::remove_file(file);
            }
        }
        let bytes = crate::source::fs::read(Path::new(url)).map_err(PinnedError::Unreadable)?;
        let actual = sha256_bytes(&bytes);
        if !actual.eq_ignore_ascii_case(sha256) {
            return Err(PinnedError::Changed { actual, bytes });
        }
        self.keep(&actual, &bytes);
        Ok(bytes)
    }

    /// Downloads `url` (its digest not known yet: validation) and keeps it;
    /// the cached file and its digest.
    pub fn fetch(&self, url: &str) -> io::Result<(PathBuf, String)> {
        let bytes = crate::source::fs::read(Path::new(url))?;
        let sha = sha256_bytes(&bytes);
        let file = self.file_of(&sha);
        if file.is_file() {
            touch(&file);
        } else {
            self.keep(&sha, &bytes);
        }
        if !file.is_file() {
            return Err(io::Error::other(format!(
                "cannot keep a copy in the cache folder {} (set BATCHFLEET_CACHE_DIR to a writable folder)",
                self.dir.display()
            )));
        }
        Ok((file, sha))
    }

    /// Writes `bytes` (of digest `sha`) into the cache atomically, then
    /// evicts; a cache that cannot be written is only logged.
    fn keep(&self, sha: &str, bytes: &[u8]) {
        let file = self.file_of(sha);
        let kept = (|| -> io::Result<()> {
            let folder = file.parent().expect("a cache file has a folder");
            std::fs::create_dir_all(folder)?;
            let staged = folder.join(format!(".staged-{:016x}", fastrand::u64(..)));
            let written = (|| {
                let mut f = std::fs::File::create_new(&staged)?;
                io::Write::write_all(&mut f, bytes)?;
                f.sync_all()?;
                std::fs::rename(&staged, &file)
            })();
            if written.is_err() {
                let _ = std::fs::remove_file(&staged);
            }
            written
        })();
        match kept {
            Ok(()) => {
                tracing::info!(file = %file.display(), mib = bytes.len() >> 20, "downloaded into the cache");
                self.evict(&file);
            }
            Err(e) => {
                tracing::warn!(folder = %self.dir.display(), error = %e, "cannot keep a downloaded file in the cache; it will be downloaded again next time");
            }
        }
    }

    /// Removes the least recently used files until the cache holds at most
    /// its bound (`keep` stays, even alone above it).
    fn evict(&self, keep: &Path) {
        let Ok(entries) = std::fs::read_dir(self.dir.join("sha256")) else {
            return;
        };
        let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
            .flatten()
            .filter_map(|e| {
                let m = e.metadata().ok().filter(std::fs::Metadata::is_file)?;
                Some((m.modified().ok()?, m.len(), e.path()))
            })
            .collect();
        let mut total: u64 = files.iter().map(|(_, len, _)| len).sum();
        files.sort();
        for (_, len, path) in files {
            if total <= self.max_bytes {
                break;
            }
            // Staged files (random names) belong to a writer at work.
            let named = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.len() == 64 && n.bytes().all(|b| b.is_ascii_hexdigit()));
            if path == keep || !named {
                continue;
            }
            if std::fs::remove_file(&path).is_ok() {
                tracing::info!(file = %path.display(), mib = len >> 20, "evicted from the cache");
                total -= len;
            }
        }
    }
}

/// Marks a cached file used now (the eviction order).
fn touch(file: &Path) {
    if let Ok(f) = std::fs::File::options().append(true).open(file) {
        let _ = f.set_modified(std::time::SystemTime::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_local_file_is_read_only_with_the_digest_the_job_pinned() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.pt");
        std::fs::write(&path, b"model v1").unwrap();
        let sha = sha256_bytes(b"model v1");
        let p = path.to_str().unwrap();
        assert_eq!(read(p, &sha.to_uppercase()).unwrap(), b"model v1");
        std::fs::write(&path, b"model v2").unwrap();
        match read(p, &sha) {
            Err(PinnedError::Changed { actual, bytes }) => {
                assert_eq!(actual, sha256_bytes(b"model v2"));
                assert_eq!(bytes, b"model v2");
            }
            other => panic!("{other:?}"),
        }
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(read(p, &sha), Err(PinnedError::Unreadable(_))));
        assert_eq!(local_file(p, &sha), Some(path.clone()));
    }

    #[test]
    fn a_digest_that_is_not_one_names_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        let cache = Cache::new(dir.path().join("cache"), 1 << 20);
        std::fs::create_dir_all(dir.path().join("cache/sha256")).unwrap();
        // A forged digest climbing out of the cache: never read nor removed.
        // (The store is unreachable here, so the read fails after the cache.)
        let forged = "../../victim";
        assert!(!is_digest(forged));
        assert!(cache.bytes("s3://", forged).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        assert!(is_digest(&sha256_bytes(b"x")));
        assert!(!is_digest(&"g".repeat(64)));
    }

    #[test]
    fn the_cache_keeps_files_under_their_digest_within_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::new(dir.path().to_owned(), 10);
        let sha = sha256_bytes(b"0123456789");
        cache.keep(&sha, b"0123456789");
        assert_eq!(std::fs::read(cache.file_of(&sha)).unwrap(), b"0123456789");
        // Two files of 10 bytes in a cache of 10: the older goes.
        cache.keep(&sha, b"0123456789");
        let old = cache.file_of(&sha);
        let t = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        std::fs::File::options()
            .append(true)
            .open(&old)
            .unwrap()
            .set_modified(t)
            .unwrap();
        let sha2 = sha256_bytes(b"abcdefghij");
        cache.keep(&sha2, b"abcdefghij");
        assert!(!old.exists());
        assert!(cache.file_of(&sha2).exists());
        // One file above the bound alone stays.
        let sha3 = sha256_bytes(b"a larger file than the bound");
        cache.keep(&sha3, b"a larger file than the bound");
        assert!(cache.file_of(&sha3).exists());
        assert!(!cache.file_of(&sha2).exists());
    }
}
