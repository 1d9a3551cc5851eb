"""Quantization algorithms, each a config type plus a handler registered by it (``base``).

Adding one: a module here with a frozen ``AlgoConfig`` subclass (its fields are the CLI flags,
the API keywords and the resume signature), an ``Algorithm`` subclass decorated ``@register``,
and one import line below.
"""

# each registers itself; the order is the order --algo lists them
from sq.quant.algorithms import rtn  # noqa: F401  isort: skip
from sq.quant.algorithms import gptq  # noqa: F401  isort: skip
from sq.quant.algorithms import signround  # noqa: F401  isort: skip
from sq.quant.algorithms import awq  # noqa: F401  isort: skip
from sq.quant.algorithms.base import (Algorithm, add_arguments, algo_config, algorithm_names, config_from_namespace,
                                      config_type, make_algorithm, register)
from sq.quant.settings import AlgoConfig, option

__all__ = ["AlgoConfig", "Algorithm", "option", "register", "add_arguments",
           "algo_config", "algorithm_names", "config_from_namespace", "config_type", "make_algorithm"]
