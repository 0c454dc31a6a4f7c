#!/usr/bin/env bash
# The flakiness check of the multi-process tests: N consecutive runs (default 5) under a background load of 2 busy
# processes, each run's log in outputs/load_check/run<i>.log and one summary line per run in summary.log.
#   scripts/load_check.sh [RUNS] [pytest args...]     e.g. scripts/load_check.sh 5 -n 2
set -u
cd "$(dirname "$0")/.."
runs=${1:-5}; shift || true
out=outputs/load_check; mkdir -p "$out"; : > "$out/summary.log"
yes > /dev/null & busy1=$!
yes > /dev/null & busy2=$!
trap 'kill $busy1 $busy2 2>/dev/null' EXIT
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  .venv/bin/python -m pytest -q -m multiprocess -p no:cacheprovider -rfE "$@" > "$out/run$i.log" 2>&1
  code=$?
  echo "run $i: exit $code in $(( $(date +%s) - start )) s: $(tail -1 "$out/run$i.log")" | tee -a "$out/summary.log"
done
