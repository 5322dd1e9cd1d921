//! `POST /v1/responses`, OpenAI's Responses API (the Agents SDK's
//! default): a request is translated into the chat request it means —
//! `instructions` and `input` items into messages, flat function tools into
//! chat tools, `text.format` into `response_format`, `max_output_tokens`
//! into `max_completion_tokens` — and served by the same path; the answer
//! is rendered as a response object, or as the Responses streaming events.
//!
//! With `store` (on by default when the server keeps responses) the answer
//! is kept per tenant (`crate::stored`); `previous_response_id` continues a
//! kept one: its conversation — earlier turns, its input, its output, as
//! input items — comes before the new input (its `instructions` do not, as
//! OpenAI's do not). Fields are checked as chat's are: honoured, metadata,
//! or refused by name ([`RESPONSES_FIELDS`]).

use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::openai::{FieldUse, SHARED_FIELDS};
use crate::tools::Call;

/// The fields only `/v1/responses` knows (besides
/// [`SHARED_FIELDS`](crate::openai::SHARED_FIELDS)).
pub const RESPONSES_FIELDS: &[(&str, FieldUse)] = &[
    ("input", FieldUse::Honoured),
    ("instructions", FieldUse::Honoured),
    ("max_output_tokens", FieldUse::Honoured),
    ("tools", FieldUse::Honoured),
    ("tool_choice", FieldUse::Honoured),
    ("text", FieldUse::Honoured),
    ("safety_identifier", FieldUse::Metadata),
    ("prompt_cache_key", FieldUse::Metadata),
    ("parallel_tool_calls", FieldUse::Honoured),
    ("stream_options", FieldUse::Metadata),
    ("previous_response_id", FieldUse::Honoured),
    ("conversation", FieldUse::Honoured),
    ("include", FieldUse::Honoured),
    ("top_logprobs", FieldUse::Honoured),
    ("reasoning", FieldUse::RefusedUnlessNeutral),
    ("background", FieldUse::RefusedUnlessNeutral),
    ("truncation", FieldUse::Honoured),
    ("max_tool_calls", FieldUse::Honoured),
    ("prompt", FieldUse::RefusedUnlessNeutral),
];

/// Fields of the request a response object repeats back.
const ECHOED: &[&str] = &[
    "instructions",
    "previous_response_id",
    "max_output_tokens",
    "max_tool_calls",
    "metadata",
    "parallel_tool_calls",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "truncation",
    "user",
];

/// What a Responses request asks of the response store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Storing {
    /// `store`: `Some(true)` or `Some(false)` as sent, `None` if absent
    /// (then the server's default: kept when it keeps responses).
    pub store: Option<bool>,
    /// The stored response it continues.
    pub previous: Option<String>,
    /// The stored conversation it continues and joins.
    pub conversation: Option<String>,
}

impl Storing {
    /// Reads `store` and `previous_response_id`.
    pub fn of(object: &Map<String, Value>) -> Result<Storing, ApiError> {
        let store = match object.get("store") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(keep)) => Some(*keep),
            Some(_) => return Err(ApiError::invalid("store", "store must be true or false")),
        };
        let previous = match object.get("previous_response_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(id)) => Some(id.clone()),
            Some(_) => {
                return Err(ApiError::invalid(
                    "previous_response_id",
                    "previous_response_id must be a response id",
                ));
            }
        };
        let conversation = match object.get("conversation") {
            None | Some(Value::Null) => None,
            Some(Value::String(id)) => Some(id.clone()),
            Some(Value::Object(fields)) if fields.len() == 1 => match fields.get("id") {
                Some(Value::String(id)) => Some(id.clone()),
                _ => None,
            },
            Some(_) => None,
        };
        if object.get("conversation").is_some_and(|c| !c.is_null()) && conversation.is_none() {
            return Err(ApiError::invalid(
                "conversation",
                "conversation must be a conversation id or {\"id\": ...}",
            ));
        }
        if conversation.is_some() && previous.is_some() {
            return Err(ApiError::invalid(
                "conversation",
                "conversation and previous_response_id cannot be used together",
            ));
        }
        Ok(Storing {
            store,
            previous,
            conversation,
        })
    }
}

