//! The `eventmesh.offset.v1.OffsetService` gRPC implementation over any [`OffsetStore`].
//!
//! Every request is validated before it reaches the store; an invalid field is answered with
//! INVALID_ARGUMENT naming the field (`entries[3].key.topic: ...`) and nothing of the request is
//! applied. Store calls run on the blocking pool, since RocksDB (and `sync` fsyncs) block —
//! but for a write without fsync that waits for nothing, done in place
//! ([`OffsetStore::write_batch_without_waiting`]).
//!
//! `WriteOffsetsStream` applies each batch of the stream as one `WriteOffsets` call and
//! answers in order; a failed batch ends the stream with that call's error, and so does
//! shutdown (UNAVAILABLE), so a drain never waits for a writer's open stream.
//!
//! Metrics (Prometheus, when the binary installed the exporter):
//! * `eventmesh_offset_write_batches_total{result="ok"|"invalid"|"error"}`
//! * `eventmesh_offset_write_entries_total`, `eventmesh_offset_write_advanced_total`
//! * `eventmesh_offset_write_batch_seconds` — store time of one batch, fsync included
//! * `eventmesh_offset_keys` — keys stored
//! * `eventmesh_offset_operator_changes_total{action="reset"|"delete"}` — keys changed

use std::sync::Arc;
use std::time::Instant;

use eventmesh_common::keys::{KeyError, OffsetClient, OffsetKey, PartitionId, Topic};
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_common::status::FieldError;
use eventmesh_proto::offset::{self as pb, offset_service_server::OffsetService};
use tonic::{Request, Response, Status, Streaming};
use tracing::instrument;

use crate::error::Error;
use crate::store::{OffsetStore, Selector};

/// The answers of a WriteOffsetsStream call.
pub type WriteStream = std::pin::Pin<
    Box<
        dyn futures::Stream<Item = Result<pb::WriteOffsetsStreamResponse, Status>> + Send + 'static,
    >,
>;

/// Most entries accepted in one WriteOffsets call.
pub const MAX_BATCH_ENTRIES: usize = 100_000;

/// The gRPC face of an [`OffsetStore`].
#[derive(Clone)]
pub struct OffsetGrpc {
    store: Arc<dyn OffsetStore>,
    force_sync: bool,
    shutdown: CancellationToken,
}

impl OffsetGrpc {
    /// Serves `store`.
    pub fn new(store: Arc<dyn OffsetStore>) -> Self {
        OffsetGrpc {
            store,
            force_sync: false,
            shutdown: CancellationToken::new(),
        }
    }

    /// fsync every batch, whatever the request asks.
    pub fn with_forced_sync(mut self, force_sync: bool) -> Self {
        self.force_sync = force_sync;
        self
    }

    /// Ends open write streams (UNAVAILABLE) once `shutdown` is cancelled, so a drain does not
    /// wait for a writer that never closes its stream.
    pub fn with_shutdown(mut self, shutdown: CancellationToken) -> Self {
        self.shutdown = shutdown;
        self
    }

    /// One WriteOffsets batch, counted in `eventmesh_offset_write_batches_total`.
    async fn write_counted(
        &self,
        request: pb::WriteOffsetsRequest,
    ) -> Result<pb::WriteOffsetsResponse, Status> {
        let result = self.write_offsets_inner(request).await;
        let label = match &result {
            Ok(_) => "ok",
            Err(status) if status.code() == tonic::Code::InvalidArgument => "invalid",
            Err(_) => "error",
        };
        metrics::counter!("eventmesh_offset_write_batches_total", "result" => label).increment(1);
        result
    }

