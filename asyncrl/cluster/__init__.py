"""Placing the roles on a Ray cluster (run.launcher = "ray"): the actors that host them."""
