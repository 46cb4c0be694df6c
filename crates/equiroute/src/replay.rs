//! `equiroute replay`: what other policies would have done on the traffic a gateway already
//! served, estimated from its audit log (off-policy evaluation, [`equiroute_core::ope`]).
//!
//! Per interface: the log's requests are replayed in time order through each target policy,
//! which observes every logged attempt and every quality score as they happened and, at each
//! logged decision, gives its first-choice distribution. With the logging policy's
//! propensity of what it chose, IPS, SNIPS or doubly robust estimate the target's mean
//! quality, deadline-miss rate, bad-outcome rate and cost per request, with 95% intervals
//! and the effective sample size; the logging policy's own means are the sanity row.
//!
//! The log gives the index space (each record's `candidates`); the providers' prices, tiers
//! and capabilities come from `--config` (else the embedded default), and from the log alone
//! (ids, no prices) for an interface the configuration does not have.

mod log;

use anyhow::{bail, Context};
use equiroute_core::ope::{self, Estimate, Estimator, LoggedDecision, OpeOptions, SupportWarning};
use equiroute_core::policies::{
    AttemptObservation, Policy, PolicyConfig, PolicyKind, QualityObservation, RankContext,
};
use equiroute_core::{AttemptOutcome, Candidate, Millis, SlicePath, Timestamp, TokenEstimate};
use log::Joined;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

/// `--estimator`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EstimatorArg {
    Ips,
    Snips,
    Dr,
    All,
}

impl EstimatorArg {
    fn estimators(self) -> Vec<Estimator> {
        match self {
            EstimatorArg::Ips => vec![Estimator::Ips],
            EstimatorArg::Snips => vec![Estimator::Snips],
            EstimatorArg::Dr => vec![Estimator::Dr],
            EstimatorArg::All => Estimator::ALL.to_vec(),
        }
    }
}

/// `--learning-check`: which comparison of a learning policy's replays warns
/// ([`ope::LearningCheck`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LearningCheckArg {
    /// Learning from every request against learning as on its own traffic (the rule before
    /// the random-sample replay: a policy that merely learns slowly is warned too).
    AllVsOwn,
    /// That, and learning as on its own traffic against learning from a uniformly random
    /// sample of the log of the same size.
    OwnVsSample,
}

impl From<LearningCheckArg> for ope::LearningCheck {
    fn from(a: LearningCheckArg) -> Self {
        match a {
            LearningCheckArg::AllVsOwn => ope::LearningCheck::AllVsOwn,
            LearningCheckArg::OwnVsSample => ope::LearningCheck::OwnVsSample,
        }
    }
}

