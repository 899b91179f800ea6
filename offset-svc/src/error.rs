//! Errors of the offset service and their gRPC status (through the common mapping).

use eventmesh_common::status::{ClassifiedError, ErrorClass, to_status};

/// Everything that can go wrong in offset-svc.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The RocksDB database could not be opened.
    #[error("cannot open the offset store at {path}: {source}")]
    Open {
        /// The database directory.
        path: std::path::PathBuf,
        /// RocksDB's error.
        source: rocksdb::Error,
    },
    /// The data directory could not be created.
    #[error("cannot create the data directory {path}: {source}")]
    DataDir {
        /// The directory.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A write did not become durable; nothing of it was applied.
    #[error("offset store write failed: {0}")]
    Write(#[source] rocksdb::Error),
    /// The write would have waited for the store to catch up (RocksDB's write stall); nothing
    /// of it was applied. Only [`OffsetStore::write_batch_without_waiting`] meets it, and
    /// writes the usual way instead.
    ///
    /// [`OffsetStore::write_batch_without_waiting`]: crate::store::OffsetStore::write_batch_without_waiting
    #[error("the offset store would stall this write")]
    WouldStall,
    /// Flushing to disk failed.
    #[error("offset store flush failed: {0}")]
    Flush(#[source] rocksdb::Error),
    /// Reading the database failed.
    #[error("offset store read failed: {0}")]
    Read(#[source] rocksdb::Error),
    /// A stored value does not decode.
    #[error("stored value of key {key:?} is corrupt: {why}")]
    CorruptValue {
        /// The key.
        key: String,
        /// What is wrong.
        why: String,
    },
    /// A stored key does not parse as `topic#client#partition`.
    #[error("stored key {0:?} is not a valid offset key")]
    CorruptKey(String),
    /// A write of a negative offset.
    #[error(
        "offset {offset} for {key} is below -1; offsets are MQ offsets >= 0 (or -1: a start marker)"
    )]
    NegativeOffset {
        /// The key.
        key: String,
        /// The value.
        offset: i64,
    },
    /// An operator action without a reason.
    #[error("operator actions need a non-empty reason")]
    MissingReason,
    /// A blocking task died.
    #[error("offset store task failed: {0}")]
    Task(String),
    /// Serving failed.
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// Binding the listen address failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A bug: an invariant did not hold.
    #[error("internal invariant violated: {0}")]
    Internal(&'static str),
}

impl ClassifiedError for Error {
    fn class(&self) -> ErrorClass {
        match self {
            Error::NegativeOffset { .. } | Error::MissingReason => ErrorClass::InvalidArgument,
            Error::Write(_)
            | Error::Flush(_)
            | Error::Read(_)
            | Error::Open { .. }
            | Error::DataDir { .. }
            | Error::WouldStall => ErrorClass::Unavailable,
            Error::CorruptValue { .. }
            | Error::CorruptKey(_)
            | Error::Task(_)
            | Error::Serve(_)
            | Error::Bind { .. }
            | Error::Internal(_) => ErrorClass::Internal,
        }
    }
}

impl From<tokio::task::JoinError> for Error {
    fn from(err: tokio::task::JoinError) -> Self {
        Error::Task(err.to_string())
    }
}

impl From<Error> for tonic::Status {
    fn from(err: Error) -> tonic::Status {
        to_status(&err)
    }
}
