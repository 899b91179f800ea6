//! The client-facing `eventmesh.v1.EventMeshService` (DESIGN §9).
//!
//! `Subscribe` is one session: the first message must be `open` (validated: client id, topic,
//! group, mode, start, in-flight limit); the session then joins its group and two things run
//! until the stream ends — deliveries and results flow out, ACK / NACK / Extend flow in. Each
//! delivery id in a client message is answered by exactly one AckResult (a malformed, foreign
//! or unknown id is answered UNKNOWN and never breaks the stream); an id is routed to the group
//! that issued it, so a client may settle on any of its sessions. A delivery counts as written
//! — its ACK clock starts — when the response stream hands it to the transport.
//!
//! Back-pressure: a session's outgoing queue only grows by deliveries (bounded by its in-flight
//! limit) and by the results of the client message being handled; while the client does not
//! read, the session stops reading the client's messages too.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use eventmesh_common::grpc::InternalChannel;
use eventmesh_common::keys::{ClientId, GroupName, Topic};
use eventmesh_common::probe::{self, Stage};
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_common::status::FieldError;
use eventmesh_common::trace_context::{self, Operation, TRACEPARENT, entry_span};
use eventmesh_proto::DRAINING_METADATA;
use eventmesh_proto::client as pb;
use eventmesh_proto::client::{
    AckOutcome, StartPosition, SubscribeRequest, SubscriptionMode, subscribe_request,
};
use eventmesh_proto::encoded::server::event_mesh_service_server::EventMeshService;
use eventmesh_proto::encoded::{PublishBatchRequestIn, SubscribeRequestIn, SubscribeResponseBytes};
use eventmesh_proto::puller::PublishBatchRequest as PullerPublishBatch;
use eventmesh_proto::puller::PublishRequest as PullerPublish;
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use futures::Stream;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::cluster::load::Asker;
use crate::delivery_id::DeliveryId;
use crate::error::DispatcherError;
use crate::event::{PublishedEvent, encode_published};
use crate::group::{Answer, AnsweredId, Credits, GroupCmd, Outbound, SessionLink, SettleOp};
use crate::published::read_entry;
use crate::registry::{GroupKey, Shared};
use crate::responses::Responses;

/// Responses buffered per session between the session task and the transport.
const RESPONSE_BUFFER: usize = 64;

/// The service.
#[derive(Clone)]
pub struct EventMeshGrpc {
    shared: Arc<Shared>,
    advertise: String,
    shutdown: CancellationToken,
}

impl EventMeshGrpc {
    /// Serves over `shared`; `advertise` is the address Recommend answers with.
    pub fn new(shared: Arc<Shared>, advertise: String, shutdown: CancellationToken) -> Self {
        EventMeshGrpc {
            shared,
            advertise,
            shutdown,
        }
    }

    /// Sends a publish to the puller; on NOT_FOUND creates the topic (idempotent, nothing was
    /// stored) and sends once more.
    async fn publish_creating_topic<T, F, Fut>(
        &self,
        topic: &Topic,
        mut send: F,
    ) -> Result<T, DispatcherError>
    where
        F: FnMut(PullerServiceClient<InternalChannel>) -> Fut,
        Fut: std::future::Future<Output = Result<Response<T>, Status>>,
    {
        let puller = self.shared.puller();
        let puller_error = |status| DispatcherError::dependency("puller-svc", status);
        match send(puller.clone()).await {
            Err(status) if status.code() == tonic::Code::NotFound => {
                puller
                    .clone()
                    .create_topic(eventmesh_proto::puller::CreateTopicRequest {
                        topic: topic.to_string(),
                        partitions: 0,
                        implicit: true,
                    })
                    .await
                    .map_err(puller_error)?;
                send(puller).await
            }
            other => other,
        }
        .map(Response::into_inner)
        .map_err(puller_error)
    }
}

/// An event checked and encoded for the puller.
struct PreparedPublish {
    record: eventmesh_proto::puller::BatchRecord,
    event_id: String,
}

/// Checks a publish's key and event and encodes the event (an empty event id is generated).
fn prepare_publish(
    key: Bytes,
    event: Option<PublishedEvent<'_>>,
) -> Result<PreparedPublish, DispatcherError> {
    let max_key = eventmesh_common::grpc::MAX_RECORD_KEY_BYTES;
    if key.len() > max_key {
        return Err(DispatcherError::invalid(
            "key",
            format!("{} bytes, more than {max_key}", key.len()),
        ));
    }
    let event = event.ok_or_else(|| DispatcherError::invalid("event", "required"))?;
    let (body, event_id) = encode_published(event)?;
    Ok(PreparedPublish {
        record: eventmesh_proto::puller::BatchRecord {
            body,
            key,
            partition: String::new(),
        },
        event_id: event_id.into_owned(),
    })
}

