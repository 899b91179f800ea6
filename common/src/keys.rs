//! Validated names and the composite keys built from them.
//!
//! Names are validated, never silently mangled, so that a composite key splits back into
//! exactly the parts it was built from:
//! * [`Topic`]: not empty, at most 245 bytes (so `<topic>_DLQ` fits Kafka's 249; names ending
//!   in `_DLQ` may use all 249), no `#`, no `@`, no control characters. Backends may refuse
//!   more (puller-svc checks their own rules).
//! * [`ClientId`]: not empty, at most 256 bytes, no `#`, no control characters, and not of the
//!   reserved form `__…__` (starts and ends with two underscores).
//! * [`GroupName`]: `[A-Za-z0-9._-]`, 1 to 128 bytes; a BROADCAST client's own group is `~`
//!   and its client id (a namespace of its own, so it never meets a named group).
//! * [`PartitionId`]: one of `<n>` (Kafka, local log; `n` a non-negative 32-bit number
//!   without leading zeros), `<brokerName>:<queueId>` (RocketMQ), or `<lite>@<queue>` (a lite
//!   channel). Broker and lite names follow the topic rules (no `#`, `@`, `:` for brokers).
//!
//! Composite keys:
//! * [`OffsetKey`] — `topic#client#partition`, where `client` is a [`ClientId`] or a
//!   reserved MQ cursor (`__mqcursor__` for a topic's default group,
//!   `__mqcursor@<group>__` for a named group), or a group's count of offsets lost to
//!   retention (`__mqlost__`, `__mqlost@<group>__`), see [`OffsetClient`].
//! * [`PullKey`] — `topic#partition`; a lite channel's key is therefore `parent#lite@queue`.

use std::fmt;
use std::str::FromStr;

/// Longest topic name, in bytes (Kafka's limit); only dead-letter topics (`…_DLQ`) use all of
/// it, see [`MAX_TOPIC_BYTES_WITH_ROOM`].
pub const MAX_TOPIC_BYTES: usize = 249;
/// Longest name of a topic that is not a dead-letter topic: room is left for the `_DLQ` suffix
/// of its dead-letter topic.
pub const MAX_TOPIC_BYTES_WITH_ROOM: usize = MAX_TOPIC_BYTES - 4;
const DEAD_LETTER_SUFFIX: &str = "_DLQ";
/// Longest client id, in bytes.
pub const MAX_CLIENT_ID_BYTES: usize = 256;
/// Longest group name, in bytes.
pub const MAX_GROUP_BYTES: usize = 128;
/// The first character of a BROADCAST client's own group name (never in a named group).
pub const BROADCAST_GROUP_PREFIX: char = '~';
/// Longest broker or lite name inside a partition id, in bytes.
pub const MAX_PARTITION_NAME_BYTES: usize = 249;

/// Reserved client id of a topic's default group MQ cursor.
pub const MQ_CURSOR_CLIENT: &str = "__mqcursor__";
const MQ_CURSOR_GROUP_PREFIX: &str = "__mqcursor@";
/// Reserved client id of a topic's default group's count of offsets lost to retention.
pub const MQ_LOST_CLIENT: &str = "__mqlost__";
const MQ_LOST_GROUP_PREFIX: &str = "__mqlost@";
const RESERVED_AFFIX: &str = "__";

/// Why a name or key is invalid. The message names the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The name is empty.
    #[error("{kind} must not be empty")]
    Empty {
        /// What kind of name.
        kind: &'static str,
    },
    /// The name is too long.
    #[error("{kind} {value:?} is {len} bytes, longer than {max}")]
    TooLong {
        /// What kind of name.
        kind: &'static str,
        /// The offending value.
        value: String,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The name contains a character it may not contain.
    #[error("{kind} {value:?} must not contain {ch:?}")]
    BadChar {
        /// What kind of name.
        kind: &'static str,
        /// The offending value.
        value: String,
        /// The character.
        ch: char,
    },
    /// A topic name that leaves no room for its dead-letter topic's suffix.
    #[error(
        "topic {value:?} is {len} bytes; at most {MAX_TOPIC_BYTES_WITH_ROOM}, so that its dead-letter topic <topic>_DLQ fits {MAX_TOPIC_BYTES} (only names ending in _DLQ may use all {MAX_TOPIC_BYTES})"
    )]
    NoRoomForDeadLetters {
        /// The offending value.
        value: String,
        /// Its length.
        len: usize,
    },
    /// A client id has the reserved `__…__` form.
    #[error("client id {0:?} has the reserved form __…__")]
    ReservedClientId(String),
    /// The value has the wrong shape.
    #[error("{kind} {value:?} is malformed: {why}")]
    Malformed {
        /// What kind of value.
        kind: &'static str,
        /// The offending value.
        value: String,
        /// Why.
        why: &'static str,
    },
}

