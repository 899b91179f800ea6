//! The `eventmesh.puller.v1.PullerService` gRPC implementation over any [`Storage`].
//!
//! * A reader (group × topic) is aligned to its group's watermark before its first poll, and
//!   again on every `Attach` (a dispatcher that restarted lost the frames it held, so they must
//!   be read again). If offset-svc cannot be read, polls of that reader answer UNAVAILABLE.
//! * `Pull` long-polls up to `max_wait_ms` (capped at [`MAX_WAIT`]), looking again every
//!   [`IDLE_POLL`] — or at once when the backend signals an append to the topic (the local
//!   log does; a broker written by others cannot); `PullStream` pushes
//!   batches only while the dispatcher has granted credit, so back-pressure reaches the MQ. A
//!   storage error ends the stream with its status; the dispatcher reconnects.
//! * Bad input is INVALID_ARGUMENT naming the field; unknown topics and partitions are
//!   NOT_FOUND; an unavailable backend is UNAVAILABLE with the cause.

use std::collections::{BTreeMap, HashSet};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use eventmesh_common::keys::{GroupName, PartitionId, Topic};
use eventmesh_common::status::FieldError;
use eventmesh_proto::puller::{self as pb, puller_service_server::PullerService};
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::instrument;

use crate::alignment::{WatermarkSource, align_reader};
use crate::crash::{CrashPoint, crash_point};
use crate::ingest::BodyKind;
use crate::storage::{AckPulledOutcome, PollLimits, PolledBatch, ReaderKey, Storage};

/// Longest a `Pull` waits for records.
pub const MAX_WAIT: Duration = Duration::from_secs(30);
/// How often an idle long-poll or stream looks again.
const IDLE_POLL: Duration = Duration::from_millis(20);
/// Partitions of a topic created without a count.
pub const DEFAULT_PARTITIONS: u32 = 4;

/// The gRPC face of a [`Storage`].
#[derive(Clone)]
pub struct PullerGrpc {
    storage: Arc<dyn Storage>,
    watermarks: WatermarkSource,
    aligned: Arc<Mutex<HashSet<ReaderKey>>>,
    limits: PollLimits,
    default_partitions: u32,
}

fn parse_reader(field: &str, reader: Option<&pb::GroupTopic>) -> Result<ReaderKey, FieldError> {
    let reader = reader.ok_or_else(|| FieldError::new(field, "missing"))?;
    let group = match reader.group.as_str() {
        "" => None,
        name => {
            Some(GroupName::new(name).map_err(|e| FieldError::new(format!("{field}.group"), e))?)
        }
    };
    let topic = Topic::new(reader.topic.as_str())
        .map_err(|e| FieldError::new(format!("{field}.topic"), e))?;
    Ok(ReaderKey { group, topic })
}

fn parse_topic(field: &str, topic: &str) -> Result<Topic, FieldError> {
    Topic::new(topic).map_err(|e| FieldError::new(field, e))
}

fn parse_partition(field: &str, partition: &str) -> Result<Option<PartitionId>, FieldError> {
    match partition {
        "" => Ok(None),
        text => PartitionId::new(text)
            .map(Some)
            .map_err(|e| FieldError::new(field, e)),
    }
}

fn to_group_topic(reader: &ReaderKey) -> pb::GroupTopic {
    pb::GroupTopic {
        group: reader
            .group
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default(),
        topic: reader.topic.to_string(),
    }
}

fn to_response(batch: PolledBatch) -> pb::PullResponse {
    pb::PullResponse {
        records: batch
            .records
            .into_iter()
            .map(|record| pb::PulledRecord {
                partition: record.partition.to_string(),
                offset: record.offset,
                frame: record.ingested.frame,
                body_kind: match record.ingested.kind {
                    BodyKind::Frame => pb::BodyKind::Frame,
                    BodyKind::CloudEventsJson => pb::BodyKind::CloudeventsJson,
                    BodyKind::Opaque => pb::BodyKind::Opaque,
                    BodyKind::MalformedFrame => pb::BodyKind::MalformedFrame,
                } as i32,
                ack_key: record.ack_key.unwrap_or_default(),
                key: record.key,
                timestamp_unix_ms: record.timestamp_ms,
                malformed_reason: record.ingested.malformed_reason.unwrap_or_default(),
            })
            .collect(),
        ranges: batch
            .ranges
            .into_iter()
            .map(|range| pb::PartitionRange {
                partition: range.partition.to_string(),
                first: range.first,
                next: range.next,
            })
            .collect(),
    }
}

