//! Micro-benchmarks of the numerical kernels behind a decision (not run by CI):
//! `cargo bench -p equiroute-core --bench kernels`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use equiroute_core::estimators::linalg::{
    dot, dot_sparse, dots, dots_f32, nonzeros, packed_len, packed_outer, packed_outer_f32,
    packed_quad_form_sparse,
};
use equiroute_core::features::Featurizer;

fn bench(c: &mut Criterion) {
    let d = 64;
    let x: Vec<f64> = (0..d).map(|i| (i as f64).sin()).collect();
    // Ten packed 64 × 64 matrices: four for the dot kernels, ten for the heads below.
    let ms: Vec<Vec<f64>> = (0..10)
        .map(|k| (0..packed_len(d)).map(|i| ((i + k) as f64).cos()).collect())
        .collect();
    let ms32: Vec<Vec<f32>> = ms
        .iter()
        .map(|m| m.iter().map(|&v| v as f32).collect())
        .collect();
    let z = packed_outer(&x);
    let z32 = packed_outer_f32(&x);
    c.bench_function("kernel/dot_2080", |b| {
        b.iter(|| dot(black_box(&ms[0]), black_box(&z)));
    });
    c.bench_function("kernel/dots_4x2080", |b| {
        b.iter(|| dots([&ms[0], &ms[1], &ms[2], &ms[3]], black_box(&z)));
    });
    c.bench_function("kernel/dots_f32_4x2080", |b| {
        b.iter(|| dots_f32([&ms32[0], &ms32[1], &ms32[2], &ms32[3]], black_box(&z32)));
    });
    c.bench_function("kernel/packed_outer_f32_64", |b| {
        b.iter(|| packed_outer_f32(black_box(&x)));
    });
    // The quality heads' estimates and widths for K heads and a query with n nonzero features:
    // the dense way (the packed outer product once, then one single-precision dot per head)
    // against the sparse way (n(n+1)/2 entries of each head's A⁻¹ in double precision). The
    // crossing point is `sparse_limit` in policies/heads.rs.
    let thetas: Vec<Vec<f64>> = (0..10)
        .map(|k| (0..d).map(|i| ((i * 3 + k) as f64).sin()).collect())
        .collect();
    let (heads, heads32) = (&ms, &ms32);
    for n in [8usize, 16, 24, 32, 48] {
        let mut xs = vec![0.0; d];
        for k in 0..n {
            xs[k * d / n] = 0.1 + k as f64 * 0.01;
        }
        for k_heads in [3usize, 10] {
            c.bench_function(&format!("estimates/dense/k{k_heads}_nnz{n}"), |b| {
                b.iter(|| {
                    let z = packed_outer_f32(black_box(&xs));
                    let mut s = 0.0f64;
                    for h in heads32[..k_heads].chunks(4) {
                        let m = |j: usize| h.get(j).unwrap_or(&h[0]).as_slice();
                        s += dots_f32([m(0), m(1), m(2), m(3)], &z)
                            .iter()
                            .map(|&w| f64::from(w))
                            .sum::<f64>();
                    }
                    s + thetas[..k_heads].iter().map(|t| dot(t, &xs)).sum::<f64>()
                });
            });
            c.bench_function(&format!("estimates/sparse/k{k_heads}_nnz{n}"), |b| {
                b.iter(|| {
                    let nz = nonzeros(black_box(&xs), d).unwrap();
                    (0..k_heads)
                        .map(|k| {
                            packed_quad_form_sparse(&heads[k], d, &nz) + dot_sparse(&thetas[k], &nz)
                        })
                        .sum::<f64>()
                });
            });
        }
    }
    // The featurizer reads the first 128 words of the last user message (the default
    // `feature_max_words`); `*_words_all` reads every word, as it did before the cap, and
    // `*_words_max64` the fewest words allowed.
    let featurizer = Featurizer::new(d).unwrap();
    let reads_all = Featurizer::new(d)
        .unwrap()
        .with_max_words(1_000_000)
        .unwrap();
    let reads_64 = Featurizer::new(d).unwrap().with_max_words(64).unwrap();
    let sentence =
        "Which of these retrieval providers answers questions about Rust lifetimes best? ";
    for words in [1usize, 100, 1000, 10_000] {
        let text: String = if words == 1 {
            "hello".to_owned()
        } else {
            sentence.repeat(words / 11)
        };
        c.bench_function(&format!("featurize/{words}_words"), |b| {
            b.iter(|| featurizer.featurize(black_box(&text)));
        });
        if words >= 1000 {
            c.bench_function(&format!("featurize/{words}_words_all"), |b| {
                b.iter(|| reads_all.featurize(black_box(&text)));
            });
            c.bench_function(&format!("featurize/{words}_words_max64"), |b| {
                b.iter(|| reads_64.featurize(black_box(&text)));
            });
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
