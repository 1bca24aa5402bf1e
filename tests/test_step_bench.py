"""The step benchmark (``kvswap bench --model``) on the CPU: the workload on real host
tensors with the host reference (and the Triton kernel in its interpreter), the compute
load a host callable, every byte checked; contenders, tables, JSON, plot and bars."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvswap import Policy
from kvswap.cli import models
from kvswap.calibration import step, step_contiguous, step_report, step_workload
from kvswap.calibration.step import Contender, HostEnv, StepPools, StepSettings, WrongBytes
from kvswap.errors import ConfigurationError
from kvswap.registry.platform import detect
from kvswap.registry.plugins import plugin_host
from kvswap.types import Direction

KiB = 1024
TINY_FLASH = models.ModelShape("tiny-flash", layers=3, kv_heads=4, head_dim=8)
TINY_MLA = models.ModelShape("tiny-mla", layers=2, kv_heads=1, head_dim=24, layout="mla", dtype="float16")


def cpu():
    return detect(plugin_host(), "cpu")


def kvswap_cli(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSWAP_")}
    return subprocess.run([sys.executable, "-m", "kvswap", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize("direction, chunk_kib, blocks, dpb, vllm", [
    ("h2d", 4, 32, 160, "kernel@12"),   # llama-3.1-70b tp8
    ("h2d", 16, 32, 56, "kernel@12"),   # qwen2.5-7b
    ("h2d", 32, 32, 64, "batch"),       # llama-3.1-8b: 32 KiB chunks are not under 28 KiB
    ("h2d", 4, 1, 8, "batch"),          # fewer than 16 descriptors
    ("d2h", 4, 512, 160, "batch"),      # vLLM offloads on the batch route always
])
def test_contenders_and_vllms_route_per_case(direction, chunk_kib, blocks, dpb, vllm):
    shape = models.ModelShape("m", layers=dpb // 2, kv_heads=1, head_dim=chunk_kib * KiB // 32)
    cache = shape.at(1)
    assert cache.chunk_bytes == chunk_kib * KiB and cache.descriptors_per_block == dpb
    cs = {c.name: c for c in step.contenders_for(Direction.parse(direction), cache, blocks, "cuda.batch",
                                                 "triton.kernel", "triton.staged")}
    assert list(cs) == list(step.CONTENDERS)
    assert cs["default"].policy == Policy() and cs["low_interference"].policy == Policy(prefer="low_interference")
    assert cs["batch"].policy == Policy(force="cuda.batch") and cs["batch"].exact_sms is None
    assert cs["staged"].policy == Policy(force="triton.staged") and cs["staged"].exact_sms is None
    k = cs["kernel@12"]
    assert (k.policy.force, k.policy.max_sms, k.exact_sms) == ("triton.kernel", 12, 12)
    assert cs["vllm"].same_as == vllm and cs["vllm"].key == cs[vllm].key


def test_contenders_without_a_kernel_route_leave_it_out():
    cs = step.contenders_for(Direction.H2D, models.get("llama-3.1-70b").at(8), 32, "host.reference", None)
    names = [c.name for c in cs]
    assert names == ["default", "low_interference", "batch", "vllm"]
    assert cs[-1].same_as == "batch"  # vLLM's kernel is not here: its twin is the route it would fall back to


def test_exact_sms_calibration_binds_the_forced_kernel_at_exactly_12():
    """max_sms=12 alone caps the calibrated knee; the bench's kernel contender runs on 12."""
    import kvswap

    c = Contender("kernel@12", Policy(force="triton.kernel", max_sms=12), exact_sms=12)
    fn = step.bind(c, cpu(), kvswap.resolve, "h2d", device="cpu")
    assert fn.plan.params["triton.kernel"]["num_sms"] == 12
    plain = kvswap.resolve("h2d", device="cpu", policy=c.policy)
    assert plain.plan.params["triton.kernel"]["num_sms"] < 12  # the calibrated knee, capped at 12
    # a CPU-only machine has no pinned memory for a kernel (or a staged route) to read: the bench leaves them out
    assert step.routes_available(Direction.H2D, "cpu") == ("host.reference", None, None)


def block_bytes(t, bd, i):
    """Block ``i`` of ``t`` as bytes, in memory order."""
    block = t.select(bd, i)
    order = sorted(range(block.dim()), key=lambda k: -block.stride(k))
    return block.permute(*order).contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("layout", step.HOST_LAYOUTS)
