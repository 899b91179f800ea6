//! Creating a group: claiming its home (with a cluster), then steps 1–5 of [`super`]'s module
//! doc — the topic, the stored watermarks (and the mirrored record), the start positions,
//! `Attach`, the actor and its pull loop.

use super::*;

impl Shared {
    /// Claims the group's home (with a cluster), then creates the group; a failed creation
    /// gives the home back. Call with group creation held.
    pub(super) async fn claim_and_create(
        self: &Arc<Self>,
        key: &GroupKey,
        start: StartPosition,
    ) -> Result<GroupHandle, DispatcherError> {
        if let Some(cluster) = &self.cluster {
            cluster.claim_home(key).await?;
        }
        let created = tokio::time::timeout(CREATE_TIMEOUT, self.create(key, start))
            .await
            .map_err(|_| {
                DispatcherError::dependency(
                    "puller-svc/offset-svc",
                    tonic::Status::deadline_exceeded("creating the subscription group timed out"),
                )
            })
            .and_then(|created| created);
        if created.is_err()
            && let Some(cluster) = &self.cluster
        {
            cluster.release_home(key).await;
        }
        created
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
                implicit: true,
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
        let mut lost: HashMap<PartitionId, i64> = HashMap::new();
        for entry in offsets
            .read_topic_offsets(ReadTopicOffsetsRequest {
                topic: key.topic.to_string(),
                client_id: OffsetClient::MqLost(key.group.clone()).to_string(),
            })
            .await
            .map_err(offset_error)?
            .into_inner()
            .entries
        {
            if let Some(partition) = entry.key.and_then(|k| PartitionId::new(k.partition).ok()) {
                lost.insert(partition, entry.offset.max(0));
            }
        }
        // A group that lived at another instance resumes where its last home got to.
        let moved = match &self.cluster {
            Some(cluster) => match cluster.mirror().read(cluster, key).await? {
                Recorded::New => false,
                Recorded::Moved(recorded) => {
                    self.adopt_record(key, &recorded).await?;
                    stored.extend(recorded);
                    true
                }
            },
            None => false,
        };
        let ranges = puller
            .end_offsets(EndOffsetsRequest {
                topic: key.topic.to_string(),
            })
            .await
            .map_err(puller_error)?
            .into_inner()
            .partitions;
        let mut positions = BTreeMap::new();
        let mut markers = Vec::new();
        for range in ranges {
            let Ok(partition) = PartitionId::new(range.partition.clone()) else {
                continue;
            };
            let next = match stored.get(&partition) {
                Some(watermark) => watermark + 1,
                None => {
                    let first = match start {
                        // What a moved group has no record of may not have been delivered.
                        _ if moved => range.start,
                        StartPosition::Earliest | StartPosition::Stored => range.start,
                        StartPosition::Latest | StartPosition::Unspecified => range.end,
                    };
                    markers.push(OffsetEntry {
                        key: Some(self.cursor_key(key, &partition)),
                        offset: first - 1,
                    });
                    first
                }
            };
            positions.insert(partition, next);
        }
        if !markers.is_empty() {
            offsets
                .write_offsets(WriteOffsetsRequest {
                    entries: markers,
                    sync: self.settings.sync_offsets,
                })
                .await
                .map_err(offset_error)?;
        }
        if let Some(cluster) = &self.cluster {
            let start_watermarks = positions
                .iter()
                .map(|(p, next)| (p.clone(), next - 1))
                .collect();
            cluster
                .mirror()
                .record(cluster, key, &start_watermarks)
                .await?;
        }
        let generation = self.attach(key, &positions).await?;
        let seeds = positions
            .iter()
            .map(|(p, next)| (p.clone(), next - 1))
            .collect();
        let budget = self.budget(&key.topic);
        budget.join(&key.label());
        let count = self.settings.shards_for(positions.len());
        let (gate, gate_rx) = GateBoard::new(count);
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..count).map(|_| mpsc::unbounded_channel()).unzip();
        let siblings: Arc<[mpsc::UnboundedSender<GroupCmd>]> = senders.into();
        let mut shards = Vec::with_capacity(count);
        let mut metric_label: Arc<str> = Arc::from("");
        for (index, commands) in receivers.into_iter().enumerate() {
            let number = self.next_group.fetch_add(1, Ordering::Relaxed);
            // Each shard knows only its own partitions' starting points.
            let own = |values: &HashMap<PartitionId, i64>| -> HashMap<PartitionId, i64> {
                values
                    .iter()
                    .filter(|(partition, _)| shard_of(partition.as_str(), count) == index)
                    .map(|(partition, value)| (partition.clone(), *value))
                    .collect()
            };
            let started = group::spawn(
                Arc::clone(self),
                GroupInit {
                    key: key.clone(),
                    number,
                    seeds: own(&seeds),
                    lost: own(&lost),
                    budget: Arc::clone(&budget),
                    shard: ShardInit {
                        index,
                        siblings: Arc::clone(&siblings),
                        commands,
                        gate: Arc::clone(&gate),
                    },
                },
            );
            metric_label = started.metric_label;
            shards.push(ShardHandle {
                number,
                commands: siblings[index].clone(),
                ended: started.ended,
                report: started.report,
            });
        }
        tokio::spawn(pull_loop(
            Arc::clone(self),
            key.clone(),
            Arc::clone(&siblings),
            gate_rx,
            budget,
            Positions {
                next: positions,
                generation,
            },
        ));
        let handle = GroupHandle {
            number: shards[0].number,
            key: key.clone(),
            shards: shards.into(),
            metric_label,
        };
        let mut groups = self.lock_groups();
        groups.by_key.insert(key.clone(), handle.clone());
        for shard in handle.shards.iter() {
            groups
                .by_number
                .insert(shard.number, shard.commands.clone());
        }
        tracing::info!(group = %key, number = handle.number, shards = count, ?start, "subscription group created; its reader attached");
        Ok(handle)
    }

    /// Makes this instance's stored watermarks of `key` what its previous home mirrored, before
    /// the reader is attached. The record is the group's progress wherever it lived: raised by
    /// a CAS-max write (another home got further), and lowered where this instance's own
    /// offset-svc is ahead of it, which happens when the record was lowered elsewhere (an
    /// operator's reset or a rewind through another instance) or when this instance died as
    /// the group's home before its last progress was mirrored (then the lowering re-delivers
    /// at most one mirror interval: at least once, never a skip).
    pub(super) async fn adopt_record(
        &self,
        key: &GroupKey,
        recorded: &BTreeMap<PartitionId, i64>,
    ) -> Result<(), DispatcherError> {
        if recorded.is_empty() {
            return Ok(());
        }
        let entries = recorded
            .iter()
            .map(|(partition, watermark)| OffsetEntry {
                key: Some(self.cursor_key(key, partition)),
                offset: *watermark,
            })
            .collect();
        let results = self
            .offsets()
            .write_offsets(WriteOffsetsRequest {
                entries,
                sync: self.settings.sync_offsets,
            })
            .await
            .map_err(|status| DispatcherError::dependency("offset-svc", status))?
            .into_inner()
            .results;
        for ((partition, watermark), result) in recorded.iter().zip(&results) {
            if result.stored <= *watermark {
                continue;
            }
            tracing::warn!(group = %key, %partition, stored = result.stored, recorded = *watermark, "this instance's stored watermark is ahead of the group's mirrored record (lowered elsewhere, or not mirrored before this instance died): taking the record");
            let cursor = self.cursor_key(key, partition);
            self.offsets()
                .reset_offsets(ResetOffsetsRequest {
                    selector: Some(OffsetSelector {
                        topic: cursor.topic,
                        client_id: cursor.client_id,
                        partition: cursor.partition,
                    }),
                    offset: *watermark,
                    reason: format!(
                        "dispatcher {} adopts the group's mirrored record",
                        self.instance_id
                    ),
                })
                .await
                .map_err(|status| DispatcherError::dependency("offset-svc", status))?;
        }
        tracing::info!(group = %key, partitions = recorded.len(), "resuming the group where its mirrored record says (its previous home's progress)");
        Ok(())
    }
}
