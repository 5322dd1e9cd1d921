//! What an HTTP connection may cost, before and after it says who it is
//! (I11: a stranger's connections cost an authenticated tenant nothing
//! measurable).
//!
//! A connection is a **stranger** from accept until one of its requests
//! authenticates. Strangers are bounded on their own: `max_strangers` at
//! once and `per_address` from one address. A real client's connection
//! sends its headers within milliseconds and authenticates; an idle socket
//! never speaks and is closed at the header deadline. So:
//!
//! - a stranger that **speaks** while its address or the listener is past
//!   its cap takes the place of the oldest silent stranger (of that
//!   address, or of all), which is closed: one address's sockets never
//!   push out another's, and a flood of idle sockets cannot keep a tenant
//!   out;
//! - a **silent** stranger past the cap is held, not closed, up to
//!   [`HELD_SILENT`] times each cap; only past that is the oldest (silent
//!   first) closed at once. Closing idle sockets as they arrive made a flood
//!   that reopens what is closed spin: 36,000 closes and reopens in a
//!   minute on two cores, the tenant's connections waiting behind them in
//!   the kernel's accept queue. Held, they cost a descriptor each until the
//!   header deadline.
//!
//! A connection that authenticates becomes **known**: it leaves the
//! strangers' list (nothing evicts it) and takes one of `max_connections`
//! known slots for the rest of its life. The accept loop itself never
//! waits.

use std::collections::VecDeque;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;

use crate::error::{ApiError, ErrorType};

/// Silent strangers held past the caps, as a multiple of each cap: the
/// listener holds at most this many times `max_strangers` strangers, and
/// an address this many times `per_address`.
pub(crate) const HELD_SILENT: usize = 5;

/// The connections of one listener.
pub(crate) struct Connections {
    /// Strangers, oldest first: their serial and the task serving them.
    strangers: Mutex<VecDeque<Stranger>>,
    max_strangers: usize,
    per_address: usize,
    known: Arc<Semaphore>,
    max_known: usize,
}

/// A connection that has not authenticated yet.
struct Stranger {
    ticket: Ticket,
    address: IpAddr,
    task: AbortHandle,
    /// It spoke, and room was made for it if it had to be: once only,
    /// whether its first bytes were seen at accept or by its task.
    seated: bool,
}

impl Connections {
    pub(crate) fn new(
        max_strangers: usize,
        per_address: usize,
        max_known: usize,
    ) -> Arc<Connections> {
        Arc::new(Connections {
            strangers: Mutex::new(VecDeque::new()),
            max_strangers: max_strangers.max(1),
            per_address: per_address.max(1),
            known: Arc::new(Semaphore::new(max_known)),
            max_known,
        })
    }

    fn strangers(&self) -> std::sync::MutexGuard<'_, VecDeque<Stranger>> {
        self.strangers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A new connection from `address`, served by `task`, whose requests
    /// carry `ticket`: a stranger, unless it authenticated already.
    /// Returns the task to close to make room, if any: for a connection
    /// that has spoken, past a cap, the oldest silent stranger; for any,
    /// past [`HELD_SILENT`] times a cap, the oldest that has not sent a
    /// byte yet, older than this one — or if every older one has begun a
    /// request, the oldest.
    pub(crate) fn accepted(
        &self,
        ticket: &Ticket,
        address: IpAddr,
        task: AbortHandle,
    ) -> Option<AbortHandle> {
        let mut strangers = self.strangers();
        // Its task runs before this: it may have ended, or authenticated
        // already (which takes this lock after marking the ticket known,
        // so one of the two sees the other), or spoken (ditto: see `spoke`).
        if task.is_finished() || ticket.is_known() {
            return None;
        }
        strangers.push_back(Stranger {
            ticket: ticket.clone(),
            address,
            task,
            seated: false,
        });
        let evicted = if ticket.has_spoken() {
            self.room_for_speaker(&mut strangers, ticket.0.serial, address)
        } else {
            None
        };
        let evicted = evicted.or_else(|| self.hold_bound(&mut strangers, address));
        debug_assert!(strangers.len() <= self.max_strangers * HELD_SILENT);
        evicted
    }

