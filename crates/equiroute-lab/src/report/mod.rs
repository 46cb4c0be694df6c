//! Results over seeds: mean and 95% confidence interval of every metric, as a table, JSON
//! or CSV, and plots (see [`plot`]).
//!
//! JSON schema (one object per scenario; a list when several run), stable:
//!
//! ```text
//! {"scenario": str, "seeds": N, "rounds": T, "seed_list": [u64],
//!  "providers": [str], "bin_start_rounds": [usize; 40],
//!  "policies": {"<name>": {"quality": {"mean": f, "ci95": f}, "latency_mean_ms": {..},
//!     "latency_p95_ms": {..}, "deadline_miss_rate": {..}, "request_failure_rate": {..},
//!     "attempt_failure_rate": {..}, "cost_per_request": {..}, "regret": {..},
//!     "share": {"<provider>": f},
//!     "per_seed": [{"seed": u64, "quality": f, "regret": f, "cost_per_request": f,
//!                   "deadline_miss_rate": f, "request_failure_rate": f,
//!                   "share_over_time": {"<provider>": [f; 40]},
//!                   "request_failure_rate_over_time": [f; 40],
//!                   "recovery_rounds": [{"provider": str, "event": str,
//!                                        "end_round": usize, "rounds": usize | null,
//!                                        "departure_rounds": usize | null}],
//!                   "quality_shifts": [{"round": usize, "provider": str,
//!                                       "direction": "down" | "up", "from": f, "to": f,
//!                                       "scores": u64}]}],
//!     "recovery": [{"provider": str, "event": str, "end_round": usize,
//!                   "rounds": {"mean": f, "ci95": f}, "never": N, "seeds": N}],
//!     "calibration": {"ece": {"mean": f, "ci95": f}, "count": N,
//!                     "predicted": f, "observed": f,
//!                     "deciles": [{"predicted": f, "observed": f, "count": N}; 10]}}}}
//! ```
//! `calibration` is present for policies with a latency model (`ts-deadline`, `lqm-ts`) in
//! scenarios with a deadline (see [`crate::calibration`]): `ece` over seeds, the deciles
//! averaged over seeds (decile `b` of every seed), `count` summed.
//! `ci95` is the half-width of the Student-t 95% interval of the mean over seeds; `per_seed`
//! (in seed order) shows which seeds a mean and its interval come from. The series over time
//! use the share plots' 40 bins: bin `b` holds the rounds `t` with `t·40/T = b` (integer
//! division) and starts at round `bin_start_rounds[b]`; `share_over_time[p][b]` is the share
//! of that bin's requests that ranked `p` first, `request_failure_rate_over_time[b]` the share
//! that got no answer.
//! `recovery_rounds` (per seed) and `recovery` (over seeds; absent when the scenario has no
//! time-limited event) measure how fast traffic comes back after each event that ends within
//! the run: rounds from its end until its provider is the first choice in ≥ 60% of a window
//! one bin long, `null` if never (see [`crate::runner::Recovery`]); `rounds` summarises the
//! seeds that recovered, `never` counts the others. `departure_rounds` is the other way:
//! rounds from the event's start until its provider is first in < 30% of such a window.
//! `quality_shifts` lists the changes in quality scores the policy detected (`lqm-ts`'s
//! `shift`; empty for the others).

pub mod plot;

use crate::calibration::{CalibrationBin, DECILES};
use crate::runner::{Recovery, RunResult, ShiftRecord, BINS, RECOVERY_SHARE};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Mean and 95% confidence half-width over seeds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub mean: f64,
    pub ci95: f64,
}

/// Two-sided 95% Student-t critical values for 1..=30 degrees of freedom.
const T95: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
];

impl Summary {
    /// The summary of `xs`.
    #[must_use]
    pub fn of(xs: &[f64]) -> Summary {
        let n = xs.len();
        if n == 0 {
            return Summary::default();
        }
        let mean = xs.iter().sum::<f64>() / n as f64;
        if n < 2 {
            return Summary { mean, ci95: 0.0 };
        }
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        let t = T95.get(n - 2).copied().unwrap_or(1.96);
        Summary {
            mean,
            ci95: t * (var / n as f64).sqrt(),
        }
    }

