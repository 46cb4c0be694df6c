//! `equiroute bench`: policies side by side in simulated scenarios, over seeds, as a table,
//! JSON or CSV, with SVG plots in `--out` (per scenario; and per policy with a deadline-miss
//! estimate, `reliability-POLICY.svg` over every scenario of the run).

use anyhow::{bail, Context};
use equiroute_lab::report::{plot, ScenarioReport, CSV_HEADER};
use equiroute_lab::runner::{run as run_one, RunResult};
use equiroute_lab::scenario::{all_builtin, builtin, ScenarioSpec};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Output formats.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
    Csv,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A built-in scenario, or `all` (see `equiroute scenarios`).
    #[arg(long, default_value = "all")]
    scenario: String,
    /// A scenario file (TOML); may be repeated. Replaces `--scenario` when given.
    #[arg(long = "scenario-file")]
    scenario_files: Vec<PathBuf>,
    /// Policies to compare, comma-separated (default: the scenario's list).
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// Number of seeds (FIRST..FIRST+N−1).
    #[arg(long, default_value_t = 5)]
    seeds: u64,
    /// The first seed: a different range of seeds checks a result on runs it was not chosen on.
    #[arg(long, default_value_t = 1)]
    first_seed: u64,
    /// Rounds per run (default: the scenario's).
    #[arg(long)]
    rounds: Option<usize>,
    /// Directory for results.json, results.csv, table.txt and the SVG plots.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Parallel workers (default: the machine's cores).
    #[arg(long)]
    jobs: Option<usize>,
    /// Change one parameter of a named policy in every scenario of the run, e.g.
    /// `--set lqm-ts.latency=renewal` or `--set lqm-ts.lqm.alpha_ucb=0.3` (a dotted path into
    /// the policy's configuration, as `equiroute policies NAME` lists it; the value is read as JSON, else as a string). May repeat.
    /// `--set lqm-ts.min_propensity=0.01` wraps the policy in an exploration floor.
    #[arg(long = "set", value_name = "POLICY.FIELD=VALUE")]
    sets: Vec<String>,
}

/// Applies `--set POLICY.FIELD=VALUE` to `spec`: the named policy becomes a variant with the
/// same label and the changed configuration.
fn apply_set(spec: &mut ScenarioSpec, set: &str) -> anyhow::Result<()> {
    let fix = "write POLICY.FIELD=VALUE, e.g. lqm-ts.latency=renewal";
    let (path, value) = set
        .split_once('=')
        .with_context(|| format!("--set `{set}`: {fix}"))?;
    let mut parts = path.split('.');
    let policy = parts.next().unwrap_or_default();
    let fields: Vec<&str> = parts.collect();
    if policy.is_empty() || fields.is_empty() {
        bail!("--set `{set}`: {fix}");
    }
    // The exploration floor wraps any policy: it is the variant's, not the policy's.
    let floor = if fields == ["min_propensity"] {
        let v: f64 = value.parse().with_context(|| {
            format!("--set `{set}`: min_propensity is a number in [0, 0.5], e.g. 0.01")
        })?;
        equiroute_core::policies::ExplorationFloorConfig::new(v)
            .validate()
            .map_err(|e| anyhow::anyhow!("--set `{set}`: {e}"))?;
        Some(v)
    } else {
        None
    };
    let cfg = spec.policy(policy).with_context(|| {
        format!(
            "--set `{set}`: `{policy}` is not a policy of scenario {}",
            spec.name
        )
    })?;
    let min_propensity = floor.unwrap_or_else(|| spec.floor(policy).min_propensity);
    if floor.is_some() {
        spec.variants.retain(|v| v.label != policy);
        spec.variants.push(equiroute_lab::scenario::Variant {
            label: policy.to_owned(),
            policy: cfg,
            min_propensity,
            own_l_ref: true,
        });
        return Ok(());
    }
    let mut json = serde_json::to_value(&cfg)?;
    let parsed: serde_json::Value =
        serde_json::from_str(value).unwrap_or_else(|_| serde_json::Value::String(value.to_owned()));
    let mut node = &mut json;
    for (n, f) in fields.iter().enumerate() {
        let Some(obj) = node.as_object_mut() else {
            bail!(
                "--set `{set}`: `{}` is not a table of `{policy}`",
                fields[..n].join(".")
            );
        };
        node = obj
            .entry((*f).to_owned())
            .or_insert(serde_json::Value::Null);
    }
    *node = parsed;
    let patched: equiroute_core::policies::PolicyConfig =
        serde_json::from_value(json).map_err(|e| {
            anyhow::anyhow!("--set `{set}`: {e} (`equiroute policies POLICY` lists its fields)")
        })?;
    spec.variants.retain(|v| v.label != policy);
    spec.variants.push(equiroute_lab::scenario::Variant {
        label: policy.to_owned(),
        policy: patched,
        min_propensity,
        own_l_ref: true,
    });
    Ok(())
}

