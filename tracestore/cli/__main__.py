"""``python -m tracestore.cli`` runs the ``tracestore`` command."""

from . import main

main()
