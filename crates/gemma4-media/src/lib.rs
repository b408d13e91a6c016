//! Media in: images decoded with limits, then laid out as Gemma 4's vision
//! encoder expects them, value for value as the reference image processor
//! (transformers' `Gemma4ImageProcessor`) does.
//!
//! - [`decode`]: bytes → RGB pixels, refusing oversized images from their
//!   header, before the pixels are decoded.
//! - [`resize`]: the antialiased bicubic resize of 8-bit images that the
//!   reference runs (PyTorch's integer path: per-axis int16 weights, horizontal
//!   pass then vertical, each rounded to bytes).
//! - [`processor`]: the aspect-preserving target size, rescaling to `[0, 1]`,
//!   16-pixel patches with their `(x, y)` positions, and the soft-token count.
//! - [`audio`]: WAV, FLAC or MP3 → 16 kHz mono samples, and the 12B's
//!   640-sample frames.
//! - [`mel`]: the log-mel features the E2B/E4B audio tower reads, value for
//!   value as the reference feature extractor computes them.
//! - [`video`]: animated GIF, WebP or PNG → sampled RGB frames with their
//!   start times, as the reference video processor samples them.

pub mod audio;
pub mod decode;
pub mod jpeg;
pub mod mel;
pub mod processor;
pub mod resize;
pub mod video;

pub use decode::{decode_image, DecodeLimits, RgbImage};
pub use processor::{
    ImageProcessor, ProcessedImage, ProcessorSettings, Rescale, SUPPORTED_SOFT_TOKENS,
};
pub use video::{decode_video, Video, VideoLimits};

/// What can go wrong with a piece of media; every variant names the problem
/// in words a client can act on.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    #[error("the image could not be decoded: {0}")]
    Decode(String),
    #[error("the image format is not supported (supported: PNG, JPEG, GIF, WebP, BMP)")]
    UnsupportedFormat,
    #[error("the image is {width}×{height} pixels; at most {max_pixels} pixels and {max_side} per side are accepted")]
    TooLarge {
        width: u32,
        height: u32,
        max_pixels: u64,
        max_side: u32,
    },
    #[error("the media is empty")]
    Empty,
    #[error("max_soft_tokens must be one of 70, 140, 280, 560, 1120 (got {0})")]
    SoftTokenBudget(usize),
    #[error("an image processor needs patches and a pooling kernel of at least one pixel (patch_size {patch_size}, pooling_kernel_size {pooling})")]
    Geometry { patch_size: usize, pooling: usize },
    #[error("the audio format is not supported (send WAV, FLAC or MP3)")]
    UnsupportedAudio,
    #[error("the audio could not be decoded: {0}")]
    AudioDecode(String),
    #[error("the audio clip is {samples} samples long; at least {min} (about 10 ms at 16 kHz) are needed")]
    TooShort { samples: usize, min: usize },
    #[error("the audio is {seconds:.1} s long; at most {max_seconds} s are accepted")]
    TooLong { seconds: f64, max_seconds: f64 },
    #[error("the video format is not supported: {0} (send an animated GIF, WebP or PNG)")]
    UnsupportedVideo(&'static str),
    #[error("the video could not be decoded: {0}")]
    VideoDecode(String),
    #[error("the video has too many frames: at most {max_frames} frames and {max_pixels} decoded pixels in all are accepted")]
    TooManyFrames { max_frames: usize, max_pixels: u64 },
    #[error("an image of {width}×{height} cannot be resized into whole {side}-pixel blocks")]
    Degenerate { width: u32, height: u32, side: u32 },
}

pub type Result<T> = std::result::Result<T, MediaError>;
