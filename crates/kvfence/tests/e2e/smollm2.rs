//! The real model over HTTP: the README's question gets its real answer,
//! and disaggregated serving (TCP hand-off) answers concurrent requests
//! exactly as a colocated server does.

#![allow(clippy::unwrap_used)]

use crate::common::{Server, post};
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
    drop(colocated);
    let disaggregated = Server::start(&[&args[..], &["--handoff", "tcp"]].concat());
    assert_eq!(answers(&disaggregated).await, expected);
    disaggregated.wait_for_baseline().await;
}
