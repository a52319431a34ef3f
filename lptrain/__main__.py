"""``python -m lptrain`` runs the command line."""

from lptrain.cli import main

main()
