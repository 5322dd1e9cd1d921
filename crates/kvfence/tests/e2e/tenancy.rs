//! Tenants over time (I11), end to end: rates with OpenAI's headers, keys
//! that rotate without a restart, priorities and shedding.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::*;

fn header(response: &reqwest::Response, name: &str) -> String {
    response
        .headers()
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header"))
        .to_str()
        .unwrap()
        .to_string()
}

async fn complete(url: &str, key: &str, body: serde_json::Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(url)
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn rate_limits_answer_429_with_retry_after_and_openai_headers() {
    let (key, lines) = tenant(
        "metered",
        &["--requests-per-minute", "3", "--tokens-per-minute", "100"],
    );
    let file = tenants_file(&[lines]);
    let server = Server::start(&["--config", file.path().to_str().unwrap()]);
    let url = server.url("/v1/completions");
    let prompt: Vec<u32> = vec![5; 10];

    // 10 prompt tokens + 20 at most: 30 charged, what went unused given back.
    let first = complete(
        &url,
        &key,
        json!({"prompt": prompt, "max_tokens": 20, "ignore_eos": true}),
    )
    .await;
    assert_eq!(first.status(), 200);
    assert_eq!(header(&first, "x-ratelimit-limit-requests"), "3");
    assert_eq!(header(&first, "x-ratelimit-remaining-requests"), "2");
    assert_eq!(header(&first, "x-ratelimit-limit-tokens"), "100");
    let left: u64 = header(&first, "x-ratelimit-remaining-tokens")
        .parse()
        .unwrap();
    assert!((69..=71).contains(&left), "30 tokens used: {left} left");
    assert!(header(&first, "x-ratelimit-reset-tokens").ends_with('s'));

    // More than a minute's tokens can never pass: 400, and no request spent.
    let never = complete(&url, &key, json!({"prompt": prompt, "max_tokens": 95})).await;
    assert_eq!(never.status(), 400);
    assert_eq!(header(&never, "x-ratelimit-remaining-requests"), "1");
    let body: serde_json::Value = never.json().await.unwrap();
    assert_eq!(body["error"]["param"], "max_tokens");

    // 80 tokens do not fit in the ~70 left: 429 saying when they will.
    let later = complete(&url, &key, json!({"prompt": prompt, "max_tokens": 70})).await;
    assert_eq!(later.status(), 429);
    let wait: u64 = header(&later, "retry-after").parse().unwrap();
    assert!(
        (1..=10).contains(&wait),
        "about 10 tokens short at 100 a minute: {wait} s"
    );
    assert_eq!(header(&later, "x-ratelimit-remaining-requests"), "0");

    // The request rate is spent: even a tiny request waits ~20 s.
    let spent = complete(&url, &key, json!({"prompt": prompt, "max_tokens": 1})).await;
    assert_eq!(spent.status(), 429);
    let wait: u64 = header(&spent, "retry-after").parse().unwrap();
    assert!(
        (15..=20).contains(&wait),
        "one request back in 20 s: {wait}"
    );
    let body: serde_json::Value = spent.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
}

fn new_key() -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args(["tenant", "key"])
        .output()
        .unwrap();
    assert!(out.status.success());
    // The key on standard error; standard output is the quoted digest
    // alone, as it goes into the tenant's key_sha256 list.
    let told = String::from_utf8(out.stderr).unwrap();
    let key = told
        .split_whitespace()
        .find(|w| w.starts_with("kvf-"))
        .expect("the key is told on standard error")
        .to_string();
    let digest = String::from_utf8(out.stdout).unwrap();
    let hash = digest
        .trim()
        .strip_prefix('"')
        .and_then(|d| d.strip_suffix('"'))
        .expect("standard output is the quoted digest alone")
        .to_string();
    assert!(hash.len() == 64 && hash.chars().all(|c| c.is_ascii_hexdigit()));
    (key, hash)
}

