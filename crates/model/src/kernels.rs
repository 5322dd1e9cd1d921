//! CPU compute kernels: matrix multiply over packed weights, RMSNorm, RoPE,
//! SiLU, dot products. This module is the seam where another backend (CUDA,
//! vendor BLAS) would plug in: the forward pass calls only these functions.
//!
//! # Batch invariance
//!
//! Every output element is computed by the same sequence of floating-point
//! operations whatever the batch size or thread count: `matmul` accumulates
//! each `(row, column)` over `k` in ascending order with a separate multiply
//! and add (Rust never fuses them on its own), whether the row is processed in
//! a tile of four or alone; reductions (`dot`, `sum_squares`) use a fixed
//! lane layout. Quantized weights go through `qtile`, whose
//! kernels multiply and add in one exactly rounded step (`f32::mul_add`) in
//! a fixed 32-lane layout: the same bits on every CPU and in every
//! instruction-set variant. So a request's logits are bit-identical alone or batched, and
//! any difference between the two is evidence that memory crossed requests.
//! (candle's CPU matmul, measured, picks different kernels for a 1-row input
//! than for the same row in a larger batch; that is why this crate owns it.)

use rayon::prelude::*;

use crate::isa::per_isa;
pub use crate::isa::{IsaCap, widest_isa};
use crate::quant::QuantMatrix;

/// The instruction sets this process's kernels run, in words for its
/// start-up log: the hand-written kernels' (within `KVFENCE_MAX_ISA`), the
/// compiled code's, and the cap if one is set.
pub fn instruction_sets() -> String {
    crate::isa::describe(
        crate::qtile::hand_written(),
        crate::isa::Compiled::current(),
        widest_isa(),
    )
}

/// Output columns per packed panel.
pub const PANEL: usize = 16;
/// Rows computed together, sharing each loaded weight vector.
const ROW_TILE: usize = 4;
/// Multiply-adds below which a matmul runs on the calling thread: handing
/// tiny work to the pool costs more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 18;

/// A weight matrix `[n][k]` (Hugging Face's `[out][in]`) repacked into
/// column panels `[n / PANEL][k][PANEL]`, so a panel streams contiguously
/// while its `PANEL` outputs stay in registers. Columns past `n` are zero.
#[derive(Debug, Clone)]
pub struct PackedMatrix {
    n: usize,
    k: usize,
    panels: Vec<f32>,
}

impl PackedMatrix {
    /// Packs a row-major `[n][k]` matrix.
    pub fn from_rows(w: &[f32], n: usize, k: usize) -> PackedMatrix {
        assert_eq!(w.len(), n * k, "weight matrix must hold n * k elements");
        let n_panels = n.div_ceil(PANEL);
        let mut panels = vec![0.0; n_panels * k * PANEL];
        for col in 0..n {
            let (panel, lane) = (col / PANEL, col % PANEL);
            let base = panel * k * PANEL + lane;
            for (kk, &value) in w[col * k..(col + 1) * k].iter().enumerate() {
                panels[base + kk * PANEL] = value;
            }
        }
        PackedMatrix { n, k, panels }
    }

    /// Output width.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input width.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes of weights one full pass reads.
    pub fn bytes(&self) -> usize {
        self.panels.len() * 4
    }
}

/// A weight matrix in the encoding it was loaded in.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// f32, repacked into panels (safetensors models).
    Dense(PackedMatrix),
    /// Quantized blocks as the GGUF file holds them.
    Quant(QuantMatrix),
}

impl Matrix {
    /// Output width.
    pub fn n(&self) -> usize {
        match self {
            Matrix::Dense(w) => w.n(),
            Matrix::Quant(w) => w.n(),
        }
    }

    /// Input width.
    pub fn k(&self) -> usize {
        match self {
            Matrix::Dense(w) => w.k(),
            Matrix::Quant(w) => w.k(),
        }
    }

    /// Bytes of weights one full pass reads.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::Dense(w) => w.bytes(),
            Matrix::Quant(w) => w.bytes(),
        }
    }

    /// `out[m][n] = x[m][k] · wᵀ`, batch-invariant in either encoding.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        match self {
            Matrix::Dense(w) => matmul(x, m, w, out),
            Matrix::Quant(w) => w.matmul(x, m, out),
        }
    }
}

