//! Images, video and audio in chat requests: `data:` URIs (images; animated
//! GIF, WebP or PNG video) and base64 WAV, FLAC or MP3 decoded with limits
//! and processed as the reference processor does, into the encoder inputs
//! (patches, log-mel features or audio frames) whose soft tokens replace
//! each placeholder of the rendered prompt. The engine's executor runs the
//! encoders; the server only knows what they take and give
//! ([`MediaFacts`]). A video's sampled frames are processed as images and
//! laid out as the reference processor lays them out: `MM:SS <|image>` +
//! N × `<|video|>` + `<image|>` per frame, frames joined by a space.

use std::hash::Hash;
use std::sync::Arc;

use base64::Engine as _;
use gemma4_engine::block_hash::{ContentDigest, MediaSpan};
use gemma4_engine::media::{AudioFeatures, ImageFacts, MediaFacts, MediaTokens};
use gemma4_engine::{EncoderInput, SoftItem, SoftPrompt};
use gemma4_media::audio::{decode_audio, frames, Audio};
use gemma4_media::video::{DEFAULT_VIDEO_FRAMES, VIDEO_SOFT_TOKENS};
use gemma4_media::{
    decode_image, decode_video, mel, DecodeLimits, ImageProcessor, MediaError, ProcessedImage,
    Rescale, RgbImage, Video, VideoLimits,
};

use crate::error::ApiError;
use crate::openai::request::{MediaKind, MediaPart};

/// What the template writes where an image goes.
pub const IMAGE_PLACEHOLDER: &str = "<|image|>";
/// What the template writes where an audio clip goes.
pub const AUDIO_PLACEHOLDER: &str = "<|audio|>";
/// What the template writes where a video goes.
pub const VIDEO_PLACEHOLDER: &str = "<|video|>";
/// Longest audio clip (750 soft tokens of 40 ms, as the reference caps them).
pub const MAX_AUDIO_SECONDS: f64 = 30.0;

/// The server's media settings and what the checkpoint's encoders take.
pub struct Media {
    pub facts: MediaFacts,
    /// Soft tokens per image unless a request asks otherwise (70 … 1120).
    pub default_soft_tokens: usize,
    /// Most items of each kind one request may hold.
    pub max_items: MaxItems,
    pub limits: DecodeLimits,
    pub video_limits: VideoLimits,
    /// Fetches images by http(s) URL; `None` (the default) refuses them.
    pub remote: Option<crate::remote_media::RemoteMedia>,
}

/// The most images, audio clips and videos one prompt may hold
/// (`--limit-mm-per-prompt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxItems {
    pub images: usize,
    pub audio: usize,
    pub videos: usize,
}

impl Default for MaxItems {
    fn default() -> Self {
        Self {
            images: 8,
            audio: 8,
            videos: 2,
        }
    }
}

/// One item, prepared for its encoder, and where its soft tokens go.
pub struct Prepared {
    pub kind: MediaKind,
    /// The ids around and in place of its soft tokens.
    pub tokens: MediaTokens,
    /// The encoder's input for each run of soft tokens: one per image or
    /// clip, one per video frame.
    pub runs: Vec<SoftItem>,
    pub soft_tokens: usize,
    /// A video's frames: each one's `MM:SS` and soft tokens (empty for
    /// images and audio, which are one run each).
    pub frames: Vec<(String, usize)>,
    /// A digest of what the item shows (its pixels or samples and how they
    /// were laid out), the same on every replica: its KV blocks are keyed on it.
    identifier: String,
}

impl Media {
    pub fn new(facts: MediaFacts, default_soft_tokens: usize, max_items: MaxItems) -> Self {
        Self {
            facts,
            default_soft_tokens,
            max_items,
            limits: DecodeLimits::default(),
            video_limits: VideoLimits::default(),
            remote: None,
        }
    }

