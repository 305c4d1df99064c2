//! Logging set-up shared by the binaries: `tracing` to stderr, text or JSON,
//! coloured only on a terminal and never under `NO_COLOR`; while a progress
//! bar is drawn ([`logs_above`]), each log line is written above it instead
//! of through it.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use tracing_subscriber::EnvFilter;

/// How logs are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per event, for log shippers.
    Json,
}

/// Installs the global subscriber. `RUST_LOG` overrides `default_filter`.
/// Calling it twice (as in-process tests do) is harmless.
pub fn init(default_filter: &str, format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| LogWriter)
        .with_target(false)
        .with_ansi(colour(std::io::stderr().is_terminal()));
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// Whether to colour output on a stream: only a terminal, and never when
/// `NO_COLOR` is set to anything but the empty string (no-color.org).
pub fn colour(terminal: bool) -> bool {
    colour_with(terminal, std::env::var_os("NO_COLOR").as_deref())
}

fn colour_with(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Clears whatever is drawn at the bottom of the terminal, runs the write
/// it is given, and draws it again (`indicatif::ProgressBar::suspend`).
pub type Suspend = Arc<dyn Fn(&mut dyn FnMut()) + Send + Sync>;

static SUSPEND: Mutex<Option<Suspend>> = Mutex::new(None);

/// Writes log lines above a progress bar until the returned guard is
/// dropped.
pub fn logs_above(suspend: Suspend) -> LogsAbove {
    *SUSPEND.lock().unwrap_or_else(|p| p.into_inner()) = Some(suspend);
    LogsAbove(())
}

/// While alive, log lines go above the progress bar; see [`logs_above`].
#[derive(Debug)]
pub struct LogsAbove(());

impl Drop for LogsAbove {
    fn drop(&mut self) {
        *SUSPEND.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// stderr, around the progress bar when one is drawn. The formatter writes
/// each event with one `write_all`, so a line is never split by the bar.
struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let suspend = SUSPEND.lock().unwrap_or_else(|p| p.into_inner()).clone();
        match suspend {
            Some(suspend) => {
                let mut written = Ok(0);
                suspend(&mut || written = std::io::stderr().write_all(buf).map(|()| buf.len()));
                written
            }
            None => std::io::stderr().write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_and_never_under_no_color() {
        assert!(colour_with(true, None));
        assert!(colour_with(true, Some("".as_ref())));
        assert!(!colour_with(true, Some("1".as_ref())));
        assert!(!colour_with(false, None));
    }

    #[test]
    fn a_log_line_is_written_inside_the_progress_bar_suspension() {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let guard = logs_above(Arc::new({
            let calls = calls.clone();
            move |write: &mut dyn FnMut()| {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                write();
            }
        }));
        let line = b"a log line\n";
        assert_eq!(LogWriter.write(line).ok(), Some(line.len()));
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        drop(guard);
        assert_eq!(LogWriter.write(line).ok(), Some(line.len()));
        assert_eq!(
            calls.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "no bar, no suspension"
        );
    }
}
