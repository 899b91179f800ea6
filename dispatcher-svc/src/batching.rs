//! What the offset writer and the broker-ACK forwarder share: gathering work that arrives
//! within a short window into one request, and retrying a failed request with capped
//! exponential backoff — forever, because what they carry must not be dropped.

use std::time::Duration;

use tokio::sync::mpsc;

/// First retry delay after a failure.
pub const RETRY_FIRST: Duration = Duration::from_millis(50);
/// Longest retry delay.
pub const RETRY_MAX: Duration = Duration::from_secs(2);

/// Waits for work when `batch` is empty, then keeps collecting for `window`. Returns `false`
/// once the channel is closed and nothing is left to do.
pub async fn gather<T>(
    rx: &mut mpsc::UnboundedReceiver<T>,
    window: Duration,
    batch: &mut Vec<T>,
) -> bool {
    if batch.is_empty() {
        match rx.recv().await {
            Some(item) => batch.push(item),
            None => return false,
        }
    }
    if !window.is_zero() {
        tokio::time::sleep(window).await;
    }
    while let Ok(item) = rx.try_recv() {
        batch.push(item);
    }
    true
}

/// Capped exponential backoff.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next: RETRY_FIRST }
    }
}

impl Backoff {
    /// The delay before the next retry; each call doubles the following one.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(RETRY_MAX);
        delay
    }

    /// After a success.
    pub fn reset(&mut self) {
        self.next = RETRY_FIRST;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn gathers_a_window_and_stops_when_closed() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        tx.send(1).unwrap();
        tx.send(2).unwrap();
        let mut batch = Vec::new();
        assert!(gather(&mut rx, Duration::from_millis(1), &mut batch).await);
        assert_eq!(batch, [1, 2]);
        drop(tx);
        batch.clear();
        assert!(!gather(&mut rx, Duration::ZERO, &mut batch).await);
        let mut backoff = Backoff::default();
        let delays: Vec<_> = (0..8).map(|_| backoff.next_delay()).collect();
        assert_eq!(delays[0], RETRY_FIRST);
        assert_eq!(delays[7], RETRY_MAX);
    }
}
