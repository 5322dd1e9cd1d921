//! What a client asks the engine for ([`GenerationRequest`]) and what it gets
//! back ([`Event`]s through a [`RequestHandle`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvfence_model::{
    Constraint, Grammar, Grammars, LoadedModel, PromptLogprob, SamplingParams, StopStrings,
    TokenLogprobs,
};
use kvfence_pool::RequestId;
use tokio::sync::mpsc;

use crate::trace_context::TraceContext;

/// One generation request, already tokenized. On a link (a router's
/// `Submit`, a decode worker's order) it is this type's own serde form: one
/// schema, whatever carries it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct GenerationRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Completion tokens at most.
    pub max_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Strings that end the completion (excluded from it).
    #[serde(default)]
    pub stop: StopStrings,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Whose prefix cache the request reads and adds to; `None` computes
    /// every token and caches nothing.
    #[serde(default)]
    pub cache: Option<CacheScope>,
    /// What the completion must match (structured outputs); every token is
    /// drawn from what the grammar allows next.
    #[serde(default)]
    pub constraint: Option<Constrained>,
    /// Whose share of the worker its work counts against (I11).
    #[serde(default)]
    pub share: Share,
    /// The span the request's work hangs under (the router's), if it is
    /// traced: each worker it reaches records its own spans beneath.
    #[serde(default)]
    pub trace: Option<TraceContext>,
}

/// What a request's output must match: its grammar and, where the front
/// door compiled it in this process, the compiled start state (its first
/// mask computed), so no worker compiles it again on the scheduler thread
/// every tenant shares — a large JSON schema takes seconds. A request that
/// crosses a link carries the grammar alone; the link's reader compiles it
/// ([`LinkGrammars`]) before the scheduler sees it.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
#[serde(from = "Grammar", into = "Grammar")]
pub struct Constrained {
    /// The grammar.
    pub grammar: Grammar,
    /// Its start state, never advanced: each use takes a copy.
    start: Option<Constraint>,
}

impl Constrained {
    /// `grammar`, compiled: `start` is its constraint in its start state.
    pub fn compiled(grammar: Grammar, start: Constraint) -> Constrained {
        Constrained {
            grammar,
            start: Some(start),
        }
    }

    /// A fresh copy of the compiled start state, if there is one.
    pub(crate) fn start(&self) -> Option<Constraint> {
        self.start.clone()
    }
}

/// Grammars compiled where a link's frames are read — a router's link into
/// a decode process, a decode worker's into a prefill worker — so the
/// scheduler behind the link, which every tenant's requests share, only
/// copies a compiled start state. A large schema then holds up that link's
/// next message, never the batch.
pub struct LinkGrammars {
    model: Arc<LoadedModel>,
    /// Built at the link's first grammar.
    grammars: Option<Grammars>,
}

impl LinkGrammars {
    /// Grammars for `model`'s tokenizer, none built yet.
    pub fn new(model: Arc<LoadedModel>) -> LinkGrammars {
        LinkGrammars {
            model,
            grammars: None,
        }
    }

    /// Compiles `constraint`'s grammar unless it already is. The sender
    /// compiled the same grammar for the same tokenizer before sending it;
    /// should this fail anyway, the reason is the runtime's, never the
    /// client's text (I10).
    pub fn compile(&mut self, constraint: Constrained) -> Result<Constrained, String> {
        if constraint.start.is_some() {
            return Ok(constraint);
        }
        let failed = |_| "the grammar does not compile on this worker".to_string();
        let grammars = match &mut self.grammars {
            Some(grammars) => grammars,
            empty => {
                let config = self.model.model.config();
                let built = Grammars::new(
                    &self.model.tokenizer,
                    config.vocab_size,
                    &config.eos_token_ids,
                )
                .map_err(failed)?;
                empty.insert(built)
            }
        };
        let start = grammars.compile(&constraint.grammar).map_err(failed)?;
        Ok(Constrained::compiled(constraint.grammar, start))
    }
}

impl From<Constrained> for Grammar {
    /// The grammar alone: a compiled start state never leaves its process.
    fn from(constrained: Constrained) -> Grammar {
        constrained.grammar
    }
}

impl From<Grammar> for Constrained {
    /// A grammar the worker compiles itself.
    fn from(grammar: Grammar) -> Constrained {
        Constrained {
            grammar,
            start: None,
        }
    }
}

