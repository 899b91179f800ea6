//! Settling: an ACKed delivery's watermarks go to the offset writer (one job per burst,
//! [`super::settling`]); the delivery is retired — answered DURABLE, its broker ACK forwarded,
//! its budget returned — once a write covering its values and the group watermark covering its
//! offset are durable.

use super::*;

impl Group {
    /// Marks a delivery settled in the trackers and asks for the watermarks it moves to be
    /// made durable; it is retired when the writer says so.
    pub(super) fn settle(&mut self, seq: u64) {
        let Some(delivery) = self.deliveries.get(seq) else {
            return;
        };
        let (partition, offset) = (delivery.partition.clone(), delivery.offset);
        let clients = delivery.clients.clone();
        self.settled.add(seq);
        if let Some(track) = self.partitions.get_mut(&partition) {
            track.tracker.settle(offset);
            let watermark = track.tracker.watermark();
            if watermark >= 0 {
                track.submitted = track.submitted.max(watermark);
                let lost = track.passed_losses(watermark);
                self.settled.cursor(&partition, watermark, lost);
            }
        }
        for client in clients {
            let key = (client, partition.clone());
            let track = self.clients.entry(key.clone()).or_default();
            track.tracker.settle(offset);
            let watermark = track.tracker.watermark();
            if let Some(watermark) = watermark {
                track.submitted = track.submitted.max(watermark);
            }
            if track.tracker.is_idle() && track.submitted >= 0 {
                // Keep the map small; a later delivery starts a fresh tracker, and CAS-max
                // keeps the stored value from going down.
                self.clients.remove(&key);
            }
            if let Some(watermark) = watermark {
                self.settled.client(key, watermark);
            }
        }
    }

    /// Hands what the settled deliveries need durable to the writer as one job.
    pub(super) fn flush_settled(&mut self) {
        if let Some(job) = self.settled.take(&self.key) {
            for &seq in &job.tokens {
                probe::mark(Stage::WriteQueued, seq);
            }
            self.submit(job.tokens, job.entries, job.cursors, job.links);
        }
    }

    fn submit(
        &self,
        tokens: Vec<u64>,
        entries: Vec<(OffsetKey, i64)>,
        cursors: Vec<(PartitionId, i64)>,
        links: Vec<SpanContext>,
    ) {
        let group = self.cmd_tx.clone();
        let mirror = self.shared.cluster.clone();
        let key = self.key.clone();
        self.shared.writer.submit(WriteJob {
            entries,
            links,
            settles: tokens.len(),
            listener: Arc::new(move |notice| {
                if notice == WriteNotice::Durable {
                    for &seq in &tokens {
                        probe::mark(Stage::WriteDurable, seq);
                    }
                }
                // Durable progress is what the mirror carries to a group's next home; told
                // here, in the writer, so a group's last flush is mirrored after it ended.
                if let (Some(cluster), WriteNotice::Durable) = (&mirror, notice) {
                    for (partition, watermark) in &cursors {
                        cluster.mirror().note(&key, partition, *watermark);
                    }
                }
                let _ = group.send(GroupCmd::Write {
                    tokens: tokens.clone(),
                    notice,
                    cursors: cursors.clone(),
                });
            }),
        });
    }

    pub(super) fn write_notice(
        &mut self,
        tokens: Vec<u64>,
        notice: WriteNotice,
        cursors: Vec<(PartitionId, i64)>,
    ) {
        match notice {
            WriteNotice::Pending => {
                for token in tokens {
                    let Some(delivery) = self.deliveries.get(token) else {
                        continue; // retired meanwhile
                    };
                    for waiter in &delivery.waiters {
                        self.outbox.add(
                            waiter,
                            answer(
                                delivery.id,
                            AckOutcome::Pending,
                            "ACK accepted; the offset store is unavailable and the write is being retried",
                        ));
                    }
                }
            }
            WriteNotice::Durable => {
                // The crash point counts deliveries whose write is durable (and watermark-only
                // flushes), however many one job carried.
                if tokens.is_empty() {
                    crash_point(CrashPoint::AfterOffsetWrite);
                }
                for (partition, watermark) in &cursors {
                    self.stored(partition, *watermark);
                }
                for token in tokens {
                    crash_point(CrashPoint::AfterOffsetWrite);
                    self.written_durably(token);
                }
            }
        }
    }

