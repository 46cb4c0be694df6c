"""Generate reference fixtures for equiroute-core's numeric tests.

Run by hand, not by CI:

    python3 -m venv .venv && .venv/bin/pip install numpy scipy && .venv/bin/python scripts/gen_fixtures.py

It writes crates/equiroute-core/tests/fixtures/*.json (nig.json,
lognormal_tail.json, linucb.json). All randomness comes from fixed seeds, so
rerunning produces identical files.

The values here are deliberately computed the *direct* way (batch numpy sums,
explicit matrix inverses, scipy's survival function) rather than with the
incremental / rank-one-update formulas the Rust code uses, so the fixtures are
an independent check of that code rather than a transcription of it.
"""

import json
import math
from collections import deque
from pathlib import Path

import numpy as np
from scipy.stats import norm

FIXTURE_DIR = (
    Path(__file__).resolve().parent.parent
    / "crates"
    / "equiroute-core"
    / "tests"
    / "fixtures"
)


def write_json(name, obj):
    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    path = FIXTURE_DIR / name
    # json's float repr is the shortest string that round-trips, so no
    # precision is lost; a trailing newline keeps diffs and editors happy.
    with path.open("w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


def floats(a):
    """numpy array/scalar -> plain Python floats, so json can serialise it."""
    return np.asarray(a, dtype=float).tolist()


# ---------------------------------------------------------------------------
# File 1: Normal-Inverse-Gamma posterior over ln(latency)
# ---------------------------------------------------------------------------


def nig_expected(prior, latencies):
    y = np.log(np.asarray(latencies, dtype=float))
    n = len(y)
    if n == 0:
        # np.mean([]) is NaN; the Rust side defines the empty summary as zeros
        # and the posterior as the prior itself.
        mean_log, dev = 0.0, 0.0
    else:
        # Two-pass batch computation on purpose (the Rust code is incremental).
        mean_log = float(np.mean(y))
        dev = float(np.sum((y - mean_log) ** 2))

        # Guard against numpy's pairwise summation being the weak link: an
        # exactly-rounded sum must agree far below the 1e-9 test tolerance.
        exact_mean = math.fsum(y.tolist()) / n
        exact_dev = math.fsum(((y - exact_mean) ** 2).tolist())
        assert abs(exact_mean - mean_log) <= 1e-13 * max(1.0, abs(mean_log))
        assert abs(exact_dev - dev) <= 1e-12 * max(1.0, dev)

    mu0, k0, a0, b0 = prior["mu0"], prior["kappa0"], prior["alpha0"], prior["beta0"]
    kn = k0 + n
    return {
        "n": n,
        "mean_log": mean_log,
        "deviation_sum": dev,
        "kappa_n": kn,
        "mu_n": (k0 * mu0 + n * mean_log) / kn,
        "alpha_n": a0 + n / 2,
        "beta_n": b0 + 0.5 * dev + k0 * n * (mean_log - mu0) ** 2 / (2 * kn),
    }


def lognormal_latencies(seed, median_ms, sigma, size):
    rng = np.random.default_rng(seed)
    lat = rng.lognormal(mean=math.log(median_ms), sigma=sigma, size=size)
    # Microsecond resolution is what a real timer gives and roughly halves the
    # file size versus 17-digit floats. Expected values are computed from the
    # rounded numbers, so nothing is lost.
    return np.round(lat, 3).tolist()


def prior(mu0, kappa0, alpha0, beta0):
    return {"mu0": mu0, "kappa0": kappa0, "alpha0": alpha0, "beta0": beta0}


def gen_nig():
    default_prior = prior(math.log(500.0), 1.0, 2.0, 1.0)
    weak_prior = prior(math.log(500.0), 0.5, 1.5, 0.3)
    # A prior centred far from the data makes the kappa0*n*(mean-mu0)^2 term
    # dominate beta_n, so a sign/factor bug there cannot hide.
    far_prior = prior(math.log(100.0), 2.0, 3.0, 2.5)

    specs = [
        ("single_latency", default_prior, [250.0]),
        ("five_hand_picked", default_prior, [120.0, 85.5, 310.0, 97.25, 1500.0]),
        ("lognormal_n50_median76_sigma0.9", default_prior,
         lognormal_latencies(101, 76.0, 0.9, 50)),
        ("lognormal_n1000_median316_sigma0.2", weak_prior,
         lognormal_latencies(102, 316.0, 0.2, 1000)),
        ("lognormal_n20000_median2500_sigma0.5", far_prior,
         lognormal_latencies(103, 2500.0, 0.5, 20000)),
        ("prior_only", weak_prior, []),
    ]
    cases = []
    for name, p, lat in specs:
        assert all(v > 0 for v in lat)
        cases.append({
            "name": name,
            "prior": p,
            "latencies_ms": lat,
            "expected": nig_expected(p, lat),
        })
    write_json("nig.json", {"cases": cases})
    return cases


# ---------------------------------------------------------------------------
# File 2: log-normal deadline-miss probability
# ---------------------------------------------------------------------------


def p_exceed(mu, sigma, deadline_ms):
    # sf rather than 1 - cdf: keeps full relative precision deep in the upper
    # tail, where 1 - cdf would cancel to 0.
    return float(norm.sf((np.log(deadline_ms) - mu) / sigma))


def gen_tail():
    cases = []
    for median in (50.0, 300.0, 2500.0, 6000.0):
        mu = math.log(median)
        for sigma in (0.05, 0.3, 1.0, 2.0):
            for d in (100.0, 1000.0, 6000.0, 30000.0):
                cases.append({"mu": mu, "sigma": sigma, "deadline_ms": d,
                              "p_exceed": p_exceed(mu, sigma, d)})

    # Extremes: place the deadline so the standardised z is +-isf(1e-12), i.e.
    # p_exceed ~ 1e-12 and ~ 1 - 1e-12. These catch implementations that lose
    # the tail (erfc vs 1 - erf) or clamp too early.
    z_tail = float(norm.isf(1e-12))
    for median, sigma, sign in ((300.0, 0.3, +1), (80.0, 1.2, +1),
                                (300.0, 0.3, -1), (2500.0, 0.8, -1)):
        mu = math.log(median)
        d = float(math.exp(mu + sign * z_tail * sigma))
        cases.append({"mu": mu, "sigma": sigma, "deadline_ms": d,
                      "p_exceed": p_exceed(mu, sigma, d)})
    # Deadline equal to the median: exactly one half.
    cases.append({"mu": math.log(400.0), "sigma": 0.7, "deadline_ms": 400.0,
                  "p_exceed": p_exceed(math.log(400.0), 0.7, 400.0)})

    # Posterior-mean variance of the NIG: E[sigma^2] = beta / (alpha - 1),
    # defined only for alpha > 1. kappa and mu_n are carried so the Rust test
    # can build a full posterior, but they do not enter this quantity.
    ig_cases = []
    for alpha, beta, kappa, mu_n in ((2.0, 1.0, 1.0, math.log(500.0)),
                                     (1.5, 0.3, 0.5, math.log(300.0)),
                                     (27.0, 4.2, 51.0, 4.1),
                                     (10002.0, 2500.75, 20002.0, 7.8)):
        ig_cases.append({"alpha": alpha, "beta": beta, "kappa": kappa,
                         "mu_n": mu_n, "mean_sigma2": beta / (alpha - 1.0)})

    write_json("lognormal_tail.json",
               {"cases": cases, "invgamma_normal_cases": ig_cases})
    return cases, ig_cases


# ---------------------------------------------------------------------------
# File 3: LinUCB / LQM-ContextRoute scores over a fixed stream
# ---------------------------------------------------------------------------

D, K = 6, 3
LAMBDA_R = 1.0
ALPHA_UCB = 0.7
WINDOW = 25
L_REF_MS = 400.0
EMA_BETA = 0.2
TAU0_MS = 400.0
SHRINK_LAMBDA = 1.0
N_STEPS = 200
CHECKPOINTS = (1, 2, 10, 25, 26, 60, 137, 200)

# Distinct true quality vectors so the arms' u_hat actually differ and delta
# (the shrinkage gap) is non-trivial.
TRUE_THETA = np.array([
    [0.6, 0.2, -0.1, 0.3, 0.0, 0.1],
    [0.2, 0.5, 0.3, -0.2, 0.4, 0.0],
    [-0.1, 0.1, 0.6, 0.2, 0.1, 0.5],
])
ARM_MEDIAN_MS = (80.0, 300.0, 1200.0)
ARM_LAT_SIGMA = 0.4
QUALITY_NOISE_SD = 0.1
QUALITY_BASELINE = 0.5


def unit_vector(rng):
    v = rng.standard_normal(D)
    return v / np.linalg.norm(v)


def arm_state(window):
    """Rebuild A and b from scratch from the window (no rank-one updates)."""
    a = LAMBDA_R * np.eye(D)
    b = np.zeros(D)
    for x, u in window:
        a += np.outer(x, x)
        b += u * x
    a_inv = np.linalg.inv(a)
    # A >= lambda_r * I, so it is well conditioned; make sure inv agrees.
    assert np.allclose(a @ a_inv, np.eye(D), atol=1e-12)
    return a, a_inv, b


def gen_linucb():
    rng = np.random.default_rng(20240607)
    # Probes are drawn first so they don't depend on the stream length.
    probes = [unit_vector(rng) for _ in range(3)]

    stream = []
    for _ in range(N_STEPS):
        arm = int(rng.integers(0, K))
        x = unit_vector(rng)
        # theta.x has mean zero for isotropic x, so without a baseline about
        # half of all u would clip to exactly 0 and b would carry little
        # signal. The offset keeps u mostly inside (0, 1), with occasional
        # clipping at both ends. The model has no intercept term; that is fine,
        # because the test checks arithmetic, not goodness of fit.
        u = float(np.clip(QUALITY_BASELINE + TRUE_THETA[arm] @ x
                          + rng.normal(0.0, QUALITY_NOISE_SD), 0.0, 1.0))
        lat = float(rng.lognormal(math.log(ARM_MEDIAN_MS[arm]), ARM_LAT_SIGMA))
        stream.append({"arm": arm, "x": x, "u": u, "latency_ms": lat})

    tau_hat = [TAU0_MS] * K
    windows = [deque() for _ in range(K)]
    checkpoints = []
    for step, obs in enumerate(stream, start=1):
        i = obs["arm"]
        # Latency EMA first, written in exactly this form so the Rust result
        # is bit-for-bit comparable in the common case.
        tau_hat[i] = (1.0 - EMA_BETA) * tau_hat[i] + EMA_BETA * obs["latency_ms"]
        windows[i].append((obs["x"], obs["u"]))
        if len(windows[i]) > WINDOW:
            windows[i].popleft()

        if step not in CHECKPOINTS:
            continue
        states = [arm_state(w) for w in windows]
        probe_out = []
        for p in probes:
            u_hat = np.array([p @ a_inv @ b for _, a_inv, b in states])
            # Cross-check the inverse-based estimate against a linear solve.
            for (a, _, b), uh in zip(states, u_hat):
                assert abs(p @ np.linalg.solve(a, b) - uh) < 1e-12
            width = np.array([ALPHA_UCB * math.sqrt(p @ a_inv @ p)
                              for _, a_inv, _ in states])
            delta = np.maximum(0.0, u_hat.max() - u_hat)
            score = (u_hat / (1.0 + np.array(tau_hat) / L_REF_MS)
                     + width / (1.0 + SHRINK_LAMBDA * delta))
            probe_out.append({"u_hat": floats(u_hat), "width": floats(width),
                              "delta": floats(delta), "score": floats(score)})
        checkpoints.append({
            "after_step": step,
            "arms": [{"tau_hat": float(tau_hat[k]),
                      "a_inv": floats(states[k][1].reshape(-1))}  # row-major
                     for k in range(K)],
            "probes": probe_out,
        })

    out = {
        "d": D, "k": K, "lambda_r": LAMBDA_R, "alpha_ucb": ALPHA_UCB,
        "window": WINDOW, "l_ref_ms": L_REF_MS, "ema_beta": EMA_BETA,
        "tau0_ms": TAU0_MS, "shrink_lambda": SHRINK_LAMBDA,
        "probes": [floats(p) for p in probes],
        "stream": [{"arm": s["arm"], "x": floats(s["x"]), "u": s["u"],
                    "latency_ms": s["latency_ms"]} for s in stream],
        "checkpoints": checkpoints,
    }
    write_json("linucb.json", out)
    return out


if __name__ == "__main__":
    gen_nig()
    gen_tail()
    gen_linucb()
