//! Plots as standalone SVG: the quality–latency frontier of a scenario, traffic share over
//! time per policy, and cumulative regret over time. Written by hand (a few hundred bytes of
//! markup per series) so the laboratory needs no plotting or font stack.

use super::ScenarioReport;
use crate::runner::BINS;
use std::fmt::Write as _;

const W: f64 = 720.0;
const H: f64 = 440.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 180.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLORS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A frame with axes, ticks and labels; returns the markup and the data → pixel mappings.
struct Frame {
    svg: String,
    x: (f64, f64),
    y: (f64, f64),
}

impl Frame {
    fn new(title: &str, x_label: &str, y_label: &str, x: (f64, f64), y: (f64, f64)) -> Frame {
        let mut svg = String::new();
        let _ = write!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
            (LEFT + W - RIGHT) / 2.0,
            escape(title)
        );
        let (x0, x1, y0, y1) = (LEFT, W - RIGHT, H - BOTTOM, TOP);
        let _ = write!(
            svg,
            r#"<rect x="{x0}" y="{y1}" width="{}" height="{}" fill="none" stroke="black"/>"#,
            x1 - x0,
            y0 - y1
        );
        let f = Frame { svg, x, y };
        let mut f = f;
        for k in 0..=5 {
            let t = f64::from(k) / 5.0;
            let xv = x.0 + t * (x.1 - x.0);
            let yv = y.0 + t * (y.1 - y.0);
            let (px, py) = (f.px(xv), f.py(yv));
            let _ = write!(
                f.svg,
                r##"<line x1="{px}" y1="{y0}" x2="{px}" y2="{}" stroke="black"/><text x="{px}" y="{}" text-anchor="middle">{}</text><line x1="{x0}" y1="{py}" x2="{}" y2="{py}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                y0 + 5.0,
                y0 + 18.0,
                tick(xv),
                x1,
                x0 - 6.0,
                py + 4.0,
                tick(yv)
            );
        }
        let _ = write!(
            f.svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text><text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>"#,
            f64::midpoint(x0, x1),
            H - 12.0,
            escape(x_label),
            f64::midpoint(y0, y1),
            f64::midpoint(y0, y1),
            escape(y_label)
        );
        f
    }

    fn px(&self, v: f64) -> f64 {
        let span = (self.x.1 - self.x.0).max(1e-12);
        LEFT + (v - self.x.0) / span * (W - RIGHT - LEFT)
    }

    fn py(&self, v: f64) -> f64 {
        let span = (self.y.1 - self.y.0).max(1e-12);
        H - BOTTOM - (v - self.y.0) / span * (H - BOTTOM - TOP)
    }

    fn legend(&mut self, row: usize, color: &str, label: &str) {
        let y = TOP + 10.0 + 18.0 * row as f64;
        let x = W - RIGHT + 12.0;
        let _ = write!(
            self.svg,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{color}"/><text x="{}" y="{}">{}</text>"#,
            y - 10.0,
            x + 18.0,
            y,
            escape(label)
        );
    }

    fn polyline(&mut self, points: &[(f64, f64)], color: &str) {
        let pts: Vec<String> = points
            .iter()
            .map(|&(a, b)| format!("{:.1},{:.1}", self.px(a), self.py(b)))
            .collect();
        let _ = write!(
            self.svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            pts.join(" ")
        );
    }

    fn finish(mut self) -> String {
        self.svg.push_str("</svg>\n");
        self.svg
    }
}

