"""Property tests of the input checks: random descriptor batches (a SwapFn's input) and
random id lists (``BlockMover.submit``), valid and invalid, through the host reference and
through the Triton kernel in its interpreter. Each must be copied exactly or refused with a
kvswap error before any byte moves.

An oracle written here, independently of kvswap's checks, says which inputs are valid: an
input it accepts must be copied (every destination byte checked, everything outside the
copied blocks untouched), one it refuses must raise ``InvalidTransferError`` with both sides
untouched. A batch the checks wrongly accepted could write outside the pools: it would fail
the test, or end it with a fault.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvswap  # noqa: E402
from kvswap import BlockIdError, BlockMover, InvalidTransferError, Policy  # noqa: E402
from kvswap.backends.triton_generic import HAS_TRITON  # noqa: E402
from kvswap.backends.triton_generic.launch import interpreting  # noqa: E402
from mover_layouts import expected_after, layouts, pool_pair  # noqa: E402

POOL = 16 * 1024
INT64_MAX = 2**63 - 1
ROUTES = [
    pytest.param("host.reference", id="host"),
    pytest.param("triton.kernel", id="triton", marks=pytest.mark.skipif(
        not (HAS_TRITON and interpreting()), reason="the Triton interpreter (TRITON_INTERPRET=1, without a GPU)")),
]
# Few examples under the interpreter, where each launch takes tenths of a second.
EXAMPLES = {"host.reference": 150, "triton.kernel": 20}
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])


# -- descriptor batches --------------------------------------------------------------------------
class Pools:
    """A source pool of random bytes and a destination pool, both plain host memory."""

    def __init__(self) -> None:
        rng = np.random.default_rng()
        self.src = rng.integers(0, 256, POOL, dtype=np.uint8)
        self.dst = np.empty(POOL, dtype=np.uint8)
        self.s, self.d = int(self.src.ctypes.data), int(self.dst.ctypes.data)


@st.composite
def descriptor(draw: st.DrawFn, pools: Pools) -> tuple[int, int, int]:
    """``(src address, dst address, size)``, mostly inside the pools, sometimes not valid."""
    size = draw(st.one_of(st.integers(1, 300), st.integers(1, 2048), st.sampled_from([0, -1, -4096])))
    kind = draw(st.sampled_from(["ok"] * 12 + ["src_in_dst", "null", "negative", "overflow"]))
    top = max(1, abs(size))
    src = pools.s + draw(st.integers(0, POOL - top))
    dst = pools.d + draw(st.integers(0, POOL - top))
    if kind == "src_in_dst":  # a source inside the destination pool: valid unless a destination overlaps it
        src = pools.d + draw(st.integers(0, POOL - top))
    elif kind == "null":
        src, dst = draw(st.sampled_from([(0, dst), (src, 0)]))
    elif kind == "negative":
        dst = -draw(st.integers(1, 2**40))
    elif kind == "overflow":
        src = INT64_MAX - draw(st.integers(0, top - 1 if top > 1 else 0))
    return src, dst, size


@st.composite
def batches(draw: st.DrawFn, pools: Pools) -> dict:
    descs = draw(st.lists(descriptor(pools), max_size=24))
    src, dst, sizes = ([d[i] for d in descs] for i in range(3))
    form = draw(st.sampled_from(["numpy"] * 6 + ["list", "tensor", "int32", "float", "2d", "short"]))
    return dict(src=src, dst=dst, sizes=sizes, form=form)


def as_given(b: dict) -> tuple:
    """The batch in the form the caller passes it."""
    src, dst, sizes, form = b["src"], b["dst"], b["sizes"], b["form"]
    if form == "list":
        return src, dst, sizes
    if form == "tensor":
        return (torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64),
                torch.tensor(sizes, dtype=torch.int64))
    if form == "int32":  # addresses that cannot hold a pointer
        return (np.array(src, dtype=np.int64).astype(np.int32), np.array(dst, dtype=np.int64),
                np.array(sizes, dtype=np.int64))
    if form == "float":
        return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(sizes, dtype=np.float64) + 0.5
    if form == "2d":
        return np.array(src, dtype=np.int64)[None], np.array(dst, dtype=np.int64)[None], np.array(sizes)[None]
    if form == "short":
        return np.array(src, dtype=np.int64), np.array(dst[:-1] if dst else [7], dtype=np.int64), np.array(sizes)
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(sizes, dtype=np.int64)


def oracle_accepts(b: dict) -> bool:
    """Whether a batch may be copied: written from the rules, not from kvswap's code."""
    src, dst, sizes = b["src"], b["dst"], b["sizes"]
    if b["form"] in ("2d", "short") or (b["form"] == "float" and src):
        return False  # not 1-D (even empty), unequal lengths, or sizes that are not integers (none excepted)
    if b["form"] == "int32":
        return False  # addresses narrower than a pointer, even none of them
    if not src:
        return True
    if any(n < 1 for n in sizes) or any(a <= 0 for a in src + dst):
        return False
    if any(a + n > INT64_MAX for a, n in zip(src + dst, sizes + sizes)):
        return False
    spans = sorted((d, d + n) for d, n in zip(dst, sizes))
    if any(e > s for (_, e), (s, _) in zip(spans, spans[1:])):
        return False
    return not any(d < s + m and s < d + n for d, n in zip(dst, sizes) for s, m in zip(src, sizes))


_FNS: dict = {}


