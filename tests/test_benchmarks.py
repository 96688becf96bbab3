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
