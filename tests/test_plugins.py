"""The plugin host: entry points, allow and block lists, broken plugins isolated and named."""
from __future__ import annotations

import importlib.metadata
import re
import sys
import warnings

import numpy as np
import pytest

import kvswap
from kvswap import CopyImpl, PluginWarning, Policy, hookimpl
from kvswap.registry.plugins import create_plugin_host, plugin_host, reset_plugin_host
from kvswap.registry.reference import host_copy

from fakes import COPYING_PLUGIN, entry_points_from, forget_modules, make_distribution

GOOD = COPYING_PLUGIN


def dist(tmp_path, name, source=None, module=None):
    module = module or f"kvswap_{name}_{tmp_path.name}"
    forget_modules(module)
    root = make_distribution(tmp_path / name, f"kvswap-{name}", {name: module},
                             {module: source if source is not None else GOOD.format(name=name)})
    sys.path.insert(0, str(root))
    return root


@pytest.fixture(autouse=True)
def _restore_sys_path():
    saved = list(sys.path)
    yield
    sys.path[:] = saved


def test_third_party_distribution_is_discovered_with_its_name_and_version(tmp_path):
    root = dist(tmp_path, "acme")
    host = create_plugin_host(entry_points=entry_points_from(root), env={})
    rec = host.records["acme"]
    assert (rec.status, rec.distribution, rec.version) == ("loaded", "kvswap-acme", "1.0")
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.copy"))
    assert fn.impls == ("acme.copy",)


def test_allow_list_keeps_only_named_plugins_and_warns_about_unknown_names(tmp_path):
    a, b = dist(tmp_path, "alpha"), dist(tmp_path, "beta")
    eps = entry_points_from(a) + entry_points_from(b)
    with pytest.warns(PluginWarning, match="'gamma' .*KVSWAP_PLUGINS but is not installed"):
        host = create_plugin_host(entry_points=eps, env={"KVSWAP_PLUGINS": "alpha, gamma"})
    assert host.records["alpha"].status == "loaded"
    assert host.records["beta"].status == "disabled" and "KVSWAP_PLUGINS" in host.records["beta"].reason
    assert host.pm.get_plugin("beta") is None
    assert host.records["host"].status == "loaded"  # the built-in reference is always there


def test_block_list_disables_a_plugin(tmp_path):
    a = dist(tmp_path, "alpha")
    host = create_plugin_host(entry_points=entry_points_from(a), env={"KVSWAP_DISABLE_PLUGINS": "alpha"})
    assert host.records["alpha"].status == "disabled"
    with pytest.raises(kvswap.ResolutionError, match="not registered"):
        kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="alpha.copy"))


def test_plugin_that_fails_to_import_is_named_and_others_keep_working(tmp_path):
    bad = dist(tmp_path, "broken", source="raise ImportError('needs libacme.so')\n")
    good = dist(tmp_path, "alpha")
    with pytest.warns(PluginWarning, match=r"'broken' \(from kvswap-broken 1.0\) dropped: failed to import .*needs libacme.so"):
        host = create_plugin_host(entry_points=entry_points_from(bad) + entry_points_from(good), env={})
    assert host.records["broken"].status == "failed"
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="alpha.copy"))
    assert fn.impls == ("alpha.copy",)


def test_plugin_raising_inside_a_hook_is_dropped_once_with_its_name(tmp_path):
    src = """
        from kvswap import hookimpl

        @hookimpl
        def kvswap_register_copy_impls(platform, register):
            raise KeyError("acme table missing")
    """
    host = create_plugin_host(entry_points=entry_points_from(dist(tmp_path, "raiser", src)), env={})
    with pytest.warns(PluginWarning, match="'raiser' .*dropped: kvswap_register_copy_impls raised KeyError"):
        fn = kvswap.resolve("h2d", device="cpu", host=host)
    assert fn.impls == ("host.reference",)
    assert host.records["raiser"].status == "failed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvswap.resolve("h2d", device="cpu", host=host)  # dropped: no second warning


def test_plugin_registering_something_invalid_is_dropped(tmp_path):
    src = """
        from kvswap import hookimpl

        @hookimpl
        def kvswap_register_copy_impls(platform, register):
            register("cuda.batch")
    """
    host = create_plugin_host(entry_points=entry_points_from(dist(tmp_path, "sloppy", src)), env={})
    with pytest.warns(PluginWarning, match="'sloppy' .*registered 'cuda.batch', which is not a CopyImpl"):
        assert kvswap.resolve("d2h", device="cpu", host=host).impls == ("host.reference",)


