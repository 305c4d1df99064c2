//! SIGINT and SIGTERM turned into a [`CancellationToken`] that every task can watch.

use tokio_util::sync::CancellationToken;

/// Returns a token that is cancelled on the first SIGINT or SIGTERM.
///
/// Spot VMs and Kubernetes deliver preemption as SIGTERM; both signals mean
/// "stop taking work and drain", so they are treated alike. A second
/// SIGINT (Ctrl-C pressed again while the process drains) exits at once
/// with 130: what was not committed is redone by whoever runs it next.
pub fn on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let child = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown signal received; press Ctrl-C again to stop at once");
        child.cancel();
        second_interrupt().await;
        tracing::warn!("interrupted again: stopping at once");
        std::process::exit(130);
    });
    token
}

/// Waits for a SIGINT (forever where none can be received).
#[cfg(unix)]
async fn second_interrupt() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::interrupt()) {
        Ok(mut int) => {
            int.recv().await;
        }
        Err(_) => std::future::pending::<()>().await,
    }
}

#[cfg(not(unix))]
async fn second_interrupt() {
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(unix)]
async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot install signal handlers; shutdown only on stdin close");
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() {
    let _ = tokio::signal::ctrl_c().await;
}
