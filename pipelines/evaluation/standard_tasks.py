"""Standard lm-eval tasks (gsm8k, ...) judged beside a domain's probes, as rows keyed `<domain>:<task>`.

The task's definition is lm-eval's own (the YAML the installed lm_eval ships, found through its
TaskManager); quantgate only overrides where the data comes from (`data_files`: a local file per split,
for machines that reach no dataset hub) and, if asked, the few-shot count, the filter and the metric that
score an item. Items are the task's evaluation docs in lm-eval's order; their stable id is
`<task>:<doc_id>`. Tasks that execute model-written code (lm-eval's `unsafe_code`) score through HF
evaluate's code_eval, which loads from the hub and runs the code in the evaluating process: for `humaneval`
and `mbpp` quantgate reads the YAML without importing its utils module and scores each item pass@1 with
the same program code_eval would run, in quantgate's sandbox (pipelines/core/sandbox.py); any other code task
is refused.
"""

from __future__ import annotations

import ast
import copy
import functools
import os
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.core.paths import EVAL_DIR

SEP = ":"  # row key `<domain>:<task>`, item id `<task>:<doc_id>`


LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}  # suffix -> HF datasets builder


def data_loader(data_files: dict[str, str], where: str) -> str:
    """The HF datasets builder that reads every split's local file (one builder for all of them)."""
    kinds = {split: LOADERS.get(Path(path).suffix.lower()) for split, path in data_files.items()}
    if None in kinds.values():
        split = next(s for s, k in kinds.items() if k is None)
        raise QuantgateError(f"{where}: data file {data_files[split]} (split {split!r}): only "
                             f"{', '.join(sorted(LOADERS))} files are read")
    if len(set(kinds.values())) > 1:
        raise QuantgateError(f"{where}: data_files mixes formats ({kinds}): give every split in one format")
    return next(iter(kinds.values()))


def untracked_data(tasks: dict, tracked: Path = EVAL_DIR) -> list[str]:
    """Local task data outside `tracked` (the folder dvc.yaml's baseline, evaluate and compare stages depend on):
    DVC would not see it change, so results made from it could be stale without anyone knowing."""
    root = tracked.resolve()
    return [f"requests.{domain}.tasks: task {spec.name}'s {split} data {path} is outside {tracked}/, which DVC "
            f"does not track for it: move it under {tracked}/ (e.g. {tracked}/{domain}/{spec.name}/{Path(path).name})"
            for domain, specs in tasks.items() for spec in specs for split, path in (spec.data_files or {}).items()
            if not Path(path).resolve().is_relative_to(root)]


def row_key(domain: str, task: str) -> str:
    return f"{domain}{SEP}{task}"


def is_task_row(key: str) -> bool:
    return SEP in key