/// `out[m][n] = x[m][k] · wᵀ`.
pub fn matmul(x: &[f32], m: usize, w: &PackedMatrix, out: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    assert_eq!(x.len(), m * k, "matmul input must be m * k");
    assert_eq!(out.len(), m * n, "matmul output must be m * n");
    if m == 0 {
        return;
    }
    let n_panels = n.div_ceil(PANEL);
    // Panel-major scratch: each panel's outputs for every row are one
    // contiguous chunk, so panels can be computed in parallel safely.
    let mut scratch = vec![0.0f32; n_panels * m * PANEL];
    let work = |(panel, chunk): (usize, &mut [f32])| {
        panel_kernel(
            x,
            m,
            k,
            &w.panels[panel * k * PANEL..(panel + 1) * k * PANEL],
            chunk,
        )
    };
    if m * n * k >= PARALLEL_MIN_MACS {
        scratch.par_chunks_mut(m * PANEL).enumerate().for_each(work);
    } else {
        scratch.chunks_mut(m * PANEL).enumerate().for_each(work);
    }
    for (panel, chunk) in scratch.chunks(m * PANEL).enumerate() {
        let cols = PANEL.min(n - panel * PANEL);
        for row in 0..m {
            out[row * n + panel * PANEL..][..cols].copy_from_slice(&chunk[row * PANEL..][..cols]);
        }
    }
}

per_isa! {
    /// One panel for every row: tiles of `ROW_TILE` rows, then single rows,
    /// with identical per-element arithmetic in both.
    ///
    /// Compiled per instruction set ([`per_isa!`]). Rust never fuses a
    /// multiply and an add unless asked, so every variant rounds exactly
    /// alike: dispatch changes speed, never bits.
    fn panel_kernel(x: &[f32], m: usize, k: usize, panel: &[f32], out: &mut [f32]) {
        let mut row = 0;
        while row + ROW_TILE <= m {
            let mut acc = [[0.0f32; PANEL]; ROW_TILE];
            let rows: [&[f32]; ROW_TILE] =
                std::array::from_fn(|i| &x[(row + i) * k..(row + i + 1) * k]);
            for (kk, w) in panel.chunks_exact(PANEL).enumerate() {
                for (acc_row, x_row) in acc.iter_mut().zip(rows) {
                    let a = x_row[kk];
                    for (o, &wj) in acc_row.iter_mut().zip(w) {
                        *o += a * wj;
                    }
                }
            }
            for (i, acc_row) in acc.iter().enumerate() {
                out[(row + i) * PANEL..][..PANEL].copy_from_slice(acc_row);
            }
            row += ROW_TILE;
        }
        while row < m {
            let mut acc = [0.0f32; PANEL];
            let x_row = &x[row * k..(row + 1) * k];
            for (kk, w) in panel.chunks_exact(PANEL).enumerate() {
                let a = x_row[kk];
                for (o, &wj) in acc.iter_mut().zip(w) {
                    *o += a * wj;
                }
            }
            out[row * PANEL..][..PANEL].copy_from_slice(&acc);
            row += 1;
        }
    }
}

/// Lanes of [`dot`]: short vectors (attention over a 64-wide head, RMSNorm).
const LANES: usize = 8;

/// Dot product with a fixed 8-lane layout: deterministic and vectorisable.
/// Lane `i` sums elements `i, i + 8, i + 16, ...`, then lanes are summed in
/// order, then the tail. Always inlined, so each caller compiles it for its
/// own instruction set.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [0.0f32; LANES];
    let split = a.len() - a.len() % LANES;
    for (ca, cb) in a[..split]
        .chunks_exact(LANES)
        .zip(b[..split].chunks_exact(LANES))
    {
        for i in 0..LANES {
            lanes[i] += ca[i] * cb[i];
        }
    }
    let mut total = lanes.iter().sum::<f32>();
    for (x, y) in a[split..].iter().zip(&b[split..]) {
        total += x * y;
    }
    total
}

/// `out += weight * v`, elementwise.
#[inline(always)]
pub fn axpy(weight: f32, v: &[f32], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += weight * x;
    }
}

