//! Subscriptions: a stream of [`Delivery`]s that heals itself.
//!
//! A background task owns the gRPC session. It opens it (Recommend → Subscribe → Open →
//! Opened), asking Recommend about its own topic and group, so the answer is the group's home
//! instance in a cluster; an Open refused with the home in the status metadata
//! (`em-home-instance`, `em-home-address`) is followed there, at most [`MAX_HOME_HOPS`] times,
//! and a redirect to the instance just left means the home is moving: back off, ask again.
//! FAILED_PRECONDITION without that metadata is a refusal and ends the subscription. It forwards the deliveries into a channel the [`Subscription`] reads, and sends the
//! application's ACKs, NACKs and extensions, merging every ACK queued at that moment into one
//! `Ack` message. When the session breaks — the stream errors or ends, or keepalive declares a
//! frozen instance dead — it reconnects with backoff, failing over to another instance when the
//! seeds offer one, and re-opens with the same options. What was delivered but not ACKed on the
//! broken session comes back from the server (at-least-once): an ACK of an old delivery sent on
//! the new session is answered UNKNOWN or NOT_OWNED and the redelivery carries the same event id.
//!
//! Memory stays bounded: the server never has more than `max_in_flight` un-ACKed deliveries out
//! on a session, at most that many (1024 for the server's default) wait between the task and
//! the application ([`crate::handoff`], which hands over one message's deliveries at a time),
//! and the task stops reading the stream while it holds deliveries the hand-off has no room
//! for.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use eventmesh_proto::DRAINING_METADATA;
use eventmesh_proto::client as pb;
use eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient;
use eventmesh_proto::client::{subscribe_request, subscribe_response};
use futures::Stream;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tracing::Instrument as _;

use crate::client::{GroupTarget, Inner, Instance, MAX_MESSAGE};
use crate::config::Backoff;
use crate::error::{ClientError, is_transient_status};
use crate::handoff::{self, Giver, Taker};
use crate::otel;

pub use pb::{AckOutcome, StartPosition, SubscriptionMode};

/// Home redirects followed in a row before asking Recommend again.
pub const MAX_HOME_HOPS: usize = 3;

/// The home a FAILED_PRECONDITION names in its metadata, `(instance id, host:port)`.
fn home_redirect(status: &tonic::Status) -> Option<(String, String)> {
    if status.code() != tonic::Code::FailedPrecondition {
        return None;
    }
    let get = |name| {
        status
            .metadata()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
    };
    Some((get("em-home-instance")?, get("em-home-address")?))
}

/// What to subscribe to.
///
/// ```
/// use eventmesh_client::{StartPosition, SubscribeOptions};
/// let options = SubscribeOptions::new("orders")
///     .group("billing")
///     .start(StartPosition::Earliest)
///     .max_in_flight(512);
/// ```
#[derive(Debug, Clone)]
pub struct SubscribeOptions {
    topic: String,
    group: String,
    mode: SubscriptionMode,
    start: StartPosition,
    max_in_flight: u32,
}

impl SubscribeOptions {
    /// LOAD_BALANCE in the topic's default group, the server's default start and in-flight
    /// limit.
    pub fn new(topic: impl Into<String>) -> Self {
        SubscribeOptions {
            topic: topic.into(),
            group: String::new(),
            mode: SubscriptionMode::LoadBalance,
            start: StartPosition::Unspecified,
            max_in_flight: 0,
        }
    }

