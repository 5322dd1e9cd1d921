//! Black-box clients of any OpenAI-compatible endpoint (kvfence, vLLM,
//! SGLang, llama.cpp's server, hosted APIs). They speak plain HTTP and know
//! nothing of kvfence's internals.
//!
//! - [`bench`]: the load generator behind `kvfence bench` — time to first
//!   token, time per output token, inter-token latency, throughput and
//!   goodput under a latency SLO.

pub mod bench;
mod stream;

pub use stream::{StreamError, Timeline};
