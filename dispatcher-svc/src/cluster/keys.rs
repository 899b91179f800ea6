//! The cluster's etcd key layout, under a configured prefix (`/em` by default):
//!
//! | key | value | lease |
//! |---|---|---|
//! | `<prefix>/instances/<id>` | `ts\|addr\|sessions\|inflow\|outflow\|cpu` ([`super::load`]) | the instance's |
//! | `<prefix>/clients/<id>` | `client=sessions,…` of that instance | the instance's |
//! | `<prefix>/groups/<topic>/<group>` | `instanceId\|addr` of the group's home | the home's |
//! | `<prefix>/watermarks/<topic>/<group>/<partition>` | the group's mirrored watermark ([`super::mirror`]) | none |
//!
//! Topics may contain `/` and a BROADCAST group holds a client id, so both are percent-encoded
//! (every byte outside `[A-Za-z0-9._~-]` becomes `%XX`, upper-case hex): a path segment never
//! holds `/`, and the encoding is injective. The topic's default group is `%(default)`, which no
//! encoded name can be (an encoded `%` is always followed by two hex digits).

use eventmesh_common::keys::{GroupName, Topic};

/// The segment standing for a topic's default group.
pub const DEFAULT_GROUP_SEGMENT: &str = "%(default)";

/// Percent-encodes one path segment.
pub fn encode_segment(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'~' | b'-') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The inverse of [`encode_segment`]; `None` for anything it cannot have produced.
pub fn decode_segment(segment: &str) -> Option<String> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = segment.get(i + 1..i + 3)?;
            if hex.bytes().any(|b| b.is_ascii_lowercase()) {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The keys of one cluster.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `prefix` (validated by the config: starts with `/`, no trailing `/`).
    pub fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.trim_end_matches('/').to_owned(),
        }
    }

    /// The prefix of every instance's key.
    pub fn instances(&self) -> String {
        format!("{}/instances/", self.prefix)
    }

    /// An instance's key.
    pub fn instance(&self, id: &str) -> String {
        format!("{}{}", self.instances(), encode_segment(id))
    }

    /// The prefix of every instance's per-client session counts.
    pub fn clients(&self) -> String {
        format!("{}/clients/", self.prefix)
    }

    /// An instance's per-client session counts.
    pub fn client_counts(&self, id: &str) -> String {
        format!("{}{}", self.clients(), encode_segment(id))
    }

    /// The prefix of every group's home key.
    pub fn homes(&self) -> String {
        format!("{}/groups/", self.prefix)
    }

    /// A group's home key.
    pub fn home(&self, topic: &Topic, group: Option<&GroupName>) -> String {
        format!("{}{}", self.homes(), group_path(topic, group))
    }

    /// The prefix of every group's mirrored watermarks.
    pub fn watermarks(&self) -> String {
        format!("{}/watermarks/", self.prefix)
    }

    /// The instance id an instance key names (`None`: not an instance key).
    pub fn instance_id_of(&self, key: &str) -> Option<String> {
        decode_segment(key.strip_prefix(&self.instances())?)
    }

    /// The instance id a client-counts key names.
    pub fn client_counts_owner(&self, key: &str) -> Option<String> {
        decode_segment(key.strip_prefix(&self.clients())?)
    }

    /// The (topic, group) a home key names, as the `topic/group` path relative to the homes
    /// prefix (the form [`group_path`] builds).
    pub fn home_path_of<'k>(&self, key: &'k str) -> Option<&'k str> {
        key.strip_prefix(&self.homes())
    }
}

/// `<topic>/<group>` with both segments encoded.
pub fn group_path(topic: &Topic, group: Option<&GroupName>) -> String {
    let group = group.map_or_else(
        || DEFAULT_GROUP_SEGMENT.to_owned(),
        |g| encode_segment(g.as_str()),
    );
    format!("{}/{group}", encode_segment(topic.as_str()))
}

/// The inverse of [`group_path`]: `(topic, group)` with the default group as `""`.
pub fn parse_group_path(path: &str) -> Option<(String, String)> {
    let (topic, group) = path.split_once('/')?;
    let group = if group == DEFAULT_GROUP_SEGMENT {
        String::new()
    } else {
        decode_segment(group)?
    };
    Some((decode_segment(topic)?, group))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn segments_round_trip_and_never_hold_a_slash() {
        for value in [
            "orders",
            "a/b/c",
            "100%",
            "~client/with:odd#",
            "é/ü",
            "%(default)",
        ] {
            let encoded = encode_segment(value);
            assert!(!encoded.contains('/'), "{encoded}");
            assert_eq!(decode_segment(&encoded).unwrap(), value);
            assert_ne!(encoded, DEFAULT_GROUP_SEGMENT);
        }
        assert_eq!(
            decode_segment("%2f"),
            None,
            "lower-case hex is never produced"
        );
        assert_eq!(decode_segment("%2"), None);
        assert_eq!(decode_segment("%FF"), None, "not UTF-8");
    }

    #[test]
    fn layout() {
        let keys = Keys::new("/em");
        let topic = Topic::new("a/b").unwrap();
        let group = GroupName::named("g.1").unwrap();
        assert_eq!(keys.home(&topic, Some(&group)), "/em/groups/a%2Fb/g.1");
        assert_eq!(keys.home(&topic, None), "/em/groups/a%2Fb/%(default)");
        let broadcast = GroupName::broadcast("c-1").unwrap();
        assert_eq!(keys.home(&topic, Some(&broadcast)), "/em/groups/a%2Fb/~c-1");
        assert_eq!(keys.instance("i-1"), "/em/instances/i-1");
        assert_eq!(keys.instance_id_of("/em/instances/i%2F1").unwrap(), "i/1");
        assert_eq!(keys.instance_id_of("/em/groups/x"), None);
        assert_eq!(
            keys.home_path_of("/em/groups/a%2Fb/g.1").unwrap(),
            group_path(&topic, Some(&group))
        );
        assert_eq!(
            parse_group_path(&group_path(&topic, None)).unwrap(),
            ("a/b".to_owned(), String::new())
        );
        assert_eq!(
            parse_group_path(&group_path(&topic, Some(&broadcast))).unwrap(),
            ("a/b".to_owned(), "~c-1".to_owned())
        );
        assert_eq!(parse_group_path("no-slash"), None);
    }
}
