"""What the quant methods share about tensor parallelism: the split they are told of, and its errors.

A method learns how a layer is split only from the ``ShardSpec`` passed to ``create_weights``
(``pluginfer.core.protocols``); the layers' ``projection_rows`` says which checkpoint rows of a
fused projection a rank holds. A format whose blocks or groups run along the inputs can split a
row-parallel layer only where its inputs split into whole blocks; ``check_input_split`` says so
at build time, naming the tensor-parallel size, both input counts and the block.
"""

from __future__ import annotations

from pluginfer.core.protocols import ShardSpec

# the default of ``create_weights``: one rank holds the whole weight
UNSPLIT = ShardSpec()


def row_split(shard: ShardSpec) -> bool:
    """The layer's inputs are split across several ranks (row parallel)."""
    return shard.dim == 1 and shard.size > 1


def column_split(shard: ShardSpec) -> bool:
    """The layer's outputs are split across several ranks (column parallel)."""
    return shard.dim == 0 and shard.size > 1


def split_error(shard: ShardSpec, size: int, block: str, name: str | None = None, axis: str = "input") -> ValueError:
    """The error for a split into ``size``-wide shards that cuts ``block`` (e.g. "the Q4_K block of 256
    inputs") in two; ``axis``: "input" (row parallel) or "output" (column parallel)."""
    where = f"{name}: " if name else ""
    return ValueError(f"{where}parallel.tensor_parallel_size {shard.size} splits a layer's "
                      f"{size * shard.size} {axis}s into {size}-{axis} shards, not a multiple of {block}")


def check_input_split(shard: ShardSpec, input_size: int, multiple: int, block: str) -> None:
    """Raise unless this rank's ``input_size`` inputs hold whole blocks of ``multiple`` (row-parallel layers)."""
    if row_split(shard) and input_size % multiple:
        raise split_error(shard, input_size, block)
