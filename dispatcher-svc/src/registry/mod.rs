//! The instance's subscription groups: finding or creating a group for a session, where a new
//! group starts, and each group's pull loop.
//!
//! Creating a group (the first session of `(topic, group)` on this instance):
//! 1. the topic is created if missing (idempotent);
//! 2. the group's stored watermarks are read from offset-svc;
//! 3. every partition gets its position: `W + 1` where a watermark is stored (nothing un-ACKed
//!    is skipped, nothing ACKed replayed; operators use offset resets to move a group), else
//!    the start — `LATEST` and the default at the partition's end (the instance's live
//!    position), `EARLIEST` and `STORED` at its oldest retained offset — recorded first by
//!    storing the watermark just below it (`-1` for offset 0: a start marker), so a restart
//!    before any ACK resumes there instead of starting again;
//! 4. `Attach` gives the group's reader in puller-svc exactly those positions and a new
//!    generation (frames handed to an earlier dispatcher process are pulled again; an earlier
//!    holder's pulls are refused from now on);
//! 5. the group actor starts, seeded with the positions, and its pull loop
//!    ([`crate::pulling`]) starts.
//!
//! With a cluster ([`crate::cluster`]) the group's home is claimed in etcd before step 1 (an
//! Open at another instance's group is refused with the home's address), step 2 also reads the
//! group's progress mirrored in etcd (a group that moved resumes where its last home got to;
//! partitions without a record there start at EARLIEST), and the start watermarks are recorded
//! in etcd before step 4. The home is released after the group ends.
//!
//! Stopping a group for a change of its stored offsets ([`Shared::rewind`], operator resets)
//! holds group creation, ends the group, waits until everything it wrote is durable, changes
//! the offsets, and only then lets the group be created again — so no live group ever writes
//! over the change.
//!
//! Here: the group handles, the registry and joining; creating a group is in `create`,
//! changing a group's stored offsets under it in `offset_change`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use eventmesh_common::grpc;
use eventmesh_common::grpc::InternalChannel;
use eventmesh_common::keys::{GroupName, OffsetClient, OffsetKey, PartitionId, Topic};
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::client::StartPosition;
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{
    OffsetEntry, OffsetSelector, ReadTopicOffsetsRequest, ResetOffsetsRequest, WriteOffsetsRequest,
};
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use eventmesh_proto::puller::{
    AttachRequest, CreateTopicRequest, EndOffsetsRequest, GroupTopic, PastEnd,
};
use tokio::sync::{mpsc, oneshot, watch};

use crate::batching::Backoff;
use crate::broker_ack::BrokerAcker;
use crate::budget::TopicBudget;
use crate::cluster::Cluster;
use crate::cluster::meter::Meter;
use crate::cluster::mirror::Recorded;
use crate::config::DeliverySettings;
use crate::dead_letters::DeadLetterWriter;
use crate::error::DispatcherError;
use crate::group::{self, GroupCmd, GroupInit, GroupReport, SessionLink, ShardInit};
use crate::limits::{ConnectionStreams, PublishLimit};
use crate::offset_writer::OffsetWriter;
use crate::pulling::{Positions, pull_loop, reader_positions, rewind_targets};
use crate::shard::{GateBoard, shard_of};

mod create;
mod offset_change;

/// Calls made while creating a group give up after this.
const CREATE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stop for an offset change waits for the group to end.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// A subscription group on a topic.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupKey {
    /// The topic.
    pub topic: Topic,
    /// The group; `None` is the topic's default group.
    pub group: Option<GroupName>,
}

impl GroupKey {
    /// The group's name for metrics and logs (`(default)` for the default group).
    pub fn label(&self) -> String {
        self.group
            .as_ref()
            .map_or_else(|| "(default)".to_owned(), ToString::to_string)
    }