/// A Responses request as the chat request it means.
#[derive(Debug)]
pub struct Translated {
    /// The chat request.
    pub chat: Map<String, Value>,
    /// The fields its response repeats.
    pub echo: Value,
    /// Its own input as input items, each with an id (what
    /// `input_items` lists and a continuation replays).
    pub input: Vec<Value>,
    /// `truncation: "auto"`: a conversation past the context loses its
    /// oldest turns rather than failing.
    pub truncate: bool,
}

/// The chat request a Responses request means, after the `earlier` items
/// of the stored conversation it continues.
pub fn to_chat(object: &Map<String, Value>, earlier: &[Value]) -> Result<Translated, ApiError> {
    let mut chat = Map::new();
    // The shared fields mean the same on both endpoints.
    for (field, _) in SHARED_FIELDS {
        if let Some(value) = object.get(*field) {
            chat.insert((*field).into(), value.clone());
        }
    }
    if let Some(max) = object.get("max_output_tokens") {
        chat.insert("max_completion_tokens".into(), max.clone());
    }
    let input = input_items(object)?;
    let items: Vec<&Value> = earlier.iter().chain(&input).collect();
    chat.insert(
        "messages".into(),
        Value::Array(messages(object, &items, earlier.len())?),
    );
    if let Some(tools) = object.get("tools").filter(|t| !t.is_null()) {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = object.get("tool_choice").filter(|c| !c.is_null()) {
        chat.insert("tool_choice".into(), chat_tool_choice(choice)?);
    }
    for field in ["parallel_tool_calls", "max_tool_calls"] {
        if let Some(value) = object.get(field) {
            chat.insert(field.into(), value.clone());
        }
    }
    if let Some(alternatives) = logprobs_wanted(object)? {
        chat.insert("logprobs".into(), true.into());
        chat.insert("top_logprobs".into(), alternatives.into());
    }
    if let Some(text) = object.get("text").filter(|t| !t.is_null()) {
        let Value::Object(settings) = text else {
            return Err(ApiError::invalid("text", "text must be an object"));
        };
        for (name, value) in settings {
            match name.as_str() {
                "format" => {
                    chat.insert("response_format".into(), response_format(value)?);
                }
                // Honoured as chat's `verbosity` is: its default only.
                "verbosity" if value.is_null() || value == "medium" => {}
                "verbosity" => {
                    return Err(ApiError::invalid(
                        "text.verbosity",
                        "text.verbosity other than medium is not supported by this server",
                    ));
                }
                _ => {
                    return Err(ApiError::invalid(
                        "text",
                        "unrecognized field in text; it takes format and verbosity",
                    ));
                }
            }
        }
    }
    let truncate = match object.get("truncation") {
        None | Some(Value::Null) => false,
        Some(value) if value == "disabled" => false,
        Some(value) if value == "auto" => true,
        Some(_) => {
            return Err(ApiError::invalid(
                "truncation",
                "truncation must be auto or disabled",
            ));
        }
    };
    let mut echo = Map::new();
    for &field in ECHOED {
        echo.insert(
            field.into(),
            object.get(field).cloned().unwrap_or(Value::Null),
        );
    }
    Ok(Translated {
        chat,
        echo: Value::Object(echo),
        input,
        truncate,
    })
}

/// What `include` may hold: the one output this server can add, the
/// message text's log-probabilities. (OpenAI's others add the results of
/// tools it runs, images and reasoning, none of which is served here.)
const LOGPROBS_INCLUDED: &str = "message.output_text.logprobs";

/// Reads `include` and `top_logprobs`: with the message text's
/// log-probabilities included, how many alternatives each token lists
/// (0 to 20); `None` when not included. Alternatives asked for without the
/// log-probabilities would change nothing, so they are refused, as chat's
/// `top_logprobs` is without `logprobs`.
fn logprobs_wanted(object: &Map<String, Value>) -> Result<Option<u64>, ApiError> {
    let included = match object.get("include") {
        None | Some(Value::Null) => false,
        Some(Value::Array(values)) => {
            if values.iter().any(|value| value != LOGPROBS_INCLUDED) {
                return Err(ApiError::invalid(
                    "include",
                    format!("include may hold only \"{LOGPROBS_INCLUDED}\" on this server"),
                ));
            }
            !values.is_empty()
        }
        Some(_) => return Err(ApiError::invalid("include", "include must be a list")),
    };
    let alternatives = match object.get("top_logprobs") {
        None | Some(Value::Null) => 0,
        Some(value) => value.as_u64().filter(|n| *n <= 20).ok_or_else(|| {
            ApiError::invalid(
                "top_logprobs",
                "top_logprobs must be an integer from 0 to 20",
            )
        })?,
    };
    if alternatives > 0 && !included {
        return Err(ApiError::invalid(
            "top_logprobs",
            format!("top_logprobs needs include: [\"{LOGPROBS_INCLUDED}\"]"),
        ));
    }
    Ok(included.then_some(alternatives))
}

/// A Conversations API `items` list checked as input items (at most 20, as
/// OpenAI's), each given an id if it has none; errors name `items[i]`.
pub fn conversation_items(items: &Value) -> Result<Vec<Value>, ApiError> {
    let rename = |mut error: ApiError| {
        error.param = error.param.map(|p| p.replacen("input", "items", 1));
        error
    };
    match items.as_array() {
        Some(list) if list.len() > 20 => {
            return Err(ApiError::invalid("items", "at most 20 items at once"));
        }
        Some(_) => {}
        None => return Err(ApiError::invalid("items", "items must be a list")),
    }
    let mut object = Map::new();
    object.insert("input".into(), items.clone());
    let items = input_items(&object).map_err(rename)?;
    let refs: Vec<&Value> = items.iter().collect();
    messages(&Map::new(), &refs, 0).map_err(rename)?;
    Ok(items)
}

/// `input` as a list of input items, each with an id: a string is one
/// user message; an item without an id gets one.
fn input_items(object: &Map<String, Value>) -> Result<Vec<Value>, ApiError> {
    match object.get("input") {
        Some(Value::String(text)) => Ok(vec![json!({
            "type": "message",
            "id": item_id("msg"),
            "role": "user",
            "content": [{ "type": "input_text", "text": text }],
        })]),
        Some(Value::Array(items)) if !items.is_empty() => Ok(items
            .iter()
            .map(|item| {
                let mut item = item.clone();
                if let Value::Object(fields) = &mut item {
                    let kind = fields
                        .entry("type")
                        .or_insert_with(|| "message".into())
                        .as_str()
                        .map(str::to_string);
                    let prefix = match kind.as_deref() {
                        Some("function_call") => "fc",
                        Some("function_call_output") => "fco",
                        _ => "msg",
                    };
                    fields.entry("id").or_insert_with(|| item_id(prefix).into());
                    if prefix == "msg" {
                        in_parts(fields);
                    }
                }
                item
            })
            .collect()),
        None | Some(Value::Null) => Err(ApiError::invalid("input", "input is required")),
        Some(_) => Err(ApiError::invalid(
            "input",
            "input must be a string or a non-empty list of items",
        )),
    }
}

/// A message's text content as the one part OpenAI keeps it in (and
/// lists it in, where clients index `content[0].text`): `output_text` for
/// the assistant's, `input_text` for the others'. Parts stay as sent.
fn in_parts(message: &mut Map<String, Value>) {
    let Some(Value::String(text)) = message.get("content") else {
        return;
    };
    let part = if message.get("role").and_then(Value::as_str) == Some("assistant") {
        json!({ "type": "output_text", "text": text, "annotations": [] })
    } else {
        json!({ "type": "input_text", "text": text })
    };
    message.insert("content".into(), json!([part]));
}

/// The keys each kind of `input` item and content part may carry: what
/// it means, and the metadata OpenAI's own outputs carry when a client
/// sends them back (`id`, `status`, an output part's `annotations` and
/// `logprobs`), which say nothing about the request.
const MESSAGE_KEYS: &[&str] = &["type", "role", "content", "id", "status"];
const CALL_KEYS: &[&str] = &["type", "id", "call_id", "name", "arguments", "status"];
const OUTPUT_KEYS: &[&str] = &["type", "id", "call_id", "output", "status"];
const PART_KEYS: &[&str] = &["type", "text", "annotations", "logprobs"];

/// Refuses a key of `item` outside `allowed`, naming it under `at`: an
/// accepted field that did nothing would be a silent lie.
fn known_keys(item: &Value, allowed: &[&str], at: &str) -> Result<(), ApiError> {
    let Some(unknown) = item
        .as_object()
        .and_then(|fields| fields.keys().find(|k| !allowed.contains(&k.as_str())))
    else {
        return Ok(());
    };
    Err(ApiError::invalid(
        &format!("{at}.{}", crate::redact::clipped(unknown)),
        format!("unknown field (allowed here: {})", allowed.join(", ")),
    ))
}

/// `instructions` and the input `items` as chat messages: text items,
/// earlier function calls (consecutive ones in one assistant turn) and their
/// outputs as tool messages. The first `earlier` items came from the stored
/// response a request continues.
fn messages(
    object: &Map<String, Value>,
    items: &[&Value],
    earlier: usize,
) -> Result<Vec<Value>, ApiError> {
    let mut messages = Vec::new();
    match object.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => {
            messages.push(json!({ "role": "system", "content": text }));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "instructions",
                "instructions must be a string",
            ));
        }
    }
    for (i, item) in items.iter().enumerate() {
        let param = |field: &str| match i.checked_sub(earlier) {
            Some(i) => format!("input[{i}]{field}"),
            None => "previous_response_id".to_string(),
        };
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                known_keys(item, MESSAGE_KEYS, &param(""))?;
                let role = item.get("role").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(&param(".role"), "a message item needs a role")
                })?;
                let content = match item.get("content") {
                    Some(Value::String(text)) => text.clone(),
                    Some(Value::Array(parts)) => {
                        let mut text = String::new();
                        for (j, part) in parts.iter().enumerate() {
                            let at = param(&format!(".content[{j}]"));
                            // The kind first: an image refused for its
                            // `image_url` would name the wrong problem.
                            let kind = part.get("type").and_then(Value::as_str);
                            if !matches!(kind, Some("input_text" | "output_text" | "text")) {
                                return Err(ApiError::invalid(
                                    &format!("{at}.type"),
                                    "only text content parts are supported (input_text, output_text)",
                                ));
                            }
                            known_keys(part, PART_KEYS, &at)?;
                            let Some(t) = part.get("text").and_then(Value::as_str) else {
                                return Err(ApiError::invalid(
                                    &format!("{at}.text"),
                                    "a text part needs its text, a string",
                                ));
                            };
                            text.push_str(t);
                        }
                        text
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            &param(".content"),
                            "content must be a string or a list of text parts",
                        ));
                    }
                };
                messages.push(json!({ "role": role, "content": content }));
            }
            "function_call" => {
                known_keys(item, CALL_KEYS, &param(""))?;
                let field = |name: &str| {
                    item.get(name)
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .ok_or_else(|| {
                            ApiError::invalid(
                                &param(&format!(".{name}")),
                                format!("a function_call item needs {name}"),
                            )
                        })
                };
                let call = json!({
                    "id": field("call_id")?,
                    "type": "function",
                    "function": { "name": field("name")?, "arguments": field("arguments")? },
                });
                // Calls side by side are one assistant turn.
                match messages.last_mut() {
                    Some(last) if last["role"] == "assistant" && last["tool_calls"].is_array() => {
                        if let Some(calls) = last["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    _ => messages.push(json!({
                        "role": "assistant", "content": null, "tool_calls": [call],
                    })),
                }
            }
            "function_call_output" => {
                known_keys(item, OUTPUT_KEYS, &param(""))?;
                let output = match item.get("output") {
                    Some(Value::String(text)) => text.clone(),
                    Some(other) if !other.is_null() => other.to_string(),
                    _ => {
                        return Err(ApiError::invalid(
                            &param(".output"),
                            "a function_call_output item needs output",
                        ));
                    }
                };
                messages.push(json!({
                    "role": "tool",
                    "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "content": output,
                }));
            }
            _ => {
                return Err(ApiError::invalid(
                    &param(".type"),
                    "input items are message, function_call or function_call_output",
                ));
            }
        }
    }
    Ok(messages)
}

