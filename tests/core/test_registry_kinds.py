"""The plugin kinds beyond the engine's four: tool-call and reasoning parsers, HTTP endpoints, request
processors and checkpoint formats, each registered, listed and looked up like the others; and the spec
classes, one per kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pluginfer.core.hookspecs import (
    HOOKS_BY_KIND,
    KINDS,
    PLUGIN_API_VERSION,
    SPEC_CLASSES,
    CheckpointFormatSpec,
    CollectiveSpec,
    EndpointSpec,
    ModelSpec,
    MultimodalProcessorSpec,
    PluginSpec,
    QuantSpec,
    ReasoningParserSpec,
    RequestProcessorSpec,
    ToolParserSpec,
    hookimpl,
)
from pluginfer.core.registry import (
    BrokenPluginError,
    DuplicatePluginError,
    PluginVersionError,
    Registry,
    UnknownPluginError,
)
from pluginfer.engine.loader import open_checkpoint, read_hf_config
from pluginfer.formats.safetensors import SafetensorsCheckpoint
from tests.core.fake_dists import forget_modules, make_dist, plugin_source

PARSERS = """
class BracketCalls:
    needs_special_tokens = False

    def parse(self, text, final):
        from pluginfer.core.parsers import FunctionCall, ToolCallText
        head, _, call = text.partition("[[")
        if not call:
            return ToolCallText(text)
        name, _, arguments = call.rstrip("]").partition(" ")
        return ToolCallText(head, [FunctionCall(name, arguments or "{}")])

    def new_id(self):
        return "call_bracket"


class Hash:
    def split(self, text, final):
        reasoning, _, content = text.rpartition("##")
        return reasoning, content
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLUGINFER_PLUGINS", raising=False)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    forget_modules(root)


def plugin(hook: str, *specs: PluginSpec) -> object:
    return type("InProcessPlugin", (), {hook: hookimpl(lambda self: list(specs))})()


def info_of(registry: Registry, name: str):
    (info,) = [info for info in registry.plugins if info.name == name]
    return info


def test_one_spec_class_per_kind_with_only_its_fields() -> None:
    assert set(KINDS) == set(HOOKS_BY_KIND) == set(SPEC_CLASSES)
    assert {cls.kind for cls in SPEC_CLASSES.values()} == set(KINDS)
    with pytest.raises(TypeError, match="PluginSpec is the base of the spec classes since plugin API 4"):
        PluginSpec(name="x", factory="m:f")
    with pytest.raises(TypeError, match="unexpected keyword argument 'kind'"):
        ModelSpec(kind="model", name="x", factory="m:f")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'claims'"):
        ModelSpec(name="x", factory="m:f", claims="m:c")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'launchers'"):
        QuantSpec(name="x", factory="m:f", launchers=("mpi",))  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="CheckpointFormatSpec.claims must be 'module:attr'"):
        CheckpointFormatSpec(name="x", factory="m:f")
    with pytest.raises(ValueError, match="ToolParserSpec.factory must be 'module:attr'"):
        ToolParserSpec(name="x", factory="nocolon")
    assert ModelSpec(name="m", factory="m:f", architectures=("MForCausalLM",)).names == ("m", "MForCausalLM")
    with pytest.raises(TypeError, match="unexpected keyword argument 'gguf_architectures'"):  # version 5: converters
        ModelSpec(name="x", factory="m:f", gguf_architectures=("llama",))  # type: ignore[call-arg]
    assert ToolParserSpec(name="t", factory="m:f").api_versions == (PLUGIN_API_VERSION,) == (6,)


def test_parsers_register_resolve_and_build(site: Path) -> None:
    make_dist(site, "fake-parsers", "0.3", modules={
        "fakeplug_parsers": plugin_source('[ToolParserSpec(name="bracket", aliases=("brackets",), '
                                          'factory="fakeplug_parsers_impl:BracketCalls")]', hook="pluginfer_tool_parsers")
        + '\n\n@hookimpl\ndef pluginfer_reasoning_parsers():\n'
          '    return [ReasoningParserSpec(name="hash", factory="fakeplug_parsers_impl:Hash", description="## ends it")]\n',
        "fakeplug_parsers_impl": PARSERS}, entry_points={"fakeparsers": "fakeplug_parsers"})
    registry = Registry.discover()
    parser = registry.load("tool_parser", "BRACKETS")()
    parsed = parser.parse("Sure. [[get_weather {\"city\": \"Paris\"}]]", final=True)
    assert (parsed.content, parsed.calls[0].name, json.loads(parsed.calls[0].arguments)) == \
        ("Sure. ", "get_weather", {"city": "Paris"})
    assert registry.load("reasoning_parser", "hash")().split("think##answer", True) == ("think", "answer")
    assert registry.resolve("tool_parser", "hermes").name == "hermes"  # the built-ins beside them
    listing = registry.describe()
    assert "fakeparsers (fake-parsers 0.3)\n  hooks: pluginfer_reasoning_parsers, pluginfer_tool_parsers" in listing
    assert "tool_parser bracket [brackets] - usable" in listing
    assert "reasoning_parser hash: ## ends it - usable" in listing
    with pytest.raises(UnknownPluginError, match="no tool_parser plugin named 'hash'; available: bracket, brackets, "):
        registry.load("tool_parser", "hash")  # kinds do not share names


