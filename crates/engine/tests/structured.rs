//! Structured outputs are always valid: for random JSON schemas, greedy and
//! sampled completions through the engine parse as JSON and validate
//! against their schema, and end because the grammar is complete, not
//! because `max_tokens` ran out.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, OnceLock};

use kvfence_engine::{Engine, EngineConfig, Event, FinishReason, GenerationRequest, Share};
use kvfence_model::{Grammar, LoadedModel, SamplingParams, StopStrings};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec};
use proptest::prelude::*;
use serde_json::{Value, json};

fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let model = Arc::new(LoadedModel::load("builtin:tiny").unwrap());
        let spec = PoolSpec::new(
            model.model.kv_shape(),
            16,
            ElemType::F32,
            PoolSize::Tokens(16_384),
        );
        Engine::start(model, Pool::new(&spec).unwrap(), EngineConfig::default())
    })
}

/// A leaf schema: a boolean, a bounded integer, a string enum, a short
/// string, or null.
fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!({"type": "boolean"})),
        (-50i64..50, 0i64..100).prop_map(|(min, span)| json!({
            "type": "integer", "minimum": min, "maximum": min + span,
        })),
        proptest::collection::btree_set("[a-z]{1,6}", 1..4)
            .prop_map(|words| json!({"enum": words.into_iter().collect::<Vec<_>>()})),
        (0u64..8).prop_map(|max| json!({"type": "string", "maxLength": max})),
        Just(json!({"type": "null"})),
    ]
}

/// An object of one to three properties (leaves, short arrays of leaves,
/// or objects of leaves), some required, nothing else allowed.
fn schema() -> impl Strategy<Value = Value> {
    let value = leaf().prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            (inner.clone(), 0u64..3).prop_map(|(items, max)| json!({
                "type": "array", "items": items, "maxItems": max,
            })),
            object(inner),
        ]
    });
    object(value.boxed())
}

fn object(values: impl Strategy<Value = Value> + Clone) -> impl Strategy<Value = Value> {
    proptest::collection::btree_map("[a-z]{1,5}", (values, any::<bool>()), 1..4).prop_map(
        |properties| {
            let required: Vec<&String> = properties
                .iter()
                .filter(|(_, (_, required))| *required)
                .map(|(name, _)| name)
                .collect();
            let schemas: serde_json::Map<String, Value> = properties
                .iter()
                .map(|(name, (schema, _))| (name.clone(), schema.clone()))
                .collect();
            json!({
                "type": "object",
                "properties": schemas,
                "required": required,
                "additionalProperties": false,
            })
        },
    )
}

/// Whether `value` is valid against `schema` (the subset made above).
fn valid(schema: &Value, value: &Value) -> bool {
    if let Some(options) = schema["enum"].as_array() {
        return options.contains(value);
    }
    match schema["type"].as_str() {
        Some("boolean") => value.is_boolean(),
        Some("null") => value.is_null(),
        Some("integer") => value.as_f64().is_some_and(|n| {
            n.fract() == 0.0
                && n >= schema["minimum"].as_f64().unwrap()
                && n <= schema["maximum"].as_f64().unwrap()
        }),
        Some("string") => value
            .as_str()
            .is_some_and(|s| s.chars().count() as u64 <= schema["maxLength"].as_u64().unwrap()),
        Some("array") => value.as_array().is_some_and(|items| {
            items.len() as u64 <= schema["maxItems"].as_u64().unwrap()
                && items.iter().all(|item| valid(&schema["items"], item))
        }),
        Some("object") => value.as_object().is_some_and(|object| {
            let properties = schema["properties"].as_object().unwrap();
            let required = schema["required"].as_array().unwrap();
            required
                .iter()
                .all(|name| object.contains_key(name.as_str().unwrap()))
                && object
                    .iter()
                    .all(|(k, v)| properties.get(k).is_some_and(|s| valid(s, v)))
        }),
        other => panic!("the generator makes no schema of type {other:?}"),
    }
}

/// The completion's text and how it ended.
fn generate(schema: &Value, sampling: SamplingParams) -> (String, Event) {
    let request = GenerationRequest {
        prompt: b"json please: ".iter().map(|&b| u32::from(b)).collect(),
        max_tokens: 400,
        sampling,
        stop: StopStrings::default(),
        ignore_eos: false,
        cache: None,
        constraint: Some(Grammar::JsonSchema(schema.clone()).into()),
        share: Share::default(),
        trace: None,
    };
    let mut handle = engine().submit(request).unwrap();
    let mut text = String::new();
    loop {
        match handle.blocking_next().unwrap() {
            Event::Token { text: piece, .. } => text.push_str(&piece),
            end => return (text, end),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn constrained_output_always_parses_and_validates(schema in schema(), seed in any::<u64>()) {
        for sampling in [SamplingParams::greedy(), SamplingParams::seeded(1.0, seed)] {
            let (text, end) = generate(&schema, sampling);
            prop_assert!(
                matches!(end, Event::Finished { reason: FinishReason::Stop, .. }),
                "{end:?} after {text:?} for {schema}"
            );
            let value: Value = serde_json::from_str(&text)
                .map_err(|e| TestCaseError::fail(format!("{text:?} for {schema}: {e}")))?;
            prop_assert!(valid(&schema, &value), "{text} is not valid against {schema}");
        }
    }
}
