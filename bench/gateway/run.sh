#!/usr/bin/env bash
# Gateway performance benchmark: the same load (oha), the same request and the same three mock
# upstreams against four systems -- the upstream directly, Equiroute, nginx and the LiteLLM
# proxy -- then one table of added latency, sustained throughput and peak memory.
# See bench/gateway/README.md for the method and the prerequisites.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh" # find_nginx (run.sh keeps its own find_oha, defined below)
ROOT=$(cd "$HERE/../.." && pwd)

usage() {
    cat <<EOF
Usage: bench/gateway/run.sh [--quick] [--profile heavy-tail] [--systems LIST] [--out DIR] [--install]

  --quick          a smoke run: 2 s points, 1 s warm-ups, throughput at c=64 only (about 2 min)
  --systems LIST   comma-separated subset of: direct,equiroute,equiroute1,nginx,litellm
                   (default: all; equiroute1 is Equiroute with server.worker_threads = 1;
                   direct is always measured, the added latencies need it)
  --profile heavy-tail
                   instead of the phases above: every system at one fixed rate against three
                   mocks with a heavy (Pareto) tail, Equiroute with and without hedging
                   (systems direct,nginx,litellm,equiroute,equiroute-hedge; about 9 minutes;
                   results in target/bench-gateway-tail by default)
  --out DIR        results directory (default: target/bench-gateway)
  --install        install what is missing first: nginx-light (apt-get), oha (cargo install),
                   litellm[proxy] (a virtualenv at LITELLM_VENV), then run

Environment:
  EQUIROUTE_BIN     the equiroute binary (default: target/release/equiroute;
                    build it with: cargo build --release -p equiroute)
  OHA_BIN           the load generator (default: oha on PATH, then ~/.cargo/bin/oha)
  NGINX_BIN         default: nginx on PATH, then /usr/sbin/nginx
  LITELLM_VENV      virtualenv holding litellm[proxy] (default: bench/gateway/.venv)
  BENCH_PORT_BASE   first of 16 loopback ports used (default: 18900)
  BENCH_DURATION    seconds measured per point (default: 10; --quick: 2)
  BENCH_DURATION_C1 seconds measured at c=1 in the latency phase (default: 20; --quick: 2)
  BENCH_WARMUP      seconds of warm-up before each point (default: 3; --quick: 1)
  BENCH_RATE        the fixed-rate run's requests per second (default: 2000)
  BENCH_TAIL_RATE   --profile heavy-tail: requests per second (default: 100)
  BENCH_TAIL_SECONDS, BENCH_TAIL_WARMUP
                    --profile heavy-tail: seconds measured (default: 60) after a warm-up at
                    the same rate (default: 30; the time Equiroute's latency model learns in)
EOF
}

QUICK=0
PROFILE=default
SYSTEMS=""
OUT=""
INSTALL=0
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --systems) SYSTEMS="direct,${2:?--systems needs a list}"; shift ;;
        --profile) PROFILE="${2:?--profile needs a name: heavy-tail}"; shift ;;
        --out) OUT="${2:?--out needs a directory}"; shift ;;
        --install) INSTALL=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

case "$PROFILE" in
    default)
        SYSTEMS="${SYSTEMS:-direct,equiroute,equiroute1,nginx,litellm}"
        OUT="${OUT:-$ROOT/target/bench-gateway}" ;;
    heavy-tail)
        SYSTEMS="${SYSTEMS:-direct,nginx,litellm,equiroute,equiroute-hedge}"
        OUT="${OUT:-$ROOT/target/bench-gateway-tail}" ;;
    *) echo "--profile $PROFILE: unknown profile; the one there is: heavy-tail" >&2; exit 2 ;;
