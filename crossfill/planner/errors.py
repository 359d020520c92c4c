"""The planner's one error type.

Every bad input (an unknown preset, a config.json without head counts, a profile whose lengths do
not increase, an SLO no hardware can meet) raises `PlanError` with a message that names the field
and says what was expected; `crossfill plan` prints it and exits with status 2 instead of a
traceback.
"""

from __future__ import annotations


class PlanError(ValueError):
    """Bad planner input; the message names the field and what is expected."""