/// RMSNorm of each `weight.len()`-wide row of `x` into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (row, dst) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mean_square = dot(row, row) / width as f32;
        let scale = 1.0 / (mean_square + eps).sqrt();
        for ((d, &v), &w) in dst.iter_mut().zip(row).zip(weight) {
            *d = v * scale * w;
        }
    }
}

/// Elements of a gated activation below which it stays on the calling
/// thread. Rows are independent, so splitting them changes no bit.
const PARALLEL_MIN_ACTIVATIONS: usize = 1 << 14;

/// `out[r] = f(gate[r]) * up[r]` for each row `[gate | up]` of `gate_up`,
/// rows split over the pool when there are enough elements.
fn gated(gate_up: &[f32], width: usize, out: &mut [f32], f: impl Fn(f32) -> f32 + Sync + Copy) {
    let row = |(row, dst): (&[f32], &mut [f32])| {
        let (gate, up) = row.split_at(width);
        gated_row(gate, up, dst, f);
    };
    if out.len() >= PARALLEL_MIN_ACTIVATIONS {
        gate_up
            .par_chunks_exact(2 * width)
            .zip(out.par_chunks_exact_mut(width))
            .for_each(row);
    } else {
        gate_up
            .chunks_exact(2 * width)
            .zip(out.chunks_exact_mut(width))
            .for_each(row);
    }
}