    /// The stranger `serial`, from `address`, sent its first bytes: past a
    /// cap it takes the place of the oldest silent stranger, whose task is
    /// returned to close.
    fn spoke(&self, serial: u64) -> Option<AbortHandle> {
        let mut strangers = self.strangers();
        let address = strangers
            .iter()
            .find(|s| s.ticket.0.serial == serial)?
            .address;
        self.room_for_speaker(&mut strangers, serial, address)
    }

    /// If the strangers of `address`, or all, are past their cap, removes
    /// the oldest silent one (of that address, or of all) other than the
    /// speaker `serial`.
    fn room_for_speaker(
        &self,
        strangers: &mut VecDeque<Stranger>,
        serial: u64,
        address: IpAddr,
    ) -> Option<AbortHandle> {
        let speaker = strangers.iter_mut().find(|s| s.ticket.0.serial == serial)?;
        if std::mem::replace(&mut speaker.seated, true) {
            return None;
        }
        let same = strangers.iter().filter(|s| s.address == address).count();
        let over_address = same > self.per_address;
        if !over_address && strangers.len() <= self.max_strangers {
            return None;
        }
        let victim = strangers.iter().position(|s| {
            (!over_address || s.address == address)
                && s.ticket.0.serial != serial
                && !s.ticket.has_spoken()
        })?;
        strangers.remove(victim).map(|s| s.task)
    }

    /// If the strangers of `address`, or all, are past what the listener
    /// holds at all, removes the oldest that has not spoken (else the
    /// oldest) of that address, or of all, before the newest.
    fn hold_bound(
        &self,
        strangers: &mut VecDeque<Stranger>,
        address: IpAddr,
    ) -> Option<AbortHandle> {
        let same = strangers.iter().filter(|s| s.address == address).count();
        let over_address = same > self.per_address * HELD_SILENT;
        if !over_address && strangers.len() <= self.max_strangers * HELD_SILENT {
            return None;
        }
        let eligible = |s: &Stranger| !over_address || s.address == address;
        let older = strangers.len() - 1;
        let victim = strangers
            .iter()
            .take(older)
            .position(|s| eligible(s) && !s.ticket.has_spoken())
            .or_else(|| strangers.iter().position(eligible))?;
        strangers.remove(victim).map(|s| s.task)
    }

    /// The connection `serial` closed.
    pub(crate) fn closed(&self, serial: u64) {
        self.strangers().retain(|s| s.ticket.0.serial != serial);
    }

    /// Strangers open now.
    #[cfg(test)]
    pub(crate) fn stranger_count(&self) -> usize {
        self.strangers().len()
    }
}

/// One connection's standing, shared with the requests it carries.
#[derive(Clone)]
pub struct Ticket(Arc<TicketInner>);

struct TicketInner {
    serial: u64,
    connections: Arc<Connections>,
    known: Mutex<Option<OwnedSemaphorePermit>>,
    /// The client has sent at least a byte.
    spoke: AtomicBool,
}

impl Ticket {
    pub(crate) fn new(serial: u64, connections: Arc<Connections>) -> Ticket {
        Ticket(Arc::new(TicketInner {
            serial,
            connections,
            known: Mutex::new(None),
            spoke: AtomicBool::new(false),
        }))
    }

    /// The client sent its first bytes ([`Watched`] says so, or a peek at
    /// accept): past a cap, the oldest silent stranger makes room for it.
    pub(crate) fn spoke(&self) {
        if self.0.spoke.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(evicted) = self.0.connections.spoke(self.0.serial) {
            tracing::debug!("too many unauthenticated connections; closed the oldest silent one");
            evicted.abort();
        }
    }

