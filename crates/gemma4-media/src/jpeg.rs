//! JPEG → RGB exactly as the reference gets it: transformers opens images
//! with PIL, and PIL decodes JPEG with libjpeg-turbo at its defaults (the
//! accurate integer IDCT, "fancy" triangular chroma upsampling). Other
//! decoders upsample 4:2:0 and 4:2:2 chroma differently and move pixels by
//! one or two levels, enough to change a greedy reply, so the same library
//! decodes here, built from its source and linked statically.
//!
//! Colour follows PIL's `convert("RGB")`: YCbCr and grayscale through
//! libjpeg-turbo's own conversion (gray is replicated), CMYK and YCCK as
//! PIL's `cmyk2rgb` computes it from the inverted ink values Adobe writes.

use turbojpeg::{Colorspace, Decompressor, Image, PixelFormat};

use crate::decode::{check_size, DecodeLimits, RgbImage};
use crate::{MediaError, Result};

/// Most progressive scans decoded: a file of endless scans costs time for
/// nothing (libjpeg-turbo's own advice for untrusted files).
const MAX_SCANS: u32 = 500;

fn failed(e: turbojpeg::Error) -> MediaError {
    MediaError::Decode(format!("JPEG: {e}"))
}

/// Decodes JPEG bytes, checking the canvas from the header first.
pub fn decode_jpeg(bytes: &[u8], limits: DecodeLimits) -> Result<RgbImage> {
    let mut decompressor = Decompressor::new().map_err(failed)?;
    let header = decompressor.read_header(bytes).map_err(failed)?;
    let width = u32::try_from(header.width).unwrap_or(u32::MAX);
    let height = u32::try_from(header.height).unwrap_or(u32::MAX);
    check_size(width, height, limits)?;
    decompressor.set_scan_limit(MAX_SCANS).map_err(failed)?;
    let cmyk = matches!(header.colorspace, Colorspace::CMYK | Colorspace::YCCK);
    let format = if cmyk {
        PixelFormat::CMYK
    } else {
        PixelFormat::RGB
    };
    let pitch = header.width * format.size();
    let mut pixels = vec![0u8; pitch * header.height];
    let image = Image {
        pixels: pixels.as_mut_slice(),
        width: header.width,
        pitch,
        height: header.height,
        format,
    };
    decompressor.decompress(bytes, image).map_err(failed)?;
    if cmyk {
        pixels = cmyk_to_rgb(&pixels);
    }
    RgbImage::new(width, height, pixels)
        .ok_or_else(|| MediaError::Decode("JPEG: the decoded size does not match".into()))
}

/// PIL's `CMYK;I` unpacking and `cmyk2rgb`: libjpeg hands back the inverted
/// ink values Adobe files hold, PIL inverts them to ink, then each channel
/// is `(255 − k) − c · (255 − k) / 255`, the division rounded as PIL's
/// `MULDIV255` rounds it.
fn cmyk_to_rgb(inverted: &[u8]) -> Vec<u8> {
    let muldiv255 = |a: u32, b: u32| {
        let t = a * b + 128;
        ((t >> 8) + t) >> 8
    };
    let mut rgb = Vec::with_capacity(inverted.len() / 4 * 3);
    for px in inverted.chunks_exact(4) {
        let [c, m, y, k] = [px[0], px[1], px[2], px[3]].map(|v| u32::from(255 - v));
        let nk = 255 - k;
        for ink in [c, m, y] {
            rgb.push(nk.saturating_sub(muldiv255(ink, nk)) as u8);
        }
    }
    rgb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmyk_follows_pils_rounding() {
        // Inverted (Adobe) values: 255 means no ink.
        assert_eq!(cmyk_to_rgb(&[255, 255, 255, 255]), [255, 255, 255]);
        assert_eq!(cmyk_to_rgb(&[0, 0, 0, 255]), [0, 0, 0]);
        assert_eq!(cmyk_to_rgb(&[255, 255, 255, 0]), [0, 0, 0]);
        // c = 100, k = 55: nk = 200, 200 − round(100 · 200 / 255) = 200 − 78.
        assert_eq!(cmyk_to_rgb(&[155, 255, 0, 200]), [122, 200, 0]);
    }

    #[test]
    fn a_cut_file_is_an_error() {
        let err = decode_jpeg(b"\xff\xd8\xff\xe0garbage", DecodeLimits::default());
        assert!(matches!(err, Err(MediaError::Decode(_))), "{err:?}");
    }
}
