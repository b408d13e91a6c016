//! The vision path against transformers in float32, on tiny checkpoints with
//! a vision tower (`tests/fixtures/vision/*`, written by
//! `tools/make_vision_fixture.py`): E-style (causal), and the dense (k = v)
//! and MoE variants with bidirectional image attention on sliding layers, and
//! the 12B's encoder-free path (`unified`, with its raw-frame audio beside
//! an image in one prompt), and E-style with both towers (`e-audio`: the
//! conformer audio tower, its log-mel features and soft tokens, a clip alone
//! and beside an image).
//! Each image's soft tokens after `embed_vision`, then prompts holding one
//! or two images — the logits at the last prompt position and 12 greedy
//! tokens.

mod common;

use std::path::PathBuf;

use gemma4_media::audio::{decode_wav, frames, Audio};
use gemma4_media::mel::{audio_soft_tokens, log_mel, mel_frames, MEL_BINS};
use gemma4_model::golden::{greedy_with_soft_tokens, DEFAULT_TOLERANCE};
use gemma4_model::{
    place_soft_tokens, AudioEncoder, AudioFeatures, ImageEncoder, KvCache, LoadPolicy, LogitsFor,
    SoftTokenSource,
};
use serde_json::Value;

use common::{encode_image, max_abs_diff, tensor, vision_fixture};

const VARIANTS: [&str; 6] = [
    "e-style",
    "e-style-pool2",
    "dense",
    "moe",
    "unified",
    "e-audio",
];

fn fixture(variant: &str) -> PathBuf {
    vision_fixture(variant)
}

struct Fixture {
    model: gemma4_model::Gemma4,
    encoder: ImageEncoder,
    goldens: Vec<u8>,
    golden: Value,
}

fn load(variant: &str) -> Fixture {
    let dir = fixture(variant);
    let model = gemma4_model::load(&dir, LoadPolicy::default()).expect("text model");
    let encoder = ImageEncoder::load_dir(&dir, model.config().hidden_size)
        .expect("encoder")
        .expect("an image encoder");
    let goldens = std::fs::read(dir.join("golden_tensors.safetensors")).expect("goldens");
    let golden = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
        .expect("golden.json");
    Fixture {
        model,
        encoder,
        goldens,
        golden,
    }
}

/// The image's soft tokens, `[tokens · hidden]`, from its PNG.
fn encode(f: &Fixture, index: usize) -> Vec<f32> {
    encode_image(&f.encoder, index)
}

#[test]
fn soft_tokens_match_the_reference() {
    for variant in VARIANTS {
        soft_tokens_match(variant);
    }
}

fn soft_tokens_match(variant: &str) {
    let f = load(variant);
    for i in 0..4 {
        let ours = encode(&f, i);
        let (shape, want) = tensor(&f.goldens, &format!("features.{i}"));
        assert_eq!(ours.len(), shape.iter().product::<usize>(), "image {i}");
        let scale = want.iter().map(|x| x.abs()).fold(0.0, f32::max);
        let diff = max_abs_diff(&ours, &want);
        eprintln!("{variant} image {i}: soft tokens max |Δ| {diff:.2e} (largest value {scale:.2})");
        // f32 against f32: the same operations, summed in another order.
        assert!(
            diff <= 1e-4 * scale.max(1.0),
            "image {i}: max |Δ| {diff} (largest value {scale})"
        );
    }
}

#[test]
fn prompts_with_images_match_the_reference_logits_and_greedy_tokens() {
    for variant in VARIANTS {
        prompts_match(variant);
    }
}

