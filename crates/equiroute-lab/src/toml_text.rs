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
}