    /// Joins a named group: its sessions share the topic's messages.
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = group.into();
        self
    }

    /// BROADCAST: this client receives every message (it is its own group).
    pub fn broadcast(mut self) -> Self {
        self.mode = SubscriptionMode::Broadcast;
        self
    }

    /// Where a newly created group starts reading.
    pub fn start(mut self, start: StartPosition) -> Self {
        self.start = start;
        self
    }

    /// Most un-ACKed deliveries held at once (0: the server's default).
    pub fn max_in_flight(mut self, limit: u32) -> Self {
        self.max_in_flight = limit;
        self
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The group Recommend is asked about: BROADCAST is the client's own group `~<client id>`.
    fn target(&self, client_id: &str) -> GroupTarget {
        GroupTarget {
            topic: self.topic.clone(),
            group: match self.mode {
                SubscriptionMode::Broadcast => format!("~{client_id}"),
                _ => self.group.clone(),
            },
        }
    }

    fn open(&self, client_id: &str) -> pb::Open {
        pb::Open {
            client_id: client_id.to_owned(),
            topic: self.topic.clone(),
            group: self.group.clone(),
            mode: self.mode.into(),
            start: self.start.into(),
            max_in_flight: self.max_in_flight,
        }
    }
}

/// One delivered event. ACK it (or NACK it) exactly when the work it asks for is done.
#[derive(Debug)]
pub struct Delivery {
    /// Identifies this delivery; a redelivery by the same instance keeps it.
    pub id: String,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// The topic.
    pub topic: String,
    /// The MQ partition.
    pub partition: String,
    /// The MQ offset in that partition.
    pub offset: i64,
    /// The event; `event.id` is stable across redeliveries and instances.
    pub event: pb::Event,
    /// The record's ordering key in the MQ (the publish key, a Kafka record key); empty when
    /// it has none.
    pub key: bytes::Bytes,
    /// When the server redelivers unless ACKed or extended (ms since the Unix epoch).
    pub ack_deadline_unix_ms: i64,
    /// The instance that made this delivery: only it can settle the ACK. Deliveries of a
    /// session that broke may still be taken after the subscription moved on to another
    /// instance; their ACKs are then answered UNKNOWN and the events come back.
    pub instance_id: Arc<str>,
    commands: mpsc::UnboundedSender<Command>,
    /// The receive span's context (the `otel` feature; `()` without it).
    #[cfg_attr(not(feature = "otel"), allow(dead_code))]
    pub(crate) trace: otel::DeliveryTrace,
}

impl Delivery {
    /// The W3C trace context the event carries (its `traceparent` attribute, the CloudEvents
    /// distributed-tracing extension): the producer's, or the one the runtime's publish span
    /// gave it. Continue the trace from it (e.g. with an OpenTelemetry propagator).
    pub fn traceparent(&self) -> Option<&str> {
        self.event.attributes.get("traceparent").map(String::as_str)
    }

    /// ACKs the delivery. Returns at once; the outcome shows in [`Subscription::stats`] and
    /// [`Subscription::ack_results`]. ACKs queued together travel in one message.
    pub fn ack(&self) {
        let _settle = otel::settle_span(self, false).entered();
        self.send(Command::Ack(self.id.clone(), None));
    }

    /// ACKs and waits for the outcome: DURABLE once the stored progress covers the event, so
    /// no crash can bring it back (a PENDING answer — offset store unavailable — is waited
    /// through), or the no-op outcomes ALREADY_SETTLED, UNKNOWN, NOT_OWNED.
    /// [`ClientError::Interrupted`] when the session broke first (the event will then come
    /// back).
    ///
    /// Stored progress is a gap-free watermark per partition: an ACK above an earlier delivery
    /// of the same partition that is still un-ACKed (by this or another consumer of the group)
    /// is answered once that one is settled too. So do not wait on a later delivery while
    /// holding an earlier one un-ACKed; ACK with [`ack`](Self::ack) and read the outcomes from
    /// [`Subscription::ack_results`] instead.
    pub async fn ack_and_wait(&self) -> Result<AckOutcome, ClientError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Ack(self.id.clone(), Some(tx)));
        rx.instrument(otel::settle_span(self, false))
            .await
            .unwrap_or(Err(ClientError::Closed))
    }

    /// Asks for a redelivery after `delay` (zero: the server's backoff schedule).
    pub fn nack(&self, delay: Duration) {
        let _settle = otel::settle_span(self, true).entered();
        self.send(Command::Nack(self.id.clone(), millis(delay)));
    }

    /// Moves the ACK deadline to `extra` from now.
    pub fn extend(&self, extra: Duration) {
        self.send(Command::Extend(self.id.clone(), millis(extra)));
    }

    fn send(&self, command: Command) {
        // A closed channel means the subscription is gone; the server redelivers.
        let _ = self.commands.send(command);
    }
}

