"""Serving: the routing table at request time, light enough to run in front of every request (no torch)."""
