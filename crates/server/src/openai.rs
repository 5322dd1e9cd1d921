//! OpenAI wire types: request bodies (`/v1/chat/completions`,
//! `/v1/completions`) and the checks that turn them into engine requests.
//!
//! No field is dropped in silence: a body is first read as a JSON object
//! and every key is checked against what its endpoint knows
//! ([`CHAT_FIELDS`], [`COMPLETION_FIELDS`]). A field is either honoured,
//! accepted as metadata that changes nothing generated (`user`,
//! `metadata`, ...), or refused with a 400 that names it; an unknown field
//! is refused too. Type errors name the field (`param`), never the body.
//!
//! Client text is held as [`Redacted`] from the moment it is parsed (I10),
//! and so are grammars and schemas ([`RedactedJson`]).

mod unique;

use std::collections::BTreeMap;

use kvfence_model::{Grammar, MAX_TOP_LOGPROBS, SamplingParams, StopStrings};
use serde::Deserialize;
use serde::de::{DeserializeOwned, IgnoredAny};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::redact::{Redacted, RedactedJson, clipped};
use crate::tools::{ToolCallIn, ToolChoiceIn, ToolIn, Tools, render_calls};

/// How a field of a request body is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldUse {
    /// It changes what is generated, and kvfence does what it says.
    Honoured,
    /// Metadata: accepted, and changes nothing generated.
    Metadata,
    /// Accepted only when absent, null or its neutral value; anything else
    /// is a 400 naming it (kvfence does not do it).
    RefusedUnlessNeutral,
}

/// The fields every generating endpoint knows (`/v1/chat/completions`,
/// `/v1/completions`, `/v1/responses`), besides its own.
pub const SHARED_FIELDS: &[(&str, FieldUse)] = &[
    ("model", FieldUse::Honoured),
    ("temperature", FieldUse::Honoured),
    ("top_p", FieldUse::Honoured),
    ("top_k", FieldUse::Honoured),
    ("seed", FieldUse::Honoured),
    ("stream", FieldUse::Honoured),
    ("presence_penalty", FieldUse::Honoured),
    ("frequency_penalty", FieldUse::Honoured),
    ("repetition_penalty", FieldUse::Honoured),
    ("logit_bias", FieldUse::Honoured),
    ("ignore_eos", FieldUse::Honoured),
    ("cache_salt", FieldUse::Honoured),
    ("priority", FieldUse::Honoured),
    ("service_tier", FieldUse::Honoured),
    ("user", FieldUse::Metadata),
    ("metadata", FieldUse::Metadata),
    ("store", FieldUse::Metadata),
];

/// The fields only `/v1/chat/completions` knows. The tables in
/// `docs/api.md` list the same, with what each does.
pub const CHAT_FIELDS: &[(&str, FieldUse)] = &[
    ("messages", FieldUse::Honoured),
    ("max_tokens", FieldUse::Honoured),
    ("max_completion_tokens", FieldUse::Honoured),
    ("stop", FieldUse::Honoured),
    ("stream_options", FieldUse::Honoured),
    ("n", FieldUse::Honoured),
    ("logprobs", FieldUse::Honoured),
    ("top_logprobs", FieldUse::Honoured),
    ("prompt_logprobs", FieldUse::Honoured),
    ("response_format", FieldUse::Honoured),
    ("tools", FieldUse::Honoured),
    ("tool_choice", FieldUse::Honoured),
    ("safety_identifier", FieldUse::Metadata),
    ("prompt_cache_key", FieldUse::Metadata),
    ("parallel_tool_calls", FieldUse::Honoured),
    ("functions", FieldUse::RefusedUnlessNeutral),
    ("function_call", FieldUse::RefusedUnlessNeutral),
    ("modalities", FieldUse::RefusedUnlessNeutral),
    ("audio", FieldUse::RefusedUnlessNeutral),
    ("prediction", FieldUse::RefusedUnlessNeutral),
    ("reasoning_effort", FieldUse::RefusedUnlessNeutral),
    ("verbosity", FieldUse::RefusedUnlessNeutral),
    ("web_search_options", FieldUse::RefusedUnlessNeutral),
];