/// What a replayed policy learns from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Learning {
    /// Every logged request, as the gateway's policy did.
    All,
    /// A sample drawn as its own traffic would be ([`ope::learns_as_own`]).
    Own,
    /// A uniformly random sample of the same expected size ([`ope::learns_as_sample`]).
    Sample,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Audit log files (the gateway's `[audit] path`); each file's rotations (`FILE.1`,
    /// `FILE.2`, …) are read too. Several gateways' logs may be given together.
    #[arg(long, num_args = 1.., required = true, value_name = "FILE")]
    audit: Vec<PathBuf>,
    /// Policies to evaluate, comma-separated (`equiroute policies` lists them). A policy of
    /// the same name as an interface's configured one starts from its configured parameters.
    #[arg(long, value_delimiter = ',', required = true)]
    policies: Vec<String>,
    /// Change one parameter of an evaluated policy, e.g. `--set lqm-ts.lqm.l_ref_ms=800` (a
    /// dotted path, as `equiroute policies NAME` lists it; the value is read as JSON, else
    /// as a string). May repeat.
    #[arg(long = "set", value_name = "POLICY.FIELD=VALUE")]
    sets: Vec<String>,
    /// The estimator: inverse propensity scoring, its self-normalised form, doubly robust,
    /// or all three.
    #[arg(long, value_enum, default_value = "dr")]
    estimator: EstimatorArg,
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// The configuration the gateway ran with: providers' prices, tiers and capabilities, each
    /// interface's feature dimension and policy parameters (default: the embedded default).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Only this interface.
    #[arg(long)]
    interface: Option<String>,
    /// Rankings drawn per decision to estimate a Thompson-sampled policy's first-choice
    /// probabilities.
    #[arg(long, default_value_t = 200)]
    draws: u32,
    /// Seed of the policies' sampling and of the bootstrap intervals.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Which comparison warns that a learning policy's estimate depends on what it learns
    /// (docs/ope.md): `own-vs-sample` also replays it learning from a random sample of the
    /// log of the size of its own-traffic sample, and warns only when the own-traffic
    /// sample differs from both that and every request.
    #[arg(long, value_enum, default_value = "own-vs-sample")]
    learning_check: LearningCheckArg,
}

/// Policies that read the request's features: they cannot be replayed without them.
fn reads_features(kind: PolicyKind) -> bool {
    matches!(
        kind,
        PolicyKind::Lqm | PolicyKind::LqmTs | PolicyKind::Linucb | PolicyKind::Additive
    )
}

/// The context-free policies, for the message that says which ones a log without features
/// can evaluate.
fn context_free_names() -> String {
    PolicyKind::ALL
        .iter()
        .filter(|k| !reads_features(**k) && **k != PolicyKind::Oracle)
        .map(|k| k.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A policy to evaluate: its name and the `--set` changes to lay over its base parameters.
#[derive(Debug)]
struct Target {
    kind: PolicyKind,
    sets: Vec<(Vec<String>, Value)>,
}

impl Target {
    /// The configuration on `iface`: its configured one when it is the same policy, else the
    /// defaults; then the `--set` changes.
    fn config(&self, configured: Option<&PolicyConfig>) -> anyhow::Result<PolicyConfig> {
        let base = configured
            .filter(|c| c.kind() == self.kind)
            .cloned()
            .unwrap_or_else(|| PolicyConfig::default_for(self.kind));
        let mut json = serde_json::to_value(&base)?;
        for (fields, value) in &self.sets {
            let mut node = &mut json;
            for (n, f) in fields.iter().enumerate() {
                let Some(obj) = node.as_object_mut() else {
                    bail!(
                        "--set `{}.{}`: `{}` is not a table of `{}`",
                        self.kind,
                        fields.join("."),
                        fields[..n].join("."),
                        self.kind
                    );
                };
                node = obj.entry(f.clone()).or_insert(Value::Null);
            }
            *node = value.clone();
        }
        serde_json::from_value(json).map_err(|e| {
            anyhow::anyhow!(
                "--set on `{}`: {e} (`equiroute policies {}` lists its fields)",
                self.kind,
                self.kind
            )
        })
    }
}

/// `--policies` and `--set`, checked before any log is read.
fn targets(args: &Args) -> anyhow::Result<Vec<Target>> {
    let mut out: Vec<Target> = Vec::new();
    for name in &args.policies {
        let kind: PolicyKind = name.trim().parse().with_context(|| {
            format!("--policies `{name}` (`equiroute policies` lists the policies)")
        })?;
        if kind == PolicyKind::Oracle {
            bail!("--policies `oracle`: the oracle reads a simulated world's true means, which a log does not have; it exists only in `equiroute bench`");
        }
        if out.iter().any(|t| t.kind == kind) {
            bail!("--policies names `{name}` twice");
        }
        out.push(Target {
            kind,
            sets: Vec::new(),
        });
    }
    let fix = "write POLICY.FIELD=VALUE, e.g. lqm-ts.lqm.l_ref_ms=800";
    for set in &args.sets {
        let (path, value) = set
            .split_once('=')
            .with_context(|| format!("--set `{set}`: {fix}"))?;
        let mut parts = path.split('.');
        let policy = parts.next().unwrap_or_default();
        let fields: Vec<String> = parts.map(str::to_owned).collect();
        if policy.is_empty() || fields.iter().any(String::is_empty) || fields.is_empty() {
            bail!("--set `{set}`: {fix}");
        }
        let names: Vec<&str> = out.iter().map(|t| t.kind.as_str()).collect();
        let Some(target) = out.iter_mut().find(|t| t.kind.as_str() == policy) else {
            bail!(
                "--set `{set}`: `{policy}` is not one of --policies ({}): add it there",
                names.join(",")
            );
        };
        let parsed: Value =
            serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()));
        target.sets.push((fields, parsed));
        // Fail now, with the field named, rather than once per interface.
        target
            .config(None)
            .with_context(|| format!("--set `{set}`"))?;
    }
    Ok(out)
}

/// Where an interface's candidates came from.
#[derive(Clone, Debug)]
enum CandidatesFrom {
    /// The configuration file (or `embedded default`).
    Config(String),
    /// The log alone: ids only, prices unknown (0).
    Log,
}

impl CandidatesFrom {
    fn describe(&self) -> String {
        match self {
            CandidatesFrom::Config(name) => format!("candidates from {name}"),
            CandidatesFrom::Log => {
                "candidates from the log alone (prices unknown: counted as 0)".into()
            }
        }
    }
}

/// One interface's candidates, and what the configuration says of it.
struct Space {
    candidates: Vec<Candidate>,
    from: CandidatesFrom,
    policy: Option<PolicyConfig>,
    feature_dim: usize,
}

impl Space {
    fn index(&self, id: &str) -> Option<usize> {
        self.candidates.iter().position(|c| c.id.0 == id)
    }
}

/// How the logging policy's propensity is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Known {
    Exact,
    Estimated,
    Deterministic,
}

