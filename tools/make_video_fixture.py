#!/usr/bin/env python3
"""Adds video goldens (and text-only goldens) to a vision fixture written by make_vision_fixture.py.

The test video is an animated GIF (lossless, so every decoder gets the same frames):
40 frames of smooth patterns with noise, 120×90, 250 ms each (4 fps, 10 s). The reference
video processor (`Gemma4VideoProcessor`, or the 12B's `Gemma4UnifiedVideoProcessor`)
samples its default 32 frames from the frames PIL decodes, with the GIF's rate as the
metadata's fps, and resizes them within its default 70 soft tokens per frame.

The fixture's `video_token_id` is moved inside the tiny vocabulary (as the image ids
are); nothing else of the checkpoint changes, so its other goldens stand.

Writes into the fixture directory:

* `video_golden.json`: the video's path, frame count, fps, the sampled indices and
  their timestamps, per sampled frame the CRC-32 of its decoded RGB bytes and of its
  resized bytes, the soft tokens per frame, how the processor rescales (checked:
  bytes / 255); and chat turns rendered by the real template and tokenized around
  their placeholders as the processor lays them out (each frame `MM:SS ` + `<|image>` +
  N × `<|video|>` + `<image|>`, frames joined by a space), each with its 12 greedy
  tokens: one with the video, one with the video and an image, and text-only ones
  (a chat turn and a plain id prompt) for batching media with text;
* `video_golden_tensors.safetensors`: `video_features.0` (all sampled frames' soft
  tokens after `embed_vision`, `[frames · N, hidden]`) and the last-position logits of
  each chat turn (`logits.video.K`).

Needs the same packages as make_vision_fixture.py:
  python tools/make_video_fixture.py tests/fixtures/vision/e-style
  python tools/make_video_fixture.py tests/fixtures/vision/dense
  python tools/make_video_fixture.py tests/fixtures/vision/moe
  python tools/make_video_fixture.py tests/fixtures/vision/unified
  python tools/make_video_fixture.py tests/fixtures/vision/e-audio
"""

import json
import re
import sys
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageSequence
from safetensors.torch import save_file
from transformers import (
    AutoTokenizer,
    Gemma4ForConditionalGeneration,
    Gemma4UnifiedForConditionalGeneration,
)
from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
from transformers.models.gemma4_unified.image_processing_gemma4_unified import Gemma4UnifiedImageProcessor
from transformers.models.gemma4_unified.video_processing_gemma4_unified import Gemma4UnifiedVideoProcessor

sys.path.insert(0, str(Path(__file__).parent))
from make_vision_fixture import resized_bytes  # noqa: E402

SEED = 20261203
VIDEO_TOKEN = 506
FRAMES, WIDTH, HEIGHT, DELAY_MS = 40, 120, 90, 250
IMAGE_MAX_SOFT_TOKENS = 70


def write_test_video(path: Path) -> None:
    rng = np.random.default_rng(SEED)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float64)
    frames = []
    for f in range(FRAMES):
        base = np.stack(
            [
                128 + 100 * np.sin(x / 9 + y / 13 + f / 3),
                128 + 100 * np.cos(y / 7 - x / 17 - f / 5),
                255 * ((x + y + 6 * f) % (WIDTH + HEIGHT)) / (WIDTH + HEIGHT),
            ],
            axis=-1,
        )
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        frames.append(Image.fromarray(pixels, "RGB").quantize(colors=256, dither=Image.Dither.NONE))
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=DELAY_MS, loop=0,
                   optimize=False, disposal=1)


def read_frames(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)])


def video_bytes(pixel_values: torch.Tensor, positions: torch.Tensor, patch: int) -> np.ndarray:
    """A frame's resized bytes (as for images), its values checked to be bytes / 255 exactly:
    the video processor divides by 255 (its rescale is fused into a normalisation)."""
    values = pixel_values[(positions != -1).all(dim=-1)]
    assert torch.equal(torch.round(values * 255) / 255, values), "video pixels are not bytes / 255"
    return resized_bytes(pixel_values, positions, patch)


