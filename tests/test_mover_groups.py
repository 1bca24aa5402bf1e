"""BlockMover.groups: several KV groups (hybrid models), one transfer and one completion."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvswap import BlockMover, ConfigurationError, KVGroup
from kvswap.errors import BlockIdError, BlockLayoutError
from mover_shapes import KINDS, Side, expected_after

TOKENS = 4


def _groups(gen: torch.Generator):
    """Full attention (FlashAttention, host blocks 2x), sliding window (MLA-shaped, same
    size), and a FlashInfer group, each with its own block pools."""
    return [
        (Side([KINDS["flash"]] * 2, 20, TOKENS, gen), Side([KINDS["flash"]] * 2, 9, 2 * TOKENS, gen, pad=32), 1),
        (Side([KINDS["mla"]], 12, TOKENS, gen), Side([KINDS["mla"]], 15, TOKENS, gen), 0),
        (Side([KINDS["flashinfer"]] * 3, 7, TOKENS, gen), Side([KINDS["flashinfer"]] * 3, 10, TOKENS, gen), 0),
    ]


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_several_groups_move_in_one_job(direction):
    gen, rng = torch.Generator().manual_seed(41), np.random.default_rng(41)
    groups = [(d, h, bd) if direction == "d2h" else (h, d, bd) for d, h, bd in _groups(gen)]
    befores = [(s.snapshot(), d.snapshot()) for s, d, _ in groups]
    mover = BlockMover.groups([KVGroup(s.tensors, d.tensors, bd) for s, d, bd in groups[:2]]
                              + [(groups[2][0].tensors, groups[2][1].tensors)], direction)
    layouts = mover.layouts
    assert [g.factor for g in layouts] == [2, 1, 1]
    jobs: list[list] = [[] for _ in groups]
    for sizes in ((3, 0, 5), (7, 12, 1)):
        sids, dids = [], []
        for g, n in enumerate(sizes):
            sids.append(rng.choice(layouts[g].num_src_blocks, n, replace=False))
            dids.append(rng.choice(layouts[g].num_dst_blocks, n, replace=False))
            jobs[g].append((sids[-1], dids[-1]))
        ids = [list(x) for x in sids] if sizes[0] == 3 else [torch.from_numpy(x) for x in sids]
        mover.submit(ids, dids)
    mover.close()
    results = mover.poll()
    assert len(results) == 2 and all(r.ok for r in results)
    for r, k in zip(results, (0, 1)):
        assert r.bytes == sum(len(jobs[g][k][0]) * layouts[g].block_bytes for g in range(3))
    for (s, d, _), (s_before, d_before), g_jobs in zip(groups, befores, jobs):
        assert d.matches(expected_after(s, s_before, d, d_before, g_jobs))
        assert s.matches(s_before)


def test_group_ids_are_checked_per_group_before_any_byte_moves():
    gen = torch.Generator().manual_seed(42)
    (s0, d0, _), (s1, d1, _), _ = _groups(gen)
    mover = BlockMover.groups([(s0.tensors, d0.tensors, 1), (s1.tensors, d1.tensors)], "d2h")
    before = [d0.snapshot(), d1.snapshot()]
    bad = [
        ([3, 4], [1, 2], "src_block_ids\\[0\\] is 3, not a list of ids"),   # flat ids
        ([[0]], [[1]], "src_block_ids must be a list of 2 id lists, one per KV group, got list of 1"),
        ([[0], [1, 2]], [[1], [3]], "src_block_ids\\[1\\] has 2 ids but dst_block_ids\\[1\\] has 1"),
        ([[0], [12]], [[1], [3]], "src_block_ids\\[1\\]\\[0\\]=12 is out of range"),
        ([[0, 1], []], [[5, 5], []], "dst_block_ids\\[0\\]\\[0\\] and dst_block_ids\\[0\\]\\[1\\] are both 5"),
    ]
    for sid, did, message in bad:
        with pytest.raises(BlockIdError, match=message):
            mover.submit(sid, did)
    assert d0.matches(before[0]) and d1.matches(before[1]) and mover.in_flight == 0
    with pytest.raises(ConfigurationError, match="moves 2 KV groups"):
        mover.block_bytes
    mover.submit([[], []], [[], []])
    assert [r.bytes for r in mover.poll()] == [0]


def test_groups_sharing_tensors_use_distinct_blocks():
    """Groups of a hybrid model may divide one pool of blocks: allowed, and a job in which
    two groups write the same destination block is refused before any byte moves."""
    gen = torch.Generator().manual_seed(43)
    src_a, src_b, dst = (Side([KINDS["mla"]], 10, TOKENS, gen) for _ in range(3))
    before, a_before, b_before = dst.snapshot(), src_a.snapshot(), src_b.snapshot()
    mover = BlockMover.groups([(src_a.tensors, dst.tensors), (src_b.tensors, dst.tensors)], "d2h")
    with pytest.raises(BlockIdError, match="two KV groups write the same destination bytes"):
        mover.submit([[1, 2], [3]], [[4, 5], [5]])
    assert dst.matches(before)
    mover.submit([[1, 2], [3]], [[4, 5], [6]])
    mover.close()
    after_a = expected_after(src_a, a_before, dst, before, [([1, 2], [4, 5])])
    assert dst.matches(expected_after(src_b, b_before, dst, after_a, [([3], [6])]))


def test_bad_group_specs():
    gen = torch.Generator().manual_seed(44)
    s, d = Side([KINDS["mla"]], 4, TOKENS, gen), Side([KINDS["mla"]], 4, TOKENS, gen)
    for groups, message in [
        ([], "non-empty list"),
        (KVGroup(s.tensors, d.tensors), "non-empty list"),
        ([(s.tensors, d.tensors), "x"], "groups\\[1\\] is a str"),
        ([(s.tensors, d.tensors), (s.tensors, d.tensors[:0])], "groups\\[1\\]: dst_tensors is empty"),
        ([(s.tensors, d.tensors), (s.tensors, d.tensors, 5)], "groups\\[1\\]: block_dim=5 is out of range"),
    ]:
        with pytest.raises(BlockLayoutError, match=message):
            BlockMover.groups(groups, "h2d")
