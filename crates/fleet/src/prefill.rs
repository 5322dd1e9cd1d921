//! `kvfence prefill` as a process: a [`PrefillWorker`] serving every decode
//! worker that connects, each over its own TLS link and its own [`Port`]
//! (so its own namespace of hand-off ids).
//!
//! [`Port`]: crate::Port

use std::net::TcpListener;
use std::sync::{Arc, Weak};

use kvfence_handoff::tls::{Credentials, Role as LinkRole};
use tracing::{info, warn};

use super::io;
use super::wire::{Control, Hello, ModelFingerprint, PROTOCOL, PageLayout, send_control};
use crate::error::FleetError;
use crate::link::bridge;
use crate::net::{self, ListenLimits};
use kvfence_engine::PrefillWorker;
use kvfence_engine::Role;

/// Decode workers one prefill worker serves at once.
pub const MAX_DECODE_LINKS: usize = 64;

/// Accepts decode workers for `worker` on `listener` (only certificates of
/// the decode role), each greeted with a `Hello` and linked while both
/// live. A draining worker takes no new ones.
pub fn serve_decode_workers(
    worker: &Arc<PrefillWorker>,
    listener: TcpListener,
    credentials: &Credentials,
) -> Result<(), FleetError> {
    let accepted = net::accept(
        listener,
        credentials,
        &[LinkRole::Decode],
        ListenLimits::new(MAX_DECODE_LINKS),
    )?;
    let hello = hello(worker);
    let worker: Weak<PrefillWorker> = Arc::downgrade(worker);
    std::thread::Builder::new()
        .name("kvfence-prefill-accept".into())
        .spawn(move || {
            for link in accepted {
                let Some(worker) = worker.upgrade() else {
                    return;
                };
                if !worker.is_admitting() {
                    // Draining: no new decode workers.
                    continue;
                }
                let (address, role) = (link.address, link.peer);
                if !send_control(&link.tx, &Control::Hello(hello.clone())) {
                    continue;
                }
                let started = worker
                    .link_decode(address.to_string())
                    .map_err(FleetError::from)
                    .and_then(|port| bridge(link, port, "kvfence-prefill-link").map_err(io));
                match started {
                    Ok(reader) => {
                        info!(%address, %role, "decode worker connected");
                        std::thread::spawn(move || {
                            let _ = reader.join();
                            info!(%address, "decode worker gone; its hand-offs were dropped");
                        });
                    }
                    Err(error) => warn!(%address, %error, "could not start a link"),
                }
            }
        })
        .map_err(io)?;
    Ok(())
}

/// What a prefill worker says first on every link.
fn hello(worker: &PrefillWorker) -> Hello {
    let pool = worker.pool();
    Hello {
        protocol: PROTOCOL,
        role: Role::Prefill.label().into(),
        model: ModelFingerprint::of(worker.model()),
        page_size: pool.geometry().page_size,
        kv_dtype: pool.geometry().elem.name().into(),
        layer_groups: PageLayout::of(pool).layer_groups,
        tokens: pool.capacity_tokens(),
        prefills: Vec::new(),
    }
}
