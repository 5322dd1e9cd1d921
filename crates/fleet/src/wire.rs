//! The control plane's messages: what a worker says when a link opens
//! (`Hello`) and what a router and a decode worker exchange (`Control`).
//! Every field is named, so adding one never shifts another, and a
//! `protocol` number in `Hello` makes a mismatched pair of builds refuse
//! each other at once instead of misreading each other later. The messages
//! travel as JSON inside the links' TLS and length-delimited frames; none is
//! ever logged (I10: a `Submit` holds prompt tokens).

use bytes::Bytes;
use kvfence_handoff::HandoffError;
use kvfence_model::{LoadedModel, ModelConfig};
use kvfence_pool::{ElemType, Pool, PoolStats};
use serde::{Deserialize, Serialize};

use crate::net::LinkTx;
use kvfence_engine::CONTROL;
use kvfence_engine::EngineStats;
use kvfence_engine::PrefillPeer;
use kvfence_engine::{Event, GenerationRequest};

/// The control protocol's version; a peer speaking another is refused
/// (8: orders and `Submit` carry a trace context; 9: `Done` carries the
/// prompt's scores, and an event carries them to the router; 10: a grant
/// names each layer group's pages, and `Hello` the groups; 11: `Submit`
/// and orders carry the request, and `Event` the event, in the engine's
/// own serde forms; 12: pages, and so KV chunks, hold keys as columns).
pub(crate) const PROTOCOL: u32 = 12;

/// How a worker's pool lays out KV pages: what both ends of a hand-off
/// must share, since pages cross as bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PageLayout {
    /// Token slots per page.
    pub(crate) page_size: usize,
    /// Element type of stored K and V.
    pub(crate) elem: ElemType,
    /// The model layers each layer group's pages hold.
    pub(crate) layer_groups: Vec<Vec<usize>>,
}

impl PageLayout {
    /// The layout of `pool`'s pages.
    pub(crate) fn of(pool: &Pool) -> PageLayout {
        let groups = pool.layer_groups();
        PageLayout {
            page_size: pool.geometry().page_size,
            elem: pool.geometry().elem,
            layer_groups: (0..groups.len())
                .map(|g| groups.members(g).to_vec())
                .collect(),
        }
    }
}

/// What identifies a model for the hand-off: two workers whose
/// fingerprints differ cannot read each other's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFingerprint {
    /// Transformer layers.
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// The first 8 bytes of the SHA-256 of every hyper-parameter
    /// (architecture, norms, RoPE bases and scaling, sliding windows, end
    /// tokens): two models of one KV shape that compute differently —
    /// a Llama and a Qwen of the same size — must not read each other's KV.
    pub config: u64,
}

impl ModelFingerprint {
    /// The fingerprint of a loaded model.
    pub fn of(model: &LoadedModel) -> ModelFingerprint {
        Self::of_config(model.model.config())
    }

    /// The fingerprint of a model's shape.
    pub fn of_config(c: &ModelConfig) -> ModelFingerprint {
        use sha2::{Digest, Sha256};
        // Debug prints every field, floats in their shortest exact form:
        // equal configs print alike, and a new field changes the print.
        let digest = Sha256::digest(format!("{c:?}").as_bytes());
        let mut config = [0u8; 8];
        config.copy_from_slice(&digest[..8]);
        ModelFingerprint {
            layers: c.num_layers,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            vocab: c.vocab_size,
            config: u64::from_le_bytes(config),
        }
    }
}

/// What a worker tells whoever connects to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The control protocol version of the worker's build.
    pub protocol: u32,
    /// The worker's role label.
    pub role: String,
    /// The model it runs.
    pub model: ModelFingerprint,
    /// Token slots per KV page.
    pub page_size: usize,
    /// Element type of its stored K and V ([`ElemType::name`]): pages are
    /// shipped as bytes, so both ends must read them alike.
    pub kv_dtype: String,
    /// The model layers each of its pool's layer groups holds: one group
    /// of every layer, or — keeping only the windows of sliding-window
    /// layers — global and windowed groups. A hand-off moves pages group
    /// by group, so both ends must group alike. (Absent from an older
    /// build's `Hello`, which its protocol number refuses.)
    #[serde(default)]
    pub layer_groups: Vec<Vec<usize>>,
    /// Tokens of KV the worker's own pool holds.
    pub tokens: usize,
    /// A decode worker's prefill workers, as its links stand now.
    pub prefills: Vec<PrefillPeer>,
}

