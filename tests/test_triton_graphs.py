"""The bookkeeping of graphed small launches (backends/triton_generic/graphs.py) without a
GPU: when a shape is captured, which slot a call gets, and when it launches plainly. The
captures and replays themselves are checked on a GPU (test_triton_graphs_gpu.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvswap.backends.triton_generic import graphs


class _Done:
    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished


def _launch(n: int = 16, grid: int = 4, tile: str = "t") -> SimpleNamespace:
    return SimpleNamespace(n=n, grid=grid, tile=tile)


@pytest.fixture
def g(monkeypatch):
    monkeypatch.delenv(graphs.ENV, raising=False)
    out = graphs.Graphs(0, pool=None, variants=None)
    captured = []

    def capture(launch):
        captured.append((launch.n, launch.grid, launch.tile))
        return [graphs.Slot(SimpleNamespace(done=_Done()), graph=None, exec_handle=1) for _ in range(graphs.RING)]

    monkeypatch.setattr(out, "_capture", capture)
    out.captured = captured
    return out


def test_a_shape_is_captured_on_its_second_sighting_once(g):
    launch = _launch()
    assert g.slot(launch) is None and g.captured == []
    first = g.slot(launch)
    assert first is not None and first.busy and g.captured == [(16, 4, "t")]
    g.slot(_launch(n=17))  # another shape: seen once, not captured
    assert g.captured == [(16, 4, "t")]
    first.busy, first.used = False, True
    first.entry.done.finished = True
    assert g.slot(launch) is first  # its replay finished: the same buffer again, no new capture
    assert g.captured == [(16, 4, "t")]


def test_a_buffer_still_read_is_never_handed_out(g):
    launch = _launch()
    g.slot(launch)
    taken = []
    for _ in range(graphs.RING):
        slot = g.slot(launch)
        slot.busy, slot.used = False, True  # replayed, still in flight (done not finished)
        taken.append(slot)
    assert len({id(s) for s in taken}) == graphs.RING
    assert g.slot(launch) is None  # every buffer in flight: the plain launch serves
    taken[2].entry.done.finished = True
    assert g.slot(launch) is taken[2]


def test_a_failed_capture_or_the_switch_stops_capturing(g, monkeypatch):
    def fail(launch):
        g.failed = "RuntimeError: capture"
        return None

    monkeypatch.setattr(g, "_capture", fail)
    launch = _launch()
    assert g.slot(launch) is None and g.slot(launch) is None
    assert g.failed == "RuntimeError: capture"
    assert g.slot(_launch(n=3)) is None and g.slot(_launch(n=3)) is None
    monkeypatch.setenv(graphs.ENV, "off")
    off = graphs.Graphs(0, pool=None, variants=None)
    monkeypatch.setattr(off, "_capture", lambda launch: pytest.fail("captured while turned off"))
    assert off.slot(launch) is None and off.slot(launch) is None and graphs.ENV in off.failed
    assert off.describe() == f"CUDA graphs off ({graphs.ENV}=off)"


def test_no_graphs_where_the_platform_graph_launch_is_not_found(monkeypatch):
    monkeypatch.delenv(graphs.ENV, raising=False)
    monkeypatch.setattr(graphs, "raw_launcher", lambda: None)
    g = graphs.Graphs(0, pool=None, variants=None)
    launch = _launch()
    assert g.slot(launch) is None and g.slot(launch) is None  # the second sighting tries, and stops
    assert "cuGraphLaunch" in g.failed and "CUDA graphs off" in g.describe()
    assert g.slot(_launch(n=3)) is None and g.slot(_launch(n=3)) is None


def test_explain_says_whether_small_launches_are_graphed(monkeypatch):
    monkeypatch.delenv(graphs.ENV, raising=False)
    assert "replayed from CUDA graphs" in graphs.Graphs(0, pool=None, variants=None).describe()
