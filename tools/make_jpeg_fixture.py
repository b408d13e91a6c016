#!/usr/bin/env python3
"""Writes a corpus of small JPEG files and the pixels the reference decodes from each.

The corpus covers what a JPEG decoder has to get right to match transformers: odd sizes
(partial MCUs), qualities 50 to 100, chroma subsampling 4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1
and a mixed one, baseline, progressive and arithmetic-coded files, restart markers (in
blocks and in rows), optimised Huffman tables, grayscale, CMYK (Adobe, inverted), an RGB
(untransformed) JPEG, EXIF orientations, and files from four encoders: Pillow, cjpeg and
jpegtran (libjpeg-turbo-progs) and ffmpeg's mjpeg. The content is a crop of the vision
fixtures' test image 2 (smooth patterns with noise), with its noise softened, and a few
saturated shapes whose colour edges make chroma upsampling matter.

For each `NAME.jpg` the reference pixels are written losslessly as `NAME.rgb.png`:
`PIL.Image.open`, `ImageOps.exif_transpose`, `.convert("RGB")`, which is what
transformers 5.23's `image_utils.load_image` does (Pillow decodes with libjpeg-turbo's
defaults: fancy upsampling, the accurate integer IDCT). On a chat request the processor
fetches each image with its image processor's `fetch_images`: the PIL backend calls
`load_image`; the default torchvision backend (`Gemma4ImageProcessor`) calls
`load_image_as_tensor`, which decodes with torchcodec (0.16 or later, when installed) or
else `torchvision.io.decode_image(..., mode=RGB, apply_exif_orientation=True)`. Every path
applies the EXIF orientation. An image handed to the processor already decoded (a
`PIL.Image`) is only converted to RGB, never transposed. The manifest records, per file,
whether torchvision's decode (when torchvision is installed) gives the same bytes.

`manifest.json` lists each file: size as stored and as referenced, the mode Pillow opens
it in, the subsampling (named from the components' sampling factors: "4:2:0", "4:4:0",
"4:1:1", ..., "none" for grayscale), Pillow's `JpegImagePlugin.get_sampling` (0, 1, 2 for
4:4:4, 4:2:2, 4:2:0 with 2×2 luma blocks at most; -1 otherwise) and the factors, the
frame type, progressive and arithmetic flags, the encoder and its options, the restart
interval (from the DRI markers), the EXIF orientation, the sha256 of the reference RGB
bytes; and the Pillow, libjpeg-turbo and torchvision versions. As a sanity check each
file is also decoded by `djpeg -ppm` (libjpeg-turbo's command line, default options, so it
should agree with Pillow byte for byte) and by `djpeg -nosmooth` (plain replicating
upsampling: the files that differ then are those that depend on fancy upsampling,
`fancy_upsampling_matters`); the results go in the manifest beside the djpeg version.

Encoders that are missing are skipped with a message; a JPEG already in the output
folder from an earlier run is then kept and only its reference is written again. With
`--references-only` no JPEG is encoded: the references and the manifest are rebuilt
from the JPEG files present.

Needs Pillow and numpy (torch and torchvision for the torchvision comparison), and
libjpeg-turbo-progs and ffmpeg for their cases:
  apt-get install -y libjpeg-turbo-progs ffmpeg
  python tools/make_jpeg_fixture.py tests/fixtures/vision/jpeg
"""

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import PIL
import PIL.features
from PIL import Image, ImageDraw, ImageFilter, ImageOps, JpegImagePlugin

SOURCE = Path(__file__).resolve().parent.parent / "tests/fixtures/vision/images/2.png"

