#!/usr/bin/env python3
"""Writes a tiny random Gemma 4 checkpoint with a vision tower, and its float32 goldens.

The text decoder is the E-style oracle fixture's geometry (per-layer embeddings, KV
sharing, sliding and full layers); the vision tower is a two-layer encoder small enough
for a unit test, with clipped linears and standardisation switched on so that every
stage the published E2B/E4B towers have is exercised. The image, begin-of-image and
end-of-image token ids are moved inside the tiny vocabulary (the published ids are
beyond it); the model reads them from `config.json`, as it must for real checkpoints.

Weights are drawn at random and saved as bfloat16 (as published checkpoints are); the
goldens come from transformers loading the saved checkpoint in float32 with eager
attention:

* `../images/*.png`: the test images (smooth patterns with noise, so that the bicubic
  resize matters), written by this script and shared by every variant;
* `processor.json` (with `--processor`): for each test image, and for blank images of 24 other shapes at
  three soft-token budgets, what the reference image processor returns: resized size,
  patch count, soft-token count; the test images also carry the sha256 of their
  resized pixels (the processor's floats × 255, rounded back to bytes);
* `golden_tensors.safetensors`: per test image `pixels.N` (with `--processor`: the
  resized image as `[h, w, 3]` uint8, recovered from the processor's floats) and `features.N` (the soft
  tokens after `embed_vision`, `[tokens, hidden]`); per prompt `logits.N` (last
  position);
* `golden.json`: the test images' paths, per prompt the token ids (with the image soft tokens expanded), the
  images it holds, and 12 greedy tokens; and one chat turn with two images rendered by
  the real Gemma 4 template, tokenized around its placeholders, with its 12 greedy tokens.

With `--bidirectional` the text config gets `use_bidirectional_attention: "vision"` (as the
31B and 26B-A4B checkpoints have), and the reference runs with the processor's
`mm_token_type_ids`, so each image's soft tokens see each other on sliding layers.

Needs torch, torchvision and transformers 5.23 (CPU), and soundfile for the FLAC and MP3
copies of the test clip:
  pip install torch torchvision transformers==5.23.0 pillow soundfile
  python tools/make_vision_fixture.py tests/fixtures/oracle/e-style tests/fixtures/vision/e-style --processor
  python tools/make_vision_fixture.py tests/fixtures/oracle/dense-k-eq-v tests/fixtures/vision/dense --bidirectional
  python tools/make_vision_fixture.py tests/fixtures/oracle/moe tests/fixtures/vision/moe --bidirectional
  python tools/make_vision_fixture.py tests/fixtures/oracle/unified tests/fixtures/vision/unified

The unified (12B, `gemma4_unified`) variant has no encoder: its images are 48-pixel patches
(the 16-pixel patches of the same resize, merged 3×3) projected straight into the text
model, one soft token per patch; its config already asks for bidirectional image attention.
It also gets the 12B's audio path: a 16 kHz test clip (`../audio/0.wav`, 16-bit) cut into
640-sample frames, each projected into one soft token (`audio_features.0`), and a prompt
and the chat turn hold it beside images.

With `--audio` a non-unified checkpoint also gets the E2B/E4B audio tower (a two-layer
conformer, clipped linears on) and the same clip: its log-mel features as the reference
feature extractor computes them (`mel.0`, the valid frames only), its soft tokens after
`embed_audio` (`audio_features.0`, padding dropped as the model drops it), an audio prompt
and the chat turn with the clip; and `audio_processor.json`, for clips of several lengths,
the reference's valid mel frames and soft-token count:
  python tools/make_vision_fixture.py tests/fixtures/oracle/e-style tests/fixtures/vision/e-audio --audio

With `--pooling K` the encoder pools K×K patches into one soft token instead of the
published 3×3. The reference reads K in two places that must agree: the model's
`vision_config.pooling_kernel_size` (the pooler and `get_image_features` split by it) and
the image processor's own `pooling_kernel_size`, which transformers takes from
`processor_config.json` (its `image_processor` entry; `preprocessor_config.json` is the
older place) and otherwise from the class default, 3; it never looks at the model config.
The processor then resizes onto `patch_size × K`-pixel blocks within `max_soft_tokens × K²`
patches. So this variant also writes `processor_config.json`, and its goldens come from the
image processor loaded from it; its `processor.json` covers all five accepted budgets and
a README.md says what the variant is:
  python tools/make_vision_fixture.py tests/fixtures/oracle/e-style tests/fixtures/vision/e-style-pool2 --processor --pooling 2
"""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import (
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4UnifiedConfig,
    Gemma4UnifiedForConditionalGeneration,
)
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import Gemma4UnifiedAudioFeatureExtractor
from transformers.models.gemma4_unified.image_processing_gemma4_unified import Gemma4UnifiedImageProcessor

