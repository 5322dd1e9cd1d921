//! The OpenAI API surface as clients use it: no field dropped in silence,
//! structured outputs, log-probabilities, `n` choices, penalties, batches
//! and `echo`, the error envelope on every error, CORS, `models/{id}`.
//! Colocated and disaggregated alike where the engine is involved.

#![allow(clippy::unwrap_used)]

use serde_json::{Value, json};

use crate::common::{Server, post, sse};

fn chat(content: &str, max_tokens: usize) -> Value {
    json!({
        "model": "builtin:tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

fn with(mut body: Value, patch: Value) -> Value {
    for (k, v) in patch.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The `data:` payloads of a stream, parsed, without `[DONE]`.
fn chunks(data: &[String]) -> Vec<Value> {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    data[..data.len() - 1]
        .iter()
        .map(|c| serde_json::from_str(c).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn no_field_is_dropped_in_silence() {
    let server = Server::start(&[]);
    let url = server.url("/v1/chat/completions");
    // What Pydantic writes for a `SecretStr` argument.
    let secret_key =
        json!({"type": "object", "properties": {"key": {"type": "string", "format": "password"}}});
    for (patch, param) in [
        (json!({"frobnicate": true}), "frobnicate"),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "has space"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"response_format": {"type": "bogus"}}),
            "response_format.type",
        ),
        (
            json!({"response_format": {"type": "regex", "regex": "(unclosed"}}),
            "response_format",
        ),
        // A tool's schema that cannot constrain its arguments is refused by
        // its tool whatever the choice (`auto` constrains nothing).
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
                   "tool_choice": "required"}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}},
                             {"type": "function", "function": {"name": "g", "parameters": {"$ref": "#/nowhere"}}}],
                   "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tools[1].function.parameters",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}}),
            "response_format",
        ),
        // A keyword the compiler cannot enforce, where calls are held to it.
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": secret_key}}],
                   "tool_choice": "required"}),
            "tools[0].function.parameters",
        ),
        (json!({"logit_bias": {"999999": 5}}), "logit_bias"),
        (json!({"logit_bias": {"3": 150}}), "logit_bias"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"max_tokens": "many"}), "max_tokens"),
        (json!({"n": 17}), "n"),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
    ] {
        let (status, answer) = post(&url, None, with(chat("hi", 2), patch.clone())).await;
        assert_eq!(status, 400, "{patch}: {answer}");
        assert_eq!(answer["error"]["type"], "invalid_request_error", "{answer}");
        assert_eq!(answer["error"]["param"], param, "{patch}: {answer}");
    }
    // Metadata and nulls are accepted wherever OpenAI accepts them.
    let accepted = with(
        chat("hi", 2),
        json!({"user": "u-1", "metadata": {"k": "v"}, "store": false, "stream": null,
               "stream_options": null, "tools": [], "tool_choice": "none",
               "parallel_tool_calls": true, "seed": null, "stop": null, "n": null}),
    );
    let (status, body) = post(&url, None, accepted).await;
    assert_eq!(status, 200, "{body}");
    // Under `auto` such a schema only describes its function: served.
    let described = json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": secret_key}}]});
    let (status, body) = post(&url, None, with(chat("hi", 2), described)).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body["system_fingerprint"]
            .as_str()
            .unwrap()
            .starts_with("fp_")
    );
    let completions = server.url("/v1/completions");
    for (patch, param) in [
        (json!({"suffix": "tail"}), "suffix"),
        (json!({"best_of": 3}), "best_of"),
        (json!({"logprobs": 6}), "logprobs"),
        (json!({"prompt_logprobs": 21}), "prompt_logprobs"),
        (json!({"prompt_logprobs": -1}), "prompt_logprobs"),
        (
            json!({"prompt_logprobs": 1, "stream": true}),
            "prompt_logprobs",
        ),
    ] {
        let body = with(json!({"prompt": "go", "max_tokens": 2}), patch.clone());
        let (status, answer) = post(&completions, None, body).await;
        assert_eq!(
            (status, &answer["error"]["param"]),
            (400, &json!(param)),
            "{patch}: {answer}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_error_comes_in_the_openai_envelope_and_models_can_be_retrieved() {
    let server = Server::start(&["--max-body-bytes", "1000"]);
    let client = reqwest::Client::new();
    let envelope = |status: u16, body: &Value| {
        assert!(body["error"]["message"].is_string(), "{status}: {body}");
        assert!(body["error"]["type"].is_string(), "{status}: {body}");
    };
    let cases = [
        (client.get(server.url("/v1/nothing-here")), 404),
        (client.get(server.url("/v1/chat/completions")), 405),
        (client.delete(server.url("/v1/models")), 405),
        (
            client
                .post(server.url("/v1/completions"))
                .body(format!("{{\"prompt\": \"{}\"}}", "x".repeat(2000))),
            413,
        ),
        // A compressed body is refused as such, not as "invalid JSON".
        (
            client
                .post(server.url("/v1/chat/completions"))
                .header("content-encoding", "gzip")
                .body(vec![0x1f, 0x8b, 8, 0]),
            415,
        ),
        (client.get(server.url("/v1/models/other-model")), 404),
    ];
    for (request, status) in cases {
        let response = request.send().await.unwrap();
        assert_eq!(response.status().as_u16(), status);
        let body: Value = response.json().await.unwrap();
        envelope(status, &body);
        if status == 415 {
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("Content-Encoding"),
                "{body}"
            );
        }
    }
    let model = server.get_json("/v1/models/builtin:tiny").await;
    assert_eq!(model["id"], "builtin:tiny");
    assert_eq!(model["object"], "model");
}

