//! Where an ACK's time goes at half load: `emctl bench` with `EM_PROBE_DIR` set, driving
//! services built with the feature `latency-probes`.
//!
//! The dispatcher marks sampled deliveries (every 128th sequence number of a group) as they
//! pass each stage on the way to DURABLE, into `<EM_PROBE_DIR>/<binary>-<pid>.probes` (lines
//! `<stage> <sequence> <unix ns>`; `eventmesh_common::probe` writes them). The bench marks
//! the same deliveries at the client: when `ack()` was called and when the DURABLE answer
//! reached the application. Joined by sequence number within the half load's time window,
//! consecutive marks give each stage's share. Wall-clock times: every process is on this
//! machine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;

/// The directory the services write their marks to (the environment variable they read).
pub const DIR_ENV: &str = "EM_PROBE_DIR";

/// Which sequence numbers the services mark (their `probe::SAMPLE_EVERY`).
const SAMPLE_EVERY: u64 = 128;

/// The dispatcher's stages, in order (their `probe::Stage` names).
const SERVICE_STAGES: [&str; 6] = [
    "ack_read",
    "group_took",
    "write_queued",
    "write_durable",
    "group_answered",
    "answer_sent",
];

/// The client's marks of one sampled delivery: when it was ACKed and when its DURABLE answer
/// reached the application (unix ns).
#[derive(Debug, Clone, Copy)]
pub struct ClientMark {
    pub seq: u64,
    pub acked_ns: u128,
    pub answered_ns: u128,
}

/// One stage's time, from one mark to the next.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StageLatency {
    pub from: &'static str,
    pub to: &'static str,
    pub samples: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
}

/// Now, in unix ns.
pub fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos())
}

/// The sequence number of a delivery the services mark, from its id (the dispatcher's
/// `<epoch>.<group>.<sequence>`, hexadecimal); `None` when not sampled or not of that form.
pub fn sampled_seq(delivery_id: &str) -> Option<u64> {
    let seq = u64::from_str_radix(delivery_id.rsplit('.').next()?, 16).ok()?;
    seq.is_multiple_of(SAMPLE_EVERY).then_some(seq)
}

/// The marks directory when probing is on (created if missing).
pub fn probe_dir() -> anyhow::Result<Option<PathBuf>> {
    let Some(dir) = std::env::var_os(DIR_ENV) else {
        return Ok(None);
    };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(Some(dir))
}

/// Each stage's latency over the client's marks, from the services' marks made within
/// `window` (unix ns). Empty when no service marked anything (services built without
/// `latency-probes`).
pub fn breakdown(
    dir: &Path,
    window: (u128, u128),
    client: &[ClientMark],
) -> anyhow::Result<Vec<StageLatency>> {
    let marks = service_marks(dir, window)?;
    if marks.is_empty() {
        return Ok(Vec::new());
    }
    let names: Vec<&'static str> = std::iter::once("ack()")
        .chain(SERVICE_STAGES)
        .chain(std::iter::once("answer received"))
        .collect();
    let mut spans: Vec<Vec<u128>> = vec![Vec::new(); names.len() - 1];
    for mark in client {
        let Some(at) = marks.get(&mark.seq) else {
            continue;
        };
        let times: Option<Vec<u128>> = std::iter::once(Some(mark.acked_ns))
            .chain(SERVICE_STAGES.iter().map(|stage| at.get(stage).copied()))
            .chain(std::iter::once(Some(mark.answered_ns)))
            .collect();
        // Only deliveries marked at every stage (a redelivered one may miss some).
        let Some(times) = times else { continue };
        for (span, pair) in spans.iter_mut().zip(times.windows(2)) {
            span.push(pair[1].saturating_sub(pair[0]));
        }
    }
    Ok(spans
        .into_iter()
        .enumerate()
        .map(|(n, mut nanos)| {
            nanos.sort_unstable();
            let at = |q: f64| {
                nanos
                    .get(((nanos.len().saturating_sub(1)) as f64 * q) as usize)
                    .map_or(0.0, |&ns| ns as f64 / 1e6)
            };
            StageLatency {
                from: names[n],
                to: names[n + 1],
                samples: nanos.len(),
                p50_ms: at(0.50),
                p90_ms: at(0.90),
                p99_ms: at(0.99),
            }
        })
        .collect())
}