/// Responses' flat function tools as chat's nested ones.
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Some(list) = tools.as_array() else {
        return Err(ApiError::invalid("tools", "tools must be a list"));
    };
    list.iter()
        .enumerate()
        .map(|(i, tool)| {
            if tool.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].type"),
                    "only function tools are supported",
                ));
            }
            let mut function = Map::new();
            for field in ["name", "description", "parameters", "strict"] {
                if let Some(value) = tool.get(field).filter(|v| !v.is_null()) {
                    function.insert(field.into(), value.clone());
                }
            }
            Ok(json!({ "type": "function", "function": function }))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        Value::Object(object) if object.get("type").and_then(Value::as_str) == Some("function") => {
            Ok(
                json!({ "type": "function", "function": { "name": object.get("name").cloned().unwrap_or(Value::Null) } }),
            )
        }
        _ => Err(ApiError::invalid(
            "tool_choice",
            "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
        )),
    }
}

/// `text.format` as `response_format`.
fn response_format(format: &Value) -> Result<Value, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(json!({ "type": "text" })),
        Some("json_object") => Ok(json!({ "type": "json_object" })),
        Some("json_schema") => Ok(json!({
            "type": "json_schema",
            "json_schema": { "schema": format.get("schema").cloned().unwrap_or(Value::Null) },
        })),
        _ => Err(ApiError::invalid(
            "text.format.type",
            "text.format.type must be text, json_object or json_schema",
        )),
    }
}

