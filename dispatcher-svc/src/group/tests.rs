#![allow(clippy::unwrap_used)]
use super::*;
use crate::broker_ack::BrokerAcker;
use crate::config::DeliverySettings;
use crate::offset_writer::OffsetWriter;
use crate::registry::{GroupKey, SharedParts};
use eventmesh_common::keys::{GroupName, Topic};
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::client as pb;
use eventmesh_proto::puller::{PartitionRange, PulledRecord};

/// A loopback port nothing listens on: every call to it fails (and is retried).
fn nowhere_uri() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("http://127.0.0.1:{port}")
}

/// A channel to [`nowhere_uri`].
fn nowhere() -> eventmesh_common::grpc::InternalChannel {
    eventmesh_common::grpc::internal_channel(&nowhere_uri(), Duration::from_secs(5)).unwrap()
}

fn batch(offset: i64) -> PullResponse {
    let (frame, _) = crate::event::encode_for_publish(pb::Event {
        id: format!("e{offset}"),
        ..pb::Event::default()
    })
    .unwrap();
    PullResponse {
        records: vec![PulledRecord {
            partition: "0".into(),
            offset,
            frame,
            body_kind: eventmesh_proto::puller::BodyKind::Frame as i32,
            ..PulledRecord::default()
        }],
        ranges: vec![PartitionRange {
            partition: "0".into(),
            first: offset,
            next: offset + 1,
            lost_to_retention: 0,
        }],
        ..PullResponse::default()
    }
}

/// `count` records of partition 0 from `first`, as one pulled batch.
fn batch_of(first: i64, count: i64) -> PullResponse {
    let mut pulled = PullResponse::default();
    for offset in first..first + count {
        let one = batch(offset);
        pulled.records.extend(one.records);
    }
    pulled.ranges = vec![PartitionRange {
        partition: "0".into(),
        first,
        next: first + count,
        lost_to_retention: 0,
    }];
    pulled
}

/// The deliveries of the next message, which must be `Deliveries` (PENDING answers, from
/// offset writes that cannot finish here, are skipped).
async fn next_deliveries(outbound: &mut mpsc::UnboundedReceiver<Outbound>) -> Vec<Sending> {
    loop {
        match tokio::time::timeout(Duration::from_secs(5), outbound.recv()).await {
            Ok(Some(Outbound::Deliveries { batch, .. })) => return batch.into(),
            Ok(Some(Outbound::Results(answers)))
                if answers.iter().all(|a| a.outcome == AckOutcome::Pending) => {}
            other => panic!("expected deliveries, got {other:?}"),
        }
    }
}

/// What one wake-up of the actor makes ready or frees goes to a session as one message: a
/// pulled batch as far as the session's credits reach, the credits a message of ACKs frees
/// as one more, and the answers to a message of NACKs as one `Results`, in order.
#[tokio::test]
async fn a_wake_up_sends_a_session_one_message_of_deliveries_and_one_of_answers() {
    let TestGroup {
        shutdown,
        key,
        budget,
        commands,
        ..
    } = test_group(DeliverySettings::default());
    let (out, mut outbound) = join(&commands, 1, 4).await;
    let charge = budget.reserve(&key.label(), 12, 12).await;
    commands
        .send(GroupCmd::Pulled {
            batch: batch_of(0, 12),
            charge,
        })
        .unwrap();
    let offsets = |sent: &[Sending]| sent.iter().map(|s| s.offset).collect::<Vec<_>>();
    let first = next_deliveries(&mut outbound).await;
    assert_eq!(offsets(&first), [0, 1, 2, 3], "as far as the credits reach");
    let settle = |sent: &[Sending], op| {
        let seqs: Vec<u64> = sent.iter().map(|s| s.id.seq).collect();
        commands
            .send(GroupCmd::Written {
                seqs,
                session: 1,
                at: Instant::now(),
            })
            .unwrap();
        commands
            .send(GroupCmd::Settle {
                op,
                ids: sent.iter().map(|s| s.id).collect(),
                client: ClientId::new("app").unwrap(),
                reply_to: out.clone(),
            })
            .unwrap();
    };
    // Four ACKs in one message free four credits: one message of four deliveries follows.
    settle(&first, SettleOp::Ack);
    let second = next_deliveries(&mut outbound).await;
    assert_eq!(offsets(&second), [4, 5, 6, 7]);
    // Four NACKs (redelivered only after a minute) in one message: four more deliveries in
    // one message, then the four answers in one message, in the order of the ids.
    settle(&second, SettleOp::Nack(Some(Duration::from_secs(60))));
    let third = next_deliveries(&mut outbound).await;
    assert_eq!(offsets(&third), [8, 9, 10, 11]);
    // The ACKs' offset writes cannot finish here: PENDING answers may come too.
    let answered = loop {
        match tokio::time::timeout(Duration::from_secs(5), outbound.recv()).await {
            Ok(Some(Outbound::Results(answers))) => {
                let decided: Vec<_> = answers
                    .iter()
                    .filter(|a| a.outcome != AckOutcome::Pending)
                    .map(|a| (a.delivery_id.clone(), a.outcome))
                    .collect();
                if !decided.is_empty() {
                    break decided;
                }
            }
            other => panic!("expected answers, got {other:?}"),
        }
    };
    let expected: Vec<_> = second
        .iter()
        .map(|s| (AnsweredId::Issued(s.id), AckOutcome::Nacked))
        .collect();
    assert_eq!(answered, expected);
    shutdown.cancel();
}

