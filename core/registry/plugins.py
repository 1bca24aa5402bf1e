"""The plugin manager: load backends from entry points, isolate the broken ones.

Created on first use and cached (:func:`plugin_host`); tests build fresh ones with
:func:`create_plugin_host`. Every hook is called one plugin at a time, so a plugin that
raises is dropped with one warning naming it while the others keep working.
"""
from __future__ import annotations

import importlib.metadata
import inspect
import os
import threading
import types
import warnings
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Mapping, Optional

import pluggy

from .. import PROJECT
from ..errors import PluginWarning
from . import hookspecs, reference
from .failures import describe
from .impl import CopyImpl

ENTRY_POINT_GROUP = "kvswap.backends"
ALLOW_ENV = "KVSWAP_PLUGINS"
BLOCK_ENV = "KVSWAP_DISABLE_PLUGINS"
BUILTIN_NAME = "host"
HOOKS = tuple(n for n, f in vars(hookspecs).items() if n.startswith("kvswap_") and inspect.isfunction(f))


@dataclass(frozen=True)
class PluginRecord:
    """A plugin as ``kvswap info`` shows it. ``status`` is loaded, disabled or failed."""

    name: str
    distribution: str
    version: str
    module: str
    status: str = "loaded"
    reason: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _names(value: Optional[str]) -> Optional[set[str]]:
    """The plugin names a switch lists; None where it names none (unset, empty, ``","``)."""
    names = {n.strip() for n in (value or "").split(",") if n.strip()}
    return names or None


def in_tree(obj: object) -> bool:
    """Whether a plugin object is one of kvswap's own: the host reference, or a backend
    module (or an object of one) under ``kvswap.backends``."""
    module = obj.__name__ if isinstance(obj, types.ModuleType) else type(obj).__module__
    return module == reference.__name__ or module.startswith("kvswap.backends.")


