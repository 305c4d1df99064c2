//! Where data lives: a local file, or an object in S3 or an S3-compatible
//! store named by an `s3://bucket/key` URL.
//!
//! Everything that reads input — manifest checks, the planner, the worker's
//! readers, part files read back — opens it through [`Input`], which offers
//! the few operations they need (length, a byte range, a streaming reader,
//! Parquet's [`ChunkReader`]) for both kinds; [`fs`] holds the output
//! folder's operations (exists, list, remove, conditional put). S3 access is configured from the
//! environment only (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT_URL` for a non-AWS
//! store, `AWS_ALLOW_HTTP=true` for a plain-http one); credentials never
//! appear in manifests, work items or logs. Which buckets and prefixes a job
//! may touch is the data roots' to say ([`crate::paths`]).
//!
//! The store's client is async; these calls are made from planner threads
//! and blocking tasks, so they run on a small runtime of their own.

use bytes::Bytes;
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::{ObjectStore, ObjectStoreExt};
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// The URL scheme of S3 locations.
pub const S3_SCHEME: &str = "s3://";

/// Bytes fetched per request by a streaming S3 reader.
const READ_CHUNK: u64 = 8 << 20;

/// Whether `p` names an S3 object or prefix rather than a local path.
pub fn is_url(p: &Path) -> bool {
    p.to_str().is_some_and(|s| s.starts_with(S3_SCHEME))
}

/// An input file, local or in S3.
#[derive(Debug, Clone)]
pub enum Input {
    /// A local file.
    Local(PathBuf),
    /// A local file opened already (through an output folder's handle, so
    /// no link was followed to reach it), read by position; its path is for messages.
    Opened(Arc<File>, PathBuf),
    /// An S3 object.
    S3(Object),
}

/// What an input file is, as far as its metadata tells without reading
/// it: its size, and its modification time (local files) or ETag (S3
/// objects). A job's id covers its inputs' fingerprints, so a changed input
/// makes a new job, and each item carries its file's [`Fingerprint::version`]
/// for the worker to check before it reads.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Fingerprint {
    /// Length in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch (local files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtime_ns: Option<u64>,
    /// The object's ETag (S3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
}

impl Fingerprint {
    fn of_metadata(m: &std::fs::Metadata) -> Self {
        let mtime_ns = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos() as u64);
        Self {
            size: m.len(),
            mtime_ns,
            etag: None,
        }
    }

    /// The version a work item carries: `mtime:<ns>` or `etag:<etag>`
    /// (`None` when the store gave neither).
    pub fn version(&self) -> Option<String> {
        match (&self.etag, self.mtime_ns) {
            (Some(e), _) => Some(format!("etag:{e}")),
            (None, Some(ns)) => Some(format!("mtime:{ns}")),
            (None, None) => None,
        }
    }
}

/// Reads an opened file from a position on, without moving a shared offset.
struct PositionalReader {
    file: Arc<File>,
    pos: u64,
}

impl Read for PositionalReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let n = self.file.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Input {
    /// The input named by `path` (`s3://bucket/key` or a local path).
    pub fn open(path: &Path) -> io::Result<Self> {
        if is_url(path) {
            Object::parse(&path.to_string_lossy()).map(Input::S3)
        } else {
            Ok(Input::Local(path.to_owned()))
        }
    }

    /// An input over a file already opened (see [`crate::fsutil::open_under`]).
    pub fn opened(file: File, path: PathBuf) -> Self {
        Input::Opened(Arc::new(file), path)
    }

