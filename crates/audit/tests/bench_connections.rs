//! `kvfence bench` against a server that closes kept-alive connections
//! without saying so (as `llama-server` does): no request is lost to a
//! stale pooled connection, and a fresh connection per request needs no
//! retry at all.

#![allow(clippy::unwrap_used)]

use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvfence_audit::bench::{BenchConfig, run};

mod common;

/// Answers the first request of every connection with a two-token stream,
/// keeps the connection open, and drops it on the second request without
/// a byte of response.
fn one_answer_per_connection(stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    for turn in 0.. {
        if !common::read_request(&mut reader) || turn > 0 {
            return; // closes without answering
        }
        let events = concat!(
            "data: {\"choices\":[{\"text\":\"a\",\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"text\":\"b\",\"finish_reason\":\"length\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\n",
            "data: [DONE]\n\n"
        );
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n",
            events.len()
        );
        writer.write_all(head.as_bytes()).unwrap();
        writer.write_all(events.as_bytes()).unwrap();
    }
}

fn config(base_url: String, fresh_connections: bool) -> BenchConfig {
    BenchConfig {
        base_url,
        api_keys: Vec::new(),
        model: None,
        concurrency: 1,
        requests: 4,
        prompt_len: 4,
        output_len: 2,
        slo_ttft: Duration::from_secs(5),
        slo_tpot: Duration::from_secs(5),
        fresh_connections,
        seed: 0,
        idle_timeout: Duration::from_secs(30),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_pooled_connection_the_server_closed_costs_a_retry_not_a_request() {
    let report = runtime().block_on(run(&config(
        common::serve(one_answer_per_connection),
        false,
    )));
    assert_eq!(report.succeeded, 4, "failures: {:?}", report.failures);
    assert!(
        report.retried >= 1,
        "the reused connections must have failed first"
    );
    assert!(report.output_token_throughput > 0.0);
}

/// With several connections pooled, the retry must not take another of
/// them: each is as stale as the one that just failed.
#[test]
fn a_retry_goes_out_on_a_new_connection_not_another_pooled_one() {
    let config = BenchConfig {
        concurrency: 4,
        requests: 16,
        ..config(common::serve(one_answer_per_connection), false)
    };
    let report = runtime().block_on(run(&config));
    assert_eq!(report.succeeded, 16, "failures: {:?}", report.failures);
    assert!(report.retried >= 1);
}

#[test]
fn fresh_connections_need_no_retry() {
    let report = runtime().block_on(run(&config(common::serve(one_answer_per_connection), true)));
    assert_eq!(report.succeeded, 4, "failures: {:?}", report.failures);
    assert_eq!(report.retried, 0);
}
