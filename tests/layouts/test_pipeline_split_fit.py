"""Pipeline parallelism for a model that is not an nn.Sequential, through fit() under `ringtrain run`: a Hugging
Face Llama built from a config (4 decoder layers) cut into stages by the package's split
(``fit(pp_split=ringtrain.hf.decoder_stages)``: each stage runs the model's own layers and makes
the causal mask and rotary embeddings as ``LlamaModel`` does). At pp = 2 under 1F1B and at pp 2 x two stages a
rank (interleaved 1F1B, its sharded checkpoint exported by the model's own names) it trains as one worker does on
the same batches, and so do two such pipelines on four workers with FSDP2 over them: the loss at every step within rtol 1e-5, the closing evaluation alike, the parameters after the
run within 1e-5. A split that copies the model's layers, one that leaves a module out, and pp_split without a
pipeline are one line and exit 2.

Each case runs in the harness's ranks, as `ringtrain run SCRIPT --nproc N` runs it in its workers
(tests/fit/scripts.py: the numbers and the refusals are fit's own; issue 45). Every rank refuses a split alike, in
a line of its own: how `ringtrain run` relays such a line, exit 2, is test_tensor_parallel_fit.py's launched case."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_main
from tests.layouts.test_tensor_parallel_fit import STEPS, assert_refused_in_one_line, assert_same_run, fit_in_ranks, summary

PP = {"pp": 2, "pp_microbatches": 4}
INTERLEAVED = {"pp": 2, "pp_microbatches": 4, "stages_per_rank": 2, "pp_schedule": "interleaved_1f1b"}


# Its runs one after another in this process (a launched job's were all at once): on the shared 2-core machine at load
# 30-40 the pipeline file's four took over 300 s, the suite's limit (pyproject.toml); a hang still fails, at 600 s.
@pytest.mark.ranks
@pytest.mark.timeout(600)
def test_a_huggingface_llama_cut_by_the_users_split_function_trains_as_one_worker(tmp_path):
    runs = {"one": ("llama4", 1, {}), "pp": ("llama4_pp", 2, {"parallel": PP}),
            "interleaved": ("llama4_pp", 2, {"parallel": INTERLEAVED, "checkpoint": {"every_steps": STEPS,
                                                                                      "sharded": True}}),
            "fsdp_pp": ("llama4_pp", 4, {"parallel": PP, "comm": {"strategy": "fsdp"}})}
    for name, (case, nproc, sections) in runs.items():
        fit_in_ranks(tmp_path / name, case, nproc, **sections)
    assert_same_run(tmp_path / "pp", tmp_path / "one")
    done = summary(tmp_path / "pp")
    assert done["pp_microbatches_run"] == {"4": STEPS}
    # Each rank holds two of the four layers (the embeddings with the first, the norm and lm_head with the last).
    assert done["model_state_mb"] < 0.75 * summary(tmp_path / "one")["model_state_mb"]
    # Two such pipelines on four workers, FSDP2 sharding each stage over them (a user's stage is one FSDP2 unit).
    assert_same_run(tmp_path / "fsdp_pp", tmp_path / "one")
    assert summary(tmp_path / "fsdp_pp")["model_state_mb"] < 0.6 * done["model_state_mb"]
    # The interleaved run's sharded (DCP) checkpoint names every tensor as the model does: exported, it is the
    # unsplit model's state, as close to one worker's as the pipeline's own run.
    interleaved = tmp_path / "interleaved"
    exported = run_main("export", str(interleaved))  # reads the run directory: in this process
    assert exported.returncode == 0, exported.stderr
    split = load_file(interleaved / "model.safetensors")
    whole = torch.load(tmp_path / "one" / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)["model"]
    assert split.keys() == whole.keys()
    worst = max((split[k] - whole[k]).abs().max().item() for k in whole)
    print(f"interleaved, 4 stages of one layer: largest parameter difference from one worker {worst:.2e}")
    assert worst < 1e-5
    one = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "one" / "metrics.jsonl").read_text().splitlines())
           if r["type"] == "train"}
    mine = {r["step"]: r["loss"] for r in map(json.loads, (interleaved / "metrics.jsonl").read_text().splitlines())
            if r["type"] == "train"}
    assert mine.keys() == one.keys() and all(abs(mine[s] - one[s]) <= 1e-5 * abs(one[s]) for s in one)


@pytest.mark.ranks
def test_a_split_that_does_not_fit_is_one_line(tmp_path):
    cases = {"llama4_copying": ({"parallel": PP}, "stage 0 of pp_split uses a parameter of shape"),
             "llama4_leaving": ({"parallel": PP}, "no stage of pp_split holds model.norm.weight"),
             "llama4_pp": ({}, "fit(pp_split=...) cuts the model into pipeline stages, but parallel.pp is 1")}
    for case, (sections, words) in cases.items():
        ranks = fit_in_ranks(tmp_path / case, case, 2, refused=True, **sections)
        print(f"{case}: {ranks[0]['stderr'].strip()}")
        assert_refused_in_one_line(ranks, words)


@pytest.mark.unit
def test_a_pp_split_that_is_not_a_function_is_one_line():
    from ringtrain.errors import ConfigError
    from ringtrain.train.user_parts import UserParts
    from tests.layouts.tp_code import Tokens, llama4

    with pytest.raises(ConfigError, match=r"^pp_split must be a callable split\(model, stages\) returning the stage "
                                          r"modules in order, not dict$"):
        UserParts.checked(llama4, Tokens(4, seed=0), pp_split={"model.layers.0": 0})
