import sys

try:  # Ctrl-C before `main` installs its handlers: no traceback either
    from .cli import main
except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    sys.exit(130)

sys.exit(main())
