//! The isolation auditor behind `kvfence audit`: black-box checks of an
//! OpenAI-compatible endpoint that a monitor watching for `200` cannot make.
//!
//! 1. **Capacity honesty** — the advertised context (from `/v1/models`, or
//!    given) against the longest prompt actually accepted, found by binary
//!    search with one output token.
//! 2. **Boundaries** — a request exactly at the limit is served; one token
//!    over gets a 4xx in OpenAI's error shape, never a 200.
//! 3. **Determinism under load** — greedy answers to probe prompts under
//!    concurrent load from every tenant equal the same prompts sent alone.
//! 4. **Canary isolation** — each tenant's prompts carry unique random
//!    markers; none appears in another tenant's answers or in `/metrics`.
//! 5. **Abort storms** — streams cancelled at random points while probes
//!    run; afterwards the probes still answer as they did alone.
//! 6. **Fail-closed** — over the whole run, every failure came with an
//!    error status, and every `200` carried a normal finish.
//! 7. **Prefix-cache walls** — with two tenants: tenant B's latency on a
//!    long prefix tenant A has just sent is indistinguishable from B's
//!    latency on a fresh prefix of the same length (ratio of medians and a
//!    one-sided Mann–Whitney test), B is never told of more cached tokens
//!    there than chance agreement with its own earlier prompts explains,
//!    and A's own repeat is clearly faster (so the cache is on and the test
//!    means something).
//!
//! Prompts for capacity and determinism are token ids (exact lengths on
//! any server); answers are compared, never logged or stored in reports.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use rand::Rng;
use serde::Serialize;
use serde_json::{Value, json};

use crate::AuditError;

/// What to audit and how hard.
#[derive(Debug, Clone)]
pub struct AuditConfig {
    /// Server root, e.g. `http://127.0.0.1:8000`.
    pub base_url: String,
    /// One API key per tenant (none: one anonymous tenant).
    pub api_keys: Vec<String>,
    /// Model id to send, if the server needs one.
    pub model: Option<String>,
    /// The context to hold the server to when `/v1/models` does not say.
    pub context: Option<usize>,
    /// Upper bound on the whole run; checks that would overrun are skipped.
    pub budget: Duration,
    /// Whether the server claims batch-invariant greedy decoding. If not,
    /// check 3 and 5 report a divergence rate instead of failing.
    pub batch_invariant: bool,
    /// Requests in flight during the load phases.
    pub concurrency: usize,
    /// Where the server's Prometheus metrics are, when not at
    /// `BASE/metrics` (kvfence in tenant mode serves them on a listener of
    /// their own).
    pub metrics_url: Option<String>,
}

/// A check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The server behaved.
    Pass,
    /// The server did something a check forbids.
    Fail,
    /// Measured and reported, not judged (a server declared not batch-invariant).
    Report,
    /// Not run (out of budget, or nothing to check against).
    Skipped,
    /// Started but could not be finished (a request failed or timed out):
    /// neither a pass nor a failure; the figures say why.
    Inconclusive,
}

/// One check's verdict and figures.
#[derive(Debug, Clone, Serialize)]
pub struct CheckResult {
    /// Short name, as in the table.
    pub check: &'static str,
    /// The verdict.
    pub verdict: Verdict,
    /// The numbers behind it, as a one-line summary.
    pub figures: String,
}

/// The whole audit.
#[derive(Debug, Clone, Serialize)]
pub struct AuditReport {
    /// The server audited.
    pub base_url: String,
    /// One result per check, in order.
    pub checks: Vec<CheckResult>,
    /// Wall time of the run.
    pub seconds: f64,
}

impl AuditReport {
    /// Whether any check failed.
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.verdict == Verdict::Fail)
    }

    /// The human table.
    pub fn table(&self) -> String {
        let mut out = format!("{:<24} {:<8} figures\n", "check", "verdict");
        for c in &self.checks {
            let verdict = format!("{:?}", c.verdict).to_lowercase();
            out.push_str(&format!("{:<24} {:<8} {}\n", c.check, verdict, c.figures));
        }
        out
    }
}

