//! The TCP transport's byte-level pieces: length-delimited link frames and
//! the connection handshake.
//!
//! A connection opens with a mutual HMAC-SHA256 challenge-response on the
//! cluster secret: each side sends a magic string and a fresh 32-byte nonce,
//! then proves knowledge of the secret by MACing both nonces in its own
//! order. A peer without the secret learns nothing and gets nothing through;
//! fresh nonces make recorded answers useless. After the handshake the
//! stream carries link frames: `len: u32`, then `len` bytes of payload, with
//! `len` bounded before anything is allocated.
//!
//! These are blocking `std::net` helpers: each connection gets one reader and
//! one writer thread, which fits the engine's thread-per-worker schedulers.

use std::io::{IoSlice, Read, Write};

use hmac::{Hmac, Mac};
use rand::Rng;
use sha2::Sha256;

use crate::error::HandoffError;
use crate::wire::MAX_FRAME;

const MAGIC: &[u8; 8] = b"KVFHAND1";
const LABEL: &[u8] = b"kvfence hand-off v1";
/// Largest link frame: a hand-off frame plus a little envelope.
pub const MAX_LINK_FRAME: usize = MAX_FRAME + 64;

fn io(e: std::io::Error) -> HandoffError {
    HandoffError::Io(e.to_string())
}

fn tag(secret: &[u8], first: &[u8; 32], second: &[u8; 32]) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(LABEL);
    mac.update(first);
    mac.update(second);
    mac
}

/// Runs the mutual challenge-response on a fresh connection. Both ends call
/// it; it succeeds only if both know `secret`.
pub fn handshake<S: Read + Write>(stream: &mut S, secret: &[u8]) -> Result<(), HandoffError> {
    if secret.len() < 16 {
        return Err(HandoffError::AuthFailed {
            reason: "the cluster secret must be at least 16 bytes",
        });
    }
    let mine: [u8; 32] = rand::rng().random();
    let mut hello = Vec::with_capacity(40);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&mine);
    stream.write_all(&hello).map_err(io)?;
    let mut theirs_hello = [0u8; 40];
    stream.read_exact(&mut theirs_hello).map_err(io)?;
    if &theirs_hello[..8] != MAGIC {
        return Err(HandoffError::AuthFailed {
            reason: "the peer does not speak the kvfence hand-off protocol",
        });
    }
    let theirs: [u8; 32] = theirs_hello[8..].try_into().expect("32 bytes");
    if theirs == mine {
        return Err(HandoffError::AuthFailed {
            reason: "the peer echoed our nonce",
        });
    }
    // I prove the secret over (their nonce, my nonce); they over (mine, theirs).
    let proof = tag(secret, &theirs, &mine).finalize().into_bytes();
    stream.write_all(&proof).map_err(io)?;
    let mut their_proof = [0u8; 32];
    stream.read_exact(&mut their_proof).map_err(io)?;
    tag(secret, &mine, &theirs)
        .verify_slice(&their_proof)
        .map_err(|_| HandoffError::AuthFailed {
            reason: "the peer does not know the cluster secret",
        })
}

/// Writes one link frame.
pub fn write_link_frame<W: Write>(out: &mut W, payload: &[u8]) -> Result<(), HandoffError> {
    write_link_frame_parts(out, &[payload])
}

