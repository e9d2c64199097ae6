#!/usr/bin/env bash
# Writes crates/weir/symbol-order.txt: the functions the release `weir` runs, in the order the
# linker should lay them out (build.rs hands the file to lld for release builds).
#
# Why: the kernel maps the 64 KiB around each page of code a process first touches, so a
# start that touches a few hundred functions spread over 10 MB of code keeps about 8 MB of it
# resident. Laid out together, the functions a start and an idle engine run fill about 3 MB,
# and the ones a load adds come right after them (docs/performance-log.md, "Code laid out by
# use").
#
# How: the release binary runs under valgrind's callgrind on the example flows, with a
# private mosquitto; the functions run up to a second of idleness come first, then those a
# little of each kind of load adds (webhooks answered and accepted, MQTT in and out, the
# admin API). Only names the binary defines are kept.
#
# When: after a dependency or toolchain update (symbol names carry a hash of their crate's
# build), and after edits of weir's code when `cargo bench --bench webhook` says names no
# longer match (a closure is named by its place among its function's closures, so a new
# one renames those after it: 55 unmatched names once cost 1.1 MiB at idle). A stale file
# costs memory, never correctness: names it no longer matches are ignored. Names depend on
# the build's features too, so the file is made from, and fits, the default build of
# `cargo build --release -p weir`. `WEIR_SYMBOL_ORDER=0` at build time leaves the layout to
# the linker (to measure what the order is worth).
#
# Needs: valgrind, mosquitto, curl. Takes about a minute after the build.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=crates/weir/symbol-order.txt

cargo build --release -q -p weir --bin weir
bin=$root/target/release/weir
work=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() { # wait_for SECONDS COMMAND...: until the command succeeds, at most SECONDS
    local until=$((SECONDS + $1)); shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < until)) || { echo "symbol-order: timed out waiting for: $*" >&2; exit 1; }
        sleep 0.2
    done
}

mqtt_port=$(free_port)
printf 'listener %s 127.0.0.1\nallow_anonymous true\n' "$mqtt_port" >"$work/mosquitto.conf"
mosquitto -c "$work/mosquitto.conf" >"$work/mosquitto.log" 2>&1 &
pids+=($!)
wait_for 10 mosquitto_pub -p "$mqtt_port" -t ping -m x

http_port=$(free_port)
valgrind --tool=callgrind --demangle=no --callgrind-out-file="$work/cg.out" \
    "$bin" run flows --queue "sqlite:$work/queue.db" --http "127.0.0.1:$http_port" \
    --mqtt "mqtt://127.0.0.1:$mqtt_port" >"$work/weir.log" 2>&1 &
weir=$!
pids+=($weir)
wait_for 120 curl -sf "127.0.0.1:$http_port/readyz"
sleep 2
callgrind_control -d "$weir" >/dev/null # the first dump: start and idle
wait_for 30 test -s "$work/cg.out.1"

for i in $(seq 100); do
    curl -sf -H 'content-type: application/json' -d "{\"n\": $i}" "127.0.0.1:$http_port/hooks/echo" >/dev/null
    curl -sf -H 'content-type: application/json' -d "{\"amount\": $((i * 3)), \"customer\": \"c$i\"}" \
        "127.0.0.1:$http_port/hooks/orders" >/dev/null
    mosquitto_pub -p "$mqtt_port" -q 1 -t "home/room$((i % 7))/temperature" -m '{"celsius": 16.5}'
done
for path in /metrics /api/stats /api/flows /api/dead /healthz; do
    curl -s "127.0.0.1:$http_port$path" >/dev/null
done
sleep 3 # the delays and rate limits fire
kill -TERM "$weir"
wait "$weir" || true
wait_for 30 test -s "$work/cg.out"

# Function names in a callgrind file: `fn=(id) name` or `cfn=(id) name` the first time an id
# appears; in the order they first appear, which follows the run.
names() { sed -nE 's/^c?fn=\([0-9]+\) (.*)$/\1/p' "$1" | awk '!seen[$0]++'; }
nm --defined-only "$bin" | awk '$2 ~ /^[tTwW]$/ {print $3}' | sort -u >"$work/defined"
# `_start` (the C runtime's entry, before valgrind names anything) goes first.
{ echo _start; names "$work/cg.out.1"; names "$work/cg.out"; } | awk '!seen[$0]++' \
    | awk 'NR == FNR {defined[$0] = 1; next} defined[$0]' "$work/defined" - >"$out"
echo "symbol-order: $(wc -l <"$out") functions in $out ($(names "$work/cg.out.1" | wc -l) run by a start)"
