"""Simulation kit for the scheduler core: a deterministic fake model and worker that check
every plan, request traces, a step-cost model, and a driver (used by `python -m tools.simulate` and
the simulation tests). No torch, no processes.
"""
