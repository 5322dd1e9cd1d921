//! [`ModelConfig`]: a decoder's hyper-parameters, read from a Hugging Face
//! `config.json` or built in, and checked for consistency once, here.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::ModelError;
use crate::gguf::{GgufFile, Value};

/// The Llama-family variants the runtime implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2/3, SmolLM).
    Llama,
    /// `MistralForCausalLM`.
    Mistral,
    /// `Qwen2ForCausalLM`: biases on the Q, K and V projections.
    Qwen2,
    /// `Qwen3ForCausalLM`: queries and keys RMS-normalised per head.
    Qwen3,
    /// Phi-3 (`phi3` in GGUF): Llama's computation with Q, K and V in one
    /// matrix and the gate and up projections in another.
    Phi3,
    /// Gemma 3 (`gemma3` in GGUF): queries and keys RMS-normalised per
    /// head, attention and MLP outputs normalised again before the
    /// residual, a tanh-GELU gate, embeddings scaled by √hidden, and
    /// sliding-window layers interleaved with global ones.
    Gemma3,
}

/// The MLP's gate activation: `down(act(gate(x)) · up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x · σ(x)` (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU), as ggml and `gelu_pytorch_tanh` compute it.
    GeluTanh,
}

/// Layers that attend only to the most recent positions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    /// Positions a local layer's row sees: its own and the `window − 1`
    /// before it (llama.cpp's "standard" window).
    pub window: usize,
    /// Layer `i` is local unless `i % period == period − 1` (global); `0`
    /// makes every layer local. Gemma 3 has five local layers per global
    /// one (`period` 6), as llama.cpp defines it.
    pub period: usize,
    /// RoPE base of the local layers (global layers use the model's).
    pub local_rope_theta: f32,
}

impl Architecture {
    /// Those a Hugging Face directory's `config.json` loads as; Phi-3 and
    /// Gemma 3 load from GGUF files only.
    const FROM_HF: [Architecture; 4] = [
        Architecture::Llama,
        Architecture::Mistral,
        Architecture::Qwen2,
        Architecture::Qwen3,
    ];

    /// Those a GGUF file loads as (Mistral's files say `llama`).
    const FROM_GGUF: [Architecture; 5] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Phi3,
        Architecture::Gemma3,
    ];

    /// The one of `from` that `name_of` calls `wanted`; else an error
    /// naming `path` and listing what `from` is called.
    fn named(
        from: &[Architecture],
        name_of: fn(Architecture) -> &'static str,
        wanted: &str,
        path: &Path,
    ) -> Result<Architecture, ModelError> {
        from.iter()
            .copied()
            .find(|&a| name_of(a) == wanted)
            .ok_or_else(|| ModelError::UnsupportedArchitecture {
                path: path.into(),
                architecture: wanted.to_string(),
                supported: from
                    .iter()
                    .map(|&a| name_of(a))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The name `config.json` uses.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Phi3 => "Phi3ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// The name GGUF files use (`general.architecture`) and the prefix of
    /// their hyper-parameter keys.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Architecture::Llama | Architecture::Mistral => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Phi3 => "phi3",
            Architecture::Gemma3 => "gemma3",
        }
    }

    /// Whether queries and keys are RMS-normalised per head before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Architecture::Gemma3 | Architecture::Qwen3)
    }

    /// Whether the attention and MLP outputs are RMS-normalised before
    /// they join the residual stream.
    pub fn post_norms(self) -> bool {
        self == Architecture::Gemma3
    }

    /// The MLP's gate activation.
    pub fn activation(self) -> Activation {
        match self {
            Architecture::Gemma3 => Activation::GeluTanh,
            _ => Activation::Silu,
        }
    }

    /// Whether token embeddings are multiplied by √hidden before the first layer.
    pub fn scales_embeddings(self) -> bool {
        self == Architecture::Gemma3
    }

    /// Whether llama.cpp's converter reordered each head's Q and K rows
    /// for its pairwise RoPE (the `llama` family); Qwen's and Gemma's
    /// files keep Hugging Face's order, rotated by halves as this runtime
    /// does (llama.cpp's "NEOX" RoPE).
    pub fn gguf_permutes_rope(self) -> bool {
        matches!(self, Architecture::Llama | Architecture::Mistral)
    }
}

/// Llama-3 style RoPE frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    /// Overall scale factor.
    pub factor: f32,
    /// Wavelengths above `original / low_freq_factor` are scaled fully.
    pub low_freq_factor: f32,
    /// Wavelengths below `original / high_freq_factor` are not scaled.
    pub high_freq_factor: f32,
    /// Context the model was pre-trained at.
    pub original_max_position_embeddings: usize,
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Variant.
    pub architecture: Architecture,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// Optional Llama-3 RoPE scaling.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Sliding-window attention, if some layers use it.
    pub sliding_window: Option<SlidingWindow>,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// Whether `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether Q, K and V projections have biases.
    pub qkv_bias: bool,
    /// Beginning-of-sequence token, if the model uses one.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
}

