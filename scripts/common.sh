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