class PluginHost:
    """A pluggy manager plus what kvswap knows of each plugin it tried to load.

    Safe to share between threads: registering, dropping and warning hold one lock, and
    hooks are called on a snapshot of the registered implementations.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.builtin: set[str] = set()  # names of the plugins that are kvswap's own
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.RLock()

    # -- loading -------------------------------------------------------------------
    def add(self, obj: object, record: PluginRecord) -> bool:
        with self._lock:
            if self.pm.has_plugin(record.name):  # keep the record of the plugin that has the name
                self.warn(record.name, f"is the name of a second plugin ({record.module}); it was ignored")
                return False
            if obj is None:
                self.fail(record, "is None, not a module or object holding hooks")
                return False
            try:
                self.pm.register(obj, name=record.name)
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                self.fail(record, f"cannot be registered: {describe(e)}")
                return False
            refused = self._uncallable(obj)
            if refused:
                self.pm.unregister(obj)
                self.fail(record, refused)
                return False
            if not self.pm.get_hookcallers(obj):
                record = replace(record, reason=_no_hooks(obj))
            self.records[record.name] = record
            if record.reason:
                self.warn(record.name, record.reason)
            if in_tree(obj):
                self.builtin.add(record.name)
            return True

    def _uncallable(self, obj: object) -> Optional[str]:
        """Why kvswap cannot call a hook pluggy accepted: one marked as a wrapper (kvswap
        calls each plugin's hook on its own), or written as a generator (its body would
        never run)."""
        for caller in self.pm.get_hookcallers(obj) or ():
            for impl in caller.get_hookimpls():
                if impl.plugin is not obj:
                    continue
                if impl.hookwrapper or impl.wrapper:
                    return (f"marks {caller.name} as a hook wrapper; kvswap calls each plugin's "
                            "hooks on their own, so none wraps another's")
                if inspect.isgeneratorfunction(impl.function):
                    return (f"writes {caller.name} as a generator, so its body would never run; "
                            "a hook calls register(...) or returns its answer")
        return None

    def is_builtin(self, name: str) -> bool:
        """Whether the plugin ``name`` is one of kvswap's own (in-tree) backends."""
        return name in self.builtin

    def fail(self, record: PluginRecord, cause: str) -> None:
        with self._lock:
            self.records[record.name] = PluginRecord(
                record.name, record.distribution, record.version, record.module, "failed", cause
            )
            self.warn(record.name, f"dropped: {cause}")

    def warn(self, name: str, message: str) -> None:
        """One warning per plugin and message per process, naming the plugin."""
        with self._lock:
            if (name, message) in self._warned:
                return
            self._warned.add((name, message))
            rec = self.records.get(name)
        where = f" (from {rec.distribution} {rec.version})" if rec and rec.distribution != "?" else ""
        warnings.warn(f"kvswap plugin {name!r}{where} {message}", PluginWarning, stacklevel=3)

    def drop(self, name: str, cause: str) -> None:
        """Unregister a plugin that misbehaved at run time and say so once (from any
        number of threads at once: the first drops it, the others find it gone)."""
        with self._lock:
            plugin = self.pm.get_plugin(name)
            if plugin is None:
                if name in self.records and self.records[name].status == "failed":
                    return  # another thread dropped it already
            else:
                self.pm.unregister(plugin)
            record = self.records.get(name) or PluginRecord(name, "?", "?", "?")
            self.fail(record, cause)

    def check_pending(self) -> None:
        """pluggy's ``check_pending``, dropping each plugin with a hook nobody specified."""
        while True:
            with self._lock:
                try:
                    self.pm.check_pending()
                    return
                except pluggy.PluginValidationError as e:
                    name = self.pm.get_name(e.plugin) or repr(e.plugin)
                    self.drop(name, f"implements an unknown hook: {e}")

    # -- calling -------------------------------------------------------------------
    def call_each(self, hook: str, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """Call ``hook`` on each plugin in name order; yield ``(plugin, result)``.

        A plugin whose implementation raises is dropped (with a warning) and skipped.
        """
        for impl in self._impls_of(hook):
            try:
                result = impl.function(**{a: kwargs[a] for a in impl.argnames})
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                self.drop(impl.plugin_name, f"{hook} raised {describe(e)}")
                continue
            yield impl.plugin_name, result

    def collect(self, hook: str, kind: type, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call a ``register``-style hook; return ``(plugin, item)`` for every valid item.

        A plugin that registers anything but a ``kind`` is dropped whole for this call; one
        that returns something instead of registering it is warned about.
        """
        out: list[tuple[str, Any]] = []
        for impl in self._impls_of(hook):
            items: list[Any] = []
            args = dict(kwargs, register=items.append)
            try:
                returned = impl.function(**{a: args[a] for a in impl.argnames})
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                self.drop(impl.plugin_name, f"{hook} raised {describe(e)}")
                continue
            if returned is not None:
                self.warn(impl.plugin_name, f"returned a {type(returned).__name__} from {hook}, which kvswap "
                          f"ignores; offer each {kind.__name__} by calling register(...)")
            wrong = [i for i in items if not isinstance(i, kind)]
            if wrong:
                self.drop(
                    impl.plugin_name,
                    f"{hook} registered {wrong[0]!r}, which is not a {kind.__name__}",
                )
                continue
            out.extend((impl.plugin_name, i) for i in items)
        return out

    def _impls_of(self, hook: str) -> list[Any]:
        """The implementations of ``hook``, in plugin-name order, as registered now."""
        with self._lock:
            return sorted(getattr(self.pm.hook, hook).get_hookimpls(), key=lambda i: i.plugin_name)

    @property
    def loaded(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if r.status == "loaded"]


def _no_hooks(obj: object) -> str:
    """What to say of a plugin that implements no hook: usually functions without the marker."""
    try:
        unmarked = [n for n in HOOKS if callable(getattr(obj, n, None))]
    except Exception:
        unmarked = []
    if unmarked:
        return f"implements no kvswap hook; these functions need the @kvswap.hookimpl marker: {', '.join(unmarked)}"
    return (f"implements no kvswap hook (functions named after the hooks, {HOOKS[0]} and the others, "
            "marked @kvswap.hookimpl)")


def _dist(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"] or "?", dist.version or "?"


def create_plugin_host(
    entry_points: Optional[Iterable[importlib.metadata.EntryPoint]] = None,
    env: Optional[Mapping[str, str]] = None,
    extra: Iterable[tuple[str, object]] = (),
) -> PluginHost:
    """Build a fresh plugin host.

    :param entry_points: the entry points to load (default: the installed ones in
        ``kvswap.backends``).
    :param env: where to read ``KVSWAP_PLUGINS`` and ``KVSWAP_DISABLE_PLUGINS``
        (default: ``os.environ``).
    :param extra: ``(name, plugin)`` pairs registered directly, as tests do.

    The built-in host reference backend is always registered; the allow and block lists
    apply to the plugins found through entry points.
    """
    env = os.environ if env is None else env
    allow, block = _names(env.get(ALLOW_ENV)), _names(env.get(BLOCK_ENV)) or set()
    host = PluginHost()
    host.add(reference, PluginRecord(BUILTIN_NAME, PROJECT, _own_version(), reference.__name__))
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen: set[str] = set()
    # kvswap's own entry point keeps its name wherever another distribution also uses it.
    for ep in sorted(entry_points, key=lambda e: (e.name, _dist(e)[0] != PROJECT)):
        dist, version = _dist(ep)
        record = PluginRecord(ep.name, dist, version, ep.value)
        seen.add(ep.name)
        if ep.name in host.records:
            host.warn(ep.name, f"has a second entry point, {ep.value} from {dist} {version}; it was ignored")
            continue
        if allow is not None and ep.name not in allow:
            host.records[ep.name] = PluginRecord(ep.name, dist, version, ep.value, "disabled", f"not in {ALLOW_ENV}")
            continue
        if ep.name in block:
            host.pm.set_blocked(ep.name)
            host.records[ep.name] = PluginRecord(ep.name, dist, version, ep.value, "disabled", f"named in {BLOCK_ENV}")
            continue
        try:
            obj = ep.load()
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit too: a plugin must not end the process
            host.fail(record, f"failed to import {ep.value}: {describe(e)}")
            continue
        host.add(obj, record)
    for name, obj in extra:
        host.add(obj, PluginRecord(name, "?", "?", getattr(obj, "__name__", repr(obj))))
    extras = {n for n, _ in extra}
    for missing in sorted((allow or set()) - seen - {BUILTIN_NAME} - extras):
        host.warn(missing, f"is named in {ALLOW_ENV} but is not installed")
    for missing in sorted(block - seen - extras):
        why = "is built in and cannot be disabled" if missing == BUILTIN_NAME else "is not installed"
        host.warn(missing, f"is named in {BLOCK_ENV} but {why}")
    host.check_pending()
    return host


def _own_version() -> str:
    from .. import __version__

    return __version__


_lock = threading.Lock()
_cached: Optional[PluginHost] = None


def plugin_host() -> PluginHost:
    """The process's plugin host, loaded once on first use."""
    global _cached
    with _lock:
        if _cached is None:
            _cached = create_plugin_host()
        return _cached


def reset_plugin_host(host: Optional[PluginHost] = None) -> None:
    """Forget the cached host (tests, or after installing a plugin); optionally set one."""
    global _cached
    with _lock:
        _cached = host




def collect_impls(host: PluginHost, platform: str) -> list[tuple[str, CopyImpl]]:
    """``(plugin, impl)`` registered for ``platform``, one per name.

    The names kvswap's own backends register are theirs: another plugin registering one is
    ignored, with a warning naming that plugin. Between other plugins, the first by plugin
    name keeps a name, and the others are warned about (never load order). A plugin that
    registers one name twice keeps the first, with a warning.
    """
    offered = host.collect("kvswap_register_copy_impls", CopyImpl, platform=platform)
    owner: dict[str, str] = {}
    for plugin, impl in offered:  # kvswap's own first: their names are reserved
        if host.is_builtin(plugin):
            owner.setdefault(impl.name, plugin)
    for plugin, impl in offered:  # then the others, in plugin-name order (collect's)
        owner.setdefault(impl.name, plugin)
    out, taken = [], set()
    for plugin, impl in offered:
        mine = owner[impl.name]
        if mine != plugin:
            whose = "kvswap's own plugin " if host.is_builtin(mine) else ""
            host.warn(plugin, f"registers {impl.name!r}, already registered by {whose}{mine!r}; ignored")
        elif impl.name in taken:
            host.warn(plugin, f"registers {impl.name!r} twice for platform {platform!r}; the second was ignored")
        else:
            taken.add(impl.name)
            out.append((plugin, impl))
    return out
