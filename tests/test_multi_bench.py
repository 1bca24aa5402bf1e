"""``kvswap bench --devices``: the schedule, the aggregation of fake per-device windows, the
report, and a real run of two host-reference "devices" in two processes."""
from __future__ import annotations

import argparse
import json

import pytest

from kvswap.calibration import multi
from kvswap.calibration.aggregate import BAR, aggregate, multi_report
from kvswap.calibration.multi import MultiSettings, Step, schedule
from kvswap.cli import main
from kvswap.memory.numa import Topology

from numa_fakes import fake_sysfs

KiB = 1024
SETTINGS = MultiSettings(block_sizes=(4 * KiB, 64 * KiB, 256 * KiB), batch_sizes=(1024,), windows=2)


def test_schedule_times_each_device_alone_then_all_together():
    steps = schedule(SETTINGS, ["h2d", "d2h"], 3)
    per_point = SETTINGS.windows * (3 + 1)
    points = len(SETTINGS.block_sizes) * len(SETTINGS.batch_sizes) * len(multi.ROUTES)
    numa = 2 * 3 * len(SETTINGS.block_sizes) * SETTINGS.windows * 2
    assert len(steps) == 2 * (per_point + points * per_point) + numa
    first = steps[:4]
    assert [s.active for s in first] == [(0,), (1,), (2,), (0, 1, 2)]
    assert all(s.kind == "ceiling" and s.direction == "h2d" and s.window == 0 for s in first)
    assert steps[4].window == 1
    point = [s for s in steps if s.kind == "point" and s.block_bytes == 64 * KiB and s.direction == "d2h"]
    assert {s.route for s in point} == {"resolved", "batch"} and len(point) == 2 * per_point
    numa_steps = [s for s in steps if s.kind == "numa"]
    assert len(numa_steps) == numa and all(len(s.active) == 1 and s.route == "resolved" for s in numa_steps)
    assert [s.host for s in numa_steps[:4]] == ["right", "wrong", "right", "wrong"]  # interleaved
    one = schedule(MultiSettings(windows=1, numa=False), ["h2d"], 1)
    assert all(s.active == (0,) for s in one) and not any(s.kind == "numa" for s in one)


# Each device alone: ceiling 50 (cuda:0) and 40 (cuda:1) GB/s; a point alone: 45 and 36;
# together each gets 90% of alone at 4 and 64 KiB, 80% at 256 KiB; the batch route half.
# The wrong node: 0.7 of the right one on cuda:0, not measured on cuda:1.
ALONE_CEILING = {0: 50.0, 1: 40.0}


def _gbps(step: Step, rank: int) -> float | None:
    base = ALONE_CEILING[rank]
    if step.kind == "ceiling":
        return base * (0.95 if len(step.active) > 1 else 1.0)
    if step.kind == "numa":
        if rank == 1:
            return None
        return base * 0.9 * (0.7 if step.host == "wrong" else 1.0)
    g = base * 0.9 * (0.5 if step.route == "batch" else 1.0)
    if len(step.active) > 1:
        g *= 0.8 if step.block_bytes == 256 * KiB else 0.9
    return g + 0.01 * step.window  # windows differ a little: the median is the middle


def fake_outs(steps: list[Step], count: int = 2) -> list[dict]:
    outs = []
    for rank in range(count):
        recs = []
        for i, s in enumerate(steps):
            g = _gbps(s, rank) if rank in s.active else None
            if g is None:
                continue
            start = 10.0 + i + (0.01 * rank if len(s.active) > 1 else 0)  # 1 s windows, started 10 ms apart
            label = "triton.kernel@8" if s.route == "resolved" and s.block_bytes < 64 * KiB else "cuda.batch"
            recs.append({"step": i, "rank": rank, "gbps": g, "t0": start, "t1": start + 1.0, "calls": 100,
                         "label": "contiguous" if s.kind == "ceiling" else label})
        info = {"spec": f"cuda:{rank}", "device": {"name": "Fake GPU", "link": "pcie-gen5-x16"},
                "numa_node": rank, "wrong_node": 1 - rank if rank == 0 else None}
        outs.append({"rank": rank, "spec": f"cuda:{rank}", "info": info, "records": recs,
                     "failures": [{"device": "cuda:1", "error": "boom"}] if rank == 1 else []})
    return outs[::-1]  # arrival order does not matter


