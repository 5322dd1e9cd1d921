//! Disaggregated serving over real HTTP: answers equal a colocated server's
//! bit for bit, and the router's advertised context is the smallest
//! worker pool's — the incident's gap closed at the front door (I6).

#![allow(clippy::unwrap_used)]

use crate::common::{Server, post, tenant, tenants_file};
use serde_json::{Value, json};

async fn answers(server: &Server, keys: &[String]) -> Vec<String> {
    let url = server.url("/v1/completions");
    let jobs = (0..64).map(|i| {
        let url = url.clone();
        let key = keys[i % keys.len()].clone();
        async move {
            let body = json!({
                "prompt": format!("tenant {} request {i}: {}", i % 4, "abc".repeat(i % 17)),
                "max_tokens": 12,
                "temperature": if i % 2 == 0 { 0.0 } else { 0.7 },
                "seed": i,
                "ignore_eos": true,
            });
            let (status, answer) = post(&url, Some(&key), body).await;
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["text"].as_str().unwrap().to_string()
        }
    });
    futures_util::future::join_all(jobs).await
}

#[tokio::test(flavor = "multi_thread")]
async fn sixty_four_concurrent_requests_from_four_tenants_equal_colocated() {
    let tenants: Vec<(String, String)> = (0..4)
        .map(|i| tenant(&format!("t{i}"), &["--max-concurrent", "16"]))
        .collect();
    let file = tenants_file(&tenants.iter().map(|t| t.1.clone()).collect::<Vec<_>>());
    let config = file.path().to_str().unwrap();
    let keys: Vec<String> = tenants.iter().map(|t| t.0.clone()).collect();
    let colocated = Server::start(&["--config", config, "--mode", "colocated"]);
    let disaggregated = Server::start(&[
        "--config",
        config,
        "--mode",
        "disaggregated",
        "--kv-pool-tokens",
        "2048",
        "--prefill-pool-tokens",
        "1024",
    ]);
    let tcp = Server::start(&["--config", config, "--handoff", "tcp"]);
    let shm = Server::start(&["--config", config, "--handoff", "shm"]);
    let expected = answers(&colocated, &keys).await;
    assert_eq!(
        answers(&tcp, &keys).await,
        expected,
        "over the TCP hand-off"
    );
    assert_eq!(
        answers(&shm, &keys).await,
        expected,
        "over the shared-memory hand-off"
    );
    shm.wait_for_baseline().await;
    assert_eq!(answers(&disaggregated, &keys).await, expected);
    assert_eq!(
        disaggregated
            .metric("kvfence_handoffs_total{reason=\"committed\"}")
            .await,
        64.0
    );
    assert_eq!(
        disaggregated
            .metric("kvfence_handoff_checksum_failures_total")
            .await,
        0.0
    );
    disaggregated.wait_for_baseline().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn i6_a_prompt_that_fits_decode_but_not_prefill_is_refused_before_any_page_is_leased() {
    let server = Server::start(&["--kv-pool-tokens", "4096", "--prefill-pool-tokens", "256"]);
    let models: Value = server.get_json("/v1/models").await;
    assert_eq!(
        models["data"][0]["max_model_len"], 256,
        "the prefill pool bounds the context"
    );
    assert_eq!(
        server
            .metric("kvfence_capacity_tokens{role=\"decode\"}")
            .await,
        4096.0
    );
    assert_eq!(
        server
            .metric("kvfence_capacity_tokens{role=\"prefill\"}")
            .await,
        256.0
    );
    let (status, body) = post(
        &server.url("/v1/completions"),
        None,
        json!({"prompt": "x".repeat(300), "max_tokens": 10}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    assert_eq!(
        server.metric("kvfence_pool_leases_granted_total").await,
        0.0,
        "no page leased on either worker"
    );
    let (status, _) = post(
        &server.url("/v1/completions"),
        None,
        json!({"prompt": "x".repeat(200), "max_tokens": 10}),
    )
    .await;
    assert_eq!(status, 200, "what fits every pool is served");
    server.wait_for_baseline().await;
}
