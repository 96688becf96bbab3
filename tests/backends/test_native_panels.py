"""The native panel GEMM (backends/csrc/panel_linear.c) against F.linear and its own layout definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import panels as native_panels

pytestmark = pytest.mark.skipif(native.available() is not None or native.op("panel_linear") is None,
                                reason="the panel kernel needs the native library on an AVX-512 CPU")


def test_packed_layout_is_panels_of_sixteen_outputs_padded_to_sixty_four() -> None:
    weight = torch.randn(70, 9)
    packed = native_panels.pack_panels(weight)
    assert packed.shape == (8, 9, 16)  # 70 outputs padded to 128 = 8 panels of 16
    for panel in range(8):
        expected = torch.zeros(16, 9)
        rows = weight[16 * panel:16 * panel + 16]
        expected[:rows.shape[0]] = rows
        assert torch.equal(packed[panel], expected.t())


# Row counts cover each tile (1-4 rows: 4 panels; 5-14: 2 panels; more: several row groups; past 112:
# several passes over the weight), outputs
# that end inside a panel or a panel pair, inputs across several 256-input blocks and not a multiple of it.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 14, 15, 16, 29, 70, 130])
@pytest.mark.parametrize(("outputs", "inputs"), [(64, 64), (70, 33), (100, 300), (1, 5), (31, 513), (256, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear(rows: int, outputs: int, inputs: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + outputs)
    weight = torch.randn(outputs, inputs, generator=generator)
    bias = torch.randn(outputs, generator=generator) if with_bias else None
    x = torch.randn(rows, inputs, generator=generator)
    out = native_panels.panel_linear(x, native_panels.pack_panels(weight), outputs, bias)
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    # float32 sums in another order: ~1e-6 relative to the sum's terms
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=2e-4 * inputs**0.5 / 16, rtol=1e-5)


def test_leading_dims_strided_input_and_no_rows() -> None:
    weight, bias = torch.randn(48, 40), torch.randn(48)
    packed = native_panels.pack_panels(weight)
    x = torch.randn(2, 3, 40)
    torch.testing.assert_close(native_panels.panel_linear(x, packed, 48, bias), F.linear(x, weight, bias))
    strided = torch.randn(40, 6).t()  # not contiguous
    torch.testing.assert_close(native_panels.panel_linear(strided, packed, 48, None), F.linear(strided, weight))
    assert native_panels.panel_linear(torch.empty(0, 40), packed, 48, None).shape == (0, 48)


def test_a_row_does_not_depend_on_the_batch_around_it() -> None:
    """Each output sums its inputs in one fixed order whatever the tile: batching never changes a row."""
    weight = torch.randn(200, 700)
    packed = native_panels.pack_panels(weight)
    batch = torch.randn(130, 700)
    alone = torch.cat([native_panels.panel_linear(batch[i:i + 1], packed, 200) for i in range(130)])
    for rows in (2, 4, 5, 16, 33, 130):
        assert torch.equal(native_panels.panel_linear(batch[:rows], packed, 200), alone[:rows])


def test_outputs_do_not_depend_on_the_thread_count(set_threads) -> None:
    """Bit for bit at one and two threads, for calls small enough to stay on the calling thread (one row of
    256 x 256) and for larger ones split across the threads: each output's sum has one order either way."""
    for rows, outputs, inputs in ((1, 256, 256), (1, 1536, 256), (2, 700, 300), (16, 256, 256), (130, 200, 700)):
        generator = torch.Generator().manual_seed(rows + outputs)
        weight, bias = torch.randn(outputs, inputs, generator=generator), torch.randn(outputs, generator=generator)
        x, packed = torch.randn(rows, inputs, generator=generator), native_panels.pack_panels(weight)
        set_threads(1)
        one = native_panels.panel_linear(x, packed, outputs, bias)
        set_threads(2)
        assert torch.equal(native_panels.panel_linear(x, packed, outputs, bias), one)


def test_bad_inputs_are_refused() -> None:
    packed = native_panels.pack_panels(torch.randn(16, 8))
    with pytest.raises(ValueError, match="float32 inputs of 8 features"):
        native_panels.panel_linear(torch.randn(2, 8, dtype=torch.float64), packed, 16)
    with pytest.raises(ValueError, match="float32 inputs of 8 features"):
        native_panels.panel_linear(torch.randn(2, 9), packed, 16)
    with pytest.raises(ValueError, match="2-d float32 CPU weight"):
        native_panels.pack_panels(torch.randn(16, 8).bfloat16())
