"""What the SDK scripts share: starting `equiroute` subcommands and running named checks."""

import os
import re
import shutil
import subprocess


def start(args, env):
    """Starts `args` (an `equiroute` subcommand that prints its address first, http:// or
    https://); returns the process and its `host:port`."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    match = re.search(r"https?://([0-9.]+:[0-9]+)", line)
    assert match, f"no address in {line!r}"
    return proc, match.group(1)


def mock_and_gateway(binary, config, env, work, procs):
    """Starts `equiroute mock-upstream`, then `equiroute serve` on `config(mock_addr)` (the
    gateway's TOML, written into `work`); both join `procs`. Returns the mock's and the
    gateway's `host:port`."""
    mock, mock_addr = start([binary, "mock-upstream", "--listen", "127.0.0.1:0"], env)
    procs.append(mock)
    path = os.path.join(work, "gateway.toml")
    with open(path, "w") as f:
        f.write(config(mock_addr))
    gateway, addr = start([binary, "serve", "--config", path, "--listen", "127.0.0.1:0", "--in-memory"], env)
    procs.append(gateway)
    return mock_addr, addr


def run_checks(named, label):
    """Runs every `(name, thunk)`, reporting each (a failure does not stop the others);
    returns the number that failed."""
    passed = failed = 0
    for name, check in named:
        try:
            check()
            passed += 1
            print(f"ok {name}")
        except Exception as e:  # report every check, then fail the run
            failed += 1
            print(f"FAILED {name}: {e!r}")
    print(f"{label}: {passed} passed, {failed} failed")
    return failed


def stop(procs, work):
    """Stops the processes `start` started and removes the scratch directory `work`."""
    for p in procs:
        p.terminate()
        p.wait(timeout=10)
    shutil.rmtree(work, ignore_errors=True)