/// One logged decision, in the interface's index space.
struct Decision {
    decided: f64,
    eligible: Vec<usize>,
    action: usize,
    /// The logging policy's probability of `action`, when it reported a usable one.
    propensity: Option<(f64, Known)>,
    features: Option<Vec<f64>>,
    slice: SlicePath,
    tokens: TokenEstimate,
    deadline: Option<Millis>,
    /// (candidate, outcome, start).
    attempts: Vec<(usize, AttemptOutcome, f64)>,
    answered_by: Option<usize>,
    latency: f64,
    quality: Option<(f64, f64)>,
    miss: bool,
    bad: bool,
    cost: f64,
}

/// What happens, in time order, during a replay.
#[derive(Clone, Copy, Debug)]
enum Event {
    Decide(usize),
    Attempt(usize, usize),
    Feedback(usize),
}

/// One interface's log, ready to replay.
struct InterfaceLog {
    name: String,
    space: Space,
    decisions: Vec<Decision>,
    events: Vec<Event>,
    logging_policies: Vec<String>,
    features: BTreeMap<&'static str, usize>,
    /// Requests whose providers the configuration does not have.
    unknown_provider: usize,
    /// Requests whose logging policy reported no usable propensity.
    no_propensity: usize,
}

/// The four metrics, in report order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Metric {
    Quality,
    DeadlineMiss,
    Bad,
    Cost,
}

impl Metric {
    const ALL: [Metric; 4] = [
        Metric::Quality,
        Metric::DeadlineMiss,
        Metric::Bad,
        Metric::Cost,
    ];

