"""Bad input through the public API: a specific kvswap error that names what failed, raised
before any byte moves, on the host reference and on the Triton kernel in its interpreter.

Inputs the other input tests leave out: id and descriptor arrays numpy cannot read (ragged
lists, sparse or nested tensors, ``torch.Size``), ids in big-endian byte order, "tensors"
that are none, sizes too large to allocate, ``coalesce`` with unequal arrays, malformed
calibration curves, and tensors of one mover that share memory. Random data, poisoned
destinations, every byte checked.
"""
from __future__ import annotations

import gc
import sys
import warnings

import numpy as np
import pytest
import torch

import kvswap
from kvswap import (
    AllocationError, BlockIdError, BlockLayoutError, BlockMover, Calibration, ConfigurationError, Curve,
    InvalidImplError, InvalidTransferError, KVGroup, Policy,
)
from kvswap.backends.triton_generic import HAS_TRITON
from kvswap.backends.triton_generic.launch import interpreting

ROUTES = [
    pytest.param("host.reference", id="host"),
    pytest.param("triton.kernel", id="triton", marks=pytest.mark.skipif(
        not (HAS_TRITON and interpreting()), reason="the Triton interpreter (TRITON_INTERPRET=1, without a GPU)")),
]
SRC_BLOCKS, DST_BLOCKS = 320, 336
# The Triton interpreter declares that it needs pinned memory: its movers bounce the host side.
pytestmark = pytest.mark.filterwarnings("ignore::kvswap.PageableMemoryWarning")


def random_tensors(rng: np.random.Generator, count: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """bfloat16 tensors over random bytes (a poison where they are destinations)."""
    nbytes = int(np.prod(shape)) * 2
    return [torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8)).view(torch.bfloat16).view(shape)
            for _ in range(count)]


def as_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in tensors]


def same_bytes(tensors: list[torch.Tensor], snapshot: list[torch.Tensor]) -> bool:
    return all(torch.equal(t.view(torch.uint8), s) for t, s in zip(tensors, snapshot))


