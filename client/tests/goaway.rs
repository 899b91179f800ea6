//! A draining instance's HTTP/2 GOAWAY refuses a call the SDK had just sent: the SDK retries it
//! (RFC 9113 §6.8: a stream above the GOAWAY's last stream id was not processed).
//!
//! hyper's graceful shutdown — what every service does when it stops — sends GOAWAY with the
//! highest stream id, then, one round trip later, with the last stream it took. A call the
//! client opened in between fails with GOAWAY NO_ERROR, which tonic reports as INTERNAL
//! "h2 protocol error". The race is rare against a real server (a rolling-restart test met it
//! once in many runs), so this test plays the server itself: a few HTTP/2 frames over TCP that
//! answer Recommend and refuse the first publish with exactly that GOAWAY.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use eventmesh_client::{Client, ClientConfig, Event};
use eventmesh_proto::client as pb;
use prost::Message as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const CLIENT_ID: &str = "goaway-client";
const TOPIC: &str = "goaway-topic";

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

/// What the fake instance saw.
#[derive(Default)]
struct Seen {
    publishes: AtomicUsize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_refused_by_a_draining_servers_goaway_is_retried() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let server = tokio::spawn({
        let seen = seen.clone();
        async move {
            loop {
                let (socket, _) = listener.accept().await.unwrap();
                tokio::spawn(serve_connection(socket, seen.clone()));
            }
        }
    });

    let client = Client::connect(
        ClientConfig::new(CLIENT_ID)
            .endpoint(format!("http://{address}"))
            .backoff(Duration::from_millis(20), Duration::from_millis(100))
            .retry_deadline(Duration::from_secs(10)),
    )
    .await
    .unwrap();
    let event = Event {
        id: "goaway-1".into(),
        source: "/goaway".into(),
        r#type: "goaway.test".into(),
        ..Event::default()
    };
    let published = tokio::time::timeout(Duration::from_secs(20), client.publish(TOPIC, event))
        .await
        .expect("the publish ends")
        .expect("the publish refused by GOAWAY is retried and stored");
    assert_eq!(published.event_id, "goaway-1");
    assert_eq!(published.offset, 7);
    assert_eq!(
        seen.publishes.load(Ordering::SeqCst),
        2,
        "refused once, stored on the retry"
    );
    server.abort();
}

/// One HTTP/2 connection: answers Recommend; the first publish of the whole test gets a
/// GOAWAY whose last stream id is below it (NO_ERROR, as a draining server sends) and the
/// connection closes; later publishes are stored.
async fn serve_connection(mut socket: TcpStream, seen: Arc<Seen>) {
    let mut preface = [0u8; 24];
    if socket.read_exact(&mut preface).await.is_err() {
        return;
    }
    assert_eq!(&preface, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    write_frame(&mut socket, SETTINGS, 0, 0, &[]).await;
    let mut bodies: std::collections::HashMap<u32, Vec<u8>> = Default::default();
    let mut last_answered = 0;
    while let Some((kind, flags, stream, payload)) = read_frame(&mut socket).await {
        match kind {
            SETTINGS if flags & ACK == 0 => write_frame(&mut socket, SETTINGS, ACK, 0, &[]).await,
            PING if flags & ACK == 0 => write_frame(&mut socket, PING, ACK, 0, &payload).await,
            HEADERS => {
                bodies.entry(stream).or_default();
            }
            DATA => {
                let body = bodies.entry(stream).or_default();
                body.extend_from_slice(&payload);
                if flags & END_STREAM == 0 {
                    continue;
                }
                let message = body.get(5..).unwrap_or_default().to_vec();
                if let Ok(request) = pb::RecommendRequest::decode(&message[..])
                    && request.client_id == CLIENT_ID
                {
                    let answer = pb::RecommendResponse {
                        address: String::new(),
                        instance_id: "fake".into(),
                    };
                    answer_grpc(&mut socket, stream, &answer.encode_to_vec()).await;
                    last_answered = stream;
                    continue;
                }
                let request = pb::PublishRequest::decode(&message[..]).unwrap();
                assert_eq!(request.topic, TOPIC);
                if seen.publishes.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The draining server's second GOAWAY: this stream was not taken.
                    let mut goaway = Vec::with_capacity(8);
                    goaway.extend_from_slice(&last_answered.to_be_bytes());
                    goaway.extend_from_slice(&0u32.to_be_bytes());
                    write_frame(&mut socket, GOAWAY, 0, 0, &goaway).await;
                    let _ = socket.shutdown().await;
                    return;
                }
                let answer = pb::PublishResponse {
                    partition: "0".into(),
                    offset: 7,
                    event_id: request.event.unwrap().id,
                };
                answer_grpc(&mut socket, stream, &answer.encode_to_vec()).await;
                last_answered = stream;
            }
            _ => {}
        }
    }
}

/// A gRPC answer: `:status 200` and `content-type: application/grpc` (HPACK without
/// indexing or Huffman), the length-prefixed message, and `grpc-status: 0` trailers.
async fn answer_grpc(socket: &mut TcpStream, stream: u32, message: &[u8]) {
    let mut headers = vec![0x88, 0x0f, 0x10, 16];
    headers.extend_from_slice(b"application/grpc");
    write_frame(socket, HEADERS, END_HEADERS, stream, &headers).await;
    let mut data = vec![0];
    data.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    data.extend_from_slice(message);
    write_frame(socket, DATA, 0, stream, &data).await;
    let mut trailers = vec![0x00, 11];
    trailers.extend_from_slice(b"grpc-status");
    trailers.extend_from_slice(&[1, b'0']);
    write_frame(socket, HEADERS, END_HEADERS | END_STREAM, stream, &trailers).await;
}

async fn write_frame(socket: &mut TcpStream, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let length = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut frame = vec![length[1], length[2], length[3], kind, flags];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    let _ = socket.write_all(&frame).await;
}

/// The next frame (type, flags, stream id, payload), or `None` when the client closed.
async fn read_frame(socket: &mut TcpStream) -> Option<(u8, u8, u32, Vec<u8>)> {
    let mut header = [0u8; 9];
    socket.read_exact(&mut header).await.ok()?;
    let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
    let mut payload = vec![0; length];
    socket.read_exact(&mut payload).await.ok()?;
    Some((header[3], header[4], stream, payload))
}
