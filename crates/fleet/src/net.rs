//! Links between kvfence processes: TCP inside TLS 1.3 with mutual,
//! role-bound certificates ([`kvfence_handoff::tls`]), carrying
//! length-delimited frames ([`kvfence_handoff::tcp`]).
//!
//! Every link is authenticated before a single frame is read: the server
//! requires a client certificate from the cluster CA naming a role its
//! listener accepts, and the client verifies the server's certificate for
//! the role it dialled. There is no plain-TCP mode.
//!
//! What an unauthenticated peer can cost is bounded ([`ListenLimits`]): a
//! connection gets `handshake_timeout` to finish its handshake, at most
//! `max_handshaking` are in a handshake at once (past that the oldest is
//! closed, so silent sockets cannot lock out a real peer), and at most
//! `max_links` authenticated links per listener are open at once.
//!
//! The sockets and TLS live on one small IO runtime shared by every link of
//! the process ([`runtime`]); the schedulers stay plain threads and see a
//! link as a sender of frames ([`LinkTx`]) and a blocking receiver of frames.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, mpsc};
use std::time::Duration;

use bytes::Bytes;
use kvfence_handoff::tcp::MAX_LINK_FRAME;
use kvfence_handoff::tls::{Credentials, Role, peer_role};
use kvfence_handoff::{FRAME_SHELF_BYTES, FrameShelf};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc as tokio_mpsc;
use tracing::{debug, warn};

use crate::error::FleetError;

/// The IO runtime every link of this process runs on: one thread, since it
/// only moves bytes (encryption included) and the cores belong to the
/// compute pool.
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvfence-links")
            .enable_all()
            .build()
            .expect("the OS can start the link runtime's thread")
    })
}

/// Runs `future` on the link runtime and waits for it from a plain thread.
fn wait_for<T: Send + 'static>(
    future: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    runtime().spawn(async move {
        let _ = tx.send(future.await);
    });
    rx.recv().ok()
}

fn io(e: std::io::Error) -> FleetError {
    FleetError::io(e)
}

/// A failed TLS handshake: `Tls` when TLS itself refused (a certificate
/// from another CA or of the wrong role, a protocol error: the
/// configuration is wrong, retrying will not help), `Io` when the
/// connection broke under it (a peer restarting: worth retrying).
fn tls(e: std::io::Error) -> FleetError {
    let refused_by_tls = e
        .get_ref()
        .is_some_and(|inner| inner.is::<tokio_rustls::rustls::Error>());
    if refused_by_tls {
        FleetError::Tls {
            reason: e.to_string(),
        }
    } else {
        io(e)
    }
}

/// The sending half of a link: frames queued here are written in order.
/// Dropping every clone closes the link (TLS close, then FIN).
#[derive(Clone, Debug)]
pub(crate) struct LinkTx(tokio_mpsc::UnboundedSender<Vec<Bytes>>);

impl LinkTx {
    /// Queues one frame whose payload is `parts` joined; `false` once the
    /// link is gone.
    pub(crate) fn send(&self, parts: Vec<Bytes>) -> bool {
        self.0.send(parts).is_ok()
    }
}

/// An authenticated link: frames out through `tx`, frames in through `rx`
/// (disconnected once the link is gone).
pub(crate) struct Link {
    pub(crate) tx: LinkTx,
    pub(crate) rx: mpsc::Receiver<Bytes>,
    /// The role the peer's certificate proved.
    pub(crate) peer: Role,
    pub(crate) address: SocketAddr,
}

/// How long a link may take to authenticate, how many may try at once, and
/// how many may be open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenLimits {
    /// A connection that has not finished its TLS handshake by then is closed.
    pub handshake_timeout: Duration,
    /// Connections in a handshake at once; past it the oldest is closed.
    pub max_handshaking: usize,
    /// Authenticated links open at once; more are closed after the handshake.
    pub max_links: usize,
}

impl ListenLimits {
    /// Defaults for a listener that serves `max_links` peers.
    pub fn new(max_links: usize) -> ListenLimits {
        ListenLimits {
            handshake_timeout: Duration::from_secs(5),
            max_handshaking: 32,
            max_links,
        }
    }
}

/// Frames from this size up are read into buffers kept from earlier
/// frames of the link: KV chunks, hundreds of KB each, which a fresh block
/// would have the kernel fault in and zero again. Smaller frames (control
/// messages, which a worker may keep) get blocks of their own, so a kept
/// message never holds a chunk's buffer.
const SHELVED_FRAME: usize = 64 << 10;

