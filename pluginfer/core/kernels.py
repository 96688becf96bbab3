"""The open kernel table: ops defined by any plugin, implemented per backend.

An op is a plain torch function, its *reference*: its name is the op's name, its signature and
docstring are the contract, its body the oracle every device kernel is tested against.

- **Defining an op.** :func:`define_op` (``kernels.define_op(fn)``) adds the reference to the one
  namespace :data:`OPS`. The layers' ops (``layers/ops.py``, ``layers/attention_ops.py``) are defined this
  way, and so is every op a plugin owns: a quant format defines its matmul and dequantization ops in its
  own module, at import (``quant/ggml_ops.py``, ``quant/packing.py``, ...). Defining a name again with another function is an
  error; the same function again (a module imported twice) is not.
- **Implementing an op.** A backend keeps a :class:`KernelTable` and registers its kernels into it
  (:meth:`KernelTable.register`). A plugin can also supply a kernel for its own op on a backend that has
  never heard of it: :func:`implement` (``kernels.implement(backend_name, "my_op", fn)``), which every table of
  that backend consults after its own registrations.
- **When the names are checked.** A backend may register a kernel for an op whose defining module is
  not imported yet (the cpu backend implements GGML dequantization, which the gguf plugin defines; a
  plugin may not import another). So the rule is: a name and signature are checked at once when the
  op is already defined, else when the op is first looked up (:meth:`KernelTable.implementation`,
  :meth:`KernelTable.get`, at model build, after the asking plugin's module has defined it), or by
  :meth:`KernelTable.check`. Looking up a name nobody defined fails, naming the nearest defined ones.
- **Signatures.** An implementation takes the reference's parameters, by name and in order; it may add
  trailing parameters that have defaults. One taking ``*args`` (a wrapper), or a builtin without a
  signature, is trusted.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOp:
    """One op of the table: its name, its reference (whose signature and docstring are the contract)."""

    name: str
    reference: Callable

    @property
    def parameters(self) -> tuple[str, ...]:
        return tuple(inspect.signature(self.reference).parameters)

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.reference) or ""

    @property
    def defined_by(self) -> str:
        """Where the reference lives, ``module.qualname``."""
        return f"{self.reference.__module__}.{self.reference.__qualname__}"


OPS: dict[str, KernelOp] = {}
# (backend name, op name) -> a kernel a plugin supplied for its own op on that backend (implement()).
_SUPPLIED: dict[tuple[str, str], Callable] = {}


def define_op(reference: Callable, name: str | None = None) -> Callable:
    """Add op ``name`` (the function's name by default) with ``reference`` to the table; returns the
    reference, so it serves as a decorator. ValueError when the name is taken by another function."""
    name = name or reference.__name__
    op = KernelOp(name, reference)
    existing = OPS.get(name)
    if existing is not None and existing.defined_by != op.defined_by:
        raise ValueError(f"kernel op {name!r} is already defined by {existing.defined_by}; "
                         f"{op.defined_by} cannot define it again (choose another name)")
    if not op.doc:
        raise ValueError(f"kernel op {name!r} ({op.defined_by}): its reference needs a docstring, the op's contract")
    OPS[name] = op
    return reference


def lookup(name: str) -> KernelOp:
    """The defined op ``name``; KeyError naming the nearest defined ops otherwise."""
    op = OPS.get(name)
    if op is None:
        raise KeyError(unknown_op_message(name))
    return op


def unknown_op_message(name: str) -> str:
    nearest = difflib.get_close_matches(name, OPS, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, nearest))}?" if nearest else ""
    return (f"no kernel op named {name!r}{hint} (an op is defined by its plugin's module at import: "
            f"kernels.define_op; defined now: {', '.join(sorted(OPS))})")


def check_signature(owner: str, op: KernelOp, implementation: Callable) -> None:
    """TypeError unless ``implementation`` takes ``op``'s parameters, by name and in order (trailing
    parameters with defaults may follow)."""
    try:
        parameters = list(inspect.signature(implementation).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return  # a wrapper passing its arguments on
    names = tuple(p.name for p in parameters)
    extra = parameters[len(op.parameters):]
    if names[:len(op.parameters)] != op.parameters or any(p.default is inspect.Parameter.empty for p in extra):
        raise TypeError(f"{owner}: kernel for {op.name!r} takes ({', '.join(names)}); "
                        f"the op's signature is ({', '.join(op.parameters)}) ({op.defined_by})")


def implement(backend: str, name: str, implementation: Callable) -> None:
    """Supply ``implementation`` of op ``name`` (usually the calling plugin's own) to every
    :class:`KernelTable` of backend ``backend``, checked as :meth:`KernelTable.register` checks."""
    if name in OPS:
        check_signature(f"kernel supplied for backend {backend!r}", OPS[name], implementation)
    _SUPPLIED[(backend, name)] = implementation


def withdraw(backend: str, name: str) -> None:
    """Undo :func:`implement` (a plugin unloaded, a test's cleanup)."""
    _SUPPLIED.pop((backend, name), None)


class KernelTable:
    """One backend's implementations of the table's ops; what it lacks, the reference does."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._implementations: dict[str, Callable] = {}
        self._choices: dict[str, Callable[[], Callable | None]] = {}
        self._checked: set[str] = set()

    def register(self, name: str, implementation: Callable) -> None:
        """Offer ``implementation`` for op ``name``; its parameters must be named as the reference's.
        Checked now if the op is defined, else at its first lookup (module docstring)."""
        if name in OPS:
            check_signature(self.owner, OPS[name], implementation)
        self._implementations[name] = implementation
        self._checked.discard(name)

    def register_choice(self, name: str, choose: Callable[[], Callable | None]) -> None:
        """Offer a kernel for op ``name`` picked at each lookup by ``choose()`` (it returns the kernel or None):
        for a backend whose kernel depends on the machine or on settings read when a layer asks."""
        self._choices[name] = choose

    def _check(self, name: str) -> None:
        if name not in self._checked:
            op = lookup(name)
            check_signature(self.owner, op, self._implementations[name])
            self._checked.add(name)

    def implementation(self, name: str) -> Callable | None:
        """The backend's own kernel for op ``name`` (registered, or chosen now), else one a plugin supplied for
        this backend (:func:`implement`), else None. KeyError for a name no module defined."""
        op = lookup(name)
        if name in self._implementations:
            self._check(name)
            return self._implementations[name]
        chosen = self._choices[name]() if name in self._choices else None
        if chosen is not None:
            check_signature(self.owner, op, chosen)
            return chosen
        supplied = _SUPPLIED.get((self.owner, name))
        if supplied is not None:
            check_signature(f"kernel supplied for backend {self.owner!r}", op, supplied)
        return supplied

    def get(self, name: str) -> Callable:
        """The backend's kernel for ``name``, else the reference."""
        kernel = self.implementation(name)
        return kernel if kernel is not None else OPS[name].reference

    def check(self) -> None:
        """Check every registered name and signature now (every op's module must be imported first)."""
        for name in sorted({*self._implementations, *self._choices}):
            if name not in OPS:
                raise KeyError(f"{self.owner}: kernel registered for an undefined op: {unknown_op_message(name)}")
            if name in self._implementations:
                self._check(name)

    def __contains__(self, name: object) -> bool:
        return name in self._implementations or name in self._choices

    def names(self) -> list[str]:
        return sorted({*self._implementations, *self._choices})
