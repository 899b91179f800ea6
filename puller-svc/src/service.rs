//! The `eventmesh.puller.v1.PullerService` gRPC implementation over any [`Storage`].
//!
//! * A reader (group × topic) is used by one dispatcher at a time. `Attach` gives it a new
//!   **generation** and sets its cursors: to the positions the dispatcher names, else to its
//!   group's watermark + 1 read from offset-svc (a dispatcher that restarted lost the frames it
//!   held, so they must be read again; if offset-svc cannot be read, the attach answers
//!   UNAVAILABLE). Every `Pull` / `PullStream` must carry the generation: another one is refused
//!   with FAILED_PRECONDITION naming the holder in the status metadata (`em-reader-holder`,
//!   `em-reader-generation`); a reader never attached since this process started is refused
//!   without a holder, so its dispatcher attaches again. Attach, the check and each poll hold
//!   the reader's lock, so an attach never races a poll of the generation it ends.
//! * A `Pull` naming positions confirms where its caller's last kept batch ended: the cursors
//!   are set there before reading, so a response that was lost is read again, never skipped.
//! * `Pull` long-polls up to `max_wait_ms` (capped at [`MAX_WAIT`]). On a backend that signals
//!   appends to the topic (the local log) it looks again at once on an append or when the
//!   reader is attached again (so a stale poll is refused at once); straight away when the
//!   backend's poll itself waits for records (Kafka's consumer answers as soon as a fetch
//!   brings one),
//!   and otherwise on a timer: every [`IDLE_POLL`] without an append signal, every
//!   [`SIGNALLED_LOOK_AGAIN`] with one (what no signal covers: a partition whose read failed
//!   being read again); `PullStream` pushes
//!   batches only while the dispatcher has granted credit, so back-pressure reaches the MQ. A
//!   storage error ends the stream with its status; the dispatcher reconnects.
//! * Bad input is INVALID_ARGUMENT naming the field; unknown topics and partitions are
//!   NOT_FOUND; an unavailable backend is UNAVAILABLE with the cause.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use eventmesh_common::grpc;
use eventmesh_common::keys::{GroupName, PartitionId, Topic};
use eventmesh_common::status::FieldError;
use eventmesh_common::trace_context::{Operation, call_child_span};
use eventmesh_proto::puller::{self as pb, puller_service_server::PullerService};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument as _, instrument};

use crate::alignment::{WatermarkSource, align_reader, describe};
use crate::crash::{CrashPoint, crash_point};
use crate::ingest::{BodyKind, Stamping};
use crate::storage::{
    AckPulledOutcome, NewRecord, PollLimits, PolledBatch, ReaderKey, Selection, Storage,
};

/// Longest a `Pull` waits for records.
pub const MAX_WAIT: Duration = Duration::from_secs(30);
/// How often an idle long-poll or stream looks again.
const IDLE_POLL: Duration = Duration::from_millis(20);
/// How often an idle long-poll looks again when the backend signals appends: an append or an
/// attach wakes it, so the timer only retries what no signal covers (a partition whose read
/// failed). At [`IDLE_POLL`] an idle reader cost 50 polls a second, each a wake-up of a
/// worker and of a blocking-pool thread (about 1 % of a core per idle reader).
const SIGNALLED_LOOK_AGAIN: Duration = Duration::from_millis(1000);
/// Broker ACKs of one AckPulled call in flight at once.
const ACKS_IN_FLIGHT: usize = 32;
/// Partitions of a topic created without a count.
pub const DEFAULT_PARTITIONS: u32 = 4;

/// Status metadata naming the dispatcher that holds a reader.
pub const HOLDER_METADATA: &str = "em-reader-holder";
/// Status metadata with the generation of the reader's holder (hex).
pub const GENERATION_METADATA: &str = "em-reader-generation";

/// Who holds a reader now.
#[derive(Debug)]
struct ReaderSlot {
    /// The generation of its last Attach; 0: not attached since this process started.
    generation: u64,
    /// The dispatcher that attached it.
    holder: String,
    /// When it was last attached or polled.
    last_used: tokio::time::Instant,
    /// Bumped by every Attach: wakes the long polls waiting on this reader, so a poll of the
    /// generation it ends is refused at once.
    attaches: tokio::sync::watch::Sender<()>,
}

