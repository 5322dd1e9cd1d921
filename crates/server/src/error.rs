//! Errors of the server crate: [`ServerError`] for start-up and
//! configuration, [`ApiError`] for HTTP answers. The mapping from failure to
//! HTTP status (`docs/api.md`, "Errors") lives here and nowhere else.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvfence_engine::{EngineError, FailureKind};
use serde::Serialize;

/// Why the server could not be configured or started, or its response
/// store failed. Never holds request or stored text (I10).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The tenants file could not be read.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// The OS error: in the message, so not the error's `source` too.
        error: std::io::Error,
    },
    /// The tenants file is malformed.
    #[error("{path}: {reason}")]
    TenantsConfig {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A tenant `kvfence tenant add` was asked for that no server would
    /// admit.
    #[error("{reason}")]
    TenantRefused {
        /// The name asked for.
        name: String,
        /// Why a tenants file could not hold it, in the file check's words
        /// (which name the tenant).
        reason: String,
    },
    /// The configured context cannot be served by the real pools (I6).
    #[error(
        "--max-context {configured} exceeds what this server can hold: {limit} tokens ({why}); lower it or pass --clamp-context"
    )]
    ContextTooLarge {
        /// What the operator asked for.
        configured: usize,
        /// The real limit.
        limit: usize,
        /// Which limit binds.
        why: String,
    },
    /// A `--cors-origin` is not one a browser sends.
    #[error("--cors-origin {origin:?}: {reason}")]
    Cors {
        /// The origin given.
        origin: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Spans cannot be exported as asked (`--otlp-endpoint`).
    #[error("traces: {0}")]
    Traces(String),
    /// The stored-responses database could not be opened.
    #[error("the response store {path}: {reason} (--responses-store names another file, or off)")]
    ResponseStore {
        /// The database file.
        path: String,
        /// What failed.
        reason: String,
    },
    /// The response store's database failed. Its reason is in the
    /// message, so it is not the error's `source` too.
    #[error("the response store failed: {0}")]
    StoreDatabase(rusqlite::Error),
    /// The response store's PostgreSQL server failed, or could not be
    /// reached. The reason is its SQLSTATE code or the connection's
    /// error, never its message (which may quote a value).
    #[error("the response store's PostgreSQL server failed: {0}")]
    StorePostgres(String),
    /// The response store did not answer within its deadline.
    #[error("the response store did not answer within {} s", crate::stored::STORE_DEADLINE.as_secs())]
    StoreTimeout,
    /// A stored response could not be read back.
    #[error("a stored response is damaged")]
    StoredDamaged,
    /// What a tenant stores would be larger than it may store.
    #[error(
        "the tenant's stored responses and conversations would take {bytes} bytes, more than it may store ({limit})"
    )]
    StoredTooLarge {
        /// Its size.
        bytes: u64,
        /// The tenant's limit.
        limit: u64,
    },
    /// One stored response or conversation would be larger than one may be.
    #[error("a stored response or conversation may take at most {limit} bytes; this one {bytes}")]
    StoredRowTooLarge {
        /// Its size.
        bytes: u64,
        /// The most one may take.
        limit: u64,
    },
    /// Local mode (no tenants file) may only listen on loopback.
    #[error(
        "refusing to listen on {host} without --config: local mode serves one unauthenticated tenant and binds loopback only"
    )]
    PublicWithoutTenants {
        /// The host asked for.
        host: String,
    },
}

impl From<rusqlite::Error> for ServerError {
    fn from(error: rusqlite::Error) -> Self {
        ServerError::StoreDatabase(error)
    }
}

