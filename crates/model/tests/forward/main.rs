//! The paged forward pass against a dense reference, under batching, over
//! long contexts in every KV element type, and against reads of unwritten KV. One test binary sharing `common`.

mod batch_invariance;
mod common;
mod isolation;
mod long_context;
mod paged_vs_dense;
mod paused;