    /// "Within noise" of `other`, or above it: not clearly below it, because this 95%
    /// interval reaches up to `other`'s (against the best policy, whose mean is the highest,
    /// this is the intervals overlapping).
    #[must_use]
    pub fn within_noise_of(&self, other: &Summary) -> bool {
        self.mean + self.ci95 >= other.mean - other.ci95
    }
}

/// One policy's results in one scenario.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyReport {
    pub quality: Summary,
    pub latency_mean_ms: Summary,
    pub latency_p95_ms: Summary,
    pub deadline_miss_rate: Summary,
    pub request_failure_rate: Summary,
    pub attempt_failure_rate: Summary,
    pub cost_per_request: Summary,
    pub regret: Summary,
    pub share: BTreeMap<String, f64>,
    /// The headline numbers of each seed's run, in seed order.
    #[serde(default)]
    pub per_seed: Vec<SeedResult>,
    /// Mean share per provider per time bin (for plots; not in JSON).
    #[serde(skip)]
    pub share_over_time: Vec<Vec<f64>>,
    /// Mean cumulative regret per time bin (for plots; not in JSON).
    #[serde(skip)]
    pub regret_over_time: Vec<f64>,
    /// Calibration of the deadline-miss estimate over seeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<CalibrationReport>,
    /// Recovery after each time-limited event, over seeds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recovery: Vec<RecoverySummary>,
}

/// Calibration of a policy's deadline-miss estimate over seeds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CalibrationReport {
    /// Expected calibration error per seed, summarised.
    pub ece: Summary,
    /// Predictions scored, over all seeds.
    pub count: usize,
    /// Mean prediction and observed miss rate (means over seeds).
    pub predicted: f64,
    pub observed: f64,
    /// Decile `b`'s mean prediction and observed rate, averaged over seeds; counts summed.
    pub deciles: Vec<CalibrationBin>,
}

impl CalibrationReport {
    /// The summary of the runs that carry a calibration; `None` if none does.
    #[must_use]
    pub fn of(runs: &[&RunResult]) -> Option<CalibrationReport> {
        let cals: Vec<_> = runs.iter().filter_map(|r| r.calibration.as_ref()).collect();
        if cals.is_empty() {
            return None;
        }
        let n = cals.len() as f64;
        let deciles = (0..DECILES)
            .map(|b| {
                let bins: Vec<&CalibrationBin> =
                    cals.iter().filter_map(|c| c.deciles.get(b)).collect();
                let m = bins.len().max(1) as f64;
                CalibrationBin {
                    predicted: bins.iter().map(|x| x.predicted).sum::<f64>() / m,
                    observed: bins.iter().map(|x| x.observed).sum::<f64>() / m,
                    count: bins.iter().map(|x| x.count).sum(),
                }
            })
            .collect();
        Some(CalibrationReport {
            ece: Summary::of(&cals.iter().map(|c| c.ece).collect::<Vec<_>>()),
            count: cals.iter().map(|c| c.count).sum(),
            predicted: cals.iter().map(|c| c.predicted).sum::<f64>() / n,
            observed: cals.iter().map(|c| c.observed).sum::<f64>() / n,
            deciles,
        })
    }
}

/// One seed's run of a policy, in brief, with its series over time (to measure how fast
/// traffic leaves a provider and comes back without reading the plots).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SeedResult {
    pub seed: u64,
    pub quality: f64,
    pub regret: f64,
    pub cost_per_request: f64,
    pub deadline_miss_rate: f64,
    #[serde(default)]
    pub request_failure_rate: f64,
    /// Per provider, its share of first choices in each time bin.
    #[serde(default)]
    pub share_over_time: BTreeMap<String, Vec<f64>>,
    /// Requests without an answer / requests, in each time bin.
    #[serde(default)]
    pub request_failure_rate_over_time: Vec<f64>,
    /// Rounds from each time-limited event's end until its provider had its traffic back
    /// (`null`: never within the run); see [`Recovery`].
    #[serde(default)]
    pub recovery_rounds: Vec<Recovery>,
    /// The quality shifts the policy detected, in order.
    #[serde(default)]
    pub quality_shifts: Vec<ShiftRecord>,
}