fn millis(duration: Duration) -> u32 {
    u32::try_from(duration.as_millis()).unwrap_or(u32::MAX)
}

/// The server's answer for one delivery id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckResult {
    /// The delivery id as sent.
    pub delivery_id: String,
    /// What happened.
    pub outcome: AckOutcome,
    /// Detail for outcomes other than DURABLE.
    pub detail: String,
}

/// Counters of one subscription since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubscriptionStats {
    /// Deliveries received (every attempt).
    pub delivered: u64,
    /// Of those, attempts after the first.
    pub redelivered: u64,
    /// Delivery ids sent in ACKs.
    pub acks_sent: u64,
    /// ACKs answered DURABLE.
    pub durable: u64,
    /// ACKs answered PENDING (a DURABLE answer follows when the store is back).
    pub pending: u64,
    /// Answers ALREADY_SETTLED, UNKNOWN or NOT_OWNED (no-ops).
    pub no_op: u64,
    /// NACKs and extensions accepted.
    pub nacked_or_extended: u64,
    /// Sessions re-opened after a break.
    pub reconnects: u64,
    /// Sessions a draining instance (a graceful restart) ended after every ACK of theirs was
    /// durable, re-opened elsewhere at once: moves, not failures.
    pub moves: u64,
}

#[derive(Debug, Default)]
struct Counters {
    delivered: AtomicU64,
    redelivered: AtomicU64,
    acks_sent: AtomicU64,
    durable: AtomicU64,
    pending: AtomicU64,
    no_op: AtomicU64,
    nacked_or_extended: AtomicU64,
    reconnects: AtomicU64,
    moves: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> SubscriptionStats {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        SubscriptionStats {
            delivered: get(&self.delivered),
            redelivered: get(&self.redelivered),
            acks_sent: get(&self.acks_sent),
            durable: get(&self.durable),
            pending: get(&self.pending),
            no_op: get(&self.no_op),
            nacked_or_extended: get(&self.nacked_or_extended),
            reconnects: get(&self.reconnects),
            moves: get(&self.moves),
        }
    }

    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The session currently serving a subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    /// The server's session id.
    pub session_id: String,
    /// The group joined.
    pub group: String,
    /// The serving instance.
    pub instance_id: String,
    /// The in-flight limit in force.
    pub max_in_flight: u32,
}

type Waiter = oneshot::Sender<Result<AckOutcome, ClientError>>;

#[derive(Debug)]
enum Command {
    Ack(String, Option<Waiter>),
    Nack(String, u32),
    Extend(String, u32),
}

/// An open subscription: a [`Stream`] of deliveries.
///
/// Dropping it (or [`close`](Self::close)) ends the session; deliveries not ACKed by then come
/// back to the group.
#[derive(Debug)]
pub struct Subscription {
    deliveries: Taker<Delivery>,
    results: Arc<Mutex<Option<mpsc::UnboundedSender<AckResult>>>>,
    counters: Arc<Counters>,
    session: Arc<Mutex<Option<SessionInfo>>>,
    task: Option<tokio::task::JoinHandle<()>>,
    close: Option<oneshot::Sender<()>>,
}

