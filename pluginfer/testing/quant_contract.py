"""Conformance kit: what every ``QuantMethod`` owes the layers, checked on one small linear layer.

``check_quant_method(method, checkpoint, reference)`` takes what a checkpoint holds for one ``[out, in]``
weight in the format and the dense weight it stands for (from an oracle), and raises AssertionError on the
first broken promise, naming the member: ``create_weights`` and its loaders, ``apply`` against
``x @ reference.T + bias`` in the model dtype, and ``vocab_table``. Errors are measured against the output's
scale: ``max |got - want| <= atol + rtol * max |want|``. docs/plugins.md lists every check.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from pluginfer.core.device_backend import DeviceBackend
from pluginfer.core.protocols import BuildContext, QuantMethod
from pluginfer.core.registry import get_registry
from pluginfer.layers.context import building
from pluginfer.layers.linear import ReplicatedLinear


def check_quant_method(method: QuantMethod | Callable[[], QuantMethod], checkpoint: Mapping[str, Any],
                       reference: torch.Tensor, dtype: torch.dtype = torch.float32,
                       backend: DeviceBackend | None = None, atol: float = 1e-4, rtol: float = 1e-3,
                       vocab: tuple[Any, torch.Tensor] | None = None) -> QuantMethod:
    """Check ``method`` (or ``method()``) against the ``QuantMethod`` protocol; returns the instance.

    ``checkpoint``: ``{parameter name: checkpoint tensor}`` for one ``[out, in]`` weight (``{"weight": w}`` for a
    format quantized at load). ``reference``: the dense ``[out, in]`` weight they stand for. ``dtype``: the model
    dtype. ``backend``: the device backend the layer is built for (default: the registry's ``cpu`` backend).
    ``atol`` / ``rtol``: the tolerance of the matmul against the reference (scale-relative, see the module).
    ``vocab``: ``(checkpoint tensor, dense [vocab, hidden] rows)`` for the ``vocab_table`` check.
    """
    if isinstance(method, type | functools.partial) or inspect.isroutine(method):
        method = method()
    if not isinstance(getattr(method, "name", None), str) or not method.name:
        raise _fail(method, "name", f"a non-empty str, got {getattr(method, 'name', None)!r}")
    if backend is None:
        backend = get_registry().load("backend", "cpu")(None, None)
    if reference.dim() != 2:
        raise ValueError(f"reference: a dense [out, in] weight, got shape {tuple(reference.shape)}")
    out_features, in_features = reference.shape
    collective = get_registry().load("collective", "single")(None, None)
    context = BuildContext(backend=backend, quant=method, collective=collective, dtype=dtype, max_model_len=64)
    with building(context):
        layer = ReplicatedLinear(in_features, out_features, bias=True)
    _check_created(method, layer, checkpoint)
    generator = torch.Generator().manual_seed(0)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    for name, tensor in checkpoint.items():
        param = getattr(layer, name)
        param.checkpoint_name = name
        param.weight_loader(param, tensor)
    layer.bias.weight_loader(layer.bias, bias)
    method.process_weights_after_loading(layer)
    device = backend.device
    for shape in ((1, in_features), (7, in_features), (2, 33, in_features)):
        x = torch.randn(*shape, generator=generator).to(dtype)
        want = F.linear(x.double(), reference.double(), bias.double())
        _compare(method, "apply", f"x of shape {shape}", layer(x.to(device)), want, dtype, atol, rtol)
        got = method.apply(layer, x.to(device), None)
        _compare(method, "apply", f"x of shape {shape}, bias None", got, want - bias.double(), dtype, atol, rtol)
    _check_vocab_table(method, backend, dtype, vocab, atol, rtol)
    return method


def _fail(method: object, member: str, message: str) -> AssertionError:
    return AssertionError(f"QuantMethod.{member} ({type(method).__name__}): {message}")


def _check_created(method: QuantMethod, layer: torch.nn.Module, checkpoint: Mapping[str, Any]) -> None:
    registered = {name for name, _ in layer.named_parameters(recurse=False)} - {"bias"}
    if not registered:
        raise _fail(method, "create_weights", "registered no parameter on the layer")
    if set(checkpoint) - registered:
        raise _fail(method, "create_weights", f"registered no parameter for the checkpoint's "
                    f"{sorted(set(checkpoint) - registered)} (it registered {sorted(registered)})")
    if registered - set(checkpoint):
        raise _fail(method, "create_weights", f"registered {sorted(registered - set(checkpoint))}, which the "
                    f"checkpoint does not hold (it holds {sorted(checkpoint)}): loading would leave them empty")
    for name in sorted(registered):
        if not callable(getattr(getattr(layer, name), "weight_loader", None)):
            raise _fail(method, "create_weights", f"parameter {name!r} has no weight_loader")


def _compare(method: QuantMethod, member: str, what: str, got: object, want: torch.Tensor, dtype: torch.dtype,
             atol: float, rtol: float) -> None:
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise _fail(method, member, f"{what}: expected shape {tuple(want.shape)}, got {shape}")
    if got.dtype != dtype:
        raise _fail(method, member, f"{what}: returned {got.dtype}, the model dtype is {dtype}")
    error = (got.cpu().double() - want).abs().max().item()
    bound = atol + rtol * want.abs().max().item()
    if not error <= bound:
        raise _fail(method, member, f"{what}: differs from the dense reference by {error:.4g} (allowed {bound:.4g})")


def _check_vocab_table(method: QuantMethod, backend: DeviceBackend, dtype: torch.dtype,
                       vocab: tuple[Any, torch.Tensor] | None, atol: float, rtol: float) -> None:
    member = "vocab_table"
    if vocab is None:
        try:
            table = method.vocab_table(object(), 0, 4, dtype, backend)
        except ValueError:
            return  # a format that holds tables names what it cannot hold
        if table is not None:
            raise _fail(method, member, f"for an object not in this format: None or a ValueError, got "
                        f"{type(table).__name__}")
        return
    loaded, dense = vocab
    start, rows = 3, dense.shape[0] - 5  # an inner slice of rows, as one tensor-parallel rank holds
    table = method.vocab_table(loaded, start, rows, dtype, backend)
    if table is None:
        raise _fail(method, member, f"returned None for a {type(loaded).__name__}: this format keeps no tables")
    if getattr(table, "rows", None) != rows:
        raise _fail(method, member, f"asked for {rows} rows, the table says rows={getattr(table, 'rows', None)!r}")
    held = dense[start:start + rows].double()
    ids = torch.tensor([0, rows - 1, 2, 2, rows // 2])
    _compare(method, f"{member}(...).embed", f"ids {ids.tolist()}", table.embed(ids.to(backend.device)), held[ids],
             dtype, atol, rtol)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, dense.shape[1], generator=generator).to(dtype)
    bias = torch.randn(rows, generator=generator).to(dtype)
    want = hidden.double() @ held.T
    _compare(method, f"{member}(...).logits", "hidden [3, hidden], bias None",
             table.logits(hidden.to(backend.device), None), want, dtype, atol, rtol)
    _compare(method, f"{member}(...).logits", "hidden [3, hidden] with a bias",
             table.logits(hidden.to(backend.device), bias.to(backend.device)), want + bias.double(), dtype, atol, rtol)
