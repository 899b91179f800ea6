//! The offset writer: step 1 of the ACK chain (DESIGN §3).
//!
//! Every burst of ACKs a group settled (and every dead-letter, and every idle watermark flush)
//! becomes a job carrying the values it needs durable: the group's gap-free watermark under
//! `__mqcursor…__` and the clients' own watermarks. One write is in flight at a time: the jobs
//! that arrived while it ran (plus those within the optional flush window, `ack_flush_ms`, 0 by
//! default) share the next write (one RocksDB write batch in offset-svc). When it
//! succeeds every job in it is told
//! [`WriteNotice::Durable`]; only then may the dispatcher retire the delivery and forward the
//! broker ACK. When it fails, each job is told [`WriteNotice::Pending`] once ("ACKed, write
//! pending", DESIGN §6), the writer reports itself unhealthy (pulling pauses, readiness goes
//! off) and retries the merged batch with backoff until offset-svc answers. Nothing is
//! dropped: a job leaves only as durable.
//!
//! The writer runs on a thread of its own, with its own single-threaded runtime and its own
//! connection to offset-svc: every ACK waits for a write, and on the shared runtime each step
//! of a write (the writer's task, the channel's task, the HTTP/2 connection's task) waited
//! behind the sessions' and groups' work queued there — at half the maximum load a write's
//! round trip took 1.6 ms (p50) for a 60 µs store. On its own thread the steps wait only for
//! the OS to give the thread a core.
//!
//! Batches go over one `WriteOffsetsStream` (a message each way per batch, instead of a
//! call's headers, trailers and stream set-up on both sides), opened on first use and opened
//! again after it broke; an answer not back within the dependency timeout counts as a failed
//! write and the stream is dropped. A batch whose answer was lost is written again, which
//! CAS-max makes harmless.
//!
//! A write covering traced deliveries runs inside a `commit <topic>` span linked to each of
//! them (one write settles many events: it is no one event's child); its context goes to
//! offset-svc with the call, so such a write (rare: sampled traces) is a `WriteOffsets` call
//! of its own rather than a message of the stream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use eventmesh_common::grpc::{InternalChannel, traced};
use eventmesh_common::keys::OffsetKey;
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_common::trace_context::{Operation, SpanContext, links_span};
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{
    OffsetEntry, WriteOffsetsRequest, WriteOffsetsStreamRequest, WriteOffsetsStreamResponse,
};
use futures::FutureExt as _;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::transport::Endpoint;
use tracing::Instrument as _;

use crate::batching::{Backoff, gather};

/// What happened to a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteNotice {
    /// Its values are durable in offset-svc.
    Durable,
    /// The write failed; it is being retried (sent at most once per job).
    Pending,
}

/// Receives the notices of a job.
pub type Listener = Arc<dyn Fn(WriteNotice) + Send + Sync>;

/// Values that must become durable together, and who to tell.
pub struct WriteJob {
    /// Keys and the values they must reach (CAS-max: lower stored values are raised).
    pub entries: Vec<(OffsetKey, i64)>,
    /// The trace contexts of the traced deliveries this job settles.
    pub links: Vec<SpanContext>,
    /// How many deliveries this job settles, traced or not (the write span's
    /// `messaging.batch.message_count`).
    pub settles: usize,
    /// Who is told.
    pub listener: Listener,
}

struct Queued {
    job: WriteJob,
    told_pending: bool,
}

/// The handle to the writer task.
#[derive(Clone)]
pub struct OffsetWriter {
    jobs: mpsc::UnboundedSender<WriteJob>,
    healthy: watch::Receiver<bool>,
}

impl OffsetWriter {
    /// Starts the writer on a thread of its own, connecting to offset-svc at `offset_svc`
    /// from there. It runs until every handle is dropped and its queue is durable, or until
    /// `shutdown` while offset-svc is failing (what is then left was never durable and is
    /// pulled again after a restart). The handle returned ends when the writer has.
    pub fn spawn(
        offset_svc: Endpoint,
        call_timeout: Duration,
        window: Duration,
        sync: bool,
        shutdown: CancellationToken,
    ) -> std::io::Result<(OffsetWriter, JoinHandle<()>)> {
        // Exported from the start, at zero: an alert on their rate needs the series to exist
        // before the first failure.
        metrics::counter!("dispatcher_offset_write_failures_total").increment(0);
        metrics::gauge!("dispatcher_offset_writes_pending").set(0.0);
        let (jobs, rx) = mpsc::unbounded_channel();
        let (health_tx, healthy) = watch::channel(true);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (ended, writer_ended) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("offset-writer".into())
            .spawn(move || {
                runtime.block_on(async move {
                    // Connected here, so the channel's tasks run on this thread's runtime.
                    let connection = Connection {
                        client: OffsetServiceClient::new(traced(offset_svc.connect_lazy())),
                        stream: None,
                        call_timeout,
                    };
                    run(connection, rx, window, sync, health_tx, shutdown).await;
                });
                drop(ended);
            })?;
        let task = tokio::spawn(async move {
            let _ = writer_ended.await;
        });
        Ok((OffsetWriter { jobs, healthy }, task))
    }

