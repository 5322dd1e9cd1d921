//! `kvfence audit` against real servers: every check passes on healthy
//! kvfence, colocated and disaggregated, with several tenants; a server
//! that answers 200 with fixed text to everything fails capacity honesty
//! and boundaries; and a disaggregated kvfence whose prefill pool is
//! smaller than its decode pool is held to the smaller one — the test that
//! `scripts/mutation-check` runs with mutation (f), under which the server
//! advertises the decode pool's context and the audit fails.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::process::Output;

use crate::common::{Server, tenant, tenants_file};
use serde_json::Value;

fn audit(base: &str, extra: &[&str]) -> (Output, Value) {
    let report = tempfile::NamedTempFile::new().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args([
            "audit",
            "--base-url",
            base,
            "--budget-seconds",
            "120",
            "--report",
        ])
        .arg(report.path())
        .args(extra)
        .output()
        .unwrap();
    let json = std::fs::read_to_string(report.path())
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null);
    (out, json)
}

fn verdicts(report: &Value) -> Vec<(String, String)> {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["check"].as_str().unwrap().to_string(),
                c["verdict"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn all_pass(out: &Output, report: &Value, what: &str) {
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{what}:\n{table}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verdicts = verdicts(report);
    assert_eq!(verdicts.len(), 7, "{what}: {verdicts:?}");
    // The walls between tenants need two tenants' keys to be checked.
    let single_tenant =
        |(check, verdict): &(String, String)| check == "prefix-cache walls" && verdict == "skipped";
    assert!(
        verdicts.iter().all(|v| v.1 == "pass" || single_tenant(v)),
        "{what}: {verdicts:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn healthy_kvfence_passes_every_check_colocated_and_disaggregated() {
    let tenants: Vec<(String, String)> = (0..3)
        .map(|i| tenant(&format!("audit{i}"), &["--max-concurrent", "16"]))
        .collect();
    let file = tenants_file(&tenants.iter().map(|t| t.1.clone()).collect::<Vec<_>>());
    let config = file.path().to_str().unwrap();
    let keys: Vec<&str> = tenants
        .iter()
        .flat_map(|t| ["--api-key", t.0.as_str()])
        .collect();
    for mode in ["colocated", "disaggregated"] {
        let server = Server::start(&[
            "--config",
            config,
            "--mode",
            mode,
            "--kv-pool-tokens",
            "512",
        ]);
        let mut args = keys.clone();
        let metrics = server.metrics_url();
        args.extend(["--metrics-url", metrics.as_str()]);
        let (out, report) = audit(&server.base, &args);
        all_pass(&out, &report, mode);
        let canaries = report["checks"][3]["figures"].as_str().unwrap_or_default();
        assert!(
            canaries.contains("/metrics checked"),
            "the canaries were looked for in the metrics too: {canaries}"
        );
        server.wait_for_baseline().await;
    }
}

/// A "server" that answers every request with 200 and the same text, and
/// advertises a 64-token context it never enforces.
fn start_fake_server() -> String {
    start_fake_server_that(false)
}

/// A fake server that says 200 to everything; with `drops_long_prompts`, it
/// closes the connection without an answer on prompts of over 100 tokens,
/// as a server that dies on long requests would.
fn start_fake_server_that(drops_long_prompts: bool) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                let n = stream.read(&mut buf).unwrap_or(0);
                let request = String::from_utf8_lossy(&buf[..n]);
                if drops_long_prompts && request.matches(',').count() > 100 {
                    return;
                }
                let body = if request.starts_with("GET /v1/models") {
                    r#"{"object":"list","data":[{"id":"fake","object":"model","max_model_len":64}]}"#
                } else {
                    r#"{"id":"x","object":"text_completion","choices":[{"index":0,"text":"All good.","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":3,"total_tokens":4}}"#
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    format!("http://{addr}")
}

/// A check that cannot finish is reported, and the audit goes on: the
/// table and the JSON report hold all seven checks.
#[test]
fn a_check_that_cannot_finish_is_reported_inconclusive_and_the_audit_goes_on() {
    let base = start_fake_server_that(true);
    let (out, report) = audit(&base, &[]);
    let verdicts = verdicts(&report);
    assert_eq!(verdicts.len(), 7, "every check is reported: {verdicts:?}");
    assert!(
        verdicts.contains(&("capacity honesty".to_string(), "inconclusive".to_string())),
        "{verdicts:?}"
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("inconclusive") && table.contains("fail-closed"),
        "{table}"
    );
}

#[test]
fn a_server_that_says_200_to_everything_fails_capacity_and_boundaries() {
    let base = start_fake_server();
    let (out, report) = audit(&base, &[]);
    assert!(!out.status.success(), "the audit must fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("capacity honesty") && stderr.contains("boundaries"),
        "{stderr}"
    );
    let verdicts = verdicts(&report);
    for check in ["capacity honesty", "boundaries"] {
        assert!(
            verdicts.contains(&(check.to_string(), "fail".to_string())),
            "{check}: {verdicts:?}"
        );
    }
}

/// Incident replay (f), switched on by `scripts/mutation-check`: with it,
/// the server advertises the decode pool's 512 tokens while prefill holds
/// 256, and the audit's capacity check must say so. Without it, this
/// disaggregated server is honest and passes.
#[tokio::test(flavor = "multi_thread")]
async fn the_audit_holds_a_disaggregated_server_to_its_smallest_pool() {
    let server = Server::start(&[
        "--mode",
        "disaggregated",
        "--kv-pool-tokens",
        "512",
        "--prefill-pool-tokens",
        "256",
    ]);
    let (out, report) = audit(&server.base, &[]);
    all_pass(
        &out,
        &report,
        "disaggregated, prefill pool smaller than decode's",
    );
}