/// One time-limited event's recovery over seeds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecoverySummary {
    pub provider: String,
    pub event: String,
    pub end_round: usize,
    /// Over the seeds whose provider got its traffic back.
    pub rounds: Summary,
    /// Seeds whose provider never did within the run.
    pub never: usize,
    pub seeds: usize,
}

impl RecoverySummary {
    /// The summaries of the runs' recoveries, event by event (every run of a scenario lists
    /// the same events in the same order).
    #[must_use]
    pub fn of(runs: &[&RunResult]) -> Vec<RecoverySummary> {
        let Some(first) = runs.first() else {
            return Vec::new();
        };
        first
            .recovery
            .iter()
            .enumerate()
            .map(|(k, e)| {
                let per_seed: Vec<Option<usize>> = runs
                    .iter()
                    .filter_map(|r| r.recovery.get(k).map(|x| x.rounds))
                    .collect();
                let back: Vec<f64> = per_seed.iter().flatten().map(|&x| x as f64).collect();
                RecoverySummary {
                    provider: e.provider.clone(),
                    event: e.event.clone(),
                    end_round: e.end_round,
                    rounds: Summary::of(&back),
                    never: per_seed.len() - back.len(),
                    seeds: per_seed.len(),
                }
            })
            .collect()
    }

    /// `mean ± ci95 (never n/N)`, or `never N/N`.
    fn cell(&self) -> String {
        if self.never == self.seeds {
            format!("never {}/{}", self.never, self.seeds)
        } else {
            format!(
                "{} (never {}/{})",
                fmt(self.rounds, 0),
                self.never,
                self.seeds
            )
        }
    }
}

/// One scenario's results.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScenarioReport {
    pub scenario: String,
    pub seeds: usize,
    pub rounds: usize,
    pub seed_list: Vec<u64>,
    pub providers: Vec<String>,
    /// The first round of each of the [`BINS`] time bins of the series over time.
    #[serde(default)]
    pub bin_start_rounds: Vec<usize>,
    pub policies: BTreeMap<String, PolicyReport>,
    /// Policies in the order they were asked for (for tables and plots).
    #[serde(skip)]
    pub order: Vec<String>,
}

impl ScenarioReport {
    /// Aggregates runs (any order) of `policies` over seeds.
    #[must_use]
    pub fn new(
        scenario: &str,
        providers: Vec<String>,
        policies: &[String],
        runs: &[RunResult],
    ) -> ScenarioReport {
        let mut out = BTreeMap::new();
        let mut seed_list: Vec<u64> = runs.iter().map(|r| r.seed).collect();
        seed_list.sort_unstable();
        seed_list.dedup();
        for name in policies {
            let mut rs: Vec<&RunResult> = runs.iter().filter(|r| &r.policy == name).collect();
            rs.sort_by_key(|r| r.seed);
            let pick = |f: fn(&RunResult) -> f64| {
                Summary::of(&rs.iter().map(|r| f(r)).collect::<Vec<_>>())
            };
            let n = rs.len().max(1) as f64;
            let share = providers
                .iter()
                .enumerate()
                .map(|(i, p)| (p.clone(), rs.iter().map(|r| r.share[i]).sum::<f64>() / n))
                .collect();
            let share_over_time = (0..BINS)
                .map(|b| {
                    (0..providers.len())
                        .map(|i| rs.iter().map(|r| r.share_over_time[b][i]).sum::<f64>() / n)
                        .collect()
                })
                .collect();
            let regret_over_time = (0..BINS)
                .map(|b| rs.iter().map(|r| r.regret_over_time[b]).sum::<f64>() / n)
                .collect();
            out.insert(
                name.clone(),
                PolicyReport {
                    quality: pick(|r| r.quality),
                    latency_mean_ms: pick(|r| r.latency_mean_ms),
                    latency_p95_ms: pick(|r| r.latency_p95_ms),
                    deadline_miss_rate: pick(|r| r.deadline_miss_rate),
                    request_failure_rate: pick(|r| r.request_failure_rate),
                    attempt_failure_rate: pick(|r| r.attempt_failure_rate),
                    cost_per_request: pick(|r| r.cost_per_request),
                    regret: pick(|r| r.regret),
                    share,
                    per_seed: rs
                        .iter()
                        .map(|r| SeedResult {
                            seed: r.seed,
                            quality: r.quality,
                            regret: r.regret,
                            cost_per_request: r.cost_per_request,
                            deadline_miss_rate: r.deadline_miss_rate,
                            request_failure_rate: r.request_failure_rate,
                            share_over_time: providers
                                .iter()
                                .enumerate()
                                .map(|(i, p)| {
                                    (
                                        p.clone(),
                                        r.share_over_time.iter().map(|bin| bin[i]).collect(),
                                    )
                                })
                                .collect(),
                            request_failure_rate_over_time: r
                                .request_failure_rate_over_time
                                .clone(),
                            recovery_rounds: r.recovery.clone(),
                            quality_shifts: r.quality_shifts.clone(),
                        })
                        .collect(),
                    share_over_time,
                    regret_over_time,
                    calibration: CalibrationReport::of(&rs),
                    recovery: RecoverySummary::of(&rs),
                },
            );
        }
        let rounds = runs.first().map_or(0, |r| r.rounds);
        ScenarioReport {
            scenario: scenario.to_owned(),
            seeds: seed_list.len(),
            rounds,
            seed_list,
            providers,
            // The smallest t with t·BINS/rounds = b.
            bin_start_rounds: (0..BINS).map(|b| (b * rounds).div_ceil(BINS)).collect(),
            policies: out,
            order: policies.to_vec(),
        }
    }

