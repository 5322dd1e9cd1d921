//! The load generator behind `kvfence bench`: a fixed number of streamed
//! completion requests at a fixed concurrency, timed token by token.
//!
//! Prompts are token-id arrays of exactly `prompt_len` ids (from the range
//! every tokenizer has), so the load is the same on every server; request
//! `i` of a run with seed `s` sends the same prompt every time, and no two
//! requests' prompts share more than a few first tokens; every
//! request asks for exactly `output_len` tokens (`ignore_eos`). Figures:
//! time to first token (TTFT), time per output token after the first (TPOT),
//! inter-token latency (ITL, between streamed chunks), throughput, and
//! goodput — requests per second that met both latency objectives.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use serde_json::json;

use crate::AuditError;
use crate::stream::{Timeline, timed_completion};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Server root, e.g. `http://127.0.0.1:8000`.
    pub base_url: String,
    /// API keys, used round-robin (one per tenant); empty for none.
    pub api_keys: Vec<String>,
    /// `model` to send, if the server needs one.
    pub model: Option<String>,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Requests in all.
    pub requests: usize,
    /// Prompt tokens per request.
    pub prompt_len: usize,
    /// Completion tokens per request.
    pub output_len: usize,
    /// Latency objective for TTFT (goodput).
    pub slo_ttft: Duration,
    /// Latency objective for TPOT (goodput).
    pub slo_tpot: Duration,
    /// Open a new connection for every request instead of reusing idle
    /// ones (for servers that close idle connections early).
    pub fresh_connections: bool,
    /// Which prompts: runs with the same seed send the same ones.
    pub seed: u64,
    /// A request fails when the server sends nothing for this long (before
    /// its response or between two pieces of the stream), rather than
    /// holding the run forever.
    pub idle_timeout: Duration,
}

/// Percentiles of one latency, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
}

