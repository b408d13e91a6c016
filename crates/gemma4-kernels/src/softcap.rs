//! `cap · tanh(x / cap)`, the soft-capping of the final logits, vectorized.
//!
//! A step's logits are a vocabulary's worth of values (262,144 for Gemma),
//! every one passed through tanh; libm's scalar `tanhf` made that a couple
//! of milliseconds per decoded token. Here tanh is an odd polynomial below
//! 0.625 and `(1 − e^(−2a)) / (1 + e^(−2a))` above it, with the exponential
//! of [`crate::gelu`]; the loop has no branch, so the compiler vectorizes it
//! for each instruction set. The division by `cap` and the product with it
//! are done as the reference does them, so only tanh's own rounding differs
//! (within 2 units in the last place; see the tests).

use crate::dispatch::multiversion;
use crate::gelu::exp_approx;

/// Below this magnitude tanh is the polynomial (where `1 − e^(−2a)` would
/// lose digits to cancellation).
const SMALL: f32 = 0.625;

/// `tanh(a) / a − 1 = s · Σ C[i] · sⁱ`, `s = a²`, fitted by least squares on
/// `[0, SMALL]` in f64 (worst error evaluated in f32: 0.73 units in the
/// last place).
const C: [f32; 6] = [
    -0.333_333_3,
    0.133_332_16,
    -0.053_947_89,
    0.021_706_25,
    -0.008_189_946,
    0.002_153_590_8,
];

/// `tanh(t)` in f32, within 2 units in the last place (1.5 at worst in the
/// test sweep; libm's `tanhf` is within 1).
#[inline(always)]
pub fn tanh_approx(t: f32) -> f32 {
    let a = t.abs();
    let s = a * a;
    let q = ((((C[5] * s + C[4]) * s + C[3]) * s + C[2]) * s + C[1]) * s + C[0];
    let small = a + a * s * q;
    let e = exp_approx(-2.0 * a);
    let large = (1.0 - e) / (1.0 + e);
    let r = if a < SMALL { small } else { large };
    r.copysign(t)
}

#[inline(always)]
fn softcap_body(cap: f32, xs: &mut [f32]) {
    for x in xs.iter_mut() {
        *x = cap * tanh_approx(*x / cap);
    }
}

multiversion!(
    /// `x ← cap · tanh(x / cap)` for every value of `xs`.
    pub fn softcap(cap: f32, xs: &mut [f32]) => softcap_body
);

#[cfg(test)]
mod tests {
    use super::*;

    /// `|got − want|` in units in the last place of `want` rounded to f32.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        let ulp = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
        (got as f64 - want).abs() / ulp
    }

    #[test]
    fn tanh_is_within_two_ulps() {
        let mut worst = (0f64, 0f32);
        // Dense near zero and around the switch, then out to saturation.
        let mut t = 1e-6f32;
        while t < 12.0 {
            for x in [t, -t] {
                let e = ulps(tanh_approx(x), (x as f64).tanh());
                if e > worst.0 {
                    worst = (e, x);
                }
            }
            t *= 1.000_07;
        }
        assert!(worst.0 <= 2.0, "worst error {} ulp at {}", worst.0, worst.1);
    }

    #[test]
    fn limits_and_specials() {
        assert_eq!(tanh_approx(0.0), 0.0);
        assert_eq!(tanh_approx(30.0), 1.0);
        assert_eq!(tanh_approx(-1e30), -1.0);
        assert_eq!(tanh_approx(f32::INFINITY), 1.0);
        assert_eq!(tanh_approx(f32::NEG_INFINITY), -1.0);
        assert!(tanh_approx(f32::NAN).is_nan());
        // Tiny values keep their sign and size.
        assert_eq!(tanh_approx(-1e-20), -1e-20);
    }

    #[test]
    fn softcap_matches_the_reference_form() {
        let cap = 30.0f32;
        let xs: Vec<f32> = (-40_000..40_000)
            .map(|i| i as f32 * 0.005 + 0.001)
            .collect();
        let mut fast = xs.clone();
        softcap(cap, &mut fast);
        let mut portable = xs.clone();
        softcap_body(cap, &mut portable);
        for ((&x, &f), &p) in xs.iter().zip(&fast).zip(&portable) {
            // The reference's steps in f32, tanh in f64.
            let want = (cap as f64) * ((x / cap) as f64).tanh();
            assert!(
                (f as f64 - want).abs() <= 4e-7 * want.abs() + 1e-30,
                "softcap({x}) = {f}, want {want}"
            );
            assert!((f - p).abs() <= 1e-6 * p.abs(), "{f} vs {p} at {x}");
        }
    }
}