/// Polls until `key`'s status on a models listing is `status`.
async fn wait_for_status(server: &Server, key: &str, status: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = reqwest::Client::new()
            .get(server.url("/v1/models"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16();
        if got == status {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "key still answers {got}, not {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn keys_rotate_without_a_restart_and_a_bad_file_changes_nothing() {
    let ((old, old_hash), (new, new_hash)) = (new_key(), new_key());
    let file = |keys: &str| format!("[[tenants]]\nname = \"rotating\"\nkey_sha256 = [{keys}]\n");
    let tenants = tenants_file(&[file(&format!("\"{old_hash}\""))]);
    let server = Server::start(&["--config", tenants.path().to_str().unwrap()]);
    let url = server.url("/v1/completions");
    wait_for_status(&server, &new, 401).await;

    // Both keys for a while: clients move without an outage.
    std::fs::write(
        tenants.path(),
        file(&format!("\"{old_hash}\", \"{new_hash}\"")),
    )
    .unwrap();
    wait_for_status(&server, &new, 200).await;
    wait_for_status(&server, &old, 200).await;

    // A request started with the old key outlives the key.
    let mut in_flight = reqwest::Client::new()
        .post(&url)
        .bearer_auth(&old)
        .json(&json!({"prompt": "go", "max_tokens": 400, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(in_flight.status(), 200);
    std::fs::write(tenants.path(), file(&format!("\"{new_hash}\""))).unwrap();
    // SIGHUP reads it at once (the file watch would within seconds).
    let hup = Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    wait_for_status(&server, &old, 401).await;
    let mut streamed = String::new();
    while let Some(chunk) = in_flight.chunk().await.unwrap() {
        streamed.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        streamed.ends_with("data: [DONE]\n\n"),
        "the old key's request finished"
    );
    assert!(!streamed.contains("\"error\""));

    // A file that does not parse leaves the one in force, and the log says why.
    std::fs::write(tenants.path(), "[[tenants]]\nname = ").unwrap();
    server.wait_for_log("tenants file not reloaded");
    wait_for_status(&server, &new, 200).await;
    wait_for_status(&server, &old, 401).await;
    assert!(!server.log().contains(&new), "keys never reach the log");
}

#[test]
fn the_official_client_waits_out_a_rate_limit() {
    let (key, lines) = tenant("metered", &["--requests-per-minute", "60"]);
    let file = tenants_file(&[lines]);
    let server = Server::start(&["--config", file.path().to_str().unwrap()]);
    let passed = crate::openai_client::client_checks(
        "rate_limits.py",
        &server,
        &[("KVFENCE_KEY", key.as_str())],
    );
    assert_eq!(passed.len(), 3, "{passed:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn priorities_are_the_tenants_to_use_and_objectives_name_them() {
    let (key, lines) = tenant("capped", &["--max-priority", "2"]);
    let objectives = "[objectives]\nrealtime = 10\nbatch = -1\nstandard = 0\n\n".to_string();
    let file = tenants_file(&[objectives, lines]);
    let server = Server::start(&["--config", file.path().to_str().unwrap()]);
    let url = server.url("/v1/completions");
    let send = |objective: Option<&'static str>, extra: serde_json::Value| {
        let (url, key) = (url.clone(), key.clone());
        async move {
            let mut body = json!({"prompt": "hi", "max_tokens": 1});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let mut request = reqwest::Client::new()
                .post(&url)
                .bearer_auth(&key)
                .json(&body);
            if let Some(objective) = objective {
                request = request.header("x-gateway-inference-objective", objective);
            }
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let body: serde_json::Value = response.json().await.unwrap();
            (status, body["error"]["param"].as_str().map(str::to_string))
        }
    };
    assert_eq!(send(None, json!({"priority": 2})).await.0, 200);
    assert_eq!(send(None, json!({"priority": -5})).await.0, 200);
    assert_eq!(send(Some("standard"), json!({})).await.0, 200);
    assert_eq!(send(Some("batch"), json!({"priority": 2})).await.0, 200);
    // OpenAI's tiers: flex is sheddable, priority is served where allowed.
    assert_eq!(send(None, json!({"service_tier": "flex"})).await.0, 200);
    assert_eq!(send(None, json!({"service_tier": "priority"})).await.0, 200);
    let refused = [
        (send(None, json!({"priority": 3})).await, "priority"),
        (send(None, json!({"priority": 1e12})).await, "priority"),
        (
            send(Some("realtime"), json!({})).await,
            "x-gateway-inference-objective",
        ),
        (
            send(Some("unknown"), json!({})).await,
            "x-gateway-inference-objective",
        ),
        (
            send(None, json!({"service_tier": "scale-ish"})).await,
            "service_tier",
        ),
    ];
    for ((status, param), expected) in refused {
        assert_eq!((status, param.as_deref()), (400, Some(expected)));
    }
    // Two objectives, each allowed alone: which would a gateway have read?
    let twice = reqwest::Client::new()
        .post(&url)
        .bearer_auth(&key)
        .header("x-gateway-inference-objective", "batch")
        .header("x-gateway-inference-objective", "standard")
        .json(&json!({"prompt": "hi", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(twice.status(), 400);
    let body: serde_json::Value = twice.json().await.unwrap();
    assert_eq!(body["error"]["param"], "x-gateway-inference-objective");
}

#[tokio::test(flavor = "multi_thread")]
async fn sheddable_requests_make_way_with_503_when_others_wait() {
    // builtin:small decodes at tens of tokens a second, so the request
    // that holds the only slot holds it until it is dropped, however fast
    // the machine (builtin:tiny's whole context went by in under 500 ms).
    let server = Server::start(&["--max-running", "1", "--model", "builtin:small"]);
    let url = server.url("/v1/completions");
    // The only slot is taken until `long` is dropped.
    let long = hold_slots(&url, None, 1, 3000).await;
    let sheddable = tokio::spawn({
        let url = url.clone();
        async move {
            reqwest::Client::new()
                .post(&url)
                .json(&json!({"prompt": "later", "max_tokens": 2, "service_tier": "flex"}))
                .send()
                .await
                .unwrap()
        }
    });
    // Queued, not shed: nothing else waits for room.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !sheddable.is_finished(),
        "sheddable work waits while nothing else does"
    );
    let urgent = tokio::spawn({
        let url = url.clone();
        async move {
            reqwest::Client::new()
                .post(&url)
                .json(&json!({"prompt": "now", "max_tokens": 2}))
                .send()
                .await
                .unwrap()
        }
    });
    let shed = sheddable.await.unwrap();
    assert_eq!(shed.status(), 503);
    assert_eq!(shed.headers()["retry-after"], "1");
    let body: serde_json::Value = shed.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("sheddable"),
        "{body}"
    );
    assert!(
        !urgent.is_finished(),
        "the urgent request waits for the slot"
    );
    drop(long);
    assert_eq!(urgent.await.unwrap().status(), 200);
    assert_eq!(server.metric("kvfence_requests_shed_total").await, 1.0);
    server.wait_for_baseline().await;
}
