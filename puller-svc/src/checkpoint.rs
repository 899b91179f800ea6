//! Pull-cursor checkpoint files: one per backend and subscription group.
//!
//! * Name: `<backend>-pull-offsets.properties` for a topic's default group,
//!   `<backend>-pull-offsets@<group>.properties` for a named group, in the data directory.
//! * Format: Java properties ([`crate::properties`]). Keys are pull keys (`topic#partition`,
//!   lite `parent#lite@queue`); values are the **next** MQ offset to read (exclusive: every
//!   offset below it has been handed on). One extra entry, [`VERSION_KEY`]` = 1`, names the
//!   format version; it cannot collide with a pull key, which always contains `#`.
//! * Writes are atomic: the whole file goes to `<name>.tmp`, is fsynced, renamed over the old
//!   file, and the directory is fsynced, so a crash leaves either the old or the new file.
//! * A file that cannot be used (unparsable, unknown or missing version, a bad key or value)
//!   is never fatal and never silently half-used: it is renamed to
//!   `<name>.corrupt-<unix-millis>` with an error log naming the reason, and the reader starts
//!   without cursors, so alignment falls back to the group's watermark or the configured start.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use eventmesh_common::keys::{GroupName, PullKey};

use crate::crash::{CrashPoint, crash_point};
use crate::properties;

/// The properties key holding the format version.
pub const VERSION_KEY: &str = "eventmesh.pull-offsets.version";
/// The format version written.
pub const VERSION: u32 = 1;

/// Cursors of one reader: pull key → next offset to read.
pub type Cursors = BTreeMap<PullKey, i64>;

/// An I/O failure while writing a checkpoint (reading never fails: see [`load`]).
#[derive(Debug, thiserror::Error)]
#[error("cannot write checkpoint {path}: {source}")]
pub struct CheckpointError {
    /// The file.
    pub path: PathBuf,
    /// The I/O error.
    pub source: std::io::Error,
}

/// What [`load`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Loaded {
    /// The file existed and was valid.
    Cursors(Cursors),
    /// No file: a fresh reader.
    Missing,
    /// The file was unusable and has been moved aside.
    SetAside {
        /// Where it is now.
        moved_to: PathBuf,
        /// Why it was unusable.
        reason: String,
    },
}

impl Loaded {
    /// The cursors to start from (empty unless a valid file was read).
    pub fn into_cursors(self) -> Cursors {
        match self {
            Loaded::Cursors(cursors) => cursors,
            Loaded::Missing | Loaded::SetAside { .. } => Cursors::new(),
        }
    }
}

/// The checkpoint file of `backend` for `group` (`None`: the default group) in `dir`.
pub fn path(dir: &Path, backend: &str, group: Option<&GroupName>) -> PathBuf {
    match group {
        None => dir.join(format!("{backend}-pull-offsets.properties")),
        Some(group) => dir.join(format!("{backend}-pull-offsets@{group}.properties")),
    }
}

/// Renders cursors in the file format.
pub fn render(cursors: &Cursors) -> String {
    let entries: Vec<(String, String)> = cursors
        .iter()
        .map(|(key, next)| (key.to_string(), next.to_string()))
        .collect();
    let version = VERSION.to_string();
    properties::write(
        &["EventMesh pull cursors: next MQ offset to read per topic#partition"],
        std::iter::once((VERSION_KEY, version.as_str()))
            .chain(entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))),
    )
}

/// Parses the file format; any defect is an error naming it.
pub fn parse(text: &str) -> Result<Cursors, String> {
    let entries = properties::parse(text).map_err(|err| err.to_string())?;
    let mut version = None;
    let mut cursors = Cursors::new();
    for (key, value) in entries {
        if key == VERSION_KEY {
            version = Some(value);
            continue;
        }
        let pull_key: PullKey = key
            .parse()
            .map_err(|err| format!("bad cursor key {key:?}: {err}"))?;
        let next: i64 = value
            .parse()
            .ok()
            .filter(|next| *next >= 0)
            .ok_or_else(|| format!("cursor {key:?} has a bad value {value:?}"))?;
        if cursors.insert(pull_key, next).is_some() {
            return Err(format!("cursor {key:?} appears twice"));
        }
    }
    match version.as_deref() {
        Some(v) if v == VERSION.to_string() => Ok(cursors),
        Some(v) => Err(format!("unknown format version {v:?}")),
        None => Err(format!(
            "no {VERSION_KEY} entry: not written by this runtime"
        )),
    }
}

/// Reads the checkpoint at `path`, setting an unusable file aside (see the module doc).
pub fn load(path: &Path) -> Loaded {
    let text = match fs::read(path) {
        Ok(bytes) => String::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_owned()),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Loaded::Missing,
        Err(err) => Err(format!("unreadable: {err}")),
    };
    match text.and_then(|text| parse(&text)) {
        Ok(cursors) => Loaded::Cursors(cursors),
        Err(reason) => set_aside(path, reason),
    }
}

