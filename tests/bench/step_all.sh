#!/usr/bin/env bash
# The step benchmark over every built-in model x TP {1, and 8 where the KV heads split}
# x host layout {per-layer, block-major} x direction x B {32, 512}, each case against one
# contiguous copy of its bytes beside the same compute (span/contiguous), the BlockMover ceiling
# case (h2d 4 KiB x 10,000, per-layer host), and the compute slowdown per route and SM count
# (the staged route on a block-major host); then the bars (a pass/fail table, no asserts)
# and the markdown section for docs/benchmarks.md. Each part prints how long it took; the
# step part grows with REPS and with the cases (--blocks, --host-layouts, --tp).
#
#   OUT=results tests/bench/step_all.sh          (REPS=3 by default; PYTHON=python3)
#   VARIANTS=1 adds the default without each older mechanism (kvswap bench --model --variants)
set -euo pipefail
OUT=${OUT:-step-results}
PY=${PYTHON:-python3}
REPS=${REPS:-3}
mkdir -p "$OUT"
DEV=$($PY -c "import re, torch; m = re.search(r'[A-Z]+\d{2,4}', torch.cuda.get_device_name()); print(m.group(0).lower() if m else 'gpu')" 2>/dev/null || echo gpu)

STEP="kvswap bench --model all --tp 1,8 --blocks 32,512 --host-layouts per-layer,block-major --reps $REPS"
[ -n "${VARIANTS:-}" ] && STEP="$STEP --variants"
CEIL="kvswap bench --layers 1 --kv-heads 1 --head-dim 128 --blocks 5000 --directions h2d --host-layouts per-layer --reps $REPS"
SECONDS=0
$PY -m kvswap ${STEP#kvswap } --json "$OUT/step-$DEV.json" | tee "$OUT/step-$DEV.txt"
echo "step: ${SECONDS}s" >&2
$PY -m kvswap ${CEIL#kvswap } --json "$OUT/ceiling-$DEV.json" | tee "$OUT/ceiling-$DEV.txt"
echo "ceiling: ${SECONDS}s" >&2
$PY -m kvswap.calibration.step_interference --reps "$REPS" --json "$OUT/interference-$DEV.json" \
    | tee "$OUT/interference-$DEV.txt"
echo "interference: ${SECONDS}s" >&2
$PY -m kvswap bench --render "$OUT/step-$DEV.json" "$OUT/ceiling-$DEV.json" "$OUT/interference-$DEV.json" \
    --plot "$OUT/step-$DEV.png" --command "$STEP; $CEIL" > "$OUT/step-$DEV.md"
echo
echo "bars ($DEV):"
sed -n '/^| bar |/,/^$/p' "$OUT/step-$DEV.md"