impl Hello {
    /// Whether a peer that said this can work with one running `model`
    /// whose pool lays out pages as `pages`, where that matters; `Err`
    /// says what differs (no request content).
    pub(crate) fn check(
        &self,
        model: ModelFingerprint,
        pages: Option<&PageLayout>,
    ) -> Result<(), String> {
        if self.protocol != PROTOCOL {
            return Err(format!(
                "it speaks control protocol {}, this build speaks {PROTOCOL}",
                self.protocol
            ));
        }
        if self.model != model {
            return Err(format!(
                "it runs another model ({:?}, this process {:?})",
                self.model, model
            ));
        }
        let Some(&PageLayout {
            page_size,
            elem,
            ref layer_groups,
        }) = pages
        else {
            return Ok(());
        };
        if self.page_size != page_size {
            return Err(format!(
                "its KV pages hold {} tokens, this process's {page_size}",
                self.page_size
            ));
        }
        if self.kv_dtype != elem.name() {
            return Err(format!(
                "it stores KV as {}, this process as {}",
                self.kv_dtype,
                elem.name()
            ));
        }
        if &self.layer_groups != layer_groups {
            return Err(format!(
                "it groups its KV layers as {:?}, this process as {layer_groups:?} \
                 (one keeps only sliding windows, the other every position: \
                 set --kv-windows alike)",
                self.layer_groups
            ));
        }
        Ok(())
    }
}

/// Why a request naming the public prefix cache is refused at either end
/// of a router's link: that namespace is filled by a worker's own start-up.
pub(crate) const PUBLIC_OVER_A_LINK: &str =
    "the public prefix cache is filled only at a worker's start-up";

/// Why a decode worker did not take a request. Carried by name so each
/// becomes the same error, and the same HTTP status, as in one process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Refusal {
    QueueFull { capacity: usize },
    TooLong { needed: usize, capacity: usize },
    Invalid { reason: String },
    Unavailable { reason: String },
    ShuttingDown,
    Internal { message: String },
}

/// One pool's counters on the wire: every field of [`PoolStats`], by name,
/// so no counter a worker keeps arrives as a zero it never reported.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WirePool {
    pub(crate) role: String,
    pub(crate) num_pages: usize,
    pub(crate) page_size: usize,
    pub(crate) free_pages: usize,
    pub(crate) leased_pages: usize,
    pub(crate) quarantined_pages: usize,
    pub(crate) leases_granted: u64,
    pub(crate) leases_refused: u64,
    pub(crate) stale_writes_rejected: u64,
    pub(crate) foreign_writes_rejected: u64,
    pub(crate) reads_refused: u64,
    pub(crate) pages_quarantined_total: u64,
    #[serde(default)]
    pub(crate) shared_pages: usize,
    #[serde(default)]
    pub(crate) idle_shared_pages: usize,
    #[serde(default)]
    pub(crate) pinned_shared_pages: usize,
    #[serde(default)]
    pub(crate) cache_lookups: u64,
    #[serde(default)]
    pub(crate) cache_hits: u64,
    #[serde(default)]
    pub(crate) cache_hit_tokens: u64,
    #[serde(default)]
    pub(crate) cache_evictions: u64,
}

impl WirePool {
    pub(crate) fn new(role: &str, s: &PoolStats) -> WirePool {
        WirePool {
            role: role.to_string(),
            num_pages: s.num_pages,
            page_size: s.page_size,
            free_pages: s.free_pages,
            leased_pages: s.leased_pages,
            quarantined_pages: s.quarantined_pages,
            leases_granted: s.leases_granted,
            leases_refused: s.leases_refused,
            stale_writes_rejected: s.stale_writes_rejected,
            foreign_writes_rejected: s.foreign_writes_rejected,
            reads_refused: s.reads_refused,
            pages_quarantined_total: s.pages_quarantined_total,
            shared_pages: s.shared_pages,
            idle_shared_pages: s.idle_shared_pages,
            pinned_shared_pages: s.pinned_shared_pages,
            cache_lookups: s.cache_lookups,
            cache_hits: s.cache_hits,
            cache_hit_tokens: s.cache_hit_tokens,
            cache_evictions: s.cache_evictions,
        }
    }

    pub(crate) fn stats(&self) -> PoolStats {
        PoolStats {
            num_pages: self.num_pages,
            page_size: self.page_size,
            free_pages: self.free_pages,
            leased_pages: self.leased_pages,
            quarantined_pages: self.quarantined_pages,
            leases_granted: self.leases_granted,
            leases_refused: self.leases_refused,
            stale_writes_rejected: self.stale_writes_rejected,
            foreign_writes_rejected: self.foreign_writes_rejected,
            reads_refused: self.reads_refused,
            pages_quarantined_total: self.pages_quarantined_total,
            shared_pages: self.shared_pages,
            idle_shared_pages: self.idle_shared_pages,
            pinned_shared_pages: self.pinned_shared_pages,
            cache_lookups: self.cache_lookups,
            cache_hits: self.cache_hits,
            cache_hit_tokens: self.cache_hit_tokens,
            cache_evictions: self.cache_evictions,
        }
    }
}

