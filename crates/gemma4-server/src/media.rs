//! Images in chat requests: `data:` URIs decoded with limits, processed as
//! the reference processor does, and encoded by the model's vision tower (or
//! the 12B's encoder-free embedder) into the soft tokens that replace each
//! image's placeholders.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use base64::Engine as _;
use gemma4_engine::SoftPrompt;
use gemma4_media::{decode_image, DecodeLimits, ImageProcessor, RgbImage};
use gemma4_model::{ImageEncoder, VisionInput};

use crate::error::ApiError;
use crate::openai::request::ImagePart;

/// What the template writes where an image goes.
pub const IMAGE_PLACEHOLDER: &str = "<|image|>";

/// The server's vision settings and the encoder that turns images into soft tokens.
pub struct Vision {
    pub encoder: ImageEncoder,
    /// Soft tokens per image unless a request asks otherwise (70 … 1120).
    pub default_soft_tokens: usize,
    /// Most images one request may hold.
    pub max_images: usize,
    pub limits: DecodeLimits,
    /// Keys the media digest (per process, so no client can aim at a collision).
    hash_keys: std::collections::hash_map::RandomState,
}

/// One image's soft tokens.
pub struct EncodedImage {
    /// `[soft_tokens, hidden]`, row-major.
    pub embeds: Vec<f32>,
    pub soft_tokens: usize,
    digest: u64,
}

impl Vision {
    pub fn new(encoder: ImageEncoder, default_soft_tokens: usize, max_images: usize) -> Self {
        Self {
            encoder,
            default_soft_tokens,
            max_images,
            limits: DecodeLimits::default(),
            hash_keys: Default::default(),
        }
    }

    /// Decodes, processes and encodes a request's images, in order.
    pub fn encode_all(
        &self,
        images: &[ImagePart],
        max_soft_tokens: Option<usize>,
    ) -> Result<Vec<EncodedImage>, ApiError> {
        if images.len() > self.max_images {
            return Err(ApiError::bad_request(format!(
                "the request holds {} images; this server takes at most {} per prompt (--limit-mm-per-prompt)",
                images.len(),
                self.max_images
            ))
            .with_param("messages"));
        }
        let budget = max_soft_tokens.unwrap_or(self.default_soft_tokens);
        let processor = ImageProcessor::new(budget).map_err(|e| {
            ApiError::bad_request(format!("`mm_processor_kwargs.max_soft_tokens`: {e}"))
                .with_param("mm_processor_kwargs.max_soft_tokens")
        })?;
        images
            .iter()
            .map(|part| {
                let bad = |msg: String| ApiError::bad_request(msg).with_param(part.param.clone());
                let img = self
                    .load(&part.url)
                    .map_err(|e| bad(format!("`{}`: {e}", part.param)))?;
                let processed = if self.encoder.takes_merged_patches() {
                    processor.process_merged(&img)
                } else {
                    processor.process(&img)
                }
                .map_err(|e| bad(format!("`{}`: {e}", part.param)))?;
                let embeds = self
                    .encoder
                    .encode(VisionInput {
                        patches: &processed.patches,
                        positions: &processed.positions,
                    })
                    .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
                    .map_err(|e| ApiError::internal(format!("the vision encoder failed: {e}")))?;
                let mut h = self.hash_keys.build_hasher();
                (img.width, img.height, budget).hash(&mut h);
                img.pixels.hash(&mut h);
                Ok(EncodedImage {
                    embeds,
                    soft_tokens: processed.soft_tokens,
                    digest: h.finish(),
                })
            })
            .collect()
    }

    fn load(&self, url: &str) -> Result<RgbImage, String> {
        let Some(rest) = url.strip_prefix("data:") else {
            return if url.starts_with("http://") || url.starts_with("https://") {
                Err("fetching images over http(s) is off on this server; send the image as a data: URI".into())
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

    /// Splices each image's soft tokens into the tokenized pieces of the
    /// prompt around its placeholders: `<|image>`, N × `<|image|>`, `<image|>`.
    pub fn splice(
        &self,
        pieces: Vec<Vec<u32>>,
        images: Vec<EncodedImage>,
    ) -> (Vec<u32>, Arc<SoftPrompt>) {
        let tokens = self.encoder.tokens();
        let mut ids = Vec::new();
        let mut rows = Vec::new();
        let mut embeds = Vec::new();
        let mut key = self.hash_keys.build_hasher();
        let mut images = images.into_iter();
        for (i, piece) in pieces.into_iter().enumerate() {
            if i > 0 {
                if let Some(img) = images.next() {
                    ids.push(tokens.begin);
                    rows.extend(ids.len()..ids.len() + img.soft_tokens);
                    ids.extend(std::iter::repeat_n(tokens.image, img.soft_tokens));
                    ids.push(tokens.end);
                    embeds.extend(img.embeds);
                    img.digest.hash(&mut key);
                }
            }
            ids.extend(piece);
        }
        let soft = SoftPrompt {
            rows,
            embeds,
            content_key: key.finish(),
        };
        (ids, Arc::new(soft))
    }
}
