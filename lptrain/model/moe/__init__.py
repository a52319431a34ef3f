"""Mixture-of-experts layer: router, experts, and the token dispatcher (local at EP=1, all-to-all across the expert-parallel group otherwise)."""