impl Subscription {
    pub(crate) async fn open(
        inner: Arc<Inner>,
        options: SubscribeOptions,
    ) -> Result<Subscription, ClientError> {
        let capacity = match options.max_in_flight {
            0 => 1024,
            n => n as usize,
        };
        let (deliveries_tx, deliveries) = handoff::handoff(capacity);
        let (commands_tx, commands) = mpsc::unbounded_channel();
        let (close, close_rx) = oneshot::channel();
        let (first_tx, first_rx) = oneshot::channel();
        let mut subscription = Subscription {
            deliveries,
            results: Arc::default(),
            counters: Arc::default(),
            session: Arc::default(),
            task: None,
            close: Some(close),
        };
        let session_task = SessionTask {
            inner,
            options,
            deliveries: deliveries_tx,
            commands_tx,
            commands,
            results: Arc::clone(&subscription.results),
            counters: Arc::clone(&subscription.counters),
            session: Arc::clone(&subscription.session),
            waiters: HashMap::new(),
        };
        let task = tokio::spawn(session_task.run(close_rx, first_tx));
        subscription.task = Some(task);
        first_rx.await.unwrap_or(Err(ClientError::Closed))?;
        Ok(subscription)
    }

    /// The next delivery; `None` after the subscription ended. An `Err` item means it cannot
    /// go on (no instance reachable within the retry deadline, or the server refused the
    /// re-open); `None` follows.
    pub async fn next(&mut self) -> Option<Result<Delivery, ClientError>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    /// Every ACK/NACK/Extend answer from now on (DURABLE, PENDING, …), for applications that
    /// track outcomes; call once. Without it only the counters are kept.
    pub fn ack_results(&mut self) -> mpsc::UnboundedReceiver<AckResult> {
        let (tx, rx) = mpsc::unbounded_channel();
        *self.results.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
        rx
    }

    /// Counters since the subscription opened.
    pub fn stats(&self) -> SubscriptionStats {
        self.counters.snapshot()
    }