async fn read_frames<R: AsyncRead + Unpin>(mut input: R, frames: mpsc::Sender<Bytes>) {
    let shelf = FrameShelf::new(FRAME_SHELF_BYTES);
    loop {
        let mut len = [0u8; 4];
        match input.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return,
            Err(error) => {
                // A record that fails its integrity check lands here: the
                // link ends, and nothing of it was delivered.
                warn!(%error, "link closed on a read error");
                return;
            }
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_LINK_FRAME {
            warn!(
                len,
                max = MAX_LINK_FRAME,
                "link closed: frame larger than allowed"
            );
            return;
        }
        // Read into spare capacity: zeroing each chunk first was one more
        // pass over it.
        let mut payload = if len >= SHELVED_FRAME {
            shelf.take(len)
        } else {
            Vec::with_capacity(len)
        };
        let mut rest = (&mut input).take(len as u64);
        while payload.len() < len {
            match rest.read_buf(&mut payload).await {
                Ok(0) => {
                    warn!("link closed inside a frame");
                    return;
                }
                Ok(_) => {}
                Err(error) => {
                    warn!(%error, "link closed inside a frame");
                    return;
                }
            }
        }
        let frame = if len >= SHELVED_FRAME {
            shelf.freeze(payload)
        } else {
            Bytes::from(payload)
        };
        if frames.send(frame).is_err() {
            return;
        }
    }
}

async fn write_frames<W: AsyncWrite + Unpin>(
    mut output: W,
    mut queue: tokio_mpsc::UnboundedReceiver<Vec<Bytes>>,
) {
    while let Some(mut parts) = queue.recv().await {
        loop {
            let len: usize = parts.iter().map(Bytes::len).sum();
            if len > MAX_LINK_FRAME {
                warn!(len, "refusing to send a frame larger than allowed");
                let _ = output.shutdown().await;
                return;
            }
            let header = (len as u32).to_le_bytes();
            // One vectored write per frame: TLS seals the header and the
            // parts into the same records rather than a record each.
            let mut slices: Vec<IoSlice<'_>> = std::iter::once(&header[..])
                .chain(parts.iter().map(|part| &part[..]))
                .map(IoSlice::new)
                .collect();
            if let Err(error) = write_all_vectored(&mut output, &mut slices).await {
                debug!(%error, "link write failed");
                return;
            }
            // Flush once the queue is empty: frames queued together go out
            // in as few records and segments as TLS allows.
            match queue.try_recv() {
                Ok(next) => parts = next,
                Err(_) => break,
            }
        }
        if output.flush().await.is_err() {
            return;
        }
    }
    let _ = output.shutdown().await;
}

