//! Test-only helpers shared by the services' tests and benchmarks (a dev-dependency only).
//!
//! * [`KafkaBroker`] — a real Kafka-compatible broker (tansu) on loopback, started and stopped
//!   by `scripts/kafka.sh`, or the one named by `KAFKA_BOOTSTRAP`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A broker for a test: the one in `KAFKA_BOOTSTRAP`, or tansu started for the test on a free
/// loopback port (stopped, by its pid, when dropped).
#[derive(Debug)]
pub struct KafkaBroker {
    bootstrap: String,
    started_in: Option<tempfile::TempDir>,
}

impl KafkaBroker {
    /// The broker in `KAFKA_BOOTSTRAP` if set, else one of this test's own.
    ///
    /// # Panics
    /// When tansu cannot be started (`scripts/kafka.sh install` builds it).
    pub fn get() -> KafkaBroker {
        match std::env::var("KAFKA_BOOTSTRAP") {
            Ok(bootstrap) => KafkaBroker {
                bootstrap,
                started_in: None,
            },
            Err(_) => KafkaBroker::start_own(),
        }
    }

    /// A broker of this test's own (one it may freeze without disturbing anyone else).
    ///
    /// # Panics
    /// When tansu cannot be started (`scripts/kafka.sh install` builds it).
    pub fn start_own() -> KafkaBroker {
        let dir = tempfile::tempdir().expect("a temporary directory for tansu");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free loopback port")
            .port();
        let status = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(dir.path())
            .arg(port.to_string())
            .status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "could not start tansu (scripts/kafka.sh install builds it)"
        );
        KafkaBroker {
            bootstrap: format!("127.0.0.1:{port}"),
            started_in: Some(dir),
        }
    }

    /// `host:port` to bootstrap from.
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    /// Sends `signal` (`-STOP`, `-CONT`, …) to a broker this test started.
    ///
    /// # Panics
    /// For a broker from `KAFKA_BOOTSTRAP`, or when the signal cannot be sent.
    pub fn signal(&self, signal: &str) {
        let dir = self
            .started_in
            .as_ref()
            .expect("only our own broker is signalled");
        let pid = std::fs::read_to_string(dir.path().join("tansu.pid")).expect("tansu's pid file");
        let status = Command::new("kill").arg(signal).arg(pid.trim()).status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "kill {signal} {}",
            pid.trim()
        );
    }
}

impl Drop for KafkaBroker {
    fn drop(&mut self) {
        if let Some(dir) = &self.started_in {
            let _ = Command::new("bash")
                .arg(script())
                .arg("stop")
                .arg(dir.path())
                .status();
        }
    }
}

/// `scripts/kafka.sh` of the checkout being tested, found at run time: from the package
/// directory cargo names for the running test (or the working directory) upwards. Not the
/// compile-time `CARGO_MANIFEST_DIR`: a shared `CARGO_TARGET_DIR` reuses this crate's build
/// across checkouts, and the path baked into it may be another (since deleted) clone.
fn script() -> PathBuf {
    let start = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::current_dir().ok())
        .unwrap_or_default();
    start
        .ancestors()
        .map(|dir| dir.join("scripts/kafka.sh"))
        .find(|script| script.is_file())
        .unwrap_or_else(|| Path::new("scripts/kafka.sh").to_path_buf())
}
