//! The one error type of the audit crate. Errors describe what failed on
//! the wire; none carries prompt or completion text (I10).

/// Why a request to the audited server could not be made or completed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuditError {
    /// The connection failed (the message carries the whole cause chain).
    #[error("request failed: {0}")]
    Http(String),
    /// The connection failed before any response arrived: the server may
    /// have closed a pooled connection as the request went out.
    #[error("request failed before a response: {0}")]
    NoResponse(String),
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
    /// The server sent nothing for longer than the client's idle timeout,
    /// before its response or between two pieces of it.
    #[error("the server sent nothing for longer than the idle timeout")]
    TimedOut,
}

impl AuditError {
    pub(crate) fn http(e: reqwest::Error) -> AuditError {
        if e.is_timeout() {
            return AuditError::TimedOut;
        }
        AuditError::Http(cause_chain(e))
    }

    /// A failure of sending: a timeout is a silent server, not a closed
    /// connection worth another try.
    pub(crate) fn no_response(e: reqwest::Error) -> AuditError {
        if e.is_timeout() {
            return AuditError::TimedOut;
        }
        AuditError::NoResponse(cause_chain(e))
    }
}

/// `error: its source: that one's source ...`, without the URL: "error
/// sending request" alone does not say whether the peer closed, refused or
/// timed out.
fn cause_chain(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        let part = cause.to_string();
        if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = cause.source();
    }
    text
}
