"""A cluster router's view of one server's KV cache, rebuilt from its KV events only (as
llm-d's indexer and Dynamo's router keep it): the set of cached block hashes per pool
(data_parallel_rank), from msgpack KVEventBatch payloads in sequence order, and a
subscriber that catches up through the replay socket when it misses a sequence number."""
from __future__ import annotations

from collections import defaultdict

import msgpack
import zmq


class RouterView:
    def __init__(self) -> None:
        self.blocks: dict[int, set[int]] = defaultdict(set)
        self.last_seq = -1
        self.num_stored = 0
        self.num_removed = 0
        self.num_cleared = 0

    def apply(self, payload: bytes, seq: int | None = None) -> None:
        if seq is not None:
            assert seq == self.last_seq + 1, f"batch {seq} after {self.last_seq}"
            self.last_seq = seq
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and isinstance(rank, int)
        blocks = self.blocks[rank]
        for event in events:
            tag = event[0]
            if tag == "BlockStored":
                hashes, parent, tokens, block_size = event[1], event[2], event[3], event[4]
                assert parent is None or parent in blocks, "stored under an unknown parent"
                assert len(tokens) == len(hashes) * block_size
                assert not blocks & set(hashes), "a block stored twice"
                blocks.update(hashes)
                self.num_stored += len(hashes)
            elif tag == "BlockRemoved":
                assert set(event[1]) <= blocks, "removal of a block not stored"
                blocks.difference_update(event[1])
                self.num_removed += len(event[1])
            elif tag == "AllBlocksCleared":
                self.blocks.clear()
                blocks = self.blocks[rank]
                self.num_cleared += 1
            else:
                raise AssertionError(f"unknown event {tag!r}")


class Subscriber:
    """SUB + a replay DEALER (framed like vLLM's example's REQ: an empty delimiter, then the
    first missing seq; each reply batch comes back as its own message)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.view = RouterView()

    def catch_up(self, first_seq: int) -> int:
        """Ask the replay socket for every batch from first_seq; returns how many came."""
        self.replay.send_multipart((b"", first_seq.to_bytes(8, "big")))
        count = 0
        while True:
            if not self.replay.poll(5000):
                raise AssertionError("replay stopped before its end marker")
            _, seq_bytes, payload = self.replay.recv_multipart()
            if not payload:
                return count
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.view.last_seq:
                self.view.apply(payload, seq)
                count += 1

    def poll(self, timeout_ms: int = 100) -> int:
        """Apply what arrived; a gap is filled from the replay socket first."""
        count = 0
        while self.sub.poll(timeout_ms):
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.view.last_seq:
                continue
            if seq > self.view.last_seq + 1:
                self.catch_up(self.view.last_seq + 1)
            if seq == self.view.last_seq + 1:
                self.view.apply(payload, seq)
            count += 1
            timeout_ms = 0
        return count

    def close(self) -> None:
        self.sub.close(0)
        self.replay.close(0)
        self.context.term()
