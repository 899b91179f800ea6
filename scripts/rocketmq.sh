#!/usr/bin/env bash
# A real RocketMQ name server and broker for tests: rocketmq-namesrv and rocketmq-broker 1.0.0
# (crates.io, the Rust re-implementation), every listener on 127.0.0.1.
#
#   scripts/rocketmq.sh install                 # build both into the tool cache once (about 4 min)
#   scripts/rocketmq.sh start DIR               # name server + broker-a in DIR; waits until ready
#   scripts/rocketmq.sh start-broker DIR NAMESRV [NAME]
#                                               # one more broker (default broker-b) joining NAMESRV
#   scripts/rocketmq.sh stop DIR                # stop what was started in DIR, by pid
#
# `start` prints the name server's address (127.0.0.1:PORT) on its last line of stdout.
# Ports are free ones asked of the kernel; the store lives in DIR (a fresh DIR is a fresh broker).
# The broker runs with `--log-filter error`: POP traffic makes 1.0.0 log a WARN flood (see
# docs/ROCKETMQ.md). Idempotent: install skips matching binaries, start refuses a running DIR.
source "$(dirname "$0")/common.sh"

ROCKETMQ_VERSION=1.0.0
# A name server or broker starting beside busy tests on 2 cores can take well over 30 s.
WAIT_READY_SECONDS=90
NAMESRV="$EM_TOOLS/bin/rocketmq-namesrv-rust"
BROKER="$EM_TOOLS/bin/rocketmq-broker-rust"

installed() {
  [ -x "$1" ] && "$1" --version 2>/dev/null | grep -q "$ROCKETMQ_VERSION"
}

install_rocketmq() {
  installed "$NAMESRV" && installed "$BROKER" && return 0
  ensure_apt build-essential pkg-config cmake
  local crate
  for crate in rocketmq-namesrv rocketmq-broker; do
    installed "$EM_TOOLS/bin/$crate-rust" && continue
    log "building $crate $ROCKETMQ_VERSION into $EM_TOOLS (once per machine, about 2 minutes)"
    # Into the workspace's target directory (cargo_install_tool): both reuse the deps built there.
    cargo_install_tool "$crate" --version "$ROCKETMQ_VERSION"
  done
}

# Readiness is the servers' own /readyz (ROCKETMQ_HEALTH_BIND_ADDR), asked with curl.
ready() { curl -sf "http://$1/readyz"; }

# start_broker DIR NAMESRV NAME: a broker named NAME in DIR/NAME, registered with NAMESRV.
# A free port can be taken by someone else before the broker binds it (tests start brokers
# side by side): a broker that exits while starting is tried again on other ports, twice.
start_broker() {
  local dir="$1" namesrv="$2" name="$3" attempt pidfile
  pidfile="$dir/$name/broker.pid"
  still_running "$name" "$pidfile" && return 1
  for attempt in 1 2 3; do
    launch_broker "$dir" "$namesrv" "$name" && return 0
    # Still running: it did not become ready in time; stop it rather than try again.
    if kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      stop_pidfile "$pidfile"
      return 1
    fi
    log "$name exited while starting (attempt $attempt of 3)"
  done
  return 1
}

