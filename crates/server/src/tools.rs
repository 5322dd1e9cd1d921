//! Tool calling: a request's `tools` and `tool_choice`, how they reach the
//! model, and how its answer becomes `message.tool_calls`.
//!
//! The tools are described to the model in a system message (so their
//! text, like every message's, can never become a control token, I9), in
//! one fixed format: a call is `<tool_call>`, a line of JSON
//! `{"name": ..., "arguments": {...}}`, and `</tool_call>`. Earlier calls
//! in the conversation are rendered back in that format, so the model sees
//! its own past calls the way it is asked to make new ones.
//!
//! With `tool_choice` `required` or a named function the answer is
//! constrained by a grammar to exactly one such call whose arguments match
//! the function's `parameters` schema; with `auto` the model may answer in
//! text, and a call it writes is taken only if it names a known function
//! and its arguments are a JSON object.

use kvfence_engine::FinishReason;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::redact::{Redacted, RedactedJson};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Most tools one request may describe.
pub const MAX_TOOLS: usize = 128;

/// The most calls a grammar counts: a bound of `n` calls repeats the call
/// rule `n` times in it, and a client's `max_tool_calls` must not make a
/// grammar of any size it likes.
const GRAMMAR_MAX_CALLS: usize = 16;

/// One entry of `tools`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolIn {
    /// Only `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: FunctionIn,
}

/// A function the model may call.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionIn {
    /// `[A-Za-z0-9_-]{1,64}`.
    pub name: String,
    /// What it does, for the model.
    pub description: Option<Redacted>,
    /// A JSON schema of its arguments (an object); absent means none.
    pub parameters: Option<RedactedJson>,
    /// Whether its calls must match `parameters`. Calls are held to their
    /// schemas wherever they are constrained (a `required` or named
    /// choice, `auto` beside a `response_format`); under plain `auto` a
    /// strict tool constrains them too.
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `tool_choice`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoiceIn {
    /// `none`, `auto` or `required`.
    Mode(String),
    /// `{"type": "function", "function": {"name": ...}}`.
    Named {
        /// Only `function`.
        #[serde(rename = "type")]
        kind: String,
        /// Which.
        function: NamedFunction,
    },
}

/// The function `tool_choice` names.
#[derive(Debug, Deserialize)]
pub struct NamedFunction {
    /// Its name.
    pub name: String,
}

/// A call in an earlier assistant message. Its `id` and `type` are
/// metadata: the model sees calls, and their results, in order.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallIn {
    /// What was called.
    pub function: CalledFunction,
    #[serde(default, rename = "id")]
    _id: Option<serde::de::IgnoredAny>,
    #[serde(default, rename = "type")]
    _kind: Option<serde::de::IgnoredAny>,
    /// A streamed call's position, left by clients that assembled it.
    #[serde(default, rename = "index")]
    _index: Option<serde::de::IgnoredAny>,
}

/// The function and arguments of an earlier call.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CalledFunction {
    /// Its name.
    pub name: String,
    /// Its arguments, a JSON string.
    pub arguments: Redacted,
}

/// How the model must use the tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// It may call one or answer in text.
    Auto,
    /// It must call one.
    Required,
    /// It must call this one.
    Named(String),
}

/// A function as kvfence holds it.
#[derive(Clone)]
struct Tool {
    name: String,
    description: String,
    parameters: Value,
    /// Its calls must match `parameters`, under plain `auto` too.
    strict: bool,
}

/// A request's tools and how they must be used.
#[derive(Clone)]
pub struct Tools {
    tools: Vec<Tool>,
    choice: ToolChoice,
    /// The most calls an answer makes, if any bound: one without
    /// `parallel_tool_calls`, at most Responses' `max_tool_calls`. The
    /// first calls are taken; later ones are dropped, as text after calls
    /// is.
    max_calls: Option<usize>,
}

/// Names, descriptions and schemas are client content: `Debug` shows how
/// many tools there are and whether a call is required, nothing else (I10).
impl std::fmt::Debug for Tools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tools")
            .field("count", &self.tools.len())
            .field("required", &(self.choice != ToolChoice::Auto))
            .field("max_calls", &self.max_calls)
            .finish()
    }
}

/// A call the model made.
#[derive(Clone, PartialEq)]
pub struct Call {
    /// `call_` and 24 hex digits.
    pub id: String,
    /// The function.
    pub name: String,
    /// Its arguments, a JSON object as a string (cut short when the
    /// answer was: then not a whole object).
    pub arguments: String,
}

/// The arguments are generated content: `Debug` shows the id only (I10).
impl std::fmt::Debug for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Call")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Call {
    /// A call of `name` with a fresh id.
    fn new(name: &str, arguments: String) -> Call {
        Call {
            id: format!("call_{:024x}", rand::random::<u128>() >> 32),
            name: name.to_string(),
            arguments,
        }
    }
}