/// Most attention heads (query or key/value) a model may have: eight times
/// the largest open models' (128).
const MAX_HEADS: usize = 1024;
/// Most elements a head may have (open models use 64 to 256).
const MAX_HEAD_DIM: usize = 4096;
/// Most elements a hidden or intermediate activation row may have: the
/// largest open models' are 16,384 and 53,248.
const MAX_WIDTH: usize = 1 << 20;

/// The subset of `config.json` kvfence reads. Unknown fields are ignored.
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    rope_theta: f32,
    rope_scaling: Option<serde_json::Value>,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<serde_json::Value>,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f32 {
    10_000.0
}
fn default_max_pos() -> usize {
    2048
}

impl ModelConfig {
    /// Reads and checks a Hugging Face `config.json`.
    pub fn from_hf_file(path: &Path) -> Result<ModelConfig, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_hf_json(&text, path)
    }

    /// Parses and checks `config.json` text; `path` is named in errors.
    pub fn from_hf_json(text: &str, path: &Path) -> Result<ModelConfig, ModelError> {
        let hf: HfConfig = serde_json::from_str(text)
            .map_err(|e| ModelError::config(path, format!("invalid config.json: {e}")))?;
        let name = hf.architectures.first().cloned().unwrap_or_default();
        let architecture =
            Architecture::named(&Architecture::FROM_HF, Architecture::hf_name, &name, path)?;
        let rope_scaling = match hf.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(value) => Some(parse_rope_scaling(&value, path)?),
        };
        let eos_token_ids = match hf.eos_token_id {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(value) => serde_json::from_value::<EosIds>(value)
                .map_err(|e| ModelError::config(path, format!("eos_token_id: {e}")))?
                .into_vec(),
        };
        let num_kv_heads = hf.num_key_value_heads.unwrap_or(hf.num_attention_heads);
        let config = ModelConfig {
            architecture,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads,
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
            rope_scaling,
            sliding_window: None,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings,
            qkv_bias: architecture == Architecture::Qwen2 || hf.attention_bias,
            bos_token_id: hf.bos_token_id,
            eos_token_ids,
        };
        config.validate(path)?;
        Ok(config)
    }

    /// Reads and checks the hyper-parameters of a `llama`, `qwen2`,
    /// `qwen3`, `phi3` or `gemma3` GGUF file from its metadata, as llama.cpp's
    /// loader reads them.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig, ModelError> {
        let path = file.path();
        let arch = file.str("general.architecture")?;
        let architecture = Architecture::named(
            &Architecture::FROM_GGUF,
            Architecture::gguf_name,
            arch,
            path,
        )?;
        if file.has_tensor("blk.0.rope_factors_long.weight")
            || file.has_tensor("rope_factors_long.weight")
        {
            return Err(ModelError::gguf(
                path,
                "LongRoPE factors (rope_factors_long/short, Phi-3 128k) are not supported",
            ));
        }
        let key = |name: &str| format!("{arch}.{name}");
        let count = |name: &str| -> Result<usize, ModelError> {
            usize::try_from(file.u64(&key(name))?)
                .map_err(|_| ModelError::config(path, format!("{name} does not fit in memory")))
        };
        let hidden_size = count("embedding_length")?;
        let num_heads = count("attention.head_count")?;
        let head_dim = match file.get(&key("attention.key_length")) {
            Some(_) => count("attention.key_length")?,
            None => hidden_size / num_heads.max(1),
        };
        if let Some(rotary) = file
            .get(&key("rope.dimension_count"))
            .and_then(|v| v.as_u64())
            && rotary as usize != head_dim
        {
            return Err(ModelError::gguf(
                path,
                format!("partial RoPE ({rotary} of {head_dim} dimensions) is not supported"),
            ));
        }
        let vocab_size = match file.get(&key("vocab_size")) {
            Some(_) => count("vocab_size")?,
            None => file.strings("tokenizer.ggml.tokens")?.len(),
        };
        let token = |name: &str| -> Option<u32> {
            file.get(&format!("tokenizer.ggml.{name}"))
                .and_then(|v| v.as_u64())
                .and_then(|v| u32::try_from(v).ok())
        };
        let adds_bos = matches!(
            file.get("tokenizer.ggml.add_bos_token"),
            Some(Value::Bool(true))
        );
        let mut eos_token_ids: Vec<u32> = ["eos_token_id", "eot_token_id"]
            .iter()
            .filter_map(|name| token(name))
            .collect();
        if architecture == Architecture::Gemma3 {
            // Gemma ends a turn with `<end_of_turn>`, which llama.cpp
            // recognises by its text as an end of generation.
            let tokens = file.strings("tokenizer.ggml.tokens")?;
            eos_token_ids.extend(
                tokens
                    .iter()
                    .position(|t| *t == "<end_of_turn>")
                    .and_then(|id| u32::try_from(id).ok()),
            );
        }
        eos_token_ids.dedup();
        let sliding_window = match architecture {
            Architecture::Gemma3 => {
                if let Some(factor) = file
                    .get(&key("rope.scaling.factor"))
                    .and_then(Value::as_f64)
                    && factor != 1.0
                {
                    return Err(ModelError::gguf(
                        path,
                        format!("RoPE scaling (factor {factor}) is not supported for gemma3"),
                    ));
                }
                Some(SlidingWindow {
                    window: count("attention.sliding_window")?,
                    period: 6,
                    local_rope_theta: 10_000.0,
                })
            }
            _ => None,
        };
        let config = ModelConfig {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size: count("feed_forward_length")?,
            num_layers: count("block_count")?,
            num_heads,
            num_kv_heads: match file.get(&key("attention.head_count_kv")) {
                Some(_) => count("attention.head_count_kv")?,
                None => num_heads,
            },
            head_dim,
            rms_norm_eps: file.f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            rope_theta: match file.get(&key("rope.freq_base")) {
                Some(_) => file.f64(&key("rope.freq_base"))? as f32,
                None => default_theta(),
            },
            rope_scaling: None,
            sliding_window,
            max_position_embeddings: count("context_length")?,
            tie_word_embeddings: !file.has_tensor("output.weight"),
            qkv_bias: file.has_tensor("blk.0.attn_q.bias"),
            bos_token_id: if adds_bos {
                token("bos_token_id")
            } else {
                None
            },
            eos_token_ids,
        };
        config.validate(path)?;
        Ok(config)
    }

    /// Checks that the numbers describe a model the runtime can run.
    pub fn validate(&self, path: &Path) -> Result<(), ModelError> {
        let fail = |reason: String| Err(ModelError::config(path, reason));
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return fail(format!("{name} must be positive"));
        }
        // The file's word on sizes is checked before anything is sized by
        // it: a count of 2^40 layers made the loader abort on an
        // allocation of terabytes.
        let bounded = [
            (
                "num_hidden_layers",
                self.num_layers,
                kvfence_pool::MAX_LAYERS,
            ),
            ("num_attention_heads", self.num_heads, MAX_HEADS),
            ("num_key_value_heads", self.num_kv_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_HEAD_DIM),
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
        ];
        if let Some((name, value, most)) = bounded.iter().find(|(_, v, most)| v > most) {
            return fail(format!(
                "{name} ({value}) is more than this runtime runs (at most {most})"
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return fail(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return fail(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim
            ));
        }
        if u32::try_from(self.vocab_size).is_err() {
            return fail(format!("vocab_size {} exceeds u32", self.vocab_size));
        }
        if !(self.rms_norm_eps > 0.0 && self.rope_theta > 0.0) {
            return fail("rms_norm_eps and rope_theta must be positive".into());
        }
        if let Some(sliding) = &self.sliding_window {
            if !(sliding.window > 0 && sliding.local_rope_theta > 0.0) {
                return fail("a sliding window and its RoPE base must be positive".into());
            }
            if sliding.window > kvfence_pool::MAX_SPAN {
                return fail(format!(
                    "sliding window ({}) is more than this runtime runs (at most {})",
                    sliding.window,
                    kvfence_pool::MAX_SPAN
                ));
            }
        }
        if let Some(&bad) = self
            .eos_token_ids
            .iter()
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return fail(format!("eos token {bad} is outside the vocabulary"));
        }
        Ok(())
    }

    /// The config as Hugging Face `config.json` text, for export.
    pub fn to_hf_json(&self) -> String {
        let mut json = serde_json::json!({
            "architectures": [self.architecture.hf_name()],
            "model_type": match self.architecture {
                Architecture::Llama => "llama",
                Architecture::Mistral => "mistral",
                Architecture::Qwen2 => "qwen2",
                Architecture::Qwen3 => "qwen3",
                Architecture::Phi3 => "phi3",
                Architecture::Gemma3 => "gemma3_text",
            },
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "torch_dtype": "float32",
        });
        if let Some(scaling) = self.rope_scaling {
            json["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3",
                "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings,
            });
        }
        serde_json::to_string_pretty(&json).expect("a JSON value always serialises")
    }

    /// How many positions a row of `layer` attends to, counting its own:
    /// the window for a sliding-window layer, `None` (all of them) for a
    /// global one.
    pub fn attention_window(&self, layer: usize) -> Option<usize> {
        let sliding = self.sliding_window.as_ref()?;
        let global = sliding.period > 0 && layer % sliding.period == sliding.period - 1;
        (!global).then_some(sliding.window)
    }

    /// Output width of the Q projection.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Output width of each of the K and V projections.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Multiply-adds of one token through every layer's matrices (Q, K,
    /// V, output, gate, up, down): what a prompt token costs to compute.
    pub fn layer_macs_per_token(&self) -> usize {
        let h = self.hidden_size;
        let attention = h * (self.q_dim() + 2 * self.kv_dim()) + self.q_dim() * h;
        let mlp = 3 * h * self.intermediate_size;
        self.num_layers * (attention + mlp)
    }

    /// Multiply-adds of one token's logits (the output projection).
    pub fn logit_macs_per_token(&self) -> usize {
        self.vocab_size * self.hidden_size
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum EosIds {
    One(u32),
    Many(Vec<u32>),
}

impl EosIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            EosIds::One(id) => vec![id],
            EosIds::Many(ids) => ids,
        }
    }
}

