#!/usr/bin/env python3
"""Writes a checkpoint's Gemma 4 vision and audio towers as a multimodal projector GGUF.

The layout is the one llama.cpp's converter (`convert_hf_to_gguf.py --mmproj`, classes
`Gemma4VisionAudioModel` and the tensor map of gguf-py) gives a Gemma 4 E2B/E4B checkpoint:
architecture `clip`, `clip.vision.projector_type` `gemma4v` and `clip.audio.projector_type`
`gemma4a`, tensor names `v.blk.N.attn_q.weight`, `a.blk.N.ffn_up_1.weight`, … with the clip
ranges of clipped linears kept (`….input_max`), the patch embedding as a channels-first
convolution kernel `[D, 3, p, p]`, the audio query scale with its softplus applied, the
depthwise kernel as `[C, K]`, scalars as one-element vectors; matrices in f16, vectors,
norms, tables and the audio convolutions in f32.

A 12B checkpoint (`Gemma4UnifiedForConditionalGeneration`) is written as the converter's
`Gemma4UnifiedVisionAudioModel` writes it: projector types `gemma4uv` and `gemma4ua`, the
tower settings as zeros (`mm_embed_dim` as the vision width, `audio_embed_dim` as the audio
width), `model.vision_embedder.patch_ln1`/`patch_ln2`/`pos_norm` as `v.patch_norm.1`…`3`,
`patch_dense` as `v.patch_embd` with its columns (and `patch_ln1`'s values) reordered from
pixels of 3 channels to 3 planes of pixels (ggml's im2col order), `pos_embedding`
`[T, 2, D]` as `v.position_embd.weight` `[2, T, D]`.

  pip install gguf numpy
  python tools/make_mmproj_fixture.py tests/fixtures/vision/e-audio tests/fixtures/vision/e-audio-mmproj.gguf
  python tools/make_mmproj_fixture.py tests/fixtures/vision/unified tests/fixtures/vision/unified-mmproj.gguf
"""

import json
import re
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFWriter


def bf16_file_as_f32(path: Path) -> dict:
    """safetensors.numpy cannot read bf16; widen it by hand."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        data = raw[base + a : base + b]
        if info["dtype"] == "BF16":
            u = np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16
            out[name] = u.view(np.float32).reshape(info["shape"])
        elif info["dtype"] == "F32":
            out[name] = np.frombuffer(data, dtype=np.float32).reshape(info["shape"])
    return out


VISION_LINEARS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_out",
                  "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
VISION_NORMS = {"input_layernorm": "ln1", "post_attention_layernorm": "attn_post_norm",
                "pre_feedforward_layernorm": "ln2", "post_feedforward_layernorm": "ffn_post_norm",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
AUDIO_FFW = {"pre_layer_norm": "ffn_norm", "ffw_layer_1": "ffn_up", "ffw_layer_2": "ffn_down",
             "post_layer_norm": "ffn_post_norm"}
AUDIO_OTHER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.post": "attn_out", "self_attn.relative_k_proj": "attn_k_rel",
               "self_attn.per_dim_scale": "per_dim_scale", "norm_pre_attn": "attn_pre_norm",
               "norm_post_attn": "attn_post_norm", "norm_out": "ln2",
               "lconv1d.pre_layer_norm": "conv_norm", "lconv1d.conv_norm": "norm_conv",
               "lconv1d.linear_start": "conv_pw1", "lconv1d.linear_end": "conv_pw2",
               "lconv1d.depthwise_conv1d": "conv_dw"}


def field_of(rest: str) -> str:
    """`linear.weight` and `weight` → `weight`; clip ranges and biases keep their names."""
    return "weight" if rest in ("linear.weight", "weight", "") else rest


UNIFIED_NORMS = {"patch_ln1": 1, "patch_ln2": 2, "pos_norm": 3}


def gguf_name(name: str):
    m = re.fullmatch(r"model\.vision_embedder\.(\w+)\.?(.*)", name)
    if m:
        module, field = m.groups()
        if module == "pos_embedding":
            return "v.position_embd.weight"
        if module == "patch_dense":
            return f"v.patch_embd.{field}"
        return f"v.patch_norm.{UNIFIED_NORMS[module]}.{field}"
    if name == "model.embed_vision.embedding_projection.weight":
        return "mm.input_projection.weight"
    if name == "model.embed_audio.embedding_projection.weight":
        return "mm.a.input_projection.weight"
    m = re.fullmatch(r"model\.vision_tower\.(.*)", name)
    if m:
        rest = m.group(1)
        fixed = {"patch_embedder.input_proj.weight": "v.patch_embd.weight",
                 "patch_embedder.position_embedding_table": "v.position_embd.weight",
                 "std_bias": "v.std_bias", "std_scale": "v.std_scale"}
        if rest in fixed:
            return fixed[rest]
        m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.*)", rest)
        i, rest = m.group(1), m.group(2)
        for hf, g in VISION_NORMS.items():
            if rest == f"{hf}.weight":
                return f"v.blk.{i}.{g}.weight"
        module, field = re.fullmatch(r"(?:self_attn|mlp)\.(\w+)\.(.*)", rest).groups()
        return f"v.blk.{i}.{VISION_LINEARS[module]}.{field_of(field)}"
    m = re.fullmatch(r"model\.audio_tower\.(.*)", name)
    rest = m.group(1)
    m = re.fullmatch(r"subsample_conv_projection\.layer(\d)\.(conv|norm)\.weight", rest)
    if m:
        return f"a.conv1d.{m.group(1)}.weight" if m.group(2) == "conv" else f"a.conv1d.{m.group(1)}.norm.weight"
    fixed = {"subsample_conv_projection.input_proj_linear.weight": "a.input_projection.weight",
             "output_proj.weight": "a.pre_encode.out.weight", "output_proj.bias": "a.pre_encode.out.bias"}
    if rest in fixed:
        return fixed[rest]
    m = re.fullmatch(r"layers\.(\d+)\.(.*)", rest)
    i, rest = m.group(1), m.group(2)
    m = re.fullmatch(r"feed_forward([12])\.(\w+)\.?(.*)", rest)
    if m:
        suffix = "_1" if m.group(1) == "2" else ""
        return f"a.blk.{i}.{AUDIO_FFW[m.group(2)]}{suffix}.{field_of(m.group(3))}"
    for hf, g in sorted(AUDIO_OTHER.items(), key=lambda kv: -len(kv[0])):
        if rest == hf or rest.startswith(hf + "."):
            return f"a.blk.{i}.{g}.{field_of(rest[len(hf) + 1:])}"
    raise KeyError(name)


def channels_first(t: np.ndarray) -> np.ndarray:
    """Each row's p·p pixels of 3 values → 3 planes of p·p values."""
    rows = t.reshape(-1, t.shape[-1] // 3, 3)
    return rows.transpose(0, 2, 1).reshape(t.shape)


def write_tensors(w: GGUFWriter, tensors: dict) -> None:
    for name in sorted(tensors):
        if not re.match(r"model\.(vision_tower|audio_tower|embed_vision|embed_audio|vision_embedder)\.", name):
            continue
        t = tensors[name].astype(np.float32)
        g = gguf_name(name)
        if g == "v.patch_embd.weight" and t.ndim == 2 and name.startswith("model.vision_tower."):
            d, n = t.shape
            p = int(round((n // 3) ** 0.5))
            t = t.reshape(d, p, p, 3).transpose(0, 3, 1, 2)
        elif name == "model.vision_embedder.patch_dense.weight" \
                or name.startswith("model.vision_embedder.patch_ln1."):
            t = channels_first(t)
        elif name == "model.vision_embedder.pos_embedding":
            t = t.transpose(1, 0, 2)
        elif g.endswith("per_dim_scale.weight"):
            t = np.log1p(np.exp(t.astype(np.float64))).astype(np.float32)
        elif g.endswith("conv_dw.weight"):
            t = t.reshape(t.shape[0], t.shape[-1])
        if t.ndim == 0:
            t = t.reshape(1)
        keep_f32 = (t.ndim != 2 and g != "v.patch_embd.weight") or not g.endswith(".weight") \
            or "norm" in g or g.startswith("a.conv1d") or "conv_dw" in g or g == "a.input_projection.weight"
        w.add_tensor(g, np.ascontiguousarray(t if keep_f32 else t.astype(np.float16)))


def main_unified(cfg: dict, tensors: dict, out: Path) -> None:
    v, a = cfg["vision_config"], cfg["audio_config"]
    hidden = cfg["text_config"]["hidden_size"]
    w = GGUFWriter(str(out), "clip")
    w.add_string("general.type", "mmproj")
    w.add_uint32("general.file_type", 1)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", hidden)
    w.add_uint32("clip.vision.image_size", 224)
    w.add_uint32("clip.vision.patch_size", v.get("patch_size", 16))
    w.add_uint32("clip.vision.embedding_length", v["mm_embed_dim"])
    w.add_uint32("clip.vision.feed_forward_length", 0)
    w.add_uint32("clip.vision.block_count", 0)
    w.add_uint32("clip.vision.attention.head_count", 0)
    w.add_bool("clip.has_audio_encoder", True)
    w.add_uint32("clip.audio.projection_dim", hidden)
    w.add_uint32("clip.audio.embedding_length", a.get("audio_embed_dim", 640))
    w.add_uint32("clip.audio.feed_forward_length", 0)
    w.add_uint32("clip.audio.block_count", 0)
    w.add_uint32("clip.audio.attention.head_count", 0)
    w.add_string("clip.vision.projector_type", "gemma4uv")
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_string("clip.audio.projector_type", "gemma4ua")
    # The converter writes the E-style default; llama.cpp reads 640-sample frames.
    w.add_uint32("clip.audio.num_mel_bins", 128)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-6)
    finish(w, tensors, out)


def finish(w: GGUFWriter, tensors, out: Path) -> None:
    """Writes the tensors after the metadata, and the file."""
    write_tensors(w, tensors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out}")


def main(src: Path, out: Path) -> None:
    cfg = json.loads((src / "config.json").read_text())
    tensors = bf16_file_as_f32(src / "model.safetensors")
    if cfg.get("model_type") == "gemma4_unified":
        main_unified(cfg, tensors, out)
        return
    v, a = cfg["vision_config"], cfg["audio_config"]
    w = GGUFWriter(str(out), "clip")
    w.add_string("general.type", "mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.vision.projector_type", "gemma4v")
    w.add_string("clip.audio.projector_type", "gemma4a")
    w.add_uint32("clip.vision.projection_dim", cfg["text_config"]["hidden_size"])
    w.add_uint32("clip.vision.image_size", 224)
    w.add_uint32("clip.vision.patch_size", v["patch_size"])
    w.add_uint32("clip.vision.embedding_length", v["hidden_size"])
    w.add_uint32("clip.vision.feed_forward_length", v["intermediate_size"])
    w.add_uint32("clip.vision.block_count", v["num_hidden_layers"])
    w.add_uint32("clip.vision.attention.head_count", v["num_attention_heads"])
    w.add_float32("clip.vision.attention.layer_norm_epsilon", v.get("rms_norm_eps", 1e-6))
    w.add_uint32("clip.audio.projection_dim", cfg["text_config"]["hidden_size"])
    w.add_uint32("clip.audio.embedding_length", a["hidden_size"])
    w.add_uint32("clip.audio.feed_forward_length", 4 * a["hidden_size"])
    w.add_uint32("clip.audio.block_count", a["num_hidden_layers"])
    w.add_uint32("clip.audio.attention.head_count", a["num_attention_heads"])
    w.add_uint32("clip.audio.num_mel_bins", 128)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", a.get("rms_norm_eps", 1e-6))
    finish(w, tensors, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
