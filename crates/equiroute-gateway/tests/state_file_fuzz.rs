//! The state file's open path under damage: a real state file, written by `Store::save` and
//! `Store::import_json`, with bytes overwritten, cut short or followed by junk, and marked as
//! left by a crash or not. Opening it,
//! exporting and restoring either work or refuse it as `StoreError::Unusable`, leaving a
//! refused file byte for byte as it was, and redb never panics on the way — not even a panic
//! the store would catch (a panic hook counts them; this file is its own test process, so the
//! hook sees no other test's).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use equiroute_gateway::config::load;
use equiroute_gateway::server::state::AppState;
use equiroute_gateway::store::{Store, StoreError};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static HOOK: OnceLock<()> = OnceLock::new();
    HOOK.get_or_init(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
}

fn dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("equiroute-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn state(path: &Path) -> AppState {
    let text = format!(
        "[state]\npath = {:?}\n[interfaces.search]\nkind = \"tool\"\npolicy = {{ name = \"lqm\" }}\n[[interfaces.search.providers]]\nid = \"s1\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 2, p95_ms = 4 }} }}\n[[interfaces.search.providers]]\nid = \"s2\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 2, p95_ms = 4 }} }}\n",
        path.display().to_string()
    );
    AppState::new(&load(&text, "fuzz.toml", &|_| None).unwrap(), 7).unwrap()
}

/// A state file as the gateway leaves it: a saved snapshot, then the same snapshot imported
/// (two commits, so that both of redb's commit slots are in use).
fn pristine() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let path = dir().join("pristine.redb");
        let _ = std::fs::remove_file(&path);
        {
            let store = Store::open(&path).unwrap();
            store.save(&state(&path)).unwrap();
            let json = store.export_json().unwrap().unwrap();
            store.import_json(&json, &state(&path)).unwrap();
        }
        std::fs::read(&path).unwrap()
    })
}

#[derive(Debug, Clone)]
enum Damage {
    /// (position as a fraction of the length, new byte)
    Overwrite(Vec<(f64, u8)>),
    /// From a fraction of the length on, random bytes.
    RandomFrom(f64, u64),
    CutAt(f64),
    Append(Vec<u8>),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        prop::collection::vec((0.0..1.0f64, any::<u8>()), 1..40).prop_map(Damage::Overwrite),
        (0.0..1.0f64, any::<u64>()).prop_map(|(f, seed)| Damage::RandomFrom(f, seed)),
        (0.0..1.0f64).prop_map(Damage::CutAt),
        prop::collection::vec(any::<u8>(), 1..9000).prop_map(Damage::Append),
    ]
}

/// redb's header flag byte (after the 9-byte magic number) and its "recovery required" bit,
/// which a gateway killed mid-write leaves set: an open of such a file repairs it, so a
/// refused one must not have been opened for real.
const FLAGS_AT: usize = 9;
const RECOVERY_REQUIRED: u8 = 2;

fn apply(damage: &Damage, unclean: bool, good: &[u8]) -> Vec<u8> {
    let at = |f: f64| ((good.len() as f64 * f) as usize).min(good.len().saturating_sub(1));
    let mut bytes = good.to_vec();
    if unclean {
        bytes[FLAGS_AT] |= RECOVERY_REQUIRED;
    }
    match damage {
        Damage::Overwrite(edits) => {
            for (f, b) in edits {
                bytes[at(*f)] = *b;
            }
        }
        Damage::RandomFrom(f, seed) => {
            // A 64-bit LCG: reproducible from the case's seed.
            let mut x = *seed;
            for b in &mut bytes[at(*f)..] {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                *b = (x >> 56) as u8;
            }
        }
        Damage::CutAt(f) => bytes.truncate(at(*f)),
        Damage::Append(junk) => bytes.extend_from_slice(junk),
    }
    bytes
}

fn unusable_or_ok<T>(r: &Result<T, StoreError>) -> bool {
    matches!(r, Ok(_) | Err(StoreError::Unusable { .. }))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 160,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(0x00e9),
        ..ProptestConfig::default()
    })]

    #[test]
    fn a_damaged_state_file_is_read_or_refused_untouched_and_never_panics(
        damage in damage(),
        unclean in any::<bool>(),
    ) {
        count_panics();
        let path = dir().join("damaged.redb");
        let bytes = apply(&damage, unclean, pristine());
        std::fs::write(&path, &bytes).unwrap();

        let exported = Store::export_file(&path);
        prop_assert!(
            unusable_or_ok(&exported) || matches!(exported, Err(StoreError::NothingSaved { .. })),
            "{exported:?}"
        );
        prop_assert!(std::fs::read(&path).unwrap() == bytes, "export never writes");

        match Store::open_restoring(&path, &state(&path)) {
            Ok((store, _)) => {
                let json = store.export_json();
                prop_assert!(unusable_or_ok(&json), "{json:?}");
            }
            Err(e) => {
                prop_assert!(matches!(e, StoreError::Unusable { .. }), "{e:?}");
                prop_assert!(e.to_string().contains("--reset-state"), "{e}");
                prop_assert!(std::fs::read(&path).unwrap() == bytes, "refused, left as it was");
            }
        }
        prop_assert_eq!(PANICS.load(Ordering::SeqCst), 0, "redb panicked (caught or not)");
    }
}
