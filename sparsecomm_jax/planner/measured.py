"""The measurement decides: of the model's candidates, the plan whose step is fastest
when timed (``choose_measured``; ``--plan auto`` times real steps on the cluster)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sparsecomm_jax.planner.proposal import Plan


def choose_measured(
    candidates: Sequence[Plan], time_plans: Callable[[Sequence[Plan]], Sequence[float]]
) -> tuple[Plan, list[float]]:
    """The candidate of least measured step time.

    Args:
      candidates: ``candidate_plans(...)``.
      time_plans: ``plans -> seconds of a step under each`` (timed on the cluster that
        will train; ``experiments.train.startup.choose_plan`` runs real steps of every plan in
        turns, so that a change of load on the host falls on all of them). Not called
        when there is one candidate.

    Returns:
      ``(plan, seconds per candidate)`` (an empty list when nothing was timed).

    Example:
        >>> plans = [Plan((), 1.0, 0.0, 4), Plan((), 2.0, 0.0, 4)]
        >>> choose_measured(plans, lambda ps: [3.0 - p.seconds for p in ps])[0].seconds
        2.0
    """
    if len(candidates) == 1:
        return candidates[0], []
    seconds = [float(s) for s in time_plans(candidates)]
    if len(seconds) != len(candidates):
        raise ValueError(f"time_plans gave {len(seconds)} times for {len(candidates)} plans")
    best = min(range(len(candidates)), key=lambda k: seconds[k])
    return candidates[best], seconds
