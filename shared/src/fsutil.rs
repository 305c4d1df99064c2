//! File digests and atomic publication of output files (staging → fsync →
//! link into place; for an `s3://` destination, one conditional PUT).
//!
//! Everything below an output folder is reached through a [`Folder`]
//! handle, one component at a time with `O_NOFOLLOW`: a symbolic link
//! planted at `_rejects/`, `_staging/`, `_partial/` or a `part-*` name is
//! refused ([`SymlinkRefused`]), never followed, so nothing is written (or
//! read, or removed) outside the folder. Temporary files get random names
//! and are created exclusively, so two copies of one item on one worker
//! never share one.

use crate::metrics::names;
use rustix::fs::{
    fsync, linkat, mkdirat, openat, renameat, statat, unlinkat, AtFlags, Dir, FileType, Mode,
    OFlags, CWD,
};
use rustix::io::Errno;
use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

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
/// here, so a crash never leaves a partial file where readers look (they
/// are never read, and a name starting with `_` is one that dataset readers
/// skip).
pub const STAGING_DIR: &str = "_staging";

/// An entry under an output folder that is a symbolic link (or not what it
/// should be), refused: nothing under an output folder is followed through
/// a link, so a link planted there cannot send writes (or reads) elsewhere.
#[derive(Debug)]
pub struct SymlinkRefused {
    /// The entry.
    pub path: PathBuf,
}

impl std::fmt::Display for SymlinkRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "refusing {}: a symbolic link (or not a plain file or folder) inside the output folder, which batchfleet never follows; remove it",
            self.path.display()
        )
    }
}

impl std::error::Error for SymlinkRefused {}

fn refused(path: PathBuf) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, SymlinkRefused { path })
}

/// Whether `e` is a refusal to follow a symlink under an output folder.
pub fn is_symlink_refusal(e: &io::Error) -> bool {
    e.get_ref()
        .is_some_and(|inner| inner.downcast_ref::<SymlinkRefused>().is_some())
}

/// Whether `e` means the filesystem is full (or the quota spent).
pub fn is_disk_full(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
    )
}

/// A folder opened once, through which everything below it is reached one
/// component at a time with `O_NOFOLLOW`: the `*at` system calls on its
/// handle, never a path string that the kernel would resolve through links.
#[derive(Debug)]
pub struct Folder {
    fd: OwnedFd,
    path: PathBuf,
}

impl Folder {
    /// Opens the folder at `path` (created first if `create`). `path` itself
    /// is the configured output folder, checked against the data roots; links
    /// are only refused below it.
    pub fn open(path: &Path, create: bool) -> io::Result<Self> {
        if create {
            fs::create_dir_all(path)?;
        }
        let fd = openat(
            CWD,
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Self {
            fd,
            path: path.to_owned(),
        })
    }

    /// Its path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The folder `rel` below this one (plain components only), each
    /// component opened without following a link; created if `create`.
    pub fn sub(&self, rel: &Path, create: bool) -> io::Result<Folder> {
        let mut at: Option<Folder> = None;
        for name in plain_components(rel)? {
            let here = at.as_ref().unwrap_or(self);
            if create {
                match mkdirat(&here.fd, name, Mode::from_raw_mode(0o755)) {
                    Ok(()) => {}
                    Err(e) if e == Errno::EXIST => {}
                    Err(e) => return Err(e.into()),
                }
            }
            let path = here.path.join(name);
            let fd = match openat(
                &here.fd,
                name,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(e) if e == Errno::LOOP || e == Errno::NOTDIR => return Err(refused(path)),
                Err(e) => return Err(io::Error::from(e)),
            };
            at = Some(Folder { fd, path });
        }
        match at {
            Some(f) => Ok(f),
            None => Ok(Folder {
                fd: self.fd.try_clone()?,
                path: self.path.clone(),
            }),
        }
    }

