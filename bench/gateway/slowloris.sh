#!/usr/bin/env bash
# One client cannot starve the rest (issue 41, bar 4): `equiroute serve` with a simulated
# provider and the default [server] limits, one client (127.0.0.2) holding 1,000 slow
# connections with stalled 1 MiB bodies while another (127.0.0.1) sends normal requests.
# Prints the normal client's success rate and p99, and the gateway's RSS before, at its peak
# and 30 s after the attack. Loopback only, about 55 s. Not run by `cargo test`.
#
#   cargo build --release -p equiroute && bench/gateway/slowloris.sh
#
# Environment: EQUIROUTE_BIN (default target/release/equiroute), SLOWLORIS_PORT (default
# 18990), SLOWLORIS_CONNECTIONS (1000), SLOWLORIS_RATE (normal requests/s, 100),
# SLOWLORIS_PRE / SLOWLORIS_ATTACK / SLOWLORIS_AFTER (seconds: 5, 15, 30),
# SLOWLORIS_OUT (default target/bench-slowloris: the config, the gateway's log, results.json).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BIN=${EQUIROUTE_BIN:-$ROOT/target/release/equiroute}
PORT=${SLOWLORIS_PORT:-18990}
OUT=${SLOWLORIS_OUT:-$ROOT/target/bench-slowloris}
CONNECTIONS=${SLOWLORIS_CONNECTIONS:-1000}

[ -x "$BIN" ] || { echo "no binary at $BIN: cargo build --release -p equiroute" >&2; exit 2; }
# The attack's 1,000 sockets and the gateway's: raise the open-file limit to the hard one.
ulimit -n "$(ulimit -Hn)"
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt $((CONNECTIONS * 2 + 256)) ]; then
    echo "the open-file limit ($(ulimit -n)) is too low for $CONNECTIONS connections" >&2
    exit 2
fi
mkdir -p "$OUT"
cat > "$OUT/equiroute.toml" <<TOML
# The default [server] limits; one chat interface on a fast simulated provider.
[server]
listen = "127.0.0.1:$PORT"

[interfaces.chat]
kind = "chat"
deadline_ms = 3000

[[interfaces.chat.providers]]
id = "sim"
kind = "sim"
sim = { latency = { p50_ms = 2, p95_ms = 5 } }
TOML
"$BIN" check-config "$OUT/equiroute.toml" > /dev/null
"$BIN" serve --config "$OUT/equiroute.toml" > "$OUT/gateway.log" 2>&1 &
GATEWAY=$!
trap 'kill "$GATEWAY" 2>/dev/null; wait "$GATEWAY" 2>/dev/null || true' EXIT
for _ in $(seq 100); do
    if python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', $PORT), 0.2)" 2>/dev/null; then
        break
    fi
    kill -0 "$GATEWAY" 2>/dev/null || { cat "$OUT/gateway.log" >&2; exit 1; }
    sleep 0.1
done
python3 "$HERE/slowloris.py" --port "$PORT" --pid "$GATEWAY" \
    --connections "$CONNECTIONS" --rate "${SLOWLORIS_RATE:-100}" \
    --pre "${SLOWLORIS_PRE:-5}" --attack "${SLOWLORIS_ATTACK:-15}" --after "${SLOWLORIS_AFTER:-30}" \
    --json "$OUT/results.json"
