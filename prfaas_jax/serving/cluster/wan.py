"""The cross-datacenter link in packets: `WanModel` (one-way delay, jitter, loss and loss bursts)
and the forwarder that applies it to every packet between the two clusters' namespaces,
`python -m prfaas_jax.serving.cluster.wan`.

The kernel of the machines this runs on has no `netem`, so the delay line is in user space:
under `prfaas serve --netns` with a `[link]` that asks for delay, jitter or loss, the PrfaaS and
PD namespaces are joined through a third, `<prefix>-wan` (serving/cluster/netns.py), whose policy
routes hand every packet that crosses between them to a TUN device. This process reads each
packet from the TUN device, decides its fate, and writes it back at its release time; the kernel
then forwards it on to the other cluster. So TCP itself sees the round trip, the losses and the
reordering — segments, not messages — exactly as it would on a long link. The rate stays in the
kernel: a `tbf` on the PrfaaS side's veth, before the delay line (serving/transport/kernel_link.py).

Each direction (told apart by the packet's IPv4 destination) has its own state:

- **delay**: ``release = arrival + delay + jitter``, jitter drawn from a normal distribution of
  standard deviation `jitter_s`, clipped so no packet arrives before ``arrival``; without
  `reorder` a packet is never released before the one ahead of it (so jitter spreads a flow's
  arrivals without reordering TCP into collapse), with `reorder` each keeps its own time.
- **loss**: long-run rate `loss`, in bursts of `loss_burst` consecutive packets on average.
  With `loss_burst` at most 1 / (1 − loss) — what independent losses give, so the default 1
  included — each packet is lost independently with probability `loss` (Bernoulli). Above it,
  a Gilbert chain of two states (good, bad) steps once per packet and a packet is lost exactly
  when the chain is bad: it leaves the bad state with probability r = 1 / loss_burst (so a burst
  lasts loss_burst packets on average, geometrically) and enters it with p = loss · r /
  (1 − loss), so its stationary share, the long-run loss rate, is p / (p + r) = loss.

Draws come from a `random.Random(seed)` per direction, so a run is reproducible given its packet
order. With `--control-file` the model changes while the link runs (`WanControl`: another one-way
delay, loss rate or burst length, or a blackhole that drops every packet), read about five times
a second, and acknowledged in `<control file>.applied`; `prfaas soak --netns` injects its link
faults this way
(serving/loadgen/fault_runner.py). The process exits when its parent (the launcher) dies or on
SIGTERM; the TUN device and the namespace are the launcher's to delete. Its counters (packets and
bytes each way, losses, blackholed packets, the largest queue) are written to `--stats-file` every
second and on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import heapq
import json
import math
import os
import random
import select
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.cluster_sections import LinkSection
from prfaas_jax.serving.transport.lifecycle import (
    die_with_parent,
    install_stop_handlers,
    write_json,
)

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MAX_PACKET = 65_535
TICKS_PER_STATS = 5  # control-file reads per stats write (one a second)


@dataclasses.dataclass(frozen=True)
class WanModel:
    """What the link does to each packet, per direction (module docstring)."""

    delay_s: float = 0.0  # one way; the round trip is twice this
    jitter_s: float = 0.0  # standard deviation of the extra delay
    loss: float = 0.0  # long-run fraction of packets lost, in [0, 1)
    loss_burst: float = 1.0  # mean packets per loss burst, ≥ 1
    reorder: bool = False  # jitter may reorder packets
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.delay_s >= 0 and self.jitter_s >= 0):
            raise ValueError("a WAN needs delay ≥ 0 and jitter ≥ 0")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss {self.loss} is outside [0, 1)")
        if self.loss_burst < 1:
            raise ValueError(f"loss_burst {self.loss_burst} is below 1 packet")

    @property
    def active(self) -> bool:
        """Whether packets need the delay line at all."""
        return bool(self.delay_s or self.jitter_s or self.loss)


@dataclasses.dataclass(frozen=True)
class WanControl:
    """What a control file asks of the link for now: fields left None keep the configured
    model's; `blackhole` drops every packet (counted apart from the model's losses)."""

    delay_s: float | None = None
    loss: float | None = None
    loss_burst: float | None = None
    blackhole: bool = False

    def applied_to(self, model: WanModel) -> WanModel:
        changes = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        changes.pop("blackhole")
        return dataclasses.replace(model, **changes)


class GilbertLoss:
    """The loss process of one direction (module docstring): `lost()` decides one packet."""

    def __init__(self, loss: float, burst: float, rng: random.Random) -> None:
        self._rng, self._loss = rng, loss
        self.independent = burst <= 1.0 / (1.0 - loss)
        self._leave = 1.0 / burst  # r: bad → good
        self._enter = loss * self._leave / (1.0 - loss)  # p: good → bad
        self._bad = False

    def lost(self) -> bool:
        if self.independent:
            return self._rng.random() < self._loss
        if self._bad:
            self._bad = self._rng.random() >= self._leave
        else:
            self._bad = self._rng.random() < self._enter
        return self._bad


class Direction:
    """One direction's delay line: packets in, packets out at their release times."""

    def __init__(self, model: WanModel, seed: int) -> None:
        self.model = model
        self._rng = random.Random(seed)
        self._loss = GilbertLoss(model.loss, model.loss_burst, self._rng)
        self._queue: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self._last_release = -math.inf
        self.blackhole = False
        self.packets = self.bytes = self.lost = self.blackholed = self.max_queued = 0

    def retune(self, model: WanModel, blackhole: bool) -> None:
        """Apply another model to the packets that come from now on (those queued keep their
        release times); the loss process restarts in its good state."""
        self.model, self.blackhole = model, blackhole
        self._loss = GilbertLoss(model.loss, model.loss_burst, self._rng)

    def push(self, packet: bytes, now: float) -> None:
        self.packets += 1
        self.bytes += len(packet)
        if self.blackhole:
            self.blackholed += 1
            return
        if self._loss.lost():
            self.lost += 1
            return
        model = self.model
        extra = self._rng.gauss(0.0, model.jitter_s) if model.jitter_s else 0.0
        release = now + max(model.delay_s + extra, 0.0)
        if not model.reorder:
            release = max(release, self._last_release)
        self._last_release = release
        heapq.heappush(self._queue, (release, self._seq, packet))
        self._seq += 1
        self.max_queued = max(self.max_queued, len(self._queue))

    def next_release(self) -> float:
        return self._queue[0][0] if self._queue else math.inf

    def due(self, now: float) -> list[bytes]:
        out = []
        while self._queue and self._queue[0][0] <= now:
            out.append(heapq.heappop(self._queue)[2])
        return out

    def stats(self) -> dict:
        return {
            "packets": self.packets,
            "bytes": self.bytes,
            "lost": self.lost,
            "blackholed": self.blackholed,
            "max_queued": self.max_queued,
        }


