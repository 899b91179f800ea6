//! A Subscribe session's response stream.
//!
//! The stream opens with the session's `Opened`; then the session task hands the group's
//! [`Outbound`] messages to two bounded channels — answers, and deliveries with the `End` —
//! and [`Responses`] turns them into messages, answers first (an `End` status ends the stream,
//! after what came before it). A delivery's message is written
//! here, straight from its frame into the session's reused buffer ([`crate::wire`]), on the
//! session's task, so that work is spread over the cores rather than done by the group's one
//! actor. Each time the transport asks for the next message it takes what is ready — never
//! waiting for more, so a lone delivery is not held back — up to [`MAX_BATCH_ITEMS`] items and
//! about [`MAX_BATCH_BYTES`] encoded, and sends several as one `ResponseBatch` (one ready item
//! alone keeps its single-item form). A group shard hands the session its deliveries, and its
//! answers, in runs (what one wake-up of the shard decided for it): a run goes into messages
//! as far as it fits, and the rest is carried, in order, ahead of everything queued after it.
//! A delivery's ACK clock starts when it is taken into a message, and its group is told so.
//!
//! The channels are bounded and the transport takes a message only when the client reads, so
//! a client that does not read stops its session task, which bounds what it can make us queue.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use eventmesh_common::keys::Topic;
use eventmesh_common::probe::{self, Stage};
use eventmesh_proto::client as pb;
use eventmesh_proto::client::{SubscribeResponse, subscribe_response};
use eventmesh_proto::encoded::SubscribeResponseBytes;
use futures::Stream;
use smallvec::SmallVec;
use tokio::sync::mpsc;
use tonic::Status;

use crate::cluster::meter::Meter;
use crate::group::{AnsweredId, GroupCmd, Outbound, ack_deadline_unix_ms};
use crate::wire::{AnswerMessage, DeliveryMessage, ResponseBuilder};

/// Most items in one batched message.
pub const MAX_BATCH_ITEMS: usize = 256;
/// Encoded bytes one batched message aims to stay under (a larger delivery goes alone, as
/// before batching: a client's message limit fits any single delivery).
pub const MAX_BATCH_BYTES: usize = 1024 * 1024;

/// The stream of one session's responses.
pub struct Responses {
    /// Sent first.
    opened: Option<pb::Opened>,
    queues: Queues,
    builder: ResponseBuilder,
    session: u64,
    /// The session's topic: every delivery's (a group is of one topic).
    topic: Topic,
    ack_timeout: Duration,
    meter: Arc<Meter>,
}

impl Responses {
    /// The responses of `session`, subscribed to `topic` (`opened` first): `answers` (only
    /// `Results`) go out ahead of what waits in `items` (deliveries, whose ACK clock of
    /// `ack_timeout` starts when they are sent, and the `End`).
    pub fn new(
        opened: pb::Opened,
        answers: mpsc::Receiver<Outbound>,
        items: mpsc::Receiver<Outbound>,
        session: u64,
        topic: Topic,
        ack_timeout: Duration,
        meter: Arc<Meter>,
    ) -> Responses {
        Responses {
            opened: Some(opened),
            queues: Queues {
                answers,
                carried_answers: None,
                items,
                carried: None,
            },
            builder: ResponseBuilder::default(),
            session,
            topic,
            ack_timeout,
            meter,
        }
    }
}

/// What waits to be sent, answers first: an ACK's answer never waits behind deliveries queued
/// for a client that reads slowly.
struct Queues {
    answers: mpsc::Receiver<Outbound>,
    /// Answers taken from their channel but not fitting the previous message.
    carried_answers: Option<Outbound>,
    items: mpsc::Receiver<Outbound>,
    /// Deliveries (or the `End`) taken from their channel but not fitting the previous message.
    carried: Option<Outbound>,
}

/// Which queue an item came from (what it does not fit goes back to the front of it).
#[derive(Clone, Copy)]
enum Queue {
    Answers,
    Items,
}

impl Queues {
    /// The next item ready now, answers first.
    fn take_ready(&mut self) -> Option<(Outbound, Queue)> {
        if let Some(item) = self.carried_answers.take() {
            return Some((item, Queue::Answers));
        }
        if let Ok(item) = self.answers.try_recv() {
            return Some((item, Queue::Answers));
        }
        if let Some(item) = self.carried.take() {
            return Some((item, Queue::Items));
        }
        self.items.try_recv().ok().map(|item| (item, Queue::Items))
    }