    fn key(self) -> &'static str {
        match self {
            Metric::Quality => "quality",
            Metric::DeadlineMiss => "deadline_miss_rate",
            Metric::Bad => "bad_outcome_rate",
            Metric::Cost => "cost_per_request_usd",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Metric::Quality => "quality",
            Metric::DeadlineMiss => "deadline miss",
            Metric::Bad => "bad outcome",
            Metric::Cost => "cost/request $",
        }
    }

    fn value(self, d: &Decision) -> Option<f64> {
        match self {
            Metric::Quality => d.quality.map(|(q, _)| q),
            Metric::DeadlineMiss => Some(f64::from(u8::from(d.miss))),
            Metric::Bad => Some(f64::from(u8::from(d.bad))),
            Metric::Cost => Some(d.cost),
        }
    }
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let targets = targets(args)?;
    if args.draws == 0 {
        bail!("--draws must be at least 1 (rankings drawn per decision for Thompson-sampled policies)");
    }
    let (config, config_name) = load_config(args.config.as_ref())?;
    let files = log::with_rotations(&args.audit)?;
    let lines = log::read(&files)?;
    let malformed_count = lines.malformed_count;
    let malformed: Vec<String> = lines.malformed.iter().map(ToString::to_string).collect();
    let joined = log::join(lines);
    let mut interfaces = split(&joined.requests, &config, &config_name);
    if let Some(only) = &args.interface {
        interfaces.retain(|i| &i.name == only);
        if interfaces.is_empty() {
            bail!("--interface `{only}`: the log has no request of that interface");
        }
    }
    if interfaces.is_empty() {
        bail!(
            "no request record in {} ({} malformed line(s)): is this the gateway's `[audit] path`?",
            files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            malformed_count
        );
    }
    let mut notes = Vec::new();
    if malformed_count > 0 {
        notes.push(format!(
            "{malformed_count} malformed line(s) skipped (a line cut by a crash, or not written by the gateway): {}",
            malformed.join("; ")
        ));
    }
    if joined.duplicate_requests > 0 {
        notes.push(format!(
            "{} request record(s) repeat an id already read (the first is kept: was a file given twice?)",
            joined.duplicate_requests
        ));
    }
    if joined.orphan_feedback > 0 {
        notes.push(format!(
            "{} quality score(s) name a request no file holds (rotated away or dropped): not counted",
            joined.orphan_feedback
        ));
    }
    let reports: Vec<Value> = interfaces
        .iter()
        .map(|i| evaluate_interface(i, &targets, args))
        .collect();
    let report = json!({
        "files": files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
        "malformed_lines": malformed_count,
        "notes": notes,
        "interfaces": reports,
    });
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        Format::Table => print!("{}", table(&report)),
    }
    Ok(())
}

/// The configuration whose providers give the candidates' attributes.
fn load_config(
    path: Option<&PathBuf>,
) -> anyhow::Result<(equiroute_gateway::config::GatewayConfig, String)> {
    let env = |name: &str| std::env::var(name).ok();
    // Keys do not matter here: a missing one must not stop a replay.
    let lenient = |name: &str| env(name).or_else(|| Some("unused-by-replay".into()));
    match path {
        None => Ok((
            equiroute_gateway::config::load(
                equiroute_gateway::config::DEFAULT_CONFIG,
                "(embedded default)",
                &lenient,
            )?,
            "the embedded default".into(),
        )),
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("--config `{}`", p.display()))?;
            let name = p.display().to_string();
            Ok((
                equiroute_gateway::config::load(&text, &name, &lenient)?,
                name,
            ))
        }
    }
}

/// The requests of each interface, in its index space.
fn split(
    requests: &[Joined],
    config: &equiroute_gateway::config::GatewayConfig,
    config_name: &str,
) -> Vec<InterfaceLog> {
    let mut by_name: BTreeMap<&str, Vec<&Joined>> = BTreeMap::new();
    for j in requests {
        by_name.entry(&j.request.interface).or_default().push(j);
    }
    by_name
        .into_iter()
        .map(|(name, reqs)| interface_log(name, &reqs, config, config_name))
        .collect()
}

fn space(
    name: &str,
    requests: &[&Joined],
    config: &equiroute_gateway::config::GatewayConfig,
    config_name: &str,
) -> Space {
    let logged_dim = requests
        .iter()
        .find_map(|j| j.request.features.as_ref().map(Vec::len));
    if let Some(iface) = config.interfaces.iter().find(|i| i.name == name) {
        return Space {
            candidates: iface
                .providers
                .iter()
                .map(|p| p.candidate.clone())
                .collect(),
            from: CandidatesFrom::Config(config_name.to_owned()),
            policy: Some(iface.policy.clone()),
            feature_dim: logged_dim.unwrap_or(iface.feature_dim),
        };
    }
    // The newest record's list: the gateway's last configuration.
    let ids = requests
        .iter()
        .max_by(|a, b| a.request.ts_ms.total_cmp(&b.request.ts_ms))
        .map(|j| j.request.candidates.clone())
        .unwrap_or_default();
    Space {
        candidates: ids.iter().map(|id| Candidate::new(id, id, "")).collect(),
        from: CandidatesFrom::Log,
        policy: None,
        feature_dim: logged_dim.unwrap_or(64),
    }
}