impl PullerGrpc {
    /// Serves `storage`, reading watermarks through `watermarks`.
    pub fn new(storage: Arc<dyn Storage>, watermarks: WatermarkSource) -> Self {
        PullerGrpc {
            storage,
            watermarks,
            aligned: Arc::default(),
            limits: PollLimits::default(),
            default_partitions: DEFAULT_PARTITIONS,
        }
    }

    /// Partitions of topics created without a count.
    pub fn with_default_partitions(mut self, partitions: u32) -> Self {
        self.default_partitions = partitions.max(1);
        self
    }

    fn is_aligned(&self, reader: &ReaderKey) -> bool {
        self.aligned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(reader)
    }

    /// Aligns a reader to its watermark (always, or only if not yet aligned).
    async fn align(&self, reader: &ReaderKey, force: bool) -> Result<(), Status> {
        if !force && self.is_aligned(reader) {
            return Ok(());
        }
        align_reader(self.storage.as_ref(), &self.watermarks, reader)
            .await
            .map_err(|err| match err {
                crate::alignment::AlignError::Storage(storage) => Status::from(storage),
                other => Status::unavailable(other.to_string()),
            })?;
        self.aligned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(reader.clone());
        Ok(())
    }

    fn limits(&self, max_records: u32, max_bytes: u32) -> PollLimits {
        PollLimits {
            max_records: match max_records {
                0 => self.limits.max_records,
                n => (n as usize).min(10_000),
            },
            max_bytes: match max_bytes {
                0 => self.limits.max_bytes,
                n => n as usize,
            },
        }
    }

    async fn cursor_list(&self, reader: &ReaderKey) -> Result<Vec<pb::Cursor>, Status> {
        Ok(self
            .storage
            .cursors(reader)
            .await?
            .into_iter()
            .map(|(partition, next)| pb::Cursor {
                reader: Some(to_group_topic(reader)),
                partition: partition.to_string(),
                next_offset: next,
            })
            .collect())
    }
}