/// The fields only `/v1/completions` knows.
pub const COMPLETION_FIELDS: &[(&str, FieldUse)] = &[
    ("prompt", FieldUse::Honoured),
    ("max_tokens", FieldUse::Honoured),
    ("stop", FieldUse::Honoured),
    ("stream_options", FieldUse::Honoured),
    ("n", FieldUse::Honoured),
    ("best_of", FieldUse::Honoured),
    ("echo", FieldUse::Honoured),
    ("logprobs", FieldUse::Honoured),
    ("prompt_logprobs", FieldUse::Honoured),
    ("response_format", FieldUse::Honoured),
    ("suffix", FieldUse::RefusedUnlessNeutral),
];

/// Most choices one request may ask for (`n` times the prompts of a
/// batch): each is a request in the engine, and one tenant slot pays for
/// all of them.
pub const MAX_CHOICES: usize = 16;

/// Most log-probability alternatives `/v1/completions` returns (OpenAI's).
pub const MAX_COMPLETION_LOGPROBS: i64 = 5;

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    /// A single stop string.
    One(Redacted),
    /// Up to four.
    Many(Vec<Redacted>),
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with token usage.
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// Pad stream chunks against length side channels: not done, so only
    /// `false` (or null) is accepted.
    #[serde(default)]
    pub include_obfuscation: Option<bool>,
}

/// `response_format.json_schema`. Its `name` and `description` are
/// metadata, and `strict` changes nothing: the schema is always enforced.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    /// The schema; absent means any JSON object.
    pub schema: Option<RedactedJson>,
    /// Metadata.
    #[serde(default, rename = "name")]
    _name: Option<IgnoredAny>,
    /// Metadata.
    #[serde(default, rename = "description")]
    _description: Option<IgnoredAny>,
    /// Always honoured as true.
    #[serde(default, rename = "strict")]
    _strict: Option<IgnoredAny>,
}

/// `response_format`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    /// Free text (the default).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against a schema.
    JsonSchema {
        /// The schema and its metadata.
        json_schema: JsonSchemaFormat,
    },
    /// Text matching a regular expression (extension).
    Regex {
        /// The expression, matched against the whole completion.
        regex: Redacted,
    },
    /// Text in a Lark grammar's language (extension; llguidance's dialect).
    Grammar {
        /// The grammar.
        grammar: Redacted,
    },
}

/// Sampling and length fields both endpoints share.
#[derive(Debug, Default, Deserialize)]
pub struct CommonParams {
    /// The model id (must match the served model).
    pub model: Option<String>,
    /// Completion tokens at most.
    pub max_tokens: Option<i64>,
    /// Newer name of `max_tokens` (chat).
    pub max_completion_tokens: Option<i64>,
    /// 0–2; 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus mass in (0, 1].
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens (extension; 0, −1 or absent keeps all).
    pub top_k: Option<i64>,
    /// Seed of this request's sampler; choice `i` of `n` uses `seed + i`.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Stream with server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices.
    pub n: Option<i64>,
    /// Keep going past end-of-sequence tokens (extension, for benchmarks).
    pub ignore_eos: Option<bool>,
    /// −2 to 2, once per token already generated.
    pub presence_penalty: Option<f32>,
    /// −2 to 2, per time a token was generated.
    pub frequency_penalty: Option<f32>,
    /// Above 1 discourages any token of the prompt or completion (extension).
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string) → bias from −100 to 100.
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// What the output must match.
    pub response_format: Option<ResponseFormat>,
    /// Subdivides this tenant's prefix cache: requests share cached
    /// prefixes only with requests of the same tenant and the same salt.
    /// It can never reach another tenant's cache (vLLM's field).
    pub cache_salt: Option<String>,
    /// Score the prompt (vLLM's field): each prompt token's
    /// log-probability and rank, with this many alternatives (0 to 20).
    pub prompt_logprobs: Option<i64>,
    /// Scheduling priority (extension): higher is admitted sooner,
    /// negative is sheddable; at most what the tenant may use.
    pub priority: Option<i64>,
    /// OpenAI's processing tier: `flex` is sheddable work, `priority` asks
    /// for priority 1 where the tenant may use it, `auto` and `default`
    /// ask for nothing.
    pub service_tier: Option<String>,
}

