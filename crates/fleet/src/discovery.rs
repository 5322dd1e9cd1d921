//! [`PeerNames`]: the peers a process was told to reach, as `host:port`
//! names, and [`Membership`]: the addresses they resolve to now.
//!
//! Every name is resolved at start and again every [`RESOLVE_EVERY`];
//! every address any name resolves to is a peer. That is how a role finds
//! the pods behind a Kubernetes headless Service, which answers with one
//! address per ready pod: a pod that becomes ready joins within seconds,
//! one that drains, is deleted or is scaled away leaves. An address
//! literal resolves to itself, so a static list works as it always did.
//!
//! A name that fails to resolve keeps the addresses it last resolved to:
//! a DNS hiccup must not empty the fleet, and keeping a peer that is
//! really gone costs only a keeper dialling it with backoff (a peer that
//! is not admitting is never chosen for work).

use std::collections::BTreeSet;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::error::FleetError;

/// How often every name is resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(5);

/// Peers one set of names may stand for at most: each costs a keeper
/// thread and a link, so a DNS answer of thousands of addresses (a
/// misconfiguration, or a resolver an attacker controls) must not turn
/// into thousands of threads. Beyond it the lowest addresses are kept.
pub const MAX_PEERS: usize = 256;

/// Resolves one `host:port` name to the addresses behind it.
pub type Resolver = Arc<dyn Fn(&str) -> std::io::Result<Vec<SocketAddr>> + Send + Sync>;

/// The system resolver (`getaddrinfo`: /etc/hosts, then DNS).
fn system_resolver() -> Resolver {
    Arc::new(|name: &str| name.to_socket_addrs().map(Iterator::collect))
}

/// The peers of one role as an operator names them: `host:port` entries,
/// each an address literal (`10.0.0.7:9100`, `[::1]:9100`) or a DNS name
/// (`kvfence-decode.serving.svc:9100`).
#[derive(Clone)]
pub struct PeerNames {
    names: Vec<String>,
    resolver: Resolver,
    every: Duration,
}

impl std::fmt::Debug for PeerNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.names).finish()
    }
}

impl PeerNames {
    /// Checks every entry's form (a host and a non-zero port); resolves
    /// nothing yet. `role` names the peers in errors ("decode worker").
    pub fn parse(entries: &[String], role: &str) -> Result<PeerNames, FleetError> {
        if entries.is_empty() {
            return Err(FleetError::InvalidName {
                reason: format!("at least one {role} address is needed"),
            });
        }
        let mut names = Vec::with_capacity(entries.len());
        for entry in entries {
            let entry = entry.trim();
            check_name(entry).map_err(|why| FleetError::InvalidName {
                reason: format!("{role} address {entry:?}: {why}"),
            })?;
            if !names.iter().any(|n| n == entry) {
                names.push(entry.to_string());
            }
        }
        Ok(PeerNames {
            names,
            resolver: system_resolver(),
            every: RESOLVE_EVERY,
        })
    }

    /// The same names, resolved by `resolver` instead of the system's,
    /// every `every` (tests move peers in and out of a name with it).
    pub fn with_resolver(mut self, resolver: Resolver, every: Duration) -> PeerNames {
        self.resolver = resolver;
        self.every = every;
        self
    }

    /// How often the names are resolved again.
    pub fn resolve_every(&self) -> Duration {
        self.every
    }

    /// The entries, as given (duplicates dropped).
    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// Whether `entry` is `host:port` with a port a peer can listen on.
fn check_name(entry: &str) -> Result<(), &'static str> {
    if let Ok(address) = entry.parse::<SocketAddr>() {
        return if address.port() == 0 {
            Err("port 0 is not a port a peer listens on")
        } else {
            Ok(())
        };
    }
    let Some((host, port)) = entry.rsplit_once(':') else {
        return Err("expected HOST:PORT");
    };
    if host.is_empty() || host.contains(':') || host.contains(char::is_whitespace) {
        return Err("expected HOST:PORT (an IPv6 address goes in brackets: [::1]:9100)");
    }
    match port.parse::<u16>() {
        Ok(0) => Err("port 0 is not a port a peer listens on"),
        Ok(_) => Ok(()),
        Err(_) => Err("the port is not a number from 1 to 65535"),
    }
}

/// The addresses a set of [`PeerNames`] stands for now.
pub(crate) struct Membership {
    names: PeerNames,
    /// What each name resolved to last, by the name's index.
    last: Vec<BTreeSet<SocketAddr>>,
}

