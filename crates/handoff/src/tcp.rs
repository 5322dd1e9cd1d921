//! The byte-level framing of a link between processes: `len: u32`, then
//! `len` bytes of payload, with `len` bounded before anything is allocated.
//!
//! Links run inside TLS 1.3 with mutual, role-bound certificates
//! (`tls`, with the crate's `tls` feature); these helpers frame what flows inside it. They are
//! generic over `Read`/`Write` so that tests and benchmarks can frame any
//! byte stream the same way.

use std::io::{IoSlice, Read, Write};

use crate::error::HandoffError;
use crate::wire::MAX_FRAME;

/// Largest link frame: a hand-off frame plus a little envelope.
pub const MAX_LINK_FRAME: usize = MAX_FRAME + 64;

fn io(e: std::io::Error) -> HandoffError {
    HandoffError::Io(e.to_string())
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