def test_plugin_constructing_an_invalid_copyimpl_is_dropped_naming_the_impl(tmp_path):
    src = """
        from kvswap import CopyImpl, hookimpl

        @hookimpl
        def kvswap_register_copy_impls(platform, register):
            register(CopyImpl("acme.bad", "dma", ("cpu",), ("h2d",), lambda ctx: None))
    """
    host = create_plugin_host(entry_points=entry_points_from(dist(tmp_path, "incoherent", src)), env={})
    with pytest.warns(PluginWarning, match="'incoherent' .*CopyImpl 'acme.bad': kind='dma' is not valid"):
        kvswap.resolve("h2d", device="cpu", host=host)


def test_misspelt_hook_is_caught_by_check_pending(tmp_path):
    src = """
        from kvswap import hookimpl

        @hookimpl
        def kvswap_register_copy_impl(platform, register):
            pass
    """
    with pytest.warns(PluginWarning, match="'typo' .*unknown hook"):
        host = create_plugin_host(entry_points=entry_points_from(dist(tmp_path, "typo", src)), env={})
    assert host.records["typo"].status == "failed"
    assert host.pm.get_plugin("typo") is None


def test_hookimpl_with_wrong_arguments_is_refused_at_registration(tmp_path):
    src = """
        from kvswap import hookimpl

        @hookimpl
        def kvswap_register_copy_impls(platform, register, gpu):
            pass
    """
    with pytest.warns(PluginWarning, match="'wrongargs' .*cannot be registered"):
        host = create_plugin_host(entry_points=entry_points_from(dist(tmp_path, "wrongargs", src)), env={})
    assert host.records["wrongargs"].status == "failed"


def test_same_impl_name_from_two_plugins_keeps_the_first_by_plugin_name(tmp_path):
    a = dist(tmp_path, "alpha", GOOD.format(name="shared"))
    b = dist(tmp_path, "beta", GOOD.format(name="shared"))
    host = create_plugin_host(entry_points=entry_points_from(b) + entry_points_from(a), env={})
    with pytest.warns(PluginWarning, match="'beta' .*registers 'shared.copy', already registered by 'alpha'"):
        fn = kvswap.resolve("h2d", device="cpu", host=host)
    assert next(c for c in fn.plan.candidates if c.name == "shared.copy").plugin == "alpha"


def test_process_host_is_created_once_and_can_be_reset():
    first = plugin_host()
    assert plugin_host() is first
    reset_plugin_host()
    assert plugin_host() is not first


def test_in_tree_backends_load_through_entry_points():
    host = plugin_host()
    for name in ("cuda", "rocm", "triton"):
        rec = host.records[name]
        assert rec.status == "loaded", rec
        assert rec.distribution == "kvswap" and rec.module.startswith("kvswap.backends.")


# -- broken or misused plugins: each is dropped or warned about by name; the others work ----
def copy_through(fn, rng):
    """Copy 5 scattered blocks of random data through ``fn``; True when every byte of the
    destination holds what it must (the copied blocks, and the untouched poison elsewhere)."""
    B = 512
    src, dst = rng.integers(0, 256, 8 * B, dtype=np.uint8), rng.integers(0, 256, 8 * B, dtype=np.uint8)
    want = dst.copy()
    s, d = rng.permutation(8)[:5], rng.permutation(8)[:5]
    for i, j in zip(s, d):
        want[j * B:(j + 1) * B] = src[i * B:(i + 1) * B]
    fn(src.ctypes.data + s * B, dst.ctypes.data + d * B, np.full(5, B))
    return bool(np.array_equal(dst, want))