/// Gives each event published without a trace context the publish span's (when sampled), so
/// its later hops join the publish's trace; a producer's own context is never replaced.
fn stamp_trace<'a>(traceparent: Option<&'a str>, event: Option<&mut PublishedEvent<'a>>) {
    if let (Some(traceparent), Some(event)) = (traceparent, event) {
        event.carry_traceparent(traceparent);
    }
}

/// The answer for an event of a batch that was not stored.
fn publish_error(code: tonic::Code, message: String, event_id: String) -> pb::PublishOutcome {
    pb::PublishOutcome {
        outcome: Some(pb::publish_outcome::Outcome::Error(pb::PublishError {
            code: code as i32,
            message,
            event_id,
        })),
    }
}

/// A validated Open.
#[derive(Debug)]
pub struct OpenSession {
    /// The client.
    pub client: ClientId,
    /// Its group.
    pub key: GroupKey,
    /// Where a new group starts.
    pub start: StartPosition,
    /// The in-flight limit in force.
    pub max_in_flight: u32,
}

/// Validates an Open against the settings.
pub fn validate_open(
    open: &pb::Open,
    default_max_in_flight: u32,
    max_in_flight_limit: u32,
) -> Result<OpenSession, FieldError> {
    let client =
        ClientId::new(open.client_id.clone()).map_err(|e| FieldError::new("open.client_id", e))?;
    let topic = Topic::new(open.topic.clone()).map_err(|e| FieldError::new("open.topic", e))?;
    let mode = SubscriptionMode::try_from(open.mode)
        .map_err(|_| FieldError::new("open.mode", format!("unknown mode {}", open.mode)))?;
    let group = match mode {
        SubscriptionMode::Broadcast => Some(GroupName::broadcast(&open.client_id).map_err(|e| {
            FieldError::new(
                "open.client_id",
                format!(
                    "BROADCAST gives the client a group of its own named after its id, which must follow the group-name rule: {e}"
                ),
            )
        })?),
        SubscriptionMode::LoadBalance | SubscriptionMode::Unspecified => {
            if open.group.is_empty() {
                None
            } else {
                Some(
                    GroupName::named(open.group.clone())
                        .map_err(|e| FieldError::new("open.group", e))?,
                )
            }
        }
    };
    let start = StartPosition::try_from(open.start)
        .map_err(|_| FieldError::new("open.start", format!("unknown start {}", open.start)))?;
    let max_in_flight = match open.max_in_flight {
        0 => default_max_in_flight,
        n => n.min(max_in_flight_limit),
    };
    Ok(OpenSession {
        client,
        key: GroupKey { topic, group },
        start,
        max_in_flight,
    })
}

/// The group a Recommend names: none without a topic; the default group for an empty name; a
/// BROADCAST group as `~<client id>`.
fn recommend_group(topic: &str, group: &str) -> Result<Option<GroupKey>, FieldError> {
    if topic.is_empty() {
        return Ok(None);
    }
    let topic = Topic::new(topic.to_owned()).map_err(|e| FieldError::new("topic", e))?;
    let group = if group.is_empty() {
        None
    } else if let Some(client) = group.strip_prefix('~') {
        Some(GroupName::broadcast(client).map_err(|e| FieldError::new("group", e))?)
    } else {
        Some(GroupName::named(group.to_owned()).map_err(|e| FieldError::new("group", e))?)
    };
    Ok(Some(GroupKey { topic, group }))
}

type SubscribeStream = Pin<Box<dyn Stream<Item = Result<SubscribeResponseBytes, Status>> + Send>>;

