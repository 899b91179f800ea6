//! A test-only OpenTelemetry trace collector: serves the OTLP/gRPC `TraceService`
//! (`opentelemetry.proto.collector.trace.v1`) on loopback and keeps every span exported to
//! it, with the `service.name` of the process that exported it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use tonic::{Request, Response, Status};

/// One exported span and the `service.name` of the process that exported it.
#[derive(Debug, Clone)]
pub struct Exported {
    pub service: String,
    pub span: Span,
}

impl Exported {
    pub fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }

    pub fn attribute(&self, name: &str) -> Option<String> {
        attribute(&self.span.attributes, name)
    }

    pub fn links_to(&self, trace: &str) -> bool {
        self.span
            .links
            .iter()
            .any(|link| hex(&link.trace_id) == trace)
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn attribute(attributes: &[KeyValue], name: &str) -> Option<String> {
    let value = attributes
        .iter()
        .find(|kv| kv.key == name)?
        .value
        .as_ref()?;
    Some(match value.value.as_ref()? {
        Value::StringValue(text) => text.clone(),
        Value::IntValue(n) => n.to_string(),
        Value::BoolValue(b) => b.to_string(),
        Value::DoubleValue(x) => x.to_string(),
        other => format!("{other:?}"),
    })
}

/// The test's OTLP endpoint: keeps every span exported to it.
#[derive(Clone, Default)]
pub struct Collector(Arc<Mutex<Vec<Exported>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut kept = self.0.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|resource| attribute(&resource.attributes, "service.name"))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                kept.extend(scope.spans.into_iter().map(|span| Exported {
                    service: service.clone(),
                    span,
                }));
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Collector {
    pub async fn serve(&self) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = TraceServiceServer::new(self.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    }

    pub fn spans(&self) -> Vec<Exported> {
        self.0.lock().unwrap().clone()
    }

    /// Waits (bounded) until `done` holds for the spans collected so far.
    pub async fn wait_for(&self, what: &str, done: impl Fn(&[Exported]) -> bool) -> Vec<Exported> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            if Instant::now() > deadline {
                let names: Vec<_> = spans
                    .iter()
                    .map(|s| (s.service.as_str(), s.span.name.as_str(), s.trace_id()))
                    .collect();
                panic!("{what}: not seen within 30 s; collected {names:#?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The span of `service` named `name` in `trace`.
pub fn find<'a>(
    spans: &'a [Exported],
    trace: &str,
    service: &str,
    name: &str,
) -> Option<&'a Exported> {
    spans
        .iter()
        .find(|s| s.trace_id() == trace && s.service == service && s.span.name == name)
}