struct Job {
    scenario: usize,
    policy: String,
    seed: u64,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    if args.seeds == 0 {
        bail!("--seeds must be at least 1");
    }
    let Some(last_seed) = args.first_seed.checked_add(args.seeds - 1) else {
        bail!("--first-seed plus --seeds passes the largest seed; use a smaller --first-seed");
    };
    if args.rounds == Some(0) {
        bail!("--rounds must be at least 1");
    }
    let mut specs = load_scenarios(args)?;
    for set in &args.sets {
        for spec in &mut specs {
            apply_set(spec, set)?;
        }
        eprintln!("bench: --set {set} (reports keep the policy's name)");
    }
    let mut plans: Vec<(ScenarioSpec, Vec<String>, usize)> = Vec::new();
    for spec in specs {
        let policies = if args.policies.is_empty() {
            spec.policies.clone()
        } else {
            args.policies.clone()
        };
        for p in &policies {
            spec.policy(p).with_context(|| {
                format!("--policies: `{p}` in scenario {}: use a policy from `equiroute policies` or a variant label of the scenario", spec.name)
            })?;
            if let Some(fix) = spec.assumption(p) {
                bail!("--policies: scenario {}: {fix}", spec.name);
            }
        }
        let rounds = args.rounds.unwrap_or(spec.rounds);
        plans.push((spec, policies, rounds));
    }
    let jobs: Vec<Job> = plans
        .iter()
        .enumerate()
        .flat_map(|(s, (_, policies, _))| {
            policies.iter().flat_map(move |p| {
                (args.first_seed..=last_seed).map(move |seed| Job {
                    scenario: s,
                    policy: p.clone(),
                    seed,
                })
            })
        })
        .collect();
    let workers = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, std::num::NonZero::get))
        .max(1);
    let started = Instant::now();
    let results = execute(&plans, &jobs, workers)?;
    let reports: Vec<ScenarioReport> = plans
        .iter()
        .enumerate()
        .map(|(s, (spec, policies, _))| {
            let runs: Vec<RunResult> = results
                .iter()
                .filter(|(i, _)| *i == s)
                .map(|(_, r)| r.clone())
                .collect();
            let providers = spec.providers.iter().map(|p| p.id.clone()).collect();
            ScenarioReport::new(&spec.name, providers, policies, &runs)
        })
        .collect();
    write_outputs(args, &reports)?;
    match args.format {
        Format::Table => {
            for r in &reports {
                print!("{}", r.table());
            }
            println!(
                "\n{} runs in {:.1} s on {workers} workers; results, plots and table in {}",
                jobs.len(),
                started.elapsed().as_secs_f64(),
                args.out.display()
            );
        }
        Format::Json => println!("{}", json(&reports)?),
        Format::Csv => {
            println!("{CSV_HEADER}");
            for r in &reports {
                print!("{}", r.csv_rows());
            }
        }
    }
    Ok(())
}

fn load_scenarios(args: &Args) -> anyhow::Result<Vec<ScenarioSpec>> {
    if !args.scenario_files.is_empty() {
        return args
            .scenario_files
            .iter()
            .map(|path| {
                let text = std::fs::read_to_string(path).with_context(|| {
                    format!("--scenario-file {}: cannot read it", path.display())
                })?;
                Ok(ScenarioSpec::from_toml(&text, &path.display().to_string())?)
            })
            .collect();
    }
    if args.scenario == "all" {
        Ok(all_builtin()?)
    } else {
        Ok(vec![builtin(&args.scenario)?])
    }
}

