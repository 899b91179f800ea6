//! The SDK's errors.

use std::time::Duration;

/// What can go wrong talking to EventMesh.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// A configuration value is unusable (an endpoint that is not a URI, an empty client id).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// No endpoint could be reached (every one was tried, with backoff, until the deadline).
    #[error("no EventMesh instance reachable after {waited:?}: {last}")]
    Unreachable {
        /// How long the SDK kept trying.
        waited: Duration,
        /// The last failure.
        last: String,
    },
    /// The server refused the request; the status carries the reason (for example
    /// INVALID_ARGUMENT naming the field, or RESOURCE_EXHAUSTED for an oversized event).
    #[error("{operation} refused: {} ({})", status.message(), status.code())]
    Refused {
        /// What was being done.
        operation: &'static str,
        /// The server's answer.
        status: tonic::Status,
    },
    /// The session broke before the server answered this ACK; if it was not recorded the event
    /// is delivered again.
    #[error("the session broke before the ACK was answered")]
    Interrupted,
    /// The subscription was closed (by [`crate::Subscription::close`] or by dropping it).
    #[error("subscription closed")]
    Closed,
}

impl ClientError {
    /// Whether retrying the same request later can succeed (the instance or the network failed,
    /// not the request).
    pub fn is_transient(&self) -> bool {
        match self {
            ClientError::Unreachable { .. } => true,
            ClientError::Refused { status, .. } => is_transient_status(status),
            ClientError::Interrupted => true,
            ClientError::Config(_) | ClientError::Closed => false,
        }
    }

    /// A copy of this error for each of several events it failed together.
    pub(crate) fn for_each_event(&self) -> ClientError {
        match self {
            ClientError::Config(why) => ClientError::Config(why.clone()),
            ClientError::Unreachable { waited, last } => ClientError::Unreachable {
                waited: *waited,
                last: last.clone(),
            },
            ClientError::Refused { operation, status } => ClientError::Refused {
                operation,
                status: status.clone(),
            },
            ClientError::Interrupted => ClientError::Interrupted,
            ClientError::Closed => ClientError::Closed,
        }
    }
}

/// Statuses that say "try again, maybe elsewhere" rather than "this request is wrong".
pub(crate) fn is_transient_status(status: &tonic::Status) -> bool {
    if connection_went_away(status) {
        return true;
    }
    match status.code() {
        tonic::Code::Unavailable
        | tonic::Code::Unknown
        | tonic::Code::Cancelled
        | tonic::Code::DeadlineExceeded
        | tonic::Code::Aborted => true,
        // A server shedding load says when to come back; other exhaustion (a limit the
        // caller hit) is not cured by retrying.
        tonic::Code::ResourceExhausted => status.metadata().get("grpc-retry-pushback-ms").is_some(),
        _ => false,
    }
}

/// Whether the server refused the call with a graceful HTTP/2 GOAWAY: a draining instance
/// sends GOAWAY (NO_ERROR), and a call the client opened just before it arrived was not taken
/// (RFC 9113 §6.8), so it is safe to send again. tonic reports this as INTERNAL "h2 protocol
/// error", a code that otherwise means a bug, so it is told apart by the h2 error in the
/// status's source chain. A GOAWAY with an error code, or one the client sent, is not included.
fn connection_went_away(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            return h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR);
        }
        source = error.source();
    }
    false
}
