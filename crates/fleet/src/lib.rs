//! kvfence's fleet: workers in separate processes, over authenticated TCP
//! links. The workers themselves — schedulers, pools, the link codec — are
//! `kvfence_engine`'s; this crate carries their [`Port`]s over TLS and
//! speaks the control plane between processes:
//!
//! ```text
//! router ──control link──▶ decode workers ──hand-off links──▶ prefill workers
//! ```
//!
//! - [`link`]: a [`Port`] carried inside a TLS link ([`bridge`](link)), and
//!   [`TlsLoopback`], an in-process pair joined so.
//! - [`net`]: the TLS links themselves — dial, accept with the listener's
//!   bounds on what an unauthenticated peer can cost ([`ListenLimits`]).
//! - [`prefill`]: a [`PrefillWorker`] serving every decode worker that
//!   connects, each link its own namespace of hand-off ids.
//! - [`decode`]: a decode worker holding links to its prefill workers
//!   (reconnected with backoff when they drop) and serving routers.
//! - [`client`]: [`RemoteEngine`], a router's client of one decode
//!   worker, reconnecting and keeping a fresh view of the worker's load.
//! - [`fleet`]: [`Fleet`], the router's choice of a decode and a prefill
//!   worker per request, preferring the pair that holds the request's
//!   prefix within its tenant ([`affinity`]).
//! - [`discovery`]: [`PeerNames`], peers named as `host:port` and resolved
//!   again every few seconds, so pods behind a Kubernetes headless Service
//!   join and leave without a restart.
//! - [`wire`]: the control plane's messages.
//!
//! Every link is TLS 1.3 with mutual, role-bound certificates: a prefill
//! worker accepts only decode workers, a decode worker only routers, and
//! each dialler checks it reached the role it meant. A lost link fails what
//! depended on it instead of hanging — the decode worker fails hand-offs
//! that link was filling, the router fails requests in flight on that
//! worker — and is dialled again, so a restarted process rejoins without
//! restarting the others.
//!
//! Its errors are [`FleetError`]s; what it serves as the engine's
//! [`Backend`](kvfence_engine::Backend) fails with the engine's errors, as a
//! worker in this process would.
//!
//! [`Port`]: kvfence_engine::Port
//! [`PrefillWorker`]: kvfence_engine::PrefillWorker

mod affinity;
mod client;
mod decode;
mod discovery;
mod error;
mod fleet;
mod link;
mod net;
mod prefill;
mod wire;

pub use client::RemoteEngine;
pub use decode::{serve_routers, start_decode_worker};
pub use discovery::{PeerNames, RESOLVE_EVERY, Resolver};
pub use error::FleetError;
pub use fleet::Fleet;
pub use kvfence_handoff::tls;
#[doc(hidden)]
pub use link::LinkEnd;
pub use link::TlsLoopback;
pub use net::ListenLimits;
pub use prefill::{MAX_DECODE_LINKS, serve_decode_workers};
pub use wire::{Hello, ModelFingerprint, decode_control_frame};

use std::net::SocketAddr;
use std::time::Duration;

use kvfence_handoff::tls::{Credentials, Role as LinkRole};

use crate::net::Link;
use crate::wire::{Control, parse_control};

/// How long a worker may take to say `Hello` once the TLS link is up.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// The first wait before dialling a lost peer again; doubled up to
/// [`RECONNECT_MAX`].
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

fn io(e: std::io::Error) -> FleetError {
    FleetError::io(e)
}

/// Connects to a worker of role `role`, authenticates both ways, and reads
/// the `Hello` it opens with.
fn dial(
    address: SocketAddr,
    role: LinkRole,
    credentials: &Credentials,
) -> Result<(Link, Hello), FleetError> {
    let link = net::dial(address, role, credentials)?;
    let no_hello = || FleetError::Unreachable {
        reason: format!("the {role} worker at {address} sent no Hello"),
    };
    let frame = link
        .rx
        .recv_timeout(HELLO_TIMEOUT)
        .map_err(|_| no_hello())?;
    let Control::Hello(hello) = parse_control(&frame).map_err(FleetError::Malformed)? else {
        return Err(no_hello());
    };
    Ok((link, hello))
}

/// Backoff between dials of a lost peer.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Backoff {
        Backoff(RECONNECT_FIRST)
    }

    /// Sleeps for the current wait and doubles it.
    fn wait(&mut self) {
        std::thread::sleep(self.0);
        self.0 = (self.0 * 2).min(RECONNECT_MAX);
    }

    fn reset(&mut self) {
        self.0 = RECONNECT_FIRST;
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