/// Sessions of a group get runs of consecutive deliveries in turn — an even share of what is
/// ready, at most `MAX_RUN` — not one delivery each: a few are still shared evenly, and many
/// go out as runs each session's ACKs settle together.
#[tokio::test]
async fn sessions_take_turns_at_runs_of_consecutive_deliveries() {
    let group = test_group(DeliverySettings::default());
    let (commands, budget, label) = (&group.commands, &group.budget, group.key.label());
    let (_a, mut to_a) = join(commands, 1, 1000).await;
    let (_b, mut to_b) = join(commands, 2, 1000).await;
    let offsets = |sent: &[Sending]| sent.iter().map(|s| s.offset).collect::<Vec<_>>();
    // Ten ready, two sessions: five consecutive each.
    let pull = |first, count, charge| {
        let batch = batch_of(first, count);
        commands.send(GroupCmd::Pulled { batch, charge }).unwrap();
    };
    pull(0, 10, budget.reserve(&label, 10, 10).await);
    let mut first = [
        next_deliveries(&mut to_a).await,
        next_deliveries(&mut to_b).await,
    ];
    first.sort_by_key(|sent| sent[0].offset);
    assert_eq!(offsets(&first[0]), [0, 1, 2, 3, 4]);
    assert_eq!(offsets(&first[1]), [5, 6, 7, 8, 9]);
    // More ready than two whole runs each: runs of `MAX_RUN` in turn, whoever starts.
    let max_run = super::sessions::MAX_RUN;
    let many = 3 * max_run as i64 + 44;
    pull(
        10,
        many,
        budget.reserve(&label, many as u32, many as u32).await,
    );
    // One pass hands out all of them (the credits reach).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut got = vec![Vec::new(), Vec::new()];
    for (session, outbound) in got.iter_mut().zip([&mut to_a, &mut to_b]) {
        while let Ok(message) = outbound.try_recv() {
            if let Outbound::Deliveries { batch, .. } = message {
                session.extend(batch.iter().map(|s| s.offset));
            }
        }
    }
    for session in &got {
        let runs: Vec<&[i64]> = session
            .chunk_by(|before, after| after == &(before + 1))
            .collect();
        assert!(
            runs.iter().all(|run| run.len() <= max_run),
            "runs of at most {max_run}: {runs:?}"
        );
        assert!(
            runs.iter().any(|run| run.len() == max_run),
            "whole runs: {runs:?}"
        );
    }
    let mut all: Vec<i64> = got.concat();
    all.sort_unstable();
    assert_eq!(
        all,
        (10..10 + many).collect::<Vec<_>>(),
        "each once, none lost"
    );
    group.shutdown.cancel();
}

/// One group shard (topic `race`, group `g`, partition 0 from its start) whose offset
/// store and puller are unreachable: an ACKed delivery stays in its offset write.
struct TestGroup {
    shutdown: CancellationToken,
    key: GroupKey,
    budget: Arc<TopicBudget>,
    commands: mpsc::UnboundedSender<GroupCmd>,
    gate: tokio::sync::watch::Receiver<PullGate>,
}

