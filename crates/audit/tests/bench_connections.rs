//! `kvfence bench` against a server that closes kept-alive connections
//! without saying so (as `llama-server` does): no request is lost to a
//! stale pooled connection, and a fresh connection per request needs no
//! retry at all.

#![allow(clippy::unwrap_used)]

use std::io::{BufReader, Write};
use std::net::TcpStream;

use kvfence_audit::bench::BenchConfig;

mod common;

use common::{config, run};

/// Answers the first request of every connection with a two-token stream,
/// keeps the connection open, and drops it on the second request without
/// a byte of response.
fn one_answer_per_connection(mut stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    if !common::read_request(&mut reader) {
        return;
    }
    let (head, events) = common::two_tokens("\n", false);
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(events.as_bytes()).unwrap();
    // The next request on this connection is read and left unanswered.
    common::read_request(&mut reader);
}

#[test]
fn a_pooled_connection_the_server_closed_costs_a_retry_not_a_request() {
    let report = run(&config(common::serve(one_answer_per_connection)));
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
    let report = run(&BenchConfig {
        concurrency: 4,
        requests: 16,
        ..config(common::serve(one_answer_per_connection))
    });
    assert_eq!(report.succeeded, 16, "failures: {:?}", report.failures);
    assert!(report.retried >= 1);
}

#[test]
fn fresh_connections_need_no_retry() {
    let report = run(&BenchConfig {
        fresh_connections: true,
        ..config(common::serve(one_answer_per_connection))
    });
    assert_eq!(report.succeeded, 4, "failures: {:?}", report.failures);
    assert_eq!(report.retried, 0);
}