    /// The session serving the subscription now (`None` while reconnecting).
    pub fn session(&self) -> Option<SessionInfo> {
        self.session
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Ends the session after sending the ACKs already queued.
    pub async fn close(mut self) {
        if let Some(close) = self.close.take() {
            let _ = close.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Stream for Subscription {
    type Item = Result<Delivery, ClientError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut next = self.deliveries.poll_take(cx);
        if let Poll::Ready(Some(Ok(delivery))) = &mut next {
            otel::received(delivery);
        }
        next
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(close) = self.close.take() {
            let _ = close.send(());
        }
    }
}

/// How one session ended.
enum SessionEnd {
    /// The application closed the subscription or dropped it.
    Closed,
    /// The stream broke; reconnect.
    Broken(String),
    /// The instance is draining for a restart and said so (`em-draining`) once every ACK of
    /// the session was durable: reconnect elsewhere at once.
    Moved,
}

struct SessionTask {
    inner: Arc<Inner>,
    options: SubscribeOptions,
    deliveries: Giver<Delivery>,
    commands_tx: mpsc::UnboundedSender<Command>,
    commands: mpsc::UnboundedReceiver<Command>,
    results: Arc<Mutex<Option<mpsc::UnboundedSender<AckResult>>>>,
    counters: Arc<Counters>,
    session: Arc<Mutex<Option<SessionInfo>>>,
    waiters: HashMap<String, Vec<Waiter>>,
}

impl SessionTask {
    async fn run(
        mut self,
        mut close: oneshot::Receiver<()>,
        first: oneshot::Sender<Result<(), ClientError>>,
    ) {
        let mut first = Some(first);
        let mut backoff = Backoff::new(&self.inner.config);
        let mut exclude: Vec<String> = Vec::new();
        loop {
            let opened = tokio::select! {
                _ = &mut close => return,
                opened = self.open_session(&exclude) => opened,
            };
            let (instance, requests, stream) = match opened {
                Ok(opened) => opened,
                Err(error) => {
                    // Refusals (and exhausted retries) end the subscription.
                    match first.take() {
                        Some(first) => {
                            let _ = first.send(Err(error));
                        }
                        None => {
                            tracing::error!(error = %error, topic = %self.options.topic, "subscription cannot be re-opened; ending it");
                            self.deliveries.fail(error);
                        }
                    }
                    return;
                }
            };
            if let Some(first) = first.take() {
                let _ = first.send(Ok(()));
            }
            backoff.reset();
            let instance_id: Arc<str> = Arc::from(instance.id.as_str());
            let end = self.serve(&mut close, &instance_id, requests, stream).await;
            let moved = match end {
                SessionEnd::Closed => return,
                SessionEnd::Moved => {
                    tracing::info!(instance = %instance.id, topic = %self.options.topic, "the instance is draining for a restart; moving the session");
                    true
                }
                SessionEnd::Broken(reason) => {
                    tracing::warn!(instance = %instance.id, reason, topic = %self.options.topic, "session broke; reconnecting");
                    false
                }
            };
            *self.session.lock().unwrap_or_else(|p| p.into_inner()) = None;
            // After a move everything ACKed was answered; what still waits (an ACK sent after
            // the drain ended, or into a broken stream) is told so.
            for (_, waiters) in self.waiters.drain() {
                for waiter in waiters {
                    let _ = waiter.send(Err(ClientError::Interrupted));
                }
            }
            self.inner.forget(&instance.id);
            exclude = vec![instance.id];
            if moved {
                // A move is no failure: reconnect at once.
                Counters::bump(&self.counters.moves);
            } else {
                Counters::bump(&self.counters.reconnects);
                let wait = backoff.next_wait();
                tokio::select! {
                    _ = &mut close => return,
                    () = tokio::time::sleep(wait) => {}
                }
            }
        }
    }

    /// Resolves an instance and opens a session on it, retrying transient failures until the
    /// retry deadline.
    async fn open_session(
        &mut self,
        exclude: &[String],
    ) -> Result<
        (
            Instance,
            mpsc::UnboundedSender<pb::SubscribeRequest>,
            tonic::Streaming<pb::SubscribeResponse>,
        ),
        ClientError,
    > {
        let started = tokio::time::Instant::now();
        let deadline = self.inner.config.retry_deadline;
        let mut backoff = Backoff::new(&self.inner.config);
        let target = self.options.target(&self.inner.config.client_id);
        loop {
            let mut instance = self.inner.recommended(exclude, Some(&target)).await?;
            let mut hops = 0;
            let opened = loop {
                let status = match self.try_open(&instance).await {
                    Ok(opened) => break Ok(opened),
                    Err(status) => status,
                };
                match home_redirect(&status) {
                    // The group lives elsewhere: follow it, a bounded number of times.
                    Some((id, address)) if hops < MAX_HOME_HOPS && !exclude.contains(&id) => {
                        hops += 1;
                        tracing::debug!(home = %id, %address, "the group's home is another instance; opening there");
                        instance = match self.inner.instance_at(id, &address) {
                            Ok(home) => home,
                            Err(error) => break Err(tonic::Status::unavailable(error.to_string())),
                        };
                    }
                    // A home we just left, or hops without end: the home is moving. Back off
                    // and ask again.
                    Some(_) => {
                        break Err(tonic::Status::unavailable(format!(
                            "the group's home is moving ({})",
                            status.message()
                        )));
                    }
                    None => break Err(status),
                }
            };
            match opened {
                Ok((requests, stream)) => return Ok((instance, requests, stream)),
                Err(status) if is_transient_status(&status) && started.elapsed() < deadline => {
                    tracing::debug!(instance = %instance.id, error = %status.message(), "open failed; retrying");
                    self.inner.forget(&instance.id);
                    tokio::time::sleep(backoff.next_wait()).await;
                }
                Err(status) if is_transient_status(&status) => {
                    return Err(ClientError::Unreachable {
                        waited: started.elapsed(),
                        last: status.message().to_owned(),
                    });
                }
                Err(status) => {
                    return Err(ClientError::Refused {
                        operation: "subscribe",
                        status,
                    });
                }
            }
        }
    }

    async fn try_open(
        &mut self,
        instance: &Instance,
    ) -> Result<
        (
            mpsc::UnboundedSender<pb::SubscribeRequest>,
            tonic::Streaming<pb::SubscribeResponse>,
        ),
        tonic::Status,
    > {
        let (requests, outgoing) = mpsc::unbounded_channel();
        let open = self.options.open(&self.inner.config.client_id);
        let _ = requests.send(pb::SubscribeRequest {
            kind: Some(subscribe_request::Kind::Open(open)),
        });
        let mut service = EventMeshServiceClient::new(instance.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let timeout = self.inner.config.request_timeout;
        let opening = async {
            let mut stream = service
                .subscribe(UnboundedReceiverStream::new(outgoing))
                .await?
                .into_inner();
            match stream.message().await? {
                Some(pb::SubscribeResponse {
                    kind: Some(subscribe_response::Kind::Opened(opened)),
                }) => Ok((opened, stream)),
                other => Err(tonic::Status::unknown(format!(
                    "expected Opened as the first message, got {other:?}"
                ))),
            }
        };
        let (opened, stream) = tokio::time::timeout(timeout, opening).await.map_err(|_| {
            tonic::Status::deadline_exceeded("no Opened within the request timeout")
        })??;
        tracing::info!(address = %instance.address, session = %opened.session_id, group = %opened.group, instance = %opened.instance_id, topic = %self.options.topic, "session opened");
        *self.session.lock().unwrap_or_else(|p| p.into_inner()) = Some(SessionInfo {
            session_id: opened.session_id,
            group: opened.group,
            instance_id: opened.instance_id,
            max_in_flight: opened.max_in_flight,
        });
        Ok((requests, stream))
    }

    /// Runs one session until it breaks or the subscription closes.
    async fn serve(
        &mut self,
        close: &mut oneshot::Receiver<()>,
        instance_id: &Arc<str>,
        requests: mpsc::UnboundedSender<pb::SubscribeRequest>,
        mut stream: tonic::Streaming<pb::SubscribeResponse>,
    ) -> SessionEnd {
        // Deliveries taken from the stream (one message's, split to the hand-off's capacity)
        // that wait for room in the hand-off; the stream is not read meanwhile (back-pressure
        // reaches the server's flow control).
        let mut held: VecDeque<Vec<Delivery>> = VecDeque::new();
        let deliveries = self.deliveries.clone();
        loop {
            // Not biased: the application's ACKs come while it works through deliveries, and
            // with ACKs polled first the stream (and the answers in it) waited until it
            // paused.
            tokio::select! {
                _ = &mut *close => {
                    self.flush_commands(&requests);
                    return SessionEnd::Closed;
                }
                Some(command) = self.commands.recv() => {
                    self.send_commands(command, &requests);
                }
                room = deliveries.room(held.front().map_or(1, Vec::len)), if !held.is_empty() => {
                    let Ok(room) = room else { return SessionEnd::Closed };
                    if let Some(batch) = held.pop_front() {
                        room.give(batch);
                    }
                }
                message = stream.message(), if held.is_empty() => match message {
                    Ok(Some(message)) => {
                        let batch = self.receive(message, instance_id);
                        handoff::split_into(&mut held, batch, deliveries.capacity());
                    }
                    Ok(None) => return SessionEnd::Broken("the server ended the stream".into()),
                    Err(status) if status.metadata().get(DRAINING_METADATA).is_some() => return SessionEnd::Moved,
                    Err(status) => return SessionEnd::Broken(format!("{}: {}", status.code(), status.message())),
                },
            }
        }
    }

    /// Sends `first` and every other command already queued, ACKs merged into one message.
    fn send_commands(
        &mut self,
        first: Command,
        requests: &mpsc::UnboundedSender<pb::SubscribeRequest>,
    ) {
        let mut ack_ids = Vec::new();
        let mut next = Some(first);
        while let Some(command) = next {
            match command {
                Command::Ack(id, waiter) => {
                    if let Some(waiter) = waiter {
                        self.waiters.entry(id.clone()).or_default().push(waiter);
                    }
                    ack_ids.push(id);
                }
                Command::Nack(delivery_id, delay_ms) => {
                    let _ = requests.send(pb::SubscribeRequest {
                        kind: Some(subscribe_request::Kind::Nack(pb::Nack {
                            delivery_id,
                            delay_ms,
                        })),
                    });
                }
                Command::Extend(delivery_id, extra_ms) => {
                    let _ = requests.send(pb::SubscribeRequest {
                        kind: Some(subscribe_request::Kind::Extend(pb::Extend {
                            delivery_id,
                            extra_ms,
                        })),
                    });
                }
            }
            next = if ack_ids.len() >= MAX_IDS_PER_ACK {
                None
            } else {
                self.commands.try_recv().ok()
            };
        }
        if !ack_ids.is_empty() {
            self.counters
                .acks_sent
                .fetch_add(ack_ids.len() as u64, Ordering::Relaxed);
            let _ = requests.send(pb::SubscribeRequest {
                kind: Some(subscribe_request::Kind::Ack(pb::Ack {
                    delivery_ids: ack_ids,
                })),
            });
        }
    }

    fn flush_commands(&mut self, requests: &mpsc::UnboundedSender<pb::SubscribeRequest>) {
        while let Ok(command) = self.commands.try_recv() {
            self.send_commands(command, requests);
        }
    }

    /// Handles one server message: returns its deliveries for the application, then acts on
    /// its results (a result never settles a delivery of the same batch).
    fn receive(&mut self, message: pb::SubscribeResponse, instance_id: &Arc<str>) -> Vec<Delivery> {
        use subscribe_response::Kind;
        match message.kind {
            Some(Kind::Delivery(delivery)) => vec![self.delivery(delivery, instance_id)],
            Some(Kind::AckResult(result)) => {
                self.settle(std::iter::once(result));
                Vec::new()
            }
            Some(Kind::Batch(batch)) => {
                let deliveries = batch
                    .deliveries
                    .into_iter()
                    .map(|delivery| self.delivery(delivery, instance_id))
                    .collect();
                self.settle(batch.ack_results);
                deliveries
            }
            Some(Kind::Opened(_)) | None => Vec::new(),
        }
    }

    fn delivery(&self, delivery: pb::Delivery, instance_id: &Arc<str>) -> Delivery {
        Counters::bump(&self.counters.delivered);
        if delivery.attempt > 1 {
            Counters::bump(&self.counters.redelivered);
        }
        Delivery {
            id: delivery.delivery_id,
            attempt: delivery.attempt,
            topic: delivery.topic,
            partition: delivery.partition,
            offset: delivery.offset,
            event: delivery.event.unwrap_or_default(),
            key: delivery.key,
            ack_deadline_unix_ms: delivery.ack_deadline_unix_ms,
            instance_id: Arc::clone(instance_id),
            commands: self.commands_tx.clone(),
            trace: Default::default(),
        }
    }

    /// Counts one message's results, answers their waiters and passes them on to
    /// [`Subscription::ack_results`] (its lock taken once per message).
    fn settle(&mut self, results: impl IntoIterator<Item = pb::AckResult>) {
        let listener = self.results.lock().unwrap_or_else(|p| p.into_inner());
        for result in results {
            let outcome = AckOutcome::try_from(result.outcome).unwrap_or(AckOutcome::Unspecified);
            let counter = match outcome {
                AckOutcome::Durable => &self.counters.durable,
                AckOutcome::Pending => &self.counters.pending,
                AckOutcome::Nacked | AckOutcome::Extended => &self.counters.nacked_or_extended,
                _ => &self.counters.no_op,
            };
            Counters::bump(counter);
            // (Most ACKs have no waiter: the map is then empty and not even hashed into.)
            if outcome != AckOutcome::Pending
                && !self.waiters.is_empty()
                && let Some(waiters) = self.waiters.remove(&result.delivery_id)
            {
                for waiter in waiters {
                    let _ = waiter.send(Ok(outcome));
                }
            }
            if let Some(listener) = listener.as_ref() {
                let _ = listener.send(AckResult {
                    delivery_id: result.delivery_id,
                    outcome,
                    detail: result.detail,
                });
            }
        }
    }
}

/// ACK ids per message: large enough to amortise, small enough to stay far below frame limits.
const MAX_IDS_PER_ACK: usize = 4096;