fn check_len(kind: &'static str, value: &str, max: usize) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty { kind });
    }
    if value.len() > max {
        return Err(KeyError::TooLong {
            kind,
            value: value.to_owned(),
            len: value.len(),
            max,
        });
    }
    Ok(())
}

fn check_chars(kind: &'static str, value: &str, forbidden: &[char]) -> Result<(), KeyError> {
    match value
        .chars()
        .find(|c| forbidden.contains(c) || c.is_control())
    {
        Some(ch) => Err(KeyError::BadChar {
            kind,
            value: value.to_owned(),
            ch,
        }),
        None => Ok(()),
    }
}

macro_rules! string_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        ///
        /// Shared text: a clone is a reference count, not a copy (names are cloned on hot
        /// paths — per delivery, per offset entry).
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(std::sync::Arc<str>);

        impl $name {
            /// The validated text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = KeyError;
            fn from_str(s: &str) -> Result<Self, KeyError> {
                Self::new(s)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        // Hash, Eq and Ord all follow the text, so maps keyed by the name can be searched by
        // `&str` (finding the shared name instead of building a new one).
        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }
    };
}

string_newtype!(
    /// A validated topic name.
    Topic
);
string_newtype!(
    /// A validated application client id (never a reserved id).
    ClientId
);
string_newtype!(
    /// A validated subscription group name.
    GroupName
);
string_newtype!(
    /// A validated MQ partition id.
    PartitionId
);

impl Topic {
    /// Validates a topic name.
    pub fn new(value: impl Into<String>) -> Result<Self, KeyError> {
        let value = value.into();
        check_len("topic", &value, MAX_TOPIC_BYTES)?;
        if value.len() > MAX_TOPIC_BYTES_WITH_ROOM && !value.ends_with(DEAD_LETTER_SUFFIX) {
            return Err(KeyError::NoRoomForDeadLetters {
                len: value.len(),
                value,
            });
        }
        check_chars("topic", &value, &['#', '@'])?;
        Ok(Topic(value.into()))
    }
}

impl ClientId {
    /// Validates an application client id.
    pub fn new(value: impl Into<String>) -> Result<Self, KeyError> {
        let value = value.into();
        check_len("client id", &value, MAX_CLIENT_ID_BYTES)?;
        check_chars("client id", &value, &['#'])?;
        if is_reserved_form(&value) {
            return Err(KeyError::ReservedClientId(value));
        }
        Ok(ClientId(value.into()))
    }
}

fn is_reserved_form(value: &str) -> bool {
    value.starts_with(RESERVED_AFFIX) && value.ends_with(RESERVED_AFFIX)
}

