"""Paged KV-cache blocks: allocation, reference counts and prefix caching.

A request's KV cache is a list of fixed-size blocks (its block table). With prefix
caching, every full block is known by a chained hash of its tokens (the hash of the block
before it and its own token ids), so a new request whose prompt starts with the same
tokens reuses the blocks instead of recomputing them. A freed block keeps its contents
and hash until it is handed out again (least recently freed first), so a later request can
still hit it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks nobody uses, oldest-freed first: the next to be handed out (and evicted).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # hashes of the request's full blocks

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    # -- prefix cache ---------------------------------------------------------------------
    def get_computed_blocks(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks that hold a prefix of `token_ids`. At least one token is always
        left to compute, since its logits are needed."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def _cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_tokens: int
    ) -> None:
        blocks, hashes = self.req_blocks[request_id], self.req_hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            block = self.blocks[blocks[i]]
            if block.block_hash is None and h not in self.cached:
                block.block_hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id

    # -- allocation -----------------------------------------------------------------------
    def _take_free(self, block_id: int) -> None:
        del self.free_queue[block_id]

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached contents
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = block.token_ids = None
        return block_id

    def can_allocate(self, num_new_blocks: int, computed_blocks: Sequence[int] = ()) -> bool:
        # Hits on freed blocks leave the free queue too, so they count against it.
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        return num_new_blocks + revived <= self.num_free_blocks

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        computed_blocks: Sequence[int] = (),
    ) -> bool:
        """Make room for the first `num_tokens` of `token_ids`; `computed_blocks` are prefix
        hits taken when the request is first scheduled. False (and nothing changed) when
        there are not enough free blocks."""
        blocks = self.req_blocks.get(request_id, [])
        needed = -(-num_tokens // self.block_size) - len(blocks) - len(computed_blocks)
        if not self.can_allocate(max(needed, 0), computed_blocks):
            return False
        blocks = self.req_blocks.setdefault(request_id, [])
        for block_id in computed_blocks:
            if self.blocks[block_id].ref_cnt == 0:
                self._take_free(block_id)
            self.blocks[block_id].ref_cnt += 1
            blocks.append(block_id)
        for _ in range(max(needed, 0)):
            block_id = self._pop_free()
            self.blocks[block_id].ref_cnt = 1
            blocks.append(block_id)
        if self.enable_prefix_caching:
            # Registered now, before the step computes them: a request scheduled later in
            # the same step may hit them, and attention writes K/V before it reads.
            # Only blocks of known ids: async scheduling allocates for a token whose id
            # is still on the device (past the end of `token_ids`).
            self._cache_full_blocks(request_id, token_ids, min(num_tokens, len(token_ids)))
        return True

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, [])
        self.req_hashes.pop(request_id, None)
        # Tail first, so a prompt's later blocks are evicted before its earlier ones.
        for block_id in reversed(blocks):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