def test_a_spec_from_another_kinds_hook_and_an_old_api_version_are_broken() -> None:
    registry = Registry()
    registry.register(plugin("pluginfer_tool_parsers", EndpointSpec(name="echo", factory="m:f")), name="wrong")
    assert info_of(registry, "wrong").error == \
        "pluginfer_tool_parsers gave EndpointSpec 'echo'; return it from pluginfer_endpoints"
    old = RequestProcessorSpec(name="old", factory="m:f", api_versions=(2, 3))
    registry.register(plugin("pluginfer_request_processors", old), name="oldplug")
    assert info_of(registry, "oldplug").error.startswith(
        "plugin oldplug was written for plugin API versions (2, 3), this pluginfer has 6 (request_processor 'old')")
    with pytest.raises(PluginVersionError):
        registry.load("request_processor", "old")
    with pytest.raises(UnknownPluginError, match="broken plugins: wrong: pluginfer_tool_parsers gave EndpointSpec"):
        registry.resolve("endpoint", "echo")


def test_endpoint_and_processor_factories_import_only_when_loaded(site: Path) -> None:
    make_dist(site, "fake-web", modules={
        "fakeplug_web": plugin_source('[EndpointSpec(name="echo", factory="fakeplug_web_impl:attach")]',
                                      hook="pluginfer_endpoints")
        + '\n\n@hookimpl\ndef pluginfer_request_processors():\n'
          '    return [RequestProcessorSpec(name="upper", factory="fakeplug_web_missing:build")]\n',
        "fakeplug_web_impl": "def attach(context):\n    return 'attached'\n"},
        entry_points={"fakeweb": "fakeplug_web"})
    registry = Registry.discover(allow=["fakeweb"])
    assert registry.load("endpoint", "echo")(None) == "attached"
    with pytest.raises(BrokenPluginError) as caught:
        registry.load("request_processor", "upper")
    assert str(caught.value).startswith("plugin fakeweb (fake-web 1.0): cannot import factory "
                                        "'fakeplug_web_missing:build' of request_processor 'upper'")


