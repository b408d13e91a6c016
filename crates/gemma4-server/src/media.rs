//! Images and audio in chat requests: `data:` URIs and base64 WAV, FLAC or MP3 decoded
//! with limits, processed as the reference processor does, and encoded by
//! the checkpoint's encoders (the vision and audio towers, or the 12B's
//! encoder-free image and audio embedders) into the soft tokens that replace
//! each placeholder of the rendered prompt.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use base64::Engine as _;
use gemma4_engine::SoftPrompt;
use gemma4_media::audio::{decode_audio, frames, Audio};
use gemma4_media::{decode_image, mel, DecodeLimits, ImageProcessor, MediaError, RgbImage};
use gemma4_model::{AudioEncoder, AudioFeatures, ImageEncoder, MediaTokens, VisionInput};

use crate::error::ApiError;
use crate::openai::request::{MediaKind, MediaPart};

/// What the template writes where an image goes.
pub const IMAGE_PLACEHOLDER: &str = "<|image|>";
/// What the template writes where an audio clip goes.
pub const AUDIO_PLACEHOLDER: &str = "<|audio|>";
/// Longest audio clip (750 soft tokens of 40 ms, as the reference caps them).
pub const MAX_AUDIO_SECONDS: f64 = 30.0;

/// The server's media settings and the checkpoint's encoders.
pub struct Media {
    pub images: Option<ImageEncoder>,
    pub audio: Option<AudioEncoder>,
    /// Soft tokens per image unless a request asks otherwise (70 … 1120).
    pub default_soft_tokens: usize,
    /// Most images and most audio clips one request may hold.
    pub max_items: (usize, usize),
    pub limits: DecodeLimits,
    /// Fetches images by http(s) URL; `None` (the default) refuses them.
    pub remote: Option<crate::remote_media::RemoteMedia>,
    /// Keys the media digest (per process, so no client can aim at a collision).
    hash_keys: std::collections::hash_map::RandomState,
}

/// One item's soft tokens and where they go.
pub struct Encoded {
    pub kind: MediaKind,
    /// The ids around and in place of its soft tokens.
    pub tokens: MediaTokens,
    /// `[soft_tokens, hidden]`, row-major.
    pub embeds: Vec<f32>,
    pub soft_tokens: usize,
    digest: u64,
}

impl Media {
    pub fn new(
        images: Option<ImageEncoder>,
        audio: Option<AudioEncoder>,
        default_soft_tokens: usize,
        max_items: (usize, usize),
    ) -> Self {
        Self {
            images,
            audio,
            default_soft_tokens,
            max_items,
            limits: DecodeLimits::default(),
            remote: None,
            hash_keys: Default::default(),
        }
    }

    /// Lets image parts name http(s) URLs, fetched within these bounds.
    pub fn with_remote(mut self, remote: crate::remote_media::RemoteMedia) -> Self {
        self.remote = Some(remote);
        self
    }