fn interface_log(
    name: &str,
    requests: &[&Joined],
    config: &equiroute_gateway::config::GatewayConfig,
    config_name: &str,
) -> InterfaceLog {
    let space = space(name, requests, config, config_name);
    let mut out = InterfaceLog {
        name: name.to_owned(),
        decisions: Vec::new(),
        events: Vec::new(),
        logging_policies: Vec::new(),
        features: BTreeMap::new(),
        unknown_provider: 0,
        no_propensity: 0,
        space,
    };
    for j in requests {
        let r = &j.request;
        if !out.logging_policies.contains(&r.policy) {
            out.logging_policies.push(r.policy.clone());
        }
        *out.features.entry(r.features_kept().as_str()).or_default() += 1;
        let Some(d) = decision(j, &out.space) else {
            out.unknown_provider += 1;
            continue;
        };
        if d.propensity.is_none() {
            out.no_propensity += 1;
        }
        out.decisions.push(d);
    }
    out.events = events(&out.decisions);
    out
}

/// A request in the index space of `space`; `None` when it names a provider `space` lacks.
fn decision(j: &Joined, space: &Space) -> Option<Decision> {
    let r = &j.request;
    let mut eligible: Vec<usize> = r
        .eligible()
        .iter()
        .map(|id| space.index(id))
        .collect::<Option<_>>()?;
    eligible.sort_unstable();
    eligible.dedup();
    let action = space.index(r.order.first()?)?;
    if !eligible.contains(&action) {
        eligible.push(action);
        eligible.sort_unstable();
    }
    let decided = r.decided_ms();
    let attempts = r
        .attempts
        .iter()
        .map(|a| Some((space.index(&a.provider)?, a.outcome(), a.started(decided))))
        .collect::<Option<Vec<_>>>()?;
    let known = match r.propensity_kind.as_deref() {
        Some("exact") => Known::Exact,
        Some("estimated") => Known::Estimated,
        Some(_) => Known::Deterministic,
        // Logs written before the kind: 1 is a deterministic policy's, anything else exact.
        None if r.propensity == Some(1.0) => Known::Deterministic,
        None => Known::Exact,
    };
    Some(Decision {
        decided,
        eligible,
        action,
        propensity: r.propensity.filter(|p| *p > 0.0).map(|p| (p, known)),
        features: r.features.clone(),
        slice: r.slice.unwrap_or_default(),
        tokens: r.tokens.unwrap_or_default(),
        deadline: r.deadline_ms.map(Millis),
        attempts,
        answered_by: r.answered_by().and_then(|id| space.index(id)),
        latency: r.latency_ms,
        quality: j.quality.zip(j.feedback_ms),
        miss: r.deadline_miss(),
        bad: r.bad(),
        cost: r.cost_usd,
    })
}

/// Decisions, attempts (at their end) and scores, in time order; a decision before its own
/// attempts.
fn events(decisions: &[Decision]) -> Vec<Event> {
    let mut timed: Vec<(f64, u8, Event)> = Vec::new();
    for (i, d) in decisions.iter().enumerate() {
        timed.push((d.decided, 0, Event::Decide(i)));
        for (k, (_, outcome, started)) in d.attempts.iter().enumerate() {
            let end = (started + outcome.latency.0).max(d.decided);
            timed.push((end, 1, Event::Attempt(i, k)));
        }
        if let (Some((_, at)), Some(_)) = (d.quality, d.answered_by) {
            timed.push((at, 2, Event::Feedback(i)));
        }
    }
    timed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    timed.into_iter().map(|(_, _, e)| e).collect()
}

