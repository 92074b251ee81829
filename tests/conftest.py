"""Shared fixtures: compiled layers are built once per session (and reused from the build cache)."""
import functools

import pytest
import torch

import substation
from substation.config import load_config
from substation.reference import ReferenceEncoderLayer

NO_DROPOUT = {"attention": 0.0, "hidden": 0.0, "activation": 0.0}


@functools.lru_cache(maxsize=None)
def _compiled(config):
    from substation.pipeline import compile_layer
    return compile_layer(config)


def make_layer(config, seed: int = 0) -> substation.EncoderLayer:
    """A fresh EncoderLayer for ``config`` (compiled once per session), parameters drawn from ``seed``,
    biases and layer-norm parameters randomised so every gradient is exercised."""
    torch.manual_seed(seed)
    layer = substation.EncoderLayer(_compiled(config))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.startswith("norm") and "weight" in name else 0.0))
    return layer


def reference_for(layer, dtype=torch.float64) -> ReferenceEncoderLayer:
    """The PyTorch reference layer with ``layer``'s weights in ``dtype``."""
    ref = ReferenceEncoderLayer(layer.config, dtype)
    ref.load_state_dict({k: v.to(dtype) for k, v in layer.state_dict().items()})
    ref.train(layer.training)
    return ref


@pytest.fixture(scope="session")
def tiny():
    return load_config("tiny")


@pytest.fixture(scope="session")
def tiny_nodrop(tiny):
    return tiny.replace(dropout=NO_DROPOUT)
