//! The real puller-svc binary as a child process, killed on drop so a failing assertion
//! leaves no process behind.

use std::path::Path;
use std::process::{Child, Command};

use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use tonic::transport::Channel;

/// A running puller-svc.
pub struct Puller {
    child: Child,
    /// A client to it.
    pub client: PullerServiceClient<Channel>,
    /// Generations of the readers this test attached to this process.
    pub generations: std::collections::HashMap<String, u64>,
}

impl Puller {
    /// Starts puller-svc on a free port with checkpoints every 100 ms, `data_dir`, the
    /// offset-svc at `offset_svc`, and `extra` flags (a backend); waits for its address.
    pub async fn start(data_dir: &Path, offset_svc: &str, extra: &[&str]) -> Puller {
        let mut command = Command::new(env!("CARGO_BIN_EXE_puller-svc"));
        command
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .args([
                "--checkpoint-interval-ms",
                "100",
                "--offset-svc",
                offset_svc,
                "--data-dir",
            ])
            .arg(data_dir)
            .args(extra)
            .env("RUST_LOG", "warn");
        let (child, addr) = eventmesh_testkit::spawn_service(&mut command, "puller-svc").unwrap();
        let client = PullerServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        Puller {
            child,
            client,
            generations: Default::default(),
        }
    }

    /// `kill -9`, and waits for it to be gone.
    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Puller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
