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
}

/// Replaces the password part of `scheme://user:password@host…` with `***`.
/// Also masks a password-only userinfo (`redis://:password@host`).
pub fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    let masked = match userinfo.find(':') {
        Some(colon) => format!("{}:***", &userinfo[..colon]),
        None => userinfo.to_owned(),
    };
    format!("{}{}@{}", &url[..scheme_end + 3], masked, &rest[at + 1..])
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

/// Removes every occurrence of `url`'s password from `text`, for error messages
/// produced by client libraries that may echo the URL they were given.
pub fn scrub(text: &str, url: &SecretUrl) -> String {
    let mut out = text.replace(url.expose(), &url.redacted());
    if let Some(password) = password_of(url.expose()) {
        if !password.is_empty() {
            out = out.replace(password, "***");
        }
    }
    out
}

fn password_of(url: &str) -> Option<&str> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    Some(&userinfo[userinfo.find(':')? + 1..])
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
    fn scrub_removes_password_from_library_messages() {
        let url = SecretUrl::new("amqp://svc:hunter2@h/%2f");
        let msg = "failed to connect to amqp://svc:hunter2@h/%2f (auth hunter2)";
        let out = scrub(msg, &url);
        assert!(!out.contains("hunter2"), "{out}");
    }
}
