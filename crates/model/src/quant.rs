//! Quantized weights: the GGUF block formats ([`QuantFormat`]), their
//! decoding, and [`QuantMatrix`], a weight matrix kept quantized and
//! multiplied without ever being expanded to f32 as a whole.
//!
//! Q4_0, Q4_1, Q4_K, Q5_0 and Q8_0 are repacked at load (nibbles or bytes
//! contiguous, scales and offsets as f32 or the file's f16) and Q6_K is read
//! in place, so the kernels of `qtile` decode a block in registers with no
//! format branch. With up to `FUSED_MAX_ROWS` activation rows, blocks are
//! decoded in registers once per tile of activation rows; with more, each task's weight rows are decoded once to
//! memory and then read by every activation row. On AVX2, from
//! `LANES_MIN_ROWS` rows on, the decoded rows and the activations are
//! regrouped lane-major (`qtile::lanes`) so one broadcast weight feeds
//! eight rows. Activations stay f32.
//! (llama.cpp instead rounds activations to 8 bits for an integer dot
//! product; measured on SmolLM2-135M, that rounding alone moves a logit by
//! 0.5 and flips greedy answers, so kvfence keeps full precision and wins
//! its speed elsewhere.)
//!
//! # Batch invariance
//!
//! Each output element is one `qtile::reference_dot`: a fixed lane
//! layout over `k`, whatever the number of activation rows, the path or
//! the instruction set, so a request's logits are the same alone or batched.

use std::cell::Cell;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::isa::per_isa;
use crate::qtile::lanes::{self, LaneKernel};
use crate::qtile::{self, Bytes, FiveBits, Half, Nibbles, SixBits};

/// A GGUF tensor encoding this runtime can multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)] // The names llama.cpp and every GGUF tool use.
pub enum QuantFormat {
    /// 32-bit floats.
    F32,
    /// IEEE half floats.
    F16,
    /// bfloat16.
    BF16,
    /// 32 weights: f16 scale, 4-bit values offset by 8.
    Q4_0,
    /// 32 weights: f16 scale and minimum, 4-bit values.
    Q4_1,
    /// 32 weights: f16 scale, 5-bit values offset by 16 (a 32-bit mask
    /// holds the fifth bits).
    Q5_0,
    /// 32 weights: f16 scale and minimum, 5-bit values.
    Q5_1,
    /// 32 weights: f16 scale, 8-bit values.
    Q8_0,
    /// 256 weights in 16 sub-blocks with 4-bit scales and minimums, 2-bit values.
    Q2_K,
    /// 256 weights in 16 sub-blocks with 6-bit scales, 3-bit values (a
    /// mask holds the third bits).
    Q3_K,
    /// 256 weights in 8 sub-blocks with 6-bit scales and minimums, 4-bit values.
    Q4_K,
    /// 256 weights in 8 sub-blocks with 6-bit scales and minimums, 5-bit values.
    Q5_K,
    /// 256 weights in 16 sub-blocks with 8-bit scales, 6-bit values.
    Q6_K,
}

impl QuantFormat {
    /// The format of a ggml type id, if supported.
    pub fn from_ggml_type(id: u32) -> Option<QuantFormat> {
        Some(match id {
            0 => QuantFormat::F32,
            1 => QuantFormat::F16,
            2 => QuantFormat::Q4_0,
            3 => QuantFormat::Q4_1,
            6 => QuantFormat::Q5_0,
            7 => QuantFormat::Q5_1,
            8 => QuantFormat::Q8_0,
            10 => QuantFormat::Q2_K,
            11 => QuantFormat::Q3_K,
            12 => QuantFormat::Q4_K,
            13 => QuantFormat::Q5_K,
            14 => QuantFormat::Q6_K,
            30 => QuantFormat::BF16,
            _ => return None,
        })
    }

    /// The ggml type id.
    pub fn ggml_type(self) -> u32 {
        match self {
            QuantFormat::F32 => 0,
            QuantFormat::F16 => 1,
            QuantFormat::Q4_0 => 2,
            QuantFormat::Q4_1 => 3,
            QuantFormat::Q5_0 => 6,
            QuantFormat::Q5_1 => 7,
            QuantFormat::Q8_0 => 8,
            QuantFormat::Q2_K => 10,
            QuantFormat::Q3_K => 11,
            QuantFormat::Q4_K => 12,
            QuantFormat::Q5_K => 13,
            QuantFormat::Q6_K => 14,
            QuantFormat::BF16 => 30,
        }
    }