#[tonic::async_trait]
impl EventMeshService for EventMeshGrpc {
    async fn recommend(
        &self,
        request: Request<pb::RecommendRequest>,
    ) -> Result<Response<pb::RecommendResponse>, Status> {
        let request = request.into_inner();
        if !request.client_id.is_empty() {
            ClientId::new(request.client_id.clone())
                .map_err(|e| FieldError::new("client_id", e))?;
        }
        let group = recommend_group(&request.topic, &request.group)?;
        let myself = || pb::RecommendResponse {
            address: self.advertise.clone(),
            instance_id: self.shared.instance_id.clone(),
        };
        // Single-node default (DESIGN §8): without a cluster registry this instance answers
        // with itself, even when excluded — there is nowhere else to go. With one, the answer
        // comes from the watch-fed view (itself while that view is still empty).
        let Some(cluster) = &self.shared.cluster else {
            return Ok(Response::new(myself()));
        };
        let label = group.as_ref().map(GroupKey::label).unwrap_or_default();
        let asker = Asker {
            client: &request.client_id,
            topic: &request.topic,
            group: &label,
        };
        let answer = cluster
            .recommend(asker, group.as_ref(), &request.exclude)
            .map_or_else(myself, |(instance_id, address)| pb::RecommendResponse {
                address,
                instance_id,
            });
        Ok(Response::new(answer))
    }

    #[tracing::instrument(skip_all, fields(messaging.destination.name = %request.get_ref().topic))]
    async fn publish(
        &self,
        request: Request<pb::PublishRequest>,
    ) -> Result<Response<pb::PublishResponse>, Status> {
        let _in_progress = self.shared.publishes.try_enter()?;
        let lone_trace = request
            .get_ref()
            .event
            .as_ref()
            .and_then(|event| event.attributes.get(TRACEPARENT))
            .map(String::as_str);
        let span = entry_span(
            &request,
            lone_trace,
            Operation::PUBLISH,
            &request.get_ref().topic,
        );
        let request = request.into_inner();
        let topic = Topic::new(request.topic).map_err(|e| FieldError::new("topic", e))?;
        let traceparent = trace_context::sampled_traceparent(&span);
        let mut event = request.event.as_ref().map(PublishedEvent::of);
        stamp_trace(traceparent.as_deref(), event.as_mut());
        let prepared = prepare_publish(request.key.into_bytes().into(), event)?;
        let published_bytes = prepared.record.body.len();
        let event_id = prepared.event_id;
        let publish = PullerPublish {
            topic: topic.to_string(),
            body: prepared.record.body,
            key: prepared.record.key,
            partition: String::new(),
        };
        let stored = self
            .publish_creating_topic(&topic, |mut puller| {
                let publish = publish.clone();
                async move { puller.publish(publish).await }
            })
            .instrument(span.clone())
            .await?;
        span.record("messaging.message.id", event_id.as_str());
        span.record(
            "messaging.destination.partition.id",
            stored.partition.as_str(),
        );
        span.record("eventmesh.offset", stored.offset);
        metrics::counter!("dispatcher_published_total").increment(1);
        self.shared.meter.published(published_bytes);
        Ok(Response::new(pb::PublishResponse {
            partition: stored.partition,
            offset: stored.offset,
            event_id,
        }))
    }

