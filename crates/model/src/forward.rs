//! [`Model`]: a Llama-family decoder whose KV cache lives in fenced pool
//! pages. Each forward pass takes a batch of sequences — prefill chunks and
//! decode steps mixed — writes every new token's K and V into that
//! sequence's own lease, in the pool's element type (f32, f16 or bf16), and
//! reads attention context only through the lease's coverage-checked views
//! (I2), chunk by chunk ([`crate::attention`]). A read the pool refuses is an
//! error, never a computation.

use half::{bf16, f16};
use kvfence_pool::{ElemType, KvShape, LayerGroups, Lease, ReadView};

use crate::attention::{self, KvValue, SequenceQueries};
use crate::awake;
use crate::config::{Activation, Architecture, ModelConfig};
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::kernels::{self, Matrix, PackedMatrix, Rope};
use crate::quant::QuantMatrix;
use crate::tensors::TensorMap;

/// Which logits a sequence wants back from a forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last token's row only (the usual case).
    Last,
    /// Every token's row (scoring, tests).
    All,
}

/// One sequence's part of a batch: `tokens` at positions
/// `past..past + tokens.len()`, whose KV goes into `lease`.
#[derive(Debug)]
pub struct Sequence<'a> {
    /// The sequence's pages; positions `0..past` must already be written.
    pub lease: &'a mut Lease,
    /// Tokens already in the KV cache.
    pub past: usize,
    /// New tokens to run.
    pub tokens: &'a [u32],
    /// Which logits to return.
    pub logits: Logits,
}

/// A forward pass in progress ([`Model::begin`], [`Model::resume`]): the
/// batch's residual stream after the layers run so far, and what every
/// layer needs of the batch. It holds no lease: the batch is lent again to
/// each [`Model::resume`], which checks it is the same.
pub struct Pass {
    /// Each sequence's `(past, tokens)`, to check the batch against.
    shape: Vec<(usize, usize)>,
    /// Each sequence's first error; from then on its rows are computed
    /// from zeros and thrown away.
    failed: Vec<Option<ModelError>>,
    global_tables: (Vec<f32>, Vec<f32>),
    local_tables: Option<(Vec<f32>, Vec<f32>)>,
    /// The next layer to run, of `layers`.
    next_layer: usize,
    layers: usize,
    /// The residual stream, `[rows][hidden]`.
    x: Vec<f32>,
}

impl Pass {
    /// Token rows in the batch.
    pub fn rows(&self) -> usize {
        self.shape.iter().map(|&(_, n)| n).sum()
    }

    /// Layers already run.
    pub fn layers_done(&self) -> usize {
        self.next_layer
    }

    /// What is left to compute, in rows of a whole pass: the rows times
    /// the share of layers not yet run (rounded up).
    pub fn rows_left(&self) -> usize {
        (self.rows() * (self.layers - self.next_layer)).div_ceil(self.layers)
    }
}

impl std::fmt::Debug for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pass")
            .field("shape", &self.shape)
            .field("next_layer", &self.next_layer)
            .finish_non_exhaustive()
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    /// Per-head RMSNorm weights of queries and keys (`[head_dim]` each),
    /// for architectures that normalise them (Gemma 3).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// RMSNorm weights of the attention and MLP outputs, for architectures
    /// that normalise them before the residual add (Gemma 3).
    post_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// Q, K and V projections stacked: `[q_dim + 2 * kv_dim][hidden]`.
    qkv: Matrix,
    qkv_bias: Option<Vec<f32>>,
    o: Matrix,
    mlp_norm: Vec<f32>,
    /// Gate and up projections stacked: `[2 * intermediate][hidden]`.
    gate_up: Matrix,
    down: Matrix,
}

/// The token embedding table, `[vocab][hidden]`, in its loaded encoding.
enum Embedding {
    Dense(Vec<f32>),
    Quant(QuantMatrix),
}

