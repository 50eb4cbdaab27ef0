"""KV-cache events for LLM-aware routers: the engine core's prefix-cache changes, published over ZeroMQ
in the layout vLLM workers use, so routers that follow vLLM's events (vllm-router's kv_aware policy,
NVIDIA Dynamo's KV router) can follow `optimize serve` too.

`optimize serve --kv-events tcp://HOST:PORT` binds a PUB socket there and a replay (ROUTER) socket on
PORT + 1. The engine thread hands the core's event log (`Scheduler.kv_events()`: raw uint64 records,
one bytes object per step) to a queue; this module's thread decodes, batches, encodes and sends it,
so the step loop pays one bytes copy per step and nothing else.

Wire layout (declared here from vLLM's public event format; msgpack throughout):

    PUB message, 3 frames:     [topic, seq, payload]
        topic                  b"" (subscribers filter on the empty prefix)
        seq                    8 bytes, big-endian signed: 0, 1, 2, ... per published batch; a
                               subscriber that sees seq jump has missed batches (a gap)
        payload                a batch: [ts, [event, ...]]
            ts                 float, seconds since the epoch when the batch was sent
            event              a map tagged by its "type" (string keys):
              {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
               "lora_id", "medium", "lora_name"}
                  block_hashes        [uint64, ...]: consecutive blocks of one sequence, first to last
                  parent_block_hash   uint64 of the block before the first one, or nil for a sequence's
                                      first block
                  token_ids           the blocks' tokens, len(block_hashes) * block_size of them
                  block_size          int; lora_id, medium, lora_name: nil (no adapters; one device tier)
              {"type": "BlockRemoved", "block_hashes", "medium"}   blocks evicted from the prefix cache
              {"type": "AllBlocksCleared"}     forget every block of this worker (the first event a
                                               starting worker publishes)

    Replay (ROUTER at PORT + 1): a DEALER sends [b"", start_seq (8 bytes, big-endian)]; the worker
    answers every buffered batch with seq >= start_seq as [b"", seq, payload], oldest first, then
    [b"", -1 (8 bytes, big-endian signed), b""]. The buffer keeps the last `replay_batches` batches;
    a subscriber asking for older ones gets what is left, and sees the gap in the first seq.

Block hashes are the core's own prefix-cache hashes: 64-bit, keyed per scheduler, chained from the
request's cache salt (`--cache-salt-header`), so one tenant's hashes never match another's. Token
ids of every tenant's cached blocks do travel on this socket: bind it to an internal address that
only the router reaches, never beside the public API.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import msgpack
import zmq

from runtime.core import KVEvent, decode_kv_events

log = logging.getLogger(__name__)

__all__ = ["KVEventPublisher", "encode_events", "parse_endpoint", "END_SEQ"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


def parse_endpoint(endpoint: str) -> tuple[str, str]:
    """`tcp://HOST:PORT` -> (PUB endpoint, replay endpoint at PORT + 1); ValueError on anything else."""
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path or not 0 < port < 65535:
        raise ValueError(f"--kv-events: expected tcp://HOST:PORT with PORT in [1, 65534] (PORT + 1 is the "
                         f"replay socket), got {endpoint!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"


def encode_events(events: Iterable[KVEvent], block_size: int) -> list[dict[str, Any]]:
    """The core's events as wire events: runs of stored blocks that chain (each one's parent is the
    previous one) become one BlockStored, runs of removals one BlockRemoved."""
    out: list[dict[str, Any]] = []
    for ev in events:
        last = out[-1] if out else None
        if ev.kind == "stored":
            if last is not None and last["type"] == "BlockStored" and ev.parent_hash == last["block_hashes"][-1]:
                last["block_hashes"].append(ev.block_hash)
                last["token_ids"].extend(ev.token_ids)
            else:
                out.append({"type": "BlockStored", "block_hashes": [ev.block_hash], "parent_block_hash": ev.parent_hash,
                            "token_ids": list(ev.token_ids), "block_size": block_size, "lora_id": None,
                            "medium": None, "lora_name": None})
        elif ev.kind == "removed":
            if last is not None and last["type"] == "BlockRemoved":
                last["block_hashes"].append(ev.block_hash)
            else:
                out.append({"type": "BlockRemoved", "block_hashes": [ev.block_hash], "medium": None})
        else:
            out.append({"type": "AllBlocksCleared"})
    return out


class KVEventPublisher:
    """Publishes the core's event log on a ZeroMQ PUB socket, with a replay socket beside it.

    `put(data)` (any thread, cheap) queues one `Scheduler.kv_events()` result; the publisher's own
    thread does the rest. `close()` sends what is queued and stops."""

    def __init__(self, endpoint: str, block_size: int, *, replay_batches: int = 10_000) -> None:
        self.pub_endpoint, self.replay_endpoint = parse_endpoint(endpoint)
        self.block_size = block_size
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(self.pub_endpoint)
            self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(0)
            self._replay.close(0)
            self._ctx.term()
            raise OSError(f"--kv-events: cannot bind {self.pub_endpoint} / {self.replay_endpoint}: {exc}") from exc
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self._seq = 0
        self.published = 0  # batches sent (read by tests and logs)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def put(self, data: bytes) -> None:
        if data:
            self._queue.put(data)

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._pub.close()
        self._replay.close(0)
        self._ctx.term()

    # ---- the publisher thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._serve_replays()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                items = [item]
                while True:  # everything queued goes out as one batch
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = any(i is _STOP for i in items)
                events: list[KVEvent] = []
                for data in items:
                    if data is not _STOP:
                        events.extend(decode_kv_events(data, self.block_size))
                if events:
                    self._send(encode_events(events, self.block_size))
                if stop:
                    return
        except Exception:  # noqa: BLE001 - a broken publisher must not take the server down
            log.exception("the KV event publisher stopped; routers will see a gap")

    def _send(self, wire: list[dict[str, Any]]) -> None:
        payload = msgpack.packb([time.time(), wire], use_bin_type=True)
        seq = self._seq.to_bytes(8, "big", signed=True)
        self._pub.send_multipart([b"", seq, payload])
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self.published += 1

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV event replay: ignoring a malformed request of %d frames", len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart([ident, b"", seq.to_bytes(8, "big", signed=True), payload])
            self._replay.send_multipart([ident, b"", END_SEQ, b""])


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A free TCP port P on `host` whose P + 1 is free too: the PUB socket of --kv-events and its replay socket."""
    while True:
        with socket.socket() as a:
            a.bind((host, 0))
            port = a.getsockname()[1]
        with socket.socket() as b:
            try:
                b.bind((host, port + 1))
                return port
            except OSError:
                continue