impl CommonParams {
    /// The priorities the body asks for, each with the field that asked.
    pub fn priorities(&self, max_priority: i32) -> Result<Vec<(i32, &'static str)>, ApiError> {
        let mut asked = Vec::new();
        if let Some(priority) = self.priority {
            let range = crate::tenants::PRIORITY_RANGE;
            let value = i32::try_from(priority)
                .ok()
                .filter(|p| range.contains(p))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "priority",
                        format!(
                            "priority must be between {} and {}",
                            range.start(),
                            range.end()
                        ),
                    )
                })?;
            asked.push((value, "priority"));
        }
        match self.service_tier.as_deref() {
            None | Some("auto" | "default") => {}
            // Sheddable, at the tenant's own priority where that is lower.
            Some("flex") => asked.push((max_priority.min(-1), "service_tier")),
            // Priority processing where the tenant may have it; the
            // tenant's best otherwise, as OpenAI serves an account without it.
            Some("priority") => asked.push((max_priority.min(1), "service_tier")),
            Some(_) => {
                return Err(ApiError::invalid(
                    "service_tier",
                    "service_tier must be auto, default, flex or priority",
                ));
            }
        }
        Ok(asked)
    }
}

/// Longest `cache_salt` accepted.
pub const MAX_CACHE_SALT: usize = 256;

/// Message content: a string, or parts of which the text ones are used.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(Redacted),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

/// One content part. Parts other than text are refused by their type;
/// a `cache_control` hint is metadata (prefixes are cached anyway).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    /// Part type; only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<Redacted>,
    #[serde(default, rename = "image_url")]
    _image_url: Option<IgnoredAny>,
    #[serde(default, rename = "input_audio")]
    _input_audio: Option<IgnoredAny>,
    #[serde(default, rename = "file")]
    _file: Option<IgnoredAny>,
    #[serde(default, rename = "cache_control")]
    _cache_control: Option<IgnoredAny>,
}

/// One chat message. Fields OpenAI's own answers carry, which clients
/// send back with the conversation, are metadata; an `audio` or
/// `function_call` that asks for something is refused; anything else is
/// an unknown field.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageIn {
    /// `system`, `developer`, `user`, `assistant`, `tool`.
    pub role: String,
    /// The content (absent or null is empty). A participant's `name` and
    /// a tool result's `tool_call_id` are metadata.
    pub content: Option<Content>,
    /// The calls an earlier assistant turn made.
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// A participant's name (metadata).
    #[serde(default, rename = "name")]
    _name: Option<IgnoredAny>,
    /// Which call a tool result answers (metadata: results match by order).
    #[serde(default, rename = "tool_call_id")]
    _tool_call_id: Option<IgnoredAny>,
    /// An earlier answer's refusal and annotations (metadata).
    #[serde(default, rename = "refusal")]
    _refusal: Option<IgnoredAny>,
    #[serde(default, rename = "annotations")]
    _annotations: Option<IgnoredAny>,
    /// Audio in or out: only null.
    #[serde(default)]
    pub audio: Option<Value>,
    /// The pre-`tools` call: only null.
    #[serde(default)]
    pub function_call: Option<Value>,
}

/// The fields only `/v1/chat/completions` has.
#[derive(Debug, Deserialize)]
pub struct ChatFields {
    /// The conversation.
    pub messages: Vec<MessageIn>,
    /// Return each token's log-probability.
    pub logprobs: Option<bool>,
    /// And this many alternatives (0–20; needs `logprobs`).
    pub top_logprobs: Option<i64>,
    /// Functions the model may call.
    pub tools: Option<Vec<ToolIn>>,
    /// Whether and which it must call.
    pub tool_choice: Option<ToolChoiceIn>,
    /// Whether one answer may make several calls (absent: yes).
    pub parallel_tool_calls: Option<bool>,
    /// The most calls one answer makes. Responses' `max_tool_calls`,
    /// translated: a chat request that sends it is refused as an unknown
    /// field before it is read here.
    pub max_tool_calls: Option<u32>,
}

