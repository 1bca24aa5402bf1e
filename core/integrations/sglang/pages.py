"""SGLang's token indices as page ids: whole pages only, checked and mapped without a loop.

HiCache names the rows it moves by token: each page of ``page_size`` tokens is a run of
consecutive indices that starts on a page boundary, on the host side and on the device side
alike. A mover counts pages, so a transfer is served only where both index tensors are made
of such runs; page ``i`` of the transfer is then row ``host[i * P] // P`` of the host side and
``device[i * P] // P`` of the device side.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple, Optional, Union

import numpy as np


class Pages(NamedTuple):
    """One transfer's page ids, host and device side, in the transfer's order."""

    host: np.ndarray
    device: np.ndarray


def _as_numpy(indices: Any) -> np.ndarray:
    """A 1-D int64 array of ``indices`` (a torch tensor on any device, or an array)."""
    if hasattr(indices, "detach"):
        indices = indices.detach()
        if indices.device.type != "cpu":
            indices = indices.cpu()  # kernel io: SGLang keeps them on the GPU
        indices = indices.numpy()
    return np.asarray(indices, dtype=np.int64).reshape(-1)


def page_ids(indices: Any, page_size: int) -> Union[np.ndarray, str]:
    """The page of each run of ``page_size`` indices, or why ``indices`` are not whole pages.

    :param indices: token indices (a tensor on any device, or an array).
    :return: an int64 array of ``len(indices) // page_size`` page ids, or a sentence that
        says why the indices are not runs of whole pages.
    """
    idx = _as_numpy(indices)
    n = idx.size
    if n % page_size:
        return f"{n} token indices are not whole pages of {page_size}"
    runs = idx.reshape(-1, page_size)
    first = runs[:, 0]
    if (first % page_size).any():
        k = int(np.flatnonzero(first % page_size)[0])
        return f"the run at index {k * page_size} starts at token {int(first[k])}, not on a page boundary"
    if page_size > 1:
        steps = np.diff(runs, axis=1)
        if (steps != 1).any():
            k = int(np.flatnonzero((steps != 1).any(axis=1))[0])
            return f"the run at index {k * page_size} is not {page_size} consecutive tokens"
    return first // page_size


def transfer_pages(host_indices: Any, device_indices: Any, page_size: int) -> Union[Pages, str]:
    """Both sides' page ids of one transfer, or why it is not served (whole pages only)."""
    if len(host_indices) != len(device_indices):
        return f"{len(host_indices)} host indices against {len(device_indices)} device indices"
    host = page_ids(host_indices, page_size)
    if isinstance(host, str):
        return f"host indices: {host}"
    device = page_ids(device_indices, page_size)
    if isinstance(device, str):
        return f"device indices: {device}"
    return Pages(host, device)


class LastTransfer:
    """The page ids of the transfer seen last, so that its other layers reuse them.

    SGLang loads a transfer layer by layer, passing the same two index tensors each time;
    they are read (from the GPU, under the ``kernel`` io backend) and checked once. The
    tensors are held while they are the last ones, so their ids cannot name other tensors.
    """

    __slots__ = ("_key", "_pages", "_lock")

    def __init__(self) -> None:
        self._key: Optional[tuple[Any, Any]] = None
        self._pages: Union[Pages, str, None] = None
        self._lock = threading.Lock()

    def pages(self, host_indices: Any, device_indices: Any, page_size: int) -> tuple[Union[Pages, str], bool]:
        """:func:`transfer_pages` of these tensors, computed once while they are the last, and
        whether it was computed now (the first layer of a transfer) rather than kept."""
        with self._lock:
            key = self._key
            if key is not None and key[0] is host_indices and key[1] is device_indices:
                return self._pages, False  # type: ignore[return-value]
        found = transfer_pages(host_indices, device_indices, page_size)
        with self._lock:
            self._key, self._pages = (host_indices, device_indices), found
        return found, True