    async fn blocking<T, F>(&self, work: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&dyn OffsetStore) -> Result<T, Error> + Send + 'static,
    {
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || work(store.as_ref()))
            .await
            .map_err(|err| Status::from(Error::Task(err.to_string())))?
            .map_err(Status::from)
    }
    async fn write_offsets_inner(
        &self,
        request: pb::WriteOffsetsRequest,
    ) -> Result<pb::WriteOffsetsResponse, Status> {
        if request.entries.len() > MAX_BATCH_ENTRIES {
            return Err(Status::invalid_argument(format!(
                "batch of {} entries exceeds the limit of {MAX_BATCH_ENTRIES}",
                request.entries.len()
            )));
        }
        let entries = request
            .entries
            .into_iter()
            .enumerate()
            .map(|(i, entry)| {
                let key = parse_key(|| format!("entries[{i}].key"), entry.key)?;
                if entry.offset < -1 {
                    return Err(FieldError::new(
                        format!("entries[{i}].offset"),
                        format!(
                            "{} is below -1; offsets are MQ offsets >= 0 (or -1: a start marker)",
                            entry.offset
                        ),
                    ));
                }
                Ok((key, entry.offset))
            })
            .collect::<Result<Vec<_>, FieldError>>()?;
        let sync = request.sync || self.force_sync;
        let entry_count = entries.len() as u64;
        // Without fsync a write is a memory-table insert and a buffered log append: done here
        // unless it would wait (an operator's change, a RocksDB stall), which saves the hop to
        // a blocking thread and back on the path of every ACK.
        let started = Instant::now();
        let now = if sync {
            None
        } else {
            self.store.write_batch_without_waiting(&entries)
        };
        let (outcomes, keys, elapsed) = match now {
            Some(outcomes) => (outcomes?, self.store.key_count(), started.elapsed()),
            None => {
                self.blocking(move |store| {
                    let started = Instant::now();
                    let outcomes = store.write_batch(&entries, sync)?;
                    Ok((outcomes, store.key_count(), started.elapsed()))
                })
                .await?
            }
        };
        let advanced = outcomes.iter().filter(|o| o.advanced).count() as u64;
        metrics::histogram!("eventmesh_offset_write_batch_seconds").record(elapsed.as_secs_f64());
        metrics::counter!("eventmesh_offset_write_entries_total").increment(entry_count);
        metrics::counter!("eventmesh_offset_write_advanced_total").increment(advanced);
        metrics::gauge!("eventmesh_offset_keys").set(keys as f64);
        Ok(pb::WriteOffsetsResponse {
            results: outcomes
                .into_iter()
                .map(|o| pb::WriteResult {
                    stored: o.stored,
                    advanced: o.advanced,
                })
                .collect(),
        })
    }

    fn record_operator_change(action: &'static str, changed: usize, keys: usize) {
        metrics::counter!("eventmesh_offset_operator_changes_total", "action" => action)
            .increment(changed as u64);
        metrics::gauge!("eventmesh_offset_keys").set(keys as f64);
    }
}

fn field<T>(path: impl FnOnce() -> String, result: Result<T, KeyError>) -> Result<T, FieldError> {
    result.map_err(|err| FieldError::new(path(), err))
}

/// Validates a request key, moving its strings; `path` names the field and is only built for
/// an error.
fn parse_key(
    path: impl Fn() -> String,
    key: Option<pb::OffsetKey>,
) -> Result<OffsetKey, FieldError> {
    let Some(key) = key else {
        return Err(FieldError::new(path(), "missing"));
    };
    Ok(OffsetKey::new(
        field(|| format!("{}.topic", path()), Topic::new(key.topic))?,
        field(
            || format!("{}.client_id", path()),
            OffsetClient::parse(key.client_id),
        )?,
        field(
            || format!("{}.partition", path()),
            PartitionId::new(key.partition),
        )?,
    ))
}

fn parse_optional_client(path: &str, client: &str) -> Result<Option<OffsetClient>, FieldError> {
    if client.is_empty() {
        return Ok(None);
    }
    field(|| path.to_owned(), OffsetClient::parse(client)).map(Some)
}

fn parse_selector(selector: Option<&pb::OffsetSelector>) -> Result<Selector, FieldError> {
    let Some(selector) = selector else {
        return Err(FieldError::new("selector", "missing"));
    };
    let partition = match selector.partition.as_str() {
        "" => None,
        text => Some(field(
            || "selector.partition".into(),
            PartitionId::new(text),
        )?),
    };
    Ok(Selector {
        topic: field(
            || "selector.topic".into(),
            Topic::new(selector.topic.as_str()),
        )?,
        client: parse_optional_client("selector.client_id", &selector.client_id)?,
        partition,
    })
}

fn to_entry((key, offset): (OffsetKey, i64)) -> pb::OffsetEntry {
    pb::OffsetEntry {
        key: Some(pb::OffsetKey {
            topic: key.topic.to_string(),
            client_id: key.client.to_string(),
            partition: key.partition.to_string(),
        }),
        offset,
    }
}

#[tonic::async_trait]
impl OffsetService for OffsetGrpc {
    #[instrument(skip_all, fields(entries = request.get_ref().entries.len(), sync = request.get_ref().sync))]
    async fn write_offsets(
        &self,
        request: Request<pb::WriteOffsetsRequest>,
    ) -> Result<Response<pb::WriteOffsetsResponse>, Status> {
        self.write_counted(request.into_inner())
            .await
            .map(Response::new)
    }

