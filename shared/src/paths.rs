//! Confining file paths to data roots.
//!
//! Every local path a job names — input files, the model, the output folder —
//! must stay under one of the operator's data roots. The coordinator checks
//! the manifest's paths before it publishes anything; each worker checks the
//! paths of every work item again, because queue contents are not trusted.
//! A path is rejected when it is relative, has a `..` component, or resolves
//! (symlinks followed) to somewhere outside every root.
//!
//! Locations in S3 (`s3://bucket/key`) are confined the same way by roots
//! that are `s3://bucket` or `s3://bucket/prefix` URLs: once any root is
//! set, an `s3://` location must lie under an `s3://` root.

use std::path::{Component, Path, PathBuf};

/// The folders paths must stay under, resolved. Empty: no containment check
/// (paths must still be absolute and free of `..`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataRoots {
    roots: Vec<PathBuf>,
    /// `s3://bucket/prefix/` roots, each ending with `/`.
    url_roots: Vec<String>,
}

/// A path that is not allowed, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct PathError {
    /// The path as given.
    pub path: PathBuf,
    /// Why it is refused, and what to do.
    pub reason: String,
}

impl DataRoots {
    /// Resolves each local root (it must exist); `s3://` roots are kept as
    /// prefixes. Roots split at `:` (a `:`-separated variable) that tore an
    /// `s3://` URL apart are put back together first.
    pub fn new(roots: &[PathBuf]) -> Result<Self, PathError> {
        let mut out = Self::default();
        for r in &rejoin_urls(roots) {
            let text = r.to_string_lossy();
            if let Some(rest) = text.strip_prefix(crate::source::S3_SCHEME) {
                if rest.is_empty() || rest.starts_with('/') || rest.split('/').any(|s| s == "..") {
                    return Err(PathError {
                        path: r.clone(),
                        reason: "cannot use it as a data root: expected s3://bucket or s3://bucket/prefix".into(),
                    });
                }
                out.url_roots
                    .push(format!("{}/", text.trim_end_matches('/')));
                continue;
            }
            out.roots
                .push(std::fs::canonicalize(r).map_err(|e| PathError {
                    path: r.clone(),
                    reason: format!("cannot use it as a data root: {e}"),
                })?);
        }
        Ok(out)
    }

    /// Whether paths are confined to roots at all.
    pub fn is_confined(&self) -> bool {
        !self.roots.is_empty() || !self.url_roots.is_empty()
    }

