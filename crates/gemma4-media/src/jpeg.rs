//! JPEG → RGB exactly as the reference gets it: transformers opens images
//! with PIL, and PIL decodes JPEG with libjpeg-turbo at its defaults (the
//! accurate integer IDCT, "fancy" triangular chroma upsampling). Other
//! decoders upsample 4:2:0 and 4:2:2 chroma differently and move pixels by
//! one or two levels, enough to change a greedy reply, so the same decoder
//! runs here: libjpeg-turbo's decompressor as `mozjpeg-sys` ships it, built
//! from C with the C compiler alone (its x86 SIMD, which gives the same
//! bytes, only where NASM is installed) and linked statically.
//!
//! Colour follows PIL's `convert("RGB")`: YCbCr and grayscale through
//! libjpeg-turbo's own conversion (gray is replicated), CMYK and YCCK as
//! PIL's `cmyk2rgb` computes it from the inverted ink values Adobe writes.
//!
//! libjpeg reports a fatal error by calling `error_exit`, which must not
//! return; here it unwinds (the C is built with unwind tables) to the
//! `catch_unwind` around the decode, which turns it into a [`MediaError`].

use std::os::raw::{c_int, c_ulong};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use mozjpeg_sys::{
    jpeg_common_struct, jpeg_create_decompress, jpeg_decompress_struct, jpeg_destroy_decompress,
    jpeg_error_mgr, jpeg_finish_decompress, jpeg_mem_src, jpeg_progress_mgr, jpeg_read_header,
    jpeg_read_scanlines, jpeg_start_decompress, jpeg_std_error, J_COLOR_SPACE,
};

use crate::decode::{check_size, DecodeLimits, RgbImage};
use crate::{MediaError, Result};

/// Most progressive scans decoded: a file of endless scans costs time for
/// nothing (libjpeg-turbo's own advice for untrusted files).
const MAX_SCANS: c_int = 500;

/// How chroma planes stored at reduced resolution are brought back to full
/// size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChromaUpsampling {
    /// libjpeg's triangular filter: the default, what PIL and so the
    /// reference use.
    Fancy,
    /// Each chroma sample repeated: what decoders asked to be fast do. Only
    /// useful to show that the difference is visible.
    Plain,
}

/// Decodes JPEG bytes as the reference does, checking the canvas from the
/// header first.
pub fn decode_jpeg(bytes: &[u8], limits: DecodeLimits) -> Result<RgbImage> {
    decode_jpeg_upsampled(bytes, limits, ChromaUpsampling::Fancy)
}

/// Decodes JPEG bytes with the given chroma upsampling.
pub fn decode_jpeg_upsampled(
    bytes: &[u8],
    limits: DecodeLimits,
    upsampling: ChromaUpsampling,
) -> Result<RgbImage> {
    let mut decompressor = Decompressor::new();
    let decoded = catch_unwind(AssertUnwindSafe(|| {
        decompressor.decode(bytes, limits, upsampling)
    }));
    // The decompressor is destroyed before a foreign panic goes on.
    drop(decompressor);
    let (width, height, pixels) = match decoded {
        Ok(result) => result?,
        Err(payload) => match payload.downcast::<LibjpegError>() {
            Ok(error) => return Err(MediaError::Decode(format!("JPEG: {}", error.0))),
            Err(other) => resume_unwind(other),
        },
    };
    RgbImage::new(width, height, pixels)
        .ok_or_else(|| MediaError::Decode("JPEG: the decoded size does not match".into()))
}

/// A fatal error libjpeg raised, carried by the unwind out of the C code.
struct LibjpegError(String);

/// One decompressor with its error and progress managers, boxed so the
/// pointers libjpeg keeps to them stay valid.
struct Decompressor {
    cinfo: jpeg_decompress_struct,
    err: jpeg_error_mgr,
    progress: jpeg_progress_mgr,
}

impl Decompressor {
    fn new() -> Box<Self> {
        // SAFETY: the three are C structs of integers, nullable pointers and
        // optional function pointers, for which all-zero is a valid value;
        // `jpeg_std_error` and `jpeg_create_decompress` then fill them in,
        // and neither can fail (the only error `jpeg_CreateDecompress` can
        // raise is a library/header version mismatch, which the crate rules
        // out, and it is caught like any other).
        let mut decompressor: Box<Self> = Box::new(unsafe { std::mem::zeroed() });
        unsafe {
            jpeg_std_error(&mut decompressor.err);
        }
        decompressor.err.error_exit = Some(raise_error);
        decompressor.err.emit_message = Some(ignore_message);
        decompressor.progress.progress_monitor = Some(limit_scans);
        decompressor.cinfo.common.err = &mut decompressor.err;
        unsafe {
            jpeg_create_decompress(&mut decompressor.cinfo);
        }
        decompressor.cinfo.common.progress = &mut decompressor.progress;
        decompressor
    }

