//! The one-JSON-line report every subcommand ends with, and the small
//! statistics the benches share.

use std::fmt::Write as _;

/// A flat JSON object built field by field, printed as one line.
#[derive(Debug, Default)]
pub(crate) struct Report {
    body: String,
}

impl Report {
    pub(crate) fn new(bench: &str) -> Self {
        let mut report = Self::default();
        report.text("bench", bench);
        report
    }

    fn key(&mut self, key: &str) {
        if !self.body.is_empty() {
            self.body.push(',');
        }
        write_json_string(&mut self.body, key);
        self.body.push(':');
    }

    pub(crate) fn text(&mut self, key: &str, value: &str) {
        self.key(key);
        write_json_string(&mut self.body, value);
    }

    pub(crate) fn int(&mut self, key: &str, value: u64) {
        self.key(key);
        let _ = write!(self.body, "{value}");
    }

    /// Floats are printed with enough precision for ratios and never as
    /// NaN or infinity (which JSON lacks): those become null.
    pub(crate) fn float(&mut self, key: &str, value: f64) {
        self.key(key);
        if value.is_finite() {
            let _ = write!(self.body, "{value:.4}");
        } else {
            self.body.push_str("null");
        }
    }

    pub(crate) fn line(&self) -> String {
        format!("{{{}}}", self.body)
    }
}

fn write_json_string(out: &mut String, value: &str) {
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The `per_mille`/1000 quantile (nearest rank).
pub(crate) fn percentile(values: &mut [f64], per_mille: usize) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    values[(values.len() - 1) * per_mille.min(1000) / 1000]
}

/// The median of `values` (the mean of the middle two for an even count).
pub(crate) fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_is_one_json_object() {
        let mut r = Report::new("keys");
        r.int("tokens", 32768);
        r.float("ratio", 1.25);
        r.float("bad", f64::NAN);
        r.text("note", "a \"quoted\"\nline");
        assert_eq!(
            r.line(),
            r#"{"bench":"keys","tokens":32768,"ratio":1.2500,"bad":null,"note":"a \"quoted\"\u000aline"}"#
        );
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }
}