    /// Its length in bytes.
    pub fn len(&self) -> io::Result<u64> {
        match self {
            Input::Local(p) => Ok(std::fs::metadata(p)?.len()),
            Input::Opened(f, _) => Ok(f.metadata()?.len()),
            Input::S3(o) => o.len(),
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> io::Result<bool> {
        self.len().map(|n| n == 0)
    }

    /// What the file is now: its length and version (local: modification
    /// time; S3: ETag). A file whose fingerprint differs from the one a job
    /// was planned with has changed under it.
    pub fn fingerprint(&self) -> io::Result<Fingerprint> {
        match self {
            Input::Local(p) => Ok(Fingerprint::of_metadata(&std::fs::metadata(p)?)),
            Input::Opened(f, _) => Ok(Fingerprint::of_metadata(&f.metadata()?)),
            Input::S3(o) => {
                let (size, etag) = o.meta()?;
                Ok(Fingerprint {
                    size,
                    mtime_ns: None,
                    etag,
                })
            }
        }
    }

    /// Bytes `range` (a local file clamps it to its end; S3 refuses one past the end).
    pub fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        match self {
            Input::Local(p) => {
                let mut f = File::open(p)?;
                f.seek(SeekFrom::Start(range.start))?;
                let mut buf = Vec::with_capacity((range.end - range.start) as usize);
                f.take(range.end - range.start).read_to_end(&mut buf)?;
                Ok(buf)
            }
            Input::Opened(f, _) => {
                let mut buf = Vec::new();
                PositionalReader {
                    file: f.clone(),
                    pos: range.start,
                }
                .take(range.end.saturating_sub(range.start))
                .read_to_end(&mut buf)?;
                Ok(buf)
            }
            Input::S3(o) => o.read_range(range).map(|b| b.to_vec()),
        }
    }

    /// All of it.
    pub fn read_all(&self) -> io::Result<Vec<u8>> {
        match self {
            Input::Local(p) => std::fs::read(p),
            Input::Opened(..) => {
                let mut buf = Vec::new();
                self.reader()?.read_to_end(&mut buf)?;
                Ok(buf)
            }
            Input::S3(o) => o.read_all().map(|b| b.to_vec()),
        }
    }

    /// A reader from the start, streaming (S3: ranges of 8 MiB in turn).
    pub fn reader(&self) -> io::Result<Box<dyn Read + Send>> {
        match self {
            Input::Local(p) => Ok(Box::new(File::open(p)?)),
            Input::Opened(f, _) => Ok(Box::new(PositionalReader {
                file: f.clone(),
                pos: 0,
            })),
            Input::S3(o) => Ok(Box::new(o.reader_at(0)?)),
        }
    }
}

impl parquet::file::reader::Length for Input {
    fn len(&self) -> u64 {
        // Parquet asks after opening; an error here surfaces on the reads that follow.
        Input::len(self).unwrap_or(0)
    }
}

impl parquet::file::reader::ChunkReader for Input {
    type T = Box<dyn Read + Send>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        let r: io::Result<Self::T> = match self {
            Input::Local(p) => File::open(p).and_then(|mut f| {
                f.seek(SeekFrom::Start(start))?;
                Ok(Box::new(f) as Self::T)
            }),
            Input::Opened(f, _) => Ok(Box::new(PositionalReader {
                file: f.clone(),
                pos: start,
            }) as Self::T),
            Input::S3(o) => o.reader_at(start).map(|r| Box::new(r) as Self::T),
        };
        r.map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let r = match self {
            Input::Local(_) | Input::Opened(..) => self
                .read_range(start..start + length as u64)
                .map(Bytes::from),
            Input::S3(o) => o.read_range(start..start + length as u64),
        };
        r.map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))
    }
}

/// One object of an S3 bucket.
#[derive(Clone)]
pub struct Object {
    store: Arc<AmazonS3>,
    bucket: String,
    key: object_store::path::Path,
    /// Its size and ETag once asked (one HEAD per opened object, not per read).
    meta: Arc<OnceLock<(u64, Option<String>)>>,
}

impl std::fmt::Debug for Object {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Object({})", self.url())
    }
}

impl Object {
    /// The object of an `s3://bucket/key` URL.
    pub fn parse(url: &str) -> io::Result<Self> {
        let (bucket, key) = split_url(url)?;
        Ok(Self {
            store: store(&bucket)?,
            key: object_store::path::Path::parse(&key).map_err(|e| invalid(url, e))?,
            bucket,
            meta: Arc::default(),
        })
    }

    /// `s3://bucket/key`.
    pub fn url(&self) -> String {
        format!("{S3_SCHEME}{}/{}", self.bucket, self.key)
    }

    /// Its size.
    pub fn len(&self) -> io::Result<u64> {
        self.meta().map(|(n, _)| n)
    }

