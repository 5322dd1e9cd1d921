//! Tests of `attention`.

use super::*;

fn staged_both_ways<E: KvValue>(make: impl Fn(f32) -> E) {
    // 37 keys: two 16-key blocks, an 8-key block and a remainder.
    let (n, hd) = (37, 64);
    let run: Vec<E> = (0..n * hd)
        .map(|i| make(((i * 7919) % 1000) as f32 / 250.0 - 2.0))
        .collect();
    let mut fast = vec![f32::NAN; hd * CHUNK];
    let done = transpose_fast(&run, n, hd, &mut fast, 3);
    let mut wide = vec![0.0; (n - done) * hd];
    E::widen(&run[done * hd..], &mut wide);
    transpose_into(&wide, n - done, hd, &mut fast, 3 + done);
    let mut all = vec![0.0; n * hd];
    E::widen(&run, &mut all);
    let mut slow = vec![f32::NAN; hd * CHUNK];
    transpose_into(&all, n, hd, &mut slow, 3);
    for d in 0..hd {
        for j in 3..3 + n {
            let (a, b) = (fast[d * CHUNK + j], slow[d * CHUNK + j]);
            assert_eq!(a.to_bits(), b.to_bits(), "key {j}, dimension {d}");
        }
    }
    let mut widened = vec![0.0; n * hd];
    widen_fast(&run, &mut widened);
    assert_eq!(widened, all, "SIMD widening must equal the portable one");
}

/// Runs one chunk kernel over copies of the inputs; returns each
/// head's `(max, den, out)` bits, `None` where its row sees nothing.
fn run_chunk<V: ?Sized>(
    kernel: impl FnOnce(ChunkData<'_, V>, ChunkShape),
    shape: ChunkShape,
    queries: &[f32],
    keys: &[f32],
    values: &V,
) -> Vec<Option<(u32, u32, Vec<u32>)>> {
    let hd = shape.head_dim;
    let mut scores = vec![f32::NAN; shape.heads * CHUNK];
    let mut out = vec![7.0; shape.heads * hd];
    let mut max = vec![7.0; shape.heads];
    let mut den = vec![7.0; shape.heads];
    kernel(
        ChunkData {
            queries,
            keys,
            values,
            scores: &mut scores,
            out: &mut out,
            max: &mut max,
            den: &mut den,
        },
        shape,
    );
    (0..shape.heads)
        .map(|h| {
            let (lo, n) = seen_in_chunk(
                shape.first_row_end + h / shape.group,
                shape.window,
                shape.start,
                shape.len,
            );
            let sees = lo < n;
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let head_out = &out[h * hd..(h + 1) * hd];
            if !sees {
                assert!(
                    head_out.iter().chain([&max[h], &den[h]]).all(|&x| x == 7.0),
                    "a head that sees none of the chunk must be left as it was"
                );
                return None;
            }
            Some((max[h].to_bits(), den[h].to_bits(), bits(head_out)))
        })
        .collect()
}

#[cfg(target_arch = "x86_64")]
proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]

    /// The AVX-512 chunk kernel computes the portable one's bits, for
    /// decode rows and causal prefill tiles, chunks cut short, values
    /// in page runs of any length, f32 and f16 values, and contents
    /// with NaN and infinities (poisoned or overflowing KV).
    #[test]
    fn avx512_chunk_kernel_equals_the_portable_one(
        rows in 1usize..=TILE_ROWS,
        group in 1usize..=4,
        dims in 1usize..=5,
        len in 1usize..=CHUNK,
        before in 0usize..200,
        page_size in 1usize..=32,
        seed in proptest::prelude::any::<u64>(),
        poison in 0usize..4,
        half_values in proptest::prelude::any::<bool>(),
        window in 1usize..400,
    ) {
        let Some(cpu) = avx512::Cpu::detect() else { return Ok(()) };
        let hd = 16 * dims;
        let heads = rows * group;
        // The chunk starts at a multiple of CHUNK; the tile's first row
        // sees `before` positions past the chunk's start (clipped).
        let start = CHUNK * (before % 3);
        let first_row_end = start + 1 + before.min(len - 1);
        let cols = len.next_multiple_of(KEY_STEP);
        let mut state = seed | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let x = (state >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0;
            match (state >> 8) % 400 {
                0 if poison == 1 => f32::NAN,
                1 if poison == 2 => f32::INFINITY,
                2 if poison == 3 => f32::NEG_INFINITY,
                _ => x,
            }
        };
        let queries: Vec<f32> = (0..heads * hd).map(|_| next()).collect();
        let mut keys: Vec<f32> = (0..hd * CHUNK).map(|_| next()).collect();
        for d in 0..hd {
            keys[d * CHUNK + len..d * CHUNK + cols].fill(0.0);
        }
        let values: Vec<f32> = (0..len * hd).map(|_| next()).collect();
        // Half the cases slide a window over the chunk, the rest see all.
        let window = if window < 200 { window } else { usize::MAX };
        let shape = ChunkShape { heads, group, head_dim: hd, cols, start, first_row_end, window, len };
        // Page runs as `stage` cuts them: the chunk starts mid-page.
        let cut = |all_len: usize| {
            let mut ends = Vec::new();
            for_page_runs(page_size, start + 3, len, |_, _, run, j| ends.push((j, j + run)));
            assert_eq!(ends.last().map(|e| e.1), Some(all_len / hd));
            ends
        };
        let (portable, simd) = if half_values {
            let narrow: Vec<f16> = values.iter().map(|&x| f16::from_f32(x)).collect();
            let wide: Vec<f32> = narrow.iter().map(|x| x.to_f32()).collect();
            let runs: Vec<&[f16]> =
                cut(narrow.len()).iter().map(|&(a, b)| &narrow[a * hd..b * hd]).collect();
            (
                run_chunk(chunk_kernel, shape, &queries, &keys, &wide[..]),
                run_chunk(|d, s| avx512::chunk(cpu, d, s), shape, &queries, &keys, &runs[..]),
            )
        } else {
            let runs: Vec<&[f32]> =
                cut(values.len()).iter().map(|&(a, b)| &values[a * hd..b * hd]).collect();
            (
                run_chunk(chunk_kernel, shape, &queries, &keys, &values[..]),
                run_chunk(|d, s| avx512::chunk(cpu, d, s), shape, &queries, &keys, &runs[..]),
            )
        };
        proptest::prop_assert_eq!(simd, portable);
    }
}

#[test]
fn simd_staging_stores_what_the_portable_loop_stores() {
    staged_both_ways(|x| x);
    staged_both_ways(f16::from_f32);
    staged_both_ways(bf16::from_f32);
}
