"""`python -m ladle_cli ...`: the `ladle` command."""

from ladle_cli.main import main

main()