    /// Its size and ETag (one HEAD, remembered).
    fn meta(&self) -> io::Result<(u64, Option<String>)> {
        if let Some(m) = self.meta.get() {
            return Ok(m.clone());
        }
        let m = block_on(async { self.store.head(&self.key).await })
            .map(|m| (m.size, m.e_tag))
            .map_err(|e| io_error(&self.url(), e))?;
        Ok(self.meta.get_or_init(|| m).clone())
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> io::Result<bool> {
        self.len().map(|n| n == 0)
    }

    /// Bytes `range`.
    pub fn read_range(&self, range: Range<u64>) -> io::Result<Bytes> {
        if range.start >= range.end {
            return Ok(Bytes::new());
        }
        block_on(async { self.store.get_range(&self.key, range).await })
            .map_err(|e| io_error(&self.url(), e))
    }

    /// The whole object.
    pub fn read_all(&self) -> io::Result<Bytes> {
        block_on(async {
            let got = self.store.get(&self.key).await?;
            got.bytes().await
        })
        .map_err(|e| io_error(&self.url(), e))
    }

    fn reader_at(&self, start: u64) -> io::Result<ObjectReader> {
        Ok(ObjectReader {
            len: self.len()?,
            object: self.clone(),
            pos: start,
            buf: Bytes::new(),
        })
    }
}

/// Reads an object front to back in [`READ_CHUNK`] ranges.
struct ObjectReader {
    object: Object,
    len: u64,
    pos: u64,
    buf: Bytes,
}

impl Read for ObjectReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.buf.is_empty() {
            if self.pos >= self.len {
                return Ok(0);
            }
            let end = (self.pos + READ_CHUNK).min(self.len);
            self.buf = self.object.read_range(self.pos..end)?;
            self.pos = end;
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        self.buf = self.buf.slice(n..);
        Ok(n)
    }
}

/// File operations on paths that may be `s3://` URLs: the output folder's
/// part files, rejects, checkpoints and summary live wherever `[output] dir`
/// says. Local paths go to `std::fs`; in S3 a "folder" is a key prefix.
pub mod fs {
    use super::*;

    /// Whether the file exists.
    pub fn exists(p: &Path) -> io::Result<bool> {
        if !is_url(p) {
            return Ok(p.exists());
        }
        match Object::parse(&p.to_string_lossy())?.len() {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The file's bytes.
    pub fn read(p: &Path) -> io::Result<Vec<u8>> {
        Input::open(p)?.read_all()
    }

    /// The file's text.
    pub fn read_to_string(p: &Path) -> io::Result<String> {
        String::from_utf8(read(p)?).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    /// Removes a file (`NotFound` if there is none, as `std::fs`).
    pub fn remove_file(p: &Path) -> io::Result<()> {
        if !is_url(p) {
            return std::fs::remove_file(p);
        }
        if !exists(p)? {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} does not exist", p.display()),
            ));
        }
        let o = Object::parse(&p.to_string_lossy())?;
        block_on(async { o.store.delete(&o.key).await }).map_err(|e| io_error(&o.url(), e))
    }

    /// Removes a folder and everything in it (every object under the prefix).
    pub fn remove_dir_all(p: &Path) -> io::Result<()> {
        if !is_url(p) {
            return std::fs::remove_dir_all(p);
        }
        let (bucket, key) = split_url(&p.to_string_lossy())?;
        let store = store(&bucket)?;
        let prefix = format!("{}/", key.trim_end_matches('/'));
        for (url, _) in list(&bucket, &prefix)? {
            let (_, k) = split_url(&url)?;
            let path = object_store::path::Path::parse(&k).map_err(|e| invalid(&url, e))?;
            block_on(async { store.delete(&path).await }).map_err(|e| io_error(&url, e))?;
        }
        Ok(())
    }

    /// Creates a folder (S3 has none to create).
    pub fn create_dir_all(p: &Path) -> io::Result<()> {
        if is_url(p) {
            Ok(())
        } else {
            std::fs::create_dir_all(p)
        }
    }

    /// Names of the entries directly in a folder (an empty list if it does not exist).
    pub fn list_dir(p: &Path) -> io::Result<Vec<String>> {
        if !is_url(p) {
            return match std::fs::read_dir(p) {
                Ok(entries) => Ok(entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
                Err(e) => Err(e),
            };
        }
        let url = p.to_string_lossy();
        let (bucket, key) = split_url(&url)?;
        let store = store(&bucket)?;
        let prefix = object_store::path::Path::parse(key.trim_end_matches('/'))
            .map_err(|e| invalid(&url, e))?;
        let listed = block_on(async { store.list_with_delimiter(Some(&prefix)).await })
            .map_err(|e| io_error(&url, e))?;
        let mut names: Vec<String> = listed
            .objects
            .iter()
            .filter_map(|o| o.location.filename().map(str::to_owned))
            .chain(
                listed
                    .common_prefixes
                    .iter()
                    .filter_map(|c| c.filename().map(str::to_owned)),
            )
            .collect();
        names.sort();
        Ok(names)
    }

    /// Uploads `bytes` as the object `dest`; with `create_only`, only if it
    /// does not exist yet (a conditional put): `false` when another writer was first.
    pub fn put(dest: &Path, bytes: Vec<u8>, create_only: bool) -> io::Result<bool> {
        let o = Object::parse(&dest.to_string_lossy())?;
        let mode = if create_only {
            object_store::PutMode::Create
        } else {
            object_store::PutMode::Overwrite
        };
        match block_on(async {
            o.store
                .put_opts(&o.key, Bytes::from(bytes).into(), mode.into())
                .await
        }) {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) if create_only => Ok(false),
            Err(e) => Err(io_error(&o.url(), e)),
        }
    }
}