impl Percentiles {
    fn of(mut values: Vec<f64>) -> Percentiles {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_by(f64::total_cmp);
        let at =
            |q: f64| values[((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
        Percentiles {
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            mean: values.iter().sum::<f64>() / values.len() as f64,
        }
    }
}

/// The results of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Requests sent.
    pub requests: usize,
    /// Requests that streamed to a normal finish.
    pub succeeded: usize,
    /// Failures by cause (HTTP status and code, or stream error).
    pub failures: BTreeMap<String, usize>,
    /// Requests sent a second time because the first try got no response
    /// at all (a pooled connection the server had closed): each is retried
    /// once, on a new connection, and counted once in the figures.
    pub retried: usize,
    /// Wall-clock seconds of the whole run.
    pub duration_s: f64,
    /// Successful requests per second.
    pub request_throughput: f64,
    /// Completion tokens per second.
    pub output_token_throughput: f64,
    /// Prompt and completion tokens per second.
    pub total_token_throughput: f64,
    /// Time to first token.
    pub ttft_ms: Percentiles,
    /// Time per output token after the first.
    pub tpot_ms: Percentiles,
    /// Inter-token latency (between streamed chunks).
    pub itl_ms: Percentiles,
    /// Successful requests per second that met both latency objectives.
    pub goodput: f64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Request `i`'s prompt under `seed`: `len` token ids in 32..122, which
/// every vocabulary has, from a ChaCha stream of the request's own. Two
/// requests share a first token with probability 1/90 and two with
/// 1/8,100, so no prompt cache serves one from another (an arithmetic
/// pattern over `i` repeated every 90th prompt). A shorter prompt is a
/// prefix of a longer one of the same request.
fn prompt(seed: u64, i: usize, len: usize) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(i as u64);
    (0..len).map(|_| rng.random_range(32..122)).collect()
}

/// An HTTP client that reuses idle connections, or (`fresh`) opens a new
/// one for every request, and gives up on a server silent for `idle`.
fn client(fresh: bool, idle: Duration) -> Result<reqwest::Client, reqwest::Error> {
    let builder = reqwest::Client::builder().read_timeout(idle);
    if fresh {
        builder.pool_max_idle_per_host(0)
    } else {
        builder
    }
    .build()
}

/// Runs the load and measures it.
pub async fn run(config: &BenchConfig) -> Report {
    // Retries get a client that keeps no idle connection: when the server
    // has closed one pooled connection without a word, the others it holds
    // are as likely closed, and a retry on one of them failed again.
    let idle = config.idle_timeout;
    let (client, fresh) = match (client(config.fresh_connections, idle), client(true, idle)) {
        (Ok(client), Ok(fresh)) => (client, fresh),
        (Err(error), _) | (_, Err(error)) => {
            let mut failures = BTreeMap::new();
            failures.insert(AuditError::http(error).to_string(), config.requests);
            return summarize(config, Vec::new(), failures, 0, Duration::ZERO);
        }
    };
    let retried = Arc::new(AtomicUsize::new(0));
    let url = format!("{}/v1/completions", config.base_url.trim_end_matches('/'));
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let workers = (0..config.concurrency.max(1)).map(|_| {
        let (client, fresh, url, next, config, retried) = (
            client.clone(),
            fresh.clone(),
            url.clone(),
            Arc::clone(&next),
            config.clone(),
            Arc::clone(&retried),
        );
        tokio::spawn(async move {
            let mut results = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= config.requests {
                    return results;
                }
                let mut body = json!({
                    "prompt": prompt(config.seed, i, config.prompt_len),
                    "max_tokens": config.output_len,
                    "temperature": 0,
                    "ignore_eos": true,
                });
                if let Some(model) = &config.model {
                    body["model"] = model.clone().into();
                }
                let key = (!config.api_keys.is_empty())
                    .then(|| config.api_keys[i % config.api_keys.len()].as_str());
                let result = match timed_completion(&client, &url, key, body.clone()).await {
                    Err(AuditError::NoResponse(_)) => {
                        retried.fetch_add(1, Ordering::Relaxed);
                        timed_completion(&fresh, &url, key, body).await
                    }
                    other => other,
                };
                results.push(result);
            }
        })
    });
    let mut timelines: Vec<Timeline> = Vec::new();
    let mut failures = BTreeMap::new();
    for worker in futures_util::future::join_all(workers).await {
        for result in worker.unwrap_or_default() {
            match result {
                Ok(timeline) => timelines.push(timeline),
                Err(error) => *failures.entry(error.to_string()).or_insert(0) += 1,
            }
        }
    }
    let retried = retried.load(Ordering::Relaxed);
    summarize(config, timelines, failures, retried, start.elapsed())
}

fn summarize(
    config: &BenchConfig,
    timelines: Vec<Timeline>,
    failures: BTreeMap<String, usize>,
    retried: usize,
    elapsed: Duration,
) -> Report {
    let seconds = elapsed.as_secs_f64().max(1e-9);
    let tpot = |t: &Timeline| {
        (t.completion_tokens > 1)
            .then(|| ms(t.total - t.first_token) / (t.completion_tokens - 1) as f64)
    };
    let output: usize = timelines.iter().map(|t| t.completion_tokens).sum();
    let prompt: usize = timelines
        .iter()
        .map(|t| t.prompt_tokens.unwrap_or(config.prompt_len))
        .sum();
    let good = timelines
        .iter()
        .filter(|t| {
            t.first_token <= config.slo_ttft && tpot(t).is_none_or(|v| v <= ms(config.slo_tpot))
        })
        .count();
    let gaps: Vec<f64> = timelines
        .iter()
        .flat_map(|t| t.chunks.windows(2).map(|w| ms(w[1] - w[0])))
        .collect();
    Report {
        requests: config.requests,
        succeeded: timelines.len(),
        failures,
        retried,
        duration_s: seconds,
        request_throughput: timelines.len() as f64 / seconds,
        output_token_throughput: output as f64 / seconds,
        total_token_throughput: (output + prompt) as f64 / seconds,
        ttft_ms: Percentiles::of(timelines.iter().map(|t| ms(t.first_token)).collect()),
        tpot_ms: Percentiles::of(timelines.iter().filter_map(tpot).collect()),
        itl_ms: Percentiles::of(gaps),
        goodput: good as f64 / seconds,
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "requests            {} sent, {} succeeded, {} failed",
            self.requests,
            self.succeeded,
            self.requests - self.succeeded
        )?;
        for (cause, n) in &self.failures {
            writeln!(f, "  {n} × {cause}")?;
        }
        if self.retried > 0 {
            writeln!(
                f,
                "retried             {} (no response on the first try)",
                self.retried
            )?;
        }
        writeln!(f, "duration            {:.2} s", self.duration_s)?;
        writeln!(
            f,
            "throughput          {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s",
            self.request_throughput, self.output_token_throughput, self.total_token_throughput
        )?;
        writeln!(
            f,
            "goodput             {:.2} req/s within the latency objectives",
            self.goodput
        )?;
        writeln!(
            f,
            "                    p50       p90       p99       mean   (ms)"
        )?;
        for (name, p) in [
            ("time to first token", self.ttft_ms),
            ("time per out token ", self.tpot_ms),
            ("inter-token latency", self.itl_ms),
        ] {
            writeln!(
                f,
                "{name} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
                p.p50, p.p90, p.p99, p.mean
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99, p.mean), (50.0, 90.0, 99.0, 50.5));
        assert_eq!(Percentiles::of(vec![]), Percentiles::default());
        assert_eq!(Percentiles::of(vec![7.0]).p99, 7.0);
    }

