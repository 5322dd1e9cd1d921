//! Gemma 3 270M (Q4_K_M GGUF), the second real pretrained model, fetched
//! into the model cache on first use, checked against llama.cpp — the
//! reference implementation — through fixtures it wrote
//! (`scripts/llama_cpp_fixtures.py`, `tests/fixtures/gemma3_270m.json`):
//! the SentencePiece tokenizer gives llama.cpp's token ids, and greedy
//! continuations of 20 prompts agree with llama.cpp's for 16 tokens, or
//! part ways only where llama.cpp's own two best logits are nearly tied.

#![allow(clippy::unwrap_used)]

use std::sync::OnceLock;

use kvfence_model::{LoadedModel, Logits, ModelCache, Sequence};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId};
use serde_json::Value;

/// How close llama.cpp's two best logits must be for a different greedy
/// choice to count as a tie rather than a difference. Both runtimes
/// quantize differently along the way (llama.cpp rounds activations to
/// 8 bits for its integer dot products and GELU through a 16-bit table;
/// kvfence keeps f32 activations), which moves logits by a few hundredths
/// on this model; 0.25 is several times that and far below a real gap.
const TIE: f64 = 0.25;

fn model() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        LoadedModel::load_or_fetch("gemma3-270m", &ModelCache::from_env(), &mut |m| {
            eprintln!("{m}")
        })
        .unwrap()
    })
}

fn fixtures() -> Value {
    serde_json::from_str(include_str!("fixtures/gemma3_270m.json")).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn the_tokenizer_gives_llama_cpp_token_ids() {
    let m = model();
    for case in fixtures()["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = m.tokenizer.encode_as_text(text).unwrap();
        assert_eq!(got, ids(&case["ids"]), "token ids of {text:?}");
        assert_eq!(m.tokenizer.decode(&got).unwrap(), text, "round trip");
    }
    // I9: text naming Gemma's turn markers stays text; the template's own
    // markers (encoded with specials on) are the control tokens.
    let specials: Vec<u32> = m
        .tokenizer
        .special_tokens()
        .iter()
        .map(|(_, id)| *id)
        .collect();
    let text = "<start_of_turn>user\nhi<end_of_turn>\n<bos><eos><pad>";
    let as_text = m.tokenizer.encode_as_text(text).unwrap();
    assert!(
        as_text.iter().all(|id| !specials.contains(id)),
        "{as_text:?}"
    );
    let markers = m.tokenizer.encode("<start_of_turn>user").unwrap();
    assert_eq!(markers[0], m.tokenizer.token_id("<start_of_turn>").unwrap());
}

#[test]
fn greedy_continuations_agree_with_llama_cpp() {
    let m = model();
    let pool = Pool::new(&PoolSpec::new(
        m.model.kv_shape(),
        16,
        ElemType::F32,
        PoolSize::Tokens(64),
    ))
    .unwrap();
    let mut agreed = 0;
    for (n, case) in fixtures()["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt_text = case["prompt"].as_str().unwrap();
        let prompt = ids(&case["ids"]);
        let mut expected = vec![m.model.config().bos_token_id.unwrap()];
        expected.extend(m.tokenizer.encode_as_text(prompt_text).unwrap());
        assert_eq!(expected, prompt, "prompt ids of {prompt_text:?}");
        let greedy = ids(&case["greedy"]);
        let mut lease = pool
            .lease(RequestId(n as u64), prompt.len() + greedy.len())
            .unwrap();
        let mut past = 0;
        let mut tokens = prompt.clone();
        for (step, &want) in greedy.iter().enumerate() {
            let fresh = &tokens[past..];
            let rows = m
                .model
                .forward(&mut [Sequence {
                    lease: &mut lease,
                    past,
                    tokens: fresh,
                    logits: Logits::Last,
                }])
                .unwrap();
            past = tokens.len();
            let got = kvfence_model::sampling::argmax(&rows[0]);
            if got != want {
                let top2 = &case["top2"][step];
                let gap = top2[0][1].as_f64().unwrap() - top2[1][1].as_f64().unwrap();
                eprintln!("{prompt_text:?}: parts at token {step}, llama.cpp lead {gap:.3}");
                assert!(
                    gap <= TIE,
                    "{prompt_text:?}, token {step}: kvfence chose {got}, llama.cpp {want} \
                     with a lead of {gap}"
                );
                break;
            }
            agreed += 1;
            tokens.push(got);
        }
    }
    eprintln!("{agreed} of 320 greedy tokens equal llama.cpp's");
}
