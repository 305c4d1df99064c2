//! Which Arrow column types a Parquet input's id and features may have:
//! checked by the coordinator when it validates a manifest, and again by the
//! worker that reads the file.

use arrow_schema::DataType;

/// Whether a feature column of this type can be read as `f32` (integers
/// and floats; integers go through `f64`, exactly as CSV text does).
pub fn is_feature_type(t: &DataType) -> bool {
    use DataType::*;
    matches!(
        t,
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 | Float32 | Float64
    )
}

/// Whether an id column of this type can be read (strings and integers).
pub fn is_id_type(t: &DataType) -> bool {
    use DataType::*;
    matches!(
        t,
        Utf8 | LargeUtf8
            | Utf8View
            | Int8
            | Int16
            | Int32
            | Int64
            | UInt8
            | UInt16
            | UInt32
            | UInt64
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_features_and_strings_or_integers_are_ids() {
        assert!(is_feature_type(&DataType::Float64) && is_feature_type(&DataType::Int32));
        assert!(!is_feature_type(&DataType::Utf8) && !is_feature_type(&DataType::Boolean));
        assert!(is_id_type(&DataType::Utf8) && is_id_type(&DataType::Int64));
        assert!(
            !is_id_type(&DataType::Float64),
            "float ids do not round-trip as text"
        );
    }
}