@functools.lru_cache(maxsize=2)
def task_manager(with_defaults: bool, include_path: str):
    """lm-eval's task index (the built-in one takes seconds to scan: built once per process)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=with_defaults)


def task_config(domain: str, spec, include_path: str = "eval") -> dict:
    """lm-eval's config dict of the task `spec` (params TaskParams) with quantgate's overrides applied.

    The dict is what lm-eval builds the task from (simple_evaluate accepts it in `tasks`); every failure
    names the setting, the task and, for data, the file.
    """
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    where = f"requests.{domain}.tasks: task {spec.name!r}"
    entry = task_manager(True, include_path).task_index.get(spec.name)
    if entry is None:
        raise QuantgateError(f"{where} is not an lm-eval task (not in the task index of the installed lm_eval; "
                             "`lm-eval ls tasks` lists them)")
    if entry.kind != Kind.TASK or entry.yaml_path is None:
        raise QuantgateError(f"{where} is a {entry.kind.name.lower()}, not a single YAML task: list its tasks one by one")
    raw = load_yaml(entry.yaml_path, resolve_func=False)
    if raw.get("unsafe_code"):
        if spec.name not in SANDBOXED:
            raise QuantgateError(f"{where} executes model-written code (unsafe_code) through HF evaluate's code_eval, "
                                 f"outside quantgate's sandbox: of the code tasks only {', '.join(SANDBOXED)} are "
                                 "scored in the sandbox (docs/evaluate.md)")
        cfg = _sandboxed(where, spec.name, copy.deepcopy(raw), Path(entry.yaml_path))
    else:
        cfg = copy.deepcopy(load_yaml(entry.yaml_path, resolve_func=True))
    for key in ("tag", "group", "task_list"):
        cfg.pop(key, None)
    if spec.data_files:
        missing = {split: path for split, path in spec.data_files.items() if not Path(path).is_file()}
        if missing:
            split, path = next(iter(missing.items()))
            raise QuantgateError(f"{where}: data file {path} (split {split!r}) does not exist")
        eval_split = cfg.get("test_split") or cfg.get("validation_split")
        if eval_split not in spec.data_files:
            raise QuantgateError(f"{where}: data_files has no {eval_split!r} split, the one the task evaluates on")
        cfg["dataset_path"] = data_loader(spec.data_files, where)
        cfg.pop("dataset_name", None)
        cfg["dataset_kwargs"] = {"data_files": {split: str(Path(path).resolve()) for split, path in spec.data_files.items()}}
        shots = spec.num_fewshot if spec.num_fewshot is not None else cfg.get("num_fewshot") or 0
        fewshot = cfg.get("fewshot_split") or cfg.get("training_split") or cfg.get("validation_split")
        if shots and fewshot not in spec.data_files and not (cfg.get("fewshot_config") or {}).get("samples"):
            raise QuantgateError(f"{where}: {shots}-shot prompts draw from the {fewshot!r} split, which data_files "
                                 f"does not give: add it, or set num_fewshot: 0")
    if spec.num_fewshot is not None:
        cfg["num_fewshot"] = spec.num_fewshot
    filters = [f["name"] for f in cfg.get("filter_list") or []] or ["none"]
    if spec.filter is not None and spec.filter not in filters:
        raise QuantgateError(f"{where}: no filter {spec.filter!r}; the task's filters are {', '.join(filters)}")
    metrics = [m.get("metric") for m in cfg.get("metric_list") or []]
    if spec.metric is not None and spec.metric not in metrics:
        raise QuantgateError(f"{where}: no metric {spec.metric!r}; the task's metrics are {metrics}")
    metric = spec.metric or (metrics[0] if metrics else None)
    if not isinstance(metric, str):
        raise QuantgateError(f"{where}: its first metric is not named ({metric!r}); set `metric`")
    cfg["metadata"] = {**(cfg.get("metadata") or {}), "quantgate": {"filter": spec.filter or filters[0],
                                                                     "metric": metric,
                                                                     "sandbox": spec.name in SANDBOXED}}
    return cfg


def sandboxed(cfg: dict) -> bool:
    """Whether a config made by task_config runs model-written code (in the sandbox)."""
    return bool(cfg["metadata"]["quantgate"].get("sandbox"))


# Code tasks scored in the sandbox, and the hub-bound pieces of their installed YAML (lm_eval 0.4.13's
# lm_eval/tasks/<task>/<task>.yaml) that quantgate replaces; a definition that differs is refused.
SANDBOXED = ("humaneval", "mbpp")
_REPLACED = {"humaneval": {"metric": "utils.pass_at_k", "filter": "utils.build_predictions"},
             "mbpp": {"metric": "utils.pass_at_1", "samples": "utils.list_fewshot_samples"}}
# HF code_eval runs each program with a 3 s time limit and waits a second more for its process
CODE_EVAL_TIMEOUT_S = 3.0


def _sandboxed(where: str, name: str, cfg: dict, yaml_path: Path) -> dict:
    """humaneval/mbpp's config (loaded with `!function` tags left as "<dir>/utils.<fn>" strings) with
    code_eval's metric and humaneval's filter replaced by a sandboxed process_results, and mbpp's few-shot
    samples read from utils.py's literal without importing it."""
    here = str(yaml_path.parent)
    expected = _REPLACED[name]

    def differs(what) -> QuantgateError:
        return QuantgateError(f"{where}: the installed lm_eval's {yaml_path} differs from the definition quantgate "
                              f"scores in its sandbox ({what}); pin lm_eval as constraints.txt does")

    def is_function(value, fn: str) -> bool:
        return value == f"{here}/{fn}"

    metrics = cfg.get("metric_list") or []
    if len(metrics) != 1 or not is_function(metrics[0].get("metric"), expected["metric"]) \
            or metrics[0].get("k", [1]) not in ([1], 1) or cfg.get("repeats", 1) != 1:
        raise differs(f"metric_list {metrics!r}, repeats {cfg.get('repeats')!r}")
    cfg["metric_list"] = [{"metric": "pass@1", "aggregation": "mean", "higher_is_better": True}]
    filters = cfg.pop("filter_list", None)
    if name == "humaneval":
        steps = (filters or [{}])[0].get("filter") or []
        if len(filters or []) != 1 or len(steps) != 1 or not is_function(steps[0].get("filter_fn"), expected["filter"]):
            raise differs(f"filter_list {filters!r}")
        cfg["process_results"] = humaneval_results
    else:
        samples = (cfg.get("fewshot_config") or {}).get("samples")
        if filters is not None or not is_function(samples, expected["samples"]):
            raise differs(f"filter_list {filters!r}, fewshot_config.samples {samples!r}")
        cfg["fewshot_config"]["samples"] = _literal_return(yaml_path.parent / "utils.py", "list_fewshot_samples")
        cfg["process_results"] = mbpp_results
    leftover = [k for k, v in cfg.items() if f"'{here}/" in repr(v)]
    if leftover:
        raise differs(f"unresolved !function in {', '.join(leftover)}")
    return cfg


