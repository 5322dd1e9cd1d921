//! What the bench's tests share: a bare HTTP/1.1 server that reads requests
//! and leaves to each test how, and whether, to answer them; a two-token
//! stream; a small run.

use std::io::{BufRead, BufReader, Read};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use kvfence_audit::bench::{BenchConfig, Report};

/// Serves every connection on a thread of its own with `connection`, and
/// returns the server's base URL.
pub fn serve(connection: fn(TcpStream)) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            std::thread::spawn(move || connection(stream));
        }
    });
    format!("http://{address}")
}

/// Reads one request, headers and body, from `reader`: `false` when the
/// client closed the connection before sending one.
pub fn read_request(reader: &mut BufReader<TcpStream>) -> bool {
    let mut length = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return false;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap();
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    true
}

/// A response streaming two tokens and the usage, its event lines ending
/// in `line_end`: the head (closing the connection after it when `close`)
/// and the events.
pub fn two_tokens(line_end: &str, close: bool) -> (String, String) {
    let events = [
        r#"data: {"choices":[{"text":"a","finish_reason":null}]}"#,
        r#"data: {"choices":[{"text":"b","finish_reason":"length"}]}"#,
        r#"data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}"#,
        "data: [DONE]",
    ]
    .map(|event| format!("{event}{line_end}{line_end}"))
    .concat();
    let connection = if close { "connection: close\r\n" } else { "" };
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n{connection}\r\n",
        events.len()
    );
    (head, events)
}

/// A run of 4 requests, one at a time, on reused connections, against
/// `base_url`, giving up on 30 s of silence.
pub fn config(base_url: String) -> BenchConfig {
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
        fresh_connections: false,
        seed: 0,
        idle_timeout: Duration::from_secs(30),
    }
}

/// Runs the bench of `config` to its report.
pub fn run(config: &BenchConfig) -> Report {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(kvfence_audit::bench::run(config))
}
