//! The one mapping from service errors to `tonic::Status`.
//!
//! Every library error type implements [`ClassifiedError`] and converts through
//! [`to_status`], so all services answer the same situation with the same code:
//!
//! | class | gRPC code | client should |
//! | --- | --- | --- |
//! | `InvalidArgument` | INVALID_ARGUMENT | fix the request |
//! | `NotFound` | NOT_FOUND | fix the request |
//! | `FailedPrecondition` | FAILED_PRECONDITION | change state first |
//! | `ResourceExhausted` | RESOURCE_EXHAUSTED | retry with backoff |
//! | `Unavailable` | UNAVAILABLE | retry (a dependency or the service is down) |
//! | `Internal` | INTERNAL | report a bug; details are logged, not returned |

use tonic::{Code, Status};

/// How an error should be reported to a gRPC caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The request is malformed.
    InvalidArgument,
    /// The request names something that does not exist.
    NotFound,
    /// The request is valid but the state does not allow it.
    FailedPrecondition,
    /// A quota or bound is exceeded.
    ResourceExhausted,
    /// A dependency or the service itself is temporarily unavailable.
    Unavailable,
    /// A bug or a corrupted state.
    Internal,
}

/// An error that knows its [`ErrorClass`].
pub trait ClassifiedError: std::error::Error {
    /// The class of this error.
    fn class(&self) -> ErrorClass;
}

impl ClassifiedError for crate::keys::KeyError {
    fn class(&self) -> ErrorClass {
        ErrorClass::InvalidArgument
    }
}

impl ClassifiedError for crate::frame::FrameError {
    fn class(&self) -> ErrorClass {
        ErrorClass::InvalidArgument
    }
}

/// Converts an error into the status a caller sees. Internal errors are logged with their
/// full chain and answered with a generic message, so no internals leak.
pub fn to_status<E: ClassifiedError + ?Sized>(err: &E) -> Status {
    let code = match err.class() {
        ErrorClass::InvalidArgument => Code::InvalidArgument,
        ErrorClass::NotFound => Code::NotFound,
        ErrorClass::FailedPrecondition => Code::FailedPrecondition,
        ErrorClass::ResourceExhausted => Code::ResourceExhausted,
        ErrorClass::Unavailable => Code::Unavailable,
        ErrorClass::Internal => {
            tracing::error!(error = %error_chain(err), "internal error");
            return Status::internal("internal error; see the server log");
        }
    };
    Status::new(code, error_chain(err))
}

/// Renders an error and its sources as `outer: inner: innermost`.
pub fn error_chain(err: &(impl std::error::Error + ?Sized)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // thiserror's `#[error("...: {0}")]` already embeds the source; skip repeats.
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// An invalid request field: which field, and why. Its message reads
/// `invalid entries[3].key.topic: topic "a#b" must not contain '#'`.
#[derive(Debug, thiserror::Error)]
#[error("invalid {field}: {source}")]
pub struct FieldError {
    /// The field path.
    pub field: String,
    /// What is wrong with it.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl FieldError {
    /// A field error from any error.
    pub fn new(
        field: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        FieldError {
            field: field.into(),
            source: source.into(),
        }
    }
}

impl ClassifiedError for FieldError {
    fn class(&self) -> ErrorClass {
        ErrorClass::InvalidArgument
    }
}

impl From<FieldError> for Status {
    fn from(err: FieldError) -> Status {
        to_status(&err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::Topic;

    #[test]
    fn field_errors_are_invalid_argument_with_the_path() {
        let err = FieldError::new("entries[3].key.topic", Topic::new("a#b").unwrap_err());
        let status = Status::from(err);
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(
            status.message(),
            "invalid entries[3].key.topic: topic \"a#b\" must not contain '#'"
        );
    }

    #[derive(Debug, thiserror::Error)]
    #[error("disk on fire")]
    struct Boom;
    impl ClassifiedError for Boom {
        fn class(&self) -> ErrorClass {
            ErrorClass::Internal
        }
    }

    #[test]
    fn internal_errors_do_not_leak_details() {
        let status = to_status(&Boom);
        assert_eq!(status.code(), Code::Internal);
        assert!(!status.message().contains("fire"));
    }
}