async fn write_all_vectored<W: AsyncWrite + Unpin>(
    output: &mut W,
    mut unsent: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    while !unsent.is_empty() {
        match output.write_vectored(unsent).await {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut unsent, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// rustls reads its socket 4 KiB at a time: one system call per 4 KiB of KV
/// cost a third of the link's time (measured in the hand-off benchmark).
/// Reading through a larger buffer makes it one call per 256 KiB.
fn buffered(tcp: tokio::net::TcpStream) -> tokio::io::BufReader<tokio::net::TcpStream> {
    tokio::io::BufReader::with_capacity(256 << 10, tcp)
}

/// How many bytes of sealed records a link holds before it writes them to
/// the socket: rustls's default, 64 KiB, made a chunk frame of 737 KB
/// twelve system calls (and twelve wake-ups of the reader); a link holds
/// at most this much more memory.
const SEALED_BUFFER: usize = 1 << 20;

/// Starts the reader and writer of an authenticated stream. `on_close`
/// runs when the reader ends (the peer closed, or a bad record).
fn start<S>(
    stream: S,
    peer: Role,
    address: SocketAddr,
    on_close: impl FnOnce() + Send + 'static,
) -> Link
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (reader, writer) = tokio::io::split(stream);
    let (frames_tx, frames_rx) = mpsc::channel();
    let (queue_tx, queue_rx) = tokio_mpsc::unbounded_channel();
    let rt = runtime();
    rt.spawn(async move {
        read_frames(reader, frames_tx).await;
        on_close();
    });
    rt.spawn(write_frames(writer, queue_rx));
    Link {
        tx: LinkTx(queue_tx),
        rx: frames_rx,
        peer,
        address,
    }
}

/// Dials `address`, which must prove it is a `server` with a certificate
/// from the cluster CA; presents `credentials`.
pub(crate) fn dial(
    address: SocketAddr,
    server: Role,
    credentials: &Credentials,
) -> Result<Link, FleetError> {
    let connector = tokio_rustls::TlsConnector::from(credentials.client_config());
    let handshake = async move {
        let tcp = tokio::net::TcpStream::connect(address).await.map_err(io)?;
        tcp.set_nodelay(true).map_err(io)?;
        let tcp = buffered(tcp);
        let mut stream = connector
            .connect(server.server_name(), tcp)
            .await
            .map_err(tls)?;
        stream.get_mut().1.set_buffer_limit(Some(SEALED_BUFFER));
        Ok::<_, FleetError>(start(stream, server, address, || {}))
    };
    let timeout = ListenLimits::new(1).handshake_timeout;
    wait_for(async move {
        tokio::time::timeout(timeout, handshake)
            .await
            .unwrap_or_else(|_| {
                Err(FleetError::Unreachable {
                    reason: format!("no TLS handshake with {address} within {timeout:?}"),
                })
            })
    })
    .unwrap_or_else(|| Err(FleetError::ShuttingDown))
}

/// Accepts links on `listener` from peers proving one of the `allowed`
/// roles, within `limits`; each authenticated link arrives on the returned
/// channel. Refused connections are logged (address and reason, nothing
/// else) and cost no more than `limits` allow.
pub(crate) fn accept(
    listener: std::net::TcpListener,
    credentials: &Credentials,
    allowed: &'static [Role],
    limits: ListenLimits,
) -> Result<mpsc::Receiver<Link>, FleetError> {
    listener.set_nonblocking(true).map_err(io)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(credentials.server_config());
    let (links_tx, links_rx) = mpsc::channel();
    let handshaking = Arc::new(Handshaking::default());
    let refusals = Arc::new(Refusals::new(REFUSAL_LOG_EVERY));
    let open = Arc::new(AtomicUsize::new(0));
    let rt = runtime();
    let listener = {
        let _guard = rt.enter();
        tokio::net::TcpListener::from_std(listener).map_err(io)?
    };
    rt.spawn(async move {
        for serial in 0u64.. {
            let (tcp, address) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let (acceptor, links_tx) = (acceptor.clone(), links_tx.clone());
            let (registry, open) = (Arc::clone(&handshaking), Arc::clone(&open));
            let refusals = Arc::clone(&refusals);
            let task = tokio::spawn(async move {
                let result = tokio::time::timeout(limits.handshake_timeout, async {
                    let _ = tcp.set_nodelay(true);
                    acceptor.accept(buffered(tcp)).await
                })
                .await;
                registry.finished(serial);
                let mut stream = match result {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(error)) => {
                        refusals.note(std::time::Instant::now(), |suppressed| {
                            warn!(%address, %error, suppressed, "refused a connection: TLS handshake failed");
                        });
                        return;
                    }
                    Err(_) => {
                        refusals.note(std::time::Instant::now(), |suppressed| {
                            warn!(%address, suppressed, "refused a connection: no TLS handshake in time");
                        });
                        return;
                    }
                };
                stream.get_mut().1.set_buffer_limit(Some(SEALED_BUFFER));
                let role = match peer_role(stream.get_ref().1.peer_certificates(), allowed) {
                    Ok(role) => role,
                    Err(error) => {
                        refusals.note(std::time::Instant::now(), |suppressed| {
                            warn!(%address, %error, suppressed, "refused a connection");
                        });
                        return;
                    }
                };
                let claimed = open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < limits.max_links).then_some(n + 1)
                });
                if claimed.is_err() {
                    warn!(%address, %role, max = limits.max_links, "refused a link: this listener's links are all taken");
                    return;
                }
                let link = start(stream, role, address, move || {
                    open.fetch_sub(1, Ordering::AcqRel);
                });
                let _ = links_tx.send(link);
            });
            // Bounded: past the cap the oldest handshake makes room. Silent
            // sockets cannot crowd out a real peer, whose handshake takes
            // milliseconds while theirs take the whole timeout.
            if let Some(evicted) = handshaking.started(serial, task.abort_handle(), limits) {
                debug!(
                    max = limits.max_handshaking,
                    "too many connections in a handshake; closed the oldest"
                );
                evicted.abort();
            }
        }
    });
    Ok(links_rx)
}

/// How often a listener logs a refused connection at most: a stranger
/// hammering a worker port costs the log one line a second, with a count.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(1);

/// Refused connections, logged at a bounded rate: the first refusal in each
/// period is logged with how many were refused unlogged before it.
struct Refusals {
    every: Duration,
    state: std::sync::Mutex<RefusalLog>,
}

