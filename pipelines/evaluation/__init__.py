"""Evaluation: the plan every stage agrees to evaluate (pools, looks, order), the lm-eval harness, fidelity against fp16, standard tasks."""
