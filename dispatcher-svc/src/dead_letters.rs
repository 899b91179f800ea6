//! Writing dead-letter envelopes to `<topic>_DLQ` through puller-svc (DESIGN §10).
//!
//! The topic is created on demand (explicitly: dead-letter topics are ours, whatever the
//! auto-create setting). A write that fails is retried for as long as it takes: the delivery
//! stays held (unsettled) meanwhile, every failure is counted
//! (`dispatcher_dead_letter_failures_total`), and `dispatcher_dead_letters_stuck` shows how
//! many wait — an alert, never a drop. Transient failures are retried with backoff; a refusal
//! that retrying soon cannot fix (a name the MQ refuses, a missing topic that cannot be
//! created) is logged once at ERROR with the source event and tried again every minute.

use std::collections::HashSet;
use std::sync::Mutex;

use eventmesh_common::dead_letter::{DeadLetter, ENVELOPE_LIMITS, dlq_topic};
use eventmesh_common::grpc::InternalChannel;
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use eventmesh_proto::puller::{CreateTopicRequest, PublishRequest};

use crate::batching::Backoff;

/// How often a dead-letter write refused for good (a bad name, a topic that cannot be created)
/// is tried again: rarely, and loudly once; never dropped, since the event would be lost.
const PERMANENT_RETRY: std::time::Duration = std::time::Duration::from_secs(60);

/// Refusals that do not go away by retrying soon: the request itself, or the MQ's state.
fn is_permanent(status: &tonic::Status) -> bool {
    use tonic::Code;
    matches!(
        status.code(),
        Code::InvalidArgument
            | Code::NotFound
            | Code::FailedPrecondition
            | Code::PermissionDenied
            | Code::ResourceExhausted
            | Code::OutOfRange
            | Code::Unimplemented
            | Code::Unauthenticated
    )
}

/// Writes envelopes.
pub struct DeadLetterWriter {
    puller: PullerServiceClient<InternalChannel>,
    created: Mutex<HashSet<String>>,
}

impl DeadLetterWriter {
    /// Writes through `channel` to puller-svc.
    pub fn new(channel: InternalChannel) -> Self {
        DeadLetterWriter {
            puller: PullerServiceClient::new(channel),
            created: Mutex::default(),
        }
    }

    /// Writes one envelope; returns once the MQ holds it.
    pub async fn write(&self, mut letter: DeadLetter) {
        let topic = dlq_topic(&letter.topic);
        let body = match letter.encode() {
            Ok(body) => body,
            Err(err) => {
                // Only a body beyond every frame limit gets here: keep what fits and say so.
                let keep = ENVELOPE_LIMITS.max_data_bytes.min(letter.original.len());
                tracing::error!(error = %err, size = letter.original.len(), "dead-letter body too large for an envelope; truncating it");
                letter.reason = format!(
                    "{} (original body of {} bytes truncated to {keep})",
                    letter.reason,
                    letter.original.len()
                );
                letter.original = letter.original.slice(..keep);
                match letter.encode() {
                    Ok(body) => body,
                    Err(err) => {
                        tracing::error!(error = %err, "dead-letter envelope cannot be encoded; sending the reason only");
                        letter.original = bytes::Bytes::new();
                        letter.encode().unwrap_or_default()
                    }
                }
            }
        };
        let mut backoff = Backoff::default();
        let mut stuck = false;
        loop {
            match self.publish(&topic, &body).await {
                Ok(()) => break,
                Err(status) => {
                    metrics::counter!("dispatcher_dead_letter_failures_total").increment(1);
                    let permanent = is_permanent(&status);
                    if !stuck {
                        stuck = true;
                        metrics::gauge!("dispatcher_dead_letters_stuck").increment(1.0);
                        if permanent {
                            tracing::error!(topic, code = ?status.code(), message = status.message(), source_topic = letter.topic, source_partition = letter.partition, source_offset = letter.offset, "dead-letter write refused: this will not succeed until the cause is fixed (the event is held, unsettled, and the write tried again every minute)");
                        }
                    }
                    if permanent {
                        self.created
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&topic);
                        tokio::time::sleep(PERMANENT_RETRY).await;
                    } else {
                        tracing::warn!(topic, code = ?status.code(), message = status.message(), source_offset = letter.offset, "dead-letter write failed; the event is held and the write retried");
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                }
            }
        }
        if stuck {
            metrics::gauge!("dispatcher_dead_letters_stuck").decrement(1.0);
        }
    }

    async fn publish(&self, topic: &str, body: &bytes::Bytes) -> Result<(), tonic::Status> {
        let mut puller = self.puller.clone();
        let known = self
            .created
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(topic);
        if !known {
            puller
                .create_topic(CreateTopicRequest {
                    topic: topic.to_owned(),
                    partitions: 0,
                    implicit: false,
                })
                .await?;
            self.created
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(topic.to_owned());
        }
        puller
            .publish(PublishRequest {
                topic: topic.to_owned(),
                body: body.clone(),
                key: bytes::Bytes::new(),
                partition: String::new(),
            })
            .await?;
        Ok(())
    }
}