fn tick(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Pads a range so points do not sit on the frame.
fn padded(lo: f64, hi: f64) -> (f64, f64) {
    let span = (hi - lo).abs().max(1e-6);
    (lo - 0.08 * span, hi + 0.08 * span)
}

/// Quality against mean latency, one point per policy with its 95% intervals.
#[must_use]
pub fn frontier(report: &ScenarioReport) -> String {
    let pts: Vec<(&String, f64, f64, f64, f64)> = report
        .ordered()
        .map(|(n, r)| {
            (
                n,
                r.latency_mean_ms.mean,
                r.quality.mean,
                r.latency_mean_ms.ci95,
                r.quality.ci95,
            )
        })
        .collect();
    let (xl, xh) = pts.iter().fold((f64::MAX, f64::MIN), |(l, h), p| {
        (l.min(p.1 - p.3), h.max(p.1 + p.3))
    });
    let (yl, yh) = pts.iter().fold((f64::MAX, f64::MIN), |(l, h), p| {
        (l.min(p.2 - p.4), h.max(p.2 + p.4))
    });
    let mut f = Frame::new(
        &format!(
            "{}: quality vs latency ({} seeds)",
            report.scenario, report.seeds
        ),
        "mean end-to-end latency (ms)",
        "quality (gold)",
        {
            let (lo, hi) = padded(xl.max(0.0), xh);
            (lo.max(0.0), hi)
        },
        padded(yl, yh),
    );
    for (k, (name, x, y, ex, ey)) in pts.iter().enumerate() {
        let c = COLORS[k % COLORS.len()];
        let (px, py) = (f.px(*x), f.py(*y));
        let _ = write!(
            f.svg,
            r#"<line x1="{}" y1="{py}" x2="{}" y2="{py}" stroke="{c}"/><line x1="{px}" y1="{}" x2="{px}" y2="{}" stroke="{c}"/><circle cx="{px}" cy="{py}" r="5" fill="{c}"/>"#,
            f.px(x - ex),
            f.px(x + ex),
            f.py(y - ey),
            f.py(y + ey)
        );
        f.legend(k, c, name);
    }
    f.finish()
}

/// Share of first choices per provider over time, for one policy.
#[must_use]
pub fn share_over_time(report: &ScenarioReport, policy: &str) -> Option<String> {
    let r = report.policies.get(policy)?;
    let mut f = Frame::new(
        &format!("{}: traffic share over time, {policy}", report.scenario),
        "round",
        "share of first choices",
        (0.0, report.rounds as f64),
        (0.0, 1.0),
    );
    let step = report.rounds as f64 / BINS as f64;
    for (i, p) in report.providers.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = r
            .share_over_time
            .iter()
            .enumerate()
            .map(|(b, s)| ((b as f64 + 0.5) * step, s[i]))
            .collect();
        f.polyline(&pts, c);
        f.legend(i, c, p);
    }
    Some(f.finish())
}

/// Cumulative regret against the oracle over time, one line per policy.
#[must_use]
pub fn regret_over_time(report: &ScenarioReport) -> String {
    let top = report
        .ordered()
        .flat_map(|(_, r)| r.regret_over_time.iter().copied())
        .fold(0.0f64, f64::max);
    let mut f = Frame::new(
        &format!("{}: cumulative regret vs the oracle", report.scenario),
        "round",
        "cumulative regret (expected delivered quality)",
        (0.0, report.rounds as f64),
        (0.0, top.max(1e-6) * 1.05),
    );
    let step = report.rounds as f64 / BINS as f64;
    for (k, (name, r)) in report.ordered().enumerate() {
        let c = COLORS[k % COLORS.len()];
        let pts: Vec<(f64, f64)> = r
            .regret_over_time
            .iter()
            .enumerate()
            .map(|(b, v)| ((b as f64 + 1.0) * step, *v))
            .collect();
        f.polyline(&pts, c);
        f.legend(k, c, name);
    }
    f.finish()
}

