#!/usr/bin/env bash
# The step benchmark's per-layer cases on an older tree and on this one, on one machine, and
# the default's step of each case compared (tests/bench/step_vs_base.py). BASE is a copy of
# the older tree, e.g. made on a development machine and carried to the GPU machine:
#   mkdir -p .whl/base && git archive REF | tar -x -C .whl/base
#   OUT=results bash tests/bench/step_vs_base.sh .whl/base     (REPS=3 by default)
# Each tree is installed in turn (editable), so this tree is installed again at the end.
set -euo pipefail
BASE=$(realpath "$1")
OUT=$(realpath -m "${OUT:-step-vs-base}")
PY=${PYTHON:-python3}
REPS=${REPS:-3}
CASES="--model all --tp 1,8 --blocks 32,512 --reps $REPS"
mkdir -p "$OUT"
SECONDS=0
$PY -m pip install -q --no-deps --no-build-isolation -e "$BASE" >/dev/null
(cd "$BASE" && $PY -m kvswap bench $CASES --json "$OUT/step-base.json") > "$OUT/step-base.txt"
echo "base: ${SECONDS}s" >&2
$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
$PY -m kvswap bench $CASES --host-layouts per-layer --json "$OUT/step-head.json" > "$OUT/step-head.txt"
echo "head: ${SECONDS}s" >&2
$PY tests/bench/step_vs_base.py "$OUT/step-base.json" "$OUT/step-head.json" | tee "$OUT/step-vs-base.md"
