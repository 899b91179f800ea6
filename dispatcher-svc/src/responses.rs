//! A Subscribe session's response stream.
//!
//! The stream opens with the session's `Opened`; then the session task hands the group's
//! [`Outbound`] messages to a bounded channel and [`Responses`] turns them into messages (an
//! `End` status ends the stream, after what came before it). A delivery's message is written
//! here, straight from its frame into the session's reused buffer ([`crate::wire`]), on the
//! session's task, so that work is spread over the cores rather than done by the group's one
//! actor. Each time the transport asks for the next message it takes what is ready — never
//! waiting for more, so a lone delivery is not held back — up to [`MAX_BATCH_ITEMS`] items and
//! about [`MAX_BATCH_BYTES`] encoded, and sends several as one `ResponseBatch` (one ready item
//! alone keeps its single-item form). A delivery's ACK clock starts when it is taken into a
//! message, and its group is told so.
//!
//! The channel is bounded and the transport takes a message only when the client reads, so a
//! client that does not read stops its session task, which bounds what it can make us queue.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use eventmesh_proto::client as pb;
use eventmesh_proto::client::{SubscribeResponse, subscribe_response};
use eventmesh_proto::encoded::SubscribeResponseBytes;
use futures::Stream;
use smallvec::SmallVec;
use tokio::sync::mpsc;
use tonic::Status;

use crate::cluster::meter::Meter;
use crate::group::{GroupCmd, Outbound, ack_deadline_unix_ms};
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
    items: mpsc::Receiver<Outbound>,
    /// Taken from the channel but not fitting the previous message.
    carried: Option<Outbound>,
    builder: ResponseBuilder,
    session: u64,
    ack_timeout: Duration,
    meter: Arc<Meter>,
}

impl Responses {
    /// The responses of `session` (`opened` first), whose deliveries get `ack_timeout` from
    /// when they are sent.
    pub fn new(
        opened: pb::Opened,
        items: mpsc::Receiver<Outbound>,
        session: u64,
        ack_timeout: Duration,
        meter: Arc<Meter>,
    ) -> Responses {
        Responses {
            opened: Some(opened),
            items,
            carried: None,
            builder: ResponseBuilder::default(),
            session,
            ack_timeout,
            meter,
        }
    }
}

