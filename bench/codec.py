"""The state codec and the state transfer against a memory copy and a raw TCP socket, in one run.

For each preset and length it builds a full-size state of that model (random bytes in every
tensor; the codec does not look at values) and times, best of ``--repeat`` (the transfers after
3 untimed ones, as a long-running receiver sees them):

- ``memcpy``: a copy of the state's bytes into a fresh array (what producing new bytes costs at
  the least: the destination's pages are touched for the first time) and into a warm one;
- ``crc32``: the CRC32 of the same bytes by the codec (zlib-ng) and by CPython's ``zlib``;
- ``encode``: ``codec.encode`` with the frames consumed one at a time, as a push sends them;
- ``decode``: ``codec.decode`` of those frames into a state (checked equal to the source),
  its large fields in blocks of ``STATE_BLOCKS`` that the earlier decodes' states left
  (engine/host_memory.py; the JSON counts them);
- ``socket``: the same wire bytes, frame by frame, over one loopback TCP connection to another
  process that reads them into a buffer;
- ``grpc bytes``: the same frames as raw messages over one gRPC stream to a sink in that process
  (no protobuf, nothing decoded): what gRPC itself carries on this link, the ceiling of a push;
- ``push``: the round trip a PrfaaS state makes: encode (as a prefill worker's last frames:
  ``StreamEncoder.finish(views=True)``), ``DecodeWorker.PushState`` over a
  loopback channel of the prefill worker's (``DecodeChannels``) to another process serving the
  decode worker's servicer (``DecodeService``: decodes the push as it arrives; a 1-token
  ``Generate`` called before the push takes the state at once, as a decode worker's slot would),
  the frames on the data path (a TCP connection beside the stream:
  serving/transfer/data_path.py), timed to its reply; with the CPU seconds each side spent
  per push;
- ``push on the stream``: the same with the frames as messages of the gRPC stream
  (``[link] data_path = false``);
- ``push with TLS``, ``push on the stream with TLS`` (``--tls``): both pushes again, to a
  second receiver whose gRPC port and data port want mutual TLS, as every port beyond loopback
  does (certificates as ``prfaas certs`` makes them): what encryption costs the state
  transfer, against the plaintext push (the data path: Python's ``ssl``; the stream: gRPC's
  own TLS).

Rates are state payload bytes per second (the wire bytes are 0.01 % more); each row shows the
ratios the codec is held to: encode and decode against the warm copy (the JSON also has them
against the fresh one), the gRPC and push rates against the socket. Prints a table, then the
same as JSON.

    python bench/codec.py [--presets kimi-linear-48b,qwen3-next-80b]
                          [--lengths 1024,8192,32768,131072] [--frame-bytes 4194304]
                          [--repeat 3] [--streams 1] [--tls] [--json]

Memory: the state, its frames and the decoded copy are held at once (3× the state; 3.4 GiB
for ``kimi-linear-48b`` at 128K tokens).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator

import grpc
import jax
import numpy as np

from prfaas_jax.config import ModelConfig, load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec import checksum
from prfaas_jax.engine.codec.format import FrameParts
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.codec.layout import canonical_arrays, canonical_tensors, state_from_arrays
from prfaas_jax.engine.host_memory import STATE_BLOCKS, reuse_freed_memory
from prfaas_jax.engine.sampling_params import GREEDY
from prfaas_jax.model.state import ModelState
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transfer.channels import DecodeChannels
from prfaas_jax.serving.transfer.data_path import DataListener, push_messages
from prfaas_jax.serving.transfer.state_chunks import add_decode_worker_servicer
from prfaas_jax.serving.transfer.stripes import MAX_STRIPES
from prfaas_jax.serving.transport.certs import write_cluster_credentials
from prfaas_jax.serving.transport.security import server_credentials
from prfaas_jax.serving.transport.server import CHANNEL_OPTIONS, ServingServer
from prfaas_jax.serving.worker.decode import DecodeService

GB = 1e9
# Transfers before the timed ones: a serving process has long since touched its memory, and a
# fresh receiver spends its first pushes faulting pages in.
WARMUP = 3


def random_state(cfg: ModelConfig, length: int, seed: int = 0) -> ModelState:
    """A full-size state of ``cfg`` at ``length`` tokens, every tensor random bytes."""
    block = np.random.default_rng(seed).integers(0, 256, 2**20, np.uint8)
    arrays = []
    for spec in canonical_tensors(cfg, length):
        raw = np.resize(block, spec.nbytes)  # the 1 MiB block, repeated
        arrays.append((spec, raw.view(jax.numpy.dtype(spec.dtype)).reshape(spec.shape)))
    return state_from_arrays(cfg, length, arrays, length)


def best_of(repeat: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_times(nbytes: int, repeat: int) -> dict[str, float]:
    """Best times of a copy of ``nbytes`` into a fresh array and into a warm (touched) one, and
    of the CRC32 of those bytes by the codec (zlib-ng) and by CPython's zlib."""
    source = np.full(nbytes, 7, np.uint8)
    warm = np.zeros_like(source)
    return {
        "memcpy_fresh": best_of(repeat, lambda: np.copyto(np.empty_like(source), source)),
        "memcpy_warm": best_of(repeat, lambda: np.copyto(warm, source)),
        "crc32": best_of(repeat, lambda: checksum.crc32(source)),
        "crc32_zlib": best_of(repeat, lambda: zlib.crc32(source)),
    }