fn parse_rope_scaling(
    value: &serde_json::Value,
    path: &Path,
) -> Result<Llama3RopeScaling, ModelError> {
    let kind = value
        .get("rope_type")
        .or_else(|| value.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("");
    if kind != "llama3" {
        return Err(ModelError::config(
            path,
            format!("rope_scaling type {kind:?} is not supported (only llama3)"),
        ));
    }
    serde_json::from_value(value.clone())
        .map_err(|e| ModelError::config(path, format!("rope_scaling: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": true,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"
    }"#;

    #[test]
    fn reads_a_smollm_config() {
        let c = ModelConfig::from_hf_json(SMOL, Path::new("config.json")).unwrap();
        assert_eq!(
            (c.head_dim, c.num_kv_heads, c.eos_token_ids.clone()),
            (64, 3, vec![2])
        );
        assert!(c.tie_word_embeddings && !c.qkv_bias);
        let again = ModelConfig::from_hf_json(&c.to_hf_json(), Path::new("x")).unwrap();
        assert_eq!(again, c, "export round-trips");
    }

    #[test]
    fn qwen2_has_qkv_bias_and_llama3_scaling_is_read() {
        let text = SMOL.replace("LlamaForCausalLM", "Qwen2ForCausalLM").replace(
            "\"bos_token_id\": 1",
            "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}, \"bos_token_id\": 1",
        );
        let c = ModelConfig::from_hf_json(&text, Path::new("c")).unwrap();
        assert!(c.qkv_bias);
        assert_eq!(c.rope_scaling.unwrap().factor, 8.0);
    }

    /// A GGUF file's sliding window past what the pool counts in is
    /// refused with the file, as every other size is.
    #[test]
    fn a_window_too_long_to_count_is_refused() {
        let mut c = ModelConfig::from_hf_json(SMOL, Path::new("config.json")).unwrap();
        let path = Path::new("/m/gemma.gguf");
        for (window, refused) in [
            (512, false),
            (kvfence_pool::MAX_SPAN, false),
            (kvfence_pool::MAX_SPAN + 1, true),
            (usize::MAX, true),
        ] {
            c.sliding_window = Some(SlidingWindow {
                window,
                period: 6,
                local_rope_theta: 10_000.0,
            });
            match c.validate(path) {
                Ok(()) => assert!(!refused, "{window} accepted"),
                Err(error) => {
                    let error = error.to_string();
                    assert!(refused, "{window}: {error}");
                    assert!(
                        error.contains("sliding window") && error.contains("gemma.gguf"),
                        "{error}"
                    );
                }
            }
        }
    }

    #[test]
    fn unsupported_architecture_and_bad_shapes_are_named() {
        let gpt = SMOL.replace("LlamaForCausalLM", "GPT2LMHeadModel");
        let err = ModelConfig::from_hf_json(&gpt, Path::new("/m/config.json")).unwrap_err();
        assert!(
            err.to_string().contains("GPT2LMHeadModel")
                && err.to_string().contains("/m/config.json")
        );
        // It lists exactly what a config.json does load as.
        for name in [
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
        ] {
            assert!(err.to_string().contains(name), "{err}");
            let text = SMOL.replace("LlamaForCausalLM", name);
            ModelConfig::from_hf_json(&text, Path::new("c")).unwrap();
        }
        let bad = SMOL.replace("\"num_key_value_heads\": 3", "\"num_key_value_heads\": 4");
        assert!(
            ModelConfig::from_hf_json(&bad, Path::new("c"))
                .unwrap_err()
                .to_string()
                .contains("multiple")
        );
    }
}
