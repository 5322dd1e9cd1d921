//! What a tenant may spend, and what it has spent (I11): sequences at once,
//! requests per minute and tokens per minute.
//!
//! Rates are token buckets: a bucket holds at most one minute's allowance
//! and refills continuously, so a tenant may burst a minute's worth and
//! then goes at its rate. A request takes one request and, once its prompt
//! is tokenized, its prompt plus `max_tokens` for every choice, before any
//! engine work (I5); what it did not generate goes back when it ends. A
//! client that leaves early keeps its whole charge.
//!
//! What was spent lives in [`Spent`], shared by name across reloads of the
//! tenants file: a reload changes limits, never what a tenant holds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, HeaderValue};

use crate::error::{ApiError, ErrorType};

/// A tenant's limits, from the tenants file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Sequences at once (`n` choices of each prompt count apiece).
    pub max_concurrent: usize,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens: Option<usize>,
    /// Requests per minute.
    pub requests_per_minute: Option<u64>,
    /// Prompt plus completion tokens per minute.
    pub tokens_per_minute: Option<u64>,
    /// Highest priority its requests may ask for (negative: sheddable).
    pub max_priority: i32,
}

impl Limits {
    /// Local mode's: many requests, no rates.
    pub(crate) fn local() -> Limits {
        Limits {
            max_concurrent: 1024,
            max_tokens: None,
            requests_per_minute: None,
            tokens_per_minute: None,
            max_priority: 0,
        }
    }
}

/// What one tenant holds and has left, across reloads.
#[derive(Debug, Default)]
pub(crate) struct Spent {
    state: Mutex<Ledger>,
}

#[derive(Debug, Default)]
struct Ledger {
    sequences: usize,
    requests: Bucket,
    tokens: Bucket,
}

/// A token bucket whose size is its per-minute limit. A new bucket is
/// full; the limit is read at each use, so a reload that changes it takes
/// effect at once (a bucket never holds more than the current limit).
#[derive(Debug, Default)]
struct Bucket {
    /// Spent below the full bucket (so a fresh or unlimited one is full).
    deficit: f64,
    updated: Option<Instant>,
}

impl Bucket {
    fn refill(&mut self, per_minute: u64, now: Instant) {
        if let Some(then) = self.updated {
            let earned =
                now.saturating_duration_since(then).as_secs_f64() * per_minute as f64 / 60.0;
            self.deficit = (self.deficit - earned).max(0.0);
        }
        self.deficit = self.deficit.min(per_minute as f64);
        self.updated = Some(now);
    }

    fn level(&self, per_minute: u64) -> f64 {
        per_minute as f64 - self.deficit
    }

    /// How long until the bucket holds `amount`.
    fn wait_for(&self, per_minute: u64, amount: f64) -> Duration {
        let missing = (amount - self.level(per_minute)).max(0.0);
        Duration::from_secs_f64(missing * 60.0 / per_minute.max(1) as f64)
    }

    /// How long until the bucket is full again.
    fn until_full(&self, per_minute: u64) -> Duration {
        Duration::from_secs_f64(self.deficit * 60.0 / per_minute.max(1) as f64)
    }
}

impl Spent {
    fn lock(&self) -> MutexGuard<'_, Ledger> {
        // The ledger holds counts only; one a panicking thread left half
        // updated is still the best count there is.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sequences running now.
    pub(crate) fn sequences(&self) -> usize {
        self.lock().sequences
    }
}

/// What an admitted request holds: its sequences and the tokens charged
/// for it. Dropping it gives the sequences back.
#[derive(Debug)]
pub struct Admission {
    spent: Arc<Spent>,
    sequences: usize,
    /// Tokens charged and not yet settled.
    tokens: AtomicU64,
    tokens_per_minute: Option<u64>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut ledger = self.spent.lock();
        debug_assert!(
            ledger.sequences >= self.sequences,
            "sequences held were counted"
        );
        ledger.sequences -= self.sequences;
    }
}

