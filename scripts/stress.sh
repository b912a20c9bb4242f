#!/usr/bin/env bash
# Run the CPU test suite (or the tests given) N times in a row beside CPU-burning processes,
# and print how many runs passed and failed. A suite that cannot flake shows 0 failures.
#
#   scripts/stress.sh                         # the default suite, 20 runs, one burner
#   scripts/stress.sh -n 20 tests/test_moe_ep.py
#   scripts/stress.sh -n 5 -b 2 -- -k gloo    # two burners; options after -- go to pytest
#
# Options: -n RUNS (default 20), -b BURNERS (CPU-burning processes, default 1), -l LOGDIR
# (default: a new temporary directory; each failed run's output is kept there as run-K.log).
# Runs from the repository root with PYTHONPATH set to it, as the README's test command does.
set -euo pipefail

runs=20
burners=1
logdir=""
while getopts "n:b:l:h" opt; do
    case "$opt" in
        n) runs="$OPTARG" ;;
        b) burners="$OPTARG" ;;
        l) logdir="$OPTARG" ;;
        h) sed -n '2,12p' "$0"; exit 0 ;;
        *) sed -n '2,12p' "$0" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift

case "$runs" in ''|*[!0-9]*|0) echo "stress.sh: -n: expected a positive integer, got '$runs'" >&2; exit 2 ;; esac
case "$burners" in ''|*[!0-9]*) echo "stress.sh: -b: expected an integer >= 0, got '$burners'" >&2; exit 2 ;; esac

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
[ -n "$logdir" ] || logdir="$(mktemp -d -t graphstash-stress.XXXXXX)"
mkdir -p "$logdir"

burner_pids=()
stop_burners() {
    for pid in "${burner_pids[@]:-}"; do
        [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
    done
}
trap stop_burners EXIT INT TERM
for _ in $(seq 1 "$burners"); do
    python3 -c "while True: pass" &
    burner_pids+=("$!")
done

echo "stress: $runs runs of: python3 -m pytest -q -x -p no:cacheprovider $* (beside $burners CPU-burning process(es)); logs in $logdir"
passed=0
failed=0
for k in $(seq 1 "$runs"); do
    start=$(date +%s)
    if PYTHONPATH="$root" python3 -m pytest -q -x -p no:cacheprovider "$@" > "$logdir/run-$k.log" 2>&1; then
        passed=$((passed + 1))
        verdict="passed"
        rm -f "$logdir/run-$k.log"
    else
        failed=$((failed + 1))
        verdict="FAILED (log: $logdir/run-$k.log)"
    fi
    echo "run $k/$runs: $verdict in $(( $(date +%s) - start )) s"
done
echo "stress: $passed passed, $failed failed out of $runs runs"
[ "$failed" -eq 0 ]
