//! The objects the API answers with, as types: a `chat.completion` or
//! `text_completion` whole, each chunk of a stream, log-probabilities in
//! each endpoint's shape, the model list, lists of stored items, deletions
//! and probes. What a client can read in a reply is exactly what these
//! structs hold. (The Responses API's events are in `respond.rs`.)

use kvfence_engine::{FinishReason, Usage};
use serde::Serialize;
use serde_json::Value;

use crate::tools::Call;

/// A whole answer or one chunk of a streamed one. `usage` is always on a
/// whole answer and only on a stream's last chunk (`include_usage`).
#[derive(Serialize)]
pub(super) struct Body<'a, C> {
    pub(super) id: &'a str,
    pub(super) object: &'static str,
    pub(super) created: u64,
    pub(super) model: &'a str,
    pub(super) system_fingerprint: &'a str,
    pub(super) choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) usage: Option<UsageBody>,
    /// vLLM's `prompt_logprobs` for chat: once, the prompt being every
    /// choice's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) prompt_logprobs: Option<Value>,
}

/// Token counts, OpenAI's way.
#[derive(Serialize)]
pub(super) struct UsageBody {
    prompt_tokens: usize,
    completion_tokens: usize,
    total_tokens: usize,
    prompt_tokens_details: CachedTokens,
}

#[derive(Serialize)]
struct CachedTokens {
    cached_tokens: usize,
}

impl From<Usage> for UsageBody {
    fn from(usage: Usage) -> UsageBody {
        UsageBody {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details: CachedTokens {
                cached_tokens: usage.cached_tokens,
            },
        }
    }
}

/// One choice of a whole answer.
#[derive(Serialize)]
#[serde(untagged)]
pub(super) enum Choice<'a> {
    /// Chat (and the Responses API underneath): the assistant's message.
    Message {
        index: usize,
        message: Message<'a>,
        logprobs: Option<Logprobs>,
        finish_reason: Option<&'static str>,
    },
    /// Completions: the text, and vLLM's `prompt_logprobs` if asked.
    Text {
        index: usize,
        text: &'a str,
        logprobs: Option<Logprobs>,
        finish_reason: Option<&'static str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        prompt_logprobs: Option<Value>,
    },
}

/// The assistant's message of a chat choice. `content` is null only when
/// the answer is calls and nothing before them.
#[derive(Serialize)]
pub(super) struct Message<'a> {
    role: &'static str,
    content: Option<&'a str>,
    refusal: Option<()>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCall<'a>>,
}

/// A call in a chat message (`message.tool_calls[i]`).
#[derive(Serialize)]
struct ToolCall<'a> {
    id: &'a str,
    r#type: &'static str,
    function: Function<'a>,
}

#[derive(Serialize)]
struct Function<'a> {
    name: &'a str,
    arguments: &'a str,
}

impl<'a> Message<'a> {
    /// A plain answer.
    pub(super) fn text(content: &'a str) -> Message<'a> {
        Message {
            role: "assistant",
            content: Some(content),
            refusal: None,
            tool_calls: Vec::new(),
        }
    }

    /// An answer that made `calls` after `content` (null if empty).
    pub(super) fn calls(content: &'a str, calls: &'a [Call]) -> Message<'a> {
        Message {
            role: "assistant",
            content: (!content.is_empty()).then_some(content),
            refusal: None,
            tool_calls: calls.iter().map(ToolCall::of).collect(),
        }
    }
}

impl<'a> ToolCall<'a> {
    fn of(call: &'a Call) -> ToolCall<'a> {
        ToolCall {
            id: &call.id,
            r#type: "function",
            function: Function {
                name: &call.name,
                arguments: &call.arguments,
            },
        }
    }
}

/// One choice of a streamed chunk.
#[derive(Serialize)]
#[serde(untagged)]
pub(super) enum Delta<'a> {
    /// Chat: what the assistant's message gains.
    Message {
        index: usize,
        delta: MessageDelta<'a>,
        logprobs: Option<Logprobs>,
        finish_reason: Option<&'static str>,
    },
    /// Completions: text to append.
    Text {
        index: usize,
        text: &'a str,
        logprobs: Option<Logprobs>,
        finish_reason: Option<&'static str>,
    },
}

