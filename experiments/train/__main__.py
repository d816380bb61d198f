"""``python -m experiments.train``: the training command line (``command.cli``)."""

from experiments.train.command import cli

cli()