def _consume(frames: Iterator[bytes]) -> int:
    return sum(len(frame) for frame in frames)


class _TakesOneToken:
    """The decode engine of the receiver: each state is taken by a 1-token `Generate`, which
    checks nothing here and lets the state go, as a decode worker lets a finished one go."""

    max_slots = 1

    def fits(self, requests: list[tuple[int, int]]) -> int:
        return min(len(requests), self.max_slots)  # a 1-token request holds no slot

    def check_state(self, state: ModelState) -> None:
        pass


def _exit_with(parent: int) -> None:
    """End this process once ``parent`` has (a bench stopped with Ctrl-C or killed)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


SINK_SERVICE = "bench.Sink"


def _add_sink(_: object, server: grpc.Server) -> None:
    """A client stream of raw bytes, read and dropped: what gRPC alone costs per byte."""

    def take(messages: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return sum(len(message) for message in messages).to_bytes(8, "little")

    handler = grpc.stream_unary_rpc_method_handler(take)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SINK_SERVICE, {"Take": handler}),)
    )


def _receiver(
    preset: str,
    max_len: int,
    ports: multiprocessing.Queue,
    security: SecuritySection | None = None,
) -> None:
    """Another process: a TCP sink and the decode worker's servicer (mutual TLS on its ports
    with ``security``), until terminated or its parent is gone."""
    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    reuse_freed_memory()  # as a decode worker does
    cfg = load_model_config(preset)
    service = DecodeService(
        engine=_TakesOneToken,
        cfg=cfg,
        max_len=max_len,
        admit=lambda context: None,
        data_path=DataListener(security=security),
    )
    server = ServingServer(
        [
            (add_decode_worker_servicer, service, "prfaas.v1.DecodeWorker"),
            (_add_sink, None, SINK_SERVICE),
        ],
        credentials=server_credentials(security, require_client_auth=True) if security else None,
    )
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put((server.port, listener.getsockname()[1]))
    conn, _ = listener.accept()
    sink = np.empty(2**26, np.uint8)
    sink[:] = 0  # warm: the socket peer moves bytes, it does not allocate
    view = memoryview(sink)
    while True:  # each round: an 8-byte length, that many bytes, a 1-byte reply
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:  # the socket rounds are over; the servicer serves on
            threading.Event().wait()
        left = int.from_bytes(head, "little")
        while left:
            left -= conn.recv_into(view, min(left, len(view)))
        conn.sendall(b"k")


def _socket_round(conn: socket.socket, frames: list[bytes]) -> None:
    conn.sendall(sum(len(frame) for frame in frames).to_bytes(8, "little"))
    for frame in frames:
        conn.sendall(frame)
    if conn.recv(1) != b"k":
        raise RuntimeError("the socket peer closed the connection")


def _push(
    channels: DecodeChannels,
    address: str,
    state: ModelState,
    cfg: ModelConfig,
    frame_bytes: int,
    rid: str,
    streams: int = 1,
) -> pb.PushStateReply:
    """One state as a prefill worker pushes it: frames made as they are sent, on the data path
    when ``channels`` takes it; striped over ``streams`` pushes as a PrfaaS worker stripes one
    (serving/transfer/stripes.py: header, trailer and handoff on stream 0, the data frames
    round-robin; made up front, then sent by every stream at once)."""
    length = int(np.asarray(state.lengths)[0])
    encoder = codec.StreamEncoder(cfg, length, max_frame_bytes=frame_bytes)

    def frames() -> Iterator[tuple[bytes | FrameParts, bool]]:
        # As a prefill worker makes its last frames: views of the state's buffers.
        yield encoder.header(), False
        for frame in encoder.finish(state, views=True):
            yield frame, False
        yield pack_handoff(Handoff(1, GREEDY), encoder.header()), False

    stub = channels.stub(address)
    # Called first, as the router may: the state is taken as soon as it is in, and its memory
    # is free for the next push (states left parked would pile up for a second).
    request = pb.DecodeRequest(request_id=rid, prompt_len=length, max_new_tokens=1)
    taken = stub.Generate(request, timeout=600)
    if streams == 1:
        messages = push_messages(
            pb.StateChunk(request_id=rid, sender="bench"), frames(), channels.data_sender(address)
        )
        reply = stub.PushState(messages, timeout=600)
    else:
        every = list(frames())
        lanes = [[every[0]], *([] for _ in range(streams - 1))]
        for k, frame in enumerate(every[1:-2]):
            lanes[k % streams].append(frame)
        lanes[0] += every[-2:]
        pushes = []
        for lane, lane_frames in enumerate(lanes):
            first = pb.StateChunk(request_id=rid, sender="bench", stripe=lane, stripes=streams)
            sender = channels.data_sender(address)
            messages = push_messages(first, iter(lane_frames), sender)
            pushes.append(channels.stub(address, lane).PushState.future(messages, timeout=600))
        reply, *_ = [push.result() for push in pushes]
    if [t for message in taken for t in message.token_ids] != [1]:
        raise AssertionError(f"{rid}: the decode worker did not hand its state over")
    return reply


def _time_pushes(
    channels: DecodeChannels,
    address: str,
    state: ModelState,
    cfg: ModelConfig,
    args: argparse.Namespace,
    peer: int,
    pushes: Iterator[int],
) -> tuple[float, float, float]:
    """The best time of a push to the receiver at ``address`` (process ``peer``) after the
    untimed ones, and the CPU seconds per push of the receiver and of this process."""
    nbytes = sum(spec.nbytes for spec in canonical_tensors(cfg, int(np.asarray(state.lengths)[0])))

    def push() -> pb.PushStateReply:
        rid = f"r{next(pushes)}"
        return _push(channels, address, state, cfg, args.frame_bytes, rid, args.streams)

    for _ in range(WARMUP):
        reply = push()
    if reply.state_bytes != nbytes:
        raise AssertionError(f"the decode worker took {reply.state_bytes} B of {nbytes}")
    cpu = (_cpu_seconds(peer), time.process_time())
    seconds = best_of(args.repeat, push)
    receiver = (_cpu_seconds(peer) - cpu[0]) / args.repeat
    return seconds, receiver, (time.process_time() - cpu[1]) / args.repeat


def _start_receiver(
    preset: str, length: int, security: SecuritySection | None = None
) -> tuple[multiprocessing.Process, int, int]:
    """The receiver process, with its gRPC and socket ports."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    peer = context.Process(target=_receiver, args=(preset, length, ports, security), daemon=True)
    peer.start()
    grpc_port, socket_port = ports.get(timeout=120)
    return peer, grpc_port, socket_port


