//! The longest a call may take before its answer starts: a tower layer ([`CallLimitLayer`],
//! part of [`crate::grpc::ServerLayers`]) that answers `DEADLINE_EXCEEDED`, naming the limit,
//! when the service has not started its answer within it.
//!
//! Contract:
//! * A unary call is limited over its whole handling (its answer starts when it is complete).
//! * A streaming call is limited until its handler returns the stream: dispatcher-svc's
//!   Subscribe until the client's `open` message is read and validated — a client that opens a
//!   stream and never sends `open` holds nothing past the limit. The stream's life after that
//!   is not limited (ACK timeouts and HTTP/2 keepalive govern it).
//! * `None` (the internal services) adds no timer; a caller's shorter `grpc-timeout` applies
//!   either way (tonic answers it CANCELLED).
//! * The handler's future is dropped at the limit, so work it had not committed is not done;
//!   what it had committed (a publish already appended) stays, and the client's retry with the
//!   same event id is the at-least-once rule it already follows for lost answers.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::codegen::http;
use tower::{Layer, Service};

/// The layer (see the module doc): `limit` is the longest time to an answer, `setting` the
/// name of the setting that configures it (said in the status message).
#[derive(Debug, Clone, Copy, Default)]
pub struct CallLimitLayer {
    limit: Option<(Duration, &'static str)>,
}

impl CallLimitLayer {
    /// No limit beyond the caller's own `grpc-timeout`.
    pub fn none() -> CallLimitLayer {
        CallLimitLayer { limit: None }
    }

    /// Calls answered `DEADLINE_EXCEEDED` after `limit`; `setting` names its configuration.
    pub fn new(limit: Duration, setting: &'static str) -> CallLimitLayer {
        CallLimitLayer {
            limit: Some((limit, setting)),
        }
    }
}

impl<S> Layer<S> for CallLimitLayer {
    type Service = CallLimit<S>;

    fn layer(&self, inner: S) -> CallLimit<S> {
        CallLimit {
            inner,
            limit: self.limit,
        }
    }
}

/// The service [`CallLimitLayer`] wraps around the server's routes.
#[derive(Debug, Clone)]
pub struct CallLimit<S> {
    inner: S,
    limit: Option<(Duration, &'static str)>,
}

impl<S, RequestBody, ResponseBody> Service<http::Request<RequestBody>> for CallLimit<S>
where
    S: Service<http::Request<RequestBody>, Response = http::Response<ResponseBody>>,
    S::Future: Send + 'static,
    ResponseBody: Default + Send + 'static,
{
    type Response = http::Response<ResponseBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<RequestBody>) -> Self::Future {
        let answer = self.inner.call(request);
        let Some((limit, setting)) = self.limit else {
            return Box::pin(answer);
        };
        Box::pin(async move {
            match tokio::time::timeout(limit, answer).await {
                Ok(answer) => answer,
                Err(_) => Ok(exceeded(limit, setting).into_http()),
            }
        })
    }
}

/// The status of a call cut at the limit.
fn exceeded(limit: Duration, setting: &str) -> tonic::Status {
    tonic::Status::deadline_exceeded(format!(
        "no answer within the server's call limit of {} ms ({setting})",
        limit.as_millis()
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A service that answers after `delay`.
    #[derive(Clone)]
    struct Slow(Duration);

    impl Service<http::Request<()>> for Slow {
        type Response = http::Response<String>;
        type Error = std::convert::Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            let delay = self.0;
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                Ok(http::Response::new("answered".to_owned()))
            })
        }
    }

    fn grpc_status(response: &http::Response<String>) -> Option<tonic::Status> {
        tonic::Status::from_header_map(response.headers())
    }

    #[tokio::test]
    async fn a_late_answer_is_deadline_exceeded_naming_the_setting() {
        let layer = CallLimitLayer::new(Duration::from_millis(300), "call_limit_ms");
        let mut slow = layer.layer(Slow(Duration::from_secs(5)));
        let response = slow.call(http::Request::new(())).await.unwrap();
        let status = grpc_status(&response).unwrap();
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
        assert!(
            status.message().contains("300 ms (call_limit_ms)"),
            "{status:?}"
        );

        let mut quick = layer.layer(Slow(Duration::ZERO));
        let response = quick.call(http::Request::new(())).await.unwrap();
        assert!(grpc_status(&response).is_none());
        assert_eq!(response.body(), "answered");
    }

    #[tokio::test]
    async fn without_a_limit_nothing_is_cut() {
        let mut slow = CallLimitLayer::none().layer(Slow(Duration::from_millis(500)));
        let response = slow.call(http::Request::new(())).await.unwrap();
        assert_eq!(response.body(), "answered");
    }
}
