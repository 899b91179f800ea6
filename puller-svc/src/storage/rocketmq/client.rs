//! The RocketMQ client both backends share: the client's own runtime, one producer, one
//! name-server/broker handle, and a cache of topic routes.
//!
//! * **Its own runtime.** `rocketmq-client-rust` 1.0.0 runs its connections and background
//!   tasks on a `RuntimeOwner` (its own tokio runtime and threads). Every call we make is
//!   spawned there too ([`RocketMqClient::call`]) and its answer comes back over a oneshot, so
//!   the client never runs on the puller's gRPC workers and a stuck broker call is bounded by
//!   our own timeout. The client's observability is left off (`TelemetryHandle::noop()`,
//!   `install_global` never called): it installs no tracing subscriber, `log` logger or
//!   OpenTelemetry global, so ours stay in place.
//! * **Started lazily.** Nothing is contacted at construction: a puller whose name server is
//!   down starts and answers UNAVAILABLE until it is reachable.
//! * **Routes** come from the name server and are cached for [`ROUTE_TTL`] (queues added to a
//!   topic are picked up within that). A topic without a route does not exist: a send to it is
//!   refused, never left to the broker's auto-create.
//! * **Queues** are ordered as the Java producer orders them (broker name, then queue id), so a
//!   key lands on the queue a Java producer's `SelectMessageQueueByHash` picks.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cheetah_string::CheetahString;
use eventmesh_common::keys::{PartitionId, PartitionKind, Topic};
use rocketmq_client_rust::{
    ClientConfig, ClientError, ClientInstanceHandle, ClientRuntime, ClientRuntimeConfig,
    DefaultMQProducer, TelemetryHandle,
};
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_protocol::protocol::header::query_consumer_offset_request_header::QueryConsumerOffsetRequestHeader;
use rocketmq_protocol::protocol::route::topic_route_data::TopicRouteData;
use rocketmq_protocol::{RemotingCommand, RpcRequestHeader, TopicRequestHeader};
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};

use super::names::PRODUCER_GROUP;
use crate::storage::StorageError;

/// How long a topic route is trusted before the name server is asked again.
pub const ROUTE_TTL: Duration = Duration::from_secs(1);
/// Bound of one name-server or broker call (our side; the client has its own).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a created topic may take to show on every broker in the route: one periodic
/// broker registration (`registerNameServerPeriod`, 30 s by default) and some.
const ROUTE_REGISTRATION_WAIT: Duration = Duration::from_secs(40);
/// The broker's answer to an offset query for a group that holds none (`QUERY_NOT_FOUND`).
const QUERY_NOT_FOUND: i32 = 22;
/// The broker's answer code for success.
pub const SUCCESS: i32 = 0;
/// The broker id of a master in a route's broker addresses (RocketMQ `MixAll.MASTER_ID`).
const MASTER_ID: u64 = 0;
/// Permission bits of a queue set (RocketMQ `PermName`).
const PERM_WRITE: u32 = 0x2;
const PERM_READ: u32 = 0x4;

/// A client error as our storage error: the backend is unreachable or refused the call.
pub fn unavailable(what: &str, err: &ClientError) -> StorageError {
    StorageError::Unavailable(format!("rocketmq {what}: {}", describe(err)))
}

/// A client error with what its `Display` leaves out: the client's own message and the
/// broker's response code.
pub fn describe(err: &ClientError) -> String {
    let mut text = err.to_string();
    let detail = err
        .source_ref::<rocketmq_client_rust::MQClientException>()
        .and_then(|e| e.error_message().map(|m| (m.to_owned(), e.response_code())))
        .or_else(|| {
            err.source_ref::<rocketmq_client_rust::MQBrokerException>()
                .and_then(|e| e.error_message().map(|m| (m.to_owned(), e.response_code())))
        });
    if let Some((message, code)) = detail {
        text.push_str(&format!(" ({message}"));
        if code >= 0 {
            text.push_str(&format!(", code {code}"));
        }
        text.push(')');
    } else if let Some(code) = err.broker_response_code() {
        text.push_str(&format!(" (broker code {code})"));
    }
    text
}

/// Where the RocketMQ backends find the cluster, and its limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RocketMqSettings {
    /// Name server(s), `host:port;...`.
    pub namesrv: String,
    /// The cluster on whose masters created topics get their queues.
    pub cluster: String,
    /// The largest message body the brokers accept (their `maxMessageSize`); a larger
    /// publish is refused with INVALID_ARGUMENT, never retried.
    pub max_message_bytes: usize,
}