/// Every object (URL, size) whose key starts with `prefix`, under
/// `s3://bucket/` — in key order.
pub fn list(bucket: &str, prefix: &str) -> io::Result<Vec<(String, u64)>> {
    Ok(list_fingerprints(bucket, prefix)?
        .into_iter()
        .map(|(url, f)| (url, f.size))
        .collect())
}

/// [`list`] with each object's fingerprint (size and ETag), as the listing gives it.
pub fn list_fingerprints(bucket: &str, prefix: &str) -> io::Result<Vec<(String, Fingerprint)>> {
    use futures_lite::StreamExt;
    let store = store(bucket)?;
    let at = format!("{S3_SCHEME}{bucket}/{prefix}");
    let prefix_path = (!prefix.is_empty())
        .then(|| object_store::path::Path::parse(prefix.trim_end_matches('/')))
        .transpose()
        .map_err(|e| invalid(&at, e))?;
    let mut found: Vec<(String, Fingerprint)> = block_on(async {
        let mut stream = store.list(prefix_path.as_ref());
        let mut found = Vec::new();
        while let Some(meta) = stream.next().await {
            let meta = meta?;
            let fingerprint = Fingerprint {
                size: meta.size,
                mtime_ns: None,
                etag: meta.e_tag,
            };
            found.push((
                format!("{S3_SCHEME}{bucket}/{}", meta.location),
                fingerprint,
            ));
        }
        Ok::<_, object_store::Error>(found)
    })
    .map_err(|e| io_error(&at, e))?;
    found.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(found)
}

/// Expands an `s3://bucket/key-pattern` glob (`*`, `?`, `[…]`, `**`) by
/// listing the bucket under the pattern's literal prefix: matching object
/// URLs with their sizes.
pub fn glob(url_pattern: &str) -> io::Result<Vec<(String, u64)>> {
    Ok(glob_fingerprints(url_pattern)?
        .into_iter()
        .map(|(url, f)| (url, f.size))
        .collect())
}

/// [`glob`] with each object's fingerprint (size and ETag).
pub fn glob_fingerprints(url_pattern: &str) -> io::Result<Vec<(String, Fingerprint)>> {
    let (bucket, pattern) = split_url(url_pattern)?;
    let literal = pattern
        .find(['*', '?', '['])
        .map_or(pattern.as_str(), |i| &pattern[..i]);
    let prefix = &literal[..literal.rfind('/').map_or(0, |i| i + 1)];
    let matcher = glob::Pattern::new(&pattern).map_err(|e| invalid(url_pattern, e))?;
    let options = glob::MatchOptions {
        require_literal_separator: true,
        ..Default::default()
    };
    Ok(list_fingerprints(&bucket, prefix)?
        .into_iter()
        .filter(|(url, _)| {
            let key = &url[S3_SCHEME.len() + bucket.len() + 1..];
            matcher.matches_with(key, options)
        })
        .collect())
}

fn split_url(url: &str) -> io::Result<(String, String)> {
    let rest = url
        .strip_prefix(S3_SCHEME)
        .ok_or_else(|| invalid(url, "not an s3:// URL"))?;
    match rest.split_once('/') {
        Some((bucket, key)) if !bucket.is_empty() => Ok((bucket.to_owned(), key.to_owned())),
        _ => Err(invalid(url, "expected s3://bucket/key")),
    }
}

fn invalid(url: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{url}: {e}"))
}

/// An object store error as an `io::Error`: a missing object is `NotFound`
/// (which readers treat as "input gone"), the rest are `Other` (transient).
fn io_error(url: &str, e: object_store::Error) -> io::Error {
    let kind = match e {
        object_store::Error::NotFound { .. } => io::ErrorKind::NotFound,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, format!("{url}: {e}"))
}

