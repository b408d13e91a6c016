//! Gemma 4's image processor: aspect-preserving resize into whole
//! `patch · pooling` blocks within a patch budget, rescale to `[0, 1]`,
//! 16×16 patches in row-major order with their `(x, y)` positions.

use std::path::{Path, PathBuf};

use crate::resize::resize_bicubic;
use crate::{MediaError, Result, RgbImage};

/// The soft-token budgets the reference processor accepts per image.
pub const SUPPORTED_SOFT_TOKENS: [usize; 5] = [70, 140, 280, 560, 1120];

/// Bytes to `[0, 1]`: the reference multiplies by the f32 nearest to 1/255
/// (which is not always the same float as dividing by 255).
const RESCALE: f32 = (1.0f64 / 255.0) as f32;

/// How bytes become `[0, 1]`: the reference image processor multiplies by
/// the f32 nearest to 1/255; its video processor fuses the rescale into a
/// normalisation and divides by 255 (the two differ in the last bit for some
/// bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rescale {
    TimesReciprocal,
    Divide,
}

impl Rescale {
    fn apply(self, b: u8) -> f32 {
        match self {
            Self::TimesReciprocal => f32::from(b) * RESCALE,
            Self::Divide => f32::from(b) / 255.0,
        }
    }
}

/// What a checkpoint's processor files set for images. The reference's
/// image processor reads them from the `image_processor` entry of
/// `processor_config.json` (else from `preprocessor_config.json`), never
/// from `config.json`, and takes its class defaults (16, 3, 280) for what
/// neither sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessorSettings {
    pub patch_size: usize,
    pub pooling: usize,
    pub max_soft_tokens: usize,
    /// The file they came from, `None` for the defaults.
    pub file: Option<PathBuf>,
}

impl ProcessorSettings {
    /// The settings in checkpoint directory `dir`; an unreadable file or a
    /// value the reference would not take is an error naming the field.
    pub fn read(dir: &Path) -> std::result::Result<Self, String> {
        let mut settings = Self {
            patch_size: 16,
            pooling: 3,
            max_soft_tokens: 280,
            file: None,
        };
        for (name, entry) in [
            ("processor_config.json", Some("image_processor")),
            ("preprocessor_config.json", None),
        ] {
            let path = dir.join(name);
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
            let fields = match entry {
                Some(key) => match json.get(key) {
                    Some(v) => v,
                    None => continue,
                },
                None => &json,
            };
            let prefix = entry.map(|e| format!("{e}.")).unwrap_or_default();
            let number = |key: &str, default: usize| match fields.get(key) {
                None => Ok(default),
                Some(v) => v
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| {
                        format!(
                            "{}: {prefix}{key} must be a whole number of at least 1",
                            path.display()
                        )
                    }),
            };
            settings.patch_size = number("patch_size", settings.patch_size)?;
            settings.pooling = number("pooling_kernel_size", settings.pooling)?;
            settings.max_soft_tokens = number("max_soft_tokens", settings.max_soft_tokens)?;
            if !SUPPORTED_SOFT_TOKENS.contains(&settings.max_soft_tokens) {
                return Err(format!(
                    "{}: {prefix}max_soft_tokens is {}; the reference takes one of {SUPPORTED_SOFT_TOKENS:?}",
                    path.display(),
                    settings.max_soft_tokens
                ));
            }
            settings.file = Some(path);
            break;
        }
        Ok(settings)
    }

    /// Refuses settings that would cut images into blocks the encoder
    /// cannot pool: the reference then fails on every image, so the
    /// checkpoint cannot be served. `encoder` is the vision config's
    /// `(patch_size, pooling_kernel_size)`.
    pub fn check_encoder(&self, encoder: (usize, usize)) -> std::result::Result<(), String> {
        let source = match &self.file {
            Some(path) => format!("{} sets", path.display()),
            None => {
                "with no processor_config.json, the reference's image processor takes its defaults,"
                    .to_owned()
            }
        };
        for (key, ours, theirs) in [
            ("patch_size", self.patch_size, encoder.0),
            ("pooling_kernel_size", self.pooling, encoder.1),
        ] {
            if ours != theirs {
                return Err(format!(
                    "{source} {key} {ours}, but vision_config.{key} is {theirs}: images would be cut into blocks the encoder cannot take; make the two agree"
                ));
            }
        }
        Ok(())
    }
}

/// The processor's settings (`patch_size`, `pooling_kernel_size`,
/// `max_soft_tokens` of `processor_config.json` / the vision config).
#[derive(Debug, Clone, Copy)]
pub struct ImageProcessor {
    pub patch_size: usize,
    pub pooling: usize,
    pub max_soft_tokens: usize,
}

/// An image as the vision encoder takes it.
#[derive(Debug, Clone)]
pub struct ProcessedImage {
    /// The resized size.
    pub width: u32,
    pub height: u32,
    /// `[patches, patch · patch · 3]`, values in `[0, 1]`; each row is one
    /// patch's pixels, row by row, channels interleaved.
    pub patches: Vec<f32>,
    /// `(x, y)` of each patch, in patch units.
    pub positions: Vec<(u32, u32)>,
    /// How many soft tokens the image becomes (`patches / pooling²`).
    pub soft_tokens: usize,
}

impl ImageProcessor {
    /// The published checkpoints' geometry (16-pixel patches pooled 3×3)
    /// with a soft-token budget.
    pub fn new(max_soft_tokens: usize) -> Result<Self> {
        Self::with_geometry(16, 3, max_soft_tokens)
    }

