//! Sending: ready deliveries to the group's sessions, and what happens when a session stops
//! taking them or leaves.
//!
//! * [`Group::pump`] hands ready deliveries round robin to sessions with spare in-flight
//!   capacity that are not stalled, in runs of consecutive ones (an even share of what is
//!   ready, at most [`MAX_RUN`]).
//! * A delivery is **assigned** until the session's stream takes it (the ACK clock starts only
//!   then, [`Group::written`]). A session that has deliveries its stream has not taken, and took
//!   none for the assignment timeout (a client that holds its stream and never reads), is
//!   **stalled**: those deliveries go back to the group at once for its other sessions (same
//!   attempt: they never reached the client), and it gets nothing new until its stream takes
//!   something again. So one client that never reads holds nothing of its group's work; and
//!   the group's buffer share bounds what it holds of the topic ([`crate::budget`]).
//! * A session that leaves hands everything it held to the group at once: what it had taken
//!   comes back as the next attempt (or is dead-lettered after the last), the rest unchanged.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use eventmesh_common::trace_context::Operation;
use tokio::sync::mpsc;

use super::{DeliveryState, Group, GroupCmd, Outbound, Retry, Sending, SessionSlot};
use crate::crash::{CrashPoint, crash_point};
use crate::responses::MAX_BATCH_ITEMS;

/// Most consecutive ready deliveries one session gets before the next session's turn.
pub(super) const MAX_RUN: usize = 256;

impl Group {
    /// Asks for a pass handing ready deliveries to sessions ([`Group::pump_now`]), made once at
    /// the end of the actor's wake-up: every command of it may make deliveries ready or free
    /// credits (a message of ACKs frees one per id), and one pass after all of them sends each
    /// session what it gets as one message instead of one message per credit freed.
    pub(super) fn pump(&mut self) {
        self.pump_due = true;
    }

    /// Hands ready deliveries to sessions with spare capacity, round robin; each session gets
    /// what this pass handed it as one message.
    pub(super) fn pump_now(&mut self) {
        self.pump_due = false;
        // A fenced instance (its lease not renewed in time) delivers nothing: another instance
        // may be the group's home by now.
        if !self.shared.may_serve() {
            return;
        }
        // Draining for a graceful stop: what was not sent yet stays for the next instance.
        if self.draining {
            return;
        }
        let mut outgoing = std::mem::take(&mut self.outgoing);
        outgoing.resize_with(self.sessions.len(), VecDeque::new);
        self.assign_ready(&mut outgoing);
        for (slot, batch) in self.sessions.iter().zip(outgoing.iter_mut()) {
            send_deliveries(slot, batch, &self.cmd_tx);
        }
        outgoing.clear();
        self.outgoing = outgoing;
    }

    /// Assigns ready deliveries round robin to sessions with credit, adding each to its
    /// session's entry of `outgoing`. Each session in turn gets a run of consecutive ones —
    /// an even share of what is ready when the pass starts, at most [`MAX_RUN`] — rather
    /// than one each: its ACKs then name neighbouring deliveries (settled near each other,
    /// most often in offset order) and each message carries a run, while a few ready
    /// deliveries are still shared evenly (ten over two sessions: five each).
    fn assign_ready(&mut self, outgoing: &mut [VecDeque<Sending>]) {
        // Sessions in a row that took nothing (full or stalled): all of them, and the pass ends.
        let mut took_nothing = 0;
        let count = self.sessions.len();
        let run = self.ready.len().div_ceil(count.max(1)).clamp(1, MAX_RUN);
        while count > 0 && !self.ready.is_empty() {
            let index = self.next_session % count;
            self.next_session = (index + 1) % count;
            if self.assign_run(index, run, outgoing) > 0 {
                took_nothing = 0;
            } else {
                took_nothing += 1;
                if took_nothing >= count {
                    return;
                }
            }
        }
    }

