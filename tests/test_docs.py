"""The documentation cannot rot: in README.md and docs/*.md every relative link resolves (a ``#anchor`` to a
heading of its page, by GitHub's slug rule), every mention of a repository file exists (``llama_megatron/...py``,
``scripts/...sh``, ``configs/...json``, ...; also ``training/...py`` and the like inside the package, and dotted
``llama_megatron.x.y`` names), and every ``llama-megatron VERB`` / ``python -m llama_megatron...`` command of a
```bash block names a verb and flags the CLI's parser knows, with ``--config`` / ``--set`` paths that exist.

One process, no model built: the parsers are the CLI's own (``cli.build_parser``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex

import pytest

from llama_megatron import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs"))
                               if n.endswith(".md"))

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:llama_megatron|scripts|configs|tests|benchmarks|ds_configs)/[\w./-]*?"
                       r"\.(?:py|sh|json|sbatch|md))(?![\w*{])")
PACKAGE_PATH = re.compile(r"(?<![\w./-])((?:training|checkpoint|parallel|model|commands|data)/[\w/]*?\.py)\b")
DOTTED = re.compile(r"(?<![\w.])(llama_megatron(?:\.\w+)+)")
PLACEHOLDER = re.compile(r"/(?:[A-Z_]+|x|\w+_x)\.\w+$")  # configs/pretrain/X.json, tests/test_x.py: slots


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped (``-`` and ``_`` kept), spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _prose_and_blocks(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The text outside fenced blocks (fences blanked), and each fenced block as (language, body)."""
    prose, blocks, lang, body = [], [], None, []
    for line in text.split("\n"):
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body)))
                lang = None
            prose.append("")
        elif lang is None:
            prose.append(line)
        else:
            body.append(line)
            prose.append("")
    return "\n".join(prose), blocks


def anchors(text: str) -> set[str]:
    prose, _ = _prose_and_blocks(text)
    seen: dict[str, int] = {}
    out = set()
    for line in prose.split("\n"):
        if m := re.match(r"^#{1,6} (.+)$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_errors(page: str, text: str, root: str = ROOT) -> list[str]:
    """Relative links of ``text`` (a file at ``page`` under ``root``) that do not resolve."""
    prose, _ = _prose_and_blocks(text)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    errors = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(root, os.path.dirname(page), path)) if path else os.path.join(root, page)
        if path and not os.path.exists(file):
            errors.append(f"{page}: link to a missing file: {target}")
            continue
        if anchor and file.endswith(".md"):
            own = text if not path else open(file, encoding="utf-8").read()
            if anchor not in anchors(own):
                errors.append(f"{page}: link to a missing heading: {target}")
    return errors


def path_errors(page: str, text: str, root: str = ROOT) -> list[str]:
    errors = []
    for path in sorted(set(REPO_PATH.findall(text))):
        if not PLACEHOLDER.search(path) and not os.path.exists(os.path.join(root, path)):
            errors.append(f"{page}: names a missing file: {path}")
    for path in sorted(set(PACKAGE_PATH.findall(text))):
        if not os.path.exists(os.path.join(root, "llama_megatron", path)):
            errors.append(f"{page}: names a missing module: {path} (under llama_megatron/)")
    for name in sorted(set(DOTTED.findall(text))):
        if name.endswith((".json", ".py", ".md")):  # llama_megatron.json, the checkpoint's metadata file
            continue
        if not _resolves(name.rstrip(".")):
            errors.append(f"{page}: names a missing module or attribute: {name}")
    return errors


