"""The controlled conditions of the equivalence check: what it switches off so that the two
partitionings differ in nothing but how the batch is cut."""

from __future__ import annotations

import torch.nn as nn

from gradaccum.hazards.scanner import stochastic_modules

__all__ = ["disable_stochastic"]


def disable_stochastic(model: nn.Module) -> tuple[str, ...]:
    """Switch off the random layers the scan recognises, leaving normalization's mode alone.

    Dropout-like modules go to eval mode; MultiheadAttention gets ``dropout=0``. Fractional max
    pooling cannot be switched off and stays (the reproducibility probe reports it).
    """
    disabled = []
    for path, module in list(stochastic_modules(model)):
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
        elif isinstance(module, (nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)):
            continue
        else:
            module.eval()
        disabled.append(path)
    return tuple(disabled)
