//! The progress mirror: what lets a group move to another instance without loss.
//!
//! offset-svc is node-local, so a group's new home would not know where its old home got to
//! and would start at the partition's end, skipping what was published meanwhile. Its home
//! therefore records the group's watermarks in etcd under
//! `<prefix>/watermarks/<topic>/<group>/<partition>` (no lease: they outlive the home):
//! * the **creation record** — the positions the group starts from, minus one — written before
//!   the group's reader is attached, so before its first delivery;
//! * its **progress**, every `mirror_interval_ms`: only the watermarks made durable in
//!   offset-svc since the last round, many groups per etcd transaction, each group's writes in
//!   a nested transaction guarded by its own home key (a group that lost its home writes
//!   nothing, the others are unaffected).
//!
//! A new home makes its own offset-svc hold the record before it attaches the reader (raised
//! by CAS-max, lowered where it was ahead: the record may have been lowered by a reset through
//! another instance); a partition the record lacks starts at EARLIEST; a group without a record is new. With the
//! mirror off (`mirror_progress = false`) only the creation record is written, and a group that
//! finds one starts at EARLIEST wherever its own offset-svc knows nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
use eventmesh_common::keys::PartitionId;
use eventmesh_common::shutdown::CancellationToken;

use super::keys::{Keys, encode_segment, group_path};
use super::{Cluster, ClusterError, bounded};
use crate::registry::{GroupKey, Shared};

/// Groups per etcd transaction (etcd refuses more than 128 operations in one by default).
const GROUPS_PER_TXN: usize = 64;
/// Partitions of one group per nested transaction, for the same limit.
const PARTITIONS_PER_GROUP_TXN: usize = 120;

/// What the mirror found for a group at its creation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// No record: the group is new and gets its start position.
    New,
    /// The group lived elsewhere: these watermarks (empty with the mirror off: none trusted);
    /// partitions not named start at EARLIEST.
    Moved(BTreeMap<PartitionId, i64>),
}

/// Watermarks waiting to be mirrored.
#[derive(Debug)]
pub struct Mirror {
    keys: Keys,
    progress: bool,
    dirty: Mutex<HashMap<GroupKey, BTreeMap<PartitionId, i64>>>,
    /// Held by a round of progress writes and by an overwrite, so a round that took a group's
    /// old progress cannot land after an operator's reset of it.
    writing: tokio::sync::Mutex<()>,
}

impl Mirror {
    /// A mirror under `keys`; `progress` false keeps only creation records.
    pub fn new(keys: Keys, progress: bool) -> Mirror {
        Mirror {
            keys,
            progress,
            dirty: Mutex::default(),
            writing: tokio::sync::Mutex::new(()),
        }
    }

    fn group_prefix(&self, key: &GroupKey) -> String {
        format!(
            "{}{}/",
            self.keys.watermarks(),
            group_path(&key.topic, key.group.as_ref())
        )
    }

    fn partition_key(&self, key: &GroupKey, partition: &PartitionId) -> String {
        format!(
            "{}{}",
            self.group_prefix(key),
            encode_segment(partition.as_str())
        )
    }

    /// A watermark of `key` is durable in offset-svc: mirror it in the next round.
    pub fn note(&self, key: &GroupKey, partition: &PartitionId, watermark: i64) {
        if !self.progress {
            return;
        }
        let mut dirty = self.dirty.lock().unwrap_or_else(|p| p.into_inner());
        let slot = dirty
            .entry(key.clone())
            .or_default()
            .entry(partition.clone())
            .or_insert(watermark);
        *slot = (*slot).max(watermark);
    }