#[tokio::test(flavor = "multi_thread")]
async fn cors_is_off_unless_an_origin_is_named() {
    let preflight = |server: &Server| {
        reqwest::Client::new()
            .request(reqwest::Method::OPTIONS, server.url("/v1/chat/completions"))
            .header("origin", "https://app.example.com")
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization,content-type",
            )
            .send()
    };
    let closed = Server::start(&[]);
    let answer = preflight(&closed).await.unwrap();
    assert!(
        answer
            .headers()
            .get("access-control-allow-origin")
            .is_none()
    );
    let open = Server::start(&["--cors-origin", "https://app.example.com"]);
    let answer = preflight(&open).await.unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(
        answer.headers()["access-control-allow-origin"],
        "https://app.example.com"
    );
    let other = reqwest::Client::new()
        .request(reqwest::Method::OPTIONS, open.url("/v1/chat/completions"))
        .header("origin", "https://evil.example.net")
        .header("access-control-request-method", "POST")
        .send()
        .await
        .unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none());
    // A stored response may be deleted from the page that made it.
    let delete = reqwest::Client::new()
        .request(reqwest::Method::OPTIONS, open.url("/v1/responses/resp_0"))
        .header("origin", "https://app.example.com")
        .header("access-control-request-method", "DELETE")
        .send()
        .await
        .unwrap();
    let allowed = delete.headers()["access-control-allow-methods"]
        .to_str()
        .unwrap();
    assert!(allowed.contains("DELETE"), "{allowed}");
    // A real request from the named origin carries the header too.
    let response = reqwest::Client::new()
        .post(open.url("/v1/chat/completions"))
        .header("origin", "https://app.example.com")
        .json(&chat("hi", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["access-control-allow-origin"],
        "https://app.example.com"
    );
    // Its script may read the request's id (and the rate headers).
    let exposed = response.headers()["access-control-expose-headers"]
        .to_str()
        .unwrap();
    assert!(exposed.contains("x-request-id"), "{exposed}");
}

/// The modes the engine-facing cases run in.
fn modes() -> [&'static [&'static str]; 2] {
    [&[], &["--mode", "disaggregated", "--handoff", "tcp"]]
}

