//! Choosing the next token ([`Sampler`]) and deciding when to stop
//! ([`StopStrings`]): greedy, temperature, top-k, top-p, a per-request seed,
//! stop strings. Sampling refuses non-finite logits: NaN is what poisoned KV
//! pages turn into, and it must end the request, not pick a token (I7).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::ModelError;

/// How to pick tokens for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`.
    pub top_p: f32,
    /// Seed of this request's random stream.
    pub seed: u64,
}

impl SamplingParams {
    /// Always the most likely token.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
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
        Ok(())
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

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, ModelError> {
        if logits.is_empty() || logits.iter().any(|l| !l.is_finite()) {
            return Err(ModelError::NonFiniteLogits);
        }
        let index = self.index;
        self.index += 1;
        if self.params.temperature == 0.0 || self.params.top_k == 1 {
            return Ok(argmax(logits));
        }
        let mut ranked: Vec<(u32, f32)> = (0u32..).zip(logits.iter().copied()).collect();
        // Ties broken by id so the order, and so the draw, is reproducible.
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 {
            ranked.truncate(self.params.top_k);
        }
        let max = ranked[0].1;
        let mut probs: Vec<f32> = ranked
            .iter()
            .map(|&(_, l)| ((l - max) / self.params.temperature).exp())
            .collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        let mut keep = probs.len();
        let mut mass = 0.0;
        for (i, p) in probs.iter().enumerate() {
            mass += p;
            if mass >= self.params.top_p {
                keep = i + 1;
                break;
            }
        }
        let kept: f32 = probs[..keep].iter().sum();
        let mut rng = ChaCha8Rng::seed_from_u64(self.params.seed);
        rng.set_stream(index);
        let mut draw = rng.random::<f32>() * kept;
        for (i, p) in probs[..keep].iter().enumerate() {
            if draw < *p {
                return Ok(ranked[i].0);
            }
            draw -= p;
        }
        Ok(ranked[keep - 1].0)
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

/// The stop strings of one request, matched against generated text.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
}

impl StopStrings {
    /// At most four non-empty strings, as OpenAI's API allows.
    pub fn new(stops: Vec<String>) -> Result<StopStrings, ModelError> {
        if stops.len() > 4 || stops.iter().any(String::is_empty) {
            return Err(ModelError::InvalidSampling {
                reason: "stop takes at most 4 non-empty strings".into(),
            });
        }
        Ok(StopStrings { stops })
    }

    /// The stop strings.
    pub fn strings(&self) -> &[String] {
        &self.stops
    }

    /// Byte offset where the earliest stop string begins in `text`, if any:
    /// the completion ends there, the stop string excluded.
    pub fn find(&self, text: &str) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min()
    }

    /// Bytes at the end of `text` that could be the start of a stop string
    /// and so must not be streamed yet.
    pub fn holdback(&self, text: &str) -> usize {
        self.stops
            .iter()
            .map(|s| {
                (1..s.len())
                    .rev()
                    .find(|&n| s.is_char_boundary(n) && text.ends_with(&s[..n]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        }
    }

    #[test]
    fn greedy_takes_the_largest_and_the_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0]).unwrap(), 1);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, seed)).unwrap();
            (0..40)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn resuming_after_n_tokens_continues_the_same_sequence() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut whole = Sampler::new(params(0.9, 0, 0.95, 3)).unwrap();
        let all: Vec<u32> = (0..10).map(|_| whole.sample(&logits).unwrap()).collect();
        let mut rest = Sampler::new(params(0.9, 0, 0.95, 3)).unwrap();
        rest.resume_after(4);
        let tail: Vec<u32> = (0..6).map(|_| rest.sample(&logits).unwrap()).collect();
        assert_eq!(tail, all[4..]);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let logits = [5.0, 4.9, 4.8, -10.0, -10.0];
        let mut k2 = Sampler::new(params(1.0, 2, 1.0, 1)).unwrap();
        assert!((0..200).all(|_| k2.sample(&logits).unwrap() < 2));
        let mut p = Sampler::new(params(1.0, 0, 0.3, 1)).unwrap();
        assert!(
            (0..200).all(|_| p.sample(&logits).unwrap() == 0),
            "top 1 already holds 30 %"
        );
    }

    #[test]
    fn i7_non_finite_logits_end_the_request() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert!(matches!(
            s.sample(&[0.0, f32::NAN]),
            Err(ModelError::NonFiniteLogits)
        ));
    }

    #[test]
    fn out_of_range_parameters_are_refused() {
        assert!(Sampler::new(params(2.5, 0, 1.0, 0)).is_err());
        assert!(Sampler::new(params(1.0, 0, 0.0, 0)).is_err());
        assert!(StopStrings::new(vec![String::new()]).is_err());
    }

    #[test]
    fn stop_strings_cut_at_the_earliest_and_hold_back_partial_matches() {
        let stops = StopStrings::new(vec!["END".into(), "\n\n".into()]).unwrap();
        assert_eq!(stops.find("abc\n\ndefEND"), Some(3));
        assert_eq!(stops.find("abc"), None);
        assert_eq!(stops.holdback("abcEN"), 2);
        assert_eq!(stops.holdback("abc\n"), 1);
        assert_eq!(stops.holdback("abc"), 0);
    }
}