def flash_sides(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two layers of FlashAttention caches (K and V apart: two chunks per block)."""
    rng = np.random.default_rng(seed)
    return random_tensors(rng, 2, (2, SRC_BLOCKS, 4, 16)), random_tensors(rng, 2, (2, DST_BLOCKS, 4, 16))


def expected(dst: list[torch.Tensor], src: list[torch.Tensor], sid, did) -> list[torch.Tensor]:
    """Every destination byte after copying blocks ``sid`` to ``did`` (block_dim 1)."""
    want = as_bytes(dst)
    for w, s in zip(want, src):
        w[:, list(did)] = s.view(torch.uint8)[:, list(sid)]
    return want


@pytest.fixture(params=ROUTES)
def flash_mover(request):
    src, dst = flash_sides(1)
    mover = BlockMover(src, dst, "h2d", block_dim=1, policy=Policy(force=request.param))
    yield mover, src, dst
    mover.close()


# -- ids numpy cannot read -----------------------------------------------------------------------
# Made per test: torch warns that sparse CSR and nested tensors are beta and prototype.
UNREADABLE_IDS = {
    "ragged list": (lambda: ([[1], [2, 3]], [4, 5]), "src_block_ids"),
    "ragged dst": (lambda: ([1, 2], [4, [5, 6]]), "dst_block_ids"),
    "sparse tensor": (lambda: (torch.tensor([1, 2]).to_sparse(), [4, 5]), "src_block_ids.*sparse"),
    "sparse csr tensor": (lambda: ([1, 2], torch.tensor([[4, 5]]).to_sparse_csr()), "dst_block_ids.*sparse"),
    "nested tensor": (lambda: (torch.nested.nested_tensor([torch.tensor([1]), torch.tensor([2, 3])]), [4, 5]),
                      "src_block_ids.*nested"),
}
TORCH_BETA = [pytest.mark.filterwarnings("ignore:Sparse CSR tensor support"),
              pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")]


@pytest.mark.parametrize("case", list(UNREADABLE_IDS))
@TORCH_BETA[0]
@TORCH_BETA[1]
def test_ids_numpy_cannot_read_are_a_block_id_error_before_any_byte_moves(flash_mover, case):
    mover, _, dst = flash_mover
    make, message = UNREADABLE_IDS[case]
    sid, did = make()
    before = as_bytes(dst)
    with pytest.raises(BlockIdError, match=message):
        mover.submit(sid, did)
    with pytest.raises(BlockIdError, match=message):
        mover.descriptors(sid, did)
    assert same_bytes(dst, before) and mover.in_flight == 0 and mover.poll() == []


def test_ragged_ids_of_one_group_are_a_block_id_error_naming_the_group():
    src, dst = flash_sides(2)
    rng = np.random.default_rng(2)
    mla_src, mla_dst = random_tensors(rng, 1, (12, 4, 40)), random_tensors(rng, 1, (14, 4, 40))
    before = as_bytes(dst + mla_dst)
    with BlockMover.groups([KVGroup(src, dst, 1), KVGroup(mla_src, mla_dst, 0)], "h2d") as mover:
        with pytest.raises(BlockIdError, match=r"src_block_ids\[1\]"):
            mover.submit([[1], [[2], [3, 4]]], [[1], [2, 3]])
        assert mover.poll() == []
    assert same_bytes(dst + mla_dst, before)


@pytest.mark.parametrize("route", ROUTES)
def test_ids_in_a_torch_size_are_copied_as_a_list_of_them_is(route):
    src, dst = flash_sides(3)
    want = expected(dst, src, [300, 7], [1, 335])
    with BlockMover(src, dst, "h2d", block_dim=1, policy=Policy(force=route)) as mover:
        mover.submit(torch.Size([300, 7]), torch.Size([1, 335]))
    assert same_bytes(dst, want)


# -- ids in big-endian byte order ----------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
def test_big_endian_ids_are_copied_as_native_ones_are(route):
    src, dst = flash_sides(4)
    rng = np.random.default_rng(4)
    sid = rng.permutation(SRC_BLOCKS)[:300]      # more than SMALL_IDS: the numpy checks
    did = rng.permutation(DST_BLOCKS)[:300]
    want = expected(dst, src, sid, did)
    with BlockMover(src, dst, "h2d", block_dim=1, policy=Policy(force=route)) as mover:
        mover.submit(sid.astype(">i8"), did.astype(">i8"))
    assert same_bytes(dst, want)


@pytest.mark.parametrize("n", [2, 300])
def test_big_endian_ids_out_of_range_are_refused_naming_the_id(n):
    src, dst = flash_sides(5)
    before = as_bytes(dst)
    sid, did = np.arange(n, dtype=">i8"), np.arange(n, dtype=">i8")
    did[n - 1] = DST_BLOCKS
    with BlockMover(src, dst, "h2d", block_dim=1) as mover:
        with pytest.raises(BlockIdError, match=rf"dst_block_ids\[{n - 1}\]={DST_BLOCKS} is out of range"):
            mover.submit(sid, did)
    assert same_bytes(dst, before)


# -- descriptor arrays numpy cannot read ---------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
@TORCH_BETA[0]
def test_descriptor_arrays_numpy_cannot_read_are_refused_before_any_byte_moves(route):
    rng = np.random.default_rng(6)
    block = 256
    src = rng.integers(0, 256, 8 * block, dtype=np.uint8)
    dst = rng.integers(0, 256, 8 * block, dtype=np.uint8)
    before = dst.copy()
    s, d = src.ctypes.data, dst.ctypes.data
    fn = kvswap.resolve("h2d", device="cpu", policy=Policy(force=route))
    cases = [
        (([s, [s + block]], [d, d + block], [block, block]), "src_ptrs"),
        (([s, s + block], [d, d + block], [[block], block, block]), "sizes"),
        ((torch.tensor([s, s + block]).to_sparse(), [d, d + block], [block, block]), "src_ptrs.*sparse"),
        (([s, s + block], torch.tensor([[d, d + block]]).to_sparse_csr(), [block, block]), "dst_ptrs.*sparse"),
    ]
    for args, message in cases:
        with pytest.raises(InvalidTransferError, match=message):
            fn(*args)
    assert np.array_equal(dst, before)


# -- tensors that are none -----------------------------------------------------------------------
@TORCH_BETA[0]
@TORCH_BETA[1]
def test_a_mover_of_what_is_no_tensor_or_no_dense_one_is_a_block_layout_error():
    src, dst = flash_sides(7)
    before = as_bytes(dst)
    cases = [
        (lambda: BlockMover(None, dst, "h2d", block_dim=1), r"src_tensors is a NoneType"),
        (lambda: BlockMover(src, 5, "h2d", block_dim=1), r"dst_tensors is a int"),
        (lambda: BlockMover.groups([KVGroup(src, None, 1)], "h2d"), r"groups\[0\]: dst_tensors is a NoneType"),
        (lambda: BlockMover([s.to_sparse() for s in src], dst, "h2d", block_dim=1),
         r"src_tensors\[0\] is a torch.sparse_coo tensor"),
        (lambda: BlockMover([torch.randn(8, 16).to_sparse_csr()], [torch.randn(8, 16)], "h2d"),
         r"src_tensors\[0\] is a torch.sparse_csr tensor"),
        (lambda: BlockMover([torch.randn(8, 16)], [torch.nested.nested_tensor([torch.randn(4, 16)] * 2)], "h2d"),
         r"dst_tensors\[0\] is a nested tensor"),
    ]
    for make, message in cases:
        with pytest.raises(BlockLayoutError, match=message):
            make()
    assert same_bytes(dst, before)


@TORCH_BETA[0]
def test_a_host_cache_of_sparse_tensors_is_a_block_layout_error():
    with pytest.raises(BlockLayoutError, match=r"device_tensors\[0\] is a torch.sparse_csr tensor"):
        kvswap.host_cache([torch.randn(8, 16).to_sparse_csr()], 4)


# -- sizes too large to allocate -----------------------------------------------------------------
def raised(make) -> BaseException | None:
    """What ``make()`` raised, its traceback dropped and garbage collected (its frames may hold a
    half-built allocation), with every exception nobody could catch (``__del__``) recorded."""
    seen = []
    hook, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kvswap.NumaWarning)
            make()
    except Exception as e:
        e.__traceback__ = None
        return e
    finally:
        gc.collect()
        sys.unraisablehook = hook
        assert [type(u.exc_value).__name__ for u in seen] == []
    return None


def test_host_memory_beyond_what_a_size_can_count_is_a_configuration_error():
    err = raised(lambda: kvswap.host_empty((2**32, 2**32), torch.uint8, device="cpu"))
    assert isinstance(err, ConfigurationError) and "shape=(4294967296, 4294967296)" in str(err), repr(err)
    err = raised(lambda: kvswap.host_cache([torch.randn(2, 8, 4, 16)], 2**62, block_dim=1))
    assert isinstance(err, ConfigurationError) and "shape=(4611686018427387904, 512)" in str(err), repr(err)


def test_host_memory_the_machine_cannot_map_is_an_allocation_error():
    nbytes = 2**60  # past any user address space: refused by mmap whatever the overcommit policy
    err = raised(lambda: kvswap.host_empty((nbytes,), torch.uint8, device="cpu"))
    assert isinstance(err, AllocationError), repr(err)
    assert (err.nbytes, err.memory) == (nbytes, "host") and "(1152921504606846976,)" in str(err)


# -- coalesce ------------------------------------------------------------------------------------
def test_coalesce_refuses_arrays_of_unequal_length_or_no_integers():
    a = np.array([4096, 4160, 4224], dtype=np.int64)
    cases = [
        ((a, a + 8192, np.array([64, 64])), "equal length"),
        ((a[:2], a + 8192, np.array([64, 64, 64])), "equal length"),
        ((None, a, a), "src_ptrs"),
        ((a, a, a.astype(float)), "sizes"),
    ]
    for args, message in cases:
        with pytest.raises(InvalidTransferError, match=message):
            kvswap.coalesce(*args)


def test_coalesce_merges_lists_as_it_merges_arrays():
    src, dst, sizes = [4096, 4160, 4224], [8192, 8256, 8320], [64, 64, 64]
    out = kvswap.coalesce(src, dst, sizes)
    assert [x.tolist() for x in out] == [[4096], [8192], [192]]


# -- calibration curves --------------------------------------------------------------------------
def test_malformed_curves_and_calibrations_are_invalid_impl_errors():
    cases = [
        (lambda: Curve("acme.copy", "h2d", None), "points"),
        (lambda: Curve("acme.copy", "h2d", "abc"), "points"),
        (lambda: Curve("acme.copy", "h2d", ((4096, 1.0, 2),)), "points"),
        (lambda: Curve("acme.copy", "h2d", ((4096, 1.0),), num_sms=-1), "num_sms=-1"),
        (lambda: Curve("acme.copy", "h2d", ((4096, 1.0),), num_sms=2.5), "num_sms=2.5"),
        (lambda: Calibration(source="test", platform="cpu", curves=None), "curves"),
    ]
    for make, message in cases:
        with pytest.raises(InvalidImplError, match=message):
            make()


# -- tensors of one mover that share memory ------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("direction", ["h2d", "d2d"])
def test_a_job_that_writes_its_own_source_blocks_is_refused_before_any_byte_moves(route, direction):
    rng = np.random.default_rng(8)
    pool = torch.from_numpy(rng.integers(0, 256, 16 * 256, dtype=np.uint8))
    before = pool.clone()
    blocks = pool.view(16, 256)
    with BlockMover(blocks, blocks, direction, policy=Policy(force=route)) as mover:
        with pytest.raises(BlockIdError, match="overlap in memory"):
            mover.submit([0, 1], [1, 0])  # a swap: each block is read and written by the job
        assert torch.equal(pool, before)
        # Blocks the job does not both read and write still move, every byte checked.
        mover.wait(mover.submit([3, 4, 9], [12, 5, 0]))
        want = before.view(16, 256).clone()
        want[[12, 5, 0]] = before.view(16, 256)[[3, 4, 9]]
        assert torch.equal(pool.view(16, 256), want)


def test_destination_views_that_meet_for_some_blocks_are_refused_when_built():
    pool = torch.zeros(20, 64, dtype=torch.uint8)
    src = [torch.zeros(10, 64, dtype=torch.uint8) for _ in range(2)]
    # Block 5 of the first view is block 0 of the second: blocks 0, 1 and 9 alone do not show it.
    with pytest.raises(BlockLayoutError, match=r"dst_tensors\[0\] and dst_tensors\[1\] share memory"):
        BlockMover(src, [pool[0:10], pool[5:15]], "h2d")


def test_views_of_one_buffer_that_never_meet_get_no_check_per_job():
    from kvswap.addressing.regions import jobs_overlap, pair_regions

    device = [torch.zeros(2, 24, 16, 2, 8, dtype=torch.bfloat16) for _ in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = kvswap.host_cache(device, 24, block_dim=1, pin=False)
    assert not jobs_overlap([pair_regions(device, list(cache.views), 1)])  # per-layer views, block-major
    assert not jobs_overlap([pair_regions(list(cache.views), device, 1)])
    kv = torch.zeros(24, 2, 16, 8, dtype=torch.bfloat16)  # K and V interleaved, one view each
    assert not jobs_overlap([pair_regions([t.clone() for t in (kv[:, 0], kv[:, 1])], [kv[:, 0], kv[:, 1]], 0)])
    assert jobs_overlap([pair_regions([kv[:, 0]], [kv[:, 0]], 0)])  # one tensor on both sides


def test_a_job_that_writes_one_byte_twice_through_two_destination_tensors_is_refused():
    rng = np.random.default_rng(9)
    block = 64
    pool = torch.from_numpy(rng.integers(0, 256, 30 * block, dtype=np.uint8))
    before = pool.clone()
    even = pool.as_strided((10, block), (2 * block, 1), 0)       # block i at 2i
    thirds = pool.as_strided((10, block), (3 * block, 1), block)  # block i at 3i + 1
    src = [torch.from_numpy(rng.integers(0, 256, (10, block), dtype=np.uint8)) for _ in range(2)]
    with BlockMover(src, [even, thirds], "h2d") as mover:
        with pytest.raises(BlockIdError, match="overlap in memory"):
            mover.submit([0, 1], [2, 1])  # even[2] and thirds[1] are both pool block 4
        assert torch.equal(pool, before)
        mover.wait(mover.submit([0, 1], [0, 3]))  # pool blocks 0 and 6 (even), 1 and 10 (thirds)
    want = before.view(30, block).clone()
    want[0], want[6], want[1], want[10] = src[0][0], src[0][1], src[1][0], src[1][1]
    assert torch.equal(pool.view(30, block), want)


def test_switches_of_a_mover_and_resolve_are_true_or_false():
    src, dst = flash_sides(10)
    cases = [
        (lambda: BlockMover(src, dst, "h2d", block_dim=1, device_descriptors="no"), "device_descriptors='no'"),
        (lambda: BlockMover(src, dst, "h2d", block_dim=1, profiles="no"), "profiles='no'"),
        (lambda: BlockMover(src, dst, "h2d", block_dim=1, issuing_thread=1), "issuing_thread=1"),
        (lambda: BlockMover.groups([KVGroup(src, dst, 1)], "h2d", device_descriptors=0), "device_descriptors=0"),
        (lambda: kvswap.resolve("h2d", device="cpu", profiles=None), "profiles=None"),
    ]
    for make, message in cases:
        with pytest.raises(ConfigurationError, match=message):
            make()
