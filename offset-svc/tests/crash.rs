//! Crash test of the real binary: start offset-svc, write batches over gRPC from several
//! clients, `kill -9` it while writes are in flight, start it again on the same directory, and
//! check that every write it acknowledged is there (and nothing higher than was ever sent).
//! Three rounds on one directory, so recovery also runs over recovered data.

#![allow(clippy::unwrap_used)] // tests and benches: a failed unwrap is a failed run

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{
    OffsetEntry, OffsetKey, ReadTopicOffsetsRequest, WriteOffsetsRequest,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Kills the child on drop, so a failing assertion leaves no process behind.
struct Service {
    child: Child,
    addr: String,
}

impl Service {
    fn start(data_dir: &Path) -> Service {
        Self::start_with_metrics(data_dir, "127.0.0.1:0")
    }

    fn start_with_metrics(data_dir: &Path, metrics_listen: &str) -> Service {
        let mut child = Command::new(env!("CARGO_BIN_EXE_offset-svc"))
            .args([
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                metrics_listen,
                "--data-dir",
            ])
            .arg(data_dir)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn offset-svc");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the listening line");
        let addr = line
            .trim()
            .strip_prefix("offset-svc listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        Service { child, addr }
    }

    fn kill9(&mut self) {
        // Child::kill sends SIGKILL on Unix.
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const CLIENTS: usize = 4;
const PARTITIONS: u32 = 50;

fn key(client: usize, partition: u32) -> OffsetKey {
    OffsetKey {
        topic: "crash".into(),
        client_id: format!("client-{client}"),
        partition: partition.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_writes_survive_kill_minus_nine() {
    let dir = tempfile::tempdir().unwrap();
    // Highest acknowledged and highest attempted value per (client, partition).
    let acked: Arc<Mutex<HashMap<(usize, u32), i64>>> = Arc::default();
    let attempted: Arc<Mutex<HashMap<(usize, u32), i64>>> = Arc::default();
    let mut total_acked_batches = 0usize;

    for round in 0..3u64 {
        let mut service = Service::start(dir.path());
        let url = format!("http://{}", service.addr);

        // Everything acknowledged in earlier rounds must have survived.
        let mut reader = OffsetServiceClient::connect(url.clone()).await.unwrap();
        verify(&mut reader, &acked, &attempted).await;

        let mut writers = Vec::new();
        for client in 0..CLIENTS {
            let (url, acked, attempted) = (url.clone(), Arc::clone(&acked), Arc::clone(&attempted));
            writers.push(tokio::spawn(async move {
                let mut rpc = OffsetServiceClient::connect(url).await.unwrap();
                let mut rng = StdRng::seed_from_u64(round * 100 + client as u64);
                let mut batches = 0usize;
                let mut next = (round as i64) * 1_000_000;
                loop {
                    let entries: Vec<(u32, i64)> = (0..rng.random_range(1..64))
                        .map(|_| {
                            next += rng.random_range(1..10);
                            (rng.random_range(0..PARTITIONS), next)
                        })
                        .collect();
                    {
                        let mut attempted = attempted.lock().unwrap();
                        for (p, v) in &entries {
                            let slot = attempted.entry((client, *p)).or_insert(-1);
                            *slot = (*slot).max(*v);
                        }
                    }
                    let request = WriteOffsetsRequest {
                        entries: entries
                            .iter()
                            .map(|(p, v)| OffsetEntry {
                                key: Some(key(client, *p)),
                                offset: *v,
                            })
                            .collect(),
                        sync: false,
                    };
                    match rpc.write_offsets(request).await {
                        Ok(_) => {
                            let mut acked = acked.lock().unwrap();
                            for (p, v) in &entries {
                                let slot = acked.entry((client, *p)).or_insert(-1);
                                *slot = (*slot).max(*v);
                            }
                            batches += 1;
                        }
                        // The process died under us: stop writing.
                        Err(_) => return batches,
                    }
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(400 + round * 150)).await;
        service.kill9();
        for writer in writers {
            total_acked_batches += writer.await.unwrap();
        }
    }
    assert!(
        total_acked_batches > 100,
        "the writers made progress: {total_acked_batches} batches"
    );

    let service = Service::start(dir.path());
    let mut reader = OffsetServiceClient::connect(format!("http://{}", service.addr))
        .await
        .unwrap();
    verify(&mut reader, &acked, &attempted).await;
}

#[tokio::test]
async fn the_binary_serves_prometheus_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics_addr = format!("127.0.0.1:{port}");
    let service = Service::start_with_metrics(dir.path(), &metrics_addr);
    let mut rpc = OffsetServiceClient::connect(format!("http://{}", service.addr))
        .await
        .unwrap();
    rpc.write_offsets(WriteOffsetsRequest {
        entries: vec![OffsetEntry {
            key: Some(key(0, 0)),
            offset: 5,
        }],
        sync: true,
    })
    .await
    .unwrap();
    let body = http_get(&metrics_addr, "/metrics");
    for expected in [
        "eventmesh_offset_write_batches_total{result=\"ok\"} 1",
        "eventmesh_offset_write_entries_total 1",
        "eventmesh_offset_keys 1",
        "eventmesh_offset_write_batch_seconds_bucket",
    ] {
        assert!(body.contains(expected), "missing {expected:?} in:\n{body}");
    }
}

/// A plain HTTP/1.0 GET, enough for the exporter (which binds in the background at start:
/// retry the connection for a few seconds).
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut attempts = 0;
    let mut stream = loop {
        match std::net::TcpStream::connect(addr) {
            Ok(stream) => break stream,
            Err(err) if attempts < 50 => {
                attempts += 1;
                eprintln!("metrics endpoint not up yet: {err}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(err) => panic!("metrics endpoint {addr} never came up: {err}"),
        }
    };
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(
        response.starts_with("HTTP/1.0 200") || response.starts_with("HTTP/1.1 200"),
        "{response}"
    );
    response
}

async fn verify(
    reader: &mut OffsetServiceClient<tonic::transport::Channel>,
    acked: &Mutex<HashMap<(usize, u32), i64>>,
    attempted: &Mutex<HashMap<(usize, u32), i64>>,
) {
    let stored: HashMap<(String, String), i64> = reader
        .read_topic_offsets(ReadTopicOffsetsRequest {
            topic: "crash".into(),
            client_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .map(|e| {
            let k = e.key.unwrap();
            ((k.client_id, k.partition), e.offset)
        })
        .collect();
    let acked = acked.lock().unwrap().clone();
    let attempted = attempted.lock().unwrap().clone();
    for ((client, partition), value) in &acked {
        let k = key(*client, *partition);
        let got = stored
            .get(&(k.client_id.clone(), k.partition.clone()))
            .copied()
            .unwrap_or(-1);
        assert!(
            got >= *value,
            "{k:?}: acknowledged {value}, found {got} after kill -9"
        );
    }
    for ((client_id, partition), got) in &stored {
        let client: usize = client_id.trim_start_matches("client-").parse().unwrap();
        let limit = attempted
            .get(&(client, partition.parse().unwrap()))
            .copied()
            .unwrap_or(-1);
        assert!(
            *got <= limit,
            "{client_id}/{partition}: found {got}, never sent more than {limit}"
        );
    }
}
