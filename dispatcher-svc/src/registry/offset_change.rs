//! Changing a group's stored offsets under it: operator resets and the rewind of partitions
//! found past their end. The groups concerned are stopped and their writes made durable first,
//! and group creation is held meanwhile, so no live group writes over the change.

use super::*;

impl Shared {
    /// Ends the live groups of `keys` with `status` for their sessions and waits until they
    /// ended and everything they wrote is durable. Returns how many sessions were ended, or
    /// `None` when that did not happen in time (offset-svc down): then nothing may be changed.
    /// Call with group creation held.
    async fn stop_for_change(&self, keys: &[GroupKey], status: tonic::Status) -> Option<u32> {
        let mut sessions = 0;
        for key in keys {
            let Some(handle) = self.group(key) else {
                continue;
            };
            // Every shard ends the same sessions: they are counted once.
            let mut counts = Vec::with_capacity(handle.shards.len());
            for shard in handle.shards.iter() {
                let (reply, count) = oneshot::channel();
                let _ = shard.commands.send(GroupCmd::End {
                    status: status.clone(),
                    reply: Some(reply),
                });
                counts.push(count);
            }
            if tokio::time::timeout(STOP_TIMEOUT, handle.wait_ended())
                .await
                .is_err()
            {
                tracing::error!(group = %key, "group did not end in time for an offset change");
                return None;
            }
            let mut ended = 0;
            for count in counts {
                ended = ended.max(count.await.unwrap_or(0));
            }
            sessions += ended;
        }
        // The writer works through its queue in order: once this empty job is durable, so
        // is everything the groups submitted before they ended.
        matches!(
            tokio::time::timeout(STOP_TIMEOUT, self.writer.barrier()).await,
            Ok(true)
        )
        .then_some(sessions)
    }

    /// Operator reset of a topic's stored offsets, routed through this instance (see
    /// `AdminService.ResetOffsets`): the groups it concerns are ended and their writes made
    /// durable first, so none writes over it. Returns each changed partition with its previous
    /// value, and the sessions ended.
    pub async fn reset_offsets(
        &self,
        topic: &Topic,
        client: OffsetClient,
        partition: Option<PartitionId>,
        offset: i64,
        reason: &str,
    ) -> Result<(Vec<(String, i64)>, u32), DispatcherError> {
        let _creating = self.creating.lock().await;
        let keys: Vec<GroupKey> = match &client {
            OffsetClient::MqCursor(group) | OffsetClient::MqLost(group) => vec![GroupKey {
                topic: topic.clone(),
                group: group.clone(),
            }],
            // A client's offsets are written by every group it has sessions in.
            OffsetClient::Client(_) => self
                .lock_groups()
                .by_key
                .keys()
                .filter(|key| key.topic == *topic)
                .cloned()
                .collect(),
        };
        // In a cluster a group's progress also lives in its mirrored record: the reset is made
        // at the group's home (claimed for it here when it has none), applied to the record
        // too, so a move never brings the old progress back.
        let mirrored = match (&self.cluster, &client) {
            (Some(cluster), OffsetClient::MqCursor(group)) => {
                let key = GroupKey {
                    topic: topic.clone(),
                    group: group.clone(),
                };
                cluster.claim_home(&key).await?;
                Some((cluster, key))
            }
            _ => None,
        };
        let status = tonic::Status::unavailable(format!(
            "offsets of topic {topic} are being reset by an operator ({reason}); reconnect"
        ));
        if let Some((cluster, key)) = &mirrored
            && let Recorded::Moved(recorded) = cluster.mirror().read(cluster, key).await?
        {
            self.adopt_record(key, &recorded).await?;
        }
        let Some(sessions) = self.stop_for_change(&keys, status).await else {
            return Err(DispatcherError::dependency(
                "offset-svc",
                tonic::Status::unavailable(
                    "the groups' last writes did not become durable in time; nothing was reset",
                ),
            ));
        };
        let request = ResetOffsetsRequest {
            selector: Some(OffsetSelector {
                topic: topic.to_string(),
                client_id: client.to_string(),
                partition: partition.map(|p| p.to_string()).unwrap_or_default(),
            }),
            offset,
            reason: format!("{reason} (through dispatcher {})", self.instance_id),
        };
        let previous = self
            .offsets()
            .reset_offsets(request)
            .await
            .map_err(|status| DispatcherError::dependency("offset-svc", status))?
            .into_inner()
            .previous
            .into_iter()
            .map(|entry| {
                (
                    entry.key.map(|k| k.partition).unwrap_or_default(),
                    entry.offset,
                )
            })
            .collect::<Vec<(String, i64)>>();
        if let Some((cluster, key)) = &mirrored {
            let reset = previous
                .iter()
                .filter_map(|(partition, _)| {
                    Some((PartitionId::new(partition.clone()).ok()?, offset))
                })
                .collect();
            let recorded = cluster.mirror().record(cluster, key, &reset).await;
            if self.group(key).is_none() {
                cluster.release_home(key).await;
            }
            recorded?;
        }
        tracing::warn!(%topic, %client, offset, reason, sessions, "operator reset applied; the groups concerned start again from it");
        Ok((previous, sessions))
    }

