#!/usr/bin/env bash
# Calibration of the deadline-miss estimate (docs/calibration.md): the four calibration
# scenarios of this directory and the built-in bimodal-latency and heavy-tail, for one value
# of risk.shape_prior_weight (null: the log-normal alone).
#   bench/calibration/run.sh WEIGHT FIRST_SEED SEEDS OUT_DIR
set -euo pipefail
w=${1:-20}; first=${2:-1}; seeds=${3:-5}; out=${4:-/tmp/calibration}
bin=${EQUIROUTE:-target/release/equiroute}
here=$(dirname "$0")
scen=crates/equiroute-lab/scenarios
"$bin" bench \
  --scenario-file "$here/lognormal.toml" --scenario-file "$here/bimodal-cache.toml" \
  --scenario-file "$here/bimodal-two-deadlines.toml" --scenario-file "$here/pareto.toml" \
  --scenario-file "$scen/bimodal-latency.toml" --scenario-file "$scen/heavy-tail.toml" \
  --policies lqm-ts,ts-deadline,least-latency --first-seed "$first" --seeds "$seeds" --jobs 2 \
  --set "lqm-ts.risk.shape_prior_weight=$w" --set "ts-deadline.risk.shape_prior_weight=$w" \
  --format json --out "$out" > "$out.json"
jq -r '.[] | .scenario as $s | .policies | to_entries[] |
  "\($s)\t\(.key)\tmiss \(.value.deadline_miss_rate.mean*1000|round/1000) ± \(.value.deadline_miss_rate.ci95*1000|round/1000)\tquality \(.value.quality.mean*1000|round/1000) ± \(.value.quality.ci95*1000|round/1000)\tECE \(if .value.calibration then "\(.value.calibration.ece.mean*10000|round/10000) ± \(.value.calibration.ece.ci95*10000|round/10000) (n \(.value.calibration.count))" else "-" end)"' "$out.json" | column -t -s $'\t'
