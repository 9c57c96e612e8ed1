//! JSON helpers for figures that may be non-finite.
//!
//! JSON has no NaN or infinity: serde_json writes them as `null`. A field read with
//! [`f64_or_nan`] reads that `null` back as NaN, so a file holding one non-finite figure
//! still loads (a NaN loss is a fact worth keeping, not a reason to lose the run's log).

use serde::{Deserialize, Deserializer};

/// Deserializes a number, or `null` as NaN.
pub fn f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

#[cfg(test)]
mod tests {
    #[derive(serde::Serialize, serde::Deserialize)]
    struct M {
        #[serde(deserialize_with = "super::f64_or_nan")]
        x: f64,
    }

    #[test]
    fn a_non_finite_figure_survives_a_round_trip_as_nan() {
        let s = serde_json::to_string(&M { x: f64::NAN }).unwrap();
        assert_eq!(s, r#"{"x":null}"#);
        assert!(serde_json::from_str::<M>(&s).unwrap().x.is_nan());
        assert_eq!(serde_json::from_str::<M>(r#"{"x":1.5}"#).unwrap().x, 1.5);
        assert!(serde_json::from_str::<M>(r#"{"x":"a"}"#).is_err());
    }
}
