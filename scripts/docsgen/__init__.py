"""The renderers and block machinery behind scripts/docs_numbers.py, one module per group of number blocks.

blocks.py finds and rewrites `<!-- numbers:KIND -->` blocks and holds the kind -> renderer registry; sources.py
reads what a block quotes and writes its provenance line; format.py prints numbers the docs' way; shipped.py checks
the paths the docs name. The renderers: compare_blocks.py (compare.json, routing, gate, history), result_blocks.py
(evaluate, memory, quantize, calibration, reference), params_blocks.py (params.yaml), measured_blocks.py
(docs/measured/*.json, what the benchmarks record).
"""
