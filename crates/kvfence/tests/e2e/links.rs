//! Attacks on the links between worker processes (I9): every link is TLS
//! 1.3 with mutual, role-bound certificates, and an unauthenticated peer
//! costs a bounded amount. Each test attacks the real binaries the way a
//! stranger on the network (or on the path) would, and checks both that the
//! attack gets nothing and that real requests are unaffected.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvfence_fleet::tls::{Credentials, Role};
use serde_json::json;

use crate::common::{ClusterTls, Server, post, wait_for_status};
use crate::multiprocess::{cluster, start_decode, start_prefill, start_router};

fn request(i: usize) -> serde_json::Value {
    json!({"prompt": format!("link test {i}"), "max_tokens": 4, "temperature": 0.0, "ignore_eos": true})
}

async fn assert_serves(router: &Server) {
    let (status, answer) = post(&router.url("/v1/completions"), None, request(0)).await;
    assert_eq!(status, 200, "real requests are unaffected: {answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 4);
}

/// Reads from `stream` until the server closes it; returns what it sent.
/// Panics if it is still open after `limit`.
fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> Vec<u8> {
    stream.set_read_timeout(Some(limit)).unwrap();
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) => panic!(
                "still open after {:?} ({e}): the server must close it",
                started.elapsed()
            ),
        }
    }
}

/// Everything the server sent is TLS records, none of them application data
/// before the handshake ends: at most a handshake and an alert.
fn assert_no_application_data(bytes: &[u8]) {
    let mut rest = bytes;
    while rest.len() >= 5 {
        let (kind, len) = (rest[0], u16::from_be_bytes([rest[3], rest[4]]) as usize);
        assert!(
            matches!(kind, 20..=23),
            "not a TLS record: the server answered in another protocol: {bytes:?}"
        );
        rest = &rest[(5 + len).min(rest.len())..];
    }
}

fn address(server: &Server) -> String {
    server.base.clone()
}

/// The 2026 reflection attack on the old handshake: two connections to a
/// worker, each fed what the worker sent on the other. Under TLS both ends
/// are servers waiting for a ClientHello: nothing passes, and the worker
/// closes both by its handshake deadline.
#[tokio::test(flavor = "multi_thread")]
async fn i9_reflecting_a_workers_own_handshake_back_at_it_gets_nothing() {
    let cluster = cluster(&[], &[]);
    // Attacked once it serves: a decode worker links to its prefill
    // worker after it listens, and until then the router answers 503.
    wait_for_status(&cluster.router, "/ready", 200).await;
    let target = address(&cluster.decode);
    let (mut a, mut b) = (
        TcpStream::connect(&target).unwrap(),
        TcpStream::connect(&target).unwrap(),
    );
    // The old protocol opened with a magic and a nonce; send it on both.
    for s in [&mut a, &mut b] {
        s.write_all(b"KVFHAND1").unwrap();
        s.write_all(&[7u8; 32]).unwrap();
    }
    let relay = |mut from: TcpStream, mut to: TcpStream| {
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while let Ok(n) = from.read(&mut buf) {
                if n == 0 {
                    break;
                }
                seen.extend_from_slice(&buf[..n]);
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Both);
            seen
        })
    };
    let started = Instant::now();
    let ab = relay(a.try_clone().unwrap(), b.try_clone().unwrap());
    let ba = relay(b, a);
    let (from_a, from_b) = (ab.join().unwrap(), ba.join().unwrap());
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "closed by the handshake deadline"
    );
    assert_no_application_data(&from_a);
    assert_no_application_data(&from_b);
    cluster.decode.wait_for_log("refused a connection");
    assert_serves(&cluster.router).await;
}

/// A proxy that records what the client sent on its first connection.
fn recording_proxy(upstream: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let recorded = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&recorded);
    std::thread::spawn(move || {
        let Ok((client, _)) = listener.accept() else {
            return;
        };
        let server = TcpStream::connect(upstream).unwrap();
        let (mut c_in, mut s_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || {
            let mut buf = [0u8; 16384];
            while let Ok(n) = c_in.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
                if s_out.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        });
        let (mut s_in, mut c_out) = (server, client);
        let _ = std::io::copy(&mut s_in, &mut c_out);
    });
    (address, recorded)
}

