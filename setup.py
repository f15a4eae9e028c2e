"""The package's metadata is pyproject.toml's; this adds one file to what an install puts in site-packages:
``llama_megatron_lm_eval.pth``, whose line registers our lm-eval model with lm-eval in every Python process there
(llama_megatron/lm_eval_registration.py says why a start-up line and what it costs). setuptools has no setting for a
file beside the packages, so ``build_py`` writes it: into the build directory a wheel is made from, and for an
editable install (``pip install -e``) into the unpacked editable wheel, where setuptools puts what is not a module
of the project (its scripts and data)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "llama_megatron_lm_eval.pth"
PTH_LINE = "import llama_megatron.lm_eval_registration as registration; registration.install()\n"


class BuildPyWithRegistration(build_py):
    def run(self) -> None:
        super().run()
        into = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        os.makedirs(into, exist_ok=True)
        with open(os.path.join(into, PTH_NAME), "w", encoding="utf-8") as fh:
            fh.write(PTH_LINE)


if __name__ == "__main__":  # as setuptools runs it (tests/test_lm_eval_registration.py imports the names above)
    setup(cmdclass={"build_py": BuildPyWithRegistration})