    fn has_spoken(&self) -> bool {
        self.0.spoke.load(Ordering::Acquire)
    }

    fn is_known(&self) -> bool {
        self.0
            .known
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// The connection authenticated: it is no stranger any more, and holds
    /// a known slot from now on. 503 if every known slot is taken (the
    /// connection then stays a stranger, and closes after the answer).
    pub fn authenticated(&self) -> Result<(), ApiError> {
        let inner = &self.0;
        let mut known = inner.known.lock().unwrap_or_else(PoisonError::into_inner);
        if known.is_some() {
            return Ok(());
        }
        let permit = Arc::clone(&inner.connections.known)
            .try_acquire_owned()
            .map_err(|_| {
                ApiError::new(
                    ErrorType::ServiceUnavailable,
                    "connections_exhausted",
                    format!(
                        "the server already holds {} client connections; retry shortly",
                        inner.connections.max_known
                    ),
                )
            })?;
        *known = Some(permit);
        // Released before the strangers' lock is taken: `accepted` takes
        // that one and then this (`is_known`), and the two orders together
        // could deadlock the accept loop. Marked known first, so whichever
        // of the two runs second sees the other.
        drop(known);
        inner.connections.closed(inner.serial);
        Ok(())
    }
}

/// A client's socket that marks its [`Ticket`] at its first byte: a
/// stranger whose request has begun is not closed to make room for idle
/// ones.
pub(crate) struct Watched<T> {
    inner: T,
    ticket: Ticket,
    spoke: bool,
}

impl<T> Watched<T> {
    pub(crate) fn new(inner: T, ticket: Ticket) -> Watched<T> {
        Watched {
            inner,
            ticket,
            spoke: false,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if !this.spoke && buf.filled().len() > before {
            this.spoke = true;
            this.ticket.spoke();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn idle_task(rt: &tokio::runtime::Runtime) -> tokio::task::JoinHandle<()> {
        rt.spawn(std::future::pending())
    }

    const HOME: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    /// Registers a stranger from `address` with serial `serial`; returns
    /// its ticket and the task its arrival closed, if any.
    fn arrive(
        connections: &Arc<Connections>,
        rt: &tokio::runtime::Runtime,
        serial: u64,
        address: IpAddr,
        speaking: bool,
    ) -> (Ticket, tokio::task::JoinHandle<()>, Option<AbortHandle>) {
        let ticket = Ticket::new(serial, Arc::clone(connections));
        if speaking {
            // Seen by the accept loop's peek, before it registers.
            ticket.spoke();
        }
        let task = idle_task(rt);
        let evicted = connections.accepted(&ticket, address, task.abort_handle());
        (ticket, task, evicted)
    }

    fn closed(rt: &tokio::runtime::Runtime, task: tokio::task::JoinHandle<()>) -> bool {
        rt.block_on(tokio::task::yield_now());
        task.is_finished()
    }

    #[test]
    fn i11_idle_strangers_past_the_cap_are_held_not_closed() {
        // Closing an idle socket as the next arrives made a flood that
        // reopens what is closed spin the accept loop (36,000 closes a
        // minute on two cores): held, they wait for the header deadline.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let connections = Connections::new(4, 64, 8);
        let mut flood = Vec::new();
        for serial in 0..(4 * HELD_SILENT as u64) {
            let (_, task, evicted) = arrive(&connections, &rt, serial, HOME, false);
            assert!(evicted.is_none(), "silent stranger {serial} closed another");
            flood.push(task);
        }
        assert_eq!(connections.stranger_count(), 4 * HELD_SILENT);
        // One more than the listener holds: the oldest goes.
        let (_, _, evicted) = arrive(&connections, &rt, 100, HOME, false);
        evicted.unwrap().abort();
        assert!(closed(&rt, flood.remove(0)));
        // A client that speaks takes the place of the oldest silent one.
        let (_, client, evicted) = arrive(&connections, &rt, 101, HOME, true);
        evicted.unwrap().abort();
        assert!(closed(&rt, flood.remove(0)));
        assert!(!closed(&rt, client));
        assert_eq!(connections.stranger_count(), 4 * HELD_SILENT);
    }

    #[test]
    fn i11_a_stranger_that_speaks_late_makes_room_once() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let connections = Connections::new(2, 64, 8);
        let (_, oldest, _) = arrive(&connections, &rt, 0, HOME, false);
        let (_, second, _) = arrive(&connections, &rt, 1, HOME, false);
        // Registered silent (held: past the cap of 2), then its first
        // bytes reach its task: it takes the oldest silent one's place.
        let (late, talker, evicted) = arrive(&connections, &rt, 2, HOME, false);
        assert!(evicted.is_none());
        late.spoke();
        assert!(closed(&rt, oldest));
        // Its bytes seen twice (the accept loop's peek and its task), or
        // read again: room is made once.
        late.spoke();
        assert!(!closed(&rt, second));
        // Its task saw its bytes just before the accept loop registered
        // it, and the loop made room first: the task's call makes none.
        let (racer, _racer_task, _) = {
            let ticket = Ticket::new(3, Arc::clone(&connections));
            ticket.0.spoke.store(true, Ordering::Release);
            let task = idle_task(&rt);
            let evicted = connections.accepted(&ticket, HOME, task.abort_handle());
            (ticket, task, evicted)
        };
        assert!(connections.spoke(racer.0.serial).is_none());
        assert!(!closed(&rt, talker));
        assert_eq!(connections.stranger_count(), 2);
        // Under the cap a speaker closes nobody.
        let roomy = Connections::new(8, 64, 8);
        let (_, quiet, _) = arrive(&roomy, &rt, 0, HOME, false);
        let (_, _, evicted) = arrive(&roomy, &rt, 1, HOME, true);
        assert!(evicted.is_none());
        assert!(!closed(&rt, quiet));
    }

    #[test]
    fn i11_one_addresss_strangers_push_out_only_each_other() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let connections = Connections::new(64, 2, 8);
        let elsewhere = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 7));
        let (_, other, _) = arrive(&connections, &rt, 0, elsewhere, false);
        let mut flood = Vec::new();
        let mut evicted = Vec::new();
        for serial in 1..=(2 * HELD_SILENT as u64 + 3) {
            let (_, task, closes) = arrive(&connections, &rt, serial, HOME, false);
            flood.push(task);
            evicted.extend(closes);
        }
        // Three more than the address may hold: its three oldest went.
        assert_eq!(evicted.len(), 3);
        for task in evicted {
            task.abort();
        }
        for task in flood.drain(..3) {
            assert!(closed(&rt, task));
        }
        // A speaker from the address, past its cap, closes one of its own.
        let (_, _, closes) = arrive(&connections, &rt, 99, HOME, true);
        closes.unwrap().abort();
        assert!(closed(&rt, flood.remove(0)));
        assert!(!closed(&rt, other));
        assert_eq!(connections.stranger_count(), 2 * HELD_SILENT + 1);
    }

