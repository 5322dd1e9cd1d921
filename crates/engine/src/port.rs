//! A worker's links to its peers, as the worker core sees them: frames in,
//! frames out, no IO. Whatever carries the frames — a TLS link in another
//! crate, a test's pipe — holds a [`Port`] per link and moves bytes:
//!
//! - [`Outbound`] yields what the worker sends its peer, as link-frame
//!   parts (a kind byte, then the body). A hand-off frame is its own body,
//!   shared: a chunk's bytes are not copied again on the way to the socket.
//! - [`Inbound::deliver`] hands the worker one frame its peer sent, decoded
//!   here; anything malformed is an error for the carrier to close the link
//!   on, never a panic, whatever the peer sent (the property tests below
//!   feed it damaged and random frames).
//! - Dropping the [`Inbound`] is the link's end: the worker hears
//!   `PeerLost` exactly once, so in-flight hand-offs on it fail instead of
//!   hanging, however the carrier stopped.
//!
//! The frame kinds: a hand-off message ([`kvfence_handoff::Message`]), a
//! decode worker's order to a prefill worker (its grant, then the request
//! in [`GenerationRequest`]'s serde form — the schema the fleet's control
//! messages use too), a drain notice, and [`CONTROL`] — the fleet's control
//! plane, which shares the link and is never a worker's. A port knows the
//! role it faces: an order from a prefill worker closes the link.

use std::borrow::Cow;
use std::sync::{Arc, mpsc};

use bytes::Bytes;
use kvfence_handoff::HandoffError;
use kvfence_model::StopStrings;

use crate::error::EngineError;
use crate::request::{GenerationRequest, LinkGrammars};
use crate::scheduler::{Command, PeerId, PeerTx, PeerUp, PrefillOrder};

/// One link between a worker and a peer, as the worker sees it.
pub struct Port {
    /// What the peer sends, into the worker.
    pub inbound: Inbound,
    /// What the worker sends, out to the peer.
    pub outbound: Outbound,
}

impl std::fmt::Debug for Port {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Port")
            .field("peer", &self.inbound.peer)
            .finish_non_exhaustive()
    }
}

/// How the prefill and decode workers of an in-process pair
/// ([`Engine::start_disaggregated`](crate::Engine::start_disaggregated))
/// are connected.
#[derive(Debug, Clone)]
pub enum Transport {
    /// Each scheduler's way to its peer is the peer's inbox. Hand-off
    /// messages still cross as encoded frames, so the codec's checks are
    /// always on the path.
    InProcess,
    /// As `InProcess`, with one-sided grants: the prefill worker writes KV
    /// straight into the decode worker's pages through a revocable window
    /// (the RDMA memory-key model); aborted pages wait in quarantine until
    /// the writer acknowledges (I4).
    SharedMemory,
    /// Each end is a [`Port`], and `connector` carries their frames (the
    /// fleet's TLS link over loopback, for one): every order and message
    /// crosses the link codec.
    Linked(Arc<dyn Connector>),
}

/// Carries the frames of a pair's two ports, one link between them.
pub trait Connector: Send + Sync + std::fmt::Debug {
    /// Starts moving `prefill`'s outbound frames into `decode`'s inbound
    /// side and back, for as long as both workers live; the link's end
    /// drops both inbound sides.
    fn connect(&self, prefill: Port, decode: Port) -> Result<(), EngineError>;
}

/// Who is at the other end of a link, which decides what it may send.
pub(crate) enum Facing {
    /// A decode worker: it sends orders — their grammars compiled here, as
    /// they are delivered, off the scheduler's thread — and hand-off
    /// messages.
    Decode(LinkGrammars),
    /// A prefill worker: it sends hand-off messages and drain notices; an
    /// order from it (a decode worker is never one's prefill worker) closes
    /// the link.
    Prefill,
}

/// What runs when a link ends, after the worker has heard so.
type OnEnd = Box<dyn FnOnce() + Send>;

