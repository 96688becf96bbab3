"""Conformance kit: the behaviour every ``Collective`` owes on a world of two ranks.

``check_contract(collective)`` runs on each of two ranks and raises AssertionError on the first broken
promise of the protocol (``pluginfer/core/collective.py``); it ends by closing the collective (twice).
A third-party collective plugin calls it from two processes started however its library starts them
(pluginfer's own tests run it on threads, spawned gloo processes, torchrun and mpiexec ranks).
``count_traffic=True`` also checks the ``stats`` traffic counters pluginfer's built-in collectives keep
(``{operation: [calls, bytes]}``; not part of the protocol).
"""

from __future__ import annotations

import torch


def _grid(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor that says which rank made it: rank * 100 + position."""
    n = 1
    for size in shape:
        n *= size
    return (torch.arange(n, dtype=torch.float32) + 100 * rank).reshape(shape).to(dtype)


def check_contract(coll, count_traffic: bool = False) -> dict:
    assert coll.world_size == 2, coll.world_size
    me = coll.rank
    assert me in (0, 1), me
    other = 1 - me
    before = {name: list(entry) for name, entry in coll.stats.items()} if count_traffic else {}

    # all_reduce: sums, in place, every dtype the engine uses
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        tensor = (torch.arange(6).reshape(2, 3) + 1).mul(me + 1).to(dtype)
        out = coll.all_reduce(tensor)
        assert out.data_ptr() == tensor.data_ptr(), f"all_reduce {dtype}: not in place"
        expected = (torch.arange(6).reshape(2, 3) + 1).mul(3).to(dtype)
        assert torch.equal(tensor, expected), (dtype, tensor, expected)
    base = torch.zeros(4, 6)
    strided = base[:, ::2]  # not contiguous: the result must still land in base
    strided.fill_(me + 1)
    coll.all_reduce(strided)
    assert bool((base[:, ::2] == 3).all()) and bool((base[:, 1::2] == 0).all()), base

    # all_gather: rank order, along any dim
    for shape, dim in [((2, 3), 0), ((2, 3), -1), ((2, 3, 4), 1), ((2, 3), 1)]:
        got = coll.all_gather(_grid(me, shape), dim=dim)
        want = torch.cat([_grid(0, shape), _grid(1, shape)], dim=dim)
        assert torch.equal(got, want), (shape, dim, got, want)
    got = coll.all_gather(_grid(me, (3, 2), torch.bfloat16))  # default dim -1
    assert torch.equal(got, torch.cat([_grid(0, (3, 2), torch.bfloat16), _grid(1, (3, 2), torch.bfloat16)], -1))

    # broadcast_tensor from rank 1, then from rank 0
    for src in (1, 0):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            tensor = _grid(me, (2, 5), dtype)
            out = coll.broadcast_tensor(tensor, src=src)
            assert out.data_ptr() == tensor.data_ptr() and torch.equal(tensor, _grid(src, (2, 5), dtype)), (src, dtype)

    # objects
    obj = {"rank": me, "tokens": [me] * 3, "tensor": torch.arange(3) + me, "text": "é" * (me * 50)}
    got = coll.broadcast_object(obj, src=1)
    assert got["rank"] == 1 and got["tokens"] == [1, 1, 1] and got["text"] == "é" * 50, got
    assert torch.equal(got["tensor"], torch.arange(3) + 1)
    assert coll.broadcast_object(("step", me), src=0) == ("step", 0)
    assert coll.all_gather_object(("hello", me, "x" * (me * 100))) == [("hello", 0, ""), ("hello", 1, "x" * 100)]

    # send / recv, both directions (the receiver names the sender)
    for sender in (0, 1):
        for dtype in (torch.float32, torch.bfloat16):
            if me == sender:
                coll.send(_grid(me, (4, 3), dtype), dst=other)
            else:
                buffer = torch.zeros(4, 3, dtype=dtype)
                out = coll.recv(buffer, src=sender)
                assert out.data_ptr() == buffer.data_ptr() and torch.equal(buffer, _grid(sender, (4, 3), dtype))
    coll.barrier()

    # new_group: one group per rank
    solo = coll.new_group([[0], [1]])
    assert (solo.rank, solo.world_size) == (0, 1), (solo.rank, solo.world_size)
    tensor = torch.full((3,), float(me + 1))
    assert torch.equal(solo.all_reduce(tensor), torch.full((3,), float(me + 1)))
    assert torch.equal(solo.all_gather(_grid(me, (2, 2)), dim=0), _grid(me, (2, 2)))
    assert solo.broadcast_object({"me": me}, src=0) == {"me": me}
    assert solo.all_gather_object(me) == [me]
    solo.barrier()
    # ... and one group of both
    pair = coll.new_group([[0, 1]])
    assert (pair.rank, pair.world_size) == (me, 2), (pair.rank, pair.world_size)
    tensor = torch.full((3,), float(me + 1))
    assert torch.equal(pair.all_reduce(tensor), torch.full((3,), 3.0))
    assert pair.broadcast_object(me, src=1) == 1
    assert torch.equal(pair.all_gather(_grid(me, (1, 2)), dim=0), torch.cat([_grid(0, (1, 2)), _grid(1, (1, 2))]))
    pair.barrier()
    # the world still works next to its groups
    tensor = torch.ones(2)
    assert torch.equal(coll.all_reduce(tensor), torch.full((2,), 2.0))

    if not count_traffic:
        for group in (solo, pair, coll):
            group.close()
            group.close()  # idempotent
        return {}
    # traffic counters: [calls, bytes] per operation, counted from the start of these checks
    stats = {name: [calls - before.get(name, [0, 0])[0], nbytes - before.get(name, [0, 0])[1]]
             for name, (calls, nbytes) in coll.stats.items()}
    for name in ("all_reduce", "all_gather", "broadcast_tensor", "broadcast_object", "all_gather_object",
                 "send", "recv", "barrier"):
        assert name in stats, (name, stats)
    assert stats["all_reduce"][0] == 6 and stats["all_gather"][0] == 5, stats
    assert stats["send"][0] == 2 and stats["recv"][0] == 2, stats
    assert stats["send"][1] >= 4 * 3 * (4 + 2), stats  # one float32 and one bfloat16 [4, 3]
    assert stats["broadcast_object"][1] > 0 and stats["all_gather_object"][1] > 0, stats
    assert pair.stats["all_reduce"] == [1, 12], pair.stats

    for group in (solo, pair, coll):
        group.close()
        group.close()  # idempotent
    return stats