/// A decode worker's counters, and its prefill links as they stand.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WireStats {
    pub(crate) pools: Vec<WirePool>,
    pub(crate) engine: EngineStats,
    pub(crate) prefills: Vec<PrefillPeer>,
    /// Whether the worker takes new requests (false while it drains).
    pub(crate) admitting: bool,
}

/// The router ↔ decode worker conversation. Ids are the router's, unique
/// per link.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Control {
    Hello(Hello),
    /// A request for the decode worker, in the engine's own form. Its
    /// cache scope is the tenant the router authenticated (the public
    /// scope is refused), its share that tenant's.
    Submit {
        id: u64,
        request: Box<GenerationRequest>,
        /// The prefill worker the router chose (a name from the decode
        /// worker's `prefills`).
        prefill: Option<String>,
    },
    Accepted {
        id: u64,
    },
    Refused {
        id: u64,
        refusal: Refusal,
    },
    Event {
        id: u64,
        event: Event,
    },
    Cancel {
        id: u64,
    },
    /// Answered by the `Stats` with the same id: concurrent scrapes each
    /// get their own answer.
    StatsRequest {
        id: u64,
    },
    Stats {
        id: u64,
        stats: WireStats,
    },
}

/// Queues `control` on a link; false once the link is gone.
pub(crate) fn send_control(out: &LinkTx, control: &Control) -> bool {
    let body = serde_json::to_vec(control).expect("control messages always serialise");
    out.send(vec![Bytes::from_static(&[CONTROL]), body.into()])
}

pub(crate) fn parse_control(frame: &[u8]) -> Result<Control, HandoffError> {
    match frame.split_first() {
        Some((&CONTROL, body)) => {
            serde_json::from_slice(body).map_err(|_| HandoffError::Malformed {
                kind: "control",
                reason: "not a control message",
            })
        }
        _ => Err(HandoffError::Malformed {
            kind: "control",
            reason: "expected a control frame",
        }),
    }
}

