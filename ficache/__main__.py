"""``python -m ficache`` runs the CLI."""

from ficache.cli import main

main()