    /// The roots, for messages.
    pub fn describe(&self) -> String {
        self.roots
            .iter()
            .map(|r| r.display().to_string())
            .chain(
                self.url_roots
                    .iter()
                    .map(|u| u.trim_end_matches('/').to_owned()),
            )
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Checks an `s3://` location against the `s3://` roots.
    fn check_url(&self, path: &Path) -> Result<PathBuf, PathError> {
        let url = path.to_string_lossy();
        let refuse = |reason: String| PathError {
            path: path.to_owned(),
            reason,
        };
        if url.split('/').any(|s| s == "..") {
            return Err(refuse(
                "contains `..`; name the object without climbing out of its prefix".into(),
            ));
        }
        let under = |root: &String| url.starts_with(root.as_str()) || format!("{url}/") == *root;
        if self.is_confined() && !self.url_roots.iter().any(under) {
            return Err(refuse(format!(
                "is outside the data roots ({}); add its bucket or prefix with --data-root s3://bucket/prefix",
                self.describe()
            )));
        }
        Ok(path.to_owned())
    }

    /// Checks `path` and returns it resolved (symlinks followed in the part
    /// that exists; a part that does not exist yet, such as an output folder
    /// to be created, is appended as it is).
    pub fn check(&self, path: &Path) -> Result<PathBuf, PathError> {
        let refuse = |reason: String| PathError {
            path: path.to_owned(),
            reason,
        };
        if crate::source::is_url(path) {
            return self.check_url(path);
        }
        if !path.is_absolute() {
            return Err(refuse("is not an absolute path".into()));
        }
        if path.components().any(|c| c == Component::ParentDir) {
            return Err(refuse(
                "contains `..`; name the file without climbing out of its folder".into(),
            ));
        }
        let resolved = resolve_existing(path).map_err(refuse)?;
        if self.is_confined() && !self.roots.iter().any(|r| resolved.starts_with(r)) {
            let via = if resolved == path {
                String::new()
            } else {
                format!(" (it resolves to {})", resolved.display())
            };
            return Err(refuse(format!(
                "is outside the data roots ({}){via}; move it under one of them or add its folder with --data-root",
                self.describe()
            )));
        }
        Ok(resolved)
    }
}

/// `path` with its longest existing prefix resolved by the file system.
fn resolve_existing(path: &Path) -> Result<PathBuf, String> {
    let mut rest = Vec::new();
    for prefix in path.ancestors() {
        // symlink_metadata: a dangling symlink exists (and fails to resolve below).
        if std::fs::symlink_metadata(prefix).is_ok() {
            let mut resolved = std::fs::canonicalize(prefix)
                .map_err(|e| format!("cannot resolve {}: {e}", prefix.display()))?;
            for part in rest.iter().rev() {
                resolved.push(part);
            }
            return Ok(resolved);
        }
        if let Some(name) = prefix.file_name() {
            rest.push(name.to_owned());
        }
    }
    Err("none of it exists".into())
}

/// The variable `--data-root` reads: one root, or several separated by `:`.
pub const DATA_ROOT_ENV: &str = "BATCHFLEET_DATA_ROOT";

/// The variable's earlier name, still read when neither `--data-root`
/// nor [`DATA_ROOT_ENV`] gives a root.
pub const LEGACY_DATA_ROOT_ENV: &str = "BATCHFLEET_DATA_ROOTS";

/// Fills `roots` from [`LEGACY_DATA_ROOT_ENV`] when the flag and
/// [`DATA_ROOT_ENV`] gave none, and returns the notice to log then.
pub fn legacy_data_roots(roots: &mut Vec<PathBuf>) -> Option<String> {
    legacy_data_roots_from(
        roots,
        std::env::var_os(DATA_ROOT_ENV).is_some(),
        std::env::var_os(LEGACY_DATA_ROOT_ENV),
    )
}

fn legacy_data_roots_from(
    roots: &mut Vec<PathBuf>,
    new_set: bool,
    legacy: Option<std::ffi::OsString>,
) -> Option<String> {
    let legacy = legacy.filter(|v| !v.is_empty())?;
    if !roots.is_empty() || new_set {
        return Some(format!(
            "{LEGACY_DATA_ROOT_ENV} is ignored: --data-root or {DATA_ROOT_ENV} is set"
        ));
    }
    let split: Vec<PathBuf> = std::env::split_paths(&legacy)
        .filter(|p| !p.as_os_str().is_empty())
        .collect();
    roots.extend(rejoin_urls(&split));
    Some(format!(
        "{LEGACY_DATA_ROOT_ENV} is read as {DATA_ROOT_ENV}, its name now: rename it"
    ))
}

/// Data roots as given to a `:`-separated variable and split there: puts
/// back together `s3` and `//bucket/prefix`, which the split tore apart.
fn rejoin_urls(roots: &[PathBuf]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::with_capacity(roots.len());
    for r in roots {
        let text = r.to_string_lossy();
        if text.starts_with("//") && out.last().is_some_and(|p| p.as_os_str() == "s3") {
            out.pop();
            out.push(PathBuf::from(format!("s3:{text}")));
        } else {
            out.push(r.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3_locations_need_an_s3_root_once_roots_are_set() {
        let f = fixture();
        let roots = DataRoots::new(&[f.root.clone(), PathBuf::from("s3://bucket/jobs")]).unwrap();
        assert!(roots.check(Path::new("s3://bucket/jobs/a/x.csv")).is_ok());
        assert!(roots.check(Path::new("s3://bucket/jobs")).is_ok());
        for bad in [
            "s3://bucket/jobsX/x.csv",
            "s3://other/jobs/x.csv",
            "s3://bucket/jobs/../x",
        ] {
            assert!(roots.check(Path::new(bad)).is_err(), "{bad}");
        }
        let local_only = DataRoots::new(std::slice::from_ref(&f.root)).unwrap();
        let e = local_only
            .check(Path::new("s3://bucket/x.csv"))
            .unwrap_err();
        assert!(e.reason.contains("--data-root s3://"), "{e}");
        assert!(DataRoots::default().check(Path::new("s3://any/x")).is_ok());
        assert!(DataRoots::new(&[PathBuf::from("s3://")]).is_err());
        // The legacy variable, read only when nothing newer is set.
        let mut got = Vec::new();
        let notice = legacy_data_roots_from(&mut got, false, Some("/data:s3://b/p".into()));
        assert_eq!(got, vec![PathBuf::from("/data"), PathBuf::from("s3://b/p")]);
        assert!(notice.unwrap().contains("BATCHFLEET_DATA_ROOT,"));
        let mut given = vec![PathBuf::from("/x")];
        let notice = legacy_data_roots_from(&mut given, false, Some("/data".into()));
        assert_eq!(given, vec![PathBuf::from("/x")]);
        assert!(notice.unwrap().contains("ignored"));
        let mut none = Vec::new();
        assert!(legacy_data_roots_from(&mut none, true, Some("/data".into())).is_some());
        assert!(none.is_empty());
        assert!(legacy_data_roots_from(&mut none, false, None).is_none());
        // "/data:s3://b/p" split at ':' comes back whole.
        let split: Vec<PathBuf> = "/data:s3://b/p".split(':').map(PathBuf::from).collect();
        assert_eq!(
            rejoin_urls(&split),
            vec![PathBuf::from("/data"), PathBuf::from("s3://b/p")]
        );
        // DataRoots takes the split form as it comes from the variable.
        let from_var =
            DataRoots::new(&[f.root.clone(), "s3".into(), "//bucket/jobs".into()]).unwrap();
        assert!(from_var.check(Path::new("s3://bucket/jobs/x.csv")).is_ok());
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        root: PathBuf,
        outside: PathBuf,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(dir.path()).unwrap();
        let root = base.join("root");
        let outside = base.join("outside");
        std::fs::create_dir_all(root.join("data")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(root.join("data/a.csv"), "x\n").unwrap();
        std::fs::write(outside.join("secret.csv"), "x\n").unwrap();
        Fixture {
            _dir: dir,
            root,
            outside,
        }
    }

    #[test]
    fn paths_under_a_root_pass_resolved() {
        let f = fixture();
        let roots = DataRoots::new(std::slice::from_ref(&f.root)).unwrap();
        let a = f.root.join("data/a.csv");
        assert_eq!(roots.check(&a).unwrap(), a);
        // An output folder that does not exist yet.
        let out = f.root.join("out/run-1");
        assert_eq!(roots.check(&out).unwrap(), out);
        // A symlink that stays inside is fine.
        std::os::unix::fs::symlink(f.root.join("data"), f.root.join("alias")).unwrap();
        assert_eq!(roots.check(&f.root.join("alias/a.csv")).unwrap(), a);
    }

    #[test]
    fn climbing_absolute_escapes_and_escaping_symlinks_are_refused() {
        let f = fixture();
        let roots = DataRoots::new(std::slice::from_ref(&f.root)).unwrap();
        let dotdot = f.root.join("data/../../outside/secret.csv");
        assert!(roots.check(&dotdot).unwrap_err().reason.contains("`..`"));
        let abs = f.outside.join("secret.csv");
        let e = roots.check(&abs).unwrap_err();
        assert!(e.reason.contains("outside the data roots"), "{e}");
        assert!(roots
            .check(Path::new("data/a.csv"))
            .unwrap_err()
            .reason
            .contains("not an absolute path"));
        std::os::unix::fs::symlink(&f.outside, f.root.join("escape")).unwrap();
        let e = roots.check(&f.root.join("escape/secret.csv")).unwrap_err();
        assert!(
            e.reason.contains("outside the data roots") && e.reason.contains("resolves to"),
            "{e}"
        );
        // A folder to be created under an escaping link escapes too.
        assert!(roots.check(&f.root.join("escape/new/out")).is_err());
        // A dangling link cannot be resolved, so it is refused.
        std::os::unix::fs::symlink(f.root.join("nowhere"), f.root.join("dangling")).unwrap();
        assert!(roots.check(&f.root.join("dangling/x")).is_err());
    }

    #[test]
    fn without_roots_only_the_shape_is_checked() {
        let f = fixture();
        let open = DataRoots::default();
        assert!(open.check(&f.outside.join("secret.csv")).is_ok());
        assert!(open.check(&f.root.join("../outside/secret.csv")).is_err());
        assert!(open.check(Path::new("relative.csv")).is_err());
        assert!(DataRoots::new(&[f.root.join("missing")]).is_err());
    }
}