struct RefusalLog {
    last: Option<std::time::Instant>,
    suppressed: u64,
}

impl Refusals {
    fn new(every: Duration) -> Refusals {
        Refusals {
            every,
            state: std::sync::Mutex::new(RefusalLog {
                last: None,
                suppressed: 0,
            }),
        }
    }

    /// One refusal at `now`: calls `log` with the count of refusals left
    /// unlogged since the last line, if a line is due; else counts it.
    fn note(&self, now: std::time::Instant, log: impl FnOnce(u64)) {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.last.is_some_and(|last| now < last + self.every) {
            state.suppressed += 1;
            return;
        }
        let suppressed = std::mem::take(&mut state.suppressed);
        state.last = Some(now);
        drop(state);
        log(suppressed);
    }
}

/// Connections in a TLS handshake, oldest first.
#[derive(Default)]
struct Handshaking(std::sync::Mutex<std::collections::VecDeque<(u64, tokio::task::AbortHandle)>>);

impl Handshaking {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::VecDeque<(u64, tokio::task::AbortHandle)>>
    {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a new handshake; returns the oldest one to abort if that
    /// puts the listener over its cap.
    fn started(
        &self,
        serial: u64,
        task: tokio::task::AbortHandle,
        limits: ListenLimits,
    ) -> Option<tokio::task::AbortHandle> {
        let mut list = self.lock();
        if task.is_finished() {
            return None;
        }
        list.push_back((serial, task));
        (list.len() > limits.max_handshaking.max(1))
            .then(|| list.pop_front().map(|(_, task)| task))
            .flatten()
    }

    fn finished(&self, serial: u64) {
        self.lock().retain(|(s, _)| *s != serial);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfence_handoff::tls::ClusterCa;
    use std::io::Read;

    fn limits(handshake_ms: u64, max_handshaking: usize, max_links: usize) -> ListenLimits {
        ListenLimits {
            handshake_timeout: Duration::from_millis(handshake_ms),
            max_handshaking,
            max_links,
        }
    }

    fn listening(
        limits: ListenLimits,
    ) -> (SocketAddr, mpsc::Receiver<Link>, Credentials, Credentials) {
        let ca = ClusterCa::generate().unwrap();
        let prefill = ca.credentials(Role::Prefill).unwrap();
        let decode = ca.credentials(Role::Decode).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let links = accept(listener, &prefill, &[Role::Decode], limits).unwrap();
        (address, links, prefill, decode)
    }

    /// How long until the server closes a socket that sends nothing.
    fn closed_after(mut socket: std::net::TcpStream) -> Duration {
        let started = std::time::Instant::now();
        socket
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut buf = [0u8; 16];
        let _ = socket.read(&mut buf);
        started.elapsed()
    }

    #[test]
    fn an_authenticated_link_carries_frames_both_ways() {
        let (address, links, _, decode) = listening(limits(2000, 4, 4));
        let client = dial(address, Role::Prefill, &decode).unwrap();
        let server = links.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(server.peer, Role::Decode);
        assert!(
            client
                .tx
                .send(vec![Bytes::from_static(b"ab"), Bytes::from_static(b"c")])
        );
        assert_eq!(&server.rx.recv().unwrap()[..], b"abc");
        assert!(server.tx.send(vec![Bytes::from(vec![7u8; 100_000])]));
        assert_eq!(client.rx.recv().unwrap().len(), 100_000);
        drop(client);
        assert!(server.rx.recv().is_err(), "the link's end is seen");
    }

    /// Frames of every size a hand-off sends — empty, one byte in several
    /// parts, larger than the sealed-record buffer, queued back to back —
    /// arrive whole, in order, byte for byte.
    #[test]
    fn frames_of_every_size_arrive_whole_and_in_order() {
        let (address, links, _, decode) = listening(limits(2000, 4, 4));
        let client = dial(address, Role::Prefill, &decode).unwrap();
        let server = links.recv_timeout(Duration::from_secs(5)).unwrap();
        let pattern = |len: usize, seed: u8| -> Bytes {
            (0..len)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect::<Vec<u8>>()
                .into()
        };
        let sizes = [0, 1, 17, SEALED_BUFFER - 3, 3 * SEALED_BUFFER + 5, 4096, 0];
        let sent: Vec<Vec<Bytes>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                // The first byte alone, then the rest split unevenly.
                let whole = pattern(len, i as u8);
                let (one, half) = (len.min(1), (len / 2).max(len.min(1)));
                let (first, middle, last) = (
                    whole.slice(..one),
                    whole.slice(one..half),
                    whole.slice(half..),
                );
                vec![first, Bytes::new(), middle, last]
            })
            .collect();
        for parts in &sent {
            assert!(client.tx.send(parts.clone()));
        }
        for (parts, &len) in sent.iter().zip(&sizes) {
            let frame = server.rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(frame.len(), len);
            assert_eq!(frame, parts.concat(), "a {len}-byte frame arrives as sent");
        }
    }