/// An error about the chat request named as the Responses request's field.
pub fn rename_param(mut error: ApiError) -> ApiError {
    if let Some(param) = &error.param {
        let renamed = if param == "max_tokens" || param == "max_completion_tokens" {
            "max_output_tokens".to_string()
        } else if param.starts_with("messages") {
            "input".to_string()
        } else if param.starts_with("response_format") {
            "text.format".to_string()
        } else {
            param.replace(".function.", ".")
        };
        error.param = Some(renamed);
    }
    // The chat field the request became is named in messages too; ours
    // never quote the client's text, so this replaces nothing of theirs.
    error.message = error
        .message
        .replace("max_completion_tokens", "max_output_tokens");
    error
}

/// A new item id with `prefix` (`msg`, `fc`).
pub fn item_id(prefix: &str) -> String {
    format!("{prefix}_{:024x}", rand::random::<u128>() >> 32)
}

/// The assistant's text as an output item, with its tokens'
/// log-probabilities (empty unless the request included them).
pub fn message_item(id: &str, text: &str, status: &str, logprobs: &[Value]) -> Value {
    to_value(OutputItem::Message {
        id,
        status,
        role: "assistant",
        content: [OutputText {
            r#type: "output_text",
            text,
            annotations: [],
            logprobs,
        }],
    })
}

