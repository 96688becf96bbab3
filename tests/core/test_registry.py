"""Plugin discovery: real fake distributions on sys.path, and in-process plugins."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from pluginfer.core import registry as registry_module
from pluginfer.core.hookspecs import (
    PLUGIN_API_VERSION,
    BackendSpec,
    ModelSpec,
    PluginSpec,
    QuantSpec,
    hookimpl,
)
from pluginfer.core.registry import (
    BrokenPluginError,
    DuplicatePluginError,
    PluginError,
    PluginVersionError,
    Registry,
    UnknownPluginError,
    get_registry,
)
from tests.core.fake_dists import forget_modules, make_dist, plugin_source

BUILTINS = ("builtin-models", "builtin-quant", "builtin-backends", "builtin-collectives", "builtin-parsers",
            "builtin-formats")
GOOD_SPECS = """[ModelSpec(
    name="fakellama", factory="fakeplug_good_factory:build",
    aliases=("fakellama3",), architectures=("FakeLlamaForCausalLM",),
)]"""
FACTORY = "def build(hf_config, ctx):\n    return ('built', hf_config)\n"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLUGINFER_PLUGINS", raising=False)
    monkeypatch.delenv("PLUGINFER_TRACE_PLUGINS", raising=False)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    forget_modules(root)


@pytest.fixture
def good_dist(site: Path) -> Path:
    make_dist(
        site, "fake-good", "1.2.3",
        modules={"fakeplug_good": plugin_source(GOOD_SPECS), "fakeplug_good_factory": FACTORY},
        entry_points={"fakegood": "fakeplug_good"},
    )
    return site


def info_of(registry: Registry, name: str):
    (info,) = [info for info in registry.plugins if info.name == name]
    return info


def plugin_with(*specs: PluginSpec, hook: str = "pluginfer_models") -> object:
    """An in-process plugin object whose ``hook`` returns ``list(specs)``."""
    return type("InProcessPlugin", (), {hook: hookimpl(lambda self: list(specs))})()


def model(name: str, factory: str = "nowhere_at_all:build", **kwargs) -> ModelSpec:
    return ModelSpec(name=name, factory=factory, **kwargs)


def test_third_party_dist_is_discovered_and_resolves(good_dist: Path) -> None:
    registry = Registry.discover()
    info = info_of(registry, "fakegood")
    assert (info.distribution, info.version, info.error, info.skipped) == ("fake-good", "1.2.3", None, False)
    assert [spec.name for spec in info.specs] == ["fakellama"]
    spec = registry.resolve("model", "fakellama")
    assert registry.resolve("model", "FAKELLAMA3") is spec  # names and aliases ignore case
    assert registry.resolve("model", "FakeLlamaForCausalLM") is spec
    with pytest.raises(UnknownPluginError):
        registry.resolve("model", "fakellamaforcausallm")  # architectures are exact
    assert registry.resolve_any("model", ["NotThere", "FakeLlamaForCausalLM"]) is spec
    assert "fakeplug_good_factory" not in sys.modules  # factories are imported only on load
    assert registry.load("model", "fakellama3")({"x": 1}, None) == ("built", {"x": 1})
    assert "fakegood (fake-good 1.2.3)" in registry.describe()
    assert "model fakellama [fakellama3, FakeLlamaForCausalLM] - usable" in registry.describe()


def test_builtin_entry_points_are_listed(good_dist: Path) -> None:
    registry = Registry.discover()
    names = {info.name for info in registry.plugins}
    assert set(BUILTINS) <= names
    listing = registry.describe()
    assert all(f"{name} (pluginfer " in listing for name in BUILTINS)
    assert registry.resolve("model", "fakellama").name == "fakellama"  # whatever state the built-ins are in


def test_broken_import_is_listed_and_does_not_break_others(good_dist: Path) -> None:
    make_dist(
        good_dist, "fake-broken", "0.1",
        modules={"fakeplug_broken": "raise ImportError('needs libfakecuda.so')\n"},
        entry_points={"fakebroken": "fakeplug_broken"},
    )
    registry = Registry.discover()
    info = info_of(registry, "fakebroken")
    assert "ImportError" in info.error and "needs libfakecuda.so" in info.error
    assert "BROKEN: cannot import 'fakeplug_broken': ImportError: needs libfakecuda.so" in registry.describe()
    assert registry.resolve("model", "fakellama").name == "fakellama"
    with pytest.raises(UnknownPluginError) as caught:
        registry.resolve("model", "fakebrokenmodel")
    message = str(caught.value)
    assert "no model plugin named 'fakebrokenmodel'" in message
    assert "fakellama" in message  # what is available
    assert "fakebroken: cannot import 'fakeplug_broken': ImportError: needs libfakecuda.so" in message


def test_misspelled_hook_is_rejected_with_a_suggestion(good_dist: Path) -> None:
    make_dist(
        good_dist, "fake-typo", "2.0",
        modules={"fakeplug_typo": plugin_source("[]", hook="pluginfer_modles")},
        entry_points={"faketypo": "fakeplug_typo"},
    )
    registry = Registry.discover()
    error = info_of(registry, "faketypo").error
    assert "'pluginfer_modles'" in error and "did you mean 'pluginfer_models'?" in error
    assert registry._pm.get_plugin("faketypo") is None  # unregistered, so check_pending stays clean
    registry.register(plugin_with(model("later")), name="later")
    assert info_of(registry, "later").error is None
    assert registry.resolve("model", "fakellama").name == "fakellama"


def test_plugin_without_hookimpl_decorator_is_broken() -> None:
    class Undecorated:
        def pluginfer_models(self) -> list[PluginSpec]:
            return [model("x")]

    registry = Registry()
    registry.register(Undecorated(), name="undecorated")
    assert "defines no hooks" in info_of(registry, "undecorated").error


def test_hook_that_raises_or_returns_garbage_is_broken() -> None:
    class Raising:
        @hookimpl
        def pluginfer_models(self) -> list[PluginSpec]:
            raise RuntimeError("boom")

    registry = Registry()
    registry.register(Raising(), name="raising")
    wrong_kind = plugin_with(model("fine"), QuantSpec(name="int8", factory="m:f"))
    registry.register(wrong_kind, name="wrongkind")
    registry.register(plugin_with(hook="pluginfer_backends"), name="empty")  # an empty list is fine
    registry.register(type("P", (), {"pluginfer_models": hookimpl(lambda self: model("x"))})(), name="lone")
    assert info_of(registry, "raising").error == "hook pluginfer_models raised RuntimeError: boom"
    assert "return it from pluginfer_quant_methods" in info_of(registry, "wrongkind").error
    assert info_of(registry, "empty").error is None
    assert "must return a list of ModelSpec" in info_of(registry, "lone").error
    assert registry.specs("quant") == [] and registry.specs("model") == []
    with pytest.raises(BrokenPluginError, match="plugin wrongkind .*which is broken"):
        registry.resolve("model", "fine")  # its spec is known, but its plugin is broken


def test_duplicate_name_names_both_plugins_and_describe_reports_it() -> None:
    registry = Registry()
    alpha = plugin_with(model("dup", aliases=("alphaonly",)))
    registry.register(alpha, name="alpha", distribution="dist-a", version="1")
    registry.register(plugin_with(model("Dup")), name="beta", distribution="dist-b", version="2")
    with pytest.raises(DuplicatePluginError) as caught:
        registry.resolve("model", "dup")
    assert "alpha (dist-a 1)" in str(caught.value) and "beta (dist-b 2)" in str(caught.value)
    assert "overrides=True" in str(caught.value)
    assert registry.resolve("model", "alphaonly").name == "dup"  # an unrelated name still resolves
    assert "DUPLICATE: model name 'dup' is claimed by" in registry.describe()


def test_override_wins_and_two_overrides_are_still_a_duplicate() -> None:
    registry = Registry()
    registry.register(plugin_with(model("dup")), name="alpha")
    registry.register(plugin_with(model("dup", overrides=True, description="mine")), name="beta")
    assert registry.resolve("model", "dup").description == "mine"
    assert "OVERRIDE: model name 'dup' from plugin beta overrides alpha" in registry.describe()
    registry.register(plugin_with(model("dup", overrides=True)), name="gamma")
    with pytest.raises(DuplicatePluginError, match="only one may set overrides=True"):
        registry.resolve("model", "dup")


def test_api_version_mismatch_names_the_plugin() -> None:
    registry = Registry()
    future = PLUGIN_API_VERSION + 1
    registry.register(plugin_with(model("future", api_versions=(future,))), name="futureplug")
    error = info_of(registry, "futureplug").error
    expected = (
        f"plugin futureplug was written for plugin API versions ({future}), "
        f"this pluginfer has {PLUGIN_API_VERSION}"
    )
    assert error.startswith(expected)
    assert f"BROKEN: {expected}" in registry.describe()
    with pytest.raises(PluginVersionError, match="plugin futureplug was written for"):
        registry.resolve("model", "future")
    assert registry.specs("model") == []


def test_allow_list_from_env_excludes_others(good_dist: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_dist(
        good_dist, "fake-other", "1.0",
        modules={"fakeplug_other": plugin_source('[ModelSpec(name="other", factory="m:f")]')},
        entry_points={"fakeother": "fakeplug_other"},
    )
    monkeypatch.setenv("PLUGINFER_PLUGINS", "fake_good, nosuchplugin")  # distribution names match normalized
    registry = Registry.discover()
    assert info_of(registry, "fakegood").skipped is False
    assert info_of(registry, "fakeother").skipped and info_of(registry, "builtin-models").skipped
    assert "fakeplug_other" not in sys.modules
    listing = registry.describe()
    assert "fakeother (fake-other 1.0)\n  skipped (not in PLUGINFER_PLUGINS)" in listing
    assert "PLUGINFER_PLUGINS names 'nosuchplugin'" in listing
    with pytest.raises(UnknownPluginError, match="not loaded because of PLUGINFER_PLUGINS: .*fakeother"):
        registry.resolve("model", "other")
    assert info_of(Registry.discover(allow=["fakeother"]), "fakegood").skipped  # by entry-point name


def test_factory_that_fails_on_import_is_a_broken_plugin_error(site: Path) -> None:
    specs = '[ModelSpec(name="crashy", factory="fakeplug_crashy_factory:build")]'
    make_dist(
        site, "fake-crashy", "3.1",
        modules={
            "fakeplug_crashy": plugin_source(specs),
            "fakeplug_crashy_factory": "raise RuntimeError('bad wheel')\n",
        },
        entry_points={"fakecrashy": "fakeplug_crashy"},
    )
    registry = Registry.discover(allow=["fakecrashy"])
    with pytest.raises(BrokenPluginError) as caught:
        registry.load("model", "crashy")
    message = str(caught.value)
    assert message.startswith("plugin fakecrashy (fake-crashy 3.1): cannot import factory")
    assert "model 'crashy'" in message and "RuntimeError: bad wheel" in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_factory_attribute_missing_is_a_broken_plugin_error() -> None:
    registry = Registry()
    registry.register(plugin_with(model("m", factory="os.path:no_such_builder")), name="p")
    with pytest.raises(BrokenPluginError, match="AttributeError"):
        registry.load("model", "m")


def test_usable_runs_the_check(site: Path) -> None:
    checks = """
        def no_device():
            return "no FakeAccelerator here"

        def fine():
            return None

        def crash():
            raise OSError("driver")
    """
    make_dist(site, "fake-checks", modules={"fakeplug_checks": checks})

    def backend(check: str | None) -> BackendSpec:
        return BackendSpec(name="fakeaccel", factory="m:f", check=check)

    registry = Registry()
    absent = backend("fakeplug_checks:no_device")
    registry.register(plugin_with(absent, hook="pluginfer_backends"), name="accel")
    assert registry.usable(absent) == (False, "no FakeAccelerator here")
    assert registry.usable(backend("fakeplug_checks:fine")) == (True, "")
    assert registry.usable(backend(None)) == (True, "")
    assert registry.usable(backend("fakeplug_checks:crash")) == (False, "check failed: OSError: driver")
    assert registry.usable(backend("fakeplug_nosuch:check"))[1].startswith("check failed: BrokenPluginError")
    assert "backend fakeaccel - not usable here: no FakeAccelerator here" in registry.describe()


def test_register_unregister_and_name_clash() -> None:
    registry = Registry()
    registry.register(plugin_with(model("inproc")), name="inproc")
    assert info_of(registry, "inproc").label == "inproc (in-process)"
    with pytest.raises(PluginError, match="already registered"):
        registry.register(plugin_with(model("other")), name="inproc")
    registry.unregister("inproc")
    with pytest.raises(UnknownPluginError, match="available: \\(none\\)"):
        registry.resolve("model", "inproc")
    with pytest.raises(UnknownPluginError, match="no plugin named 'inproc'"):
        registry.unregister("inproc")


def test_resolve_any_lists_what_was_asked_and_what_exists() -> None:
    registry = Registry()
    registry.register(plugin_with(model("qwen", architectures=("Qwen3ForCausalLM",))), name="q")
    assert registry.resolve_any("model", ["Qwen3ForCausalLM"]).name == "qwen"
    with pytest.raises(UnknownPluginError) as caught:
        registry.resolve_any("model", ["MambaForCausalLM", "JambaForCausalLM"])
    assert "no model plugin for any of ['MambaForCausalLM', 'JambaForCausalLM']" in str(caught.value)
    assert "available: qwen" in str(caught.value)
    with pytest.raises(ValueError, match="unknown plugin kind"):
        registry.specs("models")


def test_tracing_logs_every_hook_call(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PLUGINFER_TRACE_PLUGINS", "1")
    caplog.set_level(logging.DEBUG, logger=registry_module.__name__)
    registry = Registry()
    registry.register(plugin_with(model("traced")), name="traced")
    assert "pluginfer_models" in caplog.text
    assert registry.resolve("model", "traced").name == "traced"


def test_get_registry_is_cached(good_dist: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "_cached", None)
    first = get_registry()
    assert get_registry() is first
    assert get_registry(reload=True) is not first
    assert get_registry().resolve("model", "fakellama").name == "fakellama"


def test_builtins_load_once_from_their_entry_points_and_match_pyproject() -> None:
    import re

    from pluginfer.builtin_plugins import DEFAULT_PLUGINS

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    section = pyproject.split("[project.entry-points.pluginfer]")[1].split("\n[")[0]
    assert dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', section, re.M)) == DEFAULT_PLUGINS
    registry = Registry.discover()
    for name in DEFAULT_PLUGINS:
        (info,) = [info for info in registry.plugins if info.name == name]  # not a second, "from source" one
        assert info.distribution == "pluginfer" and "from source" not in info.version


def test_listing_shows_hooks_descriptions_and_details(site: Path) -> None:
    make_dist(site, "fake-details", modules={"fakeplug_details": "def report():\n    return 'kernels: 3 loaded'\n"})
    spec = BackendSpec(name="fakedev", factory="m:f", description="a fake device", details="fakeplug_details:report")
    registry = Registry()
    registry.register(plugin_with(spec, hook="pluginfer_backends"), name="dev")
    listing = registry.describe()
    assert "dev (in-process)\n  hooks: pluginfer_backends\n  backend fakedev: a fake device - usable\n" \
           "    kernels: 3 loaded" in listing
    with pytest.raises(ValueError, match="details must be 'module:attr'"):
        BackendSpec(name="x", factory="m:f", details="nocolon")


def test_format_architectures_resolve_to_the_model_plugins_converter(site: Path) -> None:
    make_dist(site, "fake-gguf", modules={"fakeplug_gguf": "def convert(checkpoint):\n    return 'converted'\n"})
    spec = model("fakemamba", converters={"gguf": {"mamba": "fakeplug_gguf:convert"}})
    registry = Registry()
    registry.register(plugin_with(spec), name="mamba")
    assert registry.converter("gguf", "mamba")(None) == "converted"
    with pytest.raises(UnknownPluginError, match=r"gguf architecture 'rwkv' is not supported by any model plugin "
                                                 r"\(supported: mamba\)"):
        registry.converter("gguf", "rwkv")
    with pytest.raises(UnknownPluginError, match=r"\(supported: \(none\)\)"):
        registry.converter("onnx", "mamba")
    with pytest.raises(ValueError, match=r"converters\['gguf'\]\['llama'\] must be 'module:attr'"):
        model("half", converters={"gguf": {"llama": "nocolon"}})
