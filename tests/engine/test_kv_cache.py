"""BlockManager: allocation, reference counts, prefix caching, LRU reuse, fork."""

from __future__ import annotations

import pytest

from pluginfer.engine.kv_cache import BlockManager
from pluginfer.engine.sequence import SamplingParams, Sequence

BLOCK = 4


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams())


def prefill(manager: BlockManager, seq: Sequence) -> None:
    """What the scheduler and a forward do for a whole prompt in one step."""
    assert manager.allocate_prompt(seq)
    assert manager.ensure_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = len(seq)
    manager.commit_full_blocks(seq)


def test_allocate_and_free_count_blocks() -> None:
    manager = BlockManager(8, BLOCK, enable_prefix_caching=False)
    seq = make_seq(range(10))
    assert manager.allocate_prompt(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert manager.ensure_slots(seq, 10)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(3 / 8)
    assert all(manager.ref_count(block) == 1 for block in seq.block_table)
    seq.num_computed_tokens = 10
    assert manager.ensure_slots(seq, 2)  # slots 10, 11 fit the third block
    assert len(seq.block_table) == 3
    assert manager.ensure_slots(seq, 3)
    assert len(seq.block_table) == 4
    held = list(seq.block_table)
    manager.free(seq)
    assert seq.block_table == [] and manager.num_free_blocks == 8
    assert all(manager.ref_count(block) == 0 for block in held)


def test_failed_allocation_changes_nothing() -> None:
    manager = BlockManager(3, BLOCK, enable_prefix_caching=True)
    seq = make_seq(range(8))
    prefill(manager, seq)
    before = (list(seq.block_table), manager.num_free_blocks, seq.num_computed_tokens)
    assert not manager.can_ensure(seq, 9)
    assert not manager.ensure_slots(seq, 9)  # needs 3 more blocks, 1 free
    assert (list(seq.block_table), manager.num_free_blocks, seq.num_computed_tokens) == before
    assert not manager.allocate_prompt(seq)  # already holds blocks
    assert (list(seq.block_table), manager.num_free_blocks, seq.num_computed_tokens) == before


def test_prefix_hit_reuses_the_same_blocks() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    first = make_seq(range(10), "a")
    prefill(manager, first)
    second = make_seq([*range(9), 99, 100, 101], "b")  # shares two full blocks, not the third
    assert manager.allocate_prompt(second)
    assert second.block_table == first.block_table[:2]
    assert second.num_computed_tokens == second.num_cached_prompt_tokens == 8
    assert [manager.ref_count(block) for block in first.block_table] == [2, 2, 1]
    assert manager.ensure_slots(second, second.num_uncomputed_tokens)
    assert second.block_table[2] not in first.block_table


def test_no_prefix_caching_means_no_hits() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=False)
    prefill(manager, make_seq(range(12), "a"))
    other = make_seq(range(12), "b")
    assert manager.allocate_prompt(other)
    assert other.num_computed_tokens == 0 and other.block_table == []


def test_fully_cached_prompt_leaves_one_token_to_compute() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    first = make_seq(range(8), "a")
    prefill(manager, first)
    again = make_seq(range(8), "b")
    assert manager.allocate_prompt(again)
    assert again.block_table == first.block_table
    assert again.num_computed_tokens == again.num_cached_prompt_tokens == 7
    assert again.num_uncomputed_tokens == 1
    free_before = manager.num_free_blocks
    assert manager.ensure_slots(again, 1)  # its last slot lies in the shared block
    assert manager.num_free_blocks == free_before


def test_freed_cached_block_is_revived_by_a_hit() -> None:
    manager = BlockManager(4, BLOCK, enable_prefix_caching=True)
    first = make_seq(range(9), "a")
    prefill(manager, first)
    full_blocks, partial = first.block_table[:2], first.block_table[2]
    manager.free(first)
    assert manager.num_free_blocks == 4 and manager.num_cached_free_blocks == 2
    assert all(manager.is_cached(block) for block in full_blocks)
    assert not manager.is_cached(partial)
    again = make_seq([*range(8), 42], "b")
    assert manager.allocate_prompt(again)
    assert again.block_table == full_blocks
    assert manager.num_free_blocks == 2 and manager.num_cached_free_blocks == 0
    assert [manager.ref_count(block) for block in full_blocks] == [1, 1]