    #[test]
    fn a_chunk_read_into_a_kept_buffer_shows_only_its_own_bytes() {
        let (address, links, _, decode) = listening(limits(2000, 4, 4));
        let client = dial(address, Role::Prefill, &decode).unwrap();
        let server = links.recv_timeout(Duration::from_secs(5)).unwrap();
        let mut first_buffer = None;
        // Large, then smaller ones, each let go before the next is sent:
        // every one after the first lands in the buffer the first used.
        for (i, len) in [3 * SHELVED_FRAME, SHELVED_FRAME + 1, 2 * SHELVED_FRAME]
            .into_iter()
            .enumerate()
        {
            let sent = Bytes::from(vec![i as u8 + 1; len]);
            assert!(client.tx.send(vec![sent.clone()]));
            let frame = server.rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(frame, sent, "frame {i} is exactly what was sent");
            let buffer = *first_buffer.get_or_insert(frame.as_ptr());
            assert_eq!(frame.as_ptr(), buffer, "frame {i} reuses the kept buffer");
        }
        // A small frame gets a block of its own.
        assert!(client.tx.send(vec![Bytes::from_static(b"grant")]));
        let small = server.rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(&small[..], b"grant");
        assert_ne!(Some(small.as_ptr()), first_buffer);
    }

    #[test]
    fn refusals_are_logged_once_a_period_with_a_count_of_the_rest() {
        let refusals = Refusals::new(Duration::from_secs(1));
        let start = std::time::Instant::now();
        let mut lines = Vec::new();
        // 10,000 refusals over 3 s: one line a second, each counting the
        // refusals it stood for.
        for i in 0..10_000u64 {
            let at = start + Duration::from_micros(i * 300);
            refusals.note(at, |suppressed| lines.push(suppressed));
        }
        assert_eq!(lines, vec![0, 3_333, 3_333]);
    }

    #[test]
    fn a_silent_connection_is_closed_by_the_handshake_deadline() {
        let (address, _links, _, _) = listening(limits(200, 4, 4));
        let waited = closed_after(std::net::TcpStream::connect(address).unwrap());
        assert!(waited < Duration::from_secs(10), "closed after {waited:?}");
    }

    #[test]
    fn past_the_handshake_cap_the_oldest_connection_makes_room() {
        // A deadline far away: only the cap can close the first socket.
        let (address, links, _, decode) = listening(limits(60_000, 2, 4));
        let oldest = std::net::TcpStream::connect(address).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let _second = std::net::TcpStream::connect(address).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let _third = std::net::TcpStream::connect(address).unwrap();
        assert!(closed_after(oldest) < Duration::from_secs(10));
        // A real peer still gets through while the cap is full of silence.
        let _client = dial(address, Role::Prefill, &decode).unwrap();
        assert!(links.recv_timeout(Duration::from_secs(5)).is_ok());
    }

    #[test]
    fn links_past_the_cap_are_closed_after_the_handshake() {
        let (address, links, _, decode) = listening(limits(2000, 4, 1));
        let first = dial(address, Role::Prefill, &decode).unwrap();
        let _kept = links.recv_timeout(Duration::from_secs(5)).unwrap();
        let second = dial(address, Role::Prefill, &decode).unwrap();
        assert!(
            second.rx.recv_timeout(Duration::from_secs(5)).is_err(),
            "the second link is closed"
        );
        assert!(links.try_recv().is_err());
        drop((first, _kept));
        // Room again once the first link is gone.
        std::thread::sleep(Duration::from_millis(200));
        let _third = dial(address, Role::Prefill, &decode).unwrap();
        assert!(links.recv_timeout(Duration::from_secs(5)).is_ok());
    }

    #[test]
    fn a_listener_refuses_roles_it_does_not_accept() {
        let (address, links, prefill, _) = listening(limits(2000, 4, 4));
        // A prefill certificate dialling a listener that takes decode workers.
        if let Ok(link) = dial(address, Role::Prefill, &prefill) {
            assert!(link.rx.recv_timeout(Duration::from_secs(5)).is_err());
        }
        assert!(links.recv_timeout(Duration::from_millis(500)).is_err());
    }
}