impl RocketMqSettings {
    /// The broker's default `maxMessageSize`.
    pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

    /// Defaults for the name server at `namesrv`: cluster `DefaultCluster`, 4 MiB messages.
    pub fn new(namesrv: impl Into<String>) -> Self {
        RocketMqSettings {
            namesrv: namesrv.into(),
            cluster: "DefaultCluster".into(),
            max_message_bytes: Self::DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// One queue of a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueRef {
    /// Its broker's name.
    pub broker: String,
    /// Its id on that broker.
    pub queue_id: u32,
    /// `broker:queue`, the partition id everywhere in the puller.
    pub partition: PartitionId,
}

impl QueueRef {
    /// The client's form of the queue.
    pub fn message_queue(&self, topic: &Topic) -> MessageQueue {
        MessageQueue::from_parts(topic.as_str(), self.broker.as_str(), self.queue_id as i32)
    }
}

/// A topic's route: its queues and its brokers' master addresses.
#[derive(Debug, Clone, Default)]
pub struct Route {
    /// Queues a consumer reads, in producer order.
    pub read: Vec<QueueRef>,
    /// Queues a producer writes, in producer order.
    pub write: Vec<QueueRef>,
    /// Master address per broker name.
    pub masters: HashMap<String, String>,
}

impl Route {
    /// The readable queue a partition id names, or NOT_FOUND.
    pub fn read_queue(
        &self,
        topic: &Topic,
        partition: &PartitionId,
    ) -> Result<&QueueRef, StorageError> {
        self.read
            .iter()
            .find(|q| q.partition == *partition)
            .ok_or_else(|| unknown_partition(topic, partition))
    }

    /// The master address of a broker.
    pub fn master(&self, broker: &str) -> Result<&str, StorageError> {
        self.masters.get(broker).map(String::as_str).ok_or_else(|| {
            StorageError::Unavailable(format!(
                "rocketmq broker {broker} has no master in the route"
            ))
        })
    }
}

/// The master address of each broker in a name server's route data.
fn masters(data: &TopicRouteData) -> HashMap<String, String> {
    data.broker_datas
        .iter()
        .filter_map(|broker| {
            let master = broker.broker_addrs().get(&MASTER_ID)?;
            Some((broker.broker_name().to_string(), master.to_string()))
        })
        .collect()
}

/// The header that routes a broker request to `broker` (a request a proxy could forward).
pub fn broker_header(broker: &str) -> Option<TopicRequestHeader> {
    Some(TopicRequestHeader {
        rpc_request_header: Some(RpcRequestHeader {
            broker_name: Some(broker.into()),
            ..RpcRequestHeader::default()
        }),
        lo: None,
    })
}

/// NOT_FOUND for a partition the topic does not have.
pub fn unknown_partition(topic: &Topic, partition: &PartitionId) -> StorageError {
    StorageError::UnknownPartition {
        topic: topic.to_string(),
        partition: partition.to_string(),
    }
}

/// Java's `String.hashCode` (UTF-16 code units), the hash `SelectMessageQueueByHash` uses.
pub fn java_string_hash(text: &str) -> i32 {
    text.encode_utf16().fold(0i32, |hash, unit| {
        hash.wrapping_mul(31).wrapping_add(i32::from(unit))
    })
}

/// The queue index a key selects among `count` queues, as the Java producer picks it.
pub fn queue_for_key(key: &str, count: usize) -> usize {
    let count = count.max(1) as i32;
    (java_string_hash(key) % count).unsigned_abs() as usize
}

struct CachedRoute {
    route: std::sync::Arc<Route>,
    fetched: Instant,
}

/// The started parts of the client.
struct Started {
    producer: DefaultMQProducer,
    handle: std::sync::Arc<ClientInstanceHandle>,
}

/// A pooled handle (see [`RocketMqClient::lane`]).
pub struct Lane<'c> {
    client: &'c RocketMqClient,
    handle: std::sync::Arc<ClientInstanceHandle>,
}

impl Lane<'_> {
    /// The handle, to move into a call.
    pub fn handle(&self) -> std::sync::Arc<ClientInstanceHandle> {
        std::sync::Arc::clone(&self.handle)
    }
}

impl Drop for Lane<'_> {
    fn drop(&mut self) {
        self.client
            .lanes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(std::sync::Arc::clone(&self.handle));
    }
}

