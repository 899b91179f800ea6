//! Deployment checks: every service's `--check-config`, and the Kubernetes manifests validated
//! offline with the configs they carry accepted by the real binaries (scripts/deploy-check.sh;
//! `scripts/deploy-check.sh install` puts its tools in place, scripts/test.sh runs it).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const SERVICES: [&str; 3] = ["offset-svc", "puller-svc", "dispatcher-svc"];

/// The directory holding the service binaries of this build (beside emctl).
fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_emctl"))
        .parent()
        .unwrap()
        .to_owned()
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Runs `service --check-config file` with none of our EM_* environment.
fn check_config(service: &str, file: &Path, env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(bin_dir().join(service));
    for (key, _) in std::env::vars() {
        if key.starts_with("EM_") {
            command.env_remove(key);
        }
    }
    command
        .arg("--check-config")
        .arg(file)
        .envs(env.iter().copied());
    command.output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn every_service_reports_the_effective_settings_of_an_accepted_file() {
    let dir = tempfile::tempdir().unwrap();
    for service in SERVICES {
        let file = dir.path().join(format!("{service}.toml"));
        std::fs::write(&file, "log_format = \"json\"\nshutdown_timeout_secs = 7\n").unwrap();
        let out = check_config(service, &file, &[]);
        assert!(out.status.success(), "{service}: {}", text(&out.stderr));
        let report = text(&out.stdout);
        assert!(
            report.starts_with(&format!("# {service}: {} is accepted", file.display())),
            "{report}"
        );
        // The report is a config file of its own with the file's values and the defaults.
        let settings: toml::Table = toml::from_str(&report).unwrap();
        assert_eq!(settings["log_format"].as_str(), Some("json"), "{report}");
        assert_eq!(settings["shutdown_timeout_secs"].as_integer(), Some(7));
        assert!(settings.contains_key("listen"), "{report}");
        let again = dir.path().join(format!("{service}-again.toml"));
        std::fs::write(&again, &report).unwrap();
        let out = check_config(service, &again, &[]);
        assert!(out.status.success(), "{service}: {}", text(&out.stderr));
    }
}

#[test]
fn the_environment_applies_on_top_of_the_checked_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dispatcher.toml");
    std::fs::write(&file, "[delivery]\nmax_attempts = 3\n").unwrap();
    let out = check_config(
        "dispatcher-svc",
        &file,
        &[
            ("EM_DISPATCHER_MAX_ATTEMPTS", "9"),
            ("EM_DISPATCHER_INSTANCE_ID", "node-7"),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let settings: toml::Table = toml::from_str(&text(&out.stdout)).unwrap();
    assert_eq!(settings["instance_id"].as_str(), Some("node-7"));
    assert_eq!(settings["delivery"]["max_attempts"].as_integer(), Some(9));
}

#[test]
fn refused_files_exit_non_zero_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, &str); 6] = [
        ("offset-svc", "sync_write = true\n", "sync_write"),
        (
            "offset-svc",
            "store = \"memory\"\nread_only = true\n",
            "read_only",
        ),
        (
            "puller-svc",
            "offset_svc = \"127.0.0.1:50053\"\n",
            "offset_svc",
        ),
        (
            "puller-svc",
            "default_partitions = 0\n",
            "default_partitions",
        ),
        ("dispatcher-svc", "puller = \"puller:50052\"\n", "puller"),
        (
            "dispatcher-svc",
            "[cluster]\netcd_endpoints = [\"etcd:2379\"]\n",
            "etcd_endpoints",
        ),
    ];
    for (n, (service, toml_text, key)) in cases.into_iter().enumerate() {
        let file = dir.path().join(format!("{n}.toml"));
        std::fs::write(&file, toml_text).unwrap();
        let out = check_config(service, &file, &[]);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{service} accepted {toml_text:?}");
        assert!(stderr.contains(key), "{service} {toml_text:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    }
    let missing = dir.path().join("missing.toml");
    let out = check_config("offset-svc", &missing, &[]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("missing.toml"));
}

fn deploy_check(deploy_dir: &Path) -> Output {
    Command::new("bash")
        .arg(repo_root().join("scripts/deploy-check.sh"))
        .arg("check")
        .arg(deploy_dir)
        .arg(bin_dir())
        .output()
        .unwrap()
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// A copy of deploy/ with `file` (relative to it) edited by `edit`.
fn edited_deploy(edit_file: &str, edit: impl FnOnce(String) -> String) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&repo_root().join("deploy"), dir.path());
    let path = dir.path().join(edit_file);
    let before = std::fs::read_to_string(&path).unwrap();
    let after = edit(before.clone());
    assert_ne!(before, after, "the edit of {edit_file} changed nothing");
    std::fs::write(&path, after).unwrap();
    dir
}

#[test]
fn the_kubernetes_manifests_validate_and_carry_configs_the_services_accept() {
    let out = deploy_check(&repo_root().join("deploy"));
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // The base and the example overlay, three service files each.
    assert!(stderr.contains("6 config files accepted"), "{stderr}");
}

#[test]
fn the_manifest_check_refuses_an_unknown_field() {
    let dir = edited_deploy("kubernetes/base/offset-svc.yaml", |text| {
        text.replacen(
            "terminationGracePeriodSeconds: 45",
            "terminationGracePeriodSeconds: 45\n      terminationGraceSeconds: 45",
            1,
        )
    });
    let out = deploy_check(dir.path());
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("terminationGraceSeconds"), "{all}");
}

#[test]
fn the_manifest_check_refuses_a_config_the_binary_refuses() {
    let dir = edited_deploy(
        "kubernetes/overlays/example/config/dispatcher-svc.toml",
        |text| text.replacen("max_attempts = 8", "max_attempt = 8", 1),
    );
    let out = deploy_check(dir.path());
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("overlays/example: dispatcher-svc refuses its ConfigMap file"),
        "{stderr}"
    );
    assert!(stderr.contains("max_attempt"), "{stderr}");
}

#[test]
fn the_manifest_check_refuses_bad_yaml_style() {
    let dir = edited_deploy("kubernetes/base/serviceaccount.yaml", |text| {
        text.replacen(
            "automountServiceAccountToken: false",
            "automountServiceAccountToken: false   ",
            1,
        )
    });
    let out = deploy_check(dir.path());
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("trailing-spaces"), "{all}");
}