/// `prompt` of `/v1/completions`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    /// One prompt.
    Text(Redacted),
    /// A batch of prompts.
    Texts(Vec<Redacted>),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of token-id prompts.
    TokenBatches(Vec<Vec<u32>>),
}

/// The fields only `/v1/completions` has.
#[derive(Debug, Deserialize)]
pub struct CompletionFields {
    /// The prompt or prompts.
    pub prompt: PromptField,
    /// Return each token's log-probability and this many alternatives (0–5).
    pub logprobs: Option<i64>,
    /// Put the prompt before the completion in each choice's text.
    pub echo: Option<bool>,
    /// Candidates per prompt; only `n` (every candidate is returned).
    pub best_of: Option<i64>,
    /// Text after the completion (insertion); not supported.
    pub suffix: Option<Redacted>,
}

/// Reads a request body as a JSON object and checks every key against
/// `fields`. The error names the position and kind of a syntax problem, or
/// the field at fault, but never quotes the body (I10).
pub fn parse_object(
    bytes: &[u8],
    fields: &[(&str, FieldUse)],
) -> Result<Map<String, Value>, ApiError> {
    let object = body_object(bytes)?;
    for (key, value) in &object {
        let known = SHARED_FIELDS
            .iter()
            .chain(fields)
            .find(|(name, _)| name == key);
        match known {
            None => {
                return Err(ApiError::invalid(
                    clipped(key),
                    "unrecognized request argument; see docs/api.md for the fields this endpoint takes",
                ));
            }
            Some((_, FieldUse::RefusedUnlessNeutral)) if !is_neutral(key, value) => {
                return Err(ApiError::invalid(
                    key,
                    format!("{key} is not supported by this server"),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(object)
}

/// Reads a request body as one JSON object in which no object, at any
/// depth, names a member twice ([`unique`]). The error says where the body
/// went wrong, never what it says (I10).
pub fn body_object(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value = unique::from_slice(bytes).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                "is not valid JSON"
            }
            // Any JSON text is a `Value`: the one data error is a repeated name.
            serde_json::error::Category::Data => {
                "repeats a name within one object, which JSON readers resolve differently"
            }
            serde_json::error::Category::Io => "could not be read",
        };
        ApiError::invalid(
            "body",
            format!(
                "the request body {what} (line {}, column {})",
                e.line(),
                e.column()
            ),
        )
    })?;
    let Value::Object(object) = value else {
        return Err(ApiError::invalid(
            "body",
            "the request body must be a JSON object",
        ));
    };
    Ok(object)
}

/// Whether a refused field's value asks for nothing.
fn is_neutral(key: &str, value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Array(items) if items.is_empty() => true,
        Value::String(s) if s.is_empty() => true,
        Value::String(s) => {
            s == "none" && matches!(key, "tool_choice" | "function_call" | "reasoning_effort")
                // OpenAI's own default: the model answers as it does.
                || s == "medium" && key == "verbosity"
        }
        // Responses' `reasoning` with nothing set (what SDKs send by
        // default) asks for no reasoning.
        Value::Object(settings) if key == "reasoning" => settings
            .iter()
            .all(|(name, value)| value.is_null() || (name == "effort" && value == "none")),
        Value::Array(items) => {
            key == "modalities" && items.iter().all(|m| m.as_str() == Some("text"))
        }
        _ => false,
    }
}

/// Deserializes `T` from a checked body; a type error names the field.
pub fn typed<T: DeserializeOwned>(object: &Map<String, Value>) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(Value::Object(object.clone())).map_err(|error| {
        let path = error.path().to_string();
        let param = if path == "." {
            "body".to_string()
        } else {
            path
        };
        let inner = error.into_inner();
        let text = inner.to_string();
        // The path ends in the key the client sent: cut, never echoed whole.
        let param = clipped(&param).to_string();
        let message = if text.starts_with("missing field") {
            "a required field is missing".to_string()
        } else if text.starts_with("unknown field") {
            "unrecognized request argument; see docs/api.md for the fields it may hold".to_string()
        } else {
            format!("{param} has the wrong type or value")
        };
        // serde's own message may quote the value sent: never passed on (I10).
        let missing = inner
            .to_string()
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next())
            .map(str::to_string);
        match missing {
            Some(field) => ApiError::invalid(&field, format!("{field} is required")),
            None => ApiError::invalid(&param, message),
        }
    })
}

