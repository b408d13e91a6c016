#!/usr/bin/env python3
"""A prefix-aware router's view of gemma4 replicas, from their KV events.

Subscribes to each replica's ZeroMQ KV-event socket with pyzmq, decodes
every message the way llm-d's vLLM adapter does (multipart [topic, 8-byte
big-endian sequence, msgpack [timestamp, events, ...]], each event a
positional array tagged by its first element), and rebuilds each replica's
block index keyed, as the router keys it, by the tokens of the whole prefix
(not by the engine's hash values, which only link a block to its parent).

Then: one long prompt goes to the first replica only, the index predicts
which replica holds a longer prompt sharing that prefix, the longer prompt
goes there and the replica's prefix-cache hits are read from /metrics, and
other prompts are sent until the first prompt's blocks are evicted.
Prints one JSON object; the Rust test checks it.

    python3 tests/python/kv_events.py --replica http://127.0.0.1:8000,tcp://127.0.0.1:5557 \
        --replica http://127.0.0.1:8001,tcp://127.0.0.1:5558 --block-size 4
"""

import argparse
import json
import struct
import time
import urllib.request

import msgpack
import zmq


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def prefix_hits(base):
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("gemma4_prefix_cache_hits_total "):
                return float(line.split()[-1])
    raise SystemExit("no gemma4_prefix_cache_hits_total")


def decode_event(raw):
    """One event as llm-d's adapter reads it: the tag, then fields by position."""
    tag = raw[0]
    if tag == "BlockStored":
        hashes, parent, token_ids, block_size = raw[1], raw[2], raw[3], raw[4]
        lora_id = raw[5] if len(raw) > 5 else None
        medium = raw[6] if len(raw) > 6 else None
        return {"type": tag, "hashes": hashes, "parent": parent, "tokens": token_ids,
                "block_size": block_size, "lora_id": lora_id, "medium": medium}
    if tag == "BlockRemoved":
        return {"type": tag, "hashes": raw[1], "medium": raw[2] if len(raw) > 2 else None}
    if tag == "AllBlocksCleared":
        return {"type": tag}
    raise ValueError(f"unknown event {tag!r}")


class Replica:
    def __init__(self, name, base, endpoint, ctx):
        self.name, self.base = name, base
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.topics, self.sequences, self.problems = set(), [], []
        # engine hash -> prefix tokens (a tuple of every token up to the block's end)
        self.by_hash = {}
        self.prefixes = set()
        self.stored = self.removed = 0
        self.removed_prefixes = []

    def drain(self, block_size, quiet=0.5):
        """Reads messages until none arrives for `quiet` seconds."""
        while self.sock.poll(int(quiet * 1000)):
            frames = self.sock.recv_multipart()
            if len(frames) != 3:
                self.problems.append(f"{len(frames)} frames")
                continue
            topic, seq, payload = frames
            self.topics.add(topic.decode())
            self.sequences.append(struct.unpack(">Q", seq)[0])
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            if not isinstance(batch[0], float):
                self.problems.append(f"timestamp {batch[0]!r}")
            for raw in batch[1]:
                self.apply(decode_event(raw), block_size)

    def apply(self, e, block_size):
        if e["type"] == "BlockStored":
            self.stored += 1
            if e["block_size"] != block_size or len(e["tokens"]) != block_size * len(e["hashes"]):
                self.problems.append(f"block of {len(e['tokens'])} tokens, size {e['block_size']}")
            parent = () if e["parent"] is None else self.by_hash.get(e["parent"])
            if parent is None:
                self.problems.append(f"parent {e['parent']} unknown")
                return
            prefix = parent
            for i, h in enumerate(e["hashes"]):
                prefix = prefix + tuple(e["tokens"][i * block_size:(i + 1) * block_size])
                self.by_hash[h] = prefix
                self.prefixes.add(prefix)
        elif e["type"] == "BlockRemoved":
            for h in e["hashes"]:
                self.removed += 1
                prefix = self.by_hash.pop(h, None)
                if prefix is None:
                    self.problems.append(f"removed {h}, never stored")
                else:
                    self.prefixes.discard(prefix)
                    self.removed_prefixes.append(prefix)
        else:
            self.by_hash.clear()
            self.prefixes.clear()

    def matched_blocks(self, tokens, block_size):
        n = 0
        while (n + 1) * block_size <= len(tokens) and tuple(tokens[:(n + 1) * block_size]) in self.prefixes:
            n += 1
        return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", action="append", required=True, help="BASE_URL,ZMQ_ENDPOINT")
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--max-evictions", type=int, default=8)
    a = ap.parse_args()
    ctx = zmq.Context()
    replicas = [Replica(f"r{i}", *spec.split(","), ctx) for i, spec in enumerate(a.replica)]
    time.sleep(0.5)  # let the subscriptions reach the publishers
    bs = a.block_size

    shared = "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn"
    first, other = replicas[0], replicas[1]
    post(f"{first.base}/v1/completions", {"prompt": shared, "max_tokens": 2, "temperature": 0})
    post(f"{other.base}/v1/completions", {"prompt": "Entirely different words here", "max_tokens": 2,
                                          "temperature": 0})
    for r in replicas:
        r.drain(bs)
    shared_tokens = post(f"{first.base}/tokenize", {"prompt": shared})["tokens"]
    longer = shared + " while the birds sing"
    longer_tokens = post(f"{first.base}/tokenize", {"prompt": longer})["tokens"]
    matched = {r.name: r.matched_blocks(longer_tokens, bs) for r in replicas}
    predicted = max(replicas, key=lambda r: matched[r.name])
    before = prefix_hits(predicted.base)
    post(f"{predicted.base}/v1/completions", {"prompt": longer, "max_tokens": 2, "temperature": 0})
    # The engine publishes its counters right after the step that answered.
    until = time.time() + 5
    while (after := prefix_hits(predicted.base)) == before and time.time() < until:
        time.sleep(0.05)

    # Other prompts until the shared prompt's first block leaves the first replica.
    first_block = tuple(shared_tokens[:bs])
    sent = 0
    while first_block in first.prefixes and sent < a.max_evictions:
        words = " ".join(f"w{sent}x{i}" for i in range(24))
        post(f"{first.base}/v1/completions", {"prompt": words, "max_tokens": 2, "temperature": 0})
        first.drain(bs)
        sent += 1
    for r in replicas:
        r.drain(bs)

    print(json.dumps({
        "replicas": [{
            "name": r.name,
            "topics": sorted(r.topics),
            "sequences": r.sequences,
            "stored": r.stored,
            "removed": r.removed,
            "problems": r.problems,
        } for r in replicas],
        "shared_tokens": len(shared_tokens),
        "matched_blocks": matched,
        "predicted": predicted.name,
        "prefix_hits": [before, after],
        "prompts_until_evicted": sent,
        "first_block_evicted": first_block not in first.prefixes,
        "evicted_prefix_seen": any(p[:bs] == first_block for p in first.removed_prefixes),
    }))


if __name__ == "__main__":
    main()
