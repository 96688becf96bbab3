"""Paged KV cache bookkeeping: block tables, reference counts, prefix caching.

Only ids and counts live here; the cache tensors belong to the device backend.
A full block that has been computed is named by a hash chain over its tokens and
everything before it, so a later sequence with the same prefix can reuse it. Freed
blocks that carry such a name wait in an LRU list and are revived by a hit, or
evicted (losing the name) when no never-named block is left.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from pluginfer.engine.sequence import Sequence

_NO_PARENT = b""


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Name of a full block: hash of (parent block's name, the block's token ids)."""
    # A cryptographic digest, so that crafted prompts cannot collide into another user's cache.
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def _root(seq: Sequence) -> bytes:
    """The parent name of a sequence's first block: its media's salt and its LoRA adapter's, so that two images
    or two adapters never share a block."""
    return seq.cache_salt if seq.lora is None else chain_hash(seq.lora.key + seq.cache_salt, [])


class BlockManager:
    """Hands out fixed-size KV blocks to sequences and shares full blocks by content."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._block_of_hash: dict[bytes, int] = {}
        self._free_fresh: deque[int] = deque(range(num_blocks))  # hold no reusable content
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.prefix_cache_queries = 0  # prompt tokens looked up since the start
        self.prefix_cache_hits = 0  # of those, tokens found cached

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (cached ones included: they can be evicted)."""
        return len(self._free_fresh) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold reusable content."""
        return len(self._free_cached)

    def ref_count(self, block: int) -> int:
        """How many block tables hold this block."""
        return self._ref_counts[block]

    def is_cached(self, block: int) -> bool:
        """True if a prefix-cache lookup can find this block."""
        name = self._hashes[block]
        return name is not None and self._block_of_hash.get(name) == block

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold this many tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks ensure_slots(seq, num_new_tokens) would take."""
        covered = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, covered - len(seq.block_table))

    def can_ensure(self, seq: Sequence, num_new_tokens: int) -> bool:
        """True if ensure_slots(seq, num_new_tokens) would succeed."""
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def can_fork(self, parent: Sequence) -> bool:
        """True if fork(parent, child) would succeed (a partial last block needs a free block)."""
        return parent.num_computed_tokens % self.block_size == 0 or self.num_free_blocks > 0

    # -- changes ---------------------------------------------------------------------------

    def allocate_prompt(self, seq: Sequence) -> bool:
        """Give a fresh sequence the cached blocks of its longest cached prefix; nothing else.

        Sets num_computed_tokens (and num_cached_prompt_tokens) to the cached length, but
        leaves at least the last token to compute so that the step produces logits.
        Returns False, changing nothing, if the sequence already holds blocks.
        """
        if seq.block_table or seq.num_computed_tokens:
            return False
        # Prompt logprobs need logits at every prompt position, so such a prompt computes them all.
        # So does mean or CLS pooling (embeddings), which reads the hidden state of every/the first position.
        use_cache = self.enable_prefix_caching and seq.params.prompt_logprobs is None and \
            (seq.pooling is None or not seq.pooling.uses_every_position)
        matched = self._match_prefix(seq.token_ids, _root(seq)) if use_cache else []
        for block in matched:
            if self._ref_counts[block] == 0:
                del self._free_cached[block]
            self._ref_counts[block] += 1
        seq.block_table = matched
        # A fully cached sequence recomputes its last token; that rewrites one slot of a
        # shared block with the very same key/value, as vLLM does.
        num_cached = max(0, min(len(matched) * self.block_size, len(seq) - 1))
        seq.num_computed_tokens = num_cached
        seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
        if use_cache:
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += num_cached
        return True

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the table to cover num_computed_tokens + num_new_tokens slots; False if short."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(needed))
        return True

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks that are now completely computed, so later prompts can reuse them."""
        if not self.enable_prefix_caching:
            return
        table, size = seq.block_table, self.block_size
        num_full = min(seq.num_computed_tokens // size, len(table))
        first = num_full
        while first > 0 and self._hashes[table[first - 1]] is None:
            first -= 1
        if first == num_full:
            return
        parent = self._hashes[table[first - 1]] if first else _root(seq)
        tokens = seq.token_ids
        for index in range(first, num_full):
            name = chain_hash(parent, tokens[index * size:(index + 1) * size])
            block = table[index]
            self._hashes[block] = name
            # Same content computed twice at once: the first block keeps the name.
            self._block_of_hash.setdefault(name, block)
            parent = name

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references and clear its table."""
        # Tail first, so that a sequence's later blocks are evicted before its prefix.
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._release(block)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Share the parent's computed full blocks with the child; copy a partial last block.

        Returns the (source, destination) block copies the workers must do before the
        child's next forward. Raises RuntimeError, changing nothing, if no block is free
        for the copy (see can_fork).
        """
        if child.block_table:
            raise ValueError(f"fork: child sequence {child.seq_id} already holds blocks")
        if not self.can_fork(parent):
            raise RuntimeError("fork: no free KV block to copy the parent's partial block into")
        num_computed = parent.num_computed_tokens
        num_full = num_computed // self.block_size
        table = parent.block_table[:num_full]
        for block in table:
            self._ref_counts[block] += 1
        copies = []
        if num_computed % self.block_size:
            copy = self._take_free_block()
            copies.append((parent.block_table[num_full], copy))
            table.append(copy)
        child.block_table = table
        child.num_computed_tokens = num_computed
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        return copies

    # -- internals -------------------------------------------------------------------------

    def _match_prefix(self, tokens: list[int], root: bytes = _NO_PARENT) -> list[int]:
        """Cached blocks holding the longest run of full blocks at the start of tokens (``root``: the first
        block's parent name)."""
        size, parent, matched = self.block_size, root, []
        for start in range(0, len(tokens) - size + 1, size):
            name = chain_hash(parent, tokens[start:start + size])
            block = self._block_of_hash.get(name)
            if block is None:
                break
            matched.append(block)
            parent = name
        return matched

    def _take_free_block(self) -> int:
        """A free block, never-named first, else the least recently freed cached one."""
        if self._free_fresh:
            block = self._free_fresh.popleft()
        else:
            block, _ = self._free_cached.popitem(last=False)
            self._forget(block)
        self._ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        """Return an unreferenced block to the free lists."""
        if self.is_cached(block):
            self._free_cached[block] = None
        else:
            self._hashes[block] = None
            self._free_fresh.append(block)

    def _forget(self, block: int) -> None:
        """Drop a block's name; its content is about to be overwritten."""
        name = self._hashes[block]
        if name is not None and self._block_of_hash.get(name) == block:
            del self._block_of_hash[name]
        self._hashes[block] = None
