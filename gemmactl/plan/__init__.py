"""Placement planning: inventory from headers, machine profile, solver."""
