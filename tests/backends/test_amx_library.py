"""library.load_amx: the reasons it gives for no AMX library, checked in the order the AMX modules rely on."""

from __future__ import annotations

import ctypes
import logging

import pytest

from pluginfer.backends.cpu import amx_half, library
from pluginfer.backends.cpu import build as native_build


def test_the_switch_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(library.AMX_ENV, "0")
    assert library.load_amx("amx_half", amx_half.SOURCES, frozenset({"no_such_feature"}), "X", []) == (
        None, "PLUGINFER_AMX=0")


def test_a_cpu_without_the_features_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(library.AMX_ENV, "1")
    assert library.load_amx("amx_half", amx_half.SOURCES, frozenset({"no_such_feature"}), "AMX-NOTHING", []) == (
        None, "this CPU has no AMX-NOTHING")


def test_native_off_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(library.AMX_ENV, "1")
    monkeypatch.setenv("PLUGINFER_NATIVE", "0")
    assert library.load_amx("amx_half", amx_half.SOURCES, frozenset(), "AMX-BF16", []) == (
        None, "PLUGINFER_NATIVE=0")


def test_loads_with_the_signatures_set_where_the_cpu_has_amx_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    features = frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})
    if not features <= native_build.cpu_features():
        pytest.skip("this CPU has no AMX-BF16")
    monkeypatch.setenv(library.AMX_ENV, "1")
    monkeypatch.delenv("PLUGINFER_NATIVE", raising=False)
    signature = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    loaded, why = library.load_amx("amx_half", amx_half.SOURCES, features, "AMX-BF16",
                                   [("amx_half_linear", ctypes.c_int, signature)])  # a CDLL of its own
    if loaded is None:
        pytest.skip(why)
    assert why is None
    assert loaded.amx_half_linear.argtypes == signature
    assert loaded.amx_half_compiled.restype is ctypes.c_int


def test_load_once_logs_once_and_caches(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(library.AMX_ENV, "0")
    cache: list = []
    message = "test_load_once: no tiles ({why}) " + str(id(cache))
    with caplog.at_level(logging.INFO, logger="pluginfer.backends.cpu.library"):
        for _ in range(2):
            assert library.load_amx_once(cache, message, "ready", "amx_half", amx_half.SOURCES, frozenset(), "X",
                                         []) is None
    assert cache == [None]
    assert [r.getMessage() for r in caplog.records].count(message.format(why="PLUGINFER_AMX=0")) == 1
