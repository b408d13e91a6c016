//! The E2B/E4B audio tower's input: log-mel features of 16 kHz audio, as the
//! reference feature extractor computes them (`Gemma4AudioFeatureExtractor`).
//!
//! 320-sample frames (20 ms) every 160 samples (10 ms), the first centred at
//! t = 0 by 160 leading zeros; a periodic Hann window; the magnitude of a
//! 512-point real FFT; 128 triangular HTK-mel filters from 0 to 8 kHz (no
//! normalisation); `ln(mel + 0.001)`. A frame counts only when every sample
//! of its window is real audio, so the clip's tail that does not fill a
//! whole window is dropped (the reference zeroes those frames and masks them
//! out; its padding to a multiple of 128 samples changes nothing else).
//!
//! The tower then halves the frame rate twice, so one soft token stands for
//! 40 ms: [`audio_soft_tokens`].

use std::f64::consts::PI;

use crate::audio::Audio;
use crate::{MediaError, Result};

/// Samples per analysis window (20 ms at 16 kHz).
pub const FRAME: usize = 320;
/// Samples between windows (10 ms).
pub const HOP: usize = 160;
/// Mel bins per frame.
pub const MEL_BINS: usize = 128;
const FFT: usize = 512;
const MEL_FLOOR: f64 = 1e-3;
/// The reference processor's cap on one clip's soft tokens (30 s).
pub const MAX_AUDIO_SOFT_TOKENS: usize = 750;

/// `[frames, MEL_BINS]` log-mel features, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct LogMel {
    pub frames: usize,
    pub values: Vec<f32>,
}

/// Whole analysis windows in a clip of `samples` samples (after the 160
/// leading zeros; each window reads `FRAME + 1` samples, as the reference's
/// unfold does, the last one unused without pre-emphasis).
pub fn mel_frames(samples: usize) -> usize {
    let padded = samples + FRAME / 2;
    if padded < FRAME + 1 {
        0
    } else {
        (padded - (FRAME + 1)) / HOP + 1
    }
}

/// Soft tokens the tower makes of a clip of `samples` samples: the mel frames
/// through two stride-2 convolutions (kernel 3, padding 1), capped at 750.
pub fn audio_soft_tokens(samples: usize) -> usize {
    let mut t = mel_frames(samples);
    for _ in 0..2 {
        t = t.div_ceil(2);
    }
    t.min(MAX_AUDIO_SOFT_TOKENS)
}

/// The log-mel features of a clip; a clip too short for one window is an
/// error (the reference would give it no soft tokens at all).
pub fn log_mel(audio: &Audio) -> Result<LogMel> {
    let frames = mel_frames(audio.samples.len());
    if frames == 0 {
        return Err(MediaError::TooShort {
            samples: audio.samples.len(),
            min: FRAME + 1 - FRAME / 2,
        });
    }
    let window: Vec<f32> = (0..FRAME)
        .map(|n| (0.5 - 0.5 * (2.0 * PI * n as f64 / FRAME as f64).cos()) as f32)
        .collect();
    let filters = mel_filters();
    let fft = Fft::new(FFT);
    let bins = FFT / 2 + 1;
    let mut values = Vec::with_capacity(frames * MEL_BINS);
    let mut re = vec![0f64; FFT];
    let mut im = vec![0f64; FFT];
    let mut magnitude = vec![0f64; bins];
    for f in 0..frames {
        // Sample `j` of the window sits at `f·HOP + j − FRAME/2` of the clip.
        for (j, (r, w)) in re.iter_mut().zip(&window).enumerate() {
            let at = (f * HOP + j).checked_sub(FRAME / 2);
            let x = at.map_or(0.0, |i| audio.samples[i]);
            *r = f64::from(x * w);
        }
        re[FRAME..].fill(0.0);
        im.fill(0.0);
        fft.run(&mut re, &mut im);
        for (k, m) in magnitude.iter_mut().enumerate() {
            // The reference takes the magnitude in single precision.
            *m = f64::from(re[k].hypot(im[k]) as f32);
        }
        for b in 0..MEL_BINS {
            let mel: f64 = (0..bins)
                .map(|k| magnitude[k] * filters[k * MEL_BINS + b])
                .sum();
            values.push((mel + MEL_FLOOR).ln() as f32);
        }
    }
    Ok(LogMel { frames, values })
}