    /// What the offset store keeps when the group's watermark in `partition` is `watermark`:
    /// its `__mqcursor__` entry, and its `__mqlost__` entry when the lost-offset total it passes
    /// grew to `lost`.
    pub fn watermark_entries(
        &self,
        partition: &PartitionId,
        watermark: i64,
        lost: Option<i64>,
    ) -> impl Iterator<Item = (OffsetKey, i64)> {
        let key = |client| OffsetKey::new(self.topic.clone(), client, partition.clone());
        let cursor = (key(OffsetClient::MqCursor(self.group.clone())), watermark);
        let lost = lost.map(|total| (key(OffsetClient::MqLost(self.group.clone())), total));
        std::iter::once(cursor).chain(lost)
    }

    /// The puller's reader of this group.
    pub fn reader(&self) -> GroupTopic {
        GroupTopic {
            group: self
                .group
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            topic: self.topic.to_string(),
        }
    }
}

impl fmt::Display for GroupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.label(), self.topic)
    }
}

/// One live group as [`Shared::group_reports`] saw it.
#[derive(Debug, Clone)]
pub struct GroupSnapshot {
    pub key: GroupKey,
    /// The `group` label its metrics carry (bounded; see `GroupHandle::metric_label`).
    pub metric_label: Arc<str>,
    pub report: GroupReport,
}

/// One shard (actor) of a live group ([`crate::shard`]).
#[derive(Debug, Clone)]
pub struct ShardHandle {
    /// Its number in delivery ids.
    pub number: u64,
    /// Its actor.
    pub commands: mpsc::UnboundedSender<GroupCmd>,
    /// Becomes `true` when the actor has ended.
    pub ended: watch::Receiver<bool>,
    /// The shard's latest report of itself.
    pub report: watch::Receiver<GroupReport>,
}

/// A live group: one or more shards.
#[derive(Debug, Clone)]
pub struct GroupHandle {
    /// Its first shard's number: tells this life of the group from later ones.
    pub number: u64,
    /// Which group.
    pub key: GroupKey,
    /// Its shards, by index.
    pub shards: Arc<[ShardHandle]>,
    /// The `group` label of its metrics.
    pub metric_label: Arc<str>,
}

impl GroupHandle {
    /// Sends every shard the command `make` makes (a shard that ended is skipped).
    pub fn send_all(&self, make: impl Fn() -> GroupCmd) {
        for shard in self.shards.iter() {
            let _ = shard.commands.send(make());
        }
    }

    /// Waits until every shard has ended.
    pub async fn wait_ended(&self) {
        for shard in self.shards.iter() {
            let mut ended = shard.ended.clone();
            let _ = ended.wait_for(|ended| *ended).await;
        }
    }

    /// The group's latest report: its shards' reports merged.
    pub fn report(&self) -> GroupReport {
        GroupReport::merge(self.shards.iter().map(|s| s.report.borrow().clone()))
    }

    /// Joins `session` to every shard; `None` (and no shard keeps it) when one refused
    /// because it is closing. Dropped midway (the client went away during the join), the
    /// shards asked so far are told to leave again: none keeps a session nobody serves.
    async fn join(&self, session: &SessionLink) -> Option<SessionMembership> {
        let mut membership = SessionMembership {
            group: self.clone(),
            session: session.id,
            asked: 0,
        };
        for shard in self.shards.iter() {
            let (reply, answer) = oneshot::channel();
            let sent = shard.commands.send(GroupCmd::Join {
                session: session.clone(),
                reply,
            });
            // Asked from here on: a Leave after the Join undoes it whatever the answer (a
            // shard that refused ignores it).
            membership.asked += 1;
            if sent.is_err() || answer.await != Ok(true) {
                return None;
            }
        }
        Some(membership)
    }
}

/// A session's place in its group, from [`GroupHandle::join`]: dropped — at the end of the
/// session's task however it ends (a panic included), or by a join that did not finish — it
/// tells every shard that was asked to take the session that the session left.
#[must_use]
pub struct SessionMembership {
    group: GroupHandle,
    session: u64,
    /// The group's first shards that were asked (all of them once joined).
    asked: usize,
}

impl SessionMembership {
    /// The group joined.
    pub fn group(&self) -> &GroupHandle {
        &self.group
    }
}

impl Drop for SessionMembership {
    fn drop(&mut self) {
        for shard in &self.group.shards[..self.asked] {
            let _ = shard.commands.send(GroupCmd::Leave {
                session: self.session,
            });
        }
    }
}