/// An empty message part (`output_text`), as a stream opens it.
pub fn empty_output_text() -> Value {
    to_value(OutputText {
        r#type: "output_text",
        text: "",
        annotations: [],
        logprobs: &[],
    })
}

/// A function call as an output item.
pub fn call_item(id: &str, call: &Call, arguments: &str, status: &str) -> Value {
    to_value(OutputItem::FunctionCall {
        id,
        call_id: &call.id,
        name: &call.name,
        arguments,
        status,
    })
}

/// An output item of a response, as clients read it (and as a stored
/// response keeps it).
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum OutputItem<'a> {
    Message {
        id: &'a str,
        status: &'a str,
        role: &'static str,
        content: [OutputText<'a>; 1],
    },
    FunctionCall {
        id: &'a str,
        call_id: &'a str,
        name: &'a str,
        arguments: &'a str,
        status: &'a str,
    },
}

/// A message's text part.
#[derive(Serialize)]
struct OutputText<'a> {
    r#type: &'static str,
    text: &'a str,
    annotations: [Value; 0],
    /// The log-probabilities of the tokens that spell `text` (OpenAI's
    /// parts carry the list, empty when not included).
    logprobs: &'a [Value],
}

/// A response's token counts.
#[derive(Serialize)]
struct ResponseUsage {
    input_tokens: usize,
    input_tokens_details: InputDetails,
    output_tokens: usize,
    output_tokens_details: OutputDetails,
    total_tokens: usize,
}

