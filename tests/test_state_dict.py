"""Pipe.state_dict / load_state_dict and fastpipe.state_dict in one process
(the distributed save and resume are in test_mesh)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import fastpipe
from fastpipe import Pipe
from tests import models


def _bn_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()


def test_entries_under_the_model_names_each_tensor_once():
    model = models.tied_embedding_model()
    pipe = Pipe(model, chunks=2, devices=["cpu", "cpu"], balance=[3, 3])
    sd = pipe.state_dict()
    assert list(sd) == list(fastpipe.state_dict(model))
    assert "4.weight" not in sd and "0.weight" in sd  # the head's weight is the embedding's
    assert set(model.state_dict()) - set(sd) == {"4.weight"}
    for name, t in sd.items():
        assert t.data_ptr() == model.state_dict()[name].data_ptr() and not t.requires_grad
    assert isinstance(pipe.state_dict(keep_vars=True)["1.weight"], nn.Parameter)
    assert [id(p) for p in pipe.parameters()] == [id(p) for p in model.parameters()]
    with pytest.raises(TypeError, match="keyword arguments only"):
        pipe.state_dict({})
    pipe.close()


def test_buffers_are_saved_and_loaded():
    model, source = _bn_model(), _bn_model(seed=1)
    source[1].running_mean.fill_(0.5)
    pipe = Pipe(model, chunks=2, devices=["cpu", "cpu"], balance=[2, 1])
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(pipe.state_dict())
    pipe.load_state_dict(source.state_dict())
    for name, t in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], t, rtol=0, atol=0)
    pipe.close()


def test_load_takes_any_name_of_a_shared_tensor_and_checks_keys():
    model, source = models.tied_embedding_model(), models.tied_embedding_model(seed=1)
    pipe = Pipe(model, chunks=2, devices=["cpu", "cpu"], balance=[3, 3])
    full = source.state_dict()  # both names of the tied weight
    result = pipe.load_state_dict(full)
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch.testing.assert_close(model[4].weight, source[0].weight, rtol=0, atol=0)
    assert model[4].weight is model[0].weight  # still tied
    # The tied weight under its second name only.
    alias = {n: t for n, t in models.tied_embedding_model(seed=2).state_dict().items() if n != "0.weight"}
    pipe.load_state_dict(alias)
    torch.testing.assert_close(model[0].weight, alias["4.weight"], rtol=0, atol=0)

    missing = {n: t for n, t in full.items() if n != "3.bias"}
    with pytest.raises(RuntimeError, match='Missing key.*"3.bias"'):
        pipe.load_state_dict(missing)
    with pytest.raises(RuntimeError, match='Unexpected key.*"9.weight"'):
        pipe.load_state_dict({**full, "9.weight": torch.zeros(1)})
    result = pipe.load_state_dict({**missing, "9.weight": torch.zeros(1)}, strict=False)
    assert result.missing_keys == ["3.bias"] and result.unexpected_keys == ["9.weight"]
    with pytest.raises(RuntimeError, match="size mismatch"):
        pipe.load_state_dict({**full, "1.weight": torch.zeros(2, 2, dtype=torch.float64)})
    # assign=True would put a new object in one of the tie's places only.
    with pytest.raises(ValueError, match=r"assign=True\) would untie 0\.weight and 4\.weight"):
        pipe.load_state_dict(full, assign=True)
    assert model[4].weight is model[0].weight
    pipe.close()


def test_checkpoint_of_a_local_pipe_loads_into_the_plain_model(tmp_path):
    """DCP in one process, no process group: the Pipe saves, the plain model loads."""
    model = models.tied_embedding_model()
    pipe = Pipe(model, chunks=2, devices=["cpu", "cpu"], balance=[3, 3])
    x, y = torch.randint(0, 11, (4, 3)), torch.randn(4, 3, 3, dtype=torch.float64)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(x, y, nn.functional.mse_loss)
    opt.step()
    dcp.save({"model": pipe.state_dict()}, checkpoint_id=str(tmp_path))
    plain = models.tied_embedding_model(seed=3)
    dcp.load({"model": fastpipe.state_dict(plain)}, checkpoint_id=str(tmp_path))
    for name, t in model.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], t, rtol=0, atol=0)
    pipe.close()


def test_mesh_is_checked(tmp_path):
    with pytest.raises(TypeError, match="DeviceMesh, got list"):
        Pipe(models.mlp(), chunks=2, mesh=[[0, 1]])
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        with pytest.raises(ValueError, match=r"dimensions \('dp', 'pp'\).*\('tp',\)"):
            Pipe(models.mlp(), chunks=2, mesh=mesh)
        pp = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
        with pytest.raises(ValueError, match="group= or mesh=, not both"):
            Pipe(models.mlp(), chunks=2, mesh=pp, group=dist.group.WORLD)
        pipe = Pipe(models.mlp(), chunks=2, mesh=pp, shm=False)  # one rank, no replicas
        assert pipe.dp_group is None and pipe.distributed
        x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
        pipe.step(x, y, nn.functional.mse_loss)
        pipe.close()
    finally:
        dist.destroy_process_group()