class DelayLine:
    """Both directions, told apart by the IPv4 destination: packets to ``forward_dest`` (the PD
    cluster's host) go one way, everything else the other."""

    def __init__(self, model: WanModel, forward_dest: str) -> None:
        self._forward_dest = bytes(int(part) for part in forward_dest.split("."))
        self.model = model  # the configured one, which a `WanControl` modifies
        self.forward = Direction(model, model.seed)
        self.backward = Direction(model, model.seed + 1)

    def control(self, control: WanControl) -> None:
        """Both directions to ``control`` applied to the configured model."""
        for direction in (self.forward, self.backward):
            direction.retune(control.applied_to(self.model), control.blackhole)

    def push(self, packet: bytes, now: float) -> None:
        forward = len(packet) >= 20 and packet[16:20] == self._forward_dest
        (self.forward if forward else self.backward).push(packet, now)

    def next_release(self) -> float:
        return min(self.forward.next_release(), self.backward.next_release())

    def due(self, now: float) -> list[bytes]:
        return [*self.forward.due(now), *self.backward.due(now)]

    def stats(self) -> dict:
        return {"forward": self.forward.stats(), "backward": self.backward.stats()}


def open_tun(name: str) -> int:
    """A file descriptor on the existing TUN device ``name`` (raw IP packets, no header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return fd


def forward(
    fd: int,
    line: DelayLine,
    *,
    stop: threading.Event,
    on_tick: Callable[[], None] | None = None,
    tick_s: float = 1.0,
) -> None:
    """Read every packet the kernel routes into ``fd``, write each back at its release time,
    until ``stop`` is set; ``on_tick()`` runs about every ``tick_s``."""
    clock = time.monotonic
    next_tick = clock() + tick_s
    while not stop.is_set():
        now = clock()
        wait = min(line.next_release(), next_tick) - now
        readable, _, _ = select.select([fd], [], [], max(wait, 0.0))
        now = clock()
        if readable:
            while True:
                try:
                    packet = os.read(fd, MAX_PACKET)
                except BlockingIOError:
                    break
                line.push(packet, now)
        for packet in line.due(now):
            with contextlib.suppress(OSError):  # no route (a namespace going away): lost
                os.write(fd, packet)
        if now >= next_tick:
            next_tick = now + tick_s
            if on_tick is not None:
                on_tick()


def model_of(link: LinkSection, seed: int = 0) -> WanModel:
    """The packet model a cluster config's `[link]` asks for."""
    return WanModel(
        delay_s=link.one_way_delay_s,
        jitter_s=link.jitter_ms / 1e3,
        loss=link.loss_percent / 100,
        loss_burst=link.loss_burst,
        reorder=link.reorder,
        seed=seed,
    )


