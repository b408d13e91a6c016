//! Video in: an animated GIF, WebP or PNG decoded to RGB frames with their
//! start times, sampled as the reference video processor samples them
//! (`num_frames` frames at indices `i · total / num_frames`), each frame then
//! processed like an image within the video soft-token budget (70 by
//! default), and laid out in the prompt as `MM:SS <|image>` + N × `<|video|>`
//! + `<image|>` per frame.
//!
//! Frames are decoded twice: once to count them (and check the limits), once
//! to keep the sampled ones, so memory holds only what the model reads.

use std::io::Cursor;

use image::codecs::gif::GifDecoder;
use image::codecs::png::PngDecoder;
use image::codecs::webp::WebPDecoder;
use image::{AnimationDecoder, Frame, ImageDecoder};

use crate::{DecodeLimits, MediaError, Result, RgbImage};

/// The reference video processor's frame count (`Gemma4VideoProcessor.num_frames`).
pub const DEFAULT_VIDEO_FRAMES: usize = 32;
/// The reference video processor's soft tokens per frame.
pub const VIDEO_SOFT_TOKENS: usize = 70;
/// A frame that says it lasts 0 ms is shown for 100 ms, as browsers play it.
const ZERO_DELAY_MS: f64 = 100.0;

/// How much video a request may hold.
#[derive(Debug, Clone, Copy)]
pub struct VideoLimits {
    /// The canvas (every frame's size) is held to the image limits.
    pub canvas: DecodeLimits,
    /// Most frames in the file.
    pub max_frames: usize,
    /// Most pixels decoded over all frames (canvas × frames).
    pub max_decoded_pixels: u64,
}

impl Default for VideoLimits {
    /// A canvas of at most 3840×2160 pixels (the sampled frames are held at
    /// full size until they are resized: 32 of them are 800 MB at most),
    /// 3,600 frames (six minutes at 10 fps) and 1 gigapixel decoded in all.
    fn default() -> Self {
        Self {
            canvas: DecodeLimits {
                max_pixels: 3_840 * 2_160,
                max_side: 8_192,
            },
            max_frames: 3_600,
            max_decoded_pixels: 1_000_000_000,
        }
    }
}

/// The sampled frames of a video.
#[derive(Debug, Clone)]
pub struct Video {
    /// The file's frame count.
    pub total_frames: usize,
    /// The sampled frames' indices into the file.
    pub indices: Vec<usize>,
    /// The sampled frames, composited onto the full canvas.
    pub frames: Vec<RgbImage>,
    /// Each sampled frame's start, in seconds.
    pub start_seconds: Vec<f64>,
}

impl Video {
    /// Each sampled frame's start as the prompt writes it: `MM:SS`, minutes
    /// and seconds rounded down.
    pub fn timestamps(&self) -> Vec<String> {
        self.start_seconds.iter().map(|&s| timestamp(s)).collect()
    }
}

/// `MM:SS` of a time in seconds (whole minutes, then whole seconds of the minute).
pub fn timestamp(seconds: f64) -> String {
    let s = seconds.max(0.0);
    format!(
        "{:02}:{:02}",
        (s / 60.0).floor() as u64,
        (s % 60.0).floor() as u64
    )
}

/// The reference's uniform sampling: `num_frames` indices `i · total /
/// num_frames` (integer division); a video with fewer frames than asked for
/// keeps all of them.
pub fn sample_indices(total: usize, num_frames: usize) -> Vec<usize> {
    let n = num_frames.min(total);
    (0..n).map(|i| i * total / n).collect()
}

/// Which animated formats are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Container {
    Gif,
    WebP,
    Png,
}

fn container(bytes: &[u8]) -> Result<Container> {
    if bytes.is_empty() {
        return Err(MediaError::Empty);
    }
    if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Ok(Container::Gif)
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Ok(Container::WebP)
    } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Ok(Container::Png)
    } else if bytes.len() >= 12 && &bytes[4..8] == b"ftyp" {
        Err(MediaError::UnsupportedVideo(
            "MP4/MOV (H.264 and other compressed codecs) is not decoded by this server",
        ))
    } else if bytes.starts_with(b"\x1a\x45\xdf\xa3") {
        Err(MediaError::UnsupportedVideo(
            "WebM/Matroska is not decoded by this server",
        ))
    } else {
        Err(MediaError::UnsupportedVideo("the format is not recognised"))
    }
}

