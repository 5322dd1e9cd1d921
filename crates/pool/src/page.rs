//! Names for pages and their owners: [`PageId`], [`Generation`], [`PageRef`],
//! [`RequestId`] and the observable [`PageState`].
//!
//! A bare [`PageId`] says *where* memory is; only a [`PageRef`] (id plus
//! generation) says *which allocation* of it is meant. Everything outside the
//! pool names pages by `PageRef`, which is what makes writes fenceable (I3).

use std::fmt;

/// Index of a page in the pool's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId(pub u32);

impl PageId {
    /// The page's index as a `usize`, for indexing the arena.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// How many times a page has been leased. Strictly increases on every lease,
/// so a `(page, generation)` pair names one allocation, forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// A fencing token: one page in one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageRef {
    /// Where the page is.
    pub id: PageId,
    /// Which allocation of it.
    pub generation: Generation,
}

impl fmt::Display for PageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.id, self.generation)
    }
}

/// The request a lease belongs to, as the engine numbers requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// The state of one page, as I1 defines it. Every page is in exactly one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageState {
    /// Not held by anyone; may be leased.
    Free,
    /// Held by exactly one lease.
    Leased {
        /// The request holding it.
        owner: RequestId,
        /// The generation it was leased in.
        generation: Generation,
    },
    /// Sealed into the prefix cache: read by the leases of its namespace,
    /// written by none (I1). Its generation moves on only when it is
    /// evicted, so an index entry can never reach its next contents.
    Shared {
        /// The namespace whose requests may read it.
        namespace: NamespaceId,
        /// The generation it was written in.
        generation: Generation,
        /// Leases that include it now; evictable at zero.
        readers: u32,
    },
    /// Released by its lease while a one-sided writer may still store into
    /// it; not leasable until [`crate::Pool::drain`] says the writer is done (I4).
    Quarantined {
        /// The request whose lease released it.
        owner: RequestId,
        /// The generation it had when released.
        generation: Generation,
    },
}

/// Identity of one lease, unique for the life of a pool. Pages record it so
/// ownership checks read the page table itself, not the caller's word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct LeaseId(pub(crate) u64);

/// The hash of everything a [`crate::Namespace`] is made of.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NamespaceId(pub(crate) [u8; 32]);

impl std::fmt::Debug for NamespaceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ns-")?;
        self.0[..6].iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}