def test_fresh_blocks_first_then_least_recently_freed_cached_block() -> None:
    manager = BlockManager(4, BLOCK, enable_prefix_caching=True)
    old, new = make_seq(range(4), "old"), make_seq(range(100, 104), "new")
    prefill(manager, old)
    prefill(manager, new)
    manager.free(old)
    manager.free(new)  # LRU order: old's block, then new's
    taker = make_seq(range(200, 212), "taker")
    assert manager.allocate_prompt(taker)
    assert manager.ensure_slots(taker, 8)  # the two never-named blocks
    assert manager.num_cached_free_blocks == 2
    assert manager.ensure_slots(taker, 9)  # one more: evicts the least recently freed (old's)
    assert manager.num_cached_free_blocks == 1
    old_again, new_again = make_seq(range(4), "o2"), make_seq(range(100, 104), "n2")
    assert manager.allocate_prompt(old_again) and old_again.block_table == []
    assert manager.allocate_prompt(new_again) and len(new_again.block_table) == 1
    assert new_again.num_cached_prompt_tokens == 3


def test_lru_order_follows_free_order_and_tail_blocks_go_first() -> None:
    manager = BlockManager(3, BLOCK, enable_prefix_caching=True)
    seq = make_seq(range(12), "a")
    prefill(manager, seq)
    first, second, third = seq.block_table
    manager.free(seq)  # tail first: third is the least recently freed
    taker = make_seq(range(500, 504), "t")
    assert manager.allocate_prompt(taker) and manager.ensure_slots(taker, 4)
    assert taker.block_table == [third]
    assert manager.is_cached(first) and manager.is_cached(second) and not manager.is_cached(third)
    hit = make_seq(range(12), "b")
    assert manager.allocate_prompt(hit)
    assert hit.block_table == [first, second] and hit.num_computed_tokens == 8


def test_same_content_computed_twice_keeps_one_cached_copy() -> None:
    manager = BlockManager(8, BLOCK, enable_prefix_caching=True)
    one, two = make_seq(range(4), "a"), make_seq(range(4), "b")
    for seq in (one, two):  # both admitted before either is committed
        assert manager.allocate_prompt(seq) and manager.ensure_slots(seq, 4)
    for seq in (one, two):
        seq.num_computed_tokens = 4
        manager.commit_full_blocks(seq)
    assert manager.is_cached(one.block_table[0]) and not manager.is_cached(two.block_table[0])
    manager.free(two)
    manager.free(one)
    assert manager.num_cached_free_blocks == 1 and manager.num_free_blocks == 8


def test_commit_names_output_blocks_too() -> None:
    manager = BlockManager(8, BLOCK, enable_prefix_caching=True)
    seq = make_seq(range(6), "a")
    prefill(manager, seq)
    for token in (6, 7, 8):  # decode three tokens
        seq.output_token_ids.append(token)
        assert manager.ensure_slots(seq, 1)
        seq.num_computed_tokens += 1
        manager.commit_full_blocks(seq)
    assert manager.is_cached(seq.block_table[1])  # tokens 4..7 span prompt and output
    later = make_seq(range(10), "b")
    assert manager.allocate_prompt(later) and later.num_computed_tokens == 8


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    manager = BlockManager(8, BLOCK, enable_prefix_caching=True)
    parent = make_seq(range(10), "a")
    prefill(manager, parent)
    child = make_seq(range(10), "a")
    assert manager.can_fork(parent)
    copies = manager.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    assert copies == [(parent.block_table[2], child.block_table[2])]
    assert [manager.ref_count(block) for block in parent.block_table] == [2, 2, 1]
    assert child.num_computed_tokens == 10
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 8


def test_fork_of_block_aligned_prompt_copies_nothing() -> None:
    manager = BlockManager(2, BLOCK, enable_prefix_caching=False)
    parent = make_seq(range(8))
    prefill(manager, parent)
    child = make_seq(range(8))
    assert manager.num_free_blocks == 0 and manager.can_fork(parent)
    assert manager.fork(parent, child) == []
    assert child.block_table == parent.block_table


def test_fork_without_a_free_block_changes_nothing() -> None:
    manager = BlockManager(3, BLOCK, enable_prefix_caching=False)
    parent = make_seq(range(10))
    prefill(manager, parent)
    child = make_seq(range(10))
    assert not manager.can_fork(parent)
    with pytest.raises(RuntimeError):
        manager.fork(parent, child)
    assert child.block_table == [] and [manager.ref_count(b) for b in parent.block_table] == [1, 1, 1]
