"""SwapFn merges runs of descriptors contiguous on both sides where that shortens the batch,
within every route's largest descriptor; the copy is byte-for-byte the same."""
from __future__ import annotations

import numpy as np
import pytest

import kvswap
from kvswap import CopyImpl, Policy, hookimpl
from kvswap.registry.plugins import create_plugin_host
from kvswap.registry.reference import host_copy
from kvswap.resolution.swapfn import COALESCE_FROM

from fakes import address

HANDED: list[np.ndarray] = []


class Offer:
    def __init__(self, impl):
        self.impl = impl

    @hookimpl
    def kvswap_register_copy_impls(self, platform, register):
        if platform == "cpu":
            register(self.impl)


def recording(max_block_bytes=None):
    def factory(ctx):
        def fn(src, dst, sizes, stream):
            HANDED.append(sizes.copy())
            host_copy(src, dst, sizes)
        return fn

    return CopyImpl("acme.rec", "batch", ("cpu",), ("h2d", "d2h"), factory, max_block_bytes=max_block_bytes)


def forced(policy=None, **kw):
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer(recording(**kw)))])
    return kvswap.resolve("h2d", device="cpu", host=host, policy=policy or Policy(force="acme.rec"))


def runs_batch(rng, runs, run_len, block, pool, gap=64):
    """``runs`` runs of ``run_len`` blocks, contiguous on both sides, in shuffled run order,
    each run in a slot of its own with ``gap`` bytes to spare."""
    slot = run_len * block + gap
    starts_s = rng.permutation(len(pool[0]) // slot)[:runs] * slot
    starts_d = rng.permutation(len(pool[1]) // slot)[:runs] * slot
    inner = np.arange(run_len) * block
    so = (starts_s[:, None] + inner).reshape(-1)
    do = (starts_d[:, None] + inner).reshape(-1)
    return so.astype(np.int64), do.astype(np.int64), np.full(runs * run_len, block, dtype=np.int64)


def check(pool, so, do, sizes, before):
    want = before.copy()
    for s, d, n in zip(so, do, sizes):
        want[d:d + n] = pool[0][s:s + n]
    assert np.array_equal(pool[1], want)


@pytest.mark.parametrize("coalesce", [True, False])
def test_contiguous_runs_are_merged_and_every_byte_lands(coalesce):
    rng = np.random.default_rng(1)
    pool = (rng.integers(0, 256, 1 << 22, dtype=np.uint8), np.full(1 << 22, 0xA5, dtype=np.uint8))
    before = pool[1].copy()
    so, do, sizes = runs_batch(rng, runs=9, run_len=7, block=4096, pool=pool)
    fn = forced(Policy(force="acme.rec", coalesce=coalesce))
    HANDED.clear()
    fn(address(pool[0]) + so, address(pool[1]) + do, sizes)
    check(pool, so, do, sizes, before)
    (handed,) = HANDED
    if coalesce:
        assert sorted(handed.tolist()) == [7 * 4096] * 9
    else:
        assert handed.tolist() == sizes.tolist()


def test_a_merged_run_never_outgrows_a_routes_largest_descriptor():
    rng = np.random.default_rng(2)
    pool = (rng.integers(0, 256, 1 << 23, dtype=np.uint8), np.full(1 << 23, 0xA5, dtype=np.uint8))
    before = pool[1].copy()
    so, do, sizes = runs_batch(rng, runs=2, run_len=8, block=256 * 1024, pool=pool)
    fn = forced(max_block_bytes=1 << 20)  # a run of 8 blocks would be 2 MiB
    HANDED.clear()
    fn(address(pool[0]) + so, address(pool[1]) + do, sizes)
    check(pool, so, do, sizes, before)
    assert max(int(h.max()) for h in HANDED) <= 1 << 20


def test_batches_with_few_joins_or_few_descriptors_are_left_alone():
    rng = np.random.default_rng(3)
    pool = (rng.integers(0, 256, 1 << 22, dtype=np.uint8), np.full(1 << 22, 0xA5, dtype=np.uint8))
    fn = forced()
    count = 4 * COALESCE_FROM
    so, do, sizes = runs_batch(rng, runs=count, run_len=1, block=4096, pool=pool, gap=4096)
    for k in range(0, COALESCE_FROM - 2, 2):  # fewer joins than a quarter of the batch
        so[k + 1], do[k + 1] = so[k] + 4096, do[k] + 4096  # in the spare bytes of k's slot
    HANDED.clear()
    fn(address(pool[0]) + so, address(pool[1]) + do, sizes)
    assert len(HANDED[0]) == count
    so, do, sizes = runs_batch(rng, runs=1, run_len=COALESCE_FROM - 1, block=4096, pool=pool)
    HANDED.clear()
    fn(address(pool[0]) + so, address(pool[1]) + do, sizes)  # contiguous, but too short to look at
    assert len(HANDED[0]) == COALESCE_FROM - 1


def test_coalesce_is_public():
    assert kvswap.coalesce is kvswap.addressing.descriptors.coalesce


def test_a_refusal_names_the_callers_descriptor_even_in_a_merged_run():
    aligned = CopyImpl("acme.al8", "batch", ("cpu",), ("h2d", "d2h"), lambda ctx: host_copy, alignment=8)
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer(aligned))])
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.al8"))
    src = np.zeros(1 << 16, dtype=np.uint8)
    dst = np.full(1 << 16, 0xA5, dtype=np.uint8)
    sizes = np.full(16, 64, dtype=np.int64)
    sizes[9] = 61  # one contiguous run of 16 descriptors; the 10th is not a multiple of 8
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    base_s, base_d = ((address(a) + 63) // 64 * 64 for a in (src, dst))
    with pytest.raises(kvswap.InvalidTransferError, match=r"descriptor 9 \(.*size=61\) is refused by acme.al8"):
        fn(base_s + offsets, base_d + offsets, sizes)
    assert (dst == 0xA5).all()