impl GroupName {
    /// Validates a group name: a named group (`[A-Za-z0-9._-]{1,128}`) or a BROADCAST client's
    /// own group (`~` and the client id, which must follow the same rule).
    pub fn new(value: impl Into<String>) -> Result<Self, KeyError> {
        let value = value.into();
        let name = value.strip_prefix(BROADCAST_GROUP_PREFIX).unwrap_or(&value);
        check_len("group", name, MAX_GROUP_BYTES)?;
        if let Some(ch) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(KeyError::BadChar {
                kind: "group",
                value,
                ch,
            });
        }
        Ok(GroupName(value.into()))
    }

    /// A named (LOAD_BALANCE) group as a client names it: the BROADCAST prefix is refused.
    pub fn named(value: impl Into<String>) -> Result<Self, KeyError> {
        let value = value.into();
        if value.starts_with(BROADCAST_GROUP_PREFIX) {
            return Err(KeyError::BadChar {
                kind: "group",
                value,
                ch: BROADCAST_GROUP_PREFIX,
            });
        }
        GroupName::new(value)
    }

    /// The group of a BROADCAST client: its own, in a namespace no named group can enter, so
    /// a client id equal to a LOAD_BALANCE group's name never joins that group.
    pub fn broadcast(client: &str) -> Result<Self, KeyError> {
        GroupName::named(client)?;
        GroupName::new(format!("{BROADCAST_GROUP_PREFIX}{client}"))
    }

    /// Whether this is a BROADCAST client's own group.
    pub fn is_broadcast(&self) -> bool {
        self.0.starts_with(BROADCAST_GROUP_PREFIX)
    }
}

/// What a [`PartitionId`] denotes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionKind<'a> {
    /// A numbered partition (Kafka, the local log).
    Number(u32),
    /// A RocketMQ queue.
    Queue {
        /// The broker name.
        broker: &'a str,
        /// The broker-local queue id.
        queue_id: u32,
    },
    /// A lite channel inside a topic.
    Lite {
        /// The lite channel name.
        lite: &'a str,
        /// The queue the channel lives on.
        queue: u32,
    },
}

fn parse_u32(kind: &'static str, whole: &str, digits: &str) -> Result<u32, KeyError> {
    let malformed = |why| KeyError::Malformed {
        kind,
        value: whole.to_owned(),
        why,
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed("the number must be decimal digits"));
    }
    if digits.len() > 1 && digits.starts_with('0') {
        return Err(malformed("the number must not have leading zeros"));
    }
    digits
        .parse()
        .map_err(|_| malformed("the number does not fit in 32 bits"))
}

/// Numbered partitions below this share one allocation each ([`PartitionId::number`]).
pub const SHARED_PARTITION_NUMBERS: u32 = 1024;

impl PartitionId {
    /// Validates a partition id in any of its three forms.
    pub fn new(value: impl Into<String>) -> Result<Self, KeyError> {
        let value = value.into();
        Self::classify(&value)?;
        Ok(PartitionId(value.into()))
    }

    /// A numbered partition. The first [`SHARED_PARTITION_NUMBERS`] are made once per process
    /// and shared (polled records name their partition on every record).
    pub fn number(n: u32) -> Self {
        static SHARED: std::sync::OnceLock<Vec<PartitionId>> = std::sync::OnceLock::new();
        let shared = SHARED.get_or_init(|| {
            (0..SHARED_PARTITION_NUMBERS)
                .map(|n| PartitionId(n.to_string().into()))
                .collect()
        });
        match shared.get(n as usize) {
            Some(id) => id.clone(),
            None => PartitionId(n.to_string().into()),
        }
    }

    /// A RocketMQ queue.
    pub fn queue(broker: &str, queue_id: u32) -> Result<Self, KeyError> {
        Self::new(format!("{broker}:{queue_id}"))
    }

    /// A lite channel.
    pub fn lite(lite: &str, queue: u32) -> Result<Self, KeyError> {
        Self::new(format!("{lite}@{queue}"))
    }

    /// What this id denotes.
    pub fn kind(&self) -> PartitionKind<'_> {
        // Validated at construction, so classification cannot fail here; the fallback only
        // keeps this free of panics.
        Self::classify(&self.0).unwrap_or(PartitionKind::Number(0))
    }

    fn classify(value: &str) -> Result<PartitionKind<'_>, KeyError> {
        const KIND: &str = "partition";
        check_len(KIND, value, MAX_PARTITION_NAME_BYTES + 11)?;
        check_chars(KIND, value, &['#'])?;
        if let Some((lite, queue)) = value.rsplit_once('@') {
            check_len("lite name", lite, MAX_PARTITION_NAME_BYTES)?;
            check_chars("lite name", lite, &['@'])?;
            let queue = parse_u32(KIND, value, queue)?;
            return Ok(PartitionKind::Lite { lite, queue });
        }
        if let Some((broker, queue_id)) = value.rsplit_once(':') {
            check_len("broker name", broker, MAX_PARTITION_NAME_BYTES)?;
            check_chars("broker name", broker, &[':'])?;
            let queue_id = parse_u32(KIND, value, queue_id)?;
            return Ok(PartitionKind::Queue { broker, queue_id });
        }
        parse_u32(KIND, value, value).map(PartitionKind::Number)
    }
}

