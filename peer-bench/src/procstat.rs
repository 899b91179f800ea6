//! CPU time and resident memory of a process, from `/proc/<pid>/stat` and `/proc/<pid>/status`
//! (Linux only), the same way `emctl bench` measures its processes.

use anyhow::{Context, Result, anyhow};
use std::sync::OnceLock;

/// Clock ticks per second of `/proc/<pid>/stat` (`getconf CLK_TCK`; 100 on Linux when that
/// cannot be asked).
fn ticks_per_sec() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .and_then(|text| text.trim().parse::<f64>().ok())
            .filter(|ticks| *ticks > 0.0)
            .unwrap_or(100.0)
    })
}

/// `utime + stime` in clock ticks from the text of a `/proc/<pid>/stat` file.
pub fn parse_stat_ticks(stat: &str) -> Result<u64> {
    // The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| anyhow!("malformed stat line: {stat:?}"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state): utime is field 14, stime field 15.
    let field = |n: usize| -> Result<u64> {
        fields
            .get(n - 3)
            .ok_or_else(|| anyhow!("stat line has no field {n}"))?
            .parse::<u64>()
            .with_context(|| format!("stat field {n}"))
    };
    Ok(field(14)? + field(15)?)
}

/// CPU seconds (user + system) used so far by `pid`, or by this process for `None`.
pub fn cpu_seconds(pid: Option<u32>) -> Result<f64> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/stat"),
        None => "/proc/self/stat".to_string(),
    };
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    Ok(parse_stat_ticks(&stat)? as f64 / ticks_per_sec())
}

/// `VmRSS` in MiB from the text of a `/proc/<pid>/status` file.
pub fn parse_rss_mb(status: &str) -> Result<f64> {
    let line = status
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .ok_or_else(|| anyhow!("no VmRSS line"))?;
    let kib: f64 = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .context("VmRSS value")?;
    Ok(kib / 1024.0)
}

/// Resident memory of `pid` in MiB.
pub fn rss_mb(pid: u32) -> Result<f64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    parse_rss_mb(&status)
}

/// CPU seconds of the server (when its pid is known) and of this process at one instant.
#[derive(Debug, Clone, Copy)]
pub struct CpuMark {
    server: Option<f64>,
    client: f64,
}

impl CpuMark {
    pub fn now(server_pid: Option<u32>) -> Result<Self> {
        Ok(Self {
            server: server_pid.map(|pid| cpu_seconds(Some(pid))).transpose()?,
            client: cpu_seconds(None)?,
        })
    }

    /// Cores used between `self` and `later` over `wall_secs`: (server, client).
    pub fn cores_until(&self, later: &CpuMark, wall_secs: f64) -> (Option<f64>, f64) {
        let cores = |from: f64, to: f64| (to - from).max(0.0) / wall_secs.max(1e-9);
        (
            self.server.zip(later.server).map(|(a, b)| cores(a, b)),
            cores(self.client, later.client),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_skip_a_command_name_with_spaces_and_parens() -> Result<()> {
        let stat = "4242 (nats server) (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 \
                    250 75 0 0 20 0 9 0 12345 123456789 2048 18446744073709551615";
        assert_eq!(parse_stat_ticks(stat)?, 325);
        Ok(())
    }

    #[test]
    fn own_cpu_time_is_readable() -> Result<()> {
        assert!(cpu_seconds(None)? >= 0.0);
        Ok(())
    }

    #[test]
    fn rss_is_parsed_in_mib() -> Result<()> {
        let status = "Name:\tnats-server\nVmPeak:\t  9000 kB\nVmRSS:\t   20480 kB\nThreads:\t9\n";
        assert!((parse_rss_mb(status)? - 20.0).abs() < 1e-9);
        assert!(rss_mb(std::process::id())? > 0.0);
        Ok(())
    }
}
