"""KV events (justapi/scheduler/kv/events.py, publisher.py): vLLM's block hashing (canonical
CBOR, sha256, seeded NONE_HASH, salt on the first block), and a router that sees nothing but
the msgpack event stream rebuilds exactly the set of blocks the radix cache holds, with the
tree's own chain of hashes, after 1,000 mixed requests with evictions and a flush - and,
over real sockets, a late router catches up through the replay socket."""
from __future__ import annotations

import array
import hashlib
import random

import msgpack
import pytest

from justapi.scheduler.kv.events import BlockHasher, KvEventLog, cbor, external_hash, sha256_cbor
from justapi.scheduler.kv.publisher import KvEventPublisher
from justapi.scheduler.kv.radix_cache import RadixPrefixCache
from justapi.scheduler.sim.harness import Harness, build_scheduler
from tools.kv_router import RouterView, Subscriber

BLOCK_SIZE = 4

RFC8949 = [(0, "00"), (23, "17"), (24, "1818"), (100, "1864"), (1000, "1903e8"),
           (1000000, "1a000f4240"), (1000000000000, "1b000000e8d4a51000"), (None, "f6"),
           (b"\x01\x02\x03\x04", "4401020304"), ("a", "6161"), ("IETF", "6449455446"),
           ((1, (2, 3), [4, 5]), "8301820203820405"), ((), "80")]


@pytest.mark.parametrize("value,expected", RFC8949)
def test_cbor_matches_rfc8949_examples(value, expected):
    assert cbor(value).hex() == expected


def test_block_hashes_chain_as_vllm_documents():
    hasher = BlockHasher("0")
    assert hasher.none_hash == hashlib.sha256(b"\x61" + b"0").digest()  # CBOR text "0"
    tokens = list(range(100, 110))  # two full blocks of 4, two tokens left over
    first, second = hasher.chain(None, tokens, BLOCK_SIZE)
    assert first == sha256_cbor((hasher.none_hash, (100, 101, 102, 103), None))
    assert second == sha256_cbor((first, (104, 105, 106, 107), None))
    assert hasher.chain(first, tokens[4:], BLOCK_SIZE) == [second]
    salted = hasher.chain(None, tokens, BLOCK_SIZE, salt="tenant")
    assert salted[0] == sha256_cbor((hasher.none_hash, (100, 101, 102, 103), ("tenant",)))
    assert salted[1] == sha256_cbor((salted[0], (104, 105, 106, 107), None))
    assert external_hash(first) == int.from_bytes(first[-8:], "big") < 1 << 64
    assert BlockHasher("1").chain(None, tokens, BLOCK_SIZE)[0] != first


def tree_hashes(cache: RadixPrefixCache, hasher: BlockHasher) -> set[int]:
    """The hashes of every block in the tree, computed from the tree's own token runs."""
    out: set[int] = set()
    stack = [(child, None, salt) for salt, root in cache._roots.items()
             for child in root.children.values()]
    while stack:
        node, parent, salt = stack.pop()
        chain = hasher.chain(parent, array.array("i", node.tokens).tolist(), BLOCK_SIZE, salt)
        assert len(chain) == node.num_blocks
        out.update(external_hash(h) for h in chain)
        stack.extend((child, chain[-1], salt) for child in node.children.values())
    return out


def publish_to(router: RouterView, log: KvEventLog) -> None:
    for pool_id, events in log.take():
        router.apply(msgpack.packb([1.0, events, pool_id], use_bin_type=True))


def test_a_router_rebuilds_the_cached_blocks_after_1000_mixed_requests():
    rng = random.Random(7)
    h = Harness(build_scheduler(pool_blocks=40, block_size=BLOCK_SIZE, max_seqs=6, chunk_size=8,
                                overlap=True))
    state = h.scheduler.state
    log = KvEventLog(BLOCK_SIZE, "0", {0: "CPU"})
    cache = state.kv.caches[0]
    cache.events = log
    router = RouterView()
    prefixes = [[rng.randrange(3, 60) for _ in range(rng.choice([4, 9, 16]))] for _ in range(6)]
    checked = 0
    for i in range(1000):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 60) for _ in range(rng.randint(0, 9))]
        rid = f"r{i}"
        h.submit(rid, prompt, max_tokens=rng.randint(1, 10), ignore_eos=True,
                 cache_salt=rng.choice(["", "", "tenant-b"]),
                 pooling=rng.choice(["", "", "", "last", "mean"]))
        if rng.random() < 0.05:
            h.abort(rid)
        if rng.random() < 0.6:
            h.step()
            publish_to(router, log)
        if i % 250 == 249:
            cache.flush()
            publish_to(router, log)
            assert router.blocks[0] == tree_hashes(cache, log.hasher)
            checked += 1
    h.run()
    publish_to(router, log)
    assert router.blocks[0] == tree_hashes(cache, log.hasher) == log.cached_hashes(0)
    assert len(router.blocks[0]) == cache.num_blocks > 0
    assert router.num_removed > 100 and checked == 4  # evictions, flushes


def test_a_late_router_catches_up_through_the_replay_socket(tmp_path):
    pub = f"ipc://{tmp_path}/kv-pub"
    replay = f"ipc://{tmp_path}/kv-replay"
    log = KvEventLog(BLOCK_SIZE, "0", {0: "CPU", 1: "CPU"})
    publisher = KvEventPublisher(pub, replay, topic="kv@test")
    try:
        hasher = BlockHasher("0")
        tokens = list(range(10, 22))
        log.stored(0, None, [5, 6, 7], tokens, "")
        publisher.publish(log)
        log.stored(1, None, [9], tokens[:4], "")
        log.removed(0, [7])
        publisher.publish(log)  # pool 0's and pool 1's batches: seq 1..3 after the clear (0)
        subscriber = Subscriber(pub, replay, "kv@test")
        try:
            assert subscriber.catch_up(0) == 4
            chain = [external_hash(x) for x in hasher.chain(None, tokens, BLOCK_SIZE)]
            assert subscriber.view.blocks[0] == set(chain[:2])
            assert subscriber.view.blocks[1] == {chain[0]}
            assert subscriber.view.num_cleared == 1
            log.removed(1, [9])
            publisher.publish(log)  # seq 4, live on the SUB socket
            for _ in range(50):
                if subscriber.poll(100):
                    break
            assert subscriber.view.last_seq == 4 and subscriber.view.blocks[1] == set()
        finally:
            subscriber.close()
    finally:
        publisher.close()
