//! One subscription group on this instance: the reliable dispatcher (DESIGN §3, §4, §7).
//!
//! A group is an actor task that alone owns its state — sessions, deliveries, timers and the
//! gap-free watermarks — so nothing on the delivery path takes a lock. Its inputs are
//! [`GroupCmd`]s: pulled batches from its pull loop, joins and leaves of sessions, ACK / NACK /
//! Extend from clients, "written" notices from session streams, and notices from the offset
//! writer and the dead-letter writer.
//!
//! A delivery's life:
//! 1. admitted from a pulled batch by the partition's [`GroupWatermark`] (frames at or below
//!    the watermark, or already tracked, are dropped, not delivered twice);
//! 2. **ready** → **assigned** to a session with spare in-flight capacity (round robin) →
//!    **sent** once the session's stream has taken it: only then does the ACK clock start;
//! 3. an ACK from a client it was sent to makes it **writing**: the watermarks it moves are
//!    handed to the offset writer; it is not redelivered and uses no attempts (AckResult
//!    PENDING while offset-svc fails). Once the partition's *stored* watermark covers its
//!    offset it is retired: answered DURABLE, its budget returned, its broker ACK key
//!    forwarded. An ACK above a still-unsettled offset is **covering** until that one settles
//!    too — only then would a crash not bring it back, which is what DURABLE promises — and it
//!    keeps its budget meanwhile, so what a crash can redeliver stays bounded by the budget;
//! 4. a NACK or an ACK timeout sends it to **backoff** (the NACK's delay, or 1, 2, 4, 8, 16 s
//!    ±20 %) and then back to ready with the next attempt, same delivery id; after the last
//!    attempt it is **dead-lettered** to `<topic>_DLQ` (retried until that write succeeds) and
//!    then settled like an ACK;
//! 5. when its session leaves, it is reassigned at once (next attempt if it had been written).
//!
//! A group without sessions keeps its deliveries for the grace period; then those that were
//! delivered at least once are dead-lettered tagged with the group, the never-delivered ones are
//! dropped unsettled (the watermark stays below them, so the reader pulls them again when the
//! group returns), and the actor ends.

mod state;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use eventmesh_common::keys::{ClientId, OffsetClient, OffsetKey, PartitionId};
use eventmesh_proto::client as pb;
use eventmesh_proto::client::AckOutcome;
use eventmesh_proto::puller::{BodyKind, PullResponse};
use tokio::sync::{mpsc, oneshot, watch};

use crate::budget::{Charge, TopicBudget, kib_cost};
use crate::crash::{CrashPoint, crash_point};
use crate::delivery_id::DeliveryId;
use crate::event::decode_for_delivery;
use crate::offset_writer::{WriteJob, WriteNotice};
use crate::registry::{GroupKey, Shared};
use crate::watermark::{Admission, ClientWatermark, GroupWatermark};

pub use state::{Delivery, DeliveryState};

/// How often settled-but-unwritten watermark progress (skipped offsets, idle partitions) is
/// flushed.
const IDLE_FLUSH: Duration = Duration::from_millis(500);

/// What a session receives from its group, in order.
#[derive(Debug)]
pub enum Outbound {
    /// A delivery to write to the client; the stream reports back when it has.
    Delivery {
        /// The delivery (its ACK deadline is filled in when written); boxed, it is the big
        /// variant.
        message: Box<pb::Delivery>,
        /// The group's sequence number of it.
        seq: u64,
        /// Where to report that it was written.
        group: mpsc::UnboundedSender<GroupCmd>,
    },
    /// An outcome for the client.
    Result(pb::AckResult),
}

/// A session as its group sees it.
#[derive(Debug, Clone)]
pub struct SessionLink {
    /// Unique per instance.
    pub id: u64,
    /// Its client.
    pub client: ClientId,
    /// Where its deliveries and results go.
    pub out: mpsc::UnboundedSender<Outbound>,
    /// Most un-ACKed deliveries it holds.
    pub max_in_flight: u32,
}

