//! A local instance: offset-svc, puller-svc (embedded local backend) and dispatcher-svc as
//! three child processes on loopback, for `emctl up`, `emctl demo` and end-to-end tests.
//!
//! Each service writes its log to `<data_dir>/logs/<service>.log`; its first stdout line,
//! `<service> listening on <addr>`, tells the bound address (port 0 picks a free one). A
//! restarted service binds the address it had, so its neighbours and clients find it again.
//! The service binaries are looked up in `bin_dir`, `$EM_BIN_DIR`, next to the running
//! executable, or one directory up (where cargo puts binaries beside `deps/` test executables).

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// One of the three services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Service {
    /// The offset store.
    Offset,
    /// The MQ reader.
    Puller,
    /// The client-facing delivery service.
    Dispatcher,
}

impl Service {
    /// All three, in start order.
    pub const ALL: [Service; 3] = [Service::Offset, Service::Puller, Service::Dispatcher];

    /// The binary's name.
    pub fn binary(self) -> &'static str {
        match self {
            Service::Offset => "offset-svc",
            Service::Puller => "puller-svc",
            Service::Dispatcher => "dispatcher-svc",
        }
    }

    /// The environment variable that arms a crash point of this service, if it has any.
    pub fn crash_env(self) -> Option<&'static str> {
        match self {
            Service::Offset => None,
            Service::Puller => Some("EM_PULLER_CRASH_AT"),
            Service::Dispatcher => Some("EM_DISPATCHER_CRASH_AT"),
        }
    }

    /// The position of this service in per-service arrays ([`Service::ALL`] order).
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.binary())
    }
}

/// Why a local instance could not be run.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// A service binary is not where it was looked for.
    #[error(
        "{binary} not found in {searched:?}: build the services (`cargo build --bins`, or run `cargo test --workspace`), or set EM_BIN_DIR"
    )]
    BinaryNotFound {
        /// The missing binary.
        binary: &'static str,
        /// The directories searched.
        searched: Vec<PathBuf>,
    },
    /// Starting or signalling a process failed.
    #[error("{service}: {message}")]
    Process {
        /// Which service.
        service: Service,
        /// What happened.
        message: String,
    },
}

/// How to run a local instance.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// Where the services keep their data and logs.
    pub data_dir: PathBuf,
    /// Where the service binaries are; `None` searches as the module doc says.
    pub bin_dir: Option<PathBuf>,
    /// Listen addresses (port 0: any free port).
    pub listen: [SocketAddr; 3],
    /// Prometheus `/metrics` listen addresses (port 0: any free port, not reported).
    pub metrics_listen: [SocketAddr; 3],
    /// Extra command-line flags per service (indexed like [`Service::ALL`]).
    pub extra_args: [Vec<String>; 3],
    /// `RUST_LOG` for the services.
    pub log_filter: String,
    /// A crash point armed when the instance starts (`after-pull:50`; see the service's
    /// crash module); a restart via [`LocalInstance::start_service`] names its own.
    pub crash_at: Option<(Service, String)>,
    /// Environment variables set for every service (after the inherited ones), e.g. the
    /// `OTEL_*` settings of span export.
    pub env: Vec<(String, String)>,
    /// Each service's async worker threads (`--worker-threads`; 0: the service's own default,
    /// a worker per core), indexed like [`Service::ALL`]. [`LocalConfig::new`] takes
    /// [`co_located_worker_threads`].
    pub worker_threads: [usize; 3],
}

/// A third of this machine's cores, at least one.
pub fn a_third_of_the_cores() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    (cores / 3).max(1)
}

/// A service's worker threads when all three share this machine: the dispatcher, which does
/// most of the work, keeps its default (a worker per core); puller-svc and offset-svc, which do
/// a fraction of it, get [`a_third_of_the_cores`], so that three schedulers do not each start a
/// worker per core (docs/CONFIG.md, "Worker threads").
pub fn co_located_worker_threads(service: Service) -> usize {
    match service {
        Service::Dispatcher => 0,
        Service::Offset | Service::Puller => a_third_of_the_cores(),
    }
}