def applied_path(control_file: str | os.PathLike[str]) -> Path:
    """Where the delay line writes the control it has applied (`<control file>.applied`)."""
    path = Path(control_file)
    return path.with_name(path.name + ".applied")


class _ControlFile:
    """The control file, applied when its modification time changes (a missing one: the
    configured model); what was applied is then written to `applied_path`, so a writer knows
    when packets meet its control."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._seen: tuple = ()

    def apply(self, line: DelayLine) -> None:
        try:
            stat = os.stat(self.path)
        except (OSError, TypeError):
            stamp, fields = (), {}
        else:
            stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            if stamp == self._seen:
                return
            try:
                fields = json.loads(Path(self.path).read_text())
            except (OSError, ValueError):
                return  # mid-write by another writer: the next tick reads it
        if stamp != self._seen:
            self._seen = stamp
            line.control(WanControl(**fields))
            if self.path:
                write_json(applied_path(self.path), fields)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="the inter-cluster delay line of prfaas serve --netns: it serves a TUN "
        "device whose packets the WAN namespace routes to it (the module's docstring)"
    )
    parser.add_argument("--tun", required=True, help="the TUN device to serve (it must exist)")
    parser.add_argument("--forward-dest", required=True, help="IPv4 of the PD cluster's host")
    parser.add_argument("--config", help="a cluster config: its [link] gives the model")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (no --config)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="std. dev. of extra delay")
    parser.add_argument("--loss-percent", type=float, default=0.0)
    parser.add_argument("--loss-burst", type=float, default=1.0, help="mean packets per burst")
    parser.add_argument("--reorder", action="store_true", help="jitter may reorder packets")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, help="exit when this process dies")
    parser.add_argument("--address-file", help="written ({pid}) once the device is served")
    parser.add_argument("--stats-file", help="counters as JSON, rewritten every second")
    parser.add_argument(
        "--control-file", help="a `WanControl` as JSON, re-read while the link runs"
    )
    args = parser.parse_args(argv)
    try:
        if args.config:
            config = load_cluster_config(args.config)
            model = model_of(config.link, config.model.seed)
        else:
            model = WanModel(
                delay_s=args.delay_ms / 1e3,
                jitter_s=args.jitter_ms / 1e3,
                loss=args.loss_percent / 100,
                loss_burst=args.loss_burst,
                reorder=args.reorder,
                seed=args.seed,
            )
    except (UserError, ValueError) as err:
        parser.exit(2, f"prfaas wan: {err}\n")
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    stop = install_stop_handlers()
    line = DelayLine(model, args.forward_dest)
    fd = open_tun(args.tun)
    if args.address_file:
        write_json(args.address_file, {"pid": os.getpid(), "tun": args.tun})

    ticks, control = 0, _ControlFile(args.control_file)

    def tick() -> None:
        nonlocal ticks
        ticks += 1
        if args.control_file:
            control.apply(line)
        if args.stats_file and ticks % TICKS_PER_STATS == 0:
            write_json(args.stats_file, line.stats())

    try:
        forward(fd, line, stop=stop, on_tick=tick, tick_s=1.0 / TICKS_PER_STATS)
    finally:
        if args.stats_file:
            write_json(args.stats_file, line.stats())
        os.close(fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
