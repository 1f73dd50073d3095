"""`python -m layerwise_cli`."""

import sys

try:
    from layerwise_cli.cli.app import main
except KeyboardInterrupt:  # Ctrl-C while the CLI starts: one line, no traceback
    sys.stderr.write("Error: interrupted\n")
    sys.exit(130)

main()