    /// The next item, answers first; `None` once the session's task is gone and both
    /// channels are drained.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<(Outbound, Queue)>> {
        if let Some(ready) = self.take_ready() {
            return Poll::Ready(Some(ready));
        }
        // Nothing ready: wait on both channels (an answers channel closes with the items one).
        if let Poll::Ready(Some(item)) = self.answers.poll_recv(cx) {
            return Poll::Ready(Some((item, Queue::Answers)));
        }
        self.items
            .poll_recv(cx)
            .map(|item| item.map(|item| (item, Queue::Items)))
    }

    /// Puts back what did not fit, ahead of everything else in its queue.
    fn carry(&mut self, item: Outbound, queue: Queue) {
        match queue {
            Queue::Answers => self.carried_answers = Some(item),
            Queue::Items => self.carried = Some(item),
        }
    }

    /// Items queued behind the one being sent (a guess at the message's size).
    fn queued(&self) -> usize {
        self.answers.len() + self.items.len()
    }
}

/// One response being made: its builder, the ACK deadline of the deliveries in it, and the
/// notices for their groups.
struct Taker<'a> {
    session: u64,
    topic: &'a Topic,
    meter: &'a Meter,
    builder: &'a mut ResponseBuilder,
    /// When the message was made: the ACK clock of each delivery in it starts here.
    at: Instant,
    deadline_unix_ms: i64,
    /// Encoded bytes so far (the items without the keys and lengths that frame them).
    bytes: usize,
    /// Deliveries taken, per group shard in the order met (nearly always one shard): each
    /// shard is told once per message, not once per delivery.
    written: SmallVec<[(mpsc::UnboundedSender<GroupCmd>, Vec<u64>); 1]>,
}

impl<'a> Taker<'a> {
    fn new(
        session: u64,
        topic: &'a Topic,
        ack_timeout: Duration,
        meter: &'a Meter,
        builder: &'a mut ResponseBuilder,
        expected: usize,
    ) -> Self {
        // A guess from the first item (a batch that grows the buffer copies it).
        builder.start(expected.min(MAX_BATCH_BYTES + 4096));
        Taker {
            session,
            topic,
            meter,
            builder,
            at: Instant::now(),
            deadline_unix_ms: ack_deadline_unix_ms(ack_timeout),
            bytes: 0,
            written: SmallVec::new(),
        }
    }

    /// Adds `item` unless the message is already started and `item` would take it past
    /// [`MAX_BATCH_BYTES`] or [`MAX_BATCH_ITEMS`], or is an `End` (the first item always goes
    /// in; an `End` first is never handed here). A batch of deliveries or answers goes in as
    /// far as it fits. What is not added is handed back.
    fn add(&mut self, item: Outbound) -> Option<Outbound> {
        match item {
            Outbound::Deliveries { mut batch, group } => {
                let mut seqs = Vec::with_capacity(batch.len());
                while let Some(sending) = batch.front() {
                    let message = DeliveryMessage::new(sending, self.topic, self.deadline_unix_ms);
                    if !self.fits(message.encoded_len()) {
                        break;
                    }
                    self.builder.delivery(&message);
                    self.meter.delivered(message.data_len());
                    seqs.push(sending.id.seq);
                    drop(message);
                    batch.pop_front();
                }
                if !seqs.is_empty() {
                    match self
                        .written
                        .iter_mut()
                        .find(|(to, _)| to.same_channel(&group))
                    {
                        Some((_, taken)) => taken.extend_from_slice(&seqs),
                        None => self.written.push((group.clone(), seqs)),
                    }
                }
                if !batch.is_empty() {
                    return Some(Outbound::Deliveries { batch, group });
                }
            }
            Outbound::Results(mut answers) => {
                while let Some(answer) = answers.front() {
                    let message = AnswerMessage::new(answer);
                    if !self.fits(message.encoded_len()) {
                        break;
                    }
                    self.builder.result(&message);
                    if let AnsweredId::Issued(id) = &answer.delivery_id {
                        probe::mark(Stage::AnswerSent, id.seq);
                    }
                    answers.pop_front();
                }
                if !answers.is_empty() {
                    return Some(Outbound::Results(answers));
                }
            }
            Outbound::End(_) => return Some(item),
        }
        None
    }

    /// Whether an item of `len` bytes joins this message (counting it if so).
    fn fits(&mut self, len: usize) -> bool {
        let items = self.builder.items();
        if items > 0 && (items >= MAX_BATCH_ITEMS || self.bytes + len > MAX_BATCH_BYTES) {
            return false;
        }
        self.bytes += len;
        true
    }

    /// Tells each group which of its deliveries were taken, and gives the message. The
    /// notices go before the message is handed to the transport, so a group hears of a
    /// delivery before its client can ACK it.
    fn finish(self) -> SubscribeResponseBytes {
        for (group, seqs) in self.written {
            let _ = group.send(GroupCmd::Written {
                seqs,
                session: self.session,
                at: self.at,
            });
        }
        self.builder.finish()
    }
}

