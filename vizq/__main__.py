"""``python -m vizq``: an interrupt even while the libraries import exits 130 without a traceback."""
import sys

try:
    from .cli import main
except KeyboardInterrupt:
    print("\ncancelled; no output was written", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
