//! Tests of `attention`.

use super::*;

/// Staging scratch whose key and value cells are NaN, so a cell staging
/// skipped shows.
fn poisoned_scratch(hd: usize) -> Scratch {
    Scratch {
        keys: vec![f32::NAN; hd * CHUNK],
        values: vec![f32::NAN; CHUNK * hd],
        scores: Vec::new(),
        queries: Vec::new(),
        chunk_out: Vec::new(),
        chunk_max: Vec::new(),
        chunk_den: Vec::new(),
        runs: Vec::new(),
    }
}

/// Stages `len` positions from `start` out of a pool whose pages hold
/// `page_size` slots and checks every staged key and value against the
/// token-major rows written, and the padding against zero. Scratch starts
/// poisoned, so a cell staging skipped shows.
fn staged_from_pages<E: KvValue>(
    make: impl Fn(f32) -> E,
    page_size: usize,
    start: usize,
    len: usize,
) {
    use kvfence_pool::{KvShape, Pool, PoolSize, PoolSpec, RequestId};
    let (hd, heads) = (64, 2);
    let shape = KvShape {
        layers: 1,
        kv_heads: heads,
        head_dim: hd,
    };
    let pool = Pool::new(&PoolSpec::new(
        shape,
        page_size,
        E::ELEM,
        PoolSize::Tokens(start + len),
    ))
    .unwrap();
    let mut lease = pool.lease(RequestId(1), start + len).unwrap();
    let tokens = start + len;
    let element = |t: usize, i: usize, kv: usize| {
        make((((t * heads * hd + i) * 7919 + kv * 31) % 1000) as f32 / 250.0 - 2.0)
    };
    let k: Vec<E> = (0..tokens * heads * hd)
        .map(|i| element(i / (heads * hd), i % (heads * hd), 0))
        .collect();
    let v: Vec<E> = (0..tokens * heads * hd)
        .map(|i| element(i / (heads * hd), i % (heads * hd), 1))
        .collect();
    lease.write_positions(0, 0, &k, &v).unwrap();
    let view = lease.read_layer::<E>(0, tokens).unwrap();
    let mut scratch = poisoned_scratch(hd);
    let wide = |x: E| {
        let mut out = [0.0f32];
        E::widen(&[x], &mut out);
        out[0].to_bits()
    };
    stage(&view, 0, 1, start, len, hd, &mut scratch, true);
    for j in 0..len {
        let token = (start + j) * heads * hd + hd;
        for d in 0..hd {
            assert_eq!(
                scratch.keys[d * CHUNK + j].to_bits(),
                wide(k[token + d]),
                "key {j}, dimension {d}"
            );
            assert_eq!(
                scratch.values[j * hd + d].to_bits(),
                wide(v[token + d]),
                "value {j}, dimension {d}"
            );
        }
    }
    for d in 0..hd {
        for j in len..len.next_multiple_of(KEY_STEP) {
            assert_eq!(
                scratch.keys[d * CHUNK + j].to_bits(),
                0,
                "padding {j}, dimension {d}"
            );
        }
    }
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

/// The same buffers with keys read through `keys`.
#[cfg(target_arch = "x86_64")]
fn with_keys<'a, V: ?Sized, K>(data: ChunkData<'a, V>, keys: K) -> ChunkData<'a, V, K> {
    ChunkData {
        queries: data.queries,
        keys,
        values: data.values,
        scores: data.scores,
        out: data.out,
        max: data.max,
        den: data.den,
    }
}

/// The AVX-512 kernel over keys staged as the portable one reads them.
#[cfg(target_arch = "x86_64")]
fn avx512_staged<E: Stage>(cpu: avx512::Cpu, data: ChunkData<'_, [&[E]]>, shape: ChunkShape) {
    let keys = blocks::KeyBlocks::staged(data.keys, shape.head_dim, shape.cols);
    avx512::chunk(
        cpu,
        with_keys(data, keys),
        shape,
        &mut ahead::Ahead::new(Vec::new()),
    );
}

/// The AVX2 kernel over keys staged as the portable one reads them.
#[cfg(target_arch = "x86_64")]
fn avx2_staged<E: Stage>(cpu: avx2::Avx2, data: ChunkData<'_, [&[E]]>, shape: ChunkShape) {
    let keys = blocks::KeyBlocks::staged(data.keys, shape.head_dim, shape.cols);
    avx2::chunk(
        cpu,
        with_keys(data, keys),
        shape,
        &mut ahead::Ahead::new(Vec::new()),
    );
}

