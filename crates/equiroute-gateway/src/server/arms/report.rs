//! What operators see of the side policies: the shadow's and the rollout's reports (the
//! state route) and their lines of `/metrics`.

use super::{Arm, Interface, Shadow, EVENTS, SHADOW_WINDOW};
use equiroute_core::ope::{evaluate, Estimate, Estimator, LoggedDecision, OpeOptions};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::sync::atomic::Ordering;

impl Shadow {
    /// The shadow's agreement and window for its route.
    #[must_use]
    pub fn report(&self) -> Value {
        let decisions = self.decisions.load(Ordering::Relaxed);
        let agreements = self.agreements.load(Ordering::Relaxed);
        let (size, finished, scored, agreeing) = self.window.lock().map_or((0, 0, 0, 0), |w| {
            (
                w.len(),
                w.iter().filter(|r| r.bad.is_some()).count(),
                w.iter().filter(|r| r.quality.is_some()).count(),
                w.iter().filter(|r| r.live_first == r.shadow_first).count(),
            )
        });
        json!({
            "shadow_policy": self.policy.kind.as_str(),
            "decisions": decisions,
            "agreements": agreements,
            "agreement_rate": (decisions > 0).then(|| agreements as f64 / decisions as f64),
            "learnt": self.policy.learnt.load(Ordering::Relaxed),
            "dropped_observations": self.policy.dropped.load(Ordering::Relaxed),
            "window": {
                "capacity": SHADOW_WINDOW,
                "decisions": size,
                "agreements": agreeing,
                "finished": finished,
                "quality_scores": scored,
            },
        })
    }
}

/// The metrics a shadow is evaluated on (`bad_rate`: lower is better; `quality`: higher).
const OPE_METRICS: [&str; 2] = ["bad_rate", "quality"];

impl Shadow {
    /// The window's finished decisions as logged decisions for `metric` (`bad_rate`: 1 for a
    /// failed or late request; `quality`: the score, where one arrived): first as the live
    /// policy logged them, evaluated for the shadow (its own first choice as the target: one
    /// draw of its first-choice distribution, unbiased at no extra ranking); then as the live
    /// policy's own on-policy outcomes (propensity 1 on its choice: the plain mean).
    fn logged(
        &self,
        metric: &str,
        candidates: usize,
    ) -> (Vec<LoggedDecision>, Vec<LoggedDecision>) {
        let Ok(window) = self.window.lock() else {
            return (Vec::new(), Vec::new());
        };
        let one_hot = |i: usize| {
            let mut t = vec![0.0; candidates];
            t[i] = 1.0;
            t
        };
        let mut shadow = Vec::new();
        let mut live = Vec::new();
        for r in window.iter() {
            let outcome = match metric {
                "bad_rate" => r.bad.map(|b| f64::from(u8::from(b))),
                _ => r.quality,
            };
            let Some(outcome) = outcome else { continue };
            let propensity = r.live_propensity.filter(|p| *p > 0.0 && *p <= 1.0);
            let logged = LoggedDecision {
                features: r.features.clone(),
                eligible: r.eligible.clone(),
                action: r.live_first,
                propensity: propensity.unwrap_or(1.0),
                // A policy that reports 1 (or nothing) for its choice is deterministic.
                propensity_exact: propensity.is_some_and(|p| p < 1.0),
                target: one_hot(r.shadow_first),
                outcome,
            };
            live.push(LoggedDecision {
                propensity: 1.0,
                propensity_exact: true,
                target: one_hot(r.live_first),
                ..logged.clone()
            });
            shadow.push(logged);
        }
        (shadow, live)
    }

    /// Off-policy estimates of the shadow's value against the live policy's on the window,
    /// per metric, by `estimators` for the shadow (the live policy's is its plain mean), with
    /// bootstrap intervals; `null` for a metric without finished records. Warnings name
    /// the providers by their ids.
    #[must_use]
    pub fn estimates(
        &self,
        candidates: &[equiroute_core::Candidate],
        estimators: &[Estimator],
        resamples: u32,
    ) -> Value {
        let opts = OpeOptions {
            bootstrap_resamples: resamples,
            ..OpeOptions::default()
        };
        let name = |c: usize| {
            candidates
                .get(c)
                .map_or_else(|| format!("candidate {c}"), |p| format!("`{}`", p.id.0))
        };
        let show = |e: Result<Estimate, equiroute_core::ope::OpeError>| match e {
            Ok(e) => json!({
                "value": e.value, "ci_low": e.ci_low, "ci_high": e.ci_high,
                "effective_sample_size": e.effective_sample_size, "n": e.n,
                "warnings": e.warnings.iter().map(|w| w.describe(name)).collect::<Vec<_>>(),
            }),
            Err(e) => json!({"error": e.to_string()}),
        };
        let mut out = serde_json::Map::new();
        for metric in OPE_METRICS {
            let (shadow, live) = self.logged(metric, candidates.len());
            if shadow.is_empty() {
                out.insert(metric.into(), Value::Null);
                continue;
            }
            let mut by = serde_json::Map::new();
            for &e in estimators {
                by.insert(e.as_str().into(), show(evaluate(&shadow, e, &opts)));
            }
            out.insert(
                metric.into(),
                json!({
                    "records": shadow.len(),
                    "live": show(evaluate(&live, Estimator::Ips, &opts)),
                    "shadow": by,
                }),
            );
        }
        Value::Object(out)
    }
}

