"""The KV block manager: which blocks of the paged KV pool each sequence holds, and which full
blocks are kept for reuse by later sequences with the same prefix (prefix caching).

Plain Python, no tensors: the pool's memory lives in the model's ``PagedKVCache``; this module
hands out block ids. A full block is named by a hash chained over every token before its end
(``block_hash``), so equal hashes mean equal prefixes, not merely equal blocks. A block is shared
by reference count; when its last user releases it, it joins the free queue but keeps its hash,
so a later sequence with that prefix takes it back instead of computing it again, until the
block is handed out for new content (least recently released first). Beyond the pool, the
prefix cache's tiers (``prefix_tiers``: host memory, a directory) may keep the contents of blocks
it dropped; ``match_prefix`` restores those that follow the blocks it still holds.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .kv_events import KVEventLog

if TYPE_CHECKING:
    from .prefix_tiers import PrefixTiers

BlockHash = bytes


def block_hash(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a full block holding ``token_ids`` after the prefix named by ``parent``
    (None for the first block): a 16-byte BLAKE2b digest of the parent's hash and the ids."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockPool:
    """``num_blocks`` block ids with reference counts, a free queue in release order, and the
    hash -> block map of full blocks whose contents are known."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.hash_of: list[BlockHash | None] = [None] * num_blocks
        self.by_hash: dict[BlockHash, int] = {}
        # Free blocks, least recently released first; cached ones keep their hash until taken.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.events: KVEventLog | None = None  # told of every prefix forgotten (kv_events)
        self.tiers: "PrefixTiers | None" = None  # told of every block handed out whose prefix it forgets

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached-but-unused ones included)."""
        return len(self.free)

    def take_new(self) -> int:
        """A free block for new content (the least recently released); its old hash is forgotten."""
        block, _ = self.free.popitem(last=False)
        old = self.hash_of[block]
        if old is not None:
            self.hash_of[block] = None
            if self.by_hash.get(old) == block:
                del self.by_hash[old]
                if self.events is not None:
                    self.events.removed([old])
                if self.tiers is not None:  # its contents are still there: the next pass writes it
                    self.tiers.forgot(block, old)
        self.ref_count[block] = 1
        return block

    def take_cached(self, h: BlockHash) -> int | None:
        """The block holding the prefix ``h``, with one more reference, or None."""
        block = self.by_hash.get(h)
        if block is None:
            return None
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; a block nobody uses joins the end of the free queue."""
        self.ref_count[block] -= 1
        if self.ref_count[block] < 0:
            raise AssertionError(f"block {block} released more often than taken")
        if self.ref_count[block] == 0:
            self.free[block] = None

    def remember(self, block: int, h: BlockHash) -> bool:
        """Record that ``block`` holds the prefix ``h`` (its keys and values are written); True
        when that made it findable. When another block already holds that prefix, the first one
        stays the one found."""
        if self.hash_of[block] is None and h not in self.by_hash:
            self.hash_of[block] = h
            self.by_hash[h] = block
            return True
        return False


