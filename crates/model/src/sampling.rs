//! Choosing the next token ([`Sampler`]) and deciding when to stop
//! ([`StopStrings`]): greedy, temperature, top-k, top-p, a per-request seed,
//! logit bias, presence, frequency and repetition penalties, a constraint's
//! token mask, log-probabilities, stop strings. Sampling refuses non-finite
//! logits: NaN is what poisoned KV pages turn into, and it must end the
//! request, not pick a token (I7).
//!
//! Everything a draw depends on is the request's parameters, its prompt,
//! the tokens it generated and the constraint's mask for the next one —
//! never the batch around it or the worker it runs on. So rows stay
//! batch-invariant, and a decode worker that takes a request over after its
//! first token draws exactly what the prefill worker would have.

use std::borrow::Cow;
use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::ModelError;

/// Most alternatives a request may ask to see per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How to pick tokens for one request.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`.
    pub top_p: f32,
    /// Seed of this request's random stream.
    pub seed: u64,
    /// Subtracted once from the logit of every token already generated
    /// (OpenAI's `presence_penalty`, −2 to 2).
    #[serde(default)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated
    /// (OpenAI's `frequency_penalty`, −2 to 2).
    #[serde(default)]
    pub frequency_penalty: f32,
    /// Divides the positive logits, and multiplies the negative ones, of
    /// every token in the prompt or the completion; 1 is off (the
    /// `repetition_penalty` of vLLM and Hugging Face).
    #[serde(default = "no_repetition_penalty")]
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens (OpenAI's `logit_bias`, −100 to
    /// 100), in increasing token order, each token once.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each chosen token's log-probability and this many of the
    /// most likely alternatives; `None` reports nothing.
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Score the prompt: each prompt token after the first gets its
    /// log-probability and rank under the model's own distribution at the
    /// position before it, with this many of the most likely alternatives
    /// ([`prompt_logprob`]); `None` scores nothing.
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
}

fn no_repetition_penalty() -> f32 {
    1.0
}

impl SamplingParams {
    /// Always the most likely token.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
        }
    }

    /// Random sampling at `temperature` from the seed's stream.
    pub fn seeded(temperature: f32, seed: u64) -> Self {
        SamplingParams {
            temperature,
            seed,
            ..SamplingParams::greedy()
        }
    }

    /// Checks the ranges OpenAI's API allows.
    pub fn validate(&self) -> Result<(), ModelError> {
        let invalid = |reason: &str| {
            Err(ModelError::InvalidSampling {
                reason: reason.into(),
            })
        };
        if !(0.0..=2.0).contains(&self.temperature) {
            return invalid("temperature must be between 0 and 2");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid("top_p must be in (0, 1]");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return invalid("presence_penalty must be between -2 and 2");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return invalid("frequency_penalty must be between -2 and 2");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return invalid("repetition_penalty must be greater than 0 and at most 10");
        }
        if self
            .logit_bias
            .iter()
            .any(|&(_, bias)| !(-100.0..=100.0).contains(&bias))
        {
            return invalid("logit_bias values must be between -100 and 100");
        }
        if self.logit_bias.windows(2).any(|w| w[0].0 >= w[1].0) {
            return invalid("logit_bias names each token once");
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return invalid("top_logprobs must be at most 20");
        }
        if self.prompt_logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return invalid("prompt_logprobs must be at most 20");
        }
        Ok(())
    }

    /// Whether the logits need reshaping before the draw.
    fn shapes_logits(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
    }
}

/// What a draw may depend on besides the logits: the request's own tokens
/// so far, and which tokens its constraint allows next.
#[derive(Clone, Copy, Default)]
pub struct DrawContext<'a> {
    /// The prompt (read by the repetition penalty only).
    pub prompt: &'a [u32],
    /// Tokens generated so far, in order.
    pub generated: &'a [u32],
    /// The tokens allowed next, if a constraint restricts them.
    pub allowed: Option<&'a dyn Fn(u32) -> bool>,
}

impl std::fmt::Debug for DrawContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrawContext")
            .field("prompt", &self.prompt.len())
            .field("generated", &self.generated.len())
            .field("constrained", &self.allowed.is_some())
            .finish()
    }
}

