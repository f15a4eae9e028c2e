"""Our lm-eval model (``llama_megatron``) in lm-eval's registry in every Python process of an environment this
package is installed in, so that a plain ``lm_eval --model llama_megatron`` and ``lm_eval.simple_evaluate(
model="llama_megatron")`` find it as they find ``hf``.

lm-eval 0.4.13 looks models up only in its own registry and reads no plugin entry points (EleutherAI/lm-evaluation-
harness#1457, #3282). So the package installs ``llama_megatron_lm_eval.pth`` into site-packages (``setup.py``),
whose one line imports this module as the interpreter starts. It imports nothing, ours or lm-eval's: it puts a
finder in front of ``sys.meta_path`` that waits for ``lm_eval.models`` and, once that module has run, registers the
model as lm-eval registers its own, by the class's import path (a placeholder: our backend, torch and the rest load
only when lm-eval looks the model up). A process that never imports lm-eval's models pays a string comparison per
import; the finder leaves ``sys.meta_path`` at that import, and lm-eval's module keeps its own loader.

Why ``lm_eval.models`` and not the registry: lm-eval's models are not in its registry until ``lm_eval.models`` is
imported (its import registers their placeholders), and ``get_model`` imports it only while the registry is empty
(``lm_eval/api/registry.py``, ``get_model``: ``if len(model_registry) == 0: import lm_eval.models``). An entry
made as the registry is imported (as this module's first version did) leaves it non-empty, so lm-eval never loads
its own and ``get_model("hf")`` fails ("no model for this name found! Supported model names: llama_megatron"). Ours
entering right after lm-eval's own leaves the registry empty until lm-eval fills it, so lm-eval does what it does
without us, for every caller, and lists ours beside its own. (A caller that registers a model of its own before its
first lookup gets none of lm-eval's models, lm-eval's doing, and not ours either; ``import lm_eval.models`` first
brings both.)
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing is not imported at start-up either (8 ms; importlib.abc 17 ms)
if TYPE_CHECKING:
    import types
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from typing import Any

MODEL_NAME = "llama_megatron"
MODEL_CLASS = "llama_megatron.training.run.lm_harness:LlamaMegatronLM"
REGISTRY_MODULE = "lm_eval.api.registry"
MODELS_MODULE = "lm_eval.models"  # whose import registers lm-eval's own models: ours is registered after it


def register() -> None:
    """The model's placeholder in lm-eval's model registry (its ``Registry`` of 0.4.10 on): lm-eval's lookup imports
    the class, whose own ``@register_model`` then replaces the placeholder with it, as lm-eval's models do."""
    import importlib  # at lm-eval's import only (lm_eval.models has imported the registry: nothing new loads)

    registry = getattr(importlib.import_module(REGISTRY_MODULE), "model_registry", None)
    if registry is not None and hasattr(registry, "register") and MODEL_NAME not in registry:
        registry.register(MODEL_NAME, target=MODEL_CLASS)


class _RegisteringLoader:
    """The models module's own loader (everything it answers, ``get_source`` included), then :func:`register` once
    the module has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:  # the module keeps its own loader, as it has without us
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._loader
        register()


class ModelsWatcher:
    """A ``sys.meta_path`` finder that finds nothing itself: at the import of lm-eval's models module it asks the
    finders after it and wraps the loader they return."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> ModuleSpec | None:
        if fullname != MODELS_MODULE:
            return None
        uninstall()
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """What the ``.pth`` line runs: registers at once where lm-eval's models module is already imported, else watches
    for it. Twice is once."""
    if MODELS_MODULE in sys.modules:
        register()
    elif not any(isinstance(finder, ModelsWatcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, ModelsWatcher())


def uninstall() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, ModelsWatcher)]
