//! The instance's subscription groups: finding or creating a group for a session, where a new
//! group starts, and each group's pull loop.
//!
//! Creating a group (the first session of `(topic, group)` on this instance):
//! 1. the topic is created if missing (idempotent);
//! 2. the group's stored watermarks are read from offset-svc;
//! 3. the start position is applied to every partition where the group has neither a stored
//!    watermark nor a reader cursor (a group that existed before resumes) —
//!    `LATEST` and the default start at the partition's end (the instance's live position),
//!    `EARLIEST` at its oldest retained offset — by storing the watermark just below it; a
//!    partition with stored progress always resumes at `W + 1` (nothing un-ACKed is skipped,
//!    nothing ACKed replayed; operators use offset resets to move a group);
//! 4. `Attach` makes puller-svc realign the group's reader to those watermarks, so frames it
//!    handed to an earlier dispatcher process are pulled again;
//! 5. the group actor starts, seeded with the watermarks, and its pull loop starts.
//!
//! The pull loop reserves topic budget, long-polls the group's reader, and hands each batch to
//! the actor. It pauses while the group has no session or offset writes are failing, and ends
//! with the group. Nothing it pulled is dropped: a batch the actor cannot take any more (the
//! group ended) was never settled, so the reader gets it again.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use eventmesh_common::keys::{GroupName, OffsetClient, PartitionId, Topic};
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::client::StartPosition;
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{OffsetEntry, ReadTopicOffsetsRequest, WriteOffsetsRequest};
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use eventmesh_proto::puller::{
    AttachRequest, CreateTopicRequest, CursorsRequest, EndOffsetsRequest, GroupTopic, PullRequest,
};
use tokio::sync::{mpsc, oneshot, watch};
use tonic::transport::Channel;

use crate::batching::Backoff;
use crate::broker_ack::BrokerAcker;
use crate::budget::{TopicBudget, kib_cost};
use crate::config::DeliverySettings;
use crate::dead_letters::DeadLetterWriter;
use crate::error::DispatcherError;
use crate::group::{self, GroupCmd, GroupInit, PullGate, SessionLink};
use crate::offset_writer::OffsetWriter;

/// Longest a pull waits for records.
const PULL_WAIT_MS: u32 = 500;
/// KiB asked for per pull at most.
const PULL_KIB: u32 = 8 * 1024;
/// Calls made while creating a group give up after this.
const CREATE_TIMEOUT: Duration = Duration::from_secs(10);

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

/// A live group.
#[derive(Debug, Clone)]
pub struct GroupHandle {
    /// Its number in delivery ids.
    pub number: u64,
    /// Which group.
    pub key: GroupKey,
    /// Its actor.
    pub commands: mpsc::UnboundedSender<GroupCmd>,
}

#[derive(Default)]
struct Groups {
    by_key: HashMap<GroupKey, GroupHandle>,
    by_number: HashMap<u64, GroupHandle>,
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
    puller: PullerServiceClient<Channel>,
    offsets: OffsetServiceClient<Channel>,
    groups: Mutex<Groups>,
    creating: tokio::sync::Mutex<()>,
    budgets: Mutex<HashMap<Topic, Arc<TopicBudget>>>,
    next_group: AtomicU64,
    next_session: AtomicU64,
    shutdown: CancellationToken,
}

/// Channels and helpers [`Shared`] is built from.
pub struct SharedParts {
    /// Settings.
    pub settings: DeliverySettings,
    /// Instance id.
    pub instance_id: String,
    /// To puller-svc.
    pub puller: Channel,
    /// To offset-svc.
    pub offsets: Channel,
    /// The writer.
    pub writer: OffsetWriter,
    /// The forwarder.
    pub broker_acks: BrokerAcker,
    /// Instance shutdown.
    pub shutdown: CancellationToken,
}

impl Shared {
    /// Builds the shared state.
    pub fn new(parts: SharedParts) -> Arc<Self> {
        Arc::new(Shared {
            settings: parts.settings,
            epoch: rand::random::<u64>() >> 1,
            instance_id: parts.instance_id,
            writer: parts.writer,
            broker_acks: parts.broker_acks,
            dead_letters: DeadLetterWriter::new(parts.puller.clone()),
            puller: PullerServiceClient::new(parts.puller),
            offsets: OffsetServiceClient::new(parts.offsets),
            groups: Mutex::default(),
            creating: tokio::sync::Mutex::new(()),
            budgets: Mutex::default(),
            next_group: AtomicU64::new(1),
            next_session: AtomicU64::new(1),
            shutdown: parts.shutdown,
        })
    }

