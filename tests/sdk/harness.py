"""What the SDK scripts share: starting `equiroute` subcommands and running named checks."""

import re
import shutil
import subprocess


def start(args, env):
    """Starts `args` (an `equiroute` subcommand that prints its address first); returns the
    process and its `host:port`."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    match = re.search(r"http://([0-9.]+:[0-9]+)", line)
    assert match, f"no address in {line!r}"
    return proc, match.group(1)


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
