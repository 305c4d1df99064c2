//! `[on_complete]`: start the next pipeline step when a job ends — a command
//! and/or a webhook POST of the summary — and record how that went in
//! `summary.json`.

use crate::manifest::OnComplete;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{Duration, Instant};

/// What the hooks did, as recorded in `summary.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HookOutcome {
    /// The command, if one is configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command: Option<CommandOutcome>,
    /// The webhook, if one is configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookOutcome>,
}

/// How the command ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandOutcome {
    /// `succeeded`, `failed`, `timed_out` or `not_started`.
    pub status: String,
    /// Its exit code, when it exited.
    pub exit_code: Option<i32>,
    /// Wall time (s).
    pub duration_s: f64,
    /// Why it failed (for `not_started`), or the last line it wrote to stderr.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How the webhook delivery ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WebhookOutcome {
    /// `delivered` or `failed`.
    pub status: String,
    /// Attempts made.
    pub attempts: u32,
    /// HTTP status of the last answer, if any.
    pub http_status: Option<u16>,
    /// The host it went to (never the path or query, which may hold a token).
    pub target: String,
    /// The last error, if it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Runs the hooks of a finished job. `summary` is the path of `summary.json`,
/// `body` its contents, `cwd` the manifest's folder.
pub async fn run(
    hooks: &OnComplete,
    job_id: &str,
    status: &str,
    summary: &Path,
    body: &[u8],
    cwd: &Path,
) -> HookOutcome {
    let mut outcome = HookOutcome::default();
    if let Some(cmd) = &hooks.command {
        outcome.command =
            Some(run_command(cmd, hooks.command_timeout, job_id, status, summary, cwd).await);
    }
    if let Some(url) = &hooks.webhook {
        let token = hooks
            .webhook_token_env
            .as_ref()
            .and_then(|v| std::env::var(v).ok());
        outcome.webhook = Some(post(url, token, body, hooks.webhook_attempts).await);
    }
    outcome
}

async fn run_command(
    cmd: &[String],
    timeout: Duration,
    job_id: &str,
    status: &str,
    summary: &Path,
    cwd: &Path,
) -> CommandOutcome {
    let started = Instant::now();
    let out_dir = summary.parent().unwrap_or(Path::new("."));
    let child = tokio::process::Command::new(&cmd[0])
        .args(&cmd[1..])
        .current_dir(cwd)
        .env("BATCHFLEET_SUMMARY", summary)
        .env("BATCHFLEET_JOB_ID", job_id)
        .env("BATCHFLEET_JOB_STATUS", status)
        .env("BATCHFLEET_OUTPUT_DIR", out_dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::inherit())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(command = %cmd[0], error = %e, "on_complete command could not start");
            return CommandOutcome {
                status: "not_started".into(),
                exit_code: None,
                duration_s: 0.0,
                error: Some(format!("cannot start {}: {e}", cmd[0])),
            };
        }
    };
    let result = tokio::time::timeout(timeout, child.wait_with_output()).await;
    let duration_s = started.elapsed().as_secs_f64();
    match result {
        Ok(Ok(out)) => {
            let last = String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .map(str::to_owned);
            let ok = out.status.success();
            if ok {
                tracing::info!(command = %cmd[0], duration_s, "on_complete command succeeded");
            } else {
                tracing::error!(command = %cmd[0], code = ?out.status.code(), "on_complete command failed");
            }
            CommandOutcome {
                status: if ok { "succeeded" } else { "failed" }.into(),
                exit_code: out.status.code(),
                duration_s,
                error: if ok { None } else { last },
            }
        }
        Ok(Err(e)) => CommandOutcome {
            status: "failed".into(),
            exit_code: None,
            duration_s,
            error: Some(e.to_string()),
        },
        Err(_) => {
            tracing::error!(command = %cmd[0], timeout_s = timeout.as_secs(), "on_complete command timed out; killed");
            CommandOutcome {
                status: "timed_out".into(),
                exit_code: None,
                duration_s,
                error: Some(format!(
                    "still running after {}s; killed",
                    timeout.as_secs()
                )),
            }
        }
    }
}

/// `scheme://host[:port]` of a URL: what may be shown of a webhook.
pub fn origin(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "(invalid url)".into();
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit('@').next().unwrap_or(authority);
    format!("{scheme}://{host}")
}

/// POSTs `body` with capped exponential backoff and jitter: 2xx is delivered,
/// 4xx (but 408 and 429) is final, anything else is retried.
async fn post(
    url: &batchfleet_shared::secret::SecretUrl,
    token: Option<String>,
    body: &[u8],
    attempts: u32,
) -> WebhookOutcome {
    let target = origin(url.expose());
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build();
    let mut delay = Duration::from_millis(500);
    let mut last_status = None;
    let mut last_error = None;
    for attempt in 1..=attempts.max(1) {
        let (agent, url, token, body) = (
            agent.clone(),
            url.expose().to_owned(),
            token.clone(),
            body.to_vec(),
        );
        let answer = tokio::task::spawn_blocking(move || {
            let mut req = agent
                .post(&url)
                .set("Content-Type", "application/json")
                .set(
                    "User-Agent",
                    concat!("batchfleet/", env!("CARGO_PKG_VERSION")),
                );
            if let Some(t) = token {
                req = req.set("Authorization", &format!("Bearer {t}"));
            }
            match req.send_bytes(&body) {
                Ok(resp) => Ok(resp.status()),
                Err(ureq::Error::Status(code, _)) => Ok(code),
                // The transport error text may quote the URL: keep only its kind.
                Err(ureq::Error::Transport(t)) => Err(format!("{:?}", t.kind())),
            }
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        let retry = match answer {
            Ok(code) if (200..300).contains(&code) => {
                tracing::info!(%target, attempt, code, "summary delivered to the webhook");
                return WebhookOutcome {
                    status: "delivered".into(),
                    attempts: attempt,
                    http_status: Some(code),
                    target,
                    error: None,
                };
            }
            Ok(code) => {
                last_status = Some(code);
                last_error = Some(format!("HTTP {code}"));
                !(400..500).contains(&code) || code == 408 || code == 429
            }
            Err(e) => {
                last_error = Some(e);
                true
            }
        };
        tracing::warn!(%target, attempt, error = ?last_error, "webhook delivery failed");
        if !retry || attempt == attempts {
            return WebhookOutcome {
                status: "failed".into(),
                attempts: attempt,
                http_status: last_status,
                target,
                error: last_error,
            };
        }
        let jitter = 0.5 + fastrand::f64() / 2.0;
        tokio::time::sleep(delay.mul_f64(jitter)).await;
        delay = (delay * 2).min(Duration::from_secs(30));
    }
    WebhookOutcome {
        status: "failed".into(),
        attempts,
        http_status: last_status,
        target,
        error: last_error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origin_shows_no_path_query_or_credentials() {
        assert_eq!(
            origin("https://u:p@hooks.example.com:8443/T0/B1/secret?token=x"),
            "https://hooks.example.com:8443"
        );
        assert_eq!(origin("http://127.0.0.1:9/x"), "http://127.0.0.1:9");
    }
}
