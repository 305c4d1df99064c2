//! Logging set-up shared by the binaries: `tracing` to stderr, text or JSON.

use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `RUST_LOG` overrides `default_filter`.
/// Calling it twice (as in-process tests do) is harmless.
pub fn init(default_filter: &str, json: bool) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
