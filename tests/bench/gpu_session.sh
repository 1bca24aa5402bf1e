#!/usr/bin/env bash
# One command on the lent GPU machine: the gpu-marked tests, calibration (profile, plot,
# decisions), the bench and the backends' benchmark scripts, each step's output under $OUT.
#   bash tests/bench/gpu_session.sh tests calibrate bench benches overhead
# CAL_ARGS (unset: --quick; set it empty for the full grid), BENCH_ARGS (e.g. "--passes 3") and
# STEP_TIMEOUT (seconds per step, default 280) tune it;
# PROFILE names a profile for the overhead step (default: the resolver's own search).
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
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
for step in "$@"; do
  case "$step" in
    tests)
      { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
        timeout "$T" python3 -m pytest -q -m gpu tests -rfE -p no:cacheprovider; } >"$OUT/gpu_tests.log" 2>&1
      tail -n 25 "$OUT/gpu_tests.log" ;;
    calibrate)
      # shellcheck disable=SC2086
      timeout "$T" python3 -m kvswap calibrate ${CAL_ARGS---quick} --out "$OUT/profile.json" \
        --plot "$OUT/profile.png" >"$OUT/calibrate.log" 2>/tmp/calibrate.err
      echo "calibrate exit $?"; tail -n 3 /tmp/calibrate.err >>"$OUT/calibrate.log"; tail -n 60 "$OUT/calibrate.log" ;;
    bench)
      profile=$OUT/profile.json
      [ -f "$profile" ] || profile=
      { KVSWAP_PROFILE=$profile python3 -m kvswap explain --direction h2d
        KVSWAP_PROFILE=$profile python3 -m kvswap explain --direction d2h
        # shellcheck disable=SC2086
        KVSWAP_PROFILE=$profile timeout "$T" python3 -m kvswap bench ${BENCH_ARGS-} --json "$OUT/bench.json"
      } >"$OUT/bench.log" 2>&1
      echo "bench exit $?"; tail -n 70 "$OUT/bench.log" ;;
    benches)
      # Their own result files go elsewhere: at most 8 files come back from $OUT.
      { OUT=/tmp/benches timeout "$T" python3 tests/bench/bench_cuda_batch.py
        OUT=/tmp/benches timeout "$T" python3 tests/bench/bench_triton.py; } >"$OUT/benches.log" 2>&1
      echo "benches exit $?"; tail -n 80 "$OUT/benches.log" ;;
    overhead)
      # What a resolved SwapFn costs against forced ones on the same route: host time per
      # call, and the bench's own timer on copies of one route.
      { KVSWAP_PROFILE=${PROFILE:-} timeout "$T" python3 tests/bench/bench_swapfn_overhead.py
        KVSWAP_PROFILE=${PROFILE:-} timeout "$T" python3 tests/bench/bench_same_route.py; } >"$OUT/overhead.log" 2>&1
      echo "overhead exit $?"; tail -n 60 "$OUT/overhead.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
