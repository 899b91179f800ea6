//! Configuration loading shared by the service binaries.
//!
//! Precedence, highest first: command-line flag, environment variable (each flag names its
//! own, `EM_<SERVICE>_<FLAG>`), TOML config file (`--config`), built-in default. A config file
//! with an unknown key is rejected with the key's name, so a typo never silently falls back to
//! a default. Each service defines a `Config` struct (`#[serde(deny_unknown_fields, default)]`)
//! and a clap `Args` struct whose fields are `Option`s; [`load_file`] reads the file and the
//! service applies the `Some` flags on top.
//!
//! `--check-config FILE` (every service) resolves the configuration exactly as a start with
//! `--config FILE` would, environment and flags included, prints the effective settings as TOML
//! ([`checked_report`]) and exits without opening anything: 0 when the service would accept it,
//! non-zero with the refused key otherwise. Deployment checks run it against the manifests'
//! ConfigMap so a manifest never carries a file the binary refuses.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Why a config file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this service (unknown key, wrong type, ...).
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// The `--check-config` report could not be made or written.
    #[error("cannot report the effective configuration: {0}")]
    Report(String),
    /// A value is out of its allowed range.
    #[error("invalid setting {key}: {message}")]
    Invalid {
        /// The setting.
        key: &'static str,
        /// Why.
        message: String,
    },
}

/// Reads `path` as TOML into `T`, or `T::default()` when no path is given.
pub fn load_file<T: DeserializeOwned + Default>(path: Option<&Path>) -> Result<T, ConfigError> {
    let Some(path) = path else {
        return Ok(T::default());
    };
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|err| ConfigError::Parse {
        path: path.to_owned(),
        message: err.to_string().trim_end().to_owned(),
    })
}

/// Checks that `uri` (setting `key`) names a gRPC endpoint: `http://` or `https://` and a host.
/// Services check their dependency addresses at start-up, before they dial lazily, so a typo is
/// refused at once (and by `--check-config`) instead of surfacing as a failing call later.
pub fn check_endpoint(key: &'static str, uri: &str) -> Result<(), ConfigError> {
    let invalid = || ConfigError::Invalid {
        key,
        message: format!("{uri:?} is not an http:// or https:// address with a host"),
    };
    let parsed: tonic::codegen::http::Uri = uri.parse().map_err(|_| invalid())?;
    match (parsed.scheme_str(), parsed.host()) {
        (Some("http" | "https"), Some(host)) if !host.is_empty() => Ok(()),
        _ => Err(invalid()),
    }
}

/// Most async worker threads a service may be given (`worker_threads`): far above any core
/// count it runs on, low enough that a typo does not start thousands of threads.
pub const MAX_WORKER_THREADS: usize = 1024;

/// Checks the setting `worker_threads` (0: the runtime's default, else at most
/// [`MAX_WORKER_THREADS`]).
pub fn check_worker_threads(workers: usize) -> Result<(), ConfigError> {
    check_thread_count(
        "worker_threads",
        workers,
        MAX_WORKER_THREADS,
        "one per core the process may use",
    )
}

/// Checks a thread-count setting `key`: at most `max`; `zero_means` says what 0 asks for.
pub fn check_thread_count(
    key: &'static str,
    threads: usize,
    max: usize,
    zero_means: &str,
) -> Result<(), ConfigError> {
    if threads > max {
        return Err(ConfigError::Invalid {
            key,
            message: format!("{threads} is more than {max} (0: {zero_means})"),
        });
    }
    Ok(())
}

/// A service's command line: where the configuration comes from, resolved.
pub trait ServiceArgs {
    /// The service's effective configuration.
    type Config: Serialize;
    /// The file `--check-config` names, when the binary is only to check it.
    fn check_config(&self) -> Option<&Path>;
    /// Defaults, file, environment and flags resolved and validated.
    fn into_config(self) -> Result<Self::Config, ConfigError>;
}