/// One chosen token and, if the request asked, its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Draw {
    /// The token.
    pub token: u32,
    /// Its log-probability and the top alternatives'.
    pub logprobs: Option<TokenLogprobs>,
}

/// A chosen token's log-probability and the most likely alternatives', in
/// nats, from the distribution the draw was made from: the logits after
/// bias, penalties and constraint, divided by the temperature (1 when
/// greedy), before top-k and top-p cut them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprobs {
    /// The chosen token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens, most likely first (ties by id), with theirs.
    pub top: Vec<(u32, f32)>,
}

/// One prompt token's score: its log-probability under the model's
/// distribution at the position before it (the raw logits: no temperature,
/// penalty, bias or grammar, which shape draws, not the prompt), its rank
/// there (1 for the most likely token) and the most likely alternatives'.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PromptLogprob {
    /// The prompt's token, its log-probability and the alternatives'.
    pub logprobs: TokenLogprobs,
    /// 1 + how many tokens have a larger logit.
    pub rank: u32,
}

/// Scores `token` against the raw `logits` of the position before it,
/// with the `top` most likely alternatives.
pub fn prompt_logprob(logits: &[f32], token: u32, top: usize) -> PromptLogprob {
    let own = logits[token as usize];
    let above = logits.iter().filter(|&&l| l > own).count();
    PromptLogprob {
        logprobs: token_logprobs(logits, 1.0, token, top),
        rank: u32::try_from(above + 1).expect("a vocabulary has fewer than 2^32 tokens"),
    }
}

/// A request's token picker. The draw for the request's `n`-th token comes
/// from its own ChaCha stream `(seed, n)`, so the tokens do not depend on
/// which worker samples them: a prefill worker can sample the first and a
/// decode worker the rest, and the output equals one worker doing both.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    index: u64,
}

impl Sampler {
    /// A sampler for validated `params`.
    pub fn new(params: SamplingParams) -> Result<Sampler, ModelError> {
        params.validate()?;
        Ok(Sampler { params, index: 0 })
    }

    /// Continues a request whose first `n` tokens were sampled elsewhere.
    pub fn resume_after(&mut self, n: u64) {
        self.index = n;
    }

