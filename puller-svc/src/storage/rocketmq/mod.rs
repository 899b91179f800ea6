//! What the RocketMQ backends (`rocketmq4`: PULL from our own cursors; `rocketmq5`: POP with
//! the broker ACK deferred to the client's ACK) share. Issue 13 builds them; so far only the
//! name rules are here.

pub mod names;
