//! Links between workers over TCP: a [`Port`] carried inside TLS 1.3 with
//! mutual, role-bound certificates ([`crate::net`]). One thread writes the
//! port's outbound frames to the link and one delivers the link's frames to
//! the port's inbound side. A lost link — closed, or a record that fails
//! TLS's integrity check — drops the inbound side, so the worker hears
//! `PeerLost` and in-flight hand-offs fail instead of hanging.

use std::net::TcpListener;
use std::sync::Arc;
use std::thread::JoinHandle;

use kvfence_handoff::HandoffError;
use kvfence_handoff::tls::{ClusterCa, Credentials, Role as LinkRole};
use tracing::warn;

use crate::error::FleetError;
use crate::net::{self, Link, ListenLimits};
use kvfence_engine::EngineError;
use kvfence_engine::{Connector, Port, Transport};

/// Carries `port` over `link`: returns the reader thread, which ends with
/// the link (and drops the port's inbound side as it does).
pub(crate) fn bridge(link: Link, port: Port, name: &str) -> std::io::Result<JoinHandle<()>> {
    let Link { tx, rx, .. } = link;
    let Port {
        mut inbound,
        outbound,
    } = port;
    std::thread::Builder::new()
        .name(format!("{name}-tx"))
        .spawn(move || {
            for parts in outbound {
                if !tx.send(parts) {
                    break;
                }
            }
            // Dropping the link's sender closes it.
        })?;
    std::thread::Builder::new()
        .name(format!("{name}-rx"))
        .spawn(move || {
            for frame in rx {
                if let Err(error) = inbound.deliver(frame) {
                    if !matches!(error, EngineError::ShuttingDown) {
                        warn!(%error, "hand-off link closed on a bad frame");
                    }
                    break;
                }
            }
            // Dropping `inbound` tells the worker the link is gone.
        })
}

/// A pair's two ends joined by a TLS link over loopback, with credentials
/// made for this process alone (an ephemeral cluster CA, trusted by nothing
/// else and forgotten when the process ends).
#[derive(Debug, Clone, Copy)]
pub struct TlsLoopback;

impl TlsLoopback {
    /// The transport of a pair joined so.
    pub fn transport() -> Transport {
        Transport::Linked(Arc::new(TlsLoopback))
    }
}

impl Connector for TlsLoopback {
    fn connect(&self, prefill: Port, decode: Port) -> Result<(), EngineError> {
        Ok(self.link(prefill, decode)?)
    }
}

impl TlsLoopback {
    fn link(&self, prefill: Port, decode: Port) -> Result<(), FleetError> {
        let io = FleetError::io;
        let (prefill_link, decode_link) = loopback_links()?;
        bridge(prefill_link, prefill, "kvfence-prefill-link").map_err(io)?;
        bridge(decode_link, decode, "kvfence-decode-link").map_err(io)?;
        Ok(())
    }
}

/// A prefill end and a decode end joined by a TLS link over loopback, with
/// credentials made for this process alone.
pub(crate) fn loopback_links() -> Result<(Link, Link), FleetError> {
    let io = FleetError::io;
    let tls = |e: HandoffError| FleetError::Tls {
        reason: e.to_string(),
    };
    let ca = ClusterCa::generate().map_err(tls)?;
    let prefill_credentials = ca.credentials(LinkRole::Prefill).map_err(tls)?;
    let decode_credentials = ca.credentials(LinkRole::Decode).map_err(tls)?;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let address = listener.local_addr().map_err(io)?;
    let accepted = net::accept(
        listener,
        &prefill_credentials,
        &[LinkRole::Decode],
        ListenLimits::new(1),
    )?;
    let decode_link = net::dial(address, LinkRole::Prefill, &decode_credentials)?;
    let prefill_link = accepted
        .recv_timeout(ListenLimits::new(1).handshake_timeout)
        .map_err(|_| FleetError::Tls {
            reason: "the in-process TLS link did not come up".into(),
        })?;
    Ok((prefill_link, decode_link))
}

/// One end of a TLS link over loopback as [`TlsLoopback`] joins a pair (or
/// as two worker processes join, one end each), frames in and out: what the
/// link benchmark (`benches/link.rs`) drives. Not an API.
#[doc(hidden)]
pub struct LinkEnd(Link);

impl LinkEnd {
    /// A prefill end and a decode end, joined.
    pub fn loopback_pair() -> Result<(LinkEnd, LinkEnd), FleetError> {
        let (prefill, decode) = loopback_links()?;
        Ok((LinkEnd(prefill), LinkEnd(decode)))
    }

    /// The prefill end of a link to a decode end in another process:
    /// listens on `listener` and takes the first decode worker that proves
    /// itself with a certificate from `credentials`' CA.
    pub fn accept_decode(
        listener: TcpListener,
        credentials: &Credentials,
    ) -> Result<LinkEnd, FleetError> {
        let limits = ListenLimits::new(1);
        let accepted = net::accept(listener, credentials, &[LinkRole::Decode], limits)?;
        // The peer is another process that may take a while to start.
        let link = accepted
            .recv_timeout(limits.handshake_timeout * 6)
            .map_err(|_| FleetError::Unreachable {
                reason: "no decode end dialled the link".into(),
            })?;
        Ok(LinkEnd(link))
    }

    /// The decode end of a link to the prefill end listening at `address`.
    pub fn dial_prefill(
        address: std::net::SocketAddr,
        credentials: &Credentials,
    ) -> Result<LinkEnd, FleetError> {
        Ok(LinkEnd(net::dial(address, LinkRole::Prefill, credentials)?))
    }

    /// Queues one frame whose payload is `parts` joined; `false` once the
    /// link is gone.
    pub fn send(&self, parts: Vec<bytes::Bytes>) -> bool {
        self.0.tx.send(parts)
    }

    /// The next frame the peer sent; `None` once the link is gone.
    pub fn recv(&self) -> Option<bytes::Bytes> {
        self.0.rx.recv().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two ends the link bench joins across processes find each other
    /// and carry frames both ways; a decode end from another cluster does
    /// not get in.
    #[test]
    fn link_ends_of_separate_processes_join_and_refuse_strangers() {
        let ca = ClusterCa::generate().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let decode = ca.credentials(LinkRole::Decode).unwrap();
        let dialler = std::thread::spawn(move || LinkEnd::dial_prefill(address, &decode).unwrap());
        let prefill =
            LinkEnd::accept_decode(listener, &ca.credentials(LinkRole::Prefill).unwrap()).unwrap();
        let decode = dialler.join().unwrap();
        assert!(prefill.send(vec![bytes::Bytes::from_static(b"grant")]));
        assert_eq!(&decode.recv().unwrap()[..], b"grant");
        assert!(decode.send(vec![bytes::Bytes::from_static(b"chunk")]));
        assert_eq!(&prefill.recv().unwrap()[..], b"chunk");

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let stranger = ClusterCa::generate()
            .unwrap()
            .credentials(LinkRole::Decode)
            .unwrap();
        let dialler = std::thread::spawn(move || LinkEnd::dial_prefill(address, &stranger));
        let accepted = std::thread::spawn(move || {
            LinkEnd::accept_decode(listener, &ca.credentials(LinkRole::Prefill).unwrap())
        });
        assert!(
            dialler.join().unwrap().is_err(),
            "the stranger's dial fails"
        );
        drop(accepted);
    }
}