/// The target's first-choice probabilities at each decision, learning from the log as the
/// gateway's policy did ([`Learning::All`]), or only from the requests where the log made the
/// choice it would have made ([`Learning::Own`]: rejection sampling with the log's smallest
/// propensity as the constant bound, [`ope::learns_as_own`], so the kept requests are a
/// sample of the target's own traffic, contexts included), or from a uniformly random sample
/// of the same expected size ([`Learning::Sample`], the same coin). A request without a
/// usable propensity is not learnt from by the samples.
fn replay(
    policy: &mut dyn Policy,
    log: &InterfaceLog,
    draws: u32,
    seed: u64,
    learning: Learning,
) -> Vec<Vec<f64>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // The coin of rejection sampling, apart from the target's own draws.
    let mut coin = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_c017);
    let mut learnt = vec![learning == Learning::All; log.decisions.len()];
    let bound = ope::rejection_bound(
        log.decisions
            .iter()
            .filter_map(|d| d.propensity.map(|(q, _)| q)),
    );
    let zeros = vec![0.0; log.space.feature_dim];
    let features = |d: &Decision| d.features.clone().unwrap_or_else(|| zeros.clone());
    let mut targets = vec![Vec::new(); log.decisions.len()];
    for event in &log.events {
        match *event {
            Event::Decide(i) => {
                let d = &log.decisions[i];
                let x = features(d);
                let mut ctx = RankContext::new(&log.space.candidates, &d.eligible, &x);
                ctx.deadline = d.deadline;
                ctx.slice = d.slice;
                ctx.tokens = d.tokens;
                ctx.now = Timestamp(d.decided);
                targets[i] = policy
                    .first_choice_distribution(&ctx, &mut rng, draws)
                    .probabilities;
                let p = targets[i].get(d.action).copied().unwrap_or(0.0);
                match learning {
                    Learning::All => {}
                    Learning::Own => {
                        learnt[i] = d.propensity.is_some_and(|(q, _)| {
                            ope::learns_as_own(p, q, bound, coin.random::<f64>())
                        });
                    }
                    Learning::Sample => {
                        learnt[i] = d
                            .propensity
                            .is_some_and(|_| ope::learns_as_sample(bound, coin.random::<f64>()));
                    }
                }
                // The decision itself, for policies whose state moves with it (round-robin).
                let _ = policy.rank(&ctx, &mut rng);
            }
            Event::Attempt(i, _) | Event::Feedback(i) if !learnt[i] => {}
            Event::Attempt(i, k) => {
                let d = &log.decisions[i];
                let (candidate, outcome, started) = d.attempts[k];
                let x = features(d);
                // The gateway passes the time left on the deadline when the attempt began.
                let left = d
                    .deadline
                    .map(|dl| Millis((dl.0 - (started - d.decided)).max(0.0)));
                policy.observe_attempt(&AttemptObservation {
                    candidate,
                    features: &x,
                    slice: d.slice,
                    deadline: left,
                    outcome: &outcome,
                    now: Timestamp(started + outcome.latency.0),
                });
            }
            Event::Feedback(i) => {
                let d = &log.decisions[i];
                let (Some((quality, at)), Some(candidate)) = (d.quality, d.answered_by) else {
                    continue;
                };
                // The gateway keeps a pending request's features in single precision.
                let x: Vec<f64> = features(d).iter().map(|&v| f64::from(v as f32)).collect();
                policy.observe_quality(&QualityObservation {
                    candidate,
                    features: &x,
                    quality,
                    latency: Millis(d.latency),
                    now: Timestamp(at),
                });
            }
        }
    }
    targets
}

/// What the logging policy's log supports, said once per interface.
fn propensity_summary(log: &InterfaceLog) -> (&'static str, bool) {
    let kinds: Vec<Known> = log
        .decisions
        .iter()
        .filter_map(|d| d.propensity.map(|(_, k)| k))
        .collect();
    let all = |k: Known| !kinds.is_empty() && kinds.iter().all(|x| *x == k);
    if kinds.is_empty() {
        ("none reported", false)
    } else if all(Known::Deterministic) {
        ("deterministic", true)
    } else if all(Known::Exact) {
        ("exact", false)
    } else if all(Known::Estimated) {
        ("estimated", false)
    } else {
        ("mixed", kinds.contains(&Known::Deterministic))
    }
}