fn prompts_match(variant: &str) {
    let f = load(variant);
    let hidden = f.model.config().hidden_size;
    let image_token = f.encoder.tokens().soft;
    let features: Vec<Vec<f32>> = (0..4).map(|i| encode(&f, i)).collect();
    let (audio_token, clips) = audio_clips(variant, hidden);
    let prompts = f.golden["prompts"].as_array().expect("prompts");
    let indices = |v: &Value| -> Vec<usize> {
        v.as_array()
            .map(|a| a.iter().map(|x| x.as_u64().unwrap() as usize).collect())
            .unwrap_or_default()
    };
    let with_audio = prompts
        .iter()
        .filter(|p| !indices(&p["audios"]).is_empty())
        .count();
    assert!(prompts.len() >= 3, "{variant}");
    assert_eq!(with_audio > 0, !clips.is_empty(), "{variant}");
    for (n, p) in prompts.iter().enumerate() {
        let ids: Vec<u32> = p["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let images: Vec<&[f32]> = indices(&p["images"])
            .into_iter()
            .map(|i| features[i].as_slice())
            .collect();
        let audios: Vec<&[f32]> = indices(&p["audios"])
            .into_iter()
            .map(|i| clips[i].as_slice())
            .collect();
        let placed = place_soft_tokens(
            &ids,
            hidden,
            &[
                SoftTokenSource::images(image_token, &images),
                SoftTokenSource::audio(audio_token, &audios),
            ],
        )
        .unwrap_or_else(|e| panic!("{variant} prompt {n}: {e}"));
        let greedy: Vec<u32> = p["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let (logits, ours) =
            greedy_with_soft_tokens(&f.model, &ids, Some(placed.as_soft_tokens()), greedy.len())
                .expect("greedy");
        let (_, want) = tensor(&f.goldens, &format!("logits.{n}"));
        let diff = max_abs_diff(&logits, &want);
        eprintln!("{variant} prompt {n}: logits max |Δ| {diff:.2e}");
        assert!(
            diff <= DEFAULT_TOLERANCE,
            "{variant} prompt {n}: logits max |Δ| {diff}"
        );
        assert_eq!(ours, greedy, "{variant} prompt {n}");
    }
}

/// The test clip's features as the checkpoint's audio encoder reads them.
fn audio_input(encoder: &AudioEncoder, clip: &Audio) -> Vec<f32> {
    match encoder.features() {
        AudioFeatures::LogMel => log_mel(clip).expect("log-mel").values,
        AudioFeatures::Frames(n) => frames(clip, n),
    }
}

/// The fixture's audio clips as soft tokens (none where the checkpoint has
/// no audio encoder), checked against the reference's `embed_audio` output;
/// with the audio token id.
fn audio_clips(variant: &str, hidden: usize) -> (u32, Vec<Vec<f32>>) {
    let dir = fixture(variant);
    let Some(audio) = AudioEncoder::load_dir(&dir, hidden).expect("audio encoder") else {
        return (u32::MAX, Vec::new());
    };
    let wav = std::fs::read(fixture("audio").join("0.wav")).expect("wav");
    let clip = decode_wav(&wav, 30.0).expect("decode");
    let ours: Vec<f32> = audio
        .encode(&audio_input(&audio, &clip))
        .expect("encode")
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let goldens = std::fs::read(dir.join("golden_tensors.safetensors")).expect("goldens");
    let (shape, want) = tensor(&goldens, "audio_features.0");
    let tokens = match audio.features() {
        AudioFeatures::Frames(n) => clip.samples.len().div_ceil(n),
        AudioFeatures::LogMel => audio_soft_tokens(clip.samples.len()),
    };
    assert_eq!(shape, [tokens, hidden], "{variant}");
    let scale = want.iter().map(|x| x.abs()).fold(0.0, f32::max);
    let diff = max_abs_diff(&ours, &want);
    eprintln!("{variant} audio 0: soft tokens max |Δ| {diff:.2e} (largest value {scale:.2})");
    assert!(diff <= 1e-4 * scale.max(1.0), "{variant} audio: {diff}");
    (audio.tokens().soft, vec![ours])
}

#[test]
fn log_mel_features_match_the_reference() {
    let wav = std::fs::read(fixture("audio").join("0.wav")).expect("wav");
    let clip = decode_wav(&wav, 30.0).expect("decode");
    let ours = log_mel(&clip).expect("log-mel");
    let goldens = std::fs::read(fixture("e-audio").join("golden_tensors.safetensors")).unwrap();
    let (shape, want) = tensor(&goldens, "mel.0");
    assert_eq!(shape, [ours.frames, MEL_BINS]);
    let diff = max_abs_diff(&ours.values, &want);
    eprintln!(
        "log-mel of the test clip: max |Δ| {diff:.2e} over {} frames",
        ours.frames
    );
    // Single-precision FFT and window in the reference, double here.
    assert!(diff <= 1e-4, "log-mel max |Δ| {diff}");
}

#[test]
fn audio_frame_and_token_counts_match_the_reference_processor() {
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("e-audio").join("audio_processor.json")).unwrap(),
    )
    .unwrap();
    let cases = cases.as_array().expect("cases");
    assert!(cases.len() >= 5);
    for c in cases {
        let n = c["samples"].as_u64().unwrap() as usize;
        assert_eq!(
            mel_frames(n) as u64,
            c["mel_frames"].as_u64().unwrap(),
            "{n} samples"
        );
        assert_eq!(
            audio_soft_tokens(n) as u64,
            c["soft_tokens"].as_u64().unwrap(),
            "{n} samples"
        );
        let clip = Audio {
            samples: vec![0.01; n],
        };
        match log_mel(&clip) {
            Ok(m) => assert_eq!(m.frames, mel_frames(n)),
            Err(_) => assert_eq!(mel_frames(n), 0, "{n} samples"),
        }
    }
}

#[test]
fn without_the_image_the_logits_differ() {
    // The soft tokens matter: the same prompt with the placeholders' pad
    // embeddings in their place departs from the reference.
    let f = load("e-style");
    let p = &f.golden["prompts"][0];
    let ids: Vec<u32> = p["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let pad_ids: Vec<u32> = ids
        .iter()
        .map(|&t| if t == f.encoder.tokens().soft { 0 } else { t })
        .collect();
    let mut cache = KvCache::new(f.model.config().num_layers());
    let l = f
        .model
        .forward(&pad_ids, &mut cache, LogitsFor::Last, None)
        .expect("forward");
    let (_, want) = tensor(&f.goldens, "logits.0");
    let diff = max_abs_diff(&l.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &want);
    assert!(diff > 100.0 * DEFAULT_TOLERANCE, "{diff}");
}
