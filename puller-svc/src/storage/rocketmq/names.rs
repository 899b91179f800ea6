//! RocketMQ names: what the broker accepts, and the internal names we derive.
//!
//! RocketMQ names allow `[%|a-zA-Z0-9_-]`; a topic at most 127 characters, a consumer group at
//! most 255 (the broker's limits). Our topics allow more (`.`, `/`, …): a topic RocketMQ
//! cannot name is refused with the rule, never mangled, so two of our topics can never land on
//! one broker topic. The topic's dead-letter topic (`<topic>_DLQ`) must fit too.
//!
//! Internal names are derived injectively from our group names (`[A-Za-z0-9._-]{1,128}`, or `~`
//! and a client id for a BROADCAST client's own group): `.` becomes `|` and `~` becomes `%`,
//! two characters our group names never hold, so distinct groups give distinct broker groups.
//! Every group name of ours fits as a POP group with its epoch suffix (at most 160 characters).

use eventmesh_common::keys::{GroupName, Topic};

use super::epochs::EPOCH_SUFFIX_CHARS;
#[cfg(doc)]
use super::epochs::Epochs;
use crate::storage::StorageError;

/// Longest RocketMQ topic name.
pub const MAX_NAME_CHARS: usize = 127;
/// Longest RocketMQ consumer group name (the broker's `SUBSCRIPTION_GROUP_NAME_MAX_LENGTH`).
pub const MAX_GROUP_CHARS: usize = 255;
/// The consumer group the `rocketmq4` backend pulls under: one fixed name, never committed to.
pub const PULL_GROUP: &str = "eventmesh-puller-pull";
/// The producer group of the puller's sends.
pub const PRODUCER_GROUP: &str = "eventmesh-puller-producer";
/// Prefix of every POP consumer group (`rocketmq5`).
const POP_GROUP_PREFIX: &str = "eventmesh-pop";

/// The characters RocketMQ allows in a name.
fn legal(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '%' | '|' | '_' | '-')
}

/// The rule, for error messages.
pub const NAME_RULE: &str = "RocketMQ names use [%|a-zA-Z0-9_-], at most 127 characters";
/// The rule for consumer groups, for error messages.
pub const GROUP_RULE: &str = "RocketMQ consumer groups use [%|a-zA-Z0-9_-], at most 255 characters";

/// Refuses a topic RocketMQ cannot name (itself or its `<topic>_DLQ`), naming the rule.
pub fn check_topic(topic: &Topic) -> Result<(), StorageError> {
    let name = topic.as_str();
    // The longer of the two (a dead-letter topic is its own dead-letter topic).
    let dead_letters = eventmesh_common::dead_letter::dlq_topic(name);
    if !name.chars().all(legal) || dead_letters.len() > MAX_NAME_CHARS {
        return Err(StorageError::Invalid(format!(
            "topic name {name:?} cannot be a RocketMQ topic: {NAME_RULE} \
             (its dead-letter topic {dead_letters:?} too)"
        )));
    }
    Ok(())
}

/// The broker consumer group a subscription group POPs under: one per group, so groups never
/// split or share messages (the topic's default group has its own). Checked with the epoch
/// suffix every POP group carries ([`Epochs::group_name`]).
pub fn pop_group(group: Option<&GroupName>) -> Result<String, StorageError> {
    let Some(group) = group else {
        return Ok(POP_GROUP_PREFIX.to_owned());
    };
    let mapped: String = group
        .as_str()
        .chars()
        .map(|c| match c {
            '.' => '|',
            '~' => '%',
            c => c,
        })
        .collect();
    let name = format!("{POP_GROUP_PREFIX}_{mapped}");
    if name.len() + EPOCH_SUFFIX_CHARS > MAX_GROUP_CHARS || !name.chars().all(legal) {
        return Err(StorageError::Invalid(format!(
            "group {group:?} cannot be a RocketMQ consumer group as {name:?} and its epoch \
             suffix: {GROUP_RULE}"
        )));
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn topics_rocketmq_cannot_name_are_refused_with_the_rule() {
        assert!(check_topic(&Topic::new("orders_v2-EU%|x").unwrap()).is_ok());
        for bad in ["orders.v2", "a/b", "with space", "é"] {
            let err = check_topic(&Topic::new(bad).unwrap()).unwrap_err();
            assert!(err.to_string().contains(NAME_RULE), "{err}");
            assert!(matches!(err, StorageError::Invalid(_)));
        }
        // 123 characters fit with `_DLQ`; 124 do not.
        assert!(check_topic(&Topic::new("t".repeat(123)).unwrap()).is_ok());
        assert!(check_topic(&Topic::new("t".repeat(124)).unwrap()).is_err());
        assert!(check_topic(&Topic::new(format!("{}_DLQ", "t".repeat(123))).unwrap()).is_ok());
    }

    #[test]
    fn pop_groups_are_distinct_for_distinct_groups() {
        let names: Vec<String> = [None, Some("a.b"), Some("a|b"), Some("a_b"), Some("~client")]
            .into_iter()
            .filter_map(|g| match g {
                None => Some(pop_group(None).unwrap()),
                Some(g) => GroupName::new(g).ok().map(|g| pop_group(Some(&g)).unwrap()),
            })
            .collect();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        assert_eq!(names[1], "eventmesh-pop_a|b");
        assert!(names.iter().all(|n| n.chars().all(legal)));
    }

    #[test]
    fn every_group_of_ours_fits_the_broker_with_its_epoch() {
        // The longest names our groups can have: a named group of 128 characters, and a
        // BROADCAST client's own group (`~` and a 128-character client id).
        for group in ["g".repeat(128), format!("~{}", "c".repeat(128))] {
            let group = GroupName::new(group).unwrap();
            let name = pop_group(Some(&group)).unwrap();
            let longest = super::super::epochs::Epochs::group_name(&name, u64::MAX);
            assert!(longest.len() <= MAX_GROUP_CHARS, "{longest}");
            assert!(longest.chars().all(legal), "{longest}");
        }
    }
}
