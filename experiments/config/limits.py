"""Limits shared by every launcher and writer of rows, defined once."""

from __future__ import annotations

DEFAULT_TIMEOUT_S = 3600.0
"""wall-clock limit of one launched cell (or probe) when neither the sweep nor the command line
gives one: the paper-scale cells take minutes, the CPU ones under a minute"""

ERROR_TAIL_CHARS = 4000
"""how much of a failing rank's traceback a row keeps (its end, where the exception is)"""

PROCESS_GROUP_TIMEOUT_S = 2 * 3600
"""torch.distributed's collective timeout in launched ranks: longer than any cell, so a slow
rank is not mistaken for a dead one (the launcher's own timeout ends a stuck cell)"""