/// A client's request about one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleOp {
    /// Settle it.
    Ack,
    /// Redeliver it after this delay (`None`: the backoff schedule).
    Nack(Option<Duration>),
    /// Push the ACK deadline to now + this.
    Extend(Duration),
}

/// Inputs of a group actor.
#[derive(Debug)]
pub enum GroupCmd {
    /// A session joins; answered `false` when the group is closing (join a new one).
    Join {
        /// The session.
        session: SessionLink,
        /// The answer.
        reply: oneshot::Sender<bool>,
    },
    /// A session left (stream ended or broke).
    Leave {
        /// Its id.
        session: u64,
    },
    /// ACK / NACK / Extend of one delivery, answered on `reply_to`.
    Settle {
        /// What to do.
        op: SettleOp,
        /// The parsed id.
        id: DeliveryId,
        /// The id as the client sent it.
        raw_id: String,
        /// The client asking.
        client: ClientId,
        /// Where its AckResult goes.
        reply_to: mpsc::UnboundedSender<Outbound>,
    },
    /// A session's stream took a delivery.
    Written {
        /// The delivery.
        seq: u64,
        /// The session.
        session: u64,
        /// When.
        at: Instant,
    },
    /// A pulled batch and the budget reserved for it.
    Pulled {
        /// The batch.
        batch: PullResponse,
        /// Budget charged for it (already adjusted to the real size).
        charge: Charge,
    },
    /// The offset writer's notice for a job.
    Write {
        /// The job's token (a delivery sequence number; 0 for watermark-only flushes).
        token: u64,
        /// What happened.
        notice: WriteNotice,
        /// The group watermark the job wrote, if it wrote one.
        cursor: Option<(PartitionId, i64)>,
    },
    /// A dead-letter copy is durable in `<topic>_DLQ`.
    DeadLettered {
        /// The delivery.
        seq: u64,
    },
    /// The instance is shutting down.
    Stop,
}

/// What the pull loop may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullGate {
    /// Pull.
    Open,
    /// Wait (no sessions, or offset writes are failing).
    Paused,
    /// The group ended.
    Closed,
}

/// Starting state of a group, prepared by the registry.
pub struct GroupInit {
    /// Which group.
    pub key: GroupKey,
    /// Its number in delivery ids.
    pub number: u64,
    /// Stored (or start-position) watermarks per partition.
    pub seeds: HashMap<PartitionId, i64>,
    /// The topic's buffer budget.
    pub budget: Arc<TopicBudget>,
}

/// The actor. Built by [`spawn`].
pub(crate) struct Group {
    shared: Arc<Shared>,
    key: GroupKey,
    number: u64,
    budget: Arc<TopicBudget>,
    cmd_tx: mpsc::UnboundedSender<GroupCmd>,
    gate: watch::Sender<PullGate>,
    sessions: Vec<SessionSlot>,
    next_session: usize,
    next_seq: u64,
    deliveries: HashMap<u64, Delivery>,
    ready: VecDeque<u64>,
    timers: BTreeSet<(Instant, u64)>,
    seeds: HashMap<PartitionId, i64>,
    partitions: HashMap<PartitionId, PartitionTrack>,
    clients: HashMap<(ClientId, PartitionId), ClientTrack>,
    grace_until: Option<Instant>,
    closing: bool,
    writes_healthy: bool,
}

struct SessionSlot {
    link: SessionLink,
    in_flight: u32,
}

struct PartitionTrack {
    tracker: GroupWatermark,
    /// The highest watermark handed to the writer.
    submitted: i64,
    /// The highest watermark known stored (CAS-max: a later write never lowers it).
    durable: i64,
    /// Deliveries (offset, seq) whose own write is durable, waiting for `durable` to pass them.
    covering: BTreeSet<(i64, u64)>,
}

#[derive(Default)]
struct ClientTrack {
    tracker: ClientWatermark,
    submitted: i64,
}

