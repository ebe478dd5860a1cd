"""Text the project generates, classifies and measures: seeded generators, probe items, request types, PII masking, code comments, the reference corpus, calibration coverage."""
