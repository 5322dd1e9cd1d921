//! kvfence's HTTP front: the OpenAI-compatible API over an engine (local, or
//! a decode worker in another process),
//! with tenants (I9), honest admission (I6), Prometheus metrics, and
//! request text kept out of logs, metrics and errors (I10).

mod admission;
mod connections;
mod error;
mod logging;
mod metrics;
mod openai;
mod redact;
mod responses;
mod routes;
mod stored;
mod telemetry;
mod tenants;
mod text_work;
mod tools;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use kvfence_engine::{Backend, Status};
use kvfence_model::{Grammars, TextModel};
use tokio::net::TcpListener;

pub use admission::Capacity;
pub use connections::Ticket;
use connections::Watched;
pub use error::{ApiError, ErrorType, ServerError};
pub use logging::{LogGuard, init_logging};
pub use metrics::Metrics;
pub use openai::{CHAT_FIELDS, COMPLETION_FIELDS, FieldUse, SHARED_FIELDS};
pub use redact::Redacted;
pub use stored::{Conversation, ResponseStore, StoreLimits, Stored};
pub use telemetry::{OtlpProtocol, Traces};
pub use tenants::{Admission, Limits, Reload, Tenant, Tenants, new_key, new_tenant};

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    engine: Box<dyn Backend>,
    model: Arc<TextModel>,
    model_id: String,
    tenants: Arc<Tenants>,
    capacity: Capacity,
    metrics: Metrics,
    default_max_tokens: usize,
    limits: ConnectionLimits,
    metrics_on_api: bool,
    /// Name tenants on request spans.
    trace_tenant_names: bool,
    /// Template, tokenizer and grammar work at once, off the async
    /// runtime: bounded, so big prompts queue here instead of filling the
    /// blocking pool, and shared between tenants.
    text_work: text_work::TextWork,
    created: u64,
    /// Identifies this build and model in every answer (OpenAI's
    /// `system_fingerprint`): the same value means the same weights and code.
    system_fingerprint: String,
    /// Each token's bytes, for log-probabilities; built at first use.
    token_bytes: std::sync::OnceLock<Vec<Vec<u8>>>,
    /// Compiles `response_format` grammars; built at first use.
    grammars: std::sync::OnceLock<Result<Grammars, String>>,
    /// Origins a browser may call the API from (`--cors-origin`).
    cors: Cors,
    /// Where `store` keeps Responses answers; `None`: nothing is kept.
    responses: Option<stored::ResponseStore>,
}

/// Which browser origins may call the API (CORS). Off by default: a page
/// on another origin cannot read the answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Cors {
    /// No cross-origin access.
    #[default]
    Off,
    /// Any origin (`*`).
    AnyOrigin,
    /// Exactly these origins (`https://app.example.com`).
    Origins(Vec<String>),
}

impl Cors {
    /// The access `origins` allow (`--cors-origin`): none is off, `*` alone
    /// is any origin, else each must be an origin as a browser sends it
    /// (`scheme://host[:port]`, nothing after).
    pub fn from_origins(origins: &[String]) -> Result<Cors, ServerError> {
        if origins.is_empty() {
            return Ok(Cors::Off);
        }
        let refused = |origin: &str, reason: &str| ServerError::Cors {
            origin: origin.to_string(),
            reason: reason.to_string(),
        };
        if origins.iter().any(|o| o == "*") {
            if origins.len() > 1 {
                return Err(refused("*", "'*' allows every origin; give it alone"));
            }
            return Ok(Cors::AnyOrigin);
        }
        for origin in origins {
            let rest = origin
                .strip_prefix("https://")
                .or_else(|| origin.strip_prefix("http://"));
            let host_only = rest.is_some_and(|host| {
                !host.is_empty()
                    && host
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
            });
            if !host_only {
                return Err(refused(
                    origin,
                    "not an origin: give scheme://host[:port], as https://app.example.com, with no path",
                ));
            }
        }
        Ok(Cors::Origins(origins.to_vec()))
    }
}