#[derive(Default)]
struct Groups {
    by_key: HashMap<GroupKey, GroupHandle>,
    /// Each live shard's commands, by its number (what a delivery id names).
    by_number: HashMap<u64, mpsc::UnboundedSender<GroupCmd>>,
}

/// What every group and session of the instance shares.
pub struct Shared {
    /// Delivery settings.
    pub settings: DeliverySettings,
    /// Random per process start; the first part of every delivery id.
    pub epoch: u64,
    /// This instance's id.
    pub instance_id: String,
    /// The offset writer.
    pub writer: OffsetWriter,
    /// The broker-ACK forwarder.
    pub broker_acks: BrokerAcker,
    /// The dead-letter writer.
    pub dead_letters: DeadLetterWriter,
    /// Membership in a cluster (`None`: a single instance).
    pub cluster: Option<Arc<Cluster>>,
    /// The load this instance reports.
    pub meter: Arc<Meter>,
    /// Open Subscribe streams per client connection.
    pub connection_streams: Arc<ConnectionStreams>,
    /// Publish calls in progress.
    pub publishes: PublishLimit,
    puller: PullerServiceClient<InternalChannel>,
    offsets: OffsetServiceClient<InternalChannel>,
    groups: Mutex<Groups>,
    creating: tokio::sync::Mutex<()>,
    budgets: Mutex<HashMap<Topic, Arc<TopicBudget>>>,
    next_group: AtomicU64,
    next_session: AtomicU64,
    pub(crate) shutdown: CancellationToken,
}

/// Channels and helpers [`Shared`] is built from.
pub struct SharedParts {
    /// Settings.
    pub settings: DeliverySettings,
    /// Instance id.
    pub instance_id: String,
    /// To puller-svc.
    pub puller: InternalChannel,
    /// To offset-svc.
    pub offsets: InternalChannel,
    /// The writer.
    pub writer: OffsetWriter,
    /// The forwarder.
    pub broker_acks: BrokerAcker,
    /// Instance shutdown.
    pub shutdown: CancellationToken,
    /// Cluster membership.
    pub cluster: Option<Arc<Cluster>>,
    /// Load counters.
    pub meter: Arc<Meter>,
}

impl Shared {
    /// Builds the shared state.
    pub fn new(parts: SharedParts) -> Arc<Self> {
        let pull_limit = grpc::pull_response_limit(
            parts.settings.pull_batch as usize,
            crate::pulling::PULL_KIB as usize * 1024,
        );
        let connection_streams = ConnectionStreams::new(parts.settings.max_streams_per_connection);
        let publishes = PublishLimit::new(parts.settings.max_publishes_in_progress);
        Arc::new(Shared {
            settings: parts.settings,
            connection_streams,
            publishes,
            epoch: rand::random::<u64>() >> 1,
            instance_id: parts.instance_id,
            writer: parts.writer,
            broker_acks: parts.broker_acks,
            dead_letters: DeadLetterWriter::new(parts.puller.clone()),
            cluster: parts.cluster,
            meter: parts.meter,
            // A pull answer is bounded by the pull size this instance asks for plus one whole
            // record; offset reads by offset-svc's own limit.
            puller: PullerServiceClient::new(parts.puller).max_decoding_message_size(pull_limit),
            offsets: OffsetServiceClient::new(parts.offsets)
                .max_decoding_message_size(grpc::OFFSETS_MESSAGE_LIMIT),
            groups: Mutex::default(),
            creating: tokio::sync::Mutex::new(()),
            budgets: Mutex::default(),
            next_group: AtomicU64::new(1),
            next_session: AtomicU64::new(1),
            shutdown: parts.shutdown,
        })
    }

    /// A puller client.
    pub fn puller(&self) -> PullerServiceClient<InternalChannel> {
        self.puller.clone()
    }

    /// An offset-svc client.
    pub fn offsets(&self) -> OffsetServiceClient<InternalChannel> {
        self.offsets.clone()
    }

