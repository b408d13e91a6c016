#!/usr/bin/env python3
"""A Gemma 4 assistant (MTP drafter) checkpoint with random weights, shaped for a target.

No Gemma 4 assistant weights can be downloaded here, so the cost of drafting is measured
on this: a `gemma4_assistant` folder (config.json, generation_config.json and
model.safetensors in bf16, `token_ordering` in int64) whose layers read the K/V of the
target given by --target-config (its head_dim, global_head_dim, KV heads, window and RoPE)
and whose backbone is the target's width. Its drafts mean nothing; its cost per step is a
real assistant's of the same shape.

Needs numpy. Example (an E2B-shaped target):
  python3 benches/speculative/make_assistant.py \\
      --target-config tests/fixtures/configs/gemma-4-E2B-it/config.json --out /tmp/e2b-assistant
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np


def bf16_bytes(x: np.ndarray) -> bytes:
    """Round-to-nearest-even f32 -> bf16, little-endian."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-config", required=True, help="the target's Hugging Face config.json")
    ap.add_argument("--out", required=True, help="checkpoint folder to write")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4, help="the last is full attention, the rest sliding")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--centroids", type=int, default=2048, help="0: a dense head")
    ap.add_argument("--top-k", type=int, default=32, help="clusters whose tokens get logits")
    ap.add_argument("--num-assistant-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    target = json.loads(Path(args.target_config).read_text())
    t = target.get("text_config", target)
    h, vocab = args.hidden, t["vocab_size"]
    kinds = ["sliding_attention"] * (args.layers - 1) + ["full_attention"]
    text = {
        key: t[key]
        for key in [
            "attention_bias", "attention_dropout", "attention_k_eq_v", "bos_token_id",
            "eos_token_id", "final_logit_softcapping", "global_head_dim", "head_dim",
            "hidden_activation", "max_position_embeddings", "num_global_key_value_heads",
            "num_key_value_heads", "pad_token_id", "rms_norm_eps", "rope_parameters",
            "sliding_window", "vocab_size",
        ]
        if key in t
    }
    text.update(
        model_type="gemma4_text",
        hidden_size=h,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_hidden_layers=args.layers,
        num_kv_shared_layers=args.layers,
        layer_types=kinds,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        use_double_wide_mlp=False,
        enable_moe_block=False,
        tie_word_embeddings=True,
    )
    ordered = args.centroids > 0
    config = {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": t["hidden_size"],
        "use_ordered_embeddings": ordered,
        "num_centroids": args.centroids if ordered else 2048,
        "centroid_intermediate_top_k": args.top_k,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "text_config": text,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"num_assistant_tokens": args.num_assistant_tokens}, indent=2) + "\n"
    )

    rng = np.random.default_rng(args.seed)
    tensors: list[tuple[str, tuple[int, ...], str]] = []  # name, shape, kind

    def matrix(name: str, rows: int, cols: int) -> None:
        tensors.append((name, (rows, cols), "matrix"))

    def norm(name: str, n: int) -> None:
        tensors.append((name, (n,), "norm"))

    matrix("pre_projection.weight", h, 2 * t["hidden_size"])
    matrix("post_projection.weight", t["hidden_size"], h)
    for i, kind in enumerate(kinds):
        hd = t["global_head_dim"] if kind == "full_attention" and t.get("global_head_dim") else t["head_dim"]
        p = f"model.layers.{i}."
        matrix(p + "self_attn.q_proj.weight", args.heads * hd, h)
        matrix(p + "self_attn.o_proj.weight", h, args.heads * hd)
        norm(p + "self_attn.q_norm.weight", hd)
        matrix(p + "mlp.gate_proj.weight", args.intermediate, h)
        matrix(p + "mlp.up_proj.weight", args.intermediate, h)
        matrix(p + "mlp.down_proj.weight", h, args.intermediate)
        for n in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"]:
            norm(p + n + ".weight", h)
        tensors.append((p + "layer_scalar", (1,), "scalar"))
    norm("model.norm.weight", h)
    matrix("model.embed_tokens.weight", vocab, h)
    if ordered:
        matrix("masked_embedding.centroids.weight", args.centroids, h)
        tensors.append(("masked_embedding.token_ordering", (vocab,), "ordering"))

    header, offset = {}, 0
    for name, shape, kind in tensors:
        size = int(np.prod(shape)) * (8 if kind == "ordering" else 2)
        header[name] = {
            "dtype": "I64" if kind == "ordering" else "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, kind in tensors:
            if kind == "ordering":
                f.write(rng.permutation(vocab).astype("<i8").tobytes())
            elif kind == "norm":
                f.write(bf16_bytes(1.0 + 0.02 * rng.standard_normal(shape, dtype=np.float32)))
            elif kind == "scalar":
                f.write(bf16_bytes(rng.uniform(0.3, 1.0, shape).astype(np.float32)))
            else:
                rows, cols = shape
                step = max(1, (1 << 24) // cols)
                for r in range(0, rows, step):
                    n = min(step, rows - r)
                    f.write(bf16_bytes(0.02 * rng.standard_normal((n, cols), dtype=np.float32)))
    print(f"wrote {out} ({offset / 2**20:.0f} MiB of weights, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