@pytest.mark.parametrize("shape", [TINY_FLASH, TINY_MLA], ids=lambda s: s.layout)
@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_pools_check_every_moved_byte_and_the_untouched_blocks(shape, direction, layout):
    cache = shape.at(2)
    env = HostEnv(lambda: None)
    pools = StepPools(env, cache, 10, seed=3, host_layout=layout)
    assert pools.host_layout == layout
    assert len(pools.host_flat) == (1 if layout == "block-major" else cache.model.layers)
    for h, d in zip(pools.host_tensors, pools.device_tensors):  # each layer's tensor has the device's dtype and shape
        assert (h.dtype, h.shape) == (d.dtype, d.shape)
    pools.prepare(direction)
    src, dst = pools.sides(direction)
    assert not all(bool((t.view(torch.uint8) == 0).all()) for t in src)  # random, never zeros
    sid, did = np.array([7, 2, 9]), np.array([0, 5, 3])
    pools.poison(direction)
    assert all(bool((t.view(torch.uint8) == step_workload.POISON).all()) for t in dst)
    bd = cache.block_dim
    for s, d in zip(src, dst):
        d.view(torch.uint8).index_copy_(bd, torch.as_tensor(did), s.view(torch.uint8).index_select(bd, torch.as_tensor(sid)))
    assert pools.check(direction, sid, did) == 3 * cache.block_bytes
    if layout == "block-major":  # host block i: device block i of every layer, one region, layer after layer
        rows = pools.host_flat[0].view(10, -1)
        for i in range(10):
            assert torch.equal(rows[i], torch.cat([block_bytes(h, bd, i) for h in pools.host_tensors]))
        assert rows.shape[1] == cache.block_bytes
        if direction is Direction.D2H:  # what kvswap.host_cache holds: a device block's chunks end to end
            for i, j in zip(sid, did):
                assert torch.equal(rows[j], torch.cat([block_bytes(t, bd, int(i)) for t in pools.device_tensors]))

    def flip(tensor, block, last):  # one byte of one block
        b = tensor.view(torch.uint8).select(bd, block)
        at = tuple(-1 if last else 0 for _ in range(b.dim()))
        b[at] = b[at] ^ 0xFF

    flip(dst[-1], 5, True)  # one byte of one moved block wrong
    with pytest.raises(WrongBytes, match=f"layer {len(dst) - 1}, destination block 5 does not hold source block 2"):
        pools.check(direction, sid, did)
    flip(dst[-1], 5, True)
    assert pools.check(direction, sid, did) == 3 * cache.block_bytes
    flip(dst[0], 8, False)  # a block outside the job written
    with pytest.raises(WrongBytes, match="layer 0, destination block 8 was not in the job"):
        pools.check(direction, sid, did)


def run_tiny(shapes=(TINY_FLASH, TINY_MLA), directions=(Direction.H2D, Direction.D2H), blocks=(3, 5), reps=2,
             layouts=step.HOST_LAYOUTS, variants=False):
    calls = []
    env = HostEnv(lambda: calls.append(sum(range(2000))))
    settings = StepSettings(blocks=blocks, host_layouts=tuple(layouts), step_ms=1.0, reps=reps, variants=variants)
    doc = step.run_step_bench(env, cpu(), [s.at(2) for s in shapes], list(directions), settings)
    return doc, calls