impl Port {
    /// Opens a link named `peer` into the scheduler behind `inbox`, to a
    /// worker of the role `facing` says: the scheduler hears `PeerUp` (the
    /// peer's `name` and the `tokens` of KV its pool holds) before any
    /// frame. `on_end` runs when the link ends.
    pub(crate) fn open(
        inbox: mpsc::Sender<Command>,
        peer: PeerId,
        name: String,
        tokens: usize,
        facing: Facing,
        on_end: Option<OnEnd>,
    ) -> Result<Port, EngineError> {
        let (to_peer, outbox) = mpsc::channel::<Command>();
        let up = PeerUp {
            peer,
            tx: PeerTx::new(to_peer, peer),
            name,
            tokens,
        };
        if inbox.send(Command::PeerUp(Box::new(up))).is_err() {
            return Err(EngineError::ShuttingDown);
        }
        Ok(Port {
            inbound: Inbound {
                inbox,
                peer,
                facing,
                on_end,
            },
            outbound: Outbound(outbox),
        })
    }
}

/// The worker's side of what a peer sends on one link. Dropping it ends
/// the link for the worker.
pub struct Inbound {
    inbox: mpsc::Sender<Command>,
    peer: PeerId,
    facing: Facing,
    on_end: Option<OnEnd>,
}

impl Inbound {
    /// Hands the worker one link frame its peer sent. An error means the
    /// link must close: the frame is malformed (`Handoff(Malformed)`) or
    /// the worker has stopped (`ShuttingDown`).
    pub fn deliver(&mut self, frame: Bytes) -> Result<(), EngineError> {
        let mut command = decode(frame, self.peer)?;
        if let Command::Prefill { order, .. } = &mut command {
            let Facing::Decode(grammars) = &mut self.facing else {
                return Err(malformed("an order from a prefill worker").into());
            };
            if let Some(constraint) = order.request.constraint.take() {
                // Kept bare when it fails: the scheduler then refuses the
                // order the way it refuses any.
                let kept = constraint.clone();
                order.request.constraint = Some(grammars.compile(constraint).unwrap_or(kept));
            }
        }
        self.inbox
            .send(command)
            .map_err(|_| EngineError::ShuttingDown)
    }
}

impl Drop for Inbound {
    fn drop(&mut self) {
        // The scheduler may be gone already; then nothing waits on the link.
        let _ = self.inbox.send(Command::PeerLost(self.peer));
        if let Some(on_end) = self.on_end.take() {
            on_end();
        }
    }
}

/// What the worker sends its peer on one link, as link-frame parts.
pub struct Outbound(mpsc::Receiver<Command>);

impl Iterator for Outbound {
    type Item = Vec<Bytes>;

    /// Waits for the worker's next frame to the peer; `None` once the
    /// worker has let go of the link (stopped, or the peer was lost).
    fn next(&mut self) -> Option<Vec<Bytes>> {
        loop {
            let command = self.0.recv().ok()?;
            let parts = match command {
                // Shared, not copied: a chunk's bytes go out as they are.
                Command::Frame { frame, .. } => vec![Bytes::from_static(&[FRAME]), frame],
                other => match encode(&other) {
                    Some((kind, body)) => {
                        vec![
                            Bytes::from_static(kind_byte(kind)),
                            body.into_owned().into(),
                        ]
                    }
                    None => continue,
                },
            };
            return Some(parts);
        }
    }
}

/// The one-byte kind prefix of a link frame, as a static slice.
fn kind_byte(kind: u8) -> &'static [u8] {
    match kind {
        FRAME => &[FRAME],
        ORDER => &[ORDER],
        DRAINING => &[DRAINING],
        _ => &[CONTROL],
    }
}

const FRAME: u8 = 1;
const ORDER: u8 = 2;
/// The kind byte of the fleet's control-plane frames (worker hellos,
/// router requests and events): never a worker's, so [`Inbound::deliver`]
/// refuses it.
pub const CONTROL: u8 = 3;
/// The sender drains (no body): send it nothing new if another can take it.
const DRAINING: u8 = 4;

/// A command as a link frame: its kind, then its body. A hand-off frame is
/// its own body, borrowed: a chunk's bytes are not copied again on the way
/// to the socket. An order is its grant (a hand-off frame, length-prefixed)
/// and then its request in the request's own serde form, the schema every
/// control message uses.
fn encode(command: &Command) -> Option<(u8, Cow<'_, [u8]>)> {
    match command {
        Command::Frame { frame, .. } => Some((FRAME, Cow::Borrowed(frame))),
        Command::Prefill { order, .. } => {
            // A window is a mapping into this process's memory; over a
            // link grants are always two-sided.
            debug_assert!(
                order.window.is_none(),
                "one-sided grants never cross a link"
            );
            let mut out =
                Vec::with_capacity(4 + order.grant.len() + 16 * order.request.prompt.len());
            out.extend_from_slice(&(order.grant.len() as u32).to_le_bytes());
            out.extend_from_slice(&order.grant);
            serde_json::to_writer(&mut out, &order.request).expect("a request always serialises");
            Some((ORDER, Cow::Owned(out)))
        }
        Command::PeerDraining(_) => Some((DRAINING, Cow::Borrowed(&[][..]))),
        // Local-only commands never cross a link.
        Command::Submit(_)
        | Command::Shutdown
        | Command::Drain
        | Command::PeerUp(_)
        | Command::PeerLost(_) => None,
    }
}

