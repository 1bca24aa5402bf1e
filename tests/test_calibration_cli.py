"""``kvswap calibrate`` and ``kvswap bench`` on the CPU, end to end, and their bad arguments."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kvswap.resolution import profiles
from kvswap.registry import plugins
from kvswap.calibration import store
from kvswap.calibration import sweep as sweep_module
from kvswap.cli import main
from kvswap.registry.platform import cpu_device

from calibration_fakes import Ledger, LedgerTimer, ModelPlatform, modelled_host_cost

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def no_interpreted_kernel(monkeypatch):
    # The suite runs Triton's interpreter on the CPU (TRITON_INTERPRET=1), which makes
    # triton.kernel a CPU route; a real `kvswap calibrate` on a CPU has none, and timing the
    # interpreter over a whole grid would take minutes. test_calibration_sweep measures it.
    monkeypatch.setenv("KVSWAP_DISABLE_PLUGINS", "triton")


def test_calibrate_quick_writes_profile_and_plot_and_explain_names_it(tmp_path, capsys, monkeypatch):
    out, png = tmp_path / "p" / "cpu.json", tmp_path / "curves.png"
    assert main(["calibrate", "--quick", "--out", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr()
    assert "HOST MEMORY COPIES" in printed.out and "HOST MEMORY COPIES" in printed.err
    assert "host reference" in printed.out and "not device link numbers" in printed.out
    assert f"written to {out}" in printed.out and f"KVSWAP_PROFILE={out}" in printed.out
    assert re.search(rf"written to {re.escape(str(out))} \(in \d+(\.\d+)? s\)", printed.out), printed.out
    assert "(0 s)" not in printed.out
    doc = profiles.read(out, cpu_device())
    assert doc["measured"].startswith("host memory copies") and doc["host_reference"] is True
    assert {c["impl"] for c in doc["curves"]} == {"host.reference"}
    assert "measurements" not in doc  # the raw rows lie beside the profile
    raw = store.measurements_path(out)
    assert raw.name == "cpu.measurements.json" and f"raw measurements written to {raw}" in printed.out
    ms, inter = store.read_measurements(raw)
    assert {m.stage for m in ms} == {"ceiling", "size"} and inter == []
    assert set(doc["decisions"]) == {"h2d", "d2h"} and set(doc["ceiling_gbps"]) == {"h2d", "d2h"}
    assert png.read_bytes()[:8] == PNG_MAGIC
    monkeypatch.setenv(profiles.PROFILE_ENV, str(out))
    assert main(["explain", "--direction", "h2d"]) == 0
    explained = capsys.readouterr().out
    # a host reference profile is not presented as a device calibration
    assert f"calibration: profile {out} (host reference: " in explained and "(measured)" not in explained
    assert "not a device calibration" in explained


def test_calibrate_default_location_is_found_by_a_new_process(tmp_path, capsys):
    assert main(["calibrate", "--quick", "--directions", "d2h"]) == 0
    path = profiles.default_path(cpu_device())
    assert path.is_relative_to(os.environ["XDG_DATA_HOME"])
    assert path.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    assert store.measurements_path(path).is_file()
    doc = profiles.read(path, cpu_device())
    assert doc["directions"] == ["d2h"] and "carried_from" in doc["decisions"]["h2d"]
    assert "KVSWAP_PROFILE" not in capsys.readouterr().out  # no hint: it is where the resolver looks
    run = subprocess.run([sys.executable, "-m", "kvswap", "explain", "--direction", "d2h"],
                         capture_output=True, text=True, env=dict(os.environ), check=True)
    assert f"calibration: profile {path} (host reference" in run.stdout


def test_calibrate_replaces_a_corrupt_profile_and_names_it(capsys):
    path = profiles.default_path(cpu_device())
    path.parent.mkdir(parents=True)
    path.write_text("{broken")
    assert main(["calibrate", "--quick", "--directions", "h2d"]) == 0
    assert f"skipped calibration profile {path}" in capsys.readouterr().err
    assert profiles.read(path, cpu_device())["directions"] == ["h2d"]


def test_calibrate_a_device_with_a_kernel_route_then_explain(capsys, monkeypatch):
    """A modelled device (real host copies, modelled costs; see calibration_fakes): the table,
    the decisions and the plot include the kernel per SM count, and the resolver binds the knee."""
    ledger = Ledger()
    monkeypatch.delenv("KVSWAP_DISABLE_PLUGINS")  # a host of the model platform alone: nothing to disable
    plugins.reset_plugin_host(plugins.create_plugin_host(entry_points=[], extra=[("model", ModelPlatform(ledger))]))
    monkeypatch.setattr(sweep_module, "make_timer", lambda device: LedgerTimer(ledger))
    modelled_host_cost(monkeypatch)
    assert main(["calibrate", "--quick", "--device", "modelplat:0"]) == 0
    out = capsys.readouterr().out
    assert "model.kernel@8" in out and "SM knee: 8 SMs" in out and "kernel only for batches of at least" in out
    path = profiles.user_dir() / f"{ModelPlatform.IDENTITY}.json"
    doc = json.loads(path.read_text())
    assert doc["decisions"]["h2d"]["kernel_sms"] == 8 and doc["host_reference"] is False
    assert {c["num_sms"] for c in doc["curves"] if c["impl"] == "model.kernel"} == {1, 2, 4, 8, 16}
    assert path.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    assert main(["explain", "--direction", "h2d", "--device", "modelplat:0"]) == 0
    out = capsys.readouterr().out
    assert f"calibration: profile {path} (measured)" in out and "bound with num_sms=8" in out


def test_bench_writes_json_with_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--json", str(out), "--block-bytes", "4096,65536", "--batches", "1,16",
                 "--repeats", "2"]) == 0
    printed = capsys.readouterr()
    assert "HOST MEMORY COPIES" in printed.err and "host memory copies" in printed.out
    # One route without an accelerator: measured and said so, never ranked against itself.
    assert "host.reference is the one route here: nothing to rank it against" in printed.out
    assert "res/best" not in printed.out and "regret" not in printed.out and "under 0.97" not in printed.out
    assert "peer" not in printed.out and "d2h: always cuda.batch" not in printed.out
    assert "h2d: GB/s of host.reference, the one route here (" in printed.out
    result = json.loads(out.read_text())
    assert result["device"]["platform"] == "cpu" and set(result["ceiling_gbps"]) == {"h2d", "d2h"}
    assert len(result["rows"]) == 8 and result["failures"] == []
    for row in result["rows"]:
        assert set(row["candidates"]) == {"host.reference"} and row["best"] == "host.reference"
        assert row["resolved"]["route"] == "host.reference" and row["resolved"]["gbps"] > 0
        got, best = row["resolved"]["gbps"], row["candidates"][row["best"]]["gbps"]
        # GB/s are written to 3 decimals: the ratio of the rounded speeds is off by up to that much
        assert row["resolved_over_best"] == pytest.approx(got / best, rel=1e-3 + 5e-4 / got + 5e-4 / best)
        assert row["peer"] is None and row["resolved_over_peer"] is None  # no triton/cuda: not applicable
    assert not any("peer baseline" in n for n in result["notes"])
    assert result["summary"]["h2d"]["points"] == 4 and result["summary"]["h2d"]["min_resolved_over_peer"] is None
    from kvswap.calibration.bench_records import BenchResult
    from kvswap.calibration.report import bench_report
    assert BenchResult.from_dict(result).to_dict() == result  # tables can be redrawn from the file
    # A contiguous copy that a measurement beats is not called a ceiling.
    top = max(r["resolved"]["gbps"] for r in result["rows"] if r["direction"] == "h2d")
    result["ceiling_gbps"] = {"h2d": top / 2, "d2h": 1e6}
    table = bench_report(BenchResult.from_dict(result))
    assert f"a contiguous copy {top / 2:.1f} GB/s, beaten at {top:.1f}: not a ceiling here" in table
    assert "(contiguous ceiling 1000000.0 GB/s)" in table


@pytest.mark.parametrize("argv, says", [
    (["calibrate", "--directions", "sideways"], "'sideways': choose one or more of h2d, d2h, comma-separated"),
    (["calibrate", "--directions", ","], "choose one or more of h2d, d2h"),
    (["calibrate", "--directions", "h2d,d2d"], "choose one or more of h2d, d2h"),
    (["bench", "--directions", "d2d"], "choose one or more of h2d, d2h"),
    (["calibrate", "--max-sms", "-1"], "must be a whole number >= 0"),
    (["calibrate", "--knee-tolerance", "0.7"], "fraction in [0, 0.5)"),
    (["calibrate", "--plot", "curves.jpg"], "must name a .png"),
    (["calibrate", "--out", "{tmp}"], "is a directory"),
    (["calibrate", "--device", "not a device"], "is not valid"),
    (["calibrate", "--quick", "--bogus"], "unrecognized arguments"),
    (["bench", "--block-bytes", "0"], "must be a whole number >= 1"),
    (["bench", "--batches", "many"], "'many' must be a whole number >= 1"),
    (["bench", "--repeats", "0"], "must be a whole number >= 1"),
    (["bench", "--json", "{tmp}"], "is a directory"),
    (["bench", "--devices", "cpu,cpu", "--directions", "d2d"], "choose one or more of h2d, d2h"),
    (["bench", "--devices", "cpu,cpu", "--json", "{tmp}"], "is a directory"),
    (["bench", "--model", "llama-3.1-8b", "--json", "{tmp}"], "is a directory"),
    (["bench", "--model", "llama-3.1-8b", "--directions", "d2d"], "choose one or more of h2d, d2h"),
    # an output that cannot be written is refused before anything is measured
    (["calibrate", "--quick", "--out", "{file}/p.json"], "cannot be written"),
    (["calibrate", "--quick", "--plot", "{file}/p.png"], "cannot be written"),
    (["bench", "--repeats", "1", "--json", "{file}/b.json"], "cannot be written"),
    (["bench", "--model", "llama-3.1-8b", "--plot", "{file}/s.png"], "cannot be written"),
    # an option the command would ignore is a mistake, not a no-op
    (["calibrate", "--strip", "{file}", "--quick", "--out", "{tmp}/p.json"], "--strip measures nothing"),
    (["bench", "--tp", "2", "--repeats", "1"], "--tp: not used without --model"),
    (["bench", "--dtype", "fp16", "--repeats", "1"], "--dtype: not used without --model"),
    (["bench", "--window", "0.1", "--repeats", "1"], "--window: not used without --devices"),
    (["bench", "--model", "llama-3.1-8b", "--batches", "4"], "--batches: not used by the step benchmark"),
    (["bench", "--render", "{file}", "--model", "llama-3.1-8b"], "--model: not used with --render"),
    (["bench", "--model", ",", "--repeats", "1"], "names no model"),
    (["bench", "--model", "llama-3.1-8b", "--step-ms", "nan"], "positive number of milliseconds"),
    (["bench", "--model", "llama-3.1-8b", "--step-ms", "-5"], "positive number of milliseconds"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, says):
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{file}", str(tmp_path / "file")) for a in argv]
    before = sorted(tmp_path.rglob("*"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert sorted(tmp_path.rglob("*")) == before
    assert not profiles.default_path(cpu_device()).exists()


def test_a_count_that_is_not_bytes_is_not_called_a_byte_count(capsys):
    assert main(["bench", "--batches", "0"]) == 2
    err = capsys.readouterr().err
    assert "--batches" in err and "must be a whole number >= 1" in err and "byte" not in err


def test_calibrate_refuses_a_default_location_it_cannot_write_before_measuring(tmp_path, capsys, monkeypatch):
    (tmp_path / "data").write_text("")  # a user data "directory" that is a file
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert main(["calibrate", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out (default)" in err[0] and "cannot be written" in err[0], err


def test_calibrate_out_naming_a_pipe_is_refused_and_left_a_pipe(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main(["calibrate", "--quick", "--out", str(fifo)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a regular file" in err[0], err
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_a_profile_that_cannot_be_saved_is_one_line_and_status_1(tmp_path, capsys, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "cpu.json"))

    monkeypatch.setattr(store, "save", disk_full)
    assert main(["calibrate", "--quick", "--out", str(tmp_path / "cpu.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvswap: error: ") and "No space left on device" in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_bench_json_that_cannot_be_written_whole_leaves_the_old_file(tmp_path):
    """A write cut short (here by a file size limit, as a full disk or a quota would)
    leaves the file that was there, not a truncated JSON."""
    import resource

    out = tmp_path / "bench.json"
    out.write_text('{"old": true}\n')

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))  # Python ignores SIGXFSZ: writes fail

    run = subprocess.run([sys.executable, "-m", "kvswap", "bench", "--json", str(out), "--block-bytes", "4096,65536",
                          "--batches", "1,16", "--repeats", "2"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ), preexec_fn=small_files)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("kvswap: error: ") and "Traceback" not in run.stderr
    assert out.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


def interrupt_at(monkeypatch, where):
    """Make ``kvswap calibrate`` see Ctrl-C once ``where`` (a store or plot function) is called."""
    from kvswap.calibration import plot

    module = plot if where == "plot_profile" else store

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, where, interrupted)


@pytest.mark.parametrize("where, saved", [
    ("make_document", False),  # measured, nothing written yet
    ("save_measurements", True),  # the profile is in place, its raw rows not
    ("plot_profile", True),
])
def test_an_interrupted_calibrate_says_what_it_saved(tmp_path, capsys, monkeypatch, where, saved):
    out = tmp_path / "cpu.json"
    out.write_text("{\"old\": true}")  # a profile from before: replaced only once the new one is saved
    interrupt_at(monkeypatch, where)
    assert main(["calibrate", "--quick", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    if saved:
        assert f"interrupted after saving the profile for {cpu_device().identity} to {out}" in err
        assert profiles.read(out, cpu_device())["host_reference"] is True
        assert ("also written" in err) == (where == "plot_profile")
        assert store.measurements_path(out).exists() == (where == "plot_profile")
    else:
        assert "nothing was saved" in err and f"{out} is as it was" in err
        assert out.read_text() == "{\"old\": true}"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.json"]
    assert "kvswap: interrupted" not in err  # the command's own word, not the generic one


def test_an_interrupt_while_measuring_saves_nothing(capsys, monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_module.Sweep, "run", interrupted)
    assert main(["calibrate", "--quick"]) == 130
    assert "nothing was saved" in capsys.readouterr().err
    assert not profiles.default_path(cpu_device()).exists()


def test_progress_in_a_log_is_lines_not_a_bar(capsys):
    """stderr that is not a terminal (a log, a pipe, pytest's capture) gets plain lines:
    one at the end at least, never a bar redrawn in place."""
    assert not sys.stderr.isatty()
    assert main(["calibrate", "--quick", "--directions", "h2d"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    done = [line for line in err.splitlines() if re.fullmatch(r"  (\d+)/(\d+) steps( \(.*\))?, \d+ s", line)]
    assert done, err
    n, total = map(int, re.match(r"  (\d+)/(\d+)", done[-1]).groups())
    assert n == total > 1


def test_progress_lines_come_every_so_often_and_at_the_end():
    import io

    from kvswap.calibration.progress import Lines

    now = [0.0]
    out = io.StringIO()
    bar = Lines(10, "step", out, every=5.0, clock=lambda: now[0])
    for i in range(10):
        now[0] = 2.0 * (i + 1)
        bar.set_description(f"point {i}")
        bar.update(1)
    bar.close()
    assert out.getvalue().splitlines() == ["  3/10 steps (point 2), 6 s", "  6/10 steps (point 5), 12 s",
                                           "  9/10 steps (point 8), 18 s", "  10/10 steps (point 9), 20 s"]
