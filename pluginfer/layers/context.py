"""The build context layers read while a model is constructed (quant method, collective, backend)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from pluginfer.core.protocols import BuildContext

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


def has_context() -> bool:
    return _current is not None


def current_context() -> BuildContext:
    if _current is None:
        raise RuntimeError("pluginfer layers must be built inside pluginfer.layers.context.building(ctx)")
    return _current
