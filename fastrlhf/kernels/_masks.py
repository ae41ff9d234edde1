"""Host-side helper shared by the launchers that take a mask."""

import torch


def as_loadable(mask: torch.Tensor) -> torch.Tensor:
    """Triton cannot load torch.bool through every version's pointer types; view it as int8."""
    return mask.view(torch.int8) if mask.dtype == torch.bool else mask
