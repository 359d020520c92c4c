"""The simulator's one error type for bad input.

Every problem with the simulation file, a trace or a flag raises `SimError` naming the field (or
the trace row) and what was expected; `crossfill simulate` prints it and exits with status 2.
"""

from __future__ import annotations


class SimError(ValueError):
    """Bad simulation input; the message names the field or trace row and what is expected."""