/// Options applied over the environment's (tests point the stores of one
/// process at a local server this way; production uses the environment).
static OVERRIDES: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// Sets S3 options for this process on top of the `AWS_*` environment
/// (keys as `AmazonS3ConfigKey` names: `endpoint`, `allow_http`,
/// `access_key_id`, …); stores already made keep theirs.
pub fn set_s3_options(options: &[(&str, &str)]) {
    // One lock at a time: `store` takes STORES, then OVERRIDES.
    OVERRIDES.lock().unwrap_or_else(|p| p.into_inner()).extend(
        options
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    STORES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
}

static STORES: OnceLock<Mutex<HashMap<String, Arc<AmazonS3>>>> = OnceLock::new();

/// S3 credentials from mounted secret files — `AWS_ACCESS_KEY_ID_FILE`,
/// `AWS_SECRET_ACCESS_KEY_FILE` and optionally `AWS_SESSION_TOKEN_FILE`,
/// used when `AWS_ACCESS_KEY_ID` itself is not set — read again whenever
/// one of the files changes, so that credentials an agent rotates (a
/// Kubernetes Secret, Vault, a session-token refresher) are taken up by a
/// running worker or coordinator. Credentials in variables are fixed for
/// the process, as its variables are; with neither, the store's own chain
/// (web identity, container or instance credentials) refreshes them.
#[derive(Debug)]
struct FileCredentials {
    /// (variable, file) for the key id, the secret and the token.
    files: [(&'static str, Option<PathBuf>); 3],
    /// The files' (modified, length) when last read, and what they held.
    read: Mutex<Option<(Vec<Stamp>, Arc<object_store::aws::AwsCredential>)>>,
}

/// A credential file's modification time and length, when it was read.
type Stamp = Option<(std::time::SystemTime, u64)>;

impl FileCredentials {
    /// From the environment, when the key id comes as a file.
    fn from_env() -> Option<Self> {
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_some() {
            return None;
        }
        let file = |var: &str| std::env::var_os(format!("{var}_FILE")).map(PathBuf::from);
        let id = file("AWS_ACCESS_KEY_ID")?;
        Some(Self {
            files: [
                ("AWS_ACCESS_KEY_ID_FILE", Some(id)),
                ("AWS_SECRET_ACCESS_KEY_FILE", file("AWS_SECRET_ACCESS_KEY")),
                ("AWS_SESSION_TOKEN_FILE", file("AWS_SESSION_TOKEN")),
            ],
            read: Mutex::new(None),
        })
    }

    /// The credentials the files hold now (read again only if one changed).
    fn read(
        &self,
    ) -> Result<Arc<object_store::aws::AwsCredential>, crate::secret::SecretFileError> {
        let stamps: Vec<_> = self
            .files
            .iter()
            .map(|(_, f)| {
                let m = std::fs::metadata(f.as_ref()?).ok()?;
                Some((m.modified().ok()?, m.len()))
            })
            .collect();
        let mut read = self.read.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, creds)) = read.as_ref() {
            if *at == stamps {
                return Ok(creds.clone());
            }
        }
        let value = |i: usize| -> Result<Option<String>, crate::secret::SecretFileError> {
            let (var, file) = &self.files[i];
            file.as_ref()
                .map(|f| crate::secret::read_secret_file(f, var))
                .transpose()
        };
        let creds = Arc::new(object_store::aws::AwsCredential {
            key_id: value(0)?.unwrap_or_default(),
            secret_key: value(1)?.unwrap_or_default(),
            token: value(2)?,
        });
        if read.is_some() {
            tracing::info!("S3 credential files changed: read again");
        }
        *read = Some((stamps, creds.clone()));
        Ok(creds)
    }
}

#[async_trait::async_trait]
impl object_store::CredentialProvider for FileCredentials {
    type Credential = object_store::aws::AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<Self::Credential>> {
        self.read().map_err(|e| object_store::Error::Generic {
            store: "S3",
            source: Box::new(e),
        })
    }
}

fn store(bucket: &str) -> io::Result<Arc<AmazonS3>> {
    let mut stores = STORES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(s) = stores.get(bucket) {
        return Ok(s.clone());
    }
    // reqwest's rustls runs on the process-wide provider: ring (an error
    // only means one is installed already).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
    if let Some(files) = FileCredentials::from_env() {
        // Mounted secrets, read again whenever they change.
        files
            .read()
            .map_err(|e| invalid(&format!("{S3_SCHEME}{bucket}"), e))?;
        builder = builder.with_credentials(Arc::new(files));
    } else {
        for (var, key) in [
            ("AWS_ACCESS_KEY_ID", AmazonS3ConfigKey::AccessKeyId),
            ("AWS_SECRET_ACCESS_KEY", AmazonS3ConfigKey::SecretAccessKey),
            ("AWS_SESSION_TOKEN", AmazonS3ConfigKey::Token),
        ] {
            if let Some(value) = crate::secret::env_or_file(var)
                .map_err(|e| invalid(&format!("{S3_SCHEME}{bucket}"), e))?
            {
                builder = builder.with_config(key, value);
            }
        }
    }
    for (k, v) in OVERRIDES.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let key = k
            .parse()
            .map_err(|e| invalid(&format!("{S3_SCHEME}{bucket}"), e))?;
        builder = builder.with_config(key, v);
    }
    let s3 = Arc::new(
        builder
            .build()
            .map_err(|e| invalid(&format!("{S3_SCHEME}{bucket}"), e))?,
    );
    stores.insert(bucket.to_owned(), s3.clone());
    Ok(s3)
}

