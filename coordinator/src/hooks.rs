//! `[on_complete]`: start the next pipeline step when a job ends — a command
//! and/or a webhook POST of the summary — within what the operator allows
//! ([`HookPolicy`], the `--hook-*` flags), and record how that went in
//! `_summary.json`.
//!
//! A manifest is not trusted with the coordinator's secrets:
//! - the operator decides which hooks run at all (`--hooks all|webhook|none`);
//! - the coordinator process is not dumpable (`PR_SET_DUMPABLE` 0, set as
//!   it starts: [`harden_process`]), so a command running as the same user
//!   cannot read its memory or `/proc/<pid>/environ`, where the broker and
//!   Redis URLs it was started with are;
//! - with `--hook-user`, the command runs as another user (its own uid, gid
//!   and no supplementary groups), which cannot read the coordinator's
//!   `*_FILE` secrets or signal it at all;
//! - the command gets the job's variables and a few harmless ones
//!   ([`BASE_ENV`]) plus the operator's `--hook-env` list, not the
//!   coordinator's environment (broker and Redis URLs, AWS keys); it runs in
//!   a process group of its own, killed whole at its time limit, and at most
//!   [`OUTPUT_CAP`] bytes of its stderr are kept;
//! - the webhook's token and URL variables must be on the operator's
//!   `--hook-token-env` list; the webhook must be https (unless
//!   `--hook-allow-http`); redirects are not followed; link-local and cloud
//!   metadata addresses are refused (unless `--hook-allow-link-local`),
//!   checked on the addresses the host resolves to, which the request is
//!   then pinned to.

use crate::manifest::OnComplete;
use backon::{ExponentialBuilder, Retryable};
use batchfleet_shared::secret::SecretUrl;
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// Makes this process non-dumpable: no core dump, and no process of the
/// same user (a hook command, a job's script) may read its memory or
/// `/proc/<pid>/environ` or attach a debugger — only root can. The flag
/// is not inherited across `exec`, so the hook commands themselves stay
/// ordinary processes. A failure is logged and otherwise ignored.
pub fn harden_process() {
    #[cfg(target_os = "linux")]
    if let Err(e) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        eprintln!("warning: could not make the coordinator non-dumpable ({e}); hook commands running as its user could read its environment");
    }
}

/// Variables of the coordinator's environment every hook command gets (none
/// holds a secret); `--hook-env` adds more.
pub const BASE_ENV: &[&str] = &["PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR"];

/// Most bytes of a hook command's stderr kept (the last ones).
pub const OUTPUT_CAP: usize = 64 * 1024;

/// Which kinds of hook a coordinator runs (`--hooks`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum HookRun {
    /// Commands and webhooks.
    #[default]
    All,
    /// Webhooks only: no manifest starts a process on this machine.
    Webhook,
    /// Neither.
    None,
}

impl HookRun {
    fn flag(self) -> &'static str {
        match self {
            HookRun::All => "--hooks all",
            HookRun::Webhook => "--hooks webhook",
            HookRun::None => "--hooks none",
        }
    }
}

/// What the operator lets a manifest's `[on_complete]` do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HookPolicy {
    /// Which hooks run at all.
    pub run: HookRun,
    /// Variables passed to the command besides the job's and [`BASE_ENV`].
    pub command_env: Vec<String>,
    /// Variables a manifest may name in `webhook_token_env` and
    /// `webhook_url_env` (each also read from `<NAME>_FILE`).
    pub token_env: Vec<String>,
    /// Whether `http://` webhooks are allowed (else https only).
    pub allow_http: bool,
    /// Whether webhooks may go to link-local and cloud metadata addresses.
    pub allow_link_local: bool,
    /// The user commands run as (`--hook-user`); the coordinator's own when
    /// `None`.
    pub user: Option<HookUser>,
}

/// The user hook commands run as (`--hook-user`): its own uid and gid, no
/// supplementary groups, and its own `HOME`, `USER` and `LOGNAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookUser {
    /// Its name.
    pub name: String,
    /// Its user id.
    pub uid: u32,
    /// Its primary group id.
    pub gid: u32,
    /// Its home folder.
    pub home: std::path::PathBuf,
}

