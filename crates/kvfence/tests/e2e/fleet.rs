//! A fleet as an operator runs one: two prefill workers, two decode
//! workers (each linked to both prefill workers) and a router, as real
//! processes over the authenticated links. Answers equal one process's;
//! every worker takes work; a killed worker fails only what it held, the
//! rest keeps serving, and a restarted one rejoins within seconds without
//! restarting anything else; SIGTERM drains.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::{ClusterTls, Server, post, tenant, tenants_file, wait_for_status};
use crate::multiprocess::{start_decode, start_prefill, start_router};

/// Status listener for a worker, so its own counters can be read.
const STATUS: [&str; 2] = ["--metrics-listen", "127.0.0.1:0"];

/// How long a decode worker waits for KV before failing a grant: shorter
/// than the default, so a request caught by a crash ends sooner, and long
/// enough for a loaded two-core machine to prefill the test's prompts.
const HANDOFF_TIMEOUT: [&str; 2] = ["--handoff-timeout-ms", "15000"];

struct Fleet {
    prefills: Vec<Server>,
    decodes: Vec<Server>,
    router: Server,
    _tls: ClusterTls,
}

/// `prefills` prefill workers, `decodes` decode workers each linked to
/// every prefill worker, and a router in front of all decode workers,
/// started with `router_args`.
fn fleet(prefills: usize, decodes: usize, router_args: &[&str]) -> Fleet {
    let tls = ClusterTls::init();
    let prefills: Vec<Server> = (0..prefills)
        .map(|_| start_prefill(&tls, &STATUS))
        .collect();
    let prefill_list = prefills
        .iter()
        .map(|p| p.base.as_str())
        .collect::<Vec<_>>()
        .join(",");
    let mut decode_args = STATUS.to_vec();
    decode_args.extend(HANDOFF_TIMEOUT);
    let decodes: Vec<Server> = (0..decodes)
        .map(|_| start_decode(&tls, &prefill_list, &decode_args))
        .collect();
    let decode_list = decodes
        .iter()
        .map(|d| d.base.as_str())
        .collect::<Vec<_>>()
        .join(",");
    let router = start_router(&tls, &decode_list, router_args);
    Fleet {
        prefills,
        decodes,
        router,
        _tls: tls,
    }
}

fn body(i: usize) -> serde_json::Value {
    json!({
        "prompt": format!("{i} fleet {}", "z".repeat(i * 13 % 90)),
        "max_tokens": 12,
        "temperature": if i.is_multiple_of(3) { 0.8 } else { 0.0 },
        "seed": i,
        "ignore_eos": true,
    })
}

