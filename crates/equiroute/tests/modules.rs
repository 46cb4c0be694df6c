//! The workspace's shape, checked from the source tree: no import circles between the
//! modules of any crate, and the crates' dependency rule of docs/architecture.md.
//!
//! Circles: in each directory of every `crates/*/src`, the sibling modules (a file `x.rs` or a
//! directory `x/`) are the nodes; `a → b` when code in `a` (or under it) names `b` by a
//! `crate::…` path or a `super::…` path that resolves to `b`. A parent declares its children
//! and a child may use its parent's items: neither is an edge. Every strongly connected group
//! of more than one module is a circle.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `crates/` (this crate is `crates/equiroute`).
fn crates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every crate directory with a `src/`.
fn crate_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(crates_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("src").is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// Every `.rs` file under `dir`, relative to it.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p.strip_prefix(dir).unwrap().to_path_buf());
            }
        }
    }
    out.sort();
    out
}

/// The module path of a file under `src/`: `a/b.rs` and `a/b/mod.rs` are `[a, b]`, the crate
/// root (`lib.rs`, `main.rs`) is `[]`.
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    let root = parts.is_empty() && (stem == "lib" || stem == "main");
    if stem != "mod" && !root {
        parts.push(stem.to_owned());
    }
    parts
}

/// The sibling modules of the directory of module `level`: files `x.rs` and directories
/// `x/` holding Rust files.
fn modules_at(src: &Path, level: &[String]) -> BTreeSet<String> {
    let dir = level.iter().fold(src.to_path_buf(), |d, m| d.join(m));
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return BTreeSet::new();
    };
    let mut out = BTreeSet::new();
    for e in entries {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            if !rust_files(&p).is_empty() {
                out.insert(name);
            }
        } else if let Some(stem) = name.strip_suffix(".rs") {
            if !["lib", "main", "mod"].contains(&stem) {
                out.insert(stem.to_owned());
            }
        }
    }
    out
}

/// The tokens of Rust code that paths are made of: identifiers, `::`, and single punctuation
/// characters; comments, strings and character literals are left out.
fn tokens(code: &str) -> Vec<String> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_string(&c, i + 1);
        } else if (ch == 'r' || ch == 'b' || ch == 'c') && raw_string_at(&c, i).is_some() {
            i = raw_string_at(&c, i).unwrap();
        } else if (ch == 'b' || ch == 'c') && next == Some('"') {
            i = skip_string(&c, i + 2);
        } else if ch == 'b' && next == Some('\'') {
            i = skip_char(&c, i + 1).unwrap_or(i + 2);
        } else if ch == '\'' {
            // A character literal, or a lifetime (left out too).
            i = skip_char(&c, i).unwrap_or(i + 1);
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(c[start..i].iter().collect());
        } else if ch == ':' && next == Some(':') {
            out.push("::".to_owned());
            i += 2;
        } else {
            out.push(ch.to_string());
            i += 1;
        }
    }
    out
}