/// Kinds of error body, as OpenAI names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    /// 400: the request is wrong.
    InvalidRequestError,
    /// 401: no or bad API key.
    AuthenticationError,
    /// 404: unknown model.
    NotFoundError,
    /// 429: tenant limit or full queue.
    RateLimitError,
    /// 500: our fault.
    ServerError,
    /// 503: cannot serve now.
    ServiceUnavailable,
    /// 413: the body is larger than the server takes.
    #[serde(rename = "invalid_request_error")]
    TooLarge,
    /// 408: the body did not arrive in time.
    #[serde(rename = "invalid_request_error")]
    Timeout,
    /// 405: the path exists, the method does not.
    #[serde(rename = "invalid_request_error")]
    MethodNotAllowed,
    /// 415: the body is encoded in a way the server does not read.
    #[serde(rename = "invalid_request_error")]
    UnsupportedEncoding,
}

impl ErrorType {
    fn status(self) -> StatusCode {
        match self {
            ErrorType::InvalidRequestError => StatusCode::BAD_REQUEST,
            ErrorType::AuthenticationError => StatusCode::UNAUTHORIZED,
            ErrorType::NotFoundError => StatusCode::NOT_FOUND,
            ErrorType::RateLimitError => StatusCode::TOO_MANY_REQUESTS,
            ErrorType::ServerError => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorType::ServiceUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorType::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorType::Timeout => StatusCode::REQUEST_TIMEOUT,
            ErrorType::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorType::UnsupportedEncoding => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        }
    }
}

/// An HTTP error answer in OpenAI's envelope:
/// `{"error": {"message", "type", "param", "code"}}`. Messages never quote
/// prompt text (I10).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiError {
    /// Human-readable explanation.
    pub message: String,
    /// Error kind; decides the status.
    #[serde(rename = "type")]
    pub kind: ErrorType,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A stable machine-readable code.
    pub code: Option<String>,
    /// When a retry can succeed, where the server knows (a rate limit's
    /// refill); other 429s and 503s say [`RETRY_AFTER_SECONDS`].
    #[serde(skip)]
    pub retry_after: Option<std::time::Duration>,
}

impl ApiError {
    /// An error of `kind` with `message` and `code`.
    pub fn new(kind: ErrorType, code: &str, message: impl Into<String>) -> Self {
        ApiError {
            message: message.into(),
            kind,
            param: None,
            code: Some(code.to_string()),
            retry_after: None,
        }
    }

    /// The same error, telling the client a retry succeeds after `wait`.
    pub fn retry_after(self, wait: std::time::Duration) -> Self {
        ApiError {
            retry_after: Some(wait),
            ..self
        }
    }

    /// 400 about one parameter.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..Self::new(ErrorType::InvalidRequestError, "invalid_request", message)
        }
    }

    /// 400 `context_length_exceeded`, with both numbers (I6); `limit_field`
    /// is the field the request gave its completion limit in.
    pub fn context_length(
        param: &str,
        limit_field: &str,
        max_context: usize,
        prompt: usize,
        completion: usize,
    ) -> Self {
        ApiError {
            param: Some(param.into()),
            ..Self::new(
                ErrorType::InvalidRequestError,
                "context_length_exceeded",
                format!(
                    "This model's maximum context length is {max_context} tokens. However, you requested {} tokens ({prompt} in the prompt, {completion} for the completion). Please reduce the length of the prompt or {limit_field}.",
                    prompt + completion
                ),
            )
        }
    }

    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }

    /// The error envelope as JSON.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({ "error": self })
    }

    /// The reason label used in `kvfence_rejections_total`.
    pub fn reason(&self) -> &str {
        self.code.as_deref().unwrap_or("unknown")
    }
}

/// Seconds a client is told to wait before retrying a 429 or a 503: the
/// conditions behind them (a tenant's slots, a full queue, a busy or
/// unreachable worker) clear in about that time.
const RETRY_AFTER_SECONDS: u64 = 1;

impl IntoResponse for ApiError {
    /// The envelope, with `Retry-After` on the statuses a retry can cure
    /// (429, 503), as OpenAI's API and its clients' back-off expect.
    fn into_response(self) -> Response {
        let retry = matches!(
            self.status(),
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        );
        let mut response = (self.status(), Json(self.body())).into_response();
        if retry {
            // Whole seconds, rounded up: a client that waits that long
            // finds what it was missing.
            let seconds = self.retry_after.map_or(RETRY_AFTER_SECONDS, |wait| {
                wait.as_secs() + u64::from(wait.subsec_nanos() > 0)
            });
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(seconds.max(1)),
            );
        }
        response
    }
}

