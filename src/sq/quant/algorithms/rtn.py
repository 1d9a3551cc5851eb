"""Round to nearest: data-free, every weight's scales from its own rows (the baseline every
other algorithm's report is compared with).  The base handler's behaviour is RTN's."""

from __future__ import annotations

from dataclasses import dataclass

from sq.quant.algorithms.base import Algorithm, register
from sq.quant.settings import AlgoConfig


@dataclass(frozen=True)
class RTNConfig(AlgoConfig):
    """No settings: the scheme says everything."""

    name = "rtn"


@register
class RTN(Algorithm):
    config_type = RTNConfig
