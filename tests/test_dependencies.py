"""Every dependency pluginfer declares (and its ``test`` extra, which the README's test command installs) is
installed: a missing one fails here naming it, instead of silently skipping the tests that need it
(tests/conftest.py also turns an importorskip of such a module into a failure)."""

from __future__ import annotations

import importlib.metadata

import pytest

from tests import native_usage

REQUIREMENTS = native_usage.requirements()


def test_requirements_are_known() -> None:
    names = {native_usage.distribution_name(r) for r in REQUIREMENTS}
    assert {"torch", "gguf", "aiohttp", "openai"} <= names, names


@pytest.mark.parametrize("requirement", REQUIREMENTS)
def test_dependency_is_installed(requirement: str) -> None:
    name = native_usage.distribution_name(requirement)
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{name} ({requirement}) is a dependency of pluginfer (pyproject.toml) but is not installed: "
                    f"pip install -e '.[test]'", pytrace=False)


def test_a_skip_for_a_missing_dependency_becomes_a_failure() -> None:
    assert native_usage.required("could not import 'gguf': No module named 'gguf'") is not None
    assert "aiohttp" in native_usage.required("could not import 'aiohttp.web': No module named 'aiohttp'")
    assert native_usage.required("could not import 'not_a_dependency': No module named 'not_a_dependency'") is None


def test_a_skip_for_a_missing_browser_fails_under_ci_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/server/web_chat/ skips without Chromium: a developer may lack it, CI installs it (.ci/run)."""
    reason = f"{native_usage.NO_BROWSER}: install Debian's chromium"
    monkeypatch.delenv("CI", raising=False)
    assert native_usage.required(reason) is None
    monkeypatch.setenv("CI", "true")
    assert "chromium" in native_usage.required(reason)