impl Admission {
    /// The request ended having used `used` tokens (prompt and
    /// completion): what it was charged beyond that goes back.
    /// Settles once: the charge is gone after.
    pub fn settle(&self, used: u64) {
        let unused = self.tokens.swap(0, Ordering::Relaxed).saturating_sub(used);
        if let (Some(per_minute), true) = (self.tokens_per_minute, unused > 0) {
            let mut ledger = self.spent.lock();
            ledger.tokens.refill(per_minute, Instant::now());
            ledger.tokens.deficit = (ledger.tokens.deficit - unused as f64).max(0.0);
        }
    }
}

/// A 429 that says when a retry can succeed.
fn rate_limited(code: &str, message: String, wait: Duration) -> ApiError {
    ApiError::new(ErrorType::RateLimitError, code, message).retry_after(wait)
}

/// Admission of one request of tenant `name` against its `limits`.
pub(crate) struct Gate<'a> {
    pub(crate) name: &'a str,
    pub(crate) limits: &'a Limits,
    pub(crate) spent: &'a Arc<Spent>,
}

impl Gate<'_> {
    /// One sequence and one request, taken before a request's body is
    /// read; 429 if the tenant is at its concurrency, its request rate, or
    /// has no tokens left this minute.
    pub(crate) fn admit(&self, now: Instant) -> Result<Admission, ApiError> {
        let mut ledger = self.spent.lock();
        if ledger.sequences >= self.limits.max_concurrent {
            return Err(self.at_concurrency());
        }
        if let Some(rpm) = self.limits.requests_per_minute {
            ledger.requests.refill(rpm, now);
            if ledger.requests.level(rpm) < 1.0 {
                return Err(rate_limited(
                    "rate_limit_exceeded",
                    format!(
                        "tenant {} has used its {rpm} requests per minute",
                        self.name
                    ),
                    ledger.requests.wait_for(rpm, 1.0),
                ));
            }
        }
        if let Some(tpm) = self.limits.tokens_per_minute {
            ledger.tokens.refill(tpm, now);
            if ledger.tokens.level(tpm) < 1.0 {
                return Err(rate_limited(
                    "rate_limit_exceeded",
                    format!("tenant {} has used its {tpm} tokens per minute", self.name),
                    ledger.tokens.wait_for(tpm, 1.0),
                ));
            }
        }
        if self.limits.requests_per_minute.is_some() {
            ledger.requests.deficit += 1.0;
        }
        ledger.sequences += 1;
        Ok(Admission {
            spent: Arc::clone(self.spent),
            sequences: 1,
            tokens: AtomicU64::new(0),
            tokens_per_minute: self.limits.tokens_per_minute,
        })
    }

    /// Grows `admission` (one sequence, from [`Gate::admit`]) to
    /// `sequences`: 400 if the limit can never hold that many, 429 if it
    /// cannot now.
    pub(crate) fn admit_sequences(
        &self,
        admission: &mut Admission,
        sequences: usize,
    ) -> Result<(), ApiError> {
        debug_assert_eq!(admission.sequences, 1, "a request's first sequence");
        if sequences > self.limits.max_concurrent {
            return Err(ApiError::invalid(
                "n",
                format!(
                    "the request runs {sequences} sequences (n choices of each prompt); this tenant may run {} at once",
                    self.limits.max_concurrent
                ),
            ));
        }
        let more = sequences.saturating_sub(1);
        let mut ledger = self.spent.lock();
        if ledger.sequences + more > self.limits.max_concurrent {
            return Err(self.at_concurrency());
        }
        ledger.sequences += more;
        admission.sequences += more;
        Ok(())
    }

    /// Charges `tokens` (the prompts, and `max_tokens` for every choice)
    /// to the tenant's tokens per minute: 400 naming `max_tokens` if a
    /// minute's allowance can never hold them, 429 if it cannot now.
    pub(crate) fn charge(
        &self,
        admission: &mut Admission,
        tokens: u64,
        now: Instant,
    ) -> Result<(), ApiError> {
        let Some(tpm) = self.limits.tokens_per_minute else {
            return Ok(());
        };
        if tokens > tpm {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "the request may use {tokens} tokens (its prompts, and max_tokens for each choice); this tenant may use {tpm} per minute"
                ),
            ));
        }
        let mut ledger = self.spent.lock();
        ledger.tokens.refill(tpm, now);
        let wanted = tokens as f64;
        if ledger.tokens.level(tpm) < wanted {
            return Err(rate_limited(
                "rate_limit_exceeded",
                format!(
                    "the request may use {tokens} tokens; tenant {} has {:.0} of its {tpm} tokens per minute left",
                    self.name,
                    ledger.tokens.level(tpm).max(0.0)
                ),
                ledger.tokens.wait_for(tpm, wanted),
            ));
        }
        ledger.tokens.deficit += wanted;
        admission.tokens.fetch_add(tokens, Ordering::Relaxed);
        Ok(())
    }

    fn at_concurrency(&self) -> ApiError {
        ApiError::new(
            ErrorType::RateLimitError,
            "tenant_concurrency_limit",
            format!(
                "tenant {} already runs {} sequences, its limit",
                self.name, self.limits.max_concurrent
            ),
        )
    }

    /// OpenAI's `x-ratelimit-*` headers for the rates this tenant has:
    /// limit, what is left now, and how long until the bucket is full.
    pub(crate) fn rate_headers(&self, headers: &mut HeaderMap, now: Instant) {
        let mut ledger = self.spent.lock();
        let rates = [
            ("requests", self.limits.requests_per_minute),
            ("tokens", self.limits.tokens_per_minute),
        ];
        for (what, limit) in rates {
            let Some(per_minute) = limit else { continue };
            let bucket = match what {
                "requests" => &mut ledger.requests,
                _ => &mut ledger.tokens,
            };
            bucket.refill(per_minute, now);
            let remaining = bucket.level(per_minute).max(0.0).floor() as u64;
            let reset = go_duration(bucket.until_full(per_minute));
            for (field, value) in [
                ("limit", per_minute.to_string()),
                ("remaining", remaining.to_string()),
                ("reset", reset),
            ] {
                let name = format!("x-ratelimit-{field}-{what}");
                if let (Ok(name), Ok(value)) =
                    (HeaderName::try_from(name), HeaderValue::try_from(value))
                {
                    headers.insert(name, value);
                }
            }
        }
    }
}

