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
        }
    }
}

impl From<DispatcherError> for Status {
    fn from(err: DispatcherError) -> Status {
        to_status(&err)
    }
}