esac
EQUIROUTE_BIN="${EQUIROUTE_BIN:-$ROOT/target/release/equiroute}"
LITELLM_VENV="${LITELLM_VENV:-$HERE/.venv}"
LITELLM_VERSION="1.108.7"
PORT_BASE="${BENCH_PORT_BASE:-18900}"
RATE="${BENCH_RATE:-2000}"
TAIL_RATE="${BENCH_TAIL_RATE:-100}"
TAIL_SECONDS="${BENCH_TAIL_SECONDS:-60}"
TAIL_WARMUP="${BENCH_TAIL_WARMUP:-30}"
for v in TAIL_RATE TAIL_SECONDS TAIL_WARMUP; do
    [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "BENCH_${v}: a positive integer, got '${!v}'" >&2; exit 2; }
done
if [ "$QUICK" = 1 ]; then
    DURATION="${BENCH_DURATION:-2}"; WARMUP="${BENCH_WARMUP:-1}"; C1_DURATION="${BENCH_DURATION_C1:-$DURATION}"
    LAT_LEVELS="1 16 64"; TPUT_LEVELS="64"; RATE_SECONDS=3
else
    DURATION="${BENCH_DURATION:-10}"; WARMUP="${BENCH_WARMUP:-3}"; C1_DURATION="${BENCH_DURATION_C1:-20}"
    LAT_LEVELS="1 16 64"; TPUT_LEVELS="16 64 256"; RATE_SECONDS=60
fi
CORES=$(nproc)
BODY='{"model":"chat","messages":[{"role":"user","content":"hello"}]}'
MASTER_KEY="sk-bench-master-key"   # LiteLLM's master key; every system gets the same header

# Loopback ports: mocks 20 ms on +1..+3, mocks 0 ms on +4..+6, systems from +10.
MOCK20=("127.0.0.1:$((PORT_BASE + 1))" "127.0.0.1:$((PORT_BASE + 2))" "127.0.0.1:$((PORT_BASE + 3))")
MOCK0=("127.0.0.1:$((PORT_BASE + 4))" "127.0.0.1:$((PORT_BASE + 5))" "127.0.0.1:$((PORT_BASE + 6))")
# --profile heavy-tail: the three heavy-tailed mocks on +7..+9.
TAIL=("127.0.0.1:$((PORT_BASE + 7))" "127.0.0.1:$((PORT_BASE + 8))" "127.0.0.1:$((PORT_BASE + 9))")
MOCK20_PIDS=(); MOCK0_PIDS=(); TAIL_PIDS=()
EQR_ADDR="127.0.0.1:$((PORT_BASE + 10))"
NGINX_ADDR="127.0.0.1:$((PORT_BASE + 11))"
LITELLM_PORT=$((PORT_BASE + 12))
LITELLM_ADDR="127.0.0.1:$LITELLM_PORT"

