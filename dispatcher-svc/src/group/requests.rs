//! A client's ACK, NACK and Extend of a delivery, and the timers that act when none comes in
//! time (the ACK deadline, the end of a backoff, the group's grace period without sessions).

use super::*;

impl Group {
    pub(super) fn settle_request(
        &mut self,
        op: SettleOp,
        id: DeliveryId,
        client: &ClientId,
        reply_to: &mpsc::UnboundedSender<Outbound>,
    ) {
        if let Some((outcome, detail)) = self.apply_request(op, id, client, reply_to) {
            self.outbox.add(reply_to, answer(id, outcome, &detail));
        }
    }

    /// Does what a client asked about delivery `id`; returns the answer due now (none for an
    /// ACK taken: `reply_to` waits for its write instead).
    fn apply_request(
        &mut self,
        op: SettleOp,
        id: DeliveryId,
        client: &ClientId,
        reply_to: &mpsc::UnboundedSender<Outbound>,
    ) -> Option<(AckOutcome, Cow<'static, str>)> {
        // One client may not hold a delivery away from its group for long: NACK delays and
        // extensions are capped, and the answer says so.
        let (op, capped) = self.shared.settings.cap(op);
        let Some(delivery) = self.deliveries.get_mut(id.seq) else {
            return Some(if id.seq < self.next_seq {
                (AckOutcome::AlreadySettled, "already settled".into())
            } else {
                (AckOutcome::Unknown, "no such delivery".into())
            });
        };
        if !delivery.was_sent_to(client) {
            return Some((
                AckOutcome::NotOwned,
                "this delivery was not sent to a session of this client".into(),
            ));
        }
        match (op, delivery.state) {
            (
                _,
                DeliveryState::Writing | DeliveryState::Covering | DeliveryState::DeadLettering,
            ) => Some((
                AckOutcome::AlreadySettled,
                "already ACKed (or dead-lettered); settling".into(),
            )),
            (SettleOp::Ack, state) => {
                self.tallies.acked.add();
                delivery.waiters.push(reply_to.clone());
                delivery.state = DeliveryState::Writing;
                // The wake-up's clock: commands of one wake-up are handled within microseconds.
                delivery.acked_at = Some(self.woke_at);
                probe::mark(Stage::GroupTook, id.seq);
                if let Some(trace) = &delivery.trace {
                    delivery.record_hop(Operation::ACK, &self.key, client);
                    self.settled.link(trace.span_context());
                }
                self.timers.clear(delivery, id.seq);
                self.free_slot(state);
                self.settle(id.seq);
                self.pump();
                None
            }
            (SettleOp::Nack(delay), _) => {
                self.tallies.nacked.add(&delivery.partition);
                self.retry(id.seq, Retry::After(delay), "NACKed");
                self.pump();
                Some((AckOutcome::Nacked, capped.into()))
            }
            (SettleOp::Extend(extra), DeliveryState::Sent { .. }) => {
                let deadline = Instant::now() + extra;
                self.timers.set(delivery, id.seq, deadline);
                Some((AckOutcome::Extended, capped.into()))
            }
            (SettleOp::Extend(extra), _) => {
                // Not written yet (or waiting for a retry): the clock starts later; remember.
                delivery.extension = Some(extra);
                let detail = ["the ACK clock starts when the delivery is written", &capped]
                    .iter()
                    .filter(|part| !part.is_empty())
                    .copied()
                    .collect::<Vec<_>>()
                    .join("; ");
                Some((AckOutcome::Extended, detail.into()))
            }
        }
    }

    /// NACK, timeout or a lost session: back off and redeliver, or dead-letter after the last
    /// attempt.
    pub(super) fn retry(&mut self, seq: u64, when: Retry, why: &str) {
        let max_attempts = self.shared.settings.max_attempts;
        let Some(delivery) = self.deliveries.get_mut(seq) else {
            return;
        };
        let state = delivery.state;
        self.timers.clear(delivery, seq);
        if delivery.attempt >= max_attempts {
            let reason = format!("{why} on attempt {} of {max_attempts}", delivery.attempt);
            self.free_slot(state);
            self.dead_letter(seq, reason);
            return;
        }
        delivery.attempt += 1;
        self.tallies.redelivered.add(&delivery.partition);
        match when {
            Retry::Now => {
                delivery.state = DeliveryState::Ready;
                self.ready.push_front(seq);
            }
            Retry::After(delay) => {
                delivery.state = DeliveryState::Backoff;
                let wait = delay.unwrap_or_else(|| self.shared.settings.backoff(delivery.attempt));
                self.timers.set(delivery, seq, Instant::now() + wait);
            }
        }
        self.free_slot(state);
    }

    pub(super) fn on_timers(&mut self, now: Instant) {
        while let Some((at, seq)) = self.timers.pop_due(now) {
            let Some(delivery) = self.deliveries.get_mut(seq) else {
                continue;
            };
            if delivery.timer != Some(at) {
                continue;
            }
            delivery.timer = None;
            match delivery.state {
                DeliveryState::Sent { .. } => {
                    self.tallies.timed_out.add(&delivery.partition);
                    self.retry(seq, Retry::After(None), "ACK timeout");
                }
                DeliveryState::Backoff => {
                    delivery.state = DeliveryState::Ready;
                    self.ready.push_back(seq);
                }
                _ => {}
            }
        }
        if self.grace_until.is_some_and(|at| at <= now) && self.sessions.is_empty() {
            self.grace_until = None;
            self.close();
        }
        self.pump();
    }
}