def _pushes_with_tls(
    state: ModelState, cfg: ModelConfig, preset: str, args: argparse.Namespace, row: dict
) -> dict[str, float]:
    """The pushes to a receiver whose ports want mutual TLS, on the data path and on the
    stream: their best times (and their CPU seconds per push into ``row``)."""
    with tempfile.TemporaryDirectory() as folder:
        paths = write_cluster_credentials(folder, days=1)
        security = SecuritySection(**{k: str(v) for k, v in paths.items() if k != "token_file"})
        peer, grpc_port, _ = _start_receiver(preset, int(np.asarray(state.lengths)[0]), security)
        try:
            address = f"127.0.0.1:{grpc_port}"
            return _pushes(peer.pid, address, security, "_tls", state, cfg, args, row)
        finally:
            peer.terminate()
            peer.join()


def _pushes(
    peer: int,
    address: str,
    security: SecuritySection | None,
    suffix: str,
    state: ModelState,
    cfg: ModelConfig,
    args: argparse.Namespace,
    row: dict,
) -> dict[str, float]:
    """Both pushes to the receiver at ``address`` (process ``peer``): the frames on the data
    path ("push" + ``suffix``) and on the stream ("push_stream" + ``suffix``); their best
    times, and their CPU seconds per push on each side into ``row``."""
    times, pushes = {}, iter(range(10**6))
    for name, data_path in ((f"push{suffix}", True), (f"push_stream{suffix}", False)):
        channels = DecodeChannels(security, data_path=data_path)
        times[name], receiver, sender = _time_pushes(
            channels, address, state, cfg, args, peer, pushes
        )
        # Where the round trip's time goes: CPU seconds per push on each side.
        row[f"{name}_receiver_cpu_s"], row[f"{name}_sender_cpu_s"] = receiver, sender
    return times


