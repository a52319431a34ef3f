"""Mixture-of-experts layer: router, experts and local token dispatch."""
