//! Video against transformers in float32, on the vision fixtures with video
//! goldens (`video_golden.json`, written by `tools/make_video_fixture.py`):
//! E-style (causal), dense and MoE (each frame's soft tokens see each other
//! on sliding layers), the 12B's encoder-free path and E-style with both
//! towers. The test video is an
//! animated GIF of 40 frames at 4 fps; the reference samples 32 of them.
//! Checked: the sampled indices and timestamps, each sampled frame's decoded
//! and resized bytes, all frames' soft tokens after `embed_vision`, then chat
//! turns holding the video (alone, and after an image) and a text-only turn —
//! the logits at the last prompt position and 12 greedy tokens.

mod common;

use gemma4_media::resize::resize_bicubic;
use gemma4_media::video::{decode_video, DEFAULT_VIDEO_FRAMES, VIDEO_SOFT_TOKENS};
use gemma4_media::{ImageProcessor, Rescale, VideoLimits};
use gemma4_model::golden::{greedy_with_soft_tokens, DEFAULT_TOLERANCE};
use gemma4_model::{place_soft_tokens, ImageEncoder, LoadPolicy, SoftTokenSource};
use serde_json::Value;

use common::{encode_image, encode_processed, max_abs_diff, tensor, vision_fixture};

const VARIANTS: [&str; 5] = ["e-style", "dense", "moe", "unified", "e-audio"];

fn ints(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_u64().expect("a whole number"))
        .collect()
}

#[test]
fn video_prompts_match_the_reference() {
    for variant in VARIANTS {
        video_matches(variant);
    }
}

