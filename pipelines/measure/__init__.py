"""Memory measurement: what a snapshot reads, the sweep and soak phases, growth statistics, the leak and growth verdicts and their charts."""
