"""torchtitan support: path-style DCP checkpoint ids and the CheckpointManager's calls.

torchtitan is not installed (its dependencies pin another huggingface_hub than transformers'),
so these tests make the ``torch.distributed.checkpoint`` calls the way its ``CheckpointManager``
makes them: ``state_dict_saver.save(states, checkpoint_id=f"{folder}/step-{step}")`` of ``Stateful``
wrappers around ``get_model_state_dict`` / ``get_optimizer_state_dict`` (its ``ModelWrapper``
and ``OptimizersContainer``), a dataloader and a train state, resumed from the newest step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

import strata.dcp
from strata.client import Checkpointer
from strata.dcp import checkpoint_id_of, step_of_checkpoint_id
from strata.integrations import torchtitan as strata_titan
from tests.fixtures.resume import assert_same_weights, run, run_and_kill

pytestmark = pytest.mark.integration
SCRIPT = str(Path(__file__).with_name("titan_trainer.py"))


@pytest.mark.parametrize(
    ("checkpoint_id", "step"),
    [
        ("100", 100),
        (100, 100),
        ("step-100", 100),
        ("./outputs/checkpoint/step-100", 100),
        ("/mnt/ckpt/step-7/", 7),
        (Path("outputs/checkpoint/step-0"), 0),
        ("step-x", None),
        ("checkpoint/step-100/model", None),
        ("s3://bucket/run", None),
        ("", None),
        (-1, None),
        (True, None),
    ],
)
def test_checkpoint_ids_map_to_steps(checkpoint_id: str | int | Path, step: int | None) -> None:
    assert step_of_checkpoint_id(checkpoint_id) == step


def test_checkpoint_id_of_is_torchtitans_layout() -> None:
    assert checkpoint_id_of(12, "outputs/checkpoint") == "outputs/checkpoint/step-12"
    assert step_of_checkpoint_id(checkpoint_id_of(12, "outputs/checkpoint")) == 12


def _model_and_optim(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 6)).pow(2).mean().backward()
    opt.step()
    return model, opt


# A single process without torch.distributed: DCP says it assumes a single-process save.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_path_style_ids_round_trip_through_dcp(shm_dir: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = "outputs/checkpoint"
    model, opt = _model_and_optim(0)
    msd, osd = get_state_dict(model, opt)
    with Checkpointer(job_id="ns.titan", ram_dir=shm_dir / "ram", rank=0, world_size=1) as c:
        # What the manager's dcp_save does, with Strata's writer: the id names the step.
        state_dict_saver.save(
            {"model": msd, "optimizer": osd},
            storage_writer=strata.dcp.StorageWriter(checkpointer=c),
            checkpoint_id=f"{folder}/step-30",
        )
        assert c.all_steps("ram") == [30]
        # A DCP id for another storage is refused, never written as some step.
        with pytest.raises(ValueError, match="step-<N>"):
            state_dict_saver.save(
                {"model": msd},
                storage_writer=strata.dcp.StorageWriter(checkpointer=c),
                checkpoint_id="s3://bucket/run",
            )
        assert c.all_steps("ram") == [30]
        assert strata_titan.find_load_step(c) == 30

    model2, opt2 = _model_and_optim(1)
    msd2, osd2 = get_state_dict(model2, opt2)
    with Checkpointer(job_id="ns.titan", ram_dir=shm_dir / "ram", rank=0, world_size=1) as c2:
        sd: dict[str, Any] = {"model": msd2, "optimizer": osd2}
        state_dict_loader.load(
            sd,
            storage_reader=strata.dcp.StorageReader(checkpointer=c2),
            checkpoint_id=f"{folder}/step-30",
        )
        set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


def test_find_load_step_is_minus_one_without_a_checkpoint(shm_dir: Path) -> None:
    with Checkpointer(job_id="ns.none", ram_dir=shm_dir / "ram", rank=0, world_size=1) as c:
        assert strata_titan.find_load_step(c) == -1


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_sigkilled_trainer_resumes_bit_identically(
    shm_dir: Path, tmp_path: Path, async_mode: str
) -> None:
    ref, out = tmp_path / "ref.pt", tmp_path / "out.pt"
    common = ["--ram", str(shm_dir / "ram-ref"), "--async-mode", async_mode]
    run([SCRIPT, *common, "--out", str(ref)])
    args = ["--ram", str(shm_dir / "ram"), "--async-mode", async_mode]
    run_and_kill([SCRIPT, *args, "--out", str(out), "--pause-at", "13"], tmp_path / "progress")
    assert not out.exists()
    done = run([SCRIPT, *args, "--out", str(out)])
    assert "resumed from step 12" in done.stdout  # saves every 4 steps: 0, 4, 8, 12
    assert_same_weights(ref, out)