    /// Some partitions of a group's topic lie below the group's position (the topic was
    /// recreated, or the broker lost records): new events there would otherwise be taken as
    /// settled. The rule (DECISIONS.md): the group restarts those partitions at their log
    /// start — its sessions are told to reconnect, its stored watermark there is reset to just
    /// below the log start, and the rewind is counted and logged.
    pub async fn rewind(self: Arc<Self>, key: GroupKey, past_end: Vec<PastEnd>) {
        let _creating = self.creating.lock().await;
        let targets = rewind_targets(&past_end);
        let described: Vec<String> = targets
            .iter()
            .map(|(p, start, past)| {
                format!(
                    "{p}: position {} past the log end {} (log start {start})",
                    past.position, past.log_end
                )
            })
            .collect();
        tracing::error!(group = %key, partitions = ?described, "partitions restarted below the group's position (topic recreated?): the group rewinds them to their log start");
        let stopped = self
            .stop_for_change(
                std::slice::from_ref(&key),
                tonic::Status::unavailable(format!(
                    "subscription group {key} restarts: its topic's log restarted below the group's position (recreated?); reconnect"
                )),
            )
            .await;
        if stopped.is_none() {
            // The group finds the partition past its end again when it is next created.
            tracing::error!(group = %key, "the group's writes did not become durable in time; the rewind is tried again when the group is next created");
            return;
        }
        let mut rewound = BTreeMap::new();
        for (partition, start, past) in targets {
            let reason = format!(
                "dispatcher {}: partition {partition} of {} restarted below group {}'s position {} (log {}..{}); rewound to the log start",
                self.instance_id,
                key.topic,
                key.label(),
                past.position,
                past.log_start,
                past.log_end
            );
            let request = ResetOffsetsRequest {
                selector: Some(OffsetSelector {
                    topic: key.topic.to_string(),
                    client_id: OffsetClient::MqCursor(key.group.clone()).to_string(),
                    partition: partition.to_string(),
                }),
                offset: start - 1,
                reason,
            };
            match self.offsets().reset_offsets(request).await {
                Ok(_) => {
                    metrics::counter!("dispatcher_partition_rewinds_total", "topic" => key.topic.to_string())
                        .increment(1);
                    rewound.insert(partition.clone(), start - 1);
                }
                Err(status) => {
                    // The group finds the partition past its end again when it is next
                    // created, and rewinds again.
                    tracing::error!(group = %key, %partition, code = ?status.code(), message = status.message(), "rewinding the group's watermark failed; tried again when the group is next created");
                }
            }
        }
        // The mirrored record goes down too, or the group's next creation would raise its
        // watermark back above the log end. (The home is still ours: its release waits for
        // group creation, held here.)
        if let Some(cluster) = &self.cluster
            && !rewound.is_empty()
            && let Err(error) = cluster.mirror().record(cluster, &key, &rewound).await
        {
            tracing::error!(group = %key, %error, "rewinding the group's mirrored record failed; the group may find its partitions past their end again and rewind again");
        }
    }
}
