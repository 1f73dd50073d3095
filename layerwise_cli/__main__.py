"""`python -m layerwise_cli`."""

from .cli.app import main

main()
