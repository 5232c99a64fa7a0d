"""Publishes KV events as vLLM does (--kv-events): a ZeroMQ PUB socket sending
[topic, seq (8 bytes big-endian), payload] with payload the msgpack of vLLM's array-like
KVEventBatch [ts, [events...], data_parallel_rank], and a ROUTER replay socket: a router
that reconnects (or saw a gap in seq) sends the first seq it lacks as 8 big-endian bytes and
gets [seq, payload] of every batch still buffered from there, then [-1 (8 bytes), b""].
The first batch is AllBlocksCleared, so a router drops what it knew of an earlier server at
this address. Each pool's events go in a batch of their own with data_parallel_rank = the
pool id (a prefix may be cached in several pools).
A thread owns both sockets (ZeroMQ sockets are not thread-safe) and does the encoding, so the
scheduler loop only appends to a queue.
Owns: the sockets, sequence numbers and the replay buffer. Does not own: the events
(events.py).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

from justapi.config.ops import OpsConfig
from justapi.scheduler.kv.events import MEDIUMS, KvEventLog
from justapi.scheduler.kv.manager import KvCacheManager

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_BUFFER_BATCHES = 10_000
PUB_HWM = 100_000
POLL_S = 0.05


class KvEventPublisher:
    """`publish(log)` from the scheduler loop; `close()` at shutdown."""

    def __init__(self, endpoint: str, replay_endpoint: str = "", topic: str = "",
                 buffer_batches: int = REPLAY_BUFFER_BATCHES) -> None:
        self._queue: queue.SimpleQueue[tuple[float, int, list[list]] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._topic = topic.encode("utf-8")
        self._context: zmq.Context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(PUB_HWM)
        self._pub.bind(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                if self._replay is not None else "")
        self._next_seq = 0
        self._queue.put((time.time(), 0, [["AllBlocksCleared"]]))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, log: KvEventLog) -> None:
        """Queue the log's pending events (one batch per pool with news)."""
        now = time.time()
        for pool_id, events in log.take():
            self._queue.put((now, pool_id, events))

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, pool_id, events = item
            payload = msgpack.packb([ts, events, pool_id], use_bin_type=True)
            seq = self._next_seq
            self._next_seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignored a malformed KV events replay request (%d frames)", len(frames))
            return
        client, empty, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, empty, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, empty, END_SEQ, b""))


class KvEvents:
    """The scheduler process's KV events: the log its prefix caches write to, and the
    publisher `flush()` hands each loop turn's events to."""

    def __init__(self, log: KvEventLog, publisher: KvEventPublisher) -> None:
        self.log = log
        self.publisher = publisher

    def flush(self) -> None:
        self.publisher.publish(self.log)

    def close(self) -> None:
        self.publisher.close()


def open_kv_events(ops: OpsConfig, device: str, kv: KvCacheManager) -> KvEvents | None:
    """With --kv-events: a log attached to every pool's prefix cache, and its publisher."""
    if not ops.kv_events:
        return None
    medium = MEDIUMS.get(device, device.upper())
    log = KvEventLog(kv.block_size, ops.kv_events_seed(), {p: medium for p in kv.caches})
    for cache in kv.caches.values():
        cache.events = log
    publisher = KvEventPublisher(ops.kv_events, ops.kv_events_replay, ops.kv_events_topic)
    logger.info("KV events on %s (replay: %s)", publisher.endpoint,
                publisher.replay_endpoint or "none")
    return KvEvents(log, publisher)
