"""What the registry records of one plugin (``PluginInfo``) and the checks of what it registers: hooks that
no hookspec names, specs of the wrong kind or for another plugin API version."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import pluggy

from pluginfer.core.hookspecs import HOOKS_BY_KIND
from pluginfer.core.specs import PLUGIN_API_VERSION, SPEC_CLASSES, PluginSpec


@dataclass
class PluginInfo:
    """One entry point (or in-process plugin) and what came of loading it."""

    name: str
    distribution: str
    version: str
    specs: list[PluginSpec] = field(default_factory=list)
    error: str | None = None
    skipped: bool = False
    hooks: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """``name (distribution version)``, as `pluginfer plugins` prints it."""
        if self.distribution.startswith("(") and not self.version:
            return f"{self.name} {self.distribution}"
        return f"{self.name} ({' '.join(filter(None, (self.distribution, self.version)))})"


def unknown_hook_message(pm: pluggy.PluginManager, plugin: object) -> str:
    """Why pluggy refused ``plugin``: each hook it implements that no hookspec names, with the nearest one."""
    known = sorted(name for name, hook in vars(pm.hook).items() if hook.has_spec())
    problems = []
    for caller in pm.get_hookcallers(plugin) or []:
        if not caller.has_spec():
            close = difflib.get_close_matches(caller.name, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the hooks are {', '.join(known)}"
            problems.append(f"implements unknown hook {caller.name!r}; {hint}")
    return "; ".join(problems) + " (rename the function to a pluginfer hook)"


def collect_specs(pm: pluggy.PluginManager, plugin: object, info: PluginInfo) -> list[str]:
    """Call ``plugin``'s hooks alone, add the specs they return to ``info.specs``; the problems found, as messages."""
    errors = []
    others = [other for other in pm.get_plugins() if other is not plugin]
    for kind, hook_name in HOOKS_BY_KIND.items():
        caller = pm.subset_hook_caller(hook_name, remove_plugins=others)  # one plugin, still traced
        if not caller.get_hookimpls():
            continue
        try:
            results = caller()
        except (Exception, SystemExit) as exc:  # the hook's own bug; recorded so the other plugins still load
            errors.append(f"hook {hook_name} raised {type(exc).__name__}: {exc}")
            continue
        for result in results:
            wanted = SPEC_CLASSES[kind].__name__
            if not isinstance(result, (list, tuple)):
                errors.append(f"hook {hook_name} must return a list of {wanted}, got {result!r}")
                continue
            for spec in result:
                if not isinstance(spec, PluginSpec):
                    errors.append(f"hook {hook_name} returned {spec!r}, which is not a {wanted}")
                elif spec.kind != kind:
                    right = HOOKS_BY_KIND[spec.kind]
                    errors.append(f"{hook_name} gave {type(spec).__name__} {spec.name!r}; return it from {right}")
                else:
                    info.specs.append(spec)
                    if PLUGIN_API_VERSION not in spec.api_versions:
                        errors.append(version_message(info, spec))
    return errors


def version_message(info: PluginInfo, spec: PluginSpec) -> str:
    """Why ``spec`` cannot load: the plugin API versions it was written for are not this pluginfer's."""
    versions = ", ".join(str(v) for v in spec.api_versions)
    return (
        f"plugin {info.name} was written for plugin API versions ({versions}), this pluginfer has "
        f"{PLUGIN_API_VERSION} ({spec.kind} {spec.name!r}); install a release of {info.distribution} "
        f"for API {PLUGIN_API_VERSION}, or a pluginfer it supports"
    )
