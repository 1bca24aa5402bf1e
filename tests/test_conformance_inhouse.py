"""Our own backends pass the conformance kit, run exactly as a vendor runs it.

Each case is a fresh ``pytest -p kvswap.testing --kvswap-impl NAME`` process in an empty
directory. On a CPU: the host reference, and ``triton.kernel`` in Triton's interpreter. On a
GPU (``gpu`` marker): ``cuda.batch`` and the compiled ``triton.kernel``, where the kit also
checks that copies land on the caller's stream.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

CASES = [
    pytest.param("host.reference", "cpu", {}, id="host.reference-cpu"),
    pytest.param("triton.kernel", "cpu", {"TRITON_INTERPRET": "1"}, id="triton.kernel-interpreted"),
    pytest.param("cuda.batch", None, {}, marks=pytest.mark.gpu, id="cuda.batch-gpu"),
    pytest.param("triton.kernel", None, {}, marks=pytest.mark.gpu, id="triton.kernel-gpu"),
]


def run_kit(impl: str, device: str | None, extra_env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSWAP_", "TRITON_INTERPRET"))}
    env.update(extra_env)
    cmd = [sys.executable, "-m", "pytest", "-p", "kvswap.testing", "--kvswap-impl", impl,
           "-p", "no:cacheprovider", "-q", "-rfEs", "--tb=short"]
    if device:
        cmd += ["--kvswap-device", device]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("impl,device,env", CASES)
def test_inhouse_backend_passes_the_kit(impl, device, env, tmp_path):
    out = run_kit(impl, device, env, tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out.stdout.strip().splitlines()[-1])}
    assert counts.get("passed", 0) >= 40 and not counts.get("failed") and not counts.get("error"), text
    assert "is unavailable on" not in text, f"{impl} was not exercised:\n{text}"
    if device is None:  # on the GPU nothing may be skipped for want of streams or memory
        assert "host-only" not in text and "too large" not in text, text
