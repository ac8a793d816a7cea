//! How the API reads the JSON of a request body's fields: the rules `docs/openapi.json` states
//! for optional fields and whole numbers, shared by every body type (the routes' and the
//! egress settings').

use serde::Deserialize;

/// For an optional field (`#[serde(default, deserialize_with = "present")]`): left out it is
/// `None`, and `null` is refused like any other wrong type (`invalid type: null, expected ...`),
/// as `docs/openapi.json` says: a field is given with its type, or left out for its default.
pub fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// A whole number however JSON writes it: `452`, `452.0` or `4.52e2` are the same integer (as
/// JSON Schema's `integer` says; a client computing in floating point sends `452.0`). A fraction,
/// or a number out of the field's range, is refused naming the value.
pub fn integral<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<u64>,
{
    use serde::de::Error;
    let n = serde_json::Number::deserialize(d)?;
    let whole = n.as_u64().or_else(|| {
        n.as_f64()
            // `u64::MAX as f64` is 2^64, one past the range.
            .filter(|f| f.fract() == 0.0 && (0.0..u64::MAX as f64).contains(f))
            .map(|f| f as u64)
    });
    let range = || {
        Error::custom(format!(
            "invalid value: {n}, expected a whole number in range"
        ))
    };
    let Some(whole) = whole else {
        return Err(range());
    };
    T::try_from(whole).map_err(|_| range())
}

/// [`integral`] for an optional field: left out it is `None`; `null` is refused.
pub fn integral_present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<u64>,
{
    integral(d).map(Some)
}