SEED = 20261201
MAX_SOFT_TOKENS = 70
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = 500, 501, 502
VIDEO_TOKEN = 506  # as tools/make_video_fixture.py sets it
AUDIO_TOKEN, BOA_TOKEN, EOA_TOKEN = 503, 504, 505
# (width, height): upscaled, exact multiple of 48 (not resized), downscaled, a strip.
TEST_IMAGES = [(100, 77), (144, 96), (800, 600), (40, 300)]
OTHER_SHAPES = [
    (1, 1), (16, 16), (47, 49), (48, 48), (64, 64), (96, 48), (224, 224), (256, 128),
    (320, 240), (333, 517), (480, 640), (512, 512), (640, 480), (768, 1024), (1000, 10),
    (10, 1000), (1024, 768), (1280, 720), (1920, 1080), (2000, 3000), (4032, 3024),
    (3000, 100), (100, 3000), (5000, 5000),
]
BUDGETS = [70, 280, 1120]
# Every budget transformers' Gemma4ImageProcessor accepts (`_SUPPORTED_SOFT_TOKENS`),
# whatever the pooling kernel; recorded for the `--pooling` variants.
ALL_BUDGETS = [70, 140, 280, 560, 1120]
# Clip lengths (samples at 16 kHz) whose frame and soft-token counts are recorded: too
# short for a window, one window, odd and even frame counts, 1 s, the test clip, 30 s.
AUDIO_LENGTHS = [100, 161, 320, 481, 1000, 3333, 16_000, 20_800, 77_777, 480_000]


def test_image(index: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(SEED + index)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack(
        [
            128 + 100 * np.sin(x / (7 + index) + y / 13),
            128 + 100 * np.cos(y / (5 + index) - x / 17),
            255 * (x + y) / (width + height),
        ],
        axis=-1,
    )
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def test_waveform() -> np.ndarray:
    """1.3 s at 16 kHz: two tones and noise, as 16-bit samples."""
    rng = np.random.default_rng(SEED)
    t = np.arange(20_800) / 16_000
    x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1234 * t) + 0.05 * rng.normal(size=t.shape)
    return np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)


def write_wav(path: Path, samples: np.ndarray) -> None:
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(samples.tobytes())


def write_compressed(audio_dir: Path, samples: np.ndarray) -> None:
    """The same clip as FLAC (lossless, 16-bit) and MP3, for the decoders' tests."""
    import soundfile

    soundfile.write(str(audio_dir / "0.flac"), samples, 16_000, subtype="PCM_16")
    soundfile.write(str(audio_dir / "0.mp3"), samples.astype(np.float32) / 32768, 16_000, format="MP3")


def vision_config(pooling: int = 3) -> dict:
    return {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "pooling_kernel_size": pooling,
        "patch_size": 16,
        "position_embedding_size": 128,
        "use_clipped_linears": True,
        "standardize": True,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
    }


def unified_vision_config() -> dict:
    """The 12B's encoder-free embedder: 48-pixel patches straight into the text model."""
    return {
        "model_type": "gemma4_unified_vision",
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "mm_embed_dim": 48,
        "mm_posemb_size": 64,
        "output_proj_dims": 48,
        "rms_norm_eps": 1e-6,
    }


def audio_config() -> dict:
    """A two-layer conformer with the published tower's stages (E2B/E4B)."""
    return {
        "model_type": "gemma4_audio",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_act": "silu",
        "subsampling_conv_channels": [128, 8],
        "conv_kernel_size": 5,
        "residual_weight": 0.5,
        "attention_chunk_size": 12,
        "attention_context_left": 13,
        "attention_context_right": 0,
        "attention_logit_cap": 50.0,
        "use_clipped_linears": True,
        "rms_norm_eps": 1e-6,
        "output_proj_dims": 48,
    }


