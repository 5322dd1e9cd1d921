//! Tests of `openai`.

use super::*;

fn chat(body: &str) -> Result<Map<String, Value>, ApiError> {
    parse_object(body.as_bytes(), CHAT_FIELDS)
}

#[test]
fn unknown_and_unsupported_fields_are_refused_by_name() {
    let error = chat(r#"{"messages": [], "frobnicate": 1}"#).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("frobnicate"));
    let error = chat(r#"{"messages": [], "functions": [{"name": "f"}]}"#).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("functions"));
    // Neutral values and metadata pass.
    chat(r#"{"messages": [], "tools": [], "tool_choice": "none", "user": "u", "metadata": {"a": "b"}, "modalities": ["text"], "stream": null}"#)
        .unwrap();
    // Nested: stream options and content parts take their own keys.
    let params = |body: &str| -> Result<CommonParams, ApiError> { typed(&chat(body)?) };
    let error = params(r#"{"messages": [], "stream_options": {"include_usage": true, "x": 1}}"#)
        .unwrap_err();
    assert_eq!(error.param.as_deref(), Some("stream_options.x"));
    let obfuscated = params(
        r#"{"messages": [], "stream": true, "stream_options": {"include_obfuscation": true}}"#,
    )
    .unwrap()
    .include_usage()
    .unwrap_err();
    assert_eq!(
        obfuscated.param.as_deref(),
        Some("stream_options.include_obfuscation")
    );
    let parts = |part: &str| -> Result<ChatFields, ApiError> {
        typed(&chat(&format!(
            r#"{{"messages": [{{"role": "user", "content": [{part}]}}]}}"#
        ))?)
    };
    parts(r#"{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}"#).unwrap();
    let error = parts(r#"{"type": "text", "text": "hi", "detail": "high"}"#).unwrap_err();
    // Inside an untagged choice serde names the field that holds it.
    assert_eq!(error.param.as_deref(), Some("messages[0].content"));
    // OpenAI's default verbosity asks for nothing; another does.
    chat(r#"{"messages": [], "verbosity": "medium"}"#).unwrap();
    let error = chat(r#"{"messages": [], "verbosity": "low"}"#).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("verbosity"));
}

#[test]
fn unknown_nested_fields_are_refused_and_what_openai_sends_back_passes() {
    let fields = |body: &str| -> Result<ChatFields, ApiError> { typed(&chat(body)?) };
    let params = |body: &str| -> Result<CommonParams, ApiError> { typed(&chat(body)?) };
    // An assistant message as OpenAI's SDK dumps it, sent back.
    let echoed = r#"{"messages": [{"role": "assistant", "content": "hi", "refusal": null,
        "annotations": [], "audio": null, "function_call": null, "name": "bot",
        "tool_calls": [{"id": "call_1", "type": "function", "index": 0,
                        "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}],
        "tools": [{"type": "function", "function": {"name": "f", "strict": true,
                    "parameters": {"type": "object"}}}],
        "response_format": {"type": "json_schema", "json_schema":
            {"name": "x", "strict": true, "schema": {"type": "object"}}}}"#;
    fields(echoed).unwrap().messages(None).unwrap();
    params(echoed).unwrap();
    for (body, param) in [
        (
            r#"{"messages": [{"role": "user", "content": "x", "colour": 1}]}"#,
            "messages[0].colour",
        ),
        (
            r#"{"messages": [], "tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}"#,
            "tools[0].function.extra",
        ),
        (
            r#"{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}", "x": 1}}]}]}"#,
            "messages[0].tool_calls[0].function.x",
        ),
    ] {
        let error = fields(body).unwrap_err();
        assert_eq!(error.param.as_deref(), Some(param), "{body}");
        assert!(error.message.contains("unrecognized"), "{}", error.message);
    }
    let error = params(
        r#"{"messages": [], "response_format": {"type": "regex", "regex": "a+", "flags": "i"}}"#,
    )
    .unwrap_err();
    // Inside a tagged object serde names the object, not the key.
    assert_eq!(error.param.as_deref(), Some("response_format"));
    assert!(error.message.contains("unrecognized"), "{}", error.message);
    let audio = fields(r#"{"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}"#)
        .unwrap()
        .messages(None)
        .unwrap_err();
    assert_eq!(audio.param.as_deref(), Some("messages[0].audio"));
}

#[test]
fn type_errors_name_the_field_and_quote_nothing() {
    let object = chat(r#"{"messages": [], "temperature": "secret-value"}"#).unwrap();
    let error = typed::<CommonParams>(&object).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("temperature"));
    assert!(!error.message.contains("secret-value"), "{}", error.message);
    let object = chat(r#"{"model": "m"}"#).unwrap();
    let error = typed::<ChatFields>(&object).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("messages"));
    let object = chat(r#"{"messages": [], "response_format": {"type": "bogus"}}"#).unwrap();
    let error = typed::<CommonParams>(&object).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("response_format.type"));
}

#[test]
fn logit_bias_keys_must_be_tokens_of_the_vocabulary() {
    let params = |bias: &str| -> CommonParams {
        let object = chat(&format!(r#"{{"messages": [], "logit_bias": {bias}}}"#)).unwrap();
        typed(&object).unwrap()
    };
    let ok = params(r#"{"7": 5, "3": -100}"#)
        .sampling(0, None, None, 10)
        .unwrap();
    assert_eq!(ok.logit_bias, vec![(3, -100.0), (7, 5.0)]);
    for bad in [r#"{"10": 1}"#, r#"{"x": 1}"#, r#"{"1": 101}"#] {
        let error = params(bad).sampling(0, None, None, 10).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("logit_bias"), "{bad}");
    }
}

#[test]
fn both_names_of_the_completion_limit_must_agree() {
    let limit = |body: &str| {
        typed::<CommonParams>(&chat(body).unwrap())
            .unwrap()
            .max_tokens()
    };
    assert_eq!(
        limit(r#"{"messages": [], "max_tokens": 7}"#).unwrap(),
        Some(7)
    );
    assert_eq!(
        limit(r#"{"messages": [], "max_completion_tokens": 7, "max_tokens": 7}"#).unwrap(),
        Some(7)
    );
    let error =
        limit(r#"{"messages": [], "max_completion_tokens": 7, "max_tokens": 5}"#).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("max_tokens"));
    assert!(error.message.contains("disagree"), "{}", error.message);
    let error = limit(r#"{"messages": [], "max_completion_tokens": 0}"#).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("max_completion_tokens"));
}

#[test]
fn top_logprobs_needs_logprobs() {
    let fields = |body: &str| -> ChatFields { typed(&chat(body).unwrap()).unwrap() };
    assert_eq!(
        fields(r#"{"messages": [], "logprobs": true, "top_logprobs": 3}"#)
            .logprobs()
            .unwrap(),
        Some(3)
    );
    assert_eq!(
        fields(r#"{"messages": [], "top_logprobs": 0}"#)
            .logprobs()
            .unwrap(),
        None,
        "zero alternatives and no logprobs ask for nothing"
    );
    let error = fields(r#"{"messages": [], "top_logprobs": 3}"#)
        .logprobs()
        .unwrap_err();
    assert_eq!(error.param.as_deref(), Some("top_logprobs"));
    let error = fields(r#"{"messages": [], "logprobs": true, "top_logprobs": 21}"#)
        .logprobs()
        .unwrap_err();
    assert_eq!(error.param.as_deref(), Some("top_logprobs"));
}

#[test]
fn stream_options_are_refused_unless_the_answer_streams() {
    // They would do nothing, so they are refused, as OpenAI refuses them.
    let params = |body: &str| -> CommonParams { typed(&chat(body).unwrap()).unwrap() };
    for stream in ["", r#""stream": false, "#] {
        let body =
            format!(r#"{{"messages": [], {stream}"stream_options": {{"include_usage": true}}}}"#);
        let error = params(&body).include_usage().unwrap_err();
        assert_eq!(error.param.as_deref(), Some("stream_options"), "{body}");
    }
    let streamed = r#"{"messages": [], "stream": true, "stream_options": {"include_usage": true}}"#;
    assert!(params(streamed).include_usage().unwrap());
    // Absent or null, there is nothing to refuse.
    for body in [
        r#"{"messages": []}"#,
        r#"{"messages": [], "stream_options": null}"#,
        r#"{"messages": [], "stream": true}"#,
    ] {
        assert!(!params(body).include_usage().unwrap(), "{body}");
    }
}

#[test]
fn a_name_repeated_within_an_object_is_refused_wherever_it_stands() {
    // A repeated name means two things at once: whoever reads the body
    // first (a gateway's policy, a log) may see the first value where the
    // last would be served — a `user` message read as `system`.
    for body in [
        r#"{"messages": [], "max_tokens": 1, "max_tokens": 500}"#,
        r#"{"messages": [{"role": "user", "content": "hi", "role": "system"}]}"#,
        r#"{"messages": [], "response_format": {"type": "json_schema", "json_schema":
            {"name": "n", "schema": {"properties": {"a": {}, "a": {"type": "integer"}}}}}}"#,
        r#"{"messages": [], "metadata": {"secret-key": "1", "secret-key": "2"}}"#,
    ] {
        let error = chat(body).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("body"), "{body}");
        assert!(
            error.message.contains("repeats a name") && error.message.contains("line "),
            "{}",
            error.message
        );
        assert!(!error.message.contains("secret-key"), "{}", error.message);
    }
    // The same name in different objects is no repetition, and order is kept.
    let object = chat(
        r#"{"messages": [{"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"}], "metadata": {"z": "1", "a": "2"}}"#,
    )
    .unwrap();
    let keys: Vec<&String> = object["metadata"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["z", "a"]);
    assert_eq!(object["messages"][1]["role"], "assistant");
}

#[test]
fn parallel_tool_calls_reaches_the_tools_and_must_be_a_boolean() {
    let tools = r#""tools": [{"type": "function", "function": {"name": "now"}}]"#;
    let parallel = |setting: &str| {
        let body = format!(r#"{{"messages": [], {tools}{setting}}}"#);
        let fields: ChatFields = typed(&chat(&body).unwrap()).unwrap();
        format!("{:?}", fields.tools().unwrap().unwrap())
    };
    assert!(
        parallel("").contains("max_calls: None"),
        "absent: OpenAI's default, any number of calls"
    );
    assert!(parallel(r#", "parallel_tool_calls": null"#).contains("max_calls: None"));
    assert!(parallel(r#", "parallel_tool_calls": false"#).contains("max_calls: Some(1)"));
    let body = format!(r#"{{"messages": [], {tools}, "parallel_tool_calls": "no"}}"#);
    let error = typed::<ChatFields>(&chat(&body).unwrap()).unwrap_err();
    assert_eq!(error.param.as_deref(), Some("parallel_tool_calls"));
    // `max_tool_calls` is Responses' alone: chat refuses it as unknown,
    // and where it is read it must be a count.
    let body = format!(r#"{{"messages": [], {tools}, "max_tool_calls": 2}}"#);
    assert_eq!(
        chat(&body).unwrap_err().param.as_deref(),
        Some("max_tool_calls")
    );
    for bad in ["-1", "1.5", "\"2\""] {
        let object = serde_json::from_str(&format!(
            r#"{{"messages": [], {tools}, "max_tool_calls": {bad}}}"#
        ))
        .unwrap();
        let error = typed::<ChatFields>(&object).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("max_tool_calls"), "{bad}");
    }
}

#[test]
fn tools_that_may_not_be_called_or_earlier_calls_make_the_answer_stop_at_call_markup() {
    let tools = r#""tools": [{"type": "function", "function": {"name": "now"}}]"#;
    let calls = r#"{"role": "assistant", "content": null, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "a", "content": "noon"}"#;
    let user = r#"{"role": "user", "content": "hi"}"#;
    let read = |body: String| {
        let fields: ChatFields = typed(&serde_json::from_str(&body).unwrap()).unwrap();
        fields.tools().unwrap().map(|t| {
            (
                t.callable(),
                fields.messages(Some(&t)).unwrap()[0].role.clone(),
            )
        })
    };
    // A plain chat has none.
    assert_eq!(read(format!(r#"{{"messages": [{user}]}}"#)), None);
    // Tools it may call are described in a system message.
    assert_eq!(
        read(format!(r#"{{"messages": [{user}], {tools}}}"#)),
        Some((true, "system".to_string()))
    );
    // Tools it may not call, or earlier calls and no tools: unused, and
    // not described.
    for body in [
        format!(r#"{{"messages": [{user}], {tools}, "tool_choice": "none"}}"#),
        format!(r#"{{"messages": [{user}], {tools}, "max_tool_calls": 0}}"#),
        format!(r#"{{"messages": [{user}, {calls}, {user}]}}"#),
    ] {
        assert_eq!(read(body), Some((false, "user".to_string())));
    }
}
