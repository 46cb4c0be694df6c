//! `equiroute scenarios`: the built-in scenarios, one line each.

use equiroute_lab::scenario::all_builtin;

pub fn run() -> anyhow::Result<()> {
    for s in all_builtin()? {
        let first = s.description.split(". ").next().unwrap_or(&s.description);
        println!("{:<22} {}", s.name, first.trim_end_matches('.'));
    }
    Ok(())
}
