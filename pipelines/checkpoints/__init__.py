"""Admission of third-party checkpoints: every check that stands between a downloaded folder and a loader.

The interface is one shape: a check is a function `check(c: Candidate) -> list[str]` (context.py) that reads
what earlier checks put on `c`, may add what it learned, and returns its reasons to refuse (empty: no
objection), each naming its file, key or tensor. admission.py runs them in order, listed in PHASE_1 and
PHASE_2 in groups: after a group with any reason nothing later runs, so a dangerous folder is read no further.
A new format or check is one new file with one such function, added to a group there.

files (names, types, sizes, remote code), quant_config, drift (config and generation config against the
base), tokenizer, shards (safetensors headers and index), tensors (names, dtypes, shapes, values), copying
(the one streamed read that hashes, checks values and copies), manifest (what an admission records).
"""
