//! What the RocketMQ backends (`rocketmq4`: PULL from our own cursors; `rocketmq5`: POP with
//! the broker ACK deferred to the client's ACK) share: the client and its runtime, the name
//! rules, and the conversion of messages in and out.

pub mod client;
pub mod epochs;
pub mod inspect;
pub mod message;
pub mod names;
pub mod reads;
pub mod sends;