impl CommonParams {
    /// The `cache_salt`, checked to be a non-empty string of modest length.
    pub fn cache_salt(&self) -> Result<Option<String>, ApiError> {
        match &self.cache_salt {
            None => Ok(None),
            Some(salt) if !salt.is_empty() && salt.len() <= MAX_CACHE_SALT => {
                Ok(Some(salt.clone()))
            }
            Some(_) => Err(ApiError::invalid(
                "cache_salt",
                format!("cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} bytes"),
            )),
        }
    }

    /// The field the request gave its completion limit in.
    pub fn max_tokens_field(&self) -> &'static str {
        match self.max_completion_tokens {
            Some(_) => "max_completion_tokens",
            None => "max_tokens",
        }
    }

    /// The requested `max_tokens`, if any, checked to be positive. Both
    /// names may be sent (clients moving from one to the other do) only if
    /// they agree: one silently winning would leave the other doing nothing.
    pub fn max_tokens(&self) -> Result<Option<usize>, ApiError> {
        let (param, value) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(new), Some(old)) if new != old => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!(
                        "max_tokens ({old}) and max_completion_tokens ({new}) disagree; send one of them"
                    ),
                ));
            }
            (Some(n), _) => ("max_completion_tokens", n),
            (None, Some(n)) => ("max_tokens", n),
            (None, None) => return Ok(None),
        };
        if value >= 1 {
            Ok(Some(value as usize))
        } else {
            Err(ApiError::invalid(
                param,
                format!("{param} must be at least 1, got {value}"),
            ))
        }
    }

    /// Choices per prompt, 1 to [`MAX_CHOICES`].
    pub fn n(&self) -> Result<usize, ApiError> {
        match self.n {
            None => Ok(1),
            Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => Ok(n as usize),
            Some(n) => Err(ApiError::invalid(
                "n",
                format!("n must be between 1 and {MAX_CHOICES}, got {n}"),
            )),
        }
    }

    /// Whether to stream.
    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// How many alternatives each prompt token's score lists, if the
    /// prompt is to be scored (`prompt_logprobs`). Not streamed: the
    /// scores come whole in the answer, as vLLM gives them.
    pub fn prompt_logprobs(&self) -> Result<Option<usize>, ApiError> {
        let max = kvfence_model::MAX_TOP_LOGPROBS as i64;
        match self.prompt_logprobs {
            None => Ok(None),
            Some(_) if self.stream() => Err(ApiError::invalid(
                "prompt_logprobs",
                "prompt_logprobs cannot be streamed: ask without stream, or use echo with logprobs on /v1/completions",
            )),
            Some(n) if (0..=max).contains(&n) => Ok(Some(n as usize)),
            Some(n) => Err(ApiError::invalid(
                "prompt_logprobs",
                format!("prompt_logprobs must be between 0 and {max}, got {n}"),
            )),
        }
    }

    /// Sampling parameters drawing from `seed` (the request's, or the
    /// server's choice, plus the choice's index). `logprobs` is how many
    /// alternatives to report per token, if any, and `prompt_logprobs` per
    /// prompt token, if the prompt is scored; `vocab` bounds `logit_bias`'s
    /// token ids.
    pub fn sampling(
        &self,
        seed: u64,
        logprobs: Option<usize>,
        prompt_logprobs: Option<usize>,
        vocab: usize,
    ) -> Result<SamplingParams, ApiError> {
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                "temperature must be between 0 and 2",
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                "top_p must be greater than 0 and at most 1",
            ));
        }
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) if k >= 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be -1 or at least 0, got {k}"),
                ));
            }
        };
        let penalty = |name: &str, value: Option<f32>| match value {
            None => Ok(0.0),
            Some(v) if (-2.0..=2.0).contains(&v) => Ok(v),
            Some(_) => Err(ApiError::invalid(
                name,
                format!("{name} must be between -2 and 2"),
            )),
        };
        let presence_penalty = penalty("presence_penalty", self.presence_penalty)?;
        let frequency_penalty = penalty("frequency_penalty", self.frequency_penalty)?;
        let repetition_penalty = match self.repetition_penalty {
            None => 1.0,
            Some(r) if r > 0.0 && r <= 10.0 => r,
            Some(_) => {
                return Err(ApiError::invalid(
                    "repetition_penalty",
                    "repetition_penalty must be greater than 0 and at most 10",
                ));
            }
        };
        let mut logit_bias = Vec::new();
        for (key, &bias) in self.logit_bias.iter().flatten() {
            let token = key
                .parse::<u32>()
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!(
                            "logit_bias keys must be token ids below the vocabulary size {vocab}"
                        ),
                    )
                })?;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    "logit_bias values must be between -100 and 100",
                ));
            }
            logit_bias.push((token, bias));
        }
        logit_bias.sort_unstable_by_key(|&(token, _)| token);
        if logit_bias.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(ApiError::invalid(
                "logit_bias",
                "logit_bias names a token more than once",
            ));
        }
        Ok(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            logit_bias,
            logprobs,
            prompt_logprobs,
        })
    }

    /// The grammar `response_format` asks for, if any.
    pub fn grammar(&self) -> Result<Option<Grammar>, ApiError> {
        Ok(match &self.response_format {
            None | Some(ResponseFormat::Text) => None,
            Some(ResponseFormat::JsonObject) => Some(Grammar::JsonObject),
            Some(ResponseFormat::JsonSchema { json_schema }) => match &json_schema.schema {
                None => Some(Grammar::JsonObject),
                Some(RedactedJson(schema)) if schema.is_object() || schema.is_boolean() => {
                    Some(Grammar::JsonSchema(schema.clone()))
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.schema",
                        "the schema must be a JSON object",
                    ));
                }
            },
            Some(ResponseFormat::Regex { regex }) => Some(Grammar::Regex(regex.expose().into())),
            Some(ResponseFormat::Grammar { grammar }) => {
                Some(Grammar::Lark(grammar.expose().into()))
            }
        })
    }

    /// Stop strings: at most four, none empty, at most
    /// [`kvfence_model::MAX_STOP_BYTES`] together.
    pub fn stop_strings(&self) -> Result<StopStrings, ApiError> {
        let list: Vec<String> = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.expose().to_string()],
            Some(StopField::Many(v)) => v.iter().map(|s| s.expose().to_string()).collect(),
        };
        StopStrings::new(list).map_err(|error| match error {
            // The model's reason names counts and sizes, never the text (I10).
            kvfence_model::ModelError::InvalidSampling { reason } => {
                ApiError::invalid("stop", reason)
            }
            _ => ApiError::invalid("stop", "stop takes at most 4 non-empty strings"),
        })
    }

    /// Whether the last stream chunk should carry usage; 400 for
    /// obfuscated chunks, which this server does not send, and for stream
    /// options on an answer that does not stream, where they would do
    /// nothing (OpenAI refuses them too).
    pub fn include_usage(&self) -> Result<bool, ApiError> {
        let Some(options) = &self.stream_options else {
            return Ok(false);
        };
        if options.include_obfuscation == Some(true) {
            return Err(ApiError::invalid(
                "stream_options.include_obfuscation",
                "obfuscated stream chunks are not supported by this server; send false",
            ));
        }
        if !self.stream() {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options is only allowed when stream is true",
            ));
        }
        Ok(options.include_usage.unwrap_or(false))
    }
}

