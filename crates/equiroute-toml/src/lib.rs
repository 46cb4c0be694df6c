//! Reading a TOML file into typed tables with errors a person can act on: the path of the
//! offending field (`providers[2].latency.p95_ms`), what is wrong (serde's message, which
//! lists the valid names for an unknown field), and the line and column. Shared by the
//! scenario files and the gateway's configuration.

use serde::de::DeserializeOwned;

/// Where a TOML document could not be read as a `T`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TomlProblem {
    /// The field's path, `(syntax)` where the text is not TOML, or `(file)` for the top level.
    pub field: String,
    /// What is wrong, with ` (line L, column C)` when the place is known.
    pub fix: String,
}

/// Parses `text` as a `T`.
///
/// # Errors
/// The first field that cannot be read, or the syntax error.
pub fn parse<T: DeserializeOwned>(text: &str) -> Result<T, TomlProblem> {
    let at = |e: &toml::de::Error| {
        e.span().map_or(String::new(), |s| {
            let before = &text[..s.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!(" (line {line}, column {column})")
        })
    };
    let de = toml::Deserializer::parse(text).map_err(|e| TomlProblem {
        field: "(syntax)".to_owned(),
        fix: format!("{}{}", e.message(), at(&e)),
    })?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        TomlProblem {
            field: if path.is_empty() || path == "." {
                "(file)".to_owned()
            } else {
                path
            },
            fix: format!("{}{}", inner.message(), at(&inner)),
        }
    })
}

/// The most problems [`parse_all`] reports (each costs one more reading of the tree).
const MAX_PROBLEMS: usize = 50;

/// What reading the tree again needs after a problem.
enum Repair {
    /// Leave the member out (an unknown field; a value of the wrong type, whose default then
    /// applies).
    Remove,
    /// Read the string as this name instead (a misspelt name with one near it).
    Replace(String),
    /// Nothing makes the rest readable.
    Stop,
}

