"""A user's own model, data and loss, importable as "tests.user_models:..." strings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class TwoLayerNet(nn.Module):
    """A plain module with no declared plan: data parallelism only."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, width), nn.Linear(width, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)  # (b, 8) -> (b,)


def make_model(width: int = 32) -> nn.Module:
    return TwoLayerNet(width)


def make_data() -> TensorDataset:
    """512 points of a linear function of 8 inputs, fixed by its own generator."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    return TensorDataset(x, 0.5 * x @ torch.linspace(-1, 1, 8))


def mse(out, target):
    return F.mse_loss(out, target)


def wrong_shape_data() -> TensorDataset:
    return TensorDataset(torch.randn(64, 5), torch.randn(64))


def not_a_module():
    return "a string"


def raises():
    raise RuntimeError("weights file missing")
