//! `gelu_pytorch_tanh(gate) · up`, the gated MLP's activation, vectorized.
//!
//! The tanh form `0.5 · x · (1 + tanh(u))`, `u = √(2/π) · (x + 0.044715 · x³)`,
//! is computed as `x / (1 + e^(−2u))` (the same function: `1 + tanh(u) =
//! 2 / (1 + e^(−2u))`), which needs one exponential and one division and
//! loses no precision where `1 + tanh(u)` is small. The exponential is our
//! own (range reduction by ln 2, a degree-7 polynomial, the exponent put
//! back by integer addition), written so the compiler vectorizes the loop
//! for each instruction set; its error is within a float's rounding.

use crate::dispatch::multiversion;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEFF: f32 = 0.044_715;

/// `e^y` for `y` in about `[-87, 88]` (clamped there), relative error ≲ 2⁻²³.
#[inline(always)]
pub(crate) fn exp_approx(y: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two, so `n · LN2_HI` is exact for the `n` that occur.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5 · 2²³ rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let y = y.clamp(-87.0, 88.0);
    let n = (y * LOG2E + ROUND) - ROUND;
    let r = (y - n * LN2_HI) - n * LN2_LO;
    // e^r on |r| ≤ ln 2 / 2: Taylor terms to r⁷ (truncation < 6e-9 relative).
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // 2ⁿ · p by adding n to p's exponent (p is in [0.7, 1.5], n in [-126, 127]).
    f32::from_bits((p.to_bits() as i32 + ((n as i32) << 23)) as u32)
}

/// `gelu_pytorch_tanh(x)`.
#[inline(always)]
pub fn gelu_tanh_one(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + COEFF * x * x * x);
    x / (1.0 + exp_approx(-2.0 * u))
}

#[inline(always)]
fn gelu_tanh_mul_body(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu_tanh_one(g) * u;
    }
}

multiversion!(
    /// `out[i] = gelu_pytorch_tanh(gate[i]) · up[i]` over slices of equal length.
    pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) => gelu_tanh_mul_body
);

#[cfg(test)]
mod tests {
    use super::*;

    /// The tanh form in f64 from the f32 argument `u` (every f32 version
    /// rounds `u` first, and `1 + tanh(u)` then moves by up to about `2u`
    /// times that rounding: that part is the argument's, not the kernel's).
    fn reference(x: f32) -> f64 {
        let u = SQRT_2_OVER_PI * (x + COEFF * x * x * x);
        0.5 * x as f64 * (1.0 + (u as f64).tanh())
    }

    #[test]
    fn exp_is_within_rounding_of_the_true_value() {
        let mut worst = 0f64;
        let mut y = -87.0f32;
        while y < 88.0 {
            let got = exp_approx(y) as f64;
            let want = (y as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            y += 0.001_3;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
    }

    #[test]
    fn gelu_matches_the_tanh_form() {
        // Relative error against f64 (absolute below 1e-3, where f32's
        // `1 + tanh` itself has no digits left).
        let xs: Vec<f32> = (-200_000..200_000).map(|i| i as f32 * 1e-4).collect();
        let up = vec![1f32; xs.len()];
        let mut out = vec![0f32; xs.len()];
        gelu_tanh_mul(&xs, &up, &mut out);
        for (&x, &y) in xs.iter().zip(&out) {
            let want = reference(x);
            let err = (y as f64 - want).abs();
            assert!(
                err <= 4e-7 * want.abs().max(1e-3) + 1e-12,
                "gelu({x}) = {y}, want {want}"
            );
        }
        // Far out on both sides: the identity and zero.
        gelu_tanh_mul(&[30.0, -30.0, 0.0], &[2.0, 2.0, 2.0], &mut out[..3]);
        assert_eq!((out[0], out[2]), (60.0, 0.0));
        assert!(out[1] <= 0.0 && out[1] > -1e-30, "{}", out[1]);
    }

    #[test]
    fn every_level_gives_the_same_values() {
        let xs: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.013).collect();
        let up: Vec<f32> = (0..1000).map(|i| 1.0 + i as f32 * 1e-3).collect();
        let mut fast = vec![0f32; 1000];
        gelu_tanh_mul(&xs, &up, &mut fast);
        let mut portable = vec![0f32; 1000];
        gelu_tanh_mul_body(&xs, &up, &mut portable);
        for (a, b) in fast.iter().zip(&portable) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-6), "{a} vs {b}");
        }
    }
}
