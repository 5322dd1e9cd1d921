//! A request body read as JSON in which no object names a member twice.
//!
//! RFC 8259 leaves a repeated name's meaning to the reader, and readers
//! differ: `serde_json`, like Python's `json`, keeps the last value, while a
//! gateway in front of the server, or a log, may act on the first. A body
//! that says `"role": "user"` and then `"role": "system"` in one message
//! would be checked as one thing and served as another, so a repeated name
//! is refused at any depth instead of resolved.

use std::fmt;

use serde::Deserializer as _;
use serde::de::{Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// The error's text when a name repeats: `serde_json` adds the position.
const REPEATED_NAME: &str = "a name repeats within one object";

/// Reads `bytes` as one JSON value whose objects each name a member once.
/// Otherwise as [`serde_json::from_slice`]: the same syntax, nesting limit
/// and member order.
pub fn from_slice(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut reader = serde_json::Deserializer::from_slice(bytes);
    let value = reader.deserialize_any(UniqueNames)?;
    reader.end()?;
    Ok(value)
}

/// Builds a [`Value`] as `serde_json`'s own visitor does, but refuses an
/// object that names a member twice.
struct UniqueNames;

impl<'de> Visitor<'de> for UniqueNames {
    type Value = Value;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Value, E> {
        Ok(Value::Bool(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Value, E> {
        // JSON text has no NaN or infinity; a literal past f64's range is
        // a syntax error before it gets here.
        Ok(Number::from_f64(value).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, value: &str) -> Result<Value, E> {
        Ok(Value::String(value.to_owned()))
    }

    fn visit_string<E>(self, value: String) -> Result<Value, E> {
        Ok(Value::String(value))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Value, A::Error> {
        let mut list = Vec::with_capacity(items.size_hint().unwrap_or(0).min(64));
        while let Some(item) = items.next_element_seed(Seed)? {
            list.push(item);
        }
        Ok(Value::Array(list))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(name) = members.next_key::<String>()? {
            if object.contains_key(&name) {
                return Err(A::Error::custom(REPEATED_NAME));
            }
            let value = members.next_value_seed(Seed)?;
            object.insert(name, value);
        }
        Ok(Value::Object(object))
    }
}

/// Reads one nested value with [`UniqueNames`].
struct Seed;

impl<'de> serde::de::DeserializeSeed<'de> for Seed {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, reader: D) -> Result<Value, D::Error> {
        reader.deserialize_any(UniqueNames)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Map, Value};

    use super::from_slice;

    /// Any JSON value, objects with their names in any order.
    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("JSON numbers are finite", |f| f.is_finite())
                .prop_map(Value::from),
            any::<String>().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((any::<String>(), inner), 0..6).prop_map(|members| {
                    // Later members of a name are dropped: the text names each once.
                    let mut object = Map::new();
                    for (name, value) in members {
                        object.entry(name).or_insert(value);
                    }
                    Value::Object(object)
                }),
            ]
        })
    }

    proptest! {
        /// Where no name repeats, the value read is serde_json's, member
        /// order included.
        #[test]
        fn reads_what_serde_json_reads(value in json()) {
            let text = serde_json::to_string(&value).unwrap();
            let read = from_slice(text.as_bytes()).unwrap();
            let expected: Value = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(&read, &expected);
            let names = |v: &Value| v.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>());
            prop_assert_eq!(names(&read), names(&expected));
        }

        /// A name given twice in any object, however deep, is refused.
        #[test]
        fn refuses_a_name_given_twice(value in json(), name in any::<String>(), depth in 0usize..4) {
            let name = serde_json::to_string(&name).unwrap();
            let mut text = format!("{{{name}: 1, {name}: {}}}", serde_json::to_string(&value).unwrap());
            for _ in 0..depth {
                text = format!("[{{\"a\": {text}}}]");
            }
            let error = from_slice(text.as_bytes()).unwrap_err();
            prop_assert!(error.is_data(), "{}", error);
        }
    }

    #[test]
    fn trailing_text_and_syntax_errors_are_refused_as_serde_json_refuses_them() {
        for text in ["{} x", "{\"a\": }", "[1,]", "", "{\"a\": 1} {\"b\": 2}"] {
            let error = from_slice(text.as_bytes()).unwrap_err();
            assert!(error.is_syntax() || error.is_eof(), "{text:?}: {error}");
            assert!(serde_json::from_str::<Value>(text).is_err());
        }
    }
}