def test_aggregate_sums_devices_and_holds_them_against_the_ceilings_alone():
    steps = schedule(SETTINGS, ["h2d"], 2)
    result = aggregate(fake_outs(steps), steps, SETTINGS, ["h2d"])
    assert [d["name"] for d in result["devices"]] == ["cuda:0", "cuda:1"]
    c = result["ceiling"]["h2d"]
    assert c["alone"] == {"cuda:0": 50.0, "cuda:1": 40.0} and c["sum_alone_gbps"] == 90.0
    assert c["aggregate_gbps"] == 85.5 and c["aggregate_over_sum"] == 0.95
    assert c["overlap"] == round(0.99 / 1.01, 3)  # 1 s windows started 10 ms apart: 0.99 s of 1.01 in common
    rows = {(r["block_bytes"], r["route"]): r for r in result["rows"]}
    assert len(rows) == 6
    r = rows[(4 * KiB, "resolved")]
    alone = {"cuda:0": 45.005, "cuda:1": 36.005}  # median of windows 0 and 1
    assert r["alone"] == alone and r["sum_alone_gbps"] == 81.01
    assert r["together"] == {"cuda:0": round(45 * 0.9 + 0.005, 3), "cuda:1": round(36 * 0.9 + 0.005, 3)}
    assert r["sum_ceilings_gbps"] == 90.0
    assert r["over_ceilings"] == round(r["aggregate_gbps"] / 90.0, 4) and r["over_ceilings"] == 0.8101
    assert r["over_alone"] == round(r["aggregate_gbps"] / 81.01, 4)
    # against the shared ceiling: every device's contiguous copy at once, 85.5 GB/s
    assert r["shared_ceiling_gbps"] == 85.5 and r["over_shared_ceiling"] == round(r["aggregate_gbps"] / 85.5, 4)
    assert r["labels"] == {"cuda:0": "triton.kernel@8", "cuda:1": "triton.kernel@8"}
    assert rows[(256 * KiB, "batch")]["aggregate_gbps"] == round((22.5 * 0.8 + 0.005) + (18 * 0.8 + 0.005), 3)
    assert result["numa"] == [{"device": "cuda:0", "direction": "h2d", "block_bytes": b, "batch": 1024,
                               "right_node": 0, "wrong_node": 1, "right_gbps": 45.0, "wrong_gbps": 31.5,
                               "wrong_over_right": 0.7} for b in SETTINGS.block_sizes]
    s = result["summary"]["h2d"]
    # The bar counts the resolved rows of 4-128 KiB: 256 KiB is outside it.
    assert s["bar_points"] == 2 and s["under_bar"] == 2 and s["min_at"] == "4 KiB x 1024"
    assert (s["shared_bar_points"], s["min_shared_at"]) == (2, "4 KiB x 1024")
    assert s["min_over_shared_ceiling"] == rows[(4 * KiB, "resolved")]["over_shared_ceiling"] == 0.8527
    assert s["under_shared_bar"] == sum(rows[(b, "resolved")]["over_shared_ceiling"] < BAR for b in (4 * KiB, 64 * KiB))
    assert s["wrong_over_right_median"] == 0.7 and s["wrong_over_right_min"] == 0.7
    assert result["failures"] == [{"device": "cuda:1", "error": "boom"}]
    json.dumps(result)


def test_aggregate_marks_what_a_device_did_not_measure():
    steps = schedule(SETTINGS, ["h2d"], 2)
    outs = fake_outs(steps)
    for o in outs:
        if o["rank"] == 1:  # cuda:1 never timed the 64 KiB batch route together
            o["records"] = [r for r in o["records"] if not (
                steps[r["step"]].block_bytes == 64 * KiB and steps[r["step"]].route == "batch"
                and len(steps[r["step"]].active) > 1)]
    result = aggregate(outs, steps, SETTINGS, ["h2d"])
    row = next(r for r in result["rows"] if r["block_bytes"] == 64 * KiB and r["route"] == "batch")
    assert row["together"]["cuda:1"] is None and row["aggregate_gbps"] is None and row["over_ceilings"] is None
    assert row["over_shared_ceiling"] is None
    text = multi_report(result)
    assert "/18.0" in text and "-/18.0" in text


