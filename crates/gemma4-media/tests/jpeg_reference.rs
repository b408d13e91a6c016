//! JPEG pixels against the reference's: every file of
//! `tests/fixtures/vision/jpeg` (written by PIL, cjpeg and FFmpeg at several
//! qualities and subsamplings, baseline and progressive, with restart
//! markers, arithmetic coding, grayscale, CMYK and EXIF orientations;
//! `tools/make_jpeg_fixture.py`) must decode to exactly the RGB bytes the
//! reference gets for it (`NAME.rgb.png`: PIL's, which torchvision's equal).

use std::path::{Path, PathBuf};

use gemma4_media::{decode_image, DecodeLimits, RgbImage};
use serde_json::Value;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision/jpeg")
}

fn entries() -> Vec<Value> {
    let text = std::fs::read_to_string(corpus().join("manifest.json")).expect("manifest.json");
    let manifest: Value = serde_json::from_str(&text).expect("manifest JSON");
    let files = manifest["files"].as_array().expect("files").clone();
    assert!(files.len() >= 20, "the corpus has {} files", files.len());
    files
}

/// The reference's pixels for a corpus entry (`NAME.rgb.png`).
fn reference(entry: &Value) -> RgbImage {
    let png = corpus().join(entry["reference"].as_str().expect("reference"));
    let bytes = std::fs::read(&png).unwrap_or_else(|e| panic!("{}: {e}", png.display()));
    decode_image(&bytes, DecodeLimits::default()).expect("reference PNG")
}

/// Bytes that differ and the largest difference.
fn difference(a: &[u8], b: &[u8]) -> (usize, u8) {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x != y)
        .fold((0, 0), |(n, m), (x, y)| (n + 1, m.max(x.abs_diff(*y))))
}

#[test]
fn every_jpeg_decodes_to_the_references_pixels() {
    let mut wrong = Vec::new();
    for entry in entries() {
        let name = entry["file"].as_str().expect("file");
        let bytes = std::fs::read(corpus().join(name)).expect("jpeg");
        let ours =
            decode_image(&bytes, DecodeLimits::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let theirs = reference(&entry);
        assert_eq!(
            (ours.width, ours.height),
            (theirs.width, theirs.height),
            "{name}"
        );
        let (n, max) = difference(&ours.pixels, &theirs.pixels);
        if n > 0 {
            wrong.push(format!("{name}: {n} bytes differ, by up to {max}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The corpus can tell a decoder that upsamples chroma another way: with
/// libjpeg-turbo's plain (non-fancy) upsampling, every file whose chroma is
/// upsampled smoothly departs from the reference (the manifest says which:
/// not 4:4:4, gray, CMYK, 4:1:1, nor a single pixel).
#[test]
fn plain_upsampling_departs_on_subsampled_files() {
    let mut checked = 0;
    for entry in entries() {
        let name = entry["file"].as_str().expect("file");
        if entry["fancy_upsampling_matters"] != true || entry["orientation"].is_u64() {
            continue;
        }
        let bytes = std::fs::read(corpus().join(name)).expect("jpeg");
        let mut d = turbojpeg::Decompressor::new().expect("decompressor");
        let header = d.read_header(&bytes).expect("header");
        d.set_fast_upsample(true).expect("fast upsampling");
        let mut image = turbojpeg::Image {
            pixels: vec![0u8; header.width * header.height * 3],
            width: header.width,
            pitch: header.width * 3,
            height: header.height,
            format: turbojpeg::PixelFormat::RGB,
        };
        d.decompress(&bytes, image.as_deref_mut()).expect("decode");
        let (n, _) = difference(&image.pixels, &reference(&entry).pixels);
        assert!(
            n > 0,
            "{name}: plain upsampling gave the reference's pixels"
        );
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} smoothly upsampled files");
}
