#!/usr/bin/env bash
# Prepare .gpu-sglang/ on this machine (it has a package index; the GPU machine has none):
# everything kvswap's SGLang gpu tests and tests/bench/bench_sglang_hicache.py need there that
# its Python lacks. Run from the repository root; carry the folder with the run:
#
#   bash tests/bench/sglang_carry.sh            # makes .gpu-sglang/ (ignored by git)
#
#   .gpu-sglang/tree    the pure-Python SGLang the tests and the benchmark load (sglang_tree.py),
#                       SGLang's JIT kernel sources, and stand-ins for sgl_kernel (its ops raise
#                       when called) and torchvision (import-only)
#   .gpu-sglang/wheels  cp312 manylinux wheels of the light packages SGLang imports, at the
#                       versions .ci/sglang-requirements.txt pins, and platformdirs for kvswap;
#                       not torch, triton, numpy, tqdm or transformers, which the GPU machine has
#
# On the GPU machine, before the tests or the benchmark (tests/bench/sglang_env.sh):
#   . tests/bench/sglang_env.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${SGLANG_CARRY:-.gpu-sglang}
PYVER=${CARRY_PYTHON_VERSION:-3.12}
[ -x .venv-sglang/bin/python ] || bash .ci/sglang-setup
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR/wheels"
.venv-sglang/bin/python tests/bench/sglang_tree.py --out "$OUTDIR/tree"
find "$OUTDIR/tree" -name __pycache__ -prune -exec rm -rf {} +
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
grep -Ev '^(#|$|sglang==|numpy==|triton==|tqdm==|transformers==)' .ci/sglang-requirements.txt > "$reqs"
grep -E '^platformdirs' <(.venv-sglang/bin/python -m pip list --format=freeze 2>/dev/null) >> "$reqs"
abi="cp${PYVER/./}"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --abi "$abi" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$OUTDIR/wheels" -r "$reqs"
du -sh "$OUTDIR/tree" "$OUTDIR/wheels"
du -sh "$OUTDIR"
echo "carry $OUTDIR with the run (it and the repository must stay under 64 MiB together)"