/// What a chat chunk adds to the message: the role (first chunk), text, or
/// calls (each call's header, then its arguments).
#[derive(Serialize, Default)]
pub(super) struct MessageDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tool_calls: Option<Vec<ToolCallDelta<'a>>>,
}

/// A call as a chunk streams it: first `id`, `type` and the name with empty
/// arguments, then the arguments alone.
#[derive(Serialize)]
pub(super) struct ToolCallDelta<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    r#type: Option<&'static str>,
    function: FunctionDelta<'a>,
}

#[derive(Serialize)]
struct FunctionDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    arguments: &'a str,
}

impl<'a> ToolCallDelta<'a> {
    /// Call `index`'s header: its id and name, no arguments yet.
    pub(super) fn header(index: usize, call: &'a Call) -> ToolCallDelta<'a> {
        ToolCallDelta {
            index,
            id: Some(&call.id),
            r#type: Some("function"),
            function: FunctionDelta {
                name: Some(&call.name),
                arguments: "",
            },
        }
    }

    /// Call `index`'s arguments.
    pub(super) fn arguments(index: usize, call: &'a Call) -> ToolCallDelta<'a> {
        ToolCallDelta {
            index,
            id: None,
            r#type: None,
            function: FunctionDelta {
                name: None,
                arguments: &call.arguments,
            },
        }
    }
}

/// A choice's log-probabilities, in its endpoint's shape.
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub(super) enum Logprobs {
    /// Chat: an entry per token, each with its alternatives.
    Chat {
        content: Vec<TokenLogprob>,
        refusal: Option<()>,
    },
    /// Completions (OpenAI's legacy format): parallel lists, one element
    /// per token; an echoed prompt's first token has no score (`null`).
    Legacy {
        tokens: Vec<String>,
        token_logprobs: Vec<Option<f64>>,
        top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
        text_offset: Vec<usize>,
    },
}

impl Logprobs {
    /// `self` (an echoed prompt's) followed by `completion`'s, when both
    /// are in the legacy format; otherwise `completion`.
    pub(super) fn then(self, completion: Logprobs) -> Logprobs {
        match (self, completion) {
            (
                Logprobs::Legacy {
                    mut tokens,
                    mut token_logprobs,
                    mut top_logprobs,
                    mut text_offset,
                },
                Logprobs::Legacy {
                    tokens: more_tokens,
                    token_logprobs: more_logprobs,
                    top_logprobs: more_top,
                    text_offset: more_offsets,
                },
            ) => {
                tokens.extend(more_tokens);
                token_logprobs.extend(more_logprobs);
                top_logprobs.extend(more_top);
                text_offset.extend(more_offsets);
                Logprobs::Legacy {
                    tokens,
                    token_logprobs,
                    top_logprobs,
                    text_offset,
                }
            }
            (_, completion) => completion,
        }
    }
}

/// One token of a chat choice's log-probabilities.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(super) struct TokenLogprob {
    #[serde(flatten)]
    pub(super) token: Alternative,
    pub(super) top_logprobs: Vec<Alternative>,
}

/// A token and its log-probability: its text (lossy) and its bytes. (The
/// engine's `f32` widened: JSON numbers are read as doubles.)
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(super) struct Alternative {
    pub(super) token: String,
    pub(super) logprob: f64,
    pub(super) bytes: Vec<u8>,
}

/// `/health` and `/ready`'s body.
#[derive(Serialize)]
pub(super) struct Probe {
    pub(super) status: &'static str,
}

/// A list, OpenAI's way (`/v1/models`).
#[derive(Serialize)]
pub(super) struct List<T> {
    object: &'static str,
    data: Vec<T>,
}

impl<T> List<T> {
    pub(super) fn of(data: Vec<T>) -> List<T> {
        List {
            object: "list",
            data,
        }
    }
}

/// The served model: its honest context (I6), under both names clients
/// read it by.
#[derive(Serialize)]
pub(super) struct Model<'a> {
    pub(super) id: &'a str,
    pub(super) object: &'static str,
    pub(super) created: u64,
    pub(super) owned_by: &'static str,
    pub(super) max_model_len: usize,
    pub(super) context_length: usize,
}