T_START=$(date +%s)
say() { printf '[%4ds] %s\n' "$(($(date +%s) - T_START))" "$*"; }
die() { echo "error: $*" >&2; exit 1; }
has() { case ",$SYSTEMS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# ---------------------------------------------------------------------------------------------
# Tools

find_oha() {
    if [ -n "${OHA_BIN:-}" ]; then echo "$OHA_BIN"; return; fi
    command -v oha 2>/dev/null || { [ -x "$HOME/.cargo/bin/oha" ] && echo "$HOME/.cargo/bin/oha"; } || true
}

if [ "$INSTALL" = 1 ]; then
    say "install: nginx-light (apt), oha (cargo install), litellm[proxy]==$LITELLM_VERSION (venv)"
    if [ -z "$(find_nginx)" ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light \
            || echo "install: nginx-light failed; the nginx row will be missing"
    fi
    if [ -z "$(find_oha)" ]; then
        cargo install oha --locked --version 1.16.0 || die "cargo install oha failed"
    fi
    if [ ! -x "$LITELLM_VENV/bin/litellm" ]; then
        { python3 -m venv "$LITELLM_VENV" \
            && "$LITELLM_VENV/bin/pip" install -q "litellm[proxy]==$LITELLM_VERSION"; } \
            || echo "install: litellm failed; the litellm row will be missing"
    fi
fi

[ -x "$EQUIROUTE_BIN" ] || die "no equiroute binary at $EQUIROUTE_BIN: build it first with
    cargo build --release -p equiroute
or point EQUIROUTE_BIN at one"
OHA=$(find_oha)
[ -n "$OHA" ] || die "the load generator oha is missing: cargo install oha --locked (or run with --install)"
command -v python3 >/dev/null || die "python3 is needed for the report"
command -v curl >/dev/null || die "curl is needed for readiness checks and /metrics"

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT/raw" "$OUT/logs" "$OUT/runs.jsonl"
mkdir -p "$OUT/raw" "$OUT/logs"
RUNS="$OUT/runs.jsonl"
TMP=$(mktemp -d /tmp/bench-gateway.XXXXXX)

# ---------------------------------------------------------------------------------------------
# Processes: every one we start is recorded, and stopped on exit (its process group, by id).

PIDS=()
stop_pid() {
    local pid=$1 i
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Starts "$@" in its own process group (so its workers stop with it); logs to logs/NAME.log.
start() {
    local name=$1; shift
    setsid "$@" >"$OUT/logs/$name.log" 2>&1 &
    STARTED=$!
    PIDS+=("$STARTED")
}

port_free() { ! (exec 3<>"/dev/tcp/${1%:*}/${1#*:}") 2>/dev/null; }

# Waits until POST /v1/chat/completions on $1 answers 200 (timeout $2 s, process $3 alive).
wait_ready() {
    local addr=$1 timeout=$2 pid=$3 deadline=$(($(date +%s) + $2))
    while [ "$(date +%s)" -lt "$deadline" ]; do
        kill -0 "$pid" 2>/dev/null || return 1
        if [ "$(curl -s -o /dev/null -w '%{http_code}' -m 5 "http://$addr/v1/chat/completions" \
            -H 'content-type: application/json' -H "authorization: Bearer $MASTER_KEY" \
            -d "$BODY")" = 200 ]; then
            return 0
        fi
        sleep 0.5
    done
    return 1
}

# Peak resident memory (VmHWM, KiB) summed over a process and all its descendants.
peak_rss_kib() {
    local pid=$1 total=0 p kids
    local todo=("$pid")
    while [ ${#todo[@]} -gt 0 ]; do
        p=${todo[0]}; todo=("${todo[@]:1}")
        total=$((total + $(awk '/^VmHWM:/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)))
        kids=$(cat /proc/"$p"/task/*/children 2>/dev/null || true)
        for k in $kids; do todo+=("$k"); done
    done
    echo "$total"
}

# CPU time (clock ticks, user + system) of a process and all its descendants.
cpu_ticks() {
    local total=0 p kids t
    local todo=("$1")
    while [ ${#todo[@]} -gt 0 ]; do
        p=${todo[0]}; todo=("${todo[@]:1}")
        # Fields 14 and 15 after the command name (which may hold spaces, inside parentheses).
        t=$(sed -E 's/^.*\) //' "/proc/$p/stat" 2>/dev/null | awk '{print $12 + $13}' || echo 0)
        total=$((total + ${t:-0}))
        kids=$(cat /proc/"$p"/task/*/children 2>/dev/null || true)
        for k in $kids; do todo+=("$k"); done
    done
    echo "$total"
}
CLK_TCK=$(getconf CLK_TCK)
mocks_ticks() {
    local p total=0
    for p in "${MOCK20_PIDS[@]}" "${MOCK0_PIDS[@]}" "${TAIL_PIDS[@]}"; do total=$((total + $(cpu_ticks "$p"))); done
    echo "$total"
}
# User + nice + system ticks of the whole machine.
machine_ticks() { awk 'NR == 1 {print $2 + $3 + $4}' /proc/stat; }
# CPU seconds (user + system) of this shell's finished children (the load generator's runs),
# into the variable named $1. `times` runs in this shell: a subshell would see its own children.
children_s() {
    times >"$TMP/times"
    printf -v "$1" '%s' "$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); n += a[1] * 60 + a[2] } printf "%.3f", n }' "$TMP/times")"
}

# Samples a process's resident memory (VmRSS, KiB) once a second into a file: "seconds kib".
sample_rss() {
    local pid=$1 file=$2 t0
    t0=$(date +%s.%N)
    while kill -0 "$pid" 2>/dev/null; do
        awk -v t0="$t0" -v now="$(date +%s.%N)" '/^VmRSS:/ {printf "%.2f %d\n", now - t0, $2}' \
            "/proc/$pid/status" >>"$file" 2>/dev/null || true
        sleep 1
    done
}

record() { echo "$1" >>"$RUNS"; }

# Share (%) of the machine's CPU busy over half a second: taken between points, while everything
# this script started is idle, it shows load from elsewhere (a build) that skews the numbers.
busy_pct() {
    local a b
    a=($(head -1 /proc/stat)); sleep 0.5; b=($(head -1 /proc/stat))
    local idle=$(((b[4] + b[5]) - (a[4] + a[5]))) total=0 i
    for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
    [ "$total" -gt 0 ] && echo $((100 * (total - idle) / total)) || echo 0
}

# One oha measurement: a warm-up (discarded), then the point itself.
#   measure SYSTEM PHASE ADDR CONCURRENCY [extra oha args...]
measure() {
    local system=$1 phase=$2 addr=$3 c=$4; shift 4
    local file="raw/$system-$phase-c$c.json" seconds=$DURATION busy
    busy=$(busy_pct)
    if [ "$busy" -gt 25 ]; then
        echo "      WARNING: the machine was ${busy}% busy before this point (load from elsewhere?)"
    fi
    # c=1 gets more samples: its p99 is the 1-in-100 request, and it carries the tightest target.
    { [ "$phase" = latency ] || [ "$phase" = repeat ]; } && [ "$c" = 1 ] && seconds=$C1_DURATION
    local common=(--no-tui --output-format json -m POST -H 'content-type: application/json'
        -H "authorization: Bearer $MASTER_KEY" -d "$BODY" --wait-ongoing-requests-after-deadline)
    if [ "$WARMUP" != 0 ]; then
        "$OHA" "${common[@]}" -c "$c" -z "${WARMUP}s" "$@" "http://$addr/v1/chat/completions" >/dev/null 2>>"$OUT/logs/oha.log" || true
    fi
    # --profile heavy-tail: the upstream calls and hedges so far (the warm-up's are not counted).
    if [ -n "${AFTER_WARMUP:-}" ]; then "$AFTER_WARMUP" "$system" before; fi
    local sut0 sut1 mocks0 mocks1 machine0 machine1 load0 load1 sut_s foreign
    sut0=$(cpu_ticks "$SUT_PID"); mocks0=$(mocks_ticks); machine0=$(machine_ticks); children_s load0
    if "$OHA" "${common[@]}" -c "$c" -z "${seconds}s" "$@" "http://$addr/v1/chat/completions" \
        >"$OUT/$file" 2>>"$OUT/logs/oha.log"; then
        sut1=$(cpu_ticks "$SUT_PID"); mocks1=$(mocks_ticks); machine1=$(machine_ticks); children_s load1
        sut_s=$(awk -v a="$sut0" -v b="$sut1" -v t="$CLK_TCK" 'BEGIN {printf "%.3f", (b - a) / t}')
        # CPU used on the machine by anything but the system, the mocks and the load generator,
        # as a share of one core: another build running alongside shows here.
        foreign=$(awk -v m="$((machine1 - machine0))" -v s="$((sut1 - sut0))" -v k="$((mocks1 - mocks0))" \
            -v l0="$load0" -v l1="$load1" -v t="$CLK_TCK" -v d="$seconds" -v direct="$([ "$system" = direct ] && echo 1 || echo 0)" \
            'BEGIN { f = (m - k - (direct ? 0 : s)) / t - (l1 - l0); printf "%.0f", (f < 0 ? 0 : f) * 100 / d }')
        if [ "$foreign" -gt 20 ]; then
            echo "      WARNING: other processes used ${foreign}% of a core during this point"
        fi
        record "{\"system\":\"$system\",\"phase\":\"$phase\",\"concurrency\":$c,\"file\":\"$file\",\"cpu_s\":$sut_s,\"busy_before_pct\":$busy,\"foreign_cpu_pct\":$foreign}"
        python3 "$HERE/report.py" --point "$OUT/$file"
    else
        record "{\"system\":\"$system\",\"phase\":\"$phase\",\"concurrency\":$c,\"error\":\"oha failed\"}"
        echo "      oha failed (see $OUT/logs/oha.log)"
    fi
}

missing() {
    say "$1: MISSING -- $2"
    record "{\"system\":\"$1\",\"missing\":$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$2")}"
}

subst() { # subst TEMPLATE OUTPUT UPSTREAM-SET-NAME LISTEN
    local -n ups=$3
    sed -e "s|@LISTEN@|$4|g" -e "s|@UPSTREAM_1@|${ups[0]}|g" -e "s|@UPSTREAM_2@|${ups[1]}|g" \
        -e "s|@UPSTREAM_3@|${ups[2]}|g" -e "s|@WORKERS@|$CORES|g" -e "s|@PREFIX@|${5:-}|g" "$1" >"$2"
}

# ---------------------------------------------------------------------------------------------
# The systems. Each start_* starts one instance against the mock set named by $1 (MOCK20 or
# MOCK0) and sets SUT_PID and SUT_ADDR, or returns 1 with a reason in WHY.

start_direct() {
    local -n ups=$1
    local -n pids="${1}_PIDS"
    SUT_ADDR=${ups[0]}
    SUT_PID=${pids[0]}
}

start_equiroute() {
    local cfg="$TMP/equiroute-$1.toml"
    subst "$HERE/equiroute.toml" "$cfg" "$1" "$EQR_ADDR"
    if [ -n "${EQR_THREADS:-}" ]; then
        sed -i "s|^listen = .*|&\nworker_threads = $EQR_THREADS|" "$cfg"
    fi
    if [ "$1" = TAIL ]; then
        # No deadline: every system waits for the slow answers alike (a deadline would cut
        # Equiroute's); without one a hedge starts at the first provider's predictive p95.
        sed -i '/^deadline_ms = /d' "$cfg"
    fi
    if [ -n "${EQR_HEDGE:-}" ]; then
        sed -i "s|^policy = .*|&\nhedge = $EQR_HEDGE|" "$cfg"
    fi
    if ! "$EQUIROUTE_BIN" check-config "$cfg" >"$OUT/logs/equiroute-check-config.log" 2>&1; then
        WHY="check-config refused the bench config: $(tail -1 "$OUT/logs/equiroute-check-config.log")"
        return 1
    fi
    start "equiroute-$1" "$EQUIROUTE_BIN" serve --config "$cfg"
    SUT_PID=$STARTED; SUT_ADDR=$EQR_ADDR
    wait_ready "$SUT_ADDR" 30 "$SUT_PID" || { WHY="did not answer within 30 s (logs/equiroute-$1.log)"; return 1; }
}

# Equiroute with one thread serving requests (server.worker_threads = 1): on a host whose other
# core runs the load generator and the upstreams, fewer threads mean fewer wake-ups.
start_equiroute1() { EQR_THREADS=1 start_equiroute "$@"; }

# Equiroute with hedged requests, the documented defaults written out (--profile heavy-tail).
HEDGE_TABLE='{ rule = { kind = "deadline-risk", threshold = 0.2, tail_quantile = 0.95 }, max_rate = 0.05, burst = 5, max_parallel = 2 }'
start_equiroute-hedge() { EQR_HEDGE=$HEDGE_TABLE start_equiroute "$@"; }

start_nginx() {
    local nginx prefix="$TMP/nginx-$1"
    nginx=$(find_nginx)
    [ -n "$nginx" ] || { WHY="nginx is not installed (apt-get install -y nginx-light, or NGINX_BIN)"; return 1; }
    mkdir -p "$prefix"
    subst "$HERE/nginx.conf" "$prefix/nginx.conf" "$1" "$NGINX_ADDR" "$prefix"
    start "nginx-$1" "$nginx" -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/error.log"
    SUT_PID=$STARTED; SUT_ADDR=$NGINX_ADDR
    wait_ready "$SUT_ADDR" 20 "$SUT_PID" || { WHY="did not answer within 20 s (logs/nginx-$1.log)"; return 1; }
}

start_litellm() {
    [ -x "$LITELLM_VENV/bin/litellm" ] \
        || { WHY="no LiteLLM at $LITELLM_VENV (python3 -m venv $LITELLM_VENV && $LITELLM_VENV/bin/pip install 'litellm[proxy]==$LITELLM_VERSION', or --install)"; return 1; }
    local cfg="$TMP/litellm-$1.yaml"
    subst "$HERE/litellm.yaml" "$cfg" "$1" "$LITELLM_ADDR"
    # Offline and quiet: the bundled cost map instead of a download, errors-only logs, no admin
    # UI or docs pages. Usage telemetry records nothing until LITELLM_TELEMETRY_DESTINATION
    # (or a saved setting) names a destination, so those variables are cleared.
    start "litellm-$1" env -u LITELLM_TELEMETRY_DESTINATION -u LITELLM_TELEMETRY_ENDPOINT \
        -u LITELLM_TELEMETRY_GROUPS -u DATABASE_URL -u REDIS_HOST -u REDIS_URL \
        LITELLM_MASTER_KEY="$MASTER_KEY" LITELLM_LOCAL_MODEL_COST_MAP=True \
        LITELLM_LOG=ERROR DISABLE_ADMIN_UI=True NO_DOCS=True NO_REDOC=True \
        "$LITELLM_VENV/bin/litellm" --config "$cfg" --host 127.0.0.1 --port "$LITELLM_PORT" \
        --num_workers "$CORES"
    SUT_PID=$STARTED; SUT_ADDR=$LITELLM_ADDR
    wait_ready "$SUT_ADDR" 120 "$SUT_PID" || { WHY="did not answer within 120 s (logs/litellm-$1.log)"; return 1; }
}

stop_sut() {
    local system=$1 phase=$2
    record "{\"system\":\"$system\",\"phase\":\"$phase\",\"peak_rss_kib\":$(peak_rss_kib "$SUT_PID")}"
    if [[ "$system" == equiroute* ]]; then
        curl -s -m 5 "http://$SUT_ADDR/metrics" >"$OUT/raw/$system-$phase-metrics.txt" || true
    fi
    [ "$system" = direct ] || stop_pid "$SUT_PID"
}

# Runs every phase of one system: added latency at 20 ms, throughput at 0 ms.
bench_system() {
    local system=$1 c
    WHY=""; SUT_PID=""
    say "$system: latency phase (20 ms upstream), c = ${LAT_LEVELS// /, }"
    if ! "start_$system" MOCK20; then
        [ -n "${SUT_PID:-}" ] && stop_pid "$SUT_PID"
        missing "$system" "$WHY"; return 0
    fi
    for c in $LAT_LEVELS; do
        say "$system: c=$c, ${WARMUP} s warm-up + $([ "$c" = 1 ] && echo "$C1_DURATION" || echo "$DURATION") s"
        measure "$system" latency "$SUT_ADDR" "$c"
    done
    stop_sut "$system" latency
    say "$system: throughput phase (0 ms upstream), c = ${TPUT_LEVELS// /, }"
    SUT_PID=""
    if ! "start_$system" MOCK0; then
        [ -n "${SUT_PID:-}" ] && stop_pid "$SUT_PID"
        missing "$system" "throughput phase: $WHY"; return 0
    fi
    for c in $TPUT_LEVELS; do
        say "$system: c=$c, ${WARMUP} s warm-up + ${DURATION} s"
        measure "$system" throughput "$SUT_ADDR" "$c"
    done
    stop_sut "$system" throughput
}

# ---------------------------------------------------------------------------------------------
# --profile heavy-tail: the systems one after the other at one fixed rate (open loop) against
# three mocks with a Pareto tail (mock-tail.toml): per system the end-to-end percentiles, the
# errors, and the chat calls the mocks received per request (what a hedge costs).

# Chat calls received so far, summed over the three heavy-tailed mocks.
tail_calls() {
    local a n total=0
    for a in "${TAIL[@]}"; do
        n=$(curl -sf -m 5 "http://$a/_stats" | python3 -c 'import json, sys; print(json.load(sys.stdin)["chat"])') \
            || { echo "?"; return 0; }
        total=$((total + n))
    done
    echo "$total"
}

# The mocks' call count (and Equiroute's /metrics) after the warm-up (WHEN = before, called by
# measure) and after the point (WHEN = after): the measured seconds are their difference.
tail_snapshot() {
    local system=$1 when=$2
    tail_calls >"$OUT/raw/$system-tail-calls-$when.txt"
    if [[ "$system" == equiroute* ]]; then
        curl -s -m 5 "http://$SUT_ADDR/metrics" >"$OUT/raw/$system-tail-metrics-$when.txt" || true
    fi
}

heavy_tail() {
    local i system
    for i in 0 1 2; do
        start "tail-$((i + 1))" "$EQUIROUTE_BIN" mock-upstream --listen "${TAIL[$i]}" --profile "$HERE/mock-tail.toml"
        TAIL_PIDS+=("$STARTED")
    done
    for i in 0 1 2; do
        wait_ready "${TAIL[$i]}" 10 "${TAIL_PIDS[$i]}" || die "mock upstream ${TAIL[$i]} did not start (logs/tail-$((i + 1)).log)"
    done
    say "mocks: heavy tail (mock-tail.toml) on ${TAIL[*]}"
    WARMUP=$TAIL_WARMUP; DURATION=$TAIL_SECONDS; AFTER_WARMUP=tail_snapshot
    for system in direct nginx litellm equiroute equiroute-hedge; do
        if ! has "$system"; then
            record "{\"system\":\"$system\",\"missing\":\"not selected (--systems)\"}"; continue
        fi
        say "$system: $TAIL_RATE rps, ${TAIL_WARMUP} s warm-up + ${TAIL_SECONDS} s measured"
        SUT_PID=""; WHY=""
        if ! "start_$system" TAIL; then
            [ -n "${SUT_PID:-}" ] && stop_pid "$SUT_PID"
            missing "$system" "$WHY"; continue
        fi
        measure "$system" tail "$SUT_ADDR" 64 -q "$TAIL_RATE" --latency-correction
        tail_snapshot "$system" after
        stop_sut "$system" tail
    done
    say "report"
    python3 "$HERE/report.py" --tail --out "$OUT" \
        --meta "$(printf '{"equiroute_bin":"%s","load_tool":"%s","cores":%s,"rate":%s,"duration_s":%s,"warmup_s":%s,"busy_pct_at_start":%s}' \
            "$EQUIROUTE_BIN" "$("$OHA" --version)" "$CORES" "$TAIL_RATE" "$TAIL_SECONDS" "$TAIL_WARMUP" "$LOAD")"
    say "done: $OUT/results.md, $OUT/results.json"
}

# ---------------------------------------------------------------------------------------------
# Main

ALL_PORTS=("${MOCK20[@]}" "${MOCK0[@]}" "${TAIL[@]}" "$EQR_ADDR" "$NGINX_ADDR" "$LITELLM_ADDR")
for a in "${ALL_PORTS[@]}"; do port_free "$a" || die "$a is taken: pick other ports with BENCH_PORT_BASE"; done

LOAD=$(busy_pct)
if [ "$LOAD" -gt 25 ]; then
    say "WARNING: the machine is ${LOAD}% busy before starting: something else is using the CPU, numbers will be skewed"
fi
say "equiroute: $EQUIROUTE_BIN ($("$EQUIROUTE_BIN" --version 2>/dev/null || echo '?'))"
if [ "$PROFILE" = heavy-tail ]; then
    say "load: $("$OHA" --version); $CORES cores; $TAIL_RATE rps, ${TAIL_SECONDS} s measured after ${TAIL_WARMUP} s warm-up; out: $OUT"
    heavy_tail
    exit 0
fi
say "load: $("$OHA" --version); $CORES cores; ${DURATION} s per point after ${WARMUP} s warm-up; out: $OUT"

MOCK20_PIDS=(); MOCK0_PIDS=()
for i in 0 1 2; do
    start "mock20-$((i + 1))" "$EQUIROUTE_BIN" mock-upstream --listen "${MOCK20[$i]}" --profile "$HERE/mock-20ms.toml"
    MOCK20_PIDS+=("$STARTED")
    start "mock0-$((i + 1))" "$EQUIROUTE_BIN" mock-upstream --listen "${MOCK0[$i]}" --profile "$HERE/mock-0ms.toml"
    MOCK0_PIDS+=("$STARTED")
done
for i in 0 1 2; do
    wait_ready "${MOCK20[$i]}" 10 "${MOCK20_PIDS[$i]}" || die "mock upstream ${MOCK20[$i]} did not start (logs/mock20-$((i + 1)).log)"
    wait_ready "${MOCK0[$i]}" 10 "${MOCK0_PIDS[$i]}" || die "mock upstream ${MOCK0[$i]} did not start (logs/mock0-$((i + 1)).log)"
done
say "mocks: 20 ms on ${MOCK20[*]}, 0 ms on ${MOCK0[*]}"

for system in direct equiroute equiroute1 nginx litellm; do
    if has "$system"; then bench_system "$system"; else record "{\"system\":\"$system\",\"missing\":\"not selected (--systems)\"}"; fi
done

# A/A: the direct upstream once more at c=1, after everything else. Two runs of one system
# differ by this much: the resolution of the added latencies at c=1.
say "direct: c=1 again (A/A: the run-to-run spread of one system)"
SUT_PID=${MOCK20_PIDS[0]}
measure direct repeat "${MOCK20[0]}" 1

# Equiroute at a fixed rate with three providers (20 ms upstream): its peak memory there.
if has equiroute; then
    say "equiroute: fixed rate $RATE rps for ${RATE_SECONDS} s (20 ms upstream), peak RSS"
    SUT_PID=""
    if start_equiroute MOCK20; then
        saved=$WARMUP; WARMUP=0; saved_d=$DURATION; DURATION=$RATE_SECONDS
        sample_rss "$SUT_PID" "$OUT/raw/equiroute-rate-rss.txt" &
        SAMPLER=$!; PIDS+=("$SAMPLER")
        measure equiroute rate "$SUT_ADDR" 128 -q "$RATE"
        kill "$SAMPLER" 2>/dev/null || true
        WARMUP=$saved; DURATION=$saved_d
        stop_sut equiroute rate
    else
        [ -n "${SUT_PID:-}" ] && stop_pid "$SUT_PID"
        say "equiroute: fixed-rate run failed: $WHY"
    fi
fi

say "report"
python3 "$HERE/report.py" --out "$OUT" --quick "$QUICK" --rate "$RATE" \
    --meta "$(printf '{"equiroute_bin":"%s","load_tool":"%s","cores":%s,"duration_s":%s,"warmup_s":%s,"busy_pct_at_start":%s}' \
        "$EQUIROUTE_BIN" "$("$OHA" --version)" "$CORES" "$DURATION" "$WARMUP" "$LOAD")"
say "done: $OUT/results.md, $OUT/results.json"