@pytest.mark.parametrize("source, shown", [
    ("raise SystemExit('acme SDK: no device found')\n", "SystemExit: acme SDK: no device found"),
    ("class Boom(BaseException):\n    pass\nraise Boom('not an Exception')\n", "Boom: not an Exception"),
    ("import pytest\npytest.skip('no libacme', allow_module_level=True)\n", "Skipped: no libacme"),
    ("class Odd(Exception):\n    def __str__(self):\n        raise ValueError\nraise Odd()\n",
     "Odd: (its message cannot be shown"),
], ids=["sys-exit", "base-exception", "pytest-skip", "unprintable"])
def test_plugin_exiting_or_raising_any_exception_at_import_is_dropped_by_name(tmp_path, source, shown):
    bad, good = dist(tmp_path, "broken", source), dist(tmp_path, "alpha")
    with pytest.warns(PluginWarning, match=r"'broken' \(from kvswap-broken 1.0\) dropped: failed to import"):
        host = create_plugin_host(entry_points=entry_points_from(bad) + entry_points_from(good), env={})
    assert host.records["broken"].status == "failed" and shown in host.records["broken"].reason
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="alpha.copy"))
    assert copy_through(fn, np.random.default_rng())


def test_the_users_interrupt_during_a_plugin_import_is_not_swallowed(tmp_path):
    bad = dist(tmp_path, "slow", "raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        create_plugin_host(entry_points=entry_points_from(bad), env={})


def test_hook_calling_sys_exit_drops_only_that_plugin(tmp_path):
    src = """
        import sys
        from kvswap import hookimpl

        @hookimpl
        def kvswap_register_copy_impls(platform, register):
            sys.exit("acme: no device")
    """
    host = create_plugin_host(entry_points=entry_points_from(dist(tmp_path, "quitter", src)), env={})
    with pytest.warns(PluginWarning, match="'quitter' .*dropped: kvswap_register_copy_impls raised SystemExit: acme"):
        fn = kvswap.resolve("d2h", device="cpu", host=host)
    assert fn.impls == ("host.reference",) and host.records["quitter"].status == "failed"


@pytest.mark.parametrize("source, why", [
    ("""
        from kvswap import CopyImpl, hookimpl
        from kvswap.registry.reference import host_copy

        @hookimpl
        def kvswap_register_copy_impls(platform, register):
            yield CopyImpl("gen.copy", "batch", ("cpu",), ("h2d",), lambda ctx: host_copy)
     """, "writes kvswap_register_copy_impls as a generator, so its body would never run"),
    ("""
        from kvswap import hookimpl

        @hookimpl(wrapper=True)
        def kvswap_register_copy_impls(platform, register):
            return (yield)
     """, "marks kvswap_register_copy_impls as a hook wrapper"),
    ("""
        from kvswap import hookimpl

        @hookimpl(hookwrapper=True)
        def kvswap_detect_platform(device):
            yield
     """, "marks kvswap_detect_platform as a hook wrapper"),
], ids=["generator", "wrapper", "old-style-hookwrapper"])
def test_hook_kvswap_cannot_call_is_refused_at_registration(tmp_path, source, why):
    """pluggy accepts these, but kvswap calls each plugin's hook on its own: a generator's
    body would never run and a wrapper has nothing to wrap, so the plugin would be
    'loaded' while doing nothing."""
    with pytest.warns(PluginWarning, match=f"'odd' .*dropped: {why}"):
        host = create_plugin_host(entry_points=entry_points_from(dist(tmp_path, "odd", source)), env={})
    assert host.records["odd"].status == "failed" and host.pm.get_plugin("odd") is None


def test_register_hook_that_returns_its_impls_instead_of_registering_them_is_named(tmp_path):
    src = """
        from kvswap import CopyImpl, hookimpl
        from kvswap.registry.reference import host_copy

        @hookimpl
        def kvswap_register_copy_impls(platform, register):
            return [CopyImpl("ret.copy", "batch", ("cpu",), ("h2d",), lambda ctx: host_copy)]
    """
    host = create_plugin_host(entry_points=entry_points_from(dist(tmp_path, "returner", src)), env={})
    with pytest.warns(PluginWarning, match=r"'returner' .*returned a list from kvswap_register_copy_impls, "
                                           r"which kvswap ignores; offer each CopyImpl by calling register"):
        assert kvswap.resolve("h2d", device="cpu", host=host).impls == ("host.reference",)


@pytest.mark.parametrize("source, target, why", [
    (GOOD.format(name="plain").replace("    @hookimpl\n", ""), None,
     "implements no kvswap hook; these functions need the @kvswap.hookimpl marker: kvswap_register_copy_impls"),
    ("import pluggy\nhookimpl = pluggy.HookimplMarker('acme')\n\n@hookimpl\n"
     "def kvswap_register_copy_impls(platform, register):\n    pass\n", None,
     "implements no kvswap hook; these functions need the @kvswap.hookimpl marker"),
    ("PLUGIN = None\n", "PLUGIN", "dropped: is None, not a module or object holding hooks"),
], ids=["unmarked", "another-projects-marker", "entry-point-to-none"])
def test_plugin_that_offers_no_hook_is_named_not_silently_loaded(tmp_path, source, target, why):
    module = f"kvswap_nohooks_{tmp_path.name}"
    forget_modules(module)
    root = make_distribution(tmp_path / "nohooks", "kvswap-nohooks",
                             {"nohooks": f"{module}:{target}" if target else module}, {module: source})
    sys.path.insert(0, str(root))
    with pytest.warns(PluginWarning, match=rf"'nohooks' \(from kvswap-nohooks 1.0\) {re.escape(why)}"):
        host = create_plugin_host(entry_points=entry_points_from(root), env={})
    assert why.split("dropped: ")[-1] in host.records["nohooks"].reason  # kvswap info shows it


def test_one_plugin_registering_a_name_twice_is_warned_and_keeps_the_first(tmp_path):
    again = '\n            register(CopyImpl("twice.copy", "batch", ("cpu",), ("d2d",), lambda ctx: None))'
    first = '("h2d", "d2h"), lambda ctx: _copy))'
    src = GOOD.format(name="twice").replace(first, first + again)
    host = create_plugin_host(entry_points=entry_points_from(dist(tmp_path, "twice", src)), env={})
    with pytest.warns(PluginWarning, match="'twice' .*registers 'twice.copy' twice for platform 'cpu'; the second was"):
        fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="twice.copy"))
    assert copy_through(fn, np.random.default_rng())


