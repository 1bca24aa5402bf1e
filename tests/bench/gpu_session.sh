#!/usr/bin/env bash
# One command on the lent GPU machine: the gpu-marked tests, calibration (profile, plot,
# decisions) and the bench, each step's output under $OUT. Steps: tests, calibrate, bench.
#   bash tests/bench/gpu_session.sh tests calibrate bench
# CAL_ARGS (default --quick) and STEP_TIMEOUT (seconds per step, default 280) tune it.
# The GPU machine's python lacks platformdirs: carry its wheel in .whl/ (README: Testing).
set -uo pipefail
OUT=${OUT:-/tmp/kvswap-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "kvswap did not install"; exit 1; }
export PYTHONUNBUFFERED=1
T=${STEP_TIMEOUT:-280}
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
for step in "$@"; do
  case "$step" in
    tests)
      timeout "$T" python3 -m pytest -q -m gpu tests -rfE -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1
      tail -n 25 "$OUT/gpu_tests.log" ;;
    calibrate)
      # shellcheck disable=SC2086
      timeout "$T" python3 -m kvswap calibrate ${CAL_ARGS:---quick} --out "$OUT/profile.json" \
        --plot "$OUT/profile.png" >"$OUT/calibrate.log" 2>"$OUT/calibrate.err"
      echo "calibrate exit $?"; tail -n 60 "$OUT/calibrate.log"; tail -n 5 "$OUT/calibrate.err" ;;
    bench)
      profile=$OUT/profile.json
      [ -f "$profile" ] || profile=
      { KVSWAP_PROFILE=$profile python3 -m kvswap explain --direction h2d
        KVSWAP_PROFILE=$profile python3 -m kvswap explain --direction d2h
        KVSWAP_PROFILE=$profile timeout "$T" python3 -m kvswap bench --json "$OUT/bench.json"
      } >"$OUT/bench.log" 2>&1
      echo "bench exit $?"; tail -n 70 "$OUT/bench.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