def randomize(model: torch.nn.Module) -> None:
    """Every parameter and buffer drawn at random (clip ranges finite), rounded to bf16."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or "norm.weight" in name or "_ln" in name and name.endswith("weight"):
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif "position_embedding_table" in name:
                v = 0.5 * torch.randn(p.shape, generator=gen)
            else:
                v = torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5
            p.copy_(v.to(torch.bfloat16).float())
        for name, b in model.named_buffers():
            if name.endswith("input_min") or name.endswith("output_min"):
                b.copy_(torch.tensor(-1.5 - torch.rand((), generator=gen).item()))
            elif name.endswith("input_max") or name.endswith("output_max"):
                b.copy_(torch.tensor(1.5 + torch.rand((), generator=gen).item()))
            elif name.endswith("std_bias"):
                b.copy_((0.3 * torch.randn(b.shape, generator=gen)).to(torch.bfloat16).float())
            elif name.endswith("std_scale"):
                b.copy_((0.5 + torch.rand(b.shape, generator=gen)).to(torch.bfloat16).float())
            elif name.endswith("layer_scalar"):
                b.copy_((0.5 + torch.rand(b.shape, generator=gen)).to(torch.bfloat16).float())


def processor_tokens(mask: np.ndarray) -> int:
    """The processor's count for one clip: its frame mask through two stride-2 halvings."""
    t = len(mask)
    for _ in range(2):
        t_out = (t + 2 - 3) // 2 + 1
        mask = mask[::2][:t_out]
        t = len(mask)
    return int(mask.sum())


def resized_bytes(pixel_values: torch.Tensor, positions: torch.Tensor, patch: int) -> np.ndarray:
    """The resized image as [h, w, 3] bytes, rebuilt from the processor's patches."""
    valid = (positions != -1).all(dim=-1)
    pos = positions[valid]
    pw, ph = int(pos[:, 0].max()) + 1, int(pos[:, 1].max()) + 1
    patches = pixel_values[valid].reshape(ph, pw, patch, patch, 3)
    img = patches.permute(0, 2, 1, 3, 4).reshape(ph * patch, pw * patch, 3)
    out = torch.round(img * 255).to(torch.uint8).numpy()
    assert np.allclose(out.astype(np.float32) / 255, img.numpy(), atol=1e-6), "not bytes / 255"
    return out


def write_image(path: Path, img: Image.Image) -> None:
    """Writes a test image unless the file already holds these pixels (the images are
    shared by every variant, and an identical file is left as it is)."""
    if path.exists():
        with Image.open(path) as old:
            if old.mode == img.mode and old.size == img.size and old.tobytes() == img.tobytes():
                return
    img.save(path)


def processor_config(pooling: int) -> dict:
    """`processor_config.json` as transformers saves it, with the image processor's entry."""
    proc = Gemma4ImageProcessor(max_soft_tokens=MAX_SOFT_TOKENS, pooling_kernel_size=pooling)
    return {"image_processor": proc.to_dict(), "processor_class": "Gemma4Processor"}


def write_readme(dst: Path, pooling: int) -> None:
    side = 16 * pooling
    (dst / "README.md").write_text(f"""\
Written by `tools/make_vision_fixture.py --processor --pooling {pooling}` from the E-style text
checkpoint: the `e-style` vision fixture with a {pooling}×{pooling} pooling kernel instead of the
published 3×3 (same weights, same test images).

- `config.json`: `vision_config.pooling_kernel_size` = {pooling}, `patch_size` = 16.
- `processor_config.json`: the image processor's own `pooling_kernel_size` = {pooling},
  `patch_size` = 16, `max_soft_tokens` = {MAX_SOFT_TOKENS}. transformers 5.23's
  `Gemma4ImageProcessor` reads these from the `image_processor` entry of this file (else
  `preprocessor_config.json`, else its class defaults 16 / 3 / 280), never from `config.json`;
  a request may override them per call (`images_kwargs`).
- Images are resized onto {side}-pixel blocks (`patch_size × pooling_kernel_size`) within
  `max_soft_tokens × {pooling * pooling}` patches; each image gives `patches / {pooling * pooling}` soft tokens.
  (Test image 1, 144×96, is kept at its size only by 48-pixel blocks; here it is resized.)
- `max_soft_tokens` must be one of 70, 140, 280, 560, 1120 (`_SUPPORTED_SOFT_TOKENS`, checked
  whatever the pooling kernel); `processor.json` covers all five.
""")