    /// Picks the next token from one row of logits, with no history and no
    /// constraint.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, ModelError> {
        Ok(self.draw(logits, DrawContext::default())?.token)
    }

    /// Picks the next token from one row of logits for a request whose
    /// tokens so far and constraint `context` gives.
    pub fn draw(&mut self, logits: &[f32], context: DrawContext<'_>) -> Result<Draw, ModelError> {
        if logits.is_empty() || logits.iter().any(|l| !l.is_finite()) {
            return Err(ModelError::NonFiniteLogits);
        }
        let index = self.index;
        self.index += 1;
        let logits = self.shape(logits, &context);
        if logits.iter().all(|&l| l == f32::NEG_INFINITY) {
            return Err(ModelError::NoAllowedToken);
        }
        let temperature = if self.params.temperature == 0.0 {
            1.0
        } else {
            self.params.temperature
        };
        let token = if self.params.temperature == 0.0 || self.params.top_k == 1 {
            argmax(&logits)
        } else {
            self.pick(&logits, index)
        };
        let logprobs = self
            .params
            .logprobs
            .map(|top| token_logprobs(&logits, temperature, token, top));
        Ok(Draw { token, logprobs })
    }

    /// The logits after bias, penalties and the constraint's mask; the
    /// row itself when none applies.
    fn shape<'l>(&self, logits: &'l [f32], context: &DrawContext<'_>) -> Cow<'l, [f32]> {
        let p = &self.params;
        if !p.shapes_logits() && context.allowed.is_none() {
            return Cow::Borrowed(logits);
        }
        let mut shaped = logits.to_vec();
        let vocab = shaped.len();
        for &(token, bias) in &p.logit_bias {
            if let Some(l) = shaped.get_mut(token as usize) {
                *l += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; vocab];
            for &token in context.prompt.iter().chain(context.generated) {
                if let Some(seen) = seen.get_mut(token as usize) {
                    *seen = true;
                }
            }
            for (l, _) in shaped.iter_mut().zip(&seen).filter(|(_, seen)| **seen) {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &token in context.generated {
                *counts.entry(token).or_default() += 1;
            }
            for (token, count) in counts {
                if let Some(l) = shaped.get_mut(token as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * count as f32;
                }
            }
        }
        if let Some(allowed) = context.allowed {
            for (token, l) in (0u32..).zip(shaped.iter_mut()) {
                if !allowed(token) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Cow::Owned(shaped)
    }

    /// A random draw with temperature, top-k and top-p from stream `index`.
    ///
    /// The candidates are every allowed token, or the `top_k` best by
    /// (logit descending, id ascending); each weighs
    /// `exp((logit − max) / temperature)`. With `top_p < 1` the kept set
    /// is the shortest run of candidates, best first, whose weight reaches
    /// `top_p` of the candidates' (sums in f64); the draw walks the kept
    /// set best first, or in id order when nothing was ranked. Only as
    /// many candidates are ranked as the cut needs — partial selection,
    /// not a sort of the vocabulary, which cost more than the rest of a
    /// decode step on a 262,144-token vocabulary.
    fn pick(&self, logits: &[f32], index: u64) -> u32 {
        let temperature = self.params.temperature;
        let rank = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let mut candidates: Vec<(u32, f32)> = (0u32..)
            .zip(logits.iter().copied())
            .filter(|&(_, l)| l > f32::NEG_INFINITY)
            .collect();
        assert!(
            !candidates.is_empty(),
            "draw checked that some token is allowed"
        );
        let mut ranked = 0;
        let k = self.params.top_k;
        if k > 0 && k < candidates.len() {
            candidates.select_nth_unstable_by(k - 1, rank);
            candidates.truncate(k);
        }
        if k > 0 {
            candidates.sort_unstable_by(rank);
            ranked = candidates.len();
        }
        let max = candidates
            .iter()
            .map(|&(_, l)| l)
            .fold(f32::NEG_INFINITY, f32::max);
        let weight = |l: f32| f64::from(((l - max) / temperature).exp());
        let total: f64 = candidates.iter().map(|&(_, l)| weight(l)).sum();
        let mut keep = candidates.len();
        if self.params.top_p < 1.0 {
            let target = f64::from(self.params.top_p) * total;
            let mut mass = 0.0;
            let mut next = 0;
            // Rank a few more candidates at a time until the cut is found:
            // usually the first few dozen.
            'cut: loop {
                if ranked < candidates.len() && next == ranked {
                    let more = (ranked.max(16) * 4).min(candidates.len());
                    if more < candidates.len() {
                        candidates[ranked..].select_nth_unstable_by(more - ranked - 1, rank);
                    }
                    candidates[ranked..more].sort_unstable_by(rank);
                    ranked = more;
                }
                while next < ranked {
                    mass += weight(candidates[next].1);
                    next += 1;
                    if mass >= target {
                        keep = next;
                        break 'cut;
                    }
                }
                if ranked == candidates.len() {
                    break;
                }
            }
        }
        let kept = &candidates[..keep];
        let kept_mass: f64 = kept.iter().map(|&(_, l)| weight(l)).sum();
        let mut rng = ChaCha8Rng::seed_from_u64(self.params.seed);
        rng.set_stream(index);
        let mut draw = rng.random::<f64>() * kept_mass;
        for &(token, l) in kept {
            let w = weight(l);
            if draw < w {
                return token;
            }
            draw -= w;
        }
        kept[keep - 1].0
    }
}

/// The log-probability reported for a token of (numerically) no
/// probability, as OpenAI's API reports it.
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// `token`'s log-probability and the `top` most likely tokens' under
/// softmax(`logits` / `temperature`).
fn token_logprobs(logits: &[f32], temperature: f32, token: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // In f64: a 50,000-token sum in f32 loses the small terms.
    let total: f64 = logits
        .iter()
        .map(|&l| f64::from((l - max) / temperature).exp())
        .sum();
    let log_total = total.ln() as f32;
    // A tiny temperature sends every other token's to minus infinity,
    // which JSON cannot carry: such a token gets OpenAI's floor instead.
    let logprob = |l: f32| {
        let logprob = (l - max) / temperature - log_total;
        if logprob.is_finite() {
            logprob.max(LOGPROB_FLOOR)
        } else {
            LOGPROB_FLOOR
        }
    };
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (id, &l) in (0u32..).zip(logits) {
            if l == f32::NEG_INFINITY {
                continue;
            }
            let better = |&(b_id, b_l): &(u32, f32)| l > b_l || (l == b_l && id < b_id);
            if best.len() < top || best.last().is_some_and(better) {
                let at = best.iter().position(better).unwrap_or(best.len());
                best.insert(at, (id, l));
                best.truncate(top);
            }
        }
    }
    TokenLogprobs {
        token,
        logprob: logprob(logits[token as usize]),
        top: best.into_iter().map(|(id, l)| (id, logprob(l))).collect(),
    }
}

