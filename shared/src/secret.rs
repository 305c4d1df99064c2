//! Connection URLs with credentials that never reach logs, `Debug` output or errors.

use std::fmt;
use std::str::FromStr;

/// A URL that may embed a password (`amqp://user:pass@host`, `redis://:pass@host`).
///
/// `Display` and `Debug` print it with the password replaced by `***`; only
/// [`SecretUrl::expose`] gives the real string, for handing to a client library.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// Wraps a URL string.
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The full URL, credentials included. Pass it to a client, never to a log.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with any password replaced by `***`.
    pub fn redacted(&self) -> String {
        redact(&self.0)
    }

    /// The URLs of a comma-separated list (`amqp://a,amqp://b`), in order;
    /// a single URL is a list of one. A list splits only where a `,` is
    /// followed by `scheme://`, so a comma inside a password stays.
    pub fn split(&self) -> Vec<SecretUrl> {
        let starts = url_starts(&self.0);
        starts
            .iter()
            .enumerate()
            .map(|(i, &start)| {
                let end = starts.get(i + 1).map_or(self.0.len(), |next| next - 1);
                SecretUrl::new(self.0[start..end].trim())
            })
            .filter(|u| !u.0.is_empty())
            .collect()
    }

    /// Several URLs as one list (joined by `,`), as [`SecretUrl::split`] reads it.
    pub fn join(urls: &[SecretUrl]) -> SecretUrl {
        SecretUrl::new(
            urls.iter()
                .map(SecretUrl::expose)
                .collect::<Vec<_>>()
                .join(","),
        )
    }

    /// Whether a password in it holds a raw `/`, `?`, `#` or `@`, which
    /// clients take for the end of the host part.
    pub fn password_has_reserved(&self) -> bool {
        password_spans(&self.0)
            .into_iter()
            .any(|span| self.0[span].contains(['/', '?', '#', '@']))
    }
}

/// Replaces the password of `scheme://user:password@host…` with `***`;
/// of every URL in a comma-separated list (`amqp://…,amqp://…`).
pub fn redact(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let mut last = 0;
    for span in password_spans(url) {
        out.push_str(&url[last..span.start]);
        out.push_str("***");
        last = span.end;
    }
    out.push_str(&url[last..]);
    out
}

/// Where the passwords are in `text`: one URL, or several separated by
/// commas (each part from one `scheme://` to the next).
///
/// A URL's userinfo ends at its *last* `@`, and the password runs from the
/// first `:` of the userinfo to there. A password ought to percent-encode
/// `/`, `?`, `#` and `@`, but often does not, and a strict parser then ends
/// the authority early and takes the rest of the password for a path, which
/// it prints. Reading to the last `@` masks such a password whole; a URL
/// without credentials but with an `@` in its query (`redis://h:1/0?a=b@c`)
/// gets more than a password masked, which hides nothing that matters.
fn password_spans(text: &str) -> Vec<std::ops::Range<usize>> {
    let mut spans = Vec::new();
    let starts = url_starts(text);
    for (i, &start) in starts.iter().enumerate() {
        let end = starts.get(i + 1).map_or(text.len(), |next| next - 1);
        let one = &text[start..end];
        let Some(scheme_end) = one.find("://") else {
            continue;
        };
        let rest_at = scheme_end + 3;
        let rest = &one[rest_at..];
        let Some(at) = rest.rfind('@') else {
            continue;
        };
        let userinfo = &rest[..at];
        // A user name holds no '/': a ':' after one belongs to a host:port.
        let Some(colon) = userinfo.find(':').filter(|&c| !userinfo[..c].contains('/')) else {
            continue;
        };
        if colon + 1 < at {
            spans.push(start + rest_at + colon + 1..start + rest_at + at);
        }
    }
    spans
}

/// Byte offsets where each URL of a comma-separated list starts: 0, and
/// after every `,` followed by `scheme://` (spaces between allowed).
fn url_starts(text: &str) -> Vec<usize> {
    let mut starts = vec![0];
    for (i, _) in text.match_indices(',') {
        let after = text[i + 1..].trim_start();
        let scheme_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
            .unwrap_or(after.len());
        if scheme_len > 0
            && after.as_bytes()[0].is_ascii_alphabetic()
            && after[scheme_len..].starts_with("://")
        {
            starts.push(i + 1);
        }
    }
    starts
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretUrl({})", self.redacted())
    }
}

impl FromStr for SecretUrl {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self::new(s))
    }
}

/// Removes every occurrence of `url`'s passwords from `text`, for error
/// messages produced by client libraries that may echo the URL they were
/// given (or a piece of it: a password with a `/` can come back as a path).
pub fn scrub(text: &str, url: &SecretUrl) -> String {
    let mut out = text.replace(url.expose(), &url.redacted());
    for span in password_spans(url.expose()) {
        let password = &url.expose()[span];
        out = out.replace(password, "***");
        // Parsers split a raw password at its first '/', '?', '#' or '@'
        // and may quote either side alone.
        for piece in password.split(['/', '?', '#', '@']) {
            if piece.len() >= 4 {
                out = out.replace(piece, "***");
            }
        }
    }
    out
}

/// The error reading a secret from a `…_FILE` file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var} = {path}: cannot read the secret from it: {reason}")]
pub struct SecretFileError {
    /// The `…_FILE` variable or flag.
    pub var: String,
    /// The file.
    pub path: String,
    /// Why.
    pub reason: String,
}