    /// Lets image parts name http(s) URLs, fetched within these bounds.
    pub fn with_remote(mut self, remote: crate::remote_media::RemoteMedia) -> Self {
        self.remote = Some(remote);
        self
    }

    /// Refuses a request with more images, clips or videos than the server
    /// takes (before anything is fetched or decoded).
    pub fn check_counts(&self, parts: &[MediaPart]) -> Result<(), ApiError> {
        for (kind, name, max) in [
            (MediaKind::Image, "images", self.max_items.images),
            (MediaKind::Audio, "audio clips", self.max_items.audio),
            (MediaKind::Video, "videos", self.max_items.videos),
        ] {
            let n = parts.iter().filter(|p| p.kind == kind).count();
            if n > max {
                return Err(ApiError::bad_request(format!(
                    "the request holds {n} {name}; this server takes at most {max} per prompt (--limit-mm-per-prompt)"
                ))
                .with_param("messages"));
            }
        }
        Ok(())
    }

    /// Decodes and processes a request's media for the encoders, in order.
    pub fn prepare_all(
        &self,
        parts: &[MediaPart],
        max_soft_tokens: Option<usize>,
    ) -> Result<Vec<Prepared>, ApiError> {
        self.check_counts(parts)?;
        let budget = max_soft_tokens.unwrap_or(self.default_soft_tokens);
        let processor = ImageProcessor::new(budget)
            .and_then(|_| {
                self.facts
                    .image
                    .as_ref()
                    .map(|f| processor_for(f, budget))
                    .transpose()
            })
            .map_err(|e| {
                ApiError::bad_request(format!("`mm_processor_kwargs.max_soft_tokens`: {e}"))
                    .with_param("mm_processor_kwargs.max_soft_tokens")
            })?;
        parts
            .iter()
            .map(|part| {
                let bad = |e: String| {
                    ApiError::bad_request(format!("`{}`: {e}", part.param))
                        .with_param(part.param.clone())
                };
                match part.kind {
                    MediaKind::Image => self.prepare_image(part, processor.as_ref(), budget),
                    MediaKind::Audio => self.prepare_audio(part),
                    MediaKind::Video => self.prepare_video(part),
                }
                .map_err(bad)
            })
            .collect()
    }

    /// An image as the vision encoder reads it. The encoder has positions
    /// for so many patches only: a wider image is the client's, a 400.
    fn prepare_image(
        &self,
        part: &MediaPart,
        processor: Option<&ImageProcessor>,
        budget: usize,
    ) -> Result<Prepared, String> {
        let (Some(facts), Some(processor)) = (&self.facts.image, processor) else {
            return Err("this model has no vision tower; it cannot read image_url parts".into());
        };
        let img = self.load_image(&part.data)?;
        let processed = if facts.merged_patches {
            processor.process_merged(&img)
        } else {
            processor.process(&img)
        }
        .map_err(|e| e.to_string())?;
        facts
            .check_positions(&processed.positions)
            .map_err(|why| format!("this model cannot encode it: {why}"))?;
        let mut h = ContentDigest::default();
        (img.width, img.height, budget).hash(&mut h);
        img.pixels.hash(&mut h);
        let soft_tokens = processed.soft_tokens;
        Ok(Prepared {
            kind: MediaKind::Image,
            tokens: facts.tokens,
            runs: vec![image_run(processed)],
            soft_tokens,
            frames: Vec::new(),
            identifier: h.identifier(),
        })
    }

