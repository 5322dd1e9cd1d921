//! Tests of `quant`.

use super::*;
use proptest::prelude::*;

use crate::qtile::tests::floats as values;

/// One block each of Q4_K and Q6_K with fixed bytes, and values decoded
/// from them by llama.cpp's own reference (`gguf` Python package 0.19,
/// `gguf.quants.dequantize`), so the bit layout is pinned to ggml's.
fn k_block(format: QuantFormat) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..format.block_bytes())
        .map(|i| (i as u32 * 37 % 251) as u8)
        .collect();
    let d_at = if format == QuantFormat::Q4_K { 0 } else { 208 };
    bytes[d_at..d_at + 2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
    if format == QuantFormat::Q4_K {
        bytes[2..4].copy_from_slice(&f16::from_f32(0.02).to_le_bytes());
    }
    bytes
}

#[test]
fn k_formats_decode_like_ggml() {
    for (format, expected) in [
        (QuantFormat::Q4_K, Q4_K_EXPECTED),
        (QuantFormat::Q6_K, Q6_K_EXPECTED),
    ] {
        let mut out = vec![0.0; 256];
        dequantize_row(format, &k_block(format), &mut out);
        for (i, (&got, &want)) in out.iter().step_by(17).zip(expected).enumerate() {
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "{format:?} element {}: {got} vs {want}",
                i * 17
            );
        }
    }
}

/// Four blocks of `format`: bytes `(37 i + 11 b) mod 251`, the f16
/// scale fields set to finite values (block `b`'s scaled by `b + 1`).
fn reference_blocks(format: QuantFormat, scales: &[(usize, f32)]) -> Vec<u8> {
    let size = format.block_bytes();
    (0..4)
        .flat_map(|b| {
            let mut block: Vec<u8> = (0..size).map(|i| ((i * 37 + b * 11) % 251) as u8).collect();
            for &(at, value) in scales {
                let scaled = f16::from_f32(value * (b + 1) as f32);
                block[at..at + 2].copy_from_slice(&scaled.to_le_bytes());
            }
            block
        })
        .collect()
}