    /// Policies in the requested order with their reports.
    pub fn ordered(&self) -> impl Iterator<Item = (&String, &PolicyReport)> {
        self.order
            .iter()
            .filter_map(|n| self.policies.get_key_value(n))
    }

    /// The policy with the highest mean quality other than the oracle (which knows the
    /// world), if any.
    #[must_use]
    pub fn best(&self) -> Option<(&String, &PolicyReport)> {
        self.ordered()
            .filter(|(name, _)| name.as_str() != "oracle")
            .max_by(|a, b| a.1.quality.mean.total_cmp(&b.1.quality.mean))
    }

    /// A plain-text table. Quality is marked `*` for the best policy (the oracle aside) and
    /// `~` for those within noise of it (overlapping intervals).
    #[must_use]
    pub fn table(&self) -> String {
        let mut s = String::new();
        let seeds: Vec<String> = self.seed_list.iter().map(u64::to_string).collect();
        let _ = writeln!(
            s,
            "\n{} — {} seeds ({}), {} rounds; mean ± 95% CI over seeds",
            self.scenario,
            self.seeds,
            seeds.join(","),
            self.rounds
        );
        let best = self.best();
        let _ = writeln!(
            s,
            "{:<20} {:>17} {:>13} {:>13} {:>13} {:>13} {:>13} {:>15} {:>13}  share",
            "policy",
            "quality",
            "lat mean ms",
            "lat p95 ms",
            "miss rate",
            "req fail",
            "att fail",
            "cost/req $",
            "regret"
        );
        for (name, r) in self.ordered() {
            let share: Vec<String> = self
                .providers
                .iter()
                .filter_map(|p| r.share.get(p).map(|v| (p, v)))
                .filter(|(_, v)| **v >= 0.005)
                .map(|(p, v)| format!("{p} {:.0}%", v * 100.0))
                .collect();
            let mark = match best {
                Some((b, _)) if b == name => " *",
                Some((_, br)) if name != "oracle" && r.quality.within_noise_of(&br.quality) => " ~",
                _ => "  ",
            };
            let _ = writeln!(
                s,
                "{:<20} {:>17} {:>13} {:>13} {:>13} {:>13} {:>13} {:>15} {:>13}  {}",
                name,
                format!("{}{mark}", fmt(r.quality, 3)),
                fmt(r.latency_mean_ms, 0),
                fmt(r.latency_p95_ms, 0),
                fmt(r.deadline_miss_rate, 3),
                fmt(r.request_failure_rate, 3),
                fmt(r.attempt_failure_rate, 3),
                fmt_cost(r.cost_per_request),
                fmt(r.regret, 1),
                share.join(", ")
            );
        }
        if best.is_some() {
            s.push_str("quality: * best (the oracle aside), ~ within noise of it (95% intervals overlap)\n");
        }
        s.push_str(&self.recovery_table());
        s.push_str(&self.calibration_table());
        s
    }