/// A recording of a real router's side of a real handshake, replayed on a
/// new connection: the worker's fresh randoms make it worthless.
#[tokio::test(flavor = "multi_thread")]
async fn i9_a_replayed_recording_of_a_real_handshake_is_refused() {
    let cluster = cluster(&[], &[]);
    // Attacked once it serves: a decode worker links to its prefill
    // worker after it listens, and until then the router answers 503.
    wait_for_status(&cluster.router, "/ready", 200).await;
    let (proxy, recorded) = recording_proxy(address(&cluster.decode));
    let recorded_router = start_router(&cluster.tls, &proxy, &[]);
    assert_serves(&recorded_router).await;
    let recording = recorded.lock().unwrap().clone();
    assert!(
        recording.len() > 500,
        "a handshake and a request were recorded"
    );
    let mut replay = TcpStream::connect(address(&cluster.decode)).unwrap();
    replay.write_all(&recording).unwrap();
    let answer = read_until_closed(&mut replay, Duration::from_secs(15));
    assert_no_application_data(&answer);
    cluster
        .decode
        .wait_for_log("refused a connection: TLS handshake failed");
    assert_serves(&cluster.router).await;
}

/// A router holding a valid cluster layout — from another CA — cannot
/// connect, and says why.
#[test]
fn i9_a_certificate_from_another_ca_is_refused() {
    let cluster = cluster(&[], &[]);
    let stranger = ClusterTls::init();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args([
            "router",
            "--port",
            "0",
            "--decode",
            &address(&cluster.decode),
        ])
        .args(["--tls-dir", stranger.dir()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("TLS") || stderr.contains("certificate"),
        "{stderr}"
    );
    cluster.decode.wait_for_log("refused a connection");
}

/// The cluster's own CA, but the wrong role: a prefill worker's certificate
/// cannot act as a router, and a decode worker that dials something other
/// than a prefill worker refuses it.
#[tokio::test(flavor = "multi_thread")]
async fn i9_a_certificate_of_the_wrong_role_is_refused_both_ways() {
    let cluster = cluster(&[], &[]);
    // Attacked once it serves: a decode worker links to its prefill
    // worker after it listens, and until then the router answers 503.
    wait_for_status(&cluster.router, "/ready", 200).await;
    // A client presenting the prefill certificate to the decode worker's
    // router port: the chain is good, the role is not.
    let prefill = Credentials::load(cluster.tls.path(), Role::Prefill).unwrap();
    let tcp = TcpStream::connect(address(&cluster.decode)).unwrap();
    let tls =
        rustls::ClientConnection::new(prefill.client_config(), Role::Decode.server_name()).unwrap();
    let mut stream = rustls::StreamOwned::new(tls, tcp);
    stream
        .sock
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 64];
    let read = stream.read(&mut buf);
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "no Hello for a prefill certificate: {read:?}"
    );
    cluster.decode.wait_for_log("names none of the roles");
    // A decode worker pointed at another decode worker instead of a
    // prefill worker: the server's certificate does not say "prefill".
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args(["decode", "--listen", "127.0.0.1:0"])
        .args(["--prefill", &address(&cluster.decode)])
        .args(["--tls-dir", cluster.tls.dir()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("certificate"), "{stderr}");
    assert_serves(&cluster.router).await;
}

/// Plain TCP — an HTTP client, or a client of the old protocol — is closed
/// without an answer in its own protocol.
#[tokio::test(flavor = "multi_thread")]
async fn i9_a_plain_tcp_client_is_refused() {
    let cluster = cluster(&[], &[]);
    // Attacked once it serves: a decode worker links to its prefill
    // worker after it listens, and until then the router answers 503.
    wait_for_status(&cluster.router, "/ready", 200).await;
    for (target, bytes) in [
        (
            address(&cluster.decode),
            &b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        ),
        (address(&cluster.prefill), &b"KVFHAND1\x00\x01\x02\x03"[..]),
    ] {
        let mut plain = TcpStream::connect(&target).unwrap();
        plain.write_all(bytes).unwrap();
        let answer = read_until_closed(&mut plain, Duration::from_secs(10));
        assert_no_application_data(&answer);
        assert!(
            !String::from_utf8_lossy(&answer).contains("HTTP"),
            "{answer:?}"
        );
    }
    assert_serves(&cluster.router).await;
}

/// Hundreds of silent connections on a worker's port: a new router still
/// connects and serves, the existing one is unaffected, and the silent ones
/// are closed by the handshake deadline.
#[tokio::test(flavor = "multi_thread")]
async fn i9_a_flood_of_half_open_connections_does_not_lock_out_real_peers() {
    let cluster = cluster(&[], &[]);
    // Attacked once it serves: a decode worker links to its prefill
    // worker after it listens, and until then the router answers 503.
    wait_for_status(&cluster.router, "/ready", 200).await;
    let flood: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(address(&cluster.decode)).unwrap())
        .collect();
    let mut prefill_flood: Vec<TcpStream> = (0..50)
        .map(|_| TcpStream::connect(address(&cluster.prefill)).unwrap())
        .collect();
    assert_serves(&cluster.router).await;
    let late_router = start_router(&cluster.tls, &address(&cluster.decode), &[]);
    assert_serves(&late_router).await;
    for mut silent in flood.into_iter().chain(prefill_flood.drain(..)) {
        assert_no_application_data(&read_until_closed(&mut silent, Duration::from_secs(15)));
    }
    assert_serves(&cluster.router).await;
}

