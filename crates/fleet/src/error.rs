//! [`FleetError`]: what goes wrong between processes. Requests served
//! through the fleet's [`Backend`](kvfence_engine::Backend)s still fail with
//! the engine's [`EngineError`] — the trait's — so a client cannot tell a
//! worker in this process from one across a link.

use kvfence_engine::EngineError;
use kvfence_handoff::HandoffError;

/// An error of the fleet: dialling, accepting, linking, naming peers.
/// Never carries request text (I10).
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The peer could not be reached, or the link broke: dialling again
    /// may help.
    #[error("{reason}")]
    Unreachable {
        /// What failed (an address, a reason; never request text).
        reason: String,
    },
    /// TLS refused the link — a certificate from another CA, of the wrong
    /// role, or none: dialling again will not help.
    #[error("TLS: {reason}")]
    Tls {
        /// What TLS said.
        reason: String,
    },
    /// The peer is of another build, model or page layout (its `Hello`),
    /// or not a peer of the role this process needs.
    #[error("{reason}")]
    Refused {
        /// What differs.
        reason: String,
    },
    /// A peer name or address that cannot name a worker.
    #[error("{reason}")]
    InvalidName {
        /// What is wrong with it.
        reason: String,
    },
    /// A peer sent a frame no peer of this build sends.
    #[error(transparent)]
    Malformed(HandoffError),
    /// This process is stopping.
    #[error("shutting down")]
    ShuttingDown,
    /// The worker behind a link refused or failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl FleetError {
    /// Whether dialling again may help: the peer was unreachable or the
    /// link broke, rather than refused for a configuration that will not
    /// change.
    pub fn is_transient(&self) -> bool {
        matches!(self, FleetError::Unreachable { .. })
    }

    pub(crate) fn io(error: std::io::Error) -> FleetError {
        FleetError::Unreachable {
            reason: error.to_string(),
        }
    }
}

/// Where the engine asks (a [`Connector`](kvfence_engine::Connector) joining
/// a pair), a fleet error becomes the engine's nearest.
impl From<FleetError> for EngineError {
    fn from(error: FleetError) -> EngineError {
        match error {
            FleetError::Unreachable { reason } => EngineError::Handoff(HandoffError::Io(reason)),
            FleetError::Tls { reason } => EngineError::Handoff(HandoffError::Tls(reason)),
            FleetError::Refused { reason } | FleetError::InvalidName { reason } => {
                EngineError::Invalid { reason }
            }
            FleetError::Malformed(error) => EngineError::Handoff(error),
            FleetError::ShuttingDown => EngineError::ShuttingDown,
            FleetError::Engine(error) => error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unreachable_peer_is_worth_dialling_again() {
        let unreachable = FleetError::Unreachable {
            reason: "connection refused".into(),
        };
        assert!(unreachable.is_transient());
        for lasting in [
            FleetError::Tls {
                reason: "unknown issuer".into(),
            },
            FleetError::Refused {
                reason: "another model".into(),
            },
            FleetError::ShuttingDown,
        ] {
            assert!(!lasting.is_transient(), "{lasting}");
        }
    }

    #[test]
    fn the_engine_sees_its_nearest_error() {
        let engine = |error| EngineError::from(error);
        assert!(matches!(
            engine(FleetError::Engine(EngineError::QueueFull { capacity: 3 })),
            EngineError::QueueFull { capacity: 3 }
        ));
        assert!(matches!(
            engine(FleetError::Unreachable { reason: "x".into() }),
            EngineError::Handoff(HandoffError::Io(_))
        ));
        assert!(matches!(
            engine(FleetError::Refused { reason: "x".into() }),
            EngineError::Invalid { .. }
        ));
        assert!(matches!(
            engine(FleetError::ShuttingDown),
            EngineError::ShuttingDown
        ));
    }
}