    /// Recovery after each time-limited event: rounds from its end until its provider is
    /// the first choice of ≥ 60% of a bin-long window (mean ± 95% CI over the seeds where it
    /// was, and how many seeds never got there). Empty when the scenario has no such event.
    #[must_use]
    pub fn recovery_table(&self) -> String {
        let mut s = String::new();
        let Some(events) = self
            .ordered()
            .map(|(_, r)| &r.recovery)
            .find(|r| !r.is_empty())
        else {
            return s;
        };
        let _ = writeln!(
            s,
            "recovery: rounds from an event's end until its provider is first in ≥ {:.0}% of a {}-round window (mean ± 95% CI over the seeds that got there; never = seeds that did not within the run)",
            RECOVERY_SHARE * 100.0,
            (self.rounds / BINS).max(1)
        );
        let _ = write!(s, "{:<20}", "policy");
        for e in events {
            let _ = write!(
                s,
                " {:>28}",
                format!("{} {} →{}", e.provider, e.event, e.end_round)
            );
        }
        s.push('\n');
        for (name, r) in self.ordered() {
            let _ = write!(s, "{name:<20}");
            for e in &r.recovery {
                let _ = write!(s, " {:>28}", e.cell());
            }
            s.push('\n');
        }
        s
    }

    /// The calibration of the policies that estimate deadline misses: ECE (mean ± 95% CI over
    /// seeds) and, per decile of the prediction, mean predicted / observed miss rate. Empty
    /// when no policy has one.
    #[must_use]
    pub fn calibration_table(&self) -> String {
        let mut s = String::new();
        let rows: Vec<(&String, &CalibrationReport)> = self
            .ordered()
            .filter_map(|(n, r)| r.calibration.as_ref().map(|c| (n, c)))
            .collect();
        if rows.is_empty() {
            return s;
        }
        s.push_str("calibration of P(latency > deadline) for the first choice: predicted/observed miss rate by decile of the prediction (mean over seeds)\n");
        let _ = write!(s, "{:<20} {:>15} {:>7} {:>11}", "policy", "ECE", "n", "all");
        for b in 1..=DECILES {
            let _ = write!(s, " {:>11}", format!("d{b}"));
        }
        s.push('\n');
        for (name, c) in rows {
            let _ = write!(
                s,
                "{:<20} {:>15} {:>7} {:>11}",
                name,
                fmt(c.ece, 4),
                c.count,
                format!("{:.3}/{:.3}", c.predicted, c.observed)
            );
            for d in &c.deciles {
                let _ = write!(
                    s,
                    " {:>11}",
                    format!("{:.3}/{:.3}", d.predicted, d.observed)
                );
            }
            s.push('\n');
        }
        s
    }

    /// CSV rows `scenario,policy,metric,mean,ci95` (no header).
    #[must_use]
    pub fn csv_rows(&self) -> String {
        let mut s = String::new();
        for (name, r) in self.ordered() {
            for (metric, v) in [
                ("quality", r.quality),
                ("latency_mean_ms", r.latency_mean_ms),
                ("latency_p95_ms", r.latency_p95_ms),
                ("deadline_miss_rate", r.deadline_miss_rate),
                ("request_failure_rate", r.request_failure_rate),
                ("attempt_failure_rate", r.attempt_failure_rate),
                ("cost_per_request", r.cost_per_request),
                ("regret", r.regret),
            ]
            .into_iter()
            .chain(r.calibration.as_ref().map(|c| ("calibration_ece", c.ece)))
            {
                let _ = writeln!(
                    s,
                    "{},{},{},{},{}",
                    self.scenario, name, metric, v.mean, v.ci95
                );
            }
            for (p, v) in &r.share {
                let _ = writeln!(s, "{},{},share:{},{},0", self.scenario, name, p, v);
            }
            // Recovery rounds over the seeds that recovered, and the count that never did.
            for e in &r.recovery {
                let metric = format!("recovery_rounds:{}:{}:{}", e.provider, e.event, e.end_round);
                let _ = writeln!(
                    s,
                    "{},{},{metric},{},{}",
                    self.scenario, name, e.rounds.mean, e.rounds.ci95
                );
                let _ = writeln!(s, "{},{},{metric}:never,{},0", self.scenario, name, e.never);
            }
        }
        s
    }
}