/// Index of the largest logit; the lowest index wins ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    u32::try_from(best).expect("vocabulary sizes fit in u32")
}

/// The stop strings of one request, matched against generated text: the
/// client's, which end the completion where they begin (excluded from it),
/// and kept ones, which end it where they end (included: the end of a tool
/// call, when an answer may make one call only). On a link they are their
/// strings, checked again as they are read: a list when none is kept (the
/// form a client's stops always had), else `{"stops": [...], "kept": [...]}`.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "StopsForm", into = "StopsForm")]
pub struct StopStrings {
    stops: Vec<String>,
    kept: Vec<String>,
}

/// The most bytes all of a request's stop strings may hold together. Matching
/// costs each generated byte a constant amount whatever their length, but
/// their tables live as long as the request: bounded, like everything else
/// a request brings.
pub const MAX_STOP_BYTES: usize = 4096;

impl StopStrings {
    /// At most four non-empty strings of at most [`MAX_STOP_BYTES`] together.
    pub fn new(stops: Vec<String>) -> Result<StopStrings, ModelError> {
        StopStrings {
            stops,
            kept: Vec::new(),
        }
        .checked()
    }

    /// These stops, and `kept` ones that end the completion after
    /// themselves (at most four more, within the same byte bound).
    pub fn keeping(self, kept: Vec<String>) -> Result<StopStrings, ModelError> {
        StopStrings { kept, ..self }.checked()
    }

    fn checked(self) -> Result<StopStrings, ModelError> {
        for list in [&self.stops, &self.kept] {
            if list.len() > 4 || list.iter().any(String::is_empty) {
                return Err(ModelError::InvalidSampling {
                    reason: "stop takes at most 4 non-empty strings".into(),
                });
            }
        }
        let total: usize = self.stops.iter().chain(&self.kept).map(String::len).sum();
        if total > MAX_STOP_BYTES {
            return Err(ModelError::InvalidSampling {
                reason: format!(
                    "stop strings hold {total} bytes together; at most {MAX_STOP_BYTES} are allowed"
                ),
            });
        }
        Ok(self)
    }

    /// The stop strings that end the completion before themselves.
    pub fn strings(&self) -> &[String] {
        &self.stops
    }

    /// The stop strings that end the completion after themselves.
    pub fn kept(&self) -> &[String] {
        &self.kept
    }

    /// Byte offset where `text`'s completion ends, if a stop string is in
    /// it: where the earliest cut falls (an excluded stop's start, a kept
    /// stop's end).
    pub fn find(&self, text: &str) -> Option<usize> {
        let mut matcher = self.matcher();
        matcher.push(text)
    }

    /// Bytes at the end of `text` that could be the start of a stop string
    /// and so must not be streamed yet (a kept stop is streamed as it comes:
    /// it stays in the text either way).
    pub fn holdback(&self, text: &str) -> usize {
        let mut matcher = self.matcher();
        let _ = matcher.push(text);
        matcher.holdback()
    }

