//! What leaves a scheduler's core: [`Effect`]s, addressed to a client or to
//! a peer worker, in the order the core produced them. The core sends
//! nothing itself; its callers deliver — the [`Shell`](super::Shell) over
//! channels, the fleet simulator over its virtual links — and a test reads
//! them as values.
//!
//! An address ([`ClientTx`], [`PeerTx`]) is where an effect goes, not a way
//! for the core to reach it: only [`Effect::deliver`] sends through one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use bytes::Bytes;
use kvfence_handoff::Message;
use tokio::sync::mpsc as tokio_mpsc;

use super::{Command, PeerId, PrefillOrder};
use crate::request::Event;

/// Where one client's events go, and whether it cancelled: from then on it
/// hears nothing, even what the core said before it saw the cancellation.
#[derive(Debug, Clone)]
pub(crate) struct ClientTx {
    events: tokio_mpsc::UnboundedSender<Event>,
    cancelled: Arc<AtomicBool>,
}

impl ClientTx {
    pub(crate) fn new(
        events: tokio_mpsc::UnboundedSender<Event>,
        cancelled: Arc<AtomicBool>,
    ) -> ClientTx {
        ClientTx { events, cancelled }
    }

    /// It cancelled, or stopped reading.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.has_cancelled() || self.events.is_closed()
    }

    fn has_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }
}

/// The far end of a link to a peer worker: its inbox (in-process) or a
/// port's outbound queue. `stamp` is the name the peer knows this end by,
/// put on every command so the peer's scheduler can tell its links apart.
#[derive(Debug, Clone)]
pub(crate) struct PeerTx {
    tx: mpsc::Sender<Command>,
    stamp: PeerId,
}

impl PeerTx {
    pub(crate) fn new(tx: mpsc::Sender<Command>, stamp: PeerId) -> PeerTx {
        PeerTx { tx, stamp }
    }

    /// An address its holder routes by stamp alone, as the fleet
    /// simulator does: delivering to it drops the message.
    #[cfg(test)]
    pub(crate) fn routed(stamp: PeerId) -> PeerTx {
        let (tx, _) = mpsc::channel();
        PeerTx { tx, stamp }
    }

    /// The name the peer knows this link by.
    #[cfg(test)]
    pub(crate) fn stamp(&self) -> PeerId {
        self.stamp
    }
}

/// What goes to a peer worker.
pub(crate) enum ToPeer {
    /// One hand-off message's frame.
    Frame(Bytes),
    /// One chunk of KV's frame: a frame too, kept apart so that faults can
    /// be injected between chunks as they leave (see [`Effect::deliver`]).
    Chunk(Bytes),
    /// A grant to fill, with its prompt (decode to prefill).
    Order(Box<PrefillOrder>),
    /// This worker drains: send it nothing new if another can take it.
    Draining,
}

impl ToPeer {
    /// The command the peer's scheduler takes, stamped with `from`, its
    /// name for the link it came on.
    pub(crate) fn into_command(self, from: PeerId) -> Command {
        match self {
            ToPeer::Frame(frame) | ToPeer::Chunk(frame) => Command::Frame { peer: from, frame },
            ToPeer::Order(order) => Command::Prefill { peer: from, order },
            ToPeer::Draining => Command::PeerDraining(from),
        }
    }
}

/// One thing the core sends.
pub(crate) enum Effect {
    /// An event of a client's request.
    Client { to: ClientTx, event: Event },
    /// A message to a peer worker.
    Peer { to: PeerTx, message: ToPeer },
}

impl Effect {
    /// Sends it. A client that cancelled hears nothing more; a link that is
    /// gone drops what was sent on it (its loss reaches the core as
    /// [`Command::PeerLost`]).
    pub(crate) fn deliver(self) {
        match self {
            Effect::Client { to, event } => {
                if !to.has_cancelled() {
                    let _ = to.events.send(event);
                }
            }
            Effect::Peer { to, message } => {
                if let ToPeer::Chunk(_) = message {
                    // Fault injection between chunks: a delay, a lost chunk
                    // (`stall`), or a crash partway through a transfer.
                    fail::fail_point!("handoff-mid-chunk", super::crash_or_stall);
                }
                let _ = to.tx.send(message.into_command(to.stamp));
            }
        }
    }
}

