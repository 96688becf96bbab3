"""The backend conformance kit (``pluginfer.testing.backend_contract``) passes every backend pluginfer ships and
the out-of-tree gcu plugin, and fails a broken backend naming the member that broke the protocol."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.kernels import OPS
from pluginfer.core.protocols import KVCacheSpec
from pluginfer.core.registry import get_registry
from pluginfer.layers.backend_base import BaseDeviceBackend
from pluginfer.testing.backend_contract import check_backend
from tests.backends.cuda_interpreted import environment

HALF = (torch.float32, torch.bfloat16, torch.float16)
CPU_TABLE_OPS = ("dense_layout", "dense_pack", "dense_linear")


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch-path"])
def test_cpu_backend(native: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLUGINFER_NATIVE", native)
    build = get_registry().load("backend", "cpu")
    backend = check_backend(lambda: build(None, None), ops=CPU_TABLE_OPS, dtypes=HALF)
    assert backend.name == "cpu"


def test_metal_backend_on_a_cpu_stand_in() -> None:
    from pluginfer.backends.metal import MetalBackend

    check_backend(MetalBackend(device=torch.device("cpu")), dtypes=HALF)


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="torch sees no MPS device here (the metal "
                    "backend's contract on the real device needs Apple hardware; its CPU stand-in runs above)")
def test_metal_backend_on_mps() -> None:
    check_backend(get_registry().load("backend", "metal")(None, None), dtypes=HALF)


def test_gcu_plugin_backend_on_a_cpu_stand_in() -> None:
    if importlib.util.find_spec("pluginfer_gcu") is None:
        pytest.skip("plugins/pluginfer-gcu is not installed (pip install -e ./plugins/pluginfer-gcu)")
    from pluginfer_gcu.backend import GcuBackend

    backend = check_backend(GcuBackend(device=torch.device("cpu")), dtypes=HALF)
    assert backend.default_collective == "eccl"


_CUDA = """
import sys, torch
from pluginfer.backends.cuda import CudaBackend
from pluginfer.quant import compressed_tensors, ggml_ops, int8, marlin_layout, packing  # the modules defining quant ops
from pluginfer.layers import lora  # defines lora_sgmv
from pluginfer.testing.backend_contract import check_backend
ops = CudaBackend().kernels.names()  # every op it registers a Triton kernel for
assert "rms_norm" in ops and "ggml_q4_k_matmul" in ops, ops
backend = check_backend(CudaBackend, ops=ops, dtypes=(torch.float32, torch.bfloat16, torch.float16))
print("checked", backend.device)
"""


@pytest.mark.parametrize("interpret", [True, False], ids=["triton-interpreter", "gpu"])
def test_cuda_backend(interpret: bool) -> None:
    """Its Triton kernels under ``TRITON_INTERPRET=1`` on CPU tensors (read once, at import: a subprocess), and
    compiled for the GPU where there is one (CUDA graphs then checked by ``capture_decode``'s part)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton; the test extra has it)")
    if not interpret and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    done = subprocess.run([sys.executable, "-c", _CUDA], env=environment(interpret), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split()[-1] == ("cpu" if interpret else "cuda:0")


# -- broken backends: the kit names what broke -------------------------------------------------------------
class Reference(BaseDeviceBackend):
    """The base class as it is: the kernel table's references on the CPU."""

    name = "reference"

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))


def test_the_base_class_alone_passes() -> None:
    check_backend(Reference, dtypes=HALF)


class NoSoftCap(Reference):
    def paged_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, scale: float,
                        sliding_window: int | None = None, logit_soft_cap: float | None = None) -> torch.Tensor:
        return super().paged_attention(query, key, value, kv_cache, batch, scale, sliding_window, None)


class ValueOfItsOwn(Reference):
    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, block_size: int,
                          dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        caches = super().allocate_kv_cache(spec, num_blocks, block_size, dtype)
        return [(key, value.clone()) for key, value in caches]