    /// Weights per block.
    pub fn block_elements(self) -> usize {
        match self {
            QuantFormat::F32 | QuantFormat::F16 | QuantFormat::BF16 => 1,
            QuantFormat::Q4_0
            | QuantFormat::Q4_1
            | QuantFormat::Q5_0
            | QuantFormat::Q5_1
            | QuantFormat::Q8_0 => 32,
            QuantFormat::Q2_K
            | QuantFormat::Q3_K
            | QuantFormat::Q4_K
            | QuantFormat::Q5_K
            | QuantFormat::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::F32 => 4,
            QuantFormat::F16 | QuantFormat::BF16 => 2,
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q5_1 => 24,
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q2_K => 84,
            QuantFormat::Q3_K => 110,
            QuantFormat::Q4_K => 144,
            QuantFormat::Q5_K => 176,
            QuantFormat::Q6_K => 210,
        }
    }

    /// Bytes of one row of `k` weights (`k` a multiple of the block).
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_elements() * self.block_bytes()
    }
}

fn half_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Q4_K and Q5_K pack eight 6-bit scales and eight 6-bit minimums into 12 bytes.
fn k_scale_min(j: usize, s: &[u8]) -> (f32, f32) {
    let (scale, min) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    };
    (f32::from(scale), f32::from(min))
}

/// Scale and offset of a 32-weight block in its GGUF bytes: each weight
/// is `q * scale + offset` ([`qtile::decode_nibbles`]), or `q * scale`
/// for Q8_0.
fn block32_scale_offset(format: QuantFormat, b: &[u8]) -> (f32, f32) {
    let d = half_at(b, 0);
    match format {
        QuantFormat::Q4_1 => (d, half_at(b, 2)),
        QuantFormat::Q4_0 => (d, -8.0 * d),
        _ => (d, 0.0),
    }
}

/// Q4_K super-blocks as Q4_0/Q4_1's repacked form: each of a super-block's
/// eight 32-weight blocks is `q · (d · scale) − dmin · min`, that is
/// nibbles with an f32 scale and offset. The values are bit for bit the
/// reference's: `d · scale` (11 × 6 bits) and `q · d · scale` (+ 4 bits)
/// are exact in f32, so the one rounding left is the subtraction's, which
/// the kernels' fused multiply-add performs identically.
fn q4_k_nibbles<'a>(blocks: impl Iterator<Item = &'a [u8]>) -> Storage {
    let (mut quants, mut scales, mut offsets) = (Vec::new(), Vec::new(), Vec::new());
    for b in blocks {
        let (d, dmin) = (half_at(b, 0), half_at(b, 2));
        let (scale_mins, qs) = (&b[4..16], &b[16..144]);
        for j in 0..8 {
            let (scale, min) = k_scale_min(j, scale_mins);
            scales.push(d * scale);
            offsets.push(-(dmin * min));
            // Block j's weight l is nibble j % 2 of byte l of its 32-byte run.
            let q = |l: usize| (qs[j / 2 * 32 + l] >> (4 * (j % 2))) & 0x0F;
            quants.extend((0..16).map(|l| q(l) | q(l + 16) << 4));
        }
    }
    Storage::Nibbles {
        quants,
        scales,
        offsets,
    }
}

/// A Q5_0 block's word of fifth bits (bit `j` for weight `j`).
fn q5_0_high(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[2], b[3], b[4], b[5]])
}

/// Decodes one block of a 32-weight format through the same definitions
/// the matmul kernels use, so both produce the same bits.
#[inline(always)]
fn decode_block32(format: QuantFormat, b: &[u8]) -> [f32; 32] {
    let (scale, offset) = block32_scale_offset(format, b);
    match format {
        QuantFormat::Q8_0 => {
            let qs: &[u8; 32] = b[2..34].try_into().expect("a Q8_0 block holds 32 bytes");
            qtile::decode_bytes(qs, scale)
        }
        QuantFormat::Q5_0 => {
            let qs: &[u8; 16] = b[6..22]
                .try_into()
                .expect("a Q5_0 block holds 16 bytes of nibbles");
            qtile::decode_five_bits(qs, q5_0_high(b), scale)
        }
        _ => {
            let at = if format == QuantFormat::Q4_1 { 4 } else { 2 };
            let qs: &[u8; 16] = b[at..at + 16]
                .try_into()
                .expect("a 4-bit block holds 16 bytes");
            qtile::decode_nibbles(qs, scale, offset)
        }
    }
}

