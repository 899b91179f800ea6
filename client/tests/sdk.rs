//! The SDK against a real local instance: failover to a restarted instance, keepalive noticing
//! a frozen (SIGSTOP) dispatcher, ACK outcomes, NACK, and clear errors for bad input and
//! unreachable endpoints.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use eventmesh_client::local::{LocalConfig, LocalInstance, Service};
use eventmesh_client::{
    AckOutcome, Client, ClientConfig, ClientError, Event, Publisher, PublisherOptions,
    StartPosition, SubscribeOptions, Subscription,
};
use support::*;

async fn instance(dir: &std::path::Path) -> LocalInstance {
    LocalInstance::start(LocalConfig::new(dir).args(
        Service::Dispatcher,
        ["--backoff-base-ms", "100", "--backoff-max-ms", "400"],
    ))
    .await
    .unwrap()
}

fn event(n: u64) -> Event {
    Event {
        id: event_id(n),
        source: "/sdk-test".into(),
        r#type: "sdk.test".into(),
        data: format!("{n}").into_bytes().into(),
        ..Event::default()
    }
}

async fn subscribe_earliest(client: &Client, topic: &str) -> Subscription {
    client
        .subscribe(
            SubscribeOptions::new(topic)
                .group("g")
                .start(StartPosition::Earliest),
        )
        .await
        .unwrap()
}

async fn publish_range(client: &Client, topic: &str, range: std::ops::Range<u64>) {
    for n in range {
        client.publish(topic, event(n)).await.unwrap();
    }
}