def main(fixture: Path) -> None:
    cfg = json.loads((fixture / "config.json").read_text())
    unified = cfg["model_type"] == "gemma4_unified"
    cfg["video_token_id"] = VIDEO_TOKEN
    (fixture / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    image_token, boi, eoi = cfg["image_token_id"], cfg["boi_token_id"], cfg["eoi_token_id"]
    audio_token = cfg.get("audio_token_id")

    video_dir = fixture.parent / "video"
    video_dir.mkdir(exist_ok=True)
    video_path = video_dir / "0.gif"
    if not video_path.exists():
        write_test_video(video_path)
    frames = read_frames(video_path)
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3), frames.shape

    model_class = Gemma4UnifiedForConditionalGeneration if unified else Gemma4ForConditionalGeneration
    model = model_class.from_pretrained(fixture, dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config.video_token_id == VIDEO_TOKEN

    vproc = (Gemma4UnifiedVideoProcessor if unified else Gemma4VideoProcessor)()
    fps = 1000.0 / DELAY_MS
    out = vproc(videos=[frames], video_metadata=[{"total_num_frames": FRAMES, "fps": fps}],
                return_metadata=True, return_tensors="pt")
    meta = out["video_metadata"][0]
    indices = [int(i) for i in meta.frames_indices]
    stamps = [f"{int(s // 60):02d}:{int(s % 60):02d}" for s in meta.timestamps]
    per_frame = int(out["num_soft_tokens_per_video"][0])
    pv, pos = out["pixel_values_videos"], out["video_position_ids"]
    patch = 48 if unified else 16
    resized = [video_bytes(pv[i], pos[i], patch) for i in range(len(indices))]
    with torch.no_grad():
        feats = model.model.get_video_features(
            pv, pos, num_frames_per_video=out["num_frames_per_video"], return_dict=True
        ).pooler_output[0]
    assert feats.shape[0] == per_frame * len(indices)
    tensors = {"video_features.0": feats.float().contiguous()}

    # An image beside the video (the fixture's image 1).
    image = Image.open(fixture.parent / "images" / "1.png").convert("RGB")
    iproc = (Gemma4UnifiedImageProcessor if unified else Gemma4ImageProcessor)(max_soft_tokens=IMAGE_MAX_SOFT_TOKENS)
    img = iproc(images=[image], return_tensors="pt")
    image_tokens = int(img["num_soft_tokens_per_image"][0])

    tok = AutoTokenizer.from_pretrained(fixture)
    template = (fixture / "chat_template.jinja").read_text()

    def layout(rendered: str, media: list[str]) -> list[int]:
        """The processor's expansion: each placeholder becomes its tokens; text between
        (timestamps included) is tokenized piece by piece, as special tokens split it."""
        video_text = " ".join(f"{t} \x00F\x00" for t in stamps)
        text = rendered.replace("<|video|>", video_text)
        ids = []
        for piece in re.split(r"(<\|image\|>|\x00F\x00)", text):
            if piece == "<|image|>":
                ids += [boi] + [image_token] * image_tokens + [eoi]
            elif piece == "\x00F\x00":
                ids += [boi] + [VIDEO_TOKEN] * per_frame + [eoi]
            elif piece:
                ids += tok(piece, add_special_tokens=False).input_ids
        return ids

    def run(ids: list[int], with_video: bool, with_image: bool) -> tuple[torch.Tensor, list[int]]:
        input_ids = torch.tensor([ids])
        mm = (input_ids == image_token).long() + 2 * (input_ids == VIDEO_TOKEN).long()
        if audio_token is not None:
            mm += 3 * (input_ids == audio_token).long()
        extra = {}
        if with_video:
            extra.update(pixel_values_videos=pv, video_position_ids=pos,
                         num_frames_per_video=out["num_frames_per_video"])
        if with_image:
            extra.update(pixel_values=img["pixel_values"], image_position_ids=img["image_position_ids"])
        if with_video or with_image:
            extra["mm_token_type_ids"] = mm
        with torch.no_grad():
            logits = model(input_ids=input_ids, **extra).logits[0, -1]
            gen = model.generate(
                input_ids=input_ids, **extra, attention_mask=torch.ones_like(input_ids),
                max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
            )[0, len(ids):].tolist()
        return logits, gen

    chats = [
        ("Describe the video.", [{"type": "video"}], ["video"]),
        ("What changes?", [{"type": "image"}, {"type": "video"}], ["image", "video"]),
        ("Hello there, how are you?", [], []),
    ]
    golden_chats = []
    for k, (text, parts, media) in enumerate(chats):
        content = [{"type": "text", "text": text}] + parts if parts else text
        rendered = tok.apply_chat_template([{"role": "user", "content": content}], chat_template=template,
                                           tokenize=False, add_generation_prompt=True)
        ids = layout(rendered, media)
        logits, gen = run(ids, "video" in media, "image" in media)
        tensors[f"logits.video.{k}"] = logits.float().contiguous()
        golden_chats.append({"text": text, "media": media, "rendered": rendered, "ids": ids, "greedy": gen})
    # A plain id prompt with no media at all.
    plain = [2, 9, 81, 33, 45, 106, 107]
    _, plain_greedy = run(plain, False, False)

    save_file(tensors, fixture / "video_golden_tensors.safetensors")
    (fixture / "video_golden.json").write_text(json.dumps({
        "generator": "tools/make_video_fixture.py",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "video": "../video/0.gif",
        "total_frames": FRAMES,
        "fps": fps,
        "num_frames": vproc.num_frames,
        "max_soft_tokens": vproc.max_soft_tokens,
        "indices": indices,
        "timestamps": stamps,
        "frame_crc32": [zlib.crc32(frames[i].tobytes()) for i in indices],
        "resized": [int(resized[0].shape[1]), int(resized[0].shape[0])],
        "resized_crc32": [zlib.crc32(r.tobytes()) for r in resized],
        "soft_tokens_per_frame": per_frame,
        "image": "../images/1.png",
        "image_max_soft_tokens": IMAGE_MAX_SOFT_TOKENS,
        "image_soft_tokens": image_tokens,
        "chats": golden_chats,
        "plain": {"ids": plain, "greedy": plain_greedy},
    }, indent=1) + "\n")
    print(f"wrote {fixture}: {len(indices)} frames × {per_frame} soft tokens")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
