//! Workers in separate processes, over authenticated TCP links:
//!
//! ```text
//! router ──control link──▶ decode workers ──hand-off links──▶ prefill workers
//! ```
//!
//! - [`prefill`]: a prefill worker serving every decode worker that
//!   connects, each link its own namespace of hand-off ids.
//! - [`decode`]: a decode worker holding links to its prefill workers
//!   (reconnected with backoff when they drop) and serving routers.
//! - [`client`]: [`RemoteEngine`], a router's client of one decode
//!   worker, reconnecting and keeping a fresh view of the worker's load.
//! - [`fleet`]: [`Fleet`], the router's choice of a decode and a prefill
//!   worker per request, preferring the pair that holds the request's
//!   prefix within its tenant ([`affinity`]).
//! - [`discovery`]: [`discovery::PeerNames`], peers named as `host:port`
//!   and resolved again every few seconds, so pods behind a Kubernetes
//!   headless Service join and leave without a restart.
//! - [`wire`]: the control plane's messages.
//!
//! Every link is TLS 1.3 with mutual, role-bound certificates
//! ([`crate::net`]): a prefill worker accepts only decode workers, a decode
//! worker only routers, and each dialler checks it reached the role it
//! meant. A lost link fails what depended on it instead of hanging — the
//! decode worker fails hand-offs that link was filling, the router fails
//! requests in flight on that worker — and is dialled again, so a restarted
//! process rejoins without restarting the others.

pub(crate) mod affinity;
pub(crate) mod client;
pub(crate) mod decode;
pub(crate) mod discovery;
pub(crate) mod fleet;
pub(crate) mod prefill;
pub(crate) mod wire;

use std::net::SocketAddr;
use std::time::Duration;

use kvfence_handoff::HandoffError;
use kvfence_handoff::tls::{Credentials, Role as LinkRole};

use crate::error::EngineError;
use crate::net::{self, Link};
use wire::{Control, Hello, parse_control};

/// How long a worker may take to say `Hello` once the TLS link is up.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// The first wait before dialling a lost peer again; doubled up to
/// [`RECONNECT_MAX`].
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

fn io(e: std::io::Error) -> EngineError {
    EngineError::Handoff(HandoffError::Io(e.to_string()))
}

/// Whether dialling again may help: the peer was unreachable or the link
/// broke, rather than refused for a configuration that will not change (a
/// certificate from another CA or of the wrong role).
pub(crate) fn is_transient(error: &EngineError) -> bool {
    matches!(error, EngineError::Handoff(HandoffError::Io(_)))
}

/// Connects to a worker of role `role`, authenticates both ways, and reads
/// the `Hello` it opens with.
fn dial(
    address: SocketAddr,
    role: LinkRole,
    credentials: &Credentials,
) -> Result<(Link, Hello), EngineError> {
    let link = net::dial(address, role, credentials)?;
    let no_hello = || {
        EngineError::Handoff(HandoffError::Io(format!(
            "the {role} worker at {address} sent no Hello"
        )))
    };
    let frame = link
        .rx
        .recv_timeout(HELLO_TIMEOUT)
        .map_err(|_| no_hello())?;
    let Control::Hello(hello) = parse_control(&frame)? else {
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