fn malformed(reason: &'static str) -> HandoffError {
    HandoffError::Malformed {
        kind: "link",
        reason,
    }
}

/// The command a link frame carries, as from the link `peer`; an error for
/// anything malformed, never a panic, whatever the peer sent (the property
/// tests below feed it damaged and random frames). A hand-off frame stays a
/// view of `payload`.
fn decode(payload: Bytes, peer: PeerId) -> Result<Command, HandoffError> {
    let &kind = payload.first().ok_or_else(|| malformed("empty frame"))?;
    match kind {
        FRAME => Ok(Command::Frame {
            peer,
            frame: payload.slice(1..),
        }),
        DRAINING if payload.len() == 1 => Ok(Command::PeerDraining(peer)),
        ORDER => {
            let body = &payload[1..];
            let (len, rest) = body
                .split_first_chunk::<4>()
                .ok_or_else(|| malformed("frame ends inside the grant's length"))?;
            let len = u32::from_le_bytes(*len) as usize;
            if len > rest.len() {
                return Err(malformed("the grant overruns the frame"));
            }
            let (grant, request) = rest.split_at(len);
            let request: GenerationRequest = serde_json::from_slice(request)
                .map_err(|_| malformed("the order's request is not valid"))?;
            let request = GenerationRequest {
                // Prefill samples only the first token; the rest, and
                // how the completion ends, is decode's.
                max_tokens: 1,
                stop: StopStrings::default(),
                ignore_eos: false,
                ..request
            };
            Ok(Command::Prefill {
                peer,
                order: Box::new(PrefillOrder {
                    grant: grant.to_vec(),
                    request,
                    window: None,
                }),
            })
        }
        _ => Err(malformed("unknown link frame kind")),
    }
}