    async fn publish_batch(
        &self,
        request: Request<PublishBatchRequestIn>,
    ) -> Result<Response<pb::PublishBatchResponse>, Status> {
        let _in_progress = self.shared.publishes.try_enter()?;
        let span = entry_span(&request, None, Operation::PUBLISH, &request.get_ref().topic);
        span.record(
            "messaging.batch.message_count",
            request.get_ref().entries.len() as u64,
        );
        let request = request.into_inner();
        let topic = Topic::new(request.topic).map_err(|e| FieldError::new("topic", e))?;
        let max = eventmesh_common::grpc::MAX_PUBLISH_BATCH;
        if request.entries.len() > max {
            return Err(DispatcherError::invalid(
                "entries",
                format!("{} events, more than {max}", request.entries.len()),
            )
            .into());
        }
        let traceparent = trace_context::sampled_traceparent(&span);
        // Bad events are answered here; the others go to the puller as one batch and their
        // answers are put back in request order.
        let mut outcomes: Vec<Option<pb::PublishOutcome>> = vec![None; request.entries.len()];
        let mut records = Vec::with_capacity(request.entries.len());
        // For each record sent: its entry and event id.
        let mut sent = Vec::with_capacity(request.entries.len());
        let mut published_bytes = 0;
        for (i, entry) in request.entries.iter().enumerate() {
            // Read in place: the event's fields and key are slices of the received entry. The
            // key is copied (short, most often empty), so nothing sent keeps the request alive.
            let prepared = read_entry(entry).and_then(|mut read| {
                stamp_trace(traceparent.as_deref(), read.event.as_mut());
                prepare_publish(Bytes::copy_from_slice(read.key.as_bytes()), read.event)
            });
            match prepared {
                Ok(prepared) => {
                    published_bytes += prepared.record.body.len();
                    records.push(prepared.record);
                    sent.push((i, prepared.event_id));
                }
                Err(error) => {
                    let status = Status::from(error);
                    outcomes[i] = Some(publish_error(
                        status.code(),
                        format!("entries[{i}].{}", status.message()),
                        String::new(),
                    ));
                }
            }
        }
        // Every frame is written: the request's bytes are not held over the MQ's round trip.
        drop(request.entries);
        if !records.is_empty() {
            let batch = PullerPublishBatch {
                topic: topic.to_string(),
                records,
            };
            let answered = self
                .publish_creating_topic(&topic, |mut puller| {
                    let batch = batch.clone();
                    async move { puller.publish_batch(batch).await }
                })
                .instrument(span)
                .await?;
            if answered.outcomes.len() != sent.len() {
                return Err(DispatcherError::dependency(
                    "puller-svc",
                    Status::internal(format!(
                        "{} answers to a batch of {}",
                        answered.outcomes.len(),
                        sent.len()
                    )),
                )
                .into());
            }
            let mut stored = 0;
            for ((i, event_id), outcome) in sent.into_iter().zip(answered.outcomes) {
                outcomes[i] = Some(match outcome.error {
                    None => {
                        stored += 1;
                        pb::PublishOutcome {
                            outcome: Some(pb::publish_outcome::Outcome::Stored(
                                pb::PublishResponse {
                                    partition: outcome.partition,
                                    offset: outcome.offset,
                                    event_id,
                                },
                            )),
                        }
                    }
                    Some(refused) => publish_error(
                        tonic::Code::from(refused.code),
                        format!("entries[{i}]: {}", refused.message),
                        event_id,
                    ),
                });
            }
            metrics::counter!("dispatcher_published_total").increment(stored);
            self.shared.meter.published(published_bytes);
        }
        Ok(Response::new(pb::PublishBatchResponse {
            outcomes: outcomes
                .into_iter()
                .map(|outcome| {
                    outcome.unwrap_or_else(|| {
                        publish_error(tonic::Code::Internal, "not answered".into(), String::new())
                    })
                })
                .collect(),
        }))
    }

    type SubscribeStream = SubscribeStream;

    async fn subscribe(
        &self,
        request: Request<Streaming<SubscribeRequestIn>>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        // One slot per stream of this connection, held for the session's life.
        let stream_slot = request
            .remote_addr()
            .map(|peer| self.shared.connection_streams.open(peer))
            .transpose()?;
        let mut inbound = request.into_inner();
        let open = match inbound.message().await? {
            Some(SubscribeRequestIn::Other(SubscribeRequest {
                kind: Some(subscribe_request::Kind::Open(open)),
            })) => open,
            Some(_) => {
                return Err(Status::failed_precondition(
                    "the first message of a Subscribe stream must be open",
                ));
            }
            None => {
                return Err(Status::invalid_argument(
                    "the stream ended before an open message",
                ));
            }
        };
        let settings = &self.shared.settings;
        let session = validate_open(
            &open,
            settings.default_max_in_flight,
            settings.max_in_flight_limit,
        )?;
        let session_id = self.shared.next_session_id();
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        // ACK answers travel apart from deliveries, so they overtake the deliveries waiting
        // for this client to read (see SessionTask::run).
        let (answers_tx, answers_rx) = mpsc::unbounded_channel();
        let link = SessionLink {
            id: session_id,
            client: session.client.clone(),
            out: out_tx.clone(),
            credits: Arc::new(Credits::new(session.max_in_flight)),
        };
        let client = session.client.as_str();
        let limit = settings.max_sessions_per_client;
        self.shared
            .meter
            .try_session_opened(client, limit)
            .map_err(|open| {
                Status::resource_exhausted(format!(
                    "client {client:?} already has {open} open sessions on this instance (limit {limit}, max_sessions_per_client)"
                ))
            })?;
        let membership = match self
            .shared
            .join(session.key.clone(), session.start, link)
            .await
        {
            Ok(membership) => membership,
            Err(err) => {
                self.shared.meter.session_closed(client);
                return Err(err.into());
            }
        };
        let span = tracing::info_span!("session", session = session_id, client = %session.client, group = %session.key);
        tracing::info!(parent: &span, max_in_flight = session.max_in_flight, "session opened");
        let (responses, response_rx) = mpsc::channel(RESPONSE_BUFFER);
        let (answers_out, answers_out_rx) = mpsc::channel(RESPONSE_BUFFER);
        let topic = session.key.topic.clone();
        let opened = pb::Opened {
            session_id: format!("{:x}.{session_id:x}", self.shared.epoch),
            group: session.key.label(),
            instance_id: self.shared.instance_id.clone(),
            max_in_flight: session.max_in_flight,
        };
        let task = SessionTask {
            shared: Arc::clone(&self.shared),
            client: session.client,
            answers: answers_tx,
            _deliveries: out_tx,
            answers_out,
            responses,
            shards: membership.group().shards.len(),
        };
        // The session leaves its group when its task ends, however it ends.
        let shutdown = self.shutdown.clone();
        let meter = Arc::clone(&self.shared.meter);
        tokio::spawn(
            async move {
                task.run(inbound, out_rx, answers_rx, shutdown).await;
                drop(stream_slot);
                meter.session_closed(task.client.as_str());
                drop(membership);
                tracing::info!("session closed");
            }
            .instrument(span),
        );
        let stream = Responses::new(
            opened,
            answers_out_rx,
            response_rx,
            session_id,
            topic,
            settings.ack_timeout(),
            Arc::clone(&self.shared.meter),
        );
        Ok(Response::new(Box::pin(stream)))
    }
}

