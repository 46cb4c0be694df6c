//! The body sent to a chat provider, per attempt: the client's bytes with `model`, `stream`
//! and `service_tier` spliced (`ClientBody::for_provider`) against serialising the parsed
//! tree again (what the gateway did before; the cost grows with the prompt, every string is
//! escaped anew). The request is the gateway benchmark's (`bench/gateway/pair.sh --words`).
//! Not run by CI: `cargo bench -p equiroute-gateway --bench provider_body`.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use equiroute_gateway::upstream::ClientBody;

fn body(words: usize) -> Bytes {
    let sentence: Vec<&str> =
        "Which of these retrieval providers answers questions about Rust lifetimes best?"
            .split(' ')
            .collect();
    let text = if words == 1 {
        "hello".to_owned()
    } else {
        sentence
            .iter()
            .cycle()
            .take(words)
            .copied()
            .collect::<Vec<_>>()
            .join(" ")
    };
    let json =
        serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": text}]});
    Bytes::from(serde_json::to_vec(&json).unwrap())
}

/// The previous path, for comparison: the parsed tree serialised with the provider's fields.
struct Previous<'a>(&'a serde_json::Value, &'a str);

impl serde::Serialize for Previous<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        for (k, v) in self.0.as_object().into_iter().flatten() {
            if !matches!(k.as_str(), "model" | "stream" | "service_tier") {
                map.serialize_entry(k, v)?;
            }
        }
        map.serialize_entry("model", self.1)?;
        map.serialize_entry("stream", &false)?;
        map.end()
    }
}

fn bench(c: &mut Criterion) {
    for words in [1, 1000] {
        let b = ClientBody::parse(body(words)).unwrap();
        c.bench_function(&format!("provider_body/splice_{words}"), |bench| {
            bench.iter(|| black_box(&b).for_provider(Some("gpt-x"), false, None));
        });
        c.bench_function(&format!("provider_body/serialise_tree_{words}"), |bench| {
            bench.iter(|| serde_json::to_vec(&Previous(black_box(b.json()), "gpt-x")).unwrap());
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
