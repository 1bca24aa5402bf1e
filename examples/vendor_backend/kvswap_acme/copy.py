"""``acme.copy``: a whole batch in one call to the ACME runtime's DMA engine."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from kvswap import BindContext, CopyImpl, DeviceInfo, Direction, DriverError

from . import dma

PLATFORM = "acme"
DISABLE_ENV = "ACME_DMA_DISABLED"


def availability(device: DeviceInfo) -> Optional[str]:
    """None when the DMA engine can be used, else why not (shown by ``kvswap info``)."""
    if os.environ.get(DISABLE_ENV):
        return f"the ACME DMA engine is disabled ({DISABLE_ENV} is set)"
    return None


def bind(ctx: BindContext) -> Callable[..., None]:
    """The factory: called once per resolve; returns the per-transfer callable."""

    def copy(src: Any, dst: Any, sizes: Any, stream: Any) -> None:
        # kvswap has already checked the batch against the constraints declared below, so
        # a refusal here is the runtime's own, and becomes a kvswap DriverError.
        try:
            dma.batch_copy(src, dst, sizes)
        except dma.AcmeError as e:
            raise DriverError("acme.batch_copy", 1, "ACME_ERROR_INVALID_DESCRIPTOR", str(e), e.index) from e

    copy.note = f"simulated DMA engine ({ctx.direction})"  # shown by SwapFn.explain()
    return copy


ACME_COPY = CopyImpl(
    name="acme.copy",
    kind="batch",
    platforms=(PLATFORM,),
    directions=(Direction.H2D, Direction.D2H),
    factory=bind,
    availability=availability,
    alignment=dma.ALIGNMENT,
    min_block_bytes=dma.ALIGNMENT,
    max_block_bytes=dma.MAX_DESCRIPTOR_BYTES,
    description="ACME DMA engine batch copy (simulated in host memory)",
)