impl HookUser {
    /// Looks `spec` (a user name, or a numeric uid) up in the host's user
    /// database (NSS, so directory users too). Starting a process as
    /// another user takes root: a coordinator that is not root is refused
    /// here, as it starts, rather than when its first hook would run.
    pub fn resolve(spec: &str) -> Result<Self, String> {
        use nix::unistd::{Uid, User};
        let found = match spec.parse::<u32>() {
            Ok(uid) => User::from_uid(Uid::from_raw(uid)),
            Err(_) => User::from_name(spec),
        }
        .map_err(|e| format!("--hook-user {spec}: cannot look the user up ({e})"))?
        .ok_or_else(|| {
            format!("--hook-user {spec}: no such user on this host; name an existing user (for example one made for hooks: `useradd --system batchfleet-hooks`)")
        })?;
        let me = rustix::process::geteuid();
        if !me.is_root() && me.as_raw() != found.uid.as_raw() {
            return Err(format!(
                "--hook-user {spec}: starting hook commands as another user needs the coordinator to run as root (it runs as uid {}); run it as root, or leave --hook-user out (commands then run as the coordinator's user, which cannot read its memory or environment: it is not dumpable)",
                me.as_raw()
            ));
        }
        Ok(Self {
            name: found.name,
            uid: found.uid.as_raw(),
            gid: found.gid.as_raw(),
            home: found.dir,
        })
    }
}

impl HookPolicy {
    /// What `hooks` asks that this policy does not allow, as `(field,
    /// message)`: checked when a job is submitted, so a refused manifest
    /// publishes nothing, and again before the hooks run.
    pub fn problems(&self, hooks: &OnComplete) -> Vec<(&'static str, String)> {
        let mut out: Vec<_> = self.command_refused(hooks).into_iter().collect();
        out.extend(self.webhook_problems(hooks));
        out
    }

    /// Why the manifest's command may not run here, if it may not.
    fn command_refused(&self, hooks: &OnComplete) -> Option<(&'static str, String)> {
        (hooks.command.is_some() && self.run != HookRun::All).then(|| {
            (
                "[on_complete] command",
                format!(
                    "is not run by this coordinator ({}, BATCHFLEET_HOOKS): its operator runs no hook commands; remove the command (a webhook may do){}",
                    self.run.flag(),
                    if self.run == HookRun::Webhook { "" } else { ", or ask for --hooks all" }
                ),
            )
        })
    }

    /// What of the manifest's webhook this policy does not allow.
    fn webhook_problems(&self, hooks: &OnComplete) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if hooks.webhook.is_some() && self.run == HookRun::None {
            out.push((
                "[on_complete] webhook",
                "is not sent by this coordinator (--hooks none, BATCHFLEET_HOOKS): its operator runs no hooks; remove [on_complete], or ask for --hooks webhook".to_owned(),
            ));
            return out;
        }
        for (field, var) in [
            ("[on_complete] webhook_token_env", &hooks.webhook_token_env),
            ("[on_complete] webhook_url_env", &hooks.webhook_url_env),
        ] {
            if let Some(var) = var
                .as_deref()
                .filter(|v| !self.token_env.iter().any(|a| a == v))
            {
                out.push((
                    field,
                    format!(
                        "{var} is not a variable the operator lets hooks use; ask for it to be added to --hook-token-env (BATCHFLEET_HOOK_TOKEN_ENV){}",
                        if self.token_env.is_empty() {
                            ", which is empty".to_owned()
                        } else {
                            format!(", which allows {}", self.token_env.join(", "))
                        }
                    ),
                ));
            }
        }
        if let Some(url) = &hooks.webhook {
            if let Err(why) = self.check_url(url.expose()) {
                out.push(("[on_complete] webhook", why));
            }
        }
        out
    }

    /// Scheme and literal host of a webhook URL under this policy.
    fn check_url(&self, url: &str) -> Result<(), String> {
        let parsed = reqwest::Url::parse(url).map_err(|e| format!("is not a URL ({e})"))?;
        match parsed.scheme() {
            "https" => {}
            "http" if self.allow_http => {}
            "http" => {
                return Err(format!(
                    "{} is http://: webhooks must use https:// (the summary and the token would cross the network in clear), unless the operator passes --hook-allow-http (BATCHFLEET_HOOK_ALLOW_HTTP)",
                    origin(url)
                ))
            }
            other => return Err(format!("has scheme {other}; use https://")),
        }
        if self.allow_link_local {
            return Ok(());
        }
        let refused = match host_of(&parsed) {
            Some(Host::Ip(ip)) => forbidden(ip),
            Some(Host::Name(name)) => METADATA_HOSTS
                .iter()
                .any(|m| name.eq_ignore_ascii_case(m))
                .then_some("a cloud metadata service"),
            None => return Err("has no host".into()),
        };
        match refused {
            Some(what) => Err(format!(
                "{} is {what}, which webhooks may not reach unless the operator passes --hook-allow-link-local (BATCHFLEET_HOOK_ALLOW_LINK_LOCAL)",
                origin(url)
            )),
            None => Ok(()),
        }
    }

    /// The command's environment: [`BASE_ENV`] and `--hook-env` variables
    /// taken from `parent`, nothing else.
    pub fn command_env<I, K, V>(&self, parent: I) -> Vec<(std::ffi::OsString, std::ffi::OsString)>
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<std::ffi::OsString>,
        V: Into<std::ffi::OsString>,
    {
        parent
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .filter(|(k, _)| {
                k.to_str().is_some_and(|k| {
                    BASE_ENV.contains(&k) || self.command_env.iter().any(|a| a == k)
                })
            })
            .collect()
    }
}