impl Embedding {
    fn push_row(&self, token: usize, hidden: usize, out: &mut Vec<f32>) {
        match self {
            Embedding::Dense(table) => {
                out.extend_from_slice(&table[token * hidden..(token + 1) * hidden])
            }
            Embedding::Quant(table) => {
                let start = out.len();
                out.resize(start + hidden, 0.0);
                table.dequantize_row(token, &mut out[start..]);
            }
        }
    }
}

/// A loaded decoder, ready to run.
pub struct Model {
    config: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Matrix,
    rope: Rope,
    /// RoPE of the sliding-window layers, when their base differs.
    local_rope: Option<Rope>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .finish()
    }
}

fn stack(parts: &[&[f32]]) -> Vec<f32> {
    parts.concat()
}

fn dense(w: &[f32], n: usize, k: usize) -> Matrix {
    Matrix::Dense(PackedMatrix::from_rows(w, n, k))
}

/// The RoPE tables of global layers and, when the sliding-window layers
/// rotate with another base, theirs.
fn ropes(c: &ModelConfig) -> (Rope, Option<Rope>) {
    let global = Rope::new(c.head_dim, c.rope_theta, c.rope_scaling.as_ref());
    let local = c
        .sliding_window
        .filter(|s| s.local_rope_theta != c.rope_theta)
        .map(|s| Rope::new(c.head_dim, s.local_rope_theta, None));
    (global, local)
}

/// llama.cpp's converter reorders each head's Q and K rows so that RoPE
/// rotates adjacent pairs; this runtime rotates halves, as Hugging Face
/// does. Row `2j + i` of a GGUF head is row `i * head_dim / 2 + j` of the
/// Hugging Face head; this puts them back.
fn unpermute_rope_rows(data: &[u8], heads: usize, head_dim: usize, row_bytes: usize) -> Vec<u8> {
    let mut out = vec![0; data.len()];
    let half = head_dim / 2;
    for head in 0..heads {
        for i in 0..2 {
            for j in 0..half {
                let from = head * head_dim + 2 * j + i;
                let to = head * head_dim + i * half + j;
                out[to * row_bytes..(to + 1) * row_bytes]
                    .copy_from_slice(&data[from * row_bytes..(from + 1) * row_bytes]);
            }
        }
    }
    out
}