    /// The processor of an encoder with `patch_size`-pixel patches pooled
    /// `pooling × pooling` into one soft token: images are resized on
    /// `patch_size · pooling` blocks, as the reference does for any kernel.
    pub fn with_geometry(
        patch_size: usize,
        pooling: usize,
        max_soft_tokens: usize,
    ) -> Result<Self> {
        if !SUPPORTED_SOFT_TOKENS.contains(&max_soft_tokens) {
            return Err(MediaError::SoftTokenBudget(max_soft_tokens));
        }
        if patch_size == 0 || pooling == 0 {
            return Err(MediaError::Geometry {
                patch_size,
                pooling,
            });
        }
        Ok(Self {
            patch_size,
            pooling,
            max_soft_tokens,
        })
    }

    /// At most this many patches per image.
    pub fn max_patches(&self) -> usize {
        self.max_soft_tokens * self.pooling * self.pooling
    }

    /// The resized `(width, height)`: the largest size of the image's aspect
    /// that has sides in whole `patch · pooling` blocks and at most
    /// [`max_patches`](Self::max_patches) patches (very thin images get one
    /// block across and as many along as the aspect gives, capped).
    pub fn target_size(&self, width: u32, height: u32) -> Result<(u32, u32)> {
        if width == 0 || height == 0 {
            return Err(MediaError::Empty);
        }
        let (w, h) = (f64::from(width), f64::from(height));
        let side = (self.pooling * self.patch_size) as f64;
        let target_px = (self.max_patches() * self.patch_size * self.patch_size) as f64;
        let factor = (target_px / (w * h)).sqrt();
        let mut th = (factor * h / side).floor() * side;
        let mut tw = (factor * w / side).floor() * side;
        let max_side = (self.max_patches() / (self.pooling * self.pooling)) as f64 * side;
        if th == 0.0 && tw == 0.0 {
            return Err(MediaError::Degenerate {
                width,
                height,
                side: side as u32,
            });
        }
        if th == 0.0 {
            th = side;
            tw = ((w / h).floor() * side).min(max_side);
        } else if tw == 0.0 {
            tw = side;
            th = ((h / w).floor() * side).min(max_side);
        }
        if th * tw > target_px {
            return Err(MediaError::Degenerate {
                width,
                height,
                side: side as u32,
            });
        }
        Ok((tw as u32, th as u32))
    }

    /// Resizes, rescales and cuts the image into patches.
    pub fn process(&self, img: &RgbImage) -> Result<ProcessedImage> {
        self.process_with(img, false, Rescale::TimesReciprocal)
    }

    /// [`process`](Self::process) for the 12B's encoder-free embedder: each
    /// `pooling × pooling` block of patches merged into one patch of
    /// `patch · pooling` pixels (one soft token each), positions in block units.
    pub fn process_merged(&self, img: &RgbImage) -> Result<ProcessedImage> {
        self.process_with(img, true, Rescale::TimesReciprocal)
    }

    /// Resizes, rescales and cuts an image or a video frame into patches
    /// (`merged`: the 12B's 3×3-merged patches).
    pub fn process_with(
        &self,
        img: &RgbImage,
        merged: bool,
        rescale: Rescale,
    ) -> Result<ProcessedImage> {
        let (tw, th) = self.target_size(img.width, img.height)?;
        let resized = resize_bicubic(img, tw, th);
        Ok(if merged {
            let mut out = cut(&resized, self.patch_size * self.pooling, rescale);
            out.soft_tokens = out.positions.len();
            out
        } else {
            let mut out = cut(&resized, self.patch_size, rescale);
            out.soft_tokens = out.positions.len() / (self.pooling * self.pooling);
            out
        })
    }

    /// Cuts an image already of a valid size into patches (row-major patch
    /// order; within a patch, pixel rows then columns then channels).
    pub fn patchify(&self, img: &RgbImage) -> ProcessedImage {
        let mut out = cut(img, self.patch_size, Rescale::TimesReciprocal);
        out.soft_tokens = out.positions.len() / (self.pooling * self.pooling);
        out
    }
}

/// `p × p` patches of an image whose sides are multiples of `p`, rescaled.
fn cut(img: &RgbImage, p: usize, rescale: Rescale) -> ProcessedImage {
    let (w, h) = (img.width as usize, img.height as usize);
    let (pw, ph) = (w / p, h / p);
    let mut patches = Vec::with_capacity(pw * ph * p * p * 3);
    let mut positions = Vec::with_capacity(pw * ph);
    for py in 0..ph {
        for px in 0..pw {
            for dy in 0..p {
                let row = ((py * p + dy) * w + px * p) * 3;
                patches.extend(
                    img.pixels[row..row + p * 3]
                        .iter()
                        .map(|&b| rescale.apply(b)),
                );
            }
            positions.push((px as u32, py as u32));
        }
    }
    ProcessedImage {
        width: img.width,
        height: img.height,
        patches,
        positions,
        soft_tokens: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_outside_the_reference_set_are_refused() {
        assert!(ImageProcessor::new(280).is_ok());
        assert!(matches!(
            ImageProcessor::new(256),
            Err(MediaError::SoftTokenBudget(256))
        ));
    }

    #[test]
    fn patches_are_row_major_with_xy_positions() {
        let proc = ImageProcessor::new(70).unwrap();
        let pixels: Vec<u8> = (0..48 * 32 * 3).map(|i| (i % 251) as u8).collect();
        let img = RgbImage::new(48, 32, pixels.clone()).unwrap();
        let out = proc.patchify(&img);
        assert_eq!(
            out.positions,
            vec![(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
        );
        // Patch (1, 1): its first value is pixel (16, 16), red.
        let first = out.patches[4 * 768];
        assert_eq!(first, f32::from(pixels[(16 * 48 + 16) * 3]) * RESCALE);
        // Its second row starts at pixel (16, 17).
        assert_eq!(
            out.patches[4 * 768 + 48],
            f32::from(pixels[(17 * 48 + 16) * 3]) * RESCALE
        );
    }
}
