//! RMSNorm over rows, `x · (mean(x²) + eps)^-½ · w`, in one pass per row.
//!
//! A decode step normalizes a few hidden vectors eight or more times per
//! layer; as separate tensor operations (square, mean, add, root,
//! reciprocal, two products) each norm made seven allocations and passes.
//! The steps and their rounding are the tensor library's, bit for bit on a
//! CPU with AVX2 (where its f32 sum takes the order of [`sum_squares`]):
//! `mean` as the sum times `1/d`, then `1 / √(ms + eps)`, then `(x · inv) ·
//! w`. So a norm gives the same values whichever of the two paths runs it.

use crate::dispatch::multiversion;

/// `Σ v²` in the order of the tensor library's vectorized f32 sum: four
/// registers of eight lanes over 32 values a step, the registers added
/// pairwise, the lanes' halves, then pairs of pairs, then the tail's
/// squares one by one.
#[inline(always)]
fn sum_squares(x: &[f32]) -> f32 {
    let mut regs = [[0f32; 8]; 4];
    let steps = x.chunks_exact(32);
    let tail = steps.remainder();
    for step in steps {
        for (reg, vals) in regs.iter_mut().zip(step.chunks_exact(8)) {
            for (acc, v) in reg.iter_mut().zip(vals) {
                *acc += v * v;
            }
        }
    }
    let lane = |l: usize| (regs[0][l] + regs[1][l]) + (regs[2][l] + regs[3][l]);
    let half: [f32; 4] = std::array::from_fn(|l| lane(l) + lane(l + 4));
    let mut sum = (half[0] + half[1]) + (half[2] + half[3]);
    for v in tail {
        sum += v * v;
    }
    sum
}

#[inline(always)]
fn rms_norm_body(xs: &mut [f32], d: usize, eps: f32, weight: &[f32]) {
    if d == 0 {
        return;
    }
    let scale = weight.len() == d;
    for row in xs.chunks_exact_mut(d) {
        let ms = sum_squares(row) * (1.0 / d as f64) as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        if scale {
            for (v, &w) in row.iter_mut().zip(weight) {
                *v = (*v * inv) * w;
            }
        } else {
            for v in row.iter_mut() {
                *v *= inv;
            }
        }
    }
}

multiversion!(
    /// Each row of `d` values of `xs` normalized in place, then scaled by
    /// `weight` (`d` values; an empty slice: no scale).
    pub fn rms_norm(xs: &mut [f32], d: usize, eps: f32, weight: &[f32]) => rms_norm_body
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::values;

    #[test]
    fn matches_the_reference_in_f64() {
        for d in [1, 15, 16, 640, 1536 + 7] {
            let x = values(3 * d, d as u64, 4.0);
            let w = values(d, 99, 1.0);
            for weight in [&w[..], &[][..]] {
                let mut out = x.clone();
                rms_norm(&mut out, d, 1e-6, weight);
                let mut portable = x.clone();
                rms_norm_body(&mut portable, d, 1e-6, weight);
                for t in 0..3 {
                    let row = &x[t * d..(t + 1) * d];
                    let ms = row
                        .iter()
                        .map(|&v| f64::from(v) * f64::from(v))
                        .sum::<f64>()
                        / d as f64;
                    let inv = 1.0 / (ms + 1e-6).sqrt();
                    for i in 0..d {
                        let s = weight.get(i).map_or(1.0, |&w| f64::from(w));
                        let want = f64::from(row[i]) * inv * s;
                        let got = out[t * d + i];
                        assert!(
                            (f64::from(got) - want).abs() <= 1e-6 * want.abs() + 1e-30,
                            "d={d} [{t},{i}]: {got} vs {want}"
                        );
                        assert!((got - portable[t * d + i]).abs() <= 1e-6 * got.abs());
                    }
                }
            }
        }
    }

    #[test]
    fn a_zero_row_stays_zero() {
        let mut out = vec![0f32; 8];
        rms_norm(&mut out, 8, 1e-6, &[]);
        assert!(out.iter().all(|&v| v == 0.0));
    }
}