fn video_matches(variant: &str) {
    let dir = vision_fixture(variant);
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("video_golden.json")).expect("video_golden.json"),
    )
    .expect("json");
    let goldens = std::fs::read(dir.join("video_golden_tensors.safetensors")).expect("tensors");
    let model = gemma4_model::load(&dir, LoadPolicy::default()).expect("text model");
    let hidden = model.config().hidden_size;
    let encoder = ImageEncoder::load_dir(&dir, hidden)
        .expect("encoder")
        .expect("an image encoder");

    // Decoding and sampling.
    let bytes = std::fs::read(dir.join(golden["video"].as_str().unwrap())).expect("gif");
    let video = decode_video(&bytes, &VideoLimits::default(), DEFAULT_VIDEO_FRAMES).expect("video");
    assert_eq!(
        video.total_frames as u64,
        golden["total_frames"].as_u64().unwrap()
    );
    assert_eq!(
        DEFAULT_VIDEO_FRAMES as u64,
        golden["num_frames"].as_u64().unwrap()
    );
    assert_eq!(
        VIDEO_SOFT_TOKENS as u64,
        golden["max_soft_tokens"].as_u64().unwrap()
    );
    let indices: Vec<u64> = video.indices.iter().map(|&i| i as u64).collect();
    assert_eq!(indices, ints(&golden["indices"]), "{variant}");
    let stamps: Vec<&str> = golden["timestamps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(video.timestamps(), stamps, "{variant}");

    // Each sampled frame's bytes, resized bytes and soft tokens.
    let proc = ImageProcessor::new(VIDEO_SOFT_TOKENS).unwrap();
    let want_size = ints(&golden["resized"]);
    let mut features = Vec::new();
    let mut per_frame: Vec<Vec<f32>> = Vec::new();
    for (f, frame) in video.frames.iter().enumerate() {
        assert_eq!(
            u64::from(crc32fast::hash(&frame.pixels)),
            ints(&golden["frame_crc32"])[f],
            "{variant} frame {f}: decoded bytes"
        );
        let (tw, th) = proc.target_size(frame.width, frame.height).unwrap();
        assert_eq!([u64::from(tw), u64::from(th)], want_size[..], "{variant}");
        let resized = resize_bicubic(frame, tw, th);
        assert_eq!(
            u64::from(crc32fast::hash(&resized.pixels)),
            ints(&golden["resized_crc32"])[f],
            "{variant} frame {f}: resized bytes"
        );
        let p = proc
            .process_with(frame, encoder.takes_merged_patches(), Rescale::Divide)
            .unwrap();
        assert_eq!(
            p.soft_tokens as u64,
            golden["soft_tokens_per_frame"].as_u64().unwrap()
        );
        let soft = encode_processed(&encoder, &p);
        features.extend_from_slice(&soft);
        per_frame.push(soft);
    }
    let (shape, want) = tensor(&goldens, "video_features.0");
    assert_eq!(shape[0] * shape[1], features.len(), "{variant}");
    let scale = want.iter().map(|x| x.abs()).fold(0.0, f32::max);
    let diff = max_abs_diff(&features, &want);
    eprintln!("{variant} video: soft tokens max |Δ| {diff:.2e} (largest value {scale:.2})");
    assert!(diff <= 1e-4 * scale.max(1.0), "{variant}: max |Δ| {diff}");

    // Chat turns (the ids as the reference processor lays them out).
    let image = encode_image(&encoder, 1);
    let frames: Vec<&[f32]> = per_frame.iter().map(Vec::as_slice).collect();
    let video_token = encoder.video_tokens().soft;
    let image_token = encoder.tokens().soft;
    for (k, chat) in golden["chats"].as_array().unwrap().iter().enumerate() {
        let ids: Vec<u32> = ints(&chat["ids"]).into_iter().map(|x| x as u32).collect();
        let media: Vec<&str> = chat["media"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap())
            .collect();
        let images: Vec<&[f32]> = if media.contains(&"image") {
            vec![image.as_slice()]
        } else {
            Vec::new()
        };
        let video_frames: &[&[f32]] = if media.contains(&"video") {
            &frames
        } else {
            &[]
        };
        let placed = place_soft_tokens(
            &ids,
            hidden,
            &[
                SoftTokenSource::images(image_token, &images),
                SoftTokenSource::video_frames(video_token, video_frames),
            ],
        )
        .unwrap_or_else(|e| panic!("{variant} chat {k}: {e}"));
        let greedy: Vec<u32> = ints(&chat["greedy"])
            .into_iter()
            .map(|x| x as u32)
            .collect();
        let soft = (!placed.rows.is_empty()).then(|| placed.as_soft_tokens());
        let (logits, ours) =
            greedy_with_soft_tokens(&model, &ids, soft, greedy.len()).expect("greedy");
        let (_, want) = tensor(&goldens, &format!("logits.video.{k}"));
        let diff = max_abs_diff(&logits, &want);
        eprintln!(
            "{variant} chat {k} ({} tokens, {media:?}): logits max |Δ| {diff:.2e}",
            ids.len()
        );
        assert!(diff <= DEFAULT_TOLERANCE, "{variant} chat {k}: {diff}");
        assert_eq!(ours, greedy, "{variant} chat {k}");
    }
    let plain = &golden["plain"];
    let ids: Vec<u32> = ints(&plain["ids"]).into_iter().map(|x| x as u32).collect();
    let greedy: Vec<u32> = ints(&plain["greedy"])
        .into_iter()
        .map(|x| x as u32)
        .collect();
    let (_, ours) = greedy_with_soft_tokens(&model, &ids, None, greedy.len()).expect("greedy");
    assert_eq!(ours, greedy, "{variant} plain prompt");
}

#[test]
fn the_frames_matter() {
    // The same chat with another frame order departs from the reference:
    // the frames' soft tokens reach the logits, each in its own place.
    let dir = vision_fixture("e-style");
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("video_golden.json")).unwrap())
            .unwrap();
    let goldens = std::fs::read(dir.join("video_golden_tensors.safetensors")).unwrap();
    let model = gemma4_model::load(&dir, LoadPolicy::default()).unwrap();
    let hidden = model.config().hidden_size;
    let encoder = ImageEncoder::load_dir(&dir, hidden).unwrap().unwrap();
    let (_, all) = tensor(&goldens, "video_features.0");
    let per = golden["soft_tokens_per_frame"].as_u64().unwrap() as usize * hidden;
    let mut frames: Vec<&[f32]> = all.chunks(per).collect();
    frames.reverse();
    let chat = &golden["chats"][0];
    let ids: Vec<u32> = ints(&chat["ids"]).into_iter().map(|x| x as u32).collect();
    let placed = place_soft_tokens(
        &ids,
        hidden,
        &[SoftTokenSource::video_frames(
            encoder.video_tokens().soft,
            &frames,
        )],
    )
    .unwrap();
    let (logits, _) =
        greedy_with_soft_tokens(&model, &ids, Some(placed.as_soft_tokens()), 1).unwrap();
    let (_, want) = tensor(&goldens, "logits.video.0");
    let diff = max_abs_diff(&logits, &want);
    assert!(diff > 1e-2, "reversed frames: logits max |Δ| only {diff}");
}
