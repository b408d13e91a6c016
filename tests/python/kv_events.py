#!/usr/bin/env python3
"""A prefix-aware router's view of gemma4 replicas, from their KV events.

Subscribes to each replica's ZeroMQ KV-event socket with pyzmq, decodes
every message the way llm-d's indexer reads vLLM's array-like events
(multipart [topic, 8-byte big-endian sequence, msgpack [timestamp, events,
rank]], each event a positional array tagged by its first element), and
rebuilds each replica's block index per KV group, keyed, as the router keys
it, by the tokens and media keys of the whole prefix (the engine's hash
values only link a block to its parent).

Then: one long prompt goes to the first replica only, the index predicts
which replica holds a longer prompt sharing that prefix, and the longer
prompt goes there; a run of prompts sharing prefixes, with unrelated ones
between, checks before each that the tokens the index says the replica can
reuse (every group's blocks, the sliding-window group's within its window)
are exactly the tokens the engine then reuses (from /metrics); other prompts
are sent until the first prompt's blocks are evicted.
Prints one JSON object; the Rust test checks it.

    python3 tests/python/kv_events.py --replica http://127.0.0.1:8000,tcp://127.0.0.1:5557 \
        --replica http://127.0.0.1:8001,tcp://127.0.0.1:5558 --block-size 4
"""

import argparse
import base64
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


def decode_event(raw):
    """One event as llm-d's indexer reads vLLM's array-like events: the tag,
    then fields by position."""
    tag = raw[0]
    if tag == "BlockStored":
        return {"type": tag, "hashes": raw[1], "parent": raw[2], "tokens": raw[3],
                "block_size": raw[4], "lora_id": raw[5], "medium": raw[6], "lora_name": raw[7],
                "extra_keys": raw[8], "group": raw[9], "kind": raw[10], "window": raw[11]}
    if tag == "BlockRemoved":
        return {"type": tag, "hashes": raw[1], "medium": raw[2], "group": raw[3]}
    if tag == "AllBlocksCleared":
        return {"type": tag}
    raise ValueError(f"unknown event {tag!r}")


def block_item(tokens, extra):
    """A block as the index keys it: its tokens and its media keys."""
    media = None if extra is None else tuple(tuple(k) for k in extra)
    return (tuple(tokens), media)