/// Writes one link frame whose payload is `parts` joined, without joining
/// them: the length and every part go to the socket in one vectored write
/// (a few, for frames larger than the kernel takes at once). One write also
/// keeps a small frame in one segment: a length sent alone would wait on
/// Nagle's algorithm for the payload (or for the peer's delayed ACK).
pub fn write_link_frame_parts<W: Write>(out: &mut W, parts: &[&[u8]]) -> Result<(), HandoffError> {
    let len: usize = parts.iter().map(|part| part.len()).sum();
    if len > MAX_LINK_FRAME {
        return Err(HandoffError::FrameTooLarge {
            len,
            max: MAX_LINK_FRAME,
        });
    }
    let len = u32::try_from(len).expect("bounded above").to_le_bytes();
    let mut slices: Vec<IoSlice<'_>> = std::iter::once(&len[..])
        .chain(parts.iter().copied())
        .map(IoSlice::new)
        .collect();
    let mut unsent = &mut slices[..];
    while !unsent.is_empty() {
        match out.write_vectored(unsent) {
            Ok(0) => return Err(io(std::io::ErrorKind::WriteZero.into())),
            Ok(n) => IoSlice::advance_slices(&mut unsent, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
    Ok(())
}

/// Reads one link frame; `Ok(None)` on a clean end of stream between frames.
pub fn read_link_frame<R: Read>(input: &mut R) -> Result<Option<Vec<u8>>, HandoffError> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(io(e)),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_LINK_FRAME {
        return Err(HandoffError::FrameTooLarge {
            len,
            max: MAX_LINK_FRAME,
        });
    }
    // Read into spare capacity: zeroing a page-sized buffer first would be
    // one more pass over every chunk.
    let mut payload = Vec::with_capacity(len);
    input
        .take(len as u64)
        .read_to_end(&mut payload)
        .map_err(io)?;
    if payload.len() < len {
        return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(Some(payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    fn pair(
        a: &'static [u8],
        b: &'static [u8],
    ) -> (Result<(), HandoffError>, Result<(), HandoffError>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            handshake(&mut s, b)
        });
        let (mut s, _) = listener.accept().unwrap();
        let server = handshake(&mut s, a);
        drop(s);
        (server, client.join().unwrap())
    }

    #[test]
    fn peers_with_the_same_secret_connect() {
        let (a, b) = pair(b"0123456789abcdef-cluster", b"0123456789abcdef-cluster");
        assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    }

    #[test]
    fn i9_a_peer_with_the_wrong_secret_is_refused_by_both_sides() {
        let (a, b) = pair(b"0123456789abcdef-cluster", b"0123456789abcdef-WRONG!!");
        assert!(matches!(a, Err(HandoffError::AuthFailed { .. })));
        assert!(matches!(b, Err(HandoffError::AuthFailed { .. })));
    }

    #[test]
    fn a_peer_speaking_another_protocol_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: localhost:8000\r\nAccept: */*\r\n\r\n")
                .unwrap();
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
        });
        let (mut s, _) = listener.accept().unwrap();
        assert!(matches!(
            handshake(&mut s, b"0123456789abcdef-cluster"),
            Err(HandoffError::AuthFailed { .. })
        ));
        drop(s);
        client.join().unwrap();
    }

    #[test]
    fn link_frames_round_trip_and_oversized_lengths_are_refused_before_allocating() {
        let mut buf = Vec::new();
        write_link_frame(&mut buf, b"hello").unwrap();
        write_link_frame(&mut buf, b"").unwrap();
        let mut r = &buf[..];
        assert_eq!(read_link_frame(&mut r).unwrap().unwrap(), b"hello");
        assert_eq!(read_link_frame(&mut r).unwrap().unwrap(), b"");
        assert_eq!(read_link_frame(&mut r).unwrap(), None);
        let huge = (u32::MAX).to_le_bytes();
        assert!(matches!(
            read_link_frame(&mut &huge[..]),
            Err(HandoffError::FrameTooLarge { .. })
        ));
        // In parts, through a writer that takes three bytes at a time.
        struct Trickle(Vec<u8>);
        impl Write for Trickle {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                let n = buf.len().min(3);
                self.0.extend_from_slice(&buf[..n]);
                Ok(n)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut trickle = Trickle(Vec::new());
        write_link_frame_parts(&mut trickle, &[b"he", b"", b"llo, ", b"world"]).unwrap();
        assert_eq!(
            read_link_frame(&mut &trickle.0[..]).unwrap().unwrap(),
            b"hello, world"
        );
        let truncated = [5u8, 0, 0, 0, b'h'];
        assert!(matches!(
            read_link_frame(&mut &truncated[..]),
            Err(HandoffError::Io(_))
        ));
    }
}
