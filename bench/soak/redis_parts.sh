#!/usr/bin/env bash
# Samples a soak's Redis memory by part every 15 s until stopped (Ctrl-C):
#   bench/soak/redis_parts.sh PORT OUT [NAMESPACE]
# PORT: the soak's redis-server (soak.py prints "redis on PORT"); NAMESPACE: "soak" by default.
# Columns: seconds, INFO memory's used_memory, used_memory_dataset, mem_clients_normal,
# used_memory_scripts, used_memory_vm_eval, then MEMORY USAGE of the log and its XLEN, of the
# snapshot and of the acks hash (bytes), and DBSIZE (mostly feedback claim keys).
set -u
P=$1; OUT=$2; NS=${3:-soak}; t0=$(date +%s)
echo "t used dataset clients scripts vm_eval log_bytes log_len snap_bytes acks_bytes dbsize" > "$OUT"
while true; do
  info=$(redis-cli -p "$P" INFO memory 2>/dev/null) || { sleep 5; continue; }
  g() { echo "$info" | grep "^$1:" | cut -d: -f2 | tr -d '\r'; }
  m() { redis-cli -p "$P" "$@" | tr -d '\r'; }
  lb=$(m MEMORY USAGE "{$NS}:log" SAMPLES 0); ll=$(m XLEN "{$NS}:log")
  sb=$(m MEMORY USAGE "{$NS}:snapshot" SAMPLES 0); ab=$(m MEMORY USAGE "{$NS}:acks" SAMPLES 0)
  echo "$(( $(date +%s) - t0 )) $(g used_memory) $(g used_memory_dataset) $(g mem_clients_normal)" \
    "$(g used_memory_scripts) $(g used_memory_vm_eval) ${lb:-0} ${ll:-0} ${sb:-0} ${ab:-0} $(m DBSIZE)" >> "$OUT"
  sleep 15
done