    /// Queues a job. A job submitted after the writer stopped is told nothing (the instance is
    /// going down; the delivery stays un-ACKed and is pulled again).
    pub fn submit(&self, job: WriteJob) {
        let _ = self.jobs.send(job);
    }

    /// `true` while the last write succeeded.
    pub fn health(&self) -> watch::Receiver<bool> {
        self.healthy.clone()
    }

    /// Waits until every job submitted before this call is durable (the writer works through
    /// its queue in order). `false` when the writer stopped first.
    pub async fn barrier(&self) -> bool {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let tx = std::sync::Mutex::new(Some(tx));
        self.submit(WriteJob {
            entries: Vec::new(),
            links: Vec::new(),
            settles: 0,
            listener: Arc::new(move |notice| {
                if notice == WriteNotice::Durable
                    && let Some(tx) = tx.lock().unwrap_or_else(|p| p.into_inner()).take()
                {
                    let _ = tx.send(());
                }
            }),
        });
        rx.await.is_ok()
    }
}

async fn run(
    mut connection: Connection,
    mut rx: mpsc::UnboundedReceiver<WriteJob>,
    window: Duration,
    sync: bool,
    health: watch::Sender<bool>,
    shutdown: CancellationToken,
) {
    let mut fresh = Vec::new();
    let mut queue: Vec<Queued> = Vec::new();
    let mut backoff = Backoff::default();
    loop {
        if queue.is_empty() {
            if !gather(&mut rx, window, &mut fresh).await {
                return;
            }
        } else {
            // Retrying: take what arrived meanwhile, never wait for more.
            while let Ok(job) = rx.try_recv() {
                fresh.push(job);
            }
        }
        queue.extend(fresh.drain(..).map(|job| Queued {
            job,
            told_pending: false,
        }));
        if queue.is_empty() {
            continue;
        }
        let request = merged(&queue, sync);
        let entries = request.entries.len();
        let started = Instant::now();
        let span = traced_write_span(&queue);
        let written = if span.is_disabled() {
            connection.write(request).await
        } else {
            write_in_chunks(&mut connection.client, request)
                .instrument(span)
                .await
        };
        match written {
            Ok(_) => {
                metrics::histogram!("dispatcher_offset_write_seconds")
                    .record(started.elapsed().as_secs_f64());
                metrics::histogram!("dispatcher_offset_write_entries").record(entries as f64);
                for queued in queue.drain(..) {
                    (queued.job.listener)(WriteNotice::Durable);
                }
                backoff.reset();
                health.send_if_modified(|h| !std::mem::replace(h, true));
                metrics::gauge!("dispatcher_offset_writes_pending").set(0.0);
            }
            Err(status) => {
                metrics::counter!("dispatcher_offset_write_failures_total").increment(1);
                metrics::gauge!("dispatcher_offset_writes_pending").set(queue.len() as f64);
                health.send_if_modified(|h| std::mem::replace(h, false));
                tracing::warn!(code = ?status.code(), message = status.message(), jobs = queue.len(), "offset write failed; ACKs are pending and will be retried");
                for queued in queue.iter_mut().filter(|q| !q.told_pending) {
                    queued.told_pending = true;
                    (queued.job.listener)(WriteNotice::Pending);
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                    () = shutdown.cancelled() => {
                        tracing::warn!(jobs = queue.len(), "shutting down with offset writes pending; those deliveries will be pulled again");
                        return;
                    }
                }
            }
        }
    }
}

/// The span of a write settling traced deliveries (linked to each), else a disabled one.
fn traced_write_span(queue: &[Queued]) -> tracing::Span {
    let mut traced = queue.iter().filter(|q| !q.job.links.is_empty());
    let Some(first) = traced.next() else {
        return tracing::Span::none();
    };
    let topic = first
        .job
        .entries
        .first()
        .map_or("", |(key, _)| key.topic.as_str());
    let links = queue.iter().flat_map(|q| q.job.links.iter());
    let deliveries = queue.iter().map(|q| q.job.settles).sum();
    links_span(Operation::OFFSET_WRITE, topic, links, deliveries)
}

