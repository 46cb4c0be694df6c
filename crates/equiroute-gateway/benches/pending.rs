//! The pending-feedback store on the request path: every answered request leaves its context
//! (interface, candidate, features, latency, the label of the key that made it) until its quality score arrives, in a store of
//! `server.max_pending_feedback` entries (32,768 by default) that evicts the oldest when full.
//! This times `AppState::remember`'s insert one call at a time with the store full (the steady
//! state of a busy gateway), d = 64 features, ids as the gateway makes them, and prints the
//! distribution: the mean hides what the request-path tail pays for (allocation, freeing an
//! evicted context, a cold slot).
//! Not run by CI: `cargo bench -p equiroute-gateway --bench pending`.

#![allow(clippy::unwrap_used, clippy::cast_precision_loss)]

use equiroute_core::{Millis, Timestamp};
use equiroute_gateway::pending::{Features, PendingContext, PendingStore};
use std::hint::black_box;
use std::time::Instant;

const CAP: usize = 32_768;
const D: usize = 64;
const CALLS: usize = 200_000;

/// An id of the gateway's form: `req-` and 128 random bits in 32 hex digits (drawn here from
/// a seeded generator, so that runs are alike).
fn id(rng: &mut rand_chacha::ChaCha8Rng) -> String {
    format!("req-{:032x}", rand::Rng::random::<u128>(rng))
}

fn main() {
    let features: Vec<f64> = (0..D).map(|i| (i as f64 * 0.37).sin()).collect();
    let mut store = PendingStore::new(CAP);
    let mut n = 0u64;
    // The id is made before the clock starts (the gateway makes it when the request arrives).
    let mut insert = |store: &mut PendingStore, id: &str| {
        let ctx = PendingContext {
            interface: "chat",
            candidate: (n % 3) as usize,
            features: Features::F64(&features),
            latency: Millis(1.0),
            at: Timestamp(n as f64),
            owner: Some(if n.is_multiple_of(2) {
                "TEAM_A"
            } else {
                "TEAM_B"
            }),
        };
        store.remember(id, ctx);
        n += 1;
    };
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(7);
    // Fill it, then go round it twice so every slot has been evicted and reused.
    for _ in 0..3 * CAP {
        insert(&mut store, &id(&mut rng));
    }
    let mut ns: Vec<f64> = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let next = id(&mut rng);
        let started = Instant::now();
        insert(&mut store, &next);
        ns.push(started.elapsed().as_secs_f64() * 1e9);
    }
    black_box(store.len());
    ns.sort_by(f64::total_cmp);
    let q = |p: f64| ns[((ns.len() as f64 - 1.0) * p).round() as usize];
    let mean = ns.iter().sum::<f64>() / ns.len() as f64;
    println!("pending-feedback insert into a full store (cap {CAP}, d = {D}), {CALLS} calls, one at a time");
    println!("| mean ns | p50 ns | p99 ns | p99.9 ns | max ns |");
    println!("|---|---|---|---|---|");
    println!(
        "| {mean:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
        q(0.5),
        q(0.99),
        q(0.999),
        q(1.0)
    );
}
