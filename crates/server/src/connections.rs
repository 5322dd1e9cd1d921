//! What an HTTP connection may cost, before and after it says who it is
//! (I11: a stranger's connections cost an authenticated tenant nothing
//! measurable).
//!
//! A connection is a **stranger** from accept until one of its requests
//! authenticates. Strangers are bounded on their own: at most
//! `max_strangers` at once and `per_address` from one address, and past
//! either the oldest stranger (of that address, or of all) is closed to
//! make room, so one address's sockets cannot push out another's — a real client's connection sends its headers within
//! milliseconds and authenticates, while idle sockets wait for the header
//! deadline, so a flood of them cannot keep a tenant out. A connection
//! that authenticates becomes **known**: it leaves the strangers' list
//! (nothing evicts it) and takes one of `max_connections` known slots for
//! the rest of its life. The accept loop itself never waits.

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
    /// Returns the task to close if that puts the listener over a cap — of
    /// the address's strangers if it is over its own, else of all: the
    /// oldest that has not sent a byte yet, older than this one, or if
    /// every older one has begun a request, the oldest.
    pub(crate) fn accepted(
        &self,
        ticket: &Ticket,
        address: IpAddr,
        task: AbortHandle,
    ) -> Option<AbortHandle> {
        let mut strangers = self.strangers();
        // Its task runs before this: it may have ended, or authenticated
        // already (which takes this lock after marking the ticket known,
        // so one of the two sees the other).
        if task.is_finished() || ticket.is_known() {
            return None;
        }
        strangers.push_back(Stranger {
            ticket: ticket.clone(),
            address,
            task,
        });
        let same = strangers.iter().filter(|s| s.address == address).count();
        let over_address = same > self.per_address;
        if !over_address && strangers.len() <= self.max_strangers {
            return None;
        }
        let eligible = |s: &Stranger| !over_address || s.address == address;
        // A client's request arrives within milliseconds of its connection;
        // an idle socket never speaks. So a flood of sockets reopened as
        // fast as they are closed pushes out its own, not a connection whose
        // request is on its way.
        let older = strangers.len() - 1;
        let victim = strangers
            .iter()
            .take(older)
            .position(|s| eligible(s) && !s.ticket.has_spoken())
            .or_else(|| strangers.iter().position(eligible));
        let evicted = victim
            .and_then(|index| strangers.remove(index))
            .map(|s| s.task);
        debug_assert!(strangers.len() <= self.max_strangers);
        evicted
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

    /// The client sent its first bytes ([`Watched`] says so).
    pub(crate) fn spoke(&self) {
        self.0.spoke.store(true, Ordering::Relaxed);
    }

    fn has_spoken(&self) -> bool {
        self.0.spoke.load(Ordering::Relaxed)
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

    #[test]
    fn i11_one_addresss_strangers_push_out_only_each_other() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let connections = Connections::new(4, 2, 8);
        let elsewhere = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 7));
        let other = idle_task(&rt);
        assert!(
            connections
                .accepted(
                    &Ticket::new(0, Arc::clone(&connections)),
                    elsewhere,
                    other.abort_handle()
                )
                .is_none()
        );
        let flood: Vec<_> = (1..=5).map(|_| idle_task(&rt)).collect();
        let mut evicted = Vec::new();
        for (i, task) in flood.iter().enumerate() {
            let ticket = Ticket::new(i as u64 + 1, Arc::clone(&connections));
            evicted.extend(connections.accepted(&ticket, HOME, task.abort_handle()));
        }
        // Five from one address against its cap of two: its three oldest
        // went, the other address's connection stayed.
        assert_eq!(evicted.len(), 3);
        for task in evicted {
            task.abort();
        }
        rt.block_on(async {
            for task in flood.into_iter().take(3) {
                assert!(task.await.unwrap_err().is_cancelled());
            }
        });
        assert!(!other.is_finished());
        assert_eq!(connections.stranger_count(), 3);
    }

    #[test]
    fn i11_the_oldest_stranger_makes_room_and_a_known_connection_is_never_evicted() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let connections = Connections::new(3, 3, 8);
        let tenant = idle_task(&rt);
        assert!(
            connections
                .accepted(
                    &Ticket::new(0, Arc::clone(&connections)),
                    HOME,
                    tenant.abort_handle()
                )
                .is_none()
        );
        Ticket::new(0, Arc::clone(&connections))
            .authenticated()
            .unwrap();
        let mut strangers: Vec<_> = (1..=3).map(|_| idle_task(&rt)).collect();
        for (i, s) in strangers.iter().enumerate() {
            assert!(
                connections
                    .accepted(
                        &Ticket::new(i as u64 + 1, Arc::clone(&connections)),
                        HOME,
                        s.abort_handle()
                    )
                    .is_none()
            );
        }
        // A fourth stranger closes the oldest stranger, not the tenant.
        let fourth = idle_task(&rt);
        let evicted = connections
            .accepted(
                &Ticket::new(4, Arc::clone(&connections)),
                HOME,
                fourth.abort_handle(),
            )
            .unwrap();
        evicted.abort();
        let oldest = strangers.remove(0);
        rt.block_on(async {
            assert!(oldest.await.unwrap_err().is_cancelled());
        });
        assert!(!tenant.is_finished());
        assert_eq!(connections.stranger_count(), 3);
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
        let strangers: Vec<_> = (1..=5).map(|_| idle_task(&rt)).collect();
        for (i, s) in strangers.iter().enumerate() {
            let stranger = Ticket::new(i as u64 + 1, Arc::clone(&connections));
            if let Some(evicted) = connections.accepted(&stranger, HOME, s.abort_handle()) {
                evicted.abort();
            }
        }
        rt.block_on(tokio::task::yield_now());
        assert!(!tenant.is_finished(), "a known connection was closed");
        assert_eq!(connections.stranger_count(), 2);
    }

    #[test]
    fn i11_idle_strangers_push_out_each_other_not_one_whose_request_has_begun() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let connections = Connections::new(3, 8, 8);
        let client = idle_task(&rt);
        let ticket = Ticket::new(0, Arc::clone(&connections));
        assert!(
            connections
                .accepted(&ticket, HOME, client.abort_handle())
                .is_none()
        );
        // Its first bytes arrive; then a flood of sockets that never speak,
        // each reopened as soon as it is closed.
        ticket.spoke();
        let flood: Vec<_> = (1..=20).map(|_| idle_task(&rt)).collect();
        for (i, task) in flood.iter().enumerate() {
            let stranger = Ticket::new(i as u64 + 1, Arc::clone(&connections));
            if let Some(evicted) = connections.accepted(&stranger, HOME, task.abort_handle()) {
                evicted.abort();
            }
        }
        rt.block_on(tokio::task::yield_now());
        assert!(!client.is_finished(), "the client's connection was closed");
        assert_eq!(connections.stranger_count(), 3);
        // Once every older stranger has spoken, the oldest goes after all:
        // the header deadline bounds how long one may take.
        let third = Connections::new(1, 8, 8);
        let slow = idle_task(&rt);
        let talking = Ticket::new(0, Arc::clone(&third));
        third.accepted(&talking, HOME, slow.abort_handle());
        talking.spoke();
        let newcomer = idle_task(&rt);
        let evicted = third
            .accepted(
                &Ticket::new(1, Arc::clone(&third)),
                HOME,
                newcomer.abort_handle(),
            )
            .unwrap();
        evicted.abort();
        rt.block_on(async {
            assert!(slow.await.unwrap_err().is_cancelled());
        });
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
