//! `kvfence generate`: one prompt through the paged runtime, for trying a
//! model by hand. Serving many requests is `kvfence serve`'s job.

use std::io::Write;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use kvfence_model::{ChatMessage, Logits, Sampler, SamplingParams, Sequence};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId};

#[derive(Args, Debug)]
pub(crate) struct GenerateArgs {
    /// smollm2 or gemma3-270m (fetched on first use), a .gguf file, a
    /// Hugging Face model directory, builtin:tiny or builtin:small.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Send the prompt as raw text instead of a user message through the chat template.
    #[arg(long)]
    raw: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64, value_parser = crate::positive::<usize>)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Element type the KV cache is stored in.
    #[arg(long, value_enum, default_value_t = crate::Dtype::F16)]
    kv_dtype: crate::Dtype,
}

pub(crate) fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    // Checked before the model loads (smollm2 may be fetched first).
    let mut sampler = Sampler::new(SamplingParams {
        temperature: args.temperature,
        top_k: 0,
        top_p: 1.0,
        seed: args.seed,
        ..SamplingParams::greedy()
    })?;
    let loaded = crate::serve::load_model(&args.model)?;
    let text = match (&loaded.chat_template, args.raw) {
        (Some(template), false) => template.render(
            &[ChatMessage {
                role: "user".into(),
                content: args.prompt.clone(),
            }],
            true,
        )?,
        _ => args.prompt.clone(),
    };
    let mut tokens = loaded.tokenizer.encode(&text)?;
    if let Some(bos) = loaded.model.config().bos_token_id.filter(|_| args.raw) {
        tokens.insert(0, bos);
    }
    anyhow::ensure!(!tokens.is_empty(), "the prompt encodes to no tokens");
    // Refused before any work, as the API refuses it: a run past the
    // model's positions would fail at its end and lose what it made, and
    // the pool below is sized by what is asked.
    let max_context = loaded.model.config().max_position_embeddings;
    let total = tokens
        .len()
        .checked_add(args.max_tokens)
        .filter(|&total| total <= max_context)
        .with_context(|| {
            format!(
                "{}'s maximum context length is {max_context} tokens: the prompt takes {} \
                 and --max-tokens asks for {} more",
                args.model,
                tokens.len(),
                args.max_tokens
            )
        })?;
    let spec = PoolSpec::new(
        loaded.model.kv_shape(),
        16,
        ElemType::from(args.kv_dtype),
        PoolSize::Tokens(total),
    );
    let pool = Pool::new(&spec)?;
    let mut lease = pool.lease(RequestId(1), total)?;
    let eos = &loaded.model.config().eos_token_ids;

    let start = Instant::now();
    let mut past = 0;
    let mut input = tokens.clone();
    let mut generated = Vec::new();
    let mut first_token_at = None;
    while generated.len() < args.max_tokens {
        let mut batch = [Sequence {
            lease: &mut lease,
            past,
            tokens: &input,
            logits: Logits::Last,
        }];
        let logits = loaded.model.forward(&mut batch)?.remove(0);
        past += input.len();
        let next = sampler.sample(&logits)?;
        first_token_at.get_or_insert_with(|| start.elapsed());
        if eos.contains(&next) {
            break;
        }
        generated.push(next);
        input = vec![next];
    }
    let elapsed = start.elapsed();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", loaded.tokenizer.decode(&generated)?)?;
    let first = first_token_at.unwrap_or(elapsed);
    let decode_tokens = generated.len().saturating_sub(1).max(1) as f64;
    eprintln!(
        "prompt {} tokens, prefill {:.1} ms; {} tokens generated, {:.1} tok/s decode",
        tokens.len(),
        first.as_secs_f64() * 1e3,
        generated.len(),
        decode_tokens / (elapsed - first).as_secs_f64().max(1e-9),
    );
    Ok(())
}
