//! A bare HTTP/1.1 server for the bench's tests: it reads requests and
//! leaves to each test how, and whether, to answer them.

use std::io::{BufRead, BufReader, Read};
use std::net::{TcpListener, TcpStream};

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