    /// Assigns up to `run` ready deliveries to the session at `index`, as long as it has
    /// credit; returns how many it got.
    fn assign_run(
        &mut self,
        index: usize,
        run: usize,
        outgoing: &mut [VecDeque<Sending>],
    ) -> usize {
        let mut given = 0;
        while given < run {
            let Some(&seq) = self.ready.front() else {
                break;
            };
            let still_ready = self
                .deliveries
                .get(seq)
                .is_some_and(|d| d.state == DeliveryState::Ready);
            if !still_ready {
                self.ready.pop_front();
                continue;
            }
            // Taking the credit is what finds room; a session found empty wakes this shard
            // when another shard gives a credit of it back.
            if !self.sessions[index].take_credit(self.shard) {
                break;
            }
            self.ready.pop_front();
            given += 1;
            let slot = &mut self.sessions[index];
            let Some(delivery) = self.deliveries.get_mut(seq) else {
                continue;
            };
            outgoing[index].push_back(delivery.sending());
            delivery.record_hop(Operation::DELIVER, &self.key, &slot.link.client);
            delivery.state = DeliveryState::Assigned {
                session: slot.link.id,
            };
            delivery.note_client(&slot.link.client);
            let client_key = (slot.link.client.clone(), delivery.partition.clone());
            let offset = delivery.offset;
            slot.unwritten += 1;
            slot.waiting_since.get_or_insert_with(Instant::now);
            self.clients
                .entry(client_key)
                .or_default()
                .tracker
                .sent(offset);
            self.tallies.delivered.add();
            // A run goes in parts of one response's worth: an answer the session task gets
            // meanwhile overtakes the parts still waiting there.
            if outgoing[index].len() >= MAX_BATCH_ITEMS {
                send_deliveries(&self.sessions[index], &mut outgoing[index], &self.cmd_tx);
            }
        }
        given
    }

    /// A session's stream took deliveries (at `at`): their ACK clocks start, and the session
    /// is making progress (no longer stalled), whatever became of those deliveries meanwhile.
    pub(super) fn written(&mut self, seqs: &[u64], session: u64, at: Instant) {
        let timeout = self.shared.settings.ack_timeout();
        let mut taken = 0u32;
        let mut moved_on = false;
        for &seq in seqs {
            match self.deliveries.get_mut(seq) {
                Some(delivery) if delivery.state == (DeliveryState::Assigned { session }) => {
                    taken += 1;
                    delivery.state = DeliveryState::Sent { session };
                    let deadline = at + timeout + delivery.extension.take().unwrap_or_default();
                    self.timers.set(delivery, seq, deadline);
                    crash_point(CrashPoint::AfterDeliver);
                }
                _ => moved_on = true, // settled or taken back meanwhile
            }
        }
        if let Some(slot) = self.session_slot(session) {
            slot.unwritten = slot.unwritten.saturating_sub(taken);
            slot.waiting_since = (slot.unwritten > 0).then_some(at);
            if slot.link.credits.is_stalled() && slot.link.credits.set_stalled(false) {
                tracing::info!(session, "stalled session reads again");
            }
        }
        if moved_on {
            self.pump();
        }
    }

    pub(super) fn session_slot(&mut self, session: u64) -> Option<&mut SessionSlot> {
        self.sessions.iter_mut().find(|s| s.link.id == session)
    }

    /// Frees the in-flight slot a delivery held, if any.
    pub(super) fn free_slot(&mut self, state: DeliveryState) {
        let (session, unwritten) = match state {
            DeliveryState::Assigned { session } => (session, true),
            DeliveryState::Sent { session } => (session, false),
            _ => return,
        };
        let Some(slot) = self.sessions.iter_mut().find(|s| s.link.id == session) else {
            return;
        };
        if unwritten {
            slot.unwritten = slot.unwritten.saturating_sub(1);
            if slot.unwritten == 0 {
                slot.waiting_since = None;
            }
        }
        // Shards that found the session's credits spent are woken; this one delivers again
        // anyway (everything that frees a slot pumps after).
        let waiting = slot.link.credits.give_back() & !(1 << (self.shard % 64));
        if waiting != 0 {
            for (index, sibling) in self.siblings.iter().enumerate() {
                if waiting & (1 << (index % 64)) != 0 {
                    let _ = sibling.send(GroupCmd::Credit);
                }
            }
        }
    }