/// Subscribes from the earliest event and checks that exactly the `wanted` event ids are
/// delivered (each ACKed).
async fn assert_delivered(client: &Client, topic: &str, wanted: std::collections::HashSet<String>) {
    let mut subscription = subscribe_earliest(client, topic).await;
    let mut seen = std::collections::HashSet::new();
    consume_distinct(
        &mut subscription,
        &mut seen,
        wanted.len(),
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(seen, wanted);
}

/// Receives and ACKs until `wanted` distinct event ids were seen; returns the instance that
/// made the last delivery.
async fn consume_distinct(
    subscription: &mut Subscription,
    seen: &mut std::collections::HashSet<String>,
    wanted: usize,
    wait: Duration,
) -> Option<std::sync::Arc<str>> {
    let deadline = Instant::now() + wait;
    let mut last_instance = None;
    while seen.len() < wanted {
        let left = deadline.saturating_duration_since(Instant::now());
        let delivery = tokio::time::timeout(left, subscription.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {wanted} events within {wait:?}", seen.len()))
            .unwrap()
            .unwrap();
        last_instance = Some(std::sync::Arc::clone(&delivery.instance_id));
        seen.insert(delivery.event.id.clone());
        delivery.ack();
    }
    last_instance
}

#[tokio::test]
async fn fails_over_past_a_dead_seed_and_to_a_restarted_dispatcher() {
    let dir = tempfile::tempdir().unwrap();
    let mut instance = instance(dir.path()).await;
    // The first seed has nothing listening: the SDK moves on to the next.
    let client = Client::connect(
        ClientConfig::new("failover-app")
            .endpoint("http://127.0.0.1:1")
            .endpoint(instance.endpoint())
            .backoff(Duration::from_millis(50), Duration::from_millis(500))
            .retry_deadline(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let mut subscription = subscribe_earliest(&client, "failover").await;
    let first_instance = subscription.session().unwrap().instance_id;
    publish_range(&client, "failover", 0..300).await;
    let mut seen = std::collections::HashSet::new();
    let last_instance =
        consume_distinct(&mut subscription, &mut seen, 100, Duration::from_secs(30)).await;
    assert_eq!(last_instance.as_deref(), Some(first_instance.as_str()));

    instance.kill(Service::Dispatcher).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    instance
        .start_service(Service::Dispatcher, None)
        .await
        .unwrap();
    // Publishing goes on through the restarted instance, and the subscription resumes there.
    publish_range(&client, "failover", 300..400).await;
    let last_instance =
        consume_distinct(&mut subscription, &mut seen, 400, Duration::from_secs(60)).await;
    let stats = subscription.stats();
    assert!(stats.reconnects >= 1, "{stats:?}");
    let second_instance = subscription.session().unwrap().instance_id;
    assert_ne!(first_instance, second_instance);
    // Each delivery names the instance that made it, so its ACK can only settle there.
    assert_eq!(last_instance.as_deref(), Some(second_instance.as_str()));
    subscription.close().await;
    instance.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn a_frozen_dispatcher_is_noticed_by_keepalive_and_left() {
    let dir = tempfile::tempdir().unwrap();
    let mut instance = instance(dir.path()).await;
    let client = connect(&instance, "frozen-app").await;
    let mut subscription = subscribe_earliest(&client, "frozen").await;
    publish_range(&client, "frozen", 0..100).await;
    let mut seen = std::collections::HashSet::new();
    consume_distinct(&mut subscription, &mut seen, 50, Duration::from_secs(30)).await;

    // SIGSTOP: the socket stays open, nothing answers. Only keepalive can tell.
    instance.signal(Service::Dispatcher, "STOP").unwrap();
    let frozen_at = Instant::now();
    while subscription.stats().reconnects == 0 {
        assert!(
            frozen_at.elapsed() < Duration::from_secs(20),
            "a frozen dispatcher went unnoticed for 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let noticed_after = frozen_at.elapsed();
    eprintln!("frozen dispatcher noticed after {noticed_after:?}");

    // Replace the frozen instance; the subscription resumes and the rest arrives.
    instance.kill(Service::Dispatcher).await.unwrap();
    instance
        .start_service(Service::Dispatcher, None)
        .await
        .unwrap();
    consume_distinct(&mut subscription, &mut seen, 100, Duration::from_secs(60)).await;
    subscription.close().await;
    instance.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn ack_outcomes_nack_and_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let instance = instance(dir.path()).await;
    let client = connect(&instance, "outcomes-app").await;

    // Refusals come back at once, named, and are not retried.
    let started = Instant::now();
    let refused = client.publish("bad#topic", event(0)).await.unwrap_err();
    assert!(
        matches!(&refused, ClientError::Refused { status, .. } if status.code() == tonic::Code::InvalidArgument),
        "{refused}"
    );
    assert!(!refused.is_transient());
    let oversized = Event {
        data: vec![0u8; 8 * 1024 * 1024 + 1024].into(),
        ..event(1)
    };
    let refused = client.publish("outcomes", oversized).await.unwrap_err();
    assert!(
        matches!(&refused, ClientError::Refused { status, .. } if status.code() == tonic::Code::ResourceExhausted),
        "{refused}"
    );
    let refused = client
        .subscribe(SubscribeOptions::new("outcomes").group("bad group"))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, ClientError::Refused { status, .. } if status.code() == tonic::Code::InvalidArgument && status.message().contains("group")),
        "{refused}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "a refusal was retried"
    );

    // A publish without an id gets one from the SDK.
    let stored = client
        .publish(
            "outcomes",
            Event {
                id: String::new(),
                ..event(2)
            },
        )
        .await
        .unwrap();
    assert_eq!(stored.event_id.len(), 36);

    let mut subscription = subscribe_earliest(&client, "outcomes").await;
    let mut results = subscription.ack_results();
    let first = subscription.next().await.unwrap().unwrap();
    assert_eq!(first.attempt, 1);
    // NACK: the same event comes back as attempt 2 with the same delivery id.
    first.nack(Duration::from_millis(50));
    let again = tokio::time::timeout(Duration::from_secs(10), subscription.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((again.attempt, &again.id), (2, &first.id));
    assert_eq!(again.event.id, first.event.id);
    assert_eq!(again.ack_and_wait().await.unwrap(), AckOutcome::Durable);
    assert_eq!(
        again.ack_and_wait().await.unwrap(),
        AckOutcome::AlreadySettled
    );
    let mut outcomes = Vec::new();
    while outcomes.len() < 3 {
        outcomes.push(results.recv().await.unwrap().outcome);
    }
    assert_eq!(
        outcomes,
        [
            AckOutcome::Nacked,
            AckOutcome::Durable,
            AckOutcome::AlreadySettled
        ]
    );
    let stats = subscription.stats();
    assert_eq!(
        (stats.durable, stats.no_op, stats.redelivered),
        (1, 1, 1),
        "{stats:?}"
    );
    subscription.close().await;
    instance.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn no_reachable_endpoint_is_a_clear_error_after_the_deadline() {
    let started = Instant::now();
    let error = Client::connect(
        ClientConfig::new("lonely")
            .endpoint("http://127.0.0.1:1")
            .backoff(Duration::from_millis(50), Duration::from_millis(200))
            .retry_deadline(Duration::from_secs(1)),
    )
    .await
    .unwrap_err();
    assert!(matches!(error, ClientError::Unreachable { .. }), "{error}");
    assert!(error.to_string().contains("127.0.0.1:1"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let error = Client::connect(ClientConfig::new("")).await.unwrap_err();
    assert!(matches!(error, ClientError::Config(_)), "{error}");
}

/// A batch answers each event on its own (a refused one names its entry, the others are
/// stored), a bad topic refuses the whole batch, and a [`Publisher`] with thousands of events in
/// flight stores each once — every one delivered — and keeps a key's order when one batch is in
/// flight at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_publish_answers_each_event_and_a_publisher_pipelines() {
    let dir = tempfile::tempdir().unwrap();
    let instance = instance(dir.path()).await;
    let client = connect(&instance, "batcher").await;
    let topic = "batched";

    let mut reserved = event(1);
    reserved.attributes.insert("emx".into(), "1".into());
    let mut no_id = event(3);
    no_id.id.clear();
    let results = client
        .publish_batch(
            topic,
            vec![
                (String::new(), event(0)),
                (String::new(), reserved),
                ("k".into(), event(2)),
                (String::new(), no_id),
            ],
        )
        .await
        .unwrap();
    assert_eq!(results.len(), 4);
    assert_eq!(results[0].as_ref().unwrap().event_id, event_id(0));
    match &results[1] {
        Err(ClientError::Refused { status, .. }) => {
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            assert!(status.message().contains("entries[1]"), "{status:?}");
        }
        other => panic!("a reserved attribute is refused: {other:?}"),
    }
    assert_eq!(results[2].as_ref().unwrap().event_id, event_id(2));
    let generated = results[3].as_ref().unwrap().event_id.clone();
    assert!(!generated.is_empty());

    let error = client
        .publish_batch("bad#topic", vec![(String::new(), event(9))])
        .await
        .unwrap_err();
    assert!(!error.is_transient(), "{error}");
    assert!(error.to_string().contains("topic"), "{error}");

    // Thousands in flight through one publisher: each stored once, at its own offset.
    let publisher = Publisher::new(client.clone(), topic, PublisherOptions::default());
    let mut pending = Vec::new();
    for n in 100..5_100 {
        pending.push(publisher.submit("", event(n)).await.unwrap());
    }
    let mut stored = std::collections::HashSet::new();
    for answer in pending {
        let published = answer.wait().await.unwrap();
        assert!(stored.insert((published.partition, published.offset)));
    }
    assert_eq!(stored.len(), 5_000);

    let mut subscription = subscribe_earliest(&client, topic).await;
    let mut seen = std::collections::HashSet::new();
    consume_distinct(&mut subscription, &mut seen, 5_003, Duration::from_secs(60)).await;
    for n in [0, 2].into_iter().chain(100..5_100) {
        assert!(seen.contains(&event_id(n)), "event {n} delivered");
    }
    assert!(seen.contains(&generated));
    assert!(
        !seen.contains(&event_id(1)),
        "the refused event was not stored"
    );

    // One batch in flight at a time: a key's events keep their submit order.
    let ordered = Publisher::new(
        client.clone(),
        topic,
        PublisherOptions {
            max_batch_events: 3,
            max_in_flight_batches: 1,
            ..PublisherOptions::default()
        },
    );
    let mut pending = Vec::new();
    for n in 10_000..10_020 {
        pending.push(ordered.submit("order", event(n)).await.unwrap());
    }
    let mut offsets = Vec::new();
    for answer in pending {
        let published = answer.wait().await.unwrap();
        offsets.push((published.partition, published.offset));
    }
    assert!(
        offsets
            .windows(2)
            .all(|w| w[0].0 == w[1].0 && w[0].1 < w[1].1),
        "{offsets:?}"
    );
}

/// A batch entry the generated message would refuse (a key or an event text that is not UTF-8)
/// is refused alone, naming its entry: the dispatcher reads each entry in place, so the
/// batch's other events are stored and delivered. Sent as raw entries, as no SDK could.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_entry_is_refused_alone_and_the_rest_of_its_batch_is_stored() {
    use eventmesh_proto::client as pb;
    use eventmesh_proto::encoded::PublishBatchRequestIn;
    use prost::Message as _;
    use prost::encoding::bytes::encode as put_bytes;

    let dir = tempfile::tempdir().unwrap();
    let instance = instance(dir.path()).await;
    let topic = "malformed-entries";
    let good = |n: u64| {
        pb::PublishEntry {
            event: Some(event(n)),
            key: String::new(),
        }
        .encode_to_vec()
    };
    // Entry 1: a good event, then a key that is not UTF-8 (PublishEntry.key = 2).
    let mut bad_key = good(1);
    put_bytes(2, &vec![0xffu8, 0xfe], &mut bad_key);
    // Entry 2: an event (PublishEntry.event = 1) whose source (Event.source = 2) is not UTF-8.
    let mut bad_source = Vec::new();
    put_bytes(2, &vec![0xc3u8, 0x28], &mut bad_source);
    let mut bad_event = Vec::new();
    put_bytes(1, &bad_source, &mut bad_event);
    let request = PublishBatchRequestIn {
        topic: topic.into(),
        entries: vec![
            good(0).into(),
            bad_key.into(),
            bad_event.into(),
            good(3).into(),
        ],
    };
    assert!(
        pb::PublishBatchRequest::decode(request.encode_to_vec().as_slice()).is_err(),
        "the generated message refuses the batch whole"
    );
    let channel = tonic::transport::Endpoint::from_shared(instance.endpoint())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let answer = grpc
        .unary(
            tonic::Request::new(request),
            tonic::codegen::http::uri::PathAndQuery::from_static(
                "/eventmesh.v1.EventMeshService/PublishBatch",
            ),
            tonic_prost::ProstCodec::<PublishBatchRequestIn, pb::PublishBatchResponse>::default(),
        )
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.outcomes.len(), 4);
    for (i, outcome) in answer.outcomes.iter().enumerate() {
        match (&outcome.outcome, i) {
            (Some(pb::publish_outcome::Outcome::Stored(stored)), 0 | 3) => {
                assert_eq!(stored.event_id, event_id(i as u64));
            }
            (Some(pb::publish_outcome::Outcome::Error(refused)), 1 | 2) => {
                assert_eq!(refused.code, tonic::Code::InvalidArgument as i32);
                assert!(
                    refused.message.contains(&format!("entries[{i}]")),
                    "{refused:?}"
                );
                assert!(refused.message.contains("UTF-8"), "{refused:?}");
            }
            other => panic!("entry {i}: {other:?}"),
        }
    }

    let client = connect(&instance, "malformed").await;
    client.publish(topic, event(99)).await.unwrap();
    // The refused entries left nothing behind.
    assert_delivered(
        &client,
        topic,
        [0, 3, 99].into_iter().map(event_id).collect(),
    )
    .await;
}

/// The dispatcher takes a client batch up to its 17 MiB message limit and every event of it is
/// stored and delivered (the puller's own limit leaves room for the runtime's stamps); a batch
/// past the limit is refused whole with a status that says so, and nothing of it is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_at_the_message_limit_is_stored_and_one_past_it_is_refused_whole() {
    use eventmesh_proto::client as pb;
    use eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient;

    let dir = tempfile::tempdir().unwrap();
    let instance = instance(dir.path()).await;
    let mut raw = EventMeshServiceClient::connect(instance.endpoint())
        .await
        .unwrap()
        .max_encoding_message_size(64 << 20)
        .max_decoding_message_size(64 << 20);
    let topic = "at-the-limit";
    let batch = |numbers: std::ops::Range<u64>| pb::PublishBatchRequest {
        topic: topic.into(),
        entries: numbers
            .map(|n| pb::PublishEntry {
                event: Some(Event {
                    data: vec![b'x'; 4 << 20].into(),
                    ..event(n)
                }),
                key: String::new(),
            })
            .collect(),
    };
    // Four events of 4 MiB: just under 17 MiB with the request's framing.
    let at_limit = batch(0..4);
    assert!(prost::Message::encoded_len(&at_limit) < 17 << 20);
    let answer = raw.publish_batch(at_limit).await.unwrap().into_inner();
    assert_eq!(answer.outcomes.len(), 4);
    for outcome in &answer.outcomes {
        assert!(
            matches!(
                outcome.outcome,
                Some(pb::publish_outcome::Outcome::Stored(_))
            ),
            "{outcome:?}"
        );
    }
    // Five: past the limit, refused before anything is read.
    let status = raw.publish_batch(batch(10..15)).await.unwrap_err();
    assert!(
        matches!(
            status.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{status:?}"
    );
    assert!(status.message().contains("too large"), "{status:?}");

    let client = connect(&instance, "limits").await;
    client.publish(topic, event(99)).await.unwrap();
    // The refused batch left nothing behind.
    let expected = [0, 1, 2, 3, 99].into_iter().map(event_id).collect();
    assert_delivered(&client, topic, expected).await;
}

/// A Publisher holds at most `max_in_flight_batches × max_batch_bytes` of events: with the
/// dispatcher frozen (SIGSTOP) `submit` waits once that much is held, so memory stays bounded
/// whatever the server does; thawed, every accepted event is stored and delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_holds_a_bounded_number_of_bytes_while_the_server_is_frozen() {
    let dir = tempfile::tempdir().unwrap();
    let instance = instance(dir.path()).await;
    let client = connect(&instance, "bounded").await;
    let topic = "bounded";
    let publisher = Publisher::new(
        client.clone(),
        topic,
        PublisherOptions {
            max_batch_events: 512,
            max_batch_bytes: 64 << 10,
            max_in_flight_batches: 2,
            ..PublisherOptions::default()
        },
    );
    publisher.publish("", event(0)).await.unwrap();
    instance.signal(Service::Dispatcher, "STOP").unwrap();
    let mut pending = Vec::new();
    let mut blocked = false;
    for n in 1..=40 {
        let heavy = Event {
            data: vec![b'y'; 16 << 10].into(),
            ..event(n)
        };
        match tokio::time::timeout(Duration::from_millis(300), publisher.submit("", heavy)).await {
            Ok(submitted) => pending.push((n, submitted.unwrap())),
            Err(_) => {
                blocked = true;
                break;
            }
        }
    }
    instance.signal(Service::Dispatcher, "CONT").unwrap();
    // 2 × 64 KiB of room, events of a little over 16 KiB: at most 7 are held.
    assert!(blocked, "submit kept accepting while nothing was answered");
    assert!((1..=7).contains(&pending.len()), "{} held", pending.len());
    let mut wanted = std::collections::HashSet::from([event_id(0)]);
    for (n, answer) in pending {
        answer.wait().await.unwrap();
        wanted.insert(event_id(n));
    }
    assert_delivered(&client, topic, wanted).await;
}

/// While a batch is in flight, a Publisher gathers what is submitted into the next batch until
/// that one is answered (or the next is full, or `max_linger` passed) instead of sending it as
/// several small batches; with nothing in flight, a lone event goes at once. The dispatcher is
/// frozen (SIGSTOP) so that each publisher's first batch stays in flight while more events are
/// submitted: the patient one holds them all, the hasty one sends them after its linger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_gathers_events_while_a_batch_is_in_flight() {
    use eventmesh_client::PublisherStats;

    let dir = tempfile::tempdir().unwrap();
    let instance = instance(dir.path()).await;
    let client = connect(&instance, "gatherer").await;
    let topic = "gathered";
    let with_linger = |max_linger| {
        Publisher::new(
            client.clone(),
            topic,
            PublisherOptions {
                max_linger,
                ..PublisherOptions::default()
            },
        )
    };
    let patient = with_linger(Duration::from_secs(600));
    let hasty = with_linger(Duration::from_millis(50));
    // Alone, with nothing in flight: sent at once, one batch.
    patient.publish("", event(0)).await.unwrap();
    let stats = |batches, events| PublisherStats { batches, events };
    assert_eq!(patient.stats(), stats(1, 1));
    instance.signal(Service::Dispatcher, "STOP").unwrap();
    let mut pending = Vec::new();
    // Each publisher's first event goes at once and stays in flight.
    for (publisher, n) in [(&patient, 1), (&hasty, 1_001)] {
        pending.push((n, publisher.submit("", event(n)).await.unwrap()));
        let sent = tokio::time::Instant::now() + Duration::from_secs(5);
        while publisher.stats().events < if n == 1 { 2 } else { 1 } {
            assert!(tokio::time::Instant::now() < sent, "event {n} never sent");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    for n in (2..=101).chain(1_002..=1_101) {
        let publisher = if n < 1_000 { &patient } else { &hasty };
        pending.push((n, publisher.submit("", event(n)).await.unwrap()));
    }
    // Up to seven more batches could be in flight; the patient publisher's hundred wait for
    // its first batch's answer, the hasty one's go after 50 ms.
    let lingered = tokio::time::Instant::now() + Duration::from_secs(5);
    while hasty.stats().events < 101 {
        assert!(
            tokio::time::Instant::now() < lingered,
            "{:?}",
            hasty.stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = patient.stats();
    instance.signal(Service::Dispatcher, "CONT").unwrap();
    assert_eq!(
        held,
        stats(2, 2),
        "nothing more sent while a batch is in flight and the next is not full"
    );
    let mut wanted: std::collections::HashSet<String> = [event_id(0)].into();
    for (n, answer) in pending {
        answer.wait().await.unwrap();
        wanted.insert(event_id(n));
    }
    assert_eq!(
        patient.stats(),
        stats(3, 102),
        "the hundred went as one batch once the first was answered"
    );
    assert_delivered(&client, topic, wanted).await;
}

/// An application that takes one delivery at a time and waits for its ACK's answer before the
/// next, under a small in-flight limit: every answer comes, although the rest of the server's
/// message is still waiting to be taken when the ACK frees a credit and the server sends the
/// next delivery (the SDK makes room for it as each delivery is taken, so it reads on to the
/// answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_delivery_at_a_time_with_ack_and_wait_under_a_small_in_flight_limit() {
    let dir = tempfile::tempdir().unwrap();
    let instance = instance(dir.path()).await;
    let client = connect(&instance, "stepwise-app").await;
    publish_range(&client, "stepwise", 0..40).await;
    let mut subscription = client
        .subscribe(
            SubscribeOptions::new("stepwise")
                .group("g")
                .start(StartPosition::Earliest)
                .max_in_flight(4),
        )
        .await
        .unwrap();
    let mut seen = std::collections::HashSet::new();
    while seen.len() < 40 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), subscription.next())
            .await
            .expect("a delivery within 10 s")
            .unwrap()
            .unwrap();
        let outcome = tokio::time::timeout(Duration::from_secs(10), delivery.ack_and_wait())
            .await
            .expect("the ACK's answer within 10 s")
            .unwrap();
        assert_eq!(outcome, AckOutcome::Durable);
        seen.insert(delivery.event.id.clone());
    }
}

/// The SDK's connections advertise large HTTP/2 frames, so a batch of deliveries reaches it in
/// a few writes, not one per 16 KiB (the protocol's default frame).
#[tokio::test]
async fn the_sdk_advertises_large_frames() {
    use eventmesh_testkit::http2::{self, SETTINGS_MAX_FRAME_SIZE};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let uri = format!("http://{}", listener.local_addr().unwrap());
    let accepted = tokio::task::spawn_blocking(move || http2::accept_client_settings(&listener));
    // Nothing answers the handshake: the connect is left once its settings are read.
    let connecting = tokio::spawn(Client::connect(ClientConfig::new("frames").endpoint(uri)));
    let settings = accepted.await.unwrap().unwrap();
    connecting.abort();
    assert_eq!(
        http2::setting(&settings, SETTINGS_MAX_FRAME_SIZE),
        Some(eventmesh_client::HTTP2_MAX_FRAME_SIZE),
        "{settings:?}"
    );
}
