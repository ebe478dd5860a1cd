"""Judging: paired statistics, the sequential looks, the verdict's rules (one home, which the gate re-derives with), the comparison and its charts."""