impl std::fmt::Debug for Constrained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The grammar's kind and size only (I10).
        f.debug_struct("Constrained")
            .field("grammar", &self.grammar)
            .field("compiled", &self.start.is_some())
            .finish()
    }
}

/// Whose share of a worker a request's work counts against (I11): the
/// tenant the gateway authenticated — never a field the client sets — and
/// the weight the operator gave it. Workers split admission and every
/// step's compute between tenants with work in proportion to their
/// weights.
///
/// A request's priority, within what its tenant may use, picks its band:
/// a worker admits the highest band with work first, and shares within a
/// band by weight. Negative priorities are sheddable: under pressure such
/// work is refused first.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Share {
    /// The tenant's name (the empty name: work of no tenant, such as the
    /// engine's own start-up requests).
    pub tenant: String,
    weight: u32,
    #[serde(default)]
    priority: i32,
    /// The front door that sent it serves several tenants, so every
    /// worker it reaches is shared between them from this request on.
    #[serde(default)]
    shared: bool,
}

impl Share {
    /// The largest weight a tenant may have.
    pub const MAX_WEIGHT: u32 = 1_000_000;

    /// `tenant`'s share at `weight`, which is clamped to
    /// `1..=MAX_WEIGHT`.
    pub fn new(tenant: impl Into<String>, weight: u32) -> Share {
        Share {
            tenant: tenant.into(),
            weight: weight.clamp(1, Self::MAX_WEIGHT),
            priority: 0,
            shared: false,
        }
    }

    /// The same share, from a front door that serves several tenants
    /// (`shared`): a worker it reaches shares itself between tenants from
    /// the first such request — short steps and the pool cap (I11) — not
    /// only once a second tenant's work arrives.
    pub fn on_shared_workers(self, shared: bool) -> Share {
        Share { shared, ..self }
    }

    /// Whether the front door that sent it serves several tenants.
    pub fn shared(&self) -> bool {
        self.shared
    }

    /// The same share, for a request at `priority` (0 unless given).
    pub fn with_priority(self, priority: i32) -> Share {
        Share { priority, ..self }
    }

    /// The request's priority: higher bands are admitted first.
    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// Whether the request is sheddable work (a negative priority),
    /// refused first under pressure.
    pub fn sheddable(&self) -> bool {
        self.priority < 0
    }

    /// The tenant's weight, `1..=MAX_WEIGHT` (a peer's out-of-range value
    /// is clamped).
    pub fn weight(&self) -> u32 {
        self.weight.clamp(1, Self::MAX_WEIGHT)
    }
}

impl Default for Share {
    /// Work of no tenant, at weight 1.
    fn default() -> Share {
        Share::new("", 1)
    }
}

/// The wall a request's cached prefixes live behind (I9).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CacheScope {
    /// A tenant's own namespace (which also reads the public one).
    Tenant(TenantScope),
    /// The public namespace: prefixes the operator declared common to
    /// every tenant (`serve --public-system-prompt`), computed at start-up.
    /// Only the engine's own start-up submits it, and nothing a client
    /// sends reaches it: a decode worker refuses a router's request that
    /// names it.
    Public,
}

impl CacheScope {
    /// The scope of `tenant`'s requests, subdivided by `salt`.
    pub fn tenant(tenant: impl Into<String>, salt: Option<String>) -> CacheScope {
        CacheScope::Tenant(TenantScope {
            tenant: tenant.into(),
            salt,
        })
    }

    /// The tenant's scope, unless this is the public one.
    pub fn as_tenant(&self) -> Option<&TenantScope> {
        match self {
            CacheScope::Tenant(scope) => Some(scope),
            CacheScope::Public => None,
        }
    }
}

/// A tenant's namespace: the tenant the gateway authenticated — never a
/// field a client sets — and an optional salt the client chose, which only
/// subdivides that tenant's cache.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TenantScope {
    /// The authenticated tenant's name.
    pub tenant: String,
    /// The client's `cache_salt`, if it sent one.
    pub salt: Option<String>,
}