/// The writer's way to offset-svc.
struct Connection {
    client: OffsetServiceClient<InternalChannel>,
    /// The open write stream, if any.
    stream: Option<WriteStream>,
    /// How long an answer may take.
    call_timeout: Duration,
}

/// An open `WriteOffsetsStream`: requests go in one at a time, answers come back in order.
struct WriteStream {
    requests: mpsc::Sender<WriteOffsetsStreamRequest>,
    answers: tonic::Streaming<WriteOffsetsStreamResponse>,
}

impl Connection {
    /// Writes `request` over the stream (opened if need be; a batch past [`WRITE_CHUNK`] as
    /// calls of its own). Any failure drops the stream: the next write opens a new one.
    async fn write(&mut self, request: WriteOffsetsRequest) -> Result<(), tonic::Status> {
        if request.entries.len() > WRITE_CHUNK {
            return write_in_chunks(&mut self.client, request).await;
        }
        let written = tokio::time::timeout(self.call_timeout, self.write_streamed(request))
            .await
            .unwrap_or_else(|_| {
                Err(tonic::Status::deadline_exceeded(format!(
                    "no answer on the offset write stream within {:?}",
                    self.call_timeout
                )))
            });
        if written.is_err() {
            self.stream = None;
        }
        written
    }

    /// One batch on the stream. A stream offset-svc ended while the writer was idle (its
    /// restart, a lost connection) is dropped before use, its end already waiting; one that
    /// fails at the batch although it looked open (ended just then) is replaced and the batch
    /// sent once more on a new one, so a restart of offset-svc costs no failed write.
    async fn write_streamed(&mut self, request: WriteOffsetsRequest) -> Result<(), tonic::Status> {
        if let Some(stream) = &mut self.stream
            && (stream.requests.is_closed() || stream.answers.message().now_or_never().is_some())
        {
            self.stream = None;
        }
        let retry = self.stream.is_some().then(|| request.clone());
        let written = self.send_on_stream(request).await;
        match (written, retry) {
            (Err(_), Some(request)) => {
                self.stream = None;
                self.send_on_stream(request).await
            }
            (written, _) => written,
        }
    }

    async fn send_on_stream(&mut self, request: WriteOffsetsRequest) -> Result<(), tonic::Status> {
        let stream = match &mut self.stream {
            Some(stream) => stream,
            None => {
                let (requests, queued) = mpsc::channel(1);
                let answers = self
                    .client
                    .write_offsets_stream(tokio_stream::wrappers::ReceiverStream::new(queued))
                    .await?
                    .into_inner();
                self.stream.insert(WriteStream { requests, answers })
            }
        };
        let batch = WriteOffsetsStreamRequest {
            batch: Some(request),
        };
        if stream.requests.send(batch).await.is_err() {
            return Err(tonic::Status::unavailable(
                "the offset write stream closed before the batch was sent",
            ));
        }
        match stream.answers.message().await? {
            Some(_) => Ok(()),
            None => Err(tonic::Status::unavailable(
                "offset-svc ended the write stream without answering the batch",
            )),
        }
    }
}

/// Most entries per WriteOffsets call (offset-svc refuses more than 100,000); a merged batch
/// above it goes out in several calls, every job told only once all of them succeeded (a
/// retry after a partial failure repeats CAS-max writes, which is harmless).
const WRITE_CHUNK: usize = 50_000;

async fn write_in_chunks(
    client: &mut OffsetServiceClient<InternalChannel>,
    request: WriteOffsetsRequest,
) -> Result<(), tonic::Status> {
    if request.entries.len() <= WRITE_CHUNK {
        return client.write_offsets(request).await.map(|_| ());
    }
    for chunk in request.entries.chunks(WRITE_CHUNK) {
        client
            .write_offsets(WriteOffsetsRequest {
                entries: chunk.to_vec(),
                sync: request.sync,
            })
            .await?;
    }
    Ok(())
}

/// One request for every queued job: the highest value per key.
fn merged(queue: &[Queued], sync: bool) -> WriteOffsetsRequest {
    // Every ACK's keys pass through here: a fast hasher (keys are validated names).
    let mut highest: crate::group::FastMap<&OffsetKey, i64> = Default::default();
    for (key, value) in queue.iter().flat_map(|q| q.job.entries.iter()) {
        let slot = highest.entry(key).or_insert(*value);
        *slot = (*slot).max(*value);
    }
    WriteOffsetsRequest {
        entries: highest
            .into_iter()
            .map(|(key, offset)| OffsetEntry {
                key: Some(wire_key(key)),
                offset,
            })
            .collect(),
        sync,
    }
}