    #[test]
    fn prompts_are_exact_and_no_two_requests_share_more_than_a_few_first_tokens() {
        let shared = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let prompts: Vec<Vec<u32>> = (0..400).map(|i| prompt(0, i, 16)).collect();
        for (i, p) in prompts.iter().enumerate() {
            assert_eq!(p.len(), 16);
            assert!(p.iter().all(|t| (32..122).contains(t)), "{p:?}");
            for (j, q) in prompts.iter().enumerate().skip(i + 1) {
                assert!(shared(p, q) < 4, "requests {i} and {j} share a prefix");
            }
            // Another seed, other prompts; the same seed, the same ones.
            assert!(
                shared(p, &prompt(1, i, 16)) < 4,
                "seed 1 repeats request {i}"
            );
            assert_eq!(*p, prompt(0, i, 16));
            assert_eq!(prompt(0, i, 5), p[..5], "a shorter prompt is a prefix");
        }
    }

    #[test]
    fn goodput_counts_only_requests_within_both_objectives() {
        let config = BenchConfig {
            base_url: String::new(),
            api_keys: vec![],
            model: None,
            concurrency: 1,
            requests: 3,
            prompt_len: 4,
            output_len: 3,
            slo_ttft: Duration::from_millis(100),
            slo_tpot: Duration::from_millis(10),
            fresh_connections: false,
            seed: 0,
            idle_timeout: Duration::from_secs(1),
        };
        let timeline = |first: u64, total: u64| Timeline {
            first_token: Duration::from_millis(first),
            chunks: vec![Duration::from_millis(first), Duration::from_millis(total)],
            total: Duration::from_millis(total),
            completion_tokens: 3,
            prompt_tokens: Some(4),
        };
        // fast; slow first token; slow decode (tpot = 50 ms)
        let report = summarize(
            &config,
            vec![timeline(50, 60), timeline(200, 210), timeline(50, 150)],
            BTreeMap::new(),
            0,
            Duration::from_secs(1),
        );
        assert_eq!(report.goodput, 1.0);
        assert_eq!(report.succeeded, 3);
        assert_eq!(report.output_token_throughput, 9.0);
        assert_eq!(report.total_token_throughput, 21.0);
    }
}
