//! Test-only helpers shared by the services' tests and benchmarks (a dev-dependency only).
//!
//! * [`KafkaBroker`] — a real Kafka-compatible broker (tansu) on loopback, started and stopped
//!   by `scripts/kafka.sh`, or the one named by `KAFKA_BOOTSTRAP`.
//! * [`Etcd`] — a real etcd (Debian's etcd-server) on loopback, started, stopped and restarted
//!   on the same data directory by `scripts/etcd.sh`, or the one named by `ETCD_ENDPOINTS`.
//! * [`RocketMq`] — a real RocketMQ name server and broker (rocketmq-rust 1.0.0) on loopback,
//!   started and stopped by `scripts/rocketmq.sh`, or the one named by `ROCKETMQ_NAMESRV`.
//! * [`http2`] — the HTTP/2 settings a server or client advertises, read off a raw socket.
//! * [`proxy`] — a loopback TCP proxy that can hold the server's answers or cut connections.

pub mod http2;
pub mod proxy;

use std::ffi::OsStr;
use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

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
        run_script(
            "kafka.sh",
            &[
                OsStr::new("start"),
                dir.path().as_os_str(),
                OsStr::new(&port.to_string()),
            ],
            "could not start tansu (scripts/kafka.sh install builds it)",
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
        send_signal(&dir.path().join("tansu.pid"), signal);
    }
}

impl Drop for KafkaBroker {
    fn drop(&mut self) {
        if let Some(dir) = &self.started_in {
            stop_with("kafka.sh", dir.path());
        }
    }
}

/// A RocketMQ name server with its broker(s) for a test: the one in `ROCKETMQ_NAMESRV`, or a
/// name server and `broker-a` started for the test on free loopback ports (stopped, by their
/// pids, when dropped).
#[derive(Debug)]
pub struct RocketMq {
    namesrv: String,
    started_in: Option<tempfile::TempDir>,
}

impl RocketMq {
    /// The name server in `ROCKETMQ_NAMESRV` if set, else one of this test's own.
    ///
    /// # Panics
    /// When the broker cannot be started (`scripts/rocketmq.sh install` builds it).
    pub fn get() -> RocketMq {
        match std::env::var("ROCKETMQ_NAMESRV") {
            Ok(namesrv) => RocketMq {
                namesrv,
                started_in: None,
            },
            Err(_) => RocketMq::start_own(),
        }
    }

    /// A name server and broker of this test's own (ones it may freeze, kill or add to).
    ///
    /// # Panics
    /// When they cannot be started (`scripts/rocketmq.sh install` builds them).
    pub fn start_own() -> RocketMq {
        let dir = tempfile::tempdir().expect("a temporary directory for RocketMQ");
        run_script(
            "rocketmq.sh",
            &[OsStr::new("start"), dir.path().as_os_str()],
            "could not start RocketMQ (scripts/rocketmq.sh install builds it)",
        );
        let namesrv = std::fs::read_to_string(dir.path().join("namesrv.addr"))
            .expect("the name server address");
        RocketMq {
            namesrv: namesrv.trim().to_owned(),
            started_in: Some(dir),
        }
    }

    /// The name server, `host:port`.
    pub fn namesrv(&self) -> &str {
        &self.namesrv
    }

    /// Starts one more broker named `name` joining this test's name server, and waits until
    /// it is ready.
    ///
    /// # Panics
    /// For a name server from `ROCKETMQ_NAMESRV`, or when the broker does not start.
    pub fn start_broker(&self, name: &str) {
        run_script(
            "rocketmq.sh",
            &[
                OsStr::new("start-broker"),
                self.own_dir().as_os_str(),
                OsStr::new(&self.namesrv),
                OsStr::new(name),
            ],
            &format!("could not start broker {name}"),
        );
    }

    /// Sends `signal` (`-STOP`, `-CONT`, `-KILL`, …) to this test's broker `name` (`broker-a`).
    ///
    /// # Panics
    /// For a broker from `ROCKETMQ_NAMESRV`, or when the signal cannot be sent.
    pub fn signal_broker(&self, name: &str, signal: &str) {
        send_signal(&self.own_dir().join(name).join("broker.pid"), signal);
    }

    /// Sends `signal` to this test's name server.
    ///
    /// # Panics
    /// For a name server from `ROCKETMQ_NAMESRV`, or when the signal cannot be sent.
    pub fn signal_namesrv(&self, signal: &str) {
        send_signal(&self.own_dir().join("namesrv").join("namesrv.pid"), signal);
    }

    /// The broker `name`'s log file (for tests that report what the broker said).
    pub fn broker_log(&self, name: &str) -> Option<PathBuf> {
        let dir = self.started_in.as_ref()?;
        Some(dir.path().join(name).join("broker.log"))
    }

    fn own_dir(&self) -> &Path {
        self.started_in
            .as_ref()
            .expect("only our own RocketMQ is signalled or extended")
            .path()
    }
}

impl Drop for RocketMq {
    fn drop(&mut self) {
        if let Some(dir) = &self.started_in {
            stop_with("rocketmq.sh", dir.path());
        }
    }
}

/// An etcd for a test: the cluster in `ETCD_ENDPOINTS` (comma-separated), or one started for
/// the test on free loopback ports (stopped, by its pid, when dropped).
#[derive(Debug)]
pub struct Etcd {
    endpoints: Vec<String>,
    started_in: Option<tempfile::TempDir>,
}

impl Etcd {
    /// The etcd in `ETCD_ENDPOINTS` if set, else one of this test's own.
    ///
    /// # Panics
    /// When etcd cannot be started (`scripts/etcd.sh install` installs it).
    pub fn get() -> Etcd {
        match std::env::var("ETCD_ENDPOINTS") {
            Ok(endpoints) => Etcd {
                endpoints: endpoints.split(',').map(str::to_owned).collect(),
                started_in: None,
            },
            Err(_) => Etcd::start_own(),
        }
    }