/// Decodes one link frame as a worker's link does, with no worker behind
/// it: `Ok` for a frame a peer of this build could send, else why the link
/// would close. The fuzz target `port_frame` (`fuzz/`) drives it.
#[doc(hidden)]
pub fn decode_frame(frame: Bytes) -> Result<(), EngineError> {
    decode(frame, PeerId(0))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::LinkGrammars;
    use crate::request::{CacheScope, Share};
    use crate::trace::TraceContext;
    use kvfence_handoff::tcp::{read_link_frame, write_link_frame_parts};
    use kvfence_model::{Grammar, SamplingParams};

    /// What the peer's reader decodes for `command`: its encoding through
    /// the real link framing.
    fn over_the_link(command: &Command) -> Result<Command, HandoffError> {
        let (kind, body) = encode(command).expect("a command that crosses links");
        let mut wire = Vec::new();
        write_link_frame_parts(&mut wire, &[&[kind], &body])?;
        let payload = read_link_frame(&mut &wire[..])?.expect("one whole frame");
        decode(payload.into(), PeerId(7))
    }

    /// An order's link frame, whole.
    fn order_frame() -> Bytes {
        let request = GenerationRequest {
            stop: StopStrings::new(vec!["x".into()]).unwrap(),
            ignore_eos: true,
            ..GenerationRequest::greedy(vec![1, 2, 3], 9)
        };
        let order = Command::Prefill {
            peer: PeerId(0),
            order: Box::new(PrefillOrder {
                grant: vec![9],
                request,
                window: None,
            }),
        };
        let (kind, body) = encode(&order).expect("orders cross links");
        std::iter::once(kind).chain(body.iter().copied()).collect()
    }

    fn open(facing: Facing) -> (Port, mpsc::Receiver<Command>) {
        let (inbox, commands) = mpsc::channel();
        let port = Port::open(inbox, PeerId(4), "peer".into(), 0, facing, None).unwrap();
        assert!(
            matches!(commands.try_recv(), Ok(Command::PeerUp(up)) if up.peer == PeerId(4)),
            "the worker hears of the link before any frame"
        );
        (port, commands)
    }

    #[test]
    fn a_decode_worker_takes_no_order_from_its_prefill_worker() {
        let (mut port, commands) = open(Facing::Prefill);
        assert!(
            port.inbound.deliver(order_frame()).is_err(),
            "the link closes"
        );
        drop(port);
        assert!(
            matches!(commands.try_recv(), Ok(Command::PeerLost(PeerId(4)))),
            "nothing but the link's end reaches the worker"
        );
        assert!(commands.try_recv().is_err());
    }

    #[test]
    fn a_prefill_worker_takes_orders_and_only_their_first_token_is_its() {
        let model = crate::testing::tiny_model();
        let (mut port, commands) = open(Facing::Decode(LinkGrammars::new(model)));
        port.inbound.deliver(order_frame()).unwrap();
        let Ok(Command::Prefill { peer, order }) = commands.try_recv() else {
            panic!("an order reaches the prefill worker")
        };
        assert_eq!(peer, PeerId(4), "stamped with the link it came on");
        assert_eq!(order.request.prompt, [1, 2, 3]);
        // How the completion ends is the decode worker's business.
        assert_eq!(order.request.max_tokens, 1);
        assert!(order.request.stop.strings().is_empty() && !order.request.ignore_eos);
    }

    #[test]
    fn a_link_ends_once_and_its_end_runs_after_the_worker_hears() {
        let (inbox, commands) = mpsc::channel();
        let (ended_tx, ended) = mpsc::channel();
        let on_end = Box::new(move || {
            // The worker has heard by now.
            let _ = ended_tx.send(());
        });
        let port = Port::open(
            inbox,
            PeerId(1),
            "p".into(),
            0,
            Facing::Prefill,
            Some(on_end),
        )
        .unwrap();
        let Port { inbound, outbound } = port;
        drop(outbound);
        assert!(
            ended.try_recv().is_err(),
            "the outbound side is not the link's end"
        );
        drop(inbound);
        ended.try_recv().unwrap();
        let heard: Vec<_> = commands.try_iter().collect();
        assert_eq!(heard.len(), 2, "PeerUp, then PeerLost once");
        assert!(matches!(heard[1], Command::PeerLost(PeerId(1))));
    }

    #[test]
    fn hand_off_frames_cross_the_link_unchanged() {
        for len in [0, 1, 5, 70_000] {
            let frame: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let sent = Command::Frame {
                peer: PeerId(1),
                frame: frame.clone().into(),
            };
            let Command::Frame { peer, frame: got } = over_the_link(&sent).unwrap() else {
                panic!("not a frame")
            };
            assert_eq!(peer, PeerId(7), "stamped with the link it came on");
            assert_eq!(got, frame);
        }
    }

    #[test]
    fn a_drain_notice_crosses_the_link_as_from_its_link() {
        let got = over_the_link(&Command::PeerDraining(PeerId(3))).unwrap();
        assert!(matches!(got, Command::PeerDraining(PeerId(7))));
        // A drain notice has no body; one with bytes is malformed.
        assert!(decode(Bytes::from_static(&[DRAINING, 0]), PeerId(0)).is_err());
    }

    #[test]
    fn orders_round_trip_through_the_link_encoding() {
        let request = GenerationRequest {
            prompt: vec![1, 2, 300],
            max_tokens: 1,
            sampling: shaped(),
            stop: StopStrings::default(),
            ignore_eos: false,
            cache: Some(CacheScope::tenant("tenant-a", Some("salt".into()))),
            constraint: Some(Grammar::Regex("[a-z]+".into()).into()),
            share: Share::new("tenant-a", 3)
                .with_priority(-2)
                .on_shared_workers(true),
            trace: TraceContext::new(u128::MAX - 5, 0x0102_0304_0506_0708),
        };
        let sent = Command::Prefill {
            peer: PeerId(1),
            order: Box::new(PrefillOrder {
                window: None,
                grant: vec![9, 9],
                request,
            }),
        };
        let Command::Prefill { order, .. } = over_the_link(&sent).unwrap() else {
            panic!("not an order")
        };
        assert_eq!(order.grant, vec![9, 9]);
        assert_eq!(order.request.prompt, vec![1, 2, 300]);
        assert_eq!(
            order.request.trace,
            TraceContext::new(u128::MAX - 5, 0x0102_0304_0506_0708)
        );
        assert_eq!(order.request.sampling, shaped());
        assert_eq!(
            order.request.constraint.as_ref().map(|c| c.grammar.clone()),
            Some(Grammar::Regex("[a-z]+".into()))
        );
        assert_eq!(
            order.request.cache,
            Some(CacheScope::tenant("tenant-a", Some("salt".into())))
        );
        assert_eq!(
            order.request.share,
            Share::new("tenant-a", 3)
                .with_priority(-2)
                .on_shared_workers(true)
        );
        for cache in [
            None,
            Some(CacheScope::tenant("b", None)),
            Some(CacheScope::Public),
        ] {
            let mut request = order.request.clone();
            request.cache = cache.clone();
            let sent = Command::Prefill {
                peer: PeerId(1),
                order: Box::new(PrefillOrder {
                    window: None,
                    grant: vec![9],
                    request,
                }),
            };
            let Command::Prefill { order, .. } = over_the_link(&sent).unwrap() else {
                panic!("not an order")
            };
            assert_eq!(order.request.cache, cache);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn any_order_round_trips_and_damage_never_panics(
            prompt in proptest::collection::vec(0u32..300_000, 0..48),
            grant in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
            tenant in "[a-z-]{0,12}",
            salt in proptest::option::of("[a-z]{1,8}"),
            weight in 1u32..1_000,
            priority in -5i32..5,
            shared in proptest::prelude::any::<bool>(),
            trace in proptest::option::of((1u128.., 1u64..)),
            cut in proptest::prelude::any::<proptest::sample::Index>(),
            flip in proptest::prelude::any::<(proptest::sample::Index, u8)>(),
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
        ) {
            let request = GenerationRequest {
                prompt,
                max_tokens: 1,
                sampling: shaped(),
                stop: StopStrings::default(),
                ignore_eos: false,
                cache: Some(CacheScope::tenant(tenant.clone(), salt)),
                constraint: None,
                share: Share::new(tenant, weight)
                    .with_priority(priority)
                    .on_shared_workers(shared),
                trace: trace.and_then(|(trace, span)| TraceContext::new(trace, span)),
            };
            let sent = Command::Prefill {
                peer: PeerId(1),
                order: Box::new(PrefillOrder { grant, request: request.clone(), window: None }),
            };
            let Ok(Command::Prefill { order, .. }) = over_the_link(&sent) else {
                panic!("an order comes back an order")
            };
            proptest::prop_assert_eq!(&order.request.prompt, &request.prompt);
            proptest::prop_assert_eq!(&order.request.cache, &request.cache);
            proptest::prop_assert_eq!(&order.request.share, &request.share);
            proptest::prop_assert_eq!(order.request.trace, request.trace);
            let (kind, body) = encode(&sent).expect("an order crosses links");
            let whole: Vec<u8> = std::iter::once(kind).chain(body.iter().copied()).collect();
            // A frame cut short ends inside the grant or the request.
            let short = cut.index(whole.len());
            proptest::prop_assert!(decode(Bytes::copy_from_slice(&whole[..short]), PeerId(0)).is_err());
            // A damaged byte is refused or read as some other order.
            let mut damaged = whole.clone();
            let at = flip.0.index(damaged.len());
            damaged[at] ^= flip.1 | 1;
            let _ = decode(Bytes::from(damaged), PeerId(0));
            // So is any noise after an order's kind.
            let noisy: Vec<u8> = std::iter::once(ORDER).chain(noise).collect();
            let _ = decode(Bytes::from(noisy), PeerId(0));
        }
    }

    /// Sampling parameters with every field away from its default.
    fn shaped() -> SamplingParams {
        SamplingParams {
            temperature: 0.5,
            top_k: 7,
            top_p: 0.9,
            seed: 42,
            presence_penalty: 0.25,
            frequency_penalty: -0.5,
            repetition_penalty: 1.1,
            logit_bias: vec![(3, -100.0), (17, 2.5)],
            logprobs: Some(4),
            prompt_logprobs: Some(3),
        }
    }

    #[test]
    fn malformed_link_frames_are_errors_not_panics() {
        for bad in [
            &[][..],
            &[7],
            &[ORDER],
            &[ORDER, 255, 255, 255, 255],
            &[ORDER, 0, 0, 0, 0, 255, 255, 255, 255],
        ] {
            assert!(
                decode(Bytes::copy_from_slice(bad), PeerId(0)).is_err(),
                "{bad:?}"
            );
        }
        let mut s = 1u64;
        for len in 0..400 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s as u8
                })
                .collect();
            let _ = decode(bytes.into(), PeerId(0));
        }
    }
}