def test_report_tables():
    steps = schedule(SETTINGS, ["h2d", "d2h"], 2)
    result = aggregate(fake_outs(steps), steps, SETTINGS, ["h2d", "d2h"])
    text = multi_report(result)
    lines = text.splitlines()
    assert lines[0].startswith("2 device(s) at once, one process each; windows of 0.2 s, 2 per point")
    assert "  cuda:0: Fake GPU (link pcie-gen5-x16, NUMA node 0, wrong node 1)" in lines
    assert "  cuda:1: Fake GPU (link pcie-gen5-x16, NUMA node 1)" in lines
    ceiling = next(line for line in lines if line.startswith("h2d ") and "85.5" in line)
    assert ceiling.split() == ["h2d", "47.5/50.0", "38.0/40.0", "85.5", "90.0", "0.95", "0.98"]
    row = next(line for line in lines if line.startswith("d2h") and "256 KiB" in line and " batch " in line)
    assert row.split()[-1] == "cuda.batch"
    assert "host memory on the wrong NUMA node (resolved route, each device alone):" in lines
    assert any(line.split()[:2] == ["cuda:0", "h2d"] and line.split()[-1] == "0.70" for line in lines)
    s = result["summary"]["h2d"]
    assert (f"h2d: resolved route, 4 KiB-128 KiB: aggregate >= {BAR:.2f} x the sum of the ceilings alone at 0 of 2 "
            f"points (lowest 0.810 at 4 KiB x 1024); >= {BAR:.2f} x the shared ceiling (every device copying at once) "
            f"at {2 - s['under_shared_bar']} of 2 points (lowest 0.853 at 4 KiB x 1024); "
            "wrong node / right node: median 0.700, lowest 0.700") in lines
    head = next(line for line in lines if line.startswith("dir "))
    assert head.split()[-6:] == ["aggregate", "agg/ceilings", "agg/shared", "agg/alone", "overlap", "impl"]
    row = next(line for line in lines if line.startswith("h2d") and " 4 KiB " in line and " resolved " in line)
    assert row.split()[-5:-3] == ["0.81", "0.85"]  # against the sum of the ceilings alone, and the shared one


