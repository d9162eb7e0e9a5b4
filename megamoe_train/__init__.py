"""MegaMoE-Train: fused expert-parallel Mixture-of-Experts over symmetric memory."""

from .autograd import mega_moe
from .config import MegaMoEConfig
from .errors import MegaMoECallMismatchError, MegaMoEInputError, MegaMoEPeerError, MegaMoESlowPathWarning
from .layer import MegaMoELayer
from .precision import RECIPES, PrecisionRecipe
from .protocol import raise_pending_verdicts
from .symm_buffer import SymmBuffer, destroy_all_symm_buffers, get_symm_buffer, register_layer
from .weights import ExpertWeights, transform_weights

__all__ = [
    "ExpertWeights",
    "MegaMoEConfig",
    "MegaMoECallMismatchError",
    "MegaMoEInputError",
    "MegaMoEPeerError",
    "MegaMoESlowPathWarning",
    "MegaMoELayer",
    "PrecisionRecipe",
    "RECIPES",
    "SymmBuffer",
    "destroy_all_symm_buffers",
    "get_symm_buffer",
    "mega_moe",
    "raise_pending_verdicts",
    "register_layer",
    "transform_weights",
]
