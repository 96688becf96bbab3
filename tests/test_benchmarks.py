"""The lasting tools under benchmarks/: each answers --help, and --plot draws a small PNG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_every_benchmark_answers_help(script: str) -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower() or script == "serve_harness.py", done.stdout[:500]


def test_offline_throughput_plot_is_a_small_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import offline_throughput

    path = tmp_path / "plot.png"
    offline_throughput.plot(path, {"pluginfer": {1: 46.0, 4: 123.0, 16: 231.0},
                                   "transformers": {1: 34.0, 4: 76.0, 16: 119.0}}, "a title")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) < 60_000


def test_quant_throughput_modes_are_subcommands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import quant_throughput

    with pytest.raises(SystemExit) as exited:
        quant_throughput.main(["no-such-mode"])
    assert exited.value.code == 2


def test_a_widened_llama_computes_the_small_ones_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        tiny_tokenizer_dir: Path) -> None:
    """trained_llama.widen (the speculative benchmark's trained model at the 0.5B shape): more features, heads, KV
    heads, intermediate size and layers, the same logits as the small model in transformers."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import trained_llama

    torch.manual_seed(0)
    small = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                         initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False))
    small.save_pretrained(tmp_path / "small")
    AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)).save_pretrained(tmp_path / "small")
    trained_llama.widen(tmp_path / "small", tmp_path / "wide", hidden=256, layers=3, heads=4, kv_heads=2,
                        intermediate=384)
    wide = LlamaForCausalLM.from_pretrained(tmp_path / "wide")
    assert wide.config.num_hidden_layers == 3 and wide.config.hidden_size == 256
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = small(ids).logits, wide(ids).logits
    assert expected.abs().max() > 1  # logits that differ between tokens, not a flat zero
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_widen_refuses_a_shape_that_would_change_the_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import trained_llama

    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps(
        {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 192,
         "num_hidden_layers": 2, "head_dim": 64}))
    with pytest.raises(ValueError, match="grouping of query heads"):
        trained_llama.widen(tmp_path / "small", tmp_path / "wide", hidden=256, layers=3, heads=4, kv_heads=4,
                            intermediate=384)
    with pytest.raises(ValueError, match="only grows"):
        trained_llama.widen(tmp_path / "small", tmp_path / "wide", hidden=256, layers=1, heads=4, kv_heads=2,
                            intermediate=384)
