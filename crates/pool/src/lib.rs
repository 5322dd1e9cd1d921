//! The fenced KV page pool: kvfence's memory-ownership primitive.
//!
//! KV memory is an arena of pages. A request holds pages only through a
//! [`Lease`] (one owner, all-or-nothing, given back on drop); every page
//! names its allocation with a [`Generation`] that grows on each lease; every
//! write carries a [`PageRef`] fencing token; every read goes through a
//! [`ReadView`] that exists only if the positions read were written in the
//! page's current generation. Pages a one-sided writer may still reach wait
//! in quarantine until [`Pool::drain`]. Full pages of a prompt can be
//! sealed into a prefix cache, where later leases of the same [`Namespace`]
//! read them and nobody writes them again.
//!
//! Invariants enforced here (stated in `docs/architecture.md`): I1 single owner, I2 written
//! before read, I3 fenced writes, I4 drain before reuse, I8 no leak, and I9's
//! walls around cached prefixes.

mod coverage;
mod element;
mod error;
mod group;
mod layers;
mod lease;
mod ledger;
pub mod mutation;
mod page;
mod pool;
mod prefix;
mod spec;
mod sync;
mod view;
mod window;

pub use element::{ElemType, KvElement};
pub use error::PoolError;
pub use layers::{Keep, LayerGroups, MAX_SPAN};
pub use lease::Lease;
pub use page::{Generation, NamespaceId, PageId, PageRef, PageState, RequestId};
pub use pool::{Pool, PoolStats};
pub use prefix::Namespace;
pub use spec::{
    CacheSpec, Checks, ChunkRuns, DEFAULT_PUBLIC_MIN_TOKENS, Geometry, KvShape, MAX_LAYERS,
    MAX_PAGE_SIZE, PoolSize, PoolSpec, ReusePolicy, Scrub,
};
pub use view::{Keys, ReadView};
pub use window::{Window, WindowKey};
