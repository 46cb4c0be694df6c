//! The gateway crate's modules read in one direction (docs/architecture.md): each top-level
//! module uses only modules of its own layer or below: `config`, `request` and `redact` need
//! nothing of the crate but each other (`config` checks names with `redact`); `upstream`,
//! `pending` and `feedback` (the judge) only those; then
//! `shared` (Redis), the `server` (whose `AppState` the others never name), and on top
//! `store`, which saves and restores that state.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::path::Path;

/// The layer of each top-level module, lowest first.
const LAYERS: &[(&str, u8)] = &[
    ("config", 0),
    ("request", 0),
    ("redact", 0),
    ("upstream", 1),
    ("pending", 1),
    ("feedback", 1),
    ("telemetry", 1),
    ("shared", 2),
    ("server", 3),
    ("store", 4),
];

fn layer(module: &str) -> u8 {
    LAYERS
        .iter()
        .find(|(m, _)| *m == module)
        .unwrap_or_else(|| {
            panic!("module `{module}` has no layer: add it to LAYERS and docs/architecture.md")
        })
        .1
}

/// `(module, the crate modules its code names)` for every file under `src/` (tests excluded).
fn uses() -> Vec<(String, String, BTreeSet<String>)> {
    common::sources()
        .into_iter()
        .filter(|(rel, _)| rel != Path::new("lib.rs"))
        .map(|(rel, code)| {
            let top = rel.iter().next().unwrap().to_string_lossy();
            let module = top.trim_end_matches(".rs").to_owned();
            let named: BTreeSet<String> = code
                .match_indices("crate::")
                .map(|(at, _)| {
                    code[at + 7..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect()
                })
                .collect();
            (rel.display().to_string(), module, named)
        })
        .collect()
}

#[test]
fn every_module_uses_only_its_layer_or_below() {
    let mut upward = Vec::new();
    for (file, module, named) in uses() {
        for dep in named.iter().filter(|d| **d != module) {
            if layer(dep) > layer(&module) {
                upward.push(format!("{file} ({module}) uses {dep}"));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports against the layering: {upward:?}"
    );
}

#[test]
fn the_scan_sees_the_crate_paths_of_a_file() {
    let all = uses();
    let sim = all.iter().find(|(f, _, _)| f == "upstream/sim.rs").unwrap();
    assert_eq!(sim.1, "upstream");
    assert!(
        sim.2.contains("request") && sim.2.contains("config"),
        "{:?}",
        sim.2
    );
}

#[test]
fn no_two_modules_use_each_other() {
    let mut edges = BTreeSet::new();
    for (_, module, named) in uses() {
        for dep in named.into_iter().filter(|d| *d != module) {
            edges.insert((module.clone(), dep));
        }
    }
    let cycles: Vec<_> = edges
        .iter()
        .filter(|(a, b)| a < b && edges.contains(&(b.clone(), a.clone())))
        .collect();
    assert!(cycles.is_empty(), "modules that use each other: {cycles:?}");
}

/// No source file of the gateway outgrows one reading (docs/architecture.md: one module per
/// job), its unit tests included; a file that reaches this splits by job, as
/// `server/execute.rs` did into the stages.
#[test]
fn no_gateway_source_file_is_over_a_thousand_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (mut dirs, mut long) = (vec![src.clone()], Vec::new());
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().map(Result::unwrap) {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let lines = std::fs::read_to_string(&path).unwrap().lines().count();
                if lines > 1000 {
                    long.push(format!("{} ({lines} lines)", path.display()));
                }
            }
        }
    }
    assert!(long.is_empty(), "split these by job: {long:?}");
}
