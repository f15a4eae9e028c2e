"""A quiet start-up: torch's all_gather_into_tensor deprecation (DeepSpeed's calls) and DeepSpeed's
PipelineModule prints (seed settings, every stage's layers) are dropped at default verbosity, kept with
LLAMA_MEGATRON_VERBOSE=1; our own lines pass through."""

from __future__ import annotations

import warnings

from llama_megatron import quiet

DEEPSPEED_LINES = ("SEED_LAYERS=False BASE_SEED=1234 SEED_FN=None\n"
                   "Using topology: {ProcessCoord(pipe=0, data=0, model=0): 0, ProcessCoord(pipe=1, data=0, model=0): 1}\n"
                   "stage=0 layers=3\n     0: EmbeddingPipe\n     1: DecoderLayerPipe\n"
                   "stage=1 layers=2\n     3: FinalNormPipe\n    34: LMHeadPipe\n  loss: CausalLMLoss\n")


def _printed(capsys) -> str:
    with quiet.without_deepspeed_prints():
        print(DEEPSPEED_LINES, end="")
        print("our own line: kernels reference")
    return capsys.readouterr().out


def test_deepspeed_prints_dropped_ours_kept(capsys, monkeypatch) -> None:
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    assert _printed(capsys) == "our own line: kernels reference\n"
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    assert _printed(capsys) == DEEPSPEED_LINES + "our own line: kernels reference\n"


def test_all_gather_into_tensor_deprecation_filtered(monkeypatch) -> None:
    message = ("`torch.distributed.all_gather_into_tensor` is deprecated. "
               "Please use `torch.distributed.all_gather_single` instead.")
    for env, expected in (("", 0), ("1", 1)):
        monkeypatch.setenv(quiet.VERBOSE_ENV, env)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet.quiet_library_warnings()
            warnings.warn(message, FutureWarning, stacklevel=1)
            warnings.warn("another FutureWarning", FutureWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == [message] * expected + ["another FutureWarning"]