/// `[FFT/2 + 1, MEL_BINS]` triangular filters on the HTK mel scale, 0–8 kHz.
fn mel_filters() -> Vec<f64> {
    let to_mel = |hz: f64| 2595.0 * (1.0 + hz / 700.0).log10();
    let to_hz = |mel: f64| 700.0 * (10f64.powf(mel / 2595.0) - 1.0);
    let (lo, hi) = (to_mel(0.0), to_mel(8000.0));
    let points = MEL_BINS + 2;
    let step = (hi - lo) / (points - 1) as f64;
    let edges: Vec<f64> = (0..points)
        .map(|i| {
            if i == points - 1 {
                to_hz(hi)
            } else {
                to_hz(lo + i as f64 * step)
            }
        })
        .collect();
    let bins = FFT / 2 + 1;
    let bin_step = 8000.0 / (bins - 1) as f64;
    let mut out = vec![0f64; bins * MEL_BINS];
    for k in 0..bins {
        let hz = if k == bins - 1 {
            8000.0
        } else {
            k as f64 * bin_step
        };
        for b in 0..MEL_BINS {
            let down = -(edges[b] - hz) / (edges[b + 1] - edges[b]);
            let up = (edges[b + 2] - hz) / (edges[b + 2] - edges[b + 1]);
            out[k * MEL_BINS + b] = down.min(up).max(0.0);
        }
    }
    out
}

/// An in-place radix-2 complex FFT of one power-of-two size.
struct Fft {
    n: usize,
    /// `e^{-2πik/n}` for `k < n/2`.
    twiddles: Vec<(f64, f64)>,
}

impl Fft {
    fn new(n: usize) -> Self {
        debug_assert!(n.is_power_of_two());
        let twiddles = (0..n / 2)
            .map(|k| {
                let a = -2.0 * PI * k as f64 / n as f64;
                (a.cos(), a.sin())
            })
            .collect();
        Self { n, twiddles }
    }

    fn run(&self, re: &mut [f64], im: &mut [f64]) {
        let n = self.n;
        let bits = n.trailing_zeros();
        for i in 0..n {
            let j = i.reverse_bits() >> (usize::BITS - bits);
            if j > i {
                re.swap(i, j);
                im.swap(i, j);
            }
        }
        let mut len = 2;
        while len <= n {
            let stride = n / len;
            for start in (0..n).step_by(len) {
                for k in 0..len / 2 {
                    let (wr, wi) = self.twiddles[k * stride];
                    let (a, b) = (start + k, start + k + len / 2);
                    let tr = re[b] * wr - im[b] * wi;
                    let ti = re[b] * wi + im[b] * wr;
                    re[b] = re[a] - tr;
                    im[b] = im[a] - ti;
                    re[a] += tr;
                    im[a] += ti;
                }
            }
            len *= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fft_matches_the_direct_transform() {
        let n = 16;
        let x: Vec<f64> = (0..n).map(|i| ((i * 7 + 3) % 11) as f64 - 5.0).collect();
        let (mut re, mut im) = (x.clone(), vec![0.0; n]);
        Fft::new(n).run(&mut re, &mut im);
        for k in 0..n {
            let (mut r, mut i) = (0.0, 0.0);
            for (t, v) in x.iter().enumerate() {
                let a = -2.0 * PI * (k * t) as f64 / n as f64;
                r += v * a.cos();
                i += v * a.sin();
            }
            assert!(
                (re[k] - r).abs() < 1e-9 && (im[k] - i).abs() < 1e-9,
                "bin {k}"
            );
        }
    }

    #[test]
    fn frame_and_token_counts_follow_the_reference_arithmetic() {
        // (N + 160 − 321) / 160 + 1 frames; two halvings, rounded up.
        assert_eq!(mel_frames(160), 0);
        assert_eq!(mel_frames(161), 1);
        assert_eq!(mel_frames(320), 1);
        assert_eq!(mel_frames(321), 2);
        assert_eq!(mel_frames(20_800), 129);
        assert_eq!(audio_soft_tokens(20_800), 33);
        assert_eq!(audio_soft_tokens(161), 1);
        assert_eq!(audio_soft_tokens(480_000), 750);
        assert_eq!(audio_soft_tokens(960_000), 750);
    }

    #[test]
    fn a_tone_lights_the_filter_over_its_frequency() {
        let samples: Vec<f32> = (0..16_000)
            .map(|i| (2.0 * PI * 1000.0 * i as f64 / 16_000.0).sin() as f32 * 0.5)
            .collect();
        let mel = log_mel(&Audio { samples }).unwrap();
        let row = &mel.values[50 * MEL_BINS..51 * MEL_BINS];
        let peak = (0..MEL_BINS)
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap();
        // 1 kHz is 1000 mel; the filters' centres are 2840/129 mel apart.
        let centre = |b: usize| 2595.0 * (1.0f64 + 8000.0 / 700.0).log10() * (b + 1) as f64 / 129.0;
        assert!((centre(peak) - 1000.0).abs() < 25.0, "peak at bin {peak}");
        let silent = log_mel(&Audio {
            samples: vec![0.0; 1000],
        })
        .unwrap();
        assert!(silent.values.iter().all(|&v| v == (MEL_FLOOR.ln() as f32)));
    }

    #[test]
    fn too_short_a_clip_is_an_error() {
        assert!(log_mel(&Audio {
            samples: vec![0.1; 160]
        })
        .is_err());
    }
}
