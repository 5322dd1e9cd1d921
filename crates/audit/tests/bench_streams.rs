//! `kvfence bench` against servers that stream in ways the OpenAI servers
//! it was first run against do not: events whose lines end in CRLF (legal
//! server-sent events), and a server that accepts a request and then says
//! nothing at all.

#![allow(clippy::unwrap_used)]

use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvfence_audit::bench::BenchConfig;

mod common;

use common::{config, run};

/// Reads a request and answers two tokens and the usage, every line ending
/// in CRLF, in pieces that split a CRLF pair and an event.
fn crlf_events(mut stream: TcpStream) {
    common::read_request(&mut BufReader::new(stream.try_clone().unwrap()));
    let (head, events) = common::two_tokens("\r\n", true);
    stream.write_all(head.as_bytes()).unwrap();
    let split = events.find("\r\n\r\n").unwrap() + 1;
    for piece in [
        &events[..split],
        &events[split..split + 30],
        &events[split + 30..],
    ] {
        stream.write_all(piece.as_bytes()).unwrap();
        stream.flush().unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Reads a request and never answers (the connection stays open).
fn silence(stream: TcpStream) {
    common::read_request(&mut BufReader::new(stream.try_clone().unwrap()));
    std::thread::sleep(Duration::from_secs(60));
    drop(stream);
}

#[test]
fn events_with_crlf_line_ends_are_read_like_lf_ones() {
    let report = run(&BenchConfig {
        concurrency: 2,
        requests: 2,
        fresh_connections: true,
        ..config(common::serve(crlf_events))
    });
    assert_eq!(report.succeeded, 2, "failures: {:?}", report.failures);
    let tokens = report.output_token_throughput * report.duration_s;
    assert!((tokens - 4.0).abs() < 1e-6, "{tokens} tokens");
}

#[test]
fn a_silent_server_fails_the_requests_after_the_idle_timeout_instead_of_holding_the_run() {
    let started = Instant::now();
    let report = run(&BenchConfig {
        concurrency: 2,
        requests: 2,
        idle_timeout: Duration::from_millis(300),
        ..config(common::serve(silence))
    });
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the run waited for the server instead of giving up"
    );
    assert_eq!(report.succeeded, 0);
    assert_eq!(report.retried, 0, "a timeout is not a closed connection");
    assert_eq!(
        report
            .failures
            .get("the server sent nothing for longer than the idle timeout"),
        Some(&2),
        "{:?}",
        report.failures
    );
}
