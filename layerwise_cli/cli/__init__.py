"""The `layerwise` command line: one module per command."""
