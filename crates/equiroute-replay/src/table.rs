//! The report as text: per interface, one row per policy and estimator, then the warnings.

use crate::estimates::Metric;
use serde_json::Value;

/// A number with three significant digits; scientific below 0.001 (costs are often 1e-5 USD).
pub(crate) fn num(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x:.3}");
    }
    if x.abs() < 1e-3 {
        return format!("{x:.2e}");
    }
    let digits = (2 - x.abs().log10().floor() as i32).clamp(0, 9) as usize;
    format!("{x:.digits$}")
}

/// `value [low, high]`, or why there is none.
pub(crate) fn cell(v: &Value) -> String {
    match (v.get("value").and_then(Value::as_f64), v.get("error")) {
        (Some(x), _) => format!(
            "{} [{}, {}]",
            num(x),
            num(v["ci_low"].as_f64().unwrap_or(f64::NAN)),
            num(v["ci_high"].as_f64().unwrap_or(f64::NAN))
        ),
        (None, Some(e)) => format!("error: {}", e.as_str().unwrap_or("?")),
        (None, None) => "n/a (no record)".into(),
    }
}

/// The report as text: per interface, one row per policy and estimator, then the warnings.
#[must_use]
pub fn table(report: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let empty = Vec::new();
    let list = |v: &Value| v.as_array().unwrap_or(&empty).clone();
    for iface in list(&report["interfaces"]) {
        let features: Vec<String> = iface["features"]
            .as_object()
            .map(|m| m.iter().map(|(k, v)| format!("{v} {k}")).collect())
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "interface `{}`: {} requests ({} with a quality score), logged by {} (propensities {}); features: {}; {}",
            iface["interface"].as_str().unwrap_or("?"),
            iface["requests"],
            iface["with_quality"],
            iface["logging"]["policy"].as_str().unwrap_or("?"),
            iface["logging"]["propensities"].as_str().unwrap_or("?"),
            features.join(", "),
            iface["candidates_from"].as_str().unwrap_or("?"),
        );
        let mut rows: Vec<Vec<String>> = vec![{
            let mut h = vec!["policy".to_owned(), "estimator".to_owned()];
            h.extend(Metric::ALL.iter().map(|m| m.title().to_owned()));
            h.push("ESS".to_owned());
            h
        }];
        let logging = &iface["logging"]["on_policy"];
        let mut row = vec![
            format!(
                "{} (logged)",
                iface["logging"]["policy"].as_str().unwrap_or("?")
            ),
            "on-policy".to_owned(),
        ];
        row.extend(Metric::ALL.iter().map(|m| cell(&logging[m.key()])));
        row.push(logging["bad_outcome_rate"]["n"].to_string());
        rows.push(row);
        let mut notes: Vec<String> = Vec::new();
        for p in list(&iface["policies"]) {
            let name = p["policy"].as_str().unwrap_or("?").to_owned();
            if let Some(why) = p["refused"].as_str() {
                rows.push(vec![name.clone(), "refused".into(), "(see below)".into()]);
                notes.push(format!("{name}: not evaluated: {why}"));
                continue;
            }
            for e in list(&p["estimates"]) {
                let mut row = vec![
                    name.clone(),
                    e["estimator"].as_str().unwrap_or("?").to_owned(),
                ];
                row.extend(Metric::ALL.iter().map(|m| cell(&e["metrics"][m.key()])));
                let ess = e["metrics"]["bad_outcome_rate"]["effective_sample_size"]
                    .as_f64()
                    .map_or_else(|| "-".to_owned(), |x| format!("{x:.0}"));
                row.push(ess);
                rows.push(row);
            }
            for w in list(&p["warnings"]) {
                notes.push(format!("{name}: {}", w.as_str().unwrap_or("?")));
            }
        }
        let widths: Vec<usize> = (0..rows[0].len())
            .map(|c| {
                rows.iter()
                    .filter_map(|r| r.get(c))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        for r in &rows {
            let line: Vec<String> = r
                .iter()
                .enumerate()
                .map(|(c, s)| format!("{s:<w$}", w = widths[c]))
                .collect();
            let _ = writeln!(out, "  {}", line.join("  ").trim_end());
        }
        let warnings = list(&iface["warnings"]);
        if !warnings.is_empty() || !notes.is_empty() {
            let _ = writeln!(out, "  warnings:");
            for w in warnings {
                let _ = writeln!(out, "  - {}", w.as_str().unwrap_or("?"));
            }
            for n in notes {
                let _ = writeln!(out, "  - {n}");
            }
        }
        out.push('\n');
    }
    for n in list(&report["notes"]) {
        let _ = writeln!(out, "note: {}", n.as_str().unwrap_or("?"));
    }
    out.push_str("Intervals: 95% (bootstrap for the estimates, normal for the logged policy's own means). ESS: effective sample size of the bad-outcome estimate.\n");
    out
}
