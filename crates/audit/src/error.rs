//! The one error type of the audit crate. Errors describe what failed on
//! the wire; none carries prompt or completion text (I10).

/// Why a request to the audited server could not be made or completed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuditError {
    /// The connection failed.
    #[error("request failed: {0}")]
    Http(String),
    /// The server answered with an error status (its OpenAI error code, if any).
    #[error("server answered {status}: {code}")]
    Status {
        /// HTTP status.
        status: u16,
        /// `error.code` from the body, or the status text.
        code: String,
    },
    /// The stream carried an error event or ended without a finish reason.
    #[error("the stream ended without a normal finish: {0}")]
    Unfinished(String),
}

impl AuditError {
    pub(crate) fn http(e: reqwest::Error) -> AuditError {
        AuditError::Http(e.without_url().to_string())
    }
}
