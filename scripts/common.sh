# Shared by the project's scripts; source it, do not run it.
# Sets the cache locations and provides idempotent installers.

set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# One cache outside the checkout, so fresh clones (and CI runs) on the same machine reuse
# compiled dependencies and installed tools.
EM_CACHE="${EM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/eventmesh-rs}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$EM_CACHE/target}"
EM_TOOLS="$EM_CACHE/tools"
mkdir -p "$EM_CACHE" "$EM_TOOLS"

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

# Installs Debian packages that are missing (apt-get update only when something is).
ensure_apt() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Build prerequisites: libclang for RocksDB's bindgen, protoc and the well-known types
# (google/protobuf/*.proto, in libprotobuf-dev) for etcd-client's build (our own proto crate
# uses a vendored protoc), a C++ compiler for RocksDB.
ensure_build_deps() {
  command -v cargo >/dev/null || { echo "cargo is required (https://rustup.rs)" >&2; exit 1; }
  ensure_apt build-essential pkg-config clang libclang-dev protobuf-compiler libprotobuf-dev
}

# cargo install for a test tool (a broker) into the tool cache, built the way the workspace's own
# dev build is: the same target directory, toolchain (rust-toolchain.toml, hence the `cd`) and
# dev profile (`.cargo/config.toml`, which `cargo install` would otherwise ignore). So every
# dependency a broker shares with the workspace at the same version and features is compiled
# once: after `scripts/run.sh` has built the services, the three brokers take about 7.5 minutes
# on 2 cores instead of 15 (at opt-level 1 in a target directory of their own). The brokers
# run no slower in the tests that use them (their hot crates are optimised by the dev profile);
# the Kafka benchmarks compare against raw reads from the same broker, so it moves both sides.
cargo_install_tool() {
  (cd "$REPO_ROOT" && cargo install "$@" --locked --debug --root "$EM_TOOLS" \
    --config "$REPO_ROOT/.cargo/config.toml")
}

# Keeps the persistent target directory from growing without bound: every commit leaves new
# builds of the workspace's own targets (test binaries of hundreds of MB) and incremental
# caches beside the old ones (a fresh clone rebuilds them anyway). Removes those not modified
# for EM_PRUNE_MINUTES (default 120); the compiled dependencies — the expensive part — are
# never touched.
prune_target() {
  local minutes="${EM_PRUNE_MINUTES:-120}" profile dir name
  # The workspace's own target names: crates (lib, bins) and every test, bench and example.
  local names=(dispatcher_svc puller_svc offset_svc emctl jetstream_bench eventmesh_client
    eventmesh_common eventmesh_proto eventmesh_testkit eventmesh_peer_bench)
  for name in "$REPO_ROOT"/*/tests/*.rs "$REPO_ROOT"/*/benches/*.rs "$REPO_ROOT"/*/examples/*.rs; do
    [ -e "$name" ] && names+=("$(basename "$name" .rs | tr '-' '_')")
  done
  # The brokers' former target directory, before they were built into this one.
  rm -rf "$EM_CACHE/install-target"
  for profile in debug release; do
    dir="$CARGO_TARGET_DIR/$profile"
    [ -d "$dir" ] || continue
    [ -d "$dir/incremental" ] &&
      find "$dir/incremental" -mindepth 1 -maxdepth 1 -mmin "+$minutes" -exec rm -rf {} +
    for name in "${names[@]}"; do
      for sub in deps examples; do
        [ -d "$dir/$sub" ] || continue
        find "$dir/$sub" -maxdepth 1 -type f -mmin "+$minutes" \
          \( -name "$name-*" -o -name "lib$name-*" \) -delete
      done
    done
  done
}

# buf (protobuf linter) from the npm registry, into the tool cache.
ensure_buf() {
  local bin="$EM_TOOLS/node/node_modules/.bin/buf"
  if [ ! -x "$bin" ]; then
    command -v npm >/dev/null || ensure_apt npm
    log "installing buf from npm"
    npm install --silent --no-audit --no-fund --prefix "$EM_TOOLS/node" @bufbuild/buf@1 >/dev/null
  fi
  BUF="$bin"
}

# --- Servers started by the test scripts (etcd.sh, kafka.sh, nats.sh) --------------------------

# A free loopback TCP port (asked of the kernel, then released).
free_port() {
  command -v python3 >/dev/null || ensure_apt python3
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# True (and says so) when the process whose pid is in PIDFILE still runs: a DIR is started once.
#   still_running NAME PIDFILE
still_running() {
  local name="$1" pidfile="$2"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "$name already running (pid $(cat "$pidfile"), $pidfile)" >&2
    return 0
  fi
  return 1
}

# Waits (up to WAIT_READY_SECONDS, 30 by default) until CHECK... succeeds while the process
# in PIDFILE lives; says where it is ready, or prints LOG's tail and fails.
#   wait_ready NAME WHERE PIDFILE LOG CHECK...
wait_ready() {
  local name="$1" where="$2" pidfile="$3" logfile="$4"
  shift 4
  for _ in $(seq 1 $((${WAIT_READY_SECONDS:-30} * 10))); do
    if "$@" >/dev/null 2>&1; then
      log "$name ready on $where (pid $(cat "$pidfile"))"
      return 0
    fi
    kill -0 "$(cat "$pidfile")" 2>/dev/null || break
    sleep 0.1
  done
  echo "$name did not become ready on $where; log tail:" >&2
  tail -20 "$logfile" >&2
  return 1
}

# Stops the process whose pid is in PIDFILE: SIGCONT first (a SIGSTOPped process acts on
# SIGTERM only once thawed), SIGTERM, up to 10 s, then SIGKILL; removes PIDFILE.
stop_pidfile() {
  local pidfile="$1" pid
  [ -f "$pidfile" ] || return 0
  pid="$(cat "$pidfile")"
  kill -CONT "$pid" 2>/dev/null || true
  if kill -TERM "$pid" 2>/dev/null; then
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}