/// Parses `text` as a `T`, reporting every problem it can in one pass: each unknown field
/// (with the nearest known name: "did you mean `deadline_ms`?"), each value of the wrong
/// type, each unknown name, with what was expected written in TOML terms and an example. It
/// reads the tree again after each problem, the member left out (or a misspelt name read as
/// the nearest, or a required value of the wrong type read as a placeholder), so that one
/// mistake does not hide the next.
///
/// Returns the value read (`None` when a problem leaves nothing trustworthy to read: a syntax
/// error, a missing field, a placeholder) and the problems in file order.
pub fn parse_all<T: DeserializeOwned>(text: &str) -> (Option<T>, Vec<TomlProblem>) {
    let place = |span: Option<std::ops::Range<usize>>| {
        span.map_or(String::new(), |s| {
            let before = &text[..s.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!(" (line {line}, column {column})")
        })
    };
    let mut root = match toml::de::DeTable::parse(text) {
        Ok(root) => root,
        Err(e) => {
            let fix = format!("{}{}", e.message(), place(e.span()));
            let field = "(syntax)".to_owned();
            return (None, vec![TomlProblem { field, fix }]);
        }
    };
    // (where in the file, the problem): sorted into file order at the end.
    let mut found: Vec<(usize, TomlProblem)> = Vec::new();
    // Members left out for a value of the wrong type, with a placeholder of the right type
    // for when the member is required.
    let mut removed: Vec<(String, Vec<Segment>, Option<toml::de::DeValue<'static>>)> = Vec::new();
    let mut trustworthy = true;
    let value = loop {
        if found.len() >= MAX_PROBLEMS {
            break None;
        }
        let de = toml::de::Deserializer::from(root.clone());
        let e = match serde_path_to_error::deserialize::<_, T>(de) {
            Ok(value) => break Some(value),
            Err(e) => e,
        };
        let path: Vec<Segment> = e.path().iter().cloned().collect();
        let field = match e.path().to_string() {
            p if p.is_empty() || p == "." => "(file)".to_owned(),
            p => p,
        };
        let inner = e.into_inner();
        // A required member left out for its type: the placeholder, and no second problem.
        if let Some(missing) = quoted(inner.message(), "missing field ") {
            let key = match field.as_str() {
                "(file)" => missing.to_owned(),
                parent => format!("{parent}.{missing}"),
            };
            let Some((_, at, Some(placeholder))) = removed.iter().find(|(k, _, _)| *k == key)
            else {
                let (fix, _) = toml_terms(inner.message(), &field);
                let start = inner.span().map_or(usize::MAX, |s| s.start);
                let fix = format!("{fix}{}", place(inner.span()));
                found.push((start, TomlProblem { field, fix }));
                break None;
            };
            let (at, placeholder) = (at.clone(), placeholder.clone());
            trustworthy = false;
            if edit(root.get_mut(), &at, &mut |t, k| {
                let key = toml::Spanned::new(0..0, std::borrow::Cow::Owned(k.to_owned()));
                t.insert(key, toml::Spanned::new(0..0, placeholder.clone()));
                true
            }) {
                continue;
            }
            break None;
        }
        let (mut fix, repair) = toml_terms(inner.message(), &field);
        if let Some((given, home)) = home::<T>(&root, &path, inner.message()) {
            fix = format!("{fix}; it belongs one level down: `{home} = {{ {given} = … }}`");
        }
        let start = inner.span().map_or(usize::MAX, |s| s.start);
        let fix = format!("{fix}{}", place(inner.span()));
        if found.iter().any(|(_, p)| p.field == field && p.fix == fix) {
            // A repair that did not take: reading on would only repeat it.
            break None;
        }
        found.push((
            start,
            TomlProblem {
                field: field.clone(),
                fix,
            },
        ));
        let repaired = match repair {
            Repair::Stop => false,
            Repair::Remove => {
                let placeholder = placeholder(inner.message());
                removed.push((field, path.clone(), placeholder));
                edit(root.get_mut(), &path, &mut |t, k| t.remove(k).is_some())
            }
            Repair::Replace(name) => edit(root.get_mut(), &path, &mut |t, k| {
                t.get_mut(k).is_some_and(|v| {
                    *v.get_mut() = toml::de::DeValue::String(name.clone().into());
                    true
                })
            }),
        };
        if !repaired {
            break None;
        }
    };
    found.sort_by_key(|(start, _)| *start);
    let problems = found.into_iter().map(|(_, p)| p).collect();
    (value.filter(|_| trustworthy), problems)
}

use serde_path_to_error::Segment;

/// For an unknown field placed one level too high: the field's name and the member of its
/// table that takes it (`l_ref_ms` directly under `lqm-ts` belongs in its `lqm`). Found by
/// moving the field into each table member the message lists and reading again: the move
/// is right when the field is read there and nothing of its table is wrong after the move.
fn home<T: DeserializeOwned>(
    root: &toml::Spanned<toml::de::DeTable<'_>>,
    path: &[Segment],
    message: &str,
) -> Option<(String, String)> {
    let at = message.find("unknown field `")?;
    let given = quoted(&message[at..], "unknown field ")?;
    let known = message[at..]
        .split_once("expected ")
        .map_or(Vec::new(), |(_, rest)| names(rest));
    let mut table = path.to_vec();
    if matches!(table.last(), Some(Segment::Map { key }) if key == given) {
        table.pop();
    }
    let at_key = |key: &str| {
        let mut p = table.clone();
        p.push(Segment::Map {
            key: key.to_owned(),
        });
        p
    };
    let inside = table
        .iter()
        .map(|s| match s {
            Segment::Map { key } => format!(".{key}"),
            Segment::Seq { index } => format!("[{index}]"),
            _ => String::new(),
        })
        .collect::<String>();
    let inside = inside.trim_start_matches('.').to_owned();
    // Right when the field is read there and nothing of this table is wrong after the move
    // (a problem elsewhere is another problem's).
    let reads_there = |tree: toml::Spanned<toml::de::DeTable<'_>>| {
        let de = toml::de::Deserializer::from(tree);
        serde_path_to_error::deserialize::<_, T>(de)
            .err()
            .is_none_or(|e| {
                let p = e.path().to_string();
                let here = !inside.is_empty()
                    && (p == inside
                        || p.starts_with(&format!("{inside}."))
                        || p.starts_with(&format!("{inside}[")));
                !here
                    && !inside.is_empty()
                    && !e
                        .inner()
                        .message()
                        .contains(&format!("unknown field `{given}`"))
            })
    };
    let mut without = root.clone();
    let mut value = None;
    edit(without.get_mut(), &at_key(given), &mut |t, k| {
        value = t.remove(k);
        value.is_some()
    });
    let value = value?;
    let home = known.into_iter().filter(|k| *k != given).find(|k| {
        let mut moved = without.clone();
        let placed = edit(moved.get_mut(), &at_key(k), &mut |t, k| {
            let name = toml::Spanned::new(0..0, std::borrow::Cow::Owned(given.to_owned()));
            match t.get_mut(k).map(toml::Spanned::get_mut) {
                Some(toml::de::DeValue::Table(inner)) => {
                    inner.insert(name, value.clone());
                    true
                }
                Some(_) => false,
                None => {
                    let mut inner = toml::de::DeTable::new();
                    inner.insert(name, value.clone());
                    let key = toml::Spanned::new(0..0, std::borrow::Cow::Owned(k.to_owned()));
                    t.insert(
                        key,
                        toml::Spanned::new(0..0, toml::de::DeValue::Table(inner)),
                    );
                    true
                }
            }
        });
        placed && reads_there(moved)
    })?;
    Some((given.to_owned(), home.to_owned()))
}

/// A value of the type serde's message says was expected, to read on past a required member
/// of the wrong type (`None`: no such placeholder).
fn placeholder(message: &str) -> Option<toml::de::DeValue<'static>> {
    use toml::de::DeValue;
    let expected = message.split_once(", expected ")?.1.trim();
    let number =
        expected.starts_with('f') || expected.starts_with('u') || expected.starts_with('i');
    Some(if expected.contains("string") {
        DeValue::String("".into())
    } else if expected.contains("boolean") {
        DeValue::Boolean(false)
    } else if expected.contains("sequence") {
        DeValue::Array(toml::de::DeArray::new())
    } else if expected.contains("map") || expected.starts_with("struct ") {
        DeValue::Table(toml::de::DeTable::new())
    } else if number && expected[1..].chars().all(|c| c.is_ascii_alphanumeric()) {
        DeValue::Integer(toml::de::DeInteger::default())
    } else {
        return None;
    })
}

