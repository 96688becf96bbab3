"""Finds plugins through entry points, records what each registers, and resolves names to specs.

A plugin that fails to load is recorded against its name and shown by ``describe()``; an error
is raised only when a config selects a name that the failure (or a duplicate claim) affects.
pluginfer's own plugins (``pluginfer.builtin_plugins``) load even where the package was not installed
with its entry points (a source checkout on ``PYTHONPATH``), once.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from importlib.metadata import entry_points

import pluggy

from pluginfer.core import hookspecs
from pluginfer.core.hookspecs import PROJECT_NAME
from pluginfer.core.plugin_record import PluginInfo, collect_specs, unknown_hook_message, version_message
from pluginfer.core.specs import (
    CLAIMING_KINDS,
    KINDS,
    PLUGIN_API_VERSION,
    CheckpointFormatSpec,
    CollectiveSpec,
    ModelSpec,
    PluginSpec,
    QuantSpec,
)

logger = logging.getLogger(__name__)

ALLOW_ENV = "PLUGINFER_PLUGINS"
TRACE_ENV = "PLUGINFER_TRACE_PLUGINS"


class PluginError(Exception):
    """Base of every error the registry raises."""


class UnknownPluginError(PluginError):
    """No loaded plugin provides the requested name."""


class DuplicatePluginError(PluginError):
    """Two plugins claim one name of one kind and not exactly one of them declares overrides=True."""


class BrokenPluginError(PluginError):
    """The plugin providing a name failed to load, or its factory failed to import."""


class PluginVersionError(BrokenPluginError):
    """The plugin was written for plugin API versions this pluginfer does not implement."""


_Claim = tuple[PluginInfo, PluginSpec]  # a spec and the plugin that registered it


class Registry:
    """The plugins of this process and the specs they registered, looked up by kind and name."""

    def __init__(self, trace: bool | None = None) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._plugins: list[PluginInfo] = []
        self._unmatched_allow: list[str] = []
        if trace is None:
            trace = os.environ.get(TRACE_ENV, "") not in ("", "0")
        if trace:  # log every hook call, to the logger if it shows debug, else to stderr
            self._pm.trace.root.setwriter(_trace_writer())
            self._pm.enable_tracing()

    @classmethod
    def discover(cls, allow: list[str] | None = None) -> Registry:
        """Load every ``pluginfer`` entry point, or only those named in ``allow`` / PLUGINFER_PLUGINS."""
        registry = cls()
        if allow is None and os.environ.get(ALLOW_ENV, "").strip():
            allow = os.environ[ALLOW_ENV].split(",")
        wanted = {_normalize(a) for a in allow if a.strip()} if allow is not None else None
        seen: set[str] = set()
        for ep in entry_points(group=PROJECT_NAME):
            dist, version = (ep.dist.name, ep.dist.version) if ep.dist else ("(unknown)", "")
            info = PluginInfo(ep.name, dist, version)
            keys = {_normalize(info.name), _normalize(info.distribution)}
            seen |= keys
            if wanted is not None and not wanted & keys:
                info.skipped = True
            elif registry._find(ep.name):
                info.error = f"entry point name {ep.name!r} is taken by another distribution; uninstall one"
            else:
                try:
                    plugin = ep.load()
                except (Exception, SystemExit) as exc:  # any import failure is this plugin's, never the engine's
                    info.error = f"cannot import {ep.value!r}: {type(exc).__name__}: {exc}"
                else:
                    registry._add(plugin, info)
                    continue
            registry._plugins.append(info)
        registry._add_builtins(wanted, seen)
        registry._unmatched_allow = sorted(wanted - seen) if wanted is not None else []
        return registry

    def _add_builtins(self, wanted: set[str] | None, seen: set[str]) -> None:
        """The built-in plugins no entry point named (pluginfer run from a checkout it was not installed from)."""
        from pluginfer import __version__
        from pluginfer.builtin_plugins import DEFAULT_PLUGINS

        for name, module in DEFAULT_PLUGINS.items():
            if self._find(name):
                continue
            info = PluginInfo(name, "pluginfer", f"{__version__}, from source")
            keys = {_normalize(name), _normalize(info.distribution)}
            seen |= keys
            if wanted is not None and not wanted & keys:
                info.skipped = True
                self._plugins.append(info)
                continue
            try:
                plugin = importlib.import_module(module)
            except Exception as exc:  # as an entry point's: recorded, never the engine's failure
                info.error = f"cannot import {module!r}: {type(exc).__name__}: {exc}"
                self._plugins.append(info)
                continue
            self._add(plugin, info)

    def register(
        self, plugin: object, name: str, distribution: str = "(in-process)", version: str = ""
    ) -> None:
        """Register an in-process plugin with the same checks as an entry point; failures are recorded."""
        if self._find(name):
            raise PluginError(f"a plugin named {name!r} is already registered; unregister({name!r}) it first")
        self._add(plugin, PluginInfo(name, distribution, version))

    def unregister(self, name: str) -> None:
        """Forget the plugin registered under ``name`` and its specs."""
        if not self._find(name):
            known = ", ".join(info.name for info in self._plugins) or "(none)"
            raise UnknownPluginError(f"no plugin named {name!r} to unregister; registered: {known}")
        if self._pm.get_plugin(name) is not None:
            self._pm.unregister(name=name)
        self._plugins = [info for info in self._plugins if info.name != name]

    def resolve(self, kind: str, name: str) -> PluginSpec:
        """The spec of ``kind`` whose name or alias (any case) or exact name (a model's HF architecture) is ``name``."""
        _check_kind(kind)
        found = self._candidates(kind, name, healthy=True)
        if found:
            return self._pick(kind, name, found)[1]
        for info, spec in self._candidates(kind, name, healthy=False):
            if PLUGIN_API_VERSION not in spec.api_versions:
                raise PluginVersionError(version_message(info, spec))
            raise BrokenPluginError(
                f"{kind} {name!r} comes from plugin {info.label}, which is broken: {info.error}; "
                "fix or reinstall that plugin (see `pluginfer plugins`)"
            )
        raise UnknownPluginError(self._unknown_message(kind, f"named {name!r}"))

    def resolve_any(self, kind: str, names: list[str]) -> PluginSpec:
        """The spec for the first of ``names`` that resolves (e.g. an HF ``architectures`` list)."""
        for name in names:
            try:
                return self.resolve(kind, name)
            except UnknownPluginError:
                continue
        raise UnknownPluginError(self._unknown_message(kind, f"for any of {list(names)!r}"))

    def load(self, kind: str, name: str) -> Callable:
        """Resolve ``name`` and import its factory."""
        spec = self.resolve(kind, name)
        factory = self._import(spec, spec.factory, "factory")
        if not callable(factory):
            raise BrokenPluginError(f"{self._owner(spec)}: factory {spec.factory!r} is not callable")
        return factory

    def usable(self, spec: PluginSpec) -> tuple[bool, str]:
        """Run ``spec.check``: (True, "") if the plugin can run here, else (False, the reason)."""
        if spec.check is None:
            return True, ""
        try:
            reason = self._import(spec, spec.check, "check")()
        except (Exception, SystemExit) as exc:  # a crashing check means "not usable", not a crashed listing
            return False, f"check failed: {type(exc).__name__}: {exc}"
        return (True, "") if reason is None else (False, str(reason))

    def version_of(self, spec: PluginSpec) -> str:
        """``distribution version`` of the plugin that registered ``spec`` (ranks compare these)."""
        owners = [info for info in self._plugins if any(s is spec for s in info.specs)]
        return " ".join(filter(None, (owners[0].distribution, owners[0].version))) if owners else ""

    def specs(self, kind: str) -> list[PluginSpec]:
        """Every spec of ``kind`` from the plugins that loaded cleanly."""
        _check_kind(kind)
        return [spec for info in self._healthy() for spec in info.specs if spec.kind == kind]

    @property
    def plugins(self) -> list[PluginInfo]:
        """Every plugin seen: loaded, broken or skipped."""
        return list(self._plugins)

    def describe(self) -> str:
        """The listing `pluginfer plugins` prints."""
        lines: list[str] = []
        for info in self._plugins:
            lines.append(info.label)
            if info.skipped:
                lines.append(f"  skipped (not in {ALLOW_ENV})")
            elif info.error is not None:
                lines.append(f"  BROKEN: {info.error}")
            elif info.hooks:
                lines.append(f"  hooks: {', '.join(info.hooks)}")
            for spec in info.specs if info.error is None else []:
                ok, reason = self.usable(spec)
                extra = ", ".join(spec.names[1:])
                about = f": {spec.description}" if spec.description else ""
                status = "usable" if ok else f"not usable here: {reason}"
                lines.append(f"  {spec.kind} {spec.name}{f' [{extra}]' if extra else ''}{about} - {status}")
                if ok and spec.details is not None:
                    lines.append(f"    {self._details(spec)}")
        lines += self._conflicts()
        lines += [f"{ALLOW_ENV} names {name!r}, which no plugin has" for name in self._unmatched_allow]
        return "\n".join(lines) if lines else "no pluginfer plugins installed"

    def _details(self, spec: PluginSpec) -> str:
        try:
            return str(self._import(spec, spec.details, "details")())
        except Exception as exc:  # a crashing report is shown, not raised
            return f"details failed: {type(exc).__name__}: {exc}"

    def claiming(self, kind: str, argument: object) -> PluginSpec | None:
        """The highest-priority usable spec of ``kind`` whose ``claims(argument)`` is true, or None."""
        if kind not in CLAIMING_KINDS:
            raise ValueError(f"{kind} specs claim nothing; the kinds with claims are {', '.join(CLAIMING_KINDS)}")
        claimed = [spec for spec in self.specs(kind) if self._claims(spec, argument) and self.usable(spec)[0]]
        return max(claimed, key=lambda spec: spec.priority, default=None)

    def _claims(self, spec: PluginSpec, argument: object) -> bool:
        """``spec.claims(argument)``; a claims that cannot be imported or raises claims nothing (logged):
        one broken plugin never stops the others from being chosen."""
        reference = spec.claims if isinstance(spec, (QuantSpec, CheckpointFormatSpec)) else None
        if reference is None:
            return False
        try:
            return bool(self._import(spec, reference, "claims")(argument))
        except Exception as exc:
            logger.warning("%s: claims %r failed, so it claims nothing: %s", self._owner(spec), reference, exc)
            return False

    def for_launcher(self, kind: str, launcher: str) -> PluginSpec | None:
        """The highest-priority usable collective spec that names ``launcher`` in its ``launchers``."""
        if kind != CollectiveSpec.kind:
            raise ValueError(f"only collective specs name launchers, not {kind} specs")
        named = [spec for spec in self.specs(kind) if isinstance(spec, CollectiveSpec)
                 and launcher in spec.launchers and self.usable(spec)[0]]
        return max(named, key=lambda spec: spec.priority, default=None)

    def converter(self, format_name: str, architecture: str) -> Callable:
        """The function of the model plugin that reads ``format_name`` checkpoints of ``architecture``."""
        models = [spec for spec in self.specs("model") if isinstance(spec, ModelSpec)]
        owners = [spec for spec in models if architecture in spec.converters.get(format_name, {})]
        if not owners:
            known = sorted({arch for spec in models for arch in spec.converters.get(format_name, {})})
            raise UnknownPluginError(f"{format_name} architecture {architecture!r} is not supported by any model "
                                     f"plugin (supported: {', '.join(known) or '(none)'})")
        return self._import(owners[0], owners[0].converters[format_name][architecture], "converter")

    def multimodal_processor(self, architectures: list[str]) -> Callable | None:
        """The ``MultiModalProcessor`` factory for a checkpoint of HF ``architectures`` (None: no
        ``multimodal_processor`` spec lists them, so the model takes text only)."""
        for architecture in architectures:
            if any(self._candidates("multimodal_processor", architecture, healthy) for healthy in (True, False)):
                return self.load("multimodal_processor", architecture)  # a broken or old plugin's error, named
        return None

    def _add(self, plugin: object, info: PluginInfo) -> None:
        self._plugins.append(info)
        try:
            self._pm.register(plugin, name=info.name)
        except Exception as exc:  # a hookimpl taking arguments its hookspec lacks, or a plugin twice
            info.error = f"{type(exc).__name__}: {exc}"
            return
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError:
            info.error = unknown_hook_message(self._pm, plugin)
        if info.error is None and not self._pm.get_hookcallers(plugin):
            info.error = "defines no hooks; decorate them with pluginfer.core.hookspecs.hookimpl"
        info.hooks = sorted(caller.name for caller in self._pm.get_hookcallers(plugin) or [])
        if info.error is None:
            info.error = "; ".join(collect_specs(self._pm, plugin, info)) or None
        if info.error is not None:
            self._pm.unregister(plugin)

    def _find(self, name: str) -> list[PluginInfo]:
        return [info for info in self._plugins if info.name == name]

    def _healthy(self) -> list[PluginInfo]:
        return [info for info in self._plugins if info.error is None and not info.skipped]

    def _candidates(self, kind: str, name: str, healthy: bool) -> list[_Claim]:
        pool = self._healthy() if healthy else [info for info in self._plugins if info.error is not None]
        lowered = name.lower()
        return [
            (info, spec)
            for info in pool
            for spec in info.specs
            if spec.kind == kind
            and (lowered in (n.lower() for n in (spec.name, *spec.aliases)) or name in spec.exact_names)
        ]

    def _pick(self, kind: str, name: str, found: list[_Claim]) -> _Claim:
        overriding = [candidate for candidate in found if candidate[1].overrides]
        if len(found) == 1 or len(overriding) == 1:
            return overriding[0] if overriding else found[0]
        claimants = " and ".join(f"plugin {info.label} ({kind} {spec.name!r})" for info, spec in found)
        fix = "only one may set overrides=True" if overriding else "mark the winner overrides=True"
        raise DuplicatePluginError(
            f"{kind} name {name!r} is claimed by {claimants}; uninstall one, leave one out of {ALLOW_ENV}, "
            f"or {fix}"
        )

    def _conflicts(self) -> list[str]:
        lines, seen = [], set()
        for kind in KINDS:
            for name in (name for spec in self.specs(kind) for name in spec.names):
                found = self._candidates(kind, name, healthy=True)
                key = (kind, frozenset(id(spec) for _, spec in found))
                if len(found) < 2 or key in seen:
                    continue
                seen.add(key)
                try:
                    winner, _ = self._pick(kind, name, found)
                except DuplicatePluginError as exc:
                    lines.append(f"DUPLICATE: {exc}")
                    continue
                losers = ", ".join(info.name for info, _ in found if info is not winner)
                lines.append(f"OVERRIDE: {kind} name {name!r} from plugin {winner.name} overrides {losers}")
        return lines

    def _unknown_message(self, kind: str, asked: str) -> str:
        names = sorted({n for spec in self.specs(kind) for n in (spec.name, *spec.aliases)}, key=str.lower)
        message = f"no {kind} plugin {asked}; available: {', '.join(names) or '(none)'}"
        broken = [f"{info.name}: {info.error}" for info in self._plugins if info.error is not None]
        skipped = [info.name for info in self._plugins if info.skipped]
        if broken:
            message += f" (broken plugins: {'; '.join(broken)})"
        if skipped:
            message += f" (not loaded because of {ALLOW_ENV}: {', '.join(skipped)})"
        return f"{message}. Check the name, install a plugin that provides it, or run `pluginfer plugins`"

    def _owner(self, spec: PluginSpec) -> str:
        owners = [info.label for info in self._plugins if any(s is spec for s in info.specs)]
        return f"plugin {owners[0]}" if owners else "an unregistered spec"

    def _import(self, spec: PluginSpec, ref: str, what: str) -> Callable:
        module_name, _, attr = ref.partition(":")
        try:
            return functools.reduce(getattr, attr.split("."), importlib.import_module(module_name))
        except (Exception, SystemExit) as exc:  # a module that exits at import is broken, not a reason to stop
            raise BrokenPluginError(
                f"{self._owner(spec)}: cannot import {what} {ref!r} of {spec.kind} {spec.name!r}: "
                f"{type(exc).__name__}: {exc}. Fix or reinstall the plugin, or choose another {spec.kind}"
            ) from exc


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; the kinds are {', '.join(KINDS)}")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _trace_writer() -> Callable[[str], object]:
    if logger.isEnabledFor(logging.DEBUG):
        return lambda message: logger.debug(message.rstrip())
    return lambda message: sys.stderr.write(message)


_cached: Registry | None = None
_lock = threading.Lock()


def get_registry(reload: bool = False) -> Registry:
    """The process-wide ``Registry.discover()``, built on first use (or again with ``reload=True``)."""
    global _cached
    with _lock:
        if _cached is None or reload:
            _cached = Registry.discover()
        return _cached
