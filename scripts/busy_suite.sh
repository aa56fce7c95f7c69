#!/usr/bin/env bash
# Run the test suite while two CPU-bound busy loops compete for the cores, to check that no test
# depends on how fast the machine is (tests must wait on conditions and events, never on sleeps or
# wall-clock margins). The loops are stopped by their own process ids when the suite ends, however
# it ends. Arguments go to pytest:
#
#     bash scripts/busy_suite.sh                      # the whole suite, -q
#     bash scripts/busy_suite.sh -x test/integration  # a part of it
#     BUSY_LOOPS=4 bash scripts/busy_suite.sh         # more competition
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
pids=()
stop_loops() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
}
trap stop_loops EXIT
trap 'exit 130' INT TERM
for _ in $(seq "${BUSY_LOOPS:-2}"); do
  python -c 'while True: pass' &
  pids+=("$!")
done
echo "busy loops: ${pids[*]}; load: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
start=$(date +%s)
if [ "$#" -eq 0 ]; then set -- -q; fi
python -m pytest "$@"
rc=$?
echo "pytest exit status $rc after $(( $(date +%s) - start )) s beside ${#pids[@]} busy loops" >&2
exit "$rc"
