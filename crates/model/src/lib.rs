//! kvfence's model runtime: Llama-family decoders (Llama, Mistral, Qwen2,
//! Qwen3, Phi-3, SmolLM) and Gemma 3 (sliding-window layers) whose attention reads KV
//! only through the fenced pool's coverage-checked views.
//!
//! - [`config`]: hyper-parameters from `config.json` or GGUF metadata.
//! - [`tensors`]: safetensors in and out (sharded, f32/f16/bf16).
//! - [`gguf`], [`quant`]: GGUF files and their quantized block formats.
//! - [`tokenizer`], [`chat`]: text ⇄ ids, chat templates.
//! - [`kernels`]: batch-invariant CPU kernels; the seam for other backends;
//!   `qtile`: the register-tiled quantized dot products.
//! - [`forward`]: the batched, paged forward pass; [`attention`]: its
//!   tiled attention over pool pages, in f32, f16 or bf16 KV; `awake`: the
//!   pool's other workers kept polling through a pass.
//! - [`sampling`]: token choice and stop strings; [`constraint`]: grammars
//!   that restrict it (structured outputs).
//! - [`builtin`]: deterministic built-in models; [`fetch`]: pretrained
//!   models by name, cached; [`loader`]: load by name.

pub mod attention;
mod awake;
pub mod builtin;
pub mod chat;
pub mod config;
pub mod constraint;
mod error;
pub mod fetch;
pub mod forward;
pub mod gguf;
mod isa;
pub mod kernels;
pub mod loader;
mod qtile;
pub mod quant;
pub mod sampling;
pub mod tensors;
pub mod tokenizer;

pub use builtin::Builtin;
pub use chat::{ChatMessage, ChatTemplate};
pub use config::{Activation, Architecture, ModelConfig, SlidingWindow};
pub use constraint::{Constraint, Grammar, Grammars, TokenMask};
pub use error::ModelError;
pub use fetch::{KnownModel, ModelCache};
pub use forward::{Logits, Model, Pass, Sequence};
pub use loader::{LoadedModel, TextModel};
pub use sampling::{
    Draw, DrawContext, MAX_STOP_BYTES, MAX_TOP_LOGPROBS, PromptLogprob, Sampler, SamplingParams,
    StopMatcher, StopStrings, TokenLogprobs, prompt_logprob,
};
pub use tensors::{DiskDtype, Tensor, TensorMap};
pub use tokenizer::Tokenizer;

/// Starts the process's compute pool (rayon's global pool, one thread per
/// core) with its threads named `kvf-compute-N`, so that `top -H` and
/// profiles tell them apart from the workers: left to rayon, they take the
/// name of whichever thread first used the pool (a prefill worker's, in the
/// default mode). Call before any model work; once the pool exists it does
/// nothing, and the pool keeps the names it has.
pub fn start_compute_pool() {
    let _already_started = rayon::ThreadPoolBuilder::new()
        .thread_name(|index| format!("kvf-compute-{index}"))
        .build_global();
}