impl Default for ReaderSlot {
    fn default() -> Self {
        ReaderSlot {
            generation: 0,
            holder: String::new(),
            last_used: tokio::time::Instant::now(),
            attaches: tokio::sync::watch::Sender::new(()),
        }
    }
}

impl ReaderSlot {
    /// Refuses a request that carries another generation than the holder's.
    fn check(&self, reader: &ReaderKey, generation: u64) -> Result<(), Status> {
        if self.generation == 0 {
            return Err(Status::failed_precondition(format!(
                "reader {} is not attached (puller-svc restarted, or Attach was never called): attach it first",
                describe(reader)
            )));
        }
        if self.generation == generation {
            return Ok(());
        }
        let mut status = Status::failed_precondition(format!(
            "reader {} is held by dispatcher {} (generation {:x}); this request carries generation {generation:x}: the reader was attached again since",
            describe(reader),
            self.holder,
            self.generation
        ));
        if let Ok(holder) = self.holder.parse() {
            status.metadata_mut().insert(HOLDER_METADATA, holder);
        }
        if let Ok(value) = format!("{:x}", self.generation).parse() {
            status.metadata_mut().insert(GENERATION_METADATA, value);
        }
        Err(status)
    }
}

type Slot = Arc<tokio::sync::Mutex<ReaderSlot>>;

/// The gRPC face of a [`Storage`].
#[derive(Clone)]
pub struct PullerGrpc {
    storage: Arc<dyn Storage>,
    watermarks: WatermarkSource,
    readers: Arc<Mutex<HashMap<ReaderKey, Slot>>>,
    generations: Arc<AtomicU64>,
    limits: PollLimits,
    default_partitions: u32,
    auto_create_topics: bool,
    reader_idle: Duration,
}

/// Readers left unused this long are evicted unless configured otherwise.
pub const DEFAULT_READER_IDLE: Duration = Duration::from_secs(600);

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

fn parse_positions(
    field: &str,
    positions: &[pb::Position],
) -> Result<BTreeMap<PartitionId, i64>, FieldError> {
    let mut parsed = BTreeMap::new();
    for (i, position) in positions.iter().enumerate() {
        let partition = PartitionId::new(position.partition.as_str())
            .map_err(|e| FieldError::new(format!("{field}[{i}].partition"), e))?;
        if position.next < 0 {
            return Err(FieldError::new(
                format!("{field}[{i}].next"),
                format!("{} is negative", position.next),
            ));
        }
        if parsed.insert(partition, position.next).is_some() {
            return Err(FieldError::new(
                format!("{field}[{i}].partition"),
                format!("{} is named twice", position.partition),
            ));
        }
    }
    Ok(parsed)
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
                traceparent: record.ingested.traceparent,
            })
            .collect(),
        ranges: batch
            .ranges
            .into_iter()
            .map(|range| pb::PartitionRange {
                partition: range.partition.to_string(),
                first: range.first,
                next: range.next,
                lost_to_retention: range.lost_to_retention,
            })
            .collect(),
        unpositioned: batch
            .unpositioned
            .into_iter()
            .map(|range| pb::PartitionOffsets {
                partition: range.partition.to_string(),
                start: range.start,
                end: range.end,
            })
            .collect(),
        past_end: batch
            .past_end
            .into_iter()
            .map(|past| pb::PastEnd {
                partition: past.partition.to_string(),
                position: past.position,
                log_start: past.log_start,
                log_end: past.log_end,
            })
            .collect(),
    }
}

impl PullerGrpc {
    /// Serves `storage`, reading watermarks through `watermarks`.
    pub fn new(storage: Arc<dyn Storage>, watermarks: WatermarkSource) -> Self {
        // Generations are unique across restarts of this process: a random high half.
        let epoch = u64::from(rand::random::<u32>() | 1) << 32;
        PullerGrpc {
            storage,
            watermarks,
            readers: Arc::default(),
            generations: Arc::new(AtomicU64::new(epoch)),
            limits: PollLimits::default(),
            default_partitions: DEFAULT_PARTITIONS,
            auto_create_topics: true,
            reader_idle: DEFAULT_READER_IDLE,
        }
    }