#[cfg(target_arch = "x86_64")]
proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]

    /// The AVX-512 and AVX2 chunk kernels compute the portable one's
    /// bits, for decode rows and causal prefill tiles, chunks cut short,
    /// values in page runs of any length, f32 and f16 values, and
    /// contents with NaN and infinities (poisoned or overflowing KV).
    #[test]
    fn simd_chunk_kernels_equal_the_portable_one(
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
            ends.extend(page_runs(page_size, start + 3, len).map(|(_, _, run, j)| (j, j + run)));
            assert_eq!(ends.last().map(|e| e.1), Some(all_len / hd));
            ends
        };
        // Each hand-written kernel this CPU has, against the portable one.
        let (portable, avx512_bits, avx2_bits) = if half_values {
            let narrow: Vec<f16> = values.iter().map(|&x| f16::from_f32(x)).collect();
            let wide: Vec<f32> = narrow.iter().map(|x| x.to_f32()).collect();
            let runs: Vec<&[f16]> =
                cut(narrow.len()).iter().map(|&(a, b)| &narrow[a * hd..b * hd]).collect();
            (
                run_chunk(chunk_kernel, shape, &queries, &keys, &wide[..]),
                avx512::Cpu::detect().map(|cpu| {
                    run_chunk(|d, s| avx512_staged(cpu, d, s), shape, &queries, &keys, &runs[..])
                }),
                avx2::Avx2::detect().map(|cpu| {
                    run_chunk(|d, s| avx2_staged(cpu, d, s), shape, &queries, &keys, &runs[..])
                }),
            )
        } else {
            let runs: Vec<&[f32]> =
                cut(values.len()).iter().map(|&(a, b)| &values[a * hd..b * hd]).collect();
            (
                run_chunk(chunk_kernel, shape, &queries, &keys, &values[..]),
                avx512::Cpu::detect().map(|cpu| {
                    run_chunk(|d, s| avx512_staged(cpu, d, s), shape, &queries, &keys, &runs[..])
                }),
                avx2::Avx2::detect().map(|cpu| {
                    run_chunk(|d, s| avx2_staged(cpu, d, s), shape, &queries, &keys, &runs[..])
                }),
            )
        };
        if let Some(bits) = avx512_bits {
            proptest::prop_assert_eq!(&bits, &portable, "AVX-512");
        }
        if let Some(bits) = avx2_bits {
            proptest::prop_assert_eq!(&bits, &portable, "AVX2");
        }
    }
}

#[test]
fn staging_widens_exactly_the_positions_asked_for_from_key_columns() {
    // Whole 8-slot blocks by SIMD, the rest by the portable loop: pages
    // of 16 (whole blocks, and a partial last page), of 5 (no whole block)
    // and of 24 (a block and a remainder in each), from a chunk's start.
    for (page_size, start, len) in [(16, 0, 128), (16, 128, 37), (5, 128, 53), (24, 0, 101)] {
        staged_from_pages(|x| x, page_size, start, len);
        staged_from_pages(f16::from_f32, page_size, start, len);
        staged_from_pages(bf16::from_f32, page_size, start, len);
    }
}

/// Keys the SIMD kernels read where they lie in the pages give the
/// bits of the same keys staged, and only chunks of whole 16-slot blocks
/// are read in place: a partial last page, or pages of another size, are
/// staged (a block read in place past a page's written slots would read
/// whatever the page held before).
#[cfg(target_arch = "x86_64")]
#[test]
fn keys_read_in_place_score_as_staged_keys_do() {
    use kvfence_pool::{KvShape, Pool, PoolSize, PoolSpec, RequestId};
    let Some(cpu) = avx512::Cpu::detect() else {
        return;
    };
    let (hd, heads, group) = (64, 2, 3);
    let shape = KvShape {
        layers: 1,
        kv_heads: heads,
        head_dim: hd,
    };
    let at = |i: usize| f16::from_f32(((i * 7919 % 1000) as f32 / 250.0 - 2.0) * 0.37);
    for (page_size, tokens, in_place) in [
        (16, 256, true),
        (32, 128, true),
        (16, 128 + 37, false),
        (24, 128, false),
    ] {
        let pool = Pool::new(&PoolSpec::new(
            shape,
            page_size,
            f16::ELEM,
            PoolSize::Tokens(tokens),
        ))
        .unwrap();
        let mut lease = pool.lease(RequestId(1), tokens).unwrap();
        let k: Vec<f16> = (0..tokens * heads * hd).map(at).collect();
        let v: Vec<f16> = (0..tokens * heads * hd).map(|i| at(i + 13)).collect();
        lease.write_positions(0, 0, &k, &v).unwrap();
        let view = lease.read_layer::<f16>(0, tokens).unwrap();
        // The last chunk, as a decode row at the end of the context sees it.
        let start = (tokens - 1) / CHUNK * CHUNK;
        let len = tokens - start;
        let key_runs = || {
            page_runs(page_size, start, len)
                .map(|(page, slot, run, _)| (view.keys(page, 0, 1), slot..slot + run))
        };
        let blocks = blocks::KeyBlocks::from_pages(key_runs());
        assert_eq!(
            blocks.is_some(),
            in_place,
            "page size {page_size}, {tokens} tokens"
        );
        let Some(blocks) = blocks else { continue };
        let mut scratch = poisoned_scratch(hd);
        stage(&view, 0, 1, start, len, hd, &mut scratch, false);
        let queries: Vec<f32> = (0..group * hd).map(|i| at(i * 3).to_f32()).collect();
        let shape = ChunkShape {
            heads: group,
            group,
            head_dim: hd,
            cols: len,
            start,
            first_row_end: tokens,
            window: usize::MAX,
            len,
        };
        let runs: Vec<&[f16]> = page_runs(page_size, start, len)
            .map(|(page, slot, run, _)| &view.values(page, 0, 1)[slot * hd..(slot + run) * hd])
            .collect();
        let staged = run_chunk(
            |d, s| avx512_staged(cpu, d, s),
            shape,
            &queries,
            &scratch.keys,
            &runs[..],
        );
        assert!(
            staged.iter().all(Option::is_some),
            "every head sees the chunk"
        );
        let in_pages = run_chunk(
            |d, s| {
                avx512::chunk(
                    cpu,
                    with_keys(d, blocks),
                    s,
                    &mut ahead::Ahead::new(Vec::new()),
                )
            },
            shape,
            &queries,
            &scratch.keys,
            &runs[..],
        );
        assert_eq!(in_pages, staged, "AVX-512, page size {page_size}");
        if let Some(narrow) = avx2::Avx2::detect() {
            let blocks = blocks::KeyBlocks::from_pages(key_runs()).unwrap();
            let in_pages = run_chunk(
                |d, s| {
                    avx2::chunk(
                        narrow,
                        with_keys(d, blocks),
                        s,
                        &mut ahead::Ahead::new(Vec::new()),
                    )
                },
                shape,
                &queries,
                &scratch.keys,
                &runs[..],
            );
            assert_eq!(in_pages, staged, "AVX2, page size {page_size}");
        }
    }
}