/// How one response looked, kept for the fail-closed check (no text).
#[derive(Debug, Clone, Copy)]
struct Seen {
    status: u16,
    /// For a 200: a normal finish; otherwise: an OpenAI-shaped error body.
    well_formed: bool,
}

/// The HTTP side of the audit: every response goes through here and is
/// classified for check 6.
struct Client {
    http: reqwest::Client,
    config: AuditConfig,
    seen: Mutex<Vec<Seen>>,
    /// The end of the budget: no request outlives it.
    deadline: Instant,
}

/// A completion's outcome: status and, for a 200, the text.
struct Answer {
    status: u16,
    text: Option<String>,
    /// `usage.prompt_tokens_details.cached_tokens`, where the server says.
    cached: Option<u64>,
}

fn error_shaped(body: &Value) -> bool {
    body["error"]["message"].is_string()
}

fn normal_finish(body: &Value) -> bool {
    matches!(
        body["choices"][0]["finish_reason"].as_str(),
        Some("stop" | "length")
    )
}

impl Client {
    fn key(&self, tenant: usize) -> Option<&str> {
        let keys = &self.config.api_keys;
        (!keys.is_empty()).then(|| keys[tenant % keys.len()].as_str())
    }

    fn tenants(&self) -> usize {
        self.config.api_keys.len().max(1)
    }

    fn record(&self, seen: Seen) {
        self.seen
            .lock()
            .expect("the record lock is never held across a panic")
            .push(seen);
    }

    fn body(&self, prompt: Value, max_tokens: usize, seed: u64) -> Value {
        let mut body = json!({
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": seed,
        });
        if let Some(model) = &self.config.model {
            body["model"] = json!(model);
        }
        body
    }

    async fn complete(&self, tenant: usize, body: &Value) -> Result<Answer, AuditError> {
        let url = format!("{}/v1/completions", self.config.base_url);
        let left = self.deadline.saturating_duration_since(Instant::now());
        let mut request = self
            .http
            .post(&url)
            .json(body)
            .timeout(left.max(Duration::from_secs(1)));
        if let Some(key) = self.key(tenant) {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.map_err(AuditError::http)?;
        let status = response.status().as_u16();
        let value: Value = response.json().await.unwrap_or(Value::Null);
        let well_formed = if status == 200 {
            normal_finish(&value)
        } else {
            error_shaped(&value)
        };
        self.record(Seen {
            status,
            well_formed,
        });
        let text = (status == 200)
            .then(|| value["choices"][0]["text"].as_str().map(str::to_string))
            .flatten();
        let cached = value["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        Ok(Answer {
            status,
            text,
            cached,
        })
    }

    /// A streamed completion cancelled after `keep` chunks (dropping the
    /// connection, as a client that goes away does).
    async fn cancelled_stream(&self, tenant: usize, mut body: Value, keep: usize) {
        body["stream"] = json!(true);
        let url = format!("{}/v1/completions", self.config.base_url);
        let mut request = self.http.post(&url).json(&body);
        if let Some(key) = self.key(tenant) {
            request = request.bearer_auth(key);
        }
        let Ok(response) = request.send().await else {
            return;
        };
        let mut bytes = response.bytes_stream();
        for _ in 0..keep {
            if bytes.next().await.is_none() {
                break;
            }
        }
        // Dropping `bytes` closes the connection mid-stream.
    }

    /// The context the server advertises for the audited model.
    async fn advertised_context(&self) -> Option<usize> {
        let url = format!("{}/v1/models", self.config.base_url);
        let mut request = self.http.get(&url);
        if let Some(key) = self.key(0) {
            request = request.bearer_auth(key);
        }
        let models: Value = request.send().await.ok()?.json().await.ok()?;
        let list = models["data"].as_array()?;
        let entry = match &self.config.model {
            Some(id) => list.iter().find(|m| m["id"] == json!(id))?,
            None => list.first()?,
        };
        advertised_in(entry)
    }
}

