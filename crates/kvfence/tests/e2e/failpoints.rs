//! Faults injected into the real binary (built with `--features failpoints`;
//! CI runs `cargo test -p kvfence --features failpoints --test e2e failpoints::`).

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common::Server;
use serde_json::json;

/// I4 over the shared-memory hand-off: a prefill worker goes silent
/// mid-transfer; the decode worker's hand-off timeout revokes the writer's
/// window, fails the request (503) and asks the writer to acknowledge. A
/// writer that never does leaves the pages quarantined — visible in
/// `/metrics` — and never free for another request.
#[tokio::test(flavor = "multi_thread")]
async fn i4_pages_of_a_writer_that_never_acks_stay_quarantined_and_visible() {
    let server = Server::start_process(
        &[
            "serve",
            "--model",
            "builtin:tiny",
            "--port",
            "0",
            "--handoff",
            "shm",
            "--handoff-timeout-ms",
            "300",
        ],
        &[(
            "FAILPOINTS",
            "prefill-stall=return;prefill-no-abort-ack=return",
        )],
    );
    let (status, body) = crate::common::post(
        &server.url("/v1/completions"),
        None,
        json!({"prompt": "stalled", "max_tokens": 5}),
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "worker_unavailable");
    let quarantined = "kvfence_pool_pages{role=\"decode\",state=\"quarantined\"}";
    let pages = server.metric(quarantined).await;
    assert!(pages > 0.0, "the revoked grant's pages are quarantined");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        server.metric(quarantined).await,
        pages,
        "still quarantined: no ack, no release"
    );
    assert_eq!(
        server
            .metric("kvfence_pool_pages{role=\"decode\",state=\"leased\"}")
            .await,
        0.0
    );
    assert!(server.metric("kvfence_pool_pages_quarantined_total").await >= pages);
    // The worker keeps serving: other pages are still free.
    assert!(
        server
            .metric("kvfence_pool_pages{role=\"decode\",state=\"free\"}")
            .await
            > 0.0
    );
}

/// The default mode's hand-off deadline measures the prefill worker's
/// silence, not the prompt's length: every KV chunk takes 150 ms to leave
/// (nine of them, well past a 400 ms timeout in all), yet each one shows
/// the worker alive, so the answer is whole and the same as colocated.
#[tokio::test(flavor = "multi_thread")]
async fn a_transfer_longer_than_the_handoff_timeout_completes_while_chunks_keep_coming() {
    let body = json!({"prompt": "the fault matrix ".repeat(8), "max_tokens": 6,
                      "temperature": 0.0, "ignore_eos": true});
    let reference = Server::start(&["--mode", "colocated"]);
    let (status, expected) =
        crate::common::post(&reference.url("/v1/completions"), None, body.clone()).await;
    assert_eq!(status, 200, "{expected}");
    let slow = Server::start_with_env(
        &["--handoff-timeout-ms", "400"],
        &[("FAILPOINTS", "handoff-mid-chunk=sleep(150)")],
    );
    let started = std::time::Instant::now();
    let (status, answer) = crate::common::post(&slow.url("/v1/completions"), None, body).await;
    assert_eq!(status, 200, "{answer}");
    assert!(
        started.elapsed() > Duration::from_millis(800),
        "the transfer really outlasted the timeout ({:?})",
        started.elapsed()
    );
    assert_eq!(answer["choices"][0]["text"], expected["choices"][0]["text"]);
    slow.wait_for_baseline().await;
}