/// One response being made: its builder, the ACK deadline of the deliveries in it, and the
/// notices for their groups.
struct Taker<'a> {
    session: u64,
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
        ack_timeout: Duration,
        meter: &'a Meter,
        builder: &'a mut ResponseBuilder,
        expected: usize,
    ) -> Self {
        // A guess from the first item (a batch that grows the buffer copies it).
        builder.start(expected.min(MAX_BATCH_BYTES + 4096));
        Taker {
            session,
            meter,
            builder,
            at: Instant::now(),
            deadline_unix_ms: ack_deadline_unix_ms(ack_timeout),
            bytes: 0,
            written: SmallVec::new(),
        }
    }

    /// Adds `item` unless the message is already started and `item` would take it past
    /// [`MAX_BATCH_BYTES`] or is an `End` (the first item always goes in; an `End` first is
    /// never handed here). What is not added is handed back.
    fn add(&mut self, item: Outbound) -> Option<Outbound> {
        match item {
            Outbound::Delivery {
                ref sending,
                seq,
                ref group,
            } => {
                let message = DeliveryMessage::new(sending, self.deadline_unix_ms);
                if !self.fits(message.encoded_len()) {
                    drop(message);
                    return Some(item);
                }
                self.builder.delivery(&message);
                self.meter.delivered(message.data_len());
                match self
                    .written
                    .iter_mut()
                    .find(|(to, _)| to.same_channel(group))
                {
                    Some((_, seqs)) => seqs.push(seq),
                    None => self.written.push((group.clone(), vec![seq])),
                }
            }
            Outbound::Result(ref answer) => {
                let message = AnswerMessage::new(answer);
                if !self.fits(message.encoded_len()) {
                    return Some(item);
                }
                self.builder.result(&message);
            }
            Outbound::End(_) => return Some(item),
        }
        None
    }

    /// Whether an item of `len` bytes joins this message (counting it if so).
    fn fits(&mut self, len: usize) -> bool {
        if self.builder.items() > 0 && self.bytes + len > MAX_BATCH_BYTES {
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

/// A guess at an item's encoded size, to size a message's buffer.
fn size_hint(item: &Outbound) -> usize {
    match item {
        Outbound::Delivery { sending, .. } => sending.body.len() + 96,
        Outbound::Result(answer) => answer.detail.len() + 64,
        Outbound::End(_) => 0,
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
        let first = match this.carried.take() {
            Some(item) => item,
            None => match this.items.poll_recv(cx) {
                Poll::Ready(Some(item)) => item,
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            },
        };
        if let Outbound::End(status) = first {
            return Poll::Ready(Some(Err(status)));
        }
        let queued = this.items.len().min(MAX_BATCH_ITEMS - 1);
        let expected = size_hint(&first) * (queued + 1);
        let mut taker = Taker::new(
            this.session,
            this.ack_timeout,
            &this.meter,
            &mut this.builder,
            expected,
        );
        if let Some(item) = taker.add(first) {
            // Not reached: a first item always fits. Kept rather than lost.
            this.carried = Some(item);
        }
        while taker.builder.items() < MAX_BATCH_ITEMS {
            let Ok(next) = this.items.try_recv() else {
                break;
            };
            if let Some(next) = taker.add(next) {
                this.carried = Some(next);
                break;
            }
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
            topic: Topic::new("t").unwrap(),
            partition: PartitionId::number(0),
            offset: n as i64,
            decodable: true,
            body,
            key: Bytes::new(),
        }
    }

    struct Harness {
        items: mpsc::Sender<Outbound>,
        group: mpsc::UnboundedSender<GroupCmd>,
        written: mpsc::UnboundedReceiver<GroupCmd>,
        responses: Responses,
    }

    /// A session's stream, its `Opened` already taken (checked to come first).
    async fn harness() -> Harness {
        let (items, rx) = mpsc::channel(1024);
        let (group, written) = mpsc::unbounded_channel();
        let opened = pb::Opened {
            session_id: "s7".into(),
            ..pb::Opened::default()
        };
        let mut h = Harness {
            items,
            group,
            written,
            responses: Responses::new(opened, rx, 7, Duration::from_secs(30), Arc::default()),
        };
        assert!(matches!(
            h.next().await,
            subscribe_response::Kind::Opened(o) if o.session_id == "s7"
        ));
        h
    }

    impl Harness {
        async fn deliver(&self, n: u64, data_bytes: usize) {
            let item = Outbound::Delivery {
                sending: delivery(n, data_bytes),
                seq: n,
                group: self.group.clone(),
            };
            assert!(self.items.send(item).await.is_ok());
        }

        async fn result(&self, id: &str) {
            let result = crate::group::Answer {
                delivery_id: crate::group::AnsweredId::Text(id.into()),
                outcome: pb::AckOutcome::Durable,
                detail: String::new(),
            };
            assert!(self.items.send(Outbound::Result(result)).await.is_ok());
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

        let subscribe_response::Kind::Batch(first) = h.next().await else {
            panic!("a batch")
        };
        assert_eq!(first.deliveries.len(), MAX_BATCH_ITEMS);
        let ids: Vec<_> = first
            .deliveries
            .iter()
            .map(|d| d.delivery_id.clone())
            .collect();
        let expected: Vec<_> = (0..MAX_BATCH_ITEMS as u64).map(id_of).collect();
        assert_eq!(ids, expected, "deliveries keep their order");
        let subscribe_response::Kind::Batch(second) = h.next().await else {
            panic!("a batch")
        };
        assert_eq!(second.deliveries.len(), 300 - MAX_BATCH_ITEMS);
        assert_eq!(second.ack_results.len(), 1);
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
        let mut written = Vec::new();
        let mut notices = 0;
        while let Ok(GroupCmd::Written { seqs, .. }) = h.written.try_recv() {
            written.extend(seqs);
            notices += 1;
        }
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
