//! dispatcher-svc's errors and their one mapping to `tonic::Status`.

use eventmesh_common::status::{ClassifiedError, ErrorClass, FieldError, to_status};
use tonic::Status;

/// What can go wrong serving a client.
#[derive(Debug, thiserror::Error)]
pub enum DispatcherError {
    /// A request field is invalid.
    #[error(transparent)]
    InvalidArgument(#[from] FieldError),
    /// An event exceeds the frame limits.
    #[error("event too large: {0}")]
    TooLarge(String),
    /// The stream broke the protocol (for example a second Open).
    #[error("{0}")]
    Protocol(String),
    /// A co-located service (puller-svc, offset-svc) did not answer.
    #[error("{service} unavailable: {status}")]
    Dependency {
        /// Which service.
        service: &'static str,
        /// Its status.
        status: Status,
    },
    /// The instance is shutting down or the group is closing.
    #[error("{0}")]
    ShuttingDown(String),
    /// The group's home is another instance: the client is to open its session there
    /// (FAILED_PRECONDITION with the home in the metadata, see [`HOME_INSTANCE_HEADER`]).
    #[error(
        "subscription group {group} is served by its home instance {instance} at {address}; open the session there"
    )]
    HomeElsewhere {
        /// The group.
        group: String,
        /// The home's id.
        instance: String,
        /// The home's client-facing address.
        address: String,
    },
    /// etcd could not be used (unreachable, not registered yet, or the lease was lost).
    #[error("cluster coordination unavailable: {0}")]
    Cluster(String),
}

/// Status metadata naming a group's home instance (with FAILED_PRECONDITION).
pub const HOME_INSTANCE_HEADER: &str = "em-home-instance";
/// Status metadata naming a group's home address, `host:port`.
pub const HOME_ADDRESS_HEADER: &str = "em-home-address";

impl From<crate::cluster::ClusterError> for DispatcherError {
    fn from(err: crate::cluster::ClusterError) -> Self {
        match err {
            crate::cluster::ClusterError::HomeElsewhere {
                group,
                instance,
                address,
            } => DispatcherError::HomeElsewhere {
                group,
                instance,
                address,
            },
            other => DispatcherError::Cluster(other.to_string()),
        }
    }
}

impl DispatcherError {
    /// An invalid field.
    pub fn invalid(field: impl Into<String>, why: impl Into<String>) -> Self {
        DispatcherError::InvalidArgument(FieldError::new(field, why.into()))
    }

    /// A dependency's failure; its own INVALID_ARGUMENT / NOT_FOUND answers are passed on.
    pub fn dependency(service: &'static str, status: Status) -> Self {
        DispatcherError::Dependency { service, status }
    }
}

impl ClassifiedError for DispatcherError {
    fn class(&self) -> ErrorClass {
        match self {
            DispatcherError::InvalidArgument(_) => ErrorClass::InvalidArgument,
            DispatcherError::TooLarge(_) => ErrorClass::ResourceExhausted,
            DispatcherError::Protocol(_) => ErrorClass::FailedPrecondition,
            DispatcherError::Dependency { status, .. } => match status.code() {
                tonic::Code::InvalidArgument => ErrorClass::InvalidArgument,
                tonic::Code::NotFound => ErrorClass::NotFound,
                tonic::Code::FailedPrecondition => ErrorClass::FailedPrecondition,
                _ => ErrorClass::Unavailable,
            },
            DispatcherError::ShuttingDown(_) => ErrorClass::Unavailable,
            DispatcherError::HomeElsewhere { .. } => ErrorClass::FailedPrecondition,
            DispatcherError::Cluster(_) => ErrorClass::Unavailable,
        }
    }
}

impl From<DispatcherError> for Status {
    fn from(err: DispatcherError) -> Status {
        let mut status = to_status(&err);
        if let DispatcherError::HomeElsewhere {
            instance, address, ..
        } = &err
        {
            let metadata = status.metadata_mut();
            for (name, value) in [
                (HOME_INSTANCE_HEADER, instance),
                (HOME_ADDRESS_HEADER, address),
            ] {
                // Ids and addresses are ASCII; one that is not is left out rather than mangled.
                if let Ok(value) = value.parse() {
                    metadata.insert(name, value);
                }
            }
        }
        status
    }
}