def test_farthest_node(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-3", 1: "4-7", 2: "8-11", 3: ""})
    for n, dist in {0: "10 12 32 32", 1: "12 10 32 32", 2: "32 32 10 12", 3: "32 32 12 10"}.items():
        (root / f"devices/system/node/node{n}/distance").write_text(dist + "\n")
    topo = Topology(root)
    assert topo.distances(0) == {0: 10, 1: 12, 2: 32, 3: 32}
    assert multi.farthest_node(topo, 0) == 2  # node 3 is as far, but has no CPUs
    assert multi.farthest_node(topo, 2) == 0  # ties go to the lowest id
    assert multi.farthest_node(topo, None) is None
    assert multi.farthest_node(Topology(fake_sysfs(tmp_path / "one", {0: "0-3"})), 0) is None
    (root / "devices/system/node/node1/distance").write_text("10 x\n")
    assert topo.distances(1) == {} and multi.farthest_node(topo, 1) == 0  # no distances: lowest id


def test_device_indices():
    assert multi.device_indices("0,1, 2,3") == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert multi.device_indices("cuda:4,CPU") == ["cuda:4", "cpu"]
    for bad in ("", "0,x", "rocm:0", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            multi.device_indices(bad)


def test_the_command_refuses_what_does_not_go_with_devices(capsys):
    assert main(["bench", "--devices", "0,1", "--device", "cuda:0"]) == 2
    assert "--device and --devices cannot be used together" in capsys.readouterr().err
    assert main(["bench", "--devices", "0,1", "--repeats", "5"]) == 2
    assert "--repeats is not used with --devices" in capsys.readouterr().err
    assert main(["bench", "--devices", "0,1", "--window", "0"]) == 2
    assert main(["bench", "--devices", "0,0", "--window", "0.1"]) == 2
    assert "names a device twice" in capsys.readouterr().err


def test_two_host_devices_in_two_processes(tmp_path, capsys):
    """The real thing, on the host reference: two processes meet at every window's barrier,
    each checks its routes byte for byte and times its windows."""
    out = tmp_path / "multi.json"
    rc = main(["bench", "--devices", "cpu,cpu", "--block-bytes", "4096", "--batches", "4", "--passes", "2",
               "--window", "0.01", "--directions", "h2d", "--json", str(out)])
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0, text
    # What the devices told the parent as they went: each one's setup, then the windows by part.
    err = captured.err.splitlines()
    assert sum(line.startswith("  cpu#0: ready (") for line in err) == 1
    assert sum(line.startswith("  cpu#1: ready (") for line in err) == 1
    windows = len(multi.schedule(multi.multi_settings(True, [4096], [4], 2, 0.01), ["h2d"], 2))
    assert any(line.startswith(f"  {windows}/{windows} windows (h2d ") for line in err), err
    result = json.loads(out.read_text())
    assert result["failures"] == []
    assert [d["name"] for d in result["devices"]] == ["cpu#0", "cpu#1"]
    assert all(d["device"]["platform"] == "cpu" for d in result["devices"])
    c = result["ceiling"]["h2d"]
    assert all(v > 0 for v in [*c["alone"].values(), *c["together"].values()])
    assert [(r["route"], r["block_bytes"], r["batch"]) for r in result["rows"]] == [("resolved", 4096, 4),
                                                                                    ("batch", 4096, 4)]
    for r in result["rows"]:
        assert all(v > 0 for v in [*r["alone"].values(), *r["together"].values()])
        assert r["labels"] == {"cpu#0": "host.reference", "cpu#1": "host.reference"}
        assert 0 <= r["overlap"] <= 1
    assert result["numa"] == []  # the host is no device: no node to be wrong about
    assert "wrong NUMA node: not measured" in text and "results written to" in text


def test_each_window_is_reported_once_naming_its_part_and_device():
    steps = multi.schedule(multi.multi_settings(True, [4096], [4], 1, 0.01), ["h2d"], 2)
    seen = []

    class Bar:
        def add(self, n):
            seen.append(("add", n))

        def step(self, what):
            seen.append(what)

    hear = multi.progress_of(["cuda:0", "cuda:1"], steps, Bar())
    hear(1, "setup", "DeviceNotFoundError: no such device")
    for done in (2, 2, len(steps)):  # a report may repeat: nothing is counted twice
        hear(0, "step", done)
    assert seen[0] == ("add", len(steps)) and len(seen) == 1 + len(steps)
    assert seen[1] == "h2d contiguous ceiling on cuda:0" and seen[3] == "h2d contiguous ceiling on all 2 devices"
    assert any(s.startswith("h2d resolved, 4 KiB x 4 on cuda:1") for s in seen[1:])


def test_a_device_that_cannot_be_set_up_lets_the_others_run(tmp_path, capsys):
    result = multi.run_multi(["cpu", "cuda:7"], multi.multi_settings(True, [4096], [4], 1, 0.01), ["d2h"])
    setup = [f for f in result["failures"] if f.get("stage") == "setup"]
    assert len(setup) == 1 and setup[0]["device"] == "cuda:7"
    row = result["rows"][0]
    assert row["alone"]["cpu"] > 0 and row["alone"]["cuda:7"] is None and row["aggregate_gbps"] is None


def test_the_command_says_on_stderr_why_no_device_measured(capsys):
    rc = main(["bench", "--devices", "cuda:7", "--block-bytes", "4096", "--batches", "4", "--passes", "1",
               "--window", "0.01", "--directions", "h2d"])
    captured = capsys.readouterr()
    assert rc == 3 and captured.out == ""  # no such device here: the status explain and bench --model give too
    err = captured.err.strip().splitlines()
    assert any(line.startswith("kvswap: cuda:7 failed (stage setup): ") for line in err), err
    assert err[-1] == "kvswap: error: no device measured anything (the failures above say why)"