/// A URL's host: an address, or a name to resolve.
enum Host<'a> {
    Ip(IpAddr),
    Name(&'a str),
}

fn host_of(url: &reqwest::Url) -> Option<Host<'_>> {
    let host = url.host_str()?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    Some(match bare.parse() {
        Ok(ip) => Host::Ip(ip),
        Err(_) => Host::Name(host),
    })
}

/// Host names of cloud metadata services (Google's; AWS, Azure and others
/// answer on link-local addresses, refused by [`forbidden`]).
const METADATA_HOSTS: &[&str] = &["metadata.google.internal", "metadata", "metadata.goog"];

/// Why a webhook may not reach `ip`: link-local (where cloud metadata
/// services answer) or a metadata address outside that range.
fn forbidden(ip: IpAddr) -> Option<&'static str> {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    match ip {
        IpAddr::V4(v4) if v4.is_link_local() => {
            Some("a link-local address (where cloud metadata services answer)")
        }
        // Alibaba Cloud's metadata service.
        IpAddr::V4(v4) if v4.octets() == [100, 100, 100, 200] => Some("a cloud metadata service"),
        IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80 => {
            Some("a link-local address (where cloud metadata services answer)")
        }
        // AWS's IPv6 instance metadata endpoint.
        IpAddr::V6(v6) if v6.segments() == [0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254] => {
            Some("a cloud metadata service")
        }
        _ => None,
    }
}

/// What the hooks did, as recorded in `_summary.json`.
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
    /// `succeeded`, `failed`, `timed_out`, `not_started`, or `refused`
    /// (this coordinator runs no hook commands: `--hooks`).
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
    /// `delivered`, `failed`, or `refused` (the operator's policy did not
    /// allow it; nothing was sent).
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