/// `schema` written on one line with fixed separators, unless it sets its
/// own layout: free whitespace lets a small model pad forever.
fn with_layout(mut schema: Value) -> Value {
    if let Some(object) = schema.as_object_mut()
        && !object.contains_key("x-guidance")
    {
        object.insert(
            "x-guidance".into(),
            json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            }),
        );
    }
    schema
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Tools {
    /// The tools of a request, or `None` when it has none, `tool_choice` is
    /// `none` or `max_calls` is 0 under `auto`. `parallel` is
    /// `parallel_tool_calls` (absent: true, as OpenAI's); `max_calls` is
    /// Responses' `max_tool_calls` (OpenAI's bounds calls of its built-in
    /// tools; this server has none, so it bounds the function calls an
    /// answer makes).
    pub fn from_request(
        tools: Option<&[ToolIn]>,
        choice: Option<&ToolChoiceIn>,
        parallel: Option<bool>,
        max_calls: Option<u32>,
    ) -> Result<Option<Tools>, ApiError> {
        let tools = tools.unwrap_or_default();
        let choice = match choice {
            None => ToolChoice::Auto,
            Some(ToolChoiceIn::Mode(mode)) => match mode.as_str() {
                "none" => return Ok(None),
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "tool_choice must be none, auto, required or a named function",
                    ));
                }
            },
            Some(ToolChoiceIn::Named { kind, function }) => {
                if kind != "function" {
                    return Err(ApiError::invalid(
                        "tool_choice.type",
                        "tool_choice.type must be function",
                    ));
                }
                ToolChoice::Named(function.name.clone())
            }
        };
        if tools.is_empty() {
            return match choice {
                ToolChoice::Auto => Ok(None),
                _ => Err(ApiError::invalid(
                    "tool_choice",
                    "tool_choice asks for a call, but no tools are given",
                )),
            };
        }
        if max_calls == Some(0) {
            return match choice {
                ToolChoice::Auto => Ok(None),
                _ => Err(ApiError::invalid(
                    "max_tool_calls",
                    "max_tool_calls is 0, but tool_choice asks for a call",
                )),
            };
        }
        if tools.len() > MAX_TOOLS {
            return Err(ApiError::invalid(
                "tools",
                format!("at most {MAX_TOOLS} tools per request"),
            ));
        }
        let mut held = Vec::with_capacity(tools.len());
        for (i, tool) in tools.iter().enumerate() {
            if tool.kind != "function" {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].type"),
                    "only function tools are supported",
                ));
            }
            let function = &tool.function;
            if !valid_name(&function.name) {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].function.name"),
                    "a function name is 1 to 64 letters, digits, underscores or dashes",
                ));
            }
            if held.iter().any(|t: &Tool| t.name == function.name) {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].function.name"),
                    "two tools have the same name",
                ));
            }
            let parameters = match &function.parameters {
                None => json!({ "type": "object", "properties": {} }),
                Some(RedactedJson(schema)) if schema.is_object() => schema.clone(),
                Some(_) => {
                    return Err(ApiError::invalid(
                        &format!("tools[{i}].function.parameters"),
                        "parameters must be a JSON schema object",
                    ));
                }
            };
            held.push(Tool {
                strict: function.strict == Some(true),
                name: function.name.clone(),
                description: function
                    .description
                    .as_ref()
                    .map(|d| d.expose().to_string())
                    .unwrap_or_default(),
                parameters,
            });
        }
        if let ToolChoice::Named(name) = &choice
            && !held.iter().any(|t| &t.name == name)
        {
            return Err(ApiError::invalid(
                "tool_choice.function.name",
                "tool_choice names a function that is not in tools",
            ));
        }
        Ok(Some(Tools {
            tools: held,
            choice,
            max_calls: [
                (parallel == Some(false)).then_some(1),
                max_calls.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            ]
            .into_iter()
            .flatten()
            .min(),
        }))
    }

    /// Tools no answer may call: the request's are unused (`tool_choice:
    /// "none"`, `max_tool_calls: 0`) or it has none after a conversation
    /// that made calls. The model may still write the call markup it saw
    /// in that conversation; the answer is text and ends where a call
    /// would begin (the opening tag is a kept stop, and [`Tools::parse`]
    /// drops it), so no markup shows as text and no tokens go on a call
    /// nobody takes.
    pub fn unused() -> Tools {
        Tools {
            tools: Vec::new(),
            choice: ToolChoice::Auto,
            max_calls: Some(0),
        }
    }

    /// Whether an answer may call these tools (they are described to the
    /// model only then).
    pub fn callable(&self) -> bool {
        self.max_calls != Some(0)
    }

    /// Refuses, by its tool, a `parameters` schema that cannot do its job,
    /// before the calls are joined into a grammar whose error could name
    /// only the whole. Where calls are `constrained` (a `required` or named
    /// choice, or `auto` beside a `response_format`) that is any schema the
    /// grammar compiler cannot enforce whole (an unknown `format`,
    /// `uniqueItems`, `not`): arguments are always held to their schema
    /// strictly. Under plain `auto` a schema only describes the function to
    /// the model, so only one that means nothing is refused (a type that
    /// does not exist, a reference that does not resolve, a `pattern` that
    /// does not parse); keywords beyond the compiler pass, as they describe
    /// the function all the same.
    pub fn check_schemas(
        &self,
        grammars: &kvfence_model::Grammars,
        constrained: bool,
    ) -> Result<(), ApiError> {
        if !self.callable() {
            return Ok(());
        }
        let compiles = |mut schema: Value| {
            if !constrained && let Some(object) = schema.as_object_mut() {
                // llguidance's own switch: what it cannot enforce, it skips.
                object.insert("x-guidance".into(), json!({ "lenient": true }));
            }
            grammars.compile(&kvfence_model::Grammar::JsonSchema(schema))
        };
        // One compile for every tool (one by one costs 0.45 ms a tool), and
        // one by one only to find the culprit.
        let every =
            json!({ "anyOf": self.tools.iter().map(|t| &t.parameters).collect::<Vec<_>>() });
        if compiles(every).is_ok() {
            return Ok(());
        }
        for (i, tool) in self.tools.iter().enumerate() {
            if let Err(e) = compiles(tool.parameters.clone()) {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].function.parameters"),
                    format!("the parameters schema cannot constrain a call: {e}"),
                ));
            }
        }
        Ok(())
    }

    /// Whether calls are held to their schemas: always where every answer
    /// is a call or beside a `response_format` (`format`), and under plain
    /// `auto` when a tool is `strict`.
    pub fn constrains_calls(&self, format: bool) -> bool {
        self.calls_only() || format || self.tools.iter().any(|t| t.strict)
    }

    /// Whether every answer is a call (`required` or a named function):
    /// the grammar is then the tools' alone, whatever `response_format`
    /// says.
    pub fn calls_only(&self) -> bool {
        self.choice != ToolChoice::Auto
    }

    /// The system-message text that describes the tools to the model.
    pub fn instruction(&self) -> String {
        let mut text = String::from(
            "You can call functions. To call one, answer with exactly\n<tool_call>\n{\"name\": \"<function name>\", \"arguments\": <the arguments as a JSON object>}\n</tool_call>\nand nothing else. The functions:\n",
        );
        for tool in &self.tools {
            let line = json!({
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
        match &self.choice {
            ToolChoice::Auto => {
                text.push_str("If no function helps, answer in plain text.");
            }
            ToolChoice::Required => text.push_str("You must call one of them."),
            ToolChoice::Named(name) => {
                text.push_str(&format!("You must call {name}."));
            }
        }
        text
    }

    /// The grammar the answer is constrained to, given the request's
    /// `response_format` grammar (`format`): with a `required` or named
    /// choice, one call of an allowed function with arguments valid
    /// against its schema (the format is for a text answer, and there is
    /// none); with `auto`, such a call of any of the tools *or* an answer
    /// in the format — the Agents SDK's tools with a structured output —,
    /// or without a format free text and calls ([`Tools::text_or_calls`]).
    /// A regex or Lark format cannot be joined to calls: 400.
    pub fn grammar(
        &self,
        format: Option<kvfence_model::Grammar>,
    ) -> Result<Option<kvfence_model::Grammar>, ApiError> {
        use kvfence_model::Grammar;
        if !self.callable() {
            return Ok(format);
        }
        if self.choice != ToolChoice::Auto {
            return Ok(Some(Grammar::Lark(self.call_rule("start"))));
        }
        let answer = match format {
            None => return Ok(Some(self.text_or_calls(self.constrains_calls(false)))),
            Some(Grammar::JsonObject) => json!({ "type": "object" }),
            Some(Grammar::JsonSchema(schema)) => schema,
            Some(Grammar::Regex(_) | Grammar::Lark(_)) => {
                return Err(ApiError::invalid(
                    "response_format",
                    "a regex or grammar response_format cannot be combined with tools; use json_schema or json_object",
                ));
            }
        };
        let answer = with_layout(answer);
        let calls = self.call_rule("call");
        Ok(Some(Grammar::Lark(format!(
            "start: call | answer\n{calls}answer: %json {answer}\n"
        ))))
    }

    /// Under plain `auto`: text is free, but each call in it is a call —
    /// an allowed function's name and an arguments object, held to the
    /// function's schema too where `schemas` (a strict tool): a model that
    /// starts a call cannot leave it as markup in its text, or write a
    /// name no tool has. Text before a call is generated until
    /// `<tool_call>` is written (llguidance's `suffix`), so the call's
    /// opening is the text's own end; after a call the model may end, call
    /// again or write text — which the answer drops, as it drops text
    /// after calls unheld — so a model that ends its calls with a remark is
    /// never pushed into another call. At most one call (no
    /// `parallel_tool_calls`): that call and the end (its closing tag is a
    /// kept stop too); at most `n`: `n` calls, then text without a call
    /// — up to [`GRAMMAR_MAX_CALLS`], past which the grammar allows any
    /// number and the parse alone keeps the first `n`.
    fn text_or_calls(&self, schemas: bool) -> kvfence_model::Grammar {
        let arguments = self.arguments_rule(schemas);
        let turns = match self.max_calls {
            Some(1) => "turn".to_string(),
            Some(n) if n <= GRAMMAR_MAX_CALLS => format!("turn{{1,{n}}} plain?"),
            _ => "turn+ plain?".to_string(),
        };
        kvfence_model::Grammar::Lark(format!(
            "start: plain | {turns}\n\
             turn: lead \"\\n\" arguments \"\\n{CLOSE}\"\n\
             plain: PLAIN\n\
             PLAIN: /(?s:.*)/ & ~/(?s:.*){OPEN}(?s:.*)/\n\
             lead[suffix=\"{OPEN}\"]: /(?s:.*)/\n\
             {arguments}"
        ))
    }

    /// Lark rules whose rule `rule` is one call of an allowed function
    /// (any, for `auto`).
    fn call_rule(&self, rule: &str) -> String {
        let arguments = self.arguments_rule(true);
        format!("{rule}: \"{OPEN}\\n\" arguments \"\\n{CLOSE}\"\n{arguments}")
    }

    /// The Lark rule `arguments`: the JSON object between a call's tags,
    /// an allowed function's name and arguments that match its schema
    /// (`schemas`), or any object.
    fn arguments_rule(&self, schemas: bool) -> String {
        let allowed: Vec<&Tool> = match &self.choice {
            ToolChoice::Auto | ToolChoice::Required => self.tools.iter().collect(),
            ToolChoice::Named(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
        };
        let calls: Vec<Value> = allowed
            .iter()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {
                        "name": { "const": t.name },
                        "arguments": if schemas { t.parameters.clone() } else { json!({ "type": "object" }) },
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = with_layout(json!({ "anyOf": calls }));
        format!("arguments: %json {schema}\n")
    }

    /// Strings that end an answer after themselves (kept in it): when it
    /// makes one call at most, the end of a call, so the model stops at its
    /// first call instead of writing more that would be dropped — and that
    /// its tenant would be charged for.
    pub fn kept_stops(&self) -> Vec<String> {
        match self.max_calls {
            // None at all: the answer ends where a call would begin.
            Some(0) => vec![OPEN.to_string()],
            Some(1) => vec![CLOSE.to_string()],
            _ => Vec::new(),
        }
    }

    /// The calls in a finished answer, and the text before the first; no
    /// calls if a complete one is not a call this request's tools allow
    /// (the answer is then text). Only the first calls up to the bound
    /// (one without `parallel_tool_calls`): what follows them is dropped,
    /// as text after calls is. A
    /// call whose closing tag never came is a call if its object was
    /// written whole. A call cut off by the end of the answer (`finish` is
    /// `Length`: `max_tokens`) is never text: it becomes a call with the
    /// arguments written so far, as OpenAI returns one, if its function's
    /// name was written whole and is a known one, and is dropped otherwise
    /// — as is an answer's end cut inside `<tool_call>` itself.
    pub fn parse(&self, text: &str, finish: Option<FinishReason>) -> (String, Vec<Call>) {
        let Some(first) = text.find(OPEN) else {
            let cut_tag = match finish {
                Some(FinishReason::Length) => partial_open(text),
                Some(FinishReason::Stop) | None => 0,
            };
            let text = &text[..text.len() - cut_tag];
            let text = if cut_tag > 0 { text.trim_end() } else { text };
            return (text.to_string(), Vec::new());
        };
        if !self.callable() {
            // No call may be made: the answer ends where one begins.
            return (text[..first].trim_end().to_string(), Vec::new());
        }
        let mut calls = Vec::new();
        let mut rest = &text[first..];
        while let Some(start) = rest.find(OPEN) {
            let body = &rest[start + OPEN.len()..];
            let Some(end) = body.find(CLOSE) else {
                // The closing tag never came. An object written whole is a
                // call (models end an answer without the tag); one cut by
                // max_tokens is a call with its arguments so far; anything
                // else the model ended its answer in is text, as it would
                // be between the tags.
                let mut values = serde_json::Deserializer::from_str(body).into_iter::<Value>();
                match values.next() {
                    Some(Ok(value)) => match self.call_in(&value) {
                        Some(call) => calls.push(call),
                        None => return (text.to_string(), Vec::new()),
                    },
                    _ if finish == Some(FinishReason::Length) => calls.extend(self.cut_call(body)),
                    _ => return (text.to_string(), Vec::new()),
                }
                break;
            };
            let (json_text, after) = (&body[..end], &body[end + CLOSE.len()..]);
            let Ok(value) = serde_json::from_str::<Value>(json_text.trim()) else {
                return (text.to_string(), Vec::new());
            };
            let Some(call) = self.call_in(&value) else {
                return (text.to_string(), Vec::new());
            };
            calls.push(call);
            if self.max_calls.is_some_and(|most| calls.len() >= most) {
                break;
            }
            rest = after;
        }
        (text[..first].trim_end().to_string(), calls)
    }

    /// The call `value` makes, if it is one these tools allow: a known
    /// function's `name` and object `arguments`.
    fn call_in(&self, value: &Value) -> Option<Call> {
        let name = value["name"].as_str()?;
        let arguments = value.get("arguments").filter(|a| a.is_object())?;
        self.tools
            .iter()
            .any(|t| t.name == name)
            .then(|| Call::new(name, arguments.to_string()))
    }

    /// A call whose end never came: `{"name": "NAME", "arguments": ...`
    /// up to where the answer stopped.
    fn cut_call(&self, body: &str) -> Option<Call> {
        let rest = body.trim_start().strip_prefix('{')?.trim_start();
        let rest = rest
            .strip_prefix("\"name\"")?
            .trim_start()
            .strip_prefix(':')?
            .trim_start();
        let rest = rest.strip_prefix('"')?;
        // The name's closing quote: names are `[A-Za-z0-9_-]`, no escapes.
        let (name, rest) = rest.split_once('"')?;
        if !self.tools.iter().any(|t| t.name == name) {
            return None;
        }
        let arguments = rest
            .trim_start()
            .strip_prefix(',')
            .map(str::trim_start)
            .and_then(|r| r.strip_prefix("\"arguments\""))
            .map(str::trim_start)
            .and_then(|r| r.strip_prefix(':'))
            .map_or("", str::trim);
        Some(Call::new(name, arguments.to_string()))
    }
}

/// An earlier assistant turn's calls, rendered as the model is asked to
/// write them.
pub fn render_calls(calls: &[ToolCallIn]) -> String {
    calls
        .iter()
        .map(|call| {
            let arguments: Value = serde_json::from_str(call.function.arguments.expose())
                .unwrap_or_else(|_| Value::String(call.function.arguments.expose().to_string()));
            let line = json!({ "name": call.function.name, "arguments": arguments });
            format!("{OPEN}\n{line}\n{CLOSE}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// How many bytes at the end of `text` could begin `<tool_call>`: the
/// longest such end shorter than the tag, 0 if there is none.
fn partial_open(text: &str) -> usize {
    (1..OPEN.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && OPEN.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// Splits a streamed answer into text that can go out now and a call that
/// is being written: text is held back only while it could still be the
/// start of `<tool_call>`.
#[derive(Debug, Default)]
pub struct StreamSplit {
    held: String,
    /// A call has begun: everything from it on waits for the end.
    in_call: bool,
}

impl StreamSplit {
    /// Takes new text; returns the text that is surely not part of a call.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.in_call {
            return String::new();
        }
        if let Some(at) = self.held.find(OPEN) {
            self.in_call = true;
            let before = self.held[..at].to_string();
            self.held.drain(..at);
            return before;
        }
        let keep = partial_open(&self.held);
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        out
    }

    /// At the end: what was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Option<ToolChoiceIn>) -> Option<Tools> {
        tools_in_parallel(choice, None)
    }

    fn tools_in_parallel(choice: Option<ToolChoiceIn>, parallel: Option<bool>) -> Option<Tools> {
        let list: Vec<ToolIn> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}},
        ]))
        .unwrap();
        Tools::from_request(Some(&list), choice.as_ref(), parallel, None).unwrap()
    }

    #[test]
    fn without_parallel_tool_calls_an_answer_makes_one_call_the_first() {
        let answer = "Checking.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let names = |parallel| {
            let t = tools_in_parallel(None, parallel).unwrap();
            let (content, calls) = t.parse(answer, Some(FinishReason::Stop));
            assert_eq!(content, "Checking.");
            calls.into_iter().map(|c| c.name).collect::<Vec<_>>()
        };
        assert_eq!(names(None), ["now", "get_weather"], "parallel by default");
        assert_eq!(names(Some(true)), ["now", "get_weather"]);
        assert_eq!(names(Some(false)), ["now"]);
        // And the answer ends where its first call does.
        let stops = |parallel| tools_in_parallel(None, parallel).unwrap().kept_stops();
        assert_eq!(stops(Some(false)), [CLOSE]);
        assert!(stops(None).is_empty() && stops(Some(true)).is_empty());
        let kept = kvfence_model::StopStrings::default()
            .keeping(stops(Some(false)))
            .unwrap();
        assert_eq!(
            kept.find(answer),
            answer.find(CLOSE).map(|at| at + CLOSE.len())
        );
        // What follows the first call is dropped whatever it is: a second
        // call cut off by max_tokens, or one the tools do not allow.
        let t = tools_in_parallel(None, Some(false)).unwrap();
        for rest in [
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci",
            "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>",
        ] {
            let text = format!(
                "<tool_call>\n{{\"name\": \"now\", \"arguments\": {{}}}}\n</tool_call>\n{rest}"
            );
            let (content, calls) = t.parse(&text, Some(FinishReason::Length));
            assert_eq!(content, "", "{rest}");
            let names: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
            assert_eq!(names, ["now"], "{rest}");
        }
    }

    #[test]
    fn max_tool_calls_keeps_the_first_calls_and_zero_calls_none() {
        let list: Vec<ToolIn> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather"}},
            {"type": "function", "function": {"name": "now"}},
        ]))
        .unwrap();
        let limited = |parallel, most| Tools::from_request(Some(&list), None, parallel, most);
        let answer = format!(
            "{OPEN}\n{{\"name\": \"now\", \"arguments\": {{}}}}\n{CLOSE}\n\
             {OPEN}\n{{\"name\": \"get_weather\", \"arguments\": {{}}}}\n{CLOSE}\n\
             {OPEN}\n{{\"name\": \"now\", \"arguments\": {{}}}}\n{CLOSE}"
        );
        let names = |parallel, most| {
            let t = limited(parallel, most).unwrap().unwrap();
            let (_, calls) = t.parse(&answer, Some(FinishReason::Stop));
            calls.into_iter().map(|c| c.name).collect::<Vec<_>>()
        };
        assert_eq!(names(None, None), ["now", "get_weather", "now"]);
        assert_eq!(names(None, Some(2)), ["now", "get_weather"]);
        assert_eq!(names(Some(true), Some(3)), ["now", "get_weather", "now"]);
        assert_eq!(names(None, Some(1)), ["now"]);
        // The stricter of the two limits holds.
        assert_eq!(names(Some(false), Some(3)), ["now"]);
        // A bound past what a grammar counts is the parse's alone, and
        // costs the grammar nothing.
        let huge = limited(None, Some(u32::MAX)).unwrap().unwrap();
        let kvfence_model::Grammar::Lark(grammar) = huge.text_or_calls(false) else {
            panic!("plain auto's grammar is Lark");
        };
        assert!(grammar.contains("turn+ plain?"), "{grammar}");
        // The largest bound a grammar counts compiles.
        let tokenizer = kvfence_model::Tokenizer::byte_level(260).unwrap();
        let grammars = kvfence_model::Grammars::new(&tokenizer, 260, &[256]).unwrap();
        let most = limited(None, Some(GRAMMAR_MAX_CALLS as u32))
            .unwrap()
            .unwrap();
        let grammar = most.grammar(None).unwrap().unwrap();
        grammars.compile(&grammar).unwrap().mask().unwrap();
        assert_eq!(names(None, Some(u32::MAX)), ["now", "get_weather", "now"]);
        // One call at most ends the answer at that call, as without
        // parallel calls; more leave the end to the model.
        let stops = |most| limited(None, most).unwrap().unwrap().kept_stops();
        assert_eq!(stops(Some(1)), [CLOSE]);
        assert!(stops(Some(2)).is_empty());
        // None at all: the tools go unused, as under tool_choice none —
        // unless a call is required, which cannot be kept.
        assert!(limited(None, Some(0)).unwrap().is_none());
        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "now"}}),
        ] {
            let choice: ToolChoiceIn = serde_json::from_value(choice).unwrap();
            let error = Tools::from_request(Some(&list), Some(&choice), None, Some(0)).unwrap_err();
            assert_eq!(error.param.as_deref(), Some("max_tool_calls"));
        }
    }

    #[test]
    fn unused_tools_end_the_answer_where_a_call_would_begin() {
        let t = Tools::unused();
        assert!(!t.callable());
        let call = format!("{OPEN}\n{{\"name\": \"now\", \"arguments\": {{}}}}\n{CLOSE}");
        for finish in [FinishReason::Stop, FinishReason::Length] {
            let (content, calls) = t.parse(&format!("It is late.\n{call}"), Some(finish));
            assert_eq!((content.as_str(), calls.len()), ("It is late.", 0));
            let (content, calls) = t.parse(&call, Some(finish));
            assert_eq!((content.as_str(), calls.len()), ("", 0));
        }
        // The opening tag ends generation, kept so the parse above drops it.
        assert_eq!(t.kept_stops(), [OPEN]);
        // Nothing to describe, check or join to a format.
        let format = kvfence_model::Grammar::JsonObject;
        assert!(matches!(
            t.grammar(Some(format)).unwrap(),
            Some(kvfence_model::Grammar::JsonObject)
        ));
        assert!(t.grammar(None).unwrap().is_none());
        let tokenizer = kvfence_model::Tokenizer::byte_level(260).unwrap();
        let grammars = kvfence_model::Grammars::new(&tokenizer, 260, &[256]).unwrap();
        assert!(t.check_schemas(&grammars, true).is_ok());
    }

    #[test]
    fn calls_are_parsed_only_for_known_functions_with_object_arguments() {
        let t = tools(None).unwrap();
        let (content, calls) = t.parse(
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            Some(FinishReason::Stop),
        );
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
        assert!(calls[0].id.starts_with("call_"));
        for text in [
            "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>\n{\"name\": \"now\", \"arguments\": \"x\"}\n</tool_call>",
            "plain answer",
        ] {
            assert!(
                t.parse(text, Some(FinishReason::Stop)).1.is_empty(),
                "{text}"
            );
            assert_eq!(t.parse(text, Some(FinishReason::Stop)).0, text);
        }
    }

    #[test]
    fn a_call_cut_off_is_a_call_with_what_was_written_never_markup() {
        let t = tools(None).unwrap();
        // A whole call, then one cut inside its arguments: both are calls,
        // the second with its arguments so far (as OpenAI returns one).
        let (content, calls) = t.parse(
            "Checking.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",
            Some(FinishReason::Length),
        );
        assert_eq!(content, "Checking.");
        let names: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["now", "get_weather"]);
        assert_eq!(calls[1].arguments, r#"{"city": "Par"#);
        // Cut before the name was whole, or naming no known function: no
        // call, and none of the markup in the content.
        for cut in [
            "Hm.\n<tool_call>\n{\"name\": \"get_wea",
            "Hm.\n<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {",
            "Hm.\n<tool_call> not json",
            "Hm.\n<tool_call>",
        ] {
            let (content, calls) = t.parse(cut, Some(FinishReason::Length));
            assert!(calls.is_empty(), "{cut}");
            assert_eq!(content, "Hm.", "{cut}");
        }
        // Cut right after the name: a call with no arguments yet.
        let (_, calls) = t.parse(
            "<tool_call>\n{\"name\": \"now\"",
            Some(FinishReason::Length),
        );
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("now", "")
        );
    }

    #[test]
    fn a_call_left_unclosed_is_a_call_if_whole_and_text_if_the_model_ended_it_unfinished() {
        let t = tools(None).unwrap();
        // The object written whole, the closing tag never: a call with its
        // arguments, at the end of the answer or cut by max_tokens.
        let whole = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n";
        for finish in [FinishReason::Stop, FinishReason::Length] {
            let (content, calls) = t.parse(whole, Some(finish));
            assert_eq!(content, "Checking.", "{finish:?}");
            assert_eq!(calls.len(), 1, "{finish:?}");
            assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#, "{finish:?}");
        }
        // The model ended its answer inside something that is not a call
        // (here its tools' own description, echoed): text, as a closed
        // tag around the same would be.
        for unfinished in [
            "Sure.\n<tool_call>\n{\"name\":\"get_weather\",\"description\":\"Weather\"}\nIf no function helps, answer in plain text.",
            "<tool_call>\n{\"name\": \"now\"",
            "<tool_call>\n{\"name\": \"now\", \"arguments\": {\"a\": 1}",
        ] {
            let (content, calls) = t.parse(unfinished, Some(FinishReason::Stop));
            assert!(calls.is_empty(), "{unfinished}");
            assert_eq!(content, unfinished);
        }
    }

    #[test]
    fn an_answer_cut_inside_the_calls_opening_tag_shows_none_of_it() {
        let t = tools(None).unwrap();
        // Cut by max_tokens while `<tool_call>` itself was being written
        // (a forced call's first tokens, or a call after some text): the
        // partial tag is markup, never content.
        for (cut, content) in [
            ("<", ""),
            ("<to", ""),
            ("<tool_call", ""),
            ("Checking.\n<tool_ca", "Checking."),
        ] {
            let (text, calls) = t.parse(cut, Some(FinishReason::Length));
            assert!(calls.is_empty(), "{cut}");
            assert_eq!(text, content, "{cut}");
        }
        // An answer that ended on its own keeps its text, whatever its end:
        // only a cut leaves the tag unfinished.
        for ended in ["x <", "see <tool_ca"] {
            assert_eq!(t.parse(ended, Some(FinishReason::Stop)).0, ended);
        }
        // Text cut elsewhere is left whole.
        assert_eq!(t.parse("a <b> c", Some(FinishReason::Length)).0, "a <b> c");
    }

    #[test]
    fn a_choice_of_none_or_no_tools_means_no_tools_and_a_bad_name_is_refused() {
        assert!(tools(Some(ToolChoiceIn::Mode("none".into()))).is_none());
        assert!(
            Tools::from_request(None, None, None, None)
                .unwrap()
                .is_none()
        );
        let named = ToolChoiceIn::Named {
            kind: "function".into(),
            function: NamedFunction {
                name: "missing".into(),
            },
        };
        let list: Vec<ToolIn> =
            serde_json::from_value(json!([{"type": "function", "function": {"name": "now"}}]))
                .unwrap();
        let error = Tools::from_request(Some(&list), Some(&named), None, None).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("tool_choice.function.name"));
        let bad: Vec<ToolIn> = serde_json::from_value(
            json!([{"type": "function", "function": {"name": "has space"}}]),
        )
        .unwrap();
        assert!(Tools::from_request(Some(&bad), None, None, None).is_err());
    }

    #[test]
    fn a_schema_that_cannot_do_its_job_is_refused_by_its_tool_quoting_none_of_it() {
        let tokenizer = kvfence_model::Tokenizer::byte_level(260).unwrap();
        let grammars = kvfence_model::Grammars::new(&tokenizer, 260, &[256]).unwrap();
        let with_second = |parameters: Value| {
            let list: Vec<ToolIn> = serde_json::from_value(json!([
                {"type": "function", "function": {"name": "fine"}},
                {"type": "function", "function": {"name": "second", "parameters": parameters}},
            ]))
            .unwrap();
            Tools::from_request(Some(&list), None, None, None)
                .unwrap()
                .unwrap()
        };
        for constrained in [false, true] {
            assert!(
                tools(None)
                    .unwrap()
                    .check_schemas(&grammars, constrained)
                    .is_ok()
            );
            // Meaningless schemas, refused whether calls are constrained or not.
            for (parameters, secret) in [
                (json!({"type": "wizard_type"}), "wizard_type"),
                (
                    json!({"$ref": "#/definitions/secret_place"}),
                    "secret_place",
                ),
                (
                    json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "(secret_unclosed"}}}),
                    "secret_unclosed",
                ),
            ] {
                let error = with_second(parameters)
                    .check_schemas(&grammars, constrained)
                    .unwrap_err();
                assert_eq!(error.param.as_deref(), Some("tools[1].function.parameters"));
                assert!(!error.message.contains(secret), "{}", error.message);
            }
        }
        // Keywords the compiler cannot enforce describe a function all the
        // same (what Pydantic writes for `SecretStr`, `bytes`, `set[int]`),
        // and are refused only where calls would be held to them.
        for parameters in [
            json!({"type": "object", "properties": {"key": {"type": "string", "format": "password"}}}),
            json!({"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": true}}}),
        ] {
            let tools = with_second(parameters);
            assert!(tools.check_schemas(&grammars, false).is_ok());
            let error = tools.check_schemas(&grammars, true).unwrap_err();
            assert_eq!(error.param.as_deref(), Some("tools[1].function.parameters"));
        }
    }

    #[test]
    fn required_and_named_choices_compile_to_a_grammar_of_calls_only() {
        let tokenizer = kvfence_model::Tokenizer::byte_level(260).unwrap();
        let grammars = kvfence_model::Grammars::new(&tokenizer, 260, &[256]).unwrap();
        for choice in [
            ToolChoiceIn::Mode("required".into()),
            ToolChoiceIn::Named {
                kind: "function".into(),
                function: NamedFunction {
                    name: "get_weather".into(),
                },
            },
        ] {
            let grammar = tools(Some(choice)).unwrap().grammar(None).unwrap().unwrap();
            let mut constraint = grammars.compile(&grammar).unwrap();
            let mask = constraint.mask().unwrap();
            assert!(mask.allows(u32::from(b'<')));
            assert!(!mask.allows(u32::from(b'x')));
        }
    }

    /// Whether `constraint` takes every byte of `text`, and then its end
    /// if `end`.
    fn takes(constraint: &mut kvfence_model::Constraint, text: &str, end: bool) -> bool {
        for byte in text.bytes() {
            if !constraint.mask().unwrap().allows(u32::from(byte)) {
                return false;
            }
            constraint.accept(u32::from(byte)).unwrap();
        }
        !end || constraint.mask().unwrap().allows(256)
    }

    #[test]
    fn under_auto_a_strict_tool_holds_every_call_to_its_schema_and_leaves_text_free() {
        let tokenizer = kvfence_model::Tokenizer::byte_level(260).unwrap();
        let grammars = kvfence_model::Grammars::new(&tokenizer, 260, &[256]).unwrap();
        let strict_list = |strict: Option<bool>| -> Vec<ToolIn> {
            serde_json::from_value(json!([
                {"type": "function", "function": {"name": "get_weather", "strict": strict,
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"], "additionalProperties": false}}},
                {"type": "function", "function": {"name": "now"}},
            ]))
            .unwrap()
        };
        let strict = |strict: Option<bool>, parallel: Option<bool>| {
            Tools::from_request(Some(&strict_list(strict)), None, parallel, None)
                .unwrap()
                .unwrap()
        };
        let call = |city: &str| {
            format!(
                "{OPEN}\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"{city}\"}}}}\n{CLOSE}"
            )
        };
        // Not strict: text is free and a call is a call — a known name and
        // an arguments object — but its arguments are not held to the
        // schema.
        for loose in [None, Some(false)] {
            assert!(!strict(loose, None).constrains_calls(false));
            let grammar = strict(loose, None).grammar(None).unwrap().unwrap();
            for (text, end, taken) in [
                ("It is sunny <b>today</b>, I think.", true, true),
                (&*format!("Checking.\n{}", call("Paris")), true, true),
                (
                    &*format!(
                        "{OPEN}\n{{\"name\": \"get_weather\", \"arguments\": {{\"town\": 1}}}}\n{CLOSE}"
                    ),
                    true,
                    true,
                ),
                // What SmolLM2 wrote unheld: the tool's description in a
                // call it never closed, shown as text.
                (
                    &*format!("{OPEN}\n{{\"name\": \"get_weather\", \"description\""),
                    false,
                    false,
                ),
                (&*format!("{OPEN}\n{{\"name\": \"rm_rf\""), false, false),
                (&*format!("{OPEN}\nnot a call\n{CLOSE}"), false, false),
            ] {
                let mut constraint = grammars.compile(&grammar).unwrap();
                assert_eq!(takes(&mut constraint, text, end), taken, "{text}");
            }
        }
        let tools = strict(Some(true), None);
        assert!(tools.constrains_calls(false));
        let grammar = tools.grammar(None).unwrap().unwrap();
        let now = format!("{OPEN}\n{{\"name\": \"now\", \"arguments\": {{}}}}\n{CLOSE}");
        for (text, end, taken) in [
            // Text with no call is free, `<` and all.
            ("It is sunny <b>today</b>, I think.", true, true),
            ("", true, true),
            // Text, then calls held to their schemas, then the end.
            (&*format!("Checking.\n{}", call("Paris")), true, true),
            (&*format!("{}\n{now}", call("Paris")), true, true),
            // A remark after the calls is free (the answer drops it), and
            // a call in it is held all the same.
            (&*format!("{}\nHope that helps.", call("Paris")), true, true),
            (&*format!("{}\nAlso: {now}", call("Paris")), true, true),
            (
                &*format!("{}\nAlso: {OPEN}\n{{\"name\": \"rm_rf\"", call("Paris")),
                false,
                false,
            ),
            // Arguments off the schema, an unknown function: never written.
            (
                &*format!("{OPEN}\n{{\"name\": \"get_weather\", \"arguments\": {{\"town\""),
                false,
                false,
            ),
            (&*format!("{OPEN}\n{{\"name\": \"rm_rf\""), false, false),
        ] {
            let mut constraint = grammars.compile(&grammar).unwrap();
            assert_eq!(takes(&mut constraint, text, end), taken, "{text}");
        }
        // At most two calls: two, and a remark after them, but no third.
        let grammar = Tools::from_request(Some(&strict_list(Some(true))), None, None, Some(2))
            .unwrap()
            .unwrap()
            .grammar(None)
            .unwrap()
            .unwrap();
        for (text, end, taken) in [
            (&*format!("{}\n{now}", call("Paris")), true, true),
            (&*format!("{}\n{now}\nDone.", call("Paris")), true, true),
            (&*format!("{}\n{now}\n{OPEN}", call("Paris")), false, false),
        ] {
            let mut constraint = grammars.compile(&grammar).unwrap();
            assert_eq!(takes(&mut constraint, text, end), taken, "{text}");
        }
        // Without parallel calls, one call and the end.
        let grammar = strict(Some(true), Some(false))
            .grammar(None)
            .unwrap()
            .unwrap();
        let mut constraint = grammars.compile(&grammar).unwrap();
        assert!(!takes(
            &mut constraint,
            &format!("{}\n", call("Paris")),
            false
        ));
        let mut constraint = grammars.compile(&grammar).unwrap();
        assert!(takes(&mut constraint, &call("Paris"), true));
    }

    #[test]
    fn auto_with_a_structured_output_is_a_call_or_an_answer_in_the_format() {
        use kvfence_model::Grammar;
        let tokenizer = kvfence_model::Tokenizer::byte_level(260).unwrap();
        let grammars = kvfence_model::Grammars::new(&tokenizer, 260, &[256]).unwrap();
        let format = Grammar::JsonSchema(json!({
            "type": "object",
            "properties": {"answer": {"type": "string"}},
            "required": ["answer"],
        }));
        let grammar = tools(None).unwrap().grammar(Some(format)).unwrap().unwrap();
        let mut constraint = grammars.compile(&grammar).unwrap();
        let mask = constraint.mask().unwrap();
        // A call begins with `<`, an answer with `{`; nothing else.
        assert!(mask.allows(u32::from(b'<')) && mask.allows(u32::from(b'{')));
        assert!(!mask.allows(u32::from(b'x')) && !mask.allows(u32::from(b'[')));
        // Walk the answer side: the format's JSON, then the end.
        let mut text = String::new();
        for byte in br#"{"answer": "hi"}"# {
            assert!(
                constraint.mask().unwrap().allows(u32::from(*byte)),
                "{text}"
            );
            constraint.accept(u32::from(*byte)).unwrap();
            text.push(char::from(*byte));
        }
        assert!(constraint.mask().unwrap().allows(256), "the answer may end");
        // A regex format cannot be joined to calls.
        let error = tools(None)
            .unwrap()
            .grammar(Some(Grammar::Regex("x+".into())))
            .unwrap_err();
        assert_eq!(error.param.as_deref(), Some("response_format"));
        // A required call ignores the format: there is no text answer.
        let required = tools(Some(ToolChoiceIn::Mode("required".into()))).unwrap();
        let grammar = required
            .grammar(Some(Grammar::JsonObject))
            .unwrap()
            .unwrap();
        let mut constraint = grammars.compile(&grammar).unwrap();
        assert!(!constraint.mask().unwrap().allows(u32::from(b'{')));
    }

    #[test]
    fn streamed_text_is_held_only_while_it_could_begin_a_call() {
        let mut split = StreamSplit::default();
        assert_eq!(split.push("Hello <"), "Hello ");
        assert_eq!(split.push("b>"), "<b>");
        assert_eq!(split.push(" <tool"), " ");
        assert_eq!(split.push("_call>\n{"), "");
        assert_eq!(split.push("}"), "");
        assert_eq!(split.finish(), "<tool_call>\n{}");
    }
}