# (name, (width, height), encoder, options). Pillow's options are `Image.save` keywords
# (`mode` picks the image mode first, `orientation` adds an EXIF orientation tag);
# cjpeg's and ffmpeg's are their command-line switches; jpegtran's say which Pillow
# baseline file it rewrites (`src`: save keywords) and with which switches.
CASES = [
    # Pillow (its bundled libjpeg-turbo), baseline.
    ("pil-q75-420-97x61", (97, 61), "pil", {"quality": 75, "subsampling": 2}),
    ("pil-q50-422-128x128", (128, 128), "pil", {"quality": 50, "subsampling": 1}),
    ("pil-q95-444-128x128", (128, 128), "pil", {"quality": 95, "subsampling": 0}),
    ("pil-q90-420-33x300", (33, 300), "pil", {"quality": 90, "subsampling": 2}),
    ("pil-q100-444-64x48", (64, 48), "pil", {"quality": 100, "subsampling": 0}),
    ("pil-q75-420-1x1", (1, 1), "pil", {"quality": 75, "subsampling": 2}),
    ("pil-q75-420-15x9", (15, 9), "pil", {"quality": 75, "subsampling": 2}),
    ("pil-q80-422-17x33", (17, 33), "pil", {"quality": 80, "subsampling": 1}),
    ("pil-q75-420-optimize-97x61", (97, 61), "pil", {"quality": 75, "subsampling": 2, "optimize": True}),
    # Progressive.
    ("pil-q75-420-progressive-250x170", (250, 170), "pil",
     {"quality": 75, "subsampling": 2, "progressive": True}),
    ("pil-q90-422-progressive-33x300", (33, 300), "pil",
     {"quality": 90, "subsampling": 1, "progressive": True}),
    ("pil-q95-444-progressive-97x61", (97, 61), "pil",
     {"quality": 95, "subsampling": 0, "progressive": True}),
    # Restart markers: every 3 MCUs (so mid-row), every MCU row; and in a progressive file.
    ("pil-q75-420-rst3blocks-97x61", (97, 61), "pil",
     {"quality": 75, "subsampling": 2, "restart_marker_blocks": 3}),
    ("pil-q75-422-rst1row-128x128", (128, 128), "pil",
     {"quality": 75, "subsampling": 1, "restart_marker_rows": 1}),
    ("pil-q75-420-progressive-rst2rows-128x128", (128, 128), "pil",
     {"quality": 75, "subsampling": 2, "progressive": True, "restart_marker_rows": 2}),
    # Grayscale ("L") and CMYK (Pillow writes Adobe CMYK, inverted).
    ("pil-gray-q75-97x61", (97, 61), "pil", {"mode": "L", "quality": 75}),
    ("pil-gray-q90-progressive-128x128", (128, 128), "pil", {"mode": "L", "quality": 90, "progressive": True}),
    ("pil-gray-q50-rst2blocks-33x300", (33, 300), "pil", {"mode": "L", "quality": 50, "restart_marker_blocks": 2}),
    ("pil-cmyk-q90-97x61", (97, 61), "pil", {"mode": "CMYK", "quality": 90}),
    ("pil-cmyk-q75-progressive-64x48", (64, 48), "pil", {"mode": "CMYK", "quality": 75, "progressive": True}),
    # EXIF orientation (the stored image is turned; the reference is upright).
    ("pil-q85-420-exif6-97x61", (97, 61), "pil", {"quality": 85, "subsampling": 2, "orientation": 6}),
    ("pil-q85-422-exif3-33x300", (33, 300), "pil", {"quality": 85, "subsampling": 1, "orientation": 3}),
    # cjpeg (Debian's libjpeg-turbo-progs).
    ("cjpeg-q75-440-97x61", (97, 61), "cjpeg", ["-quality", "75", "-sample", "1x2"]),
    ("cjpeg-q80-422-33x300", (33, 300), "cjpeg", ["-quality", "80", "-sample", "2x1"]),
    ("cjpeg-q75-411-128x128", (128, 128), "cjpeg", ["-quality", "75", "-sample", "4x1"]),
    ("cjpeg-q75-mixed-97x61", (97, 61), "cjpeg", ["-quality", "75", "-sample", "2x2,2x1,1x1"]),
    ("cjpeg-q75-420-progressive-128x128", (128, 128), "cjpeg", ["-quality", "75", "-progressive"]),
    ("cjpeg-q75-420-rst1-97x61", (97, 61), "cjpeg", ["-quality", "75", "-restart", "1"]),
    ("cjpeg-q75-444-rst5b-33x300", (33, 300), "cjpeg", ["-quality", "75", "-sample", "1x1", "-restart", "5B"]),
    ("cjpeg-q75-420-optimize-250x170", (250, 170), "cjpeg", ["-quality", "75", "-optimize"]),
    ("cjpeg-q75-420-arithmetic-97x61", (97, 61), "cjpeg", ["-quality", "75", "-arithmetic"]),
    ("cjpeg-q90-422-arithmetic-progressive-128x128", (128, 128), "cjpeg",
     ["-quality", "90", "-sample", "2x1", "-arithmetic", "-progressive"]),
    ("cjpeg-q75-gray-33x300", (33, 300), "cjpeg", ["-quality", "75", "-grayscale"]),
    ("cjpeg-q85-rgb-97x61", (97, 61), "cjpeg", ["-quality", "85", "-rgb"]),
    # jpegtran: lossless rewrites of a Pillow baseline file.
    ("jpegtran-progressive-422-128x128", (128, 128), "jpegtran",
     {"src": {"quality": 80, "subsampling": 1}, "args": ["-progressive"]}),
    ("jpegtran-rst1-420-97x61", (97, 61), "jpegtran",
     {"src": {"quality": 75, "subsampling": 2}, "args": ["-restart", "1"]}),
    ("jpegtran-arithmetic-444-97x61", (97, 61), "jpegtran",
     {"src": {"quality": 90, "subsampling": 0}, "args": ["-arithmetic"]}),
    ("jpegtran-optimize-progressive-rst2-420-33x300", (33, 300), "jpegtran",
     {"src": {"quality": 75, "subsampling": 2}, "args": ["-optimize", "-progressive", "-restart", "2"]}),
    # ffmpeg's mjpeg encoder.
    ("ffmpeg-yuvj420p-97x61", (97, 61), "ffmpeg", ["-pix_fmt", "yuvj420p", "-q:v", "3"]),
    ("ffmpeg-yuvj422p-128x128", (128, 128), "ffmpeg", ["-pix_fmt", "yuvj422p", "-q:v", "5"]),
    ("ffmpeg-yuvj444p-33x300", (33, 300), "ffmpeg", ["-pix_fmt", "yuvj444p", "-q:v", "2"]),
]

