"""The simulated hardware: `PrefillInstance`, `DecodeInstance`, `LinkModel`.

- `PrefillInstance`: one prefill instance (PrfaaS or PD), first come first served, service time
  from its hardware's profile T(l). A prompt of l tokens whose first c tokens are cached costs
  T(l) − T(c) + T(0): the new tokens still attend to the cached ones, and the fixed per-request
  cost T(0) is paid once. It keeps the loads the router reads (`InstanceLoad`): requests
  routed to it and not yet prefilled, and their uncached tokens.
- `DecodeInstance`: `max_slots` (BS_max) slots; a request holds a slot for `output_len` steps and
  waits for one when all are taken. The step time is T_decode · (f + (1 − f) · n / BS_max) with n
  running requests: f = 1 (the default) is the constant SLO-governed step of Eq. 5; f < 1 makes
  small batches faster.
- `LinkModel`: the PrfaaS → PD inter-cluster link, a bandwidth schedule of (time, Gbps) steps,
  shared equally by the transfers in flight (`SharedServer`). It counts bytes offered and sent.

Each cluster's prefix-cache pool is `CacheModel` (sim/cache_model.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

from prfaas_jax.policy.profiles import Profile
from prfaas_jax.policy.routing import DecodeLoad, InstanceLoad, Role
from prfaas_jax.sim.events import Callback, EventLoop, FifoServer, SharedServer

BYTES_PER_GBPS = 1e9 / 8


def incremental_prefill_s(profile: Profile, prompt_len: int, cached_len: int) -> float:
    """Service time of a prompt whose first `cached_len` tokens are cached (module docstring)."""
    if cached_len <= 0:
        return profile(prompt_len)
    return max(profile(prompt_len) - profile(cached_len) + profile(0), 0.0)


class PrefillInstance:
    """A prefill instance and the router's bookkeeping for it."""

    def __init__(
        self,
        name: str,
        role: Role,
        loop: EventLoop,
        profile: Profile,
        done: Callback,
        started: Callable[[Any, float], None] | None = None,
    ) -> None:
        self.name, self.role, self.profile = name, role, profile
        self.server = FifoServer(loop, done, started)
        self.outstanding = 0  # routed here, prefill not finished
        self.outstanding_tokens = 0
        self.draining = False
        self._load: InstanceLoad | None = None

    def load(self, cached_len: int = 0) -> InstanceLoad:
        """The router's view; reused while the counters stand still (most arrivals)."""
        if cached_len:
            return InstanceLoad(self.name, self.outstanding, self.outstanding_tokens, cached_len)
        if self._load is None:
            self._load = InstanceLoad(self.name, self.outstanding, self.outstanding_tokens)
        return self._load

    def assign(self, uncached_len: int) -> None:
        self.outstanding += 1
        self.outstanding_tokens += uncached_len
        self._load = None

    def submit(self, job: Any, prompt_len: int, cached_len: int) -> float:
        """Queues a prefill; returns its service time."""
        service_s = incremental_prefill_s(self.profile, prompt_len, cached_len)
        self.server.submit(job, service_s)
        return service_s

    def release(self, uncached_len: int) -> None:
        self.outstanding -= 1
        self.outstanding_tokens -= uncached_len
        self._load = None

    @property
    def idle(self) -> bool:
        return self.outstanding == 0 and len(self.server) == 0


class DecodeInstance:
    """A decode instance with `max_slots` slots (module docstring)."""

    def __init__(
        self,
        name: str,
        loop: EventLoop,
        max_slots: int,
        step_s: float,
        fixed_fraction: float = 1.0,
    ) -> None:
        if not 0 < fixed_fraction <= 1:
            raise ValueError(f"decode step fixed_fraction must be in (0, 1], got {fixed_fraction}")
        self.name, self.max_slots, self.loop, self.step_s = name, max_slots, loop, step_s
        self.role = Role.PD_DECODE
        self.server: SharedServer | None = None
        if fixed_fraction < 1:
            variable = (1.0 - fixed_fraction) / max_slots

            def rate(n: int) -> float:  # tokens per second of one running request
                return 1.0 / (step_s * (fixed_fraction + variable * n))

            self.server = SharedServer(loop, rate, max_jobs=max_slots)
        # A constant step needs no shared clock: a request holds its slot output_len · step_s.
        self.running = 0
        self.waiting: collections.deque[tuple[int, Callback, Any]] = collections.deque()
        self.assigned = 0  # routed here and not finished: the router's pick_decode load
        self.draining = False
        self._loads: dict[int, DecodeLoad] = {}

    def load(self) -> DecodeLoad:
        load = self._loads.get(self.assigned)
        if load is None:
            load = self._loads[self.assigned] = DecodeLoad(self.name, self.assigned, self.max_slots)
        return load

    def submit(self, output_len: int, done: Callback, job: Any) -> None:
        if self.server is not None:
            self.server.submit(float(output_len), done, job)
        elif self.running < self.max_slots:
            self.running += 1
            self.loop.schedule(self.loop.now + output_len * self.step_s, self._release, (done, job))
        else:
            self.waiting.append((output_len, done, job))

    def _release(self, item: tuple[Callback, Any]) -> None:
        self.running -= 1
        if self.waiting:
            self.submit(*self.waiting.popleft())
        done, job = item
        done(job)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self.server.waiting) if self.server is not None else len(self.waiting)

    @property
    def held(self) -> int:
        """Requests the instance holds: running in a slot or waiting for one."""
        running = self.server.active if self.server is not None else self.running
        return running + self.num_waiting

    @property
    def idle(self) -> bool:
        return self.assigned == 0 and self.held == 0


class LinkModel:
    """The PrfaaS → PD link: capacity follows `schedule` [(time_s, gbps), …] (module docstring)."""

    def __init__(self, loop: EventLoop, schedule: Sequence[tuple[float, float]]) -> None:
        if not schedule or schedule[0][0] != 0.0:
            raise ValueError("a bandwidth schedule starts at time 0")
        self.loop = loop
        self.server = SharedServer(loop, lambda n: 1.0 / n, schedule[0][1] * BYTES_PER_GBPS)
        self.offered_bytes = 0.0
        for at, gbps in schedule[1:]:
            loop.schedule(at, self.server.set_capacity, gbps * BYTES_PER_GBPS)

    @property
    def capacity_bytes_per_s(self) -> float:
        return self.server.capacity

    @property
    def sent_bytes(self) -> float:
        """Bytes delivered up to now (exact: the fluid integral brought up to the clock)."""
        self.server.advance()
        return self.server.served

    def send(self, num_bytes: float, done: Callable[[Any], None], arg: Any) -> None:
        self.offered_bytes += num_bytes
        self.server.submit(num_bytes, done, arg)
