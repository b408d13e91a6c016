//! Helpers the multimodal tests share: the vision fixtures, their golden
//! tensors, and an image's soft tokens from its PNG.

use std::path::PathBuf;

use gemma4_media::{decode_image, DecodeLimits, ImageProcessor, ProcessedImage};
use gemma4_model::{ImageEncoder, VisionInput};

/// `tests/fixtures/vision/<name>` (a variant, `images` or `audio`).
pub fn vision_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vision")
        .join(name)
}

/// An f32 tensor of a safetensors file's bytes: its shape and values.
pub fn tensor(bytes: &[u8], name: &str) -> (Vec<usize>, Vec<f32>) {
    let st = safetensors::SafeTensors::deserialize(bytes).expect("safetensors");
    let t = st.tensor(name).unwrap_or_else(|_| panic!("{name}"));
    let data = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (t.shape().to_vec(), data)
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Test image `index`'s soft tokens, `[tokens · hidden]`, processed with a
/// budget of 70 as the fixtures' goldens were.
pub fn encode_image(encoder: &ImageEncoder, index: usize) -> Vec<f32> {
    let png = std::fs::read(vision_fixture("images").join(format!("{index}.png"))).expect("png");
    let img = decode_image(&png, DecodeLimits::default()).expect("decode");
    let (patch_size, pooling) = encoder.patch_geometry();
    let proc = ImageProcessor::with_geometry(patch_size, pooling, 70).unwrap();
    let processed = if encoder.takes_merged_patches() {
        proc.process_merged(&img)
    } else {
        proc.process(&img)
    }
    .expect("process");
    encode_processed(encoder, &processed)
}

/// A processed image's (or video frame's) soft tokens, `[tokens · hidden]`.
pub fn encode_processed(encoder: &ImageEncoder, processed: &ProcessedImage) -> Vec<f32> {
    let out = encoder
        .encode(VisionInput {
            patches: &processed.patches,
            positions: &processed.positions,
        })
        .expect("encode");
    assert_eq!(out.dim(0).unwrap(), processed.soft_tokens);
    out.flatten_all().unwrap().to_vec1().unwrap()
}