def test_run_on_host_measures_every_contender_and_checks_every_byte():
    doc, calls = run_tiny()
    doc = json.loads(json.dumps(doc))  # what --json writes
    assert doc["kind"] == "kvswap step bench" and doc["env"] == "host"
    assert len(doc["cases"]) == 2 * 2 * 2 * 2
    assert doc["settings"]["host_layouts"] == ["per-layer", "block-major"]
    assert [(c["model"], c["host_layout"]) for c in doc["cases"][::4]] == [
        ("tiny-flash", "per-layer"), ("tiny-flash", "block-major"),
        ("tiny-mla", "per-layer"), ("tiny-mla", "block-major")]
    assert "h2d: no staged-kind route here; its contenders are left out" in doc["notes"]
    measured_per_case = set()
    for case in doc["cases"]:
        names = [c["name"] for c in case["contenders"]]
        assert names == ["contiguous", "default", "low_interference", "batch", "vllm"]  # the reference first
        cache = (TINY_FLASH if case["layout"] == "flash" else TINY_MLA).at(2)
        assert case["chunk_bytes"] == cache.chunk_bytes
        assert case["descriptors"] == case["blocks"] * cache.descriptors_per_block
        assert case["bytes"] == case["blocks"] * cache.block_bytes
        assert case["ceiling_gbps"] > 0 and case["compute_alone_ms"] > 0 and "bound_ms" not in case
        ref = case["contenders"][0]
        assert (ref["route"], ref["same_as"], ref["span_over_contiguous"]) == ("contiguous copy", None, 1.0)
        for c in case["contenders"]:
            assert c["error"] is None, c
            assert c["staged"] is False and "makespan_over_bound" not in c
            assert c["span_over_contiguous"] > 0
            # alone and beside, every repetition, every byte of every block (the reference: of its buffer,
            # which holds the whole job here)
            assert c["bytes_checked"] == 2 * case["reps"] * case["bytes"]
            assert c["submit_us"] > 0 and c["transfer_alone_ms"] > 0 and c["transfer_beside_ms"] > 0
            assert c["makespan_ms"] >= c["compute_beside_ms"] > 0 and c["slowdown"] > 0
            # per repetition the makespan holds the compute, so its ratio to the compute alone does too
            assert c["makespan_over_compute"] >= c["slowdown"]
            assert math.isclose(c["gbps_beside"], case["bytes"] / (c["transfer_beside_ms"] / 1e3) / 1e9, rel_tol=1e-2)
        by = {c["name"]: c for c in case["contenders"]}
        assert by["vllm"]["same_as"] == "batch"
        assert by["vllm"]["makespan_ms"] == by[by["vllm"]["same_as"]]["makespan_ms"]  # one measurement
        assert by["batch"]["route"] == "host.reference"
        measured_per_case.add(sum(c["same_as"] is None for c in case["contenders"]))
    # the stand-in compute ran once alone and once per measured contender (the reference one of
    # them) in each repetition
    (n,) = measured_per_case
    assert n == 4
    assert len(calls) == len(doc["cases"]) * 2 * (1 + n)


def test_tables_bars_and_plot_from_the_json(tmp_path):
    doc, _ = run_tiny(shapes=(TINY_FLASH,), directions=(Direction.H2D,), blocks=(4,), reps=1)
    text = step_report.text_table(doc)
    assert text.count("\n") == 1 + 2 * 5 and "tiny-flash" in text and "(= batch)" in text
    assert "span/contiguous" in text and "bound" not in text and "contiguous copy" in text
    md = step_report.markdown_table(doc)
    assert md.splitlines()[0].startswith("| model | tp | dir | B | host |") and len(md.splitlines()) == 2 + 2 * 5
    (case,) = [c for c in doc["cases"] if c["host_layout"] == "block-major"]
    default = case["contenders"][1]
    assert "| tiny-flash | 2 | h2d | 4 | block-major | 512 B | 24 | default |" in md
    assert f"| {default['span_over_contiguous']:.3f} |" in md
    results = step_report.bars([doc])
    assert [" ".join(b["bar"].split()[:2]) for b in results] == [
        "default makespan", "default transfer", "geomean of", "default submit", "h2d 4", "per-layer host,",
        "per-layer host,", "block-major host,", "block-major host,", "llama-3.1-8b tp1", "block-major x512,",
        "staged route's"]
    # the reference is no contender the default is held to: the best contender is one of the four
    assert results[0]["cases"] == 2 and results[4]["ok"] is None  # no 4 KiB x 10,000 case here
    assert all(b["cases"] == 0 for b in results[5:9])  # the contiguous bars judge the built-in models only
    assert results[-1]["ok"] is None and "step_interference" in results[-1]["note"]  # none given
    path, slow = tmp_path / "f.json", tmp_path / "i.json"
    path.write_text(json.dumps(doc))
    slow.write_text(json.dumps({"kind": "kvswap step interference", "device": "d", "records": [
        {"direction": "h2d", "route": "triton.staged", "kind": "staged", "num_sms": 32, "slowdown": 0.07,
         "blocks": 900, "transfer_beside_ms": 22.0, "compute_beside_ms": 21.5, "covered": True,
         "chunk_bytes": 16 * KiB, "host_layout": "block-major"}]}))
    out = kvswap_cli("bench", "--render", str(path), str(slow), "--plot", str(tmp_path / "p.png"),
                     "--command", "kvswap bench --model all")
    assert out.returncode == 0, out.stderr
    assert "`kvswap bench --model all`" in out.stdout and "| tiny-flash | 2 | h2d | 4 | per-layer |" in out.stdout
    assert "| bar | cases | passed |" in out.stdout and "![step benchmark" in out.stdout
    # the staged route's slowdown bar reads the step_interference document rendered with it
    assert "| staged route's compute slowdown (block-major host, step_interference) <= 5% | 1 | 0 | 0.070 | " \
           "h2d triton.staged 16 KiB x900 | FAIL |" in out.stdout
    assert (tmp_path / "p.png").stat().st_size > 10_000
    from PIL import Image

    with Image.open(tmp_path / "p.png") as im:  # bars of a few colours: a palette of 16 keeps the file small
        assert im.mode == "P" and 6 <= len(im.getcolors()) <= 16


