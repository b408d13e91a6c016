//! JPEG pixels against the reference's: every file of
//! `tests/fixtures/vision/jpeg` (written by PIL, cjpeg and FFmpeg at several
//! qualities and subsamplings, baseline and progressive, with restart
//! markers, arithmetic coding, grayscale, CMYK and EXIF orientations;
//! `tools/make_jpeg_fixture.py`) must decode to exactly the RGB bytes the
//! reference gets for it (`NAME.rgb.png`: PIL's, which torchvision's equal).

use std::path::{Path, PathBuf};

use gemma4_media::jpeg::{decode_jpeg_upsampled, ChromaUpsampling};
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
        let image = decode_jpeg_upsampled(&bytes, DecodeLimits::default(), ChromaUpsampling::Plain)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let (n, _) = difference(&image.pixels, &reference(&entry).pixels);
        assert!(
            n > 0,
            "{name}: plain upsampling gave the reference's pixels"
        );
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} smoothly upsampled files");
}

/// The byte ranges of a JPEG's scans: each SOS segment with the entropy-coded
/// data after it, up to the next marker that is not a restart marker.
fn scans(bytes: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut found = Vec::new();
    let mut at = 2; // after SOI
    while at + 4 <= bytes.len() && bytes[at] == 0xFF {
        let marker = bytes[at + 1];
        if marker == 0xD9 {
            break;
        }
        let length = usize::from(u16::from_be_bytes([bytes[at + 2], bytes[at + 3]]));
        let mut end = at + 2 + length;
        if marker == 0xDA {
            while end + 1 < bytes.len()
                && !(bytes[end] == 0xFF
                    && bytes[end + 1] != 0
                    && !(0xD0..=0xD7).contains(&bytes[end + 1]))
            {
                end += 1;
            }
            found.push(at..end);
        }
        at = end;
    }
    found
}

/// A progressive file whose scans never end is refused once it passes the
/// scan limit, with a message that says so, while the file it was made from
/// still decodes.
#[test]
fn endless_progressive_scans_are_refused() {
    let name = "pil-q75-420-progressive-250x170.jpg";
    let bytes = std::fs::read(corpus().join(name)).expect("jpeg");
    let found = scans(&bytes);
    assert_eq!(found.len(), 10, "{name}: the manifest says 10 scans");
    decode_image(&bytes, DecodeLimits::default()).expect("the original decodes");

    // The first scan (DC) repeated: libjpeg warns of a bogus progression and
    // goes on, so only the limit stops it.
    let first = found[0].clone();
    let mut endless = bytes[..first.end].to_vec();
    for _ in 0..600 {
        endless.extend_from_slice(&bytes[first.clone()]);
    }
    endless.extend_from_slice(&bytes[first.end..]);
    let err = decode_image(&endless, DecodeLimits::default()).expect_err("600 extra scans");
    assert!(err.to_string().contains("more than 500 scans"), "{err}");
}

/// libjpeg's own message reaches the caller.
#[test]
fn libjpegs_message_names_the_fault() {
    let mut bytes = std::fs::read(corpus().join("pil-q75-420-97x61.jpg")).expect("jpeg");
    let sof = bytes
        .windows(2)
        .position(|w| w == [0xFF, 0xC0])
        .expect("SOF0");
    // Nine components in a frame header sized for three.
    bytes[sof + 9] = 9;
    let err = decode_image(&bytes, DecodeLimits::default()).expect_err("bad frame header");
    assert_eq!(
        err.to_string(),
        "the image could not be decoded: JPEG: Bogus marker length"
    );
}