def _literal_return(path: Path, function: str) -> list[dict]:
    """The list literal `function` in `path` returns, read with ast (the module is never imported: it
    imports HF evaluate and loads code_eval from the hub)."""
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
            if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
                try:
                    value = ast.literal_eval(body[0].value)
                except ValueError:
                    break
                if isinstance(value, list) and all(isinstance(v, dict) for v in value):
                    return value
            break
    raise QuantgateError(f"{path}: {function}() does not return a literal list of docs; quantgate reads it "
                         "without importing the module")


# code_eval's check_correctness: `exec(program, {})` with a time limit in a child process; any exception,
# SystemExit included, is a failure (so `if __name__ == "__main__":` blocks do not run and sys.exit(0) does
# not pass), and so is a child that ends without reporting (os._exit: disabled here; posix._exit or a signal
# still end it, without the sandbox runner's token, so run_python fails them too)
_EXEC = "import os, sys\nos._exit = None\ntry:\n    exec(compile({program!r}, '<program>', 'exec'), {{}})\n" \
        "except BaseException as err:\n    print(type(err).__name__, err)\n    sys.exit(1)\n"


def _pass_at_1(program: str) -> dict:
    """pass@1 of one greedy completion: the program run in the sandbox as code_eval would exec it."""
    from pipelines.core.sandbox import Limits, run_python

    outcome = run_python(_EXEC.format(program=program), Limits(timeout_s=CODE_EVAL_TIMEOUT_S + 1.0),
                         allow_unisolated=os.environ.get("QUANTGATE_ALLOW_UNISOLATED_CODE") == "1")
    if outcome.status == "refused":  # run_probes refuses such rows first: reaching this is a bug, not a score
        raise QuantgateError(f"sandbox refused a code task's program: {outcome.output}")
    return {"pass@1": 1.0 if outcome.passed else 0.0}


def humaneval_results(doc: dict, results: list[str]) -> dict:
    """lm-eval humaneval's score: its filter makes `prompt + completion`, code_eval appends a newline and the
    target `{test}\ncheck({entry_point})`."""
    return _pass_at_1(doc["prompt"] + results[0] + "\n" + f"{doc['test']}\ncheck({doc['entry_point']})")


def mbpp_results(doc: dict, results: list[str]) -> dict:
    """lm-eval mbpp's score: the completion as is, a newline, then the target (the doc's three test asserts)."""
    return _pass_at_1(results[0] + "\n" + "\n".join(str(t) for t in doc["test_list"][:3]))


def scoring(cfg: dict) -> tuple[str, str]:
    """(filter, metric) that score an item of a config made by task_config."""
    chosen = cfg["metadata"]["quantgate"]
    return chosen["filter"], chosen["metric"]


