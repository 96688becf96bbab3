"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained on pluginfer/demo/corpus.txt, saved once per session."""
    from pluginfer.demo.tokenizer import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


# A llama small enough to build in well under a second: hidden 64, 2 layers, GQA (4 heads, 2 KV heads).
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory: pytest.TempPathFactory,
                          tiny_tokenizer_dir: Path) -> tuple[Path, object]:
    """(directory, transformers model) of a float32 single-file tiny llama; copy it before editing."""
    from tests.checkpoints import save_hf_model

    out = tmp_path_factory.mktemp("tiny_llama")
    model = save_hf_model("LlamaForCausalLM", TINY_LLAMA, out, tiny_tokenizer_dir)
    return out, model


@pytest.fixture(scope="session")
def embedding_checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    """Tiny random embedding checkpoints with sentence-transformers files (tests/embedding_models.py)."""
    from tests.embedding_models import save_embedding_checkpoints

    return save_embedding_checkpoints(tmp_path_factory.mktemp("embedding_models"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def encoder_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random BERT / XLM-RoBERTa embedding models and cross-encoders (tests/encoder_models.py)."""
    from tests.encoder_models import save_encoder_checkpoints

    return save_encoder_checkpoints(tmp_path_factory.mktemp("encoder_models"))


@pytest.fixture
def unknown_architecture_checkpoint(tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path) -> Path:
    """The tiny llama with config.json claiming an architecture no plugin serves (FooForCausalLM, foo)."""
    import json
    import shutil

    path = tmp_path / "foo"
    shutil.copytree(tiny_llama_checkpoint[0], path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["FooForCausalLM"], model_type="foo")
    (path / "config.json").write_text(json.dumps(config))
    return path


# -- Skips that would hide code, and which native kernels ran (tests/native_usage.py) ---------------------


def pytest_configure(config: pytest.Config) -> None:
    from tests import native_usage

    native_usage.install()


def _hidden_by_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """A skip this machine has no excuse for (a missing hard dependency, native kernels that did not load on a
    CPU and compiler that support them, oneDNN that torch has) becomes a failure saying so."""
    from tests import native_usage

    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    reason = str(report.longrepr[2])
    why = native_usage.required(reason)
    if why is not None:
        report.outcome = "failed"
        report.longrepr = f"skipped ({reason}), but {why}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    _hidden_by_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    report = yield
    _hidden_by_skip(report)  # module-level importorskip of a hard dependency
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests import native_usage

    if hasattr(session.config, "workeroutput"):  # an xdist worker: its counts go to the controller
        session.config.workeroutput.update(native_usage.worker_output())


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a worker ended
def pytest_testnodedown(node, error) -> None:
    from tests import native_usage

    native_usage.merge_worker(getattr(node, "workeroutput", {}))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    from tests import native_usage

    terminalreporter.section("native kernel families exercised")
    for line in native_usage.summary_lines():
        terminalreporter.write_line(line)