def test_a_second_entry_point_of_a_name_names_its_distribution_and_kvswaps_own_keep_theirs(tmp_path):
    one = make_distribution(tmp_path / "one", "kvswap-acme-one", {"acme": "kvswap_acme_one"},
                            {"kvswap_acme_one": GOOD.format(name="one")})
    two = make_distribution(tmp_path / "two", "kvswap-acme-two", {"acme": "kvswap_acme_two", "host": "kvswap_acme_two"},
                            {"kvswap_acme_two": GOOD.format(name="two")})
    sys.path[:0] = [str(one), str(two)]
    with pytest.warns(PluginWarning) as caught:
        host = create_plugin_host(entry_points=entry_points_from(one) + entry_points_from(two), env={})
    said = [str(w.message) for w in caught]
    assert any("'acme' (from kvswap-acme-one 1.0) has a second entry point, kvswap_acme_two from kvswap-acme-two 1.0"
               in m for m in said), said
    assert any("'host' (from kvswap 0.1.0) has a second entry point, kvswap_acme_two from kvswap-acme-two 1.0"
               in m for m in said), said
    own = importlib.metadata.entry_points(group="kvswap.backends", name="cuda")
    impostor = make_distribution(tmp_path / "imp", "aaa-impostor", {"cuda": "kvswap_impostor"},
                                 {"kvswap_impostor": GOOD.format(name="impostor")})
    sys.path.insert(0, str(impostor))
    with pytest.warns(PluginWarning, match="'cuda' .*second entry point, kvswap_impostor from aaa-impostor"):
        host = create_plugin_host(entry_points=entry_points_from(impostor) + list(own), env={})
    assert host.records["cuda"].distribution == "kvswap"  # not decided by discovery order


def test_a_test_plugin_reusing_a_name_keeps_the_first_ones_record():
    class Other:
        pass

    with pytest.warns(PluginWarning, match="'host' .*is the name of a second plugin"):
        host = create_plugin_host(entry_points=[], env={}, extra=[("host", Other())])
    assert host.records["host"].status == "loaded" and host.records["host"].module == "kvswap.registry.reference"


@pytest.mark.parametrize("value", ["", " ", ",", " , ", ",,"])
def test_a_plugin_switch_naming_no_plugin_is_as_if_unset(tmp_path, value):
    a = dist(tmp_path, "alpha")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host = create_plugin_host(entry_points=entry_points_from(a), env={"KVSWAP_PLUGINS": value,
                                                                          "KVSWAP_DISABLE_PLUGINS": value})
    assert host.records["alpha"].status == "loaded"


