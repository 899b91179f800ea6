//! How the SDK reaches EventMesh: endpoints, identity, keepalive and retry timing.

use std::time::Duration;

use tonic::transport::Endpoint;

use crate::otel::{self, SdkChannel};

use crate::error::ClientError;

/// Settings of a [`crate::Client`].
///
/// ```
/// use std::time::Duration;
/// use eventmesh_client::ClientConfig;
///
/// let config = ClientConfig::new("orders-service-1")
///     .endpoint("http://10.0.0.5:50051")
///     .endpoint("http://10.0.0.6:50051")
///     .retry_deadline(Duration::from_secs(60));
/// assert_eq!(config.endpoints().len(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub(crate) client_id: String,
    pub(crate) endpoints: Vec<String>,
    pub(crate) keepalive_interval: Duration,
    pub(crate) keepalive_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) backoff_initial: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) retry_deadline: Duration,
}

impl ClientConfig {
    /// A client named `client_id` (ACK progress is stored per client id). Without any
    /// [`endpoint`](Self::endpoint) it talks to `http://127.0.0.1:50051`.
    pub fn new(client_id: impl Into<String>) -> Self {
        ClientConfig {
            client_id: client_id.into(),
            endpoints: Vec::new(),
            keepalive_interval: Duration::from_secs(1),
            keepalive_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            retry_deadline: Duration::from_secs(30),
        }
    }

    /// Adds a seed instance (`http://host:port`). Any live instance answers Recommend; the
    /// others are tried in order when one is down.
    pub fn endpoint(mut self, uri: impl Into<String>) -> Self {
        self.endpoints.push(uri.into());
        self
    }

    /// HTTP/2 PING interval and how long an unanswered PING may stay unanswered before the
    /// connection counts as dead (default 1 s and 2 s): a frozen instance is noticed within
    /// about three seconds, not only a closed socket.
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keepalive_interval = interval;
        self.keepalive_timeout = timeout;
        self
    }

    /// Timeout of unary requests (publish, recommend); default 10 s.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Reconnect backoff: starts at `initial`, doubles up to `max`, ±20 % jitter.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.backoff_initial = initial;
        self.backoff_max = max;
        self
    }

    /// How long a publish, or a subscription with no instance reachable, keeps retrying
    /// transient failures before giving up with [`ClientError::Unreachable`]; default 30 s.
    pub fn retry_deadline(mut self, deadline: Duration) -> Self {
        self.retry_deadline = deadline;
        self
    }

    /// The client id.
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// The configured seed endpoints (the default one when none was added).
    pub fn endpoints(&self) -> Vec<String> {
        if self.endpoints.is_empty() {
            vec![DEFAULT_ENDPOINT.to_owned()]
        } else {
            self.endpoints.clone()
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ClientError> {
        if self.client_id.is_empty() {
            return Err(ClientError::Config("client id is empty".into()));
        }
        for uri in self.endpoints() {
            self.endpoint_for(&uri)?;
        }
        Ok(())
    }

    /// A lazily connecting channel to `uri` with the keepalive settings (and the caller's
    /// trace context on every call with the `otel` feature).
    pub(crate) fn channel(&self, uri: &str) -> Result<SdkChannel, ClientError> {
        Ok(otel::traced(self.endpoint_for(uri)?.connect_lazy()))
    }

    fn endpoint_for(&self, uri: &str) -> Result<Endpoint, ClientError> {
        let uri = if uri.contains("://") {
            uri.to_owned()
        } else {
            format!("http://{uri}")
        };
        let endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|err| ClientError::Config(format!("endpoint {uri:?}: {err}")))?;
        Ok(endpoint
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(self.keepalive_interval)
            .keep_alive_timeout(self.keepalive_timeout)
            .keep_alive_while_idle(true)
            .initial_stream_window_size(Some(4 << 20))
            .initial_connection_window_size(Some(8 << 20))
            .max_frame_size(HTTP2_MAX_FRAME_SIZE))
    }
}

/// Largest HTTP/2 frame the SDK accepts, bytes (advertised to the server, which may then
/// send frames this large): a batch of deliveries in 16 KiB frames, the protocol's default,
/// costs the server a write syscall per frame, one per ~13 deliveries of 1 KiB.
pub const HTTP2_MAX_FRAME_SIZE: u32 = 1024 * 1024;

/// Where an instance started by `emctl up` (or `scripts/run.sh`) listens.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:50051";

/// Exponential backoff with ±20 % jitter.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
    initial: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn new(config: &ClientConfig) -> Self {
        Backoff {
            next: config.backoff_initial,
            initial: config.backoff_initial,
            max: config.backoff_max,
        }
    }

    /// The next wait, jittered; doubles the one after.
    pub(crate) fn next_wait(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        base.mul_f64(rand::random_range(0.8..1.2))
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_with_jitter_and_resets() {
        let config =
            ClientConfig::new("c").backoff(Duration::from_millis(100), Duration::from_millis(400));
        let mut backoff = Backoff::new(&config);
        let waits: Vec<u128> = (0..5).map(|_| backoff.next_wait().as_millis()).collect();
        for (wait, base) in waits.iter().zip([100u128, 200, 400, 400, 400]) {
            assert!(
                *wait >= base * 8 / 10 && *wait <= base * 12 / 10,
                "{waits:?}"
            );
        }
        backoff.reset();
        assert!(backoff.next_wait() <= Duration::from_millis(120));
    }

    #[test]
    fn endpoints_are_validated_and_default_to_loopback() {
        assert_eq!(ClientConfig::new("c").endpoints(), vec![DEFAULT_ENDPOINT]);
        assert!(ClientConfig::new("c").validate().is_ok());
        assert!(ClientConfig::new("").validate().is_err());
        assert!(
            ClientConfig::new("c")
                .endpoint("http://bad host:1")
                .validate()
                .is_err()
        );
        assert!(
            ClientConfig::new("c")
                .endpoint("127.0.0.1:50051")
                .validate()
                .is_ok()
        );
    }
}
