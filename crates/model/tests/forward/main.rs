//! The paged forward pass against a dense reference, under batching, and
//! against reads of unwritten KV. One test binary sharing `common`.

mod batch_invariance;
mod common;
mod isolation;
mod paged_vs_dense;