/// Lines of `(x, y)` points with markers, one per named series (e.g. a rule's parameter
/// sweep), on padded axes.
#[must_use]
pub fn curves(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    let all = series.iter().flat_map(|(_, pts)| pts.iter().copied());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in all {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let mut f = Frame::new(title, x_label, y_label, padded(x0, x1), padded(y0, y1));
    for (row, (name, pts)) in series.iter().enumerate() {
        let color = COLORS[row % COLORS.len()];
        f.polyline(pts, color);
        for &(x, y) in pts {
            let _ = write!(
                f.svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{color}"/>"#,
                f.px(x),
                f.py(y)
            );
        }
        f.legend(row, color, name);
    }
    f.finish()
}

/// A reliability diagram of `policy`'s deadline-miss estimate: per decile of the prediction,
/// the mean predicted `P(latency > deadline)` against the observed miss rate (means over
/// seeds), one line per scenario (a latency shape each, in the calibration runs; a `cal-`
/// prefix dropped), with the diagonal of perfect calibration. `None` when no scenario has a calibration for `policy`.
#[must_use]
pub fn reliability(reports: &[ScenarioReport], policy: &str) -> Option<String> {
    let series: Vec<(String, Vec<(f64, f64)>)> = reports
        .iter()
        .filter_map(|r| {
            let c = r.policies.get(policy)?.calibration.as_ref()?;
            let pts = c
                .deciles
                .iter()
                .filter(|d| d.count > 0)
                .map(|d| (d.predicted, d.observed))
                .collect();
            // The legend column is narrow: the calibration scenarios' common prefix goes.
            let name = r.scenario.strip_prefix("cal-").unwrap_or(&r.scenario);
            Some((name.to_owned(), pts))
        })
        .collect();
    if series.is_empty() {
        return None;
    }
    let top = series
        .iter()
        .flat_map(|(_, pts)| pts.iter().map(|&(x, y)| x.max(y)))
        .fold(0.0f64, f64::max);
    // Square axes from 0, rounded up to a tenth, so the diagonal is the diagonal.
    let top = ((top * 10.0).ceil() / 10.0).clamp(0.1, 1.0);
    let mut f = Frame::new(
        &format!("reliability of P(latency > deadline), {policy}"),
        "predicted miss rate (decile mean)",
        "observed miss rate",
        (0.0, top),
        (0.0, top),
    );
    let _ = write!(
        f.svg,
        r##"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#999" stroke-dasharray="4 4"/>"##,
        f.px(0.0),
        f.py(0.0),
        f.px(top),
        f.py(top)
    );
    for (row, (name, pts)) in series.iter().enumerate() {
        let color = COLORS[row % COLORS.len()];
        f.polyline(pts, color);
        for &(x, y) in pts {
            let _ = write!(
                f.svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{color}"/>"#,
                f.px(x),
                f.py(y)
            );
        }
        f.legend(row, color, name);
    }
    Some(f.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::CalibrationBin;
    use crate::report::{CalibrationReport, PolicyReport, Summary};
    use std::collections::BTreeMap;

    fn report(scenario: &str, deciles: Vec<CalibrationBin>) -> ScenarioReport {
        let s = Summary::default();
        let policy = PolicyReport {
            quality: s,
            latency_mean_ms: s,
            latency_p95_ms: s,
            deadline_miss_rate: s,
            request_failure_rate: s,
            attempt_failure_rate: s,
            cost_per_request: s,
            regret: s,
            share: BTreeMap::new(),
            per_seed: Vec::new(),
            share_over_time: Vec::new(),
            regret_over_time: Vec::new(),
            calibration: Some(CalibrationReport {
                ece: Summary {
                    mean: 0.0125,
                    ci95: 0.0,
                },
                count: 100,
                predicted: 0.2,
                observed: 0.2,
                deciles,
            }),
            recovery: Vec::new(),
        };
        ScenarioReport {
            scenario: scenario.to_owned(),
            seeds: 1,
            rounds: 100,
            seed_list: vec![1],
            providers: vec!["a".into()],
            bin_start_rounds: Vec::new(),
            policies: BTreeMap::from([("lqm-ts".to_owned(), policy)]),
            order: vec!["lqm-ts".to_owned()],
        }
    }

    #[test]
    fn the_reliability_diagram_has_one_line_per_scenario_and_the_diagonal() {
        let bin = |p: f64, o: f64| CalibrationBin {
            predicted: p,
            observed: o,
            count: 10,
        };
        let reports = [
            report("cal-lognormal", vec![bin(0.05, 0.04), bin(0.3, 0.32)]),
            report("cal-pareto", vec![bin(0.1, 0.2), bin(0.4, 0.35)]),
        ];
        let svg = reliability(&reports, "lqm-ts").unwrap_or_default();
        assert_eq!(svg.matches("<polyline").count(), 2, "{svg}");
        assert_eq!(svg.matches("<circle").count(), 4, "{svg}");
        assert!(svg.contains(">pareto<") && svg.contains("stroke-dasharray"));
        // The axes reach the largest rate, rounded up to a tenth: 0.4 → 0 to 0.4, so the
        // point (0.4, 0.35) sits at the right edge (x = W − RIGHT = 540).
        assert!(svg.contains("540.0,"), "{svg}");
        assert!(reliability(&reports, "least-latency").is_none());
    }
}
