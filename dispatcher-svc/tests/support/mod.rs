//! Shared by dispatcher-svc's integration tests: a whole instance on loopback — a real
//! offset-svc (RocksDB on disk), a real puller-svc (the local log on disk) and the dispatcher —
//! plus a small client for sessions.

#![allow(dead_code, clippy::unwrap_used)] // each test binary uses a subset

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dispatcher_svc::config::{Config, DeliverySettings};
use dispatcher_svc::registry::Shared;
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::SubscribeItem;
use eventmesh_proto::client as pb;
use eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient;
use eventmesh_proto::client::{subscribe_request, subscribe_response};
use eventmesh_proto::offset::ReadTopicOffsetsRequest;
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use puller_svc::alignment::WatermarkSource;
use puller_svc::cursors::StartAt;
pub use puller_svc::local_log::LogSettings;
use puller_svc::service::PullerGrpc;
use puller_svc::storage::Storage;
use puller_svc::storage::local::LocalStorage;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::Channel;

/// The in-process services' logs on stderr when `RUST_LOG` is set (`RUST_LOG=puller_svc=debug
/// cargo test … -- --nocapture` to see why a test failed); nothing otherwise. Once per process.
pub fn log_if_asked() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if std::env::var_os("RUST_LOG").is_some() {
        ONCE.call_once(|| {
            match eventmesh_common::telemetry::init(
                "test",
                eventmesh_common::telemetry::LogFormat::Text,
            ) {
                // Lives as long as the process: the test's logs until its end.
                Ok(guard) => std::mem::forget(guard),
                Err(err) => eprintln!("no test logs: {err}"),
            }
        });
    }
}

/// Settings that make tests quick.
pub fn fast_settings() -> DeliverySettings {
    DeliverySettings {
        ack_timeout_ms: 5_000,
        backoff_base_ms: 50,
        backoff_max_ms: 200,
        group_grace_ms: 60_000,
        ..DeliverySettings::default()
    }
}

/// offset-svc on RocksDB in `dir`, on `listen` (port 0: any).
pub async fn start_offset_svc(dir: &Path, listen: SocketAddr) -> offset_svc::server::RunningServer {
    let config = offset_svc::config::Config {
        listen,
        store: offset_svc::config::StoreKind::Rocksdb,
        data_dir: dir.to_path_buf(),
        ..offset_svc::config::Config::default()
    };
    offset_svc::server::start(config, CancellationToken::new())
        .await
        .unwrap()
}

/// puller-svc over the local log in `dir`, reading watermarks from `offset_addr`.
pub async fn start_puller(
    dir: &Path,
    offset_addr: SocketAddr,
) -> puller_svc::server::RunningServer {
    start_puller_with(dir, offset_addr, LogSettings::default()).await
}

/// puller-svc over a local log with `log` settings (segment size, retention).
pub async fn start_puller_with(
    dir: &Path,
    offset_addr: SocketAddr,
    log: LogSettings,
) -> puller_svc::server::RunningServer {
    let storage: Arc<dyn Storage> =
        Arc::new(LocalStorage::open(dir.to_path_buf(), log, StartAt::Earliest).unwrap());
    start_puller_over(storage, offset_addr, 2).await
}

/// puller-svc over any backend, reading watermarks from `offset_addr`; topics created on first
/// use get `default_partitions`.
pub async fn start_puller_over(
    storage: Arc<dyn Storage>,
    offset_addr: SocketAddr,
    default_partitions: u32,
) -> puller_svc::server::RunningServer {
    start_puller_configured(storage, offset_addr, |grpc| {
        grpc.with_default_partitions(default_partitions)
    })
    .await
    .0
}

