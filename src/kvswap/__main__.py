"""`python -m kvswap`: the stop signals are caught before the heavy imports.

Importing the commands imports torch, which takes seconds; a Ctrl-C or a
SIGTERM in that time ends with one line and 128 + the signal number, not a
KeyboardInterrupt traceback from deep inside an import."""

from kvswap.openmp_env import cap_onednn_caches, prefer_passive_openmp_wait
from kvswap.signals import Terminated, report_stop, stop_signals_raise


def entry() -> int:
    """The command line, with the imports under the same signal handling as the run."""
    prefer_passive_openmp_wait()  # before torch loads: its OpenMP reads it only then
    cap_onednn_caches()  # the same: oneDNN reads its cache sizes once
    try:
        with stop_signals_raise():
            from kvswap.cli import main
    except (KeyboardInterrupt, Terminated) as stop:
        return report_stop(stop)
    return main()


if __name__ == "__main__":
    raise SystemExit(entry())