def case(direction="h2d", chunk=4 * KiB, descriptors=5120, **contenders):
    def c(name, makespan, beside, submit=50.0, same_as=None, alone_gbps=None):
        return {"name": name, "route": "r", "same_as": same_as, "submit_us": submit, "transfer_alone_ms": 1.0,
                "transfer_beside_ms": beside, "compute_beside_ms": 20.0, "slowdown": 1.0, "makespan_ms": makespan,
                "gbps_alone": alone_gbps, "gbps_beside": 1.0, "bytes_checked": 1, "error": None}
    return {"model": "qwen2.5-7b", "layout": "flash", "tp": 1, "direction": direction, "blocks": 32, "chunk_bytes": chunk,
            "descriptors": descriptors, "bytes": 1, "compute_alone_ms": 20.0, "ceiling_gbps": 50.0, "reps": 3,
            "contenders": [c(n, *v) for n, v in contenders.items()]}


def test_bars_pass_and_fail_where_they_should():
    # The contiguous reference ends every step first and launches no job: neither the best
    # contender the default is held to, nor one counted over the submit budget.
    ok = case(contiguous=(15.0, 1.0, None), default=(20.5, 2.0, 100.0), batch=(21.0, 6.0),
              vllm=(20.0, 3.0, 50.0, "batch"))
    slow = case(chunk=64 * KiB, default=(22.0, 4.0, 400.0), batch=(20.0, 3.0), vllm=(20.0, 3.0, 50.0, "batch"))
    ceiling = case(descriptors=10_000, default=(20.0, 1.0, 150.0, None, 46.0), vllm=(20.0, 2.0))
    by = [b for b in step_report.bars([{"cases": [ok, slow, ceiling]}])]
    makespan, vs_vllm, geo, submit, ceil = by[:5]
    assert (makespan["passed"], makespan["cases"], makespan["ok"]) == (2, 3, False)
    assert makespan["worst"] == pytest.approx(1.1) and makespan["worst_case"].startswith("qwen2.5-7b tp1 per-layer h2d")
    assert (vs_vllm["passed"], vs_vllm["ok"]) == (2, False) and vs_vllm["worst"] == pytest.approx(0.75)
    assert geo["cases"] == 2 and geo["worst"] == pytest.approx(math.sqrt(1.5 * 2.0), abs=1e-4) and geo["ok"] is True
    # budgets: 100 + 0.01 x 5120 = 151.2 us; 100 + 100 = 200 us
    assert (submit["passed"], submit["ok"]) == (2, False) and submit["worst"] == pytest.approx(400 / 151.2, abs=1e-4)
    assert submit["note"] == "other contenders over budget in 0 case(s)"
    assert (ceil["cases"], ceil["ok"]) == (1, True) and ceil["worst"] == pytest.approx(0.92, abs=1e-4)
    assert "FAIL" in step_report.bars_table(by) and "PASS" in step_report.bars_table(by)
    assert all(b["ok"] is None for b in by[5:])  # a document from before the host-layout axis: nothing to judge


def bm_case(direction, layout, model="llama-3.1-8b", blocks=512, chunk=32 * KiB, **contenders):
    """A case whose contenders are ``name=(span/compute, span/contiguous, GB/s alone, staged)``,
    after the contiguous reference (its span/compute 0.95)."""
    def c(name, over_compute, over_contiguous, gbps=None, staged=False):
        return {"name": name, "route": "triton.staged" if staged else "r", "same_as": None, "submit_us": 50.0,
                "transfer_alone_ms": 1.0, "transfer_beside_ms": 1.0, "compute_beside_ms": 20.0, "slowdown": 1.0,
                "makespan_ms": 20.0 * over_compute, "makespan_over_compute": over_compute,
                "span_over_contiguous": over_contiguous, "gbps_alone": gbps, "gbps_beside": 1.0, "bytes_checked": 1,
                "staged": staged, "error": None}
    return {"model": model, "layout": "flash", "tp": 1, "host_layout": layout, "direction": direction,
            "blocks": blocks, "chunk_bytes": chunk, "descriptors": blocks * 64, "bytes": 1, "compute_alone_ms": 20.0,
            "ceiling_gbps": 50.0, "reps": 3,
            "contenders": [c(n, *v) for n, v in dict(contiguous=(0.95, 1.0, 50.0), **contenders).items()]}