/// The index after the string whose body starts at `i`.
fn skip_string(c: &[char], mut i: usize) -> usize {
    while i < c.len() {
        match c[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// The index after a raw string (`r"…"`, `r#"…"#`, `br#"…"#`) starting at `i`, if one does.
fn raw_string_at(c: &[char], i: usize) -> Option<usize> {
    let mut j = i;
    if c[j] == 'b' || c[j] == 'c' {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    // Not the end of an identifier (`for"`), nor inside one.
    if i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && (0..hashes).all(|h| c.get(j + 1 + h) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(j)
}

/// The index after the character literal starting (at its quote) at `i`; `None` for a
/// lifetime.
fn skip_char(c: &[char], i: usize) -> Option<usize> {
    match c.get(i + 1) {
        Some('\\') => {
            let mut j = i + 2;
            while j < c.len() && c[j] != '\'' {
                j += 1;
            }
            Some(j + 1)
        }
        Some(_) if c.get(i + 2) == Some(&'\'') => Some(i + 3),
        _ => None,
    }
}

/// One path a file names: resolved to module segments from the crate root (the last may be
/// an item), with the text it was written as.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Named {
    path: Vec<String>,
    written: String,
}

/// The `crate::…`, `super::…` and `self::…` paths of a file of module `module`, use groups
/// expanded and `super` resolved (inside inline modules, such as `mod tests`, from there).
fn paths(code: &str, module: &[String]) -> Vec<Named> {
    let t = tokens(code);
    let mut out = Vec::new();
    // Inline modules we are in: (name, brace depth inside it).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < t.len() {
        match t[i].as_str() {
            "{" => depth += 1,
            "}" => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            "mod" if t.get(i + 2).is_some_and(|s| s == "{") => {
                inline.push((t[i + 1].clone(), depth + 1));
            }
            "crate" | "super" | "self"
                if t.get(i + 1).is_some_and(|s| s == "::")
                    && !(i > 0 && (t[i - 1] == "$" || t[i - 1] == "::")) =>
            {
                let mut here: Vec<String> = module.to_vec();
                here.extend(inline.iter().map(|(n, _)| n.clone()));
                let (end, found) = use_tree(&t, i, Vec::new());
                for segments in found {
                    if let Some(path) = resolve(&segments, &here) {
                        out.push(Named {
                            path,
                            written: segments.join("::"),
                        });
                    }
                }
                i = end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Reads a path (and any `{…}` groups in it) from token `i`; returns the index after it and
/// every full path it names, each prefixed by `prefix`.
fn use_tree(t: &[String], mut i: usize, prefix: Vec<String>) -> (usize, Vec<Vec<String>>) {
    let mut segments = prefix;
    let mut out = Vec::new();
    loop {
        match t.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                loop {
                    match t.get(i).map(String::as_str) {
                        None => return (i, out),
                        Some("}") => {
                            i += 1;
                            break;
                        }
                        Some(",") => i += 1,
                        Some(_) => {
                            let (end, found) = use_tree(t, i, segments.clone());
                            out.extend(found);
                            i = end.max(i + 1);
                        }
                    }
                }
                return (i, out);
            }
            Some("*") => {
                out.push(segments);
                return (i + 1, out);
            }
            Some(s) if s.chars().all(|c| c.is_alphanumeric() || c == '_') => {
                segments.push(s.to_owned());
                i += 1;
                if t.get(i).is_some_and(|s| s == "::") && t.get(i + 1).is_some_and(|s| s != "<") {
                    i += 1;
                } else {
                    if t.get(i).is_some_and(|s| s == "as") {
                        i += 2;
                    }
                    out.push(segments);
                    return (i, out);
                }
            }
            _ => {
                if !segments.is_empty() {
                    out.push(segments);
                }
                return (i, out);
            }
        }
    }
}

/// `segments` (starting with `crate`, `super` or `self`) from the crate root, as seen from
/// module `here`; `self` inside a path names the path so far.
fn resolve(segments: &[String], here: &[String]) -> Option<Vec<String>> {
    let mut path: Vec<String> = match segments.first()?.as_str() {
        "crate" => Vec::new(),
        _ => here.to_vec(),
    };
    let mut rest = &segments[1..];
    if segments[0] == "super" {
        path.pop()?;
    }
    while rest.first().is_some_and(|s| s == "super") {
        path.pop()?;
        rest = &rest[1..];
    }
    path.extend(rest.iter().filter(|s| *s != "self").cloned());
    Some(path)
}

/// A named module edge between siblings: (their directory, from, to, where it is written).
type Edge = (Vec<String>, String, String, String);

/// Every sibling edge of the crate at `dir`.
fn edges(dir: &Path) -> Vec<Edge> {
    let src = dir.join("src");
    let mut siblings: BTreeMap<Vec<String>, BTreeSet<String>> = BTreeMap::new();
    let mut out = Vec::new();
    for rel in rust_files(&src) {
        if rel.starts_with("bin") {
            continue;
        }
        let code = std::fs::read_to_string(src.join(&rel)).unwrap();
        let module = module_of(&rel);
        for named in paths(&code, &module) {
            let common = module
                .iter()
                .zip(&named.path)
                .take_while(|(a, b)| a == b)
                .count();
            // Itself or below it, or an ancestor's item: not an edge.
            if common == module.len() || common >= named.path.len() {
                continue;
            }
            let level = module[..common].to_vec();
            let to = &named.path[common];
            let known = siblings
                .entry(level.clone())
                .or_insert_with(|| modules_at(&src, &level));
            if known.contains(to) {
                out.push((
                    level,
                    module[common].clone(),
                    to.clone(),
                    format!("{} names {}", rel.display(), named.written),
                ));
            }
        }
    }
    out
}

/// The strongly connected groups of more than one node (Tarjan).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.edges.get(v).into_iter().flatten() {
            if !s.index.contains_key(w.as_str()) {
                visit(s, w);
                let lw = s.low[w.as_str()];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w.as_str()) {
                let iw = s.index[w.as_str()];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut group = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                group.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                s.out.push(group);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    let nodes: BTreeSet<&str> = edges
        .iter()
        .flat_map(|(a, bs)| std::iter::once(a.as_str()).chain(bs.iter().map(String::as_str)))
        .collect();
    for v in nodes {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The circles of the crate at `dir`, each described with the edges that make it.
fn crate_circles(dir: &Path) -> Vec<String> {
    let mut by_level: BTreeMap<Vec<String>, Vec<Edge>> = BTreeMap::new();
    for e in edges(dir) {
        by_level.entry(e.0.clone()).or_default().push(e);
    }
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let mut out = Vec::new();
    for (level, es) in by_level {
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (_, a, b, _) in &es {
            graph.entry(a.clone()).or_default().insert(b.clone());
        }
        for group in circles(&graph) {
            // One place per edge, and how many more there are.
            let mut by_edge: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
            for (_, a, b, at) in &es {
                if group.contains(a) && group.contains(b) {
                    by_edge.entry((a, b)).or_default().push(at);
                }
            }
            let within: Vec<String> = by_edge
                .iter()
                .map(|((a, b), at)| match at.len() {
                    1 => format!("{a} → {b} ({})", at[0]),
                    n => format!("{a} → {b} ({}, and {} more)", at[0], n - 1),
                })
                .collect();
            let place = if level.is_empty() {
                "src/".to_owned()
            } else {
                format!("src/{}/", level.join("/"))
            };
            out.push(format!(
                "{name} {place}: {} use each other: {}",
                group.join(", "),
                within.join("; ")
            ));
        }
    }
    out
}

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    let found: Vec<String> = crate_dirs().iter().flat_map(|d| crate_circles(d)).collect();
    assert!(
        found.is_empty(),
        "import circles (move what both use to where both can use it):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_scanner_resolves_crate_and_super_paths_and_use_groups() {
    let code = r#"
        //! Docs name crate::docs::Item, which is no code.
        use crate::{alpha::A, beta::{self, B}};
        use super::gamma as g;
        const S: &str = "crate::in_a_string::X";
        fn f<'a>(x: &'a str) -> char { let _ = super::super::delta::f(); 'c' }
        macro_rules! m { () => { $crate::macro_path::X } }
        #[cfg(test)]
        mod tests {
            use super::Helper;
            use super::super::epsilon::E;
        }
    "#;
    let here = ["outer".to_owned(), "inner".to_owned()];
    let found: Vec<String> = paths(code, &here)
        .into_iter()
        .map(|n| n.path.join("::"))
        .collect();
    assert_eq!(
        found,
        [
            "alpha::A",
            "beta",
            "beta::B",
            "outer::gamma",
            "delta::f",
            "outer::inner::Helper",
            "outer::epsilon::E",
        ]
    );
}

#[test]
fn the_scan_sees_a_known_edge_and_no_edge_to_a_parents_item() {
    let gateway = crates_dir().join("equiroute-gateway");
    let all = edges(&gateway);
    // upstream/sim.rs: `use crate::config::{InterfaceKind, SimSpec};` and
    // `use super::{UpstreamReply, UpstreamRequest};` (items of its parent, `upstream`).
    let from_sim: Vec<&Edge> = all
        .iter()
        .filter(|e| e.3.starts_with("upstream/sim.rs "))
        .collect();
    assert!(
        from_sim
            .iter()
            .any(|e| e.0.is_empty() && e.1 == "upstream" && e.2 == "config"),
        "{from_sim:?}"
    );
    assert!(
        from_sim.iter().all(|e| !e.3.contains("UpstreamReply")),
        "{from_sim:?}"
    );
    // A circle is found whatever its length.
    let graph: BTreeMap<String, BTreeSet<String>> =
        [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]
            .iter()
            .fold(BTreeMap::new(), |mut g, (a, b)| {
                g.entry((*a).to_owned())
                    .or_insert_with(BTreeSet::new)
                    .insert((*b).to_owned());
                g
            });
    assert_eq!(circles(&graph), [["a", "b", "c"]]);
}

/// The workspace crates each crate's `Cargo.toml` depends on, per section.
fn workspace_dependencies() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let manifests: Vec<(String, toml::Table)> = crate_dirs()
        .iter()
        .map(|d| {
            let text = std::fs::read_to_string(d.join("Cargo.toml")).unwrap();
            let table: toml::Table = text.parse().unwrap();
            let name = table["package"]["name"].as_str().unwrap().to_owned();
            (name, table)
        })
        .collect();
    let ours: BTreeSet<&str> = manifests.iter().map(|(n, _)| n.as_str()).collect();
    manifests
        .iter()
        .map(|(name, table)| {
            let sections = ["dependencies", "dev-dependencies", "build-dependencies"]
                .iter()
                .map(|s| {
                    let deps: BTreeSet<String> = table
                        .get(*s)
                        .and_then(toml::Value::as_table)
                        .into_iter()
                        .flat_map(|t| t.keys())
                        .filter(|k| ours.contains(k.as_str()))
                        .cloned()
                        .collect();
                    ((*s).to_owned(), deps)
                })
                .collect();
            (name.clone(), sections)
        })
        .collect()
}

#[test]
fn the_crates_depend_as_the_architecture_says() {
    let deps = workspace_dependencies();
    let all =
        |krate: &str| -> BTreeSet<String> { deps[krate].values().flatten().cloned().collect() };
    assert!(
        deps["equiroute-core"]["dependencies"].is_empty(),
        "equiroute-core depends on no other workspace crate: {:?}",
        deps["equiroute-core"]
    );
    assert!(
        !all("equiroute-gateway").contains("equiroute-lab"),
        "the gateway does not carry the laboratory (normal or dev): {:?}",
        deps["equiroute-gateway"]
    );
    assert!(
        !all("equiroute-lab").contains("equiroute-gateway"),
        "the laboratory does not depend on the gateway: {:?}",
        deps["equiroute-lab"]
    );
    // The scan reads the manifests it checks.
    assert!(deps["equiroute"]["dependencies"].contains("equiroute-gateway"));
}