fn bad(e: image::ImageError) -> MediaError {
    MediaError::VideoDecode(e.to_string())
}

/// The file's frames, one at a time, with the canvas size.
fn frames<'a>(
    bytes: &'a [u8],
    kind: Container,
    limits: &VideoLimits,
) -> Result<((u32, u32), image::Frames<'a>)> {
    let cursor = Cursor::new(bytes);
    let mut decoder_limits = image::Limits::default();
    decoder_limits.max_image_width = Some(limits.canvas.max_side);
    decoder_limits.max_image_height = Some(limits.canvas.max_side);
    decoder_limits.max_alloc = Some(limits.canvas.max_pixels.saturating_mul(11));
    macro_rules! open {
        ($decoder:expr) => {{
            let mut d = $decoder;
            let size = d.dimensions();
            crate::decode::check_size(size.0, size.1, limits.canvas)?;
            d.set_limits(decoder_limits).map_err(bad)?;
            Ok((size, d))
        }};
    }
    match kind {
        Container::Gif => {
            let (size, d) = open!(GifDecoder::new(cursor).map_err(bad)?)?;
            Ok((size, d.into_frames()))
        }
        Container::WebP => {
            let (size, d) = open!(WebPDecoder::new(cursor).map_err(bad)?)?;
            Ok((size, d.into_frames()))
        }
        Container::Png => {
            let (size, d) = open!(PngDecoder::new(cursor).map_err(bad)?)?;
            Ok((size, d.apng().map_err(bad)?.into_frames()))
        }
    }
}

/// Whether the file holds an animation (a still PNG or WebP is one frame).
fn is_animated(bytes: &[u8], kind: Container) -> Result<bool> {
    Ok(match kind {
        Container::Gif => true,
        Container::WebP => WebPDecoder::new(Cursor::new(bytes))
            .map_err(bad)?
            .has_animation(),
        Container::Png => PngDecoder::new(Cursor::new(bytes))
            .map_err(bad)?
            .is_apng()
            .map_err(bad)?,
    })
}

fn delay_ms(frame: &Frame) -> f64 {
    let (n, d) = frame.delay().numer_denom_ms();
    let ms = f64::from(n) / f64::from(d.max(1));
    if ms > 0.0 {
        ms
    } else {
        ZERO_DELAY_MS
    }
}