/// Resolves `args`. With `--check-config`, writes the [`checked_report`] to stdout and answers
/// `None`: the binary exits there; otherwise answers the configuration to start with.
pub fn resolve_or_check<A: ServiceArgs>(
    service: &str,
    args: A,
) -> Result<Option<A::Config>, ConfigError> {
    let check = args.check_config().map(Path::to_owned);
    let config = args.into_config()?;
    let Some(file) = check else {
        return Ok(Some(config));
    };
    let report = checked_report(service, &file, &config)?;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(report.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|err| ConfigError::Report(err.to_string()))?;
    Ok(None)
}

/// What `--check-config FILE` prints for an accepted file: a comment naming the service and the
/// file, then every effective setting (defaults, file, environment and flags applied) as TOML,
/// itself a valid config file for the service.
pub fn checked_report<T: Serialize>(
    service: &str,
    file: &Path,
    config: &T,
) -> Result<String, ConfigError> {
    let settings = toml::to_string(config).map_err(|err| ConfigError::Report(err.to_string()))?;
    Ok(format!(
        "# {service}: {} is accepted; effective settings (defaults < file < environment < flags):\n{settings}",
        file.display()
    ))
}

/// Overrides `target` with `value` when a flag or environment variable was given.
pub fn apply<T>(target: &mut T, value: Option<T>) {
    if let Some(value) = value {
        *target = value;
    }
}

/// The settings reference, `docs/CONFIG.md`.
const CONFIG_DOC: &str = include_str!("../../docs/CONFIG.md");

/// What `service`'s settings table in `docs/CONFIG.md` (its `## service` section) gets wrong
/// (empty: nothing), for the services' tests. Its rows read
/// `` | `toml.key` | `--flag` | `ENV_VAR` | default | meaning | `` (`—` for no TOML key).
/// Every setting of `config` (dotted TOML keys, as `--check-config` prints them) needs a row,
/// every row's key must be a setting, and its flag and variable must be ones `command`
/// accepts — with every flag of `command` documented in some row.
pub fn undocumented_settings(
    service: &str,
    config: &impl Serialize,
    command: &clap::Command,
) -> Vec<String> {
    let section = doc_section(CONFIG_DOC, &format!("## {service}"));
    if section.is_empty() {
        return vec![format!("docs/CONFIG.md has no section `## {service}`")];
    }
    let mut problems = Vec::new();
    let settings = match toml::Value::try_from(config) {
        Ok(toml::Value::Table(table)) => dotted_keys("", &table),
        other => return vec![format!("the configuration is not a TOML table: {other:?}")],
    };
    let cell = |text: &str| text.trim().trim_matches('`').to_owned();
    let rows: Vec<(String, String, String)> = section
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.strip_prefix('|')?.split('|').collect();
            let flag = cell(cells.get(1)?);
            let is_flag = flag
                .strip_prefix("--")
                .is_some_and(|name| name.starts_with(|c: char| c.is_ascii_alphabetic()));
            is_flag.then(|| (cell(cells[0]), flag, cell(cells.get(2).unwrap_or(&""))))
        })
        .collect();
    for key in &settings {
        if !rows.iter().any(|(documented, _, _)| documented == key) {
            problems.push(format!("setting `{key}` has no row"));
        }
    }
    for (key, flag, env) in &rows {
        if key != "—" && !settings.contains(key) {
            problems.push(format!("row `{key}` is not a setting"));
        }
        let arg = command.get_arguments().find(|arg| {
            arg.get_long()
                .is_some_and(|long| flag == &format!("--{long}"))
        });
        match arg {
            None => problems.push(format!("row `{key}`: no flag {flag}")),
            Some(arg) => {
                let accepted = arg.get_env().and_then(|e| e.to_str()).unwrap_or_default();
                if env != accepted {
                    problems.push(format!(
                        "row `{key}`: {flag} reads `{accepted}`, not `{env}`"
                    ));
                }
            }
        }
    }
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let flag = format!("--{long}");
        if !matches!(long, "help" | "version" | "check-config")
            && !rows.iter().any(|(_, documented, _)| documented == &flag)
        {
            problems.push(format!("flag {flag} has no row"));
        }
    }
    problems
}