    type WriteOffsetsStreamStream = WriteStream;

    #[instrument(skip_all)]
    async fn write_offsets_stream(
        &self,
        request: Request<Streaming<pb::WriteOffsetsStreamRequest>>,
    ) -> Result<Response<Self::WriteOffsetsStreamStream>, Status> {
        let state = Some((self.clone(), request.into_inner()));
        let answers = futures::stream::unfold(state, |state| async move {
            let (service, mut requests) = state?;
            let next = tokio::select! {
                next = requests.message() => next,
                () = service.shutdown.cancelled() => {
                    return Some((Err(Status::unavailable("offset-svc is shutting down")), None));
                }
            };
            let batch = match next {
                Ok(Some(pb::WriteOffsetsStreamRequest { batch: Some(batch) })) => batch,
                Ok(Some(_)) => {
                    let missing = Status::invalid_argument("batch: missing");
                    return Some((Err(missing), None));
                }
                // The writer closed its side: the stream ends.
                Ok(None) => return None,
                Err(status) => return Some((Err(status), None)),
            };
            match service.write_counted(batch).await {
                Ok(answer) => {
                    let answer = pb::WriteOffsetsStreamResponse {
                        answer: Some(answer),
                    };
                    Some((Ok(answer), Some((service, requests))))
                }
                Err(status) => Some((Err(status), None)),
            }
        });
        Ok(Response::new(Box::pin(answers)))
    }

    #[instrument(skip_all)]
    async fn read_offset(
        &self,
        request: Request<pb::ReadOffsetRequest>,
    ) -> Result<Response<pb::ReadOffsetResponse>, Status> {
        let key = parse_key(|| "key".to_owned(), request.into_inner().key)?;
        let offset = self.blocking(move |store| store.read_offset(&key)).await?;
        Ok(Response::new(pb::ReadOffsetResponse { offset }))
    }

    #[instrument(skip_all, fields(topic = %request.get_ref().topic))]
    async fn read_topic_offsets(
        &self,
        request: Request<pb::ReadTopicOffsetsRequest>,
    ) -> Result<Response<pb::ReadTopicOffsetsResponse>, Status> {
        let request = request.get_ref();
        let topic = field(|| "topic".into(), Topic::new(request.topic.as_str()))?;
        let client = parse_optional_client("client_id", &request.client_id)?;
        let entries = self
            .blocking(move |store| store.read_topic(&topic, client.as_ref()))
            .await?;
        Ok(Response::new(pb::ReadTopicOffsetsResponse {
            entries: entries.into_iter().map(to_entry).collect(),
        }))
    }

    #[instrument(skip_all)]
    async fn list_topics(
        &self,
        _request: Request<pb::ListTopicsRequest>,
    ) -> Result<Response<pb::ListTopicsResponse>, Status> {
        let topics = self.blocking(|store| store.list_topics()).await?;
        Ok(Response::new(pb::ListTopicsResponse {
            topics: topics.into_iter().map(|t| t.to_string()).collect(),
        }))
    }

    #[instrument(skip_all, fields(reason = %request.get_ref().reason, offset = request.get_ref().offset))]
    async fn reset_offsets(
        &self,
        request: Request<pb::ResetOffsetsRequest>,
    ) -> Result<Response<pb::ResetOffsetsResponse>, Status> {
        let request = request.into_inner();
        let selector = parse_selector(request.selector.as_ref())?;
        let offset = request.offset;
        let reason = request.reason;
        let (previous, keys) = self
            .blocking(move |store| {
                Ok((store.reset(&selector, offset, &reason)?, store.key_count()))
            })
            .await?;
        Self::record_operator_change("reset", previous.len(), keys);
        Ok(Response::new(pb::ResetOffsetsResponse {
            previous: previous.into_iter().map(to_entry).collect(),
        }))
    }

    #[instrument(skip_all, fields(reason = %request.get_ref().reason))]
    async fn delete_offsets(
        &self,
        request: Request<pb::DeleteOffsetsRequest>,
    ) -> Result<Response<pb::DeleteOffsetsResponse>, Status> {
        let request = request.into_inner();
        let selector = parse_selector(request.selector.as_ref())?;
        let reason = request.reason;
        let (removed, keys) = self
            .blocking(move |store| Ok((store.delete(&selector, &reason)?, store.key_count())))
            .await?;
        Self::record_operator_change("delete", removed.len(), keys);
        Ok(Response::new(pb::DeleteOffsetsResponse {
            removed: removed.into_iter().map(to_entry).collect(),
        }))
    }
}