impl Membership {
    pub(crate) fn new(names: PeerNames) -> Membership {
        let last = vec![BTreeSet::new(); names.names.len()];
        Membership { names, last }
    }

    /// Resolves every name again and returns the union, in address order.
    /// A name that fails keeps what it resolved to last.
    pub(crate) fn refresh(&mut self) -> BTreeSet<SocketAddr> {
        for (name, last) in self.names.names.iter().zip(&mut self.last) {
            match (self.names.resolver)(name) {
                Ok(addresses) => {
                    let now: BTreeSet<SocketAddr> = addresses.into_iter().collect();
                    if now != *last {
                        info!(%name, addresses = ?now, "peer name resolves to a new set");
                    }
                    *last = now;
                }
                Err(error) => {
                    debug!(%name, %error, "peer name did not resolve; keeping its last addresses");
                }
            }
        }
        let all: BTreeSet<SocketAddr> = self.last.iter().flatten().copied().collect();
        if all.len() > MAX_PEERS {
            warn!(
                resolved = all.len(),
                kept = MAX_PEERS,
                "the peer names resolve to more addresses than a process links to; keeping the lowest"
            );
            return all.into_iter().take(MAX_PEERS).collect();
        }
        all
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Mutex;

    use super::*;

    fn names(entries: &[&str]) -> Result<PeerNames, FleetError> {
        let entries: Vec<String> = entries.iter().map(|e| e.to_string()).collect();
        PeerNames::parse(&entries, "decode worker")
    }

    #[test]
    fn accepts_literals_and_names_and_refuses_what_cannot_be_dialled() {
        assert!(names(&["127.0.0.1:9100", "[::1]:9100", "kvfence-decode.ns.svc:9100"]).is_ok());
        for bad in [
            "kvfence-decode",
            "kvfence-decode:",
            ":9100",
            "host:0",
            "127.0.0.1:0",
            "host:65536",
            "::1:9100",
            "host name:9100",
        ] {
            let error = names(&[bad]).unwrap_err().to_string();
            assert!(error.contains("decode worker address"), "{bad}: {error}");
        }
        assert!(names(&[]).is_err());
        let deduplicated = names(&["a:1", "a:1", "b:1"]).unwrap();
        assert_eq!(deduplicated.names(), ["a:1", "b:1"]);
    }

    #[test]
    fn a_name_that_stops_resolving_keeps_its_last_addresses() {
        let answers: Arc<Mutex<Vec<std::io::Result<Vec<SocketAddr>>>>> = Arc::default();
        let queue = Arc::clone(&answers);
        let resolver: Resolver = Arc::new(move |_name: &str| queue.lock().unwrap().remove(0));
        let a: SocketAddr = "10.0.0.1:9100".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:9100".parse().unwrap();
        answers.lock().unwrap().extend([
            Ok(vec![a, b, a]),
            Err(std::io::Error::other("no answer")),
            Ok(vec![b]),
            Ok(vec![]),
        ]);
        let mut membership = Membership::new(
            names(&["pods:9100"])
                .unwrap()
                .with_resolver(resolver, RESOLVE_EVERY),
        );
        assert_eq!(membership.refresh(), BTreeSet::from([a, b]));
        assert_eq!(
            membership.refresh(),
            BTreeSet::from([a, b]),
            "a failed lookup drops nobody"
        );
        assert_eq!(
            membership.refresh(),
            BTreeSet::from([b]),
            "a pod that left is gone"
        );
        assert!(
            membership.refresh().is_empty(),
            "an empty answer is an answer"
        );
    }

    #[test]
    fn a_flood_of_addresses_is_cut_to_the_bound() {
        let flood: Vec<SocketAddr> = (0..MAX_PEERS as u32 + 1000)
            .map(|i| SocketAddr::from((i.to_be_bytes(), 9100)))
            .collect();
        let resolver: Resolver = Arc::new(move |_: &str| Ok(flood.clone()));
        let mut membership = Membership::new(
            names(&["pods:9100"])
                .unwrap()
                .with_resolver(resolver, RESOLVE_EVERY),
        );
        let kept = membership.refresh();
        assert_eq!(kept.len(), MAX_PEERS);
        assert_eq!(kept.first(), Some(&SocketAddr::from(([0, 0, 0, 0], 9100))));
    }

    #[test]
    fn an_address_literal_resolves_to_itself() {
        let mut membership = Membership::new(names(&["127.0.0.1:9100"]).unwrap());
        assert_eq!(
            membership.refresh(),
            BTreeSet::from(["127.0.0.1:9100".parse().unwrap()])
        );
    }
}
