//! The image processor against transformers' `Gemma4ImageProcessor`, from
//! the vision fixtures written by `tools/make_vision_fixture.py` (the
//! published 3×3 pooling kernel, and a checkpoint pooling 2×2): resized
//! size, patch and soft-token counts for 28 shapes at several budgets, and
//! the resized pixels byte for byte for the fixture's test images, with the
//! geometry read from each checkpoint's processor files.

use std::path::PathBuf;

use gemma4_media::{decode_image, DecodeLimits, ImageProcessor, MediaError, ProcessorSettings};
use serde_json::Value;

/// The fixtures and the pooling kernel each was written with.
const FIXTURES: [(&str, usize); 2] = [("e-style", 3), ("e-style-pool2", 2)];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vision")
        .join(name)
}

/// The processor the checkpoint's own files describe, with a budget.
fn processor(name: &str, budget: usize) -> ImageProcessor {
    let s = ProcessorSettings::read(&fixture(name)).expect("processor settings");
    ImageProcessor::with_geometry(s.patch_size, s.pooling, budget).expect("budget")
}

fn cases(name: &str) -> Vec<Value> {
    let text =
        std::fs::read_to_string(fixture(name).join("processor.json")).expect("processor.json");
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
fn each_checkpoint_names_its_pooling() {
    for (name, pooling) in FIXTURES {
        let s = ProcessorSettings::read(&fixture(name)).expect("settings");
        assert_eq!((s.patch_size, s.pooling), (16, pooling), "{name}");
    }
}

#[test]
fn sizes_and_counts_match_the_reference_processor() {
    for (name, pooling) in FIXTURES {
        sizes_and_counts_match(name, pooling);
    }
}

fn sizes_and_counts_match(name: &str, pooling: usize) {
    let cases = cases(name);
    assert!(cases.len() >= 70, "{name}: {} cases", cases.len());
    for case in &cases {
        let proc = processor(name, field(case, "max_soft_tokens") as usize);
        assert_eq!(proc.pooling, pooling);
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
        assert_eq!(
            (patches / (pooling * pooling)) as u64,
            field(case, "soft_tokens"),
            "{name}: {case}"
        );
        assert!(patches <= proc.max_patches());
    }
}

#[test]
fn resized_pixels_match_the_reference_byte_for_byte() {
    for (name, _) in FIXTURES {
        resized_pixels_match(name);
    }
}

fn resized_pixels_match(name: &str) {
    let bytes = std::fs::read(fixture(name).join("golden_tensors.safetensors")).expect("goldens");
    let goldens = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut checked = 0;
    for (i, case) in cases(name)
        .iter()
        .filter(|c| c.get("image").is_some())
        .enumerate()
    {
        let file = std::fs::read(
            fixture(name)
                .join("../images")
                .join(case["image"].as_str().unwrap()),
        )
        .expect("png");
        let img = decode_image(&file, DecodeLimits::default()).expect("decode");
        assert_eq!(
            (u64::from(img.width), u64::from(img.height)),
            (field(case, "width"), field(case, "height"))
        );
        let proc = processor(name, field(case, "max_soft_tokens") as usize);
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
            "{name} image {i}: {differing} of {} bytes differ",
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
    assert_eq!(checked, 4, "{name}");
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