/// Applies `change` to the table holding the member at `path` of `table` and the member's
/// key; whether the member's table was found and `change` did something.
fn edit<'i>(
    table: &mut toml::de::DeTable<'i>,
    path: &[Segment],
    change: &mut dyn FnMut(&mut toml::de::DeTable<'i>, &str) -> bool,
) -> bool {
    let Some((Segment::Map { key }, rest)) = path.split_first() else {
        return false;
    };
    if rest.is_empty() {
        return change(table, key);
    }
    let Some(value) = table.get_mut(key.as_str()) else {
        return false;
    };
    let mut value = value.get_mut();
    let mut rest = rest;
    // Array items (`providers[2]`) down to the next table.
    while let Some((Segment::Seq { index }, after)) = rest.split_first() {
        let toml::de::DeValue::Array(items) = value else {
            return false;
        };
        let Some(item) = items.get_mut(*index) else {
            return false;
        };
        value = item.get_mut();
        rest = after;
    }
    match value {
        toml::de::DeValue::Table(inner) => edit(inner, rest, change),
        _ => false,
    }
}

/// The first name in backquotes after `prefix` in `message`.
fn quoted<'m>(message: &'m str, prefix: &str) -> Option<&'m str> {
    let rest = message.strip_prefix(prefix)?.strip_prefix('`')?;
    rest.split('`').next()
}

