"""`--kv-events`: the real engine on the demo artifact publishes its core's events through
runtime/kv_events.py; a subscriber written here from the public layout (ZeroMQ frames, msgpack
batches: no code of the publisher's) follows them, and after a random workload with shared prefixes,
cache salts and evictions its view equals the block manager's own prefix cache. The replay socket
hands the same batches to a late subscriber."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from runtime.engine import LLMEngine
from runtime.kv_events import KVEventPublisher, parse_endpoint
from runtime.sampling import SamplingParams


def free_port_pair() -> int:
    """A port P with P and P + 1 free on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


class Subscriber:
    """A router's view of one worker, from the wire: hash -> (parent, token ids)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}
        self.next_seq = 0
        self.kinds: list[str] = []
        self.payloads: list[bytes] = []

    def frame(self, frames: list[bytes]) -> None:
        topic, seq, payload = frames
        assert topic == b"" and len(seq) == 8
        n = int.from_bytes(seq, "big", signed=True)
        assert n == self.next_seq, f"gap: expected seq {self.next_seq}, got {n}"
        self.next_seq = n + 1
        self.payloads.append(payload)
        self.apply(payload)

    def apply(self, payload: bytes) -> None:
        ts, events = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and abs(ts - time.time()) < 600
        for ev in events:
            kind = ev["type"]
            self.kinds.append(kind)
            if kind == "BlockStored":
                hashes, parent, tokens, block_size = (ev["block_hashes"], ev["parent_block_hash"], ev["token_ids"],
                                                      ev["block_size"])
                assert len(tokens) == len(hashes) * block_size
                assert ev["lora_id"] is None and ev["medium"] is None and ev["lora_name"] is None
                for i, h in enumerate(hashes):
                    assert 0 <= h < 2**64 and h not in self.blocks, "stored twice"
                    self.blocks[h] = (parent if i == 0 else hashes[i - 1], tokens[i * block_size:(i + 1) * block_size])
            elif kind == "BlockRemoved":
                assert ev["medium"] is None
                for h in ev["block_hashes"]:
                    assert h in self.blocks, "removed a block never stored"
                    del self.blocks[h]
            else:
                assert ev == {"type": "AllBlocksCleared"}
                self.blocks.clear()


def test_parse_endpoint() -> None:
    assert parse_endpoint("tcp://127.0.0.1:5557") == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert parse_endpoint("tcp://[::1]:80") == ("tcp://[::1]:80", "tcp://[::1]:81")
    for bad in ("127.0.0.1:5557", "ipc:///tmp/x", "tcp://host", "tcp://h:65535", "tcp://h:0", "tcp://h:1/x"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            parse_endpoint(bad)


def test_events_follow_the_block_manager(demo_artifact: Path) -> None:
    engine = LLMEngine(demo_artifact, num_blocks=48, max_num_seqs=8, threads=1)
    sched = engine.scheduler
    bs = engine.scheduler_config.block_size
    sched.enable_kv_events()
    port = free_port_pair()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", bs)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    view = Subscriber()
    try:
        time.sleep(0.3)  # PUB drops messages for a subscriber that has not joined yet
        rng = random.Random(7)
        prefixes = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(bs, 5 * bs))] for _ in range(4)]
        pending = []
        for i in range(40):
            tail = [rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(1, 2 * bs))]
            pending.append((f"r{i}", rng.choice(prefixes) + tail, rng.choice([None, None, "tenant-a", "tenant-b"])))
        while pending or engine.has_unfinished():
            for _ in range(rng.randrange(0, 4)):
                if pending:
                    rid, ids, salt = pending.pop()
                    engine.add_request(rid, ids, SamplingParams(max_tokens=rng.randrange(1, 3 * bs), temperature=0.0,
                                                                ignore_eos=True), cache_salt=salt)
            if engine.has_unfinished():
                engine.step()
            pub.put(sched.kv_events())
        deadline = time.monotonic() + 20
        while (pub.published == 0 or view.next_seq < pub.published) and time.monotonic() < deadline:
            if sub.poll(100):
                view.frame(sub.recv_multipart())
        held = {h for _, h in sched.block_pool_state()["cached"]}
        assert view.next_seq == pub.published > 1
        assert view.kinds[0] == "AllBlocksCleared"
        assert view.kinds.count("BlockRemoved") > 0, "the workload was meant to evict cached blocks"
        assert set(view.blocks) == held  # every cached block announced and not removed; nothing else

        # a subscriber that joins late replays from seq 0 and reaches the same view
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port + 1}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
        late = Subscriber()
        while True:
            assert dealer.poll(5000), "replay did not answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            late.frame([b"", seq, payload])
        assert late.payloads == view.payloads and late.blocks == view.blocks
        dealer.send_multipart([b"", (view.next_seq - 1).to_bytes(8, "big", signed=True)])  # only the newest one
        frames: list[Any] = [dealer.recv_multipart() for _ in range(2)]
        assert int.from_bytes(frames[0][1], "big", signed=True) == view.next_seq - 1 and frames[1][1] == b"\xff" * 8
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
        pub.close()
