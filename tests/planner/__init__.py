"""Tests of the planner (`crossfill plan`)."""