/// Starts a group actor; returns its command sender and the pull gate.
pub(crate) fn spawn(
    shared: Arc<Shared>,
    init: GroupInit,
) -> (
    mpsc::UnboundedSender<GroupCmd>,
    watch::Receiver<PullGate>,
    tokio::task::JoinHandle<()>,
) {
    let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
    let (gate, gate_rx) = watch::channel(PullGate::Paused);
    let writes_healthy = *shared.writer.health().borrow();
    let group = Group {
        shared,
        key: init.key,
        number: init.number,
        budget: init.budget,
        cmd_tx: cmd_tx.clone(),
        gate,
        sessions: Vec::new(),
        next_session: 0,
        next_seq: 1,
        deliveries: HashMap::new(),
        ready: VecDeque::new(),
        timers: BTreeSet::new(),
        seeds: init.seeds,
        partitions: HashMap::new(),
        clients: HashMap::new(),
        grace_until: None,
        closing: false,
        writes_healthy,
    };
    let task = tokio::spawn(group.run(cmd_rx));
    (cmd_tx, gate_rx, task)
}

fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn result(raw_id: &str, outcome: AckOutcome, detail: &str) -> Outbound {
    Outbound::Result(pb::AckResult {
        delivery_id: raw_id.to_owned(),
        outcome: outcome as i32,
        detail: detail.to_owned(),
    })
}