def test_the_default_is_held_to_the_contiguous_copy_per_host_layout_and_block_major_to_the_staged_bars():
    cases = [
        # llama-3.1-8b tp1 x512: the default (staged) against every route that is not staged
        bm_case("h2d", "per-layer", default=(1.40, 1.35), batch=(2.0, 1.9), staged=(1.6, 1.5, 30.0, True)),
        bm_case("d2h", "per-layer", default=(1.35, 1.05), batch=(2.0, 1.9)),
        bm_case("h2d", "block-major", default=(1.05, 1.01, None, True), batch=(1.30, 1.25),
                low_interference=(0.9, 0.88, None, True), staged=(1.05, 1.02, 47.0, True)),
        bm_case("d2h", "block-major", default=(1.20, 1.06, None, True), batch=(1.30, 1.25),
                staged=(1.2, 1.12, 44.0, True)),
        # other models: the contiguous bars, and the ceiling where chunks are 4-32 KiB
        bm_case("h2d", "block-major", model="qwen2.5-7b", chunk=16 * KiB, default=(1.0, 0.99, None, True),
                staged=(1.0, 1.0, 46.0, True)),
        # a shape that is not built in: no contiguous bar judges it
        bm_case("h2d", "block-major", model="m", chunk=64 * KiB, default=(1.0, 2.0), staged=(1.0, 1.0, 10.0, True)),
    ]
    slow = {"records": [
        {"direction": "h2d", "route": "triton.staged", "kind": "staged", "num_sms": 32, "chunk_bytes": 16 * KiB,
         "blocks": 900, "slowdown": 0.03, "host_layout": "block-major"},
        {"direction": "d2h", "route": "triton.staged", "kind": "staged", "num_sms": 32, "chunk_bytes": 4 * KiB,
         "blocks": 900, "slowdown": 0.08, "host_layout": "block-major"},
        {"direction": "d2h", "route": "cuda.batch", "kind": "batch", "num_sms": 0, "chunk_bytes": 4 * KiB,
         "blocks": 900, "slowdown": 0.5},  # not staged: not judged
    ]}
    by = {b["bar"]: b for b in step_report.bars([{"cases": cases}], [slow])}
    per_layer, per_layer_geo, block_major, block_major_geo, unstaged, ceiling, slowdown = list(by.values())[5:]
    assert "<= 1.2 x contiguous" in list(by)[5] and "<= 1.05 x contiguous" in list(by)[7]
    # per-layer, span/contiguous 1.35 and 1.05: one over 1.20, the geomean over 1.08
    assert (per_layer["cases"], per_layer["passed"], per_layer["ok"]) == (2, 1, False)
    assert per_layer["worst"] == pytest.approx(1.35) and per_layer["worst_case"] == "llama-3.1-8b tp1 per-layer h2d x512"
    assert per_layer_geo["worst"] == pytest.approx((1.35 * 1.05) ** 0.5, abs=1e-4) and per_layer_geo["ok"] is False
    # block-major, 1.01, 1.06 and 0.99 (not the unbuilt shape's 2.0): d2h over 1.05, the geomean within 1.02
    assert (block_major["cases"], block_major["passed"], block_major["ok"]) == (3, 2, False)
    assert block_major["worst"] == pytest.approx(1.06)
    assert block_major["worst_case"] == "llama-3.1-8b tp1 block-major d2h x512"
    assert block_major_geo["worst"] == pytest.approx((1.01 * 1.06 * 0.99) ** (1 / 3), abs=1e-4)
    assert block_major_geo["ok"] is True
    # h2d: 1.05 / 1.30 (block-major batch), the per-layer default's 1.40 and batch's 2.0 are slower; the
    # low_interference contender took the staged route and does not count; d2h: 1.20 / 1.30
    assert (unstaged["cases"], unstaged["passed"], unstaged["ok"]) == (2, 1, False)
    assert unstaged["worst"] == pytest.approx(1.2 / 1.3, abs=1e-4) and "d2h" in unstaged["worst_case"]
    # 47 / 50, 44 / 50, 46 / 50 (the 64 KiB case is outside the range)
    assert (ceiling["cases"], ceiling["passed"]) == (3, 2) and ceiling["worst"] == pytest.approx(0.88)
    assert (slowdown["cases"], slowdown["passed"], slowdown["ok"]) == (2, 1, False)
    assert slowdown["worst"] == pytest.approx(0.08) and slowdown["worst_case"] == "d2h triton.staged 4 KiB x900"
    # where the per-layer side holds the best route that is not staged, the default is held to it
    cases[2]["contenders"][2]["makespan_over_compute"] = 1.5
    h2d = step_report.bars([{"cases": [cases[0], cases[2]]}])[9]
    assert (h2d["cases"], h2d["ok"]) == (1, True) and h2d["worst"] == pytest.approx(1.05 / 1.40, abs=1e-4)
    text = step_report.text_table({"cases": cases[2:3]})
    assert "block-major" in text and "1.010" in text  # host, the default's span/contiguous


