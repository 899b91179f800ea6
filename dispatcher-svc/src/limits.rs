//! Protective limits on the client port, each refused with a clear RESOURCE_EXHAUSTED:
//!
//! * open Subscribe sessions per client id (`max_sessions_per_client`, counted by the meter);
//! * open Subscribe streams per client connection (`max_streams_per_connection`, by the
//!   peer's socket address: one HTTP/2 connection) — [`ConnectionStreams`];
//! * Publish / PublishBatch calls in progress (`max_publishes_in_progress`): beyond it a call
//!   is shed at once, before any work, with `grpc-retry-pushback-ms` — [`PublishLimit`]. The
//!   SDK treats such an answer as transient and retries after the pushback, so a burst slows
//!   down instead of queueing without bound or failing.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;
use tonic::metadata::MetadataValue;

/// The metadata key gRPC uses for a server's retry pushback.
pub const RETRY_PUSHBACK_METADATA: &str = "grpc-retry-pushback-ms";
/// The pushback a shed publish carries, ms.
pub const PUBLISH_PUSHBACK_MS: u32 = 20;

/// Open Subscribe streams per client connection.
#[derive(Debug)]
pub struct ConnectionStreams {
    open: Mutex<HashMap<SocketAddr, u32>>,
    limit: u32,
}

/// One open stream of a connection; its slot frees when dropped (the session ended).
#[derive(Debug)]
pub struct StreamSlot {
    streams: Arc<ConnectionStreams>,
    peer: SocketAddr,
}

impl ConnectionStreams {
    /// At most `limit` streams per connection.
    pub fn new(limit: u32) -> Arc<Self> {
        Arc::new(ConnectionStreams {
            open: Mutex::default(),
            limit,
        })
    }

    /// Takes a slot for a new stream from `peer`, or refuses it.
    pub fn open(self: &Arc<Self>, peer: SocketAddr) -> Result<StreamSlot, Status> {
        let mut open = self.lock();
        let count = open.entry(peer).or_default();
        if *count >= self.limit {
            return Err(Status::resource_exhausted(format!(
                "this connection already has {count} open Subscribe streams (limit {}, \
                 max_streams_per_connection); close one or open another connection",
                self.limit
            )));
        }
        *count += 1;
        Ok(StreamSlot {
            streams: Arc::clone(self),
            peer,
        })
    }

    /// Connections with open streams (for tests and metrics).
    pub fn connections(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, u32>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.streams.lock();
        if let Some(count) = open.get_mut(&self.peer) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.peer);
            }
        }
    }
}

/// Publish calls in progress.
#[derive(Debug)]
pub struct PublishLimit {
    permits: Arc<Semaphore>,
    limit: u32,
}

impl PublishLimit {
    /// At most `limit` calls at once.
    pub fn new(limit: u32) -> Self {
        PublishLimit {
            permits: Arc::new(Semaphore::new(limit as usize)),
            limit,
        }
    }

    /// A permit for one call, or the shedding answer.
    pub fn try_enter(&self) -> Result<OwnedSemaphorePermit, Status> {
        Arc::clone(&self.permits).try_acquire_owned().map_err(|_| {
            metrics::counter!("dispatcher_publishes_shed_total").increment(1);
            let mut status = Status::resource_exhausted(format!(
                "overloaded: {} publish calls in progress (max_publishes_in_progress); retry after {PUBLISH_PUSHBACK_MS} ms",
                self.limit
            ));
            status.metadata_mut().insert(
                RETRY_PUSHBACK_METADATA,
                MetadataValue::from(PUBLISH_PUSHBACK_MS),
            );
            status
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_connection_gets_its_limit_and_slots_free_when_dropped() {
        let streams = ConnectionStreams::new(2);
        let a: SocketAddr = "127.0.0.1:1000".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:1001".parse().unwrap();
        let first = streams.open(a).unwrap();
        let _second = streams.open(a).unwrap();
        let refused = streams.open(a).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.message().contains("max_streams_per_connection"));
        let _other = streams.open(b).unwrap();
        drop(first);
        let _again = streams.open(a).unwrap();
        assert_eq!(streams.connections(), 2);
    }

    #[test]
    fn publishes_beyond_the_limit_are_shed_with_a_pushback() {
        let limit = PublishLimit::new(1);
        let held = limit.try_enter().unwrap();
        let shed = limit.try_enter().unwrap_err();
        assert_eq!(shed.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            shed.metadata().get(RETRY_PUSHBACK_METADATA).unwrap(),
            &PUBLISH_PUSHBACK_MS.to_string()
        );
        drop(held);
        let _again = limit.try_enter().unwrap();
    }
}
