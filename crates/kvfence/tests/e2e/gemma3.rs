//! Gemma 3 270M over HTTP, the second real architecture: the base model
//! continues text as llama.cpp does, the same in the default disaggregated
//! mode (TCP hand-off) as colocated; without a chat template chat requests
//! are refused with a reason, and with `--chat-template` they are served,
//! structured outputs included (SentencePiece pieces under a grammar).
//! Its sliding-window layers keep only their windows, colocated and across
//! the hand-off: the same memory advertises a longer context and a prompt
//! past the window answers as full KV does.

#![allow(clippy::unwrap_used)]

use crate::common::{Server, post};
use serde_json::json;

/// Greedy continuations of prompts whose first tokens llama.cpp and
/// kvfence agree on (`crates/model/tests/fixtures/gemma3_270m.json`).
async fn continuations(server: &Server) -> Vec<String> {
    let url = server.url("/v1/completions");
    let prompts = [
        "The capital of France is",
        "The quick brown fox",
        "Water boils at",
        "def fibonacci(n):",
    ];
    let jobs = prompts.iter().map(|prompt| {
        let url = url.clone();
        async move {
            let body = json!({"model": "gemma3-270m", "prompt": prompt, "max_tokens": 12,
                              "temperature": 0});
            let (status, answer) = post(&url, None, body).await;
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["text"].as_str().unwrap().to_string()
        }
    });
    futures_util::future::join_all(jobs).await
}

