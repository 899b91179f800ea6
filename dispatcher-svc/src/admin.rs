//! The operator's `eventmesh.v1.AdminService`: offset resets routed through the dispatcher,
//! the only writer of a group's progress, so no live group writes over them
//! ([`crate::registry::Shared::reset_offsets`]).

use std::sync::Arc;

use eventmesh_common::keys::{ClientId, GroupName, OffsetClient, PartitionId, Topic};
use eventmesh_common::status::FieldError;
use eventmesh_proto::client as pb;
use eventmesh_proto::client::admin_service_server::AdminService;
use eventmesh_proto::client::reset_offsets_request::Target;
use tonic::{Request, Response, Status};

use crate::registry::Shared;

/// The service.
#[derive(Clone)]
pub struct AdminGrpc {
    shared: Arc<Shared>,
}

impl AdminGrpc {
    /// Serves over `shared`.
    pub fn new(shared: Arc<Shared>) -> Self {
        AdminGrpc { shared }
    }
}

#[tonic::async_trait]
impl AdminService for AdminGrpc {
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
}