def _resolves(name: str) -> bool:
    """``llama_megatron.a.b.c``: the longest prefix that is a module of the package, then attributes of it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        if not _module_exists(module_name):
            continue
        obj = importlib.import_module(module_name)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _module_exists(module_name: str) -> bool:
    rel = os.path.join(ROOT, *module_name.split("."))
    return os.path.exists(rel + ".py") or os.path.exists(os.path.join(rel, "__init__.py"))


def _options(parser: argparse.ArgumentParser) -> tuple[set[str], dict[str, argparse.ArgumentParser]]:
    flags, subs = set(), {}
    for action in parser._actions:
        flags.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            subs.update(action.choices)
    return flags, subs


def commands(block: str) -> list[list[str]]:
    """Each ``llama-megatron`` / ``python -m llama_megatron`` / ``--module llama_megatron`` invocation of a bash
    block as [verb, args...] (``llama_megatron.train`` is the verb ``train``)."""
    out = []
    for line in block.replace("\\\n", " ").split("\n"):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, word in enumerate(words):
            rest = None
            if os.path.basename(word) == "llama-megatron":
                rest = words[i + 1:]
            elif word in ("-m", "--module") and i + 1 < len(words) and words[i + 1].startswith("llama_megatron"):
                module = words[i + 1]
                rest = (["train"] if module == "llama_megatron.train" else []) + words[i + 2:]
                if module not in ("llama_megatron", "llama_megatron.train"):
                    rest = [module] + words[i + 2:]  # an unknown module: reported as an unknown verb
            if rest is not None:
                out.append(rest)
                break
    return out


def _shell_blocks(text: str) -> list[str]:
    _, blocks = _prose_and_blocks(text)
    return [block for lang, block in blocks if lang in ("bash", "sh", "shell")]


def command_errors(page: str, text: str, root: str = ROOT) -> list[str]:
    errors = []
    for block in _shell_blocks(text):
        for argv in commands(block):
            shown = " ".join(argv)
            if not argv or argv[0] not in cli.VERBS:
                errors.append(f"{page}: unknown verb: {shown}")
                continue
            parser = cli.build_parser(argv[0])
            _, verbs = _options(parser)
            parser = verbs[argv[0]]
            flags, subs = _options(parser)
            args = argv[1:]
            if subs:
                if not args or args[0] not in subs:
                    errors.append(f"{page}: unknown subcommand: {shown}")
                    continue
                flags, _ = _options(subs[args[0]])
                args = args[1:]
            for j, arg in enumerate(args):
                if arg.startswith("--"):
                    flag, _, value = arg.partition("=")
                    if flag not in flags:
                        errors.append(f"{page}: unknown flag {flag}: {shown}")
                    if flag in ("--config", "--deepspeed_config"):
                        value = value or (args[j + 1] if j + 1 < len(args) else "")
                        errors += _config_path_errors(page, value, shown, root)
                    if flag == "--set":
                        value = value or (args[j + 1] if j + 1 < len(args) else "")
                        errors += _config_path_errors(page, value.partition("=")[2], shown, root)
    return errors


def _config_path_errors(page: str, value: str, shown: str, root: str) -> list[str]:
    if value.startswith(("configs/", "ds_configs/")) and not PLACEHOLDER.search(value):
        if not os.path.exists(os.path.join(root, value)):
            return [f"{page}: config path does not exist: {value} in {shown}"]
    return []


def config_errors(page: str, text: str) -> list[str]:
    """Every ``train`` / ``evaluate`` / ``estimate`` command of a bash block whose ``--config`` is a shipped file
    reads as a training config with its ``--set`` overrides applied (a key renamed or removed since fails here);
    files the page's earlier commands make (a converted model's config) are not looked for."""
    from llama_megatron.errors import LlamaMegatronError
    from llama_megatron.training.config import TrainingConfig

    errors = []
    for block in _shell_blocks(text):
        for argv in commands(block):
            if not argv or argv[0] not in ("train", "evaluate", "estimate") or "--config" not in argv:
                continue
            config = argv[argv.index("--config") + 1]
            overrides = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--set"]
            if PLACEHOLDER.search(config) or not os.path.isfile(os.path.join(ROOT, config)):
                continue
            cwd = os.getcwd()
            try:
                os.chdir(ROOT)
                TrainingConfig.from_file(config, overrides)
            except LlamaMegatronError as exc:
                if not re.search(r"not found|does not exist|no such", str(exc)):  # made by an earlier command
                    errors.append(f"{page}: {' '.join(argv)}: {exc}")
            finally:
                os.chdir(cwd)
    return errors


def convention_errors(page: str, text: str) -> list[str]:
    """One way to write the virtualenv's commands on every page: bare (``llama-megatron``, ``deepspeed``, with the
    virtualenv active: docs/command-line.md says so), never ``.venv/bin/...`` in a command block."""
    return [f"{page}: .venv/bin/ in a command block (write the bare command): {line.strip()}"
            for block in _shell_blocks(text) for line in block.split("\n")
            if ".venv/bin/" in line.split("#")[0] and not line.strip().startswith("source .venv/bin/activate")]


def layout_errors(text: str, root: str = ROOT) -> list[str]:
    """docs/layout.md's trees: every ``name.py`` a row names exists under that row's folder (a top-level row
    ``llama_megatron/x/`` or ``data/``, or an indented sub-folder row ``  sft/`` of the last top-level one; its
    continuation lines belong to it), so the map names no file that has moved or gone."""
    _, blocks = _prose_and_blocks(text)
    errors, top, folder = [], root, root
    for line in [line for _, body in blocks for line in body.split("\n")]:
        first, indent = (line.split() or [""])[0].rstrip(","), len(line) - len(line.lstrip())
        if first and indent == 0:  # a top-level row: a folder, or files of one
            top = folder = os.path.join(root, first if first.endswith("/") else os.path.dirname(first))
        elif first.endswith("/") and indent <= 4:  # a sub-folder row of the last top-level folder
            folder = os.path.join(top, first)
        for name in re.findall(r"(?<![\w./-])(\w+\.py)\b", line):
            if not any(name in files for _, _, files in os.walk(folder)):
                errors.append(f"docs/layout.md: {name} is not under {os.path.relpath(folder, root)}")
    return errors


def test_the_layout_tree_names_files_that_exist(tmp_path) -> None:
    assert layout_errors(open(os.path.join(ROOT, "docs", "layout.md"), encoding="utf-8").read()) == []
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("")
    tree = ("```\npkg/        a.py (the first), b.py\n  sub/       b.py, a.py\n                continued: c.py\n"
            "pkg/a.py    the module\n```\n")
    assert layout_errors(tree, str(tmp_path)) == ["docs/layout.md: a.py is not under pkg/sub",
                                                  "docs/layout.md: c.py is not under pkg/sub"]


@pytest.mark.parametrize("page", PAGES)
def test_links_paths_and_commands(page: str) -> None:
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    errors = (link_errors(page, text) + path_errors(page, text) + command_errors(page, text)
              + config_errors(page, text) + convention_errors(page, text))
    assert not errors, "\n".join(errors)


def test_the_checker_fails_on_rot(tmp_path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A `code` heading, too\n")
    good = "See [other](other.md), [its heading](other.md#a-code-heading-too) and [mine](#mine).\n\n# Mine\n"
    assert link_errors("docs/page.md", good, str(tmp_path)) == []
    bad = "[gone](missing.md) [no heading](other.md#nope) [no own heading](#nope) `[in code](missing.md)`\n"
    assert link_errors("docs/page.md", bad, str(tmp_path)) == [
        "docs/page.md: link to a missing file: missing.md",
        "docs/page.md: link to a missing heading: other.md#nope",
        "docs/page.md: link to a missing heading: #nope",
    ]
    assert path_errors("p.md", "see `scripts/gone.sh`, `configs/pretrain/X.json` and training/loop.py") == [
        "p.md: names a missing file: scripts/gone.sh",
        "p.md: names a missing module: training/loop.py (under llama_megatron/)",
    ]
    assert path_errors("p.md", "`llama_megatron.training.loop` and llama_megatron.training.run.loop") == [
        "p.md: names a missing module or attribute: llama_megatron.training.loop"]
    block = ("```bash\nllama-megatron trian --config configs/pretrain/tiny-cpu.json\n"
             "deepspeed --num_gpus 2 --module llama_megatron.train --confg configs/pretrain/tiny-cpu.json \\\n"
             "    --set model=configs/models/nope.json   # a comment --flag\n"
             "llama-megatron convert hf-to-megatron --hf-dir A --output B --tp 2 --pp 2\n"
             "llama-megatron convert hf-to-hf --input A\n```\n")
    assert command_errors("p.md", block) == [
        "p.md: unknown verb: trian --config configs/pretrain/tiny-cpu.json",
        "p.md: unknown flag --confg: train --confg configs/pretrain/tiny-cpu.json --set model=configs/models/nope.json",
        "p.md: config path does not exist: configs/models/nope.json in "
        "train --confg configs/pretrain/tiny-cpu.json --set model=configs/models/nope.json",
        "p.md: unknown subcommand: convert hf-to-hf --input A",
    ]
    configs = ("```bash\ndeepspeed --num_gpus 4 --module llama_megatron.train --config configs/pretrain/tiny-cpu.json "
               "--set train.stpes=3\n.venv/bin/llama-megatron estimate --config configs/pretrain/tiny-cpu.json\n```\n")
    assert config_errors("p.md", configs) == [
        "p.md: train --config configs/pretrain/tiny-cpu.json --set train.stpes=3: unknown keys in 'train': stpes"]
    assert convention_errors("p.md", configs) == [
        "p.md: .venv/bin/ in a command block (write the bare command): .venv/bin/llama-megatron estimate --config "
        "configs/pretrain/tiny-cpu.json"]
    assert slug("Fine-tuning recipes: from a Hugging Face checkpoint to a generated answer") == \
        "fine-tuning-recipes-from-a-hugging-face-checkpoint-to-a-generated-answer"
    assert slug("The `.bin` / `.idx` format (`indexed_dataset.py`)") == "the-bin--idx-format-indexed_datasetpy"
