//! One subscription group on this instance: the reliable dispatcher (DESIGN §3, §4, §7).
//!
//! A group is an actor task that alone owns its state — sessions, deliveries, timers and the
//! gap-free watermarks — so nothing on the delivery path takes a lock. One actor runs on one
//! core at a time, so it does only the bookkeeping: a delivery's message is built by the
//! session's stream ([`Sending`]), queued commands are taken in batches, and
//! `dispatcher_group_busy_seconds` tells how close the group is to that ceiling. Its inputs are
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

mod credits;
mod durable;
mod intake;
mod outbox;
mod report;
mod requests;
mod sessions;
mod settling;
mod state;
mod timers;
mod tracked;

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use eventmesh_common::keys::{ClientId, OffsetKey, PartitionId};
use eventmesh_common::probe::{self, Stage};
use eventmesh_common::trace_context::{Operation, SpanContext};
use eventmesh_proto::DRAINING_METADATA;
use eventmesh_proto::client::AckOutcome;
use eventmesh_proto::puller::PullResponse;
use tokio::sync::{mpsc, oneshot, watch};

use crate::budget::{Charge, TopicBudget};
use crate::crash::{CrashPoint, crash_point};
use crate::delivery_id::DeliveryId;
use crate::offset_writer::{WriteJob, WriteNotice};
use crate::registry::{GroupKey, Shared};
use crate::shard::GateBoard;
use crate::watermark::{ClientWatermark, GroupWatermark};
use eventmesh_common::metrics::KeptHistogram;
use metrics::Label;

pub use credits::Credits;
pub use report::{DeliveryCounts, GroupReport};
pub use state::{Delivery, DeliveryState, Sending};

/// Most commands one wake-up of the actor handles before it looks at its timers again.
const COMMANDS_PER_WAKE: usize = 64;

/// How often settled-but-unwritten watermark progress (skipped offsets, idle partitions) is
/// flushed.
const IDLE_FLUSH: Duration = Duration::from_millis(500);

/// The group's per-event maps: touched several times per delivery, so hashed with a fast
/// hasher (seeded per process; keys are sequence numbers and validated names).
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// What a session receives from its group, in order.
#[derive(Debug)]
pub enum Outbound {
    /// Deliveries to write to the client, in order (what one pass of a group shard handed
    /// this session); the stream reports back when it has written them.
    Deliveries {
        /// The deliveries, each made a message by the stream (its ACK deadline stamped then).
        batch: VecDeque<Sending>,
        /// Where to report that they were written (their sequence numbers are `id.seq`).
        group: mpsc::UnboundedSender<GroupCmd>,
    },
    /// Outcomes for the client, in the order decided (what one wake-up of a group shard
    /// decided for this session, or one answer of the session itself).
    Results(VecDeque<Answer>),
    /// The group ended under the session: the stream ends with this status.
    End(tonic::Status),
}

/// The outcome of an Ack, Nack or Extend for one delivery id (an `AckResult`, written to the
/// client by [`crate::wire`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The id the client named.
    pub delivery_id: AnsweredId,
    /// What happened.
    pub outcome: AckOutcome,
    /// Why, for outcomes other than DURABLE.
    pub detail: String,
}