class Replica:
    def __init__(self, name, base, endpoint, ctx):
        self.name, self.base = name, base
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.topics, self.sequences, self.problems = set(), [], []
        # engine hash -> prefix key (the blocks up to and including it)
        self.chain = {}
        # group index -> {"kind", "window", "held": prefix keys}
        self.groups = {}
        self.stored = self.removed = 0
        self.removed_prefixes = []
        # The full-attention group's stored blocks, in order.
        self.full_blocks = []

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
            if not isinstance(batch[0], float) or len(batch) != 3:
                self.problems.append(f"batch head {batch[0]!r}, {len(batch)} fields")
            for raw in batch[1]:
                self.apply(decode_event(raw), block_size)

    def group(self, index):
        return self.groups.setdefault(index, {"kind": None, "window": None, "held": set()})

    def apply(self, e, block_size):
        if e["type"] == "BlockStored":
            self.stored += 1
            if e["block_size"] != block_size or len(e["tokens"]) != block_size * len(e["hashes"]):
                self.problems.append(f"block of {len(e['tokens'])} tokens, size {e['block_size']}")
            if len(e["extra_keys"]) != len(e["hashes"]):
                self.problems.append(f"extra keys {e['extra_keys']!r} for {len(e['hashes'])} hashes")
            kind, window = e["kind"], e["window"]
            if not (kind == "full_attention" and window is None
                    or kind == "sliding_window" and isinstance(window, int) and window > 0):
                self.problems.append(f"kind {kind!r}, window {window!r}")
            g = self.group(e["group"])
            g["kind"], g["window"] = kind, window
            parent = () if e["parent"] is None else self.chain.get(e["parent"])
            if parent is None:
                self.problems.append(f"parent {e['parent']} unknown")
                return
            prefix, up = parent, e["parent"]
            for i, h in enumerate(e["hashes"]):
                tokens = e["tokens"][i * block_size:(i + 1) * block_size]
                prefix = prefix + (block_item(tokens, e["extra_keys"][i]),)
                self.chain[h] = prefix
                g["held"].add(prefix)
                if kind == "full_attention":
                    self.full_blocks.append({"hash": h, "parent": up, "extra": e["extra_keys"][i]})
                up = h
        elif e["type"] == "BlockRemoved":
            g = self.group(e["group"])
            for h in e["hashes"]:
                self.removed += 1
                prefix = self.chain.get(h)
                if prefix is None or prefix not in g["held"]:
                    self.problems.append(f"removed {h} from group {e['group']}, which never held it")
                else:
                    g["held"].discard(prefix)
                    self.removed_prefixes.append((e["group"], prefix))
        else:
            for g in self.groups.values():
                g["held"].clear()

    def matched_tokens(self, tokens, block_size, only_full=False):
        """Prompt tokens whose KV the replica can reuse, as its engine decides:
        the longest whole-block prefix (one token always left to compute)
        whose blocks every group holds, a sliding-window group only those
        its window still reaches from there."""
        keys, prefix = [], ()
        for b in range((len(tokens) - 1) // block_size):
            prefix = prefix + (block_item(tokens[b * block_size:(b + 1) * block_size], None),)
            keys.append(prefix)
        for k in range(len(keys), 0, -1):
            ok = True
            for g in self.groups.values():
                if g["kind"] == "sliding_window":
                    if only_full:
                        continue
                    first = max(0, k * block_size + 1 - g["window"]) // block_size
                else:
                    first = 0
                if not all(keys[j] in g["held"] for j in range(first, k)):
                    ok = False
                    break
            if ok:
                return k * block_size
        return 0

    def holds_block(self, tokens, block_size):
        """Whether any group holds the prompt's first block."""
        key = (block_item(tokens[:block_size], None),)
        return any(key in g["held"] for g in self.groups.values() if g["kind"] == "full_attention")


def metric(base, name):
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise SystemExit(f"no {name}")


def complete(replica, prompt, block_size):
    """Sends a prompt; returns (tokens, hit tokens the engine reports)."""
    name = "gemma4_prefix_cache_hit_tokens_total"
    tokens = post(f"{replica.base}/tokenize", {"prompt": prompt})["tokens"]
    before = metric(replica.base, name)
    post(f"{replica.base}/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
    # The hit is counted when the prompt is admitted, and the engine
    # publishes its counters after each step: by the reply's last token the
    # admitting step's are out.
    after = metric(replica.base, name)
    replica.drain(block_size, quiet=0.3)
    return tokens, int(after - before)


def media_blocks(replica, block_size, send):
    """Sends a chat through `send`; returns the full-attention group's stored
    blocks it added (hash, parent, extra keys) and the tokens the engine reused."""
    name = "gemma4_prefix_cache_hit_tokens_total"
    replica.drain(block_size, quiet=0.3)
    seen = len(replica.full_blocks)
    before = metric(replica.base, name)
    send()
    after = metric(replica.base, name)
    replica.drain(block_size, quiet=0.3)
    return replica.full_blocks[seen:], int(after - before)


def images(replica, block_size, image_files):
    """The same chat with two different images: the events key the blocks
    that overlap each image on its own identifier, the second chat reuses
    exactly the blocks before the image (which the index predicts), and its
    new blocks continue that chain."""
    uris = []
    for path in image_files:
        with open(path, "rb") as f:
            uris.append("data:image/png;base64," + base64.b64encode(f.read()).decode())

    def chat(uri):
        content = [{"type": "text", "text": "Look at this picture please, then say what it shows"},
                   {"type": "image_url", "image_url": {"url": uri}}]
        return lambda: post(f"{replica.base}/v1/chat/completions",
                            {"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                             "temperature": 0})

    first, _ = media_blocks(replica, block_size, chat(uris[0]))
    second, reused = media_blocks(replica, block_size, chat(uris[1]))
    ids = lambda blocks: sorted({k[0] for b in blocks if b["extra"] for k in b["extra"]})
    plain = 0
    while plain < len(first) and not first[plain]["extra"]:
        plain += 1
    return {
        "first_ids": ids(first),
        "second_ids": ids(second),
        "blocks_before_image": plain,
        "reused": reused,
        # The second chat's first new block follows the last block it reused.
        "second_follows_shared": bool(second) and plain > 0
        and second[0]["parent"] == first[plain - 1]["hash"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", action="append", required=True, help="BASE_URL,ZMQ_ENDPOINT")
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--max-evictions", type=int, default=8)
    ap.add_argument("--images", help="two PNG files: check media-keyed blocks on the first replica only")
    a = ap.parse_args()
    ctx = zmq.Context()
    replicas = [Replica(f"r{i}", *spec.split(","), ctx) for i, spec in enumerate(a.replica)]
    time.sleep(0.5)  # let the subscriptions reach the publishers
    bs = a.block_size
    if a.images:
        out = images(replicas[0], bs, a.images.split(","))
        out["problems"] = replicas[0].problems
        print(json.dumps(out))
        return

    shared = "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn"
    first, other = replicas[0], replicas[1]
    shared_tokens, _ = complete(first, shared, bs)
    complete(other, "Entirely different words here", bs)
    longer = shared + " while the birds sing"
    longer_tokens = post(f"{first.base}/tokenize", {"prompt": longer})["tokens"]
    matched = {r.name: r.matched_tokens(longer_tokens, bs) for r in replicas}
    predicted = max(replicas, key=lambda r: matched[r.name])
    _, hit = complete(predicted, longer, bs)

    # Prompts that share prefixes with earlier ones, to one replica: before
    # each, the router's prediction from the events; after it, what the
    # engine reused. Unrelated prompts between them push blocks out, the
    # sliding-window group's long before the full-attention group's.
    mispredicted, claims_of_full_alone = [], 0
    stems = [shared, "A second line of words about the weather on the hills today"]
    for i in range(10):
        stem = stems[i % 2]
        prompt = stem + f" and then {i}" if i % 3 else " ".join(f"u{i}x{j}" for j in range(20))
        tokens = post(f"{first.base}/tokenize", {"prompt": prompt})["tokens"]
        claim = first.matched_tokens(tokens, bs)
        claims_of_full_alone += first.matched_tokens(tokens, bs, only_full=True) > claim
        _, reused = complete(first, prompt, bs)
        if reused != claim:
            mispredicted.append({"prompt": i, "claimed": claim, "reused": reused})

    # Other prompts until the shared prompt's first block leaves the first replica.
    sent = 0
    while first.holds_block(shared_tokens, bs) and sent < a.max_evictions:
        words = " ".join(f"w{sent}x{i}" for i in range(24))
        complete(first, words, bs)
        sent += 1
    for r in replicas:
        r.drain(bs)

    first_block = (block_item(shared_tokens[:bs], None),)
    print(json.dumps({
        "replicas": [{
            "name": r.name,
            "topics": sorted(r.topics),
            "sequences": r.sequences,
            "stored": r.stored,
            "removed": r.removed,
            "groups": {str(i): {"kind": g["kind"], "window": g["window"]} for i, g in r.groups.items()},
            "problems": r.problems,
        } for r in replicas],
        "shared_tokens": len(shared_tokens),
        "matched_tokens": matched,
        "predicted": predicted.name,
        "predicted_hit": hit,
        "mispredicted": mispredicted,
        "claims_of_full_alone": claims_of_full_alone,
        "prompts_until_evicted": sent,
        "first_block_evicted": not first.holds_block(shared_tokens, bs),
        "evicted_prefix_seen": any(p[:1] == first_block for _, p in first.removed_prefixes),
    }))


if __name__ == "__main__":
    main()