/// Reads a secret from a file (a Docker or Kubernetes secret mounted as
/// one): its contents without the trailing newline. `var` names the
/// setting in the error.
pub fn read_secret_file(path: &std::path::Path, var: &str) -> Result<String, SecretFileError> {
    let err = |reason: String| SecretFileError {
        var: var.to_owned(),
        path: path.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let value = text.trim_end_matches(['\n', '\r']).to_owned();
    if value.is_empty() {
        return Err(err("it is empty".into()));
    }
    Ok(value)
}

/// A secret-bearing environment variable: `NAME` itself, or else the
/// contents of the file that `NAME_FILE` names. `None` when neither is set.
pub fn env_or_file(name: &str) -> Result<Option<String>, SecretFileError> {
    if let Ok(v) = std::env::var(name) {
        return Ok(Some(v));
    }
    let var = format!("{name}_FILE");
    match std::env::var_os(&var) {
        Some(path) => read_secret_file(std::path::Path::new(&path), &var).map(Some),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_password_but_keeps_user_and_host() {
        let url = SecretUrl::new("amqp://svc:hunter2@rabbit.internal:5672/%2f");
        assert_eq!(url.to_string(), "amqp://svc:***@rabbit.internal:5672/%2f");
        assert!(!format!("{url:?}").contains("hunter2"));
        assert_eq!(url.expose(), "amqp://svc:hunter2@rabbit.internal:5672/%2f");
    }

    #[test]
    fn redacts_password_only_userinfo_and_leaves_plain_urls() {
        assert_eq!(
            redact("redis://:s3cret@10.0.0.1:6379/0"),
            "redis://:***@10.0.0.1:6379/0"
        );
        assert_eq!(redact("redis://127.0.0.1:6379/"), "redis://127.0.0.1:6379/");
        assert_eq!(redact("not a url"), "not a url");
    }

    #[test]
    fn redacts_passwords_with_reserved_characters_and_every_url_of_a_list() {
        // A raw '/' (and '@', '?', '#') in a password, as people write them.
        let url = SecretUrl::new("amqp://svc:pa/ss@w?#rd@rabbit:5672/%2f");
        assert_eq!(url.to_string(), "amqp://svc:***@rabbit:5672/%2f");
        assert!(!format!("{url:?}").contains("ss@w"));
        assert_eq!(
            redact("amqp://a:one/1@h1:5672,amqps://b:two/2@h2:5671/%2f,amqp://h3"),
            "amqp://a:***@h1:5672,amqps://b:***@h2:5671/%2f,amqp://h3"
        );
        assert_eq!(
            redact("rediss://default:x/y@cache:6380"),
            "rediss://default:***@cache:6380"
        );
        // A user name only, and a port with no credentials, stay as they are.
        assert_eq!(redact("redis://user@h:1/0"), "redis://user@h:1/0");
        assert_eq!(redact("amqp://h:5672/v/x"), "amqp://h:5672/v/x");
        // An '@' in a query without credentials masks too much, never too little.
        assert_eq!(redact("redis://h:1/0?who=a@c"), "redis://h:***@c");
        // A library quoting the part of a raw password after its '/'.
        let msg = "invalid port number in \"svc:pass\": word1@rabbit";
        let out = scrub(msg, &SecretUrl::new("amqp://svc:pass/word1@rabbit"));
        assert!(!out.contains("word1") && !out.contains("pass"), "{out}");
    }

    #[test]
    fn a_list_splits_at_each_scheme_and_joins_back() {
        let list = SecretUrl::new("amqp://a:p,w@h1:5672/%2f, amqps://b:q@h2:5671,amqp://h3");
        let parts = list.split();
        let exposed: Vec<&str> = parts.iter().map(SecretUrl::expose).collect();
        assert_eq!(
            exposed,
            [
                "amqp://a:p,w@h1:5672/%2f",
                "amqps://b:q@h2:5671",
                "amqp://h3"
            ]
        );
        assert_eq!(
            SecretUrl::join(&parts).expose(),
            "amqp://a:p,w@h1:5672/%2f,amqps://b:q@h2:5671,amqp://h3"
        );
        assert_eq!(SecretUrl::new("redis://h:1/").split().len(), 1);
        // Every password of the list is masked in its printed forms.
        let shown = format!("{list} {list:?}");
        assert!(!shown.contains("p,w") && !shown.contains(":q@"), "{shown}");
    }

    #[test]
    fn secrets_are_read_from_files_without_their_newline() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let f = dir.path().join("url");
        std::fs::write(&f, "amqp://u:p@h/%2f\n").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            read_secret_file(&f, "X_FILE").as_deref(),
            Ok("amqp://u:p@h/%2f")
        );
        std::fs::write(&f, "\n").unwrap_or_else(|e| panic!("{e}"));
        let err = read_secret_file(&f, "X_FILE")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("X_FILE") && err.contains("empty"), "{err}");
        let err = read_secret_file(&dir.path().join("none"), "Y_FILE")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("Y_FILE") && err.contains("none"), "{err}");
    }

    #[test]
    fn scrub_removes_password_from_library_messages() {
        let url = SecretUrl::new("amqp://svc:hunter2@h/%2f");
        let msg = "failed to connect to amqp://svc:hunter2@h/%2f (auth hunter2)";
        let out = scrub(msg, &url);
        assert!(!out.contains("hunter2"), "{out}");
    }
}
