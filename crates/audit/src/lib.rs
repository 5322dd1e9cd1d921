//! Black-box clients of any OpenAI-compatible endpoint (kvfence, vLLM,
//! SGLang, llama.cpp's server, hosted APIs). They speak plain HTTP and know
//! nothing of kvfence's internals.
//!
//! - [`bench`]: the load generator behind `kvfence bench` — time to first
//!   token, time per output token, inter-token latency, throughput and
//!   goodput under a latency SLO.
//! - [`audit`]: the isolation auditor behind `kvfence audit` — capacity
//!   honesty, boundaries, determinism under load, canaries, abort storms,
//!   fail-closed errors.

pub mod audit;
pub mod bench;
mod error;
mod stream;

pub use error::AuditError;
pub use stream::Timeline;