def test_the_makespan_bar_compares_each_repetitions_ratio_to_its_compute_alone():
    # Raw medians from repetitions whose GEMMs ran at different clocks: the default looks 5%
    # later, but over the compute alone of their own repetitions the two are 1% apart.
    drift = case(default=(21.0, 2.0), batch=(20.0, 3.0), vllm=(20.0, 3.0, 50.0, "batch"))
    by = {c["name"]: c for c in drift["contenders"]}
    by["default"]["makespan_over_compute"], by["batch"]["makespan_over_compute"] = 1.01, 1.0
    by["vllm"]["makespan_over_compute"] = 1.0
    makespan = step_report.bars([{"cases": [drift]}])[0]
    assert makespan["ok"] is True and makespan["worst"] == pytest.approx(1.01)
    # ... and the other way round: medians 0.5% apart, a default 5% later in its own repetitions
    by["default"]["makespan_ms"], by["default"]["makespan_over_compute"] = 20.1, 1.05
    makespan = step_report.bars([{"cases": [drift]}])[0]
    assert makespan["ok"] is False and makespan["worst"] == pytest.approx(1.05)
    assert "1.050" in step_report.text_table({"cases": [drift]})  # the table shows the ratio


def test_bench_model_on_a_cpu_fails_saying_it_needs_a_gpu():
    out = kvswap_cli("bench", "--model", "llama-3.1-8b", "--blocks", "2")
    assert out.returncode == 3 and "needs a GPU" in out.stderr and "Traceback" not in out.stderr
    out = kvswap_cli("bench", "--model", "deepseek-v3", "--tp", "8")
    assert out.returncode == 2 and "does not split over 8 ranks" in out.stderr
    out = kvswap_cli("bench", "--model", "nope")
    assert out.returncode == 2 and "not built in" in out.stderr
    out = kvswap_cli("bench", "--model", "llama-3.1-8b", "--host-layouts", "per-layer,blockmajor")
    assert out.returncode == 2 and "unknown host layout 'blockmajor'; choose from per-layer,block-major" in out.stderr


def test_custom_shape_flags_and_tp_list_pick_the_caches():
    from kvswap.calibration import cli_bench, cli_step
    from kvswap.cli import Parser

    p = Parser()
    cli_bench.add_arguments(p)
    args = p.parse_args(["--model", "all", "--tp", "1,8"])
    caches, notes = cli_step.caches_from_args(args)
    assert [c.label for c in caches] == ["llama-3.1-8b tp1", "llama-3.1-8b tp8", "llama-3.1-70b tp1",
                                         "llama-3.1-70b tp8", "qwen2.5-7b tp1", "deepseek-v3 tp1",
                                         "gpt-oss-120b tp1", "gpt-oss-120b tp8"]
    assert len(notes) == 2 and cli_step.wanted(args) and args.host_layouts is None  # the settings' default: both
    args = p.parse_args(["--model", "qwen2.5-7b", "--host-layouts", "block-major,per-layer,block-major"])
    assert args.host_layouts == ["block-major", "per-layer"]
    args = p.parse_args(["--layers", "1", "--kv-heads", "1", "--head-dim", "128", "--blocks", "5000"])
    (c,), _ = cli_step.caches_from_args(args)
    assert (c.chunk_bytes, c.descriptors_per_block * 5000) == (4096, 10_000) and cli_step.wanted(args)
    assert not cli_step.wanted(p.parse_args([]))


def test_block_mover_decides_by_the_calibration_it_is_given():
    """The bench binds its kernel contender through BlockMover(calibration=...)."""
    import kvswap

    dev = cpu()
    cal = step.exact_sms_calibration(dev, 12)
    src = [torch.zeros(2, 4, 2, 1, 8, dtype=torch.bfloat16) for _ in range(2)]
    dst = [torch.zeros(2, 4, 2, 1, 8, dtype=torch.bfloat16) for _ in range(2)]
    c = Contender("batch", Policy(force="host.reference"), exact_sms=12)
    with step.bind(c, dev, kvswap.BlockMover, src, dst, "h2d", block_dim=1) as mover:
        assert mover.swap_fn.plan.calibration["source"] == cal.source
    with kvswap.BlockMover(src, dst, "h2d", block_dim=1, profiles=False) as mover:
        assert mover.swap_fn.plan.calibration["source"] != cal.source