class KVBlockManager:
    """Block tables of sequences (by id) over one ``BlockPool`` of ``block_size``-token blocks.

    ``prefix_queries`` and ``prefix_hits`` count prompt tokens looked up in the prefix cache and
    tokens found there (vLLM's metrics of those names). ``window``: the keys any layer still
    attends to behind a new token when every layer has a sliding window (0: all keys); then a
    sequence's blocks that fall wholly behind it are handed back as it grows (``release_behind``),
    their ids left in its table, where the attention kernels never read them."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, window: int = 0) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an integer >= 0, got {window!r}")
        self.window = window
        self.released: dict[object, int] = {}  # leading blocks of each sequence handed back
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.tables: dict[object, list[int]] = {}
        self.hashes: dict[object, list[BlockHash]] = {}  # chained hashes of each sequence's full blocks
        self.in_flight: dict[BlockHash, object] = {}  # prompt blocks being computed now -> their sequence
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def events(self) -> "KVEventLog | None":
        """Where blocks made findable and prefixes forgotten are told (None: nowhere)."""
        return self.pool.events

    @events.setter
    def events(self, log: "KVEventLog | None") -> None:
        self.pool.events = log

    @property
    def tiers(self) -> "PrefixTiers | None":
        """The prefix cache's tiers beyond the pool (``prefix_tiers``; None: none): told of
        blocks committed and evicted, asked for blocks the pool no longer holds."""
        return self.pool.tiers

    @tiers.setter
    def tiers(self, tiers: "PrefixTiers | None") -> None:
        self.pool.tiers = tiers

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (0..1); cached blocks nobody holds count as free."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: object) -> list[int]:
        """The block ids of ``seq_id`` in order (empty for an unknown sequence)."""
        return self.tables.get(seq_id, [])

    def _hashes(self, seq_id: object, token_ids: Sequence[int], full_blocks: int) -> list[BlockHash]:
        """The chained hashes of the first ``full_blocks`` blocks of ``token_ids``, computing
        only those not known yet."""
        known = self.hashes.setdefault(seq_id, [])
        bs = self.block_size
        for i in range(len(known), full_blocks):
            known.append(block_hash(known[-1] if known else None, token_ids[i * bs:(i + 1) * bs]))
        return known

    def match_prefix(self, seq_id: object, token_ids: Sequence[int]) -> int:
        """Give a sequence with no blocks yet the cached blocks of its longest cached prefix;
        return how many of its tokens they hold (whole blocks, and at least one token of
        ``token_ids`` always left to compute, since its logits pick the next token). The
        counters are left to ``count_lookup``, called once the sequence is admitted."""
        if self.tables.get(seq_id):
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        table = self.tables.setdefault(seq_id, [])
        if not self.prefix_caching:
            return 0
        usable = (len(token_ids) - 1) // self.block_size
        hashes = self._hashes(seq_id, token_ids, usable)
        while len(table) < usable:
            block = self.pool.take_cached(hashes[len(table)])
            if block is not None:
                table.append(block)
                continue
            # the tiers may hold the next blocks: restored into new blocks of the pool, as if computed
            restored = self.tiers.restore(self.pool, hashes[len(table):usable]) if self.tiers is not None else []
            if not restored:
                break
            if self.events is not None:
                self._stored(list(range(len(table), len(table) + len(restored))), hashes, token_ids)
            table.extend(restored)
        return len(table) * self.block_size

    def next_block_in_flight(self, seq_id: object, token_ids: Sequence[int], cached: int) -> bool:
        """Whether the first full block of ``token_ids`` past its ``cached`` tokens is being
        computed right now by another sequence (which would make it findable one step later)."""
        if not self.prefix_caching:
            return False
        i = cached // self.block_size
        if i >= (len(token_ids) - 1) // self.block_size:
            return False
        owner = self.in_flight.get(self._hashes(seq_id, token_ids, i + 1)[i])
        return owner is not None and owner != seq_id

    def claim(self, seq_id: object, token_ids: Sequence[int], cached: int) -> None:
        """Mark the full blocks of an admitted sequence's prompt past its ``cached`` tokens as
        being computed by it, so that sequences with the same prefix wait for them."""
        if not self.prefix_caching:
            return
        usable = (len(token_ids) - 1) // self.block_size
        for h in self._hashes(seq_id, token_ids, usable)[cached // self.block_size:]:
            self.in_flight.setdefault(h, seq_id)

    def count_lookup(self, queried: int, hit: int) -> None:
        """Add one admitted sequence's prefix lookup to the counters (tokens looked up, found)."""
        if self.prefix_caching:
            self.prefix_queries += queried
            self.prefix_hits += hit

    def held_blocks(self, seq_id: object) -> int:
        """Blocks ``seq_id`` holds now (those handed back behind a window not counted)."""
        return len(self.tables.get(seq_id, ())) - self.released.get(seq_id, 0)

    def can_grow(self, seq_id: object, num_tokens: int) -> bool:
        """Whether ``seq_id`` can be given blocks for ``num_tokens`` tokens in all."""
        return self.blocks_for(num_tokens) - len(self.tables.get(seq_id, ())) <= self.pool.num_free

    def grow(self, seq_id: object, num_tokens: int) -> bool:
        """Make ``seq_id`` hold blocks for ``num_tokens`` tokens in all; False (and no change)
        when the pool has too few free blocks."""
        table = self.tables.setdefault(seq_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.pool.num_free:
            return False
        for _ in range(need):
            table.append(self.pool.take_new())
        return True

    def trim(self, seq_id: object, num_tokens: int) -> None:
        """Hand back the blocks of ``seq_id`` past the first ``num_tokens`` tokens (a rejected
        speculative draft's). They hold no prefix, so they go first in the free queue: the
        cached blocks there are kept longer."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            block = table.pop()
            assert self.pool.hash_of[block] is None, "a block past a sequence's end holds a cached prefix"
            self.pool.release(block)
            if self.pool.ref_count[block] == 0:
                self.pool.free.move_to_end(block, last=False)

    def commit(self, seq_id: object, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that the keys and values of the first ``num_computed`` of ``token_ids`` are
        written: the full blocks among them become findable by their prefix hash."""
        if not self.prefix_caching:
            return
        table = self.tables.get(seq_id, ())
        full = min(num_computed // self.block_size, len(table))
        hashes = self._hashes(seq_id, token_ids, full)
        run: list[int] = []  # indices of consecutive blocks made findable now, for the events
        for i, (block, h) in enumerate(zip(table[:full], hashes)):
            made = self.pool.remember(block, h)
            if made and self.tiers is not None:
                self.tiers.committed(block, h)
            if made and self.events is not None:
                if run and run[-1] != i - 1:
                    self._stored(run, hashes, token_ids)
                    run = []
                run.append(i)
            if self.in_flight.get(h) == seq_id:
                del self.in_flight[h]
        if run:
            self._stored(run, hashes, token_ids)

    def _stored(self, run: list[int], hashes: list[BlockHash], token_ids: Sequence[int]) -> None:
        """Tell ``events`` of consecutive blocks ``run`` (indices into the sequence's blocks)."""
        bs, first, last = self.block_size, run[0], run[-1] + 1
        assert self.events is not None
        self.events.stored(hashes[first:last], hashes[first - 1] if first else None,
                           token_ids[first * bs:last * bs], bs)

    def release_behind(self, seq_id: object, num_computed: int) -> None:
        """With a window: hand back the blocks of ``seq_id`` whose every key lies before the
        first one a token at position ``num_computed`` or later can see (a full block keeps
        its prefix hash, so a later sequence with that prefix may still take it back)."""
        if not self.window:
            return
        table = self.tables.get(seq_id)
        if not table:
            return
        behind = min(max(0, num_computed - self.window + 1) // self.block_size, len(table))
        done = self.released.get(seq_id, 0)
        for block in table[done:behind]:
            self.pool.release(block)
        if behind > done:
            self.released[seq_id] = behind

    def free(self, seq_id: object) -> None:
        """Release every block of ``seq_id`` still held (last block first, so a prefix's head
        outlives its tail in the cache) and forget the sequence."""
        table = self.tables.pop(seq_id, [])
        for block in reversed(table[self.released.pop(seq_id, 0):]):
            self.pool.release(block)
        for h in self.hashes.pop(seq_id, ()):
            if self.in_flight.get(h) == seq_id:
                del self.in_flight[h]

    def held_references(self) -> int:
        """Total references held on blocks (0 once every sequence is freed)."""
        return sum(self.pool.ref_count)
