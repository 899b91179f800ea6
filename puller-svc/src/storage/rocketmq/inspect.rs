//! What bounds a RocketMQ topic's storage, read from its brokers (the `DescribeBrokerStorage`
//! RPC, `emctl rocketmq-check`).
//!
//! The seed's open item: on 4.x we never commit an offset, so nothing we do lets the broker
//! trim anything; storage is bounded only by the broker's own time-based deletion of commit-log
//! files (`fileReservedTime`), with the consume queues expected to be trimmed in step. Whether
//! they are is checked per deployment: for every queue, the commit-log position of its lowest
//! indexed entry against its broker's lowest commit-log offset still on disk.
//!
//! Per broker: `GET_BROKER_RUNTIME_INFO` (`commitLogMinOffset`, `commitLogMaxOffset`,
//! `commitLogDiskRatio`) and `GET_BROKER_CONFIG` (`fileReservedTime`, `deleteWhen`). Per queue:
//! its range (`GET_MIN_OFFSET`/`GET_MAX_OFFSET`), then `QUERY_CONSUME_QUEUE` of the entry at
//! the minimum. Read-only.

use std::collections::{BTreeMap, HashMap};

use cheetah_string::CheetahString;
use eventmesh_common::keys::Topic;
use rocketmq_protocol::protocol::header::empty_header::EmptyHeader;
use rocketmq_protocol::protocol::header::query_consume_queue_request_header::QueryConsumeQueueRequestHeader;
use rocketmq_protocol::{RemotingCommand, RequestCode};

use super::client::{QueueRef, RocketMqClient, broker_header};
use crate::storage::StorageError;
use crate::storage::report::{BrokerStorage, BrokerStorageReport, QueueStorage};

/// Reads the storage report of `topic` from its brokers.
pub async fn describe(
    client: &RocketMqClient,
    topic: &Topic,
) -> Result<BrokerStorageReport, StorageError> {
    let route = client.route(topic).await?;
    let brokers: BTreeMap<&str, &str> = route
        .read
        .iter()
        .map(|q| Ok((q.broker.as_str(), route.master(&q.broker)?)))
        .collect::<Result<_, StorageError>>()?;
    let brokers = futures::future::try_join_all(
        brokers
            .into_iter()
            .map(|(broker, address)| describe_broker(client, broker, address)),
    )
    .await?;
    let queues = futures::future::try_join_all(route.read.iter().map(|queue| {
        let address = route.master(&queue.broker);
        async move { describe_queue(client, topic, queue, address?).await }
    }))
    .await?;
    Ok(BrokerStorageReport { brokers, queues })
}

async fn describe_broker(
    client: &RocketMqClient,
    broker: &str,
    address: &str,
) -> Result<BrokerStorage, StorageError> {
    let runtime = client
        .admin(
            &format!("runtime information request to {broker}"),
            address.into(),
            RemotingCommand::create_request_command(
                RequestCode::GetBrokerRuntimeInfo,
                EmptyHeader {},
            ),
        )
        .await?;
    let runtime = runtime_table(runtime.body().map(|b| &b[..]).unwrap_or_default())
        .map_err(|problem| answer_error(broker, "runtime information", &problem))?;
    let config = client
        .admin(
            &format!("configuration request to {broker}"),
            address.into(),
            RemotingCommand::create_request_command(RequestCode::GetBrokerConfig, EmptyHeader {}),
        )
        .await?;
    let config = config_lines(config.body().map(|b| &b[..]).unwrap_or_default());
    let number = |name: &str| -> Result<i64, StorageError> {
        runtime
            .get(name)
            .and_then(|v| v.trim().parse::<i64>().ok())
            .ok_or_else(|| {
                answer_error(
                    broker,
                    "runtime information",
                    &format!("no number `{name}`"),
                )
            })
    };
    Ok(BrokerStorage {
        broker: broker.to_owned(),
        address: address.to_owned(),
        commit_log_min_offset: number("commitLogMinOffset")?,
        commit_log_max_offset: number("commitLogMaxOffset")?,
        file_reserved_hours: config
            .get("fileReservedTime")
            .and_then(|v| v.trim().parse().ok()),
        delete_when: config.get("deleteWhen").map(|v| v.trim().to_owned()),
        commit_log_disk_ratio: runtime
            .get("commitLogDiskRatio")
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|r| (0.0..=1.0).contains(r)),
    })
}