/// Runs a store call to completion from synchronous code, on this module's
/// runtime (from a thread of its own when called inside another runtime).
fn block_on<F>(f: F) -> F::Output
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    let rt = RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("batchfleet-s3")
            .enable_all()
            .build()
            .expect("a runtime for object store calls")
    });
    if tokio::runtime::Handle::try_current().is_ok() {
        std::thread::scope(|s| {
            s.spawn(|| rt.block_on(f))
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    } else {
        rt.block_on(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credential_files_are_read_again_when_they_change() {
        let dir = tempfile::tempdir().expect("dir");
        let (id, secret, token) = (
            dir.path().join("id"),
            dir.path().join("secret"),
            dir.path().join("token"),
        );
        let write = |v: &str| {
            std::fs::write(&id, format!("AKIA{v}\n")).expect("id");
            std::fs::write(&secret, format!("secret-{v}\n")).expect("secret");
            std::fs::write(&token, format!("token-{v}")).expect("token");
        };
        write("ONE");
        let files = FileCredentials {
            files: [
                ("AWS_ACCESS_KEY_ID_FILE", Some(id.clone())),
                ("AWS_SECRET_ACCESS_KEY_FILE", Some(secret.clone())),
                ("AWS_SESSION_TOKEN_FILE", Some(token.clone())),
            ],
            read: Mutex::new(None),
        };
        let first = files.read().expect("read");
        assert_eq!(
            (
                first.key_id.as_str(),
                first.secret_key.as_str(),
                first.token.as_deref()
            ),
            ("AKIAONE", "secret-ONE", Some("token-ONE"))
        );
        assert!(
            Arc::ptr_eq(&first, &files.read().expect("again")),
            "unchanged files are not read again"
        );
        // Rotated: other values, other lengths.
        write("ROTATED");
        let second = files.read().expect("read");
        assert_eq!(
            (second.key_id.as_str(), second.token.as_deref()),
            ("AKIAROTATED", Some("token-ROTATED"))
        );
        // A file emptied mid-rotation is an error naming it, not empty credentials.
        std::fs::write(&secret, "").expect("empty");
        let err = files.read().expect_err("empty secret").to_string();
        assert!(
            err.contains("AWS_SECRET_ACCESS_KEY_FILE") && !err.contains("ROTATED"),
            "{err}"
        );
    }

    #[test]
    fn urls_and_local_paths_are_told_apart() {
        assert!(is_url(Path::new("s3://b/k.csv")));
        assert!(!is_url(Path::new("/data/s3://x")));
        assert_eq!(
            split_url("s3://b/a/k.csv").unwrap(),
            ("b".into(), "a/k.csv".into())
        );
        assert!(split_url("s3:///k").is_err() && split_url("s3://bucket").is_err());
    }

    #[test]
    fn local_inputs_read_ranges_and_stream() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.txt");
        std::fs::write(&p, b"hello world").unwrap();
        let input = Input::open(&p).unwrap();
        assert_eq!(input.len().unwrap(), 11);
        assert_eq!(input.read_range(6..11).unwrap(), b"world");
        let mut all = String::new();
        input.reader().unwrap().read_to_string(&mut all).unwrap();
        assert_eq!(all, "hello world");
    }
}
