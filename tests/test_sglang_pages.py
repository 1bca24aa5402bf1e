"""The engine-free parts of kvswap's SGLang hooks: token indices to page ids (whole pages only,
checked without a loop over tokens), and the per-layer host views of each HiCache layout, paired
with a device page by a BlockMover. SGLang itself is exercised in tests/e2e_sglang."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kvswap
from kvswap.integrations.sglang.layouts import LAYOUTS, device_view, host_view
from kvswap.integrations.sglang.pages import LastTransfer, Pages, page_ids, transfer_pages


def tokens(pages, page_size):
    return (np.asarray(pages)[:, None] * page_size + np.arange(page_size)).reshape(-1)


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_runs_of_whole_pages_become_their_page_ids(page_size):
    pages = np.random.default_rng(page_size).permutation(40)[:17]
    got = page_ids(torch.from_numpy(tokens(pages, page_size)), page_size)
    assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.tolist() == pages.tolist()


@pytest.mark.parametrize("bad,why", [
    (lambda t: t[:-1], "not whole pages of 4"),
    (lambda t: t + 1, "starts at token 1, not on a page boundary"),
    (lambda t: np.concatenate([t[:4], [8, 10, 9, 11]]), "the run at index 4 is not 4 consecutive tokens"),
    (lambda t: np.concatenate([t[:4], [8, 9, 10, 12]]), "the run at index 4 is not 4 consecutive tokens"),
])
def test_indices_that_are_not_whole_pages_say_why(bad, why):
    got = page_ids(torch.from_numpy(bad(tokens([0, 2], 4)).copy()), 4)
    assert isinstance(got, str) and why in got


def test_a_transfer_is_served_only_where_both_sides_are_whole_pages():
    host, device = torch.from_numpy(tokens([5, 1], 4)), torch.from_numpy(tokens([2, 9], 4))
    pages = transfer_pages(host, device, 4)
    assert isinstance(pages, Pages) and pages.host.tolist() == [5, 1] and pages.device.tolist() == [2, 9]
    assert transfer_pages(host, device + 2, 4).startswith("device indices:")
    assert transfer_pages(host[:4], device, 4) == "4 host indices against 8 device indices"


def test_the_layers_of_one_transfer_reuse_its_pages_and_a_new_transfer_does_not():
    last = LastTransfer()
    host, device = torch.from_numpy(tokens([5], 4)), torch.from_numpy(tokens([2], 4))
    first, fresh = last.pages(host, device, 4)
    again, fresh_again = last.pages(host, device, 4)
    assert fresh and not fresh_again and again is first
    other, fresh_other = last.pages(host.clone(), device, 4)  # equal values, another tensor: read again
    assert fresh_other and other is not first and other.host.tolist() == [5]


def host_buffer(layout, pages, layers, page, heads, dim, gen):
    """One component of an SGLang MHA host buffer in ``layout`` (the leading K/V 2 dropped)."""
    shape = {"layer_first": (layers, pages * page, heads, dim), "page_first": (pages * page, layers, heads, dim),
             "page_first_direct": (pages, layers, page, heads, dim), "page_head": (pages, heads, page, layers, dim)}
    return torch.randn(shape[layout], generator=gen).to(torch.bfloat16)


def host_token(buf, layout, layer, page, token, page_size):
    """The ``[heads, dim]`` row of one token, indexed straight from the layout's definition."""
    t = page * page_size + token
    return {"layer_first": lambda: buf[layer, t], "page_first": lambda: buf[t, layer],
            "page_first_direct": lambda: buf[page, layer, token],
            "page_head": lambda: buf[page, :, token, layer]}[layout]()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layers_host_view_pairs_with_device_pages_row_by_row(layout):
    layers, pages, page, heads, dim = 3, 6, 4, 2, 8
    gen = torch.Generator().manual_seed(len(layout))
    buf = host_buffer(layout, pages, layers, page, heads, dim, gen)
    rows = torch.randn((5 * page + page, heads, dim), generator=gen).to(torch.bfloat16)  # SGLang pads a page
    before = rows.clone()
    layer = 2
    view = host_view(buf, layout, layer, page)
    assert view.data_ptr() >= buf.data_ptr() and view.shape == (pages, page, heads, dim)
    with kvswap.BlockMover(view, device_view(rows, page), "h2d", block_dim=0) as load:
        load.wait(load.submit([4, 0, 3], [1, 5, 2]))
    for h, d in ((4, 1), (0, 5), (3, 2)):
        for k in range(page):
            assert torch.equal(rows[d * page + k], host_token(buf, layout, layer, h, k, page)), (h, d, k)
    untouched = [r for r in range(rows.shape[0]) if r // page not in (1, 5, 2)]
    assert torch.equal(rows[untouched], before[untouched])