/// puller-svc with its service configured by `configure`; also returns the service (shared
/// state: for inspecting its readers).
pub async fn start_puller_configured(
    storage: Arc<dyn Storage>,
    offset_addr: SocketAddr,
    configure: impl FnOnce(PullerGrpc) -> PullerGrpc,
) -> (puller_svc::server::RunningServer, PullerGrpc) {
    let watermarks = WatermarkSource::new(eventmesh_common::grpc::traced(lazy(offset_addr)));
    let grpc = configure(PullerGrpc::new(Arc::clone(&storage), watermarks));
    let inspect = grpc.clone();
    let server = puller_svc::server::start(
        "127.0.0.1:0".parse().unwrap(),
        storage,
        grpc,
        CancellationToken::new(),
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    (server, inspect)
}

/// Stored offsets of `client_id` (a client id or `__mqcursor…__`) per partition, read from
/// the offset-svc at `offsets`.
pub async fn stored_offsets(
    offsets: SocketAddr,
    topic: &str,
    client_id: &str,
) -> HashMap<String, i64> {
    OffsetServiceClient::new(lazy(offsets))
        .read_topic_offsets(ReadTopicOffsetsRequest {
            topic: topic.into(),
            client_id: client_id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .map(|e| (e.key.unwrap().partition, e.offset))
        .collect()
}

/// A lazily connecting channel.
pub fn lazy(addr: SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy()
}

/// The dispatcher with `settings`, next to the given neighbours.
pub async fn start_dispatcher(
    puller: SocketAddr,
    offsets: SocketAddr,
    settings: DeliverySettings,
) -> (dispatcher_svc::server::RunningServer, Arc<Shared>) {
    log_if_asked();
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        puller: format!("http://{puller}"),
        offset_svc: format!("http://{offsets}"),
        shutdown_timeout_secs: 2,
        delivery: settings,
        ..Config::default()
    };
    dispatcher_svc::server::start(config, CancellationToken::new())
        .await
        .unwrap()
}

/// A whole instance in temporary directories.
pub struct Instance {
    pub dir: tempfile::TempDir,
    pub offset_svc: Option<offset_svc::server::RunningServer>,
    pub offset_addr: SocketAddr,
    pub puller: puller_svc::server::RunningServer,
    pub dispatcher: Option<dispatcher_svc::server::RunningServer>,
    pub shared: Arc<Shared>,
    pub settings: DeliverySettings,
}

impl Instance {
    pub async fn start(settings: DeliverySettings) -> Instance {
        Instance::start_with_log(settings, LogSettings::default()).await
    }

    /// An instance whose local log has `log` settings.
    pub async fn start_with_log(settings: DeliverySettings, log: LogSettings) -> Instance {
        let dir = tempfile::tempdir().unwrap();
        let offset_svc =
            start_offset_svc(&dir.path().join("offsets"), "127.0.0.1:0".parse().unwrap()).await;
        let offset_addr = offset_svc.local_addr();
        let puller = start_puller_with(&dir.path().join("puller"), offset_addr, log).await;
        let (dispatcher, shared) =
            start_dispatcher(puller.local_addr(), offset_addr, settings.clone()).await;
        Instance {
            dir,
            offset_svc: Some(offset_svc),
            offset_addr,
            puller,
            dispatcher: Some(dispatcher),
            shared,
            settings,
        }
    }

    pub fn dispatcher_addr(&self) -> SocketAddr {
        self.dispatcher.as_ref().unwrap().local_addr()
    }

    pub async fn client(&self) -> EventMeshServiceClient<Channel> {
        EventMeshServiceClient::connect(format!("http://{}", self.dispatcher_addr()))
            .await
            .unwrap()
    }

    pub async fn puller_client(&self) -> PullerServiceClient<Channel> {
        PullerServiceClient::connect(format!("http://{}", self.puller.local_addr()))
            .await
            .unwrap()
    }

    pub fn offsets_client(&self) -> OffsetServiceClient<Channel> {
        OffsetServiceClient::new(lazy(self.offset_addr))
    }

    /// Creates `topic` with `partitions` partitions.
    pub async fn create_topic(&self, topic: &str, partitions: u32) {
        self.puller_client()
            .await
            .create_topic(eventmesh_proto::puller::CreateTopicRequest {
                topic: topic.into(),
                partitions,
                implicit: false,
            })
            .await
            .unwrap();
    }

    /// Stored offsets of `client_id` (a client id or `__mqcursor…__`) per partition.
    pub async fn stored(&self, topic: &str, client_id: &str) -> HashMap<String, i64> {
        stored_offsets(self.offset_addr, topic, client_id).await
    }

    /// Stops the dispatcher (gracefully) and starts a new one with the same settings.
    pub async fn restart_dispatcher(&mut self) {
        let old = self.dispatcher.take().unwrap();
        old.shutdown();
        old.wait().await.unwrap();
        let (dispatcher, shared) = start_dispatcher(
            self.puller.local_addr(),
            self.offset_addr,
            self.settings.clone(),
        )
        .await;
        self.dispatcher = Some(dispatcher);
        self.shared = shared;
    }

    /// Stops offset-svc.
    pub async fn stop_offset_svc(&mut self) {
        let server = self.offset_svc.take().unwrap();
        server.shutdown();
        server.wait().await.unwrap();
    }

    /// Starts offset-svc again on the same address and disk.
    pub async fn restart_offset_svc(&mut self) {
        self.offset_svc =
            Some(start_offset_svc(&self.dir.path().join("offsets"), self.offset_addr).await);
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

/// An event whose data is `n` as text.
pub fn event(n: u64) -> pb::Event {
    pb::Event {
        id: format!("e-{n}"),
        source: "/test".into(),
        r#type: "test".into(),
        data: Bytes::from(n.to_string()),
        ..pb::Event::default()
    }
}

/// The number an [`event`] carries.
pub fn number(delivery: &pb::Delivery) -> u64 {
    let data = &delivery.event.as_ref().unwrap().data;
    std::str::from_utf8(data).unwrap().parse().unwrap()
}

/// Publishes events `range` to `topic` with key = the number (so partitions spread).
pub async fn publish(
    client: &mut EventMeshServiceClient<Channel>,
    topic: &str,
    range: std::ops::Range<u64>,
) {
    for n in range {
        client
            .publish(pb::PublishRequest {
                topic: topic.into(),
                event: Some(event(n)),
                key: format!("k{n}"),
            })
            .await
            .unwrap();
    }
}

/// One Subscribe stream.
pub struct Session {
    pub tx: mpsc::Sender<pb::SubscribeRequest>,
    pub rx: Streaming<pb::SubscribeResponse>,
    pub opened: pb::Opened,
    /// Results received while waiting for deliveries (and vice versa).
    pub results: Vec<pb::AckResult>,
    pub deliveries: Vec<pb::Delivery>,
}

/// An Open that starts a new group at the earliest retained event (tests publish first).
pub fn open(client_id: &str, topic: &str, group: &str, mode: pb::SubscriptionMode) -> pb::Open {
    pb::Open {
        client_id: client_id.into(),
        topic: topic.into(),
        group: group.into(),
        mode: mode as i32,
        start: pb::StartPosition::Earliest as i32,
        max_in_flight: 0,
    }
}

/// Opens a session; the status on refusal.
pub async fn try_subscribe(addr: SocketAddr, open: pb::Open) -> Result<Session, tonic::Status> {
    // Room for an event at the frame limit, as the SDK has.
    let mut client = EventMeshServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(dispatcher_svc::server::MAX_MESSAGE_BYTES);
    try_subscribe_on(&mut client, open).await
}

/// Opens a session on `client`'s connection; the status on refusal.
pub async fn try_subscribe_on(
    client: &mut EventMeshServiceClient<Channel>,
    open: pb::Open,
) -> Result<Session, tonic::Status> {
    let (tx, rx) = mpsc::channel(1024);
    tx.send(pb::SubscribeRequest {
        kind: Some(subscribe_request::Kind::Open(open)),
    })
    .await
    .unwrap();
    let mut rx = client
        .subscribe(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let first = rx.message().await?.expect("a first response");
    let Some(subscribe_response::Kind::Opened(opened)) = first.kind else {
        panic!("expected opened, got {first:?}");
    };
    Ok(Session {
        tx,
        rx,
        opened,
        results: Vec::new(),
        deliveries: Vec::new(),
    })
}

pub async fn subscribe(addr: SocketAddr, open: pb::Open) -> Session {
    try_subscribe(addr, open).await.unwrap()
}

impl Session {
    /// The next message's items (a batch taken apart); `None` at the end or after `wait`.
    async fn next(&mut self, wait: Duration) -> Option<Vec<SubscribeItem>> {
        match tokio::time::timeout(wait, self.rx.message()).await {
            Ok(Ok(Some(message))) => Some(message.into_items()),
            Ok(Ok(None)) => None,
            Ok(Err(status)) => panic!("stream failed: {status}"),
            Err(_) => None,
        }
    }

    /// Receives until `enough` holds or `wait` passes, sorting deliveries and results aside.
    async fn receive_until(&mut self, wait: Duration, enough: impl Fn(&Session) -> bool) {
        let deadline = tokio::time::Instant::now() + wait;
        while !enough(self) {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            let Some(items) = self.next(left).await else {
                break;
            };
            for item in items {
                match item {
                    SubscribeItem::Delivery(d) => self.deliveries.push(d),
                    SubscribeItem::AckResult(r) => self.results.push(r),
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
    }

    /// Waits for `n` deliveries (keeping results aside); fewer if `wait` passes.
    pub async fn deliveries(&mut self, n: usize, wait: Duration) -> Vec<pb::Delivery> {
        self.receive_until(wait, |s| s.deliveries.len() >= n).await;
        let take = n.min(self.deliveries.len());
        self.deliveries.drain(..take).collect()
    }

    /// Waits for `n` results (keeping deliveries aside).
    pub async fn results(&mut self, n: usize, wait: Duration) -> Vec<pb::AckResult> {
        self.receive_until(wait, |s| s.results.len() >= n).await;
        let take = n.min(self.results.len());
        self.results.drain(..take).collect()
    }

    pub async fn ack(&self, ids: &[&str]) {
        self.tx
            .send(pb::SubscribeRequest {
                kind: Some(subscribe_request::Kind::Ack(pb::Ack {
                    delivery_ids: ids.iter().map(|s| s.to_string()).collect(),
                })),
            })
            .await
            .unwrap();
    }

    pub async fn nack(&self, id: &str, delay_ms: u32) {
        self.tx
            .send(pb::SubscribeRequest {
                kind: Some(subscribe_request::Kind::Nack(pb::Nack {
                    delivery_id: id.into(),
                    delay_ms,
                })),
            })
            .await
            .unwrap();
    }

    pub async fn extend(&self, id: &str, extra_ms: u32) {
        self.tx
            .send(pb::SubscribeRequest {
                kind: Some(subscribe_request::Kind::Extend(pb::Extend {
                    delivery_id: id.into(),
                    extra_ms,
                })),
            })
            .await
            .unwrap();
    }

    /// ACKs `deliveries` and waits until every ACK is durable.
    pub async fn ack_durably(&mut self, deliveries: &[pb::Delivery]) {
        let ids: Vec<&str> = deliveries.iter().map(|d| d.delivery_id.as_str()).collect();
        self.ack(&ids).await;
        let results = self.results(ids.len(), Duration::from_secs(10)).await;
        assert_eq!(results.len(), ids.len(), "every ACK answered");
        for result in results {
            assert_eq!(result.outcome(), pb::AckOutcome::Durable, "{result:?}");
        }
    }
}

/// Outcome of the (single) result for `id` in `results`.
pub fn outcome_of(results: &[pb::AckResult], id: &str) -> pb::AckOutcome {
    results
        .iter()
        .find(|r| r.delivery_id == id)
        .unwrap_or_else(|| panic!("no result for {id} in {results:?}"))
        .outcome()
}

/// Reads a topic straight from puller-svc with a reader of its own (to inspect dead letters):
/// attaches the reader on first use (retrying while the topic does not exist yet).
pub struct TopicReader {
    client: PullerServiceClient<Channel>,
    reader: eventmesh_proto::puller::GroupTopic,
    generation: Option<u64>,
}

impl TopicReader {
    pub fn new(puller: SocketAddr, group: &str, topic: &str) -> TopicReader {
        TopicReader {
            client: PullerServiceClient::new(lazy(puller)),
            reader: eventmesh_proto::puller::GroupTopic {
                group: group.into(),
                topic: topic.into(),
            },
            generation: None,
        }
    }

    /// One pull (waiting up to `wait_ms`); an error while the topic does not exist.
    pub async fn pull(
        &mut self,
        wait_ms: u32,
    ) -> Result<Vec<eventmesh_proto::puller::PulledRecord>, tonic::Status> {
        let generation = match self.generation {
            Some(generation) => generation,
            None => {
                let attached = self
                    .client
                    .attach(eventmesh_proto::puller::AttachRequest {
                        dispatcher_id: "test-reader".into(),
                        readers: vec![self.reader.clone()],
                        positions: Vec::new(),
                    })
                    .await?
                    .into_inner();
                let generation = attached.generations[0].generation;
                self.generation = Some(generation);
                generation
            }
        };
        Ok(self
            .client
            .pull(eventmesh_proto::puller::PullRequest {
                reader: Some(self.reader.clone()),
                max_wait_ms: wait_ms,
                generation,
                ..Default::default()
            })
            .await?
            .into_inner()
            .records)
    }
}

/// The real dispatcher binary, next to a puller-svc and offset-svc (killed when dropped).
pub struct Dispatcher {
    child: std::process::Child,
    pub addr: SocketAddr,
}

impl Dispatcher {
    /// Starts it on a free port; `crash_at` names a crash point (`EM_DISPATCHER_CRASH_AT`).
    pub fn start(puller: SocketAddr, offsets: SocketAddr, crash_at: Option<&str>) -> Dispatcher {
        Dispatcher::start_with(puller, offsets, crash_at, &[])
    }

    /// [`Dispatcher::start`] with more command-line flags.
    pub fn start_with(
        puller: SocketAddr,
        offsets: SocketAddr,
        crash_at: Option<&str>,
        flags: &[&str],
    ) -> Dispatcher {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_dispatcher-svc"));
        command
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .arg("--puller")
            .arg(format!("http://{puller}"))
            .arg("--offset-svc")
            .arg(format!("http://{offsets}"))
            .args(["--backoff-base-ms", "50", "--backoff-max-ms", "100"])
            .args(flags)
            .env_remove("EM_DISPATCHER_CRASH_AT")
            .env("RUST_LOG", "warn");
        if let Some(point) = crash_at {
            command.env("EM_DISPATCHER_CRASH_AT", point);
        }
        let (child, addr) =
            eventmesh_testkit::spawn_service(&mut command, "dispatcher-svc").unwrap();
        Dispatcher { child, addr }
    }

    /// `kill -9`, and waits for it to be gone.
    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Waits for the process to die by itself (a crash point); true if it did.
    pub fn died_within(&mut self, wait: Duration) -> bool {
        let deadline = std::time::Instant::now() + wait;
        while std::time::Instant::now() < deadline {
            if self.child.try_wait().unwrap().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