struct SessionTask {
    shared: Arc<Shared>,
    client: ClientId,
    /// Where the answers to this session's ACKs, NACKs and Extends go (`reply_to`).
    answers: mpsc::UnboundedSender<Outbound>,
    /// Keeps the channel of deliveries open while the session lives: a group that drops its
    /// link ends the session by its `End`, not by closing the channel.
    _deliveries: mpsc::UnboundedSender<Outbound>,
    /// To the response stream: answers, which it sends ahead of `responses`.
    answers_out: mpsc::Sender<Outbound>,
    /// To the response stream: deliveries and the stream's `End`.
    responses: mpsc::Sender<Outbound>,
    /// Shards of its group: a drain ends the session once every one of them said so.
    shards: usize,
}

impl SessionTask {
    async fn run(
        &self,
        mut inbound: Streaming<SubscribeRequestIn>,
        mut out_rx: mpsc::UnboundedReceiver<Outbound>,
        mut answers_rx: mpsc::UnboundedReceiver<Outbound>,
        shutdown: CancellationToken,
    ) {
        let mut drain_until = None;
        let mut drained_shards = 0;
        // What the groups sent that waits for room in the response stream's queue. While it
        // waits the client's requests are still read (its ACKs settle and get answered
        // meanwhile); nothing more is taken from the groups.
        let mut staged: Option<Outbound> = None;
        loop {
            // In this order: a stop; then ACK answers, into the stream's answers queue, which
            // it sends ahead of the deliveries waiting in its other queue or here (up to the
            // session's in-flight limit of them) — an answer never waits for the client to
            // read deliveries sent after it was decided; then the client's requests; then
            // deliveries. An answer decided before a group's `End` is forwarded before it.
            tokio::select! {
                biased;
                // A graceful stop: the group delivers nothing new and ends this stream with
                // the draining status once what it sent is ACKed and durable; this stream keeps
                // carrying ACKs and their answers until then, or until the drain window ends.
                () = shutdown.cancelled(), if drain_until.is_none() => {
                    drain_until = Some(std::time::Instant::now() + self.shared.settings.drain());
                }
                () = crate::group::sleep_until(drain_until) => {
                    let _ = self.responses.send(Outbound::End(Status::unavailable("the instance is shutting down and the drain window ended before every delivery of this session was ACKed and durable (those come again); reconnect (Recommend names another instance)"))).await;
                    return;
                }
                answer = answers_rx.recv() => {
                    let Some(answer) = answer else { return };
                    if self.answers_out.send(answer).await.is_err() {
                        return;
                    }
                }
                message = inbound.message() => match message {
                    Ok(Some(message)) => {
                        if let Err(status) = self.handle(message) {
                            let _ = self.responses.send(Outbound::End(status)).await;
                            return;
                        }
                    }
                    Ok(None) => return,
                    Err(status) => {
                        tracing::debug!(code = ?status.code(), message = status.message(), "client stream broke");
                        return;
                    }
                },
                permit = self.responses.reserve(), if staged.is_some() => {
                    // Waits while the client does not read: then its messages are read only as
                    // far as their answers fit, which bounds what it can make us queue.
                    let (Ok(permit), Some(outbound)) = (permit, staged.take()) else { return };
                    let ends = matches!(outbound, Outbound::End(_));
                    permit.send(outbound);
                    if ends {
                        return;
                    }
                }
                outbound = out_rx.recv(), if staged.is_none() => {
                    let Some(outbound) = outbound else { return };
                    // A drained shard has nothing of this session left unsettled; the session
                    // moves once every shard of its group is drained (the others may still
                    // wait for its ACKs).
                    if let Outbound::End(status) = &outbound
                        && status.metadata().get(DRAINING_METADATA).is_some()
                    {
                        drained_shards += 1;
                        if drained_shards < self.shards {
                            continue;
                        }
                    }
                    let ends = matches!(outbound, Outbound::End(_));
                    if ends {
                        // Answers the group sent before its `End` are all here by now (it sent
                        // them first): they go out before the stream ends.
                        while let Ok(answer) = answers_rx.try_recv() {
                            if self.answers_out.send(answer).await.is_err() {
                                return;
                            }
                        }
                    }
                    staged = Some(outbound);
                }
            }
        }
    }