fn test_group(settings: DeliverySettings) -> TestGroup {
    let shutdown = CancellationToken::new();
    let (writer, _writer_task) = OffsetWriter::spawn(
        eventmesh_common::grpc::internal_endpoint(&nowhere_uri(), Duration::from_secs(5)).unwrap(),
        Duration::from_secs(5),
        Duration::from_millis(1),
        false,
        shutdown.clone(),
    )
    .unwrap();
    let (broker_acks, _acker_task) =
        BrokerAcker::spawn(nowhere(), Duration::from_millis(1), shutdown.clone());
    let shared = Shared::new(SharedParts {
        settings,
        instance_id: "test".into(),
        puller: nowhere(),
        offsets: nowhere(),
        writer,
        broker_acks,
        shutdown: shutdown.clone(),
        cluster: None,
        meter: Arc::default(),
    });
    let key = GroupKey {
        topic: Topic::new("race").unwrap(),
        group: Some(GroupName::new("g").unwrap()),
    };
    let budget = TopicBudget::new("race", 100, 1_000);
    budget.join(&key.label());
    let (commands, receiver) = mpsc::unbounded_channel();
    let (board, gate) = GateBoard::new(1);
    spawn(
        shared,
        GroupInit {
            key: key.clone(),
            number: 1,
            seeds: [(PartitionId::number(0), -1)].into(),
            lost: HashMap::new(),
            budget: Arc::clone(&budget),
            shard: ShardInit {
                index: 0,
                siblings: Arc::from([commands.clone()]),
                commands: receiver,
                gate: board,
            },
        },
    );
    TestGroup {
        shutdown,
        key,
        budget,
        commands,
        gate,
    }
}

/// Joins session `id` of client `app` with `credits`, its deliveries and answers on one
/// channel.
async fn join(
    commands: &mpsc::UnboundedSender<GroupCmd>,
    id: u64,
    credits: u32,
) -> (
    mpsc::UnboundedSender<Outbound>,
    mpsc::UnboundedReceiver<Outbound>,
) {
    let (out, outbound) = mpsc::unbounded_channel();
    let (reply, joined) = oneshot::channel();
    let session = SessionLink {
        id,
        client: ClientId::new("app").unwrap(),
        out: out.clone(),
        credits: Arc::new(Credits::new(credits)),
    };
    commands.send(GroupCmd::Join { session, reply }).unwrap();
    assert!(joined.await.unwrap());
    (out, outbound)
}

/// A batch whose pull started while the group had a session and that arrives after the
/// group began closing (here: closing, with an ACK whose offset write cannot finish yet)
/// used to be admitted. Its deliveries could never be delivered, so the closing group
/// never ended and refused every session of the group until a restart. Now it is not
/// admitted: its budget goes back and its records stay unsettled for the next reader.
#[tokio::test]
async fn a_closing_group_takes_no_batch() {
    let TestGroup {
        shutdown,
        key,
        budget,
        commands,
        mut gate,
    } = test_group(DeliverySettings {
        group_grace_ms: 10,
        ..DeliverySettings::default()
    });
    let (out, mut outbound) = join(&commands, 1, 10).await;
    let charge = budget.reserve(&key.label(), 1, 1).await;
    commands
        .send(GroupCmd::Pulled {
            batch: batch(0),
            charge,
        })
        .unwrap();
    let Some(Outbound::Deliveries {
        batch: mut sent, ..
    }) = outbound.recv().await
    else {
        panic!("a delivery");
    };
    let sending = sent.pop_front().unwrap();
    let seq = sending.id.seq;
    let message = sending.into_message(&key.topic);
    commands
        .send(GroupCmd::Written {
            seqs: vec![seq],
            session: 1,
            at: Instant::now(),
        })
        .unwrap();
    commands
        .send(GroupCmd::Settle {
            op: SettleOp::Ack,
            ids: vec![DeliveryId::parse(&message.delivery_id).unwrap()],
            client: ClientId::new("app").unwrap(),
            reply_to: out.clone(),
        })
        .unwrap();
    commands.send(GroupCmd::Leave { session: 1 }).unwrap();
    // Past the grace period the group closes, the ACK's write still pending.
    gate.wait_for(|g| *g == PullGate::Closed).await.unwrap();
    let late = budget.reserve(&key.label(), 1, 1).await;
    commands
        .send(GroupCmd::Pulled {
            batch: batch(1),
            charge: late,
        })
        .unwrap();
    let (reply, refused) = oneshot::channel();
    let session = SessionLink {
        id: 2,
        client: ClientId::new("app").unwrap(),
        out,
        credits: Arc::new(Credits::new(10)),
    };
    commands.send(GroupCmd::Join { session, reply }).unwrap();
    assert!(!refused.await.unwrap(), "a closing group takes no session");
    assert_eq!(
        budget.held_by(&key.label()).records,
        1,
        "only the ACKed delivery whose write is pending is held; the late batch is not"
    );
    shutdown.cancel();
}