/// The client part of an [`OffsetKey`]: an application client, or one of a subscription
/// group's reserved records.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OffsetClient {
    /// An application client's ACK watermark.
    Client(ClientId),
    /// A subscription group's gap-free MQ watermark; `None` is the topic's default group.
    MqCursor(Option<GroupName>),
    /// How many offsets retention removed before the group delivered them (a running total
    /// per partition, written together with the watermark that passes them).
    MqLost(Option<GroupName>),
}

/// One reserved record kind: its default group's id, named groups' prefix, and constructor.
type ReservedRecord = (
    &'static str,
    &'static str,
    fn(Option<GroupName>) -> OffsetClient,
);

/// The reserved client ids.
const RESERVED_RECORDS: [ReservedRecord; 2] = [
    (
        MQ_CURSOR_CLIENT,
        MQ_CURSOR_GROUP_PREFIX,
        OffsetClient::MqCursor,
    ),
    (MQ_LOST_CLIENT, MQ_LOST_GROUP_PREFIX, OffsetClient::MqLost),
];

impl OffsetClient {
    /// Parses an application client id or a reserved group record id (an owned `String` is
    /// moved, not copied).
    pub fn parse<S: AsRef<str> + Into<String>>(value: S) -> Result<Self, KeyError> {
        let text = value.as_ref();
        for (plain, prefix, record) in RESERVED_RECORDS {
            if text == plain {
                return Ok(record(None));
            }
            if let Some(group) = text
                .strip_prefix(prefix)
                .and_then(|rest| rest.strip_suffix(RESERVED_AFFIX))
            {
                return Ok(record(Some(GroupName::new(group)?)));
            }
        }
        ClientId::new(value.into()).map(OffsetClient::Client)
    }

    /// The cursor of a group (`None`: the topic's default group).
    pub fn mq_cursor(group: Option<GroupName>) -> Self {
        OffsetClient::MqCursor(group)
    }

    /// For a reserved record: its default-group id, named-group prefix and group.
    fn reserved(&self) -> Option<(&'static str, &'static str, Option<&GroupName>)> {
        match self {
            OffsetClient::Client(_) => None,
            OffsetClient::MqCursor(group) => {
                Some((MQ_CURSOR_CLIENT, MQ_CURSOR_GROUP_PREFIX, group.as_ref()))
            }
            OffsetClient::MqLost(group) => {
                Some((MQ_LOST_CLIENT, MQ_LOST_GROUP_PREFIX, group.as_ref()))
            }
        }
    }

    /// Appends the id to `out` (no formatting machinery: the offset store's hot path).
    fn encode_into(&self, out: &mut String) {
        match (self, self.reserved()) {
            (OffsetClient::Client(id), _) => out.push_str(id.as_str()),
            (_, Some((plain, _, None))) => out.push_str(plain),
            (_, Some((_, prefix, Some(group)))) => {
                out.push_str(prefix);
                out.push_str(group.as_str());
                out.push_str(RESERVED_AFFIX);
            }
            (_, None) => {}
        }
    }
}

impl fmt::Display for OffsetClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut encoded = String::new();
        self.encode_into(&mut encoded);
        f.write_str(&encoded)
    }
}

impl FromStr for OffsetClient {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        Self::parse(s)
    }
}

/// The key of one stored ACK offset: `topic#client#partition`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OffsetKey {
    /// The topic.
    pub topic: Topic,
    /// The client or MQ cursor.
    pub client: OffsetClient,
    /// The MQ partition.
    pub partition: PartitionId,
}

impl OffsetKey {
    /// Builds a key from validated parts.
    pub fn new(topic: Topic, client: OffsetClient, partition: PartitionId) -> Self {
        OffsetKey {
            topic,
            client,
            partition,
        }
    }

