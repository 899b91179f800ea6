//! Process shutdown: one [`CancellationToken`] cancelled by SIGINT or SIGTERM.
//!
//! Services take the token and run their own ordered shutdown when it fires (stop accepting,
//! stop work, flush state), so a Kubernetes `SIGTERM` gets the same path as Ctrl-C.

pub use tokio_util::sync::CancellationToken;

/// A token cancelled on the first SIGINT or SIGTERM. A second signal is left to the default
/// handler's successor: the service is already shutting down and exits on its own.
pub fn on_signals() -> std::io::Result<CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let cancel = token.clone();
    tokio::spawn(async move {
        let which = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
        tracing::info!(signal = which, "shutdown requested");
        cancel.cancel();
    });
    Ok(token)
}
