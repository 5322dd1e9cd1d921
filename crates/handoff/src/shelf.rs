//! [`FrameShelf`]: the buffers of frames that cross a transport, kept for
//! the next frame instead of being given back to the allocator.
//!
//! A hand-off's chunk frames are large (a page of every layer: hundreds of
//! KB) and are made on one thread and let go on another, after the peer or
//! the link is done with them. Handed back to the allocator, such a block
//! tends to go back to the OS, and the next frame, of the same size, is
//! faulted in and zeroed by the kernel again: a fifth of a TLS link's CPU
//! went to that (`docs/performance.md`, "Over TCP"). A shelf keeps up to
//! `max_bytes` of them; a frame taken from it is written from its start.
//!
//! A kept buffer still holds the bytes of the frame it last carried, which
//! may be another tenant's KV. Nothing can read them: a buffer leaves the
//! shelf empty (length zero), so safe code sees only what the next frame
//! writes into it, and [`FrameShelf::freeze`] shares exactly that length.

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;

/// What a prefill worker's or a link's shelf keeps at most: a 512-token
/// prompt of a 30-layer model with f32 KV in flight at once (23.6 MB), with
/// room to spare. A shelf holds only what was once in flight together, so
/// a worker that hands off short prompts keeps far less.
pub const FRAME_SHELF_BYTES: usize = 32 << 20;

/// A bounded stack of frame buffers, shared by whoever makes frames and
/// every holder of a frame it made (each returns its buffer when the last
/// handle to the frame is dropped). Cloning shares the shelf.
#[derive(Clone, Debug)]
pub struct FrameShelf {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    max_bytes: usize,
    kept: Mutex<Kept>,
}

#[derive(Debug, Default)]
struct Kept {
    /// Last in, first out: the most recently used buffer is the likeliest
    /// to still be in cache.
    buffers: Vec<Vec<u8>>,
    /// The capacity of `buffers`, summed.
    bytes: usize,
}

impl FrameShelf {
    /// A shelf that keeps buffers whose capacities sum to at most
    /// `max_bytes`; a buffer returned past that is freed.
    pub fn new(max_bytes: usize) -> FrameShelf {
        FrameShelf {
            shared: Arc::new(Shared {
                max_bytes,
                kept: Mutex::new(Kept::default()),
            }),
        }
    }

    /// An empty buffer that can hold `capacity` bytes without growing: the
    /// most recently returned one, or a new one when the shelf is empty.
    pub fn take(&self, capacity: usize) -> Vec<u8> {
        let kept = {
            let mut kept = self.shared.lock();
            let buffer = kept.buffers.pop();
            if let Some(buffer) = &buffer {
                kept.bytes -= buffer.capacity();
            }
            buffer
        };
        match kept {
            Some(mut buffer) => {
                debug_assert!(buffer.is_empty(), "a kept buffer is empty");
                buffer.reserve(capacity);
                buffer
            }
            None => Vec::with_capacity(capacity),
        }
    }

    /// `buffer`'s bytes as a frame that any number of holders share; the
    /// buffer comes back to this shelf when the last of them drops it.
    pub fn freeze(&self, buffer: Vec<u8>) -> Bytes {
        Bytes::from_owner(OnLoan {
            buffer,
            home: Arc::clone(&self.shared),
        })
    }

    /// Capacity on the shelf now, summed (for tests and metrics).
    pub fn kept_bytes(&self) -> usize {
        self.shared.lock().bytes
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        // The lock guards a list of buffers only; a panic elsewhere while
        // it was held cannot have left the list inconsistent.
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn give_back(&self, mut buffer: Vec<u8>) {
        buffer.clear();
        let mut kept = self.lock();
        if kept.bytes + buffer.capacity() <= self.max_bytes {
            kept.bytes += buffer.capacity();
            kept.buffers.push(buffer);
        }
    }
}

/// A buffer lent out as a frame: [`Bytes`] owns it and drops it once, when
/// its last handle goes.
struct OnLoan {
    buffer: Vec<u8>,
    home: Arc<Shared>,
}

impl AsRef<[u8]> for OnLoan {
    fn as_ref(&self) -> &[u8] {
        &self.buffer
    }
}

impl Drop for OnLoan {
    fn drop(&mut self) {
        self.home.give_back(std::mem::take(&mut self.buffer));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_returns_its_buffer_when_its_last_handle_drops() {
        let shelf = FrameShelf::new(1 << 20);
        let mut buffer = shelf.take(1000);
        buffer.extend_from_slice(&[7; 1000]);
        let address = buffer.as_ptr();
        let frame = shelf.freeze(buffer);
        let clone = frame.clone();
        let part = frame.slice(10..20);
        assert_eq!(&part[..], &[7; 10]);
        drop(frame);
        drop(clone);
        assert_eq!(shelf.kept_bytes(), 0, "a slice still holds the buffer");
        drop(part);
        assert!(shelf.kept_bytes() >= 1000);
        let again = shelf.take(1000);
        assert_eq!(again.as_ptr(), address, "the same buffer, reused");
        assert!(
            again.is_empty(),
            "a reused buffer shows none of its old bytes"
        );
        assert!(again.capacity() >= 1000);
        assert_eq!(shelf.kept_bytes(), 0);
    }

    #[test]
    fn the_shelf_keeps_no_more_than_its_bound() {
        let shelf = FrameShelf::new(2500);
        let frames: Vec<Bytes> = (0..4)
            .map(|_| {
                let mut buffer = shelf.take(1000);
                buffer.resize(1000, 1);
                shelf.freeze(buffer)
            })
            .collect();
        drop(frames);
        let kept = shelf.kept_bytes();
        assert!((1000..=2500).contains(&kept), "kept {kept} bytes");
        // Taking empties the shelf one buffer at a time; then new ones.
        let taken: Vec<Vec<u8>> = (0..4).map(|_| shelf.take(1000)).collect();
        assert_eq!(shelf.kept_bytes(), 0);
        assert!(taken.iter().all(|b| b.is_empty() && b.capacity() >= 1000));
    }

    #[test]
    fn a_small_kept_buffer_grows_to_what_is_asked() {
        let shelf = FrameShelf::new(1 << 20);
        drop(shelf.freeze(shelf.take(10)));
        let buffer = shelf.take(100_000);
        assert!(buffer.is_empty() && buffer.capacity() >= 100_000);
    }

    #[test]
    fn frames_go_home_from_other_threads() {
        let shelf = FrameShelf::new(1 << 20);
        let mut buffer = shelf.take(64);
        buffer.extend_from_slice(&[3; 64]);
        let frame = shelf.freeze(buffer);
        std::thread::spawn(move || assert_eq!(&frame[..], &[3; 64]))
            .join()
            .expect("reader thread");
        assert!(shelf.kept_bytes() >= 64);
    }
}
