//! Tests of `sampling`.

use super::*;

/// The obvious definitions, for comparison.
fn naive_find(stops: &[String], text: &str) -> Option<usize> {
    stops.iter().filter_map(|s| text.find(s.as_str())).min()
}

/// Where a completion ends with `stops` excluded and `kept` kept: the
/// earliest of the excluded ones' starts and the kept ones' ends.
fn naive_cut(stops: &[String], kept: &[String], text: &str) -> Option<usize> {
    let ends = kept
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|at| at + s.len()));
    naive_find(stops, text).into_iter().chain(ends).min()
}

fn naive_holdback(stops: &[String], text: &str) -> usize {
    stops
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

proptest::proptest! {
    /// Fed in random pieces, the matcher finds what a search of the
    /// whole text finds, and holds back what the naive check holds back.
    #[test]
    fn the_incremental_matcher_agrees_with_searching_the_whole_text(
        stops in proptest::collection::vec("[ab✓]{1,6}", 1..4),
        kept in proptest::collection::vec("[ab✓]{1,6}", 0..3),
        text in "[ab✓ ]{0,40}",
        cuts in proptest::collection::vec(0usize..40, 0..6),
    ) {
        let stop_strings = StopStrings::new(stops.clone()).unwrap().keeping(kept.clone()).unwrap();
        let mut matcher = stop_strings.matcher();
        let mut bounds: Vec<usize> = cuts.into_iter().filter(|&c| text.is_char_boundary(c.min(text.len()))).map(|c| c.min(text.len())).collect();
        bounds.push(text.len());
        bounds.sort_unstable();
        let mut fed = 0;
        for bound in bounds {
            if bound < fed { continue; }
            let found = matcher.push(&text[fed..bound]);
            fed = bound;
            let whole = naive_cut(&stops, &kept, &text[..fed]);
            // A stop found now is the earliest; until one is, none exists.
            if found.is_some() {
                proptest::prop_assert_eq!(found, whole);
                return Ok(());
            }
            proptest::prop_assert_eq!(whole, None);
            proptest::prop_assert_eq!(matcher.holdback(), naive_holdback(&stops, &text[..fed]));
        }
    }
}

#[test]
fn stop_strings_are_bounded_in_total_bytes() {
    let big = "x".repeat(MAX_STOP_BYTES / 2 + 1);
    assert!(StopStrings::new(vec![big.clone()]).is_ok());
    assert!(StopStrings::new(vec![big.clone(), big]).is_err());
}

#[test]
fn a_tiny_temperature_gives_finite_log_probabilities() {
    let logits = [1.0, 0.5, -3.0, 2.0];
    let logprobs = token_logprobs(&logits, 1e-40, 3, 4);
    assert_eq!(logprobs.logprob, 0.0);
    assert!(
        logprobs.top.iter().all(|(_, l)| l.is_finite()),
        "{logprobs:?}"
    );
    assert_eq!(logprobs.top[1].1, LOGPROB_FLOOR);
}

#[test]
fn a_prompt_token_is_scored_by_the_raw_distribution_with_its_rank() {
    let logits = [1.0, 3.0, 2.0, 3.0];
    let scored = prompt_logprob(&logits, 2, 2);
    let total: f64 = logits.iter().map(|&l: &f32| f64::from(l).exp()).sum();
    let expected = (2.0 - total.ln()) as f32;
    assert!(
        (scored.logprobs.logprob - expected).abs() < 1e-6,
        "{scored:?}"
    );
    assert_eq!(scored.rank, 3, "two tokens are more likely");
    // Ties by id, the prompt's token not necessarily among them.
    let ids: Vec<u32> = scored.logprobs.top.iter().map(|&(id, _)| id).collect();
    assert_eq!(ids, [1, 3]);
    assert_eq!(prompt_logprob(&logits, 1, 0).rank, 1);
    assert_eq!(
        prompt_logprob(&logits, 3, 0).rank,
        1,
        "a tie shares the rank"
    );
    assert!(prompt_logprob(&logits, 0, 0).logprobs.top.is_empty());
}

#[test]
fn prompt_logprobs_are_bounded_like_top_logprobs() {
    let mut params = SamplingParams::greedy();
    params.prompt_logprobs = Some(MAX_TOP_LOGPROBS);
    assert!(params.validate().is_ok());
    params.prompt_logprobs = Some(MAX_TOP_LOGPROBS + 1);
    assert!(params.validate().is_err());
}

fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        seed,
        ..SamplingParams::greedy()
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

/// The set top-p keeps, by brute force: every candidate ranked, the
/// shortest best-first run whose f64 weight reaches `top_p` of all.
fn kept_by_full_sort(logits: &[f32], temperature: f32, top_p: f32) -> Vec<u32> {
    let mut ranked: Vec<(u32, f32)> = (0u32..).zip(logits.iter().copied()).collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let max = ranked[0].1;
    let weight = |l: f32| f64::from(((l - max) / temperature).exp());
    let total: f64 = ranked.iter().map(|&(_, l)| weight(l)).sum();
    let mut mass = 0.0;
    let mut kept = Vec::new();
    for &(token, l) in &ranked {
        kept.push(token);
        mass += weight(l);
        if mass >= f64::from(top_p) * total {
            break;
        }
    }
    kept
}

#[test]
fn top_p_ranks_only_what_the_cut_needs_and_keeps_what_a_full_sort_keeps() {
    // 5,000 logits, so the cut falls after several rounds of ranking.
    let logits: Vec<f32> = (0..5000)
        .map(|i| ((i * 7919) % 5000) as f32 / 2500.0)
        .collect();
    for (top_p, temperature) in [(0.3, 1.0), (0.9, 0.7), (0.999, 2.0)] {
        let kept = kept_by_full_sort(&logits, temperature, top_p);
        assert!(kept.len() > 64, "the cut lies past the first round");
        let allowed: std::collections::HashSet<u32> = kept.iter().copied().collect();
        let mut sampler = Sampler::new(params(temperature, 0, top_p, 11)).unwrap();
        let drawn: Vec<u32> = (0..400).map(|_| sampler.sample(&logits).unwrap()).collect();
        assert!(
            drawn.iter().all(|t| allowed.contains(t)),
            "top_p {top_p}: a draw outside the {} kept tokens",
            kept.len()
        );
        let distinct: std::collections::HashSet<u32> = drawn.iter().copied().collect();
        assert!(distinct.len() > 50, "draws spread over the kept set");
    }
}

#[test]
fn draws_follow_the_distribution_with_and_without_top_k() {
    // Weights 4 : 2 : 1 : 1 at temperature 1 (logits ln 4, ln 2, 0, 0).
    let logits = [4f32.ln(), 2f32.ln(), 0.0, 0.0];
    for top_k in [0, 4, 3] {
        let mut sampler = Sampler::new(params(1.0, top_k, 1.0, 5)).unwrap();
        let mut counts = [0usize; 4];
        for _ in 0..8000 {
            counts[sampler.sample(&logits).unwrap() as usize] += 1;
        }
        // top_k 3 keeps ids 0, 1, 2 (ties go to the lower id): 4 : 2 : 1.
        let weights: &[f64] = if top_k == 3 {
            &[4.0, 2.0, 1.0, 0.0]
        } else {
            &[4.0, 2.0, 1.0, 1.0]
        };
        let total: f64 = weights.iter().sum();
        for (id, (&count, &w)) in counts.iter().zip(weights).enumerate() {
            let expected = 8000.0 * w / total;
            assert!(
                (count as f64 - expected).abs() <= 4.0 * expected.sqrt() + 1.0,
                "top_k {top_k}, token {id}: {count} draws, expected about {expected}"
            );
        }
    }
}

fn draw(params: SamplingParams, logits: &[f32], context: DrawContext<'_>) -> Draw {
    Sampler::new(params).unwrap().draw(logits, context).unwrap()
}

#[test]
fn logit_bias_moves_the_choice() {
    let logits = [1.0, 2.0, 0.5];
    assert_eq!(
        draw(SamplingParams::greedy(), &logits, DrawContext::default()).token,
        1
    );
    let biased = SamplingParams {
        logit_bias: vec![(2, 5.0)],
        ..SamplingParams::greedy()
    };
    assert_eq!(draw(biased, &logits, DrawContext::default()).token, 2);
    let banned = SamplingParams {
        logit_bias: vec![(1, -100.0)],
        ..SamplingParams::greedy()
    };
    assert_eq!(draw(banned, &logits, DrawContext::default()).token, 0);
}

#[test]
fn penalties_read_only_what_the_request_generated_or_saw() {
    let logits = [1.0, 1.5, 0.0];
    let generated = [1, 1];
    let context = DrawContext {
        generated: &generated,
        ..DrawContext::default()
    };
    // Two repeats of token 1 at 0.3 each: 1.5 − 0.6 < 1.0.
    let frequency = SamplingParams {
        frequency_penalty: 0.3,
        ..SamplingParams::greedy()
    };
    assert_eq!(draw(frequency.clone(), &logits, context).token, 0);
    assert_eq!(draw(frequency, &logits, DrawContext::default()).token, 1);
    // Presence counts once: 1.5 − 0.4 > 1.0.
    let presence = SamplingParams {
        presence_penalty: 0.4,
        ..SamplingParams::greedy()
    };
    assert_eq!(draw(presence, &logits, context).token, 1);
    // The repetition penalty divides a positive logit and reads the prompt too.
    let prompt = [1];
    let repetition = SamplingParams {
        repetition_penalty: 2.0,
        ..SamplingParams::greedy()
    };
    let seen = DrawContext {
        prompt: &prompt,
        ..DrawContext::default()
    };
    assert_eq!(draw(repetition, &logits, seen).token, 0);
}

#[test]
fn a_mask_confines_every_draw_and_an_empty_one_is_an_error() {
    let logits: Vec<f32> = (0..40).map(|i| (i as f32 * 0.7).cos()).collect();
    let even = |t: u32| t.is_multiple_of(2);
    let context = DrawContext {
        allowed: Some(&even),
        ..DrawContext::default()
    };
    let mut sampler = Sampler::new(params(1.5, 0, 1.0, 9)).unwrap();
    for _ in 0..200 {
        assert!(even(sampler.draw(&logits, context).unwrap().token));
    }
    let none = |_: u32| false;
    let empty = DrawContext {
        allowed: Some(&none),
        ..DrawContext::default()
    };
    assert!(matches!(
        sampler.draw(&logits, empty),
        Err(ModelError::NoAllowedToken)
    ));
}

#[test]
fn logprobs_are_the_draws_distribution_most_likely_first() {
    let logits = [0.0, 2.0, 1.0, 2.0];
    let with = |temperature: f32| SamplingParams {
        temperature,
        logprobs: Some(3),
        ..SamplingParams::greedy()
    };
    let got = draw(with(0.0), &logits, DrawContext::default())
        .logprobs
        .unwrap();
    assert_eq!(got.token, 1);
    let ids: Vec<u32> = got.top.iter().map(|&(id, _)| id).collect();
    assert_eq!(ids, [1, 3, 2], "ties by id");
    let total: f32 = logits.iter().map(|l| l.exp()).sum();
    assert!((got.logprob - (2.0 - total.ln())).abs() < 1e-5);
    let mass: f32 = got.top.iter().map(|&(_, lp)| lp.exp()).sum();
    assert!(mass <= 1.0 + 1e-6);
    // At temperature 0.5 the draw's distribution is sharper.
    let sharp = draw(with(0.5), &logits, DrawContext::default())
        .logprobs
        .unwrap();
    let chosen = sharp
        .top
        .iter()
        .find(|&&(id, _)| id == sharp.token)
        .unwrap();
    assert!(chosen.1 > got.logprob);
    // A masked-out token is never listed.
    let odd = |t: u32| t % 2 == 1;
    let masked = DrawContext {
        allowed: Some(&odd),
        ..DrawContext::default()
    };
    let got = draw(with(0.0), &logits, masked).logprobs.unwrap();
    assert!(got.top.iter().all(|&(id, _)| id % 2 == 1));
}

#[test]
fn shaping_parameters_out_of_range_are_refused() {
    for bad in [
        SamplingParams {
            presence_penalty: 2.5,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            frequency_penalty: -3.0,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            repetition_penalty: 0.0,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            logit_bias: vec![(1, 101.0)],
            ..SamplingParams::greedy()
        },
        SamplingParams {
            logit_bias: vec![(2, 1.0), (1, 1.0)],
            ..SamplingParams::greedy()
        },
        SamplingParams {
            logprobs: Some(21),
            ..SamplingParams::greedy()
        },
    ] {
        assert!(Sampler::new(bad).is_err());
    }
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
fn kept_stops_end_the_text_after_themselves_and_are_not_held_back() {
    let stops = StopStrings::new(vec!["END".into()])
        .unwrap()
        .keeping(vec!["</c>".into()])
        .unwrap();
    assert_eq!(stops.find("a</c>bEND"), Some(5));
    assert_eq!(stops.find("aENDb</c>"), Some(1));
    assert_eq!(stops.holdback("a</c"), 0);
    assert_eq!(stops.holdback("aEN"), 2);
    // Bounded as the client's are, together with them.
    let big = "x".repeat(MAX_STOP_BYTES / 2 + 1);
    let client = StopStrings::new(vec![big.clone()]).unwrap();
    assert!(client.keeping(vec![big]).is_err());
    assert!(StopStrings::default().keeping(vec![String::new()]).is_err());
}

#[test]
fn stop_strings_cross_a_link_as_a_list_unless_some_are_kept() {
    let plain = StopStrings::new(vec!["END".into()]).unwrap();
    assert_eq!(
        serde_json::to_value(&plain).unwrap(),
        serde_json::json!(["END"])
    );
    let with_kept = plain.keeping(vec!["</c>".into()]).unwrap();
    let form = serde_json::to_value(&with_kept).unwrap();
    assert_eq!(
        form,
        serde_json::json!({"stops": ["END"], "kept": ["</c>"]})
    );
    let back: StopStrings = serde_json::from_value(form).unwrap();
    assert_eq!(
        (back.strings(), back.kept()),
        (&["END".to_string()][..], &["</c>".to_string()][..])
    );
    // Checked again as they are read.
    let five = serde_json::json!({"stops": [], "kept": ["a", "b", "c", "d", "e"]});
    assert!(serde_json::from_value::<StopStrings>(five).is_err());
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