    /// What `name` is: `None` if absent, `Some(false)` a plain file,
    /// `Some(true)` a folder; a link (or anything else) is refused.
    pub fn entry(&self, name: &str) -> io::Result<Option<bool>> {
        match statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => match FileType::from_raw_mode(st.st_mode) {
                FileType::RegularFile => Ok(Some(false)),
                FileType::Directory => Ok(Some(true)),
                _ => Err(refused(self.path.join(name))),
            },
            Err(e) if e == Errno::NOENT => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Opens the plain file `name` for reading, without following a link.
    pub fn open_file(&self, name: &str) -> io::Result<File> {
        match openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => Ok(File::from(fd)),
            Err(e) if e == Errno::LOOP => Err(refused(self.path.join(name))),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes the file `name` (a link is removed, never followed).
    pub fn remove_file(&self, name: &str) -> io::Result<()> {
        unlinkat(&self.fd, name, AtFlags::empty()).map_err(io::Error::from)
    }

    /// Removes the folder `name` and everything in it, following no link
    /// (a link inside is removed as a link). Absent: nothing to do.
    pub fn remove_tree(&self, name: &str) -> io::Result<()> {
        let sub = match self.sub(Path::new(name), false) {
            Ok(sub) => sub,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if is_symlink_refusal(&e) => return self.remove_file(name),
            Err(e) => return Err(e),
        };
        let mut names = Vec::new();
        for entry in Dir::read_from(&sub.fd)? {
            let entry = entry?;
            let n = entry.file_name().to_string_lossy().into_owned();
            if n != "." && n != ".." {
                names.push((n, entry.file_type() == FileType::Directory));
            }
        }
        for (n, is_dir) in names {
            if is_dir {
                sub.remove_tree(&n)?;
            } else {
                sub.remove_file(&n)?;
            }
        }
        unlinkat(&self.fd, name, AtFlags::REMOVEDIR).map_err(io::Error::from)
    }

    /// Writes `name` in this folder atomically: staged under a random name in
    /// `_staging/` (created exclusively, never through a link), fsynced,
    /// then hard-linked into place — which fails if `name` exists, so the
    /// first writer wins — or, with `overwrite`, renamed over it. The folder
    /// is fsynced so the new name survives a power loss. An existing `name`
    /// that is not a plain file (a planted link) is refused, not counted as
    /// published.
    pub fn publish<F>(&self, name: &str, overwrite: bool, write: F) -> io::Result<Publish>
    where
        F: FnOnce(&mut io::BufWriter<&File>) -> io::Result<()>,
    {
        self.publish_with(name, overwrite, NameSync::Now, write)
    }

    /// [`Folder::publish`], the folder fsynced now or — `NameSync::Later` —
    /// by the caller ([`sync_folder`]) before it relies on the new name.
    pub fn publish_with<F>(
        &self,
        name: &str,
        overwrite: bool,
        sync: NameSync<'_>,
        write: F,
    ) -> io::Result<Publish>
    where
        F: FnOnce(&mut io::BufWriter<&File>) -> io::Result<()>,
    {
        let staging = self.sub(Path::new(STAGING_DIR), true)?;
        let tmp = format!("{name}.{:016x}.tmp", fastrand::u64(..));
        let fd = openat(
            &staging.fd,
            tmp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )?;
        let file = File::from(fd);
        let result = (|| {
            {
                let mut w = io::BufWriter::with_capacity(1 << 16, &file);
                write(&mut w)?;
                w.flush()?;
            }
            match sync {
                NameSync::Shared(shared) => shared.sync(&file)?,
                NameSync::Now | NameSync::Later => sync_file(&file)?,
            }
            if overwrite {
                if self.entry(name)? == Some(true) {
                    return Err(refused(self.path.join(name)));
                }
                renameat(&staging.fd, tmp.as_str(), &self.fd, name)?;
                return Ok(Publish::Committed);
            }
            match linkat(&staging.fd, tmp.as_str(), &self.fd, name, AtFlags::empty()) {
                Ok(()) => Ok(Publish::Committed),
                Err(e) if e == Errno::EXIST => match self.entry(name)? {
                    Some(false) => Ok(Publish::AlreadyExists),
                    _ => Err(refused(self.path.join(name))),
                },
                Err(e) => Err(e.into()),
            }
        })();
        let _ = unlinkat(&staging.fd, tmp.as_str(), AtFlags::empty());
        let outcome = result?;
        if matches!(sync, NameSync::Now) {
            sync_fd(&self.fd)?;
        }
        Ok(outcome)
    }
}

/// How a published file is made durable. Its bytes are durable before it is
/// linked into place in every case; its name, now or by the caller.
#[derive(Debug, Clone, Copy)]
pub enum NameSync<'a> {
    /// The file fsynced, then the folder fsynced at once.
    Now,
    /// The file fsynced; the caller fsyncs the folder ([`sync_folder`])
    /// before it relies on the name — once for several files published in
    /// it (a worker's group commit).
    Later,
    /// As `Later`, the file's bytes made durable by a sync shared with the
    /// files written beside it ([`SharedSync`](crate::shared_sync::SharedSync)).
    Shared(&'a crate::shared_sync::SharedSync),
}

/// Fsyncs the folder `path`, making the names published in it with
/// [`NameSync::Later`] durable. Nothing to do for an object store URL.
pub fn sync_folder(path: &Path) -> io::Result<()> {
    if crate::source::is_url(path) {
        return Ok(());
    }
    sync_fd(&Folder::open(path, false)?.fd)
}

/// A file's own fsync, counted.
pub(crate) fn sync_file(file: &File) -> io::Result<()> {
    metrics::counter!(names::SYNCS, "what" => "file").increment(1);
    file.sync_all()
}

/// A folder's fsync, counted.
fn sync_fd(fd: &OwnedFd) -> io::Result<()> {
    metrics::counter!(names::SYNCS, "what" => "folder").increment(1);
    fsync(fd).map_err(io::Error::from)
}

/// The plain components of a relative path; `..`, roots and the like refused.
fn plain_components(rel: &Path) -> io::Result<Vec<&str>> {
    let mut out = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => out.push(n.to_str().ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} is not UTF-8", rel.display()),
                )
            })?),
            Component::CurDir => {}
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} is not a plain relative path", rel.display()),
                ))
            }
        }
    }
    Ok(out)
}