impl LocalConfig {
    /// Any free loopback ports, data in `data_dir`.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        LocalConfig {
            data_dir: data_dir.into(),
            bin_dir: None,
            listen: [any; 3],
            metrics_listen: [any; 3],
            extra_args: Default::default(),
            log_filter: "info".into(),
            crash_at: None,
            env: Vec::new(),
            worker_threads: Service::ALL.map(co_located_worker_threads),
        }
    }

    /// The well-known ports (dispatcher 50051, puller 50052, offset-svc 50053).
    pub fn well_known_ports(mut self) -> Self {
        self.listen = [
            SocketAddr::from(([127, 0, 0, 1], 50053)),
            SocketAddr::from(([127, 0, 0, 1], 50052)),
            SocketAddr::from(([127, 0, 0, 1], 50051)),
        ];
        self
    }

    /// Arms a crash point of `service` for its first start.
    pub fn crash_at(mut self, service: Service, point: impl Into<String>) -> Self {
        self.crash_at = Some((service, point.into()));
        self
    }

    /// Sets an environment variable for every service.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Adds command-line flags for one service.
    pub fn args<I, S>(mut self, service: Service, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra_args[service.index()].extend(args.into_iter().map(Into::into));
        self
    }
}

/// A running local instance. Dropping it kills what is still running.
#[derive(Debug)]
pub struct LocalInstance {
    config: LocalConfig,
    bin_dir: PathBuf,
    children: [Option<Child>; 3],
    addrs: [SocketAddr; 3],
}

impl LocalInstance {
    /// Starts the three services, each after the one it depends on is listening.
    pub async fn start(config: LocalConfig) -> Result<LocalInstance, LocalError> {
        let bin_dir = find_bin_dir(config.bin_dir.as_deref())?;
        std::fs::create_dir_all(config.data_dir.join("logs")).map_err(|e| LocalError::Process {
            service: Service::Offset,
            message: format!("creating {}: {e}", config.data_dir.display()),
        })?;
        let mut instance = LocalInstance {
            addrs: config.listen,
            config,
            bin_dir,
            children: [None, None, None],
        };
        for service in Service::ALL {
            let crash_at = match &instance.config.crash_at {
                Some((armed, point)) if *armed == service => Some(point.clone()),
                _ => None,
            };
            instance.start_service(service, crash_at.as_deref()).await?;
        }
        Ok(instance)
    }

    /// The address a service listens on.
    pub fn addr(&self, service: Service) -> SocketAddr {
        self.addrs[service.index()]
    }

    /// Where a service serves `/metrics`, as configured (port 0 when it was left to the
    /// service).
    pub fn metrics_addr(&self, service: Service) -> SocketAddr {
        self.config.metrics_listen[service.index()]
    }