/// Runs the hooks of a finished job. `summary` is the path of `_summary.json`,
/// `body` its contents, `cwd` the manifest's folder.
pub async fn run(
    hooks: &OnComplete,
    policy: &HookPolicy,
    job_id: &str,
    status: &str,
    summary: &Path,
    body: &[u8],
    cwd: &Path,
) -> HookOutcome {
    let mut outcome = HookOutcome::default();
    if let Some(cmd) = &hooks.command {
        let job_env = [
            ("BATCHFLEET_SUMMARY", summary.as_os_str()),
            ("BATCHFLEET_JOB_ID", job_id.as_ref()),
            ("BATCHFLEET_JOB_STATUS", status.as_ref()),
            (
                "BATCHFLEET_OUTPUT_DIR",
                summary.parent().unwrap_or(Path::new(".")).as_os_str(),
            ),
        ];
        // Checked at submission; checked again here, since whoever reduces
        // the job (a `supervise` elsewhere) may allow less.
        outcome.command = Some(match policy.command_refused(hooks) {
            Some((field, why)) => {
                tracing::error!(command = %cmd[0], "on_complete command not run: {field} {why}");
                CommandOutcome {
                    status: "refused".into(),
                    exit_code: None,
                    duration_s: 0.0,
                    error: Some(format!("{field} {why}")),
                }
            }
            None => {
                let mut env = policy.command_env(std::env::vars_os());
                env.extend(job_env.iter().map(|(k, v)| ((*k).into(), (*v).to_owned())));
                if let Some(user) = &policy.user {
                    env.retain(|(k, _)| {
                        !["HOME", "USER", "LOGNAME"].contains(&k.to_str().unwrap_or(""))
                    });
                    env.push(("HOME".into(), user.home.clone().into()));
                    env.push(("USER".into(), user.name.clone().into()));
                    env.push(("LOGNAME".into(), user.name.clone().into()));
                }
                run_command(cmd, hooks.command_timeout, &env, cwd, policy.user.as_ref()).await
            }
        });
    }
    if let Some(url) = &hooks.webhook {
        let target = origin(url.expose());
        let refused = |why: String| WebhookOutcome {
            status: "refused".into(),
            attempts: 0,
            http_status: None,
            target: target.clone(),
            error: Some(why),
        };
        // Checked at submission; checked again here, since whoever reduces
        // the job (a `supervise` elsewhere) may allow less.
        outcome.webhook = Some(match policy.webhook_problems(hooks).into_iter().next() {
            Some((field, why)) => {
                tracing::error!(%target, "webhook not sent: {field} {why}");
                refused(format!("{field} {why}"))
            }
            None => match token(hooks) {
                Ok(token) => post(url, policy, token, body, hooks.webhook_attempts).await,
                Err(why) => refused(why),
            },
        });
    }
    outcome
}

/// The bearer token, from `webhook_token_env` (or its `_FILE`), read now.
fn token(hooks: &OnComplete) -> Result<Option<String>, String> {
    let Some(var) = &hooks.webhook_token_env else {
        return Ok(None);
    };
    match batchfleet_shared::secret::env_or_file(var) {
        Ok(Some(t)) => Ok(Some(t)),
        Ok(None) => Err(format!("{var} (webhook_token_env) is not set")),
        Err(e) => Err(e.to_string()),
    }
}

async fn run_command(
    cmd: &[String],
    timeout: Duration,
    env: &[(std::ffi::OsString, std::ffi::OsString)],
    cwd: &Path,
    user: Option<&HookUser>,
) -> CommandOutcome {
    let started = Instant::now();
    let mut command = tokio::process::Command::new(&cmd[0]);
    if let Some(u) = user {
        // Set with a uid, the standard library also drops the
        // supplementary groups (setgroups(0)) before setuid.
        command.uid(u.uid).gid(u.gid);
    }
    let child = command
        .args(&cmd[1..])
        .current_dir(cwd)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::inherit())
        .stderr(std::process::Stdio::piped())
        // A group of its own, so whatever it starts is killed with it.
        .process_group(0)
        .kill_on_drop(true)
        .spawn();
    let mut child = match child {
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
    let group = child
        .id()
        .and_then(|id| rustix::process::Pid::from_raw(id as i32));
    let kept = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tail = tokio::spawn({
        let (stderr, kept) = (child.stderr.take(), kept.clone());
        async move {
            if let Some(s) = stderr {
                read_tail(s, OUTPUT_CAP, &kept).await;
            }
        }
    });
    let waited = tokio::time::timeout(timeout, child.wait()).await;
    let duration_s = started.elapsed().as_secs_f64();
    let kill_group = || {
        if let Some(pgid) = group {
            // ESRCH only means every member is gone already.
            let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
        }
    };
    match waited {
        Ok(Ok(status)) => {
            // Something the command left running may hold stderr open: its
            // output so far is enough.
            if tokio::time::timeout(Duration::from_secs(1), &mut tail)
                .await
                .is_err()
            {
                tail.abort();
            }
            let err_tail = std::mem::take(&mut *kept.lock().unwrap_or_else(|p| p.into_inner()));
            let last = String::from_utf8_lossy(&err_tail)
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(str::to_owned);
            let ok = status.success();
            if ok {
                tracing::info!(command = %cmd[0], duration_s, "on_complete command succeeded");
            } else {
                tracing::error!(command = %cmd[0], code = ?status.code(), "on_complete command failed");
            }
            CommandOutcome {
                status: if ok { "succeeded" } else { "failed" }.into(),
                exit_code: status.code(),
                duration_s,
                error: if ok { None } else { last },
            }
        }
        Ok(Err(e)) => {
            kill_group();
            tail.abort();
            CommandOutcome {
                status: "failed".into(),
                exit_code: None,
                duration_s,
                error: Some(e.to_string()),
            }
        }
        Err(_) => {
            kill_group();
            let _ = child.wait().await;
            tail.abort();
            tracing::error!(command = %cmd[0], timeout_s = timeout.as_secs(), "on_complete command timed out; its process group was killed");
            CommandOutcome {
                status: "timed_out".into(),
                exit_code: None,
                duration_s,
                error: Some(format!(
                    "still running after {}s; it and every process it started were killed",
                    timeout.as_secs()
                )),
            }
        }
    }
}

