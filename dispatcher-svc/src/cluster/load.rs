//! What an instance publishes about itself under `<prefix>/instances/<id>`, how a reader of
//! those values decides who is alive, and the Recommend choice among the living.
//!
//! The value is the reference's heartbeat: `ts|addr|activeSessions|inflowBytesPerSec|
//! outflowBytesPerSec|cpuLoad` (`ts` in Unix milliseconds, `cpuLoad` in `[0, 1]`). A reader
//! skips a value without `|`, or whose timestamp is unparsable or older than the TTL; a value
//! whose load fields do not parse keeps the instance alive with an unknown load (score 500).
//! Unlike the reference (its defect 11), the address is only the second field.
//!
//! Scoring is the reference's: `sessions × 1 + (in + out) × 0.001 + cpu × 1000`, plus 10,000
//! when `cpu > 0.8` or inflow exceeds 5,000,000 B/s. Unlike the reference (its defect 12) the
//! choice spreads one client's sessions and never depends on map order: among the instances
//! within [`SPREAD_BAND`] of the best score, the one holding the fewest sessions of this client
//! wins, ties broken by a stable hash of (client, topic, group, instance).

use std::collections::HashMap;

/// Score of an instance whose load is unknown.
pub const UNKNOWN_LOAD_SCORE: f64 = 500.0;
/// Added to an overloaded instance's score.
pub const OVERLOAD_PENALTY: f64 = 10_000.0;
/// Above this CPU share an instance is overloaded.
pub const OVERLOAD_CPU: f64 = 0.8;
/// Above this inflow (bytes per second) an instance is overloaded.
pub const OVERLOAD_INFLOW_BYTES_PER_SEC: u64 = 5_000_000;
/// Instances scoring within this much of the best are equally good: among them the client's
/// sessions are spread. 100 is a hundred sessions, 100 KB/s of traffic, or a tenth of a core.
pub const SPREAD_BAND: f64 = 100.0;

/// An instance's load as it reports it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Load {
    /// Open subscription sessions.
    pub active_sessions: u64,
    /// Bytes published through the instance per second.
    pub inflow_bytes_per_sec: u64,
    /// Bytes delivered by the instance per second.
    pub outflow_bytes_per_sec: u64,
    /// The process's share of one CPU, `[0, 1]` per core used.
    pub cpu_load: f64,
}

impl Load {
    /// The reference's score: lower is better.
    pub fn score(&self) -> f64 {
        let mut score = self.active_sessions as f64
            + self.inflow_bytes_per_sec as f64 * 0.001
            + self.outflow_bytes_per_sec as f64 * 0.001
            + self.cpu_load * 1000.0;
        if self.cpu_load > OVERLOAD_CPU || self.inflow_bytes_per_sec > OVERLOAD_INFLOW_BYTES_PER_SEC
        {
            score += OVERLOAD_PENALTY;
        }
        score
    }

    /// Parses the load fields (`active|inflow|outflow|cpu`); missing trailing fields are 0,
    /// anything unparsable (or no field at all) is `None`.
    pub fn parse(fields: &[&str]) -> Option<Load> {
        if fields.len() < 2 || fields.len() > 4 {
            return None;
        }
        let field = |i: usize| fields.get(i).copied().unwrap_or("0").trim();
        let cpu_load: f64 = field(3).parse().ok()?;
        if !cpu_load.is_finite() || cpu_load < 0.0 {
            return None;
        }
        Some(Load {
            active_sessions: field(0).parse().ok()?,
            inflow_bytes_per_sec: field(1).parse().ok()?,
            outflow_bytes_per_sec: field(2).parse().ok()?,
            cpu_load,
        })
    }
}

/// One `<prefix>/instances/<id>` value.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceRecord {
    /// When the value was written, Unix milliseconds.
    pub ts_millis: u64,
    /// The client-facing `host:port`.
    pub address: String,
    /// `None`: not reported, or unparsable.
    pub load: Option<Load>,
}

impl InstanceRecord {
    /// The value as written to etcd.
    pub fn encode(&self) -> String {
        match &self.load {
            Some(load) => format!(
                "{}|{}|{}|{}|{}|{}",
                self.ts_millis,
                self.address,
                load.active_sessions,
                load.inflow_bytes_per_sec,
                load.outflow_bytes_per_sec,
                load.cpu_load
            ),
            None => format!("{}|{}", self.ts_millis, self.address),
        }
    }