#[tokio::test(flavor = "multi_thread")]
async fn structured_outputs_match_their_schema_or_regex_in_every_mode() {
    let schema = json!({
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "size": {"enum": ["small", "large"]},
        },
        "required": ["ok", "size"],
        "additionalProperties": false,
    });
    for mode in modes() {
        let server = Server::start(mode);
        let url = server.url("/v1/chat/completions");
        for temperature in [0.0, 1.0] {
            let body = with(
                chat("describe it", 40),
                json!({"temperature": temperature, "seed": 5, "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "thing", "schema": schema, "strict": true},
                }}),
            );
            let (status, answer) = post(&url, None, body).await;
            assert_eq!(status, 200, "{mode:?}: {answer}");
            let text = answer["choices"][0]["message"]["content"].as_str().unwrap();
            let value: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(value["ok"].is_boolean(), "{text}");
            assert!(
                ["small", "large"].contains(&value["size"].as_str().unwrap()),
                "{text}"
            );
            assert_eq!(value.as_object().unwrap().len(), 2, "{text}");
            assert_eq!(answer["choices"][0]["finish_reason"], "stop");
        }
        let body = with(
            chat("a code", 20),
            json!({"response_format": {"type": "regex", "regex": "[a-c]{4}-[0-9]{3}"}, "stream": true}),
        );
        let (status, data) = sse(&url, None, body).await;
        assert_eq!(status, 200);
        let text: String = chunks(&data)
            .iter()
            .filter_map(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        let (letters, digits) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
        assert!(
            letters.len() == 4 && letters.bytes().all(|b| (b'a'..=b'c').contains(&b)),
            "{text:?}"
        );
        assert!(
            digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()),
            "{text:?}"
        );
        // Without a format the same request is free text.
        let (_, free) = post(&url, None, chat("a code", 20)).await;
        let free = free["choices"][0]["message"]["content"].as_str().unwrap();
        assert_ne!(free, text, "the format changed nothing");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn logprobs_come_from_the_draws_distribution_streamed_or_not_in_every_mode() {
    for mode in modes() {
        let server = Server::start(mode);
        let url = server.url("/v1/chat/completions");
        let body = with(
            chat("count", 6),
            json!({"logprobs": true, "top_logprobs": 3, "ignore_eos": true}),
        );
        let (status, answer) = post(&url, None, body.clone()).await;
        assert_eq!(status, 200, "{answer}");
        let content = answer["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap();
        assert_eq!(content.len(), 6, "one entry per token");
        let mut text = String::new();
        for entry in content {
            let top = entry["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 3);
            let mass: f64 = top
                .iter()
                .map(|t| t["logprob"].as_f64().unwrap().exp())
                .sum();
            assert!(mass <= 1.0 + 1e-6, "{entry}");
            // Greedy: the chosen token is the most likely one.
            assert_eq!(entry["token"], top[0]["token"], "{entry}");
            assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
            let bytes: Vec<u8> = entry["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect();
            text.push_str(&String::from_utf8_lossy(&bytes));
        }
        assert_eq!(
            text,
            answer["choices"][0]["message"]["content"].as_str().unwrap()
        );
        // Streamed: the same entries, spread over the chunks.
        let (_, data) = sse(&url, None, with(body, json!({"stream": true}))).await;
        let streamed: Vec<Value> = chunks(&data)
            .iter()
            .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
            .flatten()
            .collect();
        assert_eq!(&streamed, content, "{mode:?}");
        // Completions: the legacy shape.
        let (_, legacy) = post(
            &server.url("/v1/completions"),
            None,
            json!({"prompt": "go", "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": true}),
        )
        .await;
        let logprobs = &legacy["choices"][0]["logprobs"];
        assert_eq!(logprobs["tokens"].as_array().unwrap().len(), 4, "{legacy}");
        assert_eq!(logprobs["token_logprobs"].as_array().unwrap().len(), 4);
        assert_eq!(logprobs["top_logprobs"][0].as_object().unwrap().len(), 2);
        assert_eq!(logprobs["text_offset"][0], 0);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn prompts_are_scored_with_echo_and_logprobs_or_prompt_logprobs_in_every_mode() {
    for mode in modes() {
        let server = Server::start(mode);
        let url = server.url("/v1/completions");
        let prompt: Vec<u32> = (0..40).map(|i| (i * 11 + 3) % 250).collect();
        // The greedy token after all but the prompt's last, and its
        // log-probability, as generated.
        let (status, next) = post(
            &url,
            None,
            json!({"prompt": prompt[..39], "max_tokens": 1, "temperature": 0, "logprobs": 0,
                   "ignore_eos": true}),
        )
        .await;
        assert_eq!(status, 200, "{next}");
        let generated = &next["choices"][0]["logprobs"];
        // No alternatives asked for: the chosen token alone (OpenAI's
        // legacy format always shows it, so up to `logprobs` + 1 entries).
        assert_eq!(
            generated["top_logprobs"][0],
            json!({generated["tokens"][0].as_str().unwrap(): generated["token_logprobs"][0]}),
            "{generated}"
        );
        // Drawn at a high temperature, tokens that are not the most likely
        // still show in their alternatives, with their own log-probability.
        let (status, drawn) = post(
            &url,
            None,
            json!({"prompt": prompt, "max_tokens": 8, "temperature": 2, "seed": 7,
                   "logprobs": 1, "ignore_eos": true}),
        )
        .await;
        assert_eq!(status, 200, "{drawn}");
        let drawn = &drawn["choices"][0]["logprobs"];
        for (i, token) in drawn["tokens"].as_array().unwrap().iter().enumerate() {
            let top = drawn["top_logprobs"][i].as_object().unwrap();
            assert!((1..=2).contains(&top.len()), "{i}: {drawn}");
            let own = top.get(token.as_str().unwrap());
            assert_eq!(own, Some(&drawn["token_logprobs"][i]), "{i}: {drawn}");
        }
        // Echoed and scored, two alternatives per token.
        let body = json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": true,
                          "logprobs": 2, "ignore_eos": true});
        let (status, echoed) = post(&url, None, body.clone()).await;
        assert_eq!(status, 200, "{echoed}");
        let choice = &echoed["choices"][0];
        let logprobs = &choice["logprobs"];
        let tokens = logprobs["tokens"].as_array().unwrap();
        let scores = logprobs["token_logprobs"].as_array().unwrap();
        assert_eq!((tokens.len(), scores.len()), (43, 43), "{logprobs}");
        assert!(scores[0].is_null() && logprobs["top_logprobs"][0].is_null());
        for i in 1..43 {
            assert!(scores[i].as_f64().unwrap() <= 0.0, "{i}: {logprobs}");
            // Keyed by text: tokens spelled alike (bytes of one
            // character) share a key, as in OpenAI's legacy format. The
            // two most likely, and the prompt's own token with its score
            // where it is not one of them.
            let top = logprobs["top_logprobs"][i].as_object().unwrap();
            assert!((1..=3).contains(&top.len()), "{i}: {logprobs}");
            let own = tokens[i].as_str().unwrap();
            assert_eq!(top.get(own), Some(&scores[i]), "{i}: {logprobs}");
        }
        // The text is the echoed prompt then the completion, and every
        // token's offset is where its text begins.
        let text = choice["text"].as_str().unwrap();
        let offsets: Vec<usize> = logprobs["text_offset"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o.as_u64().unwrap() as usize)
            .collect();
        let chars: Vec<char> = text.chars().collect();
        assert_eq!(offsets[0], 0);
        for (token, window) in tokens.iter().zip(offsets.windows(2)) {
            let token = token.as_str().unwrap();
            assert!(window[0] <= window[1] && window[1] <= chars.len());
            // A whole-character token's text is the text's at its offset
            // (a byte of a longer character shows as U+FFFD).
            if !token.contains('\u{FFFD}') {
                let at: String = chars[window[0]..window[1]].iter().collect();
                assert_eq!(at, token, "{offsets:?}");
            }
        }
        // Streamed: the echo and its scores lead, then the completion's.
        let (_, data) = sse(&url, None, with(body, json!({"stream": true}))).await;
        let streamed: Vec<Value> = chunks(&data)
            .iter()
            .filter_map(|c| {
                c["choices"][0]["logprobs"]["token_logprobs"]
                    .as_array()
                    .cloned()
            })
            .flatten()
            .collect();
        assert_eq!(&streamed, scores, "{mode:?}");
        // With n, the first choice scores the prompt and every choice
        // shows it, streamed or not.
        let two = json!({"prompt": prompt, "max_tokens": 2, "n": 2, "temperature": 0,
                         "echo": true, "logprobs": 1, "ignore_eos": true});
        let (status, answer) = post(&url, None, two.clone()).await;
        assert_eq!(status, 200, "{answer}");
        for choice in answer["choices"].as_array().unwrap() {
            let got = choice["logprobs"]["token_logprobs"].as_array().unwrap();
            assert_eq!(got[..40], scores[..40], "{choice}");
        }
        let (_, data) = sse(&url, None, with(two, json!({"stream": true}))).await;
        let mut streamed = [Vec::new(), Vec::new()];
        for chunk in chunks(&data) {
            for choice in chunk["choices"].as_array().unwrap() {
                let index = choice["index"].as_u64().unwrap() as usize;
                if let Some(got) = choice["logprobs"]["token_logprobs"].as_array() {
                    streamed[index].extend(got.iter().cloned());
                }
            }
        }
        for got in streamed {
            assert_eq!(got.len(), 42, "{mode:?}");
            assert_eq!(got[..40], scores[..40], "{mode:?}");
        }
        // vLLM's field: per choice, the prompt's own token with its rank.
        let (status, listed) = post(
            &url,
            None,
            json!({"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1}),
        )
        .await;
        assert_eq!(status, 200, "{listed}");
        let listed = listed["choices"][0]["prompt_logprobs"].as_array().unwrap();
        assert_eq!(listed.len(), 40);
        assert!(listed[0].is_null());
        for i in 1..40 {
            let own = &listed[i][prompt[i].to_string()];
            assert!(own["rank"].as_u64().unwrap() >= 1, "{}", listed[i]);
            assert_eq!(own["logprob"], scores[i], "the same score both ways");
            let best = listed[i]
                .as_object()
                .unwrap()
                .values()
                .find(|e| e["rank"] == 1)
                .unwrap_or_else(|| panic!("{}", listed[i]));
            assert!(best["logprob"].as_f64() >= own["logprob"].as_f64());
        }
        // Where the last token is scored, the most likely one is what a
        // greedy draw there picks, with the log-probability it had.
        let best = listed[39]
            .as_object()
            .unwrap()
            .values()
            .find(|e| e["rank"] == 1)
            .unwrap();
        assert_eq!(best["decoded_token"], generated["tokens"][0], "{best}");
        let drawn = generated["token_logprobs"][0].as_f64().unwrap();
        let scored = best["logprob"].as_f64().unwrap();
        assert!((drawn - scored).abs() < 1e-5, "{drawn} vs {scored}");
        // Chat: once, at the top (vLLM's place), for the templated prompt.
        let (status, chat_answer) = post(
            &server.url("/v1/chat/completions"),
            None,
            with(chat("hi", 2), json!({"prompt_logprobs": 0})),
        )
        .await;
        assert_eq!(status, 200, "{chat_answer}");
        let listed = chat_answer["prompt_logprobs"].as_array().unwrap();
        assert_eq!(
            listed.len() as u64,
            chat_answer["usage"]["prompt_tokens"].as_u64().unwrap()
        );
        assert!(listed[0].is_null() && listed[1].as_object().unwrap().len() == 1);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn n_choices_draw_from_distinct_seeds_and_compute_the_prompt_once() {
    let server = Server::start(&[]);
    let url = server.url("/v1/chat/completions");
    let long = "a shared prompt long enough to fill pages ".repeat(4);
    let hits_before = server.metric("kvfence_prefix_cache_hit_tokens_total").await;
    let body = with(
        chat(&long, 8),
        json!({"n": 3, "temperature": 1.0, "seed": 11, "ignore_eos": true}),
    );
    let (status, answer) = post(&url, None, body.clone()).await;
    assert_eq!(status, 200, "{answer}");
    let choices = answer["choices"].as_array().unwrap();
    let texts: Vec<&str> = choices
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        choices
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 1, 2]
    );
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    assert_eq!(answer["usage"]["completion_tokens"], 24);
    let prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    // Choices 1 and 2 read the prompt the first computed.
    let hits = server.metric("kvfence_prefix_cache_hit_tokens_total").await - hits_before;
    assert!(hits >= 2.0 * (prompt as f64 - 16.0), "{hits} of {prompt}");
    // The same seed gives the same three again; streamed, each under its index.
    let (_, data) = sse(&url, None, with(body, json!({"stream": true}))).await;
    let mut streamed = [String::new(), String::new(), String::new()];
    for chunk in chunks(&data) {
        for choice in chunk["choices"].as_array().unwrap() {
            let index = choice["index"].as_u64().unwrap() as usize;
            streamed[index].push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(
        streamed.iter().map(String::as_str).collect::<Vec<_>>(),
        texts
    );
    // A batch of prompts in /v1/completions, n each, echo on.
    let (status, batch) = post(
        &server.url("/v1/completions"),
        None,
        json!({"prompt": ["first", "second"], "n": 2, "max_tokens": 3, "echo": true, "seed": 3}),
    )
    .await;
    assert_eq!(status, 200, "{batch}");
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        let prompt = if i < 2 { "first" } else { "second" };
        assert!(
            choice["text"].as_str().unwrap().starts_with(prompt),
            "{choice}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn penalties_and_logit_bias_change_the_output() {
    let server = Server::start(&[]);
    let url = server.url("/v1/completions");
    let base =
        json!({"prompt": "the the the", "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let run = |patch: Value| {
        let url = url.clone();
        let body = with(base.clone(), patch);
        async move {
            let (status, answer) = post(&url, None, body).await;
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["text"].as_str().unwrap().to_string()
        }
    };
    let plain = run(json!({})).await;
    assert_eq!(run(json!({})).await, plain, "greedy is repeatable");
    for patch in [
        json!({"frequency_penalty": 2.0}),
        json!({"presence_penalty": 2.0}),
        json!({"repetition_penalty": 3.0}),
    ] {
        assert_ne!(run(patch.clone()).await, plain, "{patch} changed nothing");
    }
    // Banning the first greedy token moves the first token.
    let chat_url = server.url("/v1/chat/completions");
    let first = |patch: Value| {
        let url = chat_url.clone();
        let body = with(
            chat("the the the", 1),
            with(json!({"logprobs": true}), patch),
        );
        async move {
            let (status, answer) = post(&url, None, body).await;
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["logprobs"]["content"][0]["bytes"].clone()
        }
    };
    let greedy = first(json!({})).await;
    // builtin:tiny's tokens are single bytes: the byte is the id.
    let token = greedy[0].as_u64().unwrap();
    assert_eq!(greedy.as_array().unwrap().len(), 1, "{greedy}");
    let moved = first(json!({"logit_bias": {token.to_string(): -100}})).await;
    assert_ne!(moved, greedy);
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "additionalProperties": false,
                "properties": {"city": {"type": "string", "maxLength": 12},
                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    ])
}

/// The arguments of a weather call, checked against its schema.
fn check_weather(arguments: &str) {
    let arguments: Value =
        serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{arguments:?}: {e}"));
    assert!(
        arguments["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 12),
        "{arguments}"
    );
    assert!(
        ["celsius", "fahrenheit"].contains(&arguments["unit"].as_str().unwrap()),
        "{arguments}"
    );
    assert_eq!(arguments.as_object().unwrap().len(), 2, "{arguments}");
}

#[tokio::test(flavor = "multi_thread")]
async fn tools_are_called_as_required_named_and_streamed_in_every_mode() {
    for mode in modes() {
        let server = Server::start(mode);
        let url = server.url("/v1/chat/completions");
        let ask = |choice: Value| {
            with(
                chat("weather in Paris?", 300),
                json!({"tools": weather_tools(), "tool_choice": choice, "temperature": 0.8, "seed": 2}),
            )
        };
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        for choice in [json!("required"), named.clone()] {
            let (status, answer) = post(&url, None, ask(choice.clone())).await;
            assert_eq!(status, 200, "{answer}");
            let reply = &answer["choices"][0];
            assert_eq!(reply["finish_reason"], "tool_calls", "{choice}: {answer}");
            let call = &reply["message"]["tool_calls"][0];
            assert!(call["id"].as_str().unwrap().starts_with("call_"));
            assert_eq!(call["type"], "function");
            let name = call["function"]["name"].as_str().unwrap();
            if choice == named || name == "get_weather" {
                assert_eq!(name, "get_weather");
                check_weather(call["function"]["arguments"].as_str().unwrap());
            } else {
                assert_eq!(name, "get_time");
            }
        }
        // Streamed: a header with the id and name, then the arguments, then
        // the finish.
        let (status, data) = sse(&url, None, with(ask(named), json!({"stream": true}))).await;
        assert_eq!(status, 200);
        let chunks = chunks(&data);
        let calls: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
            .collect();
        assert_eq!(calls.len(), 2, "{data:?}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert!(calls[0]["id"].is_string());
        let arguments: String = calls
            .iter()
            .map(|c| c["function"]["arguments"].as_str().unwrap())
            .collect();
        check_weather(&arguments);
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "tool_calls"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn tools_and_earlier_calls_reach_the_prompt() {
    let server = Server::start(&[]);
    let url = server.url("/v1/chat/completions");
    let prompt_tokens = |body: Value| {
        let url = url.clone();
        async move {
            let (status, answer) = post(&url, None, body).await;
            assert_eq!(status, 200, "{answer}");
            answer["usage"]["prompt_tokens"].as_u64().unwrap()
        }
    };
    let plain = prompt_tokens(chat("weather in Paris?", 2)).await;
    let described = prompt_tokens(with(
        chat("weather in Paris?", 2),
        json!({"tools": weather_tools()}),
    ))
    .await;
    assert!(
        described > plain + 50,
        "the tools are described: {described} vs {plain}"
    );
    let none = prompt_tokens(with(
        chat("weather in Paris?", 2),
        json!({"tools": weather_tools(), "tool_choice": "none"}),
    ))
    .await;
    assert_eq!(none, plain, "tool_choice none describes nothing");
    // A round trip: the call, its result, and the question again.
    let round_trip = |with_call: bool| {
        let mut messages = vec![json!({"role": "user", "content": "weather in Paris?"})];
        if with_call {
            messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]}));
            messages.push(
                json!({"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}),
            );
        }
        json!({"model": "builtin:tiny", "messages": messages, "max_tokens": 2, "tools": weather_tools()})
    };
    let before = prompt_tokens(round_trip(false)).await;
    let after = prompt_tokens(round_trip(true)).await;
    // The rendered call and the result are both in the prompt.
    let call_and_result = r#"<tool_call>
{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}
</tool_call>21 degrees, sunny"#;
    assert!(
        after >= before + call_and_result.len() as u64,
        "{after} vs {before}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_responses_api_answers_streams_and_calls_tools_in_every_mode() {
    for mode in modes() {
        let server = Server::start(mode);
        let url = server.url("/v1/responses");
        let (status, answer) = post(
            &url,
            None,
            json!({"model": "builtin:tiny", "instructions": "Be brief.", "input": "hello",
                   "max_output_tokens": 5, "temperature": 0, "ignore_eos": true}),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["object"], "response");
        assert!(answer["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(
            answer["status"], "incomplete",
            "max_output_tokens ran out: {answer}"
        );
        assert_eq!(answer["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(answer["usage"]["output_tokens"], 5);
        let text = answer["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(answer["output"][0]["type"], "message");
        // The same through /v1/chat/completions: one path underneath.
        let (_, chat_answer) = post(
            &server.url("/v1/chat/completions"),
            None,
            json!({"model": "builtin:tiny", "messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
        )
        .await;
        assert_eq!(
            chat_answer["choices"][0]["message"]["content"],
            text.as_str()
        );
        // Streamed: the event sequence, the deltas adding up to the text.
        let (_, data) = sse(
            &url,
            None,
            json!({"model": "builtin:tiny", "instructions": "Be brief.", "input": "hello",
                   "max_output_tokens": 5, "temperature": 0, "ignore_eos": true, "stream": true}),
        )
        .await;
        let events: Vec<Value> = data
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(kinds.first(), Some(&"response.created"), "{kinds:?}");
        assert_eq!(kinds.last(), Some(&"response.incomplete"), "{kinds:?}");
        for needed in [
            "response.output_item.added",
            "response.output_text.done",
            "response.output_item.done",
        ] {
            assert!(kinds.contains(&needed), "{needed} missing: {kinds:?}");
        }
        let streamed: String = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(streamed, text);
        let numbers: Vec<u64> = events
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(numbers, (0..numbers.len() as u64).collect::<Vec<_>>());
        // Tools: flat function tools, a required call, a round trip.
        let tools = json!([{"type": "function", "name": "get_weather",
            "parameters": {"type": "object", "additionalProperties": false,
                "properties": {"city": {"type": "string", "maxLength": 12},
                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}}]);
        let (status, called) = post(
            &url,
            None,
            json!({"model": "builtin:tiny", "input": "weather in Paris?", "tools": tools,
                   "tool_choice": "required", "max_output_tokens": 300}),
        )
        .await;
        assert_eq!(status, 200, "{called}");
        let call = called["output"]
            .as_array()
            .unwrap()
            .iter()
            .find(|item| item["type"] == "function_call")
            .unwrap_or_else(|| panic!("{called}"))
            .clone();
        assert_eq!(call["name"], "get_weather");
        check_weather(call["arguments"].as_str().unwrap());
        let (status, after) = post(
            &url,
            None,
            json!({"model": "builtin:tiny", "tools": tools, "max_output_tokens": 3, "input": [
                {"role": "user", "content": "weather in Paris?"},
                {"type": "function_call", "call_id": call["call_id"], "name": "get_weather", "arguments": call["arguments"]},
                {"type": "function_call_output", "call_id": call["call_id"], "output": "21 degrees"},
            ]}),
        )
        .await;
        assert_eq!(status, 200, "{after}");
        assert!(after["usage"]["input_tokens"].as_u64() > called["usage"]["input_tokens"].as_u64());
        // Fields it does not serve are refused by their own names.
        for (patch, param) in [
            (json!({"max_output_tokens": 0}), "max_output_tokens"),
            (json!({"input": [{"type": "input_image"}]}), "input[0].type"),
            (
                json!({"text": {"format": {"type": "bogus"}}}),
                "text.format.type",
            ),
        ] {
            let body = with(
                json!({"model": "builtin:tiny", "input": "hi"}),
                patch.clone(),
            );
            let (status, answer) = post(&url, None, body).await;
            assert_eq!(
                (status, &answer["error"]["param"]),
                (400, &json!(param)),
                "{patch}: {answer}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn responses_truncation_auto_drops_the_oldest_turns_to_fit_the_context() {
    let server = Server::start(&[]);
    let url = server.url("/v1/responses");
    // builtin:tiny reads bytes: 4,096 tokens of context. Twelve turns of
    // 600 bytes do not fit; the last question and a few turns do.
    let mut input: Vec<Value> = (0..12)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": format!("{i:02} {}", "x".repeat(597))})
        })
        .collect();
    input.push(json!({"role": "user", "content": "and now?"}));
    let ask = |truncation: Value, input: &[Value]| {
        json!({"model": "builtin:tiny", "instructions": "Be brief.", "input": input,
               "max_output_tokens": 8, "temperature": 0, "truncation": truncation})
    };
    for disabled in [Value::Null, json!("disabled")] {
        let (status, answer) = post(&url, None, ask(disabled, &input)).await;
        assert_eq!(status, 400, "{answer}");
        assert_eq!(answer["error"]["code"], "context_length_exceeded");
    }
    let (status, answer) = post(&url, None, ask(json!("auto"), &input)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["truncation"], "auto", "repeated: {answer}");
    let used = &answer["usage"]["input_tokens"];
    // The same as sending only the latest turns that fit: the most of
    // them, with the instructions kept.
    let mut fitting = Vec::new();
    for kept in 0..12 {
        let tail = &input[input.len() - 1 - kept..];
        let (status, alone) = post(&url, None, ask(Value::Null, tail)).await;
        if status == 200 {
            fitting.push((kept, alone));
        }
    }
    let (kept, alone) = fitting.last().unwrap();
    assert!(*kept >= 1, "{fitting:?}");
    assert_eq!(&alone["usage"]["input_tokens"], used, "{alone}");
    assert_eq!(
        alone["output"][0]["content"][0]["text"],
        answer["output"][0]["content"][0]["text"]
    );
    // Asking for no length leaves room for the default answer (256).
    let mut unbounded = ask(json!("auto"), &input);
    unbounded
        .as_object_mut()
        .unwrap()
        .remove("max_output_tokens");
    let (status, answer) = post(&url, None, unbounded).await;
    assert_eq!(status, 200, "{answer}");
    let read = answer["usage"]["input_tokens"].as_u64().unwrap();
    assert!(read + 256 <= 4096 && read + 256 + 610 > 4096, "{read}");
    // A question alone past the context still fails; anything else is a 400.
    let huge = [json!({"role": "user", "content": "y".repeat(5000)})];
    let (status, answer) = post(&url, None, ask(json!("auto"), &huge)).await;
    assert_eq!(
        (status, &answer["error"]["code"]),
        (400, &json!("context_length_exceeded")),
        "{answer}"
    );
    let (status, answer) = post(&url, None, ask(json!("sometimes"), &input)).await;
    assert_eq!(
        (status, &answer["error"]["param"]),
        (400, &json!("truncation")),
        "{answer}"
    );
}

/// The log-probabilities a list of them spells: their `bytes`, joined.
fn spelled(logprobs: &[Value]) -> String {
    let bytes: Vec<u8> = logprobs
        .iter()
        .flat_map(|entry| entry["bytes"].as_array().unwrap().clone())
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn responses_carry_logprobs_when_included_streamed_or_not_in_every_mode() {
    for mode in modes() {
        let server = Server::start(mode);
        let url = server.url("/v1/responses");
        let ask = json!({"model": "builtin:tiny", "input": "count", "max_output_tokens": 6,
                         "temperature": 0, "ignore_eos": true,
                         "include": ["message.output_text.logprobs"], "top_logprobs": 3});
        let (status, answer) = post(&url, None, ask.clone()).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["top_logprobs"], 3, "repeated, as OpenAI's are");
        let part = &answer["output"][0]["content"][0];
        let logprobs = part["logprobs"].as_array().unwrap().clone();
        assert_eq!(logprobs.len(), 6, "one entry per token: {answer}");
        for entry in &logprobs {
            assert_eq!(
                entry["top_logprobs"].as_array().unwrap().len(),
                3,
                "{entry}"
            );
        }
        assert_eq!(spelled(&logprobs), part["text"].as_str().unwrap());
        // The same entries chat gives for the same conversation.
        let (_, chat_answer) = post(
            &server.url("/v1/chat/completions"),
            None,
            json!({"model": "builtin:tiny", "messages": [{"role": "user", "content": "count"}],
                   "max_tokens": 6, "temperature": 0, "ignore_eos": true,
                   "logprobs": true, "top_logprobs": 3}),
        )
        .await;
        assert_eq!(
            chat_answer["choices"][0]["logprobs"]["content"],
            json!(logprobs),
            "{mode:?}"
        );
        // Not asked: an empty list, as OpenAI's parts carry.
        let mut plain = ask.clone();
        plain.as_object_mut().unwrap().remove("include");
        plain.as_object_mut().unwrap().remove("top_logprobs");
        let (status, answer) = post(&url, None, plain).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["output"][0]["content"][0]["logprobs"], json!([]));
        // Streamed: each delta carries its own tokens' entries, which add
        // up to the whole answer's; the text's `done` carries them all.
        let (_, data) = sse(&url, None, with(ask.clone(), json!({"stream": true}))).await;
        let events: Vec<Value> = data
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let deltas: Vec<&Value> = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .collect();
        for delta in &deltas {
            let own = delta["logprobs"].as_array().unwrap();
            assert_eq!(spelled(own), delta["delta"].as_str().unwrap(), "{delta}");
        }
        let streamed: Vec<Value> = deltas
            .iter()
            .flat_map(|e| e["logprobs"].as_array().unwrap().clone())
            .collect();
        assert_eq!(streamed, logprobs, "{mode:?}");
        let done = events
            .iter()
            .find(|e| e["type"] == "response.output_text.done")
            .unwrap();
        assert_eq!(done["logprobs"], json!(logprobs));
        let finished = events.last().unwrap();
        assert_eq!(
            finished["response"]["output"][0]["content"][0]["logprobs"],
            json!(logprobs)
        );
        // What is not served, or asks for alternatives nobody reads, is
        // refused by its name.
        for (patch, param) in [
            (
                json!({"include": ["reasoning.encrypted_content"]}),
                "include",
            ),
            (json!({"include": ["bogus"]}), "include"),
            (
                json!({"include": "message.output_text.logprobs"}),
                "include",
            ),
            (json!({"include": null, "top_logprobs": 3}), "top_logprobs"),
            (json!({"top_logprobs": 21}), "top_logprobs"),
            (json!({"top_logprobs": -1}), "top_logprobs"),
            (json!({"top_logprobs": "3"}), "top_logprobs"),
        ] {
            let (status, answer) = post(&url, None, with(ask.clone(), patch.clone())).await;
            assert_eq!(
                (status, &answer["error"]["param"]),
                (400, &json!(param)),
                "{patch}: {answer}"
            );
        }
        // Empty and zero are what SDKs send when nothing is asked.
        let (status, answer) = post(
            &url,
            None,
            with(ask.clone(), json!({"include": [], "top_logprobs": 0})),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["output"][0]["content"][0]["logprobs"], json!([]));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_name_the_clients_own_field_and_echo_nothing_long() {
    let (key, lines) = crate::common::tenant("capped", &["--max-tokens", "8"]);
    let file = crate::common::tenants_file(&[lines]);
    let server = Server::start(&["--config", file.path().to_str().unwrap()]);
    let url = server.url("/v1/chat/completions");
    // The limit is named by the field the client used.
    let (status, body) = post(
        &url,
        Some(&key),
        with(
            chat("hi", 1),
            json!({"max_tokens": null, "max_completion_tokens": 9}),
        ),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "max_completion_tokens");
    // A 60 KB path is not echoed back.
    let long = format!("/v1/{}", "x".repeat(60_000));
    let response = reqwest::Client::new()
        .get(server.url(&long))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let text = response.text().await.unwrap();
    assert!(text.len() < 600, "{} bytes", text.len());
    // OpenAI's defaults and neutral values pass; the scheme is any case.
    let response = reqwest::Client::new()
        .post(&url)
        .header("authorization", format!("bearer {key}"))
        .json(&with(
            chat("hi", 2),
            json!({"verbosity": "medium", "top_logprobs": 0}),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // A tiny temperature: every log-probability is a number.
    let (status, body) = post(
        &url,
        Some(&key),
        with(
            chat("hi", 3),
            json!({"temperature": 1e-40, "logprobs": true, "top_logprobs": 5}),
        ),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for token in body["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
    {
        assert!(token["logprob"].is_number(), "{token}");
        for alternative in token["top_logprobs"].as_array().unwrap() {
            assert!(alternative["logprob"].is_number(), "{alternative}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_cut_by_max_tokens_is_a_call_never_markup() {
    let server = Server::start(&[]);
    let url = server.url("/v1/chat/completions");
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    // builtin:tiny's tokens are bytes: 50 of them end inside the arguments
    // of `<tool_call>\n{"name": "get_weather", "arguments": {...`.
    let ask = with(
        chat("weather in Paris?", 50),
        json!({"tools": weather_tools(), "tool_choice": named, "temperature": 0.8, "seed": 2}),
    );
    let (status, answer) = post(&url, None, ask.clone()).await;
    assert_eq!(status, 200, "{answer}");
    let reply = &answer["choices"][0];
    assert_eq!(reply["finish_reason"], "length", "{answer}");
    assert!(reply["message"]["content"].is_null(), "{answer}");
    let call = &reply["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{answer}");
    let arguments = call["arguments"].as_str().unwrap();
    assert!(arguments.starts_with('{') && serde_json::from_str::<Value>(arguments).is_err());
    // Streamed: tool-call deltas, no content, the same finish.
    let (status, data) = sse(&url, None, with(ask, json!({"stream": true}))).await;
    assert_eq!(status, 200);
    assert!(!data.iter().any(|d| d.contains("tool_call>")), "{data:?}");
    let chunks = chunks(&data);
    let names: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"].get("name"))
        .collect();
    assert_eq!(names, [&json!("get_weather")], "{data:?}");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    // Cut inside `<tool_call>` itself (its 11 bytes): no call yet, and none
    // of the tag as content — whole, streamed, or through /v1/responses.
    let responses = server.url("/v1/responses");
    for max_tokens in 1..=11 {
        let ask = with(
            chat("weather in Paris?", max_tokens),
            json!({"tools": weather_tools(), "tool_choice": "required"}),
        );
        let (status, answer) = post(&url, None, ask.clone()).await;
        assert_eq!(status, 200, "{answer}");
        let reply = &answer["choices"][0];
        assert_eq!(reply["finish_reason"], "length", "{answer}");
        assert_eq!(reply["message"]["content"], "", "{answer}");
        assert!(reply["message"].get("tool_calls").is_none(), "{answer}");
        let (_, data) = sse(&url, None, with(ask, json!({"stream": true}))).await;
        let text: String = self::chunks(&data)
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, "", "{data:?}");
        let (status, answer) = post(
            &responses,
            None,
            json!({"model": "builtin:tiny", "input": "weather in Paris?", "tools": [
                {"type": "function", "name": "get_time", "parameters": {"type": "object"}}],
                "tool_choice": "required", "max_output_tokens": max_tokens, "temperature": 0}),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["status"], "incomplete", "{answer}");
        for item in answer["output"].as_array().unwrap() {
            assert_eq!(item["type"], "message", "{answer}");
            assert_eq!(item["content"][0]["text"], "", "{answer}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_answer_carries_the_servers_own_request_id() {
    let (key, lines) = crate::common::tenant("ids", &[]);
    let file = crate::common::tenants_file(&[lines]);
    let server = Server::start(&["--config", file.path().to_str().unwrap()]);
    let url = server.url("/v1/chat/completions");
    let send = |key: Option<String>| {
        let url = url.clone();
        async move {
            let mut request = reqwest::Client::new()
                .post(&url)
                .header("x-request-id", "mine-1")
                .json(&chat("hi", 1));
            if let Some(key) = key {
                request = request.bearer_auth(key);
            }
            let response = request.send().await.unwrap();
            let id = response.headers()["x-request-id"]
                .to_str()
                .unwrap()
                .to_string();
            (response.status().as_u16(), id)
        }
    };
    let (ok, first) = send(Some(key.clone())).await;
    let (_, second) = send(Some(key.clone())).await;
    let (refused, stranger) = send(None).await;
    assert_eq!((ok, refused), (200, 401));
    for id in [&first, &second, &stranger] {
        assert!(id.starts_with("req_") && id.len() == 28, "{id}");
    }
    assert!(first != second && second != stranger, "one id per request");
    // Every other answer too: lists, stored responses, 404s and 405s.
    let client = reqwest::Client::new();
    for (request, status) in [
        (client.get(server.url("/v1/models")), 200),
        (client.get(server.url("/v1/responses/resp_0")), 404),
        (client.delete(server.url("/v1/conversations/conv_0")), 404),
        (client.get(server.url("/v1/nowhere")), 404),
        (client.get(server.url("/v1/chat/completions")), 405),
    ] {
        let response = request.bearer_auth(&key).send().await.unwrap();
        assert_eq!(response.status(), status);
        let id = response.headers()["x-request-id"].to_str().unwrap();
        assert!(id.starts_with("req_") && id.len() == 28, "{id}");
    }
    // The client's own label is in the log beside the server's id.
    server.wait_for_log("client_request_id=mine-1");
    assert!(server.log().contains(&first));
}

#[tokio::test(flavor = "multi_thread")]
async fn tools_with_a_structured_output_give_a_call_or_an_answer_in_the_format() {
    let server = Server::start(&[]);
    let url = server.url("/v1/chat/completions");
    let format = json!({"type": "json_schema", "json_schema": {"name": "verdict", "schema": {
        "type": "object", "additionalProperties": false,
        "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}});
    let (mut calls, mut answers) = (0, 0);
    // A random model picks either side; every answer is one or the other.
    for seed in 0..12 {
        let (status, answer) = post(
            &url,
            None,
            with(
                chat("weather in Paris?", 120),
                json!({"tools": weather_tools(), "tool_choice": "auto",
                       "response_format": format, "temperature": 1.0, "seed": seed}),
            ),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        let message = &answer["choices"][0]["message"];
        match message["tool_calls"].as_array() {
            Some(list) => {
                calls += 1;
                let name = list[0]["function"]["name"].as_str().unwrap();
                assert!(["get_weather", "get_time"].contains(&name), "{answer}");
            }
            None => {
                answers += 1;
                let content: Value =
                    serde_json::from_str(message["content"].as_str().unwrap()).unwrap();
                assert!(content["ok"].is_boolean(), "{content}");
            }
        }
    }
    assert_eq!(calls + answers, 12);
    assert!(calls > 0 && answers > 0, "{calls} calls, {answers} answers");
    // A regex format cannot be joined to calls.
    let (status, answer) = post(
        &url,
        None,
        with(
            chat("hi", 4),
            json!({"tools": weather_tools(),
                   "response_format": {"type": "regex", "regex": "[a-z]+"}}),
        ),
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["param"], "response_format");
}
