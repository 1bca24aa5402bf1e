"""The conformance kit fails broken backends and passes a correct one.

Throwaway backends live in a fake distribution (a ``.dist-info`` with a ``kvswap.backends``
entry point beside the module, on ``sys.path``), so the kit finds them exactly as it finds
a vendor's installed package. Each broken one gets one thing wrong; the kit is run against
it in-process through ``pytester`` and must fail, naming the tests that caught it. Every
broken write stays inside the guard bytes around a block or inside the test's own buffers,
so running them in this process is safe.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from kvswap import PluginWarning

from fakes import forget_modules, make_distribution

pytest_plugins = ["pytester"]

MODULE = "kvswap_kit_fixtures"

BACKENDS = '''
import ctypes

import numpy as np

from kvswap import CopyImpl, hookimpl

memmove = ctypes.memmove


def good(src, dst, sizes, stream):
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        memmove(d, s, n)


def corrupt_byte(src, dst, sizes, stream):
    good(src, dst, sizes, stream)
    i = len(sizes) // 2
    byte = ctypes.c_ubyte.from_address(int(dst[i]) + int(sizes[i]) // 2)
    byte.value ^= 0x01


def overrun(src, dst, sizes, stream):  # one byte past the end of every block
    good(src, dst, sizes + 1, stream)


def underrun(src, dst, sizes, stream):  # one byte before the start of every block
    good(src - 1, dst - 1, sizes + 1, stream)


def round_down_8(src, dst, sizes, stream):  # a DMA engine that needs 8-byte alignment
    good(src & ~7, dst & ~7, np.maximum(sizes & ~7, 8), stream)


def smallest_size_only(src, dst, sizes, stream):  # as if every block had one size
    good(src, dst, np.full_like(sizes, sizes.min()), stream)


def first_thousand(src, dst, sizes, stream):
    good(src[:1000], dst[:1000], sizes[:1000], stream)


def truncate_64k(src, dst, sizes, stream):
    good(src, dst, np.minimum(sizes, 65536), stream)


def odd_thousand(src, dst, sizes, stream):  # wrong only for large batches of odd sizes
    good(src, dst, sizes, stream)
    odd = np.flatnonzero(sizes % 2)
    if len(sizes) >= 1000 and len(odd):
        i = int(odd[len(odd) // 2])
        byte = ctypes.c_ubyte.from_address(int(dst[i]) + int(sizes[i]) - 1)
        byte.value ^= 0x01


class IgnoresItsAlignment(CopyImpl):
    """Declares 16-byte alignment, then refuses nothing."""

    def refused(self, src, dst, sizes):
        return np.zeros(len(sizes), dtype=bool)


def impl(name, fn, cls=CopyImpl, **kw):
    return cls(f"kit.{name}", "batch", ("cpu",), ("h2d", "d2h"), lambda ctx: fn, **kw)


CONSTRAINED = dict(alignment=8, min_block_bytes=16, max_block_bytes=256 * 1024)
IMPLS = [
    impl("good", good, **CONSTRAINED),
    CopyImpl("kit.good_h2d_only", "batch", ("cpu",), ("h2d",), lambda ctx: good),
    impl("corrupt_byte", corrupt_byte),
    impl("overrun", overrun),
    impl("underrun", underrun),
    impl("undeclared_alignment", round_down_8),
    impl("ignores_alignment", round_down_8, cls=IgnoresItsAlignment, alignment=16),
    impl("mixed_sizes_liar", smallest_size_only),
    impl("drops_descriptors", first_thousand),
    impl("undeclared_max", truncate_64k),
    impl("odd_thousand", odd_thousand),
    impl("bad_availability", good, availability=lambda device: True),
    impl("raising_availability", good, availability=lambda device: {}["driver"]),
    CopyImpl("kit.unavailable_h2d_only", "batch", ("cpu",), ("h2d",), lambda ctx: good,
             availability=lambda device: "needs an Acme card"),
]
WRONG_PLATFORM = impl("wrong_platform", good)


@hookimpl
def kvswap_register_copy_impls(platform, register):
    if platform == "cpu":
        for i in IMPLS:
            register(i)
    if platform in ("cpu", "cuda"):
        register(WRONG_PLATFORM)
'''


@pytest.fixture
def kit_backends(tmp_path, monkeypatch):
    """The throwaway backends, installed as a fake distribution on sys.path."""
    forget_modules(MODULE)
    root = make_distribution(tmp_path / "site", "kvswap-kit-fixtures", {"kitfixtures": MODULE},
                             {MODULE: BACKENDS})
    monkeypatch.syspath_prepend(str(root))
    yield root
    forget_modules(MODULE)


def run_kit(pytester: pytest.Pytester, impl: str, *extra: str) -> pytest.RunResult:
    from kvswap.registry.plugins import reset_plugin_host

    reset_plugin_host()  # the kit loads plugins afresh, as a new process would
    try:
        return pytester.runpytest("-p", "kvswap.testing", "--kvswap-impl", impl, "-p", "no:cacheprovider", *extra)
    finally:
        reset_plugin_host()


def test_correct_backend_with_constraints_is_certified(kit_backends, pytester):
    result = run_kit(pytester, "kit.good", "-v")
    assert result.ret == 0
    outcomes = result.parseoutcomes()
    assert "failed" not in outcomes and outcomes["passed"] >= 40
    # Its declared constraints were exercised: each violation refused with no byte changed.
    for direction in ("h2d", "d2h"):
        for label in ("src-misaligned", "dst-misaligned", "size-misaligned", "below-min", "above-max"):
            result.stdout.fnmatch_lines(
                [f"*test_swapfn_refuses_what_the_impl_declares_it_cannot_copy?{direction}-{label}? PASSED*"])


def test_a_one_direction_backend_is_certified_for_that_direction(kit_backends, pytester):
    result = run_kit(pytester, "kit.good_h2d_only", "-v")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*test_resolve_refuses_directions_not_advertised PASSED*",
                                 "*test_copies_thousands_of_blocks?h2d-default? PASSED*"])
    result.stdout.no_fnmatch_line("*d2h-*")


BROKEN = [
    # (impl, tests that must fail, what the failure message must say: text, or a pattern)
    ("kit.corrupt_byte", ["test_copies_each_size", "test_swapfn_copies_one_block"], "1 byte(s) of the destination differ"),
    ("kit.overrun", ["test_copies_each_size", "test_copies_one_block"], "outside every block"),
    ("kit.underrun", ["test_copies_each_size", "test_copies_one_block"], "outside every block"),
    ("kit.undeclared_alignment", ["test_copies_each_size?h2d-default-3B?"], "of the destination differ"),
    ("kit.ignores_alignment", ["test_refusal_is_what_the_declaration_says",
                               "test_swapfn_refuses_what_the_impl_declares_it_cannot_copy?h2d-src-misaligned?"],
     "refused() disagrees with its declared constraints"),
    ("kit.mixed_sizes_liar", ["test_copies_mixed_sizes_in_one_call", "test_swapfn_copies_mixed_sizes"],
     "of the destination differ"),
    # it copies the first 1000 of 3000: the first wrong block, by destination offset, is any of the others
    ("kit.drops_descriptors", ["test_copies_thousands_of_blocks", "test_swapfn_copies_thousands_from_torch_tensors"],
     re.compile(r"the first is byte \d+ of descriptor [12]\d{3} \(of 3000")),
    ("kit.undeclared_max", ["test_copies_each_size?h2d-default-262144B?"], "of the destination differ"),
    ("kit.odd_thousand", ["test_copies_many_odd_sizes_at_odd_addresses", "test_swapfn_copies_many_odd_sizes"],
     "1 byte(s) of the destination differ"),
    ("kit.bad_availability", ["test_availability_answers_none_or_a_reason"], "must return None or a reason"),
    ("kit.raising_availability", ["test_availability_answers_none_or_a_reason"],
     "availability check raised KeyError: 'driver'; it must return None or a reason, never raise"),
    ("kit.wrong_platform", ["test_registered_only_for_platforms_it_serves"], "registered when kvswap asks for ['cuda']"),
]


@pytest.mark.parametrize("impl,failing,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_backend_fails_the_kit(kit_backends, pytester, impl, failing, message):
    result = run_kit(pytester, impl, "-rf", "--tb=native")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    for name in failing:
        result.stdout.fnmatch_lines([f"FAILED kvswap/testing/conformance.py::{name}*"])
    out = result.stdout.str()
    assert message.search(out) if isinstance(message, re.Pattern) else message in out


def test_unknown_impl_is_a_usage_error_that_lists_the_registered_ones(kit_backends, pytester):
    result = run_kit(pytester, "kit.nonexistent")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvswap-impl='kit.nonexistent' is not a registered implementation for "
                                 "platform 'cpu'*registered for cpu: host.reference, kit.bad_availability*"])


def test_impl_of_another_platform_names_where_it_is_registered(kit_backends, pytester):
    result = run_kit(pytester, "kit.wrong_platform", "--kvswap-device", "cpu", "-q")
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # registered for cpu too: it runs, and is caught
    source = BACKENDS.replace('if platform in ("cpu", "cuda")', 'if platform == "cuda"')
    (kit_backends / f"{MODULE}.py").write_text(textwrap.dedent(source))
    forget_modules(MODULE)
    result = run_kit(pytester, "kit.wrong_platform")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*it is registered for cuda: pass --kvswap-device for such a device*"])


def test_kit_runs_its_own_suite_in_any_directory_and_never_loads_unasked(tmp_path):
    """A real process in an empty directory: the kit needs no test files of the caller;
    a plain pytest run there does not know the kit's options (no ``pytest11`` entry point)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSWAP_")}
    (tmp_path / "test_callers_own.py").write_text("def test_callers_own():\n    assert False\n")
    kit = subprocess.run([sys.executable, "-m", "pytest", "-p", "kvswap.testing", "--kvswap-impl",
                          "host.reference", "-q", "-p", "no:cacheprovider"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert kit.returncode == 0, kit.stdout + kit.stderr
    assert "test_callers_own" not in kit.stdout and " passed" in kit.stdout
    with_paths = subprocess.run([sys.executable, "-m", "pytest", "-p", "kvswap.testing", "--kvswap-impl",
                                 "host.reference", "test_callers_own.py", "-p", "no:cacheprovider"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert with_paths.returncode == pytest.ExitCode.USAGE_ERROR
    assert "runs the kit's own suite; drop the paths" in with_paths.stderr
    plain = subprocess.run([sys.executable, "-m", "pytest", "--kvswap-impl", "host.reference",
                            "-p", "no:cacheprovider"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == pytest.ExitCode.USAGE_ERROR
    assert "unrecognized arguments: --kvswap-impl" in plain.stderr
    import importlib.metadata

    loaded_by_default = [ep.value for ep in importlib.metadata.entry_points(group="pytest11")]
    assert not any(v.startswith("kvswap") for v in loaded_by_default)


def test_a_failure_replays_with_the_seed_it_printed(kit_backends, pytester):
    args = ("-k", "test_copies_one_block and h2d", "--tb=line")
    first = run_kit(pytester, "kit.corrupt_byte", *args)
    (seed,) = set(re.findall(r"seed (\d+)\]", first.stdout.str()))
    again = run_kit(pytester, "kit.corrupt_byte", "--kvswap-seed", seed, *args)
    where = r"the first is (.*?) \["
    assert re.findall(where, again.stdout.str()) == re.findall(where, first.stdout.str()) != []


def test_an_unavailable_impl_has_its_checks_skipped_not_failed(kit_backends, pytester):
    """Unavailable for a reason of its own, it is refused for that reason before its
    direction is looked at: the direction check skips, as the copy checks do."""
    result = run_kit(pytester, "kit.unavailable_h2d_only", "-v", "-rs")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*test_resolve_refuses_directions_not_advertised SKIPPED*"])
    assert "failed" not in result.parseoutcomes() and "needs an Acme card" in result.stdout.str()


@pytest.fixture
def vendor_plugin(tmp_path, monkeypatch):
    """Install one throwaway plugin ``kvswap-vendor`` (entry point ``vendor``) from source."""
    module = "kvswap_kit_vendor"

    def install(source: str) -> None:
        forget_modules(module)
        root = make_distribution(tmp_path / "vendor", "kvswap-vendor", {"vendor": module}, {module: source})
        monkeypatch.syspath_prepend(str(root))

    yield install
    forget_modules(module)


def vendor_with(hook: str) -> str:
    """A plugin that registers the good ``kit.vendor`` on the CPU, plus ``hook`` (source)."""
    return BACKENDS.split("@hookimpl")[0] + '''
@hookimpl
def kvswap_register_copy_impls(platform, register):
    if platform == "cpu":
        register(impl("vendor", good))

''' + hook


VENDOR = vendor_with('''
@hookimpl
def kvswap_register_calibrations(device, register):
    raise RuntimeError("calibration table missing")
''')


def test_a_plugin_dropped_by_another_of_its_hooks_fails_the_kit_naming_the_hook(vendor_plugin, pytester):
    """Its copy impl registers fine, but its calibration hook raises: the first resolve drops
    the whole plugin, so an engine would lose the impl. The kit says so, naming the hook,
    and the checks after it say why the impl is gone instead of 'not registered'."""
    vendor_plugin(VENDOR)
    result = run_kit(pytester, "kit.vendor", "-rfE", "--tb=line")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["FAILED kvswap/testing/conformance.py::test_plugin_stays_loaded_through_a_resolve*"])
    out = result.stdout.str()
    assert "plugin 'vendor' was dropped, so kvswap no longer offers kit.vendor: kvswap_register_calibrations " \
           "raised RuntimeError: calibration table missing" in out
    assert "is not registered" not in out


@pytest.mark.parametrize("source, why, device", [
    ("raise SystemExit('acme SDK: no device found')\n",
     "failed to import kvswap_kit_vendor: SystemExit: acme SDK: no device found", "acme"),
    ("raise SystemExit('acme SDK: no device found')\n",
     "failed to import kvswap_kit_vendor: SystemExit: acme SDK: no device found", None),
    (BACKENDS.split("@hookimpl")[0] + "\n@hookimpl\ndef kvswap_register_copy_impls(platform, register):\n"
     "    register(impl('vendor', good, alignment=8, min_block_bytes=9, max_block_bytes=15))\n",
     "CopyImpl 'kit.vendor': accepts no block size", None),
], ids=["exits-at-import-device-unknown", "exits-at-import-impl-unknown", "accepts-no-size"])
def test_a_plugin_that_cannot_load_is_a_usage_error_naming_it(vendor_plugin, pytester, source, why, device):
    """Whether the device or the impl is what cannot be found, the message says which
    plugin failed to load and why (a plugin calling sys.exit() is no INTERNALERROR)."""
    vendor_plugin(source)
    with pytest.warns(PluginWarning, match="'vendor' .*dropped"):
        result = run_kit(pytester, "kit.vendor", *(["--kvswap-device", device] if device else []))
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines([f"*plugins not loaded: vendor (failed: *{why}*"])


def test_the_kit_without_an_impl_is_a_usage_error_that_lists_the_registered_ones(tmp_path):
    """Loaded on request without --kvswap-impl, in a folder of unrelated files, the kit
    collects nothing there: it says what to pass, naming the implementations registered."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSWAP_")}
    (tmp_path / "unrelated").mkdir()
    (tmp_path / "unrelated" / "test_other.py").write_text("import no_such_module\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "kvswap.testing", "-p", "no:cacheprovider"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "the kvswap conformance kit needs --kvswap-impl NAME: registered for cpu device" in out.stderr
    assert "host.reference" in out.stderr and "no_such_module" not in out.stdout + out.stderr


STREAM_HOOK = vendor_with('''
@hookimpl
def kvswap_create_stream(platform, device_index):
    raise RuntimeError("the vendor SDK has no streams")
''')


def test_a_stream_hook_that_raises_fails_the_kit(vendor_plugin, pytester):
    """On an accelerator kvswap asks for a stream of its own and drops a plugin whose hook
    raises: the kit asks too, on any device, and fails naming the hook."""
    vendor_plugin(STREAM_HOOK)
    result = run_kit(pytester, "kit.vendor", "-rfE", "--tb=line")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["FAILED kvswap/testing/conformance.py::test_stream_hook_answers_a_handle_or_none*"])
    assert "kvswap_create_stream raised RuntimeError: the vendor SDK has no streams" in result.stdout.str()
    vendor_plugin(STREAM_HOOK.replace('raise RuntimeError("the vendor SDK has no streams")', "return 'stream 0'"))
    result = run_kit(pytester, "kit.vendor", "-rfE", "--tb=short")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "vendor's kvswap_create_stream returned 'stream 0': it must return None or a stream handle" in \
        result.stdout.str()