    /// A clip as the audio encoder reads it.
    fn prepare_audio(&self, part: &MediaPart) -> Result<Prepared, String> {
        let facts = self.facts.audio.as_ref().ok_or(
            "this model has no audio encoder; it cannot read input_audio parts".to_string(),
        )?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(part.data.trim())
            .map_err(|e| format!("the audio is not valid base64: {e}"))?;
        let audio = decode_audio(&bytes, MAX_AUDIO_SECONDS).map_err(|e| e.to_string())?;
        let mut h = ContentDigest::default();
        for x in &audio.samples {
            x.to_bits().hash(&mut h);
        }
        let features = audio_input(facts.features, &audio).map_err(|e| e.to_string())?;
        let soft_tokens = facts.features.soft_tokens(features.len());
        if soft_tokens == 0 {
            return Err("the audio clip is too short to hear".into());
        }
        Ok(Prepared {
            kind: MediaKind::Audio,
            tokens: facts.tokens,
            runs: vec![SoftItem {
                input: EncoderInput::Audio { features },
                soft_tokens,
            }],
            soft_tokens,
            frames: Vec::new(),
            identifier: h.identifier(),
        })
    }

    /// A video's sampled frames, each as an image the vision encoder reads.
    fn prepare_video(&self, part: &MediaPart) -> Result<Prepared, String> {
        let facts =
            self.facts.image.as_ref().ok_or(
                "this model has no vision tower; it cannot read video_url parts".to_string(),
            )?;
        let bytes = data_uri_bytes(&part.data, "video")?;
        let video = decode_video(&bytes, &self.video_limits, DEFAULT_VIDEO_FRAMES)
            .map_err(|e| e.to_string())?;
        let mut h = ContentDigest::default();
        for frame in &video.frames {
            (frame.width, frame.height).hash(&mut h);
            frame.pixels.hash(&mut h);
        }
        let mut frames = Vec::new();
        let mut runs = Vec::new();
        for (timestamp, processed) in video_frames(facts, &video).map_err(|e| e.to_string())? {
            facts
                .check_positions(&processed.positions)
                .map_err(|why| format!("this model cannot encode it: {why}"))?;
            (&timestamp, processed.soft_tokens).hash(&mut h);
            frames.push((timestamp, processed.soft_tokens));
            runs.push(image_run(processed));
        }
        let soft_tokens = frames.iter().map(|f| f.1).sum();
        Ok(Prepared {
            kind: MediaKind::Video,
            tokens: facts.video_tokens,
            runs,
            soft_tokens,
            frames,
            identifier: h.identifier(),
        })
    }

    fn load_image(&self, url: &str) -> Result<RgbImage, String> {
        let bytes = data_uri_bytes(url, "image")?;
        decode_image(&bytes, self.limits).map_err(|e| e.to_string())
    }

    /// Splices each item's soft tokens into the tokenized prompt: `pieces`
    /// are the text between runs (see [`lay_out_frames`]: one more than the
    /// items' runs). An image becomes `<|image>`, N × `<|image|>`, `<image|>`
    /// (one attention block on models with bidirectional image attention); a
    /// video frame the same around N × `<|video|>`; a clip `<|audio>`,
    /// N × `<|audio|>`, `<audio|>`.
    pub fn splice(
        &self,
        pieces: Vec<Vec<u32>>,
        items: Vec<Prepared>,
    ) -> (Vec<u32>, Arc<SoftPrompt>) {
        let mut ids = Vec::new();
        let mut rows = Vec::new();
        let mut runs = Vec::new();
        let mut blocks = Vec::new();
        let mut media = Vec::new();
        let mut pieces = pieces.into_iter();
        ids.extend(pieces.next().unwrap_or_default());
        for item in items {
            let MediaTokens { soft, begin, end } = item.tokens;
            // The item runs from its first begin marker to its last end marker.
            let start = ids.len();
            for (r, run) in item.runs.into_iter().enumerate() {
                if r > 0 {
                    ids.extend(pieces.next().unwrap_or_default());
                }
                ids.push(begin);
                let span = (ids.len(), ids.len() + run.soft_tokens);
                if item.kind != MediaKind::Audio {
                    blocks.push(span);
                }
                rows.extend(span.0..span.1);
                ids.extend(std::iter::repeat_n(soft, run.soft_tokens));
                ids.push(end);
                runs.push(run);
            }
            media.push(MediaSpan {
                identifier: item.identifier,
                start,
                end: ids.len(),
            });
            ids.extend(pieces.next().unwrap_or_default());
        }
        let soft = SoftPrompt {
            rows,
            items: runs,
            blocks,
            media: media.into(),
        };
        (ids, Arc::new(soft))
    }
}

