//! Antialiased bicubic resize of 8-bit images, as the reference processor
//! runs it (`torchvision` `resize(antialias=True)` on a `uint8` tensor, which
//! PyTorch computes in integers, as Pillow does):
//!
//! - per axis and output index, cubic weights (a = −0.5) over the input span
//!   the filter covers (widened by the scale when shrinking), normalised to
//!   sum to 1, in f64;
//! - the weights of one axis scaled to int16 with the largest precision
//!   (≤ 22 bits) at which the biggest weight still fits, and rounded half away
//!   from zero;
//! - sums in i32 starting from half a unit, shifted back and clamped to a
//!   byte; the horizontal pass runs first (when the width changes), the
//!   vertical pass reads its bytes.

use crate::RgbImage;

/// One axis's taps: for each output index, the first input index, and its
/// int16 weights (`taps` per output, zero-padded).
struct AxisTaps {
    start: Vec<usize>,
    len: Vec<usize>,
    taps: usize,
    weights: Vec<i32>,
    precision: u32,
}

/// Cubic convolution with a = −0.5 (the antialiasing filter).
fn cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

impl AxisTaps {
    fn new(input: usize, output: usize) -> Self {
        let scale = input as f64 / output as f64;
        let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
        let taps = support.ceil() as usize * 2 + 1;
        let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
        let mut start = Vec::with_capacity(output);
        let mut len = Vec::with_capacity(output);
        let mut weights_f = vec![0.0f64; output * taps];
        let mut max_weight = 0.0f64;
        for i in 0..output {
            let center = scale * (i as f64 + 0.5);
            // Truncation toward zero, as the reference's integer casts.
            let lo = ((center - support + 0.5) as i64).max(0);
            let hi = ((center + support + 0.5) as i64).min(input as i64);
            let n = (hi - lo).clamp(0, taps as i64) as usize;
            let w = &mut weights_f[i * taps..i * taps + n];
            let mut total = 0.0;
            for (j, wj) in w.iter_mut().enumerate() {
                *wj = cubic((j as f64 + lo as f64 - center + 0.5) * invscale);
                total += *wj;
            }
            if total != 0.0 {
                for wj in w.iter_mut() {
                    *wj /= total;
                    max_weight = max_weight.max(*wj);
                }
            }
            start.push(lo as usize);
            len.push(n);
        }
        let mut precision = 0u32;
        while precision < 22 {
            let next = (0.5 + max_weight * f64::from(1u32 << (precision + 1))) as i32;
            if next >= 1 << 15 {
                break;
            }
            precision += 1;
        }
        let unit = f64::from(1u32 << precision);
        let weights = weights_f
            .iter()
            .map(|&w| {
                let v = w * unit;
                // Stored as int16 by the reference.
                (if v < 0.0 {
                    (v - 0.5) as i32
                } else {
                    (v + 0.5) as i32
                }) as i16 as i32
            })
            .collect();
        Self {
            start,
            len,
            taps,
            weights,
            precision,
        }
    }

    /// One output value from `len` inputs read through `at`.
    fn apply(&self, i: usize, at: impl Fn(usize) -> u8) -> u8 {
        let w = &self.weights[i * self.taps..i * self.taps + self.len[i]];
        // Weights are normalised (the largest is near 1), so the precision is
        // always well above zero.
        let mut sum: i32 = 1 << (self.precision - 1);
        for (j, &wj) in w.iter().enumerate() {
            sum += wj * i32::from(at(self.start[i] + j));
        }
        (sum >> self.precision).clamp(0, 255) as u8
    }
}

/// Resizes an RGB image to `width × height` (antialiased bicubic).
pub fn resize_bicubic(img: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (iw, ih) = (img.width as usize, img.height as usize);
    let (ow, oh) = (width as usize, height as usize);
    if (iw, ih) == (ow, oh) {
        return img.clone();
    }
    let horizontal: Vec<u8> = if ow != iw {
        let taps = AxisTaps::new(iw, ow);
        let mut out = vec![0u8; ih * ow * 3];
        for y in 0..ih {
            let row = &img.pixels[y * iw * 3..(y + 1) * iw * 3];
            for x in 0..ow {
                for c in 0..3 {
                    out[(y * ow + x) * 3 + c] = taps.apply(x, |k| row[k * 3 + c]);
                }
            }
        }
        out
    } else {
        img.pixels.clone()
    };
    let pixels = if oh != ih {
        let taps = AxisTaps::new(ih, oh);
        let mut out = vec![0u8; oh * ow * 3];
        for y in 0..oh {
            for x in 0..ow {
                for c in 0..3 {
                    out[(y * ow + x) * 3 + c] = taps.apply(y, |k| horizontal[(k * ow + x) * 3 + c]);
                }
            }
        }
        out
    } else {
        horizontal
    };
    RgbImage {
        width,
        height,
        pixels,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_of_each_output_sum_to_one_unit() {
        for (input, output) in [(100, 432), (800, 432), (7, 3), (300, 1056), (1, 384)] {
            let t = AxisTaps::new(input, output);
            let unit = 1i32 << t.precision;
            for i in 0..output {
                let sum: i32 = t.weights[i * t.taps..(i + 1) * t.taps].iter().sum();
                // Each weight is rounded on its own: a few units off at most.
                assert!(
                    (sum - unit).abs() <= t.taps as i32,
                    "{input}->{output} at {i}: {sum} vs {unit}"
                );
            }
        }
    }

    #[test]
    fn a_flat_image_stays_flat() {
        let img = RgbImage::new(9, 5, [10u8, 200, 77].repeat(45)).unwrap();
        for (w, h) in [(48, 48), (4, 2), (9, 11), (30, 5)] {
            let out = resize_bicubic(&img, w, h);
            assert!(out.pixels.chunks(3).all(|p| p == [10, 200, 77]), "{w}x{h}");
        }
    }
}