/// The keys of `table` and its sub-tables, dotted (`delivery.ack_timeout_ms`).
fn dotted_keys(prefix: &str, table: &toml::Table) -> Vec<String> {
    table
        .iter()
        .flat_map(|(key, value)| {
            let key = format!("{prefix}{key}");
            match value {
                toml::Value::Table(inner) => dotted_keys(&format!("{key}."), inner),
                _ => vec![key],
            }
        })
        .collect()
}

/// The part of `doc` from the heading `heading` to the next heading of the same level.
fn doc_section<'a>(doc: &'a str, heading: &str) -> &'a str {
    let Some(start) = doc.find(&format!("\n{heading}\n")) else {
        return "";
    };
    let rest = &doc[start + 1..];
    let level = heading.split(' ').next().unwrap_or("##");
    let end = rest[heading.len()..]
        .find(&format!("\n{level} "))
        .map_or(rest.len(), |end| end + heading.len());
    &rest[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Default, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields, default)]
    struct Sample {
        listen: String,
        sync: bool,
    }

    #[test]
    fn missing_path_gives_defaults() {
        assert_eq!(load_file::<Sample>(None).unwrap(), Sample::default());
    }

    #[test]
    fn file_values_and_unknown_keys() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.toml");
        std::fs::write(&good, "listen = \"127.0.0.1:1\"\n").unwrap();
        let loaded: Sample = load_file(Some(&good)).unwrap();
        assert_eq!(loaded.listen, "127.0.0.1:1");
        assert!(!loaded.sync);

        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "lisen = \"x\"\n").unwrap();
        let err = load_file::<Sample>(Some(&bad)).unwrap_err().to_string();
        assert!(err.contains("unknown field `lisen`"), "{err}");

        let missing = dir.path().join("missing.toml");
        assert!(matches!(
            load_file::<Sample>(Some(&missing)),
            Err(ConfigError::Read { .. })
        ));
    }

    #[test]
    fn the_check_report_is_itself_a_valid_file() {
        #[derive(Debug, Default, Deserialize, Serialize, PartialEq)]
        #[serde(deny_unknown_fields, default)]
        struct Nested {
            listen: String,
            endpoints: Vec<String>,
            inner: Sample2,
        }
        #[derive(Debug, Default, Deserialize, Serialize, PartialEq)]
        #[serde(deny_unknown_fields, default)]
        struct Sample2 {
            timeout_ms: u64,
        }
        let config = Nested {
            listen: "0.0.0.0:1".into(),
            endpoints: vec!["http://etcd:2379".into()],
            inner: Sample2 { timeout_ms: 7 },
        };
        let report = checked_report("svc", Path::new("/etc/svc.toml"), &config).unwrap();
        assert!(
            report.starts_with("# svc: /etc/svc.toml is accepted"),
            "{report}"
        );
        let back: Nested = toml::from_str(&report).unwrap();
        assert_eq!(back, config);
    }

    #[test]
    fn endpoints_need_a_scheme_and_a_host() {
        for good in [
            "http://127.0.0.1:50053",
            "https://offset.eventmesh.svc:50053",
            "http://[::1]:1",
        ] {
            check_endpoint("offset_svc", good).unwrap();
        }
        for bad in [
            "127.0.0.1:50053",
            "offset:50053",
            "ftp://x:1",
            "http://",
            "",
            "http://a b",
        ] {
            let err = check_endpoint("offset_svc", bad).unwrap_err().to_string();
            assert!(err.contains("offset_svc"), "{bad}: {err}");
        }
    }

    #[test]
    fn flags_override() {
        let mut value = 1;
        apply(&mut value, None);
        assert_eq!(value, 1);
        apply(&mut value, Some(2));
        assert_eq!(value, 2);
    }
}
