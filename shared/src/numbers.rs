//! Numbers in text fields, as workers read CSV features.
//!
//! One parser for every field: `fast_float2` gives the correctly rounded
//! `f64` of the text (any number of digits, exponents, `inf`), which is then
//! rounded to `f32` — what Python's `float()` followed by a float32 tensor
//! gives. Rounding the text straight to `f32` differs from that in rare
//! double-rounding cases (see the tests).
//!
//! A field is *missing* when it is empty, any spelling of NaN, or one of the
//! other markers `pandas.read_csv` takes as missing by default
//! ([`MISSING_MARKERS`]); what a missing value becomes is the job's
//! [`crate::message::Missing`] policy (`[input] missing`).

/// The text `pandas.read_csv` reads as missing by default
/// (`pandas._libs.parsers.STR_NA_VALUES`), besides the empty field, matched
/// exactly after trimming ASCII blanks. Spellings of NaN are here for the
/// record; the parser already reads them (in any case) as NaN.
pub const MISSING_MARKERS: [&str; 18] = [
    "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>",
    "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null",
];

/// What one text field holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Field {
    /// A number, rounded to `f32` through the correctly rounded `f64`.
    Number(f32),
    /// Empty, NaN or a missing marker.
    Missing,
}

/// Reads one field (ASCII blanks around it allowed); `None` when it is
/// neither a number nor missing.
pub fn parse_field(raw: &[u8]) -> Option<Field> {
    let text = raw.trim_ascii();
    match fast_float2::parse::<f64, _>(text) {
        Ok(v) if v.is_nan() => Some(Field::Missing),
        Ok(v) => Some(Field::Number(v as f32)),
        // Off the common path: only text that is not a number is compared.
        Err(_) if text.is_empty() || is_missing_marker(text) => Some(Field::Missing),
        Err(_) => None,
    }
}

/// Whether `text` (already trimmed) is one of [`MISSING_MARKERS`].
pub fn is_missing_marker(text: &[u8]) -> bool {
    MISSING_MARKERS.iter().any(|m| m.as_bytes() == text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn number(text: &str) -> f32 {
        match parse_field(text.as_bytes()) {
            Some(Field::Number(v)) => v,
            other => panic!("{text:?} read as {other:?}"),
        }
    }

    #[test]
    fn rounds_through_f64_as_python_and_numpy_do() {
        // Just above the midpoint of 1 and the next f32: its nearest f64 is
        // the midpoint itself, which rounds to even (1.0). Rounding the text
        // straight to f32 gives the next f32 instead;
        // `np.float32(float("1.0000000596046448"))` is 1.0.
        assert_eq!(number("1.0000000596046448"), 1.0);
        assert_eq!("1.0000000596046448".parse::<f32>().unwrap(), 1.000_000_1);
        // What pandas' to_csv writes for float64 columns: up to 17 digits, exponents.
        for text in [
            "0.12345678901234566",
            "-1.2345678901234567e+20",
            "1e-05",
            "3.4028235677973366e+38",
            "-0.0",
            "7",
            "+2.5",
            ".5",
            "5.",
            " 1.25 ",
        ] {
            let via_f64 = text.trim().parse::<f64>().unwrap() as f32;
            assert_eq!(number(text).to_bits(), via_f64.to_bits(), "{text}");
        }
        assert_eq!(number("inf"), f32::INFINITY);
        assert_eq!(number("-Infinity"), f32::NEG_INFINITY);
        // Beyond f32's range: infinity, as float32(float(x)) gives.
        assert_eq!(number("1e39"), f32::INFINITY);
    }

    #[test]
    fn empty_nan_and_pandas_markers_are_missing_and_junk_is_not_a_number() {
        for text in [
            "", "  ", "NaN", "nan", "-nan", "NAN", "+nan", "NA", "N/A", "null", "None", "<NA>",
            "#N/A",
        ] {
            assert_eq!(
                parse_field(text.as_bytes()),
                Some(Field::Missing),
                "{text:?}"
            );
        }
        for text in [
            "abc", "1,5", "1.2.3", "0x10", "1_000", "--1", "e5", "nan0", "NONE",
        ] {
            assert_eq!(parse_field(text.as_bytes()), None, "{text:?}");
        }
    }
}
