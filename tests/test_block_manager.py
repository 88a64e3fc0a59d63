"""The block manager under a hypothesis state machine: reference counts, sharing only
through the prefix cache, and prefix hits only for identical token blocks."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.block_manager import BlockManager

BLOCK = 4
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=24)  # few ids: many shared prefixes


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
        self.live: dict[str, list[int]] = {}
        self.next_id = 0

    @rule(tokens=tokens_st)
    def add(self, tokens):
        hits = self.bm.get_computed_blocks(tokens)
        for i, block_id in enumerate(hits):  # a hit holds exactly the same tokens
            assert self.bm.blocks[block_id].token_ids == tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
        free_before = self.bm.num_free_blocks
        rid = f"r{self.next_id}"
        self.next_id += 1
        if self.bm.allocate_slots(rid, tokens, len(tokens), hits):
            self.live[rid] = list(tokens)
        else:
            assert self.bm.num_free_blocks == free_before and rid not in self.bm.req_blocks

    @precondition(lambda self: self.live)
    @rule(data=st.data(), more=tokens_st)
    def append(self, data, more):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens = self.live[rid] + more
        if self.bm.allocate_slots(rid, tokens, len(tokens)):
            self.live[rid] = tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.bm.free(rid)
        del self.live[rid]

    @invariant()
    def reference_counts_match_owners(self):
        owners = Counter(b for rid in self.live for b in self.bm.block_table(rid))
        for block in self.bm.blocks:
            assert block.ref_cnt == owners.get(block.block_id, 0)
            assert (block.block_id in self.bm.free_queue) == (block.ref_cnt == 0)

    @invariant()
    def sharing_only_through_the_prefix_cache(self):
        for block in self.bm.blocks:
            if block.ref_cnt > 1:
                assert block.block_hash is not None
                assert self.bm.cached[block.block_hash] == block.block_id

    @invariant()
    def tables_hold_enough_blocks(self):
        for rid, tokens in self.live.items():
            assert len(self.bm.block_table(rid)) == -(-len(tokens) // BLOCK)

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        for rid, tokens in self.live.items():
            for i, block_id in enumerate(self.bm.block_table(rid)):
                block = self.bm.blocks[block_id]
                if block.token_ids is not None:
                    assert block.token_ids == tuple(tokens[i * BLOCK : (i + 1) * BLOCK])

    def teardown(self):
        for rid in list(self.live):
            self.bm.free(rid)
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_prefix_hit_requires_identical_tokens():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert bm.allocate_slots("a", first, len(first))
    assert bm.get_computed_blocks([1, 2, 3, 4, 5, 6, 7, 8, 0]) == bm.block_table("a")[:2]
    assert bm.get_computed_blocks([1, 2, 3, 4, 5, 6, 7, 0, 9]) == bm.block_table("a")[:1]
    assert bm.get_computed_blocks([0, 2, 3, 4, 5, 6, 7, 8, 9]) == []
    # At least one token is always left to compute.
    assert len(bm.get_computed_blocks([1, 2, 3, 4, 5, 6, 7, 8])) == 1


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    bm.allocate_slots("a", tokens, len(tokens))
    table = bm.block_table("a")
    bm.free("a")
    assert bm.get_computed_blocks(tokens) == table[:2]
    # Taking every block evicts the cached contents.
    assert bm.allocate_slots("b", [0] * 16, 16)
    assert bm.get_computed_blocks(tokens) == []


def test_collision_is_not_a_hit():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    bm.allocate_slots("a", [1, 2, 3, 4, 5], 5)
    block = bm.blocks[bm.block_table("a")[0]]
    block.token_ids = (9, 9, 9, 9)  # as if another token block had the same hash
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == []


def test_invalid_size():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