    /// Readers no dispatcher attached or polled for this long are evicted.
    pub fn with_reader_idle(mut self, idle: Duration) -> Self {
        self.reader_idle = idle;
        self
    }

    /// How long a reader may stay unused before it is evicted.
    pub fn reader_idle(&self) -> Duration {
        self.reader_idle
    }

    /// Readers known to this process (attached at least once and not evicted).
    pub fn reader_count(&self) -> usize {
        self.readers.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Evicts every reader unused for the idle time: its generation (its dispatcher attaches
    /// again when it comes back), what the backend holds for it, and its cursors. A reader
    /// being attached or polled right now, or with a long poll waiting, is skipped. Returns
    /// how many were evicted.
    pub async fn evict_idle(&self) -> usize {
        let now = tokio::time::Instant::now();
        let idle: Vec<(ReaderKey, Slot)> = {
            let readers = self.readers.lock().unwrap_or_else(|p| p.into_inner());
            readers
                .iter()
                .map(|(reader, slot)| (reader.clone(), Arc::clone(slot)))
                .collect()
        };
        let mut evicted = 0;
        for (reader, slot) in idle {
            let Ok(mut held) = slot.try_lock() else {
                continue;
            };
            // A long poll waiting for a signal holds a receiver (taken under this lock) and
            // refreshes `last_used` only when it looks again: it is in use.
            if now.duration_since(held.last_used) < self.reader_idle
                || held.attaches.receiver_count() > 0
            {
                continue;
            }
            self.readers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&reader);
            // A request that took this slot before it left the map is refused as not attached,
            // rather than reading (and so loading again) the cursors evicted below.
            held.generation = 0;
            drop(held);
            if let Err(err) = self.storage.evict_reader(&reader).await {
                tracing::warn!(reader = %describe(&reader), error = %err, "evicting an idle reader failed");
                continue;
            }
            evicted += 1;
        }
        if evicted > 0 {
            tracing::info!(evicted, idle = ?self.reader_idle, "idle readers evicted");
        }
        evicted
    }

    /// Whether a topic is created because a publish or subscribe named it (`implicit`
    /// CreateTopic); off, only explicit creations go through.
    pub fn with_auto_create_topics(mut self, auto_create: bool) -> Self {
        self.auto_create_topics = auto_create;
        self
    }

    /// Partitions of topics created without a count.
    pub fn with_default_partitions(mut self, partitions: u32) -> Self {
        self.default_partitions = partitions.max(1);
        self
    }

    fn slot(&self, reader: &ReaderKey) -> Slot {
        let mut readers = self.readers.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(readers.entry(reader.clone()).or_default())
    }

    /// Takes a reader for `holder`: sets the named positions (or aligns to the watermark when
    /// none are named) and starts a new generation. Returns it.
    async fn attach_reader(
        &self,
        reader: &ReaderKey,
        holder: &str,
        positions: &BTreeMap<PartitionId, i64>,
    ) -> Result<u64, Status> {
        let slot = self.slot(reader);
        let mut slot = slot.lock().await;
        if positions.is_empty() {
            align_reader(self.storage.as_ref(), &self.watermarks, reader)
                .await
                .map_err(|err| match err {
                    crate::alignment::AlignError::Storage(storage) => Status::from(storage),
                    other => Status::unavailable(other.to_string()),
                })?;
        }
        for (partition, next) in positions {
            self.storage
                .position_pull_offset(reader, partition, *next)
                .await?;
        }
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        slot.last_used = tokio::time::Instant::now();
        if slot.generation != 0 && slot.holder != holder {
            tracing::warn!(reader = %describe(reader), from = slot.holder, to = holder, "reader taken over by another dispatcher; the previous holder's pulls are refused from now on");
        }
        slot.generation = generation;
        holder.clone_into(&mut slot.holder);
        slot.attaches.send_replace(());
        Ok(generation)
    }

    /// Whether an empty poll that took `took` already waited for records inside the backend
    /// (Kafka's consumer answers as soon as a fetch brings one), so the look-again timer would
    /// only delay the next record. An answer that came back sooner — e.g. with no partition to
    /// read — still takes the timer: polls must not spin.
    fn waited_in_backend(&self, took: Duration) -> bool {
        self.storage.waits_in_poll() && took >= IDLE_POLL
    }

    /// A poll's limits from a request's (0: this service's default) and the form it asks for.
    fn limits(&self, max_records: u32, max_bytes: u32, stamping: Stamping) -> PollLimits {
        PollLimits {
            max_records: match max_records {
                0 => self.limits.max_records,
                n => (n as usize).min(grpc::MAX_PULL_RECORDS),
            },
            max_bytes: match max_bytes {
                0 => self.limits.max_bytes,
                n => (n as usize).min(grpc::MAX_PULL_BYTES),
            },
            stamping,
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

/// Waits until the topic's next append, the reader's next attach or `until`, whichever comes
/// first. A signal whose sender is gone (never while the reader's slot and the storage live)
/// waits for `until`, so the long poll cannot spin.
async fn wait_for_signal(
    appends: &mut tokio::sync::watch::Receiver<u64>,
    attaches: &mut tokio::sync::watch::Receiver<()>,
    until: tokio::time::Instant,
) {
    tokio::select! {
        () = changed_or_never(appends) => {}
        () = changed_or_never(attaches) => {}
        () = tokio::time::sleep_until(until) => {}
    }
}

/// Resolves at the signal's next change; never when its sender is gone.
async fn changed_or_never<T>(signal: &mut tokio::sync::watch::Receiver<T>) {
    if signal.changed().await.is_err() {
        std::future::pending::<()>().await;
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
        let span = call_child_span(&request, Operation::APPEND, &request.get_ref().topic);
        let request = request.into_inner();
        let topic = parse_topic("topic", &request.topic)?;
        let partition = parse_partition("partition", &request.partition)?;
        self.storage.check_topic_name(&topic)?;
        check_key("key", &request.key)?;
        let appended = self
            .storage
            .send(&topic, request.key, request.body, partition)
            .instrument(span.clone())
            .await?;
        crash_point(CrashPoint::AfterPublish);
        span.record(
            "messaging.destination.partition.id",
            appended.partition.as_str(),
        );
        span.record("eventmesh.offset", appended.offset);
        Ok(Response::new(pb::PublishResponse {
            partition: appended.partition.to_string(),
            offset: appended.offset,
        }))
    }

    #[instrument(skip_all, fields(topic = %request.get_ref().topic, records = request.get_ref().records.len()))]
    async fn publish_batch(
        &self,
        request: Request<pb::PublishBatchRequest>,
    ) -> Result<Response<pb::PublishBatchResponse>, Status> {
        let span = call_child_span(&request, Operation::APPEND, &request.get_ref().topic);
        span.record(
            "messaging.batch.message_count",
            request.get_ref().records.len() as u64,
        );
        let request = request.into_inner();
        let topic = parse_topic("topic", &request.topic)?;
        self.storage.check_topic_name(&topic)?;
        if request.records.len() > grpc::MAX_PUBLISH_BATCH {
            return Err(FieldError::new(
                "records",
                format!(
                    "{} records, more than {}",
                    request.records.len(),
                    grpc::MAX_PUBLISH_BATCH
                ),
            )
            .into());
        }
        // Records refused here are answered without reaching the backend; the others are sent
        // as one batch and their answers put back in request order.
        let mut outcomes = vec![None; request.records.len()];
        let mut accepted = Vec::with_capacity(request.records.len());
        let mut accepted_at = Vec::with_capacity(request.records.len());
        for (i, record) in request.records.into_iter().enumerate() {
            match check_batch_record(i, record) {
                Ok(record) => {
                    accepted.push(record);
                    accepted_at.push(i);
                }
                Err(refused) => outcomes[i] = Some(refused_outcome(&refused)),
            }
        }
        if !accepted.is_empty() {
            let results = self
                .storage
                .send_batch(&topic, accepted)
                .instrument(span)
                .await?;
            crash_point(CrashPoint::AfterPublish);
            for (i, result) in accepted_at.into_iter().zip(results) {
                outcomes[i] = Some(match result {
                    Ok(appended) => pb::RecordOutcome {
                        partition: appended.partition.to_string(),
                        offset: appended.offset,
                        error: None,
                    },
                    Err(error) => refused_outcome(&Status::from(error)),
                });
            }
        }
        Ok(Response::new(pb::PublishBatchResponse {
            outcomes: outcomes
                .into_iter()
                .map(|outcome| {
                    outcome.unwrap_or_else(|| {
                        refused_outcome(&Status::internal("the backend did not answer this record"))
                    })
                })
                .collect(),
        }))
    }

    #[instrument(skip_all, fields(dispatcher = %request.get_ref().dispatcher_id, readers = request.get_ref().readers.len()))]
    async fn attach(
        &self,
        request: Request<pb::AttachRequest>,
    ) -> Result<Response<pb::AttachResponse>, Status> {
        let request = request.into_inner();
        if request.dispatcher_id.is_empty() {
            return Err(FieldError::new("dispatcher_id", "must not be empty").into());
        }
        let mut readers = Vec::with_capacity(request.readers.len());
        for (i, reader) in request.readers.iter().enumerate() {
            readers.push(parse_reader(&format!("readers[{i}]"), Some(reader))?);
        }
        let mut positions: HashMap<ReaderKey, BTreeMap<PartitionId, i64>> = HashMap::new();
        for (i, entry) in request.positions.iter().enumerate() {
            let reader = parse_reader(&format!("positions[{i}].reader"), entry.reader.as_ref())?;
            if !readers.contains(&reader) {
                return Err(FieldError::new(
                    format!("positions[{i}].reader"),
                    "names a reader that is not in readers",
                )
                .into());
            }
            let parsed = parse_positions(&format!("positions[{i}].positions"), &entry.positions)?;
            positions.entry(reader).or_default().extend(parsed);
        }
        let mut response = pb::AttachResponse::default();
        for reader in &readers {
            let named = positions.remove(reader).unwrap_or_default();
            let generation = self
                .attach_reader(reader, &request.dispatcher_id, &named)
                .await?;
            response.cursors.extend(self.cursor_list(reader).await?);
            response.generations.push(pb::ReaderGeneration {
                reader: Some(to_group_topic(reader)),
                generation,
            });
        }
        tracing::info!(dispatcher = %request.dispatcher_id, readers = readers.len(), "dispatcher attached its readers");
        Ok(Response::new(response))
    }

    #[instrument(skip_all)]
    async fn pull(
        &self,
        request: Request<pb::PullRequest>,
    ) -> Result<Response<pb::PullResponse>, Status> {
        let request = request.into_inner();
        let reader = parse_reader("reader", request.reader.as_ref())?;
        let partition = parse_partition("partition", &request.partition)?;
        let selection = Selection::of(partition, parse_positions("positions", &request.positions)?);
        let stamping = if request.bare_frames {
            Stamping::ExceptOwnFrames
        } else {
            Stamping::Every
        };
        let limits = self.limits(request.max_records, request.max_bytes, stamping);
        let slot = self.slot(&reader);
        let deadline = tokio::time::Instant::now()
            + Duration::from_millis(request.max_wait_ms.into()).min(MAX_WAIT);
        let mut appends = self.storage.appends(&reader.topic);
        let mut attaches = None;
        loop {
            if let Some(appends) = appends.as_mut() {
                // What is appended from here on wakes the wait below.
                appends.borrow_and_update();
            }
            let polled_at = tokio::time::Instant::now();
            let batch = {
                let mut held = slot.lock().await;
                held.check(&reader, request.generation)?;
                held.last_used = tokio::time::Instant::now();
                // Taken under the lock an Attach needs: an attach from here on wakes the wait.
                attaches.get_or_insert_with(|| held.attaches.subscribe());
                self.poll_counted(&reader, &selection, limits).await?
            };
            if !batch.records.is_empty() {
                crash_point(CrashPoint::AfterPull);
            }
            if !batch.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(Response::new(to_response(batch)));
            }
            match (appends.as_mut(), attaches.as_mut()) {
                (Some(appends), Some(attaches)) => {
                    let until = deadline.min(tokio::time::Instant::now() + SIGNALLED_LOOK_AGAIN);
                    wait_for_signal(appends, attaches, until).await;
                }
                _ if self.waited_in_backend(polled_at.elapsed()) => {}
                _ => {
                    let until = deadline.min(tokio::time::Instant::now() + IDLE_POLL);
                    tokio::time::sleep_until(until).await;
                }
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
            let mut credits: BTreeMap<ReaderKey, StreamReader> = BTreeMap::new();
            let mut idle = false;
            // How long the last round of polls took (an empty round that waited inside the
            // backend needs no look-again timer).
            let mut round_took = Duration::ZERO;
            loop {
                let has_credit = credits.values().any(|r| r.credit > 0);
                let pause = if idle && !service.waited_in_backend(round_took) {
                    IDLE_POLL
                } else {
                    Duration::ZERO
                };
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
                        let round_started = tokio::time::Instant::now();
                        for (reader, open) in credits.iter_mut().filter(|(_, r)| r.credit > 0) {
                            let limits = PollLimits {
                                max_records: (open.credit as usize).min(service.limits.max_records),
                                ..service.limits
                            };
                            let batch = match service.stream_poll(reader, open, limits).await {
                                Ok(batch) => batch,
                                Err(status) => {
                                    let _ = tx.send(Err(status)).await;
                                    return;
                                }
                            };
                            if batch.is_empty() {
                                continue;
                            }
                            idle = false;
                            open.credit -= batch.records.len().min(open.credit as usize) as u32;
                            let response = pb::PullStreamResponse {
                                reader: Some(to_group_topic(reader)),
                                batch: Some(to_response(batch)),
                            };
                            if tx.send(Ok(response)).await.is_err() {
                                return;
                            }
                        }
                        round_took = round_started.elapsed();
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
        let readers = request
            .entries
            .iter()
            .enumerate()
            .map(|(i, entry)| parse_reader(&format!("entries[{i}].reader"), entry.reader.as_ref()))
            .collect::<Result<Vec<_>, FieldError>>()?;
        // Broker ACKs are one round trip each: sent concurrently (answers keep entry order).
        let storage = &self.storage;
        let entries = readers
            .into_iter()
            .zip(request.entries.into_iter().map(|entry| entry.ack_key));
        let results = futures::stream::iter(entries)
            .map(|(reader, ack_key)| async move {
                let (outcome, detail) = match storage.ack_pulled(&reader, &ack_key).await {
                    Ok(AckPulledOutcome::Acked) => (pb::AckPulledOutcome::Acked, String::new()),
                    Ok(AckPulledOutcome::NotApplicable) => {
                        (pb::AckPulledOutcome::NotApplicable, String::new())
                    }
                    Ok(AckPulledOutcome::UnknownKey) => (
                        pb::AckPulledOutcome::UnknownKey,
                        "unknown ack key; the broker redelivers after its invisible time"
                            .to_owned(),
                    ),
                    Err(err) => (pb::AckPulledOutcome::Failed, err.to_string()),
                };
                pb::AckPulledResult {
                    outcome: outcome as i32,
                    detail,
                }
            })
            .buffered(ACKS_IN_FLIGHT)
            .collect::<Vec<_>>()
            .await;
        Ok(Response::new(pb::AckPulledResponse { results }))
    }

    #[instrument(skip_all, fields(topic = %request.get_ref().topic))]
    async fn create_topic(
        &self,
        request: Request<pb::CreateTopicRequest>,
    ) -> Result<Response<pb::CreateTopicResponse>, Status> {
        let request = request.into_inner();
        let topic = parse_topic("topic", &request.topic)?;
        self.storage.check_topic_name(&topic)?;
        if request.implicit && !self.auto_create_topics {
            return match self.storage.partition_count(&topic).await {
                Ok(partitions) => Ok(Response::new(pb::CreateTopicResponse {
                    created: false,
                    partitions,
                })),
                Err(crate::storage::StorageError::UnknownTopic(_)) => {
                    Err(Status::not_found(format!(
                        "topic {topic} does not exist, and puller-svc creates topics only when asked explicitly (auto_create_topics is off): create it first"
                    )))
                }
                Err(err) => Err(err.into()),
            };
        }
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
            .pull_lite(
                &reader,
                &request.lite,
                self.limits(request.max_records, 0, Stamping::Every),
            )
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

    async fn describe_broker_storage(
        &self,
        request: Request<pb::DescribeBrokerStorageRequest>,
    ) -> Result<Response<pb::DescribeBrokerStorageResponse>, Status> {
        let topic = parse_topic("topic", &request.get_ref().topic)?;
        let report = self.storage.describe_broker_storage(&topic).await?;
        Ok(Response::new(pb::DescribeBrokerStorageResponse {
            backend: self.storage.backend().to_owned(),
            brokers: report
                .brokers
                .into_iter()
                .map(|b| pb::BrokerStorage {
                    broker: b.broker,
                    address: b.address,
                    commit_log_min_offset: b.commit_log_min_offset,
                    commit_log_max_offset: b.commit_log_max_offset,
                    file_reserved_hours: b.file_reserved_hours.unwrap_or(-1),
                    delete_when: b.delete_when.unwrap_or_default(),
                    commit_log_disk_ratio: b.commit_log_disk_ratio.unwrap_or(-1.0),
                })
                .collect(),
            queues: report
                .queues
                .into_iter()
                .map(|q| pb::QueueStorage {
                    partition: q.partition.to_string(),
                    min_offset: q.min_offset,
                    max_offset: q.max_offset,
                    min_entry_commit_log_offset: q.min_entry_commit_log_offset.unwrap_or(-1),
                })
                .collect(),
        }))
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

/// One reader open on a PullStream.
struct StreamReader {
    /// Records it may still be pushed.
    credit: u32,
    /// The generation it was opened with.
    generation: u64,
    /// Where each positioned partition continues (empty: the reader's cursors).
    positions: BTreeMap<PartitionId, i64>,
}

impl PullerGrpc {
    /// One read from the backend; a failed one, and each partition that failed in a batch
    /// the others filled, counts in `puller_pull_errors_total{backend}` (an operator's signal
    /// that the MQ is failing reads while the Pull answers an error or leaves a partition
    /// behind).
    async fn poll_counted(
        &self,
        reader: &ReaderKey,
        selection: &Selection,
        limits: PollLimits,
    ) -> Result<PolledBatch, crate::storage::StorageError> {
        let polled = self.storage.poll(reader, selection, limits).await;
        let errors = match &polled {
            Ok(batch) => u64::from(batch.failed_partitions),
            Err(_) => 1,
        };
        if errors > 0 {
            metrics::counter!("puller_pull_errors_total", "backend" => self.storage.backend())
                .increment(errors);
        }
        polled
    }

    /// One poll of a streamed reader under its lock; positioned partitions continue where the
    /// batch ended.
    async fn stream_poll(
        &self,
        reader: &ReaderKey,
        open: &mut StreamReader,
        limits: PollLimits,
    ) -> Result<PolledBatch, Status> {
        let slot = self.slot(reader);
        let mut held = slot.lock().await;
        held.check(reader, open.generation)?;
        held.last_used = tokio::time::Instant::now();
        let selection = Selection::of(None, open.positions.clone());
        let batch = self.poll_counted(reader, &selection, limits).await?;
        for range in &batch.ranges {
            if let Some(next) = open.positions.get_mut(&range.partition) {
                *next = range.next;
            }
        }
        Ok(batch)
    }

    /// Handles one message of a PullStream.
    async fn stream_message(
        &self,
        message: pb::PullStreamRequest,
        credits: &mut BTreeMap<ReaderKey, StreamReader>,
    ) -> Result<(), Status> {
        use pb::pull_stream_request::Kind;
        match message.kind {
            Some(Kind::Open(open)) => {
                let reader = parse_reader("open.reader", open.reader.as_ref())?;
                self.slot(&reader)
                    .lock()
                    .await
                    .check(&reader, open.generation)?;
                let positions = parse_positions("open.positions", &open.positions)?;
                credits.insert(
                    reader,
                    StreamReader {
                        credit: 0,
                        generation: open.generation,
                        positions,
                    },
                );
            }
            Some(Kind::OpenReader(_)) => {
                return Err(Status::failed_precondition(
                    "open_reader carries no generation; readers are fenced: Attach, then send `open` with the generation",
                ));
            }
            Some(Kind::CloseReader(reader)) => {
                credits.remove(&parse_reader("close_reader", Some(&reader))?);
            }
            Some(Kind::Credit(credit)) => {
                let reader = parse_reader("credit.reader", credit.reader.as_ref())?;
                let open = credits.get_mut(&reader).ok_or_else(|| {
                    Status::failed_precondition("credit for a reader that is not open")
                })?;
                open.credit = open.credit.saturating_add(credit.records);
            }
            None => return Err(Status::invalid_argument("empty PullStreamRequest")),
        }
        Ok(())
    }
}

/// One record of a publish batch, checked as `Publish` checks its request.
fn check_batch_record(index: usize, record: pb::BatchRecord) -> Result<NewRecord, Status> {
    let partition = parse_partition(&format!("records[{index}].partition"), &record.partition)?;
    check_key(&format!("records[{index}].key"), &record.key)?;
    Ok(NewRecord {
        key: record.key,
        body: record.body,
        partition,
    })
}

/// Refuses a record key over the limit.
fn check_key(field: &str, key: &[u8]) -> Result<(), FieldError> {
    if key.len() > grpc::MAX_RECORD_KEY_BYTES {
        return Err(FieldError::new(
            field,
            format!(
                "{} bytes, more than {}",
                key.len(),
                grpc::MAX_RECORD_KEY_BYTES
            ),
        ));
    }
    Ok(())
}

/// The answer for a record of a batch that was not stored.
fn refused_outcome(status: &Status) -> pb::RecordOutcome {
    pb::RecordOutcome {
        partition: String::new(),
        offset: -1,
        error: Some(pb::RecordError {
            code: status.code() as i32,
            message: status.message().to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use tokio::sync::watch;
    use tokio::time::Instant;

    use super::wait_for_signal;

    /// Far beyond any test's patience: a wait that returns was woken by a signal.
    const NEVER: Duration = Duration::from_secs(3600);

    async fn woken_by(signal: impl FnOnce(&watch::Sender<u64>, &watch::Sender<()>)) {
        let (appended, mut appends) = watch::channel(0);
        let (attached, mut attaches) = watch::channel(());
        let until = Instant::now() + NEVER;
        let waiting = tokio::spawn(async move {
            wait_for_signal(&mut appends, &mut attaches, until).await;
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        signal(&appended, &attached);
        tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("the signal woke the wait")
            .unwrap();
    }

    #[tokio::test]
    async fn an_append_wakes_a_waiting_long_poll() {
        woken_by(|appended, _| appended.send_modify(|n| *n += 1)).await;
    }

    #[tokio::test]
    async fn an_attach_wakes_a_waiting_long_poll() {
        woken_by(|_, attached| {
            attached.send_replace(());
        })
        .await;
    }

    #[tokio::test]
    async fn signals_whose_senders_are_gone_wait_for_the_timer_instead_of_spinning() {
        let (appended, mut appends) = watch::channel(0);
        let (attached, mut attaches) = watch::channel(());
        drop((appended, attached));
        let started = Instant::now();
        let wait = Duration::from_millis(50);
        wait_for_signal(&mut appends, &mut attaches, started + wait).await;
        assert!(
            started.elapsed() >= wait,
            "returned after {:?}",
            started.elapsed()
        );
    }
}
