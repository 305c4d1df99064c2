//! `[on_complete]`: what runs when the job ends — a command (no shell) with
//! its time limit, and a webhook. No secret may sit in the manifest: a URL
//! with credentials is refused in favour of `webhook_url_env` /
//! `webhook_token_env`, whose variables must be set. Running them is
//! [`crate::hooks`]' part.

use super::schema::OnCompleteSection;
use super::spec::OnComplete;
use super::Problems;
use batchfleet_shared::secret::{env_or_file, SecretUrl};

/// Checks `[on_complete]`; the webhook URL is taken from the environment
/// when `webhook_url_env` names it.
pub(super) fn check(oc: &OnCompleteSection, problems: &mut Problems) -> OnComplete {
    let command_timeout = match oc.command_timeout.as_deref().map(humantime::parse_duration) {
        None => std::time::Duration::from_secs(600),
        Some(Ok(d)) if !d.is_zero() => d,
        Some(_) => {
            problems.add(
                "[on_complete] command_timeout",
                "is not a positive duration; write e.g. \"30s\", \"10m\"".into(),
            );
            std::time::Duration::from_secs(600)
        }
    };
    let mut on_complete = OnComplete {
        command: oc.command.clone(),
        command_timeout,
        webhook: None,
        webhook_token_env: oc.webhook_token_env.clone(),
        webhook_url_env: oc.webhook_url_env.clone(),
        webhook_attempts: oc.webhook_attempts.unwrap_or(5),
    };
    if oc
        .command
        .as_ref()
        .is_some_and(|c| c.first().is_none_or(String::is_empty))
    {
        problems.add(
            "[on_complete] command",
            "must name a program, e.g. [\"./load.sh\", \"--fast\"]".into(),
        );
    }
    if !(1..=20).contains(&on_complete.webhook_attempts) {
        problems.add("[on_complete] webhook_attempts", "must be 1 to 20".into());
    }
    match (&oc.webhook, &oc.webhook_url_env) {
        (Some(_), Some(_)) => problems.add(
            "[on_complete] webhook",
            "and webhook_url_env are both set; keep one".into(),
        ),
        (Some(url), None) => match webhook_url(url) {
            Ok(u) if has_credentials(u.expose()) => problems.add(
                "[on_complete] webhook",
                "holds credentials, which never go in a manifest: put the URL in an environment variable named by webhook_url_env, or the token in one named by webhook_token_env".into(),
            ),
            Ok(u) => on_complete.webhook = Some(u),
            Err(e) => problems.add("[on_complete] webhook", e),
        },
        (None, Some(var)) => match env_or_file(var) {
            Ok(Some(url)) => match webhook_url(&url) {
                Ok(u) => on_complete.webhook = Some(u),
                Err(e) => problems.add("[on_complete] webhook_url_env", format!("${var} {e}")),
            },
            Ok(None) => problems.add(
                "[on_complete] webhook_url_env",
                format!("environment variable {var} (or {var}_FILE) is not set; export it before running the job"),
            ),
            Err(e) => problems.add("[on_complete] webhook_url_env", e.to_string()),
        },
        (None, None) => {}
    }
    if let Some(var) = &oc.webhook_token_env {
        match env_or_file(var) {
            Ok(Some(_)) => {}
            Ok(None) => problems.add(
                "[on_complete] webhook_token_env",
                format!("environment variable {var} (or {var}_FILE) is not set; export it before running the job"),
            ),
            Err(e) => problems.add("[on_complete] webhook_token_env", e.to_string()),
        }
    }
    on_complete
}

/// A webhook URL: http or https with a host. Kept secret (it may hold a token).
fn webhook_url(text: &str) -> Result<SecretUrl, String> {
    let scheme_ok = text.starts_with("http://") || text.starts_with("https://");
    let host = text
        .split_once("://")
        .map(|(_, rest)| rest.split(['/', '?', '#']).next().unwrap_or(""));
    if !scheme_ok || host.is_none_or(str::is_empty) {
        return Err("must be an http:// or https:// URL with a host".into());
    }
    Ok(SecretUrl::new(text))
}

/// Whether a URL carries `user:password@` or a token-like query.
fn has_credentials(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    authority.contains('@')
        || url.split_once('?').is_some_and(|(_, q)| {
            let q = q.to_ascii_lowercase();
            ["token", "key", "secret", "sig", "password"]
                .iter()
                .any(|k| q.contains(k))
        })
}

#[cfg(test)]
mod tests {
    use crate::manifest::testing::{problems, Fixture, GOOD};

    #[test]
    fn histogram_and_on_complete_rules_keep_secrets_out() {
        let fx = Fixture::new();
        let err = problems(fx.load(&format!(
            "{GOOD}\n[on_complete]\ncommand = []\nwebhook = \"https://u:pw@hooks.example.com/x\"\nwebhook_token_env = \"BF_SURELY_UNSET_VAR\"\n"
        )));
        assert!(
            err.contains("[on_complete] command: must name a program"),
            "{err}"
        );
        assert!(
            err.contains("[on_complete] webhook: holds credentials"),
            "{err}"
        );
        // (`pw@`, not `pw`: the temporary folder's random name may hold "pw".)
        assert!(!err.contains("pw@"), "the password is not echoed: {err}");
        assert!(
            err.contains("BF_SURELY_UNSET_VAR (or BF_SURELY_UNSET_VAR_FILE) is not set"),
            "{err}"
        );
        let err = problems(fx.load(&format!(
            "{GOOD}\n[on_complete]\nwebhook = \"https://hooks.example.com/x?token=abc\"\n"
        )));
        assert!(
            err.contains("holds credentials") && !err.contains("abc"),
            "{err}"
        );
        let err = problems(fx.load(&GOOD.replace(
            "[output]",
            "[output]\nhistogram = { min = 1.0, max = 0.0, bins = 0 }",
        )));
        assert!(err.contains("min (1) must be below max (0)"), "{err}");
        assert!(err.contains("bins must be 1 to 1000, not 0"), "{err}");
        let spec = fx
            .load(&format!(
                "{}\n[on_complete]\nwebhook = \"http://127.0.0.1:9/hook\"\n",
                GOOD.replace(
                    "[output]",
                    "[output]\nhistogram = { min = -3.0, max = 3.0, bins = 12 }"
                )
            ))
            .unwrap();
        assert_eq!(spec.task.output.histogram.bins, 12);
        assert_eq!(spec.on_complete.webhook_attempts, 5);
    }
}