/// A key as offset-svc's API spells it.
fn wire_key(key: &OffsetKey) -> eventmesh_proto::offset::OffsetKey {
    eventmesh_proto::offset::OffsetKey {
        topic: key.topic.to_string(),
        client_id: key.client.to_string(),
        partition: key.partition.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use eventmesh_common::keys::{OffsetClient, PartitionId, Topic};

    use super::*;

    /// An offset-svc with an in-memory store, listening on `listen`, served by `runtime`.
    fn start_offset_svc(
        runtime: &tokio::runtime::Runtime,
        listen: std::net::SocketAddr,
    ) -> offset_svc::server::RunningServer {
        runtime.block_on(offset_svc_at(listen))
    }

    /// An offset-svc with an in-memory store, listening on `listen`, on the current runtime.
    async fn offset_svc_at(listen: std::net::SocketAddr) -> offset_svc::server::RunningServer {
        let config = offset_svc::config::Config {
            listen,
            store: offset_svc::config::StoreKind::Memory,
            ..offset_svc::config::Config::default()
        };
        offset_svc::server::start(config, CancellationToken::new())
            .await
            .unwrap()
    }

    /// A writer to the offset-svc at `uri`, started from the current runtime.
    fn writer_to(uri: &str) -> OffsetWriter {
        let endpoint =
            eventmesh_common::grpc::internal_endpoint(uri, Duration::from_secs(5)).unwrap();
        let (writer, _task) = OffsetWriter::spawn(
            endpoint,
            Duration::from_secs(5),
            Duration::ZERO,
            false,
            CancellationToken::new(),
        )
        .unwrap();
        writer
    }

    /// A job for the default group's cursor of `orders` partition 0, its notices sent to `told`.
    fn cursor_job(offset: i64, told: std::sync::mpsc::Sender<WriteNotice>) -> WriteJob {
        job_telling(
            offset,
            Arc::new(move |notice| {
                let _ = told.send(notice);
            }),
        )
    }

    /// The default group's cursor of `orders` partition 0, the key every test job writes.
    fn orders_cursor() -> OffsetKey {
        OffsetKey::new(
            Topic::new("orders").unwrap(),
            OffsetClient::MqCursor(None),
            PartitionId::number(0),
        )
    }

    /// A job raising [`orders_cursor`] to `offset`, its notices given to `listener`.
    fn job_telling(offset: i64, listener: Listener) -> WriteJob {
        WriteJob {
            entries: vec![(orders_cursor(), offset)],
            links: Vec::new(),
            settles: 1,
            listener,
        }
    }

    /// offset-svc restarted while the writer was idle (its write stream ended by the shutdown)
    /// costs no failed write: the next job is durable at once, with no PENDING notice and the
    /// writer never unhealthy (it used to fail on the dead stream first).
    #[test]
    fn a_restart_of_offset_svc_between_writes_costs_no_failed_write() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let server = start_offset_svc(&runtime, std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        let addr = server.local_addr();
        let _inside = runtime.enter();
        let writer = writer_to(&format!("http://{addr}"));
        let (told, notices) = std::sync::mpsc::channel();
        writer.submit(cursor_job(1, told.clone()));
        let wait = Duration::from_secs(10);
        assert_eq!(notices.recv_timeout(wait).unwrap(), WriteNotice::Durable);

        server.shutdown();
        runtime.block_on(server.wait()).unwrap();
        let server = start_offset_svc(&runtime, addr);
        let health = writer.health();
        writer.submit(cursor_job(2, told));
        assert_eq!(notices.recv_timeout(wait).unwrap(), WriteNotice::Durable);
        assert!(*health.borrow(), "the writer stayed healthy");
        server.shutdown();
        runtime.block_on(server.wait()).unwrap();
    }

    /// A write completes while the only thread of the runtime that started the writer is
    /// blocked: the writer and its connection to offset-svc run on a thread of their own (on
    /// the starting runtime the write could not even be sent).
    #[test]
    fn a_write_completes_while_the_runtime_that_started_the_writer_is_blocked() {
        let server_runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let server = start_offset_svc(
            &server_runtime,
            std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        );
        let uri = format!("http://{}", server.local_addr());

        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _inside = runtime.enter();
        let writer = writer_to(&uri);
        let (told, notices) = std::sync::mpsc::channel();
        writer.submit(cursor_job(7, told));
        // This thread, the starting runtime's only one, now blocks until the writer answers.
        assert_eq!(
            notices.recv_timeout(Duration::from_secs(10)).unwrap(),
            WriteNotice::Durable
        );
    }

    /// The stored value of [`orders_cursor`], read from offset-svc directly (not through the
    /// writer's path).
    async fn stored_cursor(uri: &str) -> i64 {
        let mut client = OffsetServiceClient::connect(uri.to_owned()).await.unwrap();
        client
            .read_offset(eventmesh_proto::offset::ReadOffsetRequest {
                key: Some(wire_key(&orders_cursor())),
            })
            .await
            .unwrap()
            .into_inner()
            .offset
    }

    /// Waits (up to 5 s) until offset-svc stores `value` for the cursor.
    async fn wait_stored(uri: &str, value: i64) {
        let started = Instant::now();
        while stored_cursor(uri).await < value {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "offset-svc never stored {value}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A job whose notices are recorded in `order` as `(offset, notice)`.
    fn recorded_job(
        offset: i64,
        order: &Arc<std::sync::Mutex<Vec<(i64, WriteNotice)>>>,
    ) -> WriteJob {
        let order = Arc::clone(order);
        job_telling(
            offset,
            Arc::new(move |notice| order.lock().unwrap().push((offset, notice))),
        )
    }

    /// The connection is cut while a write waits for its answer (stored, the answer held by
    /// a proxy) and another job waits behind it: neither is told DURABLE before it is written
    /// on a new connection, both are told in the order they came, a barrier submitted after
    /// them is answered only then, and the writer ends healthy.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_cut_off_before_its_answer_is_written_again_and_jobs_stay_in_order() {
        let server = offset_svc_at(std::net::SocketAddr::from(([127, 0, 0, 1], 0))).await;
        let direct = format!("http://{}", server.local_addr());
        let proxy = eventmesh_testkit::proxy::Proxy::start(server.local_addr())
            .await
            .unwrap();
        let writer = writer_to(&format!("http://{}", proxy.addr()));
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        writer.submit(recorded_job(1, &order));
        assert!(writer.barrier().await);

        proxy.hold_answers();
        writer.submit(recorded_job(2, &order));
        wait_stored(&direct, 2).await;
        writer.submit(recorded_job(3, &order));
        let barrier = tokio::spawn({
            let writer = writer.clone();
            async move { writer.barrier().await }
        });
        // Stored, but not answered: not durable as far as the writer knows.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(*order.lock().unwrap(), [(1, WriteNotice::Durable)]);
        proxy.sever();
        proxy.release_answers();
        let answered = tokio::time::timeout(Duration::from_secs(20), barrier).await;
        assert!(answered.unwrap().unwrap(), "the barrier was never answered");
        let order = order.lock().unwrap().clone();
        let durable: Vec<i64> = order
            .iter()
            .filter(|(_, notice)| *notice == WriteNotice::Durable)
            .map(|(offset, _)| *offset)
            .collect();
        assert_eq!(durable, [1, 2, 3], "{order:?}");
        for offset in [2, 3] {
            let pending = order
                .iter()
                .filter(|(o, n)| *o == offset && *n == WriteNotice::Pending)
                .count();
            assert!(
                pending <= 1,
                "job {offset} told PENDING {pending} times: {order:?}"
            );
        }
        assert!(*writer.health().borrow(), "the writer ended unhealthy");
        assert_eq!(stored_cursor(&direct).await, 3);
        server.shutdown();
        server.wait().await.unwrap();
    }

    /// Thousands of jobs submitted as fast as they come are told DURABLE in the order they
    /// were submitted, however the writes split them (`barrier` relies on it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_are_told_durable_in_the_order_submitted() {
        let server = offset_svc_at(std::net::SocketAddr::from(([127, 0, 0, 1], 0))).await;
        let writer = writer_to(&format!("http://{}", server.local_addr()));
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        for offset in 0..5_000 {
            writer.submit(recorded_job(offset, &order));
            if offset % 100 == 0 {
                tokio::task::yield_now().await;
            }
        }
        assert!(writer.barrier().await);
        let order = order.lock().unwrap().clone();
        let expected: Vec<_> = (0..5_000).map(|o| (o, WriteNotice::Durable)).collect();
        assert_eq!(order, expected);
        server.shutdown();
        server.wait().await.unwrap();
    }
}
