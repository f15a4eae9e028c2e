"""Our lm-eval model in lm-eval's registry wherever the package is installed (llama_megatron/lm_eval_registration.py,
the ``.pth`` line setup.py installs): in this environment's editable install and in a wheel built from the tree,
a fresh interpreter that imports lm-eval's registry finds ``llama_megatron`` as a placeholder for our class, with
nothing of ours imported beyond the registration module. (tests/test_training_lm_eval.py runs lm-eval's plain
console script on a checkpoint.)"""

from __future__ import annotations

import importlib
import importlib.util
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
# the repository's setup.py (its .pth name and line), read from its path: the repository root stays off sys.path
_spec = importlib.util.spec_from_file_location("package_setup", os.path.join(ROOT, "setup.py"))
package_setup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(package_setup)

PROBE = """
import sys
{prelude}
import lm_eval.api.registry as registry
watching = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "RegistryWatcher"]
ours = sorted(m for m in sys.modules if m.startswith("llama_megatron"))
print(registry.model_registry._objs.get("llama_megatron"), watching, ours)
"""


def _probe(prelude: str = "", flags: tuple[str, ...] = ()) -> str:
    done = subprocess.run([sys.executable, *flags, "-c", PROBE.format(prelude=prelude)], capture_output=True, text=True,
                          cwd="/", env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


EXPECTED = f"{lm_eval_registration.MODEL_CLASS} [] ['llama_megatron', 'llama_megatron.lm_eval_registration']"


def test_the_installed_package_registers_the_model_at_start_up() -> None:
    pth = os.path.join(sysconfig.get_paths()["purelib"], package_setup.PTH_NAME)
    assert open(pth, encoding="utf-8").read() == package_setup.PTH_LINE
    assert _probe() == EXPECTED
    # the placeholder names our lm-eval model
    module, name = lm_eval_registration.MODEL_CLASS.split(":")
    from lm_eval.api.model import LM

    assert issubclass(getattr(importlib.import_module(module), name), LM)


def test_a_built_wheel_carries_the_registration(tmp_path) -> None:
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
    probe = _probe(f"sys.path.append({sysconfig.get_paths()['purelib']!r})\n"
                   f"import site; site.addsitedir({site_dir!r})\n"
                   f"assert sys.modules['llama_megatron'].__file__.startswith({site_dir!r})", flags=("-S",))
    assert probe == EXPECTED


def test_install_registers_at_once_when_the_registry_is_loaded_and_watches_once(monkeypatch) -> None:
    import lm_eval.api.registry as registry

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    lm_eval_registration.install()  # the registry is imported here: nothing to watch for
    assert lm_eval_registration.MODEL_NAME in registry.model_registry
    assert not any(isinstance(f, lm_eval_registration.RegistryWatcher) for f in sys.meta_path)
    monkeypatch.delitem(sys.modules, lm_eval_registration.REGISTRY_MODULE)
    lm_eval_registration.install()
    lm_eval_registration.install()
    assert sum(isinstance(f, lm_eval_registration.RegistryWatcher) for f in sys.meta_path) == 1
    lm_eval_registration.uninstall()
    assert not any(isinstance(f, lm_eval_registration.RegistryWatcher) for f in sys.meta_path)
