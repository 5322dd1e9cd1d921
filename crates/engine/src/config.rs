//! [`EngineConfig`]: the scheduling limits every worker runs with, and
//! its [`Role`].

/// Scheduling limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Requests decoding or prefilling at once.
    pub max_running: usize,
    /// Requests waiting for pages at most; more are refused (back-pressure).
    pub max_queue: usize,
    /// Tokens one forward pass may process (decode tokens plus prefill chunks).
    pub step_tokens: usize,
    /// Tokens one forward pass may process once the worker serves more than
    /// one tenant (I11): a short step bounds how long a newly arrived
    /// request waits for the step in flight and for its own.
    pub shared_step_tokens: usize,
    /// How long a decode worker waits without hearing from the prefill
    /// worker filling a grant — no chunk, no progress report — before it
    /// aborts the grant and fails the request (503). A prefill worker
    /// reports progress on every order it holds at least four times
    /// within its own value of this, so give every worker the same one.
    pub handoff_timeout: std::time::Duration,
    /// What a grant's whole life may take per prompt token, on top of
    /// `handoff_timeout`: a prefill worker that keeps reporting progress
    /// but never finishes still fails within
    /// [`EngineConfig::handoff_deadline`].
    pub handoff_time_per_token: std::time::Duration,
    /// How long a client's request may wait in the queue for pages or a
    /// slot before it is refused as unavailable (503), having cost nothing.
    pub max_queue_wait: std::time::Duration,
    /// The worker serves several tenants from its start (its server's
    /// tenants file names more than one), so what a shared worker does —
    /// short steps, the pool cap, prompts' last chunks ahead of other
    /// tenants' chunks — holds from the first request, not only once a
    /// second tenant has sent work: else the first tenant to arrive at a
    /// fresh worker could fill its pool before anyone else is known (I11).
    pub shared: bool,
}

impl EngineConfig {
    /// The most positions one step writes for one sequence: a decode row,
    /// or a prefill chunk of at most a step's tokens (at least 16, so a
    /// full decode batch never starves prefill). A pool whose windowed
    /// layers keep only their windows must leave room for it.
    pub fn longest_write(&self) -> usize {
        self.step_tokens.max(self.shared_step_tokens).max(16)
    }

    /// The longest a grant of `prompt_tokens` may stay uncommitted,
    /// however alive its prefill worker is: `handoff_timeout` plus
    /// `handoff_time_per_token` for every prompt token.
    pub fn handoff_deadline(&self, prompt_tokens: usize) -> std::time::Duration {
        let tokens = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
        self.handoff_timeout
            .saturating_add(self.handoff_time_per_token.saturating_mul(tokens))
    }

    /// How often a prefill worker reports progress on each order it holds:
    /// a quarter of the silence deadline, at most a second.
    pub fn progress_interval(&self) -> std::time::Duration {
        (self.handoff_timeout / 4).min(std::time::Duration::from_secs(1))
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running: 64,
            max_queue: 256,
            step_tokens: 256,
            shared_step_tokens: 64,
            handoff_timeout: std::time::Duration::from_secs(30),
            // 20 prompt tokens a second at least, queueing included: far
            // below what a busy CPU prefills.
            handoff_time_per_token: std::time::Duration::from_millis(50),
            max_queue_wait: std::time::Duration::from_secs(300),
            shared: false,
        }
    }
}

/// What a scheduler does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Prefill and decode on one worker.
    Colocated,
    /// Prefill only; KV goes to a decode worker.
    Prefill,
    /// Decode only; KV comes from a prefill worker.
    Decode,
}

impl Role {
    /// The role a label names (`colocated` for anything unknown).
    pub fn from_label(label: &str) -> Role {
        match label {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            _ => Role::Colocated,
        }
    }

    /// The label used in metrics.
    pub fn label(self) -> &'static str {
        match self {
            Role::Colocated => "colocated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}