/// A page of stored items (a conversation's, a response's input), with
/// the ids a client pages on.
#[derive(Serialize)]
pub(super) struct ItemPage {
    object: &'static str,
    first_id: Option<Value>,
    last_id: Option<Value>,
    has_more: bool,
    data: Vec<Value>,
}

impl ItemPage {
    pub(super) fn of(data: Vec<Value>, has_more: bool) -> ItemPage {
        ItemPage {
            object: "list",
            first_id: data.first().map(|item| item["id"].clone()),
            last_id: data.last().map(|item| item["id"].clone()),
            has_more,
            data,
        }
    }
}

/// What a deletion answers: the id, `object` (`conversation.deleted`,
/// `response.deleted`) and that it is gone.
#[derive(Serialize)]
pub(super) struct Deleted<'a> {
    pub(super) id: &'a str,
    pub(super) object: &'static str,
    pub(super) deleted: bool,
}

/// `object` as JSON: what these types hold always serialises.
pub(super) fn to_value(object: impl Serialize) -> Value {
    serde_json::to_value(object).expect("the API's objects always serialise")
}

/// A finish reason as OpenAI names it.
pub(super) fn finish_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// The finish of an answer that made calls: `tool_calls`, or `length` if
/// it was cut short.
pub(super) fn tool_finish(finish: Option<FinishReason>) -> &'static str {
    match finish {
        Some(FinishReason::Length) => "length",
        _ => "tool_calls",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call() -> Call {
        Call {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        }
    }

    #[test]
    fn a_chat_choice_is_openais_message() {
        let choice = Choice::Message {
            index: 1,
            message: Message::text("hi"),
            logprobs: None,
            finish_reason: Some("stop"),
        };
        assert_eq!(
            serde_json::to_value(&choice).unwrap(),
            json!({"index": 1, "message": {"role": "assistant", "content": "hi", "refusal": null},
                   "logprobs": null, "finish_reason": "stop"})
        );
        let calls = [call()];
        let choice = Choice::Message {
            index: 0,
            message: Message::calls("", &calls),
            logprobs: None,
            finish_reason: Some(tool_finish(None)),
        };
        assert_eq!(
            serde_json::to_value(&choice).unwrap(),
            json!({"index": 0, "message": {"role": "assistant", "content": null, "refusal": null,
                   "tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                   "logprobs": null, "finish_reason": "tool_calls"})
        );
    }

    #[test]
    fn chunks_carry_only_what_they_add() {
        let calls = [call()];
        let role = Delta::Message {
            index: 0,
            delta: MessageDelta {
                role: Some("assistant"),
                content: Some(""),
                tool_calls: None,
            },
            logprobs: None,
            finish_reason: None,
        };
        assert_eq!(
            serde_json::to_value(&role).unwrap(),
            json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})
        );
        let header = MessageDelta {
            tool_calls: Some(vec![ToolCallDelta::header(0, &calls[0])]),
            ..MessageDelta::default()
        };
        assert_eq!(
            serde_json::to_value(&header).unwrap(),
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": ""}}]})
        );
        let arguments = ToolCallDelta::arguments(0, &calls[0]);
        assert_eq!(
            serde_json::to_value(&arguments).unwrap(),
            json!({"index": 0, "function": {"arguments": "{\"city\":\"Paris\"}"}})
        );
        let end = Delta::Text {
            index: 2,
            text: "",
            logprobs: None,
            finish_reason: Some(finish_name(FinishReason::Length)),
        };
        assert_eq!(
            serde_json::to_value(&end).unwrap(),
            json!({"index": 2, "text": "", "logprobs": null, "finish_reason": "length"})
        );
    }

    #[test]
    fn usage_rides_a_whole_answer_and_a_streams_last_chunk_only() {
        let body = |usage: Option<UsageBody>| {
            serde_json::to_value(Body::<Delta<'_>> {
                id: "c",
                object: "chat.completion.chunk",
                created: 1,
                model: "m",
                system_fingerprint: "f",
                choices: Vec::new(),
                usage,
                prompt_logprobs: None,
            })
            .unwrap()
        };
        assert!(body(None).get("usage").is_none());
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_tokens: 1,
        };
        assert_eq!(
            body(Some(usage.into()))["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                   "prompt_tokens_details": {"cached_tokens": 1}})
        );
    }
}