per_isa! {
    /// One row of [`gated`], compiled per instruction set: `f` is built from
    /// [`exp`], whose every operation is an instruction that rounds alike in
    /// scalar and vector form, so the loop vectorises and every lane keeps the
    /// scalar bits. (A libm `expf` or `tanhf` per element, which this replaced,
    /// was a sixth of a 512-token Gemma 3 prefill.)
    fn gated_row<F: Fn(f32) -> f32>(gate: &[f32], up: &[f32], out: &mut [f32], f: F) {
        for ((d, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *d = f(g) * u;
        }
    }
}

/// `gate_up` rows are `[gate | up]`; writes `silu(gate) * up` into `out`,
/// `silu(g) = g · σ(g)`.
pub fn silu_mul(gate_up: &[f32], width: usize, out: &mut [f32]) {
    gated(gate_up, width, out, |g| g * sigmoid(g));
}

/// `gate_up` rows are `[gate | up]`; writes `gelu(gate) * up` into `out`,
/// GELU in its tanh approximation (ggml's `gelu`, Hugging Face's
/// `gelu_pytorch_tanh`): `½ g (1 + tanh u)` with `u = √(2/π) (g + 0.044715
/// g³)`, computed as the identical `g · σ(2u)` (no cancellation where
/// `tanh u` nears −1, one [`exp`]).
pub fn gelu_mul(gate_up: &[f32], width: usize, out: &mut [f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    gated(gate_up, width, out, |g| {
        let inner = SQRT_2_OVER_PI * g * (1.0 + COEF_A * g * g);
        g * sigmoid(2.0 * inner)
    });
}

/// `σ(z) = 1 / (1 + e^−z)` from [`exp`] of `−|z|`, which never overflows:
/// `1 / (1 + e)` for `z ≥ 0`, `e / (1 + e)` below. NaN stays NaN.
#[inline(always)]
pub fn sigmoid(z: f32) -> f32 {
    let e = exp(-z.abs());
    let denominator = 1.0 + e;
    if z >= 0.0 {
        1.0 / denominator
    } else {
        e / denominator
    }
}

/// `e^x` for `x ≤ 0`, to about one ulp, built only from operations that
/// round the same everywhere (so it vectorises and stays bit-identical
/// across instruction sets, unlike the platform's `expf`). Below −87 it
/// returns `e^−87` (a normal number, far below any weight that matters);
/// NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n · LN2_HI is exact for the n that occur.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = if x < -87.0 { -87.0 } else { x };
    let n = (x * LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    // Minimax polynomial for (e^r − 1 − r) / r² on |r| ≤ ln 2 / 2.
    let mut p = 1.987_569_2e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let e = p.mul_add(r * r, r) + 1.0;
    // 2^n for n in −126..=0: the exponent field alone.
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    e * scale
}

/// Rotary position embedding frequencies (Hugging Face's rotate-half form).
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Frequencies for `head_dim`, base `theta`, optional Llama-3 scaling.
    pub fn new(
        head_dim: usize,
        theta: f32,
        scaling: Option<&crate::config::Llama3RopeScaling>,
    ) -> Rope {
        let half = head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| {
                let freq = 1.0 / f64::from(theta).powf((2 * i) as f64 / head_dim as f64);
                let Some(s) = scaling else { return freq as f32 };
                let original = s.original_max_position_embeddings as f64;
                let low_wavelen = original / f64::from(s.low_freq_factor);
                let high_wavelen = original / f64::from(s.high_freq_factor);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let factor = f64::from(s.factor);
                let scaled = if wavelen < high_wavelen {
                    freq
                } else if wavelen > low_wavelen {
                    freq / factor
                } else {
                    let smooth = (original / wavelen - f64::from(s.low_freq_factor))
                        / f64::from(s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * freq / factor + smooth * freq
                };
                scaled as f32
            })
            .collect();
        Rope { inv_freq }
    }

    /// Divides each frequency by its factor, as llama.cpp applies a GGUF
    /// file's `rope_freqs.weight` (Llama 3.1's scaling, baked per
    /// frequency by its converter).
    pub fn with_frequency_factors(mut self, factors: &[f32]) -> Rope {
        assert_eq!(
            factors.len(),
            self.inv_freq.len(),
            "one factor per rotated pair"
        );
        for (f, &factor) in self.inv_freq.iter_mut().zip(factors) {
            *f /= factor;
        }
        self
    }

    /// `(cos, sin)` tables for `positions`, `[position][head_dim / 2]` each.
    pub fn tables(&self, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &pos in positions {
            for &f in &self.inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        (cos, sin)
    }

    /// Rotates every head of one token's `x` (`[heads][head_dim]`) in place,
    /// given that token's rows of the tables.
    pub fn apply(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = head_dim / 2;
        for head in x.chunks_exact_mut(head_dim) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (lo[i], hi[i]);
                lo[i] = a * cos[i] - b * sin[i];
                hi[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_the_platform_on_its_domain() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (ours, theirs) = (exp(x), x.exp());
            let ulps = ours.to_bits().abs_diff(theirs.to_bits());
            worst = worst.max(ulps);
            x += 0.000_37;
        }
        assert!(worst <= 2, "exp is {worst} ulp from the platform's");
        assert_eq!(exp(0.0), 1.0);
        assert!(
            exp(f32::NAN).is_nan(),
            "NaN (poisoned KV) must not be hidden"
        );
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 1e-37);
    }

    #[test]
    fn gated_activations_are_within_a_few_ulp_of_their_definitions() {
        let (mut worst_silu, mut worst_gelu) = (0.0f64, 0.0f64);
        let mut g = -40.0f32;
        while g <= 40.0 {
            let x = f64::from(g);
            let silu = x / (1.0 + (-x).exp());
            let inner = 0.797_884_560_802_865_4 * x * (1.0 + 0.044_715 * x * x);
            // ½ x (1 + tanh u), written as x / (1 + e^−2u) (the same
            // function) so f64 keeps its digits where tanh u nears −1.
            let gelu = x / (1.0 + (-2.0 * inner).exp());
            assert!((gelu - 0.5 * x * (1.0 + inner.tanh())).abs() <= 1e-15 * (1.0 + x.abs()));
            let (mut s, mut e) = ([0.0f32], [0.0f32]);
            silu_mul(&[g, 1.0], 1, &mut s);
            gelu_mul(&[g, 1.0], 1, &mut e);
            // Error in units of the result's last place (or of 1e-30,
            // where the result nears zero).
            let ulp = |v: f64| (v.abs() * f64::from(f32::EPSILON)).max(1e-30);
            worst_silu = worst_silu.max((f64::from(s[0]) - silu).abs() / ulp(silu));
            // The argument 2u is rounded to f32 first: e^2u inherits its
            // relative error times |2u|, whatever computes the exponential.
            let conditioning = 1.0 + (2.0 * inner).abs();
            worst_gelu = worst_gelu.max((f64::from(e[0]) - gelu).abs() / ulp(gelu) / conditioning);
            g += 0.000_77;
        }
        assert!(
            worst_silu <= 4.0,
            "silu is {worst_silu} ulp from its definition"
        );
        assert!(
            worst_gelu <= 8.0,
            "gelu is {worst_gelu} ulp from its definition"
        );
        let mut nan = [0.0f32];
        gelu_mul(&[f32::NAN, 1.0], 1, &mut nan);
        assert!(nan[0].is_nan(), "NaN (poisoned KV) must not be hidden");
    }

    #[test]
    fn gated_activations_give_vector_lanes_and_the_scalar_loop_the_same_bits() {
        // 37 wide: whole vectors and a remainder in every variant.
        let width = 37;
        let gate_up: Vec<f32> = (0..2 * width)
            .map(|i| ((i * 7919) % 2001) as f32 / 100.0 - 10.0)
            .collect();
        for activation in [silu_mul as fn(&[f32], usize, &mut [f32]), gelu_mul] {
            let mut row = vec![0.0; width];
            activation(&gate_up, width, &mut row);
            for (j, &got) in row.iter().enumerate() {
                // Each element alone: a one-wide row never fills a vector.
                let mut one = [0.0f32];
                activation(&[gate_up[j], gate_up[width + j]], 1, &mut one);
                assert_eq!(got.to_bits(), one[0].to_bits(), "element {j}");
            }
        }
    }

    #[test]
    fn gated_activations_split_over_threads_give_each_row_its_own_bits() {
        let width = 96;
        let rows = 2 * PARALLEL_MIN_ACTIVATIONS / width;
        let gate_up: Vec<f32> = (0..rows * 2 * width)
            .map(|i| ((i * 7919) % 2001) as f32 / 250.0 - 4.0)
            .collect();
        for activation in [silu_mul as fn(&[f32], usize, &mut [f32]), gelu_mul] {
            let mut whole = vec![0.0; rows * width];
            activation(&gate_up, width, &mut whole);
            for (row, expected) in gate_up
                .chunks_exact(2 * width)
                .zip(whole.chunks_exact(width))
            {
                // One row alone stays on this thread.
                let mut alone = vec![0.0; width];
                activation(row, width, &mut alone);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&alone), bits(expected));
            }
        }
    }
    use proptest::prelude::*;

    fn naive(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for r in 0..m {
            for c in 0..n {
                out[r * n + c] = (0..k).map(|i| x[r * k + i] * w[c * k + i]).sum();
            }
        }
        out
    }

    proptest! {
        #[test]
        fn matmul_matches_naive_and_rows_are_batch_invariant(
            m in 1usize..11, n in 1usize..40, k in 1usize..70, seed in any::<u64>()
        ) {
            let mut s = seed | 1;
            let mut next = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s % 2000) as f32 / 1000.0 - 1.0 };
            let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let packed = PackedMatrix::from_rows(&w, n, k);
            let mut out = vec![0.0; m * n];
            matmul(&x, m, &packed, &mut out);
            for (a, b) in out.iter().zip(naive(&x, m, &w, n, k)) {
                prop_assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
            }
            for r in 0..m {
                let mut alone = vec![0.0; n];
                matmul(&x[r * k..(r + 1) * k], 1, &packed, &mut alone);
                prop_assert_eq!(&alone[..], &out[r * n..(r + 1) * n], "row {} differs alone", r);
            }
        }
    }

    #[test]
    fn large_matmul_uses_the_pool_and_stays_batch_invariant() {
        let (m, n, k) = (9, 300, 256);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104_729) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let packed = PackedMatrix::from_rows(&w, n, k);
        let mut out = vec![0.0; m * n];
        matmul(&x, m, &packed, &mut out);
        let mut last = vec![0.0; n];
        matmul(&x[(m - 1) * k..], 1, &packed, &mut last);
        assert_eq!(&last[..], &out[(m - 1) * n..]);
    }

    #[test]
    fn rope_rotation_preserves_norm_and_position_zero_is_identity() {
        let rope = Rope::new(8, 10_000.0, None);
        let (cos, sin) = rope.tables(&[0, 5]);
        let orig = [1.0f32, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 2.0];
        let mut x = orig;
        Rope::apply(&mut x, 8, &cos[..4], &sin[..4]);
        assert_eq!(x, orig);
        Rope::apply(&mut x, 8, &cos[4..], &sin[4..]);
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x) - norm(&orig)).abs() < 1e-4);
        assert_ne!(x, orig);
    }
}