/// A prompt's scores (`echo` with `logprobs`): the legacy object, checked
/// for the start of sequence a base model's prompt begins with.
async fn echoed_scores(server: &Server) -> serde_json::Value {
    let body = json!({"model": "gemma3-270m", "prompt": "Hello world, naïve café", "max_tokens": 2,
                      "temperature": 0, "echo": true, "logprobs": 2});
    let (status, answer) = post(&server.url("/v1/completions"), None, body).await;
    assert_eq!(status, 200, "{answer}");
    let logprobs = answer["choices"][0]["logprobs"].clone();
    // <bos> is scored by nothing and spells nothing: "Hello" is at 0.
    assert_eq!(logprobs["tokens"][0], "<bos>", "{logprobs}");
    assert_eq!(logprobs["tokens"][1], "Hello", "{logprobs}");
    assert!(logprobs["token_logprobs"][0].is_null());
    assert_eq!(
        (&logprobs["text_offset"][0], &logprobs["text_offset"][1]),
        (&json!(0), &json!(0)),
        "{logprobs}"
    );
    assert!(
        answer["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("Hello world, naïve café")
    );
    logprobs
}

/// The context `/v1/models` advertises.
async fn advertised_context(server: &Server) -> u64 {
    let models = reqwest::get(server.url("/v1/models"))
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap();
    models["data"][0]["context_length"].as_u64().unwrap()
}

/// A greedy continuation of a prompt longer than the window (512) and
/// than what a window's pages hold (912 positions at 256-token steps), so
/// a pool that keeps only windows has given pages back before it answers.
async fn past_the_window(server: &Server) -> (String, u64, u64) {
    let prompt: String = (0..96)
        .map(|i| format!("Line {i}: the fox jumps.\n"))
        .collect();
    let body = json!({"model": "gemma3-270m", "prompt": prompt, "max_tokens": 12,
                      "temperature": 0});
    let (status, answer) = post(&server.url("/v1/completions"), None, body).await;
    assert_eq!(status, 200, "{answer}");
    let usage = &answer["usage"];
    (
        answer["choices"][0]["text"].as_str().unwrap().to_string(),
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn gemma3_continues_like_llama_cpp_in_every_mode_and_chats_with_a_template() {
    let args = ["--model", "gemma3-270m", "--kv-pool-tokens", "1024"];
    let colocated = Server::start(
        &[
            &args[..],
            &["--mode", "colocated", "--prefix-cache-tenant-quota", "100"],
        ]
        .concat(),
    );
    // The memory of 1,024 tokens of full KV, windows kept alone: 1,584.
    let context = advertised_context(&colocated).await;
    assert!(context > 1024 * 3 / 2, "{context}");
    let (long, prompt_tokens, _) = past_the_window(&colocated).await;
    assert!(
        (913..=1012).contains(&prompt_tokens),
        "{prompt_tokens} tokens: past a window's pages, within the full pool"
    );
    // Sent again, it starts from its global layers' pages and its
    // windows' last pages, sealed as they slid (the tenant may fill the
    // cache: 59 global pages and five windows of 35 pages are more than
    // half this pool); the answer is the same.
    let (again, _, cached) = past_the_window(&colocated).await;
    assert_eq!(again, long);
    assert!(cached > 512, "{cached} tokens cached");
    let expected = continuations(&colocated).await;
    assert!(
        expected[0].starts_with(" the capital of the country of France."),
        "{:?}",
        expected[0]
    );
    let chat = json!({"model": "gemma3-270m", "messages": [{"role": "user", "content": "Hi"}]});
    let (status, refusal) = post(&colocated.url("/v1/chat/completions"), None, chat).await;
    assert_eq!(status, 400, "{refusal}");
    assert!(
        refusal["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--chat-template"),
        "{refusal}"
    );
    let scored = echoed_scores(&colocated).await;
    colocated.wait_for_baseline().await;
    drop(colocated);

    let template = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        template.path(),
        "{{ bos_token }}{% for m in messages %}<start_of_turn>\
         {{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}\
         <end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    )
    .unwrap();
    let disaggregated = Server::start(
        &[
            &args[..],
            &["--handoff", "tcp", "--chat-template"],
            &[template.path().to_str().unwrap()],
        ]
        .concat(),
    );
    // Both workers keep windows: each pool holds what the colocated one
    // did, and only the windows cross the link.
    assert_eq!(advertised_context(&disaggregated).await, context);
    let (text, prompt_tokens, _) = past_the_window(&disaggregated).await;
    assert_eq!(text, long);
    // Full KV would be 18,432 bytes a token (18 layers, one KV head of 256,
    // f16); the three global layers' prompt and fifteen windows are about
    // two thirds of it at this length.
    let moved = disaggregated
        .metric_sum(|line| line.starts_with("kvfence_handoff_bytes_total"))
        .await;
    let full = (prompt_tokens * 18_432) as f64;
    assert!(
        moved > 0.0 && moved < 0.75 * full,
        "{moved} bytes crossed where full KV is {full}"
    );

    // Windows off: the memory of 1,024 tokens holds 1,024, and the long
    // prompt's prefix is cached.
    let full =
        Server::start(&[&args[..], &["--mode", "colocated", "--kv-windows", "off"]].concat());
    assert_eq!(advertised_context(&full).await, 1024);
    assert_eq!(past_the_window(&full).await.0, long);
    let (again, _, cached) = past_the_window(&full).await;
    assert_eq!(again, long);
    // As much as a tenant may cache: half the pool, 512 tokens.
    assert_eq!(cached, 512);
    drop(full);
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args([
            "serve",
            "--model",
            "builtin:tiny",
            "--port",
            "0",
            "--kv-windows",
            "on",
            "--handoff",
            "shm",
        ])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("two-sided"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert_eq!(continuations(&disaggregated).await, expected);
    assert_eq!(echoed_scores(&disaggregated).await, scored);
    let url = disaggregated.url("/v1/chat/completions");
    let (status, answer) = post(
        &url,
        None,
        json!({"model": "gemma3-270m", "max_tokens": 8, "temperature": 0,
               "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    // <bos>, <start_of_turn> and <end_of_turn> are one token each: the
    // template's markers became control tokens.
    assert_eq!(answer["usage"]["prompt_tokens"], 16, "{answer}");
    let schema = json!({"type": "object", "additionalProperties": false,
        "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]});
    let (status, answer) = post(
        &url,
        None,
        json!({"model": "gemma3-270m", "max_tokens": 40, "temperature": 0.7, "seed": 3,
               "messages": [{"role": "user", "content": "Name a city, in JSON."}],
               "response_format": {"type": "json_schema",
                                   "json_schema": {"name": "c", "schema": schema}}}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["finish_reason"], "stop", "{answer}");
    let text = answer["choices"][0]["message"]["content"].as_str().unwrap();
    let value: serde_json::Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(value["city"].is_string(), "{value}");
    disaggregated.wait_for_baseline().await;
}

/// Gemma 3 as separate processes — `kvfence prefill`, `decode` and
/// `router` over mutual TLS — keeps only its windows on both workers and
/// answers as one process does, a prompt past the window included; a
/// decode worker that keeps every position refuses to link to a prefill
/// worker that keeps windows, and says which flag to set.
#[tokio::test(flavor = "multi_thread")]
async fn gemma3_keeps_its_windows_across_processes() {
    use crate::common::ClusterTls;
    use crate::multiprocess::{start_decode, start_prefill, start_router};

    let model = ["--model", "gemma3-270m", "--kv-pool-tokens", "1024"];
    let one = Server::start(&model);
    let expected = continuations(&one).await;
    let (long, ..) = past_the_window(&one).await;
    let context = advertised_context(&one).await;
    drop(one);

    let tls = ClusterTls::init();
    let prefill = start_prefill(&tls, &model);
    let decode = start_decode(&tls, &prefill.base, &model);
    let router = start_router(&tls, &decode.base, &model[..2]);
    assert_eq!(advertised_context(&router).await, context);
    assert!(context > 1024 * 3 / 2, "{context}");
    assert_eq!(continuations(&router).await, expected);
    assert_eq!(past_the_window(&router).await.0, long);
    router.wait_for_baseline().await;

    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args(["decode", "--listen", "127.0.0.1:0", "--kv-windows", "off"])
        .args(model)
        .args(["--prefill", &prefill.base, "--tls-dir", tls.dir()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "the decode worker started: {stderr}"
    );
    assert!(stderr.contains("--kv-windows"), "{stderr}");
}