def doc_count(domain: str, spec, include_path: str = "eval") -> int:
    """How many evaluation docs the task has (its item pool): lm-eval builds the task and loads its data."""
    from pipelines.core.logs import library_output

    cfg = task_config(domain, spec, include_path)
    try:
        with library_output("lm_eval"):
            task = task_manager(True, include_path).load([cfg])["tasks"][cfg["task"]]
            return len(task.eval_docs)
    except Exception as err:  # noqa: BLE001 - a dataset that cannot load is named, not a traceback
        source = (cfg.get("dataset_kwargs") or {}).get("data_files") or cfg.get("dataset_path")
        raise QuantgateError(f"requests.{domain}.tasks: task {spec.name!r} could not load its data ({source}): "
                             f"{type(err).__name__}: {err}"[:2000]) from None


def item_id(task: str, doc_id: int) -> str:
    return f"{task}{SEP}{doc_id}"


def config_files(configs: dict[str, dict], folder: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({task: YAML file}, {row: why not}) for standard-task rows' configs (`configs`: row -> task_config's dict), so a
    run of the `lm_eval` command (against an endpoint) asks and scores the items as quantgate does here, not as
    lm-eval's own YAML would: each written where `--tasks` takes it by path, its functions as `!function module.name`
    (lm-eval imports them), and read back with lm-eval's own loader. A config that does not come back the same (a
    function with no importable name, a value YAML cannot hold) is that row's refusal, never a silent change."""
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(tuple, Dumper.represent_list)
    Dumper.add_multi_representer(object, lambda dumper, obj: dumper.represent_scalar("!function", _named(obj)))
    files, refused = {}, {}
    for row, cfg in configs.items():
        path = Path(folder) / f"{cfg['task']}.yaml"
        try:
            path.write_text(yaml.dump(cfg, Dumper=Dumper, sort_keys=False), encoding="utf-8")  # non-ASCII escaped
            if not _same(load_yaml(str(path), resolve_func=True), cfg):
                raise QuantgateError("lm-eval's loader reads another config back")
        except Exception as err:  # noqa: BLE001 - whatever the config holds: this row's refusal, with the cause
            refused[row] = (f"task {cfg['task']}'s config cannot be handed to the lm_eval command as quantgate "
                            f"builds it ({type(err).__name__}: {str(err)[:300]}): judge the model on it here, or "
                            "from a sample log of that task")
            continue
        files[cfg["task"]] = str(path)
    return files, refused


def _named(obj) -> str:
    """`module.name` under which lm-eval's loader finds `obj` again: its own, or, for a value such as a
    functools.partial that lm-eval's task modules define at top level, the attribute of the loaded module holding it
    (or an equal partial: task_config deep-copies the config, and with it each partial)."""
    import sys

    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(name, str) and getattr(sys.modules.get(module), name, None) is obj:
        return f"{module}.{name}"
    home = getattr(getattr(obj, "func", None), "__module__", None)  # a partial's function's module first
    for module_name, loaded in sorted(sys.modules.items(), key=lambda item: item[0] != home):
        if module_name.startswith("lm_eval.tasks.") or module_name == __name__:
            holder = next((attr for attr, value in list(vars(loaded).items()) if value is obj
                           or isinstance(obj, functools.partial) and _same(value, obj)), None)
            if holder:
                return f"{module_name}.{holder}"
    raise QuantgateError(f"{obj!r} has no name lm-eval can import it by")


def _same(read, built) -> bool:
    """Whether a config read back equals the one built: the same values, a tuple as its list, the same functions (a
    functools.partial: the same function, arguments and keywords)."""
    if isinstance(built, dict):
        return isinstance(read, dict) and read.keys() == built.keys() and all(_same(read[k], built[k]) for k in built)
    if isinstance(built, (list, tuple)):
        return isinstance(read, list) and len(read) == len(built) and all(map(_same, read, built))
    if isinstance(built, functools.partial):  # its arguments type for type: partial(f, True) is not partial(f, 1)
        return isinstance(read, functools.partial) and read.func is built.func and _same(list(read.args), built.args) \
            and _same(read.keywords, built.keywords)
    return read is built if callable(built) else type(read) is type(built) and read == built
