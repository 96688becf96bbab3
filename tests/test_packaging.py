"""Packaging: the wheel and the sdist of pluginfer and of the example plugin install into a
fresh environment that cannot see this checkout, and work there.

The environment is a venv without system site packages; the heavy dependencies (torch, transformers,
...) come from a directory of symlinks to this interpreter's site-packages minus every pluginfer
distribution and every editable install, named in a ``.pth`` file. A ``.pth`` line only appends a
path (it does not run the ``.pth`` files in it), so the editable finder of the checkout never loads;
the test asserts that ``import pluginfer`` fails before the install and resolves into the venv after.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = Path("plugins") / "pluginfer-example-granite"
C_SOURCES = sorted(p.name for p in (ROOT / "pluginfer" / "backends" / "cpu" / "csrc").iterdir() if p.suffix in (".c", ".h"))
WEB_FILES = sorted(p.name for p in (ROOT / "pluginfer" / "server" / "web").iterdir())  # the chat page at /
# What a build must not see of the working tree: the same as .gitignore.
UNTRACKED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", ".pytest_cache",
                                   ".ruff_cache", "logs", "*.so")

# Run in the installed environment: where pluginfer and its distributions come from, and whether the
# native kernels load (compiled from the installed sources into $PLUGINFER_CACHE).
PROBE = """
import importlib.metadata, importlib.util, json, pluginfer
from pluginfer.backends.cpu import ops as native, library as native_library
dists = [d for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").lower().startswith("pluginfer")]
granite = importlib.util.find_spec("pluginfer_granite")
print(json.dumps({
    "pluginfer": pluginfer.__file__, "version": pluginfer.__version__,
    "dists": sorted(f"{d.metadata['Name']} {d.version} {d.locate_file('')}" for d in dists),
    "granite": granite.origin if granite else None,
    "sources": [str(s) for s in native_library.SOURCES], "native": native.available(),
}))
"""

# Without a compiler: the cpu backend still builds, and says once how to get the kernels.
NO_COMPILER = """
import logging
from pluginfer.backends.cpu import backend as cpu
logging.basicConfig(level=logging.WARNING)
assert not cpu.build().native_kernels and not cpu.build().native_kernels
"""


def _version(pyproject: Path) -> str:
    return re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M).group(1)


def _run(cmd: list, cwd: Path, env: dict | None = None, timeout: float = 300) -> str:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (f"{' '.join(map(str, cmd))} exited {result.returncode}\n"
                                    f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def _build(project: Path, dist: Path) -> None:
    """sdist first (from a tree the wheel build has not touched), then the wheel; no build isolation."""
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
          dist], cwd=project)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist,
          "."], cwd=project)


def _editable(dist_info: Path) -> bool:
    try:
        return json.loads((dist_info / "direct_url.json").read_text()).get("dir_info", {}).get("editable", False)
    except (OSError, ValueError):
        return False


def _dependencies(target: Path) -> Path:
    """Symlinks to everything in this interpreter's site-packages but pluginfer's own distributions, editable
    installs and .pth files."""
    target.mkdir()
    dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    for directory in map(Path, dirs):
        if not directory.is_dir():
            continue
        for entry in directory.iterdir():
            name = entry.name.lower()
            if (name.startswith(("pluginfer", "__editable__", "__pycache__")) or name.endswith((".pth", ".egg-link"))
                    or (name.endswith(".dist-info") and _editable(entry)) or (target / entry.name).exists()):
                continue
            (target / entry.name).symlink_to(entry)
    return target


class Env:
    """A venv that sees the dependencies but not this checkout; commands run outside the checkout."""

    def __init__(self, root: Path, dependencies: Path) -> None:
        root.mkdir()
        self.root, self.venv, self.cache = root, root / "venv", root / "cache"
        _run([sys.executable, "-m", "venv", "--without-pip", self.venv], cwd=root)
        self.python = self.venv / "bin" / "python"
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PLUGINFER_PLUGINS", "CC")}
        self.env.update(PYTHONNOUSERSITE="1", PLUGINFER_CACHE=str(self.cache), VIRTUAL_ENV=str(self.venv),
                        PATH=f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        self.site = Path(self.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
        (self.site / "_pluginfer_test_dependencies.pth").write_text(f"{dependencies}\n")

    def run(self, program: str, *args: object, env: dict[str, str | None] | None = None) -> str:
        executable = self.python if program == "python" else self.venv / "bin" / program
        merged = {k: v for k, v in {**self.env, **(env or {})}.items() if v is not None}  # None: unset
        return _run([executable, *args], cwd=self.root, env=merged)

    def install(self, *artifacts: Path) -> None:
        self.run("python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                 *artifacts)

    def probe(self) -> dict:
        return json.loads(self.run("python", "-c", PROBE).strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(dist directory with both projects' wheels and sdists, dependency directory)."""
    pytest.importorskip("setuptools", reason="building without isolation needs setuptools installed")
    tmp = tmp_path_factory.mktemp("packaging")
    source, dist = tmp / "source", tmp / "dist"
    shutil.copytree(ROOT, source, ignore=UNTRACKED, symlinks=True)  # builds write build/ and egg-info
    _build(source, dist)
    _build(source / PLUGIN, dist)
    return dist, _dependencies(tmp / "dependencies")


def _artifacts(dist: Path, kind: str) -> list[Path]:
    found = sorted(dist.glob("pluginfer-*.whl" if kind == "wheel" else "pluginfer-*.tar.gz"))
    found += sorted(dist.glob("pluginfer_example_granite-*.whl" if kind == "wheel"
                              else "pluginfer_example_granite-*.tar.gz"))
    assert len(found) == 2, f"expected pluginfer's and the plugin's {kind}, found {os.listdir(dist)}"
    return found


def test_the_wheel_and_the_sdist_carry_the_c_sources(built: tuple[Path, Path]) -> None:
    dist, _ = built
    assert C_SOURCES, "pluginfer/backends/cpu/csrc has no C sources"
    (wheel, _), (sdist, _) = _artifacts(dist, "wheel"), _artifacts(dist, "sdist")
    in_wheel = zipfile.ZipFile(wheel).namelist()
    with tarfile.open(sdist) as archive:
        in_sdist = archive.getnames()
    for name in C_SOURCES:
        assert f"pluginfer/backends/cpu/csrc/{name}" in in_wheel
        assert any(n.endswith(f"/pluginfer/backends/cpu/csrc/{name}") for n in in_sdist), name
    assert "pluginfer/demo/corpus.txt" in in_wheel
    assert {"index.html", "chat.js", "chat.css", "markdown.js"} <= set(WEB_FILES), WEB_FILES
    for name in WEB_FILES:
        assert f"pluginfer/server/web/{name}" in in_wheel, name
        assert any(n.endswith(f"/pluginfer/server/web/{name}") for n in in_sdist), name


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_package_works_without_the_checkout(built: tuple[Path, Path], kind: str,
                                                      tmp_path: Path) -> None:
    from pluginfer.backends.cpu import ops as native

    dist, dependencies = built
    env = Env(tmp_path / kind, dependencies)
    with pytest.raises(AssertionError, match="ModuleNotFoundError"):  # the checkout is not on this path
        env.run("python", "-c", "import pluginfer")
    env.install(*_artifacts(dist, kind))

    probe = env.probe()
    version, plugin_version = _version(ROOT / "pyproject.toml"), _version(ROOT / PLUGIN / "pyproject.toml")
    assert Path(probe["pluginfer"]).is_relative_to(env.site), probe
    assert Path(probe["granite"]).is_relative_to(env.site), probe
    assert probe["dists"] == [f"pluginfer {version} {env.site}",
                              f"pluginfer-example-granite {plugin_version} {env.site}"], probe
    assert probe["version"] == version
    assert all(Path(s).is_relative_to(env.site) and Path(s).is_file() for s in probe["sources"]), probe
    here = native.available()
    if here is None:  # the kernels load in this process, so they must load from the installed sources
        assert probe["native"] is None, f"native kernels load here but not from the {kind}: {probe['native']}"
        assert list((env.cache / "native").glob("*.so")), "no kernel library compiled into $PLUGINFER_CACHE"
    else:
        assert probe["native"] is not None

    listing = env.run("pluginfer", "plugins")
    assert f"builtin-backends (pluginfer {version})" in listing, listing
    assert f"granite (pluginfer-example-granite {plugin_version})" in listing, listing
    assert "model granite" in listing and "BROKEN" not in listing, listing

    output = env.run("pluginfer", "generate", "--model", "demo", "--prompt", "hi", "--max-tokens", "4")
    assert output.strip(), "the demo generation printed nothing"
    if here is None:
        assert "native kernels unavailable" not in output, output

    if kind == "wheel":  # no compiler on PATH: still works, and says once how to get the kernels
        empty = tmp_path / "no-compiler"
        empty.mkdir()
        log = env.run("python", "-c", NO_COMPILER, env={"PATH": str(empty), "PLUGINFER_NATIVE": None,
                                                         "PLUGINFER_CACHE": str(tmp_path / "cache-no-compiler")})
        warnings = [line for line in log.splitlines() if "native kernels unavailable" in line]
        assert len(warnings) == 1, log
        assert "no C compiler" in warnings[0] and "install a C compiler" in warnings[0], warnings