/// Reads one control frame as every control link does: `Ok` for a message
/// of this build's protocol, else why the link would close. The fuzz
/// target `control_frame` (`fuzz/`) drives it.
#[doc(hidden)]
pub fn decode_control_frame(frame: &[u8]) -> Result<(), HandoffError> {
    parse_control(frame)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfence_engine::trace::TraceContext;
    use kvfence_engine::{CacheScope, FailureKind, Share};
    use kvfence_model::{Grammar, SamplingParams, StopStrings};

    #[test]
    fn a_submit_carries_the_request_whole() {
        let request = GenerationRequest {
            prompt: vec![1, 2],
            max_tokens: 3,
            sampling: SamplingParams {
                temperature: 0.5,
                top_k: 4,
                top_p: 0.9,
                seed: 11,
                ..SamplingParams::greedy()
            },
            stop: StopStrings::new(vec!["x".into()])
                .unwrap()
                .keeping(vec!["</tool_call>".into()])
                .unwrap(),
            ignore_eos: true,
            cache: Some(CacheScope::tenant("acme", Some("salt".into()))),
            constraint: Some(Grammar::Regex("[a-z]+".into()).into()),
            share: Share::new("acme", 2).with_priority(-1),
            trace: TraceContext::new(3, 4),
        };
        let submit = Control::Submit {
            id: 7,
            request: Box::new(request),
            prefill: Some("10.0.0.1:7000".into()),
        };
        let json = serde_json::to_vec(&submit).unwrap();
        let frame: Vec<u8> = std::iter::once(CONTROL).chain(json).collect();
        let Control::Submit {
            id,
            request,
            prefill,
        } = parse_control(&frame).unwrap()
        else {
            panic!("not a submit")
        };
        assert_eq!((id, prefill.as_deref()), (7, Some("10.0.0.1:7000")));
        assert_eq!((request.prompt, request.max_tokens), (vec![1, 2], 3));
        assert_eq!(request.sampling.top_k, 4);
        assert_eq!(request.stop.strings(), ["x"]);
        assert_eq!(request.stop.kept(), ["</tool_call>"]);
        assert!(request.ignore_eos);
        assert_eq!(
            request.cache,
            Some(CacheScope::tenant("acme", Some("salt".into())))
        );
        assert_eq!(
            request.constraint.map(|c| c.grammar),
            Some(Grammar::Regex("[a-z]+".into()))
        );
        assert_eq!(request.share, Share::new("acme", 2).with_priority(-1));
        assert_eq!(request.trace, TraceContext::new(3, 4));
    }

    #[test]
    fn stop_strings_are_checked_again_as_a_submit_is_read() {
        let json = serde_json::json!({"Submit": {"id": 1, "prefill": null, "request": {
            "prompt": [1], "max_tokens": 1, "sampling": SamplingParams::greedy(),
            "stop": ["a", "b", "c", "d", "e"], "ignore_eos": false}}});
        let frame: Vec<u8> = std::iter::once(CONTROL)
            .chain(serde_json::to_vec(&json).unwrap())
            .collect();
        assert!(parse_control(&frame).is_err(), "five stop strings");
    }

    #[test]
    fn damaged_or_random_control_frames_are_errors_not_panics() {
        let submit = serde_json::to_vec(&Control::Cancel { id: 3 }).unwrap();
        let whole: Vec<u8> = std::iter::once(CONTROL).chain(submit).collect();
        assert!(parse_control(&whole).is_ok());
        for cut in 0..whole.len() {
            assert!(parse_control(&whole[..cut]).is_err(), "cut at {cut}");
        }
        let mut s = 7u64;
        for len in 0..300 {
            let noise: Vec<u8> = std::iter::once(CONTROL)
                .chain((0..len).map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s as u8
                }))
                .collect();
            let _ = parse_control(&noise);
        }
    }

    #[test]
    fn a_failure_kind_travels_by_name_and_unknown_kinds_are_refused() {
        let event = Event::Failed {
            kind: FailureKind::TooLong,
            message: String::new(),
        };
        let json = serde_json::to_string(&event).unwrap();
        assert!(json.contains("TooLong"), "{json}");
        let unknown = json.replace("TooLong", "Mystery");
        assert!(serde_json::from_str::<Event>(&unknown).is_err());
    }

    #[test]
    fn hellos_from_another_protocol_model_page_size_kv_type_or_grouping_are_refused() {
        let model = ModelFingerprint {
            layers: 4,
            kv_heads: 2,
            head_dim: 16,
            vocab: 300,
            config: 7,
        };
        let hello = Hello {
            protocol: PROTOCOL,
            role: "decode".into(),
            model,
            page_size: 16,
            kv_dtype: "f16".into(),
            layer_groups: vec![vec![0, 1, 2, 3]],
            tokens: 1024,
            prefills: Vec::new(),
        };
        let layout = |page_size, elem, layer_groups| PageLayout {
            page_size,
            elem,
            layer_groups,
        };
        let ours = layout(16, ElemType::F16, vec![vec![0, 1, 2, 3]]);
        assert!(hello.check(model, Some(&ours)).is_ok());
        let pages = layout(32, ElemType::F16, ours.layer_groups.clone());
        assert!(hello.check(model, Some(&pages)).is_err());
        let elem = layout(16, ElemType::BF16, ours.layer_groups.clone());
        let why = hello.check(model, Some(&elem)).unwrap_err();
        assert!(why.contains("f16") && why.contains("bf16"), "{why}");
        // A decode worker that keeps only windows, a prefill worker that
        // keeps every position: pages of other layers.
        let windows = layout(16, ElemType::F16, vec![vec![1, 3], vec![0, 2]]);
        let why = hello.check(model, Some(&windows)).unwrap_err();
        assert!(why.contains("--kv-windows"), "{why}");
        let other = ModelFingerprint {
            vocab: 301,
            ..model
        };
        assert!(hello.check(other, None).is_err());
        let computes_otherwise = ModelFingerprint { config: 8, ..model };
        assert!(hello.check(computes_otherwise, None).is_err());
        let old = Hello {
            protocol: PROTOCOL - 1,
            ..hello
        };
        assert!(old.check(model, None).unwrap_err().contains("protocol"));
    }

    #[test]
    fn one_shape_computed_two_ways_is_two_fingerprints() {
        let llama = kvfence_model::Builtin::Tiny.config();
        let qwen = ModelConfig {
            architecture: kvfence_model::Architecture::Qwen3,
            ..llama.clone()
        };
        let other_base = ModelConfig {
            rope_theta: 500_000.0,
            ..llama.clone()
        };
        let of = ModelFingerprint::of_config;
        assert_eq!(of(&llama), of(&llama.clone()), "deterministic");
        assert_ne!(of(&llama), of(&qwen));
        assert_ne!(of(&llama), of(&other_base));
        assert_eq!(
            (of(&llama).layers, of(&llama).vocab),
            (of(&qwen).layers, of(&qwen).vocab)
        );
    }
}