    /// The watermark of `partition` is stored up to `watermark`: retires what it now covers.
    fn stored(&mut self, partition: &PartitionId, watermark: i64) {
        let Some(track) = self.partitions.get_mut(partition) else {
            return;
        };
        track.durable = track.durable.max(watermark);
        let mut covered = Vec::new();
        while let Some(&(offset, seq)) = track.covering.first() {
            if offset > track.durable {
                break;
            }
            track.covering.pop_first();
            covered.push(seq);
        }
        for seq in covered {
            self.retire(seq);
        }
    }

    /// A delivery's own offset write is durable: retired when the stored watermark covers it,
    /// else covering until it does (or dropped unanswered when the group is ending: the
    /// offset below it will not settle here, so it comes back to the next reader).
    fn written_durably(&mut self, seq: u64) {
        let Some(delivery) = self.deliveries.get_mut(seq) else {
            return; // a watermark-only flush, or retired already
        };
        let Some(track) = self.partitions.get_mut(&delivery.partition) else {
            // Tracks live as long as the group, so this cannot happen; retiring is the
            // answer that never leaves a delivery stuck.
            self.retire(seq);
            return;
        };
        if delivery.offset <= track.durable {
            self.retire(seq);
        } else if self.closing {
            self.drop_unanswered(seq);
        } else {
            delivery.state = DeliveryState::Covering;
            track.covering.insert((delivery.offset, seq));
        }
    }

    /// Returns the budget of the deliveries retired since the last call, in one release: a
    /// release takes the topic budget's locks and may wake the pull loop, so it is done once
    /// per wake-up of the actor, not once per delivery.
    pub(super) fn release_retired(&mut self) {
        let charge = std::mem::take(&mut self.retired_charge);
        if charge != Charge::default() {
            self.budget.release(&self.label, charge);
        }
    }

    /// Forgets a delivery without answering or forwarding anything; returns its budget.
    pub(super) fn drop_unanswered(&mut self, seq: u64) {
        if let Some(delivery) = self.deliveries.remove(seq) {
            self.budget.release(&self.label, delivery.charge);
        }
    }

    fn retire(&mut self, seq: u64) {
        let Some(delivery) = self.deliveries.remove(seq) else {
            return;
        };
        self.retired_charge += delivery.charge;
        if let Some(acked_at) = delivery.acked_at {
            self.ack_latency
                .observe(self.woke_at.saturating_duration_since(acked_at));
        }
        probe::mark(Stage::GroupAnswered, seq);
        for waiter in &delivery.waiters {
            self.outbox
                .add(waiter, answer(delivery.id, AckOutcome::Durable, ""));
        }
        if !delivery.ack_key.is_empty() {
            self.shared
                .broker_acks
                .ack(self.key.reader(), delivery.ack_key, delivery.trace);
        }
    }

    /// Writes watermark progress no ACK carried (skipped offsets, idle partitions).
    pub(super) fn flush_watermarks(&mut self) {
        // Settled deliveries first: their job may carry a lost-offset count that must be
        // written with (or before) any watermark that passes it, and the writer keeps order.
        self.flush_settled();
        let keys: Vec<PartitionId> = self.partitions.keys().cloned().collect();
        for partition in keys {
            let Some(track) = self.partitions.get_mut(&partition) else {
                continue;
            };
            let watermark = track.tracker.watermark();
            if watermark > track.submitted {
                track.submitted = watermark;
                let lost = track.passed_losses(watermark);
                // One job per partition, so its notice names the watermark it stored; the
                // writer merges them into one call anyway.
                let entries = self
                    .key
                    .watermark_entries(&partition, watermark, lost)
                    .collect();
                self.submit(
                    Vec::new(),
                    entries,
                    vec![(partition, watermark)],
                    Vec::new(),
                );
            }
        }
    }
}