    fn take_dirty(&self) -> HashMap<GroupKey, BTreeMap<PartitionId, i64>> {
        std::mem::take(&mut *self.dirty.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Reads `key`'s record.
    pub async fn read(&self, cluster: &Cluster, key: &GroupKey) -> Result<Recorded, ClusterError> {
        let mut client = cluster.client();
        let prefix = self.group_prefix(key);
        let answer = bounded(
            cluster.call_timeout(),
            "a watermark record read",
            client.get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
        )
        .await?;
        if answer.kvs().is_empty() {
            return Ok(Recorded::New);
        }
        let mut watermarks = BTreeMap::new();
        if self.progress {
            for kv in answer.kvs() {
                let parsed = kv.key_str().ok().and_then(|k| {
                    let partition = super::keys::decode_segment(k.strip_prefix(&prefix)?)?;
                    let partition = PartitionId::new(partition).ok()?;
                    let watermark: i64 = kv.value_str().ok()?.parse().ok()?;
                    Some((partition, watermark))
                });
                match parsed {
                    Some((partition, watermark)) => {
                        watermarks.insert(partition, watermark);
                    }
                    None => {
                        tracing::warn!(group = %key, key = ?kv.key_str(), "skipping an unreadable watermark record entry (its partition starts at EARLIEST)")
                    }
                }
            }
        }
        Ok(Recorded::Moved(watermarks))
    }

    /// Writes `key`'s record as given, guarded by its home: the creation record (before the
    /// group's first delivery), and after an operator's reset or a rewind (values may go
    /// down: progress of the group not yet mirrored is dropped first).
    pub async fn record(
        &self,
        cluster: &Cluster,
        key: &GroupKey,
        watermarks: &BTreeMap<PartitionId, i64>,
    ) -> Result<(), ClusterError> {
        let _writing = self.writing.lock().await;
        if let Some(dirty) = self
            .dirty
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(key)
        {
            for partition in watermarks.keys() {
                dirty.remove(partition);
            }
        }
        let mut client = cluster.client();
        for chunk in watermarks
            .iter()
            .collect::<Vec<_>>()
            .chunks(PARTITIONS_PER_GROUP_TXN)
        {
            let txn = self.guarded(cluster, key, chunk.iter().map(|(p, w)| (*p, **w)));
            let answer = bounded(
                cluster.call_timeout(),
                "a watermark record write",
                client.txn(txn),
            )
            .await?;
            if !answer.succeeded() {
                return Err(ClusterError::NotRegistered(
                    "the group's home changed while recording its start",
                ));
            }
        }
        Ok(())
    }

    /// `key`'s writes in one transaction, guarded by its home key naming this instance.
    fn guarded<'a>(
        &self,
        cluster: &Cluster,
        key: &GroupKey,
        watermarks: impl Iterator<Item = (&'a PartitionId, i64)>,
    ) -> Txn {
        let home = self.keys.home(&key.topic, key.group.as_ref());
        let puts: Vec<TxnOp> = watermarks
            .map(|(partition, watermark)| {
                TxnOp::put(
                    self.partition_key(key, partition),
                    watermark.to_string(),
                    None,
                )
            })
            .collect();
        Txn::new()
            .when([Compare::value(home, CompareOp::Equal, cluster.home_value())])
            .and_then(puts)
    }

    /// Writes what changed since the last round. Returns (groups written, groups whose guard
    /// failed); what failed for etcd's sake is kept for the next round.
    pub async fn flush(&self, cluster: &Cluster) -> Result<(usize, usize), ClusterError> {
        let _writing = self.writing.lock().await;
        let dirty = self.take_dirty();
        if dirty.is_empty() {
            return Ok((0, 0));
        }
        let mut client = cluster.client();
        let groups: Vec<(GroupKey, BTreeMap<PartitionId, i64>)> = dirty.into_iter().collect();
        let (mut written, mut refused) = (0, 0);
        for (index, chunk) in groups.chunks(GROUPS_PER_TXN).enumerate() {
            let nested: Vec<TxnOp> = chunk
                .iter()
                .map(|(key, watermarks)| {
                    TxnOp::txn(
                        self.guarded(
                            cluster,
                            key,
                            watermarks
                                .iter()
                                .take(PARTITIONS_PER_GROUP_TXN)
                                .map(|(p, w)| (p, *w)),
                        ),
                    )
                })
                .collect();
            let answer = match bounded(
                cluster.call_timeout(),
                "a watermark mirror write",
                client.txn(Txn::new().and_then(nested)),
            )
            .await
            {
                Ok(answer) => answer,
                Err(error) => {
                    // Keep this chunk and the rest for the next round.
                    for (key, watermarks) in &groups[index * GROUPS_PER_TXN..] {
                        for (partition, watermark) in watermarks {
                            self.note(key, partition, *watermark);
                        }
                    }
                    return Err(error);
                }
            };
            for (response, (key, watermarks)) in answer.op_responses().iter().zip(chunk) {
                let succeeded =
                    matches!(response, etcd_client::TxnOpResponse::Txn(t) if t.succeeded());
                if succeeded {
                    written += 1;
                    // Partitions beyond one nested transaction's share go next round.
                    for (partition, watermark) in watermarks.iter().skip(PARTITIONS_PER_GROUP_TXN) {
                        self.note(key, partition, *watermark);
                    }
                } else {
                    refused += 1;
                    tracing::debug!(group = %key, "not mirrored: the group's home key no longer names this instance");
                }
            }
        }
        metrics::counter!("dispatcher_cluster_mirror_groups_written_total")
            .increment(written as u64);
        Ok((written, refused))
    }
}

/// Mirrors progress every interval while this instance may serve.
pub async fn run(cluster: Arc<Cluster>, shared: Weak<Shared>, shutdown: CancellationToken) {
    let interval = Duration::from_millis(cluster.settings.mirror_interval_ms);
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = shutdown.cancelled() => return,
        }
        if shared.upgrade().is_none() {
            return;
        }
        if !cluster.may_serve() {
            // Fenced: no mirror writes (what is noted is dropped with the groups it belongs to).
            let _ = cluster.mirror.take_dirty();
            continue;
        }
        if let Err(error) = cluster.mirror.flush(&cluster).await {
            tracing::warn!(%error, "mirroring group progress failed; retried next round");
        }
    }
}
