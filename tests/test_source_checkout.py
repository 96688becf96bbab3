"""A source checkout that was never installed (no entry points anywhere) still has the built-in plugins.

The checkout is a directory holding only a link to ``pluginfer/`` (a fresh clone has no egg-info); the
dependencies come from a directory of links to site-packages minus pluginfer's distributions, editable
finders and ``.pth`` files; ``python -S`` keeps site.py (and so every ``.pth``) out.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

from pluginfer.builtin_plugins import DEFAULT_PLUGINS

ROOT = Path(__file__).resolve().parents[1]


def _dependencies(target: Path) -> Path:
    target.mkdir()
    for directory in map(Path, site.getsitepackages()):
        for entry in directory.iterdir() if directory.is_dir() else ():
            name = entry.name.lower()
            if name.startswith(("pluginfer", "__editable__", "__pycache__")) or name.endswith((".pth", ".egg-link")):
                continue
            if not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
    return target


def test_builtin_plugins_load_from_a_checkout_that_was_never_installed(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "pluginfer").symlink_to(ROOT / "pluginfer")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "PLUGINFER_CACHE": str(tmp_path / "cache"),
           "PLUGINFER_NATIVE": "0", "PYTHONPATH": os.pathsep.join([str(clone), str(_dependencies(tmp_path / "deps"))])}

    def run(*args: str) -> str:
        result = subprocess.run([sys.executable, "-S", *args], cwd=clone, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    seen = run("-c", "import importlib.metadata as m, pluginfer; "
                     "print(pluginfer.__file__, [d.metadata['Name'] for d in m.distributions() "
                     "if d.metadata['Name'].lower().startswith('pluginfer')])")
    assert seen.split()[0].startswith(str(clone)) and seen.strip().endswith("[]"), seen

    listing = run("-m", "pluginfer", "plugins")
    for name in DEFAULT_PLUGINS:
        assert listing.count(f"{name} (pluginfer 0+unknown, from source)") == 1, listing
    assert "BROKEN" not in listing
    assert "model llama [llama3, mistral, yi, LlamaForCausalLM, MistralForCausalLM]: Llama 1-3" in listing
    assert "  hooks: pluginfer_backends" in listing
    assert "native kernels: not loaded (disabled by PLUGINFER_NATIVE=0); torch path" in listing
