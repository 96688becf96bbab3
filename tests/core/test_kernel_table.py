"""The open kernel table (``core/kernels.py``): a plugin defines an op, backends implement it.

The oracle of each kernel here is the op's own torch reference (``torch.nn.functional.softmax``'s
arithmetic), the contract a plugin's op would carry.
"""

from __future__ import annotations

import pytest
import torch

from pluginfer.core import kernels
from pluginfer.core.kernels import KernelTable
from pluginfer.layers import ops  # noqa: F401 - defines rms_norm, which these tests collide with


def scaled_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(x * scale)`` over the last axis, in float32 (a test plugin's op)."""
    return torch.softmax(x.float() * scale, dim=-1)


@pytest.fixture
def scaled_softmax_op() -> str:
    kernels.define_op(scaled_softmax)
    yield "scaled_softmax"
    kernels.OPS.pop("scaled_softmax", None)
    kernels.withdraw("test-device", "scaled_softmax")


def test_a_plugin_defines_an_op_and_a_backend_implements_it(scaled_softmax_op: str) -> None:
    table = KernelTable("test-device")
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    assert table.implementation(scaled_softmax_op) is None
    torch.testing.assert_close(table.get(scaled_softmax_op)(x, 0.5), torch.nn.functional.softmax(x * 0.5, dim=-1))

    def fast_softmax(x: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.exp(x * scale - (x * scale).logsumexp(-1, keepdim=True))  # a trailing defaulted parameter

    table.register(scaled_softmax_op, fast_softmax)
    assert table.get(scaled_softmax_op) is fast_softmax
    torch.testing.assert_close(fast_softmax(x, 0.5), scaled_softmax(x, 0.5))


def test_defining_the_same_function_twice_is_no_error_another_one_is(scaled_softmax_op: str) -> None:
    kernels.define_op(scaled_softmax)  # a module imported twice

    def other(x: torch.Tensor, scale: float) -> torch.Tensor:
        """Another contract under the same name."""
        return x

    with pytest.raises(ValueError, match="'scaled_softmax' is already defined by .*test_kernel_table.scaled_softmax"):
        kernels.define_op(other, name="scaled_softmax")
    with pytest.raises(ValueError, match="'rms_norm' is already defined by pluginfer.layers.ops.rms_norm"):
        kernels.define_op(other, name="rms_norm")


def test_an_op_needs_a_documented_reference() -> None:
    def undocumented(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match="needs a docstring"):
        kernels.define_op(undocumented)
    assert "undocumented" not in kernels.OPS


def test_unknown_names_fail_naming_the_nearest(scaled_softmax_op: str) -> None:
    table = KernelTable("test-device")
    with pytest.raises(KeyError, match="no kernel op named 'scaled_softmx'; did you mean 'scaled_softmax'"):
        table.get("scaled_softmx")
    with pytest.raises(KeyError, match="did you mean 'rms_norm'"):
        table.implementation("rms_nrom")
    with pytest.raises(KeyError, match="did you mean 'rms_norm'"):
        kernels.lookup("rmsnorm")


def test_a_kernel_whose_parameters_differ_is_refused(scaled_softmax_op: str) -> None:
    table = KernelTable("test-device")
    with pytest.raises(TypeError, match=r"takes \(x, factor\); the op's signature is \(x, scale\)"):
        table.register(scaled_softmax_op, lambda x, factor: x)
    with pytest.raises(TypeError, match=r"takes \(x, scale, out\)"):  # an extra parameter without a default
        table.register(scaled_softmax_op, lambda x, scale, out: x)
    assert scaled_softmax_op not in table
    with pytest.raises(TypeError, match="kernel supplied for backend 'test-device'"):
        kernels.implement("test-device", scaled_softmax_op, lambda y: y)


def test_a_kernel_registered_before_its_op_is_checked_at_lookup() -> None:
    table = KernelTable("test-device")
    table.register("scaled_softmax", lambda x, factor: x)  # the defining module is not imported yet
    with pytest.raises(KeyError, match="undefined op: no kernel op named 'scaled_softmax'"):
        table.check()
    try:
        kernels.define_op(scaled_softmax)
        with pytest.raises(TypeError, match=r"the op's signature is \(x, scale\)"):
            table.get("scaled_softmax")
    finally:
        kernels.OPS.pop("scaled_softmax", None)


def test_a_plugin_supplies_its_op_for_a_named_backend(scaled_softmax_op: str) -> None:
    def softmax_for_test_device(x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.softmax(x.double() * scale, dim=-1).float()

    kernels.implement("test-device", scaled_softmax_op, softmax_for_test_device)
    assert KernelTable("test-device").implementation(scaled_softmax_op) is softmax_for_test_device
    assert KernelTable("other-device").implementation(scaled_softmax_op) is None
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(softmax_for_test_device(x, 2.0), scaled_softmax(x, 2.0))
    own = KernelTable("test-device")
    own.register(scaled_softmax_op, scaled_softmax)  # the backend's own registration comes first
    assert own.get(scaled_softmax_op) is scaled_softmax


def test_a_choice_is_made_at_each_lookup(scaled_softmax_op: str) -> None:
    table = KernelTable("test-device")
    offered: list = [None]
    table.register_choice(scaled_softmax_op, lambda: offered[0])
    assert table.get(scaled_softmax_op) is scaled_softmax  # nothing chosen: the reference
    offered[0] = torch.softmax  # a builtin without a signature is trusted
    assert table.implementation(scaled_softmax_op) is torch.softmax


def test_every_op_the_cpu_backend_registers_is_defined() -> None:
    """Once the modules that define ops are imported, the cpu backend's table names only defined ops."""
    from pluginfer.backends.cpu import backend
    from pluginfer.quant import compressed_tensors, ggml_ops, int4, packing  # noqa: F401  (they define the quant ops)

    table = backend.CpuBackend(native_kernels=False).kernels
    table.check()
    assert {"ggml_dequantize", "grouped_dequantize", "int4_dequantize", "half_linear", "rms_norm",
            "w8a8_pack", "w8a8_linear"} <= set(table.names())
