//! [`EngineConfig`]: the scheduling limits every worker runs with.

/// Scheduling limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Requests decoding or prefilling at once.
    pub max_running: usize,
    /// Requests waiting for pages at most; more are refused (back-pressure).
    pub max_queue: usize,
    /// Tokens one forward pass may process (decode tokens plus prefill chunks).
    pub step_tokens: usize,
    /// How long a decode worker waits for a granted hand-off to commit
    /// before it aborts the grant and fails the request (503).
    pub handoff_timeout: std::time::Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running: 64,
            max_queue: 256,
            step_tokens: 256,
            handoff_timeout: std::time::Duration::from_secs(30),
        }
    }
}
