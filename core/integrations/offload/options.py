"""kvswap's options for an engine's offloading, read from the engine's own configuration.

An engine hands kvswap one mapping (vLLM: ``kv_connector_extra_config["kvswap"]``). Every
field of :class:`kvswap.Policy` passes through by name (``max_sms``, ``prefer``, ``force``,
...), beside the options of the offloading worker itself. Anything else is refused, naming
the key and the valid ones, when the engine starts: a misspelt option never goes unnoticed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ... import ConfigurationError, Policy

WORKER_KEYS = ("numa_node", "stats_file", "corrupt_loads")


@dataclass(frozen=True)
class OffloadOptions:
    """What kvswap is told for one engine's offloading.

    :ivar policy: passed to both movers (SM budget, preference, forced route, ...).
    :ivar numa_node: the NUMA node of the host cache (None: the device's).
    :ivar stats_file: a JSON file the worker rewrites with its counters whenever jobs
        finish, and at shutdown (``{rank}`` in the name becomes the engine worker's rank).
    :ivar corrupt_loads: a test control: overwrite every loaded device block with random
        bytes once its load has finished, so that a comparison of outputs can show it
        would see a bad load. Never for serving.
    """

    policy: Policy = field(default_factory=Policy)
    numa_node: Optional[int] = None
    stats_file: Optional[str] = None
    corrupt_loads: bool = False

    def __post_init__(self) -> None:
        n = self.numa_node
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigurationError(f"numa_node={n!r} must be a NUMA node number >= 0, or left out")
        if self.stats_file is not None and (not isinstance(self.stats_file, str) or not self.stats_file):
            raise ConfigurationError(f"stats_file={self.stats_file!r} must be a file path")
        if not isinstance(self.corrupt_loads, bool):
            raise ConfigurationError(f"corrupt_loads={self.corrupt_loads!r} must be true or false")

    @classmethod
    def parse(cls, options: Optional[Mapping[str, Any]], where: str = "kvswap options") -> OffloadOptions:
        """Options from a mapping of plain values (what a JSON object gives).

        :param where: how the engine's user names the mapping, for messages.
        :raises ConfigurationError: not a mapping, an unknown key, or a bad value; the
            message names the key and, for an unknown one, the valid keys.
        """
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise ConfigurationError(f"{where}={options!r} must be a mapping (a JSON object) of kvswap options")
        policy_keys = tuple(f.name for f in dataclasses.fields(Policy))
        unknown = sorted(set(options) - set(policy_keys) - set(WORKER_KEYS), key=repr)  # keys of any type
        if unknown:
            raise ConfigurationError(f"{where}: unknown option(s) {', '.join(map(repr, unknown))}; "
                                     f"valid: {', '.join(policy_keys + WORKER_KEYS)}")
        try:
            policy = Policy(**{k: options[k] for k in policy_keys if k in options})
            return cls(policy=policy, **{k: options[k] for k in WORKER_KEYS if k in options})
        except ConfigurationError as e:
            raise ConfigurationError(f"{where}: {e}") from e


def _whole(value: Any) -> Optional[int]:
    """``value`` as a whole number (an int, an integral float such as 4e9, or digits)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def host_bytes(value: Any, where: str = "host memory") -> int:
    """``value`` (an engine's setting, named ``where`` in messages) as a number of bytes.

    :raises ConfigurationError: not a positive whole number of bytes (``"8GB"``, 0, -5, 1.5).
    """
    total = _whole(value)
    if total is None or total <= 0:
        raise ConfigurationError(f"{where}={value!r}: give a positive whole number of bytes")
    return total


def chunks_for(memory: Any, bytes_per_block: int, blocks_per_chunk: int, workers: int = 1,
               where: str = "host memory") -> int:
    """How many chunks of ``blocks_per_chunk`` blocks fit ``memory`` bytes of host memory
    shared by ``workers`` engine workers, each with its own cache of ``bytes_per_block``
    per block.

    :param where: how the engine's user names the host memory, for messages.
    :raises ConfigurationError: ``memory`` is not a positive number of bytes, or too
        small for one chunk.
    """
    total = host_bytes(memory, where)
    per_chunk = bytes_per_block * blocks_per_chunk * workers
    if per_chunk <= 0:
        raise ConfigurationError(f"a chunk of {blocks_per_chunk} blocks of {bytes_per_block} bytes for "
                                 f"{workers} worker(s) must hold at least one byte")
    n = total // per_chunk
    if n < 1:
        raise ConfigurationError(f"{where}={total} bytes holds no chunk: one takes {per_chunk} bytes "
                                 f"({blocks_per_chunk} block(s) of {bytes_per_block} bytes for {workers} worker(s))")
    return n