impl Model {
    /// Builds the model from Hugging Face-named tensors, checking every shape.
    pub fn from_tensors(config: ModelConfig, tensors: &TensorMap) -> Result<Model, ModelError> {
        let c = &config;
        let h = c.hidden_size;
        let embed = tensors
            .get("model.embed_tokens.weight", &[c.vocab_size, h])?
            .data
            .clone();
        let gemma = c.architecture == Architecture::Gemma3;
        // Hugging Face's Gemma norms scale by `1 + w`; llama.cpp's converter
        // adds the one when it writes GGUF, so the runtime multiplies by `w`.
        let norm = |name: &str, len: usize| -> Result<Vec<f32>, ModelError> {
            let w = &tensors.get(name, &[len])?.data;
            Ok(if gemma {
                w.iter().map(|v| v + 1.0).collect()
            } else {
                w.clone()
            })
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let name = |suffix: &str| format!("model.layers.{i}.{suffix}");
            let weight = |suffix: &str, shape: &[usize]| -> Result<&[f32], ModelError> {
                Ok(&tensors.get(&name(suffix), shape)?.data)
            };
            let qk_norm = if c.architecture.qk_norm() {
                Some((
                    norm(&name("self_attn.q_norm.weight"), c.head_dim)?,
                    norm(&name("self_attn.k_norm.weight"), c.head_dim)?,
                ))
            } else {
                None
            };
            // Gemma names the MLP's input norm `pre_feedforward_layernorm`
            // and uses `post_attention_layernorm` for the attention output.
            let (mlp_norm, post_norms) = if c.architecture.post_norms() {
                (
                    norm(&name("pre_feedforward_layernorm.weight"), h)?,
                    Some((
                        norm(&name("post_attention_layernorm.weight"), h)?,
                        norm(&name("post_feedforward_layernorm.weight"), h)?,
                    )),
                )
            } else {
                (norm(&name("post_attention_layernorm.weight"), h)?, None)
            };
            let q = weight("self_attn.q_proj.weight", &[c.q_dim(), h])?;
            let k = weight("self_attn.k_proj.weight", &[c.kv_dim(), h])?;
            let v = weight("self_attn.v_proj.weight", &[c.kv_dim(), h])?;
            let qkv_bias = if c.qkv_bias {
                Some(stack(&[
                    weight("self_attn.q_proj.bias", &[c.q_dim()])?,
                    weight("self_attn.k_proj.bias", &[c.kv_dim()])?,
                    weight("self_attn.v_proj.bias", &[c.kv_dim()])?,
                ]))
            } else {
                None
            };
            let gate = weight("mlp.gate_proj.weight", &[c.intermediate_size, h])?;
            let up = weight("mlp.up_proj.weight", &[c.intermediate_size, h])?;
            layers.push(Layer {
                attn_norm: norm(&name("input_layernorm.weight"), h)?,
                qk_norm,
                post_norms,
                qkv: dense(&stack(&[q, k, v]), c.q_dim() + 2 * c.kv_dim(), h),
                qkv_bias,
                o: dense(
                    weight("self_attn.o_proj.weight", &[h, c.q_dim()])?,
                    h,
                    c.q_dim(),
                ),
                mlp_norm,
                gate_up: dense(&stack(&[gate, up]), 2 * c.intermediate_size, h),
                down: dense(
                    weight("mlp.down_proj.weight", &[h, c.intermediate_size])?,
                    h,
                    c.intermediate_size,
                ),
            });
        }
        let lm_head = if c.tie_word_embeddings {
            dense(&embed, c.vocab_size, h)
        } else {
            dense(
                &tensors.get("lm_head.weight", &[c.vocab_size, h])?.data,
                c.vocab_size,
                h,
            )
        };
        let (rope, local_rope) = ropes(c);
        Ok(Model {
            norm: norm("model.norm.weight", h)?,
            rope,
            local_rope,
            embed: Embedding::Dense(embed),
            layers,
            lm_head,
            config,
        })
    }