/// Splits `rel` into its folder and file name.
fn split_name(rel: &Path) -> io::Result<(&Path, &str)> {
    let name = rel.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} has no file name", rel.display()),
        )
    })?;
    Ok((rel.parent().unwrap_or(Path::new("")), name))
}

/// Writes `root/rel` atomically (see [`Folder::publish`]); `root` is an
/// output folder, `rel` a plain relative path inside it whose folders are
/// created as needed and never followed through a link. For an `s3://`
/// root, one conditional PUT ([`publish_object`]).
pub fn publish_under<F>(root: &Path, rel: &Path, overwrite: bool, write: F) -> io::Result<Publish>
where
    F: FnOnce(&mut io::BufWriter<&File>) -> io::Result<()>,
{
    publish_under_with(root, rel, overwrite, NameSync::Now, write)
}

/// [`publish_under`], the folder fsynced now or by the caller (`sync`).
pub fn publish_under_with<F>(
    root: &Path,
    rel: &Path,
    overwrite: bool,
    sync: NameSync<'_>,
    write: F,
) -> io::Result<Publish>
where
    F: FnOnce(&mut io::BufWriter<&File>) -> io::Result<()>,
{
    if crate::source::is_url(root) {
        return publish_object(&root.join(rel), overwrite, write);
    }
    let (dir, name) = split_name(rel)?;
    Folder::open(root, true)?
        .sub(dir, true)?
        .publish_with(name, overwrite, sync, write)
}

/// Writes `dest` atomically in its folder (see [`Folder::publish`]).
pub fn publish_atomically<F>(dest: &Path, overwrite: bool, write: F) -> io::Result<Publish>
where
    F: FnOnce(&mut io::BufWriter<&File>) -> io::Result<()>,
{
    let (dir, name) = split_name(dest)?;
    publish_under(dir, Path::new(name), overwrite, write)
}

/// Whether `root/rel` exists, following no link below `root` (one found is an error).
pub fn exists_under(root: &Path, rel: &Path) -> io::Result<bool> {
    if crate::source::is_url(root) {
        return crate::source::fs::exists(&root.join(rel));
    }
    let (dir, name) = split_name(rel)?;
    let folder = match Folder::open(root, false).and_then(|f| f.sub(dir, false)) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    Ok(folder.entry(name)?.is_some())
}

/// Opens `root/rel` for reading, following no link below `root`.
pub fn open_under(root: &Path, rel: &Path) -> io::Result<crate::source::Input> {
    if crate::source::is_url(root) {
        return crate::source::Input::open(&root.join(rel));
    }
    let (dir, name) = split_name(rel)?;
    let file = Folder::open(root, false)?
        .sub(dir, false)?
        .open_file(name)?;
    Ok(crate::source::Input::opened(file, root.join(rel)))
}