def main(src: Path, dst: Path, bidirectional: bool, with_processor: bool, with_audio: bool,
         pooling: int = 3) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    image_dir = dst.parent / "images"
    image_dir.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    unified = cfg["model_type"] == "gemma4_unified"
    if unified and pooling != 3:
        raise SystemExit("--pooling is for checkpoints with a vision encoder")
    cfg["vision_config"] = unified_vision_config() if unified else vision_config(pooling)
    if bidirectional:
        cfg["text_config"]["use_bidirectional_attention"] = "vision"
    if unified:
        # The 12B's encoder-free audio: raw 640-sample frames, one soft token each.
        cfg["audio_config"] = {"model_type": "gemma4_unified_audio", "audio_embed_dim": 640, "rms_norm_eps": 1e-6}
        cfg["audio_token_id"] = AUDIO_TOKEN
        cfg["boa_token_id"] = BOA_TOKEN
        cfg["eoa_token_index"] = EOA_TOKEN
    elif with_audio:
        cfg["audio_config"] = audio_config()
        cfg["audio_token_id"] = AUDIO_TOKEN
        cfg["boa_token_id"] = BOA_TOKEN
        cfg["eoa_token_index"] = EOA_TOKEN
    has_audio = unified or with_audio
    cfg["image_token_id"] = IMAGE_TOKEN
    cfg["boi_token_id"] = BOI_TOKEN
    cfg["eoi_token_id"] = EOI_TOKEN
    cfg["video_token_id"] = VIDEO_TOKEN
    config_class = Gemma4UnifiedConfig if unified else Gemma4Config
    model_class = Gemma4UnifiedForConditionalGeneration if unified else Gemma4ForConditionalGeneration
    config = config_class(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
    config.text_config._attn_implementation = "eager"
    if not unified:
        config.vision_config._attn_implementation = "eager"
    if with_audio:
        config.audio_config._attn_implementation = "eager"
    config._attn_implementation = "eager"

    torch.manual_seed(SEED)
    model = model_class(config).float().eval()
    randomize(model)
    model.save_pretrained(dst, safe_serialization=True)
    # Saved as bf16 (values are on the bf16 grid, so nothing is lost).
    from safetensors.torch import load_file

    weights = load_file(dst / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()},
              dst / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((dst / "config.json").read_text())
    saved["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    # The real Gemma 4 chat template (it renders image parts as <|image|>).
    shutil.copy(src.parent / "real-vocab" / "chat_template.jinja", dst / "chat_template.jinja")
    # The goldens come from the checkpoint as saved, widened to float32.
    model = model_class.from_pretrained(
        dst, dtype=torch.float32, attn_implementation="eager"
    ).eval()

    budgets = BUDGETS
    if pooling != 3:
        # The processor's setting as a checkpoint carries it, and the reference
        # processor loaded from that file.
        (dst / "processor_config.json").write_text(json.dumps(processor_config(pooling), indent=2) + "\n")
        write_readme(dst, pooling)
        tv = Gemma4ImageProcessor.from_pretrained(dst)
        pil = Gemma4ImageProcessorPil.from_pretrained(dst)
        for proc in (tv, pil):
            got = (proc.patch_size, proc.pooling_kernel_size, proc.max_soft_tokens)
            assert got == (16, pooling, MAX_SOFT_TOKENS), got
        budgets = ALL_BUDGETS
    else:
        tv = (Gemma4UnifiedImageProcessor if unified else Gemma4ImageProcessor)(max_soft_tokens=MAX_SOFT_TOKENS)
        pil = Gemma4ImageProcessorPil(max_soft_tokens=MAX_SOFT_TOKENS)
    processor_cases = []
    tensors = {}
    images = []
    for i, (w, h) in enumerate(TEST_IMAGES):
        img = test_image(i, w, h)
        write_image(image_dir / f"{i}.png", img)
        img = Image.open(image_dir / f"{i}.png").convert("RGB")
        out = tv(images=[img], return_tensors="pt")
        out_pil = pil(images=[img], return_tensors="pt")
        if not unified and not torch.equal(out["pixel_values"], out_pil["pixel_values"]):
            diff = (out["pixel_values"] - out_pil["pixel_values"]).abs().max().item() * 255
            print(f"image {i}: torchvision and PIL backends differ by up to {diff:.1f}/255")
        pixels = resized_bytes(out["pixel_values"][0], out["image_position_ids"][0], 48 if unified else 16)
        if with_processor:
            tensors[f"pixels.{i}"] = torch.from_numpy(pixels.copy())
        with torch.no_grad():
            feats = model.model.get_image_features(
                out["pixel_values"], out["image_position_ids"], return_dict=True
            ).pooler_output[0]
        tensors[f"features.{i}"] = feats.float().contiguous()
        images.append((out, feats))
        processor_cases.append({
            "image": f"{i}.png", "width": w, "height": h, "max_soft_tokens": MAX_SOFT_TOKENS,
            "resized": [pixels.shape[1], pixels.shape[0]],  # patches below count 16-pixel ones
            "patches": int((out["image_position_ids"][0] != -1).all(dim=-1).sum()),
            "soft_tokens": int(out["num_soft_tokens_per_image"][0]),
            "pixels_sha256": hashlib.sha256(pixels.tobytes()).hexdigest(),
        })
    for w, h in OTHER_SHAPES:
        for budget in budgets:
            if pooling != 3:
                proc = Gemma4ImageProcessor.from_pretrained(dst, max_soft_tokens=budget)
                assert (proc.pooling_kernel_size, proc.max_soft_tokens) == (pooling, budget)
            else:
                proc = Gemma4ImageProcessor(max_soft_tokens=budget)
            img = Image.new("RGB", (w, h), (40, 90, 200))
            try:
                out = proc(images=[img], return_tensors="pt")
            except ValueError as e:
                processor_cases.append({"width": w, "height": h, "max_soft_tokens": budget, "error": str(e)})
                continue
            valid = (out["image_position_ids"][0] != -1).all(dim=-1)
            pos = out["image_position_ids"][0][valid]
            processor_cases.append({
                "width": w, "height": h, "max_soft_tokens": budget,
                "resized": [int(pos[:, 0].max()) * 16 + 16, int(pos[:, 1].max()) * 16 + 16],
                "patches": int(valid.sum()),
                "soft_tokens": int(out["num_soft_tokens_per_image"][0]),
            })
    if with_processor:
        (dst / "processor.json").write_text(json.dumps(processor_cases, indent=1) + "\n")

    audio = None
    if has_audio:
        audio_dir = dst.parent / "audio"
        audio_dir.mkdir(exist_ok=True)
        samples = test_waveform()
        write_wav(audio_dir / "0.wav", samples)
        write_compressed(audio_dir, samples)
        waveform = samples.astype(np.float32) / 32768.0
        extractor = Gemma4UnifiedAudioFeatureExtractor() if unified else Gemma4AudioFeatureExtractor()
        feats = extractor([waveform], return_tensors="pt")
        with torch.no_grad():
            out = model.model.get_audio_features(
                feats["input_features"], feats["input_features_mask"], return_dict=True
            )
        audio_features = out.pooler_output[0]
        if getattr(out, "attention_mask", None) is not None:
            # The model keeps only the soft tokens of real (not padding) frames.
            audio_features = audio_features[out.attention_mask[0]]
        tensors["audio_features.0"] = audio_features.float().contiguous()
        if not unified:
            mask = feats["input_features_mask"][0].bool()
            tensors["mel.0"] = feats["input_features"][0][mask].float().contiguous()
            cases = []
            rng = np.random.default_rng(SEED + 99)
            for n in AUDIO_LENGTHS:
                clip = (0.1 * rng.normal(size=n)).astype(np.float32)
                f = extractor([clip], return_tensors="np")
                m = f["input_features_mask"][0]
                cases.append({
                    "samples": n,
                    "mel_frames": int(m.sum()),
                    # As the processor counts a clip's placeholders: the mask through two halvings.
                    "soft_tokens": int(processor_tokens(m)),
                })
            (dst / "audio_processor.json").write_text(json.dumps(cases, indent=1) + "\n")
        audio = (feats, audio_features.shape[0])

    # Prompts: text ids from the tiny vocabulary around one or two images.
    prompts = [
        {"text_before": [2, 105, 17, 33], "images": [0], "text_after": [45, 106, 107]},
        {"text_before": [2, 9, 81], "images": [1, 3], "text_after": [64, 12]},
        {"text_before": [2, 200], "images": [2], "text_after": [300, 301, 7]},
    ]
    if has_audio:
        prompts.append({"text_before": [2, 9], "images": [1], "audios": [0], "text_after": [64, 12]})
    if with_audio:
        prompts.append({"text_before": [2, 33], "images": [], "audios": [0], "text_after": [45, 106]})
    golden_prompts = []
    for n, p in enumerate(prompts):
        ids = list(p["text_before"])
        for k, img_index in enumerate(p["images"]):
            if k:
                ids.append(19)
            count = images[img_index][1].shape[0]
            ids += [BOI_TOKEN] + [IMAGE_TOKEN] * count + [EOI_TOKEN]
        for _ in p.get("audios", []):
            ids += [19, BOA_TOKEN] + [AUDIO_TOKEN] * audio[1] + [EOA_TOKEN]
        ids += p["text_after"]
        extra = {}
        if p["images"]:
            extra["pixel_values"] = torch.cat([images[i][0]["pixel_values"] for i in p["images"]])
            extra["image_position_ids"] = torch.cat([images[i][0]["image_position_ids"] for i in p["images"]])
        input_ids = torch.tensor([ids])
        mm = (input_ids == IMAGE_TOKEN).long() + 3 * (input_ids == AUDIO_TOKEN).long()
        if p.get("audios"):
            extra.update({"input_features": audio[0]["input_features"],
                          "input_features_mask": audio[0]["input_features_mask"]})
        with torch.no_grad():
            logits = model(input_ids=input_ids, mm_token_type_ids=mm, **extra).logits[0, -1]
            gen = model.generate(
                input_ids=input_ids, mm_token_type_ids=mm,
                **extra, attention_mask=torch.ones_like(input_ids),
                max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                min_new_tokens=12,
            )[0, len(ids):].tolist()
        tensors[f"logits.{n}"] = logits.float().contiguous()
        golden_prompts.append({"ids": ids, "images": p["images"], "audios": p.get("audios", []), "greedy": gen})
    # A chat turn as the server builds it: the real template renders each
    # image part as <|image|>; the text between is tokenized piece by piece
    # and each placeholder becomes <|image>, N soft tokens, <image|>.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dst)
    import re

    chat_images = [1, 3]
    chat_audios = [0] if has_audio else []
    content = [{"type": "text", "text": "Compare these two."}, {"type": "image"}, {"type": "image"}]
    content += [{"type": "audio"} for _ in chat_audios]
    messages = [{"role": "user", "content": content}]
    rendered = tok.apply_chat_template(
        messages, chat_template=(dst / "chat_template.jinja").read_text(),
        tokenize=False, add_generation_prompt=True)
    pieces = re.split(r"(<\|image\|>|<\|audio\|>)", rendered)
    ids = []
    next_image = iter(chat_images)
    for piece in pieces:
        if piece == "<|image|>":
            count = images[next(next_image)][1].shape[0]
            ids += [BOI_TOKEN] + [IMAGE_TOKEN] * count + [EOI_TOKEN]
        elif piece == "<|audio|>":
            ids += [BOA_TOKEN] + [AUDIO_TOKEN] * audio[1] + [EOA_TOKEN]
        else:
            ids += tok(piece, add_special_tokens=False).input_ids
    pv = torch.cat([images[i][0]["pixel_values"] for i in chat_images])
    pos = torch.cat([images[i][0]["image_position_ids"] for i in chat_images])
    input_ids = torch.tensor([ids])
    extra = {}
    if chat_audios:
        extra = {"input_features": audio[0]["input_features"],
                 "input_features_mask": audio[0]["input_features_mask"]}
    with torch.no_grad():
        gen = model.generate(
            input_ids=input_ids, pixel_values=pv, image_position_ids=pos,
            mm_token_type_ids=(input_ids == IMAGE_TOKEN).long() + 3 * (input_ids == AUDIO_TOKEN).long(),
            **extra,
            attention_mask=torch.ones_like(input_ids), max_new_tokens=12, min_new_tokens=12,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, len(ids):].tolist()
    chat_golden = {"messages_text": "Compare these two.", "images": chat_images, "audios": chat_audios,
                   "rendered": rendered, "ids": ids, "greedy": gen}
    save_file(tensors, dst / "golden_tensors.safetensors")
    golden = {
        "generator": "tools/make_vision_fixture.py",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "max_soft_tokens": MAX_SOFT_TOKENS,
    }
    if pooling != 3:
        golden.update({"patch_size": 16, "pooling_kernel_size": pooling})
    golden.update({
        "images": [f"../images/{i}.png" for i in range(len(TEST_IMAGES))],
        "audios": ["../audio/0.wav"] if has_audio else [],
        "prompts": golden_prompts,
        "chat": chat_golden,
    })
    (dst / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {dst}")


if __name__ == "__main__":
    flags = sys.argv[3:]
    pooling = int(flags[flags.index("--pooling") + 1]) if "--pooling" in flags else 3
    main(Path(sys.argv[1]), Path(sys.argv[2]), "--bidirectional" in flags, "--processor" in flags,
         "--audio" in flags, pooling)