def test_variants_run_beside_the_default_every_byte_checked_and_stay_out_of_the_bars():
    """--variants: the default without each older mechanism, measured like every contender;
    the bars judge the same contenders as without them, and a table says what each gains."""
    doc, _ = run_tiny(shapes=(TINY_FLASH,), directions=(Direction.H2D, Direction.D2H), blocks=(4,), reps=2,
                      variants=True)
    doc = json.loads(json.dumps(doc))
    for case in doc["cases"]:
        by = {c["name"]: c for c in case["contenders"]}
        assert list(by)[-len(step.VARIANTS):] == list(step.VARIANTS)
        for v in step.VARIANTS:
            assert by[v]["error"] is None and by[v]["same_as"] is None, by[v]
            assert by[v]["bytes_checked"] == 2 * case["reps"] * case["bytes"] and by[v]["makespan_ms"] > 0
    plain = json.loads(json.dumps(doc))
    for case in plain["cases"]:
        case["contenders"] = [c for c in case["contenders"] if c["name"] not in step.VARIANTS]
    assert step_report.bars([doc]) == step_report.bars([plain])
    table = step_report.variants_table([doc])
    assert all(f"| {v} | 4 | " in table for v in step.VARIANTS), table
    assert step_report.variants_table([plain]) is None
    rendered = step_report.render_markdown(doc)
    assert "What each older mechanism still gains" in rendered
    # The per-case table leaves the variants to that summary; the JSON keeps their rows.
    assert not any(f"| {v} |" in step_report.markdown_table(doc) for v in step.VARIANTS)
    assert all(v in step_report.text_table(doc) for v in step.VARIANTS)


def test_a_variants_mover_options_apply(monkeypatch):
    from kvswap.calibration import step_contenders

    seen = {}

    def mover(*args, **kwargs):
        seen.clear()
        seen.update(kwargs)
        return "mover"

    monkeypatch.setattr(step_contenders, "BlockMover", mover)
    by = {c.name: c for c in step_contenders.variants()}
    assert step_contenders.make_mover([], [], Direction.H2D, 0, by["default/no-thread"], cpu()) == "mover"
    assert seen["issuing_thread"] is False and "device_descriptors" not in seen
    step_contenders.make_mover([], [], Direction.H2D, 0, by["default/thread-only"], cpu())
    assert seen["issuing_thread"] is True and "device_descriptors" not in seen
    step_contenders.make_mover([], [], Direction.H2D, 0, by["default/descriptors"], cpu())
    assert seen["device_descriptors"] is False


def _scripted_spans(monkeypatch, spans, fail=None):
    """``step.one_step`` as it is (every byte moved and checked), its makespan replaced by
    ``spans[name][repetition]``; ``fail``: ``(name, repetition)`` where it raises instead."""
    real, seen = step.one_step, {}

    def scripted(env, side, mover, *args):
        got = real(env, side, mover, *args)
        name = "contiguous" if isinstance(mover, step_contiguous.ContiguousCopy) else "default"
        rep = seen[name] = seen.get(name, -1) + 1
        if (name, rep) == fail:
            raise RuntimeError("the link went away")
        return (*got[:3], spans[name][rep])

    monkeypatch.setattr(step, "one_step", scripted)


def test_span_over_contiguous_divides_each_repetition_by_the_references_in_the_same_repetition(monkeypatch):
    # The GPU's clock moves a step's time between repetitions: per repetition the default is
    # 1.1, 1.2 and 1.0 x the reference; the medians (20 ms each) would say 1.0.
    _scripted_spans(monkeypatch, {"contiguous": [0.010, 0.040, 0.020], "default": [0.011, 0.048, 0.020]})
    env = HostEnv(lambda: sum(range(500)))
    pools = StepPools(env, TINY_FLASH.at(2), 64)
    case = step.run_case(env, pools, cpu(), Direction.H2D, 4, [Contender("default", Policy())], 3,
                         np.random.default_rng(0))
    by = case.by_name()
    assert [c.name for c in case.contenders] == ["contiguous", "default"]
    assert by["default"].makespan_ms == pytest.approx(20.0) and by["contiguous"].makespan_ms == pytest.approx(20.0)
    assert by["default"].span_over_contiguous == pytest.approx(1.1)
    assert by["contiguous"].span_over_contiguous == 1.0
    # each checked alone and beside in every repetition
    assert by["default"].bytes_checked == by["contiguous"].bytes_checked == 2 * 3 * 4 * TINY_FLASH.at(2).block_bytes