/// A delivery id as the client sent it.
#[derive(Debug, Clone, PartialEq)]
pub enum AnsweredId {
    /// One this instance issued: only the canonical text parses, so it is the text the client
    /// sent, made again when answered instead of kept.
    Issued(DeliveryId),
    /// Anything else, as text (bytes that are not UTF-8 with replacement characters).
    Text(String),
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
    /// Its in-flight limit: most un-ACKed deliveries it holds, from all shards of the group.
    pub credits: Arc<Credits>,
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
    /// ACK / NACK / Extend of deliveries (those of one client message this shard issued),
    /// each answered on `reply_to`.
    Settle {
        /// What to do.
        op: SettleOp,
        /// The deliveries (each answered with its id's text, which is what the client sent:
        /// only the canonical text parses).
        ids: Vec<DeliveryId>,
        /// The client asking.
        client: ClientId,
        /// Where its AckResult goes.
        reply_to: mpsc::UnboundedSender<Outbound>,
    },
    /// A session's stream took deliveries into one message.
    Written {
        /// The deliveries, in the order taken.
        seqs: Vec<u64>,
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
        /// The deliveries whose values the job carried (none for watermark-only flushes).
        tokens: Vec<u64>,
        /// What happened.
        notice: WriteNotice,
        /// The group watermarks the job wrote, per partition.
        cursors: Vec<(PartitionId, i64)>,
    },
    /// A dead-letter copy is durable in `<topic>_DLQ`.
    DeadLettered {
        /// The delivery.
        seq: u64,
    },
    /// Another shard of the group gave a session's in-flight credit back after this one found
    /// none ([`Credits`]): deliver what waits for it.
    Credit,
    /// The instance is draining for a graceful stop: deliver nothing new, keep taking ACKs of
    /// what was sent, and once all of it is settled and durable end every session with
    /// [`draining_status`] (the client moves without having anything redelivered).
    Drain,
    /// The instance is shutting down.
    Stop,
    /// Another shard of the group ended ([`crate::shard`]): a shard without sessions closes as
    /// after its grace period (writes in progress finish first); one with sessions ends like
    /// [`GroupCmd::End`], its sessions told to reconnect.
    SiblingEnded,
    /// End the group now (its reader was taken over, or its offsets are being changed): every
    /// session's stream ends with `status`; nothing unsettled is answered or retired, so it
    /// comes back from the group's next reader.
    End {
        /// What the sessions are told.
        status: tonic::Status,
        /// Told how many sessions were ended.
        reply: Option<oneshot::Sender<u32>>,
    },
}

/// When a delivery's next attempt is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// At once (its session left).
    Now,
    /// After this delay (`None`: the backoff schedule).
    After(Option<Duration>),
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
    /// Stored counts of offsets lost to retention per partition.
    pub lost: HashMap<PartitionId, i64>,
    /// The topic's buffer budget.
    pub budget: Arc<TopicBudget>,
    /// Which shard of the group this actor is ([`crate::shard`]).
    pub shard: ShardInit,
}

/// A shard's place in its group: its index, every shard's commands (its own included, made
/// before any is spawned), its own command queue, and the board its pull gate is set on.
pub struct ShardInit {
    /// Its index, `0..siblings.len()`.
    pub index: usize,
    /// Every shard's commands, by index.
    pub siblings: Arc<[mpsc::UnboundedSender<GroupCmd>]>,
    /// Its own commands.
    pub commands: mpsc::UnboundedReceiver<GroupCmd>,
    /// The group's pull gate.
    pub gate: Arc<GateBoard>,
}

/// The actor. Built by [`spawn`].
pub(crate) struct Group {
    /// `key.label()`, computed once: the budget is told it on every retired delivery.
    label: String,
    /// The group's counters, and its gauges and report, made every flush ([`Group::report`]).
    tallies: report::Tallies,
    gauges: report::Gauges,
    ack_latency: report::AckLatency,
    report_tx: watch::Sender<GroupReport>,
    /// `dispatcher_group_busy_seconds` ([`Group::report_busy`]), and the time at work not
    /// reported yet.
    busy: KeptHistogram,
    busy_time: Duration,
    shared: Arc<Shared>,
    key: GroupKey,
    number: u64,
    budget: Arc<TopicBudget>,
    cmd_tx: mpsc::UnboundedSender<GroupCmd>,
    /// Its index among the group's shards, and every shard's commands.
    shard: usize,
    siblings: Arc<[mpsc::UnboundedSender<GroupCmd>]>,
    gate: Arc<GateBoard>,
    sessions: Vec<SessionSlot>,
    /// Scratch of [`Group::pump`]: what one pass hands each session (by index in `sessions`),
    /// sent as one message per session; empty between passes.
    outgoing: Vec<VecDeque<Sending>>,
    /// A pass of [`Group::pump_now`] is due at the end of this wake-up.
    pump_due: bool,
    /// Answers decided in this wake-up, sent at its end.
    outbox: outbox::Outbox,
    next_session: usize,
    next_seq: u64,
    deliveries: tracked::Tracked,
    ready: VecDeque<u64>,
    timers: timers::Timers,
    seeds: HashMap<PartitionId, i64>,
    lost_seeds: HashMap<PartitionId, i64>,
    partitions: FastMap<PartitionId, PartitionTrack>,
    clients: FastMap<(ClientId, PartitionId), ClientTrack>,
    grace_until: Option<Instant>,
    closing: bool,
    /// Draining ([`GroupCmd::Drain`]): nothing new is delivered.
    draining: bool,
    /// When the actor last woke up: one clock read per wake-up serves every command of it.
    woke_at: Instant,
    writes_healthy: bool,
    /// Settled deliveries waiting to be handed to the writer as one job.
    settled: settling::SettledWrites,
    /// Budget of the deliveries retired in this wake-up, returned at its end.
    retired_charge: Charge,
    ended: watch::Sender<bool>,
}