/// Reads a stream to its end into `kept`, which holds only its last `cap`
/// bytes at every moment (so what was read is there if the reading stops
/// early).
async fn read_tail(
    mut r: impl tokio::io::AsyncRead + Unpin,
    cap: usize,
    kept: &std::sync::Mutex<Vec<u8>>,
) {
    let mut buf = vec![0u8; 8192];
    while let Ok(n) = r.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.extend_from_slice(&buf[..n]);
        if kept.len() > cap {
            let extra = kept.len() - cap;
            kept.drain(..extra);
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

/// One failed delivery attempt: what went wrong and whether another may help.
#[derive(Debug)]
struct Failed {
    status: Option<u16>,
    error: String,
    retry: bool,
}

/// POSTs `body` (capped exponential backoff with jitter, by `backon`): 2xx
/// is delivered; a redirect and 4xx (but 408 and 429) are final; anything
/// else is retried. The host's addresses are resolved and checked once,
/// and every attempt goes to them.
async fn post(
    url: &SecretUrl,
    policy: &HookPolicy,
    token: Option<String>,
    body: &[u8],
    attempts: u32,
) -> WebhookOutcome {
    let target = origin(url.expose());
    let failed = |attempts: u32, status: Option<u16>, error: String| {
        tracing::warn!(%target, attempts, error = %error, "webhook delivery failed");
        WebhookOutcome {
            status: "failed".into(),
            attempts,
            http_status: status,
            target: target.clone(),
            error: Some(error),
        }
    };
    let client = match client(url, policy).await {
        Ok(c) => c,
        Err(NoClient::Failed(e)) => return failed(0, None, e),
        Err(NoClient::Refused(e)) => {
            tracing::error!(%target, "webhook not sent: {e}");
            return WebhookOutcome {
                status: "refused".into(),
                attempts: 0,
                http_status: None,
                target,
                error: Some(e),
            };
        }
    };
    let tries = AtomicU32::new(0);
    let attempt = || async {
        tries.fetch_add(1, Ordering::Relaxed);
        let mut req = client
            .post(url.expose())
            .header("Content-Type", "application/json")
            .body(body.to_vec());
        if let Some(t) = &token {
            req = req.bearer_auth(t);
        }
        match req.send().await {
            Ok(resp) => {
                let code = resp.status().as_u16();
                if resp.status().is_success() {
                    Ok(code)
                } else if resp.status().is_redirection() {
                    Err(Failed {
                        status: Some(code),
                        error: format!("HTTP {code}: a redirect, which webhooks do not follow; give the final URL"),
                        retry: false,
                    })
                } else {
                    Err(Failed {
                        status: Some(code),
                        error: format!("HTTP {code}"),
                        retry: !(400..500).contains(&code) || code == 408 || code == 429,
                    })
                }
            }
            Err(e) => Err(Failed {
                status: None,
                error: batchfleet_shared::secret::scrub(&error_chain(&e.without_url()), url),
                retry: true,
            }),
        }
    };
    let backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(30))
        .with_max_times(attempts.max(1) as usize - 1)
        .with_jitter();
    let result = attempt
        .retry(backoff)
        .when(|f: &Failed| f.retry)
        .notify(|f: &Failed, wait| tracing::warn!(%target, error = %f.error, retry_in_ms = wait.as_millis() as u64, "webhook delivery failed; retrying"))
        .await;
    let made = tries.load(Ordering::Relaxed);
    match result {
        Ok(code) => {
            tracing::info!(%target, attempts = made, code, "summary delivered to the webhook");
            WebhookOutcome {
                status: "delivered".into(),
                attempts: made,
                http_status: Some(code),
                target,
                error: None,
            }
        }
        Err(f) => failed(made, f.status, f.error),
    }
}

/// Why a webhook gets no client.
enum NoClient {
    /// The policy forbids where its host resolves to.
    Refused(String),
    /// The URL, the name lookup or the client failed.
    Failed(String),
}

/// An HTTP client for one webhook: the system's CA store, no redirects, 30 s
/// per request, pinned to the host's addresses once they passed the policy.
async fn client(url: &SecretUrl, policy: &HookPolicy) -> Result<reqwest::Client, NoClient> {
    // rustls runs on the process-wide provider: ring, as everywhere in
    // batchfleet (an error only means one is installed already).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let parsed = reqwest::Url::parse(url.expose())
        .map_err(|e| NoClient::Failed(format!("invalid URL: {e}")))?;
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .user_agent(concat!("batchfleet/", env!("CARGO_PKG_VERSION")));
    if let Some(Host::Name(name)) = host_of(&parsed) {
        let port = parsed.port_or_known_default().unwrap_or(443);
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((name, port))
            .await
            .map_err(|e| NoClient::Failed(format!("cannot resolve {name}: {e}")))?
            .collect();
        if !policy.allow_link_local {
            if let Some((ip, what)) = addrs
                .iter()
                .find_map(|a| forbidden(a.ip()).map(|w| (a.ip(), w)))
            {
                return Err(NoClient::Refused(format!(
                    "{name} resolves to {ip}, {what}, which webhooks may not reach unless the operator passes --hook-allow-link-local"
                )));
            }
        }
        builder = builder.resolve_to_addrs(name, &addrs);
    }
    builder
        .build()
        .map_err(|e| NoClient::Failed(error_chain(&e)))
}

/// An error with its causes, `a: b: c` (reqwest's own text is only the outermost).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
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

    fn hooks(webhook: &str, token_env: Option<&str>) -> OnComplete {
        OnComplete {
            webhook: Some(SecretUrl::new(webhook)),
            webhook_token_env: token_env.map(str::to_owned),
            ..OnComplete::default()
        }
    }

    #[test]
    fn the_policy_allows_https_to_ordinary_hosts_and_allowlisted_variables_only() {
        let strict = HookPolicy {
            token_env: vec!["HOOK_TOKEN".into()],
            ..HookPolicy::default()
        };
        assert!(strict
            .problems(&hooks("https://hooks.example.com/x", Some("HOOK_TOKEN")))
            .is_empty());
        // Private and loopback addresses are ordinary internal services.
        assert!(strict
            .problems(&hooks("https://10.1.2.3/x", None))
            .is_empty());
        let p = strict.problems(&hooks(
            "https://hooks.example.com/x",
            Some("AWS_SECRET_ACCESS_KEY"),
        ));
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].0, "[on_complete] webhook_token_env");
        assert!(
            p[0].1.contains("AWS_SECRET_ACCESS_KEY")
                && p[0].1.contains("--hook-token-env")
                && p[0].1.contains("HOOK_TOKEN"),
            "{}",
            p[0].1
        );
        let http = strict.problems(&hooks("http://hooks.example.com/x", None));
        assert!(http[0].1.contains("--hook-allow-http"), "{:?}", http);
        for link_local in [
            "https://169.254.169.254/latest/meta-data",
            "https://[fe80::1]/x",
            "https://[fd00:ec2::254]/x",
            "https://metadata.google.internal/computeMetadata/v1/",
            "https://[::ffff:169.254.169.254]/",
        ] {
            let p = strict.problems(&hooks(link_local, None));
            assert!(
                p.len() == 1 && p[0].1.contains("--hook-allow-link-local"),
                "{link_local}: {p:?}"
            );
        }
        let lax = HookPolicy {
            allow_http: true,
            allow_link_local: true,
            ..HookPolicy::default()
        };
        assert!(lax
            .problems(&hooks("http://169.254.169.254/x", None))
            .is_empty());
        let mut url_env = hooks("https://hooks.example.com/x", None);
        url_env.webhook_url_env = Some("DATABASE_URL".into());
        assert_eq!(lax.problems(&url_env)[0].0, "[on_complete] webhook_url_env");
    }

    #[test]
    fn the_operator_decides_which_kinds_of_hook_run() {
        let both = OnComplete {
            command: Some(vec!["true".into()]),
            ..hooks("https://hooks.example.com/x", None)
        };
        assert!(HookPolicy::default().problems(&both).is_empty());
        let webhook_only = HookPolicy {
            run: HookRun::Webhook,
            ..HookPolicy::default()
        };
        let p = webhook_only.problems(&both);
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].0, "[on_complete] command");
        assert!(p[0].1.contains("--hooks webhook"), "{}", p[0].1);
        // The webhook alone still goes.
        assert!(webhook_only.webhook_problems(&both).is_empty());
        let none = HookPolicy {
            run: HookRun::None,
            ..HookPolicy::default()
        };
        let fields: Vec<_> = none.problems(&both).into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["[on_complete] command", "[on_complete] webhook"]);
    }

    #[tokio::test]
    async fn a_refused_command_is_not_run_and_the_summary_says_why() {
        let dir = tempfile::tempdir().expect("tmp");
        let marker = dir.path().join("ran");
        let hooks = OnComplete {
            command: Some(vec![
                "sh".into(),
                "-c".into(),
                format!("touch {}", marker.display()),
            ]),
            command_timeout: Duration::from_secs(60),
            ..OnComplete::default()
        };
        let policy = HookPolicy {
            run: HookRun::Webhook,
            ..HookPolicy::default()
        };
        let summary = dir.path().join("_summary.json");
        let outcome = run(
            &hooks,
            &policy,
            "j",
            "completed",
            &summary,
            b"{}",
            dir.path(),
        )
        .await;
        let command = outcome.command.expect("an outcome for the command");
        assert_eq!(command.status, "refused");
        assert!(command
            .error
            .unwrap_or_default()
            .contains("--hooks webhook"));
        assert!(!marker.exists(), "the refused command ran");
        let ran = run(
            &hooks,
            &HookPolicy::default(),
            "j",
            "completed",
            &summary,
            b"{}",
            dir.path(),
        )
        .await;
        assert_eq!(ran.command.expect("ran").status, "succeeded");
        assert!(marker.exists());
    }

    #[test]
    fn the_command_gets_the_base_variables_and_the_allowlist_only() {
        let policy = HookPolicy {
            command_env: vec!["WAREHOUSE_DSN".into()],
            ..HookPolicy::default()
        };
        let parent = [
            ("PATH", "/usr/bin"),
            ("BATCHFLEET_AMQP_URL", "amqp://u:secret@h"),
            ("AWS_SECRET_ACCESS_KEY", "k"),
            ("WAREHOUSE_DSN", "dsn"),
            ("HOME", "/root"),
        ];
        let mut names: Vec<String> = policy
            .command_env(parent)
            .into_iter()
            .filter_map(|(k, _)| k.into_string().ok())
            .collect();
        names.sort();
        assert_eq!(names, ["HOME", "PATH", "WAREHOUSE_DSN"]);
    }

    #[tokio::test]
    async fn only_the_last_bytes_of_a_long_output_are_kept() {
        let text: Vec<u8> = (0..1_000_000u32)
            .flat_map(|i| format!("{i}\n").into_bytes())
            .collect();
        let kept = std::sync::Mutex::new(Vec::new());
        read_tail(&text[..], 1000, &kept).await;
        let kept = kept.into_inner().unwrap_or_default();
        assert_eq!(kept.len(), 1000);
        assert!(text.ends_with(&kept));
    }
}