#[derive(Serialize)]
struct InputDetails {
    cached_tokens: usize,
}

#[derive(Serialize)]
struct OutputDetails {
    reasoning_tokens: usize,
}

impl From<kvfence_engine::Usage> for ResponseUsage {
    fn from(u: kvfence_engine::Usage) -> ResponseUsage {
        ResponseUsage {
            input_tokens: u.prompt_tokens,
            input_tokens_details: InputDetails {
                cached_tokens: u.cached_tokens,
            },
            output_tokens: u.completion_tokens,
            // No reasoning model is served.
            output_tokens_details: OutputDetails {
                reasoning_tokens: 0,
            },
            total_tokens: u.prompt_tokens + u.completion_tokens,
        }
    }
}

/// What these objects are built from always serialises.
fn to_value(object: impl Serialize) -> Value {
    serde_json::to_value(object).expect("a response's objects always serialise")
}

/// A response object: `status` is `in_progress`, `completed` or
/// `incomplete` (then because `max_output_tokens` ran out).
pub fn response_object(
    id: &str,
    created: u64,
    model: &str,
    status: &str,
    output: Vec<Value>,
    usage: Option<kvfence_engine::Usage>,
    echo: &Value,
) -> Value {
    let mut response = json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "error": null,
        "incomplete_details": (status == "incomplete").then(|| json!({ "reason": "max_output_tokens" })),
        "usage": usage.map(|u| to_value(ResponseUsage::from(u))),
    });
    for (key, value) in echo.as_object().into_iter().flatten() {
        response[key] = value.clone();
    }
    // What clients read even when the request left them out.
    for (key, default) in [
        ("tools", json!([])),
        ("tool_choice", json!("auto")),
        ("parallel_tool_calls", json!(true)),
        ("metadata", json!({})),
        ("truncation", json!("disabled")),
    ] {
        if response[key].is_null() {
            response[key] = default;
        }
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::parse_object;

    fn object(value: Value) -> Map<String, Value> {
        value.as_object().unwrap().clone()
    }

    #[test]
    fn unknown_keys_of_input_items_are_refused_and_openai_metadata_passes() {
        // What the Agents SDK sends back: output items with ids, statuses
        // and output_text parts with annotations.
        let echoed = json!({"input": [
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f",
             "arguments": "{}", "status": "completed"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok", "status": "completed"},
            {"role": "user", "content": "next"},
        ]});
        to_chat(&object(echoed), &[]).unwrap();
        for (item, at) in [
            (
                json!({"role": "user", "content": "x", "audio": {"id": "a"}}),
                "input[0].audio",
            ),
            (
                json!({"role": "user", "content": [{"type": "input_text", "text": "x", "cache_control": {}}]}),
                "input[0].content[0].cache_control",
            ),
            (
                json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "strict": true}),
                "input[0].strict",
            ),
            (
                json!({"type": "function_call_output", "call_id": "c", "output": "o", "is_error": true}),
                "input[0].is_error",
            ),
        ] {
            let error = to_chat(&object(json!({"input": [item]})), &[]).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(at));
        }
    }

    #[test]
    fn input_items_become_messages_and_calls_share_a_turn() {
        let Translated { chat, .. } = to_chat(
            &object(json!({
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "max_output_tokens": 9,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        })),
            &[],
        )
        .unwrap();
        let messages = chat["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 4);
        assert_eq!(messages[0]["role"], "system");
        assert_eq!(messages[1]["content"], "weather?");
        assert_eq!(messages[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(messages[3]["role"], "tool");
        assert_eq!(chat["max_completion_tokens"], 9);
        assert_eq!(chat["response_format"]["type"], "json_schema");
    }

    /// Items are kept, listed and read back as OpenAI lists them: a
    /// message's text content in parts (`input_text`, or `output_text` for
    /// the assistant), which clients index (`content[0].text`).
    #[test]
    fn a_message_s_text_content_is_kept_in_parts() {
        let items = conversation_items(&json!([
            {"role": "user", "content": "hello"},
            {"type": "message", "role": "assistant", "content": "hi there"},
            {"role": "system", "content": [{"type": "input_text", "text": "as sent"}]},
        ]))
        .unwrap();
        assert_eq!(
            items[0]["content"],
            json!([{"type": "input_text", "text": "hello"}])
        );
        assert_eq!(
            items[1]["content"],
            json!([{"type": "output_text", "text": "hi there", "annotations": []}])
        );
        assert_eq!(
            items[2]["content"],
            json!([{"type": "input_text", "text": "as sent"}])
        );
        // And they read as the same conversation.
        let Translated { chat, input, .. } = to_chat(
            &object(json!({"input": [{"role": "user", "content": "hello"}]})),
            &[],
        )
        .unwrap();
        assert_eq!(chat["messages"][0]["content"], "hello");
        assert_eq!(input[0]["content"][0]["text"], "hello");
    }

    #[test]
    fn tools_come_as_chat_tools_with_their_choice_and_call_limits() {
        let Translated { chat, echo, .. } = to_chat(
            &object(json!({
                "input": "x",
                "tools": [{"type": "function", "name": "now", "parameters": {"type": "object"}}],
                "tool_choice": "auto",
                "parallel_tool_calls": false,
                "max_tool_calls": 3,
            })),
            &[],
        )
        .unwrap();
        assert_eq!(chat["tools"][0]["function"]["name"], "now");
        assert_eq!(chat["tool_choice"], "auto");
        assert_eq!(chat["parallel_tool_calls"], false);
        assert_eq!(chat["max_tool_calls"], 3);
        assert_eq!(
            echo["parallel_tool_calls"], false,
            "the response repeats it"
        );
        assert_eq!(echo["max_tool_calls"], 3, "and the bound");
    }

    #[test]
    fn text_settings_are_honoured_or_refused_and_empty_reasoning_passes() {
        let Translated { chat, .. } = to_chat(
            &object(json!({
                "input": "x",
                "text": {"format": {"type": "text"}, "verbosity": "medium"},
            })),
            &[],
        )
        .unwrap();
        assert_eq!(chat["response_format"], json!({"type": "text"}));
        for (text, param) in [
            (json!({"verbosity": "high"}), "text.verbosity"),
            (json!({"format": {"type": "text"}, "colour": "red"}), "text"),
            (json!("plain"), "text"),
        ] {
            let error = to_chat(&object(json!({"input": "x", "text": text})), &[]).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param));
        }
        let fields = |body: &str| parse_object(body.as_bytes(), RESPONSES_FIELDS);
        fields(r#"{"input": "x", "reasoning": {}}"#).unwrap();
        fields(r#"{"input": "x", "reasoning": {"effort": null, "summary": null}}"#).unwrap();
        let error = fields(r#"{"input": "x", "reasoning": {"effort": "high"}}"#).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("reasoning"));
    }

    #[test]
    fn a_continuation_reads_the_stored_conversation_before_its_input() {
        let first = to_chat(
            &object(json!({"instructions": "first only", "input": "hello"})),
            &[],
        )
        .unwrap();
        let item = &first.input[0];
        assert_eq!(item["type"], "message");
        assert!(item["id"].as_str().unwrap().starts_with("msg_"));
        let mut earlier = first.input.clone();
        earlier.push(message_item("msg_out", "hi there", "completed", &[]));
        let next = to_chat(
            &object(json!({"input": [{"role": "user", "content": "again"}]})),
            &earlier,
        )
        .unwrap();
        let roles: Vec<_> = next.chat["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        // The first request's instructions are not carried over.
        assert_eq!(
            roles,
            [
                ("user", "hello"),
                ("assistant", "hi there"),
                ("user", "again")
            ]
        );
        assert_eq!(next.input.len(), 1);
        assert!(next.input[0]["id"].as_str().unwrap().starts_with("msg_"));
        // A damaged stored item is named as the continuation, never as
        // this request's input.
        let error =
            to_chat(&object(json!({"input": "x"})), &[json!({"type": "image"})]).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("previous_response_id"));
        let storing = |body: Value| Storing::of(&object(body));
        assert_eq!(
            storing(json!({"store": false, "previous_response_id": "resp_1"})).unwrap(),
            Storing {
                store: Some(false),
                previous: Some("resp_1".into()),
                conversation: None,
            }
        );
        assert_eq!(storing(json!({})).unwrap().store, None);
        assert!(storing(json!({"store": "yes"})).is_err());
        assert!(storing(json!({"previous_response_id": 7})).is_err());
        assert_eq!(
            storing(json!({"conversation": {"id": "conv_1"}}))
                .unwrap()
                .conversation,
            Some("conv_1".into())
        );
        for bad in [
            json!({"conversation": 3}),
            json!({"conversation": {"id": "conv_1", "x": 1}}),
            json!({"conversation": "conv_1", "previous_response_id": "resp_1"}),
        ] {
            assert_eq!(
                storing(bad).unwrap_err().param.as_deref(),
                Some("conversation")
            );
        }
    }

    #[test]
    fn unsupported_items_and_tools_are_refused_by_their_place() {
        let error = to_chat(&object(json!({"input": [{"type": "input_image"}]})), &[]).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("input[0].type"));
        // A part of a kind not served is refused as that, not for the
        // fields its kind has (an image's `image_url`, a file's `file_id`).
        for part in [
            json!({"type": "input_image", "image_url": "https://example.com/a.png"}),
            json!({"type": "input_file", "file_id": "file_1"}),
        ] {
            let input =
                json!([{"role": "user", "content": [{"type": "input_text", "text": "a"}, part]}]);
            let error = to_chat(&object(json!({ "input": input })), &[]).unwrap_err();
            assert_eq!(error.param.as_deref(), Some("input[0].content[1].type"));
            assert!(error.message.contains("text"), "{}", error.message);
        }
        let error = to_chat(
            &object(json!({"input": "x", "tools": [{"type": "web_search"}]})),
            &[],
        )
        .unwrap_err();
        assert_eq!(error.param.as_deref(), Some("tools[0].type"));
        let error = to_chat(&object(json!({})), &[]).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("input"));
        let renamed = rename_param(ApiError::invalid("tools[0].function.name", "x"));
        assert_eq!(renamed.param.as_deref(), Some("tools[0].name"));
        // Only the chat request's token limits become `max_output_tokens`;
        // a refused field of the Responses request keeps its own name.
        for (chat, responses) in [
            ("max_tokens", "max_output_tokens"),
            ("max_completion_tokens", "max_output_tokens"),
            ("max_tool_calls", "max_tool_calls"),
        ] {
            let renamed = rename_param(ApiError::invalid(chat, "x"));
            assert_eq!(renamed.param.as_deref(), Some(responses), "{chat}");
        }
    }
}