/// The on-policy mean of `metric` with a normal 95% interval.
fn on_policy(log: &InterfaceLog, metric: Metric) -> Value {
    let xs: Vec<f64> = log
        .decisions
        .iter()
        .filter_map(|d| metric.value(d))
        .collect();
    if xs.is_empty() {
        return json!({"n": 0});
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    let half = 1.96 * (var / n).sqrt();
    json!({"value": mean, "ci_low": mean - half, "ci_high": mean + half, "n": xs.len(), "effective_sample_size": n})
}

/// A warning in words, with provider ids instead of indices.
fn warning_text(w: &SupportWarning, space: &Space) -> String {
    w.describe(|c| {
        space
            .candidates
            .get(c)
            .map_or_else(|| format!("candidate {c}"), |p| format!("`{}`", p.id.0))
    })
}

/// One interface's report, as JSON (the table is printed from it).
fn evaluate_interface(log: &InterfaceLog, targets: &[Target], args: &Args) -> Value {
    let with_quality = log.decisions.iter().filter(|d| d.quality.is_some()).count();
    let (propensities, deterministic) = propensity_summary(log);
    let mut warnings: Vec<String> = Vec::new();
    if deterministic {
        warnings.push(format!(
            "the logging policy ({}) is deterministic: its log only shows what happens where another policy makes the same choice, so estimates are valid only for policies that agree with it; log with an exploration floor (min_propensity) or a stochastic policy to evaluate others",
            log.logging_policies.join(", ")
        ));
    }
    if log.unknown_provider > 0 {
        warnings.push(format!(
            "{} request(s) name a provider that {} does not have in `{}`: skipped (give --config the configuration the gateway ran with)",
            log.unknown_provider,
            match &log.space.from {
                CandidatesFrom::Config(name) => name.as_str(),
                CandidatesFrom::Log => "the log",
            },
            log.name
        ));
    }
    if log.no_propensity > 0 {
        warnings.push(format!(
            "{} of {} request(s) have no usable propensity (the logging policy did not report one, or an estimate of 0): they cannot be reweighted and are left out of the estimates (lqm-ts and ts-deadline report one with propensity_samples > 0)",
            log.no_propensity,
            log.decisions.len()
        ));
    }
    if let CandidatesFrom::Log = log.space.from {
        warnings.push(format!(
            "the configuration has no interface `{}`: candidates are the log's ids, with unknown prices (give --config the gateway's configuration for cost-aware policies)",
            log.name
        ));
    }
    let missing_features = log
        .decisions
        .iter()
        .filter(|d| d.features.is_none())
        .count();
    let logging = json!({
        "policy": log.logging_policies.join(","),
        "propensities": propensities,
        "on_policy": Metric::ALL.iter().map(|m| (m.key().to_owned(), on_policy(log, *m))).collect::<serde_json::Map<_, _>>(),
    });
    let usable: Vec<usize> = (0..log.decisions.len())
        .filter(|&i| log.decisions[i].propensity.is_some())
        .collect();
    let policies: Vec<Value> = targets
        .iter()
        .enumerate()
        .map(|(n, t)| {
            evaluate_target(
                log,
                t,
                &usable,
                missing_features,
                args,
                args.seed.wrapping_add(n as u64),
            )
        })
        .collect();
    json!({
        "interface": log.name,
        "requests": log.decisions.len() + log.unknown_provider,
        "with_quality": with_quality,
        "features": log.features,
        "candidates": log.space.candidates.iter().map(|c| c.id.0.clone()).collect::<Vec<_>>(),
        "candidates_from": log.space.from.describe(),
        "logging": logging,
        "warnings": warnings,
        "policies": policies,
    })
}

fn evaluate_target(
    log: &InterfaceLog,
    target: &Target,
    usable: &[usize],
    missing_features: usize,
    args: &Args,
    seed: u64,
) -> Value {
    let name = target.kind.as_str();
    let refused = |why: String| json!({"policy": name, "refused": why});
    if reads_features(target.kind) && missing_features > 0 {
        return refused(format!(
            "`{name}` reads each request's features, and {missing_features} of {} logged request(s) have none (written with [audit] features = \"hash\" or \"none\"): only context-free policies ({}) can be evaluated from this log; set features = \"full\" to evaluate contextual ones",
            log.decisions.len(),
            context_free_names()
        ));
    }
    if usable.is_empty() {
        return refused(
            "no logged request has a usable propensity: nothing can be reweighted (log with a policy that reports its propensities, or an exploration floor)".into(),
        );
    }
    let opts = OpeOptions {
        seed,
        learning_check: args.learning_check.into(),
        ..OpeOptions::default()
    };
    // Replayed learning from every request (the estimate), then only from a sample drawn as
    // its own traffic would be, and from a random sample of the same size: a policy that
    // learns may score otherwise ([`ope::with_learning_replays`]).
    let mut learnings = vec![Learning::All, Learning::Own];
    if opts.learning_check == ope::LearningCheck::OwnVsSample {
        learnings.push(Learning::Sample);
    }
    let mut replays = Vec::with_capacity(learnings.len());
    for learning in learnings {
        let built = target.config(log.space.policy.as_ref()).and_then(|cfg| {
            cfg.build(&log.space.candidates, log.space.feature_dim)
                .map_err(|e| anyhow::anyhow!("{e}"))
        });
        match built {
            Ok(mut p) => replays.push(replay(p.as_mut(), log, args.draws, seed, learning)),
            Err(e) => {
                return refused(format!(
                    "cannot be built for interface `{}`: {e:#}",
                    log.name
                ))
            }
        }
    }
    let (distributions, own_distributions, sample_distributions) =
        (&replays[0], &replays[1], replays.get(2));
    // Contextual reward models for DR only when every record has its features.
    let with_features = missing_features == 0;
    let mut warnings: Vec<String> = Vec::new();
    let mut estimates = Vec::new();
    for estimator in args.estimator.estimators() {
        let mut metrics = serde_json::Map::new();
        for metric in Metric::ALL {
            let records =
                |targets: &[Vec<f64>]| records(log, usable, with_features, metric, targets);
            let (all, own) = (records(distributions), records(own_distributions));
            let evaluated = ope::evaluate(&all, estimator, &opts).and_then(|e| {
                let o = ope::evaluate(&own, estimator, &opts)?;
                let s = sample_distributions
                    .map(|d| ope::evaluate(&records(d), estimator, &opts))
                    .transpose()?;
                Ok(ope::with_learning_replays(e, &o, s.as_ref(), &opts))
            });
            let value = match evaluated {
                Ok(e) => {
                    for w in &e.warnings {
                        // Said once for the interface.
                        if *w == SupportWarning::DeterministicLogger {
                            continue;
                        }
                        let mut text = warning_text(w, &log.space);
                        if matches!(w, SupportWarning::LearningDependent { .. }) {
                            text = format!("{} ({estimator}): {text}", metric.key());
                        }
                        let text = if metric == Metric::Quality && e.n < usable.len() {
                            format!("quality (the {} request(s) with a score): {text}", e.n)
                        } else {
                            text
                        };
                        if !warnings.contains(&text) {
                            warnings.push(text);
                        }
                    }
                    estimate_json(&e)
                }
                Err(ope::OpeError::Empty) => json!({"n": 0}),
                Err(e) => json!({"n": all.len(), "error": e.to_string()}),
            };
            metrics.insert(metric.key().to_owned(), value);
        }
        estimates.push(json!({"estimator": estimator.as_str(), "metrics": metrics}));
    }
    json!({"policy": name, "estimates": estimates, "warnings": warnings})
}

/// The evaluator's records of one metric: the usable logged decisions with the target's
/// first-choice probabilities (`targets`, indexed like the log's decisions).
fn records(
    log: &InterfaceLog,
    usable: &[usize],
    with_features: bool,
    metric: Metric,
    targets: &[Vec<f64>],
) -> Vec<LoggedDecision> {
    usable
        .iter()
        .filter_map(|&i| {
            let d = &log.decisions[i];
            let (propensity, known) = d.propensity?;
            Some(LoggedDecision {
                features: if with_features {
                    d.features.clone().unwrap_or_default()
                } else {
                    Vec::new()
                },
                eligible: d.eligible.clone(),
                action: d.action,
                propensity,
                propensity_exact: known != Known::Deterministic,
                target: targets[i].clone(),
                outcome: metric.value(d)?,
            })
        })
        .collect()
}

fn estimate_json(e: &Estimate) -> Value {
    json!({
        "value": e.value,
        "ci_low": e.ci_low,
        "ci_high": e.ci_high,
        "effective_sample_size": e.effective_sample_size,
        "n": e.n,
    })
}

/// A number with three significant digits; scientific below 0.001 (costs are often 1e-5 USD).
fn num(x: f64) -> String {
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
fn cell(v: &Value) -> String {
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
fn table(report: &Value) -> String {
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
