"""`python -m hybridkv`: the same entry point as the `hybridkv` command."""

from hybridkv.cli import main

main()
