//! Image bytes → 8-bit RGB, with the size checked from the header first, so a
//! small file that claims a huge canvas (a decoding bomb) is refused before a
//! single row is decoded.

use std::io::Cursor;

use image::metadata::Orientation;
use image::{ImageDecoder, ImageFormat, ImageReader, Limits};

use crate::{MediaError, Result};

/// An 8-bit RGB image, rows top to bottom, pixels interleaved (`[h, w, 3]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<u8>,
}

impl RgbImage {
    /// Wraps interleaved RGB bytes; `None` if the length is not `w · h · 3`.
    pub fn new(width: u32, height: u32, pixels: Vec<u8>) -> Option<Self> {
        (pixels.len() as u64 == u64::from(width) * u64::from(height) * 3).then_some(Self {
            width,
            height,
            pixels,
        })
    }
}

/// How large an image may be.
#[derive(Debug, Clone, Copy)]
pub struct DecodeLimits {
    pub max_pixels: u64,
    pub max_side: u32,
}

impl Default for DecodeLimits {
    /// 50 megapixels, 16,384 per side: any photograph, no bomb.
    fn default() -> Self {
        Self {
            max_pixels: 50_000_000,
            max_side: 16_384,
        }
    }
}

/// Decodes PNG, JPEG, GIF (first frame), WebP or BMP bytes to RGB, turned
/// upright as the file's EXIF orientation says (the reference's loaders do
/// so on every path a request's image takes). Images with an alpha channel
/// are composited as the reference's `convert("RGB")` does: the alpha is
/// dropped.
pub fn decode_image(bytes: &[u8], limits: DecodeLimits) -> Result<RgbImage> {
    let upright = decode_as_stored(bytes, limits)?;
    Ok(match exif_orientation(bytes) {
        Orientation::NoTransforms => upright,
        orientation => {
            let (w, h) = (upright.width, upright.height);
            let Some(buffer) = image::RgbImage::from_raw(w, h, upright.pixels) else {
                return Err(MediaError::Decode("the decoded size does not match".into()));
            };
            let mut turned = image::DynamicImage::ImageRgb8(buffer);
            turned.apply_orientation(orientation);
            let rgb = turned.into_rgb8();
            let (width, height) = rgb.dimensions();
            RgbImage {
                width,
                height,
                pixels: rgb.into_raw(),
            }
        }
    })
}

/// The orientation the file's EXIF data names; none when it has no EXIF
/// data or names no valid orientation (the reference ignores those too).
fn exif_orientation(bytes: &[u8]) -> Orientation {
    ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .ok()
        .and_then(|r| r.into_decoder().ok())
        .and_then(|mut d| d.orientation().ok())
        .unwrap_or(Orientation::NoTransforms)
}

/// The pixels as stored, before any EXIF orientation.
fn decode_as_stored(bytes: &[u8], limits: DecodeLimits) -> Result<RgbImage> {
    let reader = || {
        ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| MediaError::Decode(e.to_string()))
    };
    match reader()?.format() {
        Some(ImageFormat::Jpeg) => return crate::jpeg::decode_jpeg(bytes, limits),
        Some(ImageFormat::Png | ImageFormat::Gif | ImageFormat::WebP | ImageFormat::Bmp) => {}
        _ => return Err(MediaError::UnsupportedFormat),
    }
    let (width, height) = reader()?
        .into_dimensions()
        .map_err(|e| MediaError::Decode(e.to_string()))?;
    check_size(width, height, limits)?;
    let mut reader = reader()?;
    let mut decoder_limits = Limits::default();
    decoder_limits.max_image_width = Some(limits.max_side);
    decoder_limits.max_image_height = Some(limits.max_side);
    // Room for the decoded canvas in its widest layout (16-bit RGBA) and the
    // RGB copy.
    decoder_limits.max_alloc = Some(limits.max_pixels.saturating_mul(11));
    reader.limits(decoder_limits);
    let decoded = reader
        .decode()
        .map_err(|e| MediaError::Decode(e.to_string()))?;
    let rgb = decoded.into_rgb8();
    let (width, height) = rgb.dimensions();
    Ok(RgbImage {
        width,
        height,
        pixels: rgb.into_raw(),
    })
}

/// Refuses an empty canvas or one over the limits (from its header).
pub(crate) fn check_size(width: u32, height: u32, limits: DecodeLimits) -> Result<()> {
    if width == 0 || height == 0 {
        return Err(MediaError::Empty);
    }
    if width > limits.max_side
        || height > limits.max_side
        || u64::from(width) * u64::from(height) > limits.max_pixels
    {
        return Err(MediaError::TooLarge {
            width,
            height,
            max_pixels: limits.max_pixels,
            max_side: limits.max_side,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(width: u32, height: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(width, height, |x, y| {
            image::Rgb([(x % 256) as u8, (y % 256) as u8, 7])
        });
        let mut out = Vec::new();
        img.write_to(&mut Cursor::new(&mut out), ImageFormat::Png)
            .unwrap();
        out
    }

    /// The PNG chunk checksum (CRC-32, polynomial 0xEDB88320).
    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    #[test]
    fn decodes_png_pixels_exactly() {
        let img = decode_image(&png(5, 3), DecodeLimits::default()).unwrap();
        assert_eq!((img.width, img.height), (5, 3));
        assert_eq!(&img.pixels[..6], &[0, 0, 7, 1, 0, 7]);
        assert_eq!(img.pixels[(2 * 5 + 4) * 3..][..3], [4, 2, 7]);
    }

    #[test]
    fn a_canvas_over_the_limit_is_refused_from_its_header() {
        // A PNG header claiming 20000×20000 with no pixel data behind it: the
        // size is read and refused; nothing is decoded.
        let mut bomb = png(1, 1);
        bomb[16..20].copy_from_slice(&20_000u32.to_be_bytes());
        bomb[20..24].copy_from_slice(&20_000u32.to_be_bytes());
        let crc = crc32(&bomb[12..29]);
        bomb[29..33].copy_from_slice(&crc.to_be_bytes());
        let err = decode_image(&bomb, DecodeLimits::default()).unwrap_err();
        assert!(
            matches!(err, MediaError::TooLarge { width: 20_000, .. }),
            "{err}"
        );
        let small = DecodeLimits {
            max_pixels: 10,
            max_side: 100,
        };
        assert!(matches!(
            decode_image(&png(4, 4), small),
            Err(MediaError::TooLarge { .. })
        ));
    }

    #[test]
    fn garbage_and_unknown_formats_are_errors() {
        assert!(matches!(
            decode_image(b"not an image at all", DecodeLimits::default()),
            Err(MediaError::UnsupportedFormat)
        ));
        let mut cut = png(8, 8);
        cut.truncate(cut.len() / 2);
        assert!(matches!(
            decode_image(&cut, DecodeLimits::default()),
            Err(MediaError::Decode(_))
        ));
    }
}