/// What the core has produced and not yet handed out, in order.
#[derive(Default)]
pub(crate) struct Outbox(Vec<Effect>);

impl Outbox {
    /// Tells a client `event`, unless it cancelled.
    pub(crate) fn client(&mut self, to: &ClientTx, event: Event) {
        if !to.has_cancelled() {
            self.0.push(Effect::Client {
                to: to.clone(),
                event,
            });
        }
    }

    pub(crate) fn peer(&mut self, to: &PeerTx, message: ToPeer) {
        self.0.push(Effect::Peer {
            to: to.clone(),
            message,
        });
    }

    /// One hand-off message to a peer.
    pub(crate) fn message(&mut self, to: &PeerTx, message: &Message) {
        self.peer(to, ToPeer::Frame(message.to_frame().into()));
    }

    pub(crate) fn take(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.0)
    }
}

/// The world around a core while it polls, which may compute for long: it
/// takes the core's effects before each forward pass and at the end (so a
/// token computed by an express pass is not held back by the longer pass
/// after it), and says whether a command waits (a pass pauses between
/// layers for one).
pub(crate) trait Outside: Send {
    /// Takes effects, in order.
    fn send(&mut self, effects: Vec<Effect>);
    /// Whether a command has arrived since the last poll.
    fn command_waiting(&mut self) -> bool;
}

/// An outside that delivers at once and never pauses a pass (tests).
#[cfg(test)]
pub(crate) struct Deliver;

#[cfg(test)]
impl Outside for Deliver {
    fn send(&mut self, effects: Vec<Effect>) {
        effects.into_iter().for_each(Effect::deliver);
    }

    fn command_waiting(&mut self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId};

    use super::{Effect, Outside};
    use crate::config::EngineConfig;
    use crate::counters::Counters;
    use crate::request::{Event, GenerationRequest};
    use crate::scheduler::{Command, Pending, Role, Scheduler};
    use crate::testing::tiny_model;

    /// Keeps what the core sends; never pauses it.
    #[derive(Default)]
    struct Kept(Vec<Effect>);

    impl Outside for Kept {
        fn send(&mut self, effects: Vec<Effect>) {
            self.0.extend(effects);
        }

        fn command_waiting(&mut self) -> bool {
            false
        }
    }

    #[test]
    fn a_core_sends_nothing_itself_every_event_leaves_as_an_effect_in_order() {
        let model = tiny_model();
        let spec = PoolSpec::new(
            model.model.kv_shape(),
            16,
            ElemType::F32,
            PoolSize::Tokens(256),
        );
        let counters = Arc::new(Counters::default());
        let mut core = Scheduler::new(
            Role::Colocated,
            model,
            Pool::new(&spec).unwrap(),
            EngineConfig::default(),
            Arc::clone(&counters),
        );
        let request = GenerationRequest {
            ignore_eos: true,
            ..GenerationRequest::greedy(vec![5, 6, 7, 8], 3)
        };
        let (pending, mut handle) = Pending::for_client(RequestId(1), request, None);
        counters.queued.fetch_add(1, Ordering::AcqRel);
        let taken = core.handle(Command::Submit(Box::new(pending)));
        assert!(taken.is_empty(), "taking a request says nothing yet");

        let mut kept = Kept::default();
        while core.poll(Instant::now(), &mut kept) {}
        assert!(
            handle.try_next().is_err(),
            "nothing reaches the client but through its effects"
        );
        let events: Vec<&Event> = kept
            .0
            .iter()
            .map(|effect| match effect {
                Effect::Client { event, .. } => event,
                Effect::Peer { .. } => panic!("a colocated worker has no peer"),
            })
            .collect();
        let (last, tokens) = events.split_last().unwrap();
        assert!(
            tokens.iter().all(|e| matches!(e, Event::Token { .. })),
            "tokens (and the text's flushed rest), then the end: {events:?}"
        );
        assert!(
            matches!(last, Event::Finished { usage, .. } if usage.completion_tokens == 3),
            "{events:?}"
        );
        let sent = events.len();

        for effect in kept.0 {
            effect.deliver();
        }
        let mut delivered = 0;
        while handle.try_next().is_ok() {
            delivered += 1;
        }
        assert_eq!(delivered, sent, "delivering hands the client each one");
    }
}