    /// Refuses a request with more images or clips than the server takes
    /// (before anything is fetched or decoded).
    pub fn check_counts(&self, parts: &[MediaPart]) -> Result<(), ApiError> {
        for (kind, name, max) in [
            (MediaKind::Image, "images", self.max_items.0),
            (MediaKind::Audio, "audio clips", self.max_items.1),
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

    /// Decodes, processes and encodes a request's media, in order.
    pub fn encode_all(
        &self,
        parts: &[MediaPart],
        max_soft_tokens: Option<usize>,
    ) -> Result<Vec<Encoded>, ApiError> {
        self.check_counts(parts)?;
        let budget = max_soft_tokens.unwrap_or(self.default_soft_tokens);
        let processor = ImageProcessor::new(budget).map_err(|e| {
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
                let internal = |e: gemma4_model::ModelError| {
                    ApiError::internal(format!("the media encoder failed: {e}"))
                };
                let mut h = self.hash_keys.build_hasher();
                let (tokens, embeds, soft_tokens) = match part.kind {
                    MediaKind::Image => {
                        let encoder = self.images.as_ref().ok_or_else(|| {
                            bad(
                                "this model has no vision tower; it cannot read image_url parts"
                                    .into(),
                            )
                        })?;
                        let img = self.load_image(&part.data).map_err(bad)?;
                        let processed = if encoder.takes_merged_patches() {
                            processor.process_merged(&img)
                        } else {
                            processor.process(&img)
                        }
                        .map_err(|e| bad(e.to_string()))?;
                        (img.width, img.height, budget).hash(&mut h);
                        img.pixels.hash(&mut h);
                        let embeds = encoder
                            .encode(VisionInput {
                                patches: &processed.patches,
                                positions: &processed.positions,
                            })
                            .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
                            .map_err(internal)?;
                        (encoder.tokens(), embeds, processed.soft_tokens)
                    }
                    MediaKind::Audio => {
                        let encoder = self.audio.as_ref().ok_or_else(|| {
                            bad(
                                "this model has no audio encoder; it cannot read input_audio parts"
                                    .into(),
                            )
                        })?;
                        let bytes = base64::engine::general_purpose::STANDARD
                            .decode(part.data.trim())
                            .map_err(|e| bad(format!("the audio is not valid base64: {e}")))?;
                        let audio = decode_audio(&bytes, MAX_AUDIO_SECONDS)
                            .map_err(|e| bad(e.to_string()))?;
                        for x in &audio.samples {
                            x.to_bits().hash(&mut h);
                        }
                        let features =
                            audio_input(encoder, &audio).map_err(|e| bad(e.to_string()))?;
                        let soft = encoder.encode(&features).map_err(internal)?;
                        let soft_tokens = soft.dim(0).map_err(|e| internal(e.into()))?;
                        let embeds = soft
                            .flatten_all()
                            .and_then(|t| t.to_vec1::<f32>())
                            .map_err(|e| internal(e.into()))?;
                        (encoder.tokens(), embeds, soft_tokens)
                    }
                };
                Ok(Encoded {
                    kind: part.kind,
                    tokens,
                    embeds,
                    soft_tokens,
                    digest: h.finish(),
                })
            })
            .collect()
    }

    fn load_image(&self, url: &str) -> Result<RgbImage, String> {
        let Some(rest) = url.strip_prefix("data:") else {
            return if url.starts_with("http://") || url.starts_with("https://") {
                Err("fetching images over http(s) is off on this server (it starts with --allow-remote-media); send the image as a data: URI".into())
            } else {
                Err("the image must be a data: URI (data:image/png;base64,…)".into())
            };
        };
        let Some((header, payload)) = rest.split_once(',') else {
            return Err("a data: URI needs a comma before its data".into());
        };
        if !header.ends_with(";base64") {
            return Err("the data: URI must be base64 (data:image/…;base64,…)".into());
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(payload.trim())
            .map_err(|e| format!("the data: URI is not valid base64: {e}"))?;
        decode_image(&bytes, self.limits).map_err(|e| e.to_string())
    }

    /// Splices each item's soft tokens into the tokenized prompt: `pieces`
    /// are the text between placeholders (one more than `items`). An image
    /// becomes `<|image>`, N × `<|image|>`, `<image|>` (one attention block on
    /// models with bidirectional image attention); a clip `<|audio>`,
    /// N × `<|audio|>`, `<audio|>`.
    pub fn splice(
        &self,
        pieces: Vec<Vec<u32>>,
        items: Vec<Encoded>,
    ) -> (Vec<u32>, Arc<SoftPrompt>) {
        let mut ids = Vec::new();
        let mut rows = Vec::new();
        let mut embeds = Vec::new();
        let mut blocks = Vec::new();
        let mut key = self.hash_keys.build_hasher();
        let mut items = items.into_iter();
        for (i, piece) in pieces.into_iter().enumerate() {
            if i > 0 {
                if let Some(item) = items.next() {
                    let MediaTokens { soft, begin, end } = item.tokens;
                    ids.push(begin);
                    let span = (ids.len(), ids.len() + item.soft_tokens);
                    if item.kind == MediaKind::Image {
                        blocks.push(span);
                    }
                    rows.extend(span.0..span.1);
                    ids.extend(std::iter::repeat_n(soft, item.soft_tokens));
                    ids.push(end);
                    embeds.extend(item.embeds);
                    item.digest.hash(&mut key);
                }
            }
            ids.extend(piece);
        }
        let soft = SoftPrompt {
            rows,
            embeds,
            blocks,
            content_key: key.finish(),
        };
        (ids, Arc::new(soft))
    }
}

/// A clip's features as the checkpoint's audio encoder reads them: log-mel
/// frames for the conformer tower, raw sample frames for the 12B's embedder.
pub fn audio_input(encoder: &AudioEncoder, clip: &Audio) -> Result<Vec<f32>, MediaError> {
    Ok(match encoder.features() {
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
