#!/usr/bin/env bash
# Everything a maintainer runs on a GPU machine, one step after another, each step's output
# under $OUT (default /tmp/kvswap-out). Run from the repository root:
#   bash tests/bench/gpu_session.sh tests calibrate bench benches overhead step fuzz
# Steps:
#   tests      the gpu-marked tests (GPU_TESTS: the files or folders, default tests)
#   calibrate  kvswap calibrate (CAL_ARGS: unset means --quick; set it empty for the full grid)
#   bench      kvswap explain and kvswap bench, with the profile just calibrated if there is one
#              (BENCH_ARGS, e.g. "--passes 3")
#   benches    the backends' benchmarks against the contiguous ceiling
#   overhead   the host cost of a SwapFn call and of BlockMover.submit (PROFILE names a profile),
#              and how long each route holds the calling thread
#   step       the step benchmark over every built-in model (tests/bench/step_all.sh)
#   fuzz       random transfers through every route, every byte checked (FUZZ_ARGS)
#   envelope   where cuMemcpyBatchAsync faults, without kvswap (tests/bench/batch_fault)
#   limits     the fuzz at kvswap's per-call limits
#   soak       engine-like load for SOAK_SECONDS (default 300), every job checked
#   vllm       kvswap's vLLM offloading worker: its gpu tests (every byte), then its host time
#              per job and transfer time against a bare BlockMover (tests/bench/bench_vllm_worker.py)
# STEP_TIMEOUT (seconds per step, default 280) bounds each step.
# On a machine without a package index whose Python lacks kvswap's small dependencies
# (pluggy, platformdirs, tqdm, pytest), put their wheels in .whl/: they are installed first.
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
        # shellcheck disable=SC2086
        timeout "$T" python3 -m pytest -q -m gpu ${GPU_TESTS:-tests} -rfE -p no:cacheprovider; } >"$OUT/gpu_tests.log" 2>&1
      tail -n 25 "$OUT/gpu_tests.log" ;;
    calibrate)
      # shellcheck disable=SC2086
      timeout "$T" python3 -m kvswap calibrate ${CAL_ARGS---quick} --out "$OUT/profile.json" \
        --plot "$OUT/profile.png" >"$OUT/calibrate.log" 2>"$OUT/calibrate.err"
      echo "calibrate exit $?"; tail -n 3 "$OUT/calibrate.err" >>"$OUT/calibrate.log"; tail -n 60 "$OUT/calibrate.log" ;;
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
      { OUT=$OUT/benches timeout "$T" python3 tests/bench/bench_cuda_batch.py
        OUT=$OUT/benches timeout "$T" python3 tests/bench/bench_triton.py; } >"$OUT/benches.log" 2>&1
      echo "benches exit $?"; tail -n 80 "$OUT/benches.log" ;;
    overhead)
      { KVSWAP_PROFILE=${PROFILE:-} timeout "$T" python3 tests/bench/bench_swapfn_overhead.py
        timeout "$T" python3 tests/bench/bench_mover_submit.py --json "$OUT/mover_submit.json"
        timeout "$T" python3 tests/bench/bench_thread_held.py --json "$OUT/thread_held.json"; } >"$OUT/overhead.log" 2>&1
      echo "overhead exit $?"; tail -n 60 "$OUT/overhead.log" ;;
    step)
      OUT=$OUT/step PYTHON=python3 timeout 900 bash tests/bench/step_all.sh >"$OUT/step.log" 2>&1
      echo "step exit $?"; tail -n 60 "$OUT/step.log" ;;
    fuzz)
      # shellcheck disable=SC2086
      timeout "$T" python3 tests/bench/fuzz.py --device cuda:0 ${FUZZ_ARGS---transfers 100000} \
        --json "$OUT/fuzz.json" >"$OUT/fuzz.log" 2>&1
      echo "fuzz exit $?"; tail -n 30 "$OUT/fuzz.log" ;;
    envelope)
      timeout 480 python3 tests/bench/batch_fault/envelope.py --out "$OUT/envelope" >"$OUT/envelope.log" 2>&1
      echo "envelope exit $?"; tail -n 60 "$OUT/envelope.log" ;;
    limits)
      timeout "$T" python3 tests/bench/fuzz.py --device cuda:0 --limits --json "$OUT/fuzz_limits.json" \
        >"$OUT/fuzz_limits.log" 2>&1
      echo "limits exit $?"; tail -n 30 "$OUT/fuzz_limits.log" ;;
    soak)
      timeout 480 python3 tests/bench/soak.py --device cuda:0 --seconds "${SOAK_SECONDS:-300}" --out "$OUT/soak" \
        >"$OUT/soak.log" 2>&1
      echo "soak exit $?"; tail -n 40 "$OUT/soak.log" ;;
    vllm)
      { timeout "$T" python3 -m pytest -q -m gpu tests/test_vllm_worker_gpu.py -s -rfE -p no:cacheprovider
        timeout "$T" python3 tests/bench/bench_vllm_worker.py --out-dir "$OUT/vllm"; } >"$OUT/vllm.log" 2>&1
      echo "vllm exit $?"; tail -n 40 "$OUT/vllm.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
