#!/usr/bin/env bash
# Side by side: our instance (`emctl bench`, local backend) against NATS JetStream
# (`jetstream-bench`, peer-bench/) on this machine, rounds alternated (ours, peer, ours, peer…),
# the same workload shape on both: N events published with acks (ours: the batching Publisher;
# JetStream: async publish, acks awaited in batches), then consumed by S streams of one shared
# group with one explicit ACK per message until nothing is pending; then the live load (N/2
# published as fast as answered while consumed) and ACK latency at half of each side's live
# rate. Prints every round as a JSON line, then a table of medians and ranges with the ratios
# ours / JetStream, CPU and RSS per process; last, the idle first-event latency of both
# (publish → delivery of single events after quiet spells, 200 samples per round), in
# --idle-rounds alternated rounds (ours, peer, ours, peer…).
#
#   scripts/bench-peer.sh [--events N] [--rounds R] [--sizes 256,1024] [--streams 1,8]
#                         [--max-in-flight M] [--profile release|dev] [--sync]
#                         [--worker-threads N] [--dispatcher-arg=FLAG]... [--idle-rounds I]
#
# --max-in-flight: our per-session in-flight limit (default 4,096; the dispatcher's limit is
# raised to it). JetStream's consumer keeps max_ack_pending = max(65,536, streams × 1,024), its
# own best, so ours is the smaller window of the two.
# --sync: our local log fsyncs every append write (per batch and partition); JetStream keeps its
# default (its file store does not fsync every write). --dispatcher-arg passes a flag to our
# dispatcher-svc (e.g. --dispatcher-arg=--group-shards=1). --worker-threads: each of our
# services' and our bench client's async workers (default: emctl bench's co-located split,
# docs/CONFIG.md "Worker threads"); jetstream-bench keeps tokio's default, its best. Builds what it runs (cargo, --profile),
# installs and starts nats-server (scripts/nats.sh) in a fresh directory, stops it at the end.
source "$(dirname "$0")/common.sh"

events=200000 rounds=5 sizes=256,1024 streams=1,8 profile=release sync=false max_in_flight=4096
idle_rounds=3
dispatcher_args=() worker_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --events) events="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --idle-rounds) idle_rounds="$2"; shift 2 ;;
    --sizes) sizes="$2"; shift 2 ;;
    --streams) streams="$2"; shift 2 ;;
    --max-in-flight) max_in_flight="$2"; shift 2 ;;
    --profile) profile="$2"; shift 2 ;;
    --sync) sync=true; shift ;;
    --dispatcher-arg=*) dispatcher_args+=("$1"); shift ;;
    --worker-threads) worker_args=(--worker-threads "$2"); shift 2 ;;
    *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

[[ "$idle_rounds" =~ ^[0-9]+$ ]] || { echo "--idle-rounds: a number of rounds, not '$idle_rounds'" >&2; exit 2; }

ensure_build_deps
# cargo from the checkout, wherever this is run from: the toolchain pin and .cargo/config.toml
# apply there only.
cd "$REPO_ROOT"
log "building the services, emctl and jetstream-bench ($profile)"
cargo build -q --profile "$profile" -p offset-svc -p puller-svc -p dispatcher-svc \
  -p eventmesh-client -p eventmesh-peer-bench --bins
bin_dir="$CARGO_TARGET_DIR/$([ "$profile" = dev ] && echo debug || echo "$profile")"

work="$(mktemp -d "${TMPDIR:-/tmp}/em-bench-peer.XXXXXX")"
trap 'bash "$REPO_ROOT/scripts/nats.sh" stop "$work/nats"; rm -rf "$work"' EXIT
nats_url="$(bash "$REPO_ROOT/scripts/nats.sh" start "$work/nats" | tail -1)"
nats_pid="$(cat "$work/nats/nats.pid")"
results="$work/rounds.jsonl"