/// How the API behaves, beyond the engine.
#[derive(Debug)]
pub struct ApiOptions {
    /// Who may call.
    pub tenants: Tenants,
    /// The id clients name in `model`.
    pub model_id: String,
    /// The context limits (see [`Capacity::compute`]).
    pub capacity: Capacity,
    /// `max_tokens` when a request gives none (lowered to what the tenant and the context allow).
    pub default_max_tokens: usize,
    /// What a connection may cost.
    pub limits: ConnectionLimits,
    /// Serve `/metrics` on the API's listener. Off when metrics have a
    /// listener of their own: in tenant mode, every tenant and every stranger
    /// can reach the API's.
    pub metrics_on_api: bool,
    /// Label request counters with tenant names (off: the label is empty, so
    /// a scrape does not list who the tenants are).
    pub tenant_labels: bool,
    /// Name the tenant on each request's span (off: traces do not say
    /// who the tenants are).
    pub trace_tenant_names: bool,
    /// Which browser origins may call the API.
    pub cors: Cors,
    /// Where the Responses API keeps answers (`store`); `None` keeps none,
    /// and a request that asks to store is refused.
    pub responses: Option<ResponseStore>,
}

impl AppState {
    /// Shared state over a running engine.
    pub fn new(
        engine: Box<dyn Backend>,
        model: Arc<TextModel>,
        options: ApiOptions,
    ) -> Arc<AppState> {
        let roles = engine.capacities();
        let system_fingerprint = {
            use sha2::Digest;
            let digest = sha2::Sha256::digest(format!(
                "kvfence {} {} {:?}",
                env!("CARGO_PKG_VERSION"),
                options.model_id,
                model.config
            ));
            format!(
                "fp_{:x}",
                u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
            )
        };
        Arc::new(AppState {
            metrics: Metrics::new(&options.capacity, &roles, options.tenant_labels),
            engine,
            model,
            model_id: options.model_id,
            tenants: Arc::new(options.tenants),
            capacity: options.capacity,
            default_max_tokens: options.default_max_tokens,
            limits: options.limits,
            metrics_on_api: options.metrics_on_api,
            trace_tenant_names: options.trace_tenant_names,
            text_work: text_work::TextWork::new(
                std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get),
            ),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            system_fingerprint,
            token_bytes: std::sync::OnceLock::new(),
            grammars: std::sync::OnceLock::new(),
            cors: options.cors,
            responses: options.responses,
        })
    }

    /// The bytes token `id` puts in the text it decodes to: nothing for a
    /// special token (decoding leaves them out) or an id past the
    /// vocabulary.
    fn text_bytes(&self, id: u32) -> &[u8] {
        let table = self
            .token_bytes
            .get_or_init(|| self.model.tokenizer.token_bytes());
        match table.get(id as usize).map(Vec::as_slice) {
            Some([0xFF, ..]) | None => &[],
            Some(bytes) => bytes,
        }
    }

    /// Token `id`'s bytes (a special token's name; nothing for an id past
    /// the tokenizer's vocabulary).
    fn token_bytes(&self, id: u32) -> &[u8] {
        let table = self
            .token_bytes
            .get_or_init(|| self.model.tokenizer.token_bytes());
        match table.get(id as usize).map(Vec::as_slice) {
            // Special tokens are marked for the grammar compiler; their
            // name is what a client sees.
            Some([0xFF, name @ ..]) => name,
            Some(bytes) => bytes,
            None => &[],
        }
    }

    /// The grammar compiler over this model's tokenizer.
    fn grammars(&self) -> Result<&Grammars, ApiError> {
        self.grammars
            .get_or_init(|| {
                Grammars::new(
                    &self.model.tokenizer,
                    self.model.config.vocab_size,
                    &self.model.config.eos_token_ids,
                )
                .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|reason| {
                ApiError::new(
                    ErrorType::ServerError,
                    "grammar_unavailable",
                    format!("structured outputs are unavailable for this model: {reason}"),
                )
            })
    }

    /// Who may call.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// The engine behind the API.
    pub fn engine(&self) -> &dyn Backend {
        self.engine.as_ref()
    }
}