    /// Reads a value; `None` when it is to be skipped (no `|`, a bad or expired timestamp).
    pub fn parse_live(value: &str, now_millis: u64, ttl_millis: u64) -> Option<InstanceRecord> {
        let mut fields = value.split('|');
        let ts_millis: u64 = fields.next()?.trim().parse().ok()?;
        let address = fields.next()?.trim().to_owned();
        if now_millis.saturating_sub(ts_millis) > ttl_millis {
            return None;
        }
        let rest: Vec<&str> = fields.collect();
        let load = if rest.is_empty() {
            None
        } else {
            Load::parse(&rest)
        };
        Some(InstanceRecord {
            ts_millis,
            address,
            load,
        })
    }

    /// The score Recommend ranks by.
    pub fn score(&self) -> f64 {
        self.load.as_ref().map_or(UNKNOWN_LOAD_SCORE, Load::score)
    }
}

/// A live instance as Recommend sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The instance id.
    pub id: String,
    /// Its latest value.
    pub record: InstanceRecord,
    /// Sessions the asking client has on it.
    pub client_sessions: u64,
}

/// Who is asking, for spreading and tie-breaking.
#[derive(Debug, Clone, Copy)]
pub struct Asker<'a> {
    /// The client id.
    pub client: &'a str,
    /// The topic of the session to open.
    pub topic: &'a str,
    /// The effective group (the client id for BROADCAST).
    pub group: &'a str,
}

/// The instance to recommend: not excluded if any is not; within [`SPREAD_BAND`] of the best
/// score, fewest sessions of this client, then a stable hash. `None` only for no candidates.
pub fn choose<'c>(
    candidates: &'c [Candidate],
    exclude: &[String],
    asker: Asker<'_>,
) -> Option<&'c Candidate> {
    let allowed: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| !exclude.contains(&c.id))
        .collect();
    // Every live instance excluded: the best of them anyway (there is nowhere else to go).
    let pool: Vec<&Candidate> = if allowed.is_empty() {
        candidates.iter().collect()
    } else {
        allowed
    };
    let best = pool
        .iter()
        .map(|c| c.record.score())
        .min_by(f64::total_cmp)?;
    pool.into_iter()
        .filter(|c| c.record.score() <= best + SPREAD_BAND)
        .min_by_key(|c| (c.client_sessions, tie_break(asker, &c.id)))
}