    /// An etcd of this test's own (one it may stop, freeze or restart).
    ///
    /// # Panics
    /// When etcd cannot be started (`scripts/etcd.sh install` installs it).
    pub fn start_own() -> Etcd {
        let dir = tempfile::tempdir().expect("a temporary directory for etcd");
        let mut etcd = Etcd {
            endpoints: Vec::new(),
            started_in: Some(dir),
        };
        etcd.start();
        etcd
    }

    /// The client URLs (`http://127.0.0.1:port`).
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The client URLs joined by commas, as `--etcd-endpoints` takes them.
    pub fn endpoints_arg(&self) -> String {
        self.endpoints.join(",")
    }

    /// Stops this test's etcd (SIGTERM, then SIGKILL); its data stays for [`Etcd::start`].
    ///
    /// # Panics
    /// For an etcd from `ETCD_ENDPOINTS`.
    pub fn stop(&self) {
        stop_with("etcd.sh", self.own_dir());
    }

    /// Starts this test's etcd (again) on its data directory and ports, and waits until healthy.
    ///
    /// # Panics
    /// For an etcd from `ETCD_ENDPOINTS`, or when it does not become healthy.
    pub fn start(&mut self) {
        let dir = self.own_dir().to_owned();
        run_script(
            "etcd.sh",
            &[OsStr::new("start"), dir.as_os_str()],
            "could not start etcd (scripts/etcd.sh install installs it)",
        );
        let endpoint = std::fs::read_to_string(dir.join("endpoint")).expect("etcd's endpoint file");
        self.endpoints = vec![endpoint.trim().to_owned()];
    }

    /// Sends `signal` (`-STOP`, `-CONT`, …) to this test's etcd.
    ///
    /// # Panics
    /// For an etcd from `ETCD_ENDPOINTS`, or when the signal cannot be sent.
    pub fn signal(&self, signal: &str) {
        send_signal(&self.own_dir().join("etcd.pid"), signal);
    }

    fn own_dir(&self) -> &Path {
        self.started_in
            .as_ref()
            .expect("only our own etcd is stopped, started or signalled")
            .path()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if self.started_in.is_some() {
            self.stop();
        }
    }
}

/// Runs `scripts/<name> ARGS…` and waits for it.
///
/// # Panics
/// When it cannot be run or fails: `failure`, then the script's stderr.
fn run_script(name: &str, args: &[&OsStr], failure: &str) {
    let output = Command::new("bash")
        .arg(script(name))
        .args(args)
        .output()
        .unwrap_or_else(|err| panic!("running scripts/{name}: {err}"));
    assert!(
        output.status.success(),
        "{failure}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `scripts/<name> stop DIR`: stops what a test started in DIR, by pid (best effort: it runs
/// from `Drop`, where a failure must not panic).
fn stop_with(name: &str, dir: &Path) {
    let _ = Command::new("bash")
        .arg(script(name))
        .arg("stop")
        .arg(dir)
        .status();
}

/// Sends `signal` to the process whose pid `pid_file` holds.
fn send_signal(pid_file: &Path, signal: &str) {
    let pid = std::fs::read_to_string(pid_file).expect("a pid file");
    let pid = pid.trim();
    let status = Command::new("kill").arg(signal).arg(pid).status();
    assert!(status.is_ok_and(|s| s.success()), "kill {signal} {pid}");
    if signal == "-STOP" {
        wait_stopped(pid);
    }
}

/// Waits until every thread of `pid` is stopped: `kill` returns once the signal is sent, and
/// a thread running on another core may still answer a request before it stops.
fn wait_stopped(pid: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let tasks = Path::new("/proc").join(pid).join("task");
    loop {
        let running = std::fs::read_dir(&tasks)
            .map(|entries| {
                entries.filter_map(Result::ok).any(|task| {
                    let stat =
                        std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
                    // The state follows the command name, which ends with the last ')'.
                    let state = stat
                        .rsplit_once(')')
                        .and_then(|(_, rest)| rest.trim_start().chars().next());
                    !matches!(state, Some('T' | 't') | None)
                })
            })
            .unwrap_or(false);
        if !running {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} did not stop"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A script of the checkout being tested (`scripts/<name>`), found at run time: from the package
/// directory cargo names for the running test (or the working directory) upwards. Not the
/// compile-time `CARGO_MANIFEST_DIR`: a shared `CARGO_TARGET_DIR` reuses this crate's build
/// across checkouts, and the path baked into it may be another (since deleted) clone.
fn script(name: &str) -> PathBuf {
    let start = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::current_dir().ok())
        .unwrap_or_default();
    start
        .ancestors()
        .map(|dir| dir.join("scripts").join(name))
        .find(|script| script.is_file())
        .unwrap_or_else(|| Path::new("scripts").join(name))
}

/// Spawns a service binary (`command`, its arguments set) whose first line on stdout is
/// `<service> listening on <address>`, as each of ours prints once it serves; returns the
/// process and that address. Logs go to the test's stderr.
pub fn spawn_service(command: &mut Command, service: &str) -> std::io::Result<(Child, SocketAddr)> {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        std::io::BufReader::new(stdout).read_line(&mut line)?;
    }
    let prefix = format!("{service} listening on ");
    let addr = line
        .trim()
        .strip_prefix(&prefix)
        .and_then(|addr| addr.parse().ok());
    match addr {
        Some(addr) => Ok((child, addr)),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            Err(std::io::Error::other(format!(
                "{service} printed {line:?} first, not \"{prefix}<address>\""
            )))
        }
    }
}