    fn handle(&self, message: SubscribeRequestIn) -> Result<(), Status> {
        let kind = match message {
            SubscribeRequestIn::Ack(ids) => {
                self.route(ids, SettleOp::Ack);
                return Ok(());
            }
            SubscribeRequestIn::Other(request) => request.kind,
        };
        match kind {
            // Read as `SubscribeRequestIn::Ack` above; here only if a caller built it so.
            Some(subscribe_request::Kind::Ack(ack)) => {
                self.route(ack.delivery_ids.into_iter().map(Bytes::from), SettleOp::Ack);
            }
            Some(subscribe_request::Kind::Nack(nack)) => {
                let delay =
                    (nack.delay_ms > 0).then(|| Duration::from_millis(nack.delay_ms.into()));
                self.route([Bytes::from(nack.delivery_id)], SettleOp::Nack(delay));
            }
            Some(subscribe_request::Kind::Extend(extend)) => {
                let extra = Duration::from_millis(extend.extra_ms.into());
                self.route([Bytes::from(extend.delivery_id)], SettleOp::Extend(extra));
            }
            Some(subscribe_request::Kind::Open(_)) => {
                return Err(Status::failed_precondition(
                    "open may only be the first message of a Subscribe stream",
                ));
            }
            None => {
                return Err(Status::invalid_argument("empty SubscribeRequest"));
            }
        }
        Ok(())
    }

    /// Sends requests about deliveries to the group shards that issued them, one command per
    /// run of ids of one shard (one client message's ACKs nearly always make one run), and
    /// answers UNKNOWN for the ids no live group here issued (or that are not text).
    fn route(&self, raw_ids: impl IntoIterator<Item = Bytes>, op: SettleOp) {
        /// Consecutive ids of one group shard.
        struct Run {
            group: u64,
            shard: mpsc::UnboundedSender<GroupCmd>,
            ids: Vec<DeliveryId>,
        }
        let settle = |run: Run| {
            let _ = run.shard.send(GroupCmd::Settle {
                op,
                ids: run.ids,
                client: self.client.clone(),
                reply_to: self.answers.clone(),
            });
        };
        let mut run: Option<Run> = None;
        for raw_id in raw_ids {
            let Some(id) = std::str::from_utf8(&raw_id)
                .ok()
                .and_then(DeliveryId::parse)
            else {
                self.unknown(raw_id, "malformed delivery id");
                continue;
            };
            probe::mark(Stage::AckRead, id.seq);
            if id.epoch != self.shared.epoch {
                self.unknown(raw_id, "not issued by this instance since its last start");
                continue;
            }
            if let Some(run) = &mut run
                && run.group == id.group
            {
                run.ids.push(id);
                continue;
            }
            let Some(shard) = self.shared.shard_by_number(id.group) else {
                self.unknown(raw_id, "its subscription group has ended on this instance");
                continue;
            };
            let next = Run {
                group: id.group,
                shard,
                ids: vec![id],
            };
            if let Some(done) = run.replace(next) {
                settle(done);
            }
        }
        if let Some(done) = run {
            settle(done);
        }
    }

    /// Answers UNKNOWN for a delivery id no live group here issued.
    fn unknown(&self, raw_id: Bytes, detail: &str) {
        metrics::counter!("dispatcher_unknown_delivery_ids_total").increment(1);
        let _ = self.answers.send(Outbound::Results(
            [Answer {
                delivery_id: AnsweredId::Text(String::from_utf8_lossy(&raw_id).into_owned()),
                outcome: AckOutcome::Unknown,
                detail: detail.to_owned(),
            }]
            .into(),
        ));
    }
}