/// The context a `/v1/models` entry advertises, under the names the common
/// servers use: vLLM and SGLang `max_model_len`, llama.cpp's server
/// `meta.n_ctx` (its per-slot context), others `context_length` or
/// `context_window`.
fn advertised_in(entry: &Value) -> Option<usize> {
    ["max_model_len", "context_length", "context_window"]
        .iter()
        .find_map(|field| entry[*field].as_u64())
        .or_else(|| entry["meta"]["n_ctx"].as_u64())
        .map(|n| n as usize)
}

/// A check that could not finish: reported, and the audit goes on.
fn inconclusive(check: &'static str, error: &AuditError) -> CheckResult {
    CheckResult {
        check,
        verdict: Verdict::Inconclusive,
        figures: format!("could not finish: {error}"),
    }
}

/// `len` token ids that every vocabulary has, varied by `seed`.
fn token_prompt(len: usize, seed: u64) -> Value {
    json!(token_ids(len, seed))
}

/// `len` token ids in 10..100, a sequence of its own for every `seed`:
/// prompts made from different seeds share no prefix beyond chance (the
/// prefix-cache check relies on it — a tenant's "fresh" prompt that
/// repeated one of its own earlier prompts would be a legitimate hit the
/// check counts against the server).
fn token_ids(len: usize, seed: u64) -> Vec<u64> {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(10..100)).collect()
}