/// The HTTP routes of the API. `/metrics` is among them only when the
/// metrics are not on a listener of their own ([`ApiOptions::metrics_on_api`]).
pub fn router(state: Arc<AppState>) -> Router {
    let mut routes = Router::new()
        .route("/health", get(routes::health))
        .route("/ready", get(routes::ready))
        .route("/v1/models", get(routes::models))
        .route("/v1/models/{id}", get(routes::model))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/responses", post(routes::responses))
        .route(
            "/v1/responses/{id}",
            get(routes::stored::retrieve).delete(routes::stored::delete),
        )
        .route(
            "/v1/responses/{id}/input_items",
            get(routes::stored::input_items),
        )
        .route("/v1/conversations", post(routes::conversations::create))
        .route(
            "/v1/conversations/{id}",
            get(routes::conversations::retrieve)
                .post(routes::conversations::update)
                .delete(routes::conversations::delete),
        )
        .route(
            "/v1/conversations/{id}/items",
            get(routes::conversations::list_items).post(routes::conversations::add_items),
        )
        .route(
            "/v1/conversations/{id}/items/{item_id}",
            get(routes::conversations::item).delete(routes::conversations::delete_item),
        );
    if state.metrics_on_api {
        routes = routes.route("/metrics", get(routes::metrics));
    }
    let cors = cors_layer(&state.cors);
    let routes = routes
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(axum::middleware::from_fn(routes::request_ids))
        .with_state(state);
    match cors {
        Some(layer) => routes.layer(layer),
        None => routes,
    }
}

/// The CORS layer for `cors`, if any origin may call: preflights are
/// answered before authentication (a browser sends them without the key),
/// and the answers name only the origin that asked.
fn cors_layer(cors: &Cors) -> Option<tower_http::cors::CorsLayer> {
    use axum::http::{HeaderValue, Method, header};
    use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};
    let origin = match cors {
        Cors::Off => return None,
        Cors::AnyOrigin => AllowOrigin::any(),
        Cors::Origins(list) => AllowOrigin::list(
            list.iter()
                .filter_map(|o| HeaderValue::from_str(o).ok())
                .collect::<Vec<_>>(),
        ),
    };
    Some(
        CorsLayer::new()
            .allow_origin(origin)
            .allow_methods([Method::GET, Method::POST, Method::DELETE, Method::OPTIONS])
            // What a browser's script may read of an answer beyond the
            // basics: the request's name and where its tenant stands.
            .expose_headers([
                header::HeaderName::from_static("x-request-id"),
                header::HeaderName::from_static("retry-after"),
                header::HeaderName::from_static("x-ratelimit-limit-requests"),
                header::HeaderName::from_static("x-ratelimit-remaining-requests"),
                header::HeaderName::from_static("x-ratelimit-reset-requests"),
                header::HeaderName::from_static("x-ratelimit-limit-tokens"),
                header::HeaderName::from_static("x-ratelimit-remaining-tokens"),
                header::HeaderName::from_static("x-ratelimit-reset-tokens"),
            ])
            // The OpenAI SDKs send a dozen headers of their own; the key
            // is still checked on the request itself.
            .allow_headers(AllowHeaders::mirror_request())
            .max_age(std::time::Duration::from_secs(600)),
    )
}

/// The routes of the metrics listener: `/metrics` (and `/health`,
/// `/ready`), for the operator's scraper and probes only. A worker process
/// (`kvfence prefill`, `kvfence decode`) serves these and nothing else.
pub fn metrics_router(state: Arc<AppState>) -> Router {
    status_router(state)
}

fn status_router<S: Observed>(state: Arc<S>) -> Router {
    Router::new()
        .route("/metrics", get(routes::metrics::<S>))
        .route("/health", get(routes::health))
        .route("/ready", get(routes::ready::<S>))
        .fallback(routes::not_found)
        .with_state(state)
}

/// Serves [`metrics_router`] on `listener` until the process ends, its
/// connections bounded as [`STATUS_LIMITS`] says.
pub async fn serve_metrics(listener: TcpListener, state: Arc<AppState>) {
    serve_status(listener, metrics_router(state)).await;
}