for size in ${sizes//,/ }; do
  for stream_count in ${streams//,/ }; do
    for round in $(seq 1 "$rounds"); do
      log "size $size B, $stream_count streams, round $round/$rounds: ours"
      "$bin_dir/emctl" bench --events "$events" --sizes "$size" --streams "$stream_count" \
        --data-dir "$work" --bin-dir "$bin_dir" --puller-arg="--sync-appends=$sync" --json \
        --idle-samples 0 --max-in-flight "$max_in_flight" "${worker_args[@]}" "${dispatcher_args[@]}" \
        | sed "s/^{/{\"side\":\"ours\",\"round\":$round,\"sync\":$sync,/" | tee -a "$results"
      log "size $size B, $stream_count streams, round $round/$rounds: jetstream"
      "$bin_dir/jetstream-bench" --url "$nats_url" --server-pid "$nats_pid" --events "$events" \
        --size "$size" --streams "$stream_count" --json \
        | sed "s/^{/{\"side\":\"jetstream\",\"round\":$round,/" | tee -a "$results"
    done
  done
done

for round in $(seq 1 "$idle_rounds"); do
  log "idle first event, round $round/$idle_rounds: ours"
  "$bin_dir/emctl" bench --idle-only --idle-samples 200 --data-dir "$work" --bin-dir "$bin_dir" \
    --puller-arg="--sync-appends=$sync" --json "${worker_args[@]}" "${dispatcher_args[@]}" \
    | sed "s/^{/{\"side\":\"ours\",\"round\":$round,\"sync\":$sync,/" | tee -a "$results"
  log "idle first event, round $round/$idle_rounds: jetstream"
  "$bin_dir/jetstream-bench" --url "$nats_url" --idle-only --idle-samples 200 --json \
    | sed "s/^{/{\"side\":\"jetstream\",\"round\":$round,/" | tee -a "$results"
done

python3 - "$results" <<'PY'
import json, statistics, sys
lines = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
rows = [r for r in lines if "size" in r]
idle = [r for r in lines if "idle_samples" in r]
def stat(side, size, streams, field):
    values = [r[field] for r in rows if r["side"] == side and r["size"] == size
              and r["streams"] == streams and r.get(field) is not None]
    return (statistics.median(values), min(values), max(values)) if values else None
def show(v, digits=0):
    return "–" if v is None else f"{v[0]:,.{digits}f} ({v[1]:,.{digits}f}–{v[2]:,.{digits}f})"
print()
print("| size | streams | side | publish/s | delivered+ACKed/s | full ACK p50 / p99 ms | live rate/s | live ACK p50 / p99 ms | half rate/s | half ACK p50 / p99 ms |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
configs = sorted({(r["size"], r["streams"]) for r in rows})
for size, streams in configs:
    for side in ("ours", "jetstream"):
        def med(field):
            v = stat(side, size, streams, field)
            return "–" if v is None else f"{v[0]:.2f}"
        print(f"| {size} | {streams} | {side} | {show(stat(side, size, streams, 'publish_per_sec'))} "
              f"| {show(stat(side, size, streams, 'e2e_per_sec'))} "
              f"| {med('full_ack_p50_ms')} / {med('full_ack_p99_ms')} "
              f"| {show(stat(side, size, streams, 'live_per_sec'))} "
              f"| {med('live_ack_p50_ms')} / {med('live_ack_p99_ms')} "
              f"| {show(stat(side, size, streams, 'half_rate_per_sec'))} "
              f"| {med('half_ack_p50_ms')} / {med('half_ack_p99_ms')} |")
print()
print("| size | streams | delivered+ACKed ours / JetStream | publish ours / JetStream | live ours / JetStream |")
print("| --- | --- | --- | --- | --- |")
for size, streams in configs:
    def ratio(field):
        a, b = stat("ours", size, streams, field), stat("jetstream", size, streams, field)
        return "–" if not a or not b else f"{a[0] / b[0]:.2f}"
    print(f"| {size} | {streams} | {ratio('e2e_per_sec')} | {ratio('publish_per_sec')} | {ratio('live_per_sec')} |")
print()
print("| size | streams | side | CPU cores (median) | RSS MiB after the full load (median) |")
print("| --- | --- | --- | --- | --- |")
for size, streams in configs:
    def med(side, field, digits):
        v = stat(side, size, streams, field)
        return "–" if v is None else f"{v[0]:.{digits}f}"
    print(f"| {size} | {streams} | ours | dispatcher {med('ours', 'cpu_dispatcher', 2)}, "
          f"puller {med('ours', 'cpu_puller', 2)}, offset {med('ours', 'cpu_offset', 2)}, "
          f"client {med('ours', 'cpu_client', 2)} "
          f"| dispatcher {med('ours', 'rss_mib_dispatcher', 0)}, puller {med('ours', 'rss_mib_puller', 0)}, "
          f"offset {med('ours', 'rss_mib_offset', 0)} |")
    print(f"| {size} | {streams} | jetstream | server {med('jetstream', 'server_cpu_cores', 2)}, "
          f"client {med('jetstream', 'client_cpu_cores', 2)} | server {med('jetstream', 'server_rss_mb', 0)} |")
if idle:
    print()
    print(f"Idle first event (publish → delivery of single events after {idle[0]['idle_gap_ms']} ms "
          f"of quiet; median (range) over the rounds, {idle[0]['idle_samples']} samples each; "
          f"ours with sync={idle[0].get('sync', False)}, JetStream with its default):")
    print()
    print("| side | rounds | first event p50 ms | p99 ms | max ms | publish call p50 ms | p99 ms | max ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for side in ("ours", "jetstream"):
        runs = [r for r in idle if r["side"] == side]
        if not runs:
            continue
        def spread(field):
            values = [r[field] for r in runs]
            return (f"{statistics.median(values):.2f} "
                    f"({min(values):.2f}–{max(values):.2f})")
        print(f"| {side} | {len(runs)} | {spread('first_event_p50_ms')} | "
              f"{spread('first_event_p99_ms')} | {spread('first_event_max_ms')} | "
              f"{spread('publish_p50_ms')} | {spread('publish_p99_ms')} | {spread('publish_max_ms')} |")
PY
