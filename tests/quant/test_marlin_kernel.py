"""The Triton Marlin kernel under ``TRITON_INTERPRET=1`` against ``x @ W`` with W dequantized in torch.

Triton reads ``TRITON_INTERPRET`` once, when it is first imported (its own ``tl.zeros`` & co. are
decorated then), so the kernel runs in a fresh interpreter: this file executed as a script, with
the variable set before anything imports triton. The tests read what the script reports.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pluginfer.quant import marlin_layout as layout

# float16: the kernel rounds each dequantized weight to float16 as Marlin does, then sums in float32;
# the reference multiplies in float32 throughout.
TOLERANCE = {"float32": dict(atol=1e-4, rtol=1e-4), "float16": dict(atol=2e-2, rtol=1e-2)}

# rows, size_k, size_n, group_size, asymmetric (AWQ zero points), dtype, leading dims
CASES = {
    "grouped-fp32": (3, 256, 128, 128, False, "float32", ()),
    "per-channel-fp32": (5, 128, 64, -1, False, "float32", ()),
    "zero-points-fp32": (2, 256, 64, 128, True, "float32", ()),
    "grouped-fp16-two-row-blocks": (17, 256, 128, 128, False, "float16", ()),
    "zero-points-per-channel-fp16": (4, 128, 192, -1, True, "float16", ()),
    "leading-dims": (3, 128, 64, 128, False, "float32", (2,)),
}
SLOW_CASES = {"larger-zero-points": (33, 512, 256, 128, True, "float32", ())}


def _run_case(kernel, rows, size_k, size_n, group_size, asymmetric, dtype_name, leading) -> dict:
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(rows * size_k + size_n)
    groups = 1 if group_size == -1 else size_k // group_size
    codes = torch.randint(0, 16, (size_k, size_n), generator=generator, dtype=torch.int32)
    scales = (torch.rand(groups, size_n, generator=generator) * 0.02 + 0.005).half()
    packed, permuted = layout.pack(codes, scales, group_size)
    zeros = None
    if asymmetric:
        zeros = layout.pack_zero_points(torch.randint(0, 16, (groups, size_n), generator=generator,
                                                      dtype=torch.int32))
    x = torch.randn(*leading, rows, size_k, generator=generator).to(dtype)
    bias = torch.randn(size_n, generator=generator).to(dtype)
    out = kernel.marlin_matmul(x, packed, permuted.to(dtype), group_size, zeros, bias, layout.position_table(x.device))
    dense = layout.dequantize(packed, permuted, size_k, size_n, group_size, zeros)
    expected = (x.float() @ dense + bias.float()).to(dtype)
    report = {"shape": list(out.shape), "dtype": str(out.dtype).removeprefix("torch."),
              "max_error": (out.float() - expected.float()).abs().max().item(), "error": None}
    try:
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype_name])
        torch.testing.assert_close(layout.matmul_reference(x, packed, permuted, group_size, zeros, bias), expected,
                                   **TOLERANCE[dtype_name])
    except AssertionError as exc:
        report["error"] = str(exc)
    return report


# GPTQModel checkpoints (tests/quant/fixtures/gptq_awq): one layer repacked into Marlin tiles; the tiles
# dequantize to GPTQModel's own dequantized weight (oracle.safetensors.gz) and the kernel multiplies by it.
FIXTURES = Path(__file__).parent / "fixtures" / "gptq_awq"
ORACLE_LAYER = "model.layers.0.mlp.down_proj"
ORACLE_CASES = {"gptqmodel-gptq-b4-g128-sym": "gptq_b4_g128_sym", "gptqmodel-awq-b4-g128": "awq_b4_g128"}


def _run_oracle_case(kernel, checkpoint: str) -> dict:
    from safetensors.torch import load, load_file

    path = FIXTURES / checkpoint
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][f"{ORACLE_LAYER}.qweight"]
    tensors = load_file(str(path / shard))
    qweight, qzeros, scales = (tensors[f"{ORACLE_LAYER}.{name}"] for name in ("qweight", "qzeros", "scales"))
    if checkpoint.startswith("awq"):
        from pluginfer.quant.awq import unpack_awq

        codes, zeros, scales = unpack_awq(qweight, qzeros, scales)
        packed_zeros = layout.pack_zero_points(zeros)
    else:
        from pluginfer.quant.gptq import unpack_gptq

        codes, zeros, scales, _ = unpack_gptq(qweight, qzeros, scales, None, 4)
        assert bool((zeros == 8).all())
        packed_zeros = None
    packed, permuted = layout.pack(codes, scales, 128)
    oracle = load(gzip.open(path / "oracle.safetensors.gz").read())[f"{ORACLE_LAYER}.weight"]
    x = torch.randn(5, codes.shape[0], generator=torch.Generator().manual_seed(9))
    out = kernel.marlin_matmul(x, packed, permuted.float(), 128, packed_zeros, None, layout.position_table(x.device))
    dense = layout.dequantize(packed, permuted, codes.shape[0], codes.shape[1], 128, packed_zeros)
    expected = x @ dense
    report = {"shape": list(out.shape), "dtype": "float32", "max_error": (out - expected).abs().max().item(),
              "error": None}
    try:
        # GPTQModel multiplies in float16: our exact float32 product, rounded once, is its weight bit for bit.
        torch.testing.assert_close(dense.half().t(), oracle, atol=0, rtol=0)
        torch.testing.assert_close(out, expected, **TOLERANCE["float32"])
    except AssertionError as exc:
        report["error"] = str(exc)
    return report


def _interpreted(names: list[str]) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__, *names], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install triton; the test extra has it)")


def _have_oracle(name: str) -> bool:
    return (FIXTURES / ORACLE_CASES[name] / "oracle.safetensors.gz").is_file()


@pytest.fixture(scope="module")
def reports() -> dict:
    """Every fast case in one interpreter process (each start imports torch and triton anew)."""
    return _interpreted(list(CASES) + [name for name in ORACLE_CASES if _have_oracle(name)])


def _check(report: dict, case: tuple) -> None:
    rows, size_k, size_n, group_size, asymmetric, dtype_name, leading = case
    assert report["error"] is None, report["error"]
    assert report["shape"] == [*leading, rows, size_n] and report["dtype"] == dtype_name


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_dequantized_matmul(reports, name):
    _check(reports[name], CASES[name])


@needs_triton
@pytest.mark.parametrize("name", list(ORACLE_CASES))
def test_kernel_on_gptqmodel_layer_equals_its_dequantized_weight(reports, name):
    if not _have_oracle(name):
        pytest.skip(f"GPTQModel fixture {ORACLE_CASES[name]} is not in {FIXTURES}")
    report = reports[name]
    assert report["error"] is None, report["error"]
    assert report["shape"] == [5, 128]


@needs_triton
@pytest.mark.slow
def test_kernel_larger_shape():
    reports = _interpreted(list(SLOW_CASES))
    for name, case in SLOW_CASES.items():
        _check(reports[name], case)


@needs_triton
def test_position_table_inverts_the_layout():
    """The kernel's table: code (row r, column c) of a 16x64 run sits at that position of its run in B."""
    done = subprocess.run([sys.executable, "-c", "from pluginfer.quant.marlin_layout import position_table; "
                           "import torch; print(position_table(torch.device('cpu')).tolist())"],
                          env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    table = torch.tensor(json.loads(done.stdout)).reshape(16, 64)
    assert torch.equal(table.reshape(-1).sort().values, torch.arange(1024))
    for seed in range(4):
        codes = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        stored = layout.unpack_int4_columns(layout.pack_weight(codes))[0]
        assert torch.equal(stored[table], codes)


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton
    from pluginfer.backends.triton_kernels import marlin_matmul as marlin_kernel

    cases = {**CASES, **SLOW_CASES}
    print(json.dumps({name: _run_oracle_case(marlin_kernel, ORACLE_CASES[name]) if name in ORACLE_CASES
                      else _run_case(marlin_kernel, *cases[name]) for name in sys.argv[1:]}))