impl GenerationRequest {
    /// `prompt` continued greedily for at most `max_tokens` tokens: no stop
    /// strings, ending at end-of-sequence, no prefix cache, no grammar, of
    /// no tenant, untraced. Set what differs with struct update syntax.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
        GenerationRequest {
            prompt,
            max_tokens,
            sampling: kvfence_model::SamplingParams::greedy(),
            stop: StopStrings::default(),
            ignore_eos: false,
            cache: None,
            constraint: None,
            share: Share::default(),
            trace: None,
        }
    }

    /// Tokens of KV the request needs at most: its whole reservation
    /// (saturating: a `max_tokens` near `usize::MAX` from a peer is a need
    /// no pool meets, not an overflow).
    pub fn kv_tokens(&self) -> usize {
        self.prompt.len().saturating_add(self.max_tokens)
    }
}

/// Why a completion ended normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// End-of-sequence token, stop string, or a constraint's grammar
    /// complete.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens read from the tenant's own prefix cache rather than
    /// computed (never another tenant's: I9).
    #[serde(default)]
    pub cached_tokens: usize,
}

/// What kind of failure ended a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FailureKind {
    /// The engine or model failed; nothing computed from unverified KV was sent (I7).
    Internal,
    /// The request can never fit a worker's KV pool (I6).
    TooLong,
    /// A worker could not take the request now; retrying may succeed.
    Unavailable,
    /// The engine stopped before the request finished.
    ShuttingDown,
}

impl FailureKind {
    /// A short name for metrics and traces.
    pub fn label(self) -> &'static str {
        match self {
            FailureKind::Internal => "internal",
            FailureKind::TooLong => "too_long",
            FailureKind::Unavailable => "unavailable",
            FailureKind::ShuttingDown => "shutting_down",
        }
    }
}

/// One event of a request's life, in order. After `Finished` or `Failed`
/// nothing more comes. A decode worker relays each to its router in this
/// type's serde form.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Event {
    /// The prompt's scores, if the request asked (`prompt_logprobs`): one
    /// per prompt token after the first, in order, before any `Token`.
    Prompt {
        /// Each token's log-probability, rank and alternatives.
        logprobs: Vec<PromptLogprob>,
    },
    /// One token was generated; `text` is the newly printable text (possibly
    /// empty: an incomplete character, or text that may begin a stop string).
    Token {
        /// Text to append.
        text: String,
        /// The token's log-probabilities, if the request asked (none for
        /// the end-of-sequence token, which is not part of the text).
        #[serde(default)]
        logprobs: Option<TokenLogprobs>,
    },
    /// The completion ended normally.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The request ended with an error: the client must get an error, never
    /// a normal finish (I5, I7).
    Failed {
        /// What kind.
        kind: FailureKind,
        /// A message fit for the client (never prompt text).
        message: String,
    },
}

/// The client's end of a request. Dropping it cancels the request: its pages
/// are freed at the engine's next step (I8).
#[derive(Debug)]
pub struct RequestHandle {
    id: RequestId,
    events: mpsc::UnboundedReceiver<Event>,
    _cancel: CancelOnDrop,
}

#[derive(Debug)]
struct CancelOnDrop(Arc<AtomicBool>);

/// Cancels one request on demand; see [`RequestHandle::canceller`].
#[derive(Debug, Clone)]
pub struct Canceller(Arc<AtomicBool>);

impl Canceller {
    /// Cancels the request: its pages are freed at the engine's next step.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

impl RequestHandle {
    /// A handle over events that arrive from elsewhere — a router's client
    /// of a decode worker in another process relays them into `events` —
    /// whose `cancel` flag is set when the handle is dropped or cancelled.
    pub fn new(
        id: RequestId,
        events: mpsc::UnboundedReceiver<Event>,
        cancel: Arc<AtomicBool>,
    ) -> Self {
        RequestHandle {
            id,
            events,
            _cancel: CancelOnDrop(cancel),
        }
    }

    /// A handle that cancels this request from elsewhere (a remote peer's
    /// cancel message), as dropping the handle would.
    pub fn canceller(&self) -> Canceller {
        Canceller(Arc::clone(&self._cancel.0))
    }

    /// The engine's id for this request (for logs).
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next event, or `None` once the engine has dropped the request.
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// The next event if one is waiting (the simulator's client).
    #[cfg(test)]
    pub(crate) fn try_next(&mut self) -> Result<Event, mpsc::error::TryRecvError> {
        self.events.try_recv()
    }

    /// The next event, blocking the thread (outside async code only).
    pub fn blocking_next(&mut self) -> Option<Event> {
        self.events.blocking_recv()
    }
}