launch_broker() {
  local dir="$1" namesrv="$2" name="$3"
  local home="$dir/$name" port health
  mkdir -p "$home/store" "$home/conf"
  # The fast port is listenPort - 2 and HA is its own: pick a listen port whose -2 is free too.
  while :; do
    port="$(free_port)"
    [ "$port" -gt 1026 ] && (! (echo >"/dev/tcp/127.0.0.1/$((port - 2))") 2>/dev/null) && break
  done
  health="127.0.0.1:$(free_port)"
  cat >"$home/conf/broker.toml" <<EOF
[broker]
namesrvAddr = "$namesrv"
brokerIp1 = "127.0.0.1"
brokerIp2 = "127.0.0.1"
listenPort = $port
storePathRootDir = "$home/store"
# A topic registration the broker fails to deliver waits for the next periodic one: 10 s
# (the least 1.0.0 allows) rather than 30 s.
registerNameServerPeriod = 10000

[broker.brokerServerConfig]
bindAddress = "127.0.0.1"

[broker.brokerIdentity]
brokerName = "$name"
brokerClusterName = "DefaultCluster"
brokerId = 0

[store]
storeType = "LocalFile"
brokerRole = "ASYNC_MASTER"
storePathRootDir = "$home/store"
haListenAddress = "127.0.0.1"
haListenPort = $(free_port)
mappedFileSizeCommitLog = 67108864
# The defaults (75 / 85 / 90 %) are about the whole disk, not the broker's share: on a busy
# build machine 1.0.0 refuses to start at all ("disk capacity requires reclaim").
diskMaxUsedSpaceRatio = 95
diskSpaceCleanForciblyRatio = 97
diskSpaceWarningLevelRatio = 98
EOF
  (cd "$home" && ROCKETMQ_HOME="$home" ROCKETMQ_SECURITY_PROFILE=development-insecure-loopback \
    ROCKETMQ_HEALTH_BIND_ADDR="$health" ROCKETMQ_SHUTDOWN_TIMEOUT_SECONDS=5 \
    exec "$BROKER" -c conf/broker.toml -n "$namesrv" --log-filter "${ROCKETMQ_LOG_FILTER:-error}" >"$home/broker.log" 2>&1) &
  echo $! >"$home/broker.pid"
  echo "127.0.0.1:$port" >"$home/broker.addr"
  wait_ready "$name" "127.0.0.1:$port" "$home/broker.pid" "$home/broker.log" ready "$health"
}

start_rocketmq() {
  local dir="$1" home port health
  home="$dir/namesrv"
  mkdir -p "$home/conf"
  still_running rocketmq-namesrv "$home/namesrv.pid" && return 1
  install_rocketmq
  command -v curl >/dev/null || ensure_apt curl
  port="$(free_port)"
  health="127.0.0.1:$(free_port)"
  cat >"$home/conf/namesrv.toml" <<EOF
rocketmqHome = "$home"
kvConfigPath = "$home/kvConfig.json"
configStorePath = "$home/namesrv.properties"
EOF
  (cd "$home" && ROCKETMQ_HOME="$home" ROCKETMQ_HEALTH_BIND_ADDR="$health" \
    exec "$NAMESRV" -c conf/namesrv.toml --bindAddress 127.0.0.1 --listenPort "$port" \
    >"$home/namesrv.log" 2>&1) &
  echo $! >"$home/namesrv.pid"
  echo "127.0.0.1:$port" >"$dir/namesrv.addr"
  if ! wait_ready rocketmq-namesrv "127.0.0.1:$port" "$home/namesrv.pid" "$home/namesrv.log" \
      ready "$health"; then
    stop_rocketmq "$dir"
    return 1
  fi
  if ! start_broker "$dir" "127.0.0.1:$port" broker-a; then
    stop_rocketmq "$dir"
    return 1
  fi
  echo "127.0.0.1:$port"
}

stop_rocketmq() {
  local dir="$1" pidfile
  # Brokers first (they unregister from the name server), then the name server.
  for pidfile in "$dir"/*/broker.pid; do
    [ -e "$pidfile" ] && stop_pidfile "$pidfile"
  done
  stop_pidfile "$dir/namesrv/namesrv.pid"
}

case "${1:-}" in
  install) install_rocketmq ;;
  start) start_rocketmq "${2:?usage: rocketmq.sh start DIR}" ;;
  start-broker)
    install_rocketmq
    command -v curl >/dev/null || ensure_apt curl
    start_broker "${2:?usage: rocketmq.sh start-broker DIR NAMESRV [NAME]}" \
      "${3:?usage: rocketmq.sh start-broker DIR NAMESRV [NAME]}" "${4:-broker-b}"
    ;;
  stop) stop_rocketmq "${2:?usage: rocketmq.sh stop DIR}" ;;
  *) echo "usage: $0 install | start DIR | start-broker DIR NAMESRV [NAME] | stop DIR" >&2; exit 2 ;;
esac
