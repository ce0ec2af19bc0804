"""`python -m enrichq_service` is the `enrichq` command."""

from enrichq_service.cli import main

main()
