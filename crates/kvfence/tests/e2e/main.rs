//! End-to-end tests: real `kvfence` processes on real ports, spoken to over
//! HTTP like a client. One test binary, so the helpers in `common` are
//! compiled once and shared.

mod agents;
mod api;
mod audit;
mod bench;
mod common;
mod disaggregated;
#[cfg(feature = "failpoints")]
mod failpoints;
#[cfg(feature = "failpoints")]
mod fault_matrix;
mod fleet;
mod front_door;
mod gemma3;
mod kubernetes;
mod links;
mod multiprocess;
mod openai_client;
mod prefix_cache;
mod serve;
mod smollm2;
mod stored;
mod tenancy;
mod traces;