/// What a status listener's connections may cost. Its callers (a scraper,
/// the probes) hold no key, so every connection is a stranger; it sits on
/// `0.0.0.0` in the Kubernetes layout, as reachable as the API. Unbounded,
/// a stranger's idle sockets there took every descriptor of the process
/// and the API accepted no one (I11). A scrape or a probe speaks at once
/// and takes the place of a silent socket; silent ones are held five times
/// these caps at most, and closed at the header deadline.
pub const STATUS_LIMITS: ConnectionLimits = ConnectionLimits {
    max_connections: 0,
    max_strangers: 32,
    max_strangers_per_address: 8,
    header_timeout: Duration::from_secs(10),
    body_timeout: Duration::from_secs(10),
    // Its routes read no body.
    max_body_bytes: 0,
};

/// Serves `routes` as a status listener ([`STATUS_LIMITS`]) until the
/// process ends.
async fn serve_status(listener: TcpListener, routes: Router) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    accept(
        &listener,
        &routes,
        STATUS_LIMITS,
        &graceful,
        std::future::pending(),
    )
    .await;
}

/// What a status listener (`/metrics`, `/health`, `/ready`) reads: the
/// workers' status, and the metrics kept beside it.
pub(crate) trait Observed: Send + Sync + 'static {
    fn status(&self) -> &dyn Status;
    fn metrics(&self) -> &Metrics;
}

impl Observed for AppState {
    fn status(&self) -> &dyn Status {
        self.engine.as_ref()
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// A worker process's status listener: its pools, counters and readiness,
/// and the context its pools can hold — no API, so no tenants and no
/// request counters.
pub struct WorkerStatus {
    worker: Arc<dyn Status>,
    metrics: Metrics,
}

impl WorkerStatus {
    /// The status of `worker`, serving a model of `model_limit` positions.
    pub fn new(
        worker: Arc<dyn Status>,
        model_limit: usize,
    ) -> Result<Arc<WorkerStatus>, ServerError> {
        let roles = worker.capacities();
        let capacity = Capacity::compute(model_limit, &roles, None, true)?;
        Ok(Arc::new(WorkerStatus {
            metrics: Metrics::new(&capacity, &roles, false),
            worker,
        }))
    }
}

impl Observed for WorkerStatus {
    fn status(&self) -> &dyn Status {
        self.worker.as_ref()
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// Serves a worker's `/metrics`, `/health` and `/ready` on `listener`
/// until the process ends.
pub async fn serve_worker_status(listener: TcpListener, status: Arc<WorkerStatus>) {
    serve_status(listener, status_router(status)).await;
}

/// What one HTTP connection may cost before it has said who it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Authenticated connections open at once; past it a connection whose
    /// request authenticates is answered 503 and closed.
    pub max_connections: usize,
    /// Connections that have not authenticated yet, open at once; past it
    /// one that speaks takes the place of the oldest silent one, and silent
    /// ones are held (closed at the header deadline) up to five times this
    /// (I11; see `connections`).
    pub max_strangers: usize,
    /// Of those, from one address, likewise: one address's sockets never
    /// push out another's.
    pub max_strangers_per_address: usize,
    /// A request's headers must arrive within this (including the wait for
    /// the next request on a kept-alive connection).
    pub header_timeout: Duration,
    /// A request's whole body must arrive within this, once its headers
    /// were authenticated.
    pub body_timeout: Duration,
    /// Largest request body, in bytes (413 past it).
    pub max_body_bytes: usize,
}

impl ConnectionLimits {
    /// Sockets the front door may hold open at once: every known
    /// connection, and strangers with the silent ones held past their cap.
    pub fn sockets(&self) -> usize {
        self.max_connections + self.max_strangers * connections::HELD_SILENT
    }
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 1024,
            max_strangers: 256,
            max_strangers_per_address: 64,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_body_bytes: 2 << 20,
        }
    }
}

/// How often the tenants file is looked at for changes (SIGHUP reads it at
/// once).
const TENANTS_FILE_POLL: Duration = Duration::from_secs(2);

/// Serves until `shutdown` resolves, then stops accepting connections and
/// lets in-flight requests finish for up to `grace`; after that the engine
/// fails what is left, so every client still gets an answer (an error).
///
/// Connections are bounded ([`ConnectionLimits`]): at most
/// `max_strangers` that have not authenticated (the oldest closed past
/// that) and `max_connections` that have, and headers that do not arrive
/// within `header_timeout` close the connection, so a stranger holding
/// sockets open costs a bounded amount for a bounded time, and cannot keep
/// a tenant's new connection out. The tenants file stays in force while it
/// serves ([`Tenants::watch`]).
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let app = router(Arc::clone(&state));
    let tenants = tokio::spawn(Arc::clone(&state.tenants).watch(TENANTS_FILE_POLL));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    accept(&listener, &app, state.limits, &graceful, shutdown).await;
    drop(listener);
    tenants.abort();
    let drained = graceful.shutdown();
    tokio::pin!(drained);
    if tokio::time::timeout(grace, &mut drained).await.is_err() {
        tracing::warn!("shutdown grace period over; failing requests still in flight");
        state.engine.shutdown();
        // The failures reach their clients as errors; then the connections end.
        let _ = tokio::time::timeout(Duration::from_secs(5), drained).await;
    }
    Ok(())
}