def measure(preset: str, length: int, args: argparse.Namespace) -> dict:
    cfg = load_model_config(preset)
    state = random_state(cfg, length)
    nbytes = sum(spec.nbytes for spec in canonical_tensors(cfg, length))
    row: dict = {"preset": preset, "length": length, "state_bytes": nbytes}
    times = copy_times(nbytes, args.repeat)
    encode = lambda: codec.encode(state, cfg, max_frame_bytes=args.frame_bytes)  # noqa: E731
    _consume(encode())  # first call: warm-up
    times["encode"] = best_of(args.repeat, lambda: _consume(encode()))
    frames = list(encode())
    row["wire_bytes"] = sum(len(frame) for frame in frames)
    row["frames"] = len(frames)
    decoded = codec.decode(frames, cfg)
    if not _same(state, decoded, cfg):
        raise AssertionError(f"{preset} L={length}: the decoded state differs from the source")
    del decoded
    taken, reused = STATE_BLOCKS.taken, STATE_BLOCKS.reused
    times["decode"] = best_of(args.repeat, lambda: jax.block_until_ready(codec.decode(frames, cfg)))
    # How many of the timed decodes' large fields went into blocks an earlier state left.
    row["decode_blocks"] = STATE_BLOCKS.taken - taken
    row["decode_blocks_reused"] = STATE_BLOCKS.reused - reused

    peer, grpc_port, socket_port = _start_receiver(preset, length)
    try:
        with socket.create_connection(("127.0.0.1", socket_port)) as conn:
            for _ in range(WARMUP):
                _socket_round(conn, frames)
            times["socket"] = best_of(args.repeat, lambda: _socket_round(conn, frames))
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=CHANNEL_OPTIONS)
        take = channel.stream_unary(f"/{SINK_SERVICE}/Take")
        sink = lambda: take(iter(frames), timeout=600)  # noqa: E731
        for _ in range(WARMUP):
            sink()
        times["grpc_bare"] = best_of(args.repeat, sink)
        channel.close()
        times |= _pushes(peer.pid, f"127.0.0.1:{grpc_port}", None, "", state, cfg, args, row)
    finally:
        peer.terminate()
        peer.join()
    if args.tls:
        times |= _pushes_with_tls(state, cfg, preset, args, row)
    row |= {f"{name}_s": seconds for name, seconds in times.items()}
    rates = {name: nbytes / seconds for name, seconds in times.items()}
    row |= {f"{name}_gb_s": rate / GB for name, rate in rates.items()}
    row["encode_vs_fresh"] = rates["encode"] / rates["memcpy_fresh"]
    row["decode_vs_fresh"] = rates["decode"] / rates["memcpy_fresh"]
    row["encode_vs_warm"] = rates["encode"] / rates["memcpy_warm"]
    row["decode_vs_warm"] = rates["decode"] / rates["memcpy_warm"]
    row["push_vs_socket"] = rates["push"] / rates["socket"]
    row["push_stream_vs_socket"] = rates["push_stream"] / rates["socket"]
    row["grpc_bare_vs_socket"] = rates["grpc_bare"] / rates["socket"]
    if args.tls:
        row["push_tls_vs_push"] = rates["push_tls"] / rates["push"]
        row["push_stream_tls_vs_push"] = rates["push_stream_tls"] / rates["push"]
    return row


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _same(a: ModelState, b: ModelState, cfg: ModelConfig) -> bool:
    (la, xs), (lb, ys) = canonical_arrays(a, cfg, 0), canonical_arrays(b, cfg, 0)
    return la == lb and all(
        x.tobytes() == y.tobytes() for (_, x), (_, y) in zip(xs, ys, strict=True)
    )