    /// An incremental matcher over text that grows at its end.
    pub fn matcher(&self) -> StopMatcher {
        let excluded = self.stops.iter().map(|s| (Kmp::new(s.as_bytes()), false));
        let kept = self.kept.iter().map(|s| (Kmp::new(s.as_bytes()), true));
        StopMatcher {
            stops: excluded.chain(kept).collect(),
            seen: 0,
        }
    }
}

/// [`StopStrings`]' form on a link.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
enum StopsForm {
    Excluded(Vec<String>),
    WithKept {
        stops: Vec<String>,
        kept: Vec<String>,
    },
}

impl TryFrom<StopsForm> for StopStrings {
    type Error = ModelError;

    fn try_from(form: StopsForm) -> Result<StopStrings, ModelError> {
        match form {
            StopsForm::Excluded(stops) => StopStrings::new(stops),
            StopsForm::WithKept { stops, kept } => StopStrings::new(stops)?.keeping(kept),
        }
    }
}

impl From<StopStrings> for StopsForm {
    fn from(stops: StopStrings) -> StopsForm {
        if stops.kept.is_empty() {
            StopsForm::Excluded(stops.stops)
        } else {
            StopsForm::WithKept {
                stops: stops.stops,
                kept: stops.kept,
            }
        }
    }
}

/// One stop string's Knuth–Morris–Pratt automaton: `state` is the length
/// of the longest prefix of the pattern that ends the text seen so far.
#[derive(Debug, Clone)]
struct Kmp {
    pattern: Vec<u8>,
    /// `fallback[i]`: the longest proper border of `pattern[..=i]`.
    fallback: Vec<u32>,
    state: usize,
}

impl Kmp {
    fn new(pattern: &[u8]) -> Kmp {
        let mut fallback = vec![0u32; pattern.len()];
        let mut k = 0usize;
        for i in 1..pattern.len() {
            while k > 0 && pattern[i] != pattern[k] {
                k = fallback[k - 1] as usize;
            }
            if pattern[i] == pattern[k] {
                k += 1;
            }
            fallback[i] = k as u32;
        }
        Kmp {
            pattern: pattern.to_vec(),
            fallback,
            state: 0,
        }
    }

    /// Advances by one byte; `true` when the whole pattern has just ended.
    fn step(&mut self, byte: u8) -> bool {
        let mut k = self.state;
        if k == self.pattern.len() {
            k = self.fallback[k - 1] as usize;
        }
        while k > 0 && self.pattern[k] != byte {
            k = self.fallback[k - 1] as usize;
        }
        if self.pattern[k] == byte {
            k += 1;
        }
        self.state = k;
        k == self.pattern.len()
    }
}

/// Finds stop strings in text fed to it piece by piece: each byte costs a
/// constant amortised amount however long the stops and the text are, so
/// a request's stop strings cannot slow the step every request shares.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    /// Each stop's automaton, and whether it is kept in the text.
    stops: Vec<(Kmp, bool)>,
    /// Bytes fed so far.
    seen: usize,
}

impl StopMatcher {
    /// Feeds text appended after everything fed before. Returns the offset
    /// (from the start of all text fed) where the completion ends if a stop
    /// string ends in `appended`: the earliest cut among them (where an
    /// excluded stop begins, where a kept one ends).
    pub fn push(&mut self, appended: &str) -> Option<usize> {
        let mut earliest: Option<usize> = None;
        for (stop, kept) in &mut self.stops {
            let mut first = None;
            for (i, &byte) in appended.as_bytes().iter().enumerate() {
                if stop.step(byte) && first.is_none() {
                    let end = self.seen + i + 1;
                    first = Some(if *kept { end } else { end - stop.pattern.len() });
                }
            }
            if let Some(cut) = first {
                earliest = Some(earliest.map_or(cut, |e| e.min(cut)));
            }
        }
        self.seen += appended.len();
        earliest
    }

    /// Bytes at the end of the text fed that could begin an excluded stop
    /// string.
    pub fn holdback(&self) -> usize {
        self.stops
            .iter()
            .filter(|(_, kept)| !kept)
            .map(|(stop, _)| stop.state.min(stop.pattern.len().saturating_sub(1)))
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests;
