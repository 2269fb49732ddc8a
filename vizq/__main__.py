"""``python -m vizq``: an interrupt even while the libraries import exits 130 without a traceback.

Why the import is shielded: torch imports numpy from C and, when that import fails, carries on
without it; a Ctrl-C that lands inside it is swallowed (the run goes on as if never interrupted)
or leaves numpy half-initialised ("cannot load module more than once per process" on the next
import). So while the libraries load, SIGINT only records itself, and is acted on right after.
A SIGINT that the parent set to be ignored stays ignored.
"""
import signal
import sys

_interrupted: list[int] = []
_shield = signal.getsignal(signal.SIGINT) is signal.default_int_handler
if _shield:
    signal.signal(signal.SIGINT, lambda signum, frame: _interrupted.append(signum))
try:
    from .cli import main
finally:
    if _shield:
        signal.signal(signal.SIGINT, signal.default_int_handler)
if _interrupted:
    print("\ncancelled; no output was written", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
