//! [`Window`]: one-sided write access to a lease's pages — the RDMA
//! memory-key model.
//!
//! A one-sided writer stores bytes straight into the receiver's pages; like a
//! NIC, it knows nothing of owners or generations. What keeps its writes out
//! of other tenants' memory is the window:
//!
//! - every write first counts itself in flight, then checks the window's
//!   epoch against the key it was given; a revoked window refuses it;
//! - the receiver revokes by bumping the epoch, then waits until nothing is
//!   in flight (drained). Both sides use sequentially consistent atomics, so
//!   either the write sees the revocation or the receiver sees the write in
//!   flight: no write can slip between the two;
//! - a lease with an open window goes to `Quarantined`, not `Free`, when it
//!   is dropped, and [`Window::release`] frees the pages only once drained (I4).

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::error::PoolError;
use crate::page::{PageId, RequestId};
use crate::pool::{Counters, Shared};

/// What a writer presents with each write: the window epoch it was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowKey(u64);

/// A one-sided write window over the pages of one lease. Cheap to clone: the
/// writer and the receiver hold the same window.
#[derive(Clone)]
pub struct Window {
    inner: Arc<WindowInner>,
}

struct WindowInner {
    shared: Arc<Shared>,
    owner: RequestId,
    pages: Vec<PageId>,
    epoch: AtomicU64,
    in_flight: AtomicUsize,
}

impl Window {
    pub(crate) fn open(shared: Arc<Shared>, owner: RequestId, pages: Vec<PageId>) -> Window {
        Window {
            inner: Arc::new(WindowInner {
                shared,
                owner,
                pages,
                epoch: AtomicU64::new(1),
                in_flight: AtomicUsize::new(0),
            }),
        }
    }

    /// The key for the current epoch, handed to the writer with the grant.
    pub fn key(&self) -> WindowKey {
        WindowKey(self.inner.epoch.load(Ordering::SeqCst))
    }

    /// Writes every layer's K and V for `slots` of the window's page
    /// `index`, laid out as [`crate::ReadView::export_slots`] produces them.
    /// Refused (and counted) once the window is revoked.
    pub fn write(
        &self,
        key: WindowKey,
        index: usize,
        slots: Range<usize>,
        bytes: &[u8],
    ) -> Result<(), PoolError> {
        let inner = &self.inner;
        inner.in_flight.fetch_add(1, Ordering::SeqCst);
        let result = if inner.epoch.load(Ordering::SeqCst) != key.0 {
            Counters::bump(&inner.shared.counters.stale_writes_rejected);
            Err(PoolError::WindowRevoked { owner: inner.owner })
        } else {
            match inner.pages.get(index) {
                None => Err(PoolError::SlotsOutOfRange {
                    start: index,
                    end: index + 1,
                    page_size: inner.pages.len(),
                }),
                Some(&id) => {
                    // The page lock keeps the copy memory-safe; ownership is
                    // deliberately not checked: that is the window's job.
                    let mut page = inner.shared.pages[id.index()].write();
                    inner.shared.copy_slots_in(&mut page, slots, bytes)
                }
            }
        };
        inner.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// Revokes the window: every write that has not yet checked the epoch is
    /// refused from now on. Writes already past the check still finish;
    /// wait for [`Window::is_drained`] before reusing the pages.
    pub fn revoke(&self) {
        self.inner.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// Writes in progress right now.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// Whether no write is in progress.
    pub fn is_drained(&self) -> bool {
        self.in_flight() == 0
    }

    /// The request whose pages this window exposes.
    pub fn owner(&self) -> RequestId {
        self.inner.owner
    }

    /// Frees the quarantined pages of this window's lease once the window is
    /// revoked and drained (I4). The lease must already be dropped.
    pub fn release(&self) -> Result<usize, PoolError> {
        self.revoke();
        let in_flight = self.in_flight();
        if in_flight > 0 {
            return Err(PoolError::StillWriting {
                owner: self.inner.owner,
                in_flight,
            });
        }
        self.inner.shared.drain(self.inner.owner)
    }
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("owner", &self.inner.owner)
            .field("pages", &self.inner.pages.len())
            .field("epoch", &self.inner.epoch.load(Ordering::SeqCst))
            .field("in_flight", &self.in_flight())
            .finish()
    }
}
