//! OpenAI wire types: request bodies (`/v1/chat/completions`,
//! `/v1/completions`) and the checks that turn them into engine requests.
//! Client text is held as [`Redacted`] from the moment it is parsed (I10).

use kvfence_model::{SamplingParams, StopStrings};
use serde::Deserialize;

use crate::error::ApiError;
use crate::redact::Redacted;

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
pub struct StreamOptions {
    /// Send a last chunk with token usage.
    #[serde(default)]
    pub include_usage: bool,
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
    /// Keep only the k most likely tokens (extension; 0 or absent keeps all).
    pub top_k: Option<i64>,
    /// Seed of this request's sampler.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Stream with server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices; only 1 is served.
    pub n: Option<i64>,
    /// Keep going past end-of-sequence tokens (extension, for benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Not supported unless 0.
    pub presence_penalty: Option<f32>,
    /// Not supported unless 0.
    pub frequency_penalty: Option<f32>,
    /// Not supported.
    pub logprobs: Option<serde_json::Value>,
    /// Not supported unless false (completions).
    pub echo: Option<bool>,
    /// Subdivides this tenant's prefix cache: requests share cached
    /// prefixes only with requests of the same tenant and the same salt.
    /// It can never reach another tenant's cache (vLLM's field).
    pub cache_salt: Option<String>,
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

/// One content part.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    /// Part type; only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<Redacted>,
}

/// One chat message.
#[derive(Debug, Deserialize)]
pub struct MessageIn {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The content (absent or null is empty).
    pub content: Option<Content>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<MessageIn>,
    /// Shared fields.
    #[serde(flatten)]
    pub params: CommonParams,
}

/// `prompt` of `/v1/completions`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    /// One prompt.
    Text(Redacted),
    /// A batch of prompts (only one is served).
    Texts(Vec<Redacted>),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: PromptField,
    /// Shared fields.
    #[serde(flatten)]
    pub params: CommonParams,
}

/// Parses a JSON body into `T`. The error names the position and kind of
/// the problem but never quotes the body (I10).
pub fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                "is not valid JSON"
            }
            serde_json::error::Category::Data => "does not match the expected fields or types",
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
    })
}

impl CommonParams {
    /// Rejects what kvfence does not serve rather than silently ignoring it.
    pub fn check_supported(&self) -> Result<(), ApiError> {
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(ApiError::invalid(
                "n",
                format!("n = {n} is not supported; only 1 choice per request"),
            ));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if value.is_some_and(|v| v != 0.0) {
                return Err(ApiError::invalid(name, format!("{name} is not supported")));
            }
        }
        if self
            .logprobs
            .as_ref()
            .is_some_and(|v| !v.is_null() && v != &serde_json::Value::Bool(false))
        {
            return Err(ApiError::invalid("logprobs", "logprobs are not supported"));
        }
        if self.echo == Some(true) {
            return Err(ApiError::invalid("echo", "echo is not supported"));
        }
        Ok(())
    }

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

    /// The requested `max_tokens`, if any, checked to be positive.
    pub fn max_tokens(&self) -> Result<Option<usize>, ApiError> {
        match self.max_completion_tokens.or(self.max_tokens) {
            None => Ok(None),
            Some(n) if n >= 1 => Ok(Some(n as usize)),
            Some(n) => Err(ApiError::invalid(
                "max_tokens",
                format!("max_tokens must be at least 1, got {n}"),
            )),
        }
    }

    /// Sampling parameters; `default_seed` is used when none is given.
    pub fn sampling(&self, default_seed: u64) -> Result<SamplingParams, ApiError> {
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
        let seed = self.seed.map_or(default_seed, |s| s as u64);
        Ok(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            ..SamplingParams::greedy()
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

    /// Whether the last stream chunk should carry usage.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

impl ChatRequest {
    /// The messages as plain chat messages for the template.
    pub fn messages(&self) -> Result<Vec<kvfence_model::ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must not be empty"));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
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
                Ok(kvfence_model::ChatMessage { role, content })
            })
            .collect()
    }
}
