//! kvfence's HTTP front: the OpenAI-compatible API over an engine (local, or
//! a decode worker in another process),
//! with tenants (I9), honest admission (I6), Prometheus metrics, and
//! request text kept out of logs, metrics and errors (I10).

mod admission;
mod error;
mod metrics;
mod openai;
mod redact;
mod routes;
mod tenants;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use kvfence_engine::Backend;
use kvfence_model::LoadedModel;
use tokio::net::TcpListener;

pub use admission::Capacity;
pub use error::{ApiError, ErrorType, ServerError};
pub use metrics::Metrics;
pub use redact::Redacted;
pub use tenants::{Tenant, Tenants, new_tenant};

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    engine: Box<dyn Backend>,
    model: Arc<LoadedModel>,
    model_id: String,
    tenants: Tenants,
    capacity: Capacity,
    metrics: Metrics,
    default_max_tokens: usize,
    created: u64,
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
    /// `max_tokens` when a request gives none (lowered to what the context allows).
    pub default_max_tokens: usize,
}

impl AppState {
    /// Shared state over a running engine.
    pub fn new(
        engine: Box<dyn Backend>,
        model: Arc<LoadedModel>,
        options: ApiOptions,
    ) -> Arc<AppState> {
        let roles = engine.capacities();
        Arc::new(AppState {
            metrics: Metrics::new(&options.capacity, &roles),
            engine,
            model,
            model_id: options.model_id,
            tenants: options.tenants,
            capacity: options.capacity,
            default_max_tokens: options.default_max_tokens,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        })
    }

    /// The engine behind the API.
    pub fn engine(&self) -> &dyn Backend {
        self.engine.as_ref()
    }
}

/// The HTTP routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .route("/v1/models", get(routes::models))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/completions", post(routes::completions))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then stops accepting connections and
/// lets in-flight requests finish for up to `grace`; after that the engine
/// fails what is left, so every client still gets an answer (an error).
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let server =
        axum::serve(listener, router(Arc::clone(&state))).with_graceful_shutdown(async move {
            shutdown.await;
            let _ = stopping_tx.send(());
        });
    let enforcer = {
        let state = Arc::clone(&state);
        async move {
            if stopping_rx.await.is_ok() {
                tokio::time::sleep(grace).await;
                tracing::warn!("shutdown grace period over; failing requests still in flight");
                state.engine.shutdown();
            }
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        result = server.into_future() => result,
        () = enforcer => Ok(()),
    }
}