    /// The offset-svc key of a group's watermark in one partition.
    pub fn cursor_key(
        &self,
        key: &GroupKey,
        partition: &PartitionId,
    ) -> eventmesh_proto::offset::OffsetKey {
        eventmesh_proto::offset::OffsetKey {
            topic: key.topic.to_string(),
            client_id: OffsetClient::MqCursor(key.group.clone()).to_string(),
            partition: partition.to_string(),
        }
    }

    /// Attaches the group's reader at `positions`; returns the reader's new generation.
    pub async fn attach(
        &self,
        key: &GroupKey,
        positions: &BTreeMap<PartitionId, i64>,
    ) -> Result<u64, DispatcherError> {
        let response = self
            .puller()
            .attach(AttachRequest {
                dispatcher_id: self.instance_id.clone(),
                readers: vec![key.reader()],
                positions: vec![reader_positions(key, positions)],
            })
            .await
            .map_err(|status| DispatcherError::dependency("puller-svc", status))?
            .into_inner();
        response
            .generations
            .first()
            .map(|g| g.generation)
            .ok_or_else(|| {
                DispatcherError::dependency(
                    "puller-svc",
                    tonic::Status::internal("Attach answered without a generation"),
                )
            })
    }

    /// A fresh session id.
    pub fn next_session_id(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// The commands of the live group shard with this number.
    pub fn shard_by_number(&self, number: u64) -> Option<mpsc::UnboundedSender<GroupCmd>> {
        self.lock_groups().by_number.get(&number).cloned()
    }

    /// The live group of this key.
    pub fn group(&self, key: &GroupKey) -> Option<GroupHandle> {
        self.lock_groups().by_key.get(key).cloned()
    }

    /// Number of live groups.
    pub fn group_count(&self) -> usize {
        self.lock_groups().by_key.len()
    }

    /// The topic's buffer budget.
    pub fn budget(&self, topic: &Topic) -> Arc<TopicBudget> {
        let mut budgets = self.budgets.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(budgets.entry(topic.clone()).or_insert_with(|| {
            TopicBudget::new(
                topic.as_str(),
                self.settings.topic_buffer_records,
                self.settings.topic_buffer_kib,
            )
        }))
    }

    fn lock_groups(&self) -> std::sync::MutexGuard<'_, Groups> {
        self.groups.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every live group's latest report with its metrics label, ordered by topic and group
    /// (what `DescribeGroups` answers and what the lag gauges read). Reads what the groups
    /// published; never waits for an actor. A group that has not reported yet has
    /// `reported_unix_ms == 0`.
    pub fn group_reports(&self) -> Vec<GroupSnapshot> {
        let mut reports: Vec<GroupSnapshot> = self
            .lock_groups()
            .by_key
            .values()
            .map(|handle| GroupSnapshot {
                key: handle.key.clone(),
                metric_label: Arc::clone(&handle.metric_label),
                report: handle.report(),
            })
            .collect();
        reports.sort_by(|a, b| {
            (a.key.topic.as_str(), a.key.label()).cmp(&(b.key.topic.as_str(), b.key.label()))
        });
        reports
    }

    /// Whether this instance may deliver now (always, without a cluster; see
    /// [`Cluster::may_serve`]).
    pub fn may_serve(&self) -> bool {
        self.cluster.as_ref().is_none_or(|c| c.may_serve())
    }

    /// The keys of the live groups.
    pub fn group_keys(&self) -> Vec<GroupKey> {
        self.lock_groups().by_key.keys().cloned().collect()
    }

    /// Ends one live group now: its sessions end with `status`; nothing unsettled is retired.
    pub fn end_group(&self, key: &GroupKey, status: tonic::Status) {
        if let Some(handle) = self.group(key) {
            handle.send_all(|| GroupCmd::End {
                status: status.clone(),
                reply: None,
            });
        }
    }

    /// Ends every live group now (the instance lost its lease).
    pub fn end_all(&self, status: tonic::Status) {
        for handle in self.lock_groups().by_key.values() {
            handle.send_all(|| GroupCmd::End {
                status: status.clone(),
                reply: None,
            });
        }
    }

    /// Called by a group shard's actor as it ends; `true` when it was the group's last (then
    /// the group is gone, and [`Shared::group_ended`] must follow). The group's other shards
    /// are told to end too ([`GroupCmd::SiblingEnded`]): a group lives and dies as one.
    pub(crate) fn shard_ended(&self, key: &GroupKey, number: u64) -> bool {
        let mut groups = self.lock_groups();
        groups.by_number.remove(&number);
        let Some(handle) = groups
            .by_key
            .get(key)
            .filter(|h| h.shards.iter().any(|s| s.number == number))
            .cloned()
        else {
            // Not the live group of its key (it ended before it was listed): nothing else of
            // it is listed either.
            return true;
        };
        if handle
            .shards
            .iter()
            .any(|s| groups.by_number.contains_key(&s.number))
        {
            drop(groups);
            handle.send_all(|| GroupCmd::SiblingEnded);
            return false;
        }
        groups.by_key.remove(key);
        true
    }

    /// Called by a group's last actor as it ends.
    pub(crate) fn group_ended(self: &Arc<Self>, key: &GroupKey) {
        self.drop_budget_if_unused(&key.topic);
        eventmesh_common::metrics::forget_group_label(&key.label());
        // The home goes when the group does, unless the instance is shutting down: then the
        // last progress is mirrored first and the lease's revocation frees every home at once.
        // The group's last writes are made durable and mirrored before the home goes, so the
        // record its next creation adopts (here or elsewhere) is not behind what it ACKed.
        if let Some(cluster) = &self.cluster
            && !self.shutdown.is_cancelled()
        {
            let shared = Arc::clone(self);
            let cluster = Arc::clone(cluster);
            let key = key.clone();
            tokio::spawn(async move {
                let durable = matches!(
                    tokio::time::timeout(STOP_TIMEOUT, shared.writer.barrier()).await,
                    Ok(true)
                );
                let _creating = shared.creating.lock().await;
                if shared.group(&key).is_some() {
                    return;
                }
                if !durable {
                    tracing::warn!(group = %key, "the ended group's last writes did not become durable in time; its next creation may repeat what they covered");
                } else if let Err(error) = cluster.mirror().flush(&cluster).await {
                    tracing::warn!(group = %key, %error, "the ended group's last progress was not mirrored; its next creation may repeat up to one mirror interval");
                }
                cluster.release_home(&key).await;
            });
        }
    }

    /// A topic no group reads any more keeps no budget (topics come and go). Called when a
    /// group ends and when its pull loop has returned what it held.
    pub(crate) fn drop_budget_if_unused(&self, topic: &Topic) {
        let groups = self.lock_groups();
        if groups.by_key.keys().any(|k| k.topic == *topic) {
            return;
        }
        let mut budgets = self.budgets.lock().unwrap_or_else(|p| p.into_inner());
        if budgets.get(topic).is_some_and(|b| b.is_unused()) {
            budgets.remove(topic);
        }
    }

    /// Topics with a buffer budget in memory.
    pub fn budget_count(&self) -> usize {
        self.budgets.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Drains every group (the start of a graceful stop; [`GroupCmd::Drain`]).
    pub fn drain_all(&self) {
        for handle in self.lock_groups().by_key.values() {
            handle.send_all(|| GroupCmd::Drain);
        }
    }

    /// Stops every group (instance shutdown).
    pub fn stop_all(&self) {
        for handle in self.lock_groups().by_key.values() {
            handle.send_all(|| GroupCmd::Stop);
        }
    }

    /// Joins `session` to its group, creating the group when it is not live here; the session
    /// leaves when the membership is dropped.
    pub async fn join(
        self: &Arc<Self>,
        key: GroupKey,
        start: StartPosition,
        session: SessionLink,
    ) -> Result<SessionMembership, DispatcherError> {
        let mut backoff = Backoff::default();
        for _ in 0..100 {
            if self.shutdown.is_cancelled() {
                break;
            }
            let handle = match self.group(&key) {
                Some(handle) => handle,
                None => {
                    let _creating = self.creating.lock().await;
                    match self.group(&key) {
                        Some(handle) => handle,
                        None => self.claim_and_create(&key, start).await?,
                    }
                }
            };
            if let Some(membership) = handle.join(&session).await {
                return Ok(membership);
            }
            // The group is closing: wait for it to end, then create a new one.
            tokio::time::sleep(backoff.next_delay()).await;
        }
        Err(DispatcherError::ShuttingDown(
            "the subscription group could not be joined (instance shutting down or group closing)"
                .into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use eventmesh_common::keys::ClientId;

    use super::*;
    use crate::group::Credits;

    /// A group of `count` shards whose actors are the returned receivers.
    fn group_of(count: u64) -> (GroupHandle, Vec<mpsc::UnboundedReceiver<GroupCmd>>) {
        let mut shards = Vec::new();
        let mut receivers = Vec::new();
        for number in 1..=count {
            let (commands, receiver) = mpsc::unbounded_channel();
            shards.push(ShardHandle {
                number,
                commands,
                ended: watch::channel(false).1,
                report: watch::channel(GroupReport::default()).1,
            });
            receivers.push(receiver);
        }
        let handle = GroupHandle {
            number: 1,
            key: GroupKey {
                topic: Topic::new("t").unwrap(),
                group: Some(GroupName::new("g").unwrap()),
            },
            shards: shards.into(),
            metric_label: "t/g".into(),
        };
        (handle, receivers)
    }

    fn session() -> SessionLink {
        SessionLink {
            id: 7,
            client: ClientId::new("app").unwrap(),
            out: mpsc::unbounded_channel().0,
            credits: Arc::new(Credits::new(1)),
        }
    }

    /// Answers the shard's Join with `accept`.
    async fn answer_join(shard: &mut mpsc::UnboundedReceiver<GroupCmd>, accept: bool) {
        match shard.recv().await {
            Some(GroupCmd::Join { reply, .. }) => {
                let _ = reply.send(accept);
            }
            other => panic!("expected a Join, got {other:?}"),
        }
    }

    fn left(shard: &mut mpsc::UnboundedReceiver<GroupCmd>) -> bool {
        matches!(shard.try_recv(), Ok(GroupCmd::Leave { session: 7 }))
    }

    /// The client goes away while the second of two shards has not answered its Join yet:
    /// both shards are told to leave (the second may still take the Join after the join
    /// was dropped).
    #[tokio::test]
    async fn a_join_dropped_midway_leaves_every_shard_it_asked() {
        let (group, mut shards) = group_of(3);
        let session = session();
        let mut joining = Box::pin(group.join(&session));
        let [first, second, third] = &mut shards[..] else {
            panic!("three shards")
        };
        tokio::select! {
            _ = &mut joining => panic!("the join cannot finish"),
            () = async {
                answer_join(first, true).await;
                // The second shard's Join arrives and is never answered.
                assert!(matches!(second.recv().await, Some(GroupCmd::Join { .. })));
            } => {}
        }
        drop(joining);
        assert!(left(first), "the shard that took the session lets it go");
        assert!(left(second), "the shard asked last lets it go too");
        assert!(
            third.try_recv().is_err(),
            "a shard never asked hears nothing"
        );
    }

    #[tokio::test]
    async fn a_refused_join_leaves_the_shards_asked_and_a_finished_one_keeps_them() {
        let (group, mut shards) = group_of(2);
        let session = session();
        let (joined, ()) = tokio::join!(group.join(&session), async {
            answer_join(&mut shards[0], true).await;
            answer_join(&mut shards[1], false).await;
        });
        assert!(joined.is_none());
        assert!(left(&mut shards[0]) && left(&mut shards[1]));

        let (joined, ()) = tokio::join!(group.join(&session), async {
            answer_join(&mut shards[0], true).await;
            answer_join(&mut shards[1], true).await;
        });
        assert!(joined.is_some());
        assert!(shards[0].try_recv().is_err() && shards[1].try_recv().is_err());
        // The membership is what makes the session leave.
        drop(joined);
        assert!(left(&mut shards[0]) && left(&mut shards[1]));
    }
}
