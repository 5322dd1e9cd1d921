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
//!   in flight (drained). Each side's update and its read of the other's
//!   counter are separated by a sequentially consistent fence, so either the
//!   write sees the revocation or the receiver sees the write in flight: no
//!   write can slip between the two. [`Gate`] is that protocol alone, and a
//!   loom model checks it under every interleaving
//!   (`RUSTFLAGS="--cfg loom" cargo test -p kvfence-pool --release --lib loom`);
//! - a lease with an open window goes to `Quarantined`, not `Free`, when it
//!   is dropped, and [`Window::release`] frees the pages only once drained (I4).

use std::ops::Range;
use std::sync::Arc;

use crate::error::PoolError;
use crate::ledger::{Counters, Shared};
use crate::page::{PageId, RequestId};
use crate::sync::{AtomicU64, AtomicUsize, Ordering, fence};

/// The revoke/drain protocol of a window, without the pages: an epoch that
/// revocation bumps and a count of writes past the gate.
pub(crate) struct Gate {
    epoch: AtomicU64,
    in_flight: AtomicUsize,
}

/// A write admitted through the gate; dropping it ends the write.
pub(crate) struct Pass<'a>(&'a Gate);

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gate {
    pub(crate) fn new() -> Gate {
        Gate {
            epoch: AtomicU64::new(1),
            in_flight: AtomicUsize::new(0),
        }
    }

    pub(crate) fn key(&self) -> WindowKey {
        WindowKey(self.epoch.load(Ordering::SeqCst))
    }

    /// Admits a write presenting `key` unless the window was revoked since.
    /// Counts first, checks second: the order the drain relies on.
    pub(crate) fn enter(&self, key: WindowKey) -> Option<Pass<'_>> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let pass = Pass(self);
        fence(Ordering::SeqCst);
        (self.epoch.load(Ordering::SeqCst) == key.0).then_some(pass)
    }

    /// Refuses every write that has not yet checked its key.
    pub(crate) fn revoke(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Writes past the gate right now. Zero after [`Gate::revoke`] means no
    /// write will ever land again.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }
}

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
    gate: Gate,
}

impl Window {
    pub(crate) fn open(shared: Arc<Shared>, owner: RequestId, pages: Vec<PageId>) -> Window {
        Window {
            inner: Arc::new(WindowInner {
                shared,
                owner,
                pages,
                gate: Gate::new(),
            }),
        }
    }

    /// The key for the current epoch, handed to the writer with the grant.
    pub fn key(&self) -> WindowKey {
        self.inner.gate.key()
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
        self.write_runs(key, index, slots, std::iter::once(bytes))
    }

    /// [`Window::write`] of the bytes `runs` yield in turn, such as
    /// [`crate::ReadView::slot_runs`] of the sender's page: the bytes go
    /// from page to page with one copy.
    pub fn write_runs<'b>(
        &self,
        key: WindowKey,
        index: usize,
        slots: Range<usize>,
        runs: impl Iterator<Item = &'b [u8]> + Clone,
    ) -> Result<(), PoolError> {
        let inner = &self.inner;
        let Some(_pass) = inner.gate.enter(key) else {
            Counters::bump(&inner.shared.counters.stale_writes_rejected);
            return Err(PoolError::WindowRevoked { owner: inner.owner });
        };
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
                inner.shared.copy_slots_in(&mut page, slots, runs)
            }
        }
    }

    /// Revokes the window: every write that has not yet checked the epoch is
    /// refused from now on. Writes already past the check still finish;
    /// wait for [`Window::is_drained`] before reusing the pages.
    pub fn revoke(&self) {
        self.inner.gate.revoke();
    }

    /// Writes in progress right now.
    pub fn in_flight(&self) -> usize {
        self.inner.gate.in_flight()
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
            .field("epoch", &self.inner.gate.epoch())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

/// The gate under loom: every interleaving of a writer and a revoking
/// receiver, with the memory model's weak behaviours.
#[cfg(all(test, loom))]
mod loom_model {
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    use loom::thread;

    use super::Gate;

    /// The receiver's side of I4: revoke; if drained, free the pages.
    /// Returns whether it freed them.
    fn revoke_and_release(gate: &Gate, released: &AtomicBool) -> bool {
        gate.revoke();
        let drained = gate.in_flight() == 0;
        if drained {
            released.store(true, Ordering::Release);
        }
        drained
    }

    #[test]
    fn loom_no_write_lands_after_revoke_and_drain() {
        loom::model(|| {
            let gate = Arc::new(Gate::new());
            let released = Arc::new(AtomicBool::new(false));
            let key = gate.key();
            let writer = {
                let (gate, released) = (Arc::clone(&gate), Arc::clone(&released));
                thread::spawn(move || {
                    if let Some(_pass) = gate.enter(key) {
                        // The write itself: it must not touch released pages.
                        assert!(
                            !released.load(Ordering::Acquire),
                            "a write landed on pages the receiver had freed"
                        );
                    }
                })
            };
            let freed = revoke_and_release(&gate, &released);
            writer.join().expect("writer thread");
            if !freed {
                // Not drained at the first look: the receiver waits, as
                // `Window::release` callers do, and then it must be.
                assert_eq!(gate.in_flight(), 0);
            }
        });
    }

    /// The same race with the writer checking the epoch before counting
    /// itself in flight: loom must find the interleaving where a write
    /// lands after the drain. This proves the model can see the bug it
    /// guards against.
    #[test]
    #[should_panic(expected = "a write landed on pages the receiver had freed")]
    fn loom_finds_the_race_when_the_writer_checks_before_counting() {
        loom::model(|| {
            let epoch = Arc::new(AtomicU64::new(1));
            let in_flight = Arc::new(AtomicUsize::new(0));
            let released = Arc::new(AtomicBool::new(false));
            let writer = {
                let (epoch, in_flight, released) = (
                    Arc::clone(&epoch),
                    Arc::clone(&in_flight),
                    Arc::clone(&released),
                );
                thread::spawn(move || {
                    if epoch.load(Ordering::SeqCst) == 1 {
                        in_flight.fetch_add(1, Ordering::SeqCst);
                        assert!(
                            !released.load(Ordering::Acquire),
                            "a write landed on pages the receiver had freed"
                        );
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            };
            epoch.fetch_add(1, Ordering::SeqCst);
            if in_flight.load(Ordering::SeqCst) == 0 {
                released.store(true, Ordering::Release);
            }
            writer.join().expect("writer thread");
        });
    }
}
