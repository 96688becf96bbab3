"""plugins/pluginfer-gcu without Enflame hardware: discovery, the availability report, selection errors, the
backend with its device set to the CPU, and the eccl collective's code path run over gloo against the
collective contract. Nothing here has run on a GCU or with the real ``torch_gcu``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pluginfer import LLM
from pluginfer.core.protocols import KVCacheSpec
from pluginfer.core.registry import Registry
from pluginfer.layers import attention_ops

try:
    importlib.metadata.distribution("pluginfer-gcu")
except importlib.metadata.PackageNotFoundError:  # the README test command installs it
    pytest.skip("plugins/pluginfer-gcu is not installed (pip install -e ./plugins/pluginfer-gcu)",
                allow_module_level=True)

from pluginfer_gcu import collective, device  # noqa: E402 - after the installed check
from pluginfer_gcu.backend import GcuBackend  # noqa: E402

from tests.backends.paged import paged_batch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MISSING = "torch_gcu is not installed (Enflame's PyTorch extension"
needs_no_torch_gcu = pytest.mark.skipif(importlib.util.find_spec("torch_gcu") is not None,
                                        reason="torch_gcu is installed here")


def test_discovered_from_its_entry_point() -> None:
    registry = Registry.discover()
    info = next(p for p in registry.plugins if p.distribution == "pluginfer-gcu")
    assert info.error is None and info.version == "0.1.0"
    assert registry.resolve("backend", "gcu").factory == "pluginfer_gcu.backend:build"
    assert registry.resolve("collective", "eccl").factory == "pluginfer_gcu.collective:build"


def test_importing_the_plugin_module_touches_nothing() -> None:
    code = ("import sys, pluginfer_gcu.plugin; "
            "print([m for m in ('torch_gcu', 'pluginfer_gcu.backend', 'pluginfer_gcu.collective', "
            "'pluginfer_gcu.device', 'torch') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@needs_no_torch_gcu
def test_listed_unusable_with_the_reason() -> None:
    registry = Registry.discover()
    for kind, name in (("backend", "gcu"), ("collective", "eccl")):
        usable, reason = registry.usable(registry.resolve(kind, name))
        assert not usable and reason.startswith(MISSING), (kind, reason)
    listing = registry.describe()
    assert f"backend gcu: Enflame GCUs through torch_gcu (gcu:local_rank), torch attention - not usable here: " \
           f"{MISSING}" in listing
    assert "collective eccl: " in listing


@needs_no_torch_gcu
def test_pluginfer_plugins_command_lists_them_unusable() -> None:
    done = subprocess.run([sys.executable, "-m", "pluginfer", "plugins"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if "backend gcu" in line or "collective eccl" in line]
    assert len(lines) == 2 and all(f"not usable here: {MISSING}" in line for line in lines), done.stdout


@needs_no_torch_gcu
def test_selecting_either_fails_at_start_with_the_reason(tiny_llama_checkpoint) -> None:
    path = str(tiny_llama_checkpoint[0])
    with pytest.raises(RuntimeError, match=r"backend plugin 'gcu' cannot run here: torch_gcu is not installed"):
        LLM(model=path, backend="gcu", num_blocks=8)
    with pytest.raises(RuntimeError, match=r"collective plugin 'eccl' cannot run here: torch_gcu is not installed"):
        LLM(model=path, backend="cpu", collective="eccl", num_blocks=8)
    from pluginfer_gcu.backend import build

    with pytest.raises(RuntimeError, match="backend gcu cannot run here: torch_gcu is not installed"):
        build()


@pytest.mark.parametrize("module_text,reason", [
    ("raise ImportError('libtopsrt.so: cannot open shared object file')",
     "torch_gcu fails to import: ImportError: libtopsrt.so: cannot open shared object file"),
    ("", "no GCU device"),  # imports, registers nothing: torch sees no gcu accelerator
], ids=["broken-driver", "no-device"])
def test_checks_with_a_stand_in_torch_gcu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module_text: str,
                                          reason: str) -> None:
    (tmp_path / "torch_gcu.py").write_text(module_text + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_gcu", raising=False)
    try:
        assert device.why_not_usable() == reason
        assert collective.why_not_usable() == reason
    finally:
        sys.modules.pop("torch_gcu", None)


def test_backend_attention_on_the_cpu_equals_the_reference() -> None:
    backend = GcuBackend(device=torch.device("cpu"))
    assert backend.default_collective == "eccl" and backend.op("rms_norm") is None
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16)
    key_cache, value_cache = backend.allocate_kv_cache(spec, 16, 4, torch.float32)[0]
    generator = torch.Generator().manual_seed(0)
    key_cache.normal_(generator=generator)
    value_cache.normal_(generator=generator)
    tables, seq_lens, query_lens = [[3, 1], [7, 2, 9], [0, 4, 5, 6]], [6, 9, 14], [1, 1, 6]
    query = torch.randn(8, 4, 16, generator=generator)
    key, value = torch.randn(8, 2, 16, generator=generator), torch.randn(8, 2, 16, generator=generator)
    from pluginfer.backends.cpu.backend import (
        CpuBackend,  # the test's oracle; the plugin itself never imports it
    )

    reference = CpuBackend(native_kernels=False)
    expected = reference.paged_attention(query, key, value, (key_cache.clone(), value_cache.clone()),
                                         paged_batch(reference, tables, seq_lens, query_lens, 4), 0.25, 5, 2.0)
    ours = backend.paged_attention(query, key, value, (key_cache, value_cache),
                                   paged_batch(backend, tables, seq_lens, query_lens, 4), 0.25, 5, 2.0)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    backend.copy_blocks([(key_cache, value_cache)], [(3, 12)])
    assert torch.equal(key_cache[12], key_cache[3]) and torch.equal(value_cache[12], value_cache[3])
    latent = backend.allocate_kv_cache(KVCacheSpec(1, 1, 24, value_in_key=16), 4, 4, torch.float16)[0]
    assert latent[1].data_ptr() == latent[0][..., 24 - 16:].data_ptr() and latent[1].shape[-1] == 16
    assert isinstance(backend.prepare(paged_batch(backend, tables, seq_lens, query_lens, 4)),
                      attention_ops.PagedAttentionMetadata)


def test_backend_without_a_memory_probe_names_the_fields_to_set() -> None:
    backend = GcuBackend(device=torch.device("cpu"))
    assert backend.kv_cache_budget_bytes(4096, 0.3) == 4096
    with pytest.raises(ValueError, match="set cache.kv_cache_memory .* or cache.num_blocks"):
        backend.kv_cache_budget_bytes(None, 0.3)


_RANK = """
import json, sys
from pluginfer.core.config import EngineConfig
from pluginfer.core.protocols import RankInfo
from pluginfer.testing.collective_contract import check_contract
from pluginfer_gcu.collective import join_group
import torch
rank, port = int(sys.argv[1]), int(sys.argv[2])
config = EngineConfig(model="unused", parallel={"tensor_parallel_size": 2, "timeout_s": 30.0})
info = RankInfo(rank=rank, world_size=2, tp_size=2, local_rank=rank, local_world_size=2, master_port=port,
                launcher="spawn")
coll = join_group(config, info, torch.device("cpu"), library="gloo")
assert coll.gather_into_tensor and coll.backend == "gloo"
print(json.dumps(check_contract(coll, count_traffic=True)))
"""


def test_eccl_code_path_meets_the_collective_contract_over_gloo() -> None:
    """The eccl plugin's join (one all_gather_into_tensor per gather, as ECCL/NCCL do) on two processes, with
    gloo standing in for the ECCL library it cannot load here."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in range(2)]
    outputs = [rank.communicate(timeout=180) for rank in ranks]
    for rank, (_, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err[-3000:]
    stats = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert stats[0]["all_gather"] == stats[1]["all_gather"] and stats[0]["all_gather"][0] > 0
