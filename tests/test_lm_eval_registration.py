"""Our lm-eval model in lm-eval's registry wherever the package is installed (llama_megatron/lm_eval_registration.py,
the ``.pth`` line setup.py installs), and lm-eval's own models untouched: in this environment's editable install and
in a wheel built from the tree, a fresh interpreter whose first call into lm-eval is ``get_model("hf")`` (what
``lm_eval run --model hf`` does) gets ``HFLM``, and lm-eval's registry lists every model it lists without us, each
under the same import path, plus ``llama_megatron`` as a placeholder for our class, nothing of ours imported beyond
the registration module. (tests/test_training_lm_eval.py runs lm-eval's plain console script on a checkpoint.)"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from llama_megatron import lm_eval_registration

pytestmark = pytest.mark.launched
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PURELIB = sysconfig.get_paths()["purelib"]  # this environment's site-packages: lm-eval's, and our .pth
# the repository's setup.py (its .pth name and line), read from its path: the repository root stays off sys.path
_spec = importlib.util.spec_from_file_location("package_setup", os.path.join(ROOT, "setup.py"))
package_setup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(package_setup)

# the prelude (where lm-eval and we come from), then lm-eval asked for a model before anything else; what its
# registry then lists (each entry as its import path, loaded or not) and what is imported
PROBE = """
import json, sys
{prelude}
from lm_eval.api import registry

asked = registry.get_model({name!r})


def named(entry):
    return entry if isinstance(entry, str) else f"{{entry.__module__}}:{{entry.__name__}}"


print(json.dumps({{
    "asked": named(asked), "models": {{name: named(entry) for name, entry in registry.model_registry.items()}},
    "models_loader": type(sys.modules["lm_eval.models"].__loader__).__name__,
    "watching": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "ModelsWatcher"],
    "ours": sorted(m for m in sys.modules if m.startswith("llama_megatron"))}}))
"""


def _probe(name: str, prelude: str = "", flags: tuple[str, ...] = ()) -> dict:
    done = subprocess.run([sys.executable, *flags, "-c", PROBE.format(prelude=prelude, name=name)],
                          capture_output=True, text=True, cwd="/", env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference() -> dict:
    """lm-eval without us: an interpreter that runs no start-up line (-S: neither our editable install nor our
    .pth), lm-eval importable from this environment's site-packages. It asks for ``dummy``, lm-eval's one model that
    loads without torch (4 s of CPU less); which model is asked first changes nothing that is listed."""
    alone = _probe("dummy", f"sys.path.append({PURELIB!r})", flags=("-S",))
    assert alone["ours"] == [] and "hf" in alone["models"] and lm_eval_registration.MODEL_NAME not in alone["models"]
    return alone


def _assert_beside_lm_evals_own(probe: dict, reference: dict) -> None:
    """``hf`` loaded; lm-eval's models as without us, ours beside them (a placeholder: nothing of ours loaded but
    the registration); the watcher gone and lm-eval's module left with its own loader."""
    assert probe["asked"] == "lm_eval.models.huggingface:HFLM"
    assert probe["models"] == {**reference["models"], lm_eval_registration.MODEL_NAME: lm_eval_registration.MODEL_CLASS}
    assert probe["models_loader"] == reference["models_loader"] and probe["watching"] == []
    assert probe["ours"] == ["llama_megatron", "llama_megatron.lm_eval_registration"]


def test_the_installed_package_registers_the_model_beside_lm_evals_own(reference) -> None:
    pth = os.path.join(PURELIB, package_setup.PTH_NAME)
    assert open(pth, encoding="utf-8").read() == package_setup.PTH_LINE
    _assert_beside_lm_evals_own(_probe("hf"), reference)
    # the placeholder names our lm-eval model
    module, name = lm_eval_registration.MODEL_CLASS.split(":")
    from lm_eval.api.model import LM

    assert issubclass(getattr(importlib.import_module(module), name), LM)


def test_a_built_wheel_carries_the_registration(reference, tmp_path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    shutil.copytree(os.path.join(ROOT, "llama_megatron"), source / "llama_megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(source)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = os.listdir(tmp_path / "dist")
    with zipfile.ZipFile(tmp_path / "dist" / wheel) as archive:
        assert archive.read(package_setup.PTH_NAME).decode() == package_setup.PTH_LINE
        record = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))).decode()
        assert f"\n{package_setup.PTH_NAME}," in f"\n{record}"  # uninstalled with the package
        archive.extractall(tmp_path / "site")
    # the wheel's own .pth, processed as site-packages' are, in an interpreter without this environment's start-up
    # lines (-S: neither our editable install nor its registration), lm-eval importable from its site-packages
    site_dir = str(tmp_path / "site")
    probe = _probe("hf", f"sys.path.append({PURELIB!r})\n"
                         f"import site; site.addsitedir({site_dir!r})\n"
                         f"assert sys.modules['llama_megatron'].__file__.startswith({site_dir!r})", flags=("-S",))
    _assert_beside_lm_evals_own(probe, reference)


def test_install_registers_at_once_when_lm_evals_models_are_loaded_and_watches_once(monkeypatch) -> None:
    import lm_eval.models  # noqa: F401  (lm-eval's models registered: ours may be at once)
    from lm_eval.api.registry import model_registry

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(model_registry, "_objs", {name: entry for name, entry in model_registry.items()
                                                  if name != lm_eval_registration.MODEL_NAME})
    lm_eval_registration.install()  # lm-eval's models module is imported here: nothing to watch for
    assert model_registry._objs[lm_eval_registration.MODEL_NAME] == lm_eval_registration.MODEL_CLASS
    assert not any(isinstance(f, lm_eval_registration.ModelsWatcher) for f in sys.meta_path)
    monkeypatch.delitem(sys.modules, lm_eval_registration.MODELS_MODULE)
    lm_eval_registration.install()
    lm_eval_registration.install()
    assert sum(isinstance(f, lm_eval_registration.ModelsWatcher) for f in sys.meta_path) == 1
    lm_eval_registration.uninstall()
    assert not any(isinstance(f, lm_eval_registration.ModelsWatcher) for f in sys.meta_path)