impl ApiError {
    /// The answer for a request the engine failed after admitting it: the
    /// same status for the same failure whichever deployment served it.
    pub fn from_failure(kind: FailureKind, message: String) -> ApiError {
        match kind {
            FailureKind::ShuttingDown => {
                ApiError::new(ErrorType::ServiceUnavailable, "shutting_down", message)
            }
            FailureKind::Unavailable => {
                ApiError::new(ErrorType::ServiceUnavailable, "worker_unavailable", message)
            }
            // A worker's own check refused what admission let through (I6, defence in depth).
            FailureKind::TooLong => ApiError::new(
                ErrorType::InvalidRequestError,
                "context_length_exceeded",
                message,
            ),
            _ => ApiError::new(ErrorType::ServerError, "internal_error", message),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> Self {
        match error {
            EngineError::QueueFull { .. } => {
                ApiError::new(ErrorType::RateLimitError, "queue_full", error.to_string())
            }
            EngineError::TooLong { .. } => ApiError::new(
                ErrorType::InvalidRequestError,
                "context_length_exceeded",
                error.to_string(),
            ),
            EngineError::Invalid { .. } => ApiError::new(
                ErrorType::InvalidRequestError,
                "invalid_request",
                error.to_string(),
            ),
            EngineError::Unavailable { .. } => ApiError::new(
                ErrorType::ServiceUnavailable,
                "worker_unavailable",
                error.to_string(),
            ),
            EngineError::ShuttingDown => ApiError::new(
                ErrorType::ServiceUnavailable,
                "shutting_down",
                error.to_string(),
            ),
            other => ApiError::new(ErrorType::ServerError, "internal_error", other.to_string()),
        }
    }
}

impl From<postgres::Error> for ServerError {
    fn from(error: postgres::Error) -> Self {
        ServerError::StorePostgres(match error.code() {
            Some(state) => format!("SQLSTATE {}", state.code()),
            None => error.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_failure_says_its_reason_once() {
        let err = ServerError::from(rusqlite::Error::InvalidQuery);
        let reason = rusqlite::Error::InvalidQuery.to_string();
        assert!(err.to_string().ends_with(&reason), "{err}");
        // Not again as its cause: anyhow's "Caused by" would repeat it.
        assert!(std::error::Error::source(&err).is_none(), "{err:?}");
    }

    #[test]
    fn busy_answers_say_when_to_retry_and_others_do_not() {
        let retry = |error: ApiError| {
            error
                .into_response()
                .headers()
                .get(axum::http::header::RETRY_AFTER)
                .map(|v| v.to_str().unwrap_or_default().to_string())
        };
        let busy = ApiError::new(ErrorType::RateLimitError, "queue_full", "full");
        assert_eq!(retry(busy).as_deref(), Some("1"));
        let down = ApiError::new(ErrorType::ServiceUnavailable, "worker_unavailable", "x");
        assert_eq!(retry(down).as_deref(), Some("1"));
        assert_eq!(retry(ApiError::invalid("n", "too many")), None);
    }

    /// The same failure gets the same status in one process and behind a
    /// router: a local engine's own internal error and a remote worker's
    /// internal refusal are both 500; "cannot serve now" is 503.
    #[test]
    fn one_failure_one_status_in_every_deployment() {
        let local = ApiError::from(EngineError::Model(kvfence_model::ModelError::Tokenizer {
            reason: "x".into(),
        }));
        let remote = ApiError::from(EngineError::Internal { reason: "x".into() });
        assert_eq!(local.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(remote.status(), local.status());
        assert_eq!(
            ApiError::from(EngineError::Unavailable { reason: "x".into() }).status(),
            ApiError::from_failure(FailureKind::Unavailable, "x".into()).status()
        );
        assert_eq!(
            ApiError::from_failure(FailureKind::Internal, "x".into()).status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
}