/// A guess at an item's encoded size and item count, to size a message's buffer.
fn size_hint(item: &Outbound) -> (usize, usize) {
    match item {
        Outbound::Deliveries { batch, .. } => {
            (batch.iter().map(|s| s.body.len() + 96).sum(), batch.len())
        }
        Outbound::Results(answers) => (
            answers.iter().map(|a| a.detail.len() + 64).sum(),
            answers.len(),
        ),
        Outbound::End(_) => (0, 1),
    }
}

impl Stream for Responses {
    type Item = Result<SubscribeResponseBytes, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(opened) = this.opened.take() {
            return Poll::Ready(Some(Ok(SubscribeResponseBytes::from_message(
                &SubscribeResponse {
                    kind: Some(subscribe_response::Kind::Opened(opened)),
                },
            ))));
        }
        let (first, queue) = match this.queues.poll_next(cx) {
            Poll::Ready(Some(next)) => next,
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if let Outbound::End(status) = first {
            return Poll::Ready(Some(Err(status)));
        }
        // Each queued message holds at least one item; sized like the first one's.
        let (first_bytes, first_items) = size_hint(&first);
        let items = (first_items + this.queues.queued()).min(MAX_BATCH_ITEMS);
        let expected = first_bytes / first_items.max(1) * items;
        let mut taker = Taker::new(
            this.session,
            &this.topic,
            this.ack_timeout,
            &this.meter,
            &mut this.builder,
            expected,
        );
        // The first item goes in (a run of deliveries or answers at least its first); what
        // does not fit is carried to the next message, ahead of everything queued behind it.
        let mut next = Some((first, queue));
        while let Some((item, queue)) = next.take() {
            if let Some(rest) = taker.add(item) {
                this.queues.carry(rest, queue);
                break;
            }
            if taker.builder.items() >= MAX_BATCH_ITEMS {
                break;
            }
            next = this.queues.take_ready();
        }
        Poll::Ready(Some(Ok(taker.finish())))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use bytes::Bytes;
    use eventmesh_common::keys::{PartitionId, Topic};
    use futures::StreamExt;

    use super::*;
    use crate::delivery_id::DeliveryId;
    use crate::group::Sending;

    /// Delivery `n`'s id.
    fn id(n: u64) -> DeliveryId {
        DeliveryId {
            epoch: 1,
            group: 1,
            seq: n,
        }
    }

    /// Delivery `n`'s id as the client sees it.
    fn id_of(n: u64) -> String {
        id(n).to_text()
    }

    /// Delivery `n` on its way, its event carrying `data_bytes` of data.
    fn delivery(n: u64, data_bytes: usize) -> Sending {
        let (body, _) = crate::event::encode_for_publish(pb::Event {
            data: vec![b'x'; data_bytes].into(),
            ..pb::Event::default()
        })
        .unwrap();
        Sending {
            id: id(n),
            attempt: 1,
            partition: PartitionId::number(0),
            offset: n as i64,
            decodable: true,
            body,
            key: Bytes::new(),
        }
    }

    /// The delivery ids of a batch, in order.
    fn delivery_ids(batch: &pb::ResponseBatch) -> Vec<String> {
        batch
            .deliveries
            .iter()
            .map(|d| d.delivery_id.clone())
            .collect()
    }

    struct Harness {
        answers: mpsc::Sender<Outbound>,
        items: mpsc::Sender<Outbound>,
        group: mpsc::UnboundedSender<GroupCmd>,
        written: mpsc::UnboundedReceiver<GroupCmd>,
        responses: Responses,
    }

    /// A session's stream, its `Opened` already taken (checked to come first).
    async fn harness() -> Harness {
        let (answers, answers_rx) = mpsc::channel(1024);
        let (items, rx) = mpsc::channel(1024);
        let (group, written) = mpsc::unbounded_channel();
        let opened = pb::Opened {
            session_id: "s7".into(),
            ..pb::Opened::default()
        };
        let responses = Responses::new(
            opened,
            answers_rx,
            rx,
            7,
            Topic::new("t").unwrap(),
            Duration::from_secs(30),
            Arc::default(),
        );
        let mut h = Harness {
            answers,
            items,
            group,
            written,
            responses,
        };
        assert!(matches!(
            h.next().await,
            subscribe_response::Kind::Opened(o) if o.session_id == "s7"
        ));
        h
    }

    impl Harness {
        /// Delivery `n` alone in its group's message.
        async fn deliver(&self, n: u64, data_bytes: usize) {
            self.deliver_batch(n..n + 1, data_bytes).await;
        }

        /// Deliveries `ns` in one message of their group.
        async fn deliver_batch(&self, ns: std::ops::Range<u64>, data_bytes: usize) {
            let item = Outbound::Deliveries {
                batch: ns.map(|n| delivery(n, data_bytes)).collect(),
                group: self.group.clone(),
            };
            assert!(self.items.send(item).await.is_ok());
        }

        /// The sequence numbers the group was told were written, and in how many notices.
        fn written(&mut self) -> (Vec<u64>, usize) {
            let mut written = Vec::new();
            let mut notices = 0;
            while let Ok(GroupCmd::Written { seqs, .. }) = self.written.try_recv() {
                written.extend(seqs);
                notices += 1;
            }
            (written, notices)
        }

        async fn result(&self, id: &str) {
            let result = crate::group::Answer {
                delivery_id: crate::group::AnsweredId::Text(id.into()),
                outcome: pb::AckOutcome::Durable,
                detail: String::new(),
            };
            assert!(
                self.answers
                    .send(Outbound::Results([result].into()))
                    .await
                    .is_ok()
            );
        }

        async fn next(&mut self) -> subscribe_response::Kind {
            let bytes = self.responses.next().await.unwrap().unwrap();
            bytes.decode_message().unwrap().kind.unwrap()
        }
    }

    #[tokio::test]
    async fn one_ready_item_keeps_its_single_form() {
        let mut h = harness().await;
        h.deliver(1, 10).await;
        match h.next().await {
            subscribe_response::Kind::Delivery(d) => {
                assert_eq!(d.delivery_id, id_of(1));
                assert!(d.ack_deadline_unix_ms > 0, "the deadline is stamped");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            h.written.try_recv(),
            Ok(GroupCmd::Written {
                seqs,
                session: 7,
                ..
            }) if seqs == [1]
        ));
        h.result(&id_of(1)).await;
        assert!(matches!(
            h.next().await,
            subscribe_response::Kind::AckResult(_)
        ));
    }

    #[tokio::test]
    async fn what_is_ready_goes_as_one_batch_in_order_and_alone_items_stay_alone() {
        let mut h = harness().await;
        for n in 0..300 {
            h.deliver(n, 10).await;
        }
        h.result("r0").await;
        let end = Outbound::End(Status::unavailable("bye"));
        assert!(h.items.send(end).await.is_ok());
        h.deliver(300, 10).await;

        // The answer first (it overtakes the deliveries queued before it), then deliveries.
        let subscribe_response::Kind::Batch(first) = h.next().await else {
            panic!("a batch")
        };
        assert_eq!(first.ack_results.len(), 1);
        let ids = delivery_ids(&first);
        let expected: Vec<_> = (0..MAX_BATCH_ITEMS as u64 - 1).map(id_of).collect();
        assert_eq!(ids, expected, "deliveries keep their order");
        let subscribe_response::Kind::Batch(second) = h.next().await else {
            panic!("a batch")
        };
        let ids = delivery_ids(&second);
        let expected: Vec<_> = (MAX_BATCH_ITEMS as u64 - 1..300).map(id_of).collect();
        assert_eq!(ids, expected);
        assert!(second.ack_results.is_empty());
        let status = h.responses.next().await.unwrap().unwrap_err();
        assert_eq!(
            status.code(),
            tonic::Code::Unavailable,
            "the end status stays alone"
        );
        assert!(matches!(
            h.next().await,
            subscribe_response::Kind::Delivery(_)
        ));
        let (written, notices) = h.written();
        assert_eq!(
            written,
            (0..=300).collect::<Vec<u64>>(),
            "every delivery's group is told it was written, in order"
        );
        assert_eq!(notices, 3, "once per message");
    }

    #[tokio::test]
    async fn a_batch_stays_under_the_data_limit_and_a_large_event_goes_alone() {
        let mut h = harness().await;
        // Three fit with their framing; a fourth does not.
        let third = MAX_BATCH_BYTES / 3 - 100;
        for n in 0..4 {
            h.deliver(n, third).await;
        }
        h.deliver(4, MAX_BATCH_BYTES * 2).await;
        let subscribe_response::Kind::Batch(first) = h.next().await else {
            panic!("a batch")
        };
        assert_eq!(first.deliveries.len(), 3);
        assert!(
            matches!(h.next().await, subscribe_response::Kind::Delivery(d) if d.delivery_id == id_of(3))
        );
        assert!(
            matches!(h.next().await, subscribe_response::Kind::Delivery(d) if d.delivery_id == id_of(4))
        );
    }

    #[tokio::test]
    async fn a_group_batch_larger_than_a_message_is_carried_on_ahead_of_what_follows() {
        let mut h = harness().await;
        h.deliver_batch(0..300, 10).await;
        h.deliver_batch(300..302, 10).await;
        let subscribe_response::Kind::Batch(first) = h.next().await else {
            panic!("a batch")
        };
        let ids = delivery_ids(&first);
        assert_eq!(
            ids,
            (0..MAX_BATCH_ITEMS as u64).map(id_of).collect::<Vec<_>>()
        );
        assert!(first.ack_results.is_empty());
        let subscribe_response::Kind::Batch(second) = h.next().await else {
            panic!("a batch")
        };
        let ids = delivery_ids(&second);
        assert_eq!(
            ids,
            (MAX_BATCH_ITEMS as u64..302).map(id_of).collect::<Vec<_>>(),
            "the rest of the batch first, then the later batch"
        );
        let (written, notices) = h.written();
        assert_eq!(written, (0..302).collect::<Vec<u64>>());
        assert_eq!(notices, 2, "once per message, both batches' in one notice");
    }

    /// An answer goes out in the next message, ahead of the deliveries queued before it (and
    /// of the rest of a run of deliveries cut short by the message's limit).
    #[tokio::test]
    async fn an_answer_overtakes_the_deliveries_queued_before_it() {
        let mut h = harness().await;
        h.deliver_batch(0..MAX_BATCH_ITEMS as u64 * 2, 10).await;
        h.deliver_batch(1000..1010, 10).await;
        let subscribe_response::Kind::Batch(first) = h.next().await else {
            panic!("a batch")
        };
        assert_eq!(first.deliveries.len(), MAX_BATCH_ITEMS);
        assert!(first.ack_results.is_empty());
        h.result("r1").await;
        let subscribe_response::Kind::Batch(second) = h.next().await else {
            panic!("a batch")
        };
        assert_eq!(second.ack_results.len(), 1, "the answer comes next");
        assert_eq!(second.ack_results[0].delivery_id, "r1");
        assert_eq!(
            second.deliveries.first().map(|d| d.delivery_id.clone()),
            Some(id_of(MAX_BATCH_ITEMS as u64)),
            "then the deliveries where they left off"
        );
        // Two answers queued: the next message holds both, in order, then deliveries.
        h.result("r2").await;
        h.result("r3").await;
        let subscribe_response::Kind::Batch(third) = h.next().await else {
            panic!("a batch")
        };
        let answered: Vec<_> = third
            .ack_results
            .iter()
            .map(|r| r.delivery_id.clone())
            .collect();
        assert_eq!(answered, ["r2", "r3"]);
        drop(h.answers);
        drop(h.items);
        let mut rest = third.deliveries.len() + second.deliveries.len() + first.deliveries.len();
        while let Some(message) = h.responses.next().await {
            let message = message.unwrap().decode_message().unwrap();
            rest += match message.kind {
                Some(subscribe_response::Kind::Batch(batch)) => batch.deliveries.len(),
                Some(subscribe_response::Kind::Delivery(_)) => 1,
                other => panic!("{other:?}"),
            };
        }
        assert_eq!(rest, MAX_BATCH_ITEMS * 2 + 10, "every delivery still comes");
    }

    #[tokio::test]
    async fn a_group_batch_is_cut_at_the_data_limit() {
        let mut h = harness().await;
        let third = MAX_BATCH_BYTES / 3 - 100;
        h.deliver_batch(0..4, third).await;
        h.deliver(4, 10).await;
        let subscribe_response::Kind::Batch(first) = h.next().await else {
            panic!("a batch")
        };
        assert_eq!(first.deliveries.len(), 3);
        let subscribe_response::Kind::Batch(second) = h.next().await else {
            panic!("a batch")
        };
        let ids = delivery_ids(&second);
        assert_eq!(ids, vec![id_of(3), id_of(4)]);
        assert_eq!(h.written().0, (0..5).collect::<Vec<u64>>());
    }

    #[tokio::test]
    async fn the_end_status_ends_the_stream_after_what_came_before() {
        let mut h = harness().await;
        h.deliver(1, 10).await;
        assert!(
            h.items
                .send(Outbound::End(Status::unavailable("bye")))
                .await
                .is_ok()
        );
        drop(h.items);
        let delivery = h.responses.next().await.unwrap().unwrap();
        assert!(matches!(
            delivery.decode_message().unwrap().kind,
            Some(subscribe_response::Kind::Delivery(_))
        ));
        let status = h.responses.next().await.unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(h.responses.next().await.is_none());
    }
}
