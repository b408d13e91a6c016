//! Percentiles, means and rounding for the report's figures.

/// The `p`-th percentile (0–100) of the finite values, interpolating linearly
/// between the two nearest ranks (the same rule as numpy's default), or `None`
/// when there are no finite values.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() || !p.is_finite() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let rank = p.clamp(0.0, 100.0) / 100.0 * (sorted.len() - 1) as f64;
    let lower = rank.floor() as usize;
    let upper = rank.ceil() as usize;
    let low = *sorted.get(lower)?;
    let high = *sorted.get(upper)?;
    Some(low + (high - low) * (rank - lower as f64))
}

/// The median (50th percentile) of the finite values.
pub fn median(values: &[f64]) -> Option<f64> {
    percentile(values, 50.0)
}

/// The arithmetic mean of the finite values.
pub fn mean(values: &[f64]) -> Option<f64> {
    let finite: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if finite.is_empty() {
        return None;
    }
    Some(finite.iter().sum::<f64>() / finite.len() as f64)
}

/// `value` rounded to `decimals` places; non-finite values become `None` so that
/// they are written as JSON null rather than an invalid number.
pub fn round(value: f64, decimals: i32) -> Option<f64> {
    if !value.is_finite() {
        return None;
    }
    let scale = 10f64.powi(decimals);
    Some((value * scale).round() / scale)
}

/// [`round`] over an optional value.
pub fn round_opt(value: Option<f64>, decimals: i32) -> Option<f64> {
    value.and_then(|v| round(v, decimals))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert_eq!(median(&v), Some(2.5));
        // rank 0.99 * 3 = 2.97 → 3 + 0.97 * (4 - 3)
        let p99 = percentile(&v, 99.0).unwrap_or(f64::NAN);
        assert!((p99 - 3.97).abs() < 1e-9, "p99 = {p99}");
    }

    #[test]
    fn percentiles_of_one_hundred_values() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(median(&v), Some(50.5));
        let p99 = percentile(&v, 99.0).unwrap_or(f64::NAN);
        assert!((p99 - 99.01).abs() < 1e-9, "p99 = {p99}");
    }

    #[test]
    fn empty_and_non_finite_inputs() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(median(&[f64::NAN, f64::INFINITY]), None);
        assert_eq!(median(&[f64::NAN, 7.0]), Some(7.0));
        assert_eq!(mean(&[]), None);
        assert_eq!(mean(&[1.0, 2.0, 6.0]), Some(3.0));
        assert_eq!(percentile(&[5.0], 99.0), Some(5.0));
    }

    #[test]
    fn out_of_range_percentiles_clamp() {
        let v = [1.0, 2.0, 3.0];
        assert_eq!(percentile(&v, -5.0), Some(1.0));
        assert_eq!(percentile(&v, 250.0), Some(3.0));
        assert_eq!(percentile(&v, f64::NAN), None);
    }

    #[test]
    fn rounding() {
        assert_eq!(round(1.23456, 2), Some(1.23));
        assert_eq!(round(f64::NAN, 2), None);
        assert_eq!(round_opt(Some(2.5), 0), Some(3.0));
        assert_eq!(round_opt(None, 1), None);
    }
}