class HeadsAndDimSwapped(Reference):
    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, block_size: int,
                          dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(key.transpose(2, 3), value.transpose(2, 3))
                for key, value in super().allocate_kv_cache(spec, num_blocks, block_size, dtype)]


class CopiesBackwards(Reference):
    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]) -> None:
        super().copy_blocks(kv_caches, [(dst, src) for src, dst in copies])


class KeysOnly(Reference):
    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]) -> None:
        for key, _ in kv_caches:
            for src, dst in copies:
                key[dst] = key[src]


class AnswersEveryOp(Reference):
    def op(self, name: str) -> object:
        return OPS["rms_norm"].reference


class IgnoresTheRequest(Reference):
    def kv_cache_budget_bytes(self, requested: int | None, fraction: float) -> int:
        return 1 << 30


class StaleReplay(Reference):
    """A replay that answers the logits of the first step it saw, every step after."""

    def capture_decode(self, forward: object, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> object:
        seen: list[torch.Tensor] = []

        def replay(batch: ForwardBatch) -> torch.Tensor:
            batch.attention = self.prepare(batch)
            logits = forward(batch)
            if not seen:
                seen.append(logits)
            return seen[0]

        return replay


class EagerReplay(Reference):
    """A correct replay: the step run as the worker would run it."""

    def capture_decode(self, forward: object, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> object:
        def replay(batch: ForwardBatch) -> torch.Tensor:
            batch.attention = self.prepare(batch)
            return forward(batch)

        return replay


class Unnamed(Reference):
    name = ""

    def __init__(self) -> None:
        self.device = torch.device("cpu")


@pytest.mark.parametrize(("broken", "message"), [
    (NoSoftCap, r"DeviceBackend\.paged_attention \(window_soft_cap, torch\.float32\): differs from the kernel "
                r"table's reference"),
    (ValueOfItsOwn, r"DeviceBackend\.allocate_kv_cache: .*value_in_key=16.*the value must be a view of the key"),
    (HeadsAndDimSwapped, r"DeviceBackend\.allocate_kv_cache: .*layer 0 key: shape \(16, 4, 16, 2\), expected "
                         r"\[>= 16, 4, 2, 16\]"),
    (CopiesBackwards, r"DeviceBackend\.copy_blocks: .*after copies \[\(3, 12\), \(5, 0\), \(9, 14\)\]"),
    (KeysOnly, r"DeviceBackend\.copy_blocks: KVCacheSpec\(num_layers=2, num_kv_heads=2, .*layer 0"),
    (AnswersEveryOp, r"DeviceBackend\.op\('no_backend_has_this_op'\): an op name no plugin defined must raise KeyError"),
    (IgnoresTheRequest, r"DeviceBackend\.kv_cache_budget_bytes: a requested budget of 12345 bytes came back as "
                        r"1073741824"),
    (StaleReplay, r"DeviceBackend\.capture_decode: step 1: the replay's logits differ from the eager step's"),
    (Unnamed, r"DeviceBackend\.name: a non-empty str, got ''"),
], ids=lambda value: value.__name__ if isinstance(value, type) else "")
def test_a_broken_backend_fails_naming_the_member(broken: type, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_backend(broken)


def test_a_claimed_op_the_backend_lacks_is_named() -> None:
    with pytest.raises(AssertionError, match=r"DeviceBackend\.op\('rms_norm'\): the backend claims this op; got "
                                             r"None, not a callable"):
        check_backend(Reference, ops=["rms_norm"])


def test_a_replay_equal_to_the_eager_step_passes() -> None:
    check_backend(EagerReplay)


def test_an_object_missing_a_member_is_named() -> None:
    class Bare:
        name, device, default_collective, quant_kernels_required = "bare", torch.device("cpu"), "gloo", False

    with pytest.raises(AssertionError, match=r"DeviceBackend\.kv_cache_budget_bytes: Bare does not have it"):
        check_backend(Bare())