/// Removes the file `root/rel` (`NotFound` if absent), following no link below `root`.
pub fn remove_under(root: &Path, rel: &Path) -> io::Result<()> {
    if crate::source::is_url(root) {
        return crate::source::fs::remove_file(&root.join(rel));
    }
    let (dir, name) = split_name(rel)?;
    Folder::open(root, false)?
        .sub(dir, false)?
        .remove_file(name)
}

/// Removes the folder `root/rel` if it is empty (a folder holding anything,
/// or none there, is left as it is), following no link below `root`. In
/// S3 a "folder" is a key prefix, gone with its last object: nothing to do.
pub fn remove_empty_dir_under(root: &Path, rel: &Path) -> io::Result<()> {
    if crate::source::is_url(root) {
        return Ok(());
    }
    let (dir, name) = split_name(rel)?;
    let parent = match Folder::open(root, false).and_then(|f| f.sub(dir, false)) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    match unlinkat(&parent.fd, name, AtFlags::REMOVEDIR) {
        Ok(()) => Ok(()),
        Err(e) if e == Errno::NOTEMPTY || e == Errno::EXIST || e == Errno::NOENT => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Removes the folder `root/rel` and its contents, following no link below `root`.
pub fn remove_tree_under(root: &Path, rel: &Path) -> io::Result<()> {
    if crate::source::is_url(root) {
        return crate::source::fs::remove_dir_all(&root.join(rel));
    }
    let (dir, name) = split_name(rel)?;
    match Folder::open(root, false).and_then(|f| f.sub(dir, false)) {
        Ok(f) => f.remove_tree(name),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// [`publish_atomically`] for an `s3://` destination: staged in a local
/// temporary file, then uploaded in one PUT — conditional (`If-None-Match`)
/// unless `overwrite`, so the first writer wins there too. An object
/// appears whole or not at all.
fn publish_object<F>(dest: &Path, overwrite: bool, write: F) -> io::Result<Publish>
where
    F: FnOnce(&mut io::BufWriter<&File>) -> io::Result<()>,
{
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let tmp = std::env::temp_dir().join(format!(
        "batchfleet-{}-{}-{}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        name
    ));
    let result = (|| {
        let file = File::create(&tmp)?;
        {
            let mut w = io::BufWriter::with_capacity(1 << 16, &file);
            write(&mut w)?;
            w.flush()?;
        }
        drop(file);
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
        let first = publish_atomically(&dest, false, |w| w.write_all(b"first")).unwrap();
        let second = publish_atomically(&dest, false, |w| w.write_all(b"second")).unwrap();
        assert_eq!(first, Publish::Committed);
        assert_eq!(second, Publish::AlreadyExists);
        assert_eq!(fs::read(&dest).unwrap(), b"first");
        assert_eq!(
            fs::read_dir(dir.path().join(STAGING_DIR)).unwrap().count(),
            0
        );
    }

    #[test]
    fn a_name_published_for_a_later_sync_is_there_at_once_and_first_still_wins() {
        let dir = tempfile::tempdir().unwrap();
        let rel = Path::new("sub/part-000002.csv");
        let write = |bytes: &'static [u8]| move |w: &mut io::BufWriter<&File>| w.write_all(bytes);
        let first = publish_under_with(dir.path(), rel, false, NameSync::Later, write(b"a"));
        let second = publish_under_with(dir.path(), rel, false, NameSync::Later, write(b"b"));
        assert_eq!(
            (first.unwrap(), second.unwrap()),
            (Publish::Committed, Publish::AlreadyExists)
        );
        assert_eq!(fs::read(dir.path().join(rel)).unwrap(), b"a");
        sync_folder(&dir.path().join("sub")).unwrap();
        sync_folder(Path::new("s3://bucket/out")).expect("nothing to sync in an object store");
        assert_eq!(
            sync_folder(&dir.path().join("missing")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn overwrite_replaces_and_failed_write_publishes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("_summary.json");
        publish_atomically(&dest, true, |w| w.write_all(b"1")).unwrap();
        publish_atomically(&dest, true, |w| w.write_all(b"2")).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"2");
        let failed = publish_atomically(&dir.path().join("x"), false, |_| {
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
    fn planted_links_are_refused_and_nothing_is_written_through_them() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let out = dir.path();
        std::os::unix::fs::symlink(elsewhere.path(), out.join("_rejects")).unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("victim"), out.join("part-000001.csv"))
            .unwrap();
        fs::write(elsewhere.path().join("victim"), b"precious").unwrap();
        let e = publish_under(out, Path::new("_rejects/part-000001.jsonl"), true, |w| {
            w.write_all(b"x")
        })
        .unwrap_err();
        assert!(is_symlink_refusal(&e), "{e}");
        assert!(e.to_string().contains("rejects"), "{e}");
        // A link at the part's name is not a published part.
        let e = publish_under(out, Path::new("part-000001.csv"), false, |w| {
            w.write_all(b"x")
        })
        .unwrap_err();
        assert!(is_symlink_refusal(&e), "{e}");
        let e = publish_under(out, Path::new("part-000001.csv"), true, |w| {
            w.write_all(b"x")
        })
        .unwrap_err();
        assert!(is_symlink_refusal(&e), "{e}");
        assert_eq!(
            fs::read(elsewhere.path().join("victim")).unwrap(),
            b"precious"
        );
        assert_eq!(fs::read_dir(elsewhere.path()).unwrap().count(), 1);
        assert!(is_symlink_refusal(
            &exists_under(out, Path::new("_rejects/x")).unwrap_err()
        ));
        assert!(is_symlink_refusal(
            &open_under(out, Path::new("_rejects/x")).unwrap_err()
        ));
        // A linked _staging folder is refused too.
        fs::remove_file(out.join("part-000001.csv")).unwrap();
        fs::remove_dir(out.join(STAGING_DIR)).unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), out.join(STAGING_DIR)).unwrap();
        let e = publish_under(out, Path::new("part-000002.csv"), false, |w| {
            w.write_all(b"x")
        })
        .unwrap_err();
        assert!(is_symlink_refusal(&e), "{e}");
        assert_eq!(fs::read_dir(elsewhere.path()).unwrap().count(), 1);
    }

    #[test]
    fn trees_are_removed_without_following_links() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        fs::write(elsewhere.path().join("keep"), b"k").unwrap();
        let p = dir.path().join("_partial/part-000001-abc");
        fs::create_dir_all(&p).unwrap();
        fs::write(p.join("seg-1.csv"), b"x").unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), p.join("link")).unwrap();
        remove_tree_under(dir.path(), Path::new("_partial/part-000001-abc")).unwrap();
        assert!(!p.exists());
        assert!(elsewhere.path().join("keep").exists());
        // Removing what is not there is not an error.
        remove_tree_under(dir.path(), Path::new("_partial/none")).unwrap();
        // An empty folder goes, one holding anything stays.
        fs::create_dir_all(dir.path().join("_partial/part-000002-abc")).unwrap();
        remove_empty_dir_under(dir.path(), Path::new("_partial")).unwrap();
        assert!(dir.path().join("_partial/part-000002-abc").is_dir());
        remove_tree_under(dir.path(), Path::new("_partial/part-000002-abc")).unwrap();
        remove_empty_dir_under(dir.path(), Path::new("_partial")).unwrap();
        assert!(!dir.path().join("_partial").exists());
        remove_empty_dir_under(dir.path(), Path::new("_partial")).unwrap();
        remove_tree_under(dir.path(), Path::new("nowhere/none")).unwrap();
    }

    #[test]
    fn copies_publishing_the_same_name_at_once_never_share_a_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().to_owned();
        let writers: Vec<_> = (0..8u8)
            .map(|k| {
                let out = out.clone();
                std::thread::spawn(move || {
                    publish_under(&out, Path::new("part-000007.csv"), false, |w| {
                        for _ in 0..2000 {
                            w.write_all(&[b'a' + k; 64])?;
                        }
                        Ok(())
                    })
                    .unwrap()
                })
            })
            .collect();
        let won = writers
            .into_iter()
            .map(|t| t.join().unwrap())
            .filter(|p| *p == Publish::Committed)
            .count();
        assert_eq!(won, 1);
        let bytes = fs::read(out.join("part-000007.csv")).unwrap();
        assert_eq!(bytes.len(), 2000 * 64);
        assert!(
            bytes.iter().all(|b| *b == bytes[0]),
            "one writer's bytes, whole"
        );
        assert_eq!(fs::read_dir(out.join(STAGING_DIR)).unwrap().count(), 0);
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