/// Every format read from GGUF files decodes bit for bit as llama.cpp's
/// reference does: the SHA-256 of the f32 values the `gguf` Python
/// package (0.x, `gguf.quants.dequantize`) gives for the same bytes.
#[test]
fn every_read_format_decodes_bit_exactly_as_the_reference() {
    use sha2::{Digest, Sha256};
    let cases = [
        (
            QuantFormat::Q5_0,
            &[(0, 0.01)][..],
            "c10f8795364e0acb7599c46e3f638525c2fa48db5ec4dc8d3b06b76baa140c25",
        ),
        (
            QuantFormat::Q5_1,
            &[(0, 0.01), (2, -0.3)][..],
            "4ea76871beccd57c07952d682aff1bb02de5db42aa917cbfff4814bf7d327738",
        ),
        (
            QuantFormat::Q2_K,
            &[(80, 0.01), (82, 0.02)][..],
            "503adb428b35b8fdfa3e39362a8d9dc36c6c6a12e66eadf0c93bda1d647b833f",
        ),
        (
            QuantFormat::Q3_K,
            &[(108, 0.01)][..],
            "b4035c5cc47986f479b239eceee6076016424be8dba2370d9ecb99d35ecb5c0e",
        ),
        (
            QuantFormat::Q4_K,
            &[(0, 0.01), (2, 0.02)][..],
            "03f7799a66226a3c59aa36be9d6edbbac5e41f563a3020892b819d78b895d026",
        ),
        (
            QuantFormat::Q5_K,
            &[(0, 0.01), (2, 0.02)][..],
            "6bb1b7f0852aa5e52195847f15f8472b4a6a7461e0aa59c7e3c7a5542c84ddad",
        ),
        (
            QuantFormat::Q6_K,
            &[(208, 0.01)][..],
            "a2f795fa09cc3347c5895802cacfeafbe657848c280d8bca21d041a66ac8f8bf",
        ),
    ];
    for (format, scales, expected) in cases {
        let bytes = reference_blocks(format, scales);
        let mut out = vec![0.0f32; 4 * format.block_elements()];
        dequantize_row(format, &bytes, &mut out);
        let digest = Sha256::digest(
            out.iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        let got: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(got, expected, "{format:?}: first values {:?}", &out[..3]);
    }
}

/// The encoders round as llama.cpp's reference does: the SHA-256 of
/// the bytes `gguf.quants.quantize` gives for the same row.
#[test]
fn encoders_write_the_reference_bytes() {
    use sha2::{Digest, Sha256};
    let row: Vec<f32> = (0..64)
        .map(|i| (((i * 37) % 101) as f32 - 50.0) / 7.0)
        .collect();
    for (format, expected) in [
        (
            QuantFormat::Q5_0,
            "b895970bc38d5a7d39e8b172379d95869069e028134b5fbe12964aeba29c21fa",
        ),
        (
            QuantFormat::Q5_1,
            "78cccc37e99d65dd43ee815c2db85b0ffe9c4d3a7c132ffa77f5234c62ad6647",
        ),
        (
            QuantFormat::Q4_0,
            "682e02a16ce0aa8e1bdfa9e06070e14a646e4356e37bef4a817bbb7e0e8dd564",
        ),
        (
            QuantFormat::Q4_1,
            "85db1b1818b0f5bcc00df37a2aee532dce043e1f4b4c3c28e22d71decbc8834a",
        ),
        (
            QuantFormat::Q8_0,
            "d434dbaba3d15a78bb8dff3a0a923c8eb60645e03087ff84c85641c3addba8c3",
        ),
    ] {
        let bytes = quantize_row(format, &row).unwrap();
        let got: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(got, expected, "{format:?}");
    }
}

const Q4_K_EXPECTED: &[f32] = &[
    1.10023, 0.900192, 5.34114, 0.780167, 1.00021, 2.20047, 0.640137, 0.0, 1.08023, 2.40051,
    0.920197, 3.96085, 2.54054, 2.06044, -0.250053, -0.650139,
];
const Q6_K_EXPECTED: &[f32] = &[
    0.0, 16.9536, -3.18068, -1.38029, -8.00171, 1.70036, 4.2309, -12.6027, -26.6257, 17.6438,
    -17.6938, -4.08087, -2.3405, -2.75059, 2.76059, 26.6757,
];

proptest! {
    #[test]
    fn encoders_round_trip_within_their_step(seed in any::<u64>(), blocks in 1usize..5) {
        let row = values(seed, blocks * 32);
        for (format, step) in [
            (QuantFormat::F32, 0.0), (QuantFormat::F16, 1e-3), (QuantFormat::BF16, 8e-3),
            (QuantFormat::Q8_0, 1.0 / 127.0), (QuantFormat::Q4_1, 2.0 / 15.0), (QuantFormat::Q4_0, 2.0 / 8.0),
        ] {
            let bytes = quantize_row(format, &row).unwrap();
            prop_assert_eq!(bytes.len(), format.row_bytes(row.len()));
            let mut back = vec![0.0; row.len()];
            dequantize_row(format, &bytes, &mut back);
            for (a, b) in row.iter().zip(&back) {
                prop_assert!((a - b).abs() <= step * 0.51 + 1e-3, "{:?}: {} vs {}", format, a, b);
            }
        }
    }

    #[test]
    fn matmul_matches_decoded_reference_and_rows_are_batch_invariant(
        m in 1usize..80, n in 1usize..40, blocks in 1usize..4, seed in any::<u64>(),
    ) {
        let k = blocks * 32;
        let x = values(seed, m * k);
        let w = values(seed ^ 0x9e37, n * k);
        // Rows from six formats stacked, as Q, K and V may be.
        let formats = [
            QuantFormat::Q4_1,
            QuantFormat::Q4_0,
            QuantFormat::F16,
            QuantFormat::Q5_0,
            QuantFormat::Q8_0,
            QuantFormat::Q5_1,
        ];
        let format_of = |c: usize| formats[c * formats.len() / n];
        let file_row = |c: usize| quantize_row(format_of(c), &w[c * k..(c + 1) * k]).unwrap();
        let matrix = QuantMatrix::stack(
            formats
                .iter()
                .map(|&format| {
                    let rows: Vec<usize> = (0..n).filter(|&c| format_of(c) == format).collect();
                    let data = rows.iter().flat_map(|&c| file_row(c)).collect();
                    QuantMatrix::new(format, rows.len(), k, data)
                })
                .collect(),
        );
        let mut out = vec![0.0; m * n];
        matrix.matmul(&x, m, &mut out);
        let (mut decoded, mut stored) = (vec![0.0; k], vec![0.0; k]);
        for c in 0..n {
            // The reference decodes the file's bytes; the matrix's
            // repacked rows must hold exactly those values.
            dequantize_row(format_of(c), &file_row(c), &mut decoded);
            matrix.dequantize_row(c, &mut stored);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&stored), bits(&decoded), "row {} as stored", c);
            for r in 0..m {
                let want: f32 = x[r * k..(r + 1) * k].iter().zip(&decoded).map(|(a, b)| a * b).sum();
                let bound: f32 = x[r * k..(r + 1) * k].iter().zip(&decoded).map(|(a, b)| (a * b).abs()).sum::<f32>() * 1e-5 + 1e-6;
                prop_assert!((out[r * n + c] - want).abs() <= bound, "({}, {}): {} vs {}", r, c, out[r * n + c], want);
            }
        }
        for r in 0..m {
            let mut alone = vec![0.0; n];
            matrix.matmul(&x[r * k..(r + 1) * k], 1, &mut alone);
            prop_assert_eq!(&alone[..], &out[r * n..(r + 1) * n], "row {} differs alone", r);
        }
    }

    /// Q4_K rows repacked as nibbles and Q6_K rows read in place hold the
    /// reference decoder's exact values, stacked after Q8_0 rows as an
    /// attention block's may be, and their matmul is that of the decoded
    /// rows, batch-invariant.
    #[test]
    fn k_rows_in_register_tiles_keep_the_reference_values(
        m in 1usize..12, n in 1usize..20, supers in 1usize..3, seed in any::<u64>(), six in any::<bool>(),
    ) {
        let (format, scales) = if six {
            (QuantFormat::Q6_K, &[(208, 0.001)][..])
        } else {
            (QuantFormat::Q4_K, &[(0, 0.001), (2, 0.0007)][..])
        };
        let size = format.block_bytes();
        let k = supers * 256;
        let mut state = seed | 1;
        let mut byte = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 32) as u8
        };
        let mut kq: Vec<u8> = (0..n * supers * size).map(|_| byte()).collect();
        for (i, block) in kq.chunks_exact_mut(size).enumerate() {
            for (j, &(at, value)) in scales.iter().enumerate() {
                let scale = f16::from_f32(value * (1 + i % (7 - 2 * j)) as f32);
                block[at..at + 2].copy_from_slice(&scale.to_le_bytes());
            }
        }
        let head = quantize_row(QuantFormat::Q8_0, &values(seed, k)).unwrap();
        let matrix = QuantMatrix::stack(vec![
            QuantMatrix::new(QuantFormat::Q8_0, 1, k, head.clone()),
            QuantMatrix::new(format, n, k, kq.clone()),
        ]);
        let x = values(seed ^ 5, m * k);
        let mut out = vec![0.0; m * (n + 1)];
        matrix.matmul(&x, m, &mut out);
        let (mut decoded, mut stored) = (vec![0.0; k], vec![0.0; k]);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for c in 0..n {
            let row = &kq[c * supers * size..(c + 1) * supers * size];
            dequantize_row(format, row, &mut decoded);
            matrix.dequantize_row(c + 1, &mut stored);
            prop_assert_eq!(bits(&stored), bits(&decoded), "row {} as stored", c);
            for r in 0..m {
                let xr = &x[r * k..(r + 1) * k];
                let want: f32 = xr.iter().zip(&decoded).map(|(a, b)| a * b).sum();
                let bound: f32 = xr.iter().zip(&decoded).map(|(a, b)| (a * b).abs()).sum::<f32>() * 1e-5 + 1e-6;
                let got = out[r * (n + 1) + c + 1];
                prop_assert!((got - want).abs() <= bound, "({}, {}): {} vs {}", r, c, got, want);
            }
        }
        for r in 0..m {
            let mut alone = vec![0.0; n + 1];
            matrix.matmul(&x[r * k..(r + 1) * k], 1, &mut alone);
            prop_assert_eq!(bits(&alone), bits(&out[r * (n + 1)..(r + 1) * (n + 1)]), "row {} alone", r);
        }
    }
}

#[test]
fn integer_formats_match_ggml_block_layout() {
    // Q4_1 of a ramp: element j is j/31, so the decoded block is that ramp again.
    let ramp: Vec<f32> = (0..32).map(|j| j as f32 / 31.0).collect();
    let bytes = quantize_row(QuantFormat::Q4_1, &ramp).unwrap();
    // Low nibbles hold elements 0..16, high nibbles 16..32 (ggml's layout).
    assert_eq!(bytes[4] & 0x0F, 0);
    assert_eq!(bytes[4] >> 4, 8);
    assert_eq!(bytes[19] >> 4, 15);
}
