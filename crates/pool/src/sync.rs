//! The atomics of the window protocol: std's in every build, loom's under
//! `--cfg loom`, so loom's model checker can explore every interleaving of
//! the same code (the tokio approach).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