async fn describe_queue(
    client: &RocketMqClient,
    topic: &Topic,
    queue: &QueueRef,
    address: &str,
) -> Result<QueueStorage, StorageError> {
    let (min_offset, max_offset) = client.queue_range(topic, queue).await?;
    let min_entry_commit_log_offset = if max_offset > min_offset {
        let request = RemotingCommand::create_request_command(
            RequestCode::QueryConsumeQueue,
            QueryConsumeQueueRequestHeader {
                topic: topic.as_str().into(),
                queue_id: queue.queue_id as i32,
                index: min_offset,
                count: 1,
                consumer_group: None,
                topic_request_header: broker_header(&queue.broker),
            },
        );
        let answer = client
            .admin(
                &format!("consume-queue query of {topic} {}", queue.partition),
                CheetahString::from(address),
                request,
            )
            .await?;
        first_entry_position(answer.body().map(|b| &b[..]).unwrap_or_default())
    } else {
        None
    };
    Ok(QueueStorage {
        partition: queue.partition.clone(),
        min_offset,
        max_offset,
        min_entry_commit_log_offset,
    })
}

fn answer_error(broker: &str, what: &str, problem: &str) -> StorageError {
    StorageError::Unavailable(format!(
        "rocketmq broker {broker} answered its {what} in a form not understood: {problem}"
    ))
}

/// The `{"table": {...}}` of a runtime-information answer.
fn runtime_table(body: &[u8]) -> Result<HashMap<String, String>, String> {
    #[derive(serde::Deserialize)]
    struct Table {
        table: HashMap<String, String>,
    }
    serde_json::from_slice::<Table>(body)
        .map(|t| t.table)
        .map_err(|err| err.to_string())
}

/// The `key:value` lines of a configuration answer (Java's properties as the broker writes
/// them); lines without a `:` are skipped.
fn config_lines(body: &[u8]) -> HashMap<String, String> {
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|line| {
            let (key, value) = line.split_once(':')?;
            Some((key.trim().to_owned(), value.to_owned()))
        })
        .collect()
}

/// The commit-log offset of the first entry of a consume-queue query's answer.
fn first_entry_position(body: &[u8]) -> Option<i64> {
    let answer: serde_json::Value = serde_json::from_slice(body).ok()?;
    answer
        .get("queueData")?
        .as_array()?
        .first()?
        .get("physicOffset")?
        .as_i64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_read_as_the_broker_writes_them() {
        let runtime =
            br#"{"table":{"commitLogMinOffset":"0","commitLogMaxOffset":"4096","x":"y"}}"#;
        let table = runtime_table(runtime).unwrap();
        assert_eq!(table["commitLogMaxOffset"], "4096");
        assert!(runtime_table(b"not json").is_err());

        let config =
            config_lines(b"fileReservedTime:72\ndeleteWhen:04\nbrokerIP1:127.0.0.1\nnoise\n");
        assert_eq!(config["fileReservedTime"], "72");
        assert_eq!(config["deleteWhen"], "04");
        // A value holding a `:` keeps it.
        assert_eq!(config["brokerIP1"], "127.0.0.1");
        assert!(!config.contains_key("noise"));

        let query = br#"{"queueData":[{"physicOffset":8192,"physicSize":300,"tagsCode":0}],"maxQueueIndex":9,"minQueueIndex":3}"#;
        assert_eq!(first_entry_position(query), Some(8192));
        assert_eq!(first_entry_position(br#"{"queueData":[]}"#), None);
        assert_eq!(first_entry_position(br#"{"queueData":null}"#), None);
        assert_eq!(first_entry_position(b""), None);
    }
}