    /// Header, size check, then the pixels; libjpeg's own errors unwind out
    /// of here as [`LibjpegError`].
    fn decode(
        &mut self,
        bytes: &[u8],
        limits: DecodeLimits,
        upsampling: ChromaUpsampling,
    ) -> Result<(u32, u32, Vec<u8>)> {
        let len = c_ulong::try_from(bytes.len())
            .map_err(|_| MediaError::Decode("JPEG: the file is too large".into()))?;
        let cinfo = &mut self.cinfo;
        // SAFETY: `bytes` outlives the decompression, which ends (finished
        // or failed) before this function returns, and the source manager
        // only reads from it.
        unsafe {
            jpeg_mem_src(cinfo, bytes.as_ptr(), len);
            jpeg_read_header(cinfo, 1);
        }
        check_size(cinfo.image_width, cinfo.image_height, limits)?;
        let cmyk = matches!(
            cinfo.jpeg_color_space,
            J_COLOR_SPACE::JCS_CMYK | J_COLOR_SPACE::JCS_YCCK
        );
        cinfo.out_color_space = if cmyk {
            J_COLOR_SPACE::JCS_CMYK
        } else {
            J_COLOR_SPACE::JCS_RGB
        };
        cinfo.do_fancy_upsampling = c_int::from(upsampling == ChromaUpsampling::Fancy);
        unsafe {
            jpeg_start_decompress(cinfo);
        }
        let (width, height) = (cinfo.output_width, cinfo.output_height);
        let channels = if cmyk { 4 } else { 3 };
        let pitch = width as usize * channels;
        let mut pixels = vec![0u8; pitch * height as usize];
        for row in pixels.chunks_exact_mut(pitch) {
            let mut row_pointer = row.as_mut_ptr();
            // SAFETY: one row of `pitch` bytes, the size libjpeg writes for
            // one output scanline of `channels` components; it raises an
            // error rather than return fewer rows from a memory source.
            let read = unsafe { jpeg_read_scanlines(cinfo, &mut row_pointer, 1) };
            if read != 1 {
                return Err(MediaError::Decode("JPEG: the data ends early".into()));
            }
        }
        unsafe {
            jpeg_finish_decompress(cinfo);
        }
        if cmyk {
            pixels = cmyk_to_rgb(&pixels);
        }
        Ok((width, height, pixels))
    }
}

impl Drop for Decompressor {
    fn drop(&mut self) {
        // SAFETY: created in `new`; destroying also releases a decompressor
        // left mid-way by an error.
        unsafe { jpeg_destroy_decompress(&mut self.cinfo) }
    }
}

/// libjpeg's `error_exit`: the message, carried out by an unwind (no panic
/// hook runs, so nothing is printed).
unsafe extern "C-unwind" fn raise_error(cinfo: &mut jpeg_common_struct) {
    resume_unwind(Box::new(LibjpegError(message(cinfo))))
}

/// The text of the error libjpeg is reporting.
fn message(cinfo: &mut jpeg_common_struct) -> String {
    // SAFETY: `err` is the manager `Decompressor::new` installed.
    let Some(format) = (unsafe { cinfo.err.as_ref() }).and_then(|err| err.format_message) else {
        return "libjpeg failed".into();
    };
    // The crate declares the buffer as shared although libjpeg writes into
    // it: call it through the C signature, with a pointer to 80 bytes
    // (JMSG_LENGTH_MAX), which it fills with a NUL-terminated string.
    type FormatMessage = unsafe extern "C-unwind" fn(*mut jpeg_common_struct, *mut u8);
    let mut buffer = [0u8; 80];
    unsafe {
        let format: FormatMessage = std::mem::transmute(format);
        format(cinfo, buffer.as_mut_ptr());
    }
    let text = buffer.split(|&b| b == 0).next().unwrap_or_default();
    String::from_utf8_lossy(text).into_owned()
}

/// Warnings (a corrupt stretch of data, extra bytes) are not fatal, as with
/// PIL; they are not printed either.
unsafe extern "C-unwind" fn ignore_message(_cinfo: &mut jpeg_common_struct, _level: c_int) {}

/// Stops a file whose progressive scans never end, as libjpeg-turbo's
/// TurboJPEG API does with its scan limit.
unsafe extern "C-unwind" fn limit_scans(cinfo: &mut jpeg_common_struct) {
    if cinfo.is_decompressor == 0 {
        return;
    }
    // SAFETY: a decompressor's common fields are the first member of its
    // `jpeg_decompress_struct`.
    let scans = unsafe {
        (*(cinfo as *mut jpeg_common_struct).cast::<jpeg_decompress_struct>()).input_scan_number
    };
    if scans > MAX_SCANS {
        resume_unwind(Box::new(LibjpegError(format!(
            "the progressive image has more than {MAX_SCANS} scans"
        ))))
    }
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
