"""The training command line as a package of testable pieces.

- ``config``: ``RunConfig``, one field per flag with its help, choices and check;
- ``validate``: everything a config must satisfy, checked before JAX starts;
- ``checkpoints``: the run's checkpoint folder (one run per folder, exact resume);
- ``startup``: measurements at start-up (``--plan auto``, ``--bucket-mb auto``, the link);
- ``loop``: the step loop (``StepLoop``) and its policy for non-finite steps;
- ``runlog``: per-step logs, evaluations and the profiler's window;
- ``record``: the result record;
- ``run``: ``train_and_evaluate(config)``, one run over all of them;
- ``command``: ``main(argv)``, the command line (``python -m experiments.train``).

Example:
    >>> from experiments.train import RunConfig, validate
    >>> validate(RunConfig(strategy="embrace", optimizer="sgd"))
"""

from experiments.train.command import cli, main, make_parser
from experiments.train.config import RunConfig
from experiments.train.record import write_json
from experiments.train.run import build, make_optimizer, start_devices, train_and_evaluate
from experiments.train.validate import validate

__all__ = [
    "RunConfig",
    "build",
    "cli",
    "main",
    "make_optimizer",
    "make_parser",
    "start_devices",
    "train_and_evaluate",
    "validate",
    "write_json",
]
