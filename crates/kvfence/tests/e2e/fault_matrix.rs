//! The fault matrix over TCP: `kvfence prefill`, `decode` and `router` as
//! real processes, with a fault injected at each phase of a request's life
//! — when prefill takes the grant, between KV chunks, after `Done` before
//! decode commits, and during decode steps. Faults: a delay, a stall (the
//! hand-off timeout must fire), a crash of the worker, and a client that
//! disconnects. After every case the client saw a whole answer or an
//! error — never a 200 with a wrong or partial text — and the decode pool
//! is back at baseline (I8). Built with `--features failpoints`.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common::{ClusterTls, Server, post};
use crate::multiprocess::{Env, start_decode_with, start_prefill_with, start_router_with};
use serde_json::json;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Grant,
    MidChunk,
    BeforeCommit,
    DecodeStep,
}

impl Phase {
    const ALL: [Phase; 4] = [
        Phase::Grant,
        Phase::MidChunk,
        Phase::BeforeCommit,
        Phase::DecodeStep,
    ];

    fn failpoint(self) -> &'static str {
        match self {
            Phase::Grant => "handoff-grant",
            Phase::MidChunk => "handoff-mid-chunk",
            Phase::BeforeCommit => "handoff-before-commit",
            Phase::DecodeStep => "decode-step",
        }
    }

    /// Whether the failpoint sits in the prefill process (else decode's).
    fn in_prefill(self) -> bool {
        matches!(self, Phase::Grant | Phase::MidChunk)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Delay,
    Stall,
    Crash,
    Disconnect,
}

struct Cluster {
    _prefill: Server,
    _decode: Server,
    router: Server,
    _tls: ClusterTls,
}

/// Starts the three processes; `failpoints` goes to the process the phase lives in.
fn cluster(phase: Phase, failpoints: &str) -> Cluster {
    let tls = ClusterTls::init();
    let fp = [("FAILPOINTS", failpoints)];
    let none: [(&str, &str); 0] = [];
    let (prefill_env, decode_env): (Env<'_>, Env<'_>) = if phase.in_prefill() {
        (&fp, &none)
    } else {
        (&none, &fp)
    };
    let prefill = start_prefill_with(&tls, &["--step-tokens", "16"], prefill_env);
    let decode = start_decode_with(
        &tls,
        &prefill.base,
        &["--handoff-timeout-ms", "1000"],
        decode_env,
    );
    let router = start_router_with(&tls, &decode.base, &[], &none);
    Cluster {
        _prefill: prefill,
        _decode: decode,
        router,
        _tls: tls,
    }
}

/// A prompt spanning several 16-token pages, so there is a "between chunks".
fn request() -> serde_json::Value {
    json!({"prompt": "the fault matrix ".repeat(8), "max_tokens": 6, "temperature": 0.0, "ignore_eos": true})
}

async fn reference_text() -> String {
    let server = Server::start(&["--mode", "colocated"]);
    let (status, answer) = post(&server.url("/v1/completions"), None, request()).await;
    assert_eq!(status, 200, "{answer}");
    answer["choices"][0]["text"].as_str().unwrap().to_string()
}

/// A whole, correct answer or an error in the OpenAI envelope.
fn assert_whole_or_error(case: &str, status: u16, answer: &serde_json::Value, expected: &str) {
    if status == 200 {
        assert_eq!(
            answer["choices"][0]["text"], expected,
            "{case}: a 200 must be the right answer"
        );
        assert_eq!(
            answer["usage"]["completion_tokens"], 6,
            "{case}: a 200 is whole"
        );
    } else {
        assert!(
            answer["error"]["message"].is_string(),
            "{case}: error envelope: {answer}"
        );
    }
}

async fn run_case(phase: Phase, fault: Fault, expected: &str) {
    let case = format!("{fault:?} at {phase:?}");
    // Between chunks, the first chunk goes out untouched: the fault hits a
    // transfer under way.
    let first = if phase == Phase::MidChunk {
        "1*off->"
    } else {
        ""
    };
    let action = match fault {
        Fault::Delay if phase == Phase::MidChunk => "1*sleep(300)->off",
        Fault::Delay => "sleep(300)",
        Fault::Stall => "return(stall)",
        Fault::Crash => "return(crash)",
        // Held long enough for the client to leave while it waits.
        Fault::Disconnect if phase == Phase::DecodeStep => "sleep(500)",
        Fault::Disconnect => "1*sleep(1500)->off",
    };
    let cluster = cluster(phase, &format!("{}={first}{action}", phase.failpoint()));
    let url = cluster.router.url("/v1/completions");
    match fault {
        Fault::Disconnect => {
            let gone =
                tokio::time::timeout(Duration::from_millis(300), post(&url, None, request())).await;
            assert!(gone.is_err(), "{case}: the request should still be held");
        }
        _ => {
            let (status, answer) =
                tokio::time::timeout(Duration::from_secs(30), post(&url, None, request()))
                    .await
                    .unwrap_or_else(|_| panic!("{case}: no answer and no error within 30 s"));
            assert_whole_or_error(&case, status, &answer, expected);
            match fault {
                Fault::Delay => {
                    assert_eq!(status, 200, "{case}: a delay is not a failure: {answer}")
                }
                Fault::Stall | Fault::Crash => {
                    assert_ne!(status, 200, "{case}: the answer cannot be whole: {answer}")
                }
                Fault::Disconnect => unreachable!(),
            }
        }
    }
    // A crashed decode worker takes its pool with it; otherwise the router
    // reports decode's pool, which must drain back to nothing held.
    if fault != Fault::Crash || phase.in_prefill() {
        cluster.router.wait_for_baseline().await;
    }
    if matches!(fault, Fault::Delay | Fault::Disconnect) {
        // The cluster is still whole and keeps answering correctly.
        let (status, answer) = post(&url, None, request()).await;
        assert_eq!(status, 200, "{case}: the next request: {answer}");
        assert_eq!(
            answer["choices"][0]["text"], expected,
            "{case}: the next request"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_fault_at_every_phase_ends_in_an_answer_or_an_error_and_a_clean_pool() {
    let expected = reference_text().await;
    for phase in Phase::ALL {
        for fault in [Fault::Delay, Fault::Stall, Fault::Crash, Fault::Disconnect] {
            if phase == Phase::DecodeStep && fault == Fault::Stall {
                // A stalled decode step is a slow request, not a fault with
                // an end: the delay case covers it.
                continue;
            }
            run_case(phase, fault, &expected).await;
        }
    }
}