def swap_fn(route: str):
    if route not in _FNS:
        _FNS[route] = kvswap.resolve("h2d", device="cpu", policy=Policy(force=route))
    return _FNS[route]


@pytest.mark.parametrize("route", ROUTES)
def test_a_descriptor_batch_is_copied_exactly_or_refused_before_any_byte_moves(route):
    pools = Pools()
    fn = swap_fn(route)

    @settings(max_examples=EXAMPLES[route], **SETTINGS)
    @given(b=batches(pools), poison=st.integers(0, 255))
    def check(b: dict, poison: int) -> None:
        pools.dst[:] = poison
        src_before, dst_before = pools.src.copy(), pools.dst.copy()
        if oracle_accepts(b):
            fn(*as_given(b))
            want = dst_before.copy()
            for s, d, n in zip(b["src"], b["dst"], b["sizes"]):
                base, pool = (pools.s, src_before) if pools.s <= s < pools.s + POOL else (pools.d, dst_before)
                want[d - pools.d:d - pools.d + n] = pool[s - base:s - base + n]
            assert np.array_equal(pools.dst, want), "a byte inside or outside the blocks is wrong"
        else:
            with pytest.raises(InvalidTransferError):
                fn(*as_given(b))
            assert np.array_equal(pools.dst, dst_before), "a refused batch moved bytes"
        assert np.array_equal(pools.src, src_before)

    check()


# -- block ids ----------------------------------------------------------------------------------
SRC_BLOCKS, DST_BLOCKS = 16, 12


@st.composite
def id_lists(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(0, 10))
    values = st.one_of(st.integers(-2, SRC_BLOCKS + 2), st.integers(0, SRC_BLOCKS - 1))
    sid = draw(st.lists(values, min_size=n, max_size=n))
    if draw(st.booleans()):  # distinct in-range destinations: mostly valid
        did = draw(st.permutations(range(DST_BLOCKS)))[:n]
    else:
        did = draw(st.lists(st.integers(-1, DST_BLOCKS), min_size=n, max_size=n))
    if draw(st.integers(0, 9)) == 0 and n:  # unequal lengths
        did = did[:-1]
    return sid, did, draw(st.sampled_from(["list"] * 4 + ["int64", "int32", "uint8", "tensor", "float", "bool",
                                                          "2d", "strings"]))


def ids_as(ids: list, form: str):
    if form == "list":
        return list(ids)
    if form == "tensor":
        return torch.tensor(ids, dtype=torch.int64)
    if form in ("int64", "int32", "uint8"):
        return np.array(ids).astype(form)  # uint8 wraps negatives to large ids; int32 keeps them
    if form == "float":
        return np.array(ids, dtype=np.float64)
    if form == "bool":
        return np.array(ids, dtype=np.int64) % 2 == 1
    if form == "2d":
        return np.array(ids, dtype=np.int64)[None]
    return [str(i) for i in ids]


def ids_oracle(ids, form: str, limit: int) -> list | None:
    """The ids as integers, or None where they must be refused."""
    if form in ("bool", "2d") or (form == "strings" and len(ids)):
        return None  # not integers (a bool array even when empty), or not 1-D
    if form == "float":
        return [] if not len(ids) else None
    if form == "uint8":
        ids = [i % 256 for i in ids]
    return list(ids) if all(0 <= i < limit for i in ids) else None


_MOVERS: dict = {}


def mover_for(route: str):
    """One mover per route over host pools of random bytes (pageable: the Triton route
    stages them through its own buffers)."""
    if route not in _MOVERS:
        src, dst = pool_pair(layouts()["flash"], 31, SRC_BLOCKS, DST_BLOCKS)
        with pytest.warns(kvswap.PageableMemoryWarning) if route == "triton.kernel" else _nothing():
            mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force=route))
        _MOVERS[route] = (mover, src, dst)
    return _MOVERS[route]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("route", ROUTES)
def test_block_ids_are_copied_exactly_or_refused_before_any_byte_moves(route):
    mover, src, dst = mover_for(route)

    @settings(max_examples=EXAMPLES[route], **SETTINGS)
    @given(case=id_lists())
    def check(case: tuple) -> None:
        sid, did, form = case
        s_ok, d_ok = ids_oracle(sid, form, SRC_BLOCKS), ids_oracle(did, form, DST_BLOCKS)
        valid = s_ok is not None and d_ok is not None and len(s_ok) == len(d_ok) and len(set(d_ok)) == len(d_ok)
        before, src_before = dst.snapshot(), src.snapshot()
        if valid:
            job = mover.submit(ids_as(sid, form), ids_as(did, form))
            mover.wait(job)
            (r,) = mover.poll()
            assert r.ok and r.job_id == job and r.bytes == len(s_ok) * mover.block_bytes
            want = expected_after(dst, before, src_before, src, [(np.array(s_ok, dtype=np.int64),
                                                                   np.array(d_ok, dtype=np.int64))])
            assert dst.matches(want), "a byte inside or outside the blocks is wrong"
        else:
            with pytest.raises(BlockIdError):
                mover.submit(ids_as(sid, form), ids_as(did, form))
            assert mover.poll() == [] and dst.matches(before), "refused ids moved bytes"
        assert src.matches(src_before)
        # Fresh bytes for the next example, so that a block copied again is checked again.
        for f in dst.flats:
            f.copy_(torch.randint(0, 256, f.shape, dtype=torch.uint8))

    check()
