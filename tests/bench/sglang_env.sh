# Source on the GPU machine, from the repository root, after tests/bench/sglang_carry.sh made
# .gpu-sglang/ here and it was carried along:   . tests/bench/sglang_env.sh
# Installs, into /tmp/sglang-site, each carried wheel whose package this Python lacks (what it
# has stays first), installs kvswap editable without dependencies (its entry point is how SGLang
# finds the hooks), and puts the carried SGLang tree on PYTHONPATH.
CARRY=${SGLANG_CARRY:-$PWD/.gpu-sglang}
SITE=${SGLANG_SITE:-/tmp/sglang-site}
[ -d "$CARRY/tree" ] || { echo "no $CARRY/tree: run tests/bench/sglang_carry.sh where pip reaches an index"; return 1; }
missing=$(python3 - "$CARRY/wheels" <<'PY'
import importlib.util, sys, zipfile
from pathlib import Path
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}
    tops = {t[:-3] if t.endswith(".py") else t for t in tops if not t.endswith((".pth", ".libs"))}
    if not all(importlib.util.find_spec(t) for t in tops if t.isidentifier()):
        print(wheel)
PY
)
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $missing
fi
export PYTHONPATH="$SITE:$CARRY/tree${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "kvswap did not install"; return 1; }
python3 -c "import sglang, sgl_kernel, kvswap; assert sgl_kernel.STANDIN; print('SGLang', sglang.__version__, 'from', sglang.__file__)"
