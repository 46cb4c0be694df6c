//! `equiroute check-config PATH`: validates a gateway configuration and says what is wrong,
//! with the field path and the fix; secrets are looked up but never printed.

use anyhow::Context;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The configuration file (TOML).
    path: PathBuf,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.path)
        .with_context(|| format!("cannot read {}", args.path.display()))?;
    let file = args.path.display().to_string();
    let env = |name: &str| std::env::var(name).ok();
    let cfg = match equiroute_gateway::config::load_all(&text, &file, &env) {
        Ok(cfg) => cfg,
        Err(problems) => {
            for p in &problems {
                eprintln!("{p}");
            }
            anyhow::bail!("{file}: {} problem(s)", problems.len());
        }
    };
    println!("{}: ok, listening on {}", args.path.display(), cfg.listen);
    for i in &cfg.interfaces {
        let ids: Vec<&str> = i
            .providers
            .iter()
            .map(|p| p.candidate.id.0.as_str())
            .collect();
        println!(
            "  {} ({:?}, policy {}, deadline {}): {}",
            i.name,
            i.kind,
            i.policy.kind(),
            i.deadline
                .map_or("none".to_owned(), |d| format!("{} ms", d.0)),
            ids.join(", ")
        );
    }
    for w in &cfg.warnings {
        println!("warning: {w}");
    }
    Ok(())
}
