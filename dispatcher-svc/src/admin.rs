//! The operator's `eventmesh.v1.AdminService`: offset resets routed through the dispatcher,
//! the only writer of a group's progress, so no live group writes over them
//! ([`crate::registry::Shared::reset_offsets`]); the cluster as this instance sees it.

use std::sync::Arc;

use eventmesh_common::keys::{ClientId, GroupName, OffsetClient, PartitionId, Topic};
use eventmesh_common::status::FieldError;
use eventmesh_proto::client as pb;
use eventmesh_proto::client::admin_service_server::AdminService;
use eventmesh_proto::client::reset_offsets_request::Target;
use tonic::{Request, Response, Status};

use crate::cluster::keys::parse_group_path;
use crate::cluster::now_millis;
use crate::group::GroupReport;
use crate::registry::{GroupKey, Shared};

/// The service.
#[derive(Clone)]
pub struct AdminGrpc {
    shared: Arc<Shared>,
    advertise: String,
}

impl AdminGrpc {
    /// Serves over `shared`; `advertise` is this instance's client-facing address.
    pub fn new(shared: Arc<Shared>, advertise: String) -> Self {
        AdminGrpc { shared, advertise }
    }
}

#[tonic::async_trait]
impl AdminService for AdminGrpc {
    #[tracing::instrument(skip_all, fields(topic = %request.get_ref().topic))]
    async fn describe_groups(
        &self,
        request: Request<pb::DescribeGroupsRequest>,
    ) -> Result<Response<pb::DescribeGroupsResponse>, Status> {
        let topic = request.into_inner().topic;
        let groups = self
            .shared
            .group_reports()
            .into_iter()
            .filter(|group| topic.is_empty() || group.key.topic.as_str() == topic)
            .map(|group| group_status(&group.key, group.report))
            .collect();
        Ok(Response::new(pb::DescribeGroupsResponse {
            instance_id: self.shared.instance_id.clone(),
            groups,
        }))
    }

    #[tracing::instrument(skip_all, fields(topic = %request.get_ref().topic))]
    async fn reset_offsets(
        &self,
        request: Request<pb::ResetOffsetsRequest>,
    ) -> Result<Response<pb::ResetOffsetsResponse>, Status> {
        let request = request.into_inner();
        let topic = Topic::new(request.topic).map_err(|e| FieldError::new("topic", e))?;
        let client = match request.target {
            Some(Target::Group(group)) if group.is_empty() => OffsetClient::MqCursor(None),
            Some(Target::Group(group)) => OffsetClient::MqCursor(Some(
                GroupName::new(group).map_err(|e| FieldError::new("group", e))?,
            )),
            Some(Target::ClientId(client)) => OffsetClient::Client(
                ClientId::new(client).map_err(|e| FieldError::new("client_id", e))?,
            ),
            None => {
                return Err(FieldError::new("target", "name a group or a client_id").into());
            }
        };
        let partition = match request.partition.as_str() {
            "" => None,
            text => Some(PartitionId::new(text).map_err(|e| FieldError::new("partition", e))?),
        };
        if request.offset < -1 {
            return Err(FieldError::new(
                "offset",
                format!("{} is below -1 (-1: nothing settled)", request.offset),
            )
            .into());
        }
        if request.reason.trim().is_empty() {
            return Err(FieldError::new("reason", "must say why").into());
        }
        let (previous, sessions_ended) = self
            .shared
            .reset_offsets(
                &topic,
                client,
                partition,
                request.offset,
                request.reason.trim(),
            )
            .await?;
        Ok(Response::new(pb::ResetOffsetsResponse {
            changed: previous
                .into_iter()
                .map(|(partition, previous)| pb::ResetOffset {
                    partition,
                    previous,
                    offset: request.offset,
                })
                .collect(),
            sessions_ended,
        }))
    }

    async fn describe_cluster(
        &self,
        _request: Request<pb::DescribeClusterRequest>,
    ) -> Result<Response<pb::DescribeClusterResponse>, Status> {
        let shared = &self.shared;
        let Some(cluster) = &shared.cluster else {
            let load = shared.meter.sample();
            return Ok(Response::new(pb::DescribeClusterResponse {
                instance_id: shared.instance_id.clone(),
                clustered: false,
                instances: vec![pb::InstanceLoad {
                    instance_id: shared.instance_id.clone(),
                    address: self.advertise.clone(),
                    load_known: true,
                    active_sessions: load.active_sessions,
                    inflow_bytes_per_sec: load.inflow_bytes_per_sec,
                    outflow_bytes_per_sec: load.outflow_bytes_per_sec,
                    cpu_load: load.cpu_load,
                    reported_unix_ms: now_millis() as i64,
                    score: load.score(),
                }],
                homes: Vec::new(),
            }));
        };
        let description = cluster.describe();
        let instances = description
            .instances
            .into_iter()
            .map(|(instance_id, record)| {
                let load = record.load.unwrap_or_default();
                pb::InstanceLoad {
                    instance_id,
                    score: record.score(),
                    address: record.address,
                    load_known: record.load.is_some(),
                    active_sessions: load.active_sessions,
                    inflow_bytes_per_sec: load.inflow_bytes_per_sec,
                    outflow_bytes_per_sec: load.outflow_bytes_per_sec,
                    cpu_load: load.cpu_load,
                    reported_unix_ms: record.ts_millis as i64,
                }
            })
            .collect();
        let homes = description
            .homes
            .into_iter()
            .filter_map(|(path, value)| {
                let (topic, group) = parse_group_path(&path)?;
                let (instance_id, address) = value.split_once('|')?;
                Some(pb::GroupHome {
                    topic,
                    group,
                    instance_id: instance_id.to_owned(),
                    address: address.to_owned(),
                })
            })
            .collect();
        Ok(Response::new(pb::DescribeClusterResponse {
            instance_id: shared.instance_id.clone(),
            clustered: true,
            instances,
            homes,
        }))
    }
}

/// A group's report as the API states it.
fn group_status(key: &GroupKey, report: GroupReport) -> pb::GroupStatus {
    pb::GroupStatus {
        topic: key.topic.to_string(),
        group: key
            .group
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default(),
        sessions: report.sessions,
        in_flight: report.counts.in_flight,
        ready: report.counts.ready,
        backoff: report.counts.backoff,
        settling: report.counts.settling,
        oldest_unacked_ms: report.oldest_unacked_age.as_millis() as u64,
        delivered_total: report.delivered_total,
        acked_total: report.acked_total,
        nacked_total: report.nacked_total,
        redelivered_total: report.redelivered_total,
        timed_out_total: report.timed_out_total,
        dead_lettered_total: report.dead_lettered_total,
        partitions: report
            .partitions
            .into_iter()
            .map(|(partition, durable_watermark)| pb::PartitionProgress {
                partition: partition.to_string(),
                durable_watermark,
            })
            .collect(),
        reported_unix_ms: report.reported_unix_ms,
    }
}
