//! File digests and atomic publication of output files (staging → fsync →
//! link into place; for an `s3://` destination, one conditional PUT).

use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

/// SHA-256 of a file's contents, lower-case hex.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// SHA-256 of bytes, lower-case hex.
pub fn sha256_bytes(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// What happened when a staged file was published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publish {
    /// Our file is now at the final path.
    Committed,
    /// Another writer published the final path first; ours was discarded.
    AlreadyExists,
}

/// Name of the staging folder inside an output directory. Temp files live only
/// here, so a crash never leaves a partial file where readers look.
pub const STAGING_DIR: &str = "_staging";

/// Writes a file through a staging path and publishes it at `dest` atomically.
///
/// `write` fills a buffered writer. The staged file is flushed and fsynced, then
/// hard-linked to `dest` — which fails if `dest` exists, so the first writer wins
/// and a duplicate delivery can never replace committed output — and the
/// directory is fsynced so the new name survives a power loss. With
/// `overwrite`, a plain rename replaces any existing file instead.
pub fn publish_atomically<F>(
    dest: &Path,
    tag: &str,
    overwrite: bool,
    write: F,
) -> io::Result<Publish>
where
    F: FnOnce(&mut io::BufWriter<&File>) -> io::Result<()>,
{
    if crate::source::is_url(dest) {
        return publish_object(dest, tag, overwrite, write);
    }
    let dir = dest.parent().unwrap_or(Path::new("."));
    let staging = dir.join(STAGING_DIR);
    fs::create_dir_all(&staging)?;
    let name = dest.file_name().ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "destination has no file name")
    })?;
    let tmp: PathBuf = staging.join(format!("{}.{}.tmp", name.to_string_lossy(), tag));
    let result = (|| {
        stage(&tmp, write)?.sync_all()?;
        if overwrite {
            fs::rename(&tmp, dest)?;
            return Ok(Publish::Committed);
        }
        match fs::hard_link(&tmp, dest) {
            Ok(()) => Ok(Publish::Committed),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(Publish::AlreadyExists),
            Err(e) => Err(e),
        }
    })();
    let _ = fs::remove_file(&tmp);
    let outcome = result?;
    File::open(dir)?.sync_all()?;
    Ok(outcome)
}

/// Creates `tmp` and fills it through a buffered writer; the file, flushed.
fn stage<F>(tmp: &Path, write: F) -> io::Result<File>
where
    F: FnOnce(&mut io::BufWriter<&File>) -> io::Result<()>,
{
    let file = File::create(tmp)?;
    {
        let mut w = io::BufWriter::with_capacity(1 << 16, &file);
        write(&mut w)?;
        w.flush()?;
    }
    Ok(file)
}

/// [`publish_atomically`] for an `s3://` destination: staged in a local
/// temporary file, then uploaded in one PUT — conditional (`If-None-Match`)
/// unless `overwrite`, so the first writer wins there too. An object
/// appears whole or not at all.
fn publish_object<F>(dest: &Path, tag: &str, overwrite: bool, write: F) -> io::Result<Publish>
where
    F: FnOnce(&mut io::BufWriter<&File>) -> io::Result<()>,
{
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let tmp = std::env::temp_dir().join(format!(
        "batchfleet-{}-{}-{}.{tag}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        name
    ));
    let result = (|| {
        stage(&tmp, write)?;
        let bytes = fs::read(&tmp)?;
        match crate::source::fs::put(dest, bytes, !overwrite)? {
            true => Ok(Publish::Committed),
            false => Ok(Publish::AlreadyExists),
        }
    })();
    let _ = fs::remove_file(&tmp);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_publish_wins_and_leaves_no_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("part-000001.csv");
        let first = publish_atomically(&dest, "w1", false, |w| w.write_all(b"first")).unwrap();
        let second = publish_atomically(&dest, "w2", false, |w| w.write_all(b"second")).unwrap();
        assert_eq!(first, Publish::Committed);
        assert_eq!(second, Publish::AlreadyExists);
        assert_eq!(fs::read(&dest).unwrap(), b"first");
        assert_eq!(
            fs::read_dir(dir.path().join(STAGING_DIR)).unwrap().count(),
            0
        );
    }

    #[test]
    fn overwrite_replaces_and_failed_write_publishes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("summary.json");
        publish_atomically(&dest, "a", true, |w| w.write_all(b"1")).unwrap();
        publish_atomically(&dest, "a", true, |w| w.write_all(b"2")).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"2");
        let failed = publish_atomically(&dir.path().join("x"), "a", false, |_| {
            Err(io::Error::other("disk full"))
        });
        assert!(failed.is_err());
        assert!(!dir.path().join("x").exists());
        assert_eq!(
            fs::read_dir(dir.path().join(STAGING_DIR)).unwrap().count(),
            0
        );
    }

    #[test]
    fn sha256_matches_known_vector() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
