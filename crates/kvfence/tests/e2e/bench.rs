//! `kvfence bench` against a real server: a seconds-long smoke run so the
//! tool cannot rot, and a failing server makes it fail.

#![allow(clippy::unwrap_used)]

use crate::common::{Server, tenant, tenants_file};

#[test]
fn bench_measures_a_real_server_across_tenants_and_writes_json() {
    let (a, lines_a) = tenant("a", &[]);
    let (b, lines_b) = tenant("b", &[]);
    let file = tenants_file(&[lines_a, lines_b]);
    let server = Server::start(&["--config", file.path().to_str().unwrap()]);
    let json = tempfile::NamedTempFile::new().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args([
            "bench",
            "--base-url",
            &server.base,
            "--requests",
            "12",
            "--concurrency",
            "4",
        ])
        .args([
            "--prompt-len",
            "24",
            "--output-len",
            "8",
            "--api-key",
            &a,
            "--api-key",
            &b,
        ])
        .args(["--json", json.path().to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("time to first token"), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(json.path()).unwrap()).unwrap();
    assert_eq!(report["succeeded"], 12);
    assert!(report["output_token_throughput"].as_f64().unwrap() > 0.0);
    assert!(report["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
    assert!(
        report["ttft_ms"]["p99"].as_f64().unwrap() >= report["ttft_ms"]["p50"].as_f64().unwrap()
    );
}

#[test]
fn bench_fails_when_the_server_refuses() {
    let (_, lines) = tenant("only", &[]);
    let file = tenants_file(&[lines]);
    let server = Server::start(&["--config", file.path().to_str().unwrap()]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args([
            "bench",
            "--base-url",
            &server.base,
            "--requests",
            "3",
            "--prompt-len",
            "4",
            "--output-len",
            "2",
            "--api-key",
            "kvf-wrong",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("401"),
        "failures are reported by cause"
    );
}
