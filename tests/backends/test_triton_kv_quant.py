"""The cuda backend's Triton kernels on quantized KV caches (int8, fp8 E4M3, fp8 E5M2) under
``TRITON_INTERPRET=1``, as ``test_triton_kernels.py`` runs the float ones: ``write_kv``'s bytes equal the torch
reference's (torch's own int8 rounding and float8 casts, ``layers/kv_quant.py``), and decode and prefill attention
over the codes equal the reference ops (dequantize, then attend in float32). Where torch sees a CUDA device,
every case again compiled for the GPU. This file runs itself as a script in a fresh interpreter (Triton reads
``TRITON_INTERPRET`` at import)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.backends.cuda_interpreted import environment

KV_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")


def _quantized(cache: torch.Tensor, kv_dtype: str, seed: int) -> torch.Tensor:
    """A quantized cache of ``cache``'s shape (rows of random values, the big padding rows too)."""
    from pluginfer.layers import kv_quant

    rows = cache.float().reshape(-1, cache.shape[-2], cache.shape[-1])
    generator = torch.Generator(rows.device).manual_seed(seed)
    rows = rows * torch.logspace(-3, 1, rows.shape[-1], device=rows.device)[torch.randperm(
        rows.shape[-1], generator=generator, device=rows.device)]  # subnormal codes too
    quantized = kv_quant.quantize(rows, kv_quant.QUANTIZED_KV_DTYPES[kv_dtype])
    return quantized.view(*cache.shape[:-1], quantized.shape[-1])


def case_write(kv_dtype: str, model_dtype: str) -> dict:
    from pluginfer.backends.triton_kernels import write_kv
    from pluginfer.layers import attention_ops
    from tests.backends.triton_cases import _paged

    _, key, value, key_cache, value_cache, _, _, _, slots = _paged([9, 5], [3, 5], 4, 2, 24, 16, 4,
                                                                   getattr(torch, model_dtype), 4)
    key = key * torch.logspace(-4, 1, 24, device=key.device).to(key.dtype)  # subnormal float8 codes too
    key[1, 0] = 0.0  # a row of zeros: scale 1
    key_cache, value_cache = _quantized(key_cache, kv_dtype, 1), _quantized(value_cache, kv_dtype, 2)
    ours = (key_cache.clone(), value_cache.clone())
    write_kv.write_kv(key, value, *ours, slots)
    attention_ops.write_kv(key, value, key_cache, value_cache, slots)
    for mine, theirs in zip(ours, (key_cache, value_cache)):
        mismatched = (mine.view(torch.uint8) != theirs.view(torch.uint8)).sum().item()
        if mismatched:
            return {"error": f"{mismatched} bytes differ from the reference's"}
    return {"error": None}


def case_attention(kv_dtype: str, model_dtype: str, prefill: bool, window: int | None, cap: float | None) -> dict:
    from pluginfer.backends.triton_kernels import decode_attention, prefill_attention
    from pluginfer.layers import attention_ops
    from tests.backends.triton_cases import DECODE_SHAPES, PREFILL_SHAPES, _paged, compare

    seq_lens, query_lens, heads, kv_heads, head_dim, v_dim, block_size = (
        PREFILL_SHAPES["chunk-and-prefix-hit"] if prefill else DECODE_SHAPES["gqa"])
    query, _, _, key_cache, value_cache, tables, starts, lens, _ = _paged(
        seq_lens, query_lens, heads, kv_heads, head_dim, v_dim, block_size, getattr(torch, model_dtype), 6)
    key_cache, value_cache = _quantized(key_cache, kv_dtype, 3), _quantized(value_cache, kv_dtype, 4)
    scale = head_dim ** -0.5
    if prefill:
        arguments = (query, key_cache, value_cache, tables, starts, lens, max(query_lens), scale, window, cap)
        ours, expected = prefill_attention.paged_prefill_attention(*arguments), attention_ops.paged_prefill_attention(*arguments)
    else:
        arguments = (query, key_cache, value_cache, tables, lens, scale, window, cap)
        ours = decode_attention.decode_attention(*arguments, keys_per_split=16)  # several splits
        expected = attention_ops.paged_decode_attention(*arguments)
    return compare(ours, expected, model_dtype)