/// A duration as OpenAI's `x-ratelimit-reset-*` headers write it (Go's
/// style): `250ms`, `1s`, `6m0s`, `1.5s`.
fn go_duration(duration: Duration) -> String {
    let ms = duration.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (minutes, ms) = (ms / 60_000, ms % 60_000);
    let seconds = if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        let text = format!("{:.3}", ms as f64 / 1000.0);
        format!("{}s", text.trim_end_matches('0'))
    };
    if minutes > 0 {
        format!("{minutes}m{seconds}")
    } else {
        seconds
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn limits(rpm: Option<u64>, tpm: Option<u64>) -> Limits {
        Limits {
            max_concurrent: 100,
            max_tokens: None,
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
            max_priority: 0,
        }
    }

    #[test]
    fn reset_times_read_as_openai_writes_them() {
        assert_eq!(go_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(go_duration(Duration::from_secs(1)), "1s");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(go_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(go_duration(Duration::from_millis(61_250)), "1m1.25s");
    }

    #[test]
    fn a_request_rate_bursts_a_minute_then_refills_at_its_rate() {
        let (limits, spent) = (limits(Some(60), None), Arc::new(Spent::default()));
        let gate = Gate {
            name: "a",
            limits: &limits,
            spent: &spent,
        };
        let t0 = Instant::now();
        for _ in 0..60 {
            drop(gate.admit(t0).unwrap());
        }
        let refused = gate.admit(t0).unwrap_err();
        assert_eq!(refused.status(), 429);
        assert_eq!(refused.retry_after, Some(Duration::from_secs(1)));
        // One a second comes back.
        assert!(gate.admit(t0 + Duration::from_millis(500)).is_err());
        assert!(gate.admit(t0 + Duration::from_secs(1)).is_ok());
        assert!(gate.admit(t0 + Duration::from_secs(1)).is_err());
    }

    #[test]
    fn tokens_are_charged_before_work_and_unused_ones_come_back() {
        let (limits, spent) = (limits(None, Some(1000)), Arc::new(Spent::default()));
        let gate = Gate {
            name: "a",
            limits: &limits,
            spent: &spent,
        };
        let t0 = Instant::now();
        let mut first = gate.admit(t0).unwrap();
        gate.charge(&mut first, 800, t0).unwrap();
        let mut second = gate.admit(t0).unwrap();
        let refused = gate.charge(&mut second, 300, t0).unwrap_err();
        assert_eq!(refused.status(), 429);
        // 100 missing at 1000 a minute: six seconds.
        assert_eq!(refused.retry_after, Some(Duration::from_secs(6)));
        // The first used 500 of its 800: 300 come back, the second fits.
        first.settle(500);
        first.settle(0);
        gate.charge(&mut second, 300, t0).unwrap();
        assert!(
            gate.charge(&mut second, 201, t0).is_err(),
            "a request settles once: the second settle gave nothing back"
        );
        // More than a minute's allowance can never pass: 400, not 429.
        let mut third = gate.admit(t0 + Duration::from_secs(60)).unwrap();
        let never = gate.charge(&mut third, 1001, t0).unwrap_err();
        assert_eq!(
            (never.status().as_u16(), never.param.as_deref()),
            (400, Some("max_tokens"))
        );
    }

    #[test]
    fn headers_report_limits_what_is_left_and_when_it_is_full() {
        let (limits, spent) = (limits(Some(10), Some(600)), Arc::new(Spent::default()));
        let gate = Gate {
            name: "a",
            limits: &limits,
            spent: &spent,
        };
        let t0 = Instant::now();
        let mut admission = gate.admit(t0).unwrap();
        gate.charge(&mut admission, 100, t0).unwrap();
        let mut headers = HeaderMap::new();
        gate.rate_headers(&mut headers, t0);
        let get = |name: &str| headers[name].to_str().unwrap().to_string();
        assert_eq!(get("x-ratelimit-limit-requests"), "10");
        assert_eq!(get("x-ratelimit-remaining-requests"), "9");
        assert_eq!(get("x-ratelimit-reset-requests"), "6s");
        assert_eq!(get("x-ratelimit-limit-tokens"), "600");
        assert_eq!(get("x-ratelimit-remaining-tokens"), "500");
        assert_eq!(get("x-ratelimit-reset-tokens"), "10s");
        let unlimited = Limits::local();
        let gate = Gate {
            name: "b",
            limits: &unlimited,
            spent: &spent,
        };
        let mut none = HeaderMap::new();
        gate.rate_headers(&mut none, t0);
        assert!(none.is_empty(), "no rate, no headers");
    }

    #[test]
    fn a_refused_request_spends_nothing() {
        let (mut limits, spent) = (limits(Some(2), Some(100)), Arc::new(Spent::default()));
        limits.max_concurrent = 1;
        let gate = Gate {
            name: "a",
            limits: &limits,
            spent: &spent,
        };
        let t0 = Instant::now();
        let held = gate.admit(t0).unwrap();
        // At its concurrency: the request rate is not touched.
        assert_eq!(
            gate.admit(t0).unwrap_err().code.as_deref(),
            Some("tenant_concurrency_limit")
        );
        drop(held);
        assert_eq!(spent.sequences(), 0);
        drop(gate.admit(t0).unwrap());
        assert_eq!(
            gate.admit(t0).unwrap_err().code.as_deref(),
            Some("rate_limit_exceeded")
        );
    }
}