/// The text between the items' runs, as the reference processor lays a
/// video out: the piece before a video gets its first frame's `MM:SS `, and
/// each further frame adds a piece ` MM:SS ` (each frame's soft tokens sit
/// between `<|image>` and `<image|>`, which split the text when it is
/// tokenized). `pieces` has one more entry than `items`.
pub fn lay_out_frames(pieces: &[&str], items: &[Prepared]) -> Vec<String> {
    let mut out = Vec::with_capacity(pieces.len());
    let mut pieces = pieces.iter();
    let mut current = pieces.next().map_or_else(String::new, |p| (*p).to_owned());
    for item in items {
        for (f, (stamp, _)) in item.frames.iter().enumerate() {
            if f > 0 {
                out.push(std::mem::replace(&mut current, " ".into()));
            }
            current.push_str(stamp);
            current.push(' ');
        }
        out.push(std::mem::replace(
            &mut current,
            pieces.next().map_or_else(String::new, |p| (*p).to_owned()),
        ));
    }
    out.push(current);
    out
}

/// The bytes of a `data:` URI (`what` names the media in errors).
fn data_uri_bytes(url: &str, what: &str) -> Result<Vec<u8>, String> {
    let Some(rest) = url.strip_prefix("data:") else {
        return if url.starts_with("http://") || url.starts_with("https://") {
            Err(format!("fetching media over http(s) is off on this server (it starts with --allow-remote-media); send the {what} as a data: URI"))
        } else {
            Err(format!(
                "the {what} must be a data: URI (data:{}/…;base64,…)",
                if what == "video" {
                    "image/gif"
                } else {
                    "image/png"
                }
            ))
        };
    };
    let Some((header, payload)) = rest.split_once(',') else {
        return Err("a data: URI needs a comma before its data".into());
    };
    if !header.ends_with(";base64") {
        return Err("the data: URI must be base64 (data:…;base64,…)".into());
    }
    base64::engine::general_purpose::STANDARD
        .decode(payload.trim())
        .map_err(|e| format!("the data: URI is not valid base64: {e}"))
}

/// A processed image (or video frame) as the vision encoder's input.
fn image_run(processed: ProcessedImage) -> SoftItem {
    SoftItem {
        input: EncoderInput::Image {
            patches: processed.patches,
            positions: processed.positions,
        },
        soft_tokens: processed.soft_tokens,
    }
}

/// The image processor for a checkpoint's vision encoder: its patch size
/// and pooling kernel, with a soft-token budget.
pub fn processor_for(
    facts: &ImageFacts,
    max_soft_tokens: usize,
) -> Result<ImageProcessor, MediaError> {
    ImageProcessor::with_geometry(facts.patch_size, facts.pooling, max_soft_tokens)
}

/// A video's sampled frames as the reference video processor lays them out
/// (resized within its soft-token budget per frame, bytes divided by 255),
/// each with its start as the prompt writes it (`MM:SS`), in order.
pub fn video_frames(
    facts: &ImageFacts,
    video: &Video,
) -> Result<Vec<(String, ProcessedImage)>, MediaError> {
    let processor = processor_for(facts, VIDEO_SOFT_TOKENS)?;
    video
        .frames
        .iter()
        .zip(video.timestamps())
        .map(|(frame, timestamp)| {
            let processed = processor.process_with(frame, facts.merged_patches, Rescale::Divide)?;
            Ok((timestamp, processed))
        })
        .collect()
}

