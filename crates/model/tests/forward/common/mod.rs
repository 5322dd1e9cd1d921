//! Shared test helpers: a pool sized for a model, a greedy generation loop
//! over the paged forward, and a dense reference forward written the plain
//! way (full K/V arrays, naive matmuls, f64 accumulation), independent of the
//! crate's kernels.

// In a test helper, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use kvfence_model::{Logits, Model, ModelConfig, Sequence, TensorMap};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId, ReusePolicy, Scrub};

pub const PAGE: usize = 8;

/// A pool for `model` with poison scrub and immediate reuse: the harshest
/// setting for isolation.
pub fn pool_for(model: &Model, tokens: usize) -> Pool {
    pool_of(model, tokens, ElemType::F32)
}

/// [`pool_for`] storing K and V as `elem`.
pub fn pool_of(model: &Model, tokens: usize, elem: ElemType) -> Pool {
    let spec = PoolSpec::new(model.kv_shape(), PAGE, elem, PoolSize::Tokens(tokens))
        .with_scrub(Scrub::Poison)
        .with_reuse(ReusePolicy::NewestFreedFirst);
    Pool::new(&spec).unwrap()
}

/// Greedy generation: prefill `prompt` in chunks of `chunk` tokens, then
/// `steps` decode steps. Returns the logits row of each step (the prompt's
/// last token first) and every token (prompt and generated).
pub fn generate(
    model: &Model,
    pool: &Pool,
    owner: u64,
    prompt: &[u32],
    steps: usize,
    chunk: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut lease = pool.lease(RequestId(owner), prompt.len() + steps).unwrap();
    let mut tokens = prompt.to_vec();
    let mut rows = Vec::new();
    let mut past = 0;
    for piece in prompt.chunks(chunk) {
        let last = past + piece.len() == prompt.len();
        let mut batch = [Sequence {
            lease: &mut lease,
            past,
            tokens: piece,
            logits: if last { Logits::Last } else { Logits::None },
        }];
        let out = model.forward(&mut batch).unwrap();
        if last {
            rows.push(out[0].clone());
        }
        past += piece.len();
    }
    for _ in 0..steps {
        let next = kvfence_model::sampling::argmax(rows.last().unwrap());
        tokens.push(next);
        let mut batch = [Sequence {
            lease: &mut lease,
            past,
            tokens: &[next],
            logits: Logits::Last,
        }];
        rows.push(model.forward(&mut batch).unwrap().remove(0));
        past += 1;
    }
    (rows, tokens)
}

fn linear(x: &[f32], n: usize, w: &[f32], out_dim: usize, bias: Option<&[f32]>) -> Vec<f32> {
    let in_dim = x.len() / n;
    let mut out = vec![0.0; n * out_dim];
    for r in 0..n {
        for o in 0..out_dim {
            let mut acc = 0.0f64;
            for i in 0..in_dim {
                acc += f64::from(x[r * in_dim + i]) * f64::from(w[o * in_dim + i]);
            }
            out[r * out_dim + o] = acc as f32 + bias.map_or(0.0, |b| b[o]);
        }
    }
    out
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let h = w.len();
    let mut out = vec![0.0; x.len()];
    for (row, dst) in x.chunks(h).zip(out.chunks_mut(h)) {
        let ms = row
            .iter()
            .map(|v| f64::from(*v) * f64::from(*v))
            .sum::<f64>()
            / h as f64;
        let scale = 1.0 / (ms + f64::from(eps)).sqrt();
        for i in 0..h {
            dst[i] = (f64::from(row[i]) * scale) as f32 * w[i];
        }
    }
    out
}

fn rope(x: &mut [f32], heads: usize, hd: usize, pos: usize, theta: f32) {
    let half = hd / 2;
    for h in 0..heads {
        let v = &mut x[h * hd..(h + 1) * hd];
        for i in 0..half {
            let inv = 1.0 / f64::from(theta).powf((2 * i) as f64 / hd as f64);
            let angle = pos as f64 * inv;
            let (c, s) = (angle.cos(), angle.sin());
            let (a, b) = (f64::from(v[i]), f64::from(v[i + half]));
            v[i] = (a * c - b * s) as f32;
            v[i + half] = (b * c + a * s) as f32;
        }
    }
}

fn gelu_tanh(x: f32) -> f32 {
    let x = f64::from(x);
    let inner = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    (0.5 * x * (1.0 + inner.tanh())) as f32
}

