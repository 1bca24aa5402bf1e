"""The plugin host: entry points, allow and block lists, broken plugins isolated and named."""
from __future__ import annotations

import sys
import warnings

import pytest

import kvswap
from kvswap import PluginWarning, Policy
from kvswap.registry.plugins import create_plugin_host, plugin_host, reset_plugin_host

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