/// A clip's features as the checkpoint's audio encoder reads them: log-mel
/// frames for the conformer tower, raw sample frames for the 12B's embedder.
pub fn audio_input(features: AudioFeatures, clip: &Audio) -> Result<Vec<f32>, MediaError> {
    Ok(match features {
        AudioFeatures::LogMel => mel::log_mel(clip)?.values,
        AudioFeatures::Frames(n) => frames(clip, n),
    })
}

/// Splits a rendered prompt at its media placeholders: the text pieces, and
/// the kinds of the placeholders between them, in order.
pub fn split_placeholders(text: &str) -> (Vec<&str>, Vec<MediaKind>) {
    let mut pieces = Vec::new();
    let mut kinds = Vec::new();
    let mut rest = text;
    loop {
        let next = [
            (
                rest.find(IMAGE_PLACEHOLDER),
                IMAGE_PLACEHOLDER,
                MediaKind::Image,
            ),
            (
                rest.find(AUDIO_PLACEHOLDER),
                AUDIO_PLACEHOLDER,
                MediaKind::Audio,
            ),
            (
                rest.find(VIDEO_PLACEHOLDER),
                VIDEO_PLACEHOLDER,
                MediaKind::Video,
            ),
        ]
        .into_iter()
        .filter_map(|(at, p, k)| at.map(|at| (at, p, k)))
        .min_by_key(|(at, _, _)| *at);
        match next {
            Some((at, placeholder, kind)) => {
                pieces.push(&rest[..at]);
                kinds.push(kind);
                rest = &rest[at + placeholder.len()..];
            }
            None => {
                pieces.push(rest);
                return (pieces, kinds);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(kind: MediaKind, soft: u32, frames: &[(&str, usize)]) -> Prepared {
        let runs: Vec<usize> = if frames.is_empty() {
            vec![2]
        } else {
            frames.iter().map(|f| f.1).collect()
        };
        let soft_tokens = runs.iter().sum();
        Prepared {
            kind,
            tokens: MediaTokens {
                soft,
                begin: 90,
                end: 91,
            },
            runs: runs
                .into_iter()
                .map(|n| SoftItem {
                    input: EncoderInput::Embeds(vec![0.5; n]),
                    soft_tokens: n,
                })
                .collect(),
            soft_tokens,
            frames: frames.iter().map(|(t, n)| ((*t).to_owned(), *n)).collect(),
            identifier: "7".into(),
        }
    }

    #[test]
    fn a_video_is_laid_out_frame_by_frame_with_its_timestamps() {
        let text = "user\n<|image|>Look:<|video|>ok";
        let (pieces, kinds) = split_placeholders(text);
        assert_eq!(kinds, vec![MediaKind::Image, MediaKind::Video]);
        let items = vec![
            item(MediaKind::Image, 80, &[]),
            item(
                MediaKind::Video,
                81,
                &[("00:00", 1), ("00:02", 1), ("01:05", 1)],
            ),
        ];
        let laid = lay_out_frames(&pieces, &items);
        assert_eq!(
            laid,
            vec!["user\n", "Look:00:00 ", " 00:02 ", " 01:05 ", "ok"]
        );
        // Each piece "tokenized" as its length, to see where it lands.
        let pieces: Vec<Vec<u32>> = laid.iter().map(|p| vec![p.len() as u32]).collect();
        let media = Media::new(MediaFacts::default(), 280, MaxItems::default());
        let (ids, soft) = media.splice(pieces, items);
        assert_eq!(
            ids,
            vec![5, 90, 80, 80, 91, 11, 90, 81, 91, 7, 90, 81, 91, 7, 90, 81, 91, 2]
        );
        assert_eq!(soft.rows, vec![2, 3, 7, 11, 15]);
        // The image and each frame are blocks of their own.
        assert_eq!(soft.blocks, vec![(2, 4), (7, 8), (11, 12), (15, 16)]);
        // One encoder input per run: the image, then each frame.
        let runs: Vec<usize> = soft.items.iter().map(|i| i.soft_tokens).collect();
        assert_eq!(runs, vec![2, 1, 1, 1]);
    }
}
