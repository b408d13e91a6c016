//! The image processor against transformers' `Gemma4ImageProcessor`, from
//! the vision fixture written by `tools/make_vision_fixture.py`: resized
//! size, patch and soft-token counts for 28 shapes at three budgets, and the
//! resized pixels byte for byte for the fixture's test images.

use std::path::PathBuf;

use gemma4_media::{decode_image, DecodeLimits, ImageProcessor, MediaError};
use serde_json::Value;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision/e-style")
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixture().join("processor.json")).expect("processor.json");
    serde_json::from_str::<Value>(&text)
        .expect("json")
        .as_array()
        .expect("array")
        .clone()
}

fn field(case: &Value, key: &str) -> u64 {
    case[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} in {case}"))
}

#[test]
fn sizes_and_counts_match_the_reference_processor() {
    let cases = cases();
    assert!(cases.len() >= 70, "{} cases", cases.len());
    for case in &cases {
        let proc = ImageProcessor::new(field(case, "max_soft_tokens") as usize).expect("budget");
        let (w, h) = (field(case, "width") as u32, field(case, "height") as u32);
        if case.get("error").is_some() {
            assert!(proc.target_size(w, h).is_err(), "{case}");
            continue;
        }
        let (tw, th) = proc
            .target_size(w, h)
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        let resized = case["resized"].as_array().expect("resized");
        assert_eq!(
            (u64::from(tw), u64::from(th)),
            (resized[0].as_u64().unwrap(), resized[1].as_u64().unwrap()),
            "{case}"
        );
        let patches = (tw as usize / proc.patch_size) * (th as usize / proc.patch_size);
        assert_eq!(patches as u64, field(case, "patches"), "{case}");
        assert_eq!((patches / 9) as u64, field(case, "soft_tokens"), "{case}");
        assert!(patches <= proc.max_patches());
    }
}

#[test]
fn resized_pixels_match_the_reference_byte_for_byte() {
    let bytes = std::fs::read(fixture().join("golden_tensors.safetensors")).expect("goldens");
    let goldens = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut checked = 0;
    for (i, case) in cases()
        .iter()
        .filter(|c| c.get("image").is_some())
        .enumerate()
    {
        let file = std::fs::read(
            fixture()
                .join("../images")
                .join(case["image"].as_str().unwrap()),
        )
        .expect("png");
        let img = decode_image(&file, DecodeLimits::default()).expect("decode");
        assert_eq!(
            (u64::from(img.width), u64::from(img.height)),
            (field(case, "width"), field(case, "height"))
        );
        let proc = ImageProcessor::new(field(case, "max_soft_tokens") as usize).unwrap();
        let out = proc.process(&img).expect("process");
        assert_eq!(out.soft_tokens as u64, field(case, "soft_tokens"));
        let want = goldens.tensor(&format!("pixels.{i}")).expect("pixels");
        assert_eq!(want.shape(), [out.height as usize, out.width as usize, 3]);
        let resized = gemma4_media::resize::resize_bicubic(&img, out.width, out.height);
        let differing = resized
            .pixels
            .iter()
            .zip(want.data())
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(
            differing,
            0,
            "image {i}: {differing} of {} bytes differ",
            want.data().len()
        );
        // The patches hold those bytes rescaled.
        let first_patch_value = out.patches[0];
        assert_eq!(
            first_patch_value,
            f32::from(want.data()[0]) * (1.0f64 / 255.0) as f32
        );
        checked += 1;
    }
    assert_eq!(checked, 4);
}

#[test]
fn degenerate_sizes_are_errors_not_panics() {
    let proc = ImageProcessor::new(70).unwrap();
    assert!(matches!(proc.target_size(0, 10), Err(MediaError::Empty)));
    // 100000×1: one block high, as long as the budget allows.
    let (w, h) = proc.target_size(100_000, 1).unwrap();
    assert_eq!(h, 48);
    assert!(w as usize / 16 * 3 <= proc.max_patches());
}