    /// Validates the three parts.
    pub fn parse_parts(topic: &str, client: &str, partition: &str) -> Result<Self, KeyError> {
        Ok(OffsetKey {
            topic: Topic::new(topic)?,
            client: OffsetClient::parse(client)?,
            partition: PartitionId::new(partition)?,
        })
    }

    /// Appends the encoded key (`topic#client#partition`) to `out`, without the formatting
    /// machinery (this is on the offset store's hot path).
    pub fn encode_into(&self, out: &mut String) {
        out.push_str(self.topic.as_str());
        out.push('#');
        self.client.encode_into(out);
        out.push('#');
        out.push_str(self.partition.as_str());
    }

    /// The prefix shared by every key of `topic` (`topic#`); unambiguous because topics
    /// cannot contain `#`.
    pub fn topic_prefix(topic: &Topic) -> String {
        format!("{topic}#")
    }

    /// The prefix shared by every key of one client of `topic` (`topic#client#`).
    pub fn client_prefix(topic: &Topic, client: &OffsetClient) -> String {
        format!("{topic}#{client}#")
    }
}

impl fmt::Display for OffsetKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut encoded = String::new();
        self.encode_into(&mut encoded);
        f.write_str(&encoded)
    }
}

impl FromStr for OffsetKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        let mut parts = s.split('#');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(topic), Some(client), Some(partition), None) => {
                Self::parse_parts(topic, client, partition)
            }
            _ => Err(KeyError::Malformed {
                kind: "offset key",
                value: s.to_owned(),
                why: "expected topic#client#partition",
            }),
        }
    }
}

/// The key of one pull cursor: `topic#partition` (lite: `parent#lite@queue`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PullKey {
    /// The topic (a lite channel's parent).
    pub topic: Topic,
    /// The partition (a lite channel's `lite@queue`).
    pub partition: PartitionId,
}

impl PullKey {
    /// Builds a key from validated parts.
    pub fn new(topic: Topic, partition: PartitionId) -> Self {
        PullKey { topic, partition }
    }

    /// The key of a lite channel: `parent#lite@queue`.
    pub fn lite(parent: Topic, lite: &str, queue: u32) -> Result<Self, KeyError> {
        Ok(PullKey {
            topic: parent,
            partition: PartitionId::lite(lite, queue)?,
        })
    }
}

impl fmt::Display for PullKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.topic, self.partition)
    }
}

