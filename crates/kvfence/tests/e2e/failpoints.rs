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
