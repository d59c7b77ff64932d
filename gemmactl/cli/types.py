"""Option types the commands share, so a flag is checked at the boundary, in its own words."""

from __future__ import annotations

import math

import click


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (click's own accepts them)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


NON_NEGATIVE = FiniteFloatRange(min=0.0)
