"""Reward functions for rltt recipes (referenced as `rewards/FILE.py:FUNCTION`)."""