type PullStreamStream = Pin<Box<dyn Stream<Item = Result<pb::PullStreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl PullerService for PullerGrpc {
    #[instrument(skip_all, fields(topic = %request.get_ref().topic))]
    async fn publish(
        &self,
        request: Request<pb::PublishRequest>,
    ) -> Result<Response<pb::PublishResponse>, Status> {
        let request = request.into_inner();
        let topic = parse_topic("topic", &request.topic)?;
        let partition = parse_partition("partition", &request.partition)?;
        let appended = self
            .storage
            .send(&topic, request.key, request.body, partition)
            .await?;
        crash_point(CrashPoint::AfterPublish);
        Ok(Response::new(pb::PublishResponse {
            partition: appended.partition.to_string(),
            offset: appended.offset,
        }))
    }

    #[instrument(skip_all, fields(dispatcher = %request.get_ref().dispatcher_id, readers = request.get_ref().readers.len()))]
    async fn attach(
        &self,
        request: Request<pb::AttachRequest>,
    ) -> Result<Response<pb::AttachResponse>, Status> {
        let request = request.into_inner();
        let mut cursors = Vec::new();
        for (i, reader) in request.readers.iter().enumerate() {
            let reader = parse_reader(&format!("readers[{i}]"), Some(reader))?;
            self.align(&reader, true).await?;
            cursors.extend(self.cursor_list(&reader).await?);
        }
        tracing::info!(dispatcher = %request.dispatcher_id, readers = request.readers.len(), "dispatcher attached; readers realigned");
        Ok(Response::new(pb::AttachResponse { cursors }))
    }

    #[instrument(skip_all)]
    async fn pull(
        &self,
        request: Request<pb::PullRequest>,
    ) -> Result<Response<pb::PullResponse>, Status> {
        let request = request.into_inner();
        let reader = parse_reader("reader", request.reader.as_ref())?;
        let partition = parse_partition("partition", &request.partition)?;
        let limits = self.limits(request.max_records, request.max_bytes);
        self.align(&reader, false).await?;
        let deadline = tokio::time::Instant::now()
            + Duration::from_millis(request.max_wait_ms.into()).min(MAX_WAIT);
        let mut appends = self.storage.appends(&reader.topic);
        loop {
            if let Some(appends) = appends.as_mut() {
                // What is appended from here on wakes the wait below.
                appends.borrow_and_update();
            }
            let batch = self
                .storage
                .poll(&reader, partition.as_ref(), limits)
                .await?;
            if !batch.records.is_empty() {
                crash_point(CrashPoint::AfterPull);
            }
            if !batch.records.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(Response::new(to_response(batch)));
            }
            let until = deadline.min(tokio::time::Instant::now() + IDLE_POLL);
            match appends.as_mut() {
                Some(appends) => {
                    let _ = tokio::time::timeout_at(until, appends.changed()).await;
                }
                None => tokio::time::sleep_until(until).await,
            }
        }
    }

    type PullStreamStream = PullStreamStream;

    #[instrument(skip_all)]
    async fn pull_stream(
        &self,
        request: Request<Streaming<pb::PullStreamRequest>>,
    ) -> Result<Response<Self::PullStreamStream>, Status> {
        let mut inbound = request.into_inner();
        // A small buffer: the dispatcher's credit, not this queue, bounds what is in flight.
        let (tx, rx) = mpsc::channel(2);
        let service = self.clone();
        tokio::spawn(async move {
            let mut credits: BTreeMap<ReaderKey, u32> = BTreeMap::new();
            let mut idle = false;
            loop {
                let has_credit = credits.values().any(|c| *c > 0);
                let pause = if idle { IDLE_POLL } else { Duration::ZERO };
                tokio::select! {
                    message = inbound.message() => {
                        let result = match message {
                            Ok(Some(message)) => service.stream_message(message, &mut credits).await,
                            Ok(None) | Err(_) => return,
                        };
                        if let Err(status) = result {
                            let _ = tx.send(Err(status)).await;
                            return;
                        }
                        idle = false;
                    }
                    () = tokio::time::sleep(pause), if has_credit => {
                        idle = true;
                        for (reader, credit) in credits.iter_mut().filter(|(_, c)| **c > 0) {
                            let limits = PollLimits {
                                max_records: (*credit as usize).min(service.limits.max_records),
                                ..service.limits
                            };
                            let batch = match service.storage.poll(reader, None, limits).await {
                                Ok(batch) => batch,
                                Err(err) => {
                                    let _ = tx.send(Err(Status::from(err))).await;
                                    return;
                                }
                            };
                            if batch.records.is_empty() {
                                continue;
                            }
                            idle = false;
                            *credit -= batch.records.len().min(*credit as usize) as u32;
                            let response = pb::PullStreamResponse {
                                reader: Some(to_group_topic(reader)),
                                batch: Some(to_response(batch)),
                            };
                            if tx.send(Ok(response)).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    #[instrument(skip_all, fields(entries = request.get_ref().entries.len()))]
    async fn ack_pulled(
        &self,
        request: Request<pb::AckPulledRequest>,
    ) -> Result<Response<pb::AckPulledResponse>, Status> {
        let request = request.into_inner();
        let mut results = Vec::with_capacity(request.entries.len());
        for (i, entry) in request.entries.iter().enumerate() {
            let reader = parse_reader(&format!("entries[{i}].reader"), entry.reader.as_ref())?;
            let (outcome, detail) = match self.storage.ack_pulled(&reader, &entry.ack_key).await {
                Ok(AckPulledOutcome::Acked) => (pb::AckPulledOutcome::Acked, String::new()),
                Ok(AckPulledOutcome::NotApplicable) => {
                    (pb::AckPulledOutcome::NotApplicable, String::new())
                }
                Ok(AckPulledOutcome::UnknownKey) => (
                    pb::AckPulledOutcome::UnknownKey,
                    "unknown ack key; the broker redelivers after its invisible time".to_owned(),
                ),
                Err(err) => (pb::AckPulledOutcome::Failed, err.to_string()),
            };
            results.push(pb::AckPulledResult {
                outcome: outcome as i32,
                detail,
            });
        }
        Ok(Response::new(pb::AckPulledResponse { results }))
    }

    #[instrument(skip_all, fields(topic = %request.get_ref().topic))]
    async fn create_topic(
        &self,
        request: Request<pb::CreateTopicRequest>,
    ) -> Result<Response<pb::CreateTopicResponse>, Status> {
        let request = request.into_inner();
        let topic = parse_topic("topic", &request.topic)?;
        let partitions = match request.partitions {
            0 => self.default_partitions,
            n => n,
        };
        let created = self.storage.create_topic(&topic, partitions).await?;
        let partitions = self.storage.partition_count(&topic).await?;
        Ok(Response::new(pb::CreateTopicResponse {
            created,
            partitions,
        }))
    }

    async fn create_lite(
        &self,
        request: Request<pb::CreateLiteRequest>,
    ) -> Result<Response<pb::CreateLiteResponse>, Status> {
        let request = request.into_inner();
        let parent = parse_topic("parent", &request.parent)?;
        let partition = self.storage.create_lite(&parent, &request.lite).await?;
        Ok(Response::new(pb::CreateLiteResponse {
            partition: partition.to_string(),
        }))
    }

    async fn publish_lite(
        &self,
        request: Request<pb::PublishLiteRequest>,
    ) -> Result<Response<pb::PublishLiteResponse>, Status> {
        let request = request.into_inner();
        let parent = parse_topic("parent", &request.parent)?;
        let appended = self
            .storage
            .send_lite(&parent, &request.lite, request.body)
            .await?;
        Ok(Response::new(pb::PublishLiteResponse {
            partition: appended.partition.to_string(),
            offset: appended.offset,
        }))
    }

    async fn pull_lite(
        &self,
        request: Request<pb::PullLiteRequest>,
    ) -> Result<Response<pb::PullLiteResponse>, Status> {
        let request = request.into_inner();
        let reader = ReaderKey {
            group: None,
            topic: parse_topic("parent", &request.parent)?,
        };
        let batch = self
            .storage
            .pull_lite(&reader, &request.lite, self.limits(request.max_records, 0))
            .await?;
        Ok(Response::new(pb::PullLiteResponse {
            batch: Some(to_response(batch)),
        }))
    }

    async fn end_offsets(
        &self,
        request: Request<pb::EndOffsetsRequest>,
    ) -> Result<Response<pb::EndOffsetsResponse>, Status> {
        let topic = parse_topic("topic", &request.get_ref().topic)?;
        let partitions = self
            .storage
            .end_offsets(&topic)
            .await?
            .into_iter()
            .map(|range| pb::PartitionOffsets {
                partition: range.partition.to_string(),
                start: range.start,
                end: range.end,
            })
            .collect();
        Ok(Response::new(pb::EndOffsetsResponse { partitions }))
    }

    async fn cursors(
        &self,
        request: Request<pb::CursorsRequest>,
    ) -> Result<Response<pb::CursorsResponse>, Status> {
        let request = request.into_inner();
        let reader = parse_reader(
            "reader",
            Some(&pb::GroupTopic {
                group: request.group,
                topic: request.topic,
            }),
        )?;
        Ok(Response::new(pb::CursorsResponse {
            cursors: self.cursor_list(&reader).await?,
        }))
    }
}

impl PullerGrpc {
    /// Handles one message of a PullStream.
    async fn stream_message(
        &self,
        message: pb::PullStreamRequest,
        credits: &mut BTreeMap<ReaderKey, u32>,
    ) -> Result<(), Status> {
        use pb::pull_stream_request::Kind;
        match message.kind {
            Some(Kind::OpenReader(reader)) => {
                let reader = parse_reader("open_reader", Some(&reader))?;
                self.align(&reader, false).await?;
                credits.entry(reader).or_insert(0);
            }
            Some(Kind::CloseReader(reader)) => {
                credits.remove(&parse_reader("close_reader", Some(&reader))?);
            }
            Some(Kind::Credit(credit)) => {
                let reader = parse_reader("credit.reader", credit.reader.as_ref())?;
                let slot = credits.get_mut(&reader).ok_or_else(|| {
                    Status::failed_precondition("credit for a reader that is not open")
                })?;
                *slot = slot.saturating_add(credit.records);
            }
            None => return Err(Status::invalid_argument("empty PullStreamRequest")),
        }
        Ok(())
    }
}