    /// A puller client.
    pub fn puller(&self) -> PullerServiceClient<Channel> {
        self.puller.clone()
    }

    /// A fresh session id.
    pub fn next_session_id(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// The live group with this number.
    pub fn group_by_number(&self, number: u64) -> Option<GroupHandle> {
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

    /// Called by a group actor as it ends.
    pub(crate) fn group_ended(&self, key: &GroupKey, number: u64) {
        let mut groups = self.lock_groups();
        if groups.by_key.get(key).is_some_and(|h| h.number == number) {
            groups.by_key.remove(key);
        }
        groups.by_number.remove(&number);
    }

    /// Stops every group (instance shutdown).
    pub fn stop_all(&self) {
        for handle in self.lock_groups().by_key.values() {
            let _ = handle.commands.send(GroupCmd::Stop);
        }
    }

    /// Joins `session` to its group, creating the group when it is not live here.
    pub async fn join(
        self: &Arc<Self>,
        key: GroupKey,
        start: StartPosition,
        session: SessionLink,
    ) -> Result<GroupHandle, DispatcherError> {
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
                        None => tokio::time::timeout(CREATE_TIMEOUT, self.create(&key, start))
                            .await
                            .map_err(|_| {
                                DispatcherError::dependency(
                                    "puller-svc/offset-svc",
                                    tonic::Status::deadline_exceeded(
                                        "creating the subscription group timed out",
                                    ),
                                )
                            })??,
                    }
                }
            };
            let (reply, answer) = oneshot::channel();
            let sent = handle.commands.send(GroupCmd::Join {
                session: session.clone(),
                reply,
            });
            if sent.is_ok() && answer.await == Ok(true) {
                return Ok(handle);
            }
            // The group is closing: wait for it to end, then create a new one.
            tokio::time::sleep(backoff.next_delay()).await;
        }
        Err(DispatcherError::ShuttingDown(
            "the subscription group could not be joined (instance shutting down or group closing)"
                .into(),
        ))
    }

    async fn create(
        self: &Arc<Self>,
        key: &GroupKey,
        start: StartPosition,
    ) -> Result<GroupHandle, DispatcherError> {
        let puller_error = |status| DispatcherError::dependency("puller-svc", status);
        let offset_error = |status| DispatcherError::dependency("offset-svc", status);
        let mut puller = self.puller.clone();
        let mut offsets = self.offsets.clone();
        puller
            .create_topic(CreateTopicRequest {
                topic: key.topic.to_string(),
                partitions: 0,
            })
            .await
            .map_err(puller_error)?;
        let cursor_client = OffsetClient::MqCursor(key.group.clone()).to_string();
        let mut stored: HashMap<PartitionId, i64> = HashMap::new();
        for entry in offsets
            .read_topic_offsets(ReadTopicOffsetsRequest {
                topic: key.topic.to_string(),
                client_id: cursor_client.clone(),
            })
            .await
            .map_err(offset_error)?
            .into_inner()
            .entries
        {
            if let Some(partition) = entry.key.and_then(|k| PartitionId::new(k.partition).ok()) {
                stored.insert(partition, entry.offset);
            }
        }
        // Partitions the group's reader already has a cursor in: the group existed (a
        // dispatcher restart, a group that came back); it resumes, the start does not apply.
        let known: std::collections::HashSet<String> = puller
            .cursors(CursorsRequest {
                topic: key.topic.to_string(),
                group: key.reader().group,
            })
            .await
            .map_err(puller_error)?
            .into_inner()
            .cursors
            .into_iter()
            .map(|c| c.partition)
            .collect();
        if start != StartPosition::Stored {
            let ranges = puller
                .end_offsets(EndOffsetsRequest {
                    topic: key.topic.to_string(),
                })
                .await
                .map_err(puller_error)?
                .into_inner()
                .partitions;
            let mut entries = Vec::new();
            for range in ranges {
                let Ok(partition) = PartitionId::new(range.partition.clone()) else {
                    continue;
                };
                if stored.contains_key(&partition) || known.contains(&range.partition) {
                    continue;
                }
                let first = match start {
                    StartPosition::Earliest => range.start,
                    _ => range.end,
                };
                if first > 0 {
                    stored.insert(partition, first - 1);
                    entries.push(OffsetEntry {
                        key: Some(eventmesh_proto::offset::OffsetKey {
                            topic: key.topic.to_string(),
                            client_id: cursor_client.clone(),
                            partition: range.partition,
                        }),
                        offset: first - 1,
                    });
                }
            }
            if !entries.is_empty() {
                offsets
                    .write_offsets(WriteOffsetsRequest {
                        entries,
                        sync: self.settings.sync_offsets,
                    })
                    .await
                    .map_err(offset_error)?;
            }
        }
        let cursors = puller
            .attach(AttachRequest {
                dispatcher_id: self.instance_id.clone(),
                readers: vec![key.reader()],
            })
            .await
            .map_err(puller_error)?
            .into_inner()
            .cursors;
        let mut seeds = stored;
        for cursor in cursors {
            if let Ok(partition) = PartitionId::new(cursor.partition) {
                seeds.entry(partition).or_insert(cursor.next_offset - 1);
            }
        }
        let number = self.next_group.fetch_add(1, Ordering::Relaxed);
        let budget = self.budget(&key.topic);
        let (commands, gate, _task) = group::spawn(
            Arc::clone(self),
            GroupInit {
                key: key.clone(),
                number,
                seeds,
                budget: Arc::clone(&budget),
            },
        );
        tokio::spawn(pull_loop(
            Arc::clone(self),
            key.clone(),
            commands.clone(),
            gate,
            budget,
        ));
        let handle = GroupHandle {
            number,
            key: key.clone(),
            commands,
        };
        let mut groups = self.lock_groups();
        groups.by_key.insert(key.clone(), handle.clone());
        groups.by_number.insert(number, handle.clone());
        tracing::info!(group = %key, number, ?start, "subscription group created and its reader realigned");
        Ok(handle)
    }
}