impl ChatFields {
    /// How many alternatives each token's log-probabilities list, if any.
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        let top = match self.top_logprobs {
            None => None,
            Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
                ));
            }
        };
        match (self.logprobs.unwrap_or(false), top) {
            (true, top) => Ok(Some(top.unwrap_or(0))),
            // No alternatives without log-probabilities asks for nothing.
            (false, None | Some(0)) => Ok(None),
            (false, Some(_)) => Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs set to true",
            )),
        }
    }

    /// The request's tools, if it has any to use; [`Tools::unused`] if it
    /// has tools it may not call, or made calls earlier in the
    /// conversation and has none now.
    pub fn tools(&self) -> Result<Option<Tools>, ApiError> {
        let tools = Tools::from_request(
            self.tools.as_deref(),
            self.tool_choice.as_ref(),
            self.parallel_tool_calls,
            self.max_tool_calls,
        )?;
        let given = self.tools.as_ref().is_some_and(|t| !t.is_empty());
        let called = self
            .messages
            .iter()
            .any(|m| m.role == "tool" || m.tool_calls.as_ref().is_some_and(|c| !c.is_empty()));
        Ok(tools.or_else(|| (given || called).then(Tools::unused)))
    }

    /// The messages as plain chat messages for the template: earlier tool
    /// calls rendered into their turns, and `tools` described in the
    /// system message.
    pub fn messages(
        &self,
        tools: Option<&Tools>,
    ) -> Result<Vec<kvfence_model::ChatMessage>, ApiError> {
        let mut messages = self.plain_messages()?;
        if let Some(tools) = tools.filter(|t| t.callable()) {
            match messages.first_mut() {
                Some(first) if first.role == "system" => {
                    first.content = format!("{}\n\n{}", first.content, tools.instruction());
                }
                _ => messages.insert(
                    0,
                    kvfence_model::ChatMessage {
                        role: "system".into(),
                        content: tools.instruction(),
                    },
                ),
            }
        }
        Ok(messages)
    }

    fn plain_messages(&self) -> Result<Vec<kvfence_model::ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must not be empty"));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                for (field, value) in [("audio", &m.audio), ("function_call", &m.function_call)] {
                    if value.as_ref().is_some_and(|v| !v.is_null()) {
                        return Err(ApiError::invalid(
                            &format!("messages[{i}].{field}"),
                            format!("messages[].{field} is not supported by this server"),
                        ));
                    }
                }
                let content = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.expose().to_string(),
                    Some(Content::Parts(parts)) => {
                        let mut text = String::new();
                        for part in parts {
                            match (part.kind.as_str(), &part.text) {
                                ("text", Some(t)) => text.push_str(t.expose()),
                                _ => {
                                    return Err(ApiError::invalid(
                                        &format!("messages[{i}].content"),
                                        "only text content parts are supported",
                                    ));
                                }
                            }
                        }
                        text
                    }
                };
                // The role is rendered into the prompt as the template's own
                // text: only the roles the API defines, never free text.
                let role = match m.role.as_str() {
                    "system" | "user" | "assistant" | "tool" => m.role.clone(),
                    "developer" => "system".to_string(),
                    _ => {
                        return Err(ApiError::invalid(
                            &format!("messages[{i}].role"),
                            "role must be one of system, developer, user, assistant, tool",
                        ));
                    }
                };
                let content = match &m.tool_calls {
                    Some(calls) if role == "assistant" && !calls.is_empty() => {
                        let calls = render_calls(calls);
                        if content.is_empty() {
                            calls
                        } else {
                            format!("{content}\n{calls}")
                        }
                    }
                    _ => content,
                };
                Ok(kvfence_model::ChatMessage { role, content })
            })
            .collect()
    }
}

impl CompletionFields {
    /// How many alternatives each token's log-probabilities list, if any.
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match self.logprobs {
            None => Ok(None),
            Some(n) if (0..=MAX_COMPLETION_LOGPROBS).contains(&n) => Ok(Some(n as usize)),
            Some(n) => Err(ApiError::invalid(
                "logprobs",
                format!("logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {n}"),
            )),
        }
    }

    /// Refuses what this endpoint's fields ask for but kvfence does not do.
    pub fn check(&self, n: usize) -> Result<(), ApiError> {
        if let Some(best_of) = self.best_of
            && best_of != n as i64
        {
            return Err(ApiError::invalid(
                "best_of",
                "best_of must equal n: every candidate is returned as a choice",
            ));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "suffix is not supported"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
