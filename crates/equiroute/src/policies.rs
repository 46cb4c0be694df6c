//! `equiroute policies`: the policy names accepted in configuration.

use equiroute_core::policies::PolicyKind;

pub fn run() {
    for kind in PolicyKind::ALL {
        println!("{:<18} {}", kind.as_str(), kind.summary());
    }
}
