"""The step benchmark's contenders: the policies a BlockMover is built with in each case, the
routes available to them here, and the route each one's job took, as the tables name it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from kvswap.cli.models import KVCache
from kvswap import BlockMover
from kvswap.registry.thresholds import Calibration
from kvswap.types import DeviceInfo, Direction, Policy

from .bench import label
from .peer import PEER_KERNEL, PEER_MAX_BLOCK, PEER_MIN_BATCH, PEER_SMS, peer_route

KiB = 1024
KERNEL_SMS = PEER_SMS  # "kernel only": the SMs vLLM's Triton path runs its copy on
VLLM_POLICY = (f"vLLM's Triton path: h2d chunks under {PEER_MAX_BLOCK // KiB} KiB in jobs of at least "
               f"{PEER_MIN_BATCH} descriptors on the kernel at {PEER_SMS} SMs, else the batch route; "
               f"d2h always the batch route")
CONTENDERS = ("default", "low_interference", "batch", f"kernel@{KERNEL_SMS}", "staged", "vllm")
# The default with one of kvswap's older mechanisms taken away (``kvswap bench --model
# --variants``): what each still gains shows against the default's step.
VARIANTS = ("default/no-thread", "default/thread-only", "default/descriptors", "default/rerun")


@dataclass(frozen=True)
class Contender:
    """One way to resolve the mover. ``exact_sms`` binds the forced kernel at exactly that
    many SMs (not the calibrated knee capped by it); ``same_as`` names the contender whose
    mover (and measurements) this one shares in a case. ``options``: further BlockMover
    arguments."""

    name: str
    policy: Policy
    exact_sms: Optional[int] = None
    same_as: Optional[str] = None
    options: tuple = ()

    @property
    def key(self) -> tuple[Policy, Optional[int]]:
        return self.policy, self.exact_sms


class Routes(NamedTuple):
    """The implementation of each kind a mover can be forced onto here, by name (None: none)."""

    batch: Optional[str]
    kernel: Optional[str]
    staged: Optional[str] = None


def variants() -> list[Contender]:
    """:data:`VARIANTS`: the default without its issuing thread (every job built and
    launched in ``submit``), without launching large by-id jobs in ``submit`` (every job
    through the thread: ``issuing_thread=True``), and sending descriptors instead of ids
    to the device; and the default again on a mover of its own
    (``default/rerun``), whose spread against the default is the run's noise."""
    return [Contender("default/no-thread", Policy(), options=(("issuing_thread", False),)),
            Contender("default/thread-only", Policy(), options=(("issuing_thread", True),)),
            Contender("default/descriptors", Policy(), options=(("device_descriptors", False),)),
            Contender("default/rerun", Policy())]


def contenders_for(direction: Direction, cache: KVCache, blocks: int, batch_impl: Optional[str],
                   kernel_impl: Optional[str], staged_impl: Optional[str] = None,
                   with_variants: bool = False) -> list[Contender]:
    """The contenders of one case. Routes that are not available here are left out (their
    impl None); vLLM's policy is the batch route or the kernel on 12 SMs, whichever its rule
    picks for this chunk size and job. ``with_variants`` adds :func:`variants`."""
    out = [Contender("default", Policy()), Contender("low_interference", Policy(prefer="low_interference"))]
    forced: dict[str, Contender] = {}
    if batch_impl:
        forced["batch"] = Contender("batch", Policy(force=batch_impl))
    if kernel_impl:
        name = f"kernel@{KERNEL_SMS}"
        forced[name] = Contender(name, Policy(force=kernel_impl, max_sms=KERNEL_SMS), exact_sms=KERNEL_SMS)
    if staged_impl:
        forced["staged"] = Contender("staged", Policy(force=staged_impl))
    out += forced.values()
    impl, _ = peer_route(str(direction), cache.chunk_bytes, blocks * cache.descriptors_per_block)
    # Where its kernel cannot run, vLLM copies on the batch route.
    twin = forced.get(f"kernel@{KERNEL_SMS}") if impl == PEER_KERNEL else None
    twin = twin or forced.get("batch")
    if twin is not None:
        out.append(Contender("vllm", twin.policy, twin.exact_sms, same_as=twin.name))
    return out + variants() if with_variants else out


def routes_available(direction: Direction, device: Any, host: Any = None) -> Routes:
    """The batch-, kernel- and staged-kind implementations a mover can use here. A route
    that needs pinned host memory (a kernel, a staged route as shipped) is left out on a
    machine without an accelerator, which has none (Triton's interpreter included)."""
    from kvswap.resolution.resolver import resolve

    plan = resolve(direction, device=device, host=host).plan
    on_cpu = plan.device.platform == "cpu"
    usable = [c for c in plan.candidates if c.available]

    def first(kind: str) -> Optional[str]:
        return next((c.name for c in usable if c.kind == kind
                     and not (on_cpu and kind != "batch" and c.constraints.get("requires_pinned", True))), None)

    return Routes(first("batch"), first("kernel"), first("staged"))


def exact_sms_calibration(dev: DeviceInfo, num_sms: int) -> Calibration:
    """What the resolver decides by to bind a forced kernel at exactly ``num_sms`` SMs."""
    return Calibration(source=f"kvswap bench --model: kernel bound at {num_sms} SMs", platform=dev.platform,
                       scope="device", kernel_sms={str(d): num_sms for d in (Direction.H2D, Direction.D2H)},
                       identity=dev.identity)


def bind(contender: Contender, dev: DeviceInfo, target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``target(*args, policy=contender.policy, **kwargs)`` (BlockMover, resolve), with the
    kernel bound at exactly ``contender.exact_sms`` SMs where it asks for that."""
    if contender.exact_sms is not None:
        kwargs["calibration"] = exact_sms_calibration(dev, contender.exact_sms)
    return target(*args, policy=contender.policy, **kwargs)


def make_mover(src: list, dst: list, direction: Direction, block_dim: int, contender: Contender,
               dev: DeviceInfo) -> BlockMover:
    """A BlockMover for ``contender`` over these tensors."""
    return bind(contender, dev, BlockMover, src, dst, direction, block_dim=block_dim, **dict(contender.options))


def _kinds(mover: BlockMover) -> dict[str, str]:
    return {c.name: c.kind for c in mover.swap_fn.plan.candidates}


def staged_by_itself(mover: BlockMover, sid: np.ndarray, did: np.ndarray) -> Optional[str]:
    """The staged route this job takes by id (a mover on a host side in long runs chooses
    it by itself, :meth:`BlockMover.explain` says so), by name; else None."""
    name = mover.id_route(len(sid))
    return name if name is not None and _kinds(mover).get(name) == "staged" else None


def route_label(mover: BlockMover, sid: np.ndarray, did: np.ndarray) -> str:
    """The route(s) this job takes, as the tables name them (``triton.kernel@12``,
    ``triton.staged``: a staged route's device side is a short burst, its SMs not named)."""
    try:
        staged = staged_by_itself(mover, sid, did)
        if staged is not None:
            return staged
        kinds = _kinds(mover)
        work = mover.swap_fn.assign(*mover.descriptors(sid, did))
        return "+".join(dict.fromkeys(label(name, None if kinds.get(name) == "staged" else sms)
                                      for name, sms, _ in work))
    except Exception:  # a label is a courtesy; the run says what failed
        return "+".join(mover.swap_fn.impls)


def is_staged(mover: BlockMover, route: str) -> bool:
    """Whether ``route`` (:func:`route_label`'s) names a staged-kind implementation."""
    kinds = _kinds(mover)
    return any(kinds.get(name.split("@")[0]) == "staged" for name in route.split("+"))