impl Group {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<GroupCmd>) {
        let mut health = self.shared.writer.health();
        let mut flush = tokio::time::interval(IDLE_FLUSH);
        flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.grace_until = Some(Instant::now() + self.grace());
        tracing::info!(group = %self.key, number = self.number, "subscription group started");
        loop {
            let next_timer = self.timers.first().map(|(at, _)| *at);
            let wake = match (next_timer, self.grace_until) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            tokio::select! {
                command = commands.recv() => match command {
                    Some(GroupCmd::Stop) | None => break,
                    Some(command) => self.handle(command),
                },
                () = sleep_until(wake) => self.on_timers(Instant::now()),
                _ = flush.tick() => self.flush_watermarks(),
                changed = health.changed() => {
                    if changed.is_ok() {
                        self.writes_healthy = *health.borrow_and_update();
                        self.update_gate();
                    }
                }
            }
            if self.closing && self.deliveries.is_empty() {
                break;
            }
        }
        self.flush_watermarks();
        let _ = self.gate.send(PullGate::Closed);
        // Batches still queued were never admitted: return their budget.
        commands.close();
        while let Ok(command) = commands.try_recv() {
            if let GroupCmd::Pulled { charge, .. } = command {
                self.budget.release(&self.group_label(), charge);
            }
        }
        self.release_all();
        self.shared.group_ended(&self.key, self.number);
        tracing::info!(group = %self.key, "subscription group ended");
    }

    fn grace(&self) -> Duration {
        Duration::from_millis(self.shared.settings.group_grace_ms)
    }

    fn group_label(&self) -> String {
        self.key.label()
    }

    fn handle(&mut self, command: GroupCmd) {
        match command {
            GroupCmd::Join { session, reply } => {
                let accepted = !self.closing;
                if accepted {
                    tracing::debug!(group = %self.key, session = session.id, client = %session.client, "session joined");
                    self.sessions.push(SessionSlot {
                        link: session,
                        in_flight: 0,
                    });
                    self.grace_until = None;
                    self.update_gate();
                }
                let _ = reply.send(accepted);
                self.pump();
            }
            GroupCmd::Leave { session } => self.leave(session),
            GroupCmd::Settle {
                op,
                id,
                raw_id,
                client,
                reply_to,
            } => self.settle_request(op, id, &raw_id, &client, reply_to),
            GroupCmd::Written { seq, session, at } => self.written(seq, session, at),
            GroupCmd::Pulled { batch, charge } => self.pulled(batch, charge),
            GroupCmd::Write {
                token,
                notice,
                cursor,
            } => self.write_notice(token, notice, cursor),
            GroupCmd::DeadLettered { seq } => self.dead_lettered(seq),
            GroupCmd::Stop => {}
        }
    }

    fn update_gate(&self) {
        let gate = if self.closing {
            PullGate::Closed
        } else if self.sessions.is_empty() || !self.writes_healthy {
            PullGate::Paused
        } else {
            PullGate::Open
        };
        self.gate
            .send_if_modified(|g| std::mem::replace(g, gate) != gate);
    }

    // ---- intake ------------------------------------------------------------------------

    fn pulled(&mut self, batch: PullResponse, charge: Charge) {
        let mut unused = charge;
        for record in batch.records {
            let Ok(partition) = PartitionId::new(record.partition.clone()) else {
                tracing::error!(
                    partition = record.partition,
                    "puller sent an invalid partition id; record ignored (it stays unsettled)"
                );
                continue;
            };
            let track = self.partition(&partition, record.offset);
            match track.tracker.admit(record.offset) {
                Admission::Deliver => {}
                admission => {
                    tracing::trace!(group = %self.key, %partition, offset = record.offset, ?admission, "duplicate record dropped");
                    continue;
                }
            }
            let cost = Charge {
                records: 1,
                kib: kib_cost(record.frame.len()),
            };
            unused.records = unused.records.saturating_sub(cost.records);
            unused.kib = unused.kib.saturating_sub(cost.kib);
            let seq = self.next_seq;
            self.next_seq += 1;
            let id = DeliveryId {
                epoch: self.shared.epoch,
                group: self.number,
                seq,
            };
            let malformed = match BodyKind::try_from(record.body_kind) {
                Ok(BodyKind::MalformedFrame) => Some(record.malformed_reason.clone()),
                _ => None,
            };
            let (event, problem) = match malformed {
                Some(reason) => (None, Some(reason)),
                None => match decode_for_delivery(&record.frame) {
                    Ok(event) => (Some(event), None),
                    Err(err) => (None, Some(format!("frame does not decode: {err}"))),
                },
            };
            let delivery = Delivery::new(
                id.to_string(),
                partition,
                record.offset,
                event,
                record.frame,
                record.ack_key,
                cost,
            );
            self.deliveries.insert(seq, delivery);
            match problem {
                Some(reason) => self.dead_letter(seq, reason),
                None => self.ready.push_back(seq),
            }
        }
        for range in batch.ranges {
            let Ok(partition) = PartitionId::new(range.partition) else {
                continue;
            };
            self.partition(&partition, range.first)
                .tracker
                .cover(range.next);
        }
        // Budget reserved but not filled (duplicates, short batches) goes back at once.
        if unused != Charge::default() {
            self.budget.release(&self.group_label(), unused);
        }
        self.pump();
    }

    /// The partition's tracker, seeded from the stored watermark or, for a partition the
    /// group has no progress in, from just below the first offset the reader delivers.
    fn partition(&mut self, partition: &PartitionId, first_seen: i64) -> &mut PartitionTrack {
        let seeds = &self.seeds;
        self.partitions.entry(partition.clone()).or_insert_with(|| {
            let seed = seeds.get(partition).copied().unwrap_or(first_seen - 1);
            PartitionTrack {
                tracker: GroupWatermark::new(seed),
                submitted: seed,
                durable: seed,
                covering: BTreeSet::new(),
            }
        })
    }

    // ---- sending -----------------------------------------------------------------------

    /// Hands ready deliveries to sessions with spare capacity, round robin.
    fn pump(&mut self) {
        while !self.sessions.is_empty() {
            let Some(&seq) = self.ready.front() else {
                return;
            };
            let still_ready = self
                .deliveries
                .get(&seq)
                .is_some_and(|d| d.state == DeliveryState::Ready);
            if !still_ready {
                self.ready.pop_front();
                continue;
            }
            let count = self.sessions.len();
            let Some(index) = (0..count)
                .map(|i| (self.next_session + i) % count)
                .find(|i| self.sessions[*i].in_flight < self.sessions[*i].link.max_in_flight)
            else {
                return; // every session is full
            };
            self.ready.pop_front();
            self.next_session = (index + 1) % count;
            let slot = &mut self.sessions[index];
            let Some(delivery) = self.deliveries.get_mut(&seq) else {
                continue;
            };
            let message = Box::new(delivery.message(&self.key.topic));
            delivery.state = DeliveryState::Assigned {
                session: slot.link.id,
            };
            delivery.note_client(&slot.link.client);
            let client_key = (slot.link.client.clone(), delivery.partition.clone());
            let offset = delivery.offset;
            let sent = slot.link.out.send(Outbound::Delivery {
                message,
                seq,
                group: self.cmd_tx.clone(),
            });
            if sent.is_err() {
                // The session is going away; its Leave will follow and reassign.
                delivery.state = DeliveryState::Ready;
                self.ready.push_front(seq);
                return;
            }
            slot.in_flight += 1;
            self.clients
                .entry(client_key)
                .or_default()
                .tracker
                .sent(offset);
            metrics::counter!("dispatcher_deliveries_total").increment(1);
        }
    }

    fn written(&mut self, seq: u64, session: u64, at: Instant) {
        let timeout = self.shared.settings.ack_timeout();
        let Some(delivery) = self.deliveries.get_mut(&seq) else {
            return;
        };
        if delivery.state != (DeliveryState::Assigned { session }) {
            return; // settled or reassigned meanwhile
        }
        delivery.state = DeliveryState::Sent { session };
        let deadline = at + timeout + delivery.extension.take().unwrap_or_default();
        set_timer(&mut self.timers, delivery, seq, deadline);
        crash_point(CrashPoint::AfterDeliver);
    }

    fn session_slot(&mut self, session: u64) -> Option<&mut SessionSlot> {
        self.sessions.iter_mut().find(|s| s.link.id == session)
    }

    /// Frees the in-flight slot a delivery held, if any.
    fn free_slot(&mut self, state: DeliveryState) {
        if let DeliveryState::Assigned { session } | DeliveryState::Sent { session } = state
            && let Some(slot) = self.session_slot(session)
        {
            slot.in_flight = slot.in_flight.saturating_sub(1);
        }
    }

    fn leave(&mut self, session: u64) {
        let Some(index) = self.sessions.iter().position(|s| s.link.id == session) else {
            return;
        };
        self.sessions.remove(index);
        if self.next_session >= self.sessions.len() {
            self.next_session = 0;
        }
        let held: Vec<u64> = self
            .deliveries
            .iter()
            .filter(|(_, d)| d.state.session() == Some(session))
            .map(|(seq, _)| *seq)
            .collect();
        tracing::debug!(group = %self.key, session, reassigned = held.len(), "session left");
        for seq in held {
            let was_written = self
                .deliveries
                .get(&seq)
                .is_some_and(|d| matches!(d.state, DeliveryState::Sent { .. }));
            if was_written {
                self.retry(seq, None, "its session left");
            } else if let Some(delivery) = self.deliveries.get_mut(&seq) {
                delivery.state = DeliveryState::Ready;
                self.ready.push_front(seq);
            }
        }
        if self.sessions.is_empty() {
            self.grace_until = Some(Instant::now() + self.grace());
        }
        self.update_gate();
        self.pump();
    }

    // ---- client requests ----------------------------------------------------------------

    fn settle_request(
        &mut self,
        op: SettleOp,
        id: DeliveryId,
        raw_id: &str,
        client: &ClientId,
        reply_to: mpsc::UnboundedSender<Outbound>,
    ) {
        let reply = |outcome, detail: &str| {
            let _ = reply_to.send(result(raw_id, outcome, detail));
        };
        let Some(delivery) = self.deliveries.get_mut(&id.seq) else {
            if id.seq < self.next_seq {
                reply(AckOutcome::AlreadySettled, "already settled");
            } else {
                reply(AckOutcome::Unknown, "no such delivery");
            }
            return;
        };
        if !delivery.was_sent_to(client) {
            reply(
                AckOutcome::NotOwned,
                "this delivery was not sent to a session of this client",
            );
            return;
        }
        match (op, delivery.state) {
            (
                _,
                DeliveryState::Writing | DeliveryState::Covering | DeliveryState::DeadLettering,
            ) => {
                reply(
                    AckOutcome::AlreadySettled,
                    "already ACKed (or dead-lettered); settling",
                );
            }
            (SettleOp::Ack, state) => {
                metrics::counter!("dispatcher_acks_total").increment(1);
                delivery.waiters.push(reply_to.clone());
                delivery.state = DeliveryState::Writing;
                clear_timer(&mut self.timers, delivery, id.seq);
                self.free_slot(state);
                self.settle(id.seq);
                self.pump();
            }
            (SettleOp::Nack(delay), _) => {
                self.retry(id.seq, delay, "NACKed");
                reply(AckOutcome::Nacked, "");
                self.pump();
            }
            (SettleOp::Extend(extra), DeliveryState::Sent { .. }) => {
                let deadline = Instant::now() + extra;
                set_timer(&mut self.timers, delivery, id.seq, deadline);
                reply(AckOutcome::Extended, "");
            }
            (SettleOp::Extend(extra), _) => {
                // Not written yet (or waiting for a retry): the clock starts later; remember.
                delivery.extension = Some(extra);
                reply(
                    AckOutcome::Extended,
                    "the ACK clock starts when the delivery is written",
                );
            }
        }
    }

    /// NACK, timeout or a lost session: back off and redeliver, or dead-letter after the last
    /// attempt.
    fn retry(&mut self, seq: u64, delay: Option<Duration>, why: &str) {
        let max_attempts = self.shared.settings.max_attempts;
        let Some(delivery) = self.deliveries.get_mut(&seq) else {
            return;
        };
        let state = delivery.state;
        clear_timer(&mut self.timers, delivery, seq);
        if delivery.attempt >= max_attempts {
            let reason = format!("{why} on attempt {} of {max_attempts}", delivery.attempt);
            self.free_slot(state);
            self.dead_letter(seq, reason);
            return;
        }
        delivery.attempt += 1;
        delivery.state = DeliveryState::Backoff;
        let wait = delay.unwrap_or_else(|| self.shared.settings.backoff(delivery.attempt));
        set_timer(&mut self.timers, delivery, seq, Instant::now() + wait);
        metrics::counter!("dispatcher_redeliveries_total").increment(1);
        self.free_slot(state);
    }

    fn on_timers(&mut self, now: Instant) {
        while let Some(&(at, seq)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.pop_first();
            let Some(delivery) = self.deliveries.get_mut(&seq) else {
                continue;
            };
            if delivery.timer != Some(at) {
                continue;
            }
            delivery.timer = None;
            match delivery.state {
                DeliveryState::Sent { .. } => {
                    metrics::counter!("dispatcher_ack_timeouts_total").increment(1);
                    self.retry(seq, None, "ACK timeout");
                }
                DeliveryState::Backoff => {
                    delivery.state = DeliveryState::Ready;
                    self.ready.push_back(seq);
                }
                _ => {}
            }
        }
        if self.grace_until.is_some_and(|at| at <= now) && self.sessions.is_empty() {
            self.grace_until = None;
            self.close();
        }
        self.pump();
    }

    // ---- settling ---------------------------------------------------------------------------

    /// Marks a delivery settled in the trackers and asks for the watermarks it moves to be
    /// made durable; it is retired when the writer says so.
    fn settle(&mut self, seq: u64) {
        let Some(delivery) = self.deliveries.get(&seq) else {
            return;
        };
        let (partition, offset) = (delivery.partition.clone(), delivery.offset);
        let clients = delivery.clients.clone();
        let mut entries = Vec::with_capacity(1 + clients.len());
        let mut cursor = None;
        if let Some(track) = self.partitions.get_mut(&partition) {
            track.tracker.settle(offset);
            let watermark = track.tracker.watermark();
            if watermark >= 0 {
                track.submitted = track.submitted.max(watermark);
                entries.push((self.cursor_key(&partition), watermark));
                cursor = Some((partition.clone(), watermark));
            }
        }
        for client in clients {
            let offset_key = self.client_key(&client, &partition);
            let key = (client, partition.clone());
            let track = self.clients.entry(key.clone()).or_default();
            track.tracker.settle(offset);
            if let Some(watermark) = track.tracker.watermark() {
                track.submitted = track.submitted.max(watermark);
                entries.push((offset_key, watermark));
            }
            if track.tracker.is_idle() && track.submitted >= 0 {
                // Keep the map small; a later delivery starts a fresh tracker, and CAS-max
                // keeps the stored value from going down.
                self.clients.remove(&key);
            }
        }
        self.submit(seq, entries, cursor);
    }

    fn submit(
        &self,
        token: u64,
        entries: Vec<(OffsetKey, i64)>,
        cursor: Option<(PartitionId, i64)>,
    ) {
        let group = self.cmd_tx.clone();
        self.shared.writer.submit(WriteJob {
            entries,
            token,
            listener: Arc::new(move |token, notice| {
                let _ = group.send(GroupCmd::Write {
                    token,
                    notice,
                    cursor: cursor.clone(),
                });
            }),
        });
    }

    fn cursor_key(&self, partition: &PartitionId) -> OffsetKey {
        OffsetKey::new(
            self.key.topic.clone(),
            OffsetClient::MqCursor(self.key.group.clone()),
            partition.clone(),
        )
    }

    fn client_key(&self, client: &ClientId, partition: &PartitionId) -> OffsetKey {
        OffsetKey::new(
            self.key.topic.clone(),
            OffsetClient::Client(client.clone()),
            partition.clone(),
        )
    }

    fn write_notice(
        &mut self,
        token: u64,
        notice: WriteNotice,
        cursor: Option<(PartitionId, i64)>,
    ) {
        match notice {
            WriteNotice::Pending => {
                let Some(delivery) = self.deliveries.get(&token) else {
                    return; // a watermark-only flush
                };
                for waiter in &delivery.waiters {
                    let _ = waiter.send(result(
                        &delivery.id,
                        AckOutcome::Pending,
                        "ACK accepted; the offset store is unavailable and the write is being retried",
                    ));
                }
            }
            WriteNotice::Durable => {
                crash_point(CrashPoint::AfterOffsetWrite);
                if let Some((partition, watermark)) = cursor {
                    self.stored(&partition, watermark);
                }
                self.written_durably(token);
            }
        }
    }

    /// The watermark of `partition` is stored up to `watermark`: retires what it now covers.
    fn stored(&mut self, partition: &PartitionId, watermark: i64) {
        let Some(track) = self.partitions.get_mut(partition) else {
            return;
        };
        track.durable = track.durable.max(watermark);
        let mut covered = Vec::new();
        while let Some(&(offset, seq)) = track.covering.first() {
            if offset > track.durable {
                break;
            }
            track.covering.pop_first();
            covered.push(seq);
        }
        for seq in covered {
            self.retire(seq);
        }
    }

    /// A delivery's own offset write is durable: retired when the stored watermark covers it,
    /// else covering until it does (or dropped unanswered when the group is ending: the
    /// offset below it will not settle here, so it comes back to the next reader).
    fn written_durably(&mut self, seq: u64) {
        let Some(delivery) = self.deliveries.get_mut(&seq) else {
            return; // a watermark-only flush, or retired already
        };
        let Some(track) = self.partitions.get_mut(&delivery.partition) else {
            // Tracks live as long as the group, so this cannot happen; retiring is the
            // answer that never leaves a delivery stuck.
            self.retire(seq);
            return;
        };
        if delivery.offset <= track.durable {
            self.retire(seq);
        } else if self.closing {
            self.drop_unanswered(seq);
        } else {
            delivery.state = DeliveryState::Covering;
            track.covering.insert((delivery.offset, seq));
        }
    }

    /// Forgets a delivery without answering or forwarding anything; returns its budget.
    fn drop_unanswered(&mut self, seq: u64) {
        if let Some(delivery) = self.deliveries.remove(&seq) {
            self.budget.release(&self.group_label(), delivery.charge);
        }
    }

    fn retire(&mut self, seq: u64) {
        let Some(delivery) = self.deliveries.remove(&seq) else {
            return;
        };
        for waiter in &delivery.waiters {
            let _ = waiter.send(result(&delivery.id, AckOutcome::Durable, ""));
        }
        self.budget.release(&self.group_label(), delivery.charge);
        if !delivery.ack_key.is_empty() {
            self.shared
                .broker_acks
                .ack(self.key.reader(), delivery.ack_key);
        }
    }

    /// Writes watermark progress no ACK carried (skipped offsets, idle partitions).
    fn flush_watermarks(&mut self) {
        let keys: Vec<PartitionId> = self.partitions.keys().cloned().collect();
        for partition in keys {
            let Some(track) = self.partitions.get_mut(&partition) else {
                continue;
            };
            let watermark = track.tracker.watermark();
            if watermark > track.submitted {
                track.submitted = watermark;
                // One job per partition, so its notice names the watermark it stored; the
                // writer merges them into one call anyway.
                let entries = vec![(self.cursor_key(&partition), watermark)];
                self.submit(0, entries, Some((partition, watermark)));
            }
        }
    }

    // ---- dead letters -------------------------------------------------------------------------

    fn dead_letter(&mut self, seq: u64, reason: String) {
        let Some(delivery) = self.deliveries.get_mut(&seq) else {
            return;
        };
        delivery.state = DeliveryState::DeadLettering;
        tracing::warn!(group = %self.key, delivery = delivery.id, partition = %delivery.partition, offset = delivery.offset, attempts = delivery.attempt, reason, "dead-lettering");
        let letter = delivery.dead_letter(&self.key, reason);
        let group = self.cmd_tx.clone();
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            shared.dead_letters.write(letter).await;
            let _ = group.send(GroupCmd::DeadLettered { seq });
        });
    }

    fn dead_lettered(&mut self, seq: u64) {
        let Some(delivery) = self.deliveries.get_mut(&seq) else {
            return;
        };
        delivery.state = DeliveryState::Writing;
        metrics::counter!("dispatcher_dead_letters_total").increment(1);
        self.settle(seq);
    }

    // ---- ending -------------------------------------------------------------------------------

    /// The grace period ended without sessions.
    fn close(&mut self) {
        self.closing = true;
        self.update_gate();
        let seqs: Vec<u64> = self.deliveries.keys().copied().collect();
        let mut dropped = 0;
        for seq in seqs {
            let Some(delivery) = self.deliveries.get(&seq) else {
                continue;
            };
            match delivery.state {
                DeliveryState::Writing | DeliveryState::DeadLettering => {}
                // The offset below it may never settle here now (never-delivered ones are
                // dropped): the next reader gets it again.
                DeliveryState::Covering => self.drop_unanswered(seq),
                _ if delivery.attempt > 1 || !delivery.clients.is_empty() => {
                    self.dead_letter(
                        seq,
                        "subscription group ended: no session within the grace period".into(),
                    );
                }
                _ => {
                    self.drop_unanswered(seq);
                    dropped += 1;
                }
            }
        }
        for track in self.partitions.values_mut() {
            track.covering.clear();
        }
        tracing::info!(group = %self.key, dropped, "grace period over: delivered-but-unACKed events dead-lettered, undelivered ones left for the next reader");
    }

    fn release_all(&mut self) {
        let label = self.group_label();
        for (_, delivery) in self.deliveries.drain() {
            self.budget.release(&label, delivery.charge);
        }
    }
}

fn set_timer(
    timers: &mut BTreeSet<(Instant, u64)>,
    delivery: &mut Delivery,
    seq: u64,
    at: Instant,
) {
    clear_timer(timers, delivery, seq);
    delivery.timer = Some(at);
    timers.insert((at, seq));
}

fn clear_timer(timers: &mut BTreeSet<(Instant, u64)>, delivery: &mut Delivery, seq: u64) {
    if let Some(at) = delivery.timer.take() {
        timers.remove(&(at, seq));
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Fills in the ACK deadline of a delivery being written now.
pub fn stamp_deadline(message: &mut pb::Delivery, timeout: Duration) {
    message.ack_deadline_unix_ms = now_unix_ms() + timeout.as_millis() as i64;
}
