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
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

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
    serial: u64,
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

    /// A new connection from `address`, served by `task`: a stranger.
    /// Returns the task to close if that puts the listener over a cap: the
    /// address's oldest stranger if the address is over its own, else the
    /// oldest of all.
    pub(crate) fn accepted(
        &self,
        serial: u64,
        address: IpAddr,
        task: AbortHandle,
    ) -> Option<AbortHandle> {
        let mut strangers = self.strangers();
        if task.is_finished() {
            return None;
        }
        strangers.push_back(Stranger {
            serial,
            address,
            task,
        });
        let same = strangers.iter().filter(|s| s.address == address).count();
        let victim = if same > self.per_address {
            strangers.iter().position(|s| s.address == address)
        } else if strangers.len() > self.max_strangers {
            Some(0)
        } else {
            None
        };
        let evicted = victim
            .and_then(|index| strangers.remove(index))
            .map(|s| s.task);
        debug_assert!(strangers.len() <= self.max_strangers);
        evicted
    }

    /// The connection `serial` closed.
    pub(crate) fn closed(&self, serial: u64) {
        self.strangers().retain(|s| s.serial != serial);
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
}

impl Ticket {
    pub(crate) fn new(serial: u64, connections: Arc<Connections>) -> Ticket {
        Ticket(Arc::new(TicketInner {
            serial,
            connections,
            known: Mutex::new(None),
        }))
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
                .accepted(0, elsewhere, other.abort_handle())
                .is_none()
        );
        let flood: Vec<_> = (1..=5).map(|_| idle_task(&rt)).collect();
        let mut evicted = Vec::new();
        for (i, task) in flood.iter().enumerate() {
            evicted.extend(connections.accepted(i as u64 + 1, HOME, task.abort_handle()));
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
                .accepted(0, HOME, tenant.abort_handle())
                .is_none()
        );
        Ticket::new(0, Arc::clone(&connections))
            .authenticated()
            .unwrap();
        let mut strangers: Vec<_> = (1..=3).map(|_| idle_task(&rt)).collect();
        for (i, s) in strangers.iter().enumerate() {
            assert!(
                connections
                    .accepted(i as u64 + 1, HOME, s.abort_handle())
                    .is_none()
            );
        }
        // A fourth stranger closes the oldest stranger, not the tenant.
        let fourth = idle_task(&rt);
        let evicted = connections
            .accepted(4, HOME, fourth.abort_handle())
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
