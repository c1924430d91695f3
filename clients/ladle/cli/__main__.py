"""`python -m ladle.cli ...`: the `ladle` command."""

from ladle.cli.main import main

main()
