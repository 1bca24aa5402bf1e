"""The ``kvswap`` command as a person (or a script) uses it, in fresh processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fakes import COPYING_PLUGIN, make_distribution

BROKEN = "raise RuntimeError('acme firmware missing')\n"
ACME = COPYING_PLUGIN.format(name="acme")


def kvswap(*args, env=None, code=None):
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "kvswap", *args]
    full = dict(os.environ, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=120)


@pytest.fixture
def third_party(tmp_path):
    root = make_distribution(tmp_path / "site", "kvswap-acme", {"acme": "kvswap_acme", "fragile": "kvswap_fragile"},
                             {"kvswap_acme": ACME, "kvswap_fragile": BROKEN}, version="2.5")
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def test_info_json_lists_reference_available_and_gpu_impls_with_reasons():
    out = kvswap("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)  # stdout carries only the JSON
    assert info["platform"] == "cpu" and info["device"]["platform"] == "cpu"
    impls = {i["name"]: i for i in info["impls"]}
    assert impls["host.reference"]["available"] is True and impls["host.reference"]["reason"] is None
    assert set(impls["host.reference"]) >= {"name", "kind", "directions", "available", "reason"}
    for gpu in ("cuda.batch", "rocm.batch"):
        assert impls[gpu]["available"] is False and impls[gpu]["reason"], impls[gpu]
    for p in info["plugins"]:
        assert {"name", "distribution", "version"} <= set(p)
    assert {p["name"] for p in info["plugins"]} >= {"host", "cuda", "rocm", "triton"}


def test_info_text_names_plugins_and_reasons():
    out = kvswap("info")
    assert out.returncode == 0, out.stderr
    assert "host.reference" in out.stdout and "unavailable:" in out.stdout and "plugins:" in out.stdout


def test_third_party_plugin_is_discovered_forced_and_blocked(third_party):
    info = json.loads(kvswap("info", "--json", env=third_party).stdout)
    acme = next(p for p in info["plugins"] if p["name"] == "acme")
    assert (acme["distribution"], acme["version"], acme["status"]) == ("kvswap-acme", "2.5", "loaded")
    assert any(i["name"] == "acme.copy" and i["available"] for i in info["impls"])

    out = kvswap("explain", "--direction", "h2d", "--force", "acme.copy", env=third_party)
    assert out.returncode == 0, out.stderr
    assert "-> acme.copy" in out.stdout

    blocked = dict(third_party, KVSWAP_DISABLE_PLUGINS="acme")
    out = kvswap("explain", "--direction", "h2d", "--force", "acme.copy", env=blocked)
    assert out.returncode == 2 and "'acme.copy' is not registered" in out.stderr  # a usage error of --force
    info = json.loads(kvswap("info", "--json", env=blocked).stdout)
    assert next(p for p in info["plugins"] if p["name"] == "acme")["status"] == "disabled"


def test_plugin_raising_on_import_leaves_info_and_resolve_working(third_party):
    out = kvswap("info", "--json", env=third_party)
    assert out.returncode == 0
    json.loads(out.stdout)
    assert "kvswap: warning: plugin 'fragile' (from kvswap-acme 2.5) dropped" in out.stderr
    assert "acme firmware missing" in out.stderr
    code = (
        "import numpy as np, kvswap\n"
        "src = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)\n"
        "dst = np.zeros(4096, dtype=np.uint8) + 7\n"
        "fn = kvswap.resolve('h2d')\n"
        "fn([src.ctypes.data], [dst.ctypes.data + 8], [100])\n"
        "assert (dst[8:108] == src[:100]).all() and (dst[:8] == 7).all() and (dst[108:] == 7).all()\n"
        "print(fn.explain())\n"
    )
    out = kvswap(code=code, env=third_party)
    assert out.returncode == 0, out.stderr
    assert "fragile" in out.stderr and "host.reference" in out.stdout


def test_explain_json_and_block_bytes():
    out = kvswap("explain", "--direction", "d2h", "--block-bytes", "8192,16384", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["direction"] == "d2h" and plan["device"]["platform"] == "cpu"
    assert plan["routes"][0]["impl"] == "host.reference"


@pytest.mark.parametrize(
    "args, fragment",
    [
        ([], "required"),
        (["explain"], "--direction"),
        (["explain", "--direction", "sideways"], "direction='sideways' is not valid"),
        (["explain", "--direction", "h2d", "--block-bytes", "8k"], "'8k' must be a whole number >= 1"),
        (["explain", "--direction", "h2d", "--max-sms", "-1"], "must be a whole number >= 0"),
        (["explain", "--direction", "h2d", "--device", "gpu#1"], "device='gpu#1' is not valid"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, fragment):
    out = kvswap(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("argv", [
    ["explain", "--direction", "h2d", "--device", "cuda:99"],
    ["info", "--device", "cuda:99"],
    ["bench", "--device", "cuda:99", "--repeats", "1"],
    ["bench", "--model", "llama-3.1-8b", "--device", "cuda:99"],
    ["calibrate", "--quick", "--device", "cuda:99"],
], ids=["explain", "info", "bench", "bench-model", "calibrate"])
def test_a_device_that_is_not_here_exits_3_from_every_command(argv, capsys):
    """One kind of failure, one status: a device that is not on this machine (no GPU, or no
    99th) is 3 whichever command asks for it, as --help says (bench --devices:
    tests/test_multi_bench.py)."""
    from kvswap.cli import main

    assert main(argv) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvswap: error: device='cuda:99'"), err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU machine bench --model runs")
def test_bench_model_without_a_gpu_exits_3_as_a_missing_device_does(capsys):
    from kvswap.cli import main

    assert main(["bench", "--model", "llama-3.1-8b"]) == 3
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["explain", "--direction", "h2d"], ["explain", "--directions", "h2d"],
    ["bench", "--direction", "h2d"], ["bench", "--directions", "h2d"],
    ["calibrate", "--direction", "h2d"], ["calibrate", "--directions", "h2d"],
])
def test_every_command_takes_both_spellings_of_the_direction_option(argv):
    from kvswap.cli import build_parser

    args = build_parser().parse_args(argv)
    chosen = getattr(args, "directions", None) or [args.direction]
    assert [str(d) for d in chosen] == ["h2d"]


@pytest.mark.parametrize("argv", [
    ["explain", "--direction", "sideways"],  # argparse's own error, in a subcommand
    ["explain", "--direction", "h2d", "--device", "gpu#1"],  # kvswap's ConfigurationError
    ["calibrate", "--directions", "d2d"],
    ["bench", "--block-bytes", "0"],
    ["frobnicate"],
])
def test_every_error_line_has_one_prefix(argv, capsys):
    from kvswap.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvswap: error: "), err


def test_calibrate_directions_lists_only_what_it_takes(capsys):
    from kvswap.cli import main

    assert main(["calibrate", "--directions", "sideways"]) == 2
    err = capsys.readouterr().err
    assert "choose one or more of h2d, d2h" in err and "d2d" not in err
    out = kvswap("calibrate", "--help")
    assert "h2d,d2h" in out.stdout and "d2d" not in out.stdout


def test_help_explains_each_command():
    out = kvswap("--help")
    assert out.returncode == 0
    for cmd in ("info", "explain"):
        assert cmd in out.stdout
    out = kvswap("explain", "--help")
    assert "--block-bytes" in out.stdout and "--max-sms" in out.stdout


def test_help_names_the_environment_switches_and_exit_statuses():
    out = kvswap("--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for switch in ("KVSWAP_FORCE_IMPL", "KVSWAP_PROFILE", "KVSWAP_PLUGINS", "KVSWAP_DISABLE_PLUGINS"):
        assert switch in text, switch
    assert "Exit status: 0 done; 1 the work failed; 2 a usage error" in text
    assert "3 no such device here (no GPU, or fewer than the index named)" in text


def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "kvswap")
    out = subprocess.run([exe, "info", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["platform"] == "cpu"


def test_version_exits_0_and_names_the_package_version():
    from kvswap import __version__

    out = kvswap("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvswap {__version__}"


def test_forced_implementation_that_cannot_be_honoured_is_a_usage_error():
    out = kvswap("explain", "--direction", "h2d", "--force", "nosuch")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "--force" in out.stderr and "'nosuch' is not registered" in out.stderr
    assert "host.reference" in out.stderr  # what is usable instead
    out = kvswap("explain", "--direction", "d2h", env={"KVSWAP_FORCE_IMPL": "nosuch"})
    assert out.returncode == 2 and "KVSWAP_FORCE_IMPL='nosuch'" in out.stderr


@pytest.mark.parametrize("args", [["info"], ["info", "--json"], ["explain", "--direction", "h2d"], ["--help"]])
def test_closed_pipe_ends_quietly(args):
    cmd = [sys.executable, "-m", "kvswap", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the command writes, as `| head` leaves it
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert proc.returncode in (0, 141), (proc.returncode, err)


def test_closed_pipe_after_first_line_in_a_shell():
    out = subprocess.run(f"{sys.executable} -m kvswap info | head -1", shell=True, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("\n") == 1
    assert out.stderr == "", out.stderr


@pytest.mark.parametrize("command", [["info"], ["explain", "--direction", "h2d"]])
def test_unknown_device_string_is_named_as_not_recognised(command):
    out = kvswap(*command, "--device", "nosuch")
    assert out.returncode == 2
    assert "device='nosuch' is not recognised" in out.stderr and "torch sees" not in out.stderr


BLOCK_IMPORT = (
    "import sys, importlib.abc\n"
    "class Block(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'kvswap.calibration.cli_calibrate':\n"
    "            raise ImportError('matplotlib went missing')\n"
    "sys.meta_path.insert(0, Block())\n"
    "from kvswap.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_optional_command_that_cannot_load_is_listed_and_says_why():
    run = lambda *args: subprocess.run([sys.executable, "-c", BLOCK_IMPORT, *args], capture_output=True,
                                       text=True, timeout=120)
    out = run("--help")
    assert out.returncode == 0 and "calibrate" in out.stdout and "unavailable" in out.stdout
    assert "bench" in out.stdout
    out = run("calibrate", "--quick", "--device", "cpu")
    assert out.returncode == 1
    assert "kvswap calibrate is unavailable" in out.stderr and "matplotlib went missing" in out.stderr
    assert "Traceback" not in out.stderr
    out = run("info", "--json")  # the rest of the CLI is untouched
    assert out.returncode == 0 and json.loads(out.stdout)["platform"] == "cpu"


def test_every_command_is_listed_in_help():
    out = kvswap("--help")
    for cmd in ("info", "explain", "calibrate", "bench"):
        assert cmd in out.stdout


def test_explain_takes_every_direction():
    out = kvswap("explain", "--direction", "d2d", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["direction"] == "d2d"
    assert "d2d" in kvswap("explain", "--help").stdout