COLUMNS = (
    ("preset", "preset", "{}"),
    ("L", "length", "{:,}"),
    ("MiB", "state_bytes", None),
    ("memcpy fresh/warm GB/s", None, None),
    ("encode GB/s", "encode_gb_s", "{:.2f}"),
    ("decode GB/s", "decode_gb_s", "{:.2f}"),
    ("enc/dec ÷ warm", None, None),
    ("socket GB/s", "socket_gb_s", "{:.2f}"),
    ("gRPC bytes GB/s (÷ socket)", None, None),
    ("push GB/s (÷ socket)", None, None),
    ("push on the stream GB/s (÷ socket)", None, None),
    ("CPU-s per push: receiver / sender", None, None),
    ("CRC32 GB/s: zlib-ng / zlib", None, None),
)
TLS_COLUMNS = (
    ("push with TLS GB/s (÷ push)", "push_tls", None),
    ("push on the stream with TLS GB/s (÷ push)", "push_stream_tls", None),
)


def columns(rows: list[dict]) -> tuple[tuple[str, str | None, str | None], ...]:
    """The table's columns: with ``--tls`` the TLS pushes too."""
    return (*COLUMNS, *TLS_COLUMNS) if rows and "push_tls_gb_s" in rows[0] else COLUMNS


def cells(row: dict) -> list[str]:
    out = []
    for title, key, fmt in columns([row]):
        if title == "MiB":
            out.append(f"{row['state_bytes'] / 2**20:,.0f}")
        elif title.startswith("memcpy"):
            out.append(f"{row['memcpy_fresh_gb_s']:.1f} / {row['memcpy_warm_gb_s']:.1f}")
        elif title.startswith("gRPC bytes"):
            out.append(f"{row['grpc_bare_gb_s']:.2f} ({row['grpc_bare_vs_socket']:.0%})")
        elif title.endswith("with TLS GB/s (÷ push)"):
            out.append(f"{row[f'{key}_gb_s']:.2f} ({row[f'{key}_vs_push']:.0%})")
        elif title.startswith("push on the stream"):
            out.append(f"{row['push_stream_gb_s']:.2f} ({row['push_stream_vs_socket']:.0%})")
        elif title.startswith("push GB/s"):
            out.append(f"{row['push_gb_s']:.2f} ({row['push_vs_socket']:.0%})")
        elif title.startswith("CRC32"):
            out.append(f"{row['crc32_gb_s']:.1f} / {row['crc32_zlib_gb_s']:.1f}")
        elif title.startswith("CPU-s"):
            out.append(f"{row['push_receiver_cpu_s']:.2f} / {row['push_sender_cpu_s']:.2f}")
        elif title.startswith("enc/dec ÷ warm"):
            out.append(f"{row['encode_vs_warm']:.0%} / {row['decode_vs_warm']:.0%}")
        else:
            out.append(fmt.format(row[key]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="The state codec and transfer against memcpy and a raw TCP socket.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n")[-2],
    )
    parser.add_argument("--presets", default="kimi-linear-48b,qwen3-next-80b")
    parser.add_argument("--lengths", default="1024,8192,32768,131072")
    parser.add_argument("--frame-bytes", type=int, default=codec.DEFAULT_MAX_FRAME_BYTES)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--streams", type=int, default=1, help="pushes a state is striped over ([link] streams)"
    )
    parser.add_argument(
        "--tls", action="store_true", help="also push to a receiver whose ports want mutual TLS"
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    reuse_freed_memory()  # as a prefill worker does
    try:
        presets = [name for name in args.presets.split(",") if name]
        lengths = [int(n) for n in args.lengths.split(",") if n]
        for name in presets:
            load_model_config(name)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    if args.repeat < 1 or any(n < 1 for n in lengths):
        parser.error("--repeat and every length must be ≥ 1")
    if not 1 <= args.streams <= MAX_STRIPES:
        parser.error(f"--streams must be in [1, {MAX_STRIPES}]")
    rows = []
    for name in presets:
        for length in lengths:
            rows.append(measure(name, length, args))
            if not args.json:
                print(" | ".join(cells(rows[-1])), file=sys.stderr, flush=True)
    result = {
        "machine": {"cpus": multiprocessing.cpu_count(), "platform": platform.platform()},
        "frame_bytes": args.frame_bytes,
        "repeat": args.repeat,
        "streams": args.streams,
        "tls": args.tls,
        "rows": rows,
    }
    if not args.json:
        shown = columns(rows)
        print("| " + " | ".join(title for title, _, _ in shown) + " |")
        print("|" + "---|" * len(shown))
        for row in rows:
            print("| " + " | ".join(cells(row)) + " |")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