/// The CSV header matching [`ScenarioReport::csv_rows`].
pub const CSV_HEADER: &str = "scenario,policy,metric,mean,ci95";

fn fmt(v: Summary, digits: usize) -> String {
    format!("{:.*} ± {:.*}", digits, v.mean, digits, v.ci95)
}

fn fmt_cost(v: Summary) -> String {
    format!("{:.5} ± {:.5}", v.mean, v.ci95)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_uses_the_t_interval() {
        // Mean 3, sample sd sqrt(2.5), n = 5: half-width 2.776·sqrt(2.5/5) = 1.963.
        let s = Summary::of(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!((s.mean - 3.0).abs() < 1e-12);
        assert!((s.ci95 - 2.776 * 0.5f64.sqrt()).abs() < 1e-9);
        assert_eq!(
            Summary::of(&[7.0]),
            Summary {
                mean: 7.0,
                ci95: 0.0
            }
        );
    }

    #[test]
    fn the_table_marks_the_best_policy_and_those_within_noise_of_it() {
        // Qualities per seed: a 0.60/0.62 (0.61 ± 12.706·0.01 = 0.127), b 0.20/0.22 (0.21 ±
        // 0.127: below a's interval), c 0.50/0.70 (0.60 ± 1.27: reaches a's), oracle 0.9 (never marked).
        let run = |policy: &str, seed: u64, quality: f64| RunResult {
            policy: policy.to_owned(),
            seed,
            rounds: 10,
            quality,
            latency_mean_ms: 1.0,
            latency_p95_ms: 1.0,
            latency_p50_ms: 1.0,
            latency_p99_ms: 1.0,
            calls_per_request: 1.0,
            hedge_rate: 0.0,
            hedge_win_rate: 0.0,
            deadline_miss_rate: 0.0,
            request_failure_rate: 0.0,
            attempt_failure_rate: 0.0,
            cost_per_request: 0.0,
            regret: 0.0,
            share: vec![1.0],
            share_over_time: vec![vec![1.0]; BINS],
            regret_over_time: vec![0.0; BINS],
            request_failure_rate_over_time: vec![0.0; BINS],
            calibration: None,
            recovery: Vec::new(),
            by_deadline: Vec::new(),
            quality_shifts: Vec::new(),
        };
        let runs = [
            run("a", 1, 0.60),
            run("a", 2, 0.62),
            run("b", 1, 0.20),
            run("b", 2, 0.22),
            run("c", 1, 0.50),
            run("c", 2, 0.70),
            run("oracle", 1, 0.9),
            run("oracle", 2, 0.9),
        ];
        let names: Vec<String> = ["a", "b", "c", "oracle"].map(str::to_owned).to_vec();
        let r = ScenarioReport::new("s", vec!["p".into()], &names, &runs);
        assert_eq!(r.best().map(|(n, _)| n.as_str()), Some("a"));
        // Each seed's own numbers, in seed order, in the JSON too.
        let seeds: Vec<(u64, f64)> = r.policies["c"]
            .per_seed
            .iter()
            .map(|s| (s.seed, s.quality))
            .collect();
        assert_eq!(seeds, vec![(1, 0.50), (2, 0.70)]);
        let json = serde_json::to_value(&r).unwrap_or_default();
        assert_eq!(json["policies"]["b"]["per_seed"][1]["quality"], 0.22);
        let table = r.table();
        let line = |p: &str| {
            table
                .lines()
                .find(|l| l.starts_with(&format!("{p} ")))
                .unwrap_or_default()
                .to_owned()
        };
        assert!(line("a").contains("0.610 ± 0.127 *"), "{table}");
        assert!(line("b").contains("0.210 ± 0.127  "), "{table}");
        assert!(line("c").contains("0.600 ± 1.271 ~"), "{table}");
        assert!(
            !line("oracle").contains('*') && !line("oracle").contains('~'),
            "{table}"
        );
        // Touching intervals count; clearly below does not; above always does.
        let x = Summary {
            mean: 0.5,
            ci95: 0.125,
        };
        let y = Summary {
            mean: 0.75,
            ci95: 0.125,
        };
        assert!(x.within_noise_of(&y));
        let z = Summary {
            mean: 0.76,
            ci95: 0.125,
        };
        assert!(!x.within_noise_of(&z) && z.within_noise_of(&x));
    }
}