/// The shared RocketMQ client (see the module docs).
pub struct RocketMqClient {
    settings: RocketMqSettings,
    runtime: std::sync::Arc<ClientRuntime>,
    /// Where our calls run: the client's own runtime.
    spawner: tokio::runtime::Handle,
    started: tokio::sync::OnceCell<Started>,
    routes: Mutex<HashMap<Topic, CachedRoute>>,
    /// Idle handles for [`RocketMqClient::lane`].
    lanes: Mutex<Vec<std::sync::Arc<ClientInstanceHandle>>>,
    round_robin: AtomicUsize,
    /// Kept last: dropping it stops the client's runtime.
    _owner: RuntimeOwner,
}

impl std::fmt::Debug for RocketMqClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocketMqClient")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl RocketMqClient {
    /// The client's runtime and threads for the cluster `settings` name; nothing is contacted
    /// yet.
    pub async fn new(settings: RocketMqSettings) -> Result<Self, StorageError> {
        let internal = |what: &str, err: &dyn std::fmt::Display| {
            StorageError::Internal(format!("rocketmq client {what}: {err}"))
        };
        let owner = RuntimeOwner::plan(RuntimeConfig {
            thread_name: "rocketmq-client".into(),
            worker_threads: 2,
            ..RuntimeConfig::default()
        })
        .map_err(|err| internal("runtime plan", &err))?
        .build()
        .map_err(|err| internal("runtime", &err))?;
        let context = owner.root_context().component("eventmesh-puller");
        let runtime = ClientRuntime::try_new(
            context.clone(),
            ClientRuntimeConfig::default(),
            TelemetryHandle::noop(),
        )
        .map_err(|err| internal("client runtime", &err))?;
        // The client runtime's own tokio handle, taken from a task running there.
        let (tx, rx) = tokio::sync::oneshot::channel();
        context
            .spawn("handle", rocketmq_runtime::TaskKind::Worker, async move {
                let _ = tx.send(tokio::runtime::Handle::current());
            })
            .map_err(|err| internal("spawn", &err))?;
        let spawner = rx.await.map_err(|err| internal("runtime handle", &err))?;
        Ok(RocketMqClient {
            settings,
            runtime,
            spawner,
            started: tokio::sync::OnceCell::new(),
            routes: Mutex::new(HashMap::new()),
            lanes: Mutex::new(Vec::new()),
            round_robin: AtomicUsize::new(0),
            _owner: owner,
        })
    }

    /// The name server this client asks.
    pub fn namesrv(&self) -> &str {
        &self.settings.namesrv
    }

    /// Refuses a body larger than the brokers take (INVALID_ARGUMENT: a retry cannot help).
    pub fn check_body(&self, body: &[u8]) -> Result<(), StorageError> {
        if body.len() > self.settings.max_message_bytes {
            return Err(StorageError::Invalid(format!(
                "a message of {} bytes exceeds the RocketMQ brokers' {}-byte limit (maxMessageSize; \
                 the puller's rocketmq_max_message_bytes)",
                body.len(),
                self.settings.max_message_bytes
            )));
        }
        Ok(())
    }

    /// The client runtime, for consumers a backend builds itself.
    pub fn runtime(&self) -> std::sync::Arc<ClientRuntime> {
        std::sync::Arc::clone(&self.runtime)
    }

    /// The largest body a message may carry (the brokers' `maxMessageSize`).
    pub fn max_message_bytes(&self) -> usize {
        self.settings.max_message_bytes
    }

    /// A client config for this name server, with every address on this host's loopback-safe
    /// defaults.
    pub fn config(&self) -> ClientConfig {
        let mut config = ClientConfig::default();
        config.set_namesrv_addr(self.settings.namesrv.as_str().into());
        config
    }

    /// Runs `work` on the client's runtime, bounded by `timeout`.
    ///
    /// Not an `async fn`: `work` is spawned at once and the returned future holds only the
    /// task's handle. As an `async fn` it kept `work` (a RocketMQ client future, a type many
    /// levels deep) inside its own future, and the compiler proved `Send` through that whole
    /// type again in every future awaiting it, up to each `Send`-boxed trait method: this
    /// crate's compile took 156 s instead of 89.
    pub fn call<T, F>(
        &self,
        what: &'static str,
        timeout: Duration,
        work: F,
    ) -> impl Future<Output = Result<T, StorageError>> + Send + 'static
    where
        T: Send + 'static,
        F: Future<Output = Result<T, StorageError>> + Send + 'static,
    {
        let task = self.spawner.spawn(work);
        async move {
            match tokio::time::timeout(timeout, task).await {
                Ok(Ok(result)) => result,
                Ok(Err(err)) => Err(StorageError::Internal(format!(
                    "rocketmq {what} task failed: {err}"
                ))),
                Err(_) => Err(StorageError::Unavailable(format!(
                    "rocketmq {what}: no answer within {} ms",
                    timeout.as_millis()
                ))),
            }
        }
    }

    async fn started(&self) -> Result<&Started, StorageError> {
        self.started
            .get_or_try_init(|| async {
                let mut producer = DefaultMQProducer::builder(self.runtime())
                    .client_config(self.config())
                    .producer_group(PRODUCER_GROUP)
                    .max_message_size(
                        u32::try_from(self.settings.max_message_bytes).unwrap_or(u32::MAX),
                    )
                    .build();
                let handle =
                    ClientInstanceHandle::get_or_create(&self.runtime, 1, self.config(), None)
                        .map_err(|err| unavailable("client instance", &err))?;
                let handle = std::sync::Arc::new(handle);
                let started = {
                    let handle = std::sync::Arc::clone(&handle);
                    self.call("start", CALL_TIMEOUT, async move {
                        producer
                            .start()
                            .await
                            .map_err(|err| unavailable("producer start", &err))?;
                        handle
                            .start()
                            .await
                            .map_err(|err| unavailable("client start", &err))?;
                        Ok(producer)
                    })
                    .await?
                };
                Ok(Started {
                    producer: started,
                    handle,
                })
            })
            .await
    }

    /// The started producer.
    pub async fn producer(&self) -> Result<DefaultMQProducer, StorageError> {
        Ok(self.started().await?.producer.clone())
    }

    /// The started name-server/broker handle.
    pub async fn handle(&self) -> Result<std::sync::Arc<ClientInstanceHandle>, StorageError> {
        Ok(std::sync::Arc::clone(&self.started().await?.handle))
    }

    /// A handle of its own on the same client instance, from a pool: every handle serialises
    /// its calls (one operation gate per handle), so a long-polling POP must not share one with
    /// other reads or with ACKs. The handle goes back to the pool when the lease is dropped.
    pub async fn lane(&self) -> Result<Lane<'_>, StorageError> {
        self.started().await?;
        let pooled = self.lanes.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let handle = match pooled {
            Some(handle) => handle,
            None => std::sync::Arc::new(
                ClientInstanceHandle::get_or_create(&self.runtime, 1, self.config(), None)
                    .map_err(|err| unavailable("client instance", &err))?,
            ),
        };
        Ok(Lane {
            client: self,
            handle,
        })
    }

    /// One admin request to the broker at `addr`, on a lane of its own; its answer, or an
    /// error naming `what` when it does not answer SUCCESS.
    pub async fn admin(
        &self,
        what: &str,
        addr: CheetahString,
        request: RemotingCommand,
    ) -> Result<RemotingCommand, StorageError> {
        let lane = self.lane().await?;
        let handle = lane.handle();
        let what = what.to_owned();
        self.call("admin", CALL_TIMEOUT, async move {
            let answer = handle
                .invoke_remoting(&addr, request, CALL_TIMEOUT.as_millis() as u64)
                .await
                .map_err(|err| unavailable(&what, &err))?;
            if answer.code() != SUCCESS {
                return Err(StorageError::Unavailable(format!(
                    "the broker refused the {what}: code {} {}",
                    answer.code(),
                    answer.remark().map(|r| r.as_str()).unwrap_or("")
                )));
            }
            Ok(answer)
        })
        .await
    }

    /// The name server's route data of the topic `name` (`None`: it has none); `what` names
    /// the call in errors.
    async fn name_server_route(
        &self,
        what: &'static str,
        name: String,
    ) -> Result<Option<TopicRouteData>, StorageError> {
        let handle = self.handle().await?;
        self.call(what, CALL_TIMEOUT, async move {
            handle
                .topic_route(&name, CALL_TIMEOUT.as_millis() as u64)
                .await
                .map_err(|err| unavailable(what, &err))
        })
        .await
    }

    /// The topic's route (cached for [`ROUTE_TTL`]); NOT_FOUND when it has none.
    pub async fn route(&self, topic: &Topic) -> Result<std::sync::Arc<Route>, StorageError> {
        if let Some(cached) = self.cached_route(topic) {
            return Ok(cached);
        }
        let data = self
            .name_server_route("topic route", topic.to_string())
            .await?
            .ok_or_else(|| StorageError::UnknownTopic(topic.to_string()))?;
        let mut route = Route::default();
        let mut queue_datas = data.queue_datas.clone();
        queue_datas.sort_by(|a, b| a.broker_name.cmp(&b.broker_name));
        for queue_data in &queue_datas {
            let broker = queue_data.broker_name.to_string();
            for queue_id in 0..queue_data.read_queue_nums.max(queue_data.write_queue_nums) {
                let partition = PartitionId::queue(&broker, queue_id).map_err(|err| {
                    StorageError::Internal(format!(
                        "broker name {broker:?} cannot name a partition: {err}"
                    ))
                })?;
                let queue = QueueRef {
                    broker: broker.clone(),
                    queue_id,
                    partition,
                };
                if queue_data.perm & PERM_READ != 0 && queue_id < queue_data.read_queue_nums {
                    route.read.push(queue.clone());
                }
                if queue_data.perm & PERM_WRITE != 0 && queue_id < queue_data.write_queue_nums {
                    route.write.push(queue);
                }
            }
        }
        route.masters = masters(&data);
        if route.read.is_empty() && route.write.is_empty() {
            return Err(StorageError::UnknownTopic(topic.to_string()));
        }
        let route = std::sync::Arc::new(route);
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                topic.clone(),
                CachedRoute {
                    route: std::sync::Arc::clone(&route),
                    fetched: Instant::now(),
                },
            );
        Ok(route)
    }

    fn cached_route(&self, topic: &Topic) -> Option<std::sync::Arc<Route>> {
        let routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        routes
            .get(topic)
            .filter(|cached| cached.fetched.elapsed() < ROUTE_TTL)
            .map(|cached| std::sync::Arc::clone(&cached.route))
    }

    /// Forgets a cached route (after creating the topic, or when a broker refused a queue).
    pub fn forget_route(&self, topic: &Topic) {
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(topic);
    }

    /// The queue a send goes to: the partition named (it must be a writable queue of the
    /// topic), else the queue the key hashes to, else the next one round robin.
    pub fn pick_queue<'r>(
        &self,
        route: &'r Route,
        topic: &Topic,
        key: Option<&str>,
        partition: Option<&PartitionId>,
    ) -> Result<&'r QueueRef, StorageError> {
        if route.write.is_empty() {
            return Err(StorageError::Unavailable(format!(
                "rocketmq topic {topic} has no writable queue"
            )));
        }
        if let Some(partition) = partition {
            if !matches!(partition.kind(), PartitionKind::Queue { .. }) {
                return Err(unknown_partition(topic, partition));
            }
            return route
                .write
                .iter()
                .find(|q| q.partition == *partition)
                .ok_or_else(|| unknown_partition(topic, partition));
        }
        let index = match key {
            Some(key) => queue_for_key(key, route.write.len()),
            None => self.round_robin.fetch_add(1, Ordering::Relaxed) % route.write.len(),
        };
        Ok(&route.write[index])
    }

    /// Creates `topic` with `queues_per_broker` queues on every master of the cluster;
    /// `Ok(false)` when it existed.
    pub async fn create_topic(
        &self,
        topic: &Topic,
        queues_per_broker: u32,
    ) -> Result<bool, StorageError> {
        match self.route(topic).await {
            Ok(_) => return Ok(false),
            Err(StorageError::UnknownTopic(_)) => {}
            Err(err) => return Err(err),
        }
        let queues = i32::try_from(queues_per_broker)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                StorageError::Invalid(format!("a topic needs 1 to {} queues per broker", i32::MAX))
            })?;
        // The client creates the topic on the masters the name server lists for the cluster
        // at this moment; those are the brokers the route must show before we answer.
        let brokers = self.cluster_brokers().await?;
        let mut producer = self.producer().await?;
        let (cluster, name) = (self.settings.cluster.clone(), topic.to_string());
        self.call("create topic", CALL_TIMEOUT, async move {
            producer
                .create_topic(&cluster, &name, queues, HashMap::new())
                .await
                .map_err(|err| unavailable("create topic", &err))
        })
        .await?;
        // Each broker registers the new topic with the name server as it creates it, but
        // drops that registration silently when it fails (a busy or just-started broker);
        // its next periodic registration carries it. Until every broker shows the topic a
        // send or a reader would miss its queues there, so wait for all of them.
        let deadline = Instant::now() + ROUTE_REGISTRATION_WAIT;
        loop {
            self.forget_route(topic);
            let missing: Vec<&str> = match self.route(topic).await {
                Ok(route) => brokers
                    .iter()
                    .filter(|broker| !route.masters.contains_key(*broker))
                    .map(String::as_str)
                    .collect(),
                Err(StorageError::UnknownTopic(_)) => brokers.iter().map(String::as_str).collect(),
                Err(err) => return Err(err),
            };
            if missing.is_empty() {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                self.forget_route(topic);
                return Err(StorageError::Unavailable(format!(
                    "rocketmq created {topic}, but after {} s the name server's route still \
                     lacks broker(s) {}: a broker registers a topic when it creates it, else \
                     at its next periodic registration (registerNameServerPeriod)",
                    ROUTE_REGISTRATION_WAIT.as_secs(),
                    missing.join(", ")
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The brokers of our cluster that have a master, as the name server lists them (the
    /// route of the topic named after the cluster).
    async fn cluster_brokers(&self) -> Result<Vec<String>, StorageError> {
        let data = self
            .name_server_route("cluster route", self.settings.cluster.clone())
            .await?;
        let brokers: Vec<String> = data
            .map(|data| masters(&data).into_keys().collect())
            .unwrap_or_default();
        if brokers.is_empty() {
            return Err(StorageError::Unavailable(format!(
                "rocketmq cluster {} has no master broker registered with the name server",
                self.settings.cluster
            )));
        }
        Ok(brokers)
    }

    /// A queue's retained range `[min, max)`, from its broker.
    pub async fn queue_range(
        &self,
        topic: &Topic,
        queue: &QueueRef,
    ) -> Result<(i64, i64), StorageError> {
        let route = self.route(topic).await?;
        let addr = route.master(&queue.broker)?.to_owned();
        let mq = queue.message_queue(topic);
        let handle = self.handle().await?;
        self.call("queue offsets", CALL_TIMEOUT, async move {
            let timeout = CALL_TIMEOUT.as_millis() as u64;
            let min = handle
                .min_offset(&addr, &mq, timeout)
                .await
                .map_err(|err| unavailable("min offset", &err))?;
            let max = handle
                .max_offset(&addr, &mq, timeout)
                .await
                .map_err(|err| unavailable("max offset", &err))?;
            Ok((min, max))
        })
        .await
    }

    /// The consume offset `group` holds on the broker for one queue of `topic` (`None`: it
    /// holds none).
    pub async fn consume_offset(
        &self,
        group: &str,
        topic: &Topic,
        partition: &PartitionId,
    ) -> Result<Option<i64>, StorageError> {
        let route = self.route(topic).await?;
        let queue = route.read_queue(topic, partition)?;
        let addr = route.master(&queue.broker)?.to_owned();
        let mut header =
            QueryConsumerOffsetRequestHeader::new(group, topic.as_str(), queue.queue_id as i32);
        // Without this the broker answers 0 for a group that never committed.
        header.set_zero_if_not_found = Some(false);
        let handle = self.handle().await?;
        self.call("query consumer offset", CALL_TIMEOUT, async move {
            match handle
                .query_consumer_offset(&addr, header, CALL_TIMEOUT.as_millis() as u64)
                .await
            {
                Ok(offset) => Ok(Some(offset)),
                Err(err) if err.broker_response_code() == Some(QUERY_NOT_FOUND) => Ok(None),
                Err(err) => Err(unavailable("query consumer offset", &err)),
            }
        })
        .await
    }
}

/// The Java key hash, checked against values Java computes.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn java_string_hash_matches_java() {
        // "hello".hashCode() == 99162322; "".hashCode() == 0; "polygenelubricants" is the
        // classic Integer.MIN_VALUE hash.
        assert_eq!(java_string_hash("hello"), 99_162_322);
        assert_eq!(java_string_hash(""), 0);
        assert_eq!(java_string_hash("polygenelubricants"), i32::MIN);
        // A non-ASCII key hashes its UTF-16 units: "é" (U+00E9) is 233.
        assert_eq!(java_string_hash("é"), 233);
        // A supplementary character is two surrogate units: "😀" = D83D DE00.
        assert_eq!(java_string_hash("😀"), 0xD83D * 31 + 0xDE00);
    }

    #[test]
    fn queue_for_key_is_the_absolute_remainder() {
        assert_eq!(queue_for_key("hello", 4), (99_162_322 % 4) as usize);
        // Negative hash: Java's Math.abs(hash % n).
        assert_eq!(
            queue_for_key("polygenelubricants", 3),
            (i32::MIN % 3).unsigned_abs() as usize
        );
        assert_eq!(queue_for_key("anything", 1), 0);
    }
}
