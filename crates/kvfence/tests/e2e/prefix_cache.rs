//! The prefix cache over HTTP, behind tenant walls (I9): a tenant's repeat
//! reports `cached_tokens` and answers exactly as without the cache, in
//! every mode; another tenant, or another `cache_salt`, never hits; the
//! metrics give totals and no tenant; pools come back to baseline with the
//! cache kept.

#![allow(clippy::unwrap_used)]

use serde_json::{Value, json};

use crate::common::{Server, post, tenant, tenants_file};

/// A chat with a long system prompt (several pages) and a short question.
fn chat(question: &str, salt: Option<&str>) -> Value {
    let system = "You are the assistant of a platform team. Answer briefly, cite the runbook, \
                  and never guess what the logs do not show. "
        .repeat(3);
    let mut body = json!({
        "model": "builtin:tiny",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 12,
        "temperature": 0,
    });
    if let Some(salt) = salt {
        body["cache_salt"] = json!(salt);
    }
    body
}

/// Sends `body` as `key`; the answer's text and its cached prompt tokens.
async fn ask(server: &Server, key: &str, body: Value) -> (String, u64) {
    let (status, reply) = post(&server.url("/v1/chat/completions"), Some(key), body).await;
    assert_eq!(status, 200, "{reply}");
    let text = reply["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    (text, cached)
}

/// What every server in this file answers, in order: (text, cached tokens).
async fn conversation(server: &Server, a: &str, b: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for (key, question, salt) in [
        (a, "Which page holds the drain steps?", None),
        (a, "Which page holds the drain steps?", None),
        (a, "And the rollback steps?", None),
        (b, "Which page holds the drain steps?", None),
        (a, "Which page holds the drain steps?", Some("project-x")),
        (a, "Which page holds the drain steps?", Some("project-x")),
    ] {
        out.push(ask(server, key, chat(question, salt)).await);
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn i9_a_tenants_repeat_hits_its_own_cache_only_and_answers_the_same() {
    let (a, a_lines) = tenant("alpha", &[]);
    let (b, b_lines) = tenant("beta", &[]);
    let file = tenants_file(&[a_lines, b_lines]);
    let config = file.path().to_str().unwrap();
    let reference = Server::start(&["--config", config, "--prefix-cache", "off"]);
    let expected = conversation(&reference, &a, &b).await;
    assert!(
        expected.iter().all(|(_, cached)| *cached == 0),
        "{expected:?}"
    );

    for mode in [
        &["--mode", "colocated"][..],
        &["--mode", "disaggregated"],
        &["--mode", "disaggregated", "--handoff", "tcp"],
    ] {
        let mut args = vec!["--config", config];
        args.extend_from_slice(mode);
        let server = Server::start(&args);
        let got = conversation(&server, &a, &b).await;
        let texts = |v: &[(String, u64)]| v.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>();
        assert_eq!(
            texts(&got),
            texts(&expected),
            "{mode:?}: the cache changed an answer"
        );
        let cached: Vec<u64> = got.iter().map(|(_, c)| *c).collect();
        assert_eq!(cached[0], 0, "{mode:?}: {cached:?}");
        assert!(
            cached[1] >= 32,
            "{mode:?}: the tenant's repeat missed: {cached:?}"
        );
        assert!(
            cached[2] >= 32,
            "{mode:?}: the shared system prompt missed: {cached:?}"
        );
        assert_eq!(
            cached[3], 0,
            "{mode:?}: beta hit alpha's prefix: {cached:?}"
        );
        assert_eq!(
            cached[4], 0,
            "{mode:?}: a salt reached the unsalted cache: {cached:?}"
        );
        assert!(
            cached[5] >= 32,
            "{mode:?}: the salt's own repeat missed: {cached:?}"
        );

        if mode.contains(&"disaggregated") {
            // The decode worker keeps what it was sent: a repeat crosses the
            // link as its last pages only.
            let bytes = || server.metric("kvfence_handoff_bytes_total");
            let question = "How long may a drain take?";
            let before = bytes().await;
            ask(&server, &a, chat(question, None)).await;
            let first = bytes().await - before;
            ask(&server, &a, chat(question, None)).await;
            let repeat = bytes().await - before - first;
            assert!(
                first > 0.0 && repeat > 0.0 && repeat * 2.0 < first,
                "{mode:?}: a repeat moved {repeat} bytes, the first {first}"
            );
        }
        server.wait_for_baseline().await;
        let metrics = server.metrics_text().await;
        assert!(server.metric("kvfence_prefix_cache_hits_total").await >= 3.0);
        assert!(server.metric("kvfence_prefix_cache_hit_tokens_total").await >= 96.0);
        assert!(server.metric("kvfence_pool_pages{state=\"cached\"}").await > 0.0);
        for line in metrics.lines().filter(|l| l.contains("prefix_cache")) {
            assert!(
                !line.contains("alpha") && !line.contains("beta") && !line.contains("project-x"),
                "a cache metric names a tenant or salt: {line}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_cache_salt_is_refused_naming_the_field() {
    let server = Server::start(&["--mode", "colocated"]);
    for salt in [json!(""), json!("x".repeat(257))] {
        let mut body = chat("hi", None);
        body["cache_salt"] = salt.clone();
        let (status, reply) = post(&server.url("/v1/chat/completions"), None, body).await;
        assert_eq!(status, 400, "{salt}: {reply}");
        let param = reply["error"]["param"].as_str().unwrap_or_default();
        let message = reply["error"]["message"].as_str().unwrap_or_default();
        assert!(
            param == "cache_salt" || message.contains("cache_salt"),
            "{salt}: {reply}"
        );
    }
}

/// The system prompt of [`chat`], as a file for `--public-system-prompt`.
fn public_system_prompt() -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    let system = chat("", None)["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    std::fs::write(file.path(), system).unwrap();
    file
}

#[tokio::test(flavor = "multi_thread")]
async fn i9_a_public_system_prompt_serves_every_tenant_from_its_first_request() {
    let (a, a_lines) = tenant("alpha", &[]);
    let (b, b_lines) = tenant("beta", &[]);
    let file = tenants_file(&[a_lines, b_lines]);
    let config = file.path().to_str().unwrap();
    let system = public_system_prompt();
    let system = system.path().to_str().unwrap();
    let reference = Server::start(&["--config", config, "--prefix-cache", "off"]);
    let question = "Which page holds the drain steps?";
    let expected = ask(&reference, &a, chat(question, None)).await.0;

    for mode in ["colocated", "disaggregated"] {
        let args = ["--config", config, "--mode", mode];
        let server = Server::start(&[&args[..], &["--public-system-prompt", system]].concat());
        assert!(server.metric("kvfence_pool_pages{state=\"public\"}").await >= 2.0);
        for (key, salt) in [(&a, None), (&b, None), (&a, Some("project-x"))] {
            let (text, cached) = ask(&server, key, chat(question, salt)).await;
            assert_eq!(text, expected, "{mode}: the public pages changed an answer");
            assert!(
                cached >= 32,
                "{mode}: a first request missed the public prompt: {cached}"
            );
        }
        server.wait_for_baseline().await;
        // Without the flag the same first requests compute everything.
        let private = Server::start(&args);
        assert_eq!(ask(&private, &b, chat(question, None)).await.1, 0);
    }
}

#[test]
fn a_public_system_prompt_that_cannot_be_read_is_refused_at_start() {
    let system = public_system_prompt();
    let system = system.path().to_str().unwrap();
    let short = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(short.path(), "Be brief.").unwrap();
    let short = short.path().to_str().unwrap();
    let blank = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(blank.path(), " \n\t\n").unwrap();
    let blank = blank.path().to_str().unwrap();
    for (args, says) in [
        (
            vec!["--public-system-prompt", blank],
            "the public system prompt is empty",
        ),
        (
            vec!["--public-system-prompt", system, "--prefix-cache", "off"],
            "--prefix-cache on",
        ),
        (
            vec!["--public-system-prompt", short],
            "--public-prefix-min-tokens",
        ),
        (
            vec!["--public-system-prompt", "/nonexistent/system.txt"],
            "reading --public-system-prompt",
        ),
        (
            vec![
                "--public-system-prompt",
                system,
                "--prefix-cache-tenant-quota",
                "1",
            ],
            "--prefix-cache-tenant-quota",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
            .args(["serve", "--model", "builtin:tiny", "--port", "0"])
            .args(["--kv-pool-tokens", "1024"])
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("runbook"),
            "an error quoted the prompt: {stderr}"
        );
    }
}