    /// The dispatcher's URI, for [`crate::ClientConfig::endpoint`].
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr(Service::Dispatcher))
    }

    /// A service's URI.
    pub fn uri(&self, service: Service) -> String {
        format!("http://{}", self.addr(service))
    }

    /// A service's async worker threads as configured (0: the service's default).
    pub fn worker_threads(&self, service: Service) -> usize {
        self.config.worker_threads[service.index()]
    }

    /// The data directory.
    pub fn data_dir(&self) -> &Path {
        &self.config.data_dir
    }

    /// A service's log file.
    pub fn log_file(&self, service: Service) -> PathBuf {
        self.config
            .data_dir
            .join("logs")
            .join(format!("{}.log", service.binary()))
    }

    /// The process id of a running service.
    pub fn pid(&self, service: Service) -> Option<u32> {
        self.children[service.index()].as_ref()?.id()
    }

    /// Whether a service's process is running (not exited; a stopped process counts as
    /// running).
    pub fn is_running(&mut self, service: Service) -> bool {
        match self.children[service.index()].as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Starts (or restarts) a service on its address, optionally with a crash point armed
    /// (`after-checkpoint`, …; see the service's crash module), and waits until it listens.
    pub async fn start_service(
        &mut self,
        service: Service,
        crash_at: Option<&str>,
    ) -> Result<(), LocalError> {
        let process_error = |message: String| LocalError::Process { service, message };
        let data = &self.config.data_dir;
        let listen = self.addrs[service.index()];
        let mut command = Command::new(self.bin_dir.join(service.binary()));
        command
            .arg("--listen")
            .arg(listen.to_string())
            .arg("--metrics-listen")
            .arg(self.config.metrics_listen[service.index()].to_string());
        match service {
            Service::Offset => {
                command.arg("--data-dir").arg(data.join("offset"));
            }
            Service::Puller => {
                command
                    .arg("--data-dir")
                    .arg(data.join("puller"))
                    .arg("--offset-svc")
                    .arg(self.uri(Service::Offset));
            }
            Service::Dispatcher => {
                command
                    .arg("--puller")
                    .arg(self.uri(Service::Puller))
                    .arg("--offset-svc")
                    .arg(self.uri(Service::Offset));
            }
        }
        let workers = self.config.worker_threads[service.index()];
        if workers > 0 {
            command.arg("--worker-threads").arg(workers.to_string());
        }
        command.args(&self.config.extra_args[service.index()]);
        for other in Service::ALL {
            if let Some(env) = other.crash_env() {
                command.env_remove(env);
            }
        }
        if let (Some(point), Some(env)) = (crash_at, service.crash_env()) {
            command.env(env, point);
        }
        let log_path = self.log_file(service);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| process_error(format!("opening {}: {e}", log_path.display())))?;
        command.envs(self.config.env.iter().map(|(key, value)| (key, value)));
        command
            .env("RUST_LOG", &self.config.log_filter)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .map_err(|e| process_error(format!("spawning {}: {e}", service.binary())))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| process_error("no stdout pipe".into()))?;
        let mut lines = BufReader::new(stdout).lines();
        let prefix = format!("{} listening on ", service.binary());
        let first = tokio::time::timeout(START_TIMEOUT, lines.next_line()).await;
        let line = match first {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) | Ok(Err(_)) => {
                let status = child.wait().await.ok();
                return Err(process_error(format!(
                    "exited before listening ({status:?}); see {}",
                    log_path.display()
                )));
            }
            Err(_) => {
                let _ = child.kill().await;
                return Err(process_error(format!(
                    "not listening after {START_TIMEOUT:?}; see {}",
                    log_path.display()
                )));
            }
        };
        let addr: SocketAddr = line
            .strip_prefix(&prefix)
            .and_then(|rest| rest.trim().parse().ok())
            .ok_or_else(|| process_error(format!("unexpected first line {line:?}")))?;
        self.addrs[service.index()] = addr;
        // Keep draining stdout into the log so the pipe never fills.
        let log_path_for_task = log_path.clone();
        tokio::spawn(async move {
            let Ok(mut log) = tokio::fs::OpenOptions::new()
                .append(true)
                .open(&log_path_for_task)
                .await
            else {
                return;
            };
            while let Ok(Some(line)) = lines.next_line().await {
                let _ = log.write_all(format!("{line}\n").as_bytes()).await;
            }
        });
        self.children[service.index()] = Some(child);
        Ok(())
    }

    /// Kills a service with SIGKILL (no cleanup, like a node failure) and reaps it.
    pub async fn kill(&mut self, service: Service) -> Result<(), LocalError> {
        if let Some(mut child) = self.children[service.index()].take() {
            // A stopped process dies of SIGKILL too.
            let _ = child.kill().await;
        }
        Ok(())
    }

    /// Sends SIGSTOP (freeze) or SIGCONT (thaw) to a service. A STOP returns once every thread
    /// of the process is stopped (it blocks the calling thread for as long, at most 10 s).
    pub fn signal(&self, service: Service, signal: &str) -> Result<(), LocalError> {
        let pid = self.pid(service).ok_or_else(|| LocalError::Process {
            service,
            message: "not running".into(),
        })?;
        send_signal(pid, signal).map_err(|message| LocalError::Process { service, message })?;
        if signal == "STOP" {
            wait_until_stopped(pid).map_err(|message| LocalError::Process { service, message })?;
        }
        Ok(())
    }

    /// Waits up to `wait` for a service to exit by itself (an armed crash point); true if it
    /// did (and it is reaped).
    pub async fn wait_for_exit(&mut self, service: Service, wait: Duration) -> bool {
        let Some(child) = self.children[service.index()].as_mut() else {
            return true;
        };
        match tokio::time::timeout(wait, child.wait()).await {
            Ok(_) => {
                self.children[service.index()] = None;
                true
            }
            Err(_) => false,
        }
    }

    /// Stops everything gracefully (SIGTERM, dispatcher first so ACKs flush; SIGKILL after
    /// `grace`).
    pub async fn stop(mut self, grace: Duration) {
        for service in Service::ALL.iter().rev() {
            let Some(mut child) = self.children[service.index()].take() else {
                continue;
            };
            if let Some(pid) = child.id() {
                let _ = send_signal(pid, "CONT");
                let _ = send_signal(pid, "TERM");
            }
            if tokio::time::timeout(grace, child.wait()).await.is_err() {
                tracing::warn!(%service, "did not stop within {grace:?}; killing it");
                let _ = child.kill().await;
            }
        }
    }
}