/// Runs every check within the budget. `progress` hears one line per step.
pub async fn run(
    config: AuditConfig,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<AuditReport, AuditError> {
    let started = Instant::now();
    let deadline = started + config.budget;
    let client = Client {
        http: reqwest::Client::builder()
            .timeout(config.budget)
            .build()
            .map_err(AuditError::http)?,
        config: config.clone(),
        seen: Mutex::new(Vec::new()),
        deadline,
    };
    let mut checks = Vec::new();

    // A check that cannot finish (a request that fails or outlives the
    // budget) is reported as inconclusive and the audit goes on: the table
    // and the report always come out.
    progress("[1/7] capacity honesty: searching for the longest accepted prompt");
    let advertised = match client.advertised_context().await {
        Some(n) => Some(n),
        None => config.context,
    };
    let limit = match capacity_check(&client, advertised, deadline).await {
        Ok((capacity, limit)) => {
            checks.push(capacity);
            limit
        }
        Err(error) => {
            checks.push(inconclusive("capacity honesty", &error));
            advertised
        }
    };

    progress("[2/7] boundaries: at the limit, and one token over");
    checks.push(
        boundary_check(&client, limit, deadline)
            .await
            .unwrap_or_else(|e| inconclusive("boundaries", &e)),
    );

    progress("[3/7] determinism under load");
    let probes: Vec<Value> = (0..4)
        .map(|i| token_prompt(12 + 9 * i, 100 + i as u64))
        .collect();
    let solo = solo_answers(&client, &probes).await;
    checks.push(match &solo {
        Ok(solo) => determinism_check(&client, &probes, solo, deadline)
            .await
            .unwrap_or_else(|e| inconclusive("determinism under load", &e)),
        Err(error) => inconclusive("determinism under load", error),
    });

    progress("[4/7] canary isolation across tenants");
    checks.push(
        canary_check(&client, deadline)
            .await
            .unwrap_or_else(|e| inconclusive("canary isolation", &e)),
    );

    progress("[5/7] abort storm");
    checks.push(match &solo {
        Ok(solo) => abort_storm_check(&client, &probes, solo, deadline)
            .await
            .unwrap_or_else(|e| inconclusive("abort storm", &e)),
        Err(error) => inconclusive("abort storm", error),
    });

    progress("[6/7] prefix-cache walls between tenants");
    checks.push(
        prefix_wall_check(&client, limit, deadline)
            .await
            .unwrap_or_else(|e| inconclusive("prefix-cache walls", &e)),
    );

    progress("[7/7] fail-closed over the whole run");
    checks.push(fail_closed_check(&client));

    Ok(AuditReport {
        base_url: config.base_url,
        checks,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Check 7. Each trial sends, as one-token completions: A a fresh long
/// prefix (warming A's cache), A the same prefix again, and — in random
/// order — B the same prefix and B a fresh prefix of the same length.
async fn prefix_wall_check(
    client: &Client,
    limit: Option<usize>,
    deadline: Instant,
) -> Result<CheckResult, AuditError> {
    const CHECK: &str = "prefix-cache walls";
    const TRIALS: u64 = 8;
    if client.tenants() < 2 {
        return Ok(skipped(CHECK, "needs two tenants' keys"));
    }
    if Instant::now() > deadline {
        return Ok(skipped(CHECK, "out of budget"));
    }
    // Long enough that a cached prefix is plainly faster on any engine.
    let len = limit.map_or(1024, |l| l.saturating_sub(8)).min(1024);
    if len < 64 {
        return Ok(skipped(CHECK, "the context is too short to time a prefix"));
    }
    let timed = |tenant: usize, prompt: Value| async move {
        let body = client.body(prompt, 1, 0);
        let start = Instant::now();
        let answer = client.complete(tenant, &body).await?;
        if answer.status != 200 {
            return Err(AuditError::Status {
                status: answer.status,
                code: format!("a {len}-token prompt was refused"),
            });
        }
        Ok::<_, AuditError>((start.elapsed().as_secs_f64(), answer.cached))
    };
    let (mut own, mut across, mut fresh) = (Vec::new(), Vec::new(), Vec::new());
    let (mut told, mut own_told) = (Vec::new(), 0u64);
    for trial in 0..TRIALS {
        let seed = rand::rng().random::<u32>() as u64;
        let prefix = token_prompt(len, seed);
        timed(0, prefix.clone()).await?;
        let repeat = timed(0, prefix.clone()).await?;
        own.push(repeat.0);
        own_told += repeat.1.unwrap_or(0);
        let other = token_prompt(len, seed + 1 + trial);
        let b_first = rand::rng().random::<bool>();
        let (on_a, new) = if b_first {
            let on_a = timed(1, prefix).await?;
            (on_a, timed(1, other).await?)
        } else {
            let new = timed(1, other).await?;
            (timed(1, prefix).await?, new)
        };
        told.push(on_a.1.unwrap_or(0));
        across.push(on_a.0);
        fresh.push(new.0);
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (across_ratio, own_ratio) = (
        median(&across) / median(&fresh),
        median(&own) / median(&fresh),
    );
    let p = mann_whitney_less(&across, &fresh);
    let p_own = mann_whitney_less(&own, &fresh);
    let figures = format!(
        "{len}-token prefixes, {TRIALS} trials: another tenant on a cached prefix ÷ fresh {across_ratio:.2} (p = {p:.4} that it is faster), own repeat ÷ fresh {own_ratio:.2} (p = {p_own:.4}), cached tokens told to the other tenant {} (at most {CHANCE_AGREEMENT} a prompt is chance), to the owner {own_told}",
        told.iter().sum::<u64>()
    );
    let timing = Timing {
        across_p: p,
        across_ratio,
        own_p: p_own,
    };
    Ok(CheckResult {
        check: CHECK,
        verdict: walls_verdict(&told, own_told, &timing),
        figures,
    })
}

/// Leading tokens two of the check's prompts (ids drawn from 90) may share
/// by chance: a cache that reuses part of a page — kvfence copies the
/// first slots of one — tells a tenant of the few its own earlier prompts
/// happen to share with a new one. Eight in a row agree one time in 90^8
/// (4 × 10^15), so more than this on another tenant's prefix is that
/// tenant's cache.
const CHANCE_AGREEMENT: u64 = 8;

/// What the walls check timed, for its verdict.
struct Timing {
    /// That the other tenant is faster on a cached prefix than on a fresh one.
    across_p: f64,
    /// The other tenant's median on a cached prefix ÷ on a fresh one.
    across_ratio: f64,
    /// That the owner's repeat is faster than a fresh prefix.
    own_p: f64,
}

/// The walls check's verdict from the cached tokens the other tenant was
/// told on each of the owner's prefixes, those told to the owner on its
/// repeats, and the timing.
fn walls_verdict(told: &[u64], own_told: u64, timing: &Timing) -> Verdict {
    // Timing alone fails a server only on near-complete separation (and a
    // clear gap), so noise on a busy machine does not; a server that
    // reports cached tokens is held to them, past chance agreement.
    let told_of_another = told.iter().any(|&n| n > CHANCE_AGREEMENT);
    let cache_visible = own_told > 0 || timing.own_p < 0.05;
    if told_of_another || (timing.across_p < 0.001 && timing.across_ratio < 0.8) {
        Verdict::Fail
    } else if !cache_visible {
        // No visible cache: the walls cannot be told from no cache at all.
        Verdict::Inconclusive
    } else {
        Verdict::Pass
    }
}

/// One-sided Mann–Whitney U test, normal approximation: the probability of
/// seeing `x` this much smaller than `y` (or more) if both came from one
/// distribution.
fn mann_whitney_less(x: &[f64], y: &[f64]) -> f64 {
    let (n1, n2) = (x.len() as f64, y.len() as f64);
    let u: f64 = x
        .iter()
        .map(|a| {
            y.iter()
                .map(|b| match a.total_cmp(b) {
                    std::cmp::Ordering::Less => 1.0,
                    std::cmp::Ordering::Equal => 0.5,
                    std::cmp::Ordering::Greater => 0.0,
                })
                .sum::<f64>()
        })
        .sum();
    let mean = n1 * n2 / 2.0;
    let sd = (n1 * n2 * (n1 + n2 + 1.0) / 12.0).sqrt();
    let z = (u - mean) / sd;
    0.5 * erfc(z / std::f64::consts::SQRT_2)
}

/// The complementary error function (Abramowitz and Stegun 7.1.26, error
/// below 1.5e-7: plenty for a p-value).
fn erfc(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let e = poly * (-x * x).exp();
    if x >= 0.0 { e } else { 2.0 - e }
}

fn skipped(check: &'static str, why: &str) -> CheckResult {
    CheckResult {
        check,
        verdict: Verdict::Skipped,
        figures: why.to_string(),
    }
}

/// Check 1. Returns the result and the limit to test boundaries against:
/// the advertised context, else the measured one.
async fn capacity_check(
    client: &Client,
    advertised: Option<usize>,
    deadline: Instant,
) -> Result<(CheckResult, Option<usize>), AuditError> {
    const CHECK: &str = "capacity honesty";
    let Some(advertised) = advertised else {
        return Ok((
            skipped(
                CHECK,
                "no context advertised in /v1/models and no --context",
            ),
            None,
        ));
    };
    // Longest prompt accepted with one output token: advertised - 1 on an
    // honest server. Search [0, 2 × advertised] so accepting more than the
    // advertised context (silent truncation) shows up too.
    let accepts = |len: usize| async move {
        let body = client.body(token_prompt(len, 1), 1, 0);
        client.complete(0, &body).await.map(|a| a.status == 200)
    };
    let (mut lo, mut hi) = (0usize, 2 * advertised + 1);
    if !accepts(1).await? {
        return Ok((
            CheckResult {
                check: CHECK,
                verdict: Verdict::Fail,
                figures: format!("advertised {advertised}; not even a 1-token prompt is served"),
            },
            Some(advertised),
        ));
    }
    lo = lo.max(1);
    while hi - lo > 1 {
        if Instant::now() > deadline {
            return Ok((
                skipped(CHECK, "out of budget during the search"),
                Some(advertised),
            ));
        }
        let mid = lo + (hi - lo) / 2;
        if accepts(mid).await? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let accepted = lo;
    let honest = accepted + 1 == advertised;
    Ok((
        CheckResult {
            check: CHECK,
            verdict: if honest { Verdict::Pass } else { Verdict::Fail },
            figures: format!(
                "advertised context {advertised}; longest prompt accepted with 1 output token {accepted} (honest: {})",
                advertised - 1
            ),
        },
        Some(advertised),
    ))
}

/// Check 2.
async fn boundary_check(
    client: &Client,
    limit: Option<usize>,
    deadline: Instant,
) -> Result<CheckResult, AuditError> {
    const CHECK: &str = "boundaries";
    let Some(limit) = limit else {
        return Ok(skipped(CHECK, "no context to test against"));
    };
    if Instant::now() > deadline {
        return Ok(skipped(CHECK, "out of budget"));
    }
    let at = client
        .complete(0, &client.body(token_prompt(limit - 1, 2), 1, 0))
        .await?;
    let over_body = client.body(token_prompt(limit, 3), 1, 0);
    let url = format!("{}/v1/completions", client.config.base_url);
    let mut request = client.http.post(&url).json(&over_body);
    if let Some(key) = client.key(0) {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.map_err(AuditError::http)?;
    let over_status = response.status().as_u16();
    let over_value: Value = response.json().await.unwrap_or(Value::Null);
    let over_shaped = error_shaped(&over_value);
    client.record(Seen {
        status: over_status,
        well_formed: if over_status == 200 {
            normal_finish(&over_value)
        } else {
            over_shaped
        },
    });
    let pass = at.status == 200 && (400..500).contains(&over_status) && over_shaped;
    Ok(CheckResult {
        check: CHECK,
        verdict: if pass { Verdict::Pass } else { Verdict::Fail },
        figures: format!(
            "{} tokens + 1 out: {}; {} tokens + 1 out: {}{}",
            limit - 1,
            at.status,
            limit,
            over_status,
            if over_status >= 400 && !over_shaped {
                " (not an OpenAI error body)"
            } else {
                ""
            }
        ),
    })
}

const PROBE_TOKENS: usize = 16;

async fn solo_answers(
    client: &Client,
    probes: &[Value],
) -> Result<Vec<Option<String>>, AuditError> {
    let mut out = Vec::with_capacity(probes.len());
    for (i, prompt) in probes.iter().enumerate() {
        let answer = client
            .complete(0, &client.body(prompt.clone(), PROBE_TOKENS, i as u64))
            .await?;
        out.push(answer.text);
    }
    Ok(out)
}

/// How probe answers compared with their solo answers.
#[derive(Debug, Default, Clone, Copy)]
struct Comparison {
    /// Served, with a different text.
    differ: usize,
    /// Served, with the same text.
    same: usize,
    /// Refused (busy, overloaded): nothing to compare. Check 6 judges
    /// whether the refusal was well formed.
    refused: usize,
}

impl std::ops::AddAssign for Comparison {
    fn add_assign(&mut self, other: Comparison) {
        self.differ += other.differ;
        self.same += other.same;
        self.refused += other.refused;
    }
}

/// Sends the probes (concurrently with whatever else runs) and compares.
async fn probes_under(
    client: &Client,
    probes: &[Value],
    solo: &[Option<String>],
) -> Result<Comparison, AuditError> {
    let answers = futures_util::future::join_all(probes.iter().enumerate().map(|(i, p)| {
        let body = client.body(p.clone(), PROBE_TOKENS, i as u64);
        async move { client.complete(i, &body).await }
    }))
    .await;
    let mut seen = Comparison::default();
    for (answer, want) in answers.into_iter().zip(solo) {
        let answer = answer?;
        if answer.status != 200 {
            seen.refused += 1;
        } else if answer.text != *want {
            seen.differ += 1;
        } else {
            seen.same += 1;
        }
    }
    Ok(seen)
}

fn judged(client: &Client, check: &'static str, seen: Comparison, what: &str) -> CheckResult {
    let verdict = match (seen.differ, seen.same, client.config.batch_invariant) {
        (0, 0, _) => Verdict::Skipped,
        (0, _, _) => Verdict::Pass,
        (_, _, true) => Verdict::Fail,
        (_, _, false) => Verdict::Report,
    };
    CheckResult {
        check,
        verdict,
        figures: format!(
            "{} of {} served probe answers differ from solo {what} ({} refused)",
            seen.differ,
            seen.differ + seen.same,
            seen.refused
        ),
    }
}

/// Check 3.
async fn determinism_check(
    client: &Client,
    probes: &[Value],
    solo: &[Option<String>],
    deadline: Instant,
) -> Result<CheckResult, AuditError> {
    const CHECK: &str = "determinism under load";
    if solo.iter().any(Option::is_none) {
        return Ok(CheckResult {
            check: CHECK,
            verdict: Verdict::Fail,
            figures: "a probe prompt is not served even alone".into(),
        });
    }
    if Instant::now() > deadline {
        return Ok(skipped(CHECK, "out of budget"));
    }
    let rounds = 3;
    let mut seen = Comparison::default();
    for round in 0..rounds {
        let load = (0..client.config.concurrency).map(|i| {
            let len = 8 + (i * 37 + round * 11) % 120;
            let body = client.body(token_prompt(len, 500 + i as u64), 24, i as u64);
            async move { client.complete(i, &body).await.map(|_| ()) }
        });
        let (load, probes) = tokio::join!(
            futures_util::future::join_all(load),
            probes_under(client, probes, solo)
        );
        load.into_iter().collect::<Result<Vec<()>, _>>()?;
        seen += probes?;
    }
    Ok(judged(
        client,
        CHECK,
        seen,
        &format!("under load from {} tenant(s)", client.tenants()),
    ))
}

/// Check 4.
async fn canary_check(client: &Client, deadline: Instant) -> Result<CheckResult, AuditError> {
    const CHECK: &str = "canary isolation";
    if Instant::now() > deadline {
        return Ok(skipped(CHECK, "out of budget"));
    }
    let tenants = client.tenants().max(2);
    let markers: Vec<String> = (0..tenants)
        .map(|_| format!("CANARY{:016X}", rand::rng().random::<u64>()))
        .collect();
    let jobs = (0..tenants * 3).map(|i| {
        let tenant = i % tenants;
        let marker = &markers[tenant];
        let prompt = format!("Remember the code {marker}. Repeat the code {marker} exactly:");
        let body = client.body(json!(prompt), 24, i as u64);
        async move {
            client
                .complete(tenant, &body)
                .await
                .map(|a| (tenant, a.text))
        }
    });
    let mut leaks = 0;
    for answer in futures_util::future::join_all(jobs).await {
        let (tenant, text) = answer?;
        let text = text.unwrap_or_default();
        leaks += markers
            .iter()
            .enumerate()
            .filter(|(other, m)| *other != tenant && text.contains(m.as_str()))
            .count();
    }
    let metrics = client
        .http
        .get(
            client
                .config
                .metrics_url
                .clone()
                .unwrap_or_else(|| format!("{}/metrics", client.config.base_url)),
        )
        .send()
        .await
        .ok();
    let (metrics_checked, metrics_leaks) = match metrics {
        Some(r) if r.status().is_success() => {
            let body = r.text().await.unwrap_or_default();
            (
                true,
                markers.iter().filter(|m| body.contains(m.as_str())).count(),
            )
        }
        _ => (false, 0),
    };
    Ok(CheckResult {
        check: CHECK,
        verdict: if leaks + metrics_leaks == 0 {
            Verdict::Pass
        } else {
            Verdict::Fail
        },
        figures: format!(
            "{tenants} marker groups over {} key(s), {} requests: {leaks} foreign markers in answers; /metrics {}",
            client.config.api_keys.len(),
            tenants * 3,
            if metrics_checked {
                format!("checked, {metrics_leaks} markers")
            } else {
                "not reachable".to_string()
            }
        ),
    })
}

/// Check 5.
async fn abort_storm_check(
    client: &Client,
    probes: &[Value],
    solo: &[Option<String>],
    deadline: Instant,
) -> Result<CheckResult, AuditError> {
    const CHECK: &str = "abort storm";
    if Instant::now() > deadline {
        return Ok(skipped(CHECK, "out of budget"));
    }
    let storm = 2 * client.config.concurrency.max(4);
    let cancels: Vec<(usize, usize)> = (0..storm)
        .map(|i| (i, rand::rng().random_range(0..6)))
        .collect();
    let storm_jobs = cancels.iter().map(|&(i, keep)| {
        let body = client.body(
            token_prompt(20 + (i * 29) % 150, 900 + i as u64),
            64,
            i as u64,
        );
        client.cancelled_stream(i, body, keep)
    });
    let (_, during) = tokio::join!(
        futures_util::future::join_all(storm_jobs),
        probes_under(client, probes, solo)
    );
    let mut seen = during?;
    seen += probes_under(client, probes, solo).await?;
    let mut result = judged(client, CHECK, seen, "during and after the storm");
    result.figures = format!(
        "{storm} streams cancelled at random points; {}",
        result.figures
    );
    Ok(result)
}

/// Check 6.
fn fail_closed_check(client: &Client) -> CheckResult {
    let seen = client
        .seen
        .lock()
        .expect("the record lock is never held across a panic");
    let ok = seen.iter().filter(|s| s.status == 200).count();
    let errors = seen.len() - ok;
    let bad_200 = seen
        .iter()
        .filter(|s| s.status == 200 && !s.well_formed)
        .count();
    let bad_errors = seen
        .iter()
        .filter(|s| s.status != 200 && !s.well_formed)
        .count();
    CheckResult {
        check: "fail-closed",
        verdict: if bad_200 + bad_errors == 0 {
            Verdict::Pass
        } else {
            Verdict::Fail
        },
        figures: format!(
            "{} responses: {ok} ok ({bad_200} without a normal finish), {errors} errors ({bad_errors} not OpenAI-shaped)",
            seen.len()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_of_different_seeds_share_no_prefix() {
        // The prefix-cache check sends a tenant prompts of fresh seeds and
        // counts any cache hit on them against the server: two seeds whose
        // prompts began alike would be a false failure.
        let heads: std::collections::HashSet<Vec<u64>> =
            (0..2_000).map(|seed| token_ids(8, seed)).collect();
        assert_eq!(heads.len(), 2_000);
        assert_eq!(token_ids(64, 7), token_ids(64, 7), "a seed is a prompt");
        assert!(token_ids(64, 7).iter().all(|t| (10..100).contains(t)));
    }

    #[test]
    fn chance_agreement_with_a_tenant_s_own_prompts_is_not_a_breach_of_the_walls() {
        let quiet = Timing {
            across_p: 0.5,
            across_ratio: 1.0,
            own_p: 0.0004,
        };
        // A token or two its own earlier prompts share with the prefix.
        let chance = [0, 1, 0, 2, 0, 0, 1, 0];
        assert_eq!(walls_verdict(&chance, 8184, &quiet), Verdict::Pass);
        // A page of another tenant's prefix, in any one trial.
        let page = [0, 1, 0, 16, 0, 0, 0, 0];
        assert_eq!(walls_verdict(&page, 8184, &quiet), Verdict::Fail);
        // Timing that separates completely fails without a word on tokens.
        let faster = Timing {
            across_p: 0.0002,
            across_ratio: 0.3,
            ..quiet
        };
        assert_eq!(walls_verdict(&[0; 8], 8184, &faster), Verdict::Fail);
        // No visible cache: the walls cannot be told from no cache.
        let no_cache = Timing {
            own_p: 0.5,
            ..quiet
        };
        assert_eq!(walls_verdict(&[0; 8], 0, &no_cache), Verdict::Inconclusive);
    }

    #[test]
    fn the_mann_whitney_test_tells_a_faster_sample_from_an_equal_one() {
        let slow = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0];
        let fast = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let interleaved = [10.5, 11.5, 12.5, 13.5, 14.5, 15.5, 16.5, 9.5];
        assert!(mann_whitney_less(&fast, &slow) < 0.001);
        assert!(mann_whitney_less(&slow, &fast) > 0.999);
        let p = mann_whitney_less(&interleaved, &slow);
        assert!(p > 0.1 && p < 0.9, "{p}");
        assert!((erfc(0.0) - 1.0).abs() < 1e-6);
        assert!((erfc(1.0) - 0.157_299_2).abs() < 1e-6);
        assert!((erfc(-1.0) - 1.842_700_8).abs() < 1e-6);
    }

    #[test]
    fn the_advertised_context_is_read_under_the_common_servers_names() {
        for (entry, expected) in [
            (json!({"id": "m", "max_model_len": 4096}), Some(4096)),
            (json!({"id": "m", "context_length": 8192}), Some(8192)),
            (
                json!({"id": "m", "meta": {"n_ctx": 2048, "n_ctx_train": 8192}}),
                Some(2048),
            ),
            (json!({"id": "m"}), None),
        ] {
            assert_eq!(advertised_in(&entry), expected, "{entry}");
        }
    }
}