/// A single tile of rows (a short prefill piece, or the rows a decode step
/// verifies at once) gives each row the bits it gets alone: over a long
/// context that the tile's tasks split into runs of chunks, with the tile
/// crossing a chunk boundary (its first rows see none of the last chunk),
/// with and without a sliding window whose start crosses one too.
#[test]
fn every_row_of_a_single_tile_gets_the_bits_it_gets_alone() {
    use crate::builtin::Builtin;
    use kvfence_pool::{KvShape, Pool, PoolSize, PoolSpec, RequestId};
    let (rows, past) = (TILE_ROWS, 8 * CHUNK - 6);
    let tokens = past + rows;
    for window in [None, Some(300)] {
        let mut config = Builtin::Small.config();
        config.sliding_window = window.map(|window| crate::SlidingWindow {
            window,
            period: 0,
            local_rope_theta: 10_000.0,
        });
        assert_eq!(config.attention_window(0), window);
        let (hd, kv_heads, q_dim) = (config.head_dim, config.num_kv_heads, config.q_dim());
        let shape = KvShape {
            layers: 1,
            kv_heads,
            head_dim: hd,
        };
        let pool = Pool::new(&PoolSpec::new(
            shape,
            16,
            f16::ELEM,
            PoolSize::Tokens(tokens),
        ))
        .unwrap();
        let mut lease = pool.lease(RequestId(1), tokens).unwrap();
        let at = |i: usize| f16::from_f32(((i * 7919 % 1000) as f32 / 250.0 - 2.0) * 0.37);
        let k: Vec<f16> = (0..tokens * kv_heads * hd).map(at).collect();
        let v: Vec<f16> = (0..tokens * kv_heads * hd).map(|i| at(i + 13)).collect();
        lease.write_positions(0, 0, &k, &v).unwrap();
        let view = lease.read_layer::<f16>(0, tokens).unwrap();
        let queries: Vec<f32> = (0..rows * q_dim).map(|i| at(i * 3).to_f32()).collect();
        let pass = |past: usize, queries: &[f32], rows: usize| {
            let mut out = vec![f32::NAN; rows * q_dim];
            let part = SequenceQueries {
                view: &view,
                past,
                queries,
                stride: q_dim,
                rows,
            };
            attend(&config, 0, &[Some(part)], &[rows], &mut out);
            out
        };
        let tile = pass(past, &queries, rows);
        for r in 0..rows {
            let alone = pass(past + r, &queries[r * q_dim..(r + 1) * q_dim], 1);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&tile[r * q_dim..(r + 1) * q_dim]),
                bits(&alone),
                "row {r}, window {window:?}"
            );
        }
    }
}

/// A decode row's chunks split into runs that cover each chunk once, in
/// order, as many as the threads ask for (fewer only with fewer chunks),
/// of sizes within one chunk of each other.
#[test]
fn a_decode_rows_chunks_split_into_even_runs_in_order() {
    let jobs = rayon::current_num_threads() * DECODE_JOBS_PER_THREAD;
    for first in [0, 3] {
        for total in 1..=70 {
            let runs: Vec<(usize, usize)> = job_chunks(first..first + total).collect();
            assert_eq!(runs.len(), jobs.min(total), "{total} chunks");
            assert_eq!(runs[0].0, first);
            assert_eq!(runs[runs.len() - 1].1, first + total);
            assert!(runs.windows(2).all(|w| w[0].1 == w[1].0));
            let sizes: Vec<usize> = runs.iter().map(|(c, end)| end - c).collect();
            let (least, most) = (sizes.iter().min(), sizes.iter().max());
            assert!(
                most.zip(least).is_some_and(|(m, l)| m - l <= 1 && *l > 0),
                "{sizes:?}"
            );
        }
    }
}
