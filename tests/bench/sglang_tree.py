"""The pure-Python part of SGLang that kvswap's SGLang tests and benchmark load, copied into a
folder a GPU machine without a package index puts on PYTHONPATH (tests/bench/sglang_carry.sh).

What is loaded is recorded twice, in the SGLang venv .ci/sglang-setup makes: while
tests/e2e_sglang runs on this CPU, and while the modules the GPU tests and the benchmark import
are imported with torch told it has a CUDA device (SGLang imports more on CUDA, sgl_kernel's ops
among them; sgl_kernel is a stand-in that raises when called). The folder gets those modules,
every package ``__init__`` above them, the HiCache pools, allocators and storage modules whole,
SGLang's JIT kernel sources (``sglang/kernels/jit``: the benchmark builds hicache.cuh from them),
and the stand-ins for sgl_kernel and torchvision. ``sglang.srt`` is a namespace package, so the
tree is copied as files, never zipped.

    .venv-sglang/bin/python tests/bench/sglang_tree.py --out .gpu-sglang/tree
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STANDINS = [ROOT / "tests" / "bench" / "sglang_standins" / "sgl_kernel",
            ROOT / ".ci" / "torchvision-standin" / "torchvision"]
# Imported by tests/e2e_sglang and tests/bench/bench_sglang_hicache.py (on CUDA SGLang imports more).
GPU_IMPORTS = [
    "sglang.srt.plugins", "sglang.srt.plugins.hook_registry", "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.allocator.paged", "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla", "sglang.srt.mem_cache.hicache_storage", "sglang.srt.mem_cache.utils",
    "sglang.srt.mem_cache.storage.backend_factory", "sglang.srt.runtime_context",
    "sglang.kernels.ops.kvcache.hicache", "sglang.kernels.jit.utils",
]
# Copied whole (their .py files, not their subfolders): the HiCache paths a GPU takes import
# from these lazily, inside functions.
WHOLE = ["sglang/srt/mem_cache", "sglang/srt/mem_cache/pool_host", "sglang/srt/mem_cache/allocator",
         "sglang/srt/mem_cache/storage", "sglang/kernels/ops/kvcache"]
TREES = ["sglang/kernels/jit", "sglang/srt/mem_cache/cpp_utils"]  # every file below: C++ sources built at run time
RECORD_ENV = "KVSWAP_SGLANG_TREE_RECORD"


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ARG001  (a pytest plugin: -p sglang_tree)
    out = os.environ.get(RECORD_ENV)
    if out:
        Path(out).write_text(json.dumps(sorted(m for m in sys.modules if m.startswith("sglang"))))


def simulate_cuda() -> None:
    """Tell torch (a CPU build) that it has one CUDA device of compute capability 9.0, so that
    SGLang takes its CUDA imports; nothing is run on it."""
    import torch

    class Properties:
        name, major, minor, multi_processor_count = "NVIDIA H100 80GB HBM3", 9, 0, 132
        total_memory, L2_cache_size, warp_size, gcnArchName = 80 << 30, 50 << 20, 32, ""

    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: Properties.name
    torch.cuda.get_device_properties = lambda *a, **k: Properties()
    torch.cuda.mem_get_info = lambda *a, **k: (70 << 30, 80 << 30)


def recorded_on_cuda(out: Path) -> None:
    sys.path.insert(0, str(STANDINS[0].parent))
    simulate_cuda()
    for name in GPU_IMPORTS:
        importlib.import_module(name)
    out.write_text(json.dumps(sorted(m for m in sys.modules if m.startswith("sglang"))))


def record(work: Path) -> set[str]:
    """The sglang modules the CPU tests load and the GPU imports load, each in its own process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "bench"), os.environ.get("PYTHONPATH", "")]))
    cpu, cuda = work / "cpu.json", work / "cuda.json"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "sglang_tree",
                    str(ROOT / "tests" / "e2e_sglang")], check=True, cwd=ROOT, env={**env, RECORD_ENV: str(cpu)},
                   stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, __file__, "--cuda-imports", str(cuda)], check=True, cwd=ROOT, env=env)
    return set(json.loads(cpu.read_text())) | set(json.loads(cuda.read_text()))


def copy_tree(modules: set[str], out: Path) -> int:
    """Copy ``modules``, their packages' ``__init__`` files, :data:`WHOLE` and :data:`TREES` from
    the installed sglang into ``out``; the number of bytes copied."""
    import sglang

    site = Path(sglang.__file__).resolve().parents[1]
    files: set[Path] = set()
    for name in modules:
        parts = name.split(".")
        for k in range(1, len(parts) + 1):  # every package above, and the module itself
            base = site.joinpath(*parts[:k])
            for f in (base / "__init__.py", base.with_suffix(".py")):
                if f.is_file():
                    files.add(f)
    for d in WHOLE:
        files |= set((site / d).glob("*.py"))
    for d in TREES:
        files |= {f for f in (site / d).rglob("*") if f.is_file() and "__pycache__" not in f.parts}
    total = 0
    for f in sorted(files):
        dest = out / f.relative_to(site)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
        total += f.stat().st_size
    for standin in STANDINS:
        shutil.copytree(standin, out / standin.name, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="the folder to fill (emptied first)")
    ap.add_argument("--cuda-imports", type=Path, help=argparse.SUPPRESS)  # the child that records CUDA imports
    args = ap.parse_args(argv)
    if args.cuda_imports:
        recorded_on_cuda(args.cuda_imports)
        return 0
    if args.out is None:
        ap.error("--out is required")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    work = args.out.parent / (args.out.name + ".record")
    work.mkdir(exist_ok=True)
    try:
        modules = record(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = copy_tree(modules, args.out)
    print(f"{len(modules)} sglang modules recorded; {total / 2**20:.1f} MiB of SGLang copied into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
