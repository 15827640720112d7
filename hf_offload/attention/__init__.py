"""The offload attention: the handoff from ``update()`` to the attention call (:mod:`.handoff`), the step's shared
inputs (:mod:`.inputs`), exact prefill (:mod:`.prefill`), the fused decode step (:mod:`.decode`) and the general
tiled path (:mod:`.forward`)."""

from .handoff import Handoff, OffloadMask, leave_handoff, plain_causal, take_handoff
from .inputs import DecodeInputs, forced_blocks
from .forward import offload_attention_forward

__all__ = [
    "DecodeInputs",
    "Handoff",
    "OffloadMask",
    "forced_blocks",
    "leave_handoff",
    "offload_attention_forward",
    "plain_causal",
    "take_handoff",
]