def case_latent(kv_dtype: str, prefill: bool) -> dict:
    """Multi-head latent attention's cache: one KV head whose value is a view of the key row's last features
    and its scale (``core.kv_layout.value_in_key``)."""
    from pluginfer.backends.triton_kernels import decode_attention, prefill_attention
    from pluginfer.core.kv_layout import value_in_key
    from pluginfer.layers import attention_ops
    from tests.backends.triton_cases import _paged, compare

    seq_lens, query_lens = ([40, 9, 23], [1, 1, 1]) if not prefill else ([21, 30], [7, 30])
    query, _, _, key_cache, _, tables, starts, lens, _ = _paged(seq_lens, query_lens, 4, 1, 24, 24, 8, torch.float32, 8)
    key_cache = _quantized(key_cache, kv_dtype, 5)
    value_cache = value_in_key(key_cache, 16)
    scale = 24 ** -0.5
    if prefill:
        arguments = (query, key_cache, value_cache, tables, starts, lens, max(query_lens), scale, None, None)
        ours, expected = prefill_attention.paged_prefill_attention(*arguments), attention_ops.paged_prefill_attention(*arguments)
    else:
        arguments = (query, key_cache, value_cache, tables, lens, scale, None, None)
        ours = decode_attention.decode_attention(*arguments, keys_per_split=16)
        expected = attention_ops.paged_decode_attention(*arguments)
    return compare(ours, expected, "float32")


CASES: dict[str, tuple] = {}
for _kv in KV_DTYPES:
    CASES |= {
        f"write-{_kv}-float32": (case_write, _kv, "float32"),
        f"write-{_kv}-bfloat16": (case_write, _kv, "bfloat16"),
        f"decode-{_kv}-float32": (case_attention, _kv, "float32", False, None, None),
        f"decode-window-softcap-{_kv}-float32": (case_attention, _kv, "float32", False, 7, 2.5),
        f"prefill-{_kv}-float32": (case_attention, _kv, "float32", True, None, None),
        f"prefill-window-softcap-{_kv}-float32": (case_attention, _kv, "float32", True, 6, 2.0),
    }
CASES |= {"decode-int8-float16": (case_attention, "int8", "float16", False, None, None),
          "prefill-fp8_e4m3-bfloat16": (case_attention, "fp8_e4m3", "bfloat16", True, None, None),
          "decode-latent-int8": (case_latent, "int8", False), "prefill-latent-fp8_e4m3": (case_latent, "fp8_e4m3", True),
          "decode-latent-fp8_e5m2": (case_latent, "fp8_e5m2", False)}


def _run(interpret: bool) -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton; the test extra has it)")
    done = subprocess.run([sys.executable, __file__], env=environment(interpret), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reports() -> dict:
    return _run(interpret=True)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_on_a_quantized_cache_equals_the_reference(reports: dict, name: str) -> None:
    assert reports[name]["error"] is None, f"{name}: {reports[name]['error']}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_same_cases_compiled_for_the_gpu() -> None:
    reports = _run(interpret=False)
    failed = {name: report["error"] for name, report in reports.items() if report["error"] is not None}
    assert set(reports) == set(CASES) and not failed, failed


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert torch.cuda.is_available(), "run with TRITON_INTERPRET=1, or where torch sees a CUDA device"
        torch.set_default_device("cuda")
    results = {}
    for case_name, (function, *arguments) in CASES.items():
        try:
            results[case_name] = function(*arguments)
        except Exception as exc:  # one broken kernel must not hide the others' results
            results[case_name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results))