impl FromStr for PullKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        match s.split_once('#') {
            Some((topic, partition)) => Ok(PullKey {
                topic: Topic::new(topic)?,
                partition: PartitionId::new(partition)?,
            }),
            None => Err(KeyError::Malformed {
                kind: "pull key",
                value: s.to_owned(),
                why: "expected topic#partition",
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_reject_separators_and_empty() {
        assert!(Topic::new("orders").is_ok());
        assert!(Topic::new("orders.v2_x-y").is_ok());
        for bad in ["", "a#b", "a@b", "tab\there"] {
            assert!(Topic::new(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Topic::new("x".repeat(MAX_TOPIC_BYTES_WITH_ROOM)).is_ok());
        // 246..=249 bytes used to be valid, and their `<topic>_DLQ` was not.
        assert!(matches!(
            Topic::new("x".repeat(MAX_TOPIC_BYTES_WITH_ROOM + 1)),
            Err(KeyError::NoRoomForDeadLetters { len: 246, .. })
        ));
        let dead = format!("{}_DLQ", "x".repeat(MAX_TOPIC_BYTES_WITH_ROOM));
        assert!(Topic::new(dead).is_ok(), "a dead-letter topic uses all 249");
        assert!(matches!(
            Topic::new("x".repeat(MAX_TOPIC_BYTES + 1)),
            Err(KeyError::TooLong { .. })
        ));
    }

    #[test]
    fn client_ids_reject_reserved_forms() {
        assert!(ClientId::new("client-1").is_ok());
        assert!(ClientId::new("a@b").is_ok(), "@ is allowed in client ids");
        assert!(ClientId::new("__leading").is_ok());
        assert!(ClientId::new("trailing__").is_ok());
        for bad in ["", "a#b", "__mqcursor__", "__x__", "____"] {
            assert!(ClientId::new(bad).is_err(), "{bad:?} accepted");
        }
        assert!(matches!(
            ClientId::new("__x__"),
            Err(KeyError::ReservedClientId(_))
        ));
    }

    #[test]
    fn group_names_follow_the_charset() {
        assert!(GroupName::new("Group_1.a-b").is_ok());
        assert!(GroupName::new("g".repeat(128)).is_ok());
        // BROADCAST groups live in their own namespace.
        let own = GroupName::broadcast("billing").unwrap();
        assert_eq!(own.as_str(), "~billing");
        assert!(own.is_broadcast());
        assert_ne!(own, GroupName::named("billing").unwrap());
        assert!(GroupName::named("~billing").is_err());
        assert!(GroupName::broadcast("~x").is_err());
        assert!(GroupName::broadcast("a b").is_err());
        assert_eq!(
            GroupName::new("~billing").unwrap(),
            own,
            "stored keys parse back"
        );
        for bad in ["", "a b", "a#b", "a@b", "é", &"g".repeat(129)] {
            assert!(GroupName::new(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn partition_ids_have_three_forms() {
        assert_eq!(
            PartitionId::new("0").unwrap().kind(),
            PartitionKind::Number(0)
        );
        assert_eq!(
            PartitionId::new("4294967295").unwrap().kind(),
            PartitionKind::Number(u32::MAX)
        );
        assert_eq!(
            PartitionId::new("broker-a:3").unwrap().kind(),
            PartitionKind::Queue {
                broker: "broker-a",
                queue_id: 3
            }
        );
        assert_eq!(
            PartitionId::new("chat-42@7").unwrap().kind(),
            PartitionKind::Lite {
                lite: "chat-42",
                queue: 7
            }
        );
        for bad in [
            "",
            "-1",
            "01",
            "4294967296",
            "a",
            ":1",
            "b:",
            "b:x",
            "@1",
            "l@",
            "a#1",
            "l@b:1@2",
            "a:b:1",
        ] {
            assert!(PartitionId::new(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn offset_keys_round_trip_including_cursors() {
        let group = GroupName::new("billing").unwrap();
        let cases = [
            (
                "orders",
                OffsetClient::Client(ClientId::new("c-1").unwrap()),
                "0",
                "orders#c-1#0",
            ),
            (
                "orders",
                OffsetClient::MqCursor(None),
                "2",
                "orders#__mqcursor__#2",
            ),
            (
                "orders",
                OffsetClient::MqCursor(Some(group.clone())),
                "broker-a:1",
                "orders#__mqcursor@billing__#broker-a:1",
            ),
            (
                "orders",
                OffsetClient::MqLost(None),
                "3",
                "orders#__mqlost__#3",
            ),
            (
                "orders",
                OffsetClient::MqLost(Some(group)),
                "0",
                "orders#__mqlost@billing__#0",
            ),
        ];
        for (topic, client, partition, text) in cases {
            let key = OffsetKey::new(
                Topic::new(topic).unwrap(),
                client,
                PartitionId::new(partition).unwrap(),
            );
            assert_eq!(key.to_string(), text);
            assert_eq!(text.parse::<OffsetKey>().unwrap(), key);
        }
        for bad in [
            "orders#c-1",
            "orders#c#0#x",
            "orders#__other__#0",
            "orders#__mqcursor@bad name__#0",
            "orders#__mqcursor@__#0",
            "orders#__mqlost@bad name__#0",
            "#c#0",
        ] {
            assert!(bad.parse::<OffsetKey>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn pull_keys_include_the_lite_layout() {
        let key = PullKey::lite(Topic::new("parent").unwrap(), "chat", 3).unwrap();
        assert_eq!(key.to_string(), "parent#chat@3");
        assert_eq!("parent#chat@3".parse::<PullKey>().unwrap(), key);
        assert_eq!(
            "orders#5".parse::<PullKey>().unwrap().partition.kind(),
            PartitionKind::Number(5)
        );
        assert!("orders".parse::<PullKey>().is_err());
        assert!("orders#5#6".parse::<PullKey>().is_err());
    }
}
