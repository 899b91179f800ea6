//! The real puller-svc binary on the local backend, next to a real offset-svc: `kill -9`
//! during a stream of publishes loses no acknowledged record; after the restart a group with a
//! watermark resumes at watermark + 1 on its first poll (un-ACKed offsets above it come back),
//! a group without one resumes from its checkpoint, and a dispatcher attach realigns again.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use eventmesh_common::frame::{Frame, FrameLimits};
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{OffsetEntry, OffsetKey, WriteOffsetsRequest};
use eventmesh_proto::puller::{self as pb};
use support::binary::Puller;

fn event(id: u64) -> Bytes {
    let mut frame = Frame::event();
    frame.set_attribute("id", id.to_string());
    frame.encode(&FrameLimits::DEFAULT).unwrap()
}

fn reader(group: &str) -> pb::GroupTopic {
    pb::GroupTopic {
        group: group.into(),
        topic: "crash".into(),
    }
}

/// Pulls from a group's reader, attaching it first (which aligns it to its watermark, as a
/// dispatcher's first attach does) when this process has not seen it yet.
async fn pull_ids(puller: &mut Puller, group: &str, max: u32) -> Vec<u64> {
    if !puller.generations.contains_key(group) {
        let generation = support::attach(&mut puller.client, "test", reader(group)).await;
        puller.generations.insert(group.to_owned(), generation);
    }
    let response = puller
        .client
        .pull(pb::PullRequest {
            reader: Some(reader(group)),
            max_records: max,
            generation: puller.generations[group],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    response
        .records
        .iter()
        .map(|r| {
            let frame = Frame::decode(&r.frame, &FrameLimits::DEFAULT).unwrap();
            frame.attribute("id").unwrap().parse().unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_minus_nine_loses_no_acknowledged_publish_and_cursors_resume() {
    let (offsets, offset_channel) = support::memory_offset_svc().await;
    let offset_url = format!("http://{}", offsets.local_addr());
    let dir = tempfile::tempdir().unwrap();
    let mut puller = Puller::start(dir.path(), &offset_url, &[]).await;
    puller
        .client
        .create_topic(pb::CreateTopicRequest {
            topic: "crash".into(),
            partitions: 1,
            implicit: false,
        })
        .await
        .unwrap();
    // One reader reads 40 records before the crash; its cursor is checkpointed.
    let acked: Arc<Mutex<BTreeSet<u64>>> = Arc::default();
    let mut writers = Vec::new();
    for w in 0..3u64 {
        let (mut client, acked) = (puller.client.clone(), Arc::clone(&acked));
        writers.push(tokio::spawn(async move {
            for i in 0.. {
                let id = w * 1_000_000 + i;
                let request = pb::PublishRequest {
                    topic: "crash".into(),
                    body: event(id),
                    ..Default::default()
                };
                match client.publish(request).await {
                    Ok(_) => acked.lock().unwrap().insert(id),
                    Err(_) => return,
                };
            }
        }));
    }
    while acked.lock().unwrap().len() < 300 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let first = pull_ids(&mut puller, "g", 40).await;
    assert_eq!(first.len(), 40);
    let other = pull_ids(&mut puller, "h", 10).await;
    assert_eq!(other, first[..10].to_vec());
    for checkpoint in [
        "local-pull-offsets@g.properties",
        "local-pull-offsets@h.properties",
    ] {
        let path = dir.path().join(checkpoint);
        let expected = if checkpoint.contains("@g") {
            "crash\\#0=40"
        } else {
            "crash\\#0=10"
        };
        for _ in 0..100 {
            if std::fs::read_to_string(&path).is_ok_and(|t| t.contains(expected)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            std::fs::read_to_string(&path).unwrap().contains(expected),
            "{checkpoint}"
        );
    }
    // The dispatcher of group g settled offsets up to 19 only (ACKs out of order above it).
    OffsetServiceClient::new(offset_channel.clone())
        .write_offsets(WriteOffsetsRequest {
            entries: vec![OffsetEntry {
                key: Some(OffsetKey {
                    topic: "crash".into(),
                    client_id: "__mqcursor@g__".into(),
                    partition: "0".into(),
                }),
                offset: 19,
            }],
            sync: false,
        })
        .await
        .unwrap();
    puller.kill9();
    for writer in writers {
        writer.await.unwrap();
    }
    let acked = acked.lock().unwrap().clone();

    let mut puller = Puller::start(dir.path(), &offset_url, &[]).await;
    // Every acknowledged publish is there (read by a fresh group from the start).
    let mut all = BTreeSet::new();
    loop {
        let batch = pull_ids(&mut puller, "audit", 1_000).await;
        if batch.is_empty() {
            break;
        }
        all.extend(batch);
    }
    let missing: Vec<_> = acked.difference(&all).collect();
    assert!(
        missing.is_empty(),
        "{} acknowledged publishes lost, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    // Group g: its first poll after the restart is aligned to the watermark: 20..39 again.
    assert_eq!(pull_ids(&mut puller, "g", 20).await, first[20..40].to_vec());
    // Group h had no watermark: nothing of it is settled, so it starts over at the configured
    // start (earliest), not at its checkpoint (which may be past un-ACKed records).
    assert_eq!(pull_ids(&mut puller, "h", 5).await, first[0..5].to_vec());
    // A dispatcher re-attach realigns g again, without a restart.
    let attached = puller
        .client
        .attach(pb::AttachRequest {
            dispatcher_id: "d".into(),
            readers: vec![reader("g")],
            positions: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(attached.cursors[0].next_offset, 20);
    drop(puller);
    offsets.shutdown();
    offsets.wait().await.unwrap();
}
