//! The fenced KV hand-off between a prefill and a decode worker
//! (`docs/architecture.md`, "The KV hand-off"), written sans-IO: [`Receiver`] and [`send_kv`] consume and
//! produce [`Message`]s; transports only move frames.
//!
//! The guarantees, each a checked fact rather than an assumption:
//! - a `Done` can only be built from proof that every granted slot was sent
//!   from a fully written source (I5);
//! - every chunk is checked for epoch, grant membership, the page's current
//!   generation and an xxh3 checksum before it lands (I3);
//! - a hand-off commits only if `Done` names the granted token count, every
//!   page arrived, coverage spans every granted slot and the digest matches;
//!   anything else fails it and frees its pages (I2, I7, I8).
//!
//! A grant is made per layer group of the receiver's pool
//! ([`GrantedGroup`]): a group of sliding-window layers is granted only the
//! pages its first pass reads, so positions behind the window never cross;
//! the sender's groups must hold the same layers.

mod error;
mod id;
mod receiver;
mod sender;
mod shelf;
pub mod tcp;
#[cfg(feature = "tls")]
pub mod tls;
mod wire;

pub use error::HandoffError;
pub use id::{Epoch, HandoffId, RejectReason};
pub use receiver::{Committed, Outcome, Receiver, ReceiverStats};
pub use sender::{
    AllSent, AsFrame, AsMessage, ChunkFrames, Chunks, Grant, Put, Streaming, TwoSided,
    WindowWrites, send_kv, send_kv_one_sided,
};
pub use shelf::{FRAME_SHELF_BYTES, FrameShelf};
pub use wire::{GrantedGroup, MAX_FRAME, Message, PromptScore};