/// The `equiroute_shadow_value` samples of one interface's shadow.
fn shadow_values(
    out: &mut String,
    family: &str,
    name: &str,
    shadow: &Shadow,
    candidates: &[equiroute_core::Candidate],
) {
    let est = shadow.estimates(candidates, &[Estimator::Snips], 200);
    for metric in OPE_METRICS {
        for (arm, at) in [("live", "/live"), ("shadow", "/shadow/snips")] {
            let e = est[metric].pointer(at).cloned().unwrap_or(Value::Null);
            for (bound, key) in [
                ("estimate", "value"),
                ("low", "ci_low"),
                ("high", "ci_high"),
            ] {
                if let Some(v) = e[key].as_f64() {
                    let _ = writeln!(
                        out,
                        "{family}{{interface=\"{name}\",arm=\"{arm}\",metric=\"{metric}\",bound=\"{bound}\"}} {v}"
                    );
                }
            }
        }
    }
}

/// The side policies' metric families: name, type and help.
const METRIC_FAMILIES: [(&str, &str, &str); 8] = [
    (
        "equiroute_shadow_decisions_total",
        "counter",
        "Live decisions the shadow policy ranked.",
    ),
    (
        "equiroute_shadow_agreements_total",
        "counter",
        "Live decisions whose first choice the shadow policy shared.",
    ),
    (
        "equiroute_rollout_active",
        "gauge",
        "1 while the canary routes its share of the requests.",
    ),
    (
        "equiroute_rollout_requests_total",
        "counter",
        "Finished requests of each rollout arm (client errors excluded).",
    ),
    (
        "equiroute_rollout_bad_outcomes_total",
        "counter",
        "Requests of each rollout arm that failed or missed their deadline.",
    ),
    (
        "equiroute_rollout_events_total",
        "counter",
        "Canary rollbacks (by metric), promotions and aborts.",
    ),
    (
        "equiroute_rollout_events_received_total",
        "counter",
        "Canary rollbacks (by metric), promotions and aborts decided on another instance and applied here (state shared through Redis).",
    ),
    (
        "equiroute_shadow_value",
        "gauge",
        "Value of the live policy (its mean) and of the shadow (self-normalised IPS) on the shadow's window of recent decisions, with the 95% interval's bounds.",
    ),
];

/// The side policies' lines of `/metrics` (labels: interface, arm, event: bounded), each
/// family's samples together under its `HELP` and `TYPE`.
pub fn render_metrics<I: Interface>(
    ifaces: &std::collections::BTreeMap<String, std::sync::Arc<I>>,
    out: &mut String,
) {
    let families = &METRIC_FAMILIES;
    let mut samples: [String; 8] = Default::default();
    for (name, iface) in ifaces {
        let (arms, candidates) = (iface.arms(), iface.candidates());
        if let Some(s) = &arms.shadow {
            let _ = writeln!(
                samples[0],
                "{}{{interface=\"{name}\"}} {}",
                families[0].0,
                s.decisions.load(Ordering::Relaxed)
            );
            let _ = writeln!(
                samples[1],
                "{}{{interface=\"{name}\"}} {}",
                families[1].0,
                s.agreements.load(Ordering::Relaxed)
            );
            shadow_values(&mut samples[7], families[7].0, name, s, candidates);
        }
        let Some(r) = &arms.rollout else {
            continue;
        };
        let _ = writeln!(
            samples[2],
            "{}{{interface=\"{name}\"}} {}",
            families[2].0,
            u8::from(r.active.load(Ordering::Relaxed))
        );
        if let Ok(stats) = r.stats.lock() {
            for arm in [Arm::Live, Arm::Candidate] {
                let m = stats.bad[arm as usize];
                let label = arm.as_str();
                let _ = writeln!(
                    samples[3],
                    "{}{{interface=\"{name}\",arm=\"{label}\"}} {}",
                    families[3].0, m.n
                );
                let _ = writeln!(
                    samples[4],
                    "{}{{interface=\"{name}\",arm=\"{label}\"}} {}",
                    families[4].0, m.sum
                );
            }
        }
        // Decided here (family 5), and received from another instance (family 6).
        for (family, counts) in [(5, &r.events), (6, &r.received)] {
            for (event, count) in EVENTS.iter().zip(counts) {
                let _ = writeln!(
                    samples[family],
                    "{}{{interface=\"{name}\",event=\"{event}\"}} {}",
                    families[family].0,
                    count.load(Ordering::Relaxed)
                );
            }
        }
    }
    for ((family, kind, help), lines) in families.iter().zip(&samples) {
        if !lines.is_empty() {
            let _ = writeln!(out, "# HELP {family} {help}\n# TYPE {family} {kind}");
            out.push_str(lines);
        }
    }
}