fn set_aside(path: &Path, reason: String) -> Loaded {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let mut moved_to = path.as_os_str().to_owned();
    moved_to.push(format!(".corrupt-{millis}"));
    let moved_to = PathBuf::from(moved_to);
    match fs::rename(path, &moved_to) {
        Ok(()) => tracing::error!(
            file = %path.display(),
            moved_to = %moved_to.display(),
            %reason,
            "unusable pull-cursor checkpoint set aside; cursors fall back to the watermark or the configured start"
        ),
        Err(err) => tracing::error!(
            file = %path.display(),
            %reason,
            error = %err,
            "unusable pull-cursor checkpoint could not be moved aside; ignoring it"
        ),
    }
    Loaded::SetAside { moved_to, reason }
}

/// Atomically replaces the checkpoint at `path` with `cursors`.
pub fn store(path: &Path, cursors: &Cursors) -> Result<(), CheckpointError> {
    let error = |source| CheckpointError {
        path: path.to_owned(),
        source,
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // A backend whose data directory holds nothing else (Kafka) may not have created it.
    fs::create_dir_all(dir).map_err(error)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = File::create(&tmp).map_err(error)?;
    file.write_all(render(cursors).as_bytes()).map_err(error)?;
    file.sync_all().map_err(error)?;
    drop(file);
    crash_point(CrashPoint::BeforeCheckpointRename);
    fs::rename(&tmp, path).map_err(error)?;
    File::open(dir).and_then(|d| d.sync_all()).map_err(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cursors(entries: &[(&str, i64)]) -> Cursors {
        entries
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), *v))
            .collect()
    }

    #[test]
    fn file_names_per_backend_and_group() {
        let dir = Path::new("/data");
        assert_eq!(
            path(dir, "kafka", None),
            Path::new("/data/kafka-pull-offsets.properties")
        );
        let group = GroupName::new("billing").unwrap();
        assert_eq!(
            path(dir, "local", Some(&group)),
            Path::new("/data/local-pull-offsets@billing.properties")
        );
    }

    #[test]
    fn store_and_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let file = path(dir.path(), "local", None);
        assert_eq!(load(&file), Loaded::Missing);
        let saved = cursors(&[
            ("orders#0", 8),
            ("orders#1", 0),
            ("parent#chat@3", 17),
            ("t#broker-a:2", 5),
        ]);
        store(&file, &saved).unwrap();
        let text = fs::read_to_string(&file).unwrap();
        assert!(text.contains("orders\\#0=8"), "{text}");
        assert!(text.contains("eventmesh.pull-offsets.version=1"), "{text}");
        assert_eq!(load(&file), Loaded::Cursors(saved.clone()));
        // Replacing leaves no temporary file behind.
        store(&file, &cursors(&[("orders#0", 9)])).unwrap();
        assert_eq!(load(&file).into_cursors(), cursors(&[("orders#0", 9)]));
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn unusable_files_are_set_aside_with_the_reason() {
        let cases = [
            (
                "truncated",
                "eventmesh.pull-offsets.version=1\norders\\#0=1\norders\\#1=",
                "bad value",
            ),
            (
                "no version",
                "orders\\#0=5\n",
                "not written by this runtime",
            ),
            (
                "future version",
                "eventmesh.pull-offsets.version=2\n",
                "unknown format version",
            ),
            (
                "bad key",
                "eventmesh.pull-offsets.version=1\norders=5\n",
                "bad cursor key",
            ),
            (
                "negative",
                "eventmesh.pull-offsets.version=1\norders\\#0=-3\n",
                "bad value",
            ),
            (
                "duplicate",
                "eventmesh.pull-offsets.version=1\no\\#0=1\no\\#0=2\n",
                "twice",
            ),
            (
                "bad escape",
                "eventmesh.pull-offsets.version=1\no\\#0=\\uZZZZ\n",
                "malformed",
            ),
        ];
        for (name, text, why) in cases {
            let dir = tempfile::tempdir().unwrap();
            let file = path(dir.path(), "kafka", None);
            fs::write(&file, text).unwrap();
            match load(&file) {
                Loaded::SetAside { moved_to, reason } => {
                    assert!(reason.contains(why), "{name}: {reason}");
                    assert!(!file.exists(), "{name}: the bad file is moved away");
                    assert_eq!(
                        fs::read_to_string(&moved_to).unwrap(),
                        text,
                        "{name}: kept for inspection"
                    );
                }
                other => panic!("{name}: {other:?}"),
            }
            assert_eq!(
                load(&file),
                Loaded::Missing,
                "{name}: the next load starts fresh"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let file = path(dir.path(), "kafka", None);
        fs::write(&file, [0xff, 0xfe, 0x00]).unwrap();
        assert!(matches!(load(&file), Loaded::SetAside { reason, .. } if reason.contains("UTF-8")));
    }
}
