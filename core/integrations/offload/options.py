"""kvswap's options for an engine's offloading, read from the engine's own configuration.

An engine hands kvswap one mapping (vLLM: ``kv_connector_extra_config["kvswap"]``). Every
field of :class:`kvswap.Policy` passes through by name (``max_sms``, ``prefer``, ``force``,
...), beside the options of the offloading worker itself. Anything else is refused, naming
the key and the valid ones, when the engine starts: a misspelt option never goes unnoticed.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
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
        if self.numa_node is not None:
            object.__setattr__(self, "numa_node", whole(self.numa_node, "numa_node"))
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


def whole(value: Any, name: str, minimum: int = 0) -> int:
    """``value`` as an int where it is a whole number (an int, or an integral float such as
    ``4e9``), never a bool; refused in the words :func:`kvswap.types.whole` uses for
    :class:`~kvswap.Policy` (integrations see only kvswap's public API, so the rule is
    restated here, and tests/test_offload_options.py holds the two to one wording)."""
    n = None
    if isinstance(value, bool):
        pass
    elif isinstance(value, numbers.Integral):
        n = int(value)
    elif isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        n = int(value)
    if n is None or n < minimum:
        raise ConfigurationError(f"{name}={value!r} must be a whole number >= {minimum}")
    return n


def host_bytes(value: Any, where: str = "host memory") -> int:
    """``value`` (an engine's setting, named ``where`` in messages) as a number of bytes: a
    whole number >= 1 (``4e9`` too), or a string of digits, as the engine's own ``int()``
    of it takes.

    :raises ConfigurationError: anything else (``"8GB"``, 0, -5, 1.5).
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return whole(value, where, 1)


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