/// Every name in backquotes in `text`.
fn names(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// The known name nearest `given`, when near enough to be a slip of the keyboard.
#[must_use]
pub fn nearest<'a>(given: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edit_distance(given, k), *k))
        // A third of the name, at least two slips from four letters on (`siez` → `size`).
        .filter(|(d, k)| {
            let len = k.len().max(given.len());
            *d <= (len / 3).max(1 + usize::from(len >= 4))
        })
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// Levenshtein distance between `a` and `b`, in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// What serde's `expected` says, in TOML terms with an example.
fn expected_in_toml(expected: &str, field: &str) -> String {
    let last = field.rsplit('.').next().unwrap_or(field);
    let last = last.split('[').next().unwrap_or(last);
    let t = expected.trim();
    if t.starts_with('f') && t[1..].chars().all(|c| c.is_ascii_digit()) {
        return format!("a number, e.g. `{last} = 1.5`");
    }
    let whole = [
        "u8", "u16", "u32", "u64", "usize", "i8", "i16", "i32", "i64", "isize",
    ];
    if whole.contains(&t) {
        return format!("a whole number, e.g. `{last} = 3`");
    }
    if t.contains("boolean") {
        return format!("`true` or `false`, e.g. `{last} = true`");
    }
    if t.contains("string") || t == "a character" {
        return format!("a string in quotes, e.g. `{last} = \"text\"`");
    }
    if t.contains("sequence") {
        return format!("an array, e.g. `{last} = [\"a\", \"b\"]`");
    }
    if t.starts_with("struct ") || t.contains("map") || t.starts_with("enum ") {
        return format!("a table, e.g. `{last} = {{ name = \"value\" }}` or a `[{field}]` section");
    }
    t.to_owned()
}

/// What serde's `found` part names (a string, an integer, a map...), in TOML terms.
fn found_in_toml(found: &str) -> &'static str {
    match found.split([' ', '`']).next().unwrap_or_default() {
        "string" | "char" => "a string",
        "integer" => "a whole number",
        "floating" => "a number",
        "boolean" => "a boolean",
        "map" => "a table",
        "sequence" => "an array",
        _ => "another kind of value",
    }
}