/// Waits until no page is held in `server`'s own pools.
async fn wait_for_own_baseline(server: &Server) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.pages_held().await > 0.0 {
        assert!(
            Instant::now() < deadline,
            "I8: a worker's pool never came back to baseline"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_prefill_and_two_decode_workers_answer_64_requests_from_4_tenants_like_one_process() {
    let tenants: Vec<(String, String)> = (0..4)
        .map(|t| tenant(&format!("team{t}"), &["--max-concurrent", "32"]))
        .collect();
    let config = tenants_file(&tenants.iter().map(|(_, c)| c.clone()).collect::<Vec<_>>());
    let config_path = config.path().to_str().unwrap().to_string();
    let fleet = fleet(
        2,
        2,
        &["--config", &config_path, "--metrics-listen", "127.0.0.1:0"],
    );
    let reference = Server::start(&["--mode", "colocated"]);
    let url = fleet.router.url("/v1/completions");
    let jobs = (0..64).map(|i| {
        let (url, key) = (url.clone(), tenants[i % 4].0.clone());
        async move {
            let (status, answer) = post(&url, Some(&key), body(i)).await;
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["text"].as_str().unwrap().to_string()
        }
    });
    let got = futures_util::future::join_all(jobs).await;
    let reference_url = reference.url("/v1/completions");
    let expected = futures_util::future::join_all((0..64).map(|i| {
        let url = reference_url.clone();
        async move {
            let (status, answer) = post(&url, None, body(i)).await;
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["text"].as_str().unwrap().to_string()
        }
    }))
    .await;
    assert_eq!(got, expected, "the fleet answers exactly like one process");
    for (i, decode) in fleet.decodes.iter().enumerate() {
        let committed = decode
            .metric("kvfence_handoffs_total{reason=\"committed\"}")
            .await;
        assert!(
            committed > 0.0 && committed < 64.0,
            "decode worker {i} took {committed} of 64"
        );
    }
    for (i, prefill) in fleet.prefills.iter().enumerate() {
        let prompt_tokens = prefill.metric("kvfence_prompt_tokens_total").await;
        assert!(prompt_tokens > 0.0, "prefill worker {i} prefilled nothing");
    }
    // The router shows each decode worker's own counters, labelled by
    // worker, and two scrapes at once both do.
    for decode in &fleet.decodes {
        let own = decode.metric("kvfence_generated_tokens_total").await;
        let series = format!(
            "kvfence_generated_tokens_total{{worker=\"{}\"}}",
            decode.base
        );
        let (a, b) = tokio::join!(fleet.router.metric(&series), fleet.router.metric(&series));
        assert_eq!((a, b), (own, own), "the router's {series}");
    }
    fleet.router.wait_for_baseline().await;
    for worker in fleet.prefills.iter().chain(&fleet.decodes) {
        wait_for_own_baseline(worker).await;
    }
}

/// Sends `n` requests of `max_tokens` at once; every one must end as a
/// whole answer or an OpenAI error, within the hand-off timeout's reach.
/// Returns how many failed.
async fn load(url: &str, n: usize, offset: usize, max_tokens: usize) -> usize {
    let jobs = (0..n).map(|i| {
        let url = url.to_string();
        async move {
            let request = json!({
                "prompt": format!("{} under load {}", offset + i, "w".repeat(600 + i * 7)),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": true,
                "seed": offset + i,
            });
            // The hand-off timeout is 15 s: nothing may wait much longer.
            let answer = tokio::time::timeout(Duration::from_secs(30), post(&url, None, request))
                .await
                .expect("no request hangs past the hand-off timeout");
            match answer {
                (200, answer) => {
                    assert_eq!(
                        answer["usage"]["completion_tokens"], max_tokens,
                        "a 200 is a whole answer"
                    );
                    0
                }
                (_, answer) => {
                    assert!(
                        answer["error"]["message"].is_string(),
                        "an OpenAI error: {answer}"
                    );
                    1
                }
            }
        }
    });
    futures_util::future::join_all(jobs).await.into_iter().sum()
}

/// Sends one request a time until one succeeds; panics after `limit`.
async fn serves_within(router: &Server, limit: Duration, what: &str) {
    let started = Instant::now();
    loop {
        let (status, answer) = post(&router.url("/v1/completions"), None, body(5)).await;
        if status == 200 {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "{what}: still {status} after {limit:?}: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_worker_fails_only_what_it_held_and_rejoins_when_restarted() {
    let mut fleet = fleet(2, 2, &["--metrics-listen", "127.0.0.1:0"]);
    let url = fleet.router.url("/v1/completions");
    for victim in ["prefill", "decode"] {
        let router = fleet.router.base.clone();
        let pending = tokio::spawn({
            let url = url.clone();
            // Long completions, so the decode worker is killed mid-answer.
            let max_tokens = if victim == "decode" { 400 } else { 16 };
            async move { load(&url, 16, 0, max_tokens).await }
        });
        let killed = match victim {
            "prefill" => &mut fleet.prefills[0],
            _ => &mut fleet.decodes[0],
        };
        // Killed while it holds work.
        let deadline = Instant::now() + Duration::from_secs(10);
        while killed.metric("kvfence_running_requests").await < 1.0 {
            assert!(
                Instant::now() < deadline,
                "the {victim} worker never got work"
            );
        }
        let label = format!("worker=\"{}\"", killed.base);
        killed.kill();
        let failed = pending.await.unwrap();
        if victim == "decode" {
            // A dead worker's numbers are absent, not stale, not zero.
            let text = fleet.router.metrics_text().await;
            assert!(
                !text.contains(&label),
                "{label} still in the router's metrics:\n{text}"
            );
        }
        assert!(
            failed < 16,
            "{victim} killed: the other pair kept serving ({failed} of 16 failed)"
        );
        // A lost prefill worker's hand-offs move to the other one: nothing
        // is lost (prefill is deterministic, so the answers are the same).
        // What a killed decode worker was decoding ends with an error (or,
        // if the router had not yet heard it was accepted, is sent to the
        // other pair), never a hang or a cut answer — `load` checks that.
        if victim == "prefill" {
            assert_eq!(failed, 0, "hand-offs on the lost prefill worker moved");
        }
        // The rest of the fleet serves at once, without the dead worker.
        serves_within(&fleet.router, Duration::from_secs(5), "the surviving pair").await;
        assert_eq!(
            load(&url, 8, 100, 16).await,
            0,
            "{victim} down: requests go around it"
        );
        // Restarted on the same address, it rejoins within seconds and
        // takes work again; nothing else was restarted.
        let restarted_at = Instant::now();
        let killed = match victim {
            "prefill" => &mut fleet.prefills[0],
            _ => &mut fleet.decodes[0],
        };
        killed.restart();
        let metric = match victim {
            "prefill" => "kvfence_prompt_tokens_total",
            _ => "kvfence_handoffs_total{reason=\"committed\"}",
        };
        // Fresh prompts each round: repeats would rightly stay with the
        // pair that caches them.
        for round in 0.. {
            assert_eq!(
                load(&url, 4, 200 + 4 * round, 16).await,
                0,
                "requests succeed while it rejoins"
            );
            let worker = match victim {
                "prefill" => &fleet.prefills[0],
                _ => &fleet.decodes[0],
            };
            if worker.metric(metric).await > 0.0 {
                break;
            }
            assert!(
                restarted_at.elapsed() < Duration::from_secs(5),
                "the restarted {victim} worker took no work within 5 s"
            );
        }
        assert_eq!(fleet.router.base, router);
        fleet.router.wait_for_baseline().await;
        for worker in fleet.prefills.iter().chain(&fleet.decodes) {
            wait_for_own_baseline(worker).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn workers_report_readiness_and_drain_on_sigterm() {
    let fleet = fleet(1, 1, &["--metrics-listen", "127.0.0.1:0"]);
    for server in [&fleet.prefills[0], &fleet.decodes[0], &fleet.router] {
        wait_for_status(server, "/ready", 200).await;
        wait_for_status(server, "/health", 200).await;
    }
    // A worker's /metrics shows its own pool.
    for (worker, role) in [
        (&fleet.prefills[0], "prefill"),
        (&fleet.decodes[0], "decode"),
    ] {
        let text = worker.metrics_text().await;
        let free = format!("kvfence_pool_pages{{worker=\"local\",role=\"{role}\",state=\"free\"}}");
        assert!(text.contains(&free), "{text}");
    }
    // The decode worker without a prefill worker is alive but not ready,
    // and the router, with no pair left, says so too.
    let Fleet {
        mut prefills,
        decodes,
        router,
        _tls,
    } = fleet;
    prefills[0].kill();
    wait_for_status(&decodes[0], "/ready", 503).await;
    wait_for_status(&decodes[0], "/health", 200).await;
    wait_for_status(&router, "/ready", 503).await;
    let (status, answer) = post(&router.url("/v1/completions"), None, body(1)).await;
    assert_eq!(status, 503, "{answer}");
    prefills[0].restart();
    wait_for_status(&decodes[0], "/ready", 200).await;
    wait_for_status(&router, "/ready", 200).await;
    serves_within(&router, Duration::from_secs(5), "after the prefill restart").await;
    // SIGTERM on the decode worker mid-request: the request finishes, new
    // ones are refused, and the process exits by itself, cleanly.
    let long = tokio::spawn({
        let url = router.url("/v1/completions");
        async move {
            post(
                &url,
                None,
                json!({"prompt": "drain me", "max_tokens": 400, "ignore_eos": true}),
            )
            .await
        }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while decodes[0].metric("kvfence_running_requests").await < 1.0 {
        assert!(Instant::now() < deadline, "the long request started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut decodes = decodes;
    let decode = decodes.remove(0);
    decode.terminate();
    wait_for_status(&router, "/ready", 503).await;
    let (status, answer) = long.await.unwrap();
    assert_eq!(
        status, 200,
        "a request in flight finishes during the drain: {answer}"
    );
    assert_eq!(answer["usage"]["completion_tokens"], 400);
    assert!(
        decode.wait().success(),
        "the drained decode worker exits cleanly"
    );
    let (status, _) = post(&router.url("/v1/completions"), None, body(2)).await;
    assert_eq!(status, 503, "no decode worker left");
    prefills[0].terminate();
    assert!(prefills.remove(0).wait().success());
    router.terminate();
    assert!(router.wait().success());
}

/// A prefill worker told to stop (SIGTERM) under load tells its decode
/// workers, which send new orders to the other one: it finishes what it
/// has, says it drained, and exits cleanly — and no client notices.
#[tokio::test(flavor = "multi_thread")]
async fn a_draining_prefill_worker_gets_no_new_orders_and_exits_cleanly() {
    let tls = ClusterTls::init();
    // Small steps, so it always has an order in hand under this load: it
    // could only drain by being sent nothing new.
    let mut drain_args = STATUS.to_vec();
    drain_args.extend(["--shutdown-timeout", "20", "--step-tokens", "16"]);
    let draining = start_prefill(&tls, &drain_args);
    let other = start_prefill(&tls, &STATUS);
    let prefills = format!("{},{}", draining.base, other.base);
    let decode = start_decode(&tls, &prefills, &STATUS);
    let router = start_router(&tls, &decode.base, &[]);
    let url = router.url("/v1/completions");
    // Load that keeps coming for the whole drain: eight clients, each
    // sending its next request as soon as the last one is answered.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..8)
        .map(|client| {
            let (url, stop) = (url.clone(), std::sync::Arc::clone(&stop));
            tokio::spawn(async move {
                let (mut failed, mut sent) = (0, 0);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    failed += load(&url, 1, client * 1000 + sent, 8).await;
                    sent += 1;
                }
                (failed, sent)
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while draining.metric("kvfence_prompt_tokens_total").await == 0.0 {
        assert!(
            Instant::now() < deadline,
            "the first prefill worker took work"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    draining.terminate();
    let log = draining.log_after_exit();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut failed, mut sent) = (0, 0);
    for client in clients {
        let (f, s) = client.await.unwrap();
        (failed, sent) = (failed + f, sent + s);
    }
    assert!(
        log.contains("drained; exiting"),
        "it drained rather than timed out:\n{log}"
    );
    assert_eq!(failed, 0, "no client noticed ({sent} requests)");
    serves_within(&router, Duration::from_secs(5), "after the drain").await;
    router.wait_for_baseline().await;
    wait_for_own_baseline(&other).await;
}

/// Two decode workers on one prefill worker number their hand-offs the
/// same way (1, 2, 3…): the prefill worker keeps each link's apart, so
/// every answer is still exactly one process's. Incident replay (g) keys
/// them by id alone and is caught here.
#[tokio::test(flavor = "multi_thread")]
async fn i1_hand_off_ids_of_two_decode_workers_on_one_prefill_worker_never_meet() {
    let fleet = fleet(1, 2, &[]);
    let reference = Server::start(&["--mode", "colocated"]);
    let run = |server: &Server| {
        let url = server.url("/v1/completions");
        async move {
            futures_util::future::join_all((0..32).map(|i| {
                let url = url.clone();
                async move {
                    let (status, answer) = post(&url, None, body(i)).await;
                    assert_eq!(status, 200, "{answer}");
                    answer["choices"][0]["text"].as_str().unwrap().to_string()
                }
            }))
            .await
        }
    };
    let got = run(&fleet.router).await;
    assert_eq!(got, run(&reference).await);
    for decode in &fleet.decodes {
        let committed = decode
            .metric("kvfence_handoffs_total{reason=\"committed\"}")
            .await;
        assert!(committed > 0.0, "both decode workers took work");
    }
    fleet.router.wait_for_baseline().await;
}

/// A tenant's repeats go to the pair that took their prefix, so both its
/// prefill and its decode worker find the prompt cached: every repeat
/// hits on both sides (with free pages as the only tie-break, repeats
/// would go to the other, emptier, decode worker and miss).
#[tokio::test(flavor = "multi_thread")]
async fn repeats_follow_their_prefix_to_the_pair_that_caches_it() {
    let fleet = fleet(2, 2, &["--metrics-listen", "127.0.0.1:0"]);
    let url = fleet.router.url("/v1/completions");
    let prompt = |p: usize| format!("{p} {}", "runbook step ".repeat(12 + p));
    for round in 0..4 {
        for p in 0..3 {
            let body = json!({"prompt": prompt(p), "max_tokens": 4, "temperature": 0});
            let (status, answer) = post(&url, None, body).await;
            assert_eq!(status, 200, "round {round}, prompt {p}: {answer}");
            // Let the router's view of the workers' free pages catch up
            // (it polls every 250 ms), so free pages really tie-break.
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
    }
    let mut hits = [0.0, 0.0];
    for (side, workers) in [&fleet.prefills, &fleet.decodes].into_iter().enumerate() {
        for worker in workers {
            hits[side] += worker.metric("kvfence_prefix_cache_hits_total").await;
        }
    }
    assert_eq!(hits, [9.0, 9.0], "prefill and decode hits of 9 repeats");
    fleet.router.wait_for_baseline().await;
}
