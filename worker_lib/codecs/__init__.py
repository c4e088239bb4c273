"""Gradient codecs behind one interface: THC and the baselines it is compared with.

See docs/codecs.md and ``worker_lib.codecs.base`` for the interface; ``make_codec`` builds a codec
from a registered name (``CODEC_NAMES``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker_lib.codecs.base import (
    Codec,
    CodecKind,
    CodecState,
    DARCodec,
    HomomorphicCodec,
    Message,
    RoundContext,
)
from worker_lib.codecs.dynquant import DynamicQuantization, DynQuantConfig
from worker_lib.codecs.natural import NaturalCompression, NaturalConfig
from worker_lib.codecs.terngrad import TernGrad, TernGradConfig
from worker_lib.codecs.thc import THC
from worker_lib.codecs.threelc import ThreeLC, ThreeLCConfig
from worker_lib.codecs.topk import TopK, TopKConfig
from worker_lib.thc.codec import THCConfig

_FACTORIES: dict[str, Callable[..., Codec]] = {
    "thc": lambda **kw: THC(THCConfig(), **kw),
    "terngrad": lambda **kw: TernGrad(TernGradConfig(), **kw),
    "terngrad-noclip": lambda **kw: TernGrad(TernGradConfig(clip=None), **kw),
    "topk10": lambda **kw: TopK(TopKConfig(percent=10.0), **kw),
    "3lc": lambda **kw: ThreeLC(ThreeLCConfig(), **kw),
    "3lc-s1.75": lambda **kw: ThreeLC(ThreeLCConfig(sparsity=1.75), **kw),
    "natural": lambda **kw: NaturalCompression(NaturalConfig(), **kw),
    "natural-det": lambda **kw: NaturalCompression(NaturalConfig(rounding="nearest"), **kw),
    "dynquant": lambda **kw: DynamicQuantization(DynQuantConfig(), **kw),
}
CODEC_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_codec(name: str, *, device: torch.device | str = "cpu", seed: int | None = None) -> Codec:
    """A codec with its paper's default knobs, by registered name."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}") from None
    return factory(device=device, seed=seed)


__all__ = [
    "CODEC_NAMES",
    "THC",
    "Codec",
    "CodecKind",
    "CodecState",
    "DARCodec",
    "DynQuantConfig",
    "DynamicQuantization",
    "HomomorphicCodec",
    "Message",
    "NaturalCompression",
    "NaturalConfig",
    "RoundContext",
    "TernGrad",
    "TernGradConfig",
    "ThreeLC",
    "ThreeLCConfig",
    "TopK",
    "TopKConfig",
    "make_codec",
]
