"""The verifier's exact tiling check: ``ir.tiling``, where the planner and the checkpoint reader
reach it too (``ir`` <- ``planner`` <- ``verify``)."""

from ..ir.tiling import (RUNS_PER_BOX, Fault, contains, inside, outside_point, tiling_fault,
                         well_formed)

__all__ = ["RUNS_PER_BOX", "Fault", "contains", "inside", "outside_point", "tiling_fault",
           "well_formed"]