per_isa! {
    /// Decodes one row (a whole number of blocks) into `out`.
    pub fn dequantize_row(format: QuantFormat, bytes: &[u8], out: &mut [f32]) {
        debug_assert_eq!(bytes.len(), format.row_bytes(out.len()));
        let blocks = bytes
            .chunks_exact(format.block_bytes())
            .zip(out.chunks_exact_mut(format.block_elements()));
        match format {
            QuantFormat::F32 => {
                for (b, o) in blocks {
                    o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            QuantFormat::F16 => {
                for (b, o) in blocks {
                    o[0] = half_at(b, 0);
                }
            }
            QuantFormat::BF16 => {
                for (b, o) in blocks {
                    o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            QuantFormat::Q4_0 | QuantFormat::Q4_1 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => {
                for (b, o) in blocks {
                    let o: &mut [f32; 32] = o.try_into().expect("a 32-weight block");
                    *o = decode_block32(format, b);
                }
            }
            QuantFormat::Q4_K => {
                for (b, o) in blocks {
                    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
                    let (scales, qs) = (&b[4..16], &b[16..144]);
                    for (pair, (q, o)) in qs.chunks_exact(32).zip(o.chunks_exact_mut(64)).enumerate() {
                        let (s1, m1) = k_scale_min(2 * pair, scales);
                        let (s2, m2) = k_scale_min(2 * pair + 1, scales);
                        for (l, &byte) in q.iter().enumerate() {
                            o[l] = d * s1 * f32::from(byte & 0x0F) - dmin * m1;
                            o[l + 32] = d * s2 * f32::from(byte >> 4) - dmin * m2;
                        }
                    }
                }
            }
            QuantFormat::Q5_1 => {
                for (b, o) in blocks {
                    let (d, m) = (half_at(b, 0), half_at(b, 2));
                    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                    let qs = &b[8..24];
                    for (j, o) in o.iter_mut().enumerate() {
                        let nibble = (qs[j % 16] >> (4 * (j / 16))) & 0x0F;
                        let q = nibble | (((qh >> j) & 1) as u8) << 4;
                        *o = d * f32::from(q) + m;
                    }
                }
            }
            QuantFormat::Q2_K => {
                for (b, o) in blocks {
                    let (scales, qs) = (&b[..16], &b[16..80]);
                    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
                    for (k, o) in o.iter_mut().enumerate() {
                        let sc = scales[k / 16];
                        let dl = d * f32::from(sc & 0x0F);
                        let ml = dmin * f32::from(sc >> 4);
                        let q = (qs[k / 128 * 32 + k % 32] >> (2 * (k % 128 / 32))) & 3;
                        *o = dl * f32::from(q) - ml;
                    }
                }
            }
            QuantFormat::Q3_K => {
                for (b, o) in blocks {
                    let (hmask, qs, scales) = (&b[..32], &b[32..96], &b[96..108]);
                    let d = half_at(b, 108);
                    // Sixteen 6-bit scales: low four bits in bytes 0..8 (two
                    // per byte), high two in bytes 8..12 (four per byte).
                    let scale = |i: usize| {
                        let low = (scales[i % 8] >> (4 * (i / 8))) & 0x0F;
                        let high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
                        f32::from((low | high << 4) as i8 - 32)
                    };
                    for (k, o) in o.iter_mut().enumerate() {
                        let low = (qs[k / 128 * 32 + k % 32] >> (2 * (k % 128 / 32))) & 3;
                        let high = (hmask[k % 32] >> (k / 32)) & 1;
                        let q = low as i8 - if high == 0 { 4 } else { 0 };
                        *o = d * scale(k / 16) * f32::from(q);
                    }
                }
            }
            QuantFormat::Q5_K => {
                for (b, o) in blocks {
                    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
                    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
                    for (k, o) in o.iter_mut().enumerate() {
                        let (sc, m) = k_scale_min(k / 32, scales);
                        let low = (qs[k / 64 * 32 + k % 32] >> (4 * (k % 64 / 32))) & 0x0F;
                        let high = (qh[k % 32] >> (k / 32)) & 1;
                        *o = d * sc * f32::from(low | high << 4) - dmin * m;
                    }
                }
            }
            QuantFormat::Q6_K => {
                // Weight `32q + l` of a 128-weight half (quarter `q`, 0 ≤ l < 32):
                // four low bits from `ql[l + 32 (q % 2)]` (its high nibble when
                // q ≥ 2), two high bits `2q` up in `qh[l]`, minus 32, times
                // `d · scale[2q + l / 16]` (its 16-weight run). Run by run, so each
                // inner loop is 16 lanes of the same shifts (it vectorises).
                for (b, o) in blocks {
                    let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
                    let d = half_at(b, 208);
                    for half in 0..2 {
                        let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
                        let sc = &scales[8 * half..];
                        for quarter in 0..4 {
                            let (low_at, low_shift) = (32 * (quarter % 2), 4 * (quarter / 2));
                            for run in 0..2 {
                                let scale = d * f32::from(sc[run + 2 * quarter] as i8);
                                let first = 16 * run;
                                let out = &mut o[128 * half + 32 * quarter + first..][..16];
                                let low = &ql[low_at + first..][..16];
                                let high = &qh[first..][..16];
                                for ((y, &l), &h) in out.iter_mut().zip(low).zip(high) {
                                    let q =
                                        ((l >> low_shift) & 0x0F) | (((h >> (2 * quarter)) & 3) << 4);
                                    *y = scale * f32::from(q as i8 - 32);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Encodes one row as `format` with llama.cpp's reference rounding. The
/// K formats have no encoder here (they are only read); asking for one
/// returns `None`.
pub fn quantize_row(format: QuantFormat, row: &[f32]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(format.row_bytes(row.len()));
    match format {
        QuantFormat::F32 => row
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        QuantFormat::F16 => row
            .iter()
            .for_each(|&v| out.extend_from_slice(&f16::from_f32(v).to_le_bytes())),
        QuantFormat::BF16 => row
            .iter()
            .for_each(|&v| out.extend_from_slice(&bf16::from_f32(v).to_le_bytes())),
        QuantFormat::Q4_0 => {
            for block in row.chunks_exact(32) {
                // The signed extreme maps to -8 so the full 4-bit range is used.
                let extreme = block
                    .iter()
                    .copied()
                    .fold(0.0f32, |e, v| if v.abs() > e.abs() { v } else { e });
                let d = extreme / -8.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as u8).min(15);
                out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
            }
        }
        QuantFormat::Q4_1 => {
            for block in row.chunks_exact(32) {
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as u8).min(15);
                out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
            }
        }
        QuantFormat::Q8_0 => {
            for block in row.chunks_exact(32) {
                let amax = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(block.iter().map(|&v| (v * id).round() as i8 as u8));
            }
        }
        QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
            for block in row.chunks_exact(32) {
                // Q5_0: the signed extreme maps to -16; Q5_1: the range
                // from the minimum over 31 steps.
                let (d, min) = if format == QuantFormat::Q5_0 {
                    let extreme = block
                        .iter()
                        .copied()
                        .fold(0.0f32, |e, v| if v.abs() > e.abs() { v } else { e });
                    (extreme / -16.0, None)
                } else {
                    let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    ((max - min) / 31.0, Some(min))
                };
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| match min {
                    Some(min) => (((v - min) * id + 0.5) as u8).min(31),
                    None => ((v * id + 16.5) as i8).min(31) as u8,
                };
                if let Some(min) = min {
                    out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                }
                let mut qh = 0u32;
                let mut qs = [0u8; 16];
                for j in 0..16 {
                    let (low, high) = (q(block[j]), q(block[j + 16]));
                    qs[j] = (low & 0x0F) | (high & 0x0F) << 4;
                    qh |= u32::from(low >> 4) << j | u32::from(high >> 4) << (j + 16);
                }
                out.extend_from_slice(&qh.to_le_bytes());
                out.extend_from_slice(&qs);
            }
        }
        QuantFormat::Q2_K
        | QuantFormat::Q3_K
        | QuantFormat::Q4_K
        | QuantFormat::Q5_K
        | QuantFormat::Q6_K => return None,
    }
    Some(out)
}

/// How a run of rows is stored.
#[derive(Debug, Clone)]
enum Storage {
    /// Q4_0 and Q4_K, repacked at load: nibbles contiguous, scales and
    /// offsets as f32 (Q4_0's offset `-8 d` and Q4_K's products of two
    /// scales are not f16 values).
    Nibbles {
        quants: Vec<u8>,
        scales: Vec<f32>,
        offsets: Vec<f32>,
    },
    /// Q4_1, repacked the same way with its scale and minimum kept as the
    /// file's f16: 20 bytes a block instead of 24.
    HalfNibbles {
        quants: Vec<u8>,
        scales: Vec<Half>,
        offsets: Vec<Half>,
    },
    /// Q8_0, its signed bytes contiguous, the scale as the file's f16.
    Bytes { quants: Vec<u8>, scales: Vec<Half> },
    /// Q5_0: the file's nibbles, fifth bits and f16 scale.
    FiveBits {
        quants: Vec<u8>,
        high: Vec<u32>,
        scales: Vec<Half>,
    },
    /// Every other format, as the file holds it; rows are decoded to f32
    /// before they meet activations.
    File(Vec<u8>),
}

impl Storage {
    /// Stores `data` (whole rows of `format`), repacking 32-weight formats.
    fn new(format: QuantFormat, data: Vec<u8>) -> Storage {
        let blocks = || data.chunks_exact(format.block_bytes());
        let scale_offsets = || blocks().map(|b| block32_scale_offset(format, b));
        let half = |b: &[u8], at: usize| Half(u16::from_le_bytes([b[at], b[at + 1]]));
        match format {
            QuantFormat::Q4_0 => Storage::Nibbles {
                quants: blocks().flat_map(|b| &b[2..18]).copied().collect(),
                scales: scale_offsets().map(|(s, _)| s).collect(),
                offsets: scale_offsets().map(|(_, o)| o).collect(),
            },
            QuantFormat::Q4_1 => Storage::HalfNibbles {
                quants: blocks().flat_map(|b| &b[4..20]).copied().collect(),
                scales: blocks().map(|b| half(b, 0)).collect(),
                offsets: blocks().map(|b| half(b, 2)).collect(),
            },
            QuantFormat::Q8_0 => Storage::Bytes {
                quants: blocks().flat_map(|b| &b[2..34]).copied().collect(),
                scales: blocks().map(|b| half(b, 0)).collect(),
            },
            // Kept at five bits (22 bytes a block, not widened to signed
            // bytes' 36): a decode step reads Q5_0 matrices whole.
            QuantFormat::Q5_0 => Storage::FiveBits {
                quants: blocks().flat_map(|b| &b[6..22]).copied().collect(),
                high: blocks().map(q5_0_high).collect(),
                scales: blocks().map(|b| half(b, 0)).collect(),
            },
            QuantFormat::Q4_K => q4_k_nibbles(blocks()),
            _ => Storage::File(data),
        }
    }

    fn append(&mut self, other: Storage) {
        match (self, other) {
            (
                Storage::Nibbles {
                    quants,
                    scales,
                    offsets,
                },
                Storage::Nibbles {
                    quants: q,
                    scales: s,
                    offsets: o,
                },
            ) => {
                quants.extend(q);
                scales.extend(s);
                offsets.extend(o);
            }
            (
                Storage::HalfNibbles {
                    quants,
                    scales,
                    offsets,
                },
                Storage::HalfNibbles {
                    quants: q,
                    scales: s,
                    offsets: o,
                },
            ) => {
                quants.extend(q);
                scales.extend(s);
                offsets.extend(o);
            }
            (
                Storage::Bytes { quants, scales },
                Storage::Bytes {
                    quants: q,
                    scales: s,
                },
            ) => {
                quants.extend(q);
                scales.extend(s);
            }
            (
                Storage::FiveBits {
                    quants,
                    high,
                    scales,
                },
                Storage::FiveBits {
                    quants: q,
                    high: h,
                    scales: s,
                },
            ) => {
                quants.extend(q);
                high.extend(h);
                scales.extend(s);
            }
            (Storage::File(data), Storage::File(d)) => data.extend(d),
            _ => unreachable!("only parts of one format are merged"),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Storage::Nibbles {
                quants,
                scales,
                offsets,
            } => quants.len() + 4 * (scales.len() + offsets.len()),
            Storage::HalfNibbles {
                quants,
                scales,
                offsets,
            } => quants.len() + 2 * (scales.len() + offsets.len()),
            Storage::Bytes { quants, scales } => quants.len() + 2 * scales.len(),
            Storage::FiveBits {
                quants,
                high,
                scales,
            } => quants.len() + 4 * high.len() + 2 * scales.len(),
            Storage::File(data) => data.len(),
        }
    }
}

/// A run of consecutive rows sharing one encoding.
#[derive(Debug, Clone)]
struct Part {
    format: QuantFormat,
    rows: usize,
    storage: Storage,
}

/// Consecutive weight rows of one part, borrowed.
#[derive(Clone, Copy)]
enum Run<'a> {
    Nibbles(Nibbles<'a>),
    HalfNibbles(Nibbles<'a, Half>),
    Bytes(Bytes<'a>),
    FiveBits(FiveBits<'a>),
    SixBits(SixBits<'a>),
    File(QuantFormat, &'a [u8]),
}

/// A weight matrix `[n][k]` (output-major, like Hugging Face's `[out][in]`)
/// loaded from GGUF: Q4_0, Q4_1 and Q8_0 repacked for the kernels, other
/// formats as the file holds them. Rows may come from several tensors of
/// different formats (Q, K and V stacked), each a `Part`.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    n: usize,
    k: usize,
    parts: Vec<Part>,
}

/// Activation rows up to which 32-weight formats decode in registers, once
/// per tile of four activation rows; above it, each task's weight rows are
/// decoded once to memory. Measured on SmolLM2 (2 cores): at 32 rows the
/// register path decodes 328 tok/s against 297 through memory; at 128 and
/// 512 (prefill) the two are equal. Both paths give the same bits (see
/// `qtile`), so the switch cannot break batch invariance.
const FUSED_MAX_ROWS: usize = 32;
/// Activation rows from which matmuls run lane-major (`qtile::lanes`)
/// where that kernel exists (AVX2). Measured on SmolLM2 under
/// `KVFENCE_MAX_ISA=avx2` (2 cores, alternated runs): prefill 128 / 512
/// 204–220 / 846–878 ms → 159–165 / 672–703, decode at batch 32 86–88 →
/// 67–74 ms; at batch 8 it was 22 → 33–37 ms (each task's rows decoded and
/// regrouped for only eight rows), so batches below sixteen keep the
/// register tiles.
const LANES_MIN_ROWS: usize = 16;
/// Weight rows per parallel task.
const TASK_ROWS: usize = 16;
/// Multiply-adds below which a matmul stays on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 18;

impl QuantMatrix {
    /// A matrix of `rows` rows of `k` weights encoded as `format`.
    ///
    /// Panics if `data` is not exactly that many rows: callers check
    /// shapes against the file before building.
    pub fn new(format: QuantFormat, rows: usize, k: usize, data: Vec<u8>) -> QuantMatrix {
        assert_eq!(
            k % format.block_elements(),
            0,
            "row length must be whole blocks"
        );
        assert_eq!(
            data.len(),
            rows * format.row_bytes(k),
            "data must be rows * row_bytes"
        );
        QuantMatrix {
            n: rows,
            k,
            parts: vec![Part {
                format,
                rows,
                storage: Storage::new(format, data),
            }],
        }
    }

    /// Stacks matrices of the same width: rows of `parts[0]`, then `parts[1]`, ...
    pub fn stack(parts: Vec<QuantMatrix>) -> QuantMatrix {
        let k = parts.first().map_or(0, |p| p.k);
        assert!(
            parts.iter().all(|p| p.k == k),
            "stacked matrices must share k"
        );
        let mut merged: Vec<Part> = Vec::new();
        for part in parts.into_iter().flat_map(|p| p.parts) {
            match merged.last_mut() {
                Some(last) if last.format == part.format => {
                    last.rows += part.rows;
                    last.storage.append(part.storage);
                }
                _ => merged.push(part),
            }
        }
        QuantMatrix {
            n: merged.iter().map(|p| p.rows).sum(),
            k,
            parts: merged,
        }
    }

    /// Output width.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input width.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes of weights one full pass reads (repacked formats included).
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.storage.bytes()).sum()
    }

    /// The rows from `row` to the end of its part, and how many there are.
    fn run(&self, mut row: usize) -> (Run<'_>, usize) {
        let k = self.k;
        let blocks = k / qtile::BLOCK;
        for part in &self.parts {
            if row < part.rows {
                let run = match &part.storage {
                    Storage::Nibbles {
                        quants,
                        scales,
                        offsets,
                    } => Run::Nibbles(Nibbles {
                        quants: &quants[row * k / 2..],
                        scales: &scales[row * blocks..],
                        offsets: &offsets[row * blocks..],
                    }),
                    Storage::HalfNibbles {
                        quants,
                        scales,
                        offsets,
                    } => Run::HalfNibbles(Nibbles {
                        quants: &quants[row * k / 2..],
                        scales: &scales[row * blocks..],
                        offsets: &offsets[row * blocks..],
                    }),
                    Storage::Bytes { quants, scales } => Run::Bytes(Bytes {
                        quants: &quants[row * k..],
                        scales: &scales[row * blocks..],
                    }),
                    Storage::FiveBits {
                        quants,
                        high,
                        scales,
                    } => Run::FiveBits(FiveBits {
                        quants: &quants[row * k / 2..],
                        high: &high[row * blocks..],
                        scales: &scales[row * blocks..],
                    }),
                    Storage::File(data) => {
                        let rows = &data[row * part.format.row_bytes(k)..];
                        match part.format {
                            QuantFormat::Q6_K => Run::SixBits(SixBits(rows)),
                            format => Run::File(format, rows),
                        }
                    }
                };
                return (run, part.rows - row);
            }
            row -= part.rows;
        }
        unreachable!("row index is below n, the sum of the parts' rows")
    }

    /// Decodes the rows from `first` on into `out` (whole rows of `k`).
    fn decode_rows(&self, mut first: usize, mut out: &mut [f32]) {
        let k = self.k;
        while !out.is_empty() {
            let (run, available) = self.run(first);
            let rows = available.min(out.len() / k);
            let (dst, rest) = out.split_at_mut(rows * k);
            match run {
                Run::Nibbles(r) => qtile::decode_rows_of(r, k, dst),
                Run::HalfNibbles(r) => qtile::decode_rows_of(r, k, dst),
                Run::Bytes(r) => qtile::decode_rows_of(r, k, dst),
                Run::FiveBits(r) => qtile::decode_rows_of(r, k, dst),
                Run::SixBits(r) => qtile::decode_rows_of(r, k, dst),
                Run::File(format, bytes) => {
                    for (row, d) in bytes
                        .chunks(format.row_bytes(k))
                        .zip(dst.chunks_exact_mut(k))
                    {
                        dequantize_row(format, row, d);
                    }
                }
            }
            first += rows;
            out = rest;
        }
    }

    /// Decodes row `row` into `out` (`k` wide).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.k, "a row is k wide");
        self.decode_rows(row, out);
    }

    /// `out[m][n] = x[m][k] · wᵀ`.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        let (n, k) = (self.n, self.k);
        assert_eq!(x.len(), m * k, "matmul input must be m * k");
        assert_eq!(out.len(), m * n, "matmul output must be m * n");
        if m == 0 {
            return;
        }
        let parallel = m * n * k >= PARALLEL_MIN_MACS;
        // The kernels work on whole 32-weight blocks. Widths that are not
        // (only possible for F32/F16/BF16 rows) are padded with zeros,
        // which add nothing to any lane.
        let padded;
        let x = if k % qtile::BLOCK == 0 {
            x
        } else {
            let wide = k.next_multiple_of(qtile::BLOCK);
            let mut p = vec![0.0f32; m * wide];
            for (dst, src) in p.chunks_exact_mut(wide).zip(x.chunks_exact(k)) {
                dst[..k].copy_from_slice(src);
            }
            padded = p;
            &padded
        };
        if m >= LANES_MIN_ROWS
            && let Some(kernel) = LaneKernel::detect()
        {
            return self.matmul_lanes(kernel, x, m, parallel, out);
        }
        let work = |(task, chunk): (usize, &mut [f32])| {
            let first = task * TASK_ROWS;
            self.task(first, TASK_ROWS.min(n - first), x, m, chunk);
        };
        if m == 1 {
            // One activation row: each task's outputs are a chunk of `out`.
            if parallel {
                out.par_chunks_mut(TASK_ROWS).enumerate().for_each(work);
            } else {
                out.chunks_mut(TASK_ROWS).enumerate().for_each(work);
            }
            return;
        }
        self.by_tasks(m, parallel, out, work);
    }

    /// Runs `work(task, chunk)` for every task of [`TASK_ROWS`] weight
    /// rows, each writing its `[row][TASK_ROWS]` chunk of a task-major
    /// scratch (so tasks write disjoint memory), then gathers the chunks
    /// into `out` (`m` rows of `n`).
    fn by_tasks(
        &self,
        m: usize,
        parallel: bool,
        out: &mut [f32],
        work: impl Fn((usize, &mut [f32])) + Sync + Send,
    ) {
        let n = self.n;
        let tasks = n.div_ceil(TASK_ROWS);
        with_scratch(&SCRATCH, tasks * m * TASK_ROWS, |scratch| {
            if parallel {
                scratch
                    .par_chunks_mut(m * TASK_ROWS)
                    .enumerate()
                    .for_each(work);
            } else {
                scratch.chunks_mut(m * TASK_ROWS).enumerate().for_each(work);
            }
            for (task, chunk) in scratch.chunks(m * TASK_ROWS).enumerate() {
                let cols = TASK_ROWS.min(n - task * TASK_ROWS);
                for row in 0..m {
                    out[row * n + task * TASK_ROWS..][..cols]
                        .copy_from_slice(&chunk[row * TASK_ROWS..][..cols]);
                }
            }
        });
    }

    /// [`QuantMatrix::matmul`] by lane-major tiles (see `qtile::lanes`):
    /// the activations regrouped once, each task's weight rows decoded and
    /// regrouped once, then every group of activation rows against every
    /// tile of the task's rows. The same bits as every other path.
    fn matmul_lanes(
        &self,
        kernel: LaneKernel,
        x: &[f32],
        m: usize,
        parallel: bool,
        out: &mut [f32],
    ) {
        let wide = x.len() / m;
        let group_len = lanes::GROUP_ROWS * wide;
        let groups = m.div_ceil(lanes::GROUP_ROWS);
        with_scratch(&LANES, groups * group_len, |grouped| {
            let regroup = |(g, group): (usize, &mut [f32])| {
                let rows = &x[g * group_len..x.len().min((g + 1) * group_len)];
                kernel.interleave_group(rows, wide, group);
            };
            if parallel {
                grouped
                    .par_chunks_mut(group_len)
                    .enumerate()
                    .for_each(regroup);
            } else {
                grouped.chunks_mut(group_len).enumerate().for_each(regroup);
            }
            let grouped = &*grouped;
            self.by_tasks(m, parallel, out, |(task, chunk)| {
                let first = task * TASK_ROWS;
                let count = TASK_ROWS.min(self.n - first);
                with_scratch(&DECODED, count * wide, |decoded| {
                    self.decode_task(first, wide, decoded);
                    let tiles_len = count.next_multiple_of(lanes::TILE_WEIGHTS) * wide;
                    with_scratch(&TILES, tiles_len, |tiles| {
                        kernel.interleave_tiles(decoded, wide, tiles);
                        kernel.dots(grouped, m, tiles, count, wide, TASK_ROWS, chunk);
                    });
                });
            });
        });
    }

    /// One task: `out[r * TASK_ROWS + c] = x[r] · w[first + c]` for
    /// `c < count`.
    fn task(&self, first: usize, count: usize, x: &[f32], m: usize, out: &mut [f32]) {
        let k = self.k;
        let (run, available) = self.run(first);
        if m <= FUSED_MAX_ROWS && available >= count {
            match run {
                Run::Nibbles(rows) => {
                    return qtile::dots_of(rows, count, x, k, TASK_ROWS, out);
                }
                Run::HalfNibbles(rows) => {
                    return qtile::dots_of(rows, count, x, k, TASK_ROWS, out);
                }
                Run::Bytes(rows) => return qtile::dots_of(rows, count, x, k, TASK_ROWS, out),
                Run::FiveBits(rows) => {
                    return qtile::dots_of(rows, count, x, k, TASK_ROWS, out);
                }
                Run::SixBits(rows) => {
                    return qtile::dots_of(rows, count, x, k, TASK_ROWS, out);
                }
                Run::File(..) => {}
            }
        }
        // The task's weight rows, decoded once and then reused by every
        // activation row while they sit in L1/L2 (zero-padded like `x`).
        let wide = x.len() / m;
        with_scratch(&DECODED, count * wide, |decoded| {
            self.decode_task(first, wide, decoded);
            qtile::dots_decoded(decoded, x, wide, TASK_ROWS, out);
        });
    }

    /// Decodes the rows from `first` on into `decoded`, rows `wide`
    /// floats apart, zero past `k`.
    fn decode_task(&self, first: usize, wide: usize, decoded: &mut [f32]) {
        if wide == self.k {
            self.decode_rows(first, decoded);
        } else {
            for (i, dst) in decoded.chunks_exact_mut(wide).enumerate() {
                let (row, padding) = dst.split_at_mut(self.k);
                self.decode_rows(first + i, row);
                padding.fill(0.0);
            }
        }
    }
}

thread_local! {
    /// Per-thread buffers reused across matmuls: a fresh multi-megabyte
    /// buffer costs a page fault per 4 KiB on every call (measured: 15 % of
    /// batch-32 decode was the kernel clearing pages).
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static DECODED: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static LANES: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static TILES: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` on `len` floats of this thread's `buffer`. Contents are left
/// from earlier calls: `f` must write before it reads. A nested call (a
/// pool thread stealing another matmul's task while it waits) finds the
/// buffer taken and allocates its own.
fn with_scratch<R>(
    buffer: &'static std::thread::LocalKey<Cell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    let mut held = buffer.take();
    if held.len() < len {
        held.resize(len, 0.0);
    }
    let result = f(&mut held[..len]);
    buffer.set(held);
    result
}

#[cfg(test)]
mod tests;