/// Waits until the gate opens; `false` when the group ended.
async fn gate_open(gate: &mut watch::Receiver<PullGate>) -> bool {
    loop {
        match *gate.borrow_and_update() {
            PullGate::Open => return true,
            PullGate::Closed => return false,
            PullGate::Paused => {}
        }
        if gate.changed().await.is_err() {
            return false;
        }
    }
}

async fn pull_loop(
    shared: Arc<Shared>,
    key: GroupKey,
    group: mpsc::UnboundedSender<GroupCmd>,
    mut gate: watch::Receiver<PullGate>,
    budget: Arc<TopicBudget>,
) {
    let label = key.label();
    let mut puller = shared.puller();
    let mut backoff = Backoff::default();
    let batch = shared.settings.pull_batch;
    loop {
        let open = tokio::select! {
            open = gate_open(&mut gate) => open,
            () = shared.shutdown.cancelled() => false,
        };
        if !open {
            return;
        }
        let mut charge = tokio::select! {
            charge = budget.reserve(&label, batch, PULL_KIB) => charge,
            () = shared.shutdown.cancelled() => return,
        };
        let request = PullRequest {
            reader: Some(key.reader()),
            partition: String::new(),
            max_records: charge.records,
            max_bytes: charge.kib.saturating_mul(1024),
            max_wait_ms: PULL_WAIT_MS,
        };
        match puller.pull(request).await {
            Ok(response) => {
                backoff.reset();
                let pulled = response.into_inner();
                let kib: u32 = pulled.records.iter().map(|r| kib_cost(r.frame.len())).sum();
                if kib > charge.kib {
                    budget.charge_more_kib(&label, kib - charge.kib).await;
                    charge.kib = kib;
                }
                metrics::counter!("dispatcher_pulled_records_total", "topic" => key.topic.to_string())
                    .increment(pulled.records.len() as u64);
                if group
                    .send(GroupCmd::Pulled {
                        batch: pulled,
                        charge,
                    })
                    .is_err()
                {
                    budget.release(&label, charge);
                    return;
                }
            }
            Err(status) => {
                budget.release(&label, charge);
                tracing::warn!(group = %key, code = ?status.code(), message = status.message(), "pull failed; retrying");
                tokio::select! {
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                    () = shared.shutdown.cancelled() => return,
                }
            }
        }
    }
}
