"""Which faults `prfaas soak --netns` injects, and when: `fault_schedule(duration_s, seed)` → a
list of `Fault`s (pure and seeded: the same arguments give the same schedule), `FAULT_KINDS`,
`HOLD_S` (how long each kind lasts) and `allows_twice`.

The kinds, each a fault a cross-datacenter deployment meets on the path or in its processes:

- on the inter-cluster link (the delay line of serving/cluster/wan.py, or the kernel's tbf):
  ``loss_burst`` (a fifth of the packets lost, in bursts of 8), ``blackhole`` (every packet
  dropped, then the link restored), ``rtt_spike`` (ten times the round trip), ``bandwidth_drop``
  (a tenth of the rate);
- on the processes: ``sigkill:<role>`` and ``sigstop:<role>`` (stopped, then SIGCONT) for each
  worker role, ``sigterm:prfaas_prefill`` (the prefill worker of the long prompts, with requests
  in flight, asked to stop) and
  ``sigterm:frontdoor`` (the HTTP front door likewise).

Corrupted frames are not scheduled: the prefill workers corrupt a share of their transfers all
along (the config's `[faults]`, serving/transfer/faults.py).

A schedule is rounds of every kind in a seeded random order, one fault at a time: each starts
`gap` after the previous one ended, the first after `warmup_s`, and none ends later than
`settle_s` before `duration_s`, so requests sent after it show whether the cluster recovered.
The gap is what spreads two rounds evenly over the run (at least `MIN_GAP_S`); a run too short for
two rounds gets what fits, and a long one more rounds.
"""

from __future__ import annotations

import dataclasses
import random

WORKER_ROLES = ("prfaas_prefill", "pd_prefill", "pd_decode")
LINK_KINDS = ("loss_burst", "blackhole", "rtt_spike", "bandwidth_drop")
PROCESS_KINDS = (
    *(f"sigkill:{role}" for role in WORKER_ROLES),
    *(f"sigstop:{role}" for role in WORKER_ROLES),
    "sigterm:prfaas_prefill",
    "sigterm:frontdoor",
)
FAULT_KINDS = (*LINK_KINDS, *PROCESS_KINDS)
CORRUPT_FRAMES = "corrupt_frames"  # injected by the workers' `[faults]`, counted from their logs
# Seconds a fault holds before it is undone (a kill or a stop request is instantaneous). A stop
# outlasts the soak config's stall timeout, so the router's watchdog has to act.
HOLD_S = {
    "loss_burst": 4.0,
    "blackhole": 3.0,
    "rtt_spike": 5.0,
    "bandwidth_drop": 6.0,
    **{f"sigstop:{role}": 8.0 for role in WORKER_ROLES},
}
MIN_GAP_S = 2.0
ROUNDS = 2  # each kind at least this often when the duration allows


@dataclasses.dataclass(frozen=True)
class Fault:
    at_s: float  # from the start of arrivals
    kind: str

    @property
    def hold_s(self) -> float:
        return HOLD_S.get(self.kind, 0.0)

    @property
    def end_s(self) -> float:
        return self.at_s + self.hold_s


def _gap(duration_s: float, warmup_s: float, settle_s: float) -> float:
    held = ROUNDS * sum(HOLD_S.get(kind, 0.0) for kind in FAULT_KINDS)
    spare = duration_s - warmup_s - settle_s - held
    return max(spare / (ROUNDS * len(FAULT_KINDS)), MIN_GAP_S)


def fault_schedule(
    duration_s: float, seed: int, *, warmup_s: float = 5.0, settle_s: float = 10.0
) -> list[Fault]:
    """The faults of a run of `duration_s` seconds of arrivals, in time order (module
    docstring)."""
    rng = random.Random(seed)
    gap = _gap(duration_s, warmup_s, settle_s)
    faults: list[Fault] = []
    at = warmup_s
    while True:
        order = list(FAULT_KINDS)
        rng.shuffle(order)
        for kind in order:
            fault = Fault(round(at, 3), kind)
            if fault.end_s > duration_s - settle_s:
                return faults
            faults.append(fault)
            at = fault.end_s + gap


def allows_twice(duration_s: float, seed: int = 0) -> bool:
    """Whether a run this long injects every kind at least `ROUNDS` times."""
    faults = fault_schedule(duration_s, seed)
    return all(sum(f.kind == kind for f in faults) >= ROUNDS for kind in FAULT_KINDS)