TOOLS = {"cjpeg": "cjpeg", "jpegtran": "jpegtran", "ffmpeg": "ffmpeg"}


def content(width: int, height: int, index: int) -> Image.Image:
    """A crop of the shared test image with its noise softened, and saturated shapes."""
    src = Image.open(SOURCE).convert("RGB")
    sw, sh = src.size
    x0 = (37 * index) % max(sw - width, 1)
    y0 = (53 * index) % max(sh - height, 1)
    crop = src.crop((x0, y0, x0 + width, y0 + height))
    soft = crop.filter(ImageFilter.GaussianBlur(1.2))
    img = Image.blend(soft, crop, 0.3)
    draw = ImageDraw.Draw(img)
    w, h = width, height
    draw.ellipse((w * 0.1, h * 0.1, w * 0.45, h * 0.4), fill=(230, 20, 30))
    draw.rectangle((w * 0.55, h * 0.05, w * 0.62, h * 0.9), fill=(20, 40, 220))
    draw.line((0, h - 1, w - 1, h * 0.5), fill=(250, 240, 10), width=max(1, min(w, h) // 20))
    draw.rectangle((w * 0.7, h * 0.6, w * 0.95, h * 0.95), outline=(10, 200, 40), width=1)
    return img


def save_pil(img: Image.Image, path: Path, opts: dict) -> None:
    opts = dict(opts)
    mode = opts.pop("mode", "RGB")
    orientation = opts.pop("orientation", None)
    if mode != img.mode:
        img = img.convert(mode)
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        opts["exif"] = exif.tobytes()
    img.save(path, "JPEG", **opts)


def encode(name: str, size: tuple, encoder: str, opts, index: int, out: Path, tmp: Path) -> bool:
    """Writes `out/NAME.jpg`; False when the encoder is missing."""
    path = out / f"{name}.jpg"
    img = content(*size, index)
    if encoder == "pil":
        save_pil(img, path, opts)
        asked = opts.get("restart_marker_blocks") or opts.get("restart_marker_rows")
        if asked and not markers(path.read_bytes())["restart_intervals"]:
            print(f"{name}: this Pillow ({PIL.__version__}) wrote no restart markers")
        return True
    if shutil.which(TOOLS[encoder]) is None:
        return False
    if encoder == "cjpeg":
        src = tmp / f"{name}.ppm"
        img.save(src)  # binary PPM
        subprocess.run(["cjpeg", *opts, "-outfile", str(path), str(src)], check=True)
    elif encoder == "jpegtran":
        src = tmp / f"{name}.src.jpg"
        save_pil(img, src, opts["src"])
        subprocess.run(["jpegtran", *opts["args"], "-outfile", str(path), str(src)], check=True)
    elif encoder == "ffmpeg":
        src = tmp / f"{name}.png"
        img.save(src)
        subprocess.run(
            ["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-i", str(src), *opts,
             "-fflags", "+bitexact", "-flags:v", "+bitexact", "-frames:v", "1", "-update", "1", str(path)],
            check=True,
        )
    return True


def markers(data: bytes) -> dict:
    """What the file's markers say: frame type, components, restart intervals, APPn."""
    info = {"frame": None, "components": [], "restart_intervals": [], "scans": 0,
            "jfif": False, "adobe_transform": None}
    frames = {0xC0: "baseline", 0xC1: "extended", 0xC2: "progressive", 0xC3: "lossless",
              0xC9: "extended-arithmetic", 0xCA: "progressive-arithmetic", 0xCB: "lossless-arithmetic"}
    i = 2
    assert data[:2] == b"\xff\xd8", "not a JPEG"
    while i < len(data):
        if data[i] != 0xFF:
            raise ValueError(f"marker expected at {i}")
        m = data[i + 1]
        if m == 0xFF:
            i += 1
            continue
        if m == 0xD9:
            break
        length = int.from_bytes(data[i + 2:i + 4], "big")
        seg = data[i + 4:i + 2 + length]
        if m in frames:
            info["frame"] = frames[m]
            n = seg[5]
            info["components"] = [
                {"id": seg[6 + 3 * k], "h": seg[7 + 3 * k] >> 4, "v": seg[7 + 3 * k] & 15} for k in range(n)
            ]
        elif m == 0xDD:
            info["restart_intervals"].append(int.from_bytes(seg[:2], "big"))
        elif m == 0xE0 and seg[:5] == b"JFIF\0":
            info["jfif"] = True
        elif m == 0xEE and seg[:5] == b"Adobe":
            info["adobe_transform"] = seg[11]
        i += 2 + length
        if m == 0xDA:
            info["scans"] += 1
            # Entropy-coded data: up to the next marker other than a stuffed 0 or RSTn.
            while i < len(data) - 1:
                if data[i] == 0xFF and data[i + 1] != 0 and not 0xD0 <= data[i + 1] <= 0xD7:
                    break
                i += 1
    return info


SAMPLING_NAMES = {(1, 1): "4:4:4", (2, 1): "4:2:2", (2, 2): "4:2:0", (1, 2): "4:4:0", (4, 1): "4:1:1",
                  (4, 2): "4:1:0"}


def sampling_name(components: list) -> str:
    """The chroma subsampling from the sampling factors: how many luma samples per chroma
    sample across and down ("none" for one component; the factors when the chroma
    components are not subsampled alike)."""
    if len(components) < 2:
        return "none"
    hmax = max(c["h"] for c in components)
    vmax = max(c["v"] for c in components)
    ratios = {(hmax // c["h"], vmax // c["v"]) for c in components[1:]}
    first = components[0]
    if len(ratios) == 1 and (first["h"], first["v"]) == (hmax, vmax):
        ratio = ratios.pop()
        if ratio in SAMPLING_NAMES:
            return SAMPLING_NAMES[ratio]
    return ",".join(f"{c['h']}x{c['v']}" for c in components)


def reference(path: Path) -> tuple:
    """(Pillow as opened, the RGB reference transformers' load_image returns, as stored)."""
    im = Image.open(path)
    im.load()
    stored = im.convert("RGB")
    upright = ImageOps.exif_transpose(im).convert("RGB")
    return im, upright, stored


def read_pnm(data: bytes) -> np.ndarray:
    """A binary PGM or PPM (as djpeg writes them) as [h, w, 3] bytes."""
    fields, pos = [], 0
    while len(fields) < 4:
        while data[pos:pos + 1].isspace():
            pos += 1
        if data[pos:pos + 1] == b"#":
            pos = data.index(b"\n", pos)
            continue
        end = pos
        while not data[end:end + 1].isspace():
            end += 1
        fields.append(data[pos:end])
        pos = end
    pos += 1
    kind, w, h, maxval = fields[0], int(fields[1]), int(fields[2]), int(fields[3])
    assert maxval == 255, maxval
    channels = 3 if kind == b"P6" else 1
    arr = np.frombuffer(data[pos:pos + w * h * channels], np.uint8).reshape(h, w, channels)
    return np.repeat(arr, 3, axis=2) if channels == 1 else arr


def djpeg(path: Path, extra: list) -> np.ndarray | str:
    if shutil.which("djpeg") is None:
        return "djpeg missing"
    r = subprocess.run(["djpeg", *extra, "-ppm", str(path)], capture_output=True)
    if r.returncode != 0:
        return r.stderr.decode().strip() or f"exit {r.returncode}"
    return read_pnm(r.stdout)


def compare(a: np.ndarray, b) -> dict:
    if isinstance(b, str):
        return {"equal": None, "error": b}
    if a.shape != b.shape:
        return {"equal": False, "shape": list(b.shape)}
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return {"equal": bool((d == 0).all()), "bytes_differing": int((d > 0).sum()), "max_diff": int(d.max())}


def torchvision_decode(path: Path):
    try:
        import torch
        from torchvision.io import ImageReadMode, decode_image
    except ImportError:
        return None
    torch.set_num_threads(1)
    try:
        t = decode_image(str(path), mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return f"{type(e).__name__}: {e}"
    return t.permute(1, 2, 0).contiguous().numpy()


def tool_version(cmd: list) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    r = subprocess.run(cmd, capture_output=True, text=True)
    text = (r.stdout + r.stderr).strip().splitlines()
    return text[0] if text else None


def main(out: Path, references_only: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    names = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, size, encoder, opts) in enumerate(CASES):
            path = out / f"{name}.jpg"
            if not references_only:
                if not encode(name, size, encoder, opts, index, out, Path(tmp)):
                    print(f"{name}: {TOOLS[encoder]} not found;",
                          "keeping the file from an earlier run" if path.exists() else "skipped")
            if path.exists():
                names.append((name, encoder, opts))

    try:
        import torchvision
        tv_version = torchvision.__version__
    except ImportError:
        tv_version = None
    files = []
    for name, encoder, opts in names:
        path = out / f"{name}.jpg"
        data = path.read_bytes()
        im, upright, stored = reference(path)
        rgb = np.asarray(upright)
        Image.fromarray(rgb, "RGB").save(out / f"{name}.rgb.png", optimize=True)
        m = markers(data)
        entry = {
            "file": path.name,
            "reference": f"{name}.rgb.png",
            "bytes": len(data),
            "width": im.size[0],
            "height": im.size[1],
            "reference_width": upright.size[0],
            "reference_height": upright.size[1],
            "mode": im.mode,
            "subsampling": sampling_name(m["components"]),
            "pil_sampling": JpegImagePlugin.get_sampling(im),
            "sampling_factors": [[c["h"], c["v"]] for c in m["components"]],
            "frame": m["frame"],
            "progressive": bool(im.info.get("progressive", 0) or im.info.get("progression", 0)),
            "arithmetic": "arithmetic" in (m["frame"] or ""),
            "scans": m["scans"],
            "restart_interval": m["restart_intervals"][0] if m["restart_intervals"] else 0,
            "jfif": m["jfif"],
            "adobe_transform": m["adobe_transform"],
            "orientation": im.getexif().get(0x0112),
            "encoder": encoder,
            "options": opts,
            "rgb_sha256": hashlib.sha256(rgb.tobytes()).hexdigest(),
        }
        if len(set(m["restart_intervals"])) > 1:
            entry["restart_intervals"] = m["restart_intervals"]
        # Sanity checks against libjpeg-turbo's command line (stored orientation).
        stored_rgb = np.asarray(stored)
        entry["djpeg"] = compare(stored_rgb, djpeg(path, []))
        entry["djpeg_nosmooth"] = compare(stored_rgb, djpeg(path, ["-nosmooth"]))
        if entry["djpeg_nosmooth"]["equal"] is not None:
            entry["fancy_upsampling_matters"] = not entry["djpeg_nosmooth"]["equal"]
        tv = torchvision_decode(path)
        if tv is not None:
            entry["torchvision"] = compare(rgb, tv)
        files.append(entry)

    manifest = {
        "generator": "tools/make_jpeg_fixture.py",
        "reference": "PIL.Image.open, ImageOps.exif_transpose, convert('RGB') "
                     "(transformers 5.23 image_utils.load_image)",
        "exif_orientation": "applied: load_image calls ImageOps.exif_transpose; load_image_as_tensor "
                            "(the torchvision backend's fetch_images) decodes with apply_exif_orientation=True",
        "pillow": PIL.__version__,
        "pillow_jpg": PIL.features.version("jpg"),
        "pillow_libjpeg_turbo": PIL.features.version("libjpeg_turbo"),
        "torchvision": tv_version,
        "djpeg": tool_version(["djpeg", "-version"]),
        "cjpeg": tool_version(["cjpeg", "-version"]),
        "ffmpeg": tool_version(["ffmpeg", "-version"]),
        "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    def report(key: str, what: str) -> None:
        differ = [f["file"] for f in files if f.get(key, {}).get("equal") is False]
        unchecked = [f"{f['file']} ({f[key]['error']})" for f in files if f.get(key, {}).get("equal") is None]
        print(f"{what} differs on {len(differ)} of {len(files)}: {', '.join(differ) or 'none'}")
        if unchecked:
            print(f"{what} not compared on: {', '.join(unchecked)}")

    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {len(files)} JPEGs and their references to {out} ({total / 1024:.0f} KiB)")
    report("djpeg", "djpeg -ppm against Pillow")
    report("djpeg_nosmooth", "djpeg -nosmooth against Pillow")
    if tv_version:
        report("torchvision", f"torchvision {tv_version} against the reference")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(Path(args[0]) if args else Path("tests/fixtures/vision/jpeg"), "--references-only" in sys.argv)
