"""The weight watch (compilecore/weight_watch.py) sees every edit of a model's weights
before the next step, including writes through `.data`, which torch gives a version
counter of its own: the watch's parameters share theirs. The oracle is the watch's answer
and the derived copies' state (passes/ops/derived.py) after each edit path, on a real
module; the engine-level check (graphs, packed copies and the head's screen against a new
engine on the edited weights) is tests/test_cpu_graph.py's."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from compilecore.weight_watch import WatchedParameter, WeightWatch
from passes.ops import derived


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4, bias=False))
    return model.requires_grad_(False)


def _new(p: torch.Tensor) -> torch.Tensor:
    return torch.randn(p.shape)


EDITS = {
    ".data.copy_": lambda m: m[0].weight.data.copy_(_new(m[0].weight)),
    ".data.mul_": lambda m: m[1].weight.data.mul_(0.5),
    ".data[row] =": lambda m: m[0].bias.data.__setitem__(2, 7.0),
    ".data view .zero_": lambda m: m[0].weight.data[:, :3].zero_(),
    ".data =": lambda m: setattr(m[1].weight, "data", _new(m[1].weight)),
    "copy_": lambda m: m[0].weight.copy_(_new(m[0].weight)),
    "arithmetic": lambda m: m[0].bias.add_(1),
    "load_state_dict": lambda m: m.load_state_dict({k: _new(v) for k, v in m.state_dict().items()}),
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(
        {k: _new(v) for k, v in m.state_dict().items()}, assign=True
    ),
    "module.weight = Parameter": lambda m: setattr(
        m[1], "weight", torch.nn.Parameter(_new(m[1].weight), requires_grad=False)
    ),
}


def _copies(model: torch.nn.Module) -> None:
    """A copy made from each weight (as the packed layouts and the head's screen are)."""
    for p in model.parameters():
        derived.derived(p, "test_copy", lambda t: t.clone())


@pytest.mark.parametrize("path", EDITS)
def test_every_edit_path_is_seen_before_the_next_step(path):
    """Each edit path, on weights that copies were made from: the watch reports it before
    the next step, once; after copies of whatever the model holds now are made, a `.data`
    write to those is reported too."""
    model = _model()
    watch = WeightWatch(model)
    _copies(model)
    assert not watch.check()
    with torch.no_grad():
        EDITS[path](model)
    assert watch.check(), path
    assert not watch.check()  # seen once
    assert all(type(p) is WatchedParameter for p in model.parameters())
    _copies(model)  # made again (current): nothing new to report
    assert not watch.check()
    model[1].weight.data.mul_(3)
    assert watch.check(), f"a .data write after {path}"


def test_a_write_in_place_with_no_copy_is_left_to_the_graphs():
    """Graphs read weights by address, so a weight written in place that no copy was made
    from needs no graph recorded again (the engine-level check that tokens follow every
    edit is tests/test_cpu_graph.py's); its address moving does."""
    model = _model()
    watch = WeightWatch(model)
    with torch.no_grad():
        model[0].weight.copy_(_new(model[0].weight))
        model[1].weight.data.mul_(2)
    assert not watch.check()
    model[1].weight.data = _new(model[1].weight)
    assert watch.check()


def test_a_data_write_makes_copies_of_the_weight_again():
    """The packed copies and the head's screen are keyed by the weight's version counter:
    a `.data` write to a watched parameter moves it, with no `mark_weights_changed`."""
    model = _model()
    WeightWatch(model)
    w = model[0].weight
    made = []
    derived.derived(w, "test_copy", lambda t: made.append(1) or t.clone())
    w.data.mul_(2)
    assert derived.current(w, "test_copy") is None  # stale: not served
    assert torch.equal(derived.derived(w, "test_copy", lambda t: made.append(1) or t.clone()), w)
    assert len(made) == 2


def test_torchs_own_data_alias_is_unseen_without_the_watch():
    """The control: a plain parameter's `.data` write moves no counter (what the watch's
    class is for)."""
    p = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    before = p._version
    p.data.mul_(2)
    assert p._version == before


def test_a_watched_parameter_still_behaves_as_a_parameter():
    model = _model()
    WeightWatch(model)
    p = model[0].weight
    alias = p.data
    assert type(alias) is torch.Tensor and not alias.requires_grad
    assert alias.data_ptr() == p.data_ptr()
    assert type(copy.deepcopy(model)[0].weight) is WatchedParameter
    assert all(type(t) is torch.Tensor for t in model.state_dict().values())
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model(torch.ones(2, 6)), model[1](model[0](torch.ones(2, 6))))


def test_someone_elses_parameter_class_is_left_alone():
    class Mine(torch.nn.Parameter):
        pass

    model = _model()
    model[1].weight = Mine(model[1].weight.detach().clone(), requires_grad=False)
    WeightWatch(model)
    assert type(model[1].weight) is Mine and type(model[0].weight) is WatchedParameter
