//! gRPC server metrics for every service, as one tower layer ([`GrpcMetricsLayer`], installed
//! by [`crate::grpc::server_builder`]):
//!
//! * `grpc_server_handled_total{grpc_service,grpc_method,grpc_code}` — calls finished, by
//!   status code (`Ok`, `InvalidArgument`, `Unavailable`, … as tonic names them);
//! * `grpc_server_handling_seconds{grpc_service,grpc_method}` — from the request to the call's
//!   status (for a stream: its whole life).
//!
//! The status is read where gRPC puts it: the response headers of a trailers-only answer (an
//! error before any message), else the trailers at the end of the body. A call whose client
//! went away before the status counts as `Cancelled`. Calls to methods no service has
//! (answered `Unimplemented`) are counted under `(unknown)` so that clients cannot grow the
//! label set with made-up paths.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use http_body::{Body, Frame, SizeHint};
use tonic::Code;
use tonic::codegen::http;
use tower::{Layer, Service};

/// The layer (see the module doc).
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcMetricsLayer;

impl<S> Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetrics<S>;

    fn layer(&self, inner: S) -> GrpcMetrics<S> {
        GrpcMetrics { inner }
    }
}

/// The service [`GrpcMetricsLayer`] wraps around the server's routes.
#[derive(Debug, Clone)]
pub struct GrpcMetrics<S> {
    inner: S,
}

impl<S, RequestBody, ResponseBody> Service<http::Request<RequestBody>> for GrpcMetrics<S>
where
    S: Service<http::Request<RequestBody>, Response = http::Response<ResponseBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResponseBody: Body + Unpin,
{
    type Response = http::Response<MeteredBody<ResponseBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<RequestBody>) -> Self::Future {
        let call = Call::new(request.uri().path());
        let answer = self.inner.call(request);
        Box::pin(async move {
            match answer.await {
                Ok(response) => {
                    let (parts, body) = response.into_parts();
                    let mut call = Some(call);
                    // Trailers-only: the status is in the headers and the body ends empty.
                    if let Some(code) = status_of(&parts.headers)
                        && let Some(call) = call.take()
                    {
                        call.finish(code);
                    }
                    Ok(http::Response::from_parts(
                        parts,
                        MeteredBody { inner: body, call },
                    ))
                }
                Err(err) => {
                    call.finish(Code::Unknown);
                    Err(err)
                }
            }
        })
    }
}

/// A response body that records its call when the status goes by (or when it is dropped
/// before: the client went away).
pub struct MeteredBody<B> {
    inner: B,
    call: Option<Call>,
}

impl<B: Body + Unpin> Body for MeteredBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let code = match &polled {
            Poll::Ready(Some(Ok(frame))) => frame
                .trailers_ref()
                .map(|trailers| status_of(trailers).unwrap_or(Code::Unknown)),
            Poll::Ready(Some(Err(_))) => Some(Code::Unknown),
            // gRPC always ends with a status; a body that ends without one did not finish.
            Poll::Ready(None) => Some(Code::Unknown),
            Poll::Pending => None,
        };
        if let Some(code) = code
            && let Some(call) = this.call.take()
        {
            call.finish(code);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for MeteredBody<B> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            call.finish(Code::Cancelled);
        }
    }
}

/// One call being measured.
struct Call {
    service: String,
    method: String,
    started: Instant,
}

impl Call {
    /// A call of `path` (`/package.Service/Method`).
    fn new(path: &str) -> Self {
        let (service, method) = path
            .trim_start_matches('/')
            .split_once('/')
            .unwrap_or((path, ""));
        Call {
            service: service.to_owned(),
            method: method.to_owned(),
            started: Instant::now(),
        }
    }

    fn finish(self, code: Code) {
        let (service, method) = if code == Code::Unimplemented {
            (UNKNOWN.to_owned(), UNKNOWN.to_owned())
        } else {
            (self.service, self.method)
        };
        metrics::histogram!(
            "grpc_server_handling_seconds",
            "grpc_service" => service.clone(),
            "grpc_method" => method.clone()
        )
        .record(self.started.elapsed().as_secs_f64());
        metrics::counter!(
            "grpc_server_handled_total",
            "grpc_service" => service,
            "grpc_method" => method,
            "grpc_code" => format!("{code:?}")
        )
        .increment(1);
    }
}

/// The label of calls to methods that do not exist.
const UNKNOWN: &str = "(unknown)";

/// The `grpc-status` of a header or trailer map.
fn status_of(headers: &http::HeaderMap) -> Option<Code> {
    let value = headers.get("grpc-status")?.to_str().ok()?;
    value.parse::<i32>().ok().map(Code::from_i32)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn paths_split_into_service_and_method() {
        let call = Call::new("/eventmesh.v1.EventMeshService/Publish");
        assert_eq!(call.service, "eventmesh.v1.EventMeshService");
        assert_eq!(call.method, "Publish");
        let odd = Call::new("/nothing");
        assert_eq!(
            (odd.service.as_str(), odd.method.as_str()),
            ("/nothing", "")
        );
    }

    #[test]
    fn the_status_is_read_from_headers_or_trailers() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(status_of(&headers), None);
        headers.insert("grpc-status", http::HeaderValue::from_static("14"));
        assert_eq!(status_of(&headers), Some(Code::Unavailable));
        headers.insert("grpc-status", http::HeaderValue::from_static("x"));
        assert_eq!(status_of(&headers), None);
    }
}

#[cfg(test)]
mod served {
    #![allow(clippy::unwrap_used)]
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    /// Health checks through a real server and client over loopback, counted by the real
    /// exporter: two answered, one NOT_FOUND (trailers-only), one `Unimplemented` method.
    #[tokio::test]
    async fn calls_through_a_real_server_are_counted_by_status() {
        let exporter = metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .unwrap();
        let (health, router) =
            crate::grpc::standard_router(&[], crate::call_limit::CallLimitLayer::none()).unwrap();
        crate::grpc::mark_serving(&health, "svc").await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            router.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = HealthClient::new(channel.clone());
        for service in ["", "svc", "no-such"] {
            let _ = client
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await;
        }
        // A method no service has.
        let mut raw = tonic::client::Grpc::new(channel);
        raw.ready().await.unwrap();
        let unknown: Result<tonic::Response<HealthCheckRequest>, _> = raw
            .unary(
                tonic::Request::new(HealthCheckRequest::default()),
                "/made.up.Service/Nothing".parse().unwrap(),
                tonic_prost::ProstCodec::default(),
            )
            .await;
        assert_eq!(unknown.unwrap_err().code(), tonic::Code::Unimplemented);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let text = exporter.render();
        let line = |code: &str, method: &str, service: &str| {
            format!(
                "grpc_server_handled_total{{grpc_service=\"{service}\",grpc_method=\"{method}\",grpc_code=\"{code}\"}}"
            )
        };
        let health = "grpc.health.v1.Health";
        assert!(
            text.contains(&(line("Ok", "Check", health) + " 2")),
            "{text}"
        );
        assert!(
            text.contains(&(line("NotFound", "Check", health) + " 1")),
            "{text}"
        );
        assert!(
            text.contains(&(line("Unimplemented", "(unknown)", "(unknown)") + " 1")),
            "{text}"
        );
        assert!(!text.contains("made.up"), "{text}");
        assert!(text.contains("grpc_server_handling_seconds"), "{text}");
    }
}