/// Decodes an animated GIF, WebP or PNG (a still one is a one-frame video)
/// and keeps `num_frames` frames sampled as the reference samples them.
pub fn decode_video(bytes: &[u8], limits: &VideoLimits, num_frames: usize) -> Result<Video> {
    let kind = container(bytes)?;
    if !is_animated(bytes, kind)? {
        return Ok(Video {
            total_frames: 1,
            indices: vec![0],
            frames: vec![crate::decode_image(bytes, limits.canvas)?],
            start_seconds: vec![0.0],
        });
    }
    // Pass 1: count the frames and their start times, within the limits.
    let ((width, height), all) = frames(bytes, kind, limits)?;
    let per_frame = u64::from(width) * u64::from(height);
    let mut starts = Vec::new();
    let mut clock = 0.0f64;
    for frame in all {
        let frame = frame.map_err(bad)?;
        if starts.len() == limits.max_frames
            || (starts.len() as u64 + 1).saturating_mul(per_frame) > limits.max_decoded_pixels
        {
            return Err(MediaError::TooManyFrames {
                max_frames: limits.max_frames,
                max_pixels: limits.max_decoded_pixels,
            });
        }
        starts.push(clock / 1000.0);
        clock += delay_ms(&frame);
    }
    if starts.is_empty() {
        return Err(MediaError::Empty);
    }
    let indices = sample_indices(starts.len(), num_frames.max(1));
    // Pass 2: keep the sampled frames.
    let (_, all) = frames(bytes, kind, limits)?;
    let mut kept = Vec::with_capacity(indices.len());
    let mut wanted = indices.iter().peekable();
    for (i, frame) in all.enumerate() {
        let Some(&&next) = wanted.peek() else { break };
        let frame = frame.map_err(bad)?;
        if i == next {
            wanted.next();
            let rgba = frame.into_buffer();
            let (w, h) = rgba.dimensions();
            // The alpha is dropped, as the reference's RGB conversion does.
            let pixels = rgba
                .into_raw()
                .chunks_exact(4)
                .flat_map(|p| [p[0], p[1], p[2]])
                .collect();
            kept.push(RgbImage::new(w, h, pixels).ok_or(MediaError::Empty)?);
        }
    }
    if kept.len() != indices.len() {
        return Err(MediaError::VideoDecode(
            "the second pass over the frames ended early".into(),
        ));
    }
    Ok(Video {
        total_frames: starts.len(),
        start_seconds: indices.iter().map(|&i| starts[i]).collect(),
        indices,
        frames: kept,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::codecs::gif::GifEncoder;
    use image::{Delay, RgbaImage};

    fn gif(frames: usize, w: u32, h: u32, delay_ms: u32) -> Vec<u8> {
        let mut out = Vec::new();
        {
            let mut enc = GifEncoder::new(&mut out);
            for f in 0..frames {
                let img = RgbaImage::from_fn(w, h, |x, y| {
                    image::Rgba([(x * 40) as u8, (y * 40) as u8, (f * 20) as u8, 255])
                });
                enc.encode_frame(Frame::from_parts(
                    img,
                    0,
                    0,
                    Delay::from_numer_denom_ms(delay_ms, 1),
                ))
                .unwrap();
            }
        }
        out
    }

    #[test]
    fn sampling_follows_the_reference() {
        // np.arange(32) * 40 // 32
        let idx = sample_indices(40, 32);
        assert_eq!(idx.len(), 32);
        assert_eq!(&idx[..6], &[0, 1, 2, 3, 5, 6]);
        assert_eq!(idx[31], 38);
        assert_eq!(sample_indices(5, 32), vec![0, 1, 2, 3, 4]);
        assert_eq!(timestamp(0.0), "00:00");
        assert_eq!(timestamp(59.99), "00:59");
        assert_eq!(timestamp(61.5), "01:01");
    }

    #[test]
    fn gif_frames_are_sampled_with_their_start_times() {
        let bytes = gif(10, 4, 3, 250);
        let v = decode_video(&bytes, &VideoLimits::default(), 4).unwrap();
        assert_eq!(v.total_frames, 10);
        assert_eq!(v.indices, vec![0, 2, 5, 7]);
        assert_eq!(v.start_seconds, vec![0.0, 0.5, 1.25, 1.75]);
        assert_eq!(v.timestamps(), vec!["00:00", "00:00", "00:01", "00:01"]);
        // Frame 5's blue channel is 5 · 20 (GIF keeps these exact colours).
        assert_eq!(v.frames[2].pixels[2], 100);
        assert_eq!((v.frames[0].width, v.frames[0].height), (4, 3));
    }

    #[test]
    fn a_still_png_is_a_one_frame_video() {
        let img = image::RgbImage::from_fn(6, 4, |x, y| image::Rgb([x as u8, y as u8, 9]));
        let mut png = Vec::new();
        img.write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
            .unwrap();
        let v = decode_video(&png, &VideoLimits::default(), 32).unwrap();
        assert_eq!((v.total_frames, v.indices.clone()), (1, vec![0]));
        assert_eq!(v.frames[0].pixels, img.into_raw());
        assert_eq!(v.timestamps(), vec!["00:00"]);
    }

    #[test]
    fn too_many_frames_and_unknown_formats_are_refused() {
        let bytes = gif(10, 4, 3, 100);
        let limits = VideoLimits {
            max_frames: 5,
            ..VideoLimits::default()
        };
        assert!(matches!(
            decode_video(&bytes, &limits, 32),
            Err(MediaError::TooManyFrames { .. })
        ));
        let mp4 = b"\0\0\0\x18ftypmp42\0\0\0\0mp42isom";
        let err = decode_video(mp4, &VideoLimits::default(), 32).unwrap_err();
        assert!(err.to_string().contains("MP4"), "{err}");
        assert!(matches!(
            decode_video(b"hello", &VideoLimits::default(), 32),
            Err(MediaError::UnsupportedVideo(_))
        ));
        // A canvas over the video limits is refused from the header: a
        // small GIF whose logical screen claims 4000×2200.
        let mut big = gif(1, 4, 3, 100);
        big[6..8].copy_from_slice(&4000u16.to_le_bytes());
        big[8..10].copy_from_slice(&2200u16.to_le_bytes());
        assert!(matches!(
            decode_video(&big, &VideoLimits::default(), 32),
            Err(MediaError::TooLarge { width: 4000, .. })
        ));
        let mut cut = gif(3, 4, 3, 100);
        cut.truncate(cut.len() - 20);
        assert!(decode_video(&cut, &VideoLimits::default(), 32).is_err());
    }
}
