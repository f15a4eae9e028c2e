"""Our lm-eval model (``llama_megatron``) in lm-eval's registry in every Python process of an environment this
package is installed in, so that a plain ``lm_eval --model llama_megatron`` and ``lm_eval.simple_evaluate(
model="llama_megatron")`` find it as they find ``hf``.

lm-eval 0.4.13 looks models up only in its own registry and reads no plugin entry points (EleutherAI/lm-evaluation-
harness#1457, #3282). So the package installs ``llama_megatron_lm_eval.pth`` into site-packages (``setup.py``),
whose one line imports this module as the interpreter starts. It imports nothing, ours or lm-eval's: it puts a
finder in front of ``sys.meta_path`` that waits for ``lm_eval.api.registry`` and, once that module has run,
registers the model there as lm-eval registers its own, by the class's import path (a placeholder: our backend,
torch and the rest load only when lm-eval looks the model up). A process that never imports lm-eval pays a string
comparison per import; the finder leaves ``sys.meta_path`` at the registry's import.
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


def register(registry_module: types.ModuleType) -> None:
    """The model's placeholder in lm-eval's model registry (its ``Registry`` of 0.4.10 on): lm-eval's lookup imports
    the class, whose own ``@register_model`` then replaces the placeholder with it, as lm-eval's models do."""
    registry = getattr(registry_module, "model_registry", None)
    if registry is not None and hasattr(registry, "register") and MODEL_NAME not in registry:
        registry.register(MODEL_NAME, target=MODEL_CLASS)


class _RegisteringLoader:
    """The registry module's own loader (everything it answers, ``get_source`` included), then :func:`register` on
    the module it made."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        register(module)


class RegistryWatcher:
    """A ``sys.meta_path`` finder that finds nothing itself: at the import of lm-eval's registry it asks the finders
    after it and wraps the loader they return."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> ModuleSpec | None:
        if fullname != REGISTRY_MODULE:
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
    """What the ``.pth`` line runs: registers at once where lm-eval's registry is already imported, else watches for
    it. Twice is once."""
    if REGISTRY_MODULE in sys.modules:
        register(sys.modules[REGISTRY_MODULE])
    elif not any(isinstance(finder, RegistryWatcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, RegistryWatcher())


def uninstall() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, RegistryWatcher)]
