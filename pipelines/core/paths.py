"""Every path and fixed name the stages share, in one place: where each stage writes and the next one reads.

Paths are relative to the repository root, where `dvc repro` runs every stage. dvc.yaml lists the same
paths as outs and deps; tests/test_dvc_stages.py holds the two together.
"""

from __future__ import annotations

from pathlib import Path

BASELINE = "fp16"  # the variant every other is judged against
MANIFEST = "quantgate.json"  # a variant folder's manifest: how it was made or admitted, and its status

PARAMS_FILE = Path("params.yaml")
DVC_YAML = Path("dvc.yaml")
DVC_LOCK = Path("dvc.lock")
LOG_FILE = Path("logs/quantgate.log")
TIMINGS_DIR = Path("logs/timings")  # each stage process's wall time and library seconds (core/timing.py)

# inputs the project ships
SHIPPED_REFERENCE_DIR = Path("reference_model")  # the trained weights, shipped with the recipe that made them
CODE_SOURCES = Path("calibration_sets/sources/code")
EVAL_DIR = Path("eval")  # a request type's probes: eval/<name>/items.jsonl and its lm-eval task YAML

# models
MODELS_DIR = Path("models")
REFERENCE_DIR = Path("models/reference")
VARIANTS_DIR = Path("models/variants")
FETCHED_DIR = Path("models/fetched")  # `quantgate fetch` puts registry versions here

# stage outputs
RESULTS = Path("results")
BUILT_DIR = Path("calibration_sets/built")  # calibrate: one set per domain
METHOD_DIR = "by_method"  # built/by_method/<method>.jsonl: the calibration texts a quantization method reads
COVERAGE_DIR = RESULTS / "calibration"  # calibrate: coverage and classifier reports
REFERENCE_REPORT = RESULTS / "reference.json"
QUANTIZE_RESULTS = RESULTS / "quantize"  # quantize: <variant>.json, status and timings
MEMORY_RESULTS = RESULTS / "memory"  # memory: <variant>.json
MEMORY_TRACES = MEMORY_RESULTS / "traces"  # memory: <variant>/ the flame graph (CPU) or CUDA snapshot of a growth
MEMORY_SUMMARY = RESULTS / "memory_summary.json"  # memory-report: compare and record read it
BASELINE_RESULTS = RESULTS / "baseline"  # baseline: fp16's answers to every look
FIDELITY_BASE = BASELINE_RESULTS / "fidelity.safetensors"  # baseline: fp16's next-token distributions
FIDELITY_TEXTS = "fidelity.jsonl"  # baseline/ and eval/<variant>/: per-text KL, log-probs, top-1 (audit re-measures)
EVAL_RESULTS = RESULTS / "eval"  # evaluate: <variant>.json and <variant>/items.jsonl
COMPARE_REPORT = RESULTS / "compare.json"  # compare: verdicts and the numbers behind them
SUMMARY = RESULTS / "summary.json"  # compare: DVC's only metrics file, the decision in a few columns
COMPARE_TABLE = RESULTS / "compare.csv"
PLOTS_DIR = RESULTS / "plots"  # every stage's charts
SHADOW_REPORT = RESULTS / "shadow.json"  # shadow: agreement with fp16 per type and bucket (route reads it)
SHADOW_METRICS = RESULTS / "shadow_metrics.json"  # shadow: latency and memory of the replay (volatile)
SHADOW_DIR = RESULTS / "shadow"  # shadow: answers.jsonl, masked or hashed
ROUTING_TABLE = RESULTS / "routing_table.json"  # route: request type x context bucket -> variant
ROLLOUT_PLAN = RESULTS / "rollout.yaml"  # route: per routed type, the canary schedule and its stop limits
KSERVE_DIR = RESULTS / "kserve"  # route: <type>.yaml, the KServe InferenceServices that start the canaries
ROUTER_CONFIG = RESULTS / "vllm-sr.yaml"  # route: the fleet plan as a vLLM Semantic Router config (routing/semantic_router.py)
FLEET_PLOT = PLOTS_DIR / "fleet_saving.png"  # route: the fleet's saving against deployments, per plan
MLFLOW_RUN = RESULTS / "mlflow_run.json"  # record writes it, gate reads it
GATE_RESULT = RESULTS / "gate.json"
GATE_REPORT = RESULTS / "report.md"
AUDIT_RESULT = RESULTS / "audit.json"  # quantgate audit: the sample, its seed, what disagreed

# other models' runs in workspaces of their own (`quantgate profile NAME`, bash scripts/run.sh --model NAME)
PROFILES_DIR = Path("profiles")  # profiles/<name>.yaml: the settings merged over params.yaml, the packages it installs
WORKSPACES_DIR = Path("workspaces")  # workspaces/<name>/: the profile's copy of this checkout, its own results
PROFILE_MARKER = ".quantgate-profile.json"  # in a workspace: its profile, and the checkout whose MLflow store it uses

# the default MLflow store (no MLFLOW_TRACKING_URI): beside dvc.yaml, at the repository root
MLFLOW_DB = "mlflow.db"
MLARTIFACTS = "mlartifacts"

# Ray's own (2.60): where its driver and `ray start` read the token last (quantgate fanout writes one there, 0600)
RAY_DEFAULT_TOKEN = "~/.ray/auth_token"
