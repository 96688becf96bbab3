"""The build context layers read while a model is constructed (quant method, collective, backend)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from pluginfer.core.protocols import BuildContext
from pluginfer.layers import attention_ops, ops  # noqa: F401 - the layers' ops are defined before a layer asks for one

_current: BuildContext | None = None


@contextlib.contextmanager
def building(ctx: BuildContext) -> Iterator[BuildContext]:
    """Make ``ctx`` visible to every layer constructed inside the ``with`` block."""
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def backend_op(backend: object, name: str) -> Callable | None:
    """The backend's faster kernel for a layer op, if it offers one (see DeviceBackend.op)."""
    return backend.op(name)


def quant_kernel(op_name: str | None, quant_format: str) -> Callable | None:
    """The current backend's kernel for a quant format's matmul (an op the format's module defined), or None;
    ``op_name`` None: the format has no such op (a GGML type no device kernel reads).

    A backend whose quantized weights run only through its own kernels (``quant_kernels_required``: the cuda
    backend) and that has none for this format makes that a build-time error naming both, instead of a
    silently slow torch dequantize path. Outside a build context there is no backend: None.
    """
    if not has_context():
        return None
    backend = current_context().backend
    kernel = backend.op(op_name) if op_name is not None else None
    if kernel is None and backend.quant_kernels_required:
        raise ValueError(f"backend {backend.name!r} has no kernel for quant format {quant_format!r} "
                         f"(op {op_name or 'none defined'}); "
                         "choose another --quant, or another --backend")
    return kernel


def has_context() -> bool:
    return _current is not None


def current_context() -> BuildContext:
    if _current is None:
        raise RuntimeError("pluginfer layers must be built inside pluginfer.layers.context.building(ctx)")
    return _current