/// Serde's `message` about `field` in TOML terms, and what reading on needs. No Rust type
/// name reaches the reader.
fn toml_terms(message: &str, field: &str) -> (String, Repair) {
    let did_you_mean = |given: &str, known: &[&str]| {
        nearest(given, known).map_or(String::new(), |k| format!(": did you mean `{k}`?"))
    };
    // A table read by its own code (a policy) says whose field it is first: keep that.
    if let Some(at) = message.find("unknown field `").filter(|&at| at > 0) {
        let (fix, repair) = toml_terms(&message[at..], field);
        return (format!("{}{fix}", &message[..at]), repair);
    }
    if let Some(given) = quoted(message, "unknown field ") {
        let known = message
            .split_once("expected ")
            .map_or(Vec::new(), |(_, rest)| names(rest));
        let listed = if known.is_empty() {
            "this table takes no fields".to_owned()
        } else {
            format!("this table takes {}", known.join(", "))
        };
        let hint = did_you_mean(given, &known);
        let fix = format!("unknown field `{given}`{hint} ({listed}; remove it or fix its name)");
        return (fix, Repair::Remove);
    }
    if let Some(given) = quoted(message, "unknown variant ") {
        let known = message
            .split_once("expected ")
            .map_or(Vec::new(), |(_, rest)| names(rest));
        let list = known.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>();
        let hint =
            nearest(given, &known).map_or(String::new(), |k| format!(" (did you mean `{k}`?)"));
        let fix = format!(
            "unknown variant `{given}`: write one of {}{hint}",
            list.join(", ")
        );
        return match nearest(given, &known) {
            Some(k) => (fix, Repair::Replace(k.to_owned())),
            None => (fix, Repair::Remove),
        };
    }
    if let Some(missing) = quoted(message, "missing field ") {
        let table = if field == "(file)" {
            "the top of the file".to_owned()
        } else {
            format!("`{field}`")
        };
        return (
            format!("missing field `{missing}`: add `{missing} = …` to {table}"),
            Repair::Stop,
        );
    }
    if let Some(rest) = message.strip_prefix("invalid type: ") {
        let (found, expected) = rest.split_once(", expected ").unwrap_or((rest, ""));
        if found.starts_with("map") && expected.contains("sequence") {
            return (
                format!(
                    "a list of tables is written with double brackets: `[[{field}]]`, once per \
                     entry (`[{field}]` is a single table)"
                ),
                Repair::Remove,
            );
        }
        let fix = format!(
            "invalid type: expected {}, got {}",
            expected_in_toml(expected, field),
            found_in_toml(found)
        );
        return (fix, Repair::Remove);
    }
    if let Some(rest) = message.strip_prefix("invalid value: ") {
        let (found, expected) = rest.split_once(", expected ").unwrap_or((rest, ""));
        let fix = format!(
            "invalid value {found}: expected {}",
            expected_in_toml(expected, field)
        );
        return (fix, Repair::Remove);
    }
    if message.contains("did not match any variant") {
        return (
            "not one of the forms this field takes (see docs/configuration.md for its forms)"
                .to_owned(),
            Repair::Remove,
        );
    }
    (message.to_owned(), Repair::Remove)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        name: String,
        #[serde(default)]
        items: Vec<Inner>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        size: f64,
    }

    #[test]
    fn problems_carry_the_path_the_message_and_the_place() {
        let p = |text: &str| parse::<Outer>(text).unwrap_err();
        let e = p("name = \"a\"\n[[items]]\nsize = 1\n[[items]]\nsiez = 2\n");
        assert_eq!(e.field, "items[1].siez");
        assert!(
            e.fix.contains("expected `size`") && e.fix.ends_with("(line 5, column 1)"),
            "{e:?}"
        );
        let e = p("name = \"a\"\n[[items]]\nsize = \"big\"\n");
        assert_eq!(e.field, "items[0].size");
        assert!(e.fix.ends_with("(line 3, column 8)"), "{e:?}");
        let e = p("name = a\n");
        assert_eq!(e.field, "(syntax)");
        assert!(e.fix.ends_with("(line 1, column 8)"), "{e:?}");
        let e = p("items = []\n");
        assert_eq!(e.field, "(file)");
        assert!(e.fix.contains("missing field `name`"), "{e:?}");
        assert!(parse::<Outer>("name = \"a\"\n").is_ok());
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Config {
        name: String,
        #[serde(default)]
        deadline_ms: Option<f64>,
        #[serde(default)]
        mode: Option<Mode>,
        #[serde(default)]
        items: Vec<Inner>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(rename_all = "lowercase")]
    enum Mode {
        Prefix,
        Restart,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Nested {
        name: Option<String>,
        inner: Option<Inner>,
    }

    #[test]
    fn every_problem_is_found_in_one_pass_in_toml_terms_with_a_near_name() {
        let text = "name = \"a\"\ndeadlin_ms = 5\nmode = \"prefx\"\nsurplus = 1\n\
                    [[items]]\nsize = \"big\"\n[[items]]\nsiez = 2\nsize = 1\n";
        let (value, problems) = parse_all::<Config>(text);
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "deadlin_ms",
                "mode",
                "surplus",
                "items[0].size",
                "items[1].siez"
            ],
            "{problems:#?}"
        );
        let fixes: Vec<&str> = problems.iter().map(|p| p.fix.as_str()).collect();
        assert!(
            fixes[0].contains("did you mean `deadline_ms`?"),
            "{}",
            fixes[0]
        );
        assert!(fixes[0].ends_with("(line 2, column 1)"), "{}", fixes[0]);
        assert!(fixes[1].contains("did you mean `prefix`?"), "{}", fixes[1]);
        assert!(
            !fixes[2].contains("did you mean"),
            "nothing near: {}",
            fixes[2]
        );
        assert!(
            fixes[3].contains("a number, e.g. `size = 1.5`, got a string"),
            "{}",
            fixes[3]
        );
        assert!(fixes[4].contains("did you mean `size`?"), "{}", fixes[4]);
        // `items[0].size` is required: read on with a placeholder, so no value is trusted.
        assert!(value.is_none());
        let (value, problems) = parse_all::<Config>("name = \"a\"\nmode = \"prefx\"\n");
        assert!(
            matches!(value.unwrap().mode, Some(Mode::Prefix)),
            "{problems:?}"
        );
        // A single-bracket table where a list of tables goes.
        let (_, problems) = parse_all::<Config>("name = \"a\"\n[items]\nsize = 1\n");
        assert!(problems[0].fix.contains("`[[items]]`"), "{problems:?}");
        // A value of the wrong type for a required field: said once, and reading goes on.
        let (value, problems) = parse_all::<Config>("name = 5\nsurplus = 1\n");
        assert!(
            value.is_none(),
            "read with a placeholder: not to be trusted"
        );
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(fields, ["name", "surplus"], "{problems:?}");
        assert!(
            problems[0].fix.contains("a string in quotes"),
            "{problems:?}"
        );
        assert_eq!(edit_distance("deadline_ms", "deadlin_ms"), 1);
        // A field one level too high: where it belongs.
        let (_, problems) = parse_all::<Nested>("size = 1\n");
        assert!(
            problems[0]
                .fix
                .contains("one level down: `inner = { size = … }`"),
            "{problems:?}"
        );
        let (_, problems) = parse_all::<Nested>("size = \"big\"\n");
        assert!(!problems[0].fix.contains("one level down"), "{problems:?}");
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
