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