/// Logits at every position of `tokens`, computed densely. Gemma 3's
/// pieces (per-head Q/K norms, post-norms, GeGLU, √hidden embeddings,
/// sliding windows with their own RoPE base) follow its Hugging Face
/// definition, norms as `1 + w`.
pub fn dense_logits(c: &ModelConfig, t: &TensorMap, tokens: &[u32]) -> Vec<Vec<f32>> {
    assert!(
        c.rope_scaling.is_none(),
        "the reference implements plain RoPE only"
    );
    let gemma = c.architecture == kvfence_model::Architecture::Gemma3;
    let (n, h, hd) = (tokens.len(), c.hidden_size, c.head_dim);
    let w = |name: &str, shape: &[usize]| t.get(name, shape).unwrap().data.clone();
    let norm_w = |name: &str, len: usize| -> Vec<f32> {
        let v = w(name, &[len]);
        if gemma {
            v.iter().map(|x| x + 1.0).collect()
        } else {
            v
        }
    };
    let embed = w("model.embed_tokens.weight", &[c.vocab_size, h]);
    let mut x: Vec<f32> = tokens
        .iter()
        .flat_map(|&tok| embed[tok as usize * h..(tok as usize + 1) * h].to_vec())
        .collect();
    if gemma {
        let scale = (h as f32).sqrt();
        x.iter_mut().for_each(|v| *v *= scale);
    }
    for l in 0..c.num_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let window = c.attention_window(l).unwrap_or(usize::MAX);
        let theta = match (c.attention_window(l), c.sliding_window) {
            (Some(_), Some(sliding)) => sliding.local_rope_theta,
            _ => c.rope_theta,
        };
        let hn = rms_norm(&x, &norm_w(&p("input_layernorm.weight"), h), c.rms_norm_eps);
        let bias = |s: &str, d: usize| c.qkv_bias.then(|| w(&p(s), &[d]));
        let qb = bias("self_attn.q_proj.bias", c.q_dim());
        let kb = bias("self_attn.k_proj.bias", c.kv_dim());
        let vb = bias("self_attn.v_proj.bias", c.kv_dim());
        let mut q = linear(
            &hn,
            n,
            &w(&p("self_attn.q_proj.weight"), &[c.q_dim(), h]),
            c.q_dim(),
            qb.as_deref(),
        );
        let mut k = linear(
            &hn,
            n,
            &w(&p("self_attn.k_proj.weight"), &[c.kv_dim(), h]),
            c.kv_dim(),
            kb.as_deref(),
        );
        let v = linear(
            &hn,
            n,
            &w(&p("self_attn.v_proj.weight"), &[c.kv_dim(), h]),
            c.kv_dim(),
            vb.as_deref(),
        );
        if c.architecture.qk_norm() {
            q = rms_norm(
                &q,
                &norm_w(&p("self_attn.q_norm.weight"), hd),
                c.rms_norm_eps,
            );
            k = rms_norm(
                &k,
                &norm_w(&p("self_attn.k_norm.weight"), hd),
                c.rms_norm_eps,
            );
        }
        for pos in 0..n {
            rope(
                &mut q[pos * c.q_dim()..(pos + 1) * c.q_dim()],
                c.num_heads,
                hd,
                pos,
                theta,
            );
            rope(
                &mut k[pos * c.kv_dim()..(pos + 1) * c.kv_dim()],
                c.num_kv_heads,
                hd,
                pos,
                theta,
            );
        }
        let group = c.num_heads / c.num_kv_heads;
        let mut attn = vec![0.0f32; n * c.q_dim()];
        for pos in 0..n {
            for head in 0..c.num_heads {
                let kvh = head / group;
                let qv = &q[pos * c.q_dim() + head * hd..][..hd];
                let first = (pos + 1).saturating_sub(window);
                let scores: Vec<f64> = (first..=pos)
                    .map(|s| {
                        let kv = &k[s * c.kv_dim() + kvh * hd..][..hd];
                        qv.iter()
                            .zip(kv)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = exps.iter().sum();
                for d in 0..hd {
                    let val: f64 = (first..=pos)
                        .map(|s| exps[s - first] * f64::from(v[s * c.kv_dim() + kvh * hd + d]))
                        .sum();
                    attn[pos * c.q_dim() + head * hd + d] = (val / sum) as f32;
                }
            }
        }
        let o = linear(
            &attn,
            n,
            &w(&p("self_attn.o_proj.weight"), &[h, c.q_dim()]),
            h,
            None,
        );
        let o = if gemma {
            rms_norm(
                &o,
                &norm_w(&p("post_attention_layernorm.weight"), h),
                c.rms_norm_eps,
            )
        } else {
            o
        };
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let mlp_norm = if gemma {
            "pre_feedforward_layernorm.weight"
        } else {
            "post_attention_layernorm.weight"
        };
        let hn = rms_norm(&x, &norm_w(&p(mlp_norm), h), c.rms_norm_eps);
        let i = c.intermediate_size;
        let g = linear(&hn, n, &w(&p("mlp.gate_proj.weight"), &[i, h]), i, None);
        let u = linear(&hn, n, &w(&p("mlp.up_proj.weight"), &[i, h]), i, None);
        let a: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, u)| {
                if gemma {
                    gelu_tanh(g) * u
                } else {
                    g / (1.0 + (-g).exp()) * u
                }
            })
            .collect();
        let d = linear(&a, n, &w(&p("mlp.down_proj.weight"), &[h, i]), h, None);
        let d = if gemma {
            rms_norm(
                &d,
                &norm_w(&p("post_feedforward_layernorm.weight"), h),
                c.rms_norm_eps,
            )
        } else {
            d
        };
        x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
    }
    let xn = rms_norm(&x, &norm_w("model.norm.weight", h), c.rms_norm_eps);
    let head = if c.tie_word_embeddings {
        embed
    } else {
        w("lm_head.weight", &[c.vocab_size, h])
    };
    linear(&xn, n, &head, c.vocab_size, None)
        .chunks(c.vocab_size)
        .map(<[f32]>::to_vec)
        .collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
