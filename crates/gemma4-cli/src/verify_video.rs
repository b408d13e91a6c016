//! `gemma4 verify` on a video golden file (`video_golden.json`, written by
//! `tools/make_video_fixture.py`): stage by stage — the sampled frames (their
//! indices, timestamps and decoded bytes), the processor's resized bytes, the
//! frames' soft tokens, then chat turns holding the video (logits at the last
//! prompt position and the greedy tokens) — and the first stage that departs
//! from the reference is named.

use std::path::Path;

use anyhow::{Context, Result};
use gemma4_media::resize::resize_bicubic;
use gemma4_media::video::{decode_video, DEFAULT_VIDEO_FRAMES, VIDEO_SOFT_TOKENS};
use gemma4_media::{decode_image, DecodeLimits, VideoLimits};
use gemma4_model::{place_soft_tokens, Gemma4, SoftTokenSource, VisionInput};
use gemma4_server::media::{processor_for, video_frames};
use serde::Deserialize;

use crate::verify_vision::{check_prompt, close_to_reference, read_golden, Tensors};

/// A video frame's soft tokens.
struct EncodedFrame {
    soft_tokens: usize,
    /// `[soft_tokens, hidden]`, row-major.
    embeds: Vec<f32>,
}

/// A golden file with a video.
#[derive(Debug, Deserialize)]
pub struct VideoGolden {
    /// The video's path, relative to the golden file.
    pub video: String,
    pub indices: Vec<usize>,
    pub timestamps: Vec<String>,
    pub frame_crc32: Vec<u32>,
    pub resized_crc32: Vec<u32>,
    /// The image beside the video in some turns, and its soft-token budget.
    pub image: String,
    pub image_max_soft_tokens: usize,
    pub chats: Vec<VideoChat>,
}

#[derive(Debug, Deserialize)]
pub struct VideoChat {
    /// `image` and `video`, in prompt order.
    pub media: Vec<String>,
    pub ids: Vec<u32>,
    pub greedy: Vec<u32>,
}

impl VideoGolden {
    /// The file as a video golden, or `None` when it is another format.
    pub fn read(path: &Path) -> Result<Option<Self>> {
        read_golden(path, &["video", "chats"], "a video golden file")
    }
}

/// Checks every stage; returns whether everything matched.
pub fn verify(
    model: &Gemma4,
    (checkpoint, mmproj): (&Path, Option<&Path>),
    golden_path: &Path,
    golden: &VideoGolden,
    tolerance: f32,
) -> Result<bool> {
    let hidden = model.config().hidden_size;
    let (images, _) = crate::model_io::load_media_encoders(checkpoint, mmproj, hidden)?;
    let encoder =
        images.context("the golden file holds a video, but the model has no vision tower")?;
    let tensors = Tensors::read(&golden_path.with_file_name("video_golden_tensors.safetensors"))?;
    let dir = golden_path.parent().unwrap_or(Path::new("."));
    let path = dir.join(&golden.video);
    let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let video = decode_video(&bytes, &VideoLimits::default(), DEFAULT_VIDEO_FRAMES)
        .with_context(|| format!("{}", path.display()))?;

    // Stage 1: the sampled frames and the processor's resized bytes.
    let sampled = video.indices == golden.indices && video.timestamps() == golden.timestamps;
    let facts = gemma4_engine::encoders::media_facts(Some(&encoder), None)
        .image
        .context("the model has no vision tower")?;
    let processor = processor_for(&facts, VIDEO_SOFT_TOKENS)?;
    let mut departing = Vec::new();
    for (f, frame) in video.frames.iter().enumerate() {
        let decoded = golden.frame_crc32.get(f) == Some(&crc32fast::hash(&frame.pixels));
        let (w, h) = processor.target_size(frame.width, frame.height)?;
        let resized = crc32fast::hash(&resize_bicubic(frame, w, h).pixels);
        if !decoded || golden.resized_crc32.get(f) != Some(&resized) {
            departing.push((f, decoded));
        }
    }
    let ok = sampled && departing.is_empty();
    println!(
        "{} video frames={} of {} timestamps={}..{}{}",
        if ok { "MATCH" } else { "DIFF " },
        video.frames.len(),
        video.total_frames,
        video.timestamps().first().map_or("", String::as_str),
        video.timestamps().last().map_or("", String::as_str),
        match (sampled, departing.first()) {
            (false, _) => " stage=frame sampling (indices or timestamps)".to_string(),
            (true, Some((f, false))) => format!(" stage=decoded frame {f}"),
            (true, Some((f, true))) => format!(" stage=processor output (frame {f})"),
            (true, None) => String::new(),
        }
    );
    if !ok {
        println!("SEQ_MATCH false (the video departs before the encoder; prompts not run)");
        return Ok(false);
    }

    // Stage 2: every frame's soft tokens.
    let frames = video_frames(&facts, &video)?
        .into_iter()
        .map(|(_, processed)| {
            let embeds = encoder
                .encode(VisionInput {
                    patches: &processed.patches,
                    positions: &processed.positions,
                })?
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(gemma4_model::ModelError::from)?;
            Ok(EncodedFrame {
                soft_tokens: processed.soft_tokens,
                embeds,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let all_frames: Vec<f32> = frames
        .iter()
        .flat_map(|f| f.embeds.iter().copied())
        .collect();
    let (diff, mut all) = close_to_reference(&all_frames, &tensors.f32s("video_features.0")?);
    println!(
        "{} video soft_tokens={}×{} max_abs_diff={diff:.3e}{}",
        if all { "MATCH" } else { "DIFF " },
        frames.len(),
        frames.first().map_or(0, |f| f.soft_tokens),
        if all { "" } else { " stage=encoder output" }
    );

    // Stage 3: the chat turns.
    let image_path = dir.join(&golden.image);
    let image = decode_image(
        &std::fs::read(&image_path)
            .with_context(|| format!("cannot read {}", image_path.display()))?,
        DecodeLimits::default(),
    )?;
    let image_processor = processor_for(&facts, golden.image_max_soft_tokens)?;
    let processed = if encoder.takes_merged_patches() {
        image_processor.process_merged(&image)?
    } else {
        image_processor.process(&image)?
    };
    let image_embeds: Vec<f32> = encoder
        .encode(VisionInput {
            patches: &processed.patches,
            positions: &processed.positions,
        })?
        .flatten_all()?
        .to_vec1()?;
    let frame_rows: Vec<&[f32]> = frames.iter().map(|f| f.embeds.as_slice()).collect();
    for (k, chat) in golden.chats.iter().enumerate() {
        let has = |kind: &str| chat.media.iter().any(|m| m == kind);
        let image_rows: Vec<&[f32]> = if has("image") {
            vec![image_embeds.as_slice()]
        } else {
            Vec::new()
        };
        let video_rows: &[&[f32]] = if has("video") { &frame_rows } else { &[] };
        let placed = place_soft_tokens(
            &chat.ids,
            hidden,
            &[
                SoftTokenSource::images(encoder.tokens().soft, &image_rows),
                SoftTokenSource::video_frames(encoder.video_tokens().soft, video_rows),
            ],
        )
        .with_context(|| format!("chat {k}"))?;
        let soft = (!placed.rows.is_empty()).then(|| placed.as_soft_tokens());
        all &= check_prompt(
            model,
            (&chat.ids, soft),
            (&chat.greedy, &tensors.f32s(&format!("logits.video.{k}"))?),
            tolerance,
            &format!("chat={k} media={:?}", chat.media),
        )?;
    }
    Ok(all)
}