struct SessionSlot {
    link: SessionLink,
    /// Of the deliveries assigned or sent to it by this shard and not settled (each holding
    /// one of its credits), the ones its stream has not taken yet.
    unwritten: u32,
    /// Since when it has had deliveries its stream did not take (reset by every take).
    waiting_since: Option<Instant>,
}

impl SessionSlot {
    fn new(link: SessionLink) -> Self {
        SessionSlot {
            link,
            unwritten: 0,
            waiting_since: None,
        }
    }
}

struct PartitionTrack {
    tracker: GroupWatermark,
    /// The highest watermark handed to the writer.
    submitted: i64,
    /// The highest watermark known stored (CAS-max: a later write never lowers it).
    durable: i64,
    /// Deliveries (offset, seq) whose own write is durable, waiting for `durable` to pass them.
    covering: BTreeSet<(i64, u64)>,
    /// Offsets lost to retention so far, as stored with the watermark that passed them.
    lost_total: i64,
    /// Losses the written watermark has not passed yet: (end of the lost span, count).
    lost_pending: std::collections::VecDeque<(i64, i64)>,
}

#[derive(Default)]
struct ClientTrack {
    tracker: ClientWatermark,
    submitted: i64,
}

/// What a started group actor is reached and watched through.
pub(crate) struct Started {
    /// Becomes `true` when it has ended.
    pub ended: watch::Receiver<bool>,
    /// Its latest report of itself.
    pub report: watch::Receiver<GroupReport>,
    /// The `group` label of its metrics (its name, or `(other)` beyond the label bound).
    pub metric_label: Arc<str>,
}

/// Starts a group actor.
pub(crate) fn spawn(shared: Arc<Shared>, init: GroupInit) -> Started {
    let ShardInit {
        index: shard,
        siblings,
        commands: cmd_rx,
        gate,
    } = init.shard;
    let cmd_tx = siblings[shard].clone();
    let (ended, ended_rx) = watch::channel(false);
    let (report_tx, report_rx) = watch::channel(GroupReport::default());
    let writes_healthy = *shared.writer.health().borrow();
    let metric_label: Arc<str> = eventmesh_common::metrics::group_label(&init.key.label()).into();
    let mut labels = vec![
        Label::new("topic", init.key.topic.to_string()),
        Label::new("group", metric_label.to_string()),
    ];
    // A sharded group's series are per shard (`sum by (group)` adds them up); one actor's
    // keep the labels they always had.
    if siblings.len() > 1 {
        labels.push(Label::new("shard", shard.to_string()));
    }
    let group = Group {
        shared,
        label: init.key.label(),
        tallies: report::Tallies::new(&labels),
        gauges: report::Gauges::new(&labels),
        ack_latency: report::AckLatency::new(&labels),
        report_tx,
        busy_time: Duration::ZERO,
        busy: KeptHistogram::histogram("dispatcher_group_busy_seconds", labels),
        key: init.key,
        number: init.number,
        budget: init.budget,
        cmd_tx,
        shard,
        siblings,
        gate,
        sessions: Vec::new(),
        outgoing: Vec::new(),
        pump_due: false,
        outbox: outbox::Outbox::default(),
        next_session: 0,
        next_seq: 1,
        deliveries: tracked::Tracked::default(),
        ready: VecDeque::new(),
        timers: timers::Timers::default(),
        seeds: init.seeds,
        lost_seeds: init.lost,
        partitions: FastMap::default(),
        clients: FastMap::default(),
        grace_until: None,
        closing: false,
        draining: false,
        woke_at: Instant::now(),
        writes_healthy,
        settled: settling::SettledWrites::default(),
        retired_charge: Charge::default(),
        ended,
    };
    tokio::spawn(group.run(cmd_rx));
    Started {
        ended: ended_rx,
        report: report_rx,
        metric_label,
    }
}

fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// How a drained session's stream ends: UNAVAILABLE with [`DRAINING_METADATA`] (the SDK
/// reconnects elsewhere at once, counting it a move rather than a broken session).
pub fn draining_status() -> tonic::Status {
    let mut status = tonic::Status::unavailable(
        "the instance is draining for a restart and every ACK of this session is durable; reconnect (Recommend names another instance)",
    );
    status.metadata_mut().insert(
        DRAINING_METADATA,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    status
}

/// What woke the actor.
enum Wake {
    /// A command (`None`: every sender is gone); more queued ones are taken with it.
    Command(Option<GroupCmd>),
    /// A timer is due.
    Timers,
    /// The periodic flush.
    Flush,
    /// The offset writer's health changed (`false`: the writer is gone).
    Health(bool),
}

/// An answer to a client about the delivery `id` it named.
fn answer(id: DeliveryId, outcome: AckOutcome, detail: &str) -> Answer {
    Answer {
        delivery_id: AnsweredId::Issued(id),
        outcome,
        detail: detail.to_owned(),
    }
}

impl Group {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<GroupCmd>) {
        let mut health = self.shared.writer.health();
        let mut flush = tokio::time::interval(IDLE_FLUSH);
        flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.grace_until = Some(Instant::now() + self.grace());
        tracing::info!(group = %self.key, number = self.number, shard = self.shard, shards = self.siblings.len(), "subscription group started");
        loop {
            let deliveries = &self.deliveries;
            self.timers.tidy(deliveries.len(), |at, seq| {
                deliveries
                    .get(seq)
                    .is_some_and(|delivery| delivery.timer == Some(at))
            });
            let next_timer = self.timers.first();
            let wake = match (next_timer, self.grace_until) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let woke = tokio::select! {
                command = commands.recv() => Wake::Command(command),
                () = sleep_until(wake) => Wake::Timers,
                _ = flush.tick() => Wake::Flush,
                changed = health.changed() => Wake::Health(changed.is_ok()),
            };
            let working = Instant::now();
            self.woke_at = working;
            // Commands check for settled ACKs due one by one (in `take`); other wake-ups here.
            let by_command = matches!(woke, Wake::Command(_));
            let go_on = match woke {
                Wake::Command(command) => {
                    // What else is queued is handled in the same wake-up (a bounded number, so
                    // timers and flushes keep their turn): one pass of the select per command
                    // cost more than most commands.
                    let mut go_on = self.take(command, &commands);
                    let mut taken = 1;
                    while go_on && taken < COMMANDS_PER_WAKE {
                        let Ok(next) = commands.try_recv() else {
                            break;
                        };
                        go_on = self.take(Some(next), &commands);
                        taken += 1;
                    }
                    go_on
                }
                Wake::Timers => {
                    self.on_timers(working);
                    true
                }
                Wake::Flush => {
                    self.flush_watermarks();
                    self.check_stalled(working);
                    // Deliveries held back while the instance's lease was late go out now.
                    self.pump();
                    self.report_busy();
                    self.report(working);
                    true
                }
                Wake::Health(true) => {
                    self.writes_healthy = *health.borrow_and_update();
                    self.update_gate();
                    true
                }
                Wake::Health(false) => true,
            };
            if !go_on {
                break;
            }
            self.release_retired();
            if self.pump_due {
                self.pump_now();
            }
            self.outbox.flush();
            if !by_command && self.settled.due(commands.is_empty()) {
                self.flush_settled();
            }
            if self.draining && !self.sessions.is_empty() && self.drained() {
                self.end_drained_sessions();
            }
            self.busy_time += working.elapsed();
            if self.closing && self.deliveries.is_empty() {
                break;
            }
        }
        self.release_retired();
        self.outbox.flush();
        self.flush_settled();
        self.flush_watermarks();
        self.report_busy();
        self.report(Instant::now());
        self.gate.set(self.shard, PullGate::Closed);
        // Batches still queued were never admitted: return their budget.
        commands.close();
        while let Ok(command) = commands.try_recv() {
            if let GroupCmd::Pulled { charge, .. } = command {
                self.budget.release(&self.label, charge);
            }
        }
        self.release_all();
        // The group's budget share and home go with its last shard.
        if self.shared.shard_ended(&self.key, self.number) {
            self.budget.leave(&self.label);
            self.shared.group_ended(&self.key);
        }
        let _ = self.ended.send(true);
        tracing::info!(group = %self.key, "subscription group ended");
    }

    /// Handles one command, then hands settled ACKs to the writer if they are due; `false`
    /// when the actor must end (`None`: every sender is gone).
    fn take(
        &mut self,
        command: Option<GroupCmd>,
        queue: &mpsc::UnboundedReceiver<GroupCmd>,
    ) -> bool {
        match command {
            Some(GroupCmd::Stop) | None => false,
            Some(GroupCmd::End { status, reply }) => {
                let ended = self.end_sessions(&status);
                if let Some(reply) = reply {
                    let _ = reply.send(ended);
                }
                false
            }
            Some(GroupCmd::SiblingEnded) if !self.sessions.is_empty() => {
                self.end_sessions(&tonic::Status::unavailable(format!(
                    "subscription group {} restarts (one of its shards ended); reconnect",
                    self.key
                )));
                false
            }
            Some(GroupCmd::SiblingEnded) => {
                if !self.closing {
                    self.grace_until = None;
                    self.close();
                }
                true
            }
            Some(command) => {
                self.handle(command);
                if self.settled.due(queue.is_empty()) {
                    self.flush_settled();
                }
                true
            }
        }
    }

    /// Records in `dispatcher_group_busy_seconds` the time the actor spent at work since the
    /// last report (once per flush interval, and when the group ends): its `_sum` grows by one
    /// second per second when the group is at its ceiling (one actor, one core at most), so
    /// `rate(..._sum)` is how busy the group's actor is, and the sum over a run divided by the
    /// events it handled is what one event costs it.
    fn report_busy(&mut self) {
        self.busy.record(self.busy_time.as_secs_f64());
        self.busy_time = Duration::ZERO;
    }

    /// Publishes the group's [`GroupReport`] and sets its gauges (every flush interval and at
    /// the end). Counting the deliveries walks them once: a few microseconds per thousand,
    /// twice a second.
    fn report(&mut self, now: Instant) {
        let mut counts = report::DeliveryCounts::default();
        for delivery in self.deliveries.values() {
            let unacked = match delivery.state {
                DeliveryState::Assigned { .. } | DeliveryState::Sent { .. } => {
                    counts.in_flight += 1;
                    true
                }
                DeliveryState::Ready => {
                    counts.ready += 1;
                    true
                }
                DeliveryState::Backoff => {
                    counts.backoff += 1;
                    true
                }
                DeliveryState::Writing | DeliveryState::Covering | DeliveryState::DeadLettering => {
                    counts.settling += 1;
                    false
                }
            };
            if unacked
                && counts
                    .oldest_unacked
                    .is_none_or(|at| delivery.pulled_at < at)
            {
                counts.oldest_unacked = Some(delivery.pulled_at);
            }
        }
        // Partitions without a tracker yet (nothing pulled since the group started) are where
        // the group started in them.
        let untracked = self
            .seeds
            .iter()
            .filter(|(partition, _)| !self.partitions.contains_key(*partition));
        let partitions = self
            .partitions
            .iter()
            .map(|(partition, track)| (partition.clone(), track.durable))
            .chain(untracked.map(|(partition, seed)| (partition.clone(), *seed)))
            .collect();
        let report = report::build(
            self.sessions.len() as u32,
            counts,
            &self.tallies,
            partitions,
            now,
        );
        self.gauges.set(&report);
        self.tallies.export();
        self.ack_latency.flush();
        self.report_tx.send_replace(report);
    }

    /// Whether nothing the group sent is waiting for an ACK or for its progress to become
    /// durable (what is ready or backing off was not sent, or is sent again anyway).
    fn drained(&self) -> bool {
        self.deliveries.values().all(|delivery| {
            matches!(
                delivery.state,
                DeliveryState::Ready | DeliveryState::Backoff
            )
        })
    }

    /// Ends every session of a drained group: its client moves to another instance, with
    /// every ACK it made answered DURABLE and nothing of it to be redelivered.
    fn end_drained_sessions(&mut self) {
        tracing::info!(group = %self.key, sessions = self.sessions.len(), "drained: every sent delivery is settled and durable; sessions told to move");
        // Answers decided so far reach each stream before its `End`.
        self.outbox.flush();
        for slot in self.sessions.drain(..) {
            let _ = slot.link.out.send(Outbound::End(draining_status()));
        }
        self.update_gate();
    }

    /// Tells every session the group ended under it; returns how many there were.
    fn end_sessions(&mut self, status: &tonic::Status) -> u32 {
        tracing::info!(group = %self.key, sessions = self.sessions.len(), code = ?status.code(), message = status.message(), "ending the group now");
        self.closing = true;
        // Answers decided so far reach each stream before its `End`.
        self.outbox.flush();
        let count = self.sessions.len() as u32;
        for slot in self.sessions.drain(..) {
            let _ = slot.link.out.send(Outbound::End(status.clone()));
        }
        count
    }

    fn grace(&self) -> Duration {
        Duration::from_millis(self.shared.settings.group_grace_ms)
    }

    fn handle(&mut self, command: GroupCmd) {
        match command {
            GroupCmd::Join { session, reply } => {
                let accepted = !self.closing;
                if accepted {
                    tracing::debug!(group = %self.key, session = session.id, client = %session.client, "session joined");
                    self.sessions.push(SessionSlot::new(session));
                    self.grace_until = None;
                    self.update_gate();
                }
                let _ = reply.send(accepted);
                self.pump();
            }
            GroupCmd::Leave { session } => self.leave(session),
            GroupCmd::Settle {
                op,
                ids,
                client,
                reply_to,
            } => {
                for id in ids {
                    self.settle_request(op, id, &client, &reply_to);
                }
            }
            GroupCmd::Written { seqs, session, at } => self.written(&seqs, session, at),
            GroupCmd::Pulled { batch, charge } => self.pulled(batch, charge),
            GroupCmd::Write {
                tokens,
                notice,
                cursors,
            } => self.write_notice(tokens, notice, cursors),
            GroupCmd::DeadLettered { seq } => self.dead_lettered(seq),
            GroupCmd::Credit => self.pump(),
            GroupCmd::Drain => {
                tracing::info!(group = %self.key, sessions = self.sessions.len(), "draining: delivering nothing new, waiting for the sent deliveries' ACKs");
                self.draining = true;
                self.update_gate();
            }
            GroupCmd::Stop | GroupCmd::End { .. } | GroupCmd::SiblingEnded => {}
        }
    }

    fn update_gate(&self) {
        let gate = if self.closing {
            PullGate::Closed
        } else if self.sessions.is_empty() || !self.writes_healthy || self.draining {
            PullGate::Paused
        } else {
            PullGate::Open
        };
        self.gate.set(self.shard, gate);
    }

    // ---- dead letters -------------------------------------------------------------------------

    fn dead_letter(&mut self, seq: u64, reason: String) {
        let Some(delivery) = self.deliveries.get_mut(seq) else {
            return;
        };
        delivery.state = DeliveryState::DeadLettering;
        tracing::warn!(group = %self.key, delivery = %delivery.id, partition = %delivery.partition, offset = delivery.offset, attempts = delivery.attempt, reason, "dead-lettering");
        let letter = delivery.dead_letter(&self.key, reason);
        let group = self.cmd_tx.clone();
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            shared.dead_letters.write(letter).await;
            let _ = group.send(GroupCmd::DeadLettered { seq });
        });
    }

    fn dead_lettered(&mut self, seq: u64) {
        let Some(delivery) = self.deliveries.get_mut(seq) else {
            return;
        };
        delivery.state = DeliveryState::Writing;
        self.tallies.dead_lettered.add(&delivery.partition);
        self.settle(seq);
    }

    // ---- ending -------------------------------------------------------------------------------

    /// The grace period ended without sessions.
    fn close(&mut self) {
        self.closing = true;
        self.update_gate();
        let seqs: Vec<u64> = self.deliveries.iter().map(|(seq, _)| seq).collect();
        let mut dropped = 0;
        for seq in seqs {
            let Some(delivery) = self.deliveries.get(seq) else {
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
        for delivery in self.deliveries.drain() {
            self.budget.release(&self.label, delivery.charge);
        }
    }
}

/// Sleeps until `at`; never, without one.
pub(crate) async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// The ACK deadline of a delivery written now, in milliseconds since the Unix epoch.
pub fn ack_deadline_unix_ms(timeout: Duration) -> i64 {
    now_unix_ms() + timeout.as_millis() as i64
}

#[cfg(test)]
mod tests;