/// The services' marks made within `window`: sequence number → stage → first time.
fn service_marks(
    dir: &Path,
    window: (u128, u128),
) -> anyhow::Result<HashMap<u64, HashMap<&'static str, u128>>> {
    let mut marks: HashMap<u64, HashMap<&'static str, u128>> = HashMap::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_none_or(|ext| ext != "probes") {
            continue;
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        for line in text.lines() {
            let mut fields = line.split(' ');
            let (Some(stage), Some(seq), Some(ns)) = (fields.next(), fields.next(), fields.next())
            else {
                continue; // a line cut by a kill
            };
            let Some(stage) = SERVICE_STAGES.iter().find(|known| **known == stage) else {
                continue;
            };
            let (Ok(seq), Ok(ns)) = (seq.parse::<u64>(), ns.parse::<u128>()) else {
                continue;
            };
            if ns < window.0 || ns > window.1 {
                continue;
            }
            marks
                .entry(seq)
                .or_default()
                .entry(stage)
                .and_modify(|first| *first = (*first).min(ns))
                .or_insert(ns);
        }
    }
    Ok(marks)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn only_every_128th_sequence_of_a_dispatcher_id_is_sampled() {
        assert_eq!(sampled_seq("1f3a.2.80"), Some(128));
        assert_eq!(sampled_seq("1f3a.2.0"), Some(0));
        assert_eq!(sampled_seq("1f3a.2.81"), None);
        assert_eq!(sampled_seq("not-an-id"), None);
    }

    #[test]
    fn stages_are_joined_by_sequence_within_the_window() {
        let dir = tempfile::tempdir().unwrap();
        // Two deliveries marked at every stage 1 ms apart; a mark outside the window (an
        // earlier group with the same sequence numbers) and a cut line are ignored.
        let mut lines = String::from("ack_read 0 1\nanswer_sent 12");
        for seq in [0u64, 128] {
            for (n, stage) in SERVICE_STAGES.iter().enumerate() {
                let ns = 10_000_000 + seq as u128 + (n as u128 + 1) * 1_000_000;
                lines = format!("{stage} {seq} {ns}\n{lines}");
            }
        }
        std::fs::write(dir.path().join("dispatcher-svc-1.probes"), lines).unwrap();
        let client: Vec<ClientMark> = [0u64, 128]
            .into_iter()
            .map(|seq| ClientMark {
                seq,
                acked_ns: 10_000_000 + seq as u128,
                answered_ns: 10_000_000 + seq as u128 + 9_000_000,
            })
            .collect();
        let stages = breakdown(dir.path(), (5_000_000, 50_000_000), &client).unwrap();
        assert_eq!(stages.len(), SERVICE_STAGES.len() + 1);
        assert_eq!(stages[0].from, "ack()");
        assert_eq!(stages[0].to, "ack_read");
        assert_eq!(stages.last().unwrap().to, "answer received");
        for stage in &stages[..stages.len() - 1] {
            assert_eq!(stage.samples, 2);
            assert!((stage.p50_ms - 1.0).abs() < 1e-9, "{stage:?}");
        }
        assert!((stages.last().unwrap().p99_ms - 3.0).abs() < 1e-9);
    }

    #[test]
    fn no_marks_from_the_services_give_no_breakdown() {
        let dir = tempfile::tempdir().unwrap();
        let client = [ClientMark {
            seq: 0,
            acked_ns: 1,
            answered_ns: 2,
        }];
        assert!(breakdown(dir.path(), (0, 10), &client).unwrap().is_empty());
    }
}