@pytest.mark.parametrize("answer", ["", "   ", SystemExit("acme: no device"), 0])
def test_availability_that_gives_no_reason_or_exits_counts_as_unavailable_saying_so(answer):
    from kvswap.registry.platform import cpu_device

    def availability(device):
        if isinstance(answer, BaseException):
            raise answer
        return answer

    impl = CopyImpl("acme.copy", "batch", ("cpu",), ("h2d",), lambda ctx: host_copy, availability=availability)
    reason = impl.unavailable_reason(cpu_device())
    assert reason and reason.strip() and reason.startswith("availability check"), reason
    assert "SystemExit: acme: no device" in reason if isinstance(answer, BaseException) else repr(answer) in reason


@pytest.mark.parametrize("field, value, message", [
    ("requires_pinned", "no", "requires_pinned='no' must be True or False"),
    ("mixed_sizes", None, "mixed_sizes=None must be True or False"),
    ("description", None, "description=None must be a str"),
    ("alignment", True, "alignment=True must be a power of two"),
    ("min_block_bytes", True, "min_block_bytes=True must be an int >= 1"),
    ("max_block_bytes", 15, "accepts no block size: no multiple of alignment=8 lies between min_block_bytes=9 and "
                            "max_block_bytes=15"),
])
def test_copyimpl_refuses_a_field_it_would_misread(field, value, message):
    from kvswap import InvalidImplError

    kw = {"alignment": 8, "min_block_bytes": 9} if field == "max_block_bytes" else {}
    with pytest.raises(InvalidImplError, match=re.escape(f"CopyImpl 'acme.copy': {message}")):
        CopyImpl("acme.copy", "batch", ("cpu",), ("h2d",), lambda ctx: host_copy, **kw, **{field: value})


# -- a broken plugin through resolve, the force switch and kvswap info ------------------------
def _offering(*impls):
    class Offer:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            for impl in impls:
                if platform in impl.platforms:
                    register(impl)

    return create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer())])


def test_factory_calling_sys_exit_leaves_the_impl_unavailable_with_the_reason():
    def factory(ctx):
        sys.exit("acme: no device")

    host = _offering(CopyImpl("acme.copy", "batch", ("cpu",), ("h2d",), factory))
    try:
        fn = kvswap.resolve("h2d", device="cpu", host=host)
    except SystemExit:
        pytest.fail("a factory's sys.exit() ended resolve()")
    cand = next(c for c in fn.plan.candidates if c.name == "acme.copy")
    assert not cand.available and "SystemExit: acme: no device" in cand.reason


@pytest.mark.parametrize("how", ["policy", "env"])
def test_forcing_an_impl_of_a_plugin_that_failed_names_the_plugin_and_why(tmp_path, monkeypatch, how):
    bad = dist(tmp_path, "acme", "raise ImportError('needs libacme.so')\n")
    with pytest.warns(PluginWarning):
        host = create_plugin_host(entry_points=entry_points_from(bad), env={})
    if how == "env":
        monkeypatch.setenv("KVSWAP_FORCE_IMPL", "acme.copy")
    policy = Policy(force="acme.copy") if how == "policy" else None
    with pytest.raises(kvswap.UnknownImplError, match=r"acme.*failed.*needs libacme.so"):
        kvswap.resolve("h2d", device="cpu", host=host, policy=policy)


@pytest.mark.parametrize("value", [" ", "host.reference "])
def test_force_switch_is_read_as_the_plugin_switches_are(monkeypatch, value):
    monkeypatch.setenv("KVSWAP_FORCE_IMPL", value)
    fn = kvswap.resolve("h2d", device="cpu", host=create_plugin_host(entry_points=[], env={}))
    assert fn.impls == ("host.reference",)


@pytest.mark.parametrize("answer", [True, SystemExit("acme: no device")])
def test_kvswap_info_shows_an_impl_of_another_platform_whose_check_misbehaves(answer):
    from kvswap.cli.inventory import impl_rows
    from kvswap.registry.platform import cpu_device

    def availability(device):
        if isinstance(answer, BaseException):
            raise answer
        return answer

    host = _offering(CopyImpl("acme.gpu", "batch", ("cuda",), ("h2d",), lambda ctx: host_copy,
                              availability=availability))
    try:
        row = next(r for r in impl_rows(host, cpu_device()) if r["name"] == "acme.gpu")
    except SystemExit:
        pytest.fail("an availability check's sys.exit() ended `kvswap info`")
    assert row["reason"].startswith("serves platforms cuda, not cpu; availability check "), row["reason"]