def test_a_reference_that_fails_leaves_no_ratio_to_it(monkeypatch):
    _scripted_spans(monkeypatch, {"contiguous": [0.010, 0.040, 0.020], "default": [0.011, 0.048, 0.020]},
                    fail=("contiguous", 1))
    env = HostEnv(lambda: sum(range(500)))
    pools = StepPools(env, TINY_FLASH.at(2), 64)
    case = step.run_case(env, pools, cpu(), Direction.D2H, 4, [Contender("default", Policy())], 3,
                         np.random.default_rng(0))
    by = case.by_name()
    assert by["contiguous"].error == "RuntimeError: the link went away"
    assert by["default"].error is None and by["default"].makespan_ms == pytest.approx(20.0)
    assert by["default"].span_over_contiguous is None and by["contiguous"].span_over_contiguous is None
    with pytest.raises(ConfigurationError, match="may not be named 'contiguous'"):
        step.run_case(env, pools, cpu(), Direction.D2H, 4, [Contender("contiguous", Policy())], 1,
                      np.random.default_rng(0))


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_the_contiguous_copy_moves_a_jobs_bytes_in_pieces_of_its_buffer_and_checks_them(direction):
    env = HostEnv(lambda: None)
    buffers = step_contiguous.ContiguousBuffers(env, 1000, seed=4)
    assert buffers.size == 1000 and not bool((buffers.want == buffers.want[0]).all())  # random, never constant
    assert step_contiguous.ContiguousBuffers(env, 1 << 40).size == step_contiguous.BUFFER_MAX  # at most
    copy = step_contiguous.ContiguousCopy(buffers, direction, block_bytes=300)
    src, dst = buffers.sides(direction)
    assert torch.equal(src, buffers.want)  # filled from the random bytes
    ids = np.arange(2)
    copy.poison(direction)
    assert bool((dst == step_workload.POISON).all())
    job = copy.submit(ids, ids)
    (done,) = copy.poll()
    assert (done.job_id, done.ok, done.bytes, done.descriptors) == (job, True, 600, 1) and copy.poll() == []
    assert copy.check(direction, ids, ids) == 600  # the job's bytes, and poison past them
    dst[599] ^= 0xFF
    with pytest.raises(WrongBytes, match="destination byte 599 does not hold"):
        copy.check(direction, ids, ids)
    dst[599] ^= 0xFF
    dst[600] ^= 0xFF
    with pytest.raises(WrongBytes, match="copy of 600 bytes wrote its destination's byte 600"):
        copy.check(direction, ids, ids)
    # 5 blocks of 300 bytes: 1,500 bytes as copies of 1,000 and 500 from the buffer's start
    assert step_contiguous.pieces(1500, 1000) == [1000, 500] and copy.label(5) == "contiguous copy in 2 pieces of 1,000 B"
    copy.poison(direction)
    copy.submit(np.arange(5), np.arange(5))
    (done,) = copy.poll()
    assert (done.bytes, done.descriptors) == (1500, 2)
    assert copy.check(direction, np.arange(5), np.arange(5)) == 1000 and torch.equal(dst, buffers.want)
    assert torch.equal(src, buffers.want)  # the source untouched
    assert copy.label(3) == "contiguous copy"


def test_render_prints_the_grid_of_kvswap_bench_as_it_ran(tmp_path):
    """``--render`` of the grid's JSON (here the host's own copies, measured now): a table per
    direction with a row per block size and batch, the command quoted."""
    path = tmp_path / "grid.json"
    out = kvswap_cli("bench", "--device", "cpu", "--block-bytes", "4096,65536", "--batches", "16,64",
                     "--directions", "h2d", "--json", str(path))
    assert out.returncode == 0, out.stderr
    out = kvswap_cli("bench", "--render", str(path), "--command", "kvswap bench --device cpu")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].endswith("— `kvswap bench --device cpu`") and lines[2] == "```text"
    # On a host the scattered copies can beat the contiguous one measured beside them; the
    # header then says so instead of calling it a ceiling (either is right here).
    assert lines[3].startswith(("h2d: GB/s (contiguous ceiling ", "h2d: GB/s (a contiguous copy "))
    rows = [line.split()[:3] for line in lines
            if line.strip().startswith(("4 KiB", "64 KiB")) and line.split()[2].isdigit()]  # not "... x 16:"
    assert rows == [["4", "KiB", "16"], ["4", "KiB", "64"], ["64", "KiB", "16"], ["64", "KiB", "64"]]
    assert lines[-2:] == ["```", ""] and "d2h: GB/s" not in out.stdout