/// Which records a tampering proxy flips a byte in.
#[derive(Clone, Copy)]
enum Tamper {
    /// The first server-to-client record of at least 8 KiB: KV chunk data.
    LargeRecordDownstream,
    /// The first client-to-server record of at least 1 KiB: a `Submit`
    /// with a long prompt (the router's periodic stats questions are tens
    /// of bytes).
    LargeRecordUpstream,
}

/// A man in the middle that forwards TLS records and flips one byte in one
/// of them.
fn tampering_proxy(upstream: String, tamper: Tamper) -> (String, Arc<Mutex<bool>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let flipped = Arc::new(Mutex::new(false));
    let done = Arc::clone(&flipped);
    std::thread::spawn(move || {
        let Ok((client, _)) = listener.accept() else {
            return;
        };
        let server = TcpStream::connect(upstream).unwrap();
        let pipe = move |mut from: TcpStream, mut to: TcpStream, flip: bool| {
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                loop {
                    let mut header = [0u8; 5];
                    if from.read_exact(&mut header).is_err() {
                        break;
                    }
                    let len = u16::from_be_bytes([header[3], header[4]]) as usize;
                    let mut body = vec![0u8; len];
                    if from.read_exact(&mut body).is_err() {
                        break;
                    }
                    let mut flag = done.lock().unwrap();
                    let hit = flip
                        && !*flag
                        && header[0] == 23
                        && match tamper {
                            Tamper::LargeRecordDownstream => len >= 8192,
                            Tamper::LargeRecordUpstream => len >= 1024,
                        };
                    if hit {
                        body[len / 2] ^= 0x01;
                        *flag = true;
                    }
                    drop(flag);
                    if to.write_all(&header).is_err() || to.write_all(&body).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(Shutdown::Both);
            })
        };
        let down = matches!(tamper, Tamper::LargeRecordDownstream);
        pipe(
            client.try_clone().unwrap(),
            server.try_clone().unwrap(),
            !down,
        );
        pipe(server, client, down);
    });
    (address, flipped)
}

/// A flipped byte in a KV chunk on the prefill → decode link: the record
/// fails its integrity check, the link ends, the request fails with an
/// error and no text, and the decode pool returns to baseline.
#[tokio::test(flavor = "multi_thread")]
async fn i9_a_tampered_kv_chunk_ends_the_link_and_the_request_with_an_error() {
    let tls = ClusterTls::init();
    let prefill = start_prefill(&tls, &[]);
    let (proxy, flipped) = tampering_proxy(address(&prefill), Tamper::LargeRecordDownstream);
    let decode = start_decode(&tls, &proxy, &[]);
    let router = start_router(&tls, &address(&decode), &[]);
    let body = json!({"prompt": "tamper ".repeat(100), "max_tokens": 4, "temperature": 0.0});
    let (status, answer) = post(&router.url("/v1/completions"), None, body).await;
    assert!(*flipped.lock().unwrap(), "the proxy flipped a byte");
    assert_ne!(status, 200, "{answer}");
    assert!(answer["error"]["message"].is_string(), "{answer}");
    assert!(answer.get("choices").is_none(), "{answer}");
    router.wait_for_baseline().await;
    drop((prefill, decode, tls));
}

/// A flipped byte in a control frame on the router → decode link: the
/// decode worker ends the link and frees what the router had in flight;
/// the client gets an error, never an answer built from the tampered
/// message, and a router with a clean link finds the pool at baseline.
#[tokio::test(flavor = "multi_thread")]
async fn i9_a_tampered_control_frame_ends_the_link_and_the_request_with_an_error() {
    let tls = ClusterTls::init();
    let prefill = start_prefill(&tls, &[]);
    let decode = start_decode(&tls, &address(&prefill), &[]);
    let (proxy, flipped) = tampering_proxy(address(&decode), Tamper::LargeRecordUpstream);
    let router = start_router(&tls, &proxy, &[]);
    let long = json!({"prompt": "tamper ".repeat(300), "max_tokens": 4, "temperature": 0.0});
    let (status, answer) = post(&router.url("/v1/completions"), None, long).await;
    assert!(*flipped.lock().unwrap(), "the proxy flipped a byte");
    assert_ne!(status, 200, "{answer}");
    assert!(answer["error"]["message"].is_string(), "{answer}");
    let clean = start_router(&tls, &address(&decode), &[]);
    clean.wait_for_baseline().await;
    assert_serves(&clean).await;
    drop((prefill, router, tls));
}