/// Runs every job on `workers` threads, with a progress bar on a terminal and a plain line
/// every 10% otherwise.
fn execute(
    plans: &[(ScenarioSpec, Vec<String>, usize)],
    jobs: &[Job],
    workers: usize,
) -> anyhow::Result<Vec<(usize, RunResult)>> {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let results = Mutex::new(Vec::with_capacity(jobs.len()));
    let failure: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(jobs.len() as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {pos}/{len} runs  {elapsed} elapsed, ~{eta} left  {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..workers.min(jobs.len()).max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let (spec, _, rounds) = &plans[job.scenario];
                match run_one(spec, &job.policy, job.seed, *rounds) {
                    Ok(r) => {
                        if let Ok(mut v) = results.lock() {
                            v.push((job.scenario, r));
                        }
                    }
                    Err(e) => {
                        if let Ok(mut f) = failure.lock() {
                            f.get_or_insert(e.into());
                        }
                        break;
                    }
                }
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(b) = &bar {
                    b.set_message(format!("{} / {}", spec.name, job.policy));
                    b.inc(1);
                } else if tenth_passed(n, jobs.len()) {
                    eprintln!(
                        "bench: {n}/{} runs done in {:.1} s",
                        jobs.len(),
                        started.elapsed().as_secs_f64()
                    );
                }
            });
        }
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(e) = failure.into_inner().ok().flatten() {
        return Err(e);
    }
    let mut results = results
        .into_inner()
        .map_err(|_| anyhow::anyhow!("a bench worker panicked"))?;
    results.sort_by(|a, b| (a.0, &a.1.policy, a.1.seed).cmp(&(b.0, &b.1.policy, b.1.seed)));
    Ok(results)
}

/// Whether the `n`th of `total` steps (from 1) passes a tenth of them: when a progress line is
/// due.
fn tenth_passed(n: usize, total: usize) -> bool {
    n * 10 / total > (n - 1) * 10 / total
}

fn json(reports: &[ScenarioReport]) -> anyhow::Result<String> {
    Ok(if reports.len() == 1 {
        serde_json::to_string_pretty(&reports[0])?
    } else {
        serde_json::to_string_pretty(reports)?
    })
}

fn write_outputs(args: &Args, reports: &[ScenarioReport]) -> anyhow::Result<()> {
    let out = &args.out;
    std::fs::create_dir_all(out)
        .with_context(|| format!("--out {}: cannot create it", out.display()))?;
    let write = |name: &str, bytes: &[u8]| {
        let path = out.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("cannot write {}", path.display()))
    };
    // Every plot as SVG and as PNG.
    let save_plot = |name: &str, svg: &str| -> anyhow::Result<()> {
        write(&format!("{name}.svg"), svg.as_bytes())?;
        write(&format!("{name}.png"), &crate::png::render(svg)?)
    };
    write("results.json", json(reports)?.as_bytes())?;
    let mut csv = format!("{CSV_HEADER}\n");
    let mut table = String::new();
    // Rendering the PNGs takes about as long as the runs on a small machine: say so.
    let started = Instant::now();
    eprintln!(
        "bench: writing the plots of {} scenario(s) to {}",
        reports.len(),
        out.display()
    );
    for (i, r) in reports.iter().enumerate() {
        csv.push_str(&r.csv_rows());
        table.push_str(&r.table());
        save_plot(&format!("{}-frontier", r.scenario), &plot::frontier(r))?;
        save_plot(
            &format!("{}-regret", r.scenario),
            &plot::regret_over_time(r),
        )?;
        for policy in &r.order {
            if let Some(svg) = plot::share_over_time(r, policy) {
                save_plot(&format!("{}-share-{policy}", r.scenario), &svg)?;
            }
        }
        if tenth_passed(i + 1, reports.len()) {
            eprintln!(
                "bench: plots of {}/{} scenarios written in {:.1} s",
                i + 1,
                reports.len(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    // A reliability diagram per policy that estimates deadline misses, a line per scenario.
    let mut calibrated: Vec<&String> = Vec::new();
    for r in reports {
        for (name, p) in r.ordered() {
            if p.calibration.is_some() && !calibrated.contains(&name) {
                calibrated.push(name);
            }
        }
    }
    for policy in calibrated {
        if let Some(svg) = plot::reliability(reports, policy) {
            save_plot(&format!("reliability-{policy}"), &svg)?;
        }
    }
    write("results.csv", csv.as_bytes())?;
    write("table.txt", table.as_bytes())?;
    Ok(())
}