/// Accepts connections on `listener` and serves `app` on each until
/// `shutdown` resolves, under `limits`: strangers bounded (past a cap the
/// oldest silent one is closed to make room; see `connections`), headers
/// due within the header deadline, each connection watched by `graceful`.
/// The accept loop itself never waits on a connection.
async fn accept(
    listener: &TcpListener,
    app: &Router,
    limits: ConnectionLimits,
    graceful: &hyper_util::server::graceful::GracefulShutdown,
    shutdown: impl Future<Output = ()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let connections = connections::Connections::new(
        limits.max_strangers,
        limits.max_strangers_per_address,
        limits.max_connections,
    );
    tokio::pin!(shutdown);
    for serial in 0u64.. {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, most likely: wait, do not spin.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        // Every request on the connection carries its ticket: the first
        // that authenticates makes the connection known.
        let ticket = Ticket::new(serial, Arc::clone(&connections));
        // A client's request has usually arrived by the time a busy loop
        // accepts its connection: it has spoken, and no idle socket's
        // arrival can close it before its task reads the request (I11).
        let mut first = [0u8; 1];
        if let Ok(Ok(1..)) = tokio::time::timeout(Duration::ZERO, tcp.peek(&mut first)).await {
            ticket.spoke();
        }
        let app = app.clone();
        let carried = ticket.clone();
        let service = hyper::service::service_fn(
            move |mut request: hyper::Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(carried.clone());
                tower_service::Service::call(&mut app.clone(), request)
            },
        );
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(Watched::new(tcp, ticket.clone())), service);
        let connection = graceful.watch(connection);
        let registry = Arc::clone(&connections);
        let task = tokio::spawn(async move {
            let _ = connection.await;
            registry.closed(serial);
        });
        if let Some(oldest) = connections.accepted(&ticket, peer.ip(), task.abort_handle()) {
            tracing::debug!(
                max = limits.max_strangers,
                "too many unauthenticated connections; closed the oldest"
            );
            oldest.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cors_origins_are_origins_or_star_alone() {
        let origins =
            |list: &[&str]| -> Vec<String> { list.iter().map(|o| o.to_string()).collect() };
        assert_eq!(Cors::from_origins(&[]).ok(), Some(Cors::Off));
        assert_eq!(
            Cors::from_origins(&origins(&["*"])).ok(),
            Some(Cors::AnyOrigin)
        );
        let two = origins(&["https://app.example.com", "http://[::1]:8080"]);
        assert_eq!(
            Cors::from_origins(&two).ok(),
            Some(Cors::Origins(two.clone()))
        );
        for bad in [
            &["*", "https://a.example"][..],
            &["app.example.com"],
            &["https://app.example.com/path"],
            &["ftp://app.example.com"],
            &["https://"],
        ] {
            let error = Cors::from_origins(&origins(bad)).unwrap_err().to_string();
            assert!(error.starts_with("--cors-origin"), "{bad:?}: {error}");
        }
    }
}