    #[test]
    fn i11_a_known_connection_is_never_evicted() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let connections = Connections::new(3, 3, 8);
        let (ticket, tenant, _) = arrive(&connections, &rt, 0, HOME, true);
        ticket.authenticated().unwrap();
        for serial in 1..=40 {
            let speaking = serial % 3 == 0;
            let (_, _, closes) = arrive(&connections, &rt, serial, HOME, speaking);
            if let Some(task) = closes {
                task.abort();
            }
        }
        assert!(!closed(&rt, tenant));
        assert_eq!(connections.stranger_count(), 3 * HELD_SILENT);
    }

    #[test]
    fn i11_a_connection_that_authenticates_before_it_is_registered_stays_known() {
        // The accept loop spawns a connection's task, then registers it: a
        // client fast enough authenticates in between. It must not be
        // listed as a stranger then, or the next strangers close it in the
        // middle of its answer (seen: a tenant's stream cut after 81 ms by
        // 1,100 reconnecting idle sockets).
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let connections = Connections::new(2, 8, 8);
        let tenant = idle_task(&rt);
        let ticket = Ticket::new(0, Arc::clone(&connections));
        ticket.authenticated().unwrap();
        assert!(
            connections
                .accepted(&ticket, HOME, tenant.abort_handle())
                .is_none()
        );
        assert_eq!(connections.stranger_count(), 0);
        for serial in 1..=30 {
            let (_, _, closes) = arrive(&connections, &rt, serial, HOME, serial % 2 == 0);
            if let Some(task) = closes {
                task.abort();
            }
        }
        assert!(!closed(&rt, tenant), "a known connection was closed");
        assert_eq!(connections.stranger_count(), 2 * HELD_SILENT);
    }

    #[test]
    fn i11_idle_strangers_push_out_each_other_not_one_whose_request_has_begun() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let connections = Connections::new(3, 8, 8);
        let (_, client, _) = arrive(&connections, &rt, 0, HOME, true);
        // Then a flood of sockets that never speak, each reopened as soon
        // as it is closed.
        for serial in 1..=60 {
            let (_, _, closes) = arrive(&connections, &rt, serial, HOME, false);
            if let Some(task) = closes {
                task.abort();
            }
        }
        assert!(!closed(&rt, client), "the client's connection was closed");
        assert_eq!(connections.stranger_count(), 3 * HELD_SILENT);
        // Once every older stranger has spoken, the oldest goes after all:
        // the header deadline bounds how long one may take.
        let full = Connections::new(1, 8, 8);
        let (_, slow, _) = arrive(&full, &rt, 0, HOME, true);
        for serial in 1..HELD_SILENT as u64 {
            let (_, _, closes) = arrive(&full, &rt, serial, HOME, true);
            assert!(closes.is_none(), "no silent one to close");
        }
        let (_, _, closes) = arrive(&full, &rt, 9, HOME, false);
        closes.unwrap().abort();
        assert!(closed(&rt, slow));
    }

    #[test]
    fn i11_a_connection_authenticating_as_it_is_registered_never_deadlocks() {
        // The accept loop registers a connection (strangers' lock, then the
        // ticket's) while the connection's task authenticates (the ticket's
        // lock, then the strangers' to leave them): with both locks held
        // across, the two could wait on each other and freeze the accept
        // loop — seen as a fleet test's requests hanging under load.
        let (finished, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let connections = Connections::new(4, 4, 1 << 20);
            for serial in 0..50_000 {
                let ticket = Ticket::new(serial, Arc::clone(&connections));
                let task = idle_task(&rt);
                let start = Arc::new(std::sync::Barrier::new(2));
                let authenticating = {
                    let (ticket, start) = (ticket.clone(), Arc::clone(&start));
                    std::thread::spawn(move || {
                        start.wait();
                        ticket.authenticated().unwrap();
                    })
                };
                start.wait();
                if let Some(evicted) = connections.accepted(&ticket, HOME, task.abort_handle()) {
                    evicted.abort();
                }
                authenticating.join().unwrap();
                assert!(ticket.is_known());
            }
            let _ = finished.send(connections.stranger_count());
        });
        let strangers = done
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("registering and authenticating deadlocked");
        assert_eq!(
            strangers, 0,
            "an authenticated connection stayed a stranger"
        );
    }

    #[test]
    fn known_slots_are_bounded_and_taken_once_per_connection() {
        let connections = Connections::new(4, 4, 1);
        let first = Ticket::new(1, Arc::clone(&connections));
        first.authenticated().unwrap();
        first.authenticated().unwrap();
        let second = Ticket::new(2, Arc::clone(&connections));
        assert_eq!(second.authenticated().unwrap_err().status(), 503);
        drop(first);
        second.authenticated().unwrap();
    }
}
