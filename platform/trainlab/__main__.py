"""`python -m trainlab ...` is the `trainlab` command."""

from trainlab.cli import main

main()