def test_allow_list_leaves_out_a_parser_plugin(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_dist(site, "fake-parsers", modules={
        "fakeplug_parsers": plugin_source('[ToolParserSpec(name="bracket", factory="m:f")]',
                                          hook="pluginfer_tool_parsers")},
        entry_points={"fakeparsers": "fakeplug_parsers"})
    monkeypatch.setenv("PLUGINFER_PLUGINS", "builtin-parsers")
    registry = Registry.discover()
    assert registry.resolve("tool_parser", "qwen").name == "hermes"
    with pytest.raises(UnknownPluginError, match="not loaded because of PLUGINFER_PLUGINS: .*fakeparsers"):
        registry.load("tool_parser", "bracket")
    assert registry.specs("checkpoint_format") == []  # builtin-formats is left out too


def test_checkpoint_formats_claim_paths_by_priority(tmp_path: Path, site: Path) -> None:
    make_dist(site, "fake-formats", modules={"fakeplug_formats": """
        import json
        from pathlib import Path

        def claims_npz(path):
            return path.suffix == ".npz"

        def claims_everything(path):
            return True

        def crashes(path):
            raise OSError("cannot stat")

        class NpzCheckpoint:
            def __init__(self, path):
                self.path = Path(path)

            def hf_config(self):
                return json.loads(self.path.with_suffix(".json").read_text())

            def load_tokenizer(self):
                return None

            def iter_weights(self, progress=None, allow_pickle=False):
                yield "w", 1.0
    """})
    npz = tmp_path / "model.npz"
    npz.write_bytes(b"")
    npz.with_suffix(".json").write_text('{"architectures": ["NpzForCausalLM"]}')
    registry = Registry()
    registry.register(plugin("pluginfer_checkpoint_formats",
                             CheckpointFormatSpec(name="npz", factory="fakeplug_formats:NpzCheckpoint",
                                                  claims="fakeplug_formats:claims_npz", priority=5),
                             CheckpointFormatSpec(name="any", factory="m:f", claims="fakeplug_formats:claims_everything"),
                             CheckpointFormatSpec(name="crashy", factory="m:f", claims="fakeplug_formats:crashes",
                                                  priority=99)), name="formats")
    assert registry.claiming("checkpoint_format", npz).name == "npz"  # the crashing claims claims nothing
    assert registry.claiming("checkpoint_format", tmp_path).name == "any"
    checkpoint = open_checkpoint(npz, registry)
    assert read_hf_config(checkpoint) == {"architectures": ["NpzForCausalLM"]}
    assert list(checkpoint.iter_weights()) == [("w", 1.0)]
    with pytest.raises(ValueError, match="tool_parser specs claim nothing"):
        registry.claiming("tool_parser", npz)


def test_the_built_in_formats_open_a_directory_and_refuse_what_none_claims(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    registry = Registry.discover(allow=["builtin-formats"])
    checkpoint = open_checkpoint(tmp_path, registry)
    assert isinstance(checkpoint, SafetensorsCheckpoint) and checkpoint.hf_config() == config
    (tmp_path / "notes.txt").write_text("no model here")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint format reads .*notes.txt, which is a file \(formats: safetensors, gguf"):
        open_checkpoint(tmp_path / "notes.txt", registry)


def test_every_kind_is_listed_with_its_hook() -> None:
    registry = Registry()
    specs = {
        "pluginfer_models": ModelSpec(name="m", factory="m:f"),
        "pluginfer_collectives": CollectiveSpec(name="c", factory="m:f", launchers=("mpi",)),
        "pluginfer_tool_parsers": ToolParserSpec(name="t", factory="m:f"),
        "pluginfer_reasoning_parsers": ReasoningParserSpec(name="r", factory="m:f"),
        "pluginfer_endpoints": EndpointSpec(name="e", factory="m:f"),
        "pluginfer_request_processors": RequestProcessorSpec(name="p", factory="m:f"),
        "pluginfer_checkpoint_formats": CheckpointFormatSpec(name="f", factory="m:f", claims="m:c"),
        "pluginfer_multimodal_processors": MultimodalProcessorSpec(name="i", factory="m:f"),
    }
    for hook, spec in specs.items():
        registry.register(plugin(hook, spec), name=f"plug-{spec.kind}")
    listing = registry.describe()
    for hook, spec in specs.items():
        assert f"plug-{spec.kind} (in-process)\n  hooks: {hook}\n  {spec.kind} {spec.name} - usable" in listing
    assert registry.for_launcher("collective", "mpi").name == "c"


EXTRA = {"checkpoint_format": {"claims": "m:c"}}


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_resolves_names_and_aliases_and_reports_unknown_and_broken(kind: str) -> None:
    spec_class = SPEC_CLASSES[kind]
    registry = Registry()
    spec = spec_class(name="thing", aliases=("Alias",), factory="no_such_module_anywhere:build", **EXTRA.get(kind, {}))
    registry.register(plugin(HOOKS_BY_KIND[kind], spec), name="p")
    assert registry.resolve(kind, "ALIAS") is spec and registry.specs(kind) == [spec]
    with pytest.raises(UnknownPluginError, match=f"no {kind} plugin named 'nope'; available: Alias, thing"):
        registry.resolve(kind, "nope")
    with pytest.raises(BrokenPluginError, match=f"plugin p .*cannot import factory 'no_such_module_anywhere:build' "
                                                f"of {kind} 'thing': ModuleNotFoundError"):
        registry.load(kind, "thing")
    registry.register(plugin(HOOKS_BY_KIND[kind], spec_class(name="thing", factory="m:f", **EXTRA.get(kind, {}))),
                      name="q")
    with pytest.raises(DuplicatePluginError, match=f"{kind} name 'thing' is claimed by plugin p .* and plugin q"):
        registry.resolve(kind, "thing")


def test_multimodal_processors_are_found_by_the_checkpoints_architectures(site: Path) -> None:
    (site / "mm_images.py").write_text("def build(model_path, hf_config, tokenizer):\n    return 'processor'\n")
    registry = Registry()
    spec = MultimodalProcessorSpec(name="images", architectures=("PicForConditionalGeneration",),
                                   factory="mm_images:build")
    registry.register(plugin("pluginfer_multimodal_processors", spec), name="pics")
    factory = registry.multimodal_processor(["SomethingElse", "PicForConditionalGeneration"])
    assert factory("dir", {}, None) == "processor"
    assert registry.multimodal_processor(["LlamaForCausalLM"]) is None  # text only
    assert registry.multimodal_processor(["picforconditionalgeneration"]) is None  # architectures keep their case
    broken = MultimodalProcessorSpec(name="gone", architectures=("GoneForConditionalGeneration",),
                                     factory="no_such_module_anywhere:build")
    registry.register(plugin("pluginfer_multimodal_processors", broken), name="gone")
    with pytest.raises(BrokenPluginError, match="cannot import factory 'no_such_module_anywhere:build' of "
                                                "multimodal_processor 'gone'"):
        registry.multimodal_processor(["GoneForConditionalGeneration"])
    assert "multimodal_processor images [PicForConditionalGeneration] - usable" in registry.describe()


def test_the_built_in_vision_models_register_their_processors_as_plugins() -> None:
    registry = Registry.discover()
    names = {spec.name: spec.architectures for spec in registry.specs("multimodal_processor")}
    assert names["qwen2-vl-images"] == ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
    assert names["llava-images"] == ("LlavaForConditionalGeneration",)
    assert registry.multimodal_processor(["Qwen2ForCausalLM"]) is None
