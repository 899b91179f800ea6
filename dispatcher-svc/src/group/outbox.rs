//! Answers to clients (`AckResult`s), collected over one wake-up of the group's actor and sent
//! to each session as one message.
//!
//! A message of ACKs settles many deliveries, and one offset write retires many: their answers
//! travel to the session's stream together instead of one channel message (and one pass of the
//! session task) each. Per session they keep the order in which they were decided. The actor
//! flushes at the end of every wake-up and before it ends a session's stream, so an answer
//! decided before a stream's `End` always reaches the stream before that `End` does.

use std::collections::VecDeque;

use tokio::sync::mpsc;

use super::{Answer, Outbound};

/// Answers waiting for the end of the wake-up, per session channel (first decided first).
#[derive(Debug, Default)]
pub(super) struct Outbox {
    pending: Vec<(mpsc::UnboundedSender<Outbound>, VecDeque<Answer>)>,
}

impl Outbox {
    /// Queues `answer` for the session behind `to`.
    pub(super) fn add(&mut self, to: &mpsc::UnboundedSender<Outbound>, answer: Answer) {
        // Answers come in runs for one session: its entry is usually the last one.
        let entry = match self.pending.last_mut() {
            Some((last, _)) if last.same_channel(to) => self.pending.last_mut(),
            _ => self.pending.iter_mut().find(|(t, _)| t.same_channel(to)),
        };
        match entry {
            Some((_, answers)) => answers.push_back(answer),
            None => self.pending.push((to.clone(), VecDeque::from([answer]))),
        }
    }

    /// Sends what is queued, one message per session (a session whose stream is gone is
    /// skipped: its client gets the outcomes as UNKNOWN or redeliveries on its next session).
    pub(super) fn flush(&mut self) {
        for (to, answers) in self.pending.drain(..) {
            let _ = to.send(Outbound::Results(answers));
        }
    }

    /// Whether nothing is queued.
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use eventmesh_proto::client::AckOutcome;

    use super::*;
    use crate::group::AnsweredId;

    fn answer(text: &str) -> Answer {
        Answer {
            delivery_id: AnsweredId::Text(text.into()),
            outcome: AckOutcome::Durable,
            detail: String::new(),
        }
    }

    fn texts(outbound: Outbound) -> Vec<String> {
        let Outbound::Results(answers) = outbound else {
            panic!("answers")
        };
        answers
            .into_iter()
            .map(|a| match a.delivery_id {
                AnsweredId::Text(text) => text,
                AnsweredId::Issued(id) => id.to_text(),
            })
            .collect()
    }

    #[test]
    fn answers_go_as_one_message_per_session_in_the_order_decided() {
        let (a, mut a_rx) = mpsc::unbounded_channel();
        let (b, mut b_rx) = mpsc::unbounded_channel();
        let mut outbox = Outbox::default();
        outbox.add(&a, answer("a1"));
        outbox.add(&b, answer("b1"));
        outbox.add(&a, answer("a2"));
        outbox.add(&a.clone(), answer("a3"));
        assert!(a_rx.try_recv().is_err(), "nothing is sent before the flush");
        outbox.flush();
        assert!(outbox.is_empty());
        assert_eq!(texts(a_rx.try_recv().unwrap()), ["a1", "a2", "a3"]);
        assert!(a_rx.try_recv().is_err(), "one message");
        assert_eq!(texts(b_rx.try_recv().unwrap()), ["b1"]);
        outbox.flush();
        assert!(a_rx.try_recv().is_err(), "an empty flush sends nothing");
    }

    #[test]
    fn a_gone_session_does_not_stop_the_others() {
        let (a, a_rx) = mpsc::unbounded_channel();
        let (b, mut b_rx) = mpsc::unbounded_channel();
        drop(a_rx);
        let mut outbox = Outbox::default();
        outbox.add(&a, answer("a1"));
        outbox.add(&b, answer("b1"));
        outbox.flush();
        assert_eq!(texts(b_rx.try_recv().unwrap()), ["b1"]);
    }
}
