"""Fixtures of the serving tests: the shared two-datacenter cluster lives in serving_cluster.py."""

from serving_cluster import cluster  # noqa: F401 - re-exported as a fixture