    /// Takes back what sessions that stopped reading hold (see the module doc).
    pub(super) fn check_stalled(&mut self, now: Instant) {
        let timeout = Duration::from_millis(self.shared.settings.assign_timeout_ms);
        let stalled: Vec<u64> = self
            .sessions
            .iter()
            .filter(|s| s.waiting_since.is_some_and(|t| now >= t + timeout))
            .map(|s| s.link.id)
            .collect();
        for session in stalled {
            // Marked first, so no shard woken by the credits given back below assigns it more;
            // every shard takes back what it assigned, and the session is counted once.
            let newly_stalled = self
                .session_slot(session)
                .is_some_and(|slot| slot.link.credits.set_stalled(true));
            if newly_stalled {
                metrics::counter!("dispatcher_stalled_sessions_total").increment(1);
            }
            let held: Vec<u64> = self
                .deliveries
                .iter()
                .filter(|(_, d)| d.state == (DeliveryState::Assigned { session }))
                .map(|(seq, _)| seq)
                .collect();
            for &seq in held.iter().rev() {
                self.free_slot(DeliveryState::Assigned { session });
                if let Some(delivery) = self.deliveries.get_mut(seq) {
                    delivery.state = DeliveryState::Ready;
                    self.ready.push_front(seq);
                }
            }
            if let Some(slot) = self.session_slot(session) {
                slot.unwritten = 0;
                slot.waiting_since = None;
            }
            tracing::warn!(group = %self.key, session, taken_back = held.len(), ?timeout, "session took no delivery for the assignment timeout: its deliveries go to the group's other sessions, and it gets none until it reads again");
        }
        self.pump();
    }

    pub(super) fn leave(&mut self, session: u64) {
        let Some(index) = self.sessions.iter().position(|s| s.link.id == session) else {
            return;
        };
        self.sessions.remove(index);
        if self.next_session >= self.sessions.len() {
            self.next_session = 0;
        }
        let held: Vec<u64> = self
            .deliveries
            .iter()
            .filter(|(_, d)| d.state.session() == Some(session))
            .map(|(seq, _)| seq)
            .collect();
        tracing::debug!(group = %self.key, session, reassigned = held.len(), "session left");
        // Each goes to the ready queue's front: taken last to first, they are sent again in
        // the order they were pulled.
        for seq in held.into_iter().rev() {
            let was_written = self
                .deliveries
                .get(seq)
                .is_some_and(|d| matches!(d.state, DeliveryState::Sent { .. }));
            if was_written {
                // Its session is gone, not the event: the next attempt goes to another
                // session at once (DESIGN §7), without a backoff.
                self.retry(seq, Retry::Now, "its session left");
            } else if let Some(delivery) = self.deliveries.get_mut(seq) {
                delivery.state = DeliveryState::Ready;
                self.ready.push_front(seq);
            }
        }
        if self.sessions.is_empty() {
            self.grace_until = Some(Instant::now() + self.grace());
        }
        self.update_gate();
        self.pump();
    }
}

/// Sends `batch` (emptied) to the session, if it holds anything.
fn send_deliveries(
    slot: &SessionSlot,
    batch: &mut VecDeque<Sending>,
    group: &mpsc::UnboundedSender<GroupCmd>,
) {
    if batch.is_empty() {
        return;
    }
    // A failed send means the session's task has ended and its Leave follows: that hands back
    // everything assigned to it, these included.
    let _ = slot.link.out.send(Outbound::Deliveries {
        batch: std::mem::take(batch),
        group: group.clone(),
    });
}

impl SessionSlot {
    /// Takes one of its credits for a new delivery from shard `shard`; `false` when it is
    /// stalled or has none left.
    fn take_credit(&self, shard: usize) -> bool {
        !self.link.credits.is_stalled() && self.link.credits.take(shard)
    }
}
