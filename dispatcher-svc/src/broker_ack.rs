//! The broker-ACK forwarder: step 3 of the ACK chain (DESIGN §3).
//!
//! Once a message's offset write is durable and the delivery is retired, its `ack_key` (only
//! backends with a broker ACK — RocketMQ 5 POP — give one) is forwarded to puller-svc's
//! `AckPulled`, batched over a short window. Entries the puller could not confirm, and whole
//! batches while the puller is down, are retried with backoff; an unknown key is logged (the
//! broker redelivers it after its invisible time, and the dispatcher then drops the copy as
//! settled). The crash point `before-broker-ack` fires just before a batch is sent.
//!
//! A batch holding traced events is sent inside a `broker_ack` span linked to each of them;
//! its context goes to the puller with the call.

use std::time::Duration;

use eventmesh_common::grpc::InternalChannel;
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_common::trace_context::{EventTrace, Operation, links_span};
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use eventmesh_proto::puller::{AckPulledEntry, AckPulledOutcome, AckPulledRequest, GroupTopic};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::Instrument as _;

use crate::batching::{Backoff, gather};
use crate::crash::{CrashPoint, crash_point};

/// Most entries per AckPulled call.
const MAX_BATCH: usize = 2_000;

/// One broker ACK to send, with the trace context of its event (if traced).
type Queued = (AckPulledEntry, Option<Box<EventTrace>>);

/// Handle to the forwarder task.
#[derive(Clone)]
pub struct BrokerAcker {
    entries: mpsc::UnboundedSender<Queued>,
}

impl BrokerAcker {
    /// Starts the forwarder; it ends when every handle is dropped and its queue is sent, or at
    /// `shutdown` while the puller is failing.
    pub fn spawn(
        channel: InternalChannel,
        window: Duration,
        shutdown: CancellationToken,
    ) -> (BrokerAcker, JoinHandle<()>) {
        let (entries, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(PullerServiceClient::new(channel), rx, window, shutdown));
        (BrokerAcker { entries }, task)
    }

    /// Queues one broker ACK.
    pub fn ack(&self, reader: GroupTopic, ack_key: String, trace: Option<Box<EventTrace>>) {
        let _ = self.entries.send((
            AckPulledEntry {
                reader: Some(reader),
                ack_key,
            },
            trace,
        ));
    }
}

/// The span of a batch with traced events (linked to each), else a disabled one.
fn traced_batch_span(batch: &[Queued]) -> tracing::Span {
    let mut traced = batch
        .iter()
        .filter_map(|(entry, trace)| Some((entry, trace.as_deref()?)));
    let Some((first, _)) = traced.next() else {
        return tracing::Span::none();
    };
    let topic = first
        .reader
        .as_ref()
        .map_or("", |reader| reader.topic.as_str());
    let links = batch
        .iter()
        .filter_map(|(_, trace)| trace.as_deref().map(EventTrace::span_context));
    links_span(Operation::BROKER_ACK, topic, links, batch.len())
}

async fn run(
    mut client: PullerServiceClient<InternalChannel>,
    mut rx: mpsc::UnboundedReceiver<Queued>,
    window: Duration,
    shutdown: CancellationToken,
) {
    let mut queue = Vec::new();
    let mut backoff = Backoff::default();
    loop {
        if !gather(&mut rx, window, &mut queue).await && queue.is_empty() {
            return;
        }
        let take = queue.len().min(MAX_BATCH);
        let batch: Vec<Queued> = queue.drain(..take).collect();
        crash_point(CrashPoint::BeforeBrokerAck);
        let span = traced_batch_span(&batch);
        let failed = match client
            .ack_pulled(AckPulledRequest {
                entries: batch.iter().map(|(entry, _)| entry.clone()).collect(),
            })
            .instrument(span)
            .await
        {
            Ok(response) => {
                let results = response.into_inner().results;
                let mut failed = Vec::new();
                for (queued, result) in batch.into_iter().zip(results) {
                    let entry = &queued.0;
                    match AckPulledOutcome::try_from(result.outcome) {
                        Ok(AckPulledOutcome::Acked | AckPulledOutcome::NotApplicable) => {
                            metrics::counter!("dispatcher_broker_acks_total").increment(1);
                        }
                        Ok(AckPulledOutcome::UnknownKey) => {
                            tracing::warn!(
                                ack_key = %entry.ack_key,
                                detail = result.detail,
                                "broker ACK key unknown to the puller; the broker will redeliver and the copy is dropped as settled"
                            );
                        }
                        _ => failed.push(queued),
                    }
                }
                failed
            }
            Err(status) => {
                tracing::warn!(code = ?status.code(), message = status.message(), entries = batch.len(), "AckPulled failed; retrying");
                batch
            }
        };
        if failed.is_empty() {
            backoff.reset();
            continue;
        }
        metrics::counter!("dispatcher_broker_ack_failures_total").increment(failed.len() as u64);
        queue.splice(0..0, failed);
        tokio::select! {
            () = tokio::time::sleep(backoff.next_delay()) => {}
            () = shutdown.cancelled() => {
                tracing::warn!(entries = queue.len(), "shutting down with broker ACKs unsent; the broker redelivers them");
                return;
            }
        }
    }
}
