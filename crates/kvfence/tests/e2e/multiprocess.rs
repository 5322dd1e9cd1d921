//! The roles as real processes over mutually authenticated TLS: `kvfence
//! prefill`, `kvfence decode` and `kvfence router`. Answers equal a
//! single-process server's; killing the prefill process mid-request gives
//! clients errors and the decode pool returns to baseline. Attacks on the
//! links themselves are in `links.rs`.

#![allow(clippy::unwrap_used)]

use crate::common::{ClusterTls, Server, post};
use serde_json::json;

pub struct Cluster {
    pub prefill: Server,
    pub decode: Server,
    pub router: Server,
    pub tls: ClusterTls,
}

/// A prefill, a decode and a router process sharing fresh credentials.
pub fn cluster(prefill_args: &[&str], decode_args: &[&str]) -> Cluster {
    let tls = ClusterTls::init();
    let prefill = start_prefill(&tls, prefill_args);
    let decode = start_decode(&tls, &prefill.base, decode_args);
    let router = start_router(&tls, &decode.base, &[]);
    Cluster {
        prefill,
        decode,
        router,
        tls,
    }
}

/// Environment variables for one process.
pub type Env<'a> = &'a [(&'a str, &'a str)];

pub fn start_prefill(tls: &ClusterTls, extra: &[&str]) -> Server {
    start_prefill_with(tls, extra, &[])
}

pub fn start_decode(tls: &ClusterTls, prefill: &str, extra: &[&str]) -> Server {
    start_decode_with(tls, prefill, extra, &[])
}

pub fn start_router(tls: &ClusterTls, decode: &str, extra: &[&str]) -> Server {
    start_router_with(tls, decode, extra, &[])
}

/// `kvfence prefill` on a free port, with `extra` arguments and `env`.
pub fn start_prefill_with(tls: &ClusterTls, extra: &[&str], env: Env<'_>) -> Server {
    let mut args = vec!["prefill", "--listen", "127.0.0.1:0", "--tls-dir", tls.dir()];
    args.extend_from_slice(extra);
    Server::start_process(&args, env)
}

/// `kvfence decode` dialling `prefill`, with `extra` arguments and `env`.
pub fn start_decode_with(tls: &ClusterTls, prefill: &str, extra: &[&str], env: Env<'_>) -> Server {
    let mut args = vec!["decode", "--listen", "127.0.0.1:0", "--prefill", prefill];
    args.extend(["--tls-dir", tls.dir()]);
    args.extend_from_slice(extra);
    Server::start_process(&args, env)
}

/// `kvfence router` in front of `decode`, with `extra` arguments and `env`.
pub fn start_router_with(tls: &ClusterTls, decode: &str, extra: &[&str], env: Env<'_>) -> Server {
    let mut args = vec!["router", "--port", "0", "--decode", decode];
    args.extend(["--tls-dir", tls.dir()]);
    args.extend_from_slice(extra);
    Server::start_process(&args, env)
}

fn body(i: usize, prompt_len: usize, max_tokens: usize) -> serde_json::Value {
    json!({
        "prompt": format!("{i}: {}", "k".repeat(prompt_len)),
        "max_tokens": max_tokens,
        "temperature": if i.is_multiple_of(2) { 0.0 } else { 0.9 },
        "seed": i,
        "ignore_eos": true,
    })
}

async fn texts(server: &Server, n: usize) -> Vec<String> {
    let url = server.url("/v1/completions");
    let jobs = (0..n).map(|i| {
        let url = url.clone();
        async move {
            let (status, answer) = post(&url, None, body(i, i * 9 % 70, 10)).await;
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["text"].as_str().unwrap().to_string()
        }
    });
    futures_util::future::join_all(jobs).await
}

#[tokio::test(flavor = "multi_thread")]
async fn three_processes_answer_exactly_like_one() {
    let reference = Server::start(&["--mode", "colocated"]);
    let cluster = cluster(&[], &[]);
    assert_eq!(
        texts(&cluster.router, 16).await,
        texts(&reference, 16).await
    );
    assert_eq!(
        cluster
            .router
            .metric("kvfence_handoffs_total{reason=\"committed\"}")
            .await,
        16.0
    );
    cluster.router.wait_for_baseline().await;
}