    /// Builds the model from a llama.cpp-named GGUF file, keeping every
    /// weight matrix in its encoding. `config` comes from the same file
    /// ([`ModelConfig::from_gguf`]).
    pub fn from_gguf(config: ModelConfig, file: &GgufFile) -> Result<Model, ModelError> {
        let c = &config;
        let h = c.hidden_size;
        // GGUF lists dimensions input-first: a `[out][in]` matrix is `[in, out]`.
        let matrix = |name: &str, out: usize, inp: usize| -> Result<QuantMatrix, ModelError> {
            let (info, data) = file.tensor(name, &[inp, out])?;
            Ok(QuantMatrix::new(info.format, out, inp, data.to_vec()))
        };
        let rope_rows = |name: &str, heads: usize| -> Result<QuantMatrix, ModelError> {
            if !c.architecture.gguf_permutes_rope() {
                return matrix(name, heads * c.head_dim, h);
            }
            let (info, data) = file.tensor(name, &[h, heads * c.head_dim])?;
            let row_bytes = info.format.row_bytes(h);
            let data = unpermute_rope_rows(data, heads, c.head_dim, row_bytes);
            Ok(QuantMatrix::new(info.format, heads * c.head_dim, h, data))
        };
        let vector = |name: &str, len: usize| -> Result<Vec<f32>, ModelError> {
            let (info, data) = file.tensor(name, &[len])?;
            let mut out = vec![0.0; len];
            crate::quant::dequantize_row(info.format, data, &mut out);
            Ok(out)
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let name = |suffix: &str| format!("blk.{i}.{suffix}");
            let qkv_bias = if c.qkv_bias {
                Some(stack(&[
                    &vector(&name("attn_q.bias"), c.q_dim())?,
                    &vector(&name("attn_k.bias"), c.kv_dim())?,
                    &vector(&name("attn_v.bias"), c.kv_dim())?,
                ]))
            } else {
                None
            };
            let qk_norm = if c.architecture.qk_norm() {
                Some((
                    vector(&name("attn_q_norm.weight"), c.head_dim)?,
                    vector(&name("attn_k_norm.weight"), c.head_dim)?,
                ))
            } else {
                None
            };
            let post_norms = if c.architecture.post_norms() {
                Some((
                    vector(&name("post_attention_norm.weight"), h)?,
                    vector(&name("post_ffw_norm.weight"), h)?,
                ))
            } else {
                None
            };
            // Phi-3 files fuse Q, K and V into one matrix, and the gate and
            // up projections into `ffn_up` (gate rows first).
            let qkv = if file.has_tensor(&name("attn_qkv.weight")) {
                matrix(&name("attn_qkv.weight"), c.q_dim() + 2 * c.kv_dim(), h)?
            } else {
                QuantMatrix::stack(vec![
                    rope_rows(&name("attn_q.weight"), c.num_heads)?,
                    rope_rows(&name("attn_k.weight"), c.num_kv_heads)?,
                    matrix(&name("attn_v.weight"), c.kv_dim(), h)?,
                ])
            };
            let gate_up = if file.has_tensor(&name("ffn_gate.weight")) {
                QuantMatrix::stack(vec![
                    matrix(&name("ffn_gate.weight"), c.intermediate_size, h)?,
                    matrix(&name("ffn_up.weight"), c.intermediate_size, h)?,
                ])
            } else {
                matrix(&name("ffn_up.weight"), 2 * c.intermediate_size, h)?
            };
            layers.push(Layer {
                attn_norm: vector(&name("attn_norm.weight"), h)?,
                qk_norm,
                post_norms,
                qkv: Matrix::Quant(qkv),
                qkv_bias,
                o: Matrix::Quant(matrix(&name("attn_output.weight"), h, c.q_dim())?),
                mlp_norm: vector(&name("ffn_norm.weight"), h)?,
                gate_up: Matrix::Quant(gate_up),
                down: Matrix::Quant(matrix(&name("ffn_down.weight"), h, c.intermediate_size)?),
            });
        }
        let embed = matrix("token_embd.weight", c.vocab_size, h)?;
        let lm_head = if file.has_tensor("output.weight") {
            matrix("output.weight", c.vocab_size, h)?
        } else {
            embed.clone()
        };
        let (mut rope, local_rope) = ropes(c);
        if file.has_tensor("rope_freqs.weight") {
            let factors = vector("rope_freqs.weight", c.head_dim / 2)?;
            if !factors.iter().all(|f| f.is_finite() && *f > 0.0) {
                return Err(ModelError::gguf(
                    file.path(),
                    "rope_freqs.weight holds a factor that is not a positive number",
                ));
            }
            rope = rope.with_frequency_factors(&factors);
        }
        Ok(Model {
            norm: vector("output_norm.weight", h)?,
            rope,
            local_rope,
            embed: Embedding::Quant(embed),
            layers,
            lm_head: Matrix::Quant(lm_head),
            config,
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The per-token KV shape a pool for this model must have.
    pub fn kv_shape(&self) -> KvShape {
        Self::kv_shape_of(&self.config)
    }

    /// The per-token KV shape of a model with `config`.
    pub fn kv_shape_of(config: &ModelConfig) -> KvShape {
        KvShape {
            layers: config.num_layers,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
        }
    }

    /// How this model's layers share a KV pool's pages when its leases
    /// keep only the windows of sliding-window layers: global layers and
    /// windowed ones in groups of one size, reads starting at
    /// [`attention::CHUNK`] granules (what the kernel reads). `max_run` is
    /// the most positions one pass writes for one sequence. One group of
    /// every layer for a model without sliding windows.
    pub fn layer_groups(&self, max_run: usize) -> Result<LayerGroups, ModelError> {
        Model::layer_groups_of(&self.config, max_run)
    }

    /// [`Model::layer_groups`] of a configuration.
    pub fn layer_groups_of(
        config: &ModelConfig,
        max_run: usize,
    ) -> Result<LayerGroups, ModelError> {
        let windows: Vec<Option<usize>> = (0..config.num_layers)
            .map(|layer| config.attention_window(layer))
            .collect();
        Ok(LayerGroups::of_windows(
            &windows,
            attention::CHUNK,
            max_run,
        )?)
    }

    /// Bytes of weights one decode step reads (the bandwidth roofline's numerator).
    pub fn weight_bytes(&self) -> usize {
        let per_layer =
            |l: &Layer| l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes();
        self.layers.iter().map(per_layer).sum::<usize>() + self.lm_head.bytes()
    }

    fn check(&self, seq: &Sequence<'_>) -> Result<(), ModelError> {
        let invalid = |reason: String| Err(ModelError::InvalidBatch { reason });
        if seq.tokens.is_empty() {
            return invalid(format!(
                "sequence of request {} has no new tokens",
                seq.lease.owner()
            ));
        }
        if let Some(&token) = seq
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(ModelError::TokenOutOfVocab {
                token,
                vocab: self.config.vocab_size,
            });
        }
        let end = seq.past + seq.tokens.len();
        if end > self.config.max_position_embeddings {
            return invalid(format!(
                "request {} reaches position {end}, past the model's {} positions",
                seq.lease.owner(),
                self.config.max_position_embeddings
            ));
        }
        if end > seq.lease.capacity_tokens() {
            return invalid(format!(
                "request {} reaches position {end} but its lease holds {} tokens",
                seq.lease.owner(),
                seq.lease.capacity_tokens()
            ));
        }
        Ok(())
    }

    /// Runs one batched forward pass. Returns, per sequence, its logits rows
    /// (`[rows][vocab]`, rows as its [`Logits`] asked) in batch order.
    ///
    /// The pass runs on a thread of the compute pool (rayon's, sized to the
    /// cores): a caller outside it hands the whole pass over once, instead
    /// of every matmul waking the pool and putting the caller to sleep
    /// (measured on SmolLM2 decode at one sequence: +15 % tokens/s), and
    /// the pool's other workers poll for its jobs through the pass instead
    /// of sleeping between them (`awake`; −11 % per step on an Intel Xeon).
    pub fn forward(&self, batch: &mut [Sequence<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_each(batch).into_iter().collect()
    }

    /// Runs one batched forward pass in which each sequence succeeds or
    /// fails on its own: a sequence whose checks fail — a token outside the
    /// vocabulary, positions past its lease or the model, a KV write or
    /// read the pool refuses (I2, I3) — gets its error, computes nothing
    /// further from its KV, and leaves every other sequence's rows exactly
    /// as they would be without it (rows never mix, so batch invariance
    /// makes this exact).
    pub fn forward_each(&self, batch: &mut [Sequence<'_>]) -> Vec<Result<Vec<f32>, ModelError>> {
        let mut pass = self.begin(batch);
        self.resume(&mut pass, batch, &mut || false)
            .expect("a pass that is never asked to pause runs to its end")
    }

    /// Starts a forward pass over `batch` that [`Model::resume`] runs,
    /// possibly in several goes: its activations live in the [`Pass`]
    /// between them. Checks every sequence and embeds its tokens.
    pub fn begin(&self, batch: &[Sequence<'_>]) -> Pass {
        let failed: Vec<Option<ModelError>> =
            batch.iter().map(|seq| self.check(seq).err()).collect();
        let c = &self.config;
        let h = c.hidden_size;
        let shape: Vec<(usize, usize)> = batch.iter().map(|s| (s.past, s.tokens.len())).collect();
        let total: usize = shape.iter().map(|&(_, n)| n).sum();
        // Row r of every activation belongs to (sequence row_seq[r], position positions[r]).
        let positions: Vec<usize> = shape.iter().flat_map(|&(past, n)| past..past + n).collect();
        let mut x = Vec::with_capacity(total * h);
        for (seq, failure) in batch.iter().zip(&failed) {
            for &t in seq.tokens {
                if failure.is_some() {
                    // Its token may be outside the table: nothing is read.
                    x.resize(x.len() + h, 0.0);
                } else {
                    self.embed.push_row(t as usize, h, &mut x);
                }
            }
        }
        if c.architecture.scales_embeddings() {
            // As llama.cpp rounds it: √hidden in f32, one multiply.
            let scale = (h as f32).sqrt();
            x.iter_mut().for_each(|v| *v *= scale);
        }
        Pass {
            global_tables: self.rope.tables(&positions),
            local_tables: self.local_rope.as_ref().map(|r| r.tables(&positions)),
            shape,
            failed,
            next_layer: 0,
            layers: self.layers.len(),
            x,
        }
    }

    /// Runs `pass` on from the layer it stopped at, over the same `batch`
    /// it began with (the same sequences at the same positions; their
    /// leases may be borrowed anew). After each layer but the last it asks
    /// `pause`; on `true` it returns `None`, the pass kept for a later
    /// call — a scheduler answers a request that just arrived between two
    /// layers instead of after the whole step. At the end it returns what
    /// [`Model::forward_each`] returns. Every layer of a pass is computed
    /// exactly once, so a paused pass gives the same bits as one that was
    /// not; between the calls only `batch`'s own leases must be left alone.
    pub fn resume(
        &self,
        pass: &mut Pass,
        batch: &mut [Sequence<'_>],
        pause: &mut (dyn FnMut() -> bool + Send),
    ) -> Option<Vec<Result<Vec<f32>, ModelError>>> {
        assert!(
            pass.next_layer < self.layers.len(),
            "a finished pass is not resumed"
        );
        assert!(
            batch
                .iter()
                .map(|s| (s.past, s.tokens.len()))
                .eq(pass.shape.iter().copied()),
            "a pass resumes over the batch it began with"
        );
        // The pool's other workers are kept polling for the pass's jobs
        // between its regions instead of sleeping (`crate::awake`); between
        // layers, any helper that left is sent again.
        let mut run = || {
            awake::kept_awake(|awake| {
                let mut between_layers = || {
                    awake.rearm();
                    pause()
                };
                self.resume_in_pool(pass, batch, &mut between_layers)
            })
        };
        if rayon::current_thread_index().is_some() {
            run()
        } else {
            rayon::scope(|_| run())
        }
    }

    fn resume_in_pool(
        &self,
        pass: &mut Pass,
        batch: &mut [Sequence<'_>],
        pause: &mut (dyn FnMut() -> bool + Send),
    ) -> Option<Vec<Result<Vec<f32>, ModelError>>> {
        // One pool serves a batch; a lease of another element type fails
        // alone, refused by its own reads and writes.
        let finished = match batch.first().map(|s| s.lease.elem()) {
            None | Some(ElemType::F32) => self.run_layers::<f32>(pass, batch, pause),
            Some(ElemType::F16) => self.run_layers::<f16>(pass, batch, pause),
            Some(ElemType::BF16) => self.run_layers::<bf16>(pass, batch, pause),
        };
        if !finished {
            return None;
        }
        let rows = self.logits(batch, &pass.x);
        Some(
            rows.into_iter()
                .zip(std::mem::take(&mut pass.failed))
                .map(|(row, failure)| match failure {
                    Some(error) => Err(error),
                    None => Ok(row),
                })
                .collect(),
        )
    }

    /// Runs layers from `pass.next_layer` until the last or until `pause`
    /// says stop; whether the last layer ran.
    fn run_layers<E: KvValue>(
        &self,
        pass: &mut Pass,
        batch: &mut [Sequence<'_>],
        pause: &mut (dyn FnMut() -> bool + Send),
    ) -> bool {
        let c = &self.config;
        let (hd, q_dim, kv_dim) = (c.head_dim, c.q_dim(), c.kv_dim());
        let qkv_width = q_dim + 2 * kv_dim;
        let total = pass.rows();
        let half = hd / 2;
        // Scratch of one go: sized by the batch, cheap next to its matmuls.
        let mut normed = vec![0.0; total * c.hidden_size];
        let mut qkv = vec![0.0; total * qkv_width];
        let mut attn = vec![0.0; total * q_dim];
        let mut proj = vec![0.0; total * c.hidden_size];
        let mut gate_up = vec![0.0; total * 2 * c.intermediate_size];
        let mut act = vec![0.0; total * c.intermediate_size];
        let mut head = vec![0.0; hd];
        let Pass {
            x,
            failed,
            global_tables,
            local_tables,
            next_layer,
            ..
        } = pass;
        while *next_layer < self.layers.len() {
            let layer_index = *next_layer;
            let layer = &self.layers[layer_index];
            let (cos, sin) = match (&local_tables, c.attention_window(layer_index)) {
                (Some(local), Some(_)) => local,
                _ => &*global_tables,
            };
            kernels::rms_norm(x, &layer.attn_norm, c.rms_norm_eps, &mut normed);
            layer.qkv.matmul(&normed, total, &mut qkv);
            for (r, row) in qkv.chunks_exact_mut(qkv_width).enumerate() {
                if let Some(bias) = &layer.qkv_bias {
                    row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
                }
                if let Some((q_norm, k_norm)) = &layer.qk_norm {
                    let (queries, keys) = row[..q_dim + kv_dim].split_at_mut(q_dim);
                    for (heads, weight) in [(queries, q_norm), (keys, k_norm)] {
                        for one in heads.chunks_exact_mut(hd) {
                            head.copy_from_slice(one);
                            kernels::rms_norm(&head, weight, c.rms_norm_eps, one);
                        }
                    }
                }
                let (cos, sin) = (
                    &cos[r * half..(r + 1) * half],
                    &sin[r * half..(r + 1) * half],
                );
                Rope::apply(&mut row[..q_dim + kv_dim], hd, cos, sin);
            }
            self.store_kv::<E>(batch, layer_index, &qkv, failed);
            self.attention::<E>(batch, layer_index, &qkv, &mut attn, failed);
            layer.o.matmul(&attn, total, &mut proj);
            self.add_residual(
                x,
                &proj,
                layer.post_norms.as_ref().map(|n| &n.0),
                &mut normed,
            );

            kernels::rms_norm(x, &layer.mlp_norm, c.rms_norm_eps, &mut normed);
            layer.gate_up.matmul(&normed, total, &mut gate_up);
            match c.architecture.activation() {
                Activation::Silu => kernels::silu_mul(&gate_up, c.intermediate_size, &mut act),
                Activation::GeluTanh => kernels::gelu_mul(&gate_up, c.intermediate_size, &mut act),
            }
            layer.down.matmul(&act, total, &mut proj);
            self.add_residual(
                x,
                &proj,
                layer.post_norms.as_ref().map(|n| &n.1),
                &mut normed,
            );
            *next_layer += 1;
            if *next_layer < self.layers.len() && pause() {
                return false;
            }
        }
        true
    }

    /// `x += out`, or `x += rms_norm(out)` for architectures that normalise
    /// a block's output first (computed into `scratch`, `out`'s size).
    fn add_residual(
        &self,
        x: &mut [f32],
        out: &[f32],
        post_norm: Option<&Vec<f32>>,
        scratch: &mut [f32],
    ) {
        let out = match post_norm {
            Some(weight) => {
                kernels::rms_norm(out, weight, self.config.rms_norm_eps, scratch);
                &*scratch
            }
            None => out,
        };
        x.iter_mut().zip(out).for_each(|(a, b)| *a += b);
    }

    /// Writes each sequence's new K and V rows of one layer into its lease;
    /// a refused write fails that sequence alone.
    fn store_kv<E: KvValue>(
        &self,
        batch: &mut [Sequence<'_>],
        layer: usize,
        qkv: &[f32],
        failed: &mut [Option<ModelError>],
    ) {
        let (q_dim, kv_dim) = (self.config.q_dim(), self.config.kv_dim());
        let width = q_dim + 2 * kv_dim;
        let mut row = 0;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (seq, failure) in batch.iter_mut().zip(failed.iter_mut()) {
            let rows = row..row + seq.tokens.len();
            row += seq.tokens.len();
            if failure.is_some() {
                continue;
            }
            k.clear();
            v.clear();
            for r in rows {
                let line = &qkv[r * width..(r + 1) * width];
                k.extend_from_slice(&line[q_dim..q_dim + kv_dim]);
                v.extend_from_slice(&line[q_dim + kv_dim..]);
            }
            let (k, v) = (E::narrow(&k), E::narrow(&v));
            if let Err(error) = seq.lease.write_positions::<E>(layer, seq.past, &k, &v) {
                *failure = Some(error.into());
            }
        }
    }

    /// Causal attention for every row, reading K/V through read views. A
    /// sequence whose view the pool refuses (I2) fails alone: its rows
    /// attend to nothing (zeros) and are thrown away.
    fn attention<E: KvValue>(
        &self,
        batch: &[Sequence<'_>],
        layer: usize,
        qkv: &[f32],
        out: &mut [f32],
        failed: &mut [Option<ModelError>],
    ) {
        let c = &self.config;
        let views: Vec<Option<ReadView<'_, E>>> = batch
            .iter()
            .zip(failed.iter_mut())
            .map(|(s, failure)| {
                if failure.is_some() {
                    return None;
                }
                // A sliding-window layer's lease holds only the positions
                // its rows can see, from where the pool says they start.
                let start = s.lease.read_start(layer, s.past);
                match s
                    .lease
                    .read_layer_from::<E>(layer, start, s.past + s.tokens.len())
                {
                    Ok(view) => Some(view),
                    Err(error) => {
                        *failure = Some(error.into());
                        None
                    }
                }
            })
            .collect();
        let width = c.q_dim() + 2 * c.kv_dim();
        let mut first = 0;
        let mut parts = Vec::with_capacity(batch.len());
        let mut rows_of = Vec::with_capacity(batch.len());
        for (seq, view) in batch.iter().zip(&views) {
            let rows = seq.tokens.len();
            parts.push(view.as_ref().map(|view| SequenceQueries {
                view,
                past: seq.past,
                queries: &qkv[first * width..(first + rows) * width],
                stride: width,
                rows,
            }));
            rows_of.push(rows);
            first += rows;
        }
        attention::attend(c, layer, &parts, &rows_of, out);
    }

    fn logits(&self, batch: &[Sequence<'_>], x: &[f32]) -> Vec<Vec<f32>> {
        let (h, vocab) = (self.config.hidden_size, self.config.vocab_size);
        let mut picked = Vec::new();
        let mut counts = Vec::with_capacity(batch.len());
        let mut row = 0;
        for seq in batch {
            let n = seq.tokens.len();
            let rows = match seq.logits {
                Logits::None => 0..0,
                // A sequence without tokens failed its check: no row to pick.
                Logits::Last if n == 0 => 0..0,
                Logits::Last => row + n - 1..row + n,
                Logits::All => row..row + n,
            };
            counts.push(rows.len());
            picked.extend_from_slice(&x[rows.start * h..rows.end * h]);
            row += n;
        }
        let m = picked.len() / h;
        let mut normed = vec![0.0; picked.len()];
        kernels::rms_norm(&picked, &self.norm, self.config.rms_norm_eps, &mut normed);
        let mut logits = vec![0.0; m * vocab];
        self.lm_head.matmul(&normed, m, &mut logits);
        let mut rest = logits.as_slice();
        counts
            .into_iter()
            .map(|n| {
                let (mine, tail) = rest.split_at(n * vocab);
                rest = tail;
                mine.to_vec()
            })
            .collect()
    }
}
