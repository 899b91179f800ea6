//! Configuration loading shared by the service binaries.
//!
//! Precedence, highest first: command-line flag, environment variable (each flag names its
//! own, `EM_<SERVICE>_<FLAG>`), TOML config file (`--config`), built-in default. A config file
//! with an unknown key is rejected with the key's name, so a typo never silently falls back to
//! a default. Each service defines a `Config` struct (`#[serde(deny_unknown_fields, default)]`)
//! and a clap `Args` struct whose fields are `Option`s; [`load_file`] reads the file and the
//! service applies the `Some` flags on top.

use std::path::{Path, PathBuf};

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

/// Overrides `target` with `value` when a flag or environment variable was given.
pub fn apply<T>(target: &mut T, value: Option<T>) {
    if let Some(value) = value {
        *target = value;
    }
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
    fn flags_override() {
        let mut value = 1;
        apply(&mut value, None);
        assert_eq!(value, 1);
        apply(&mut value, Some(2));
        assert_eq!(value, 2);
    }
}