/// Peers named by DNS name rather than address (as a Kubernetes Service
/// names pods): `localhost` resolves through the system resolver, and the
/// cluster answers like one process.
#[tokio::test(flavor = "multi_thread")]
async fn peers_given_by_dns_name_are_resolved_and_linked() {
    let tls = ClusterTls::init();
    let prefill = start_prefill(&tls, &[]);
    let by_name = |base: &str| base.replace("127.0.0.1", "localhost");
    let decode = start_decode(&tls, &by_name(&prefill.base), &[]);
    let router = start_router(&tls, &by_name(&decode.base), &[]);
    let reference = Server::start(&["--mode", "colocated"]);
    assert_eq!(texts(&router, 4).await, texts(&reference, 4).await);
}

/// A decode worker that stops answering for longer than the router's view
/// of it lasts — a process starved of CPU, or paused, as SIGSTOP pauses it
/// here — but whose link stays up is waited for, not reported unavailable:
/// a request that arrives meanwhile is answered once the worker runs again.
#[tokio::test(flavor = "multi_thread")]
async fn a_decode_worker_that_stalls_past_the_routers_view_is_waited_for() {
    let cluster = cluster(&[], &[]);
    assert_eq!(texts(&cluster.router, 1).await.len(), 1);
    let signal = |name: &str| {
        let status = std::process::Command::new("kill")
            .args([name, &cluster.decode.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {name}");
    };
    signal("-STOP");
    // Past the router's view (2 s without an answer).
    tokio::time::sleep(std::time::Duration::from_millis(3_000)).await;
    let url = cluster.router.url("/v1/completions");
    let request = tokio::spawn(async move { post(&url, None, body(7, 20, 4)).await });
    tokio::time::sleep(std::time::Duration::from_millis(1_000)).await;
    signal("-CONT");
    let (status, answer) = request.await.unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 4);
}

/// A prefill worker that stores its KV as f32 and a decode worker that
/// stores f16 must never pair: pages cross as bytes, so one would read the
/// other's numbers as garbage. The decode worker refuses at its first dial
/// and says why.
#[test]
fn workers_of_different_kv_types_refuse_to_link() {
    let tls = ClusterTls::init();
    let prefill = start_prefill(&tls, &["--kv-dtype", "f32"]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args(["decode", "--listen", "127.0.0.1:0", "--kv-dtype", "f16"])
        .args(["--prefill", &prefill.base, "--tls-dir", tls.dir()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the decode worker started: {stderr}");
    assert!(
        stderr.contains("f32") && stderr.contains("f16"),
        "the refusal names both types: {stderr}"
    );
}

/// A peer entry that can never be dialled stops the start with an error
/// that names it, before anything is loaded.
#[test]
fn a_malformed_peer_name_is_refused_at_start() {
    let tls = ClusterTls::init();
    for (role, flag) in [("decode", "--prefill"), ("router", "--decode")] {
        let mut args = vec![role, flag, "kvfence-prefill", "--tls-dir", tls.dir()];
        if role == "decode" {
            args.extend(["--listen", "127.0.0.1:0"]);
        }
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{role} started");
        assert!(
            stderr.contains("\"kvfence-prefill\"") && stderr.contains("HOST:PORT"),
            "{role}: {stderr}"
        );
    }
}

/// The API's shaping fields cross the router's link and the hand-off: a
/// grammar, penalties, `logit_bias`, logprobs, `n` and a required tool call
/// give through three processes exactly what one process gives.
#[tokio::test(flavor = "multi_thread")]
async fn constraints_logprobs_n_and_tools_through_the_router_equal_one_process() {
    let reference = Server::start(&["--mode", "colocated"]);
    let cluster = cluster(&[], &[]);
    let tools = serde_json::json!([{"type": "function", "function": {"name": "pick",
        "parameters": {"type": "object", "additionalProperties": false,
            "properties": {"side": {"enum": ["left", "right"]}}, "required": ["side"]}}}]);
    let bodies = [
        serde_json::json!({"messages": [{"role": "user", "content": "code?"}], "max_tokens": 30,
            "temperature": 0.9, "seed": 3, "n": 2, "logprobs": true, "top_logprobs": 2,
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
            "logit_bias": {"97": 4},
            "response_format": {"type": "regex", "regex": "[a-f]{3,8}-[0-9]{2}"}}),
        serde_json::json!({"messages": [{"role": "user", "content": "which?"}], "max_tokens": 60,
            "tools": tools, "tool_choice": "required", "temperature": 0.7, "seed": 5}),
    ];
    for body in bodies {
        let answer = |server: &Server| {
            let url = server.url("/v1/chat/completions");
            let body = body.clone();
            async move {
                let (status, mut answer) = post(&url, None, body).await;
                assert_eq!(status, 200, "{answer}");
                // Ids and times differ between servers; the rest must not.
                for key in ["id", "created", "system_fingerprint"] {
                    answer[key] = serde_json::Value::Null;
                }
                for choice in answer["choices"].as_array_mut().unwrap() {
                    for call in choice["message"]["tool_calls"]
                        .as_array_mut()
                        .into_iter()
                        .flatten()
                    {
                        call["id"] = serde_json::Value::Null;
                    }
                }
                answer["usage"]["prompt_tokens_details"] = serde_json::Value::Null;
                answer
            }
        };
        let expected = answer(&reference).await;
        assert_eq!(answer(&cluster.router).await, expected);
    }
    cluster.router.wait_for_baseline().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killing_the_prefill_process_mid_request_gives_errors_and_frees_the_decode_pool() {
    let mut cluster = cluster(&["--step-tokens", "32"], &[]);
    let url = cluster.router.url("/v1/completions");
    let jobs: Vec<_> = (0..8)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, None, body(i, 3000, 20)).await })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    cluster.prefill.kill();
    let mut failed = 0;
    for job in jobs {
        let (status, answer) = job.await.unwrap();
        match status {
            200 => assert_eq!(
                answer["usage"]["completion_tokens"], 20,
                "a 200 is a whole answer"
            ),
            _ => {
                assert!(
                    answer["error"]["message"].is_string(),
                    "an error in the OpenAI envelope: {answer}"
                );
                failed += 1;
            }
        }
    }
    assert!(
        failed > 0,
        "some requests were waiting for the killed prefill worker"
    );
    cluster.router.wait_for_baseline().await;
    let (status, answer) = post(&url, None, body(99, 10, 5)).await;
    assert_eq!(status, 503, "no prefill worker: {answer}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_router_spreads_requests_over_decode_workers_and_advertises_the_smallest_pool() {
    let a = cluster(&["--kv-pool-tokens", "4096"], &["--kv-pool-tokens", "4096"]);
    let small_prefill = start_prefill(&a.tls, &["--kv-pool-tokens", "1024"]);
    let b = start_decode(&a.tls, &small_prefill.base, &[]);
    let decodes = format!("{},{}", a.decode.base, b.base);
    let router = start_router(&a.tls, &decodes, &[]);
    let models: serde_json::Value = router.get_json("/v1/models").await;
    assert_eq!(
        models["data"][0]["max_model_len"], 1024,
        "the smallest prefill pool in the fleet bounds the context"
    );
    let reference = Server::start(&["--mode", "colocated"]);
    assert_eq!(texts(&router, 24).await, texts(&reference, 24).await);
    // Both workers took part: their hand-offs add up to every request.
    assert_eq!(
        router
            .metric("kvfence_handoffs_total{reason=\"committed\"}")
            .await,
        24.0
    );
    let direct_a = a
        .router
        .metric("kvfence_handoffs_total{reason=\"committed\"}")
        .await;
    assert!(
        direct_a > 0.0 && direct_a < 24.0,
        "worker a took {direct_a} of 24"
    );
    router.wait_for_baseline().await;
}

/// Two scrapes of the router's `/metrics` at once both show the decode
/// worker's real counters (they once shared one reply slot, and one of
/// them read zeros).
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_scrapes_of_the_router_both_see_the_workers_real_counters() {
    let cluster = cluster(&[], &[]);
    let url = cluster.router.url("/v1/completions");
    let long = reqwest::Client::new()
        .post(&url)
        .json(&json!({"prompt": "keep going", "max_tokens": 3000, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while cluster.router.metric("kvfence_running_requests").await < 1.0 {
        assert!(std::time::Instant::now() < deadline, "the request runs");
    }
    for _ in 0..5 {
        let (a, b) = tokio::join!(
            cluster.router.metric("kvfence_running_requests"),
            cluster.router.metric("kvfence_running_requests")
        );
        assert_eq!((a, b), (1.0, 1.0), "both scrapes see the running request");
    }
    drop(long);
    cluster.router.wait_for_baseline().await;
}