/// How long a service may take to print its listening line.
const START_TIMEOUT: Duration = Duration::from_secs(30);

fn send_signal(pid: u32, signal: &str) -> Result<(), String> {
    let status = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("running kill: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -{signal} {pid} failed ({status})"))
    }
}

/// Waits until every thread of `pid` is stopped: `kill` returns once the signal is queued,
/// while each thread stops only when it next leaves the kernel (one inside a long `fsync` keeps
/// running until it returns), so a caller that acts right away may still be answered.
fn wait_until_stopped(pid: u32) -> Result<(), String> {
    const WAIT: Duration = Duration::from_secs(10);
    let started = std::time::Instant::now();
    let tasks = PathBuf::from(format!("/proc/{pid}/task"));
    if !tasks.is_dir() {
        // Not Linux (or no procfs): nothing to look at.
        return Ok(());
    }
    loop {
        let mut running = Vec::new();
        let entries = std::fs::read_dir(&tasks).map_err(|e| format!("{}: {e}", tasks.display()))?;
        for entry in entries.flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue; // the thread ended meanwhile
            };
            // The state follows the parenthesised command name, which may contain spaces.
            let state = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next());
            if !matches!(state, Some('T' | 't' | 'Z' | 'X')) {
                running.push(format!("{}={state:?}", entry.file_name().to_string_lossy()));
            }
        }
        if running.is_empty() {
            return Ok(());
        }
        if started.elapsed() > WAIT {
            return Err(format!(
                "{pid} not stopped {WAIT:?} after SIGSTOP; threads still running: {}",
                running.join(", ")
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn find_bin_dir(explicit: Option<&Path>) -> Result<PathBuf, LocalError> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dir) = explicit {
        candidates.push(dir.to_owned());
    } else {
        if let Some(dir) = std::env::var_os("EM_BIN_DIR") {
            candidates.push(dir.into());
        }
        if let Some(dir) = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(Path::to_owned))
        {
            if let Some(parent) = dir.parent() {
                candidates.push(dir.clone());
                candidates.push(parent.to_owned());
            } else {
                candidates.push(dir);
            }
        }
    }
    candidates
        .iter()
        .find(|dir| {
            Service::ALL
                .iter()
                .all(|service| dir.join(service.binary()).is_file())
        })
        .cloned()
        .ok_or_else(|| {
            let binary = Service::ALL
                .iter()
                .find(|service| {
                    !candidates
                        .iter()
                        .any(|dir| dir.join(service.binary()).is_file())
                })
                .map_or("offset-svc", |service| service.binary());
            LocalError::BinaryNotFound {
                binary,
                searched: candidates.clone(),
            }
        })
}
