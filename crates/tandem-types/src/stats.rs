//! Small statistics helpers for reports.

/// The `q` quantile (0..=1) of `v` (sorted copy, nearest rank).
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let i = ((q * (s.len() - 1) as f64).round() as usize).min(s.len() - 1);
    s[i]
}

/// The mean of `v` (0 for none).
pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn quantiles() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(super::quantile(&v, 0.5), 3.0);
        assert_eq!(super::quantile(&v, 1.0), 5.0);
        assert_eq!(super::quantile(&[], 0.5), 0.0);
        assert_eq!(super::mean(&v), 3.0);
    }
}
