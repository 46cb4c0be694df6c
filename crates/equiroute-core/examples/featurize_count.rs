//! Featurizes one text many times, for counting instructions, which unlike time do not move
//! with the VM's noise:
//!
//! ```sh
//! cargo build --release -p equiroute-core --example featurize_count
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out \
//!     target/release/examples/featurize_count WORDS CALLS
//! ```
//!
//! `WORDS` (default 100): 1 is "hello", more repeats the kernels bench's 11-word sentence;
//! `CALLS` (default 1000). The total over the calls (program start included, about 0.1% at
//! 100 words) divided by `CALLS` is the cost of one featurize.

#![allow(clippy::expect_used)]

use equiroute_core::prelude::Featurizer;
use std::hint::black_box;

fn main() {
    let arg = |i: usize, default: usize, what: &str| -> usize {
        std::env::args().nth(i).map_or(default, |s| {
            s.parse()
                .unwrap_or_else(|_| panic!("{what}: a positive integer, got {s:?}"))
        })
    };
    let words = arg(1, 100, "WORDS");
    let calls = arg(2, 1000, "CALLS");
    let sentence =
        "Which of these retrieval providers answers questions about Rust lifetimes best? ";
    let text = if words <= 1 {
        "hello".to_owned()
    } else {
        sentence.repeat(words / 11)
    };
    let featurizer = Featurizer::new(Featurizer::DEFAULT_DIM).expect("the default dimension");
    let mut sum = 0.0;
    for _ in 0..calls {
        sum += black_box(featurizer.featurize(black_box(&text)))[0];
    }
    println!("{calls} calls, {words} words: checksum {sum:.6}");
}
