"""Which lm-evaluation-harness tasks a run names, checked before anything starts: lm-eval's task names, the tasks
shipped in data/eval/tasks (their ``data_files`` made absolute: the YAML names them relative to itself) and task YAML
files; an unknown task, missing data files and a dataset that would have to be downloaded are one line
(``ConfigError``). Read by ``evaluate --tasks`` and by the setup path for ``eval.tasks``."""

from __future__ import annotations

import functools
import os

from llama_megatron.errors import ConfigError

TASK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))), "data", "eval", "tasks")  # the tasks shipped with the repository (data/eval/README.md)


def go_offline() -> None:
    """Nothing is downloaded at run time (a task's data must be on this machine): set before ``datasets`` (which
    lm-eval imports) and the hub read the environment."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def task_configs(names: list[str | dict]) -> list[str | dict]:
    """lm-eval task names, and the shipped tasks (``data/eval/tasks/*.yaml``) as configs whose ``data_files`` are
    made absolute (the YAML names them relative to itself), so they load from any directory, offline."""
    import yaml

    out: list[str | dict] = []
    for name in names:
        if isinstance(name, dict):  # a config already (what check_tasks returns)
            out.append(name)
            continue
        path = name if name.endswith((".yaml", ".yml")) else os.path.join(TASK_DIR, f"{name}.yaml")
        if not os.path.isfile(path):
            out.append(name)  # a task of lm-eval's own (its YAML names its dataset: local copies, see the docs)
            continue
        with open(path, encoding="utf-8") as fh:
            config = yaml.safe_load(fh)
        files = config.get("dataset_kwargs", {}).get("data_files", {})
        for split, file in files.items():
            resolved = file if os.path.isabs(file) else os.path.join(os.path.dirname(os.path.abspath(path)), file)
            if not os.path.isfile(resolved):
                raise ConfigError(f"task {name}: its {split} data {resolved} is missing")
            files[split] = resolved
        out.append(config)
    return out


LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # datasets' builders that read data_files


def needs_lm_eval_tasks(configs: list[str | dict]) -> bool:
    """Whether lm-eval's own task index is needed: a task named, not written out (or a YAML that includes one)."""
    return any(not isinstance(config, dict) or "include" in config for config in configs)


@functools.cache
def task_manager(lm_eval_tasks: bool = True):
    """lm-eval's ``TaskManager`` over the shipped tasks, and over lm-eval's own when ``lm_eval_tasks``: one per
    process, since indexing lm-eval's thousands of task YAMLs takes seconds and an evaluation runs at every
    ``eval.interval``."""
    go_offline()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=TASK_DIR, include_defaults=lm_eval_tasks)


def check_tasks(names: list[str]) -> list[str | dict]:
    """The tasks' configs (:func:`task_configs`), each known to lm-eval and with its data on this machine: an
    unknown task, or one whose dataset is neither a local directory, nor local ``data_files``, nor in the datasets
    cache, is one line (``ConfigError``) before any model is loaded, and nothing is downloaded."""
    configs = task_configs(names)
    manager = task_manager(needs_lm_eval_tasks(configs))
    known = {*manager.all_tasks, *manager.all_groups, *manager.all_tags}
    for config in configs:
        if isinstance(config, dict):  # a YAML of ours or the user's
            _check_local(config.get("task", "?"), config)
            continue
        if config not in known:
            raise ConfigError(f"unknown lm-eval task {config!r} (`lm_eval ls tasks` lists lm-eval's; the shipped "
                              f"ones are in {TASK_DIR})")
        entry = manager.task_index[config]
        if entry.cfg is None or "dataset_path" not in entry.cfg:
            continue  # a group or tag: its tasks are checked when lm-eval loads them (offline)
        _check_local(config, entry.cfg)
    return configs


def _check_local(name: str, config: dict) -> None:
    path, files = config["dataset_path"], (config.get("dataset_kwargs") or {}).get("data_files")
    if os.path.isdir(path):
        return
    if files:
        listed = files.values() if isinstance(files, dict) else files if isinstance(files, list) else [files]
        missing = [f for group in listed for f in (group if isinstance(group, list) else [group])
                   if not os.path.isfile(f)]
        if missing:
            raise ConfigError(f"task {name}: its data files are missing: {', '.join(map(str, missing))}")
        return
    if path in LOCAL_BUILDERS:
        raise ConfigError(f"task {name}: dataset_path {path} names no data_files")
    import datasets

    try:  # the datasets cache only: HF_DATASETS_OFFLINE is set
        datasets.load_dataset_builder(path, config.get("dataset_name"))
    except Exception:  # noqa: BLE001 - whatever datasets raises offline, the answer is that it is not here
        raise ConfigError(f"task {name}: its dataset {path}{'/' + config['dataset_name'] if config.get('dataset_name') else ''} "
                          "is not on this machine and nothing is downloaded: copy it here and point the task's "
                          "dataset_path or data_files at it (docs/evaluation.md)") from None
