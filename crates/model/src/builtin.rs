//! The built-in models: deterministic random weights from a seed, a
//! byte-level tokenizer and ChatML, so tests and benchmarks need no
//! download. `builtin:tiny` is the test suite's model; `builtin:small` has
//! the shape of a 135M-parameter Llama (SmolLM2-135M) for benchmarks.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::chat::{CHATML, ChatTemplate};
use crate::config::{Architecture, ModelConfig};
use crate::error::ModelError;
use crate::tensors::{DiskDtype, Tensor, TensorMap};
use crate::tokenizer::{BUILTIN_SPECIALS, Tokenizer};

/// A built-in model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    /// ≈ 0.2M parameters: 4 layers, hidden 64. Fast enough for every test.
    Tiny,
    /// ≈ 106M parameters: SmolLM2-135M's shape with a 512-token vocabulary.
    Small,
}

/// Seed of the built-in weights; fixed so every run sees the same model.
pub const BUILTIN_SEED: u64 = 0x6b76_6665_6e63_6521;

const ENDOFTEXT: u32 = 256;
const IM_END: u32 = 258;

impl Builtin {
    /// Parses `builtin:tiny` / `builtin:small`.
    pub fn parse(name: &str) -> Option<Builtin> {
        match name {
            "builtin:tiny" => Some(Builtin::Tiny),
            "builtin:small" => Some(Builtin::Small),
            _ => None,
        }
    }

    /// The name users type.
    pub fn name(self) -> &'static str {
        match self {
            Builtin::Tiny => "builtin:tiny",
            Builtin::Small => "builtin:small",
        }
    }

    /// Hyper-parameters.
    pub fn config(self) -> ModelConfig {
        let common = ModelConfig {
            architecture: Architecture::Llama,
            vocab_size: 288,
            hidden_size: 64,
            intermediate_size: 176,
            num_layers: 4,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            sliding_window: None,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            qkv_bias: false,
            bos_token_id: None,
            eos_token_ids: vec![IM_END, ENDOFTEXT],
        };
        match self {
            Builtin::Tiny => common,
            Builtin::Small => ModelConfig {
                vocab_size: 512,
                hidden_size: 576,
                intermediate_size: 1536,
                num_layers: 30,
                num_heads: 9,
                num_kv_heads: 3,
                head_dim: 64,
                rope_theta: 100_000.0,
                max_position_embeddings: 8192,
                tie_word_embeddings: true,
                ..common
            },
        }
    }

    /// Deterministic weights, named as Hugging Face names them.
    pub fn tensors(self) -> TensorMap {
        weights_for(&self.config(), BUILTIN_SEED)
    }

    /// The byte-level tokenizer, sized to the vocabulary.
    pub fn tokenizer(self) -> Result<Tokenizer, ModelError> {
        Tokenizer::byte_level(self.config().vocab_size)
    }

    /// ChatML.
    pub fn chat_template(self) -> Result<ChatTemplate, ModelError> {
        ChatTemplate::new(CHATML, "", BUILTIN_SPECIALS[2])
    }

    /// Writes the model as a Hugging Face directory: `config.json`,
    /// safetensors (`shards` files), `tokenizer.json`, `tokenizer_config.json`.
    pub fn export(self, dir: &Path, shards: usize, dtype: DiskDtype) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let config_path = dir.join("config.json");
        std::fs::write(&config_path, self.config().to_hf_json())
            .map_err(|e| ModelError::io(&config_path, e))?;
        self.tensors().save_dir(dir, shards, dtype)?;
        self.tokenizer()?.save(&dir.join("tokenizer.json"))?;
        let tokenizer_config = serde_json::json!({
            "chat_template": CHATML,
            "bos_token": null,
            "eos_token": BUILTIN_SPECIALS[2],
            "model_max_length": self.config().max_position_embeddings,
        });
        let path = dir.join("tokenizer_config.json");
        let text = serde_json::to_string_pretty(&tokenizer_config)
            .expect("a JSON value always serialises");
        std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))
    }
}

/// Random weights for any config: uniform in ±1/√fan_in for projections,
/// ±0.5 for embeddings, 1 ± 0.1 for norms. Each tensor draws from its own
/// stream, so one tensor's values do not depend on the others' sizes.
pub fn weights_for(c: &ModelConfig, seed: u64) -> TensorMap {
    let mut map = TensorMap::new(format!("seed {seed:#x}"));
    let mut stream = 0u64;
    let mut add = |name: String, shape: Vec<usize>, centre: f32, spread: f32| {
        stream += 1;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        let len = shape.iter().product();
        let data = (0..len)
            .map(|_| centre + spread * (rng.random::<f32>() * 2.0 - 1.0))
            .collect();
        map.insert(name, Tensor { shape, data });
    };
    let h = c.hidden_size;
    let proj = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    // Gemma's norms scale by `1 + w` (Hugging Face's convention): centred on 0.
    let gemma = c.architecture == crate::Architecture::Gemma3;
    let norm_centre = if gemma { 0.0 } else { 1.0 };
    add(
        "model.embed_tokens.weight".into(),
        vec![c.vocab_size, h],
        0.0,
        0.5,
    );
    for i in 0..c.num_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        add(p("input_layernorm.weight"), vec![h], norm_centre, 0.1);
        if c.architecture.qk_norm() {
            add(
                p("self_attn.q_norm.weight"),
                vec![c.head_dim],
                norm_centre,
                0.1,
            );
            add(
                p("self_attn.k_norm.weight"),
                vec![c.head_dim],
                norm_centre,
                0.1,
            );
        }
        add(
            p("self_attn.q_proj.weight"),
            vec![c.q_dim(), h],
            0.0,
            proj(h),
        );
        add(
            p("self_attn.k_proj.weight"),
            vec![c.kv_dim(), h],
            0.0,
            proj(h),
        );
        add(
            p("self_attn.v_proj.weight"),
            vec![c.kv_dim(), h],
            0.0,
            proj(h),
        );
        if c.qkv_bias {
            add(p("self_attn.q_proj.bias"), vec![c.q_dim()], 0.0, 0.1);
            add(p("self_attn.k_proj.bias"), vec![c.kv_dim()], 0.0, 0.1);
            add(p("self_attn.v_proj.bias"), vec![c.kv_dim()], 0.0, 0.1);
        }
        add(
            p("self_attn.o_proj.weight"),
            vec![h, c.q_dim()],
            0.0,
            proj(c.q_dim()),
        );
        add(
            p("post_attention_layernorm.weight"),
            vec![h],
            norm_centre,
            0.1,
        );
        if c.architecture.post_norms() {
            add(
                p("pre_feedforward_layernorm.weight"),
                vec![h],
                norm_centre,
                0.1,
            );
            add(
                p("post_feedforward_layernorm.weight"),
                vec![h],
                norm_centre,
                0.1,
            );
        }
        add(
            p("mlp.gate_proj.weight"),
            vec![c.intermediate_size, h],
            0.0,
            proj(h),
        );
        add(
            p("mlp.up_proj.weight"),
            vec![c.intermediate_size, h],
            0.0,
            proj(h),
        );
        add(
            p("mlp.down_proj.weight"),
            vec![h, c.intermediate_size],
            0.0,
            proj(c.intermediate_size),
        );
    }
    add("model.norm.weight".into(), vec![h], norm_centre, 0.1);
    if !c.tie_word_embeddings {
        add("lm_head.weight".into(), vec![c.vocab_size, h], 0.0, proj(h));
    }
    map
}
