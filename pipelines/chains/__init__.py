"""The per-variant chains as Ray tasks (`quantgate fanout`, `quantgate repro`)."""