/// A hash that is the same in every process and release (FNV-1a, 64 bits).
fn tie_break(asker: Asker<'_>, instance: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in [asker.client, asker.topic, asker.group, instance] {
        for byte in part.bytes().chain(std::iter::once(0xff)) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

/// Counts per client id, as each instance publishes them for spreading: `client=count` pairs
/// joined by `,` (client ids never contain `,` or `=`). Unparsable pairs are skipped.
pub fn parse_client_counts(value: &str) -> HashMap<String, u64> {
    value
        .split(',')
        .filter_map(|pair| {
            let (client, count) = pair.split_once('=')?;
            Some((client.to_owned(), count.parse().ok()?))
        })
        .collect()
}

/// The inverse of [`parse_client_counts`], in a stable order.
pub fn encode_client_counts(counts: &HashMap<String, u64>) -> String {
    let mut pairs: Vec<(&String, &u64)> = counts.iter().filter(|(_, n)| **n > 0).collect();
    pairs.sort();
    pairs
        .into_iter()
        .map(|(client, count)| format!("{client}={count}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn live(value: &str, now: u64) -> Option<InstanceRecord> {
        InstanceRecord::parse_live(value, now, 15_000)
    }

    /// The reference's heartbeat vectors (LoadBalancingScoringTest, ClusterMembershipLoadTest).
    #[test]
    fn heartbeat_values_are_the_references() {
        let with_load = InstanceRecord {
            ts_millis: 0,
            address: "self:8080".into(),
            load: Some(Load {
                active_sessions: 3,
                inflow_bytes_per_sec: 2000,
                outflow_bytes_per_sec: 1500,
                cpu_load: 0.25,
            }),
        };
        assert_eq!(with_load.encode(), "0|self:8080|3|2000|1500|0.25");
        assert_eq!(live(&with_load.encode(), 0).unwrap(), with_load);
        let without = InstanceRecord {
            ts_millis: 0,
            address: "1.2.3.4:8080".into(),
            load: None,
        };
        assert_eq!(without.encode(), "0|1.2.3.4:8080");
        assert_eq!(live("0|1.2.3.4:8080", 0).unwrap(), without);

        assert_eq!(
            Load::parse(&["5", "1200", "800", "0.25"]).unwrap(),
            Load {
                active_sessions: 5,
                inflow_bytes_per_sec: 1200,
                outflow_bytes_per_sec: 800,
                cpu_load: 0.25
            }
        );
        assert_eq!(Load::parse(&[]), None);
        assert_eq!(Load::parse(&["5"]), None);
        // Missing trailing fields are zero; garbage is an unknown load, not a dead instance.
        assert_eq!(Load::parse(&["5", "1"]).unwrap().cpu_load, 0.0);
        let garbage = live("100|h:1|x|y|z|w", 100).unwrap();
        assert_eq!(garbage.load, None);
        assert_eq!(garbage.score(), UNKNOWN_LOAD_SCORE);
    }

    #[test]
    fn expired_and_malformed_values_are_skipped() {
        // Clock 20000, TTL 15000: c is pruned, a beats b.
        let a = live("19000|h1:8080|2|500|400|0.10", 20_000).unwrap();
        let b = live("19500|h2:8080|20|5000000|4000000|0.90", 20_000).unwrap();
        assert_eq!(live("1000|h3:8080|1|100|50|0.01", 20_000), None);
        assert!(a.score() < b.score());
        assert_eq!(a.address, "h1:8080");
        for bad in ["", "no-bar", "x|h:1", "-5|h:1", "|h:1|1|1|1|0.1"] {
            assert_eq!(live(bad, 20_000), None, "{bad:?}");
        }
    }

    #[test]
    fn overload_adds_the_penalty() {
        let normal = live("9000|n:1|3|1000|800|0.20", 10_000).unwrap();
        let overloaded = live("9500|o:1|5|2000|1500|0.90", 10_000).unwrap();
        assert!(overloaded.score() > normal.score() + OVERLOAD_PENALTY - 1_000.0);
        let flooded = Load {
            inflow_bytes_per_sec: 5_000_001,
            ..Load::default()
        };
        assert!(flooded.score() >= OVERLOAD_PENALTY);
    }

    fn idle(id: &str) -> Candidate {
        Candidate {
            id: id.into(),
            record: InstanceRecord {
                ts_millis: 0,
                address: format!("{id}:1"),
                load: Some(Load::default()),
            },
            client_sessions: 0,
        }
    }

    /// One client's 9 groups on 3 idle instances spread 3/3/3, the same way every time.
    #[test]
    fn one_clients_groups_spread_evenly_and_deterministically() {
        let run = || {
            let mut instances = vec![idle("a"), idle("b"), idle("c")];
            let mut order = Vec::new();
            for group in 0..9 {
                let group = format!("g{group}");
                let asker = Asker {
                    client: "big",
                    topic: "t",
                    group: &group,
                };
                let chosen = choose(&instances, &[], asker).unwrap().id.clone();
                let picked = instances.iter_mut().find(|c| c.id == chosen).unwrap();
                picked.client_sessions += 1;
                if let Some(load) = picked.record.load.as_mut() {
                    load.active_sessions += 1;
                }
                order.push(chosen);
            }
            (instances, order)
        };
        let (instances, order) = run();
        for instance in &instances {
            assert_eq!(instance.client_sessions, 3, "{order:?}");
        }
        assert_eq!(run().1, order, "ties are broken the same way every time");
    }

    #[test]
    fn exclusion_and_the_band() {
        let mut busy = idle("busy");
        busy.record.load = Some(Load {
            active_sessions: 1_000,
            ..Load::default()
        });
        let instances = vec![busy, idle("free")];
        let asker = Asker {
            client: "c",
            topic: "t",
            group: "g",
        };
        // Far outside the band: the client's own spreading does not override the load.
        assert_eq!(choose(&instances, &[], asker).unwrap().id, "free");
        assert_eq!(
            choose(&instances, &["free".into()], asker).unwrap().id,
            "busy"
        );
        // All excluded: the best anyway.
        assert_eq!(
            choose(&instances, &["free".into(), "busy".into()], asker)
                .unwrap()
                .id,
            "free"
        );
        assert!(choose(&[], &[], asker).is_none());
    }

    #[test]
    fn client_counts_round_trip() {
        let counts: HashMap<String, u64> = [("a".to_owned(), 2), ("b".to_owned(), 0)].into();
        assert_eq!(encode_client_counts(&counts), "a=2");
        assert_eq!(parse_client_counts("a=2,junk,b=x,c=1")["c"], 1);
        assert_eq!(parse_client_counts("a=2,junk,b=x,c=1").len(), 2);
    }
}
