"""``exchange_momentum_after="auto"``: the momentum exchange's settings chosen per compressor.

Each :class:`Recipe` is the configuration that came within 1 % of uncompressed AdamW at about
2 bits per element on the byte-level GPT-2 of ``scripts/bench_adam.py`` (docs/compressors.md):
the compressor's own settings, the warm-up's length relative to the run's LR warm-up, the
variance refresh interval, the codec of the warm-up and the refreshes, and what goes on the wire.
:func:`choose` turns ``"auto"`` into those options for one run; an option the user gave stands.
The recipes were measured with ``beta2 = 0.999``: once the optimizer is known (:func:`adapt`, when
the momentum exchange takes it over, in every front end), the refresh interval is capped to
follow a faster variance (:func:`~.momentum_exchange.refresh_limit`) and a ``beta2`` below 0.99
warns that the warm-up may be too short.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.exchange.exchange import resolve
from mergecomp.registry import get_compressor

from .momentum_exchange import (OPTION, REFRESH_OPTION, SEND_OPTION, LrWarmup, MomentumSettings, default_memory,
                                refresh_limit, refusal_of, sends_adam_gradients, smallest_beta2, warn_adam_gradients)
from .named_parameters import inner_optimizer

__all__ = ["AUTO", "RECIPES", "RUN_OPTIONS", "Recipe", "adapt", "choose", "momentum_by_default", "settings_of"]

logger = logging.getLogger("mergecomp")

AUTO = "auto"
#: the run's optimizer updates, and its LR warm-up's, which ``"auto"`` scales the warm-up to
TOTAL_OPTION, WARMUP_OPTION = "total_steps", "lr_warmup_steps"
RUN_OPTIONS = (TOTAL_OPTION, WARMUP_OPTION)
#: the LR warm-up assumed when the run's is not known: 5 % of its updates
LR_WARMUP_SHARE = 0.05
#: the shortest warm-up ``"auto"`` gives, in updates (at most :data:`SHORT_RUN_SHARE` of a shorter
#: run's): on a 3-layer GPT-2 at three times the recipes' learning rate, clipped, 600 updates
#: (beta2 0.999 and 0.95), 1-bit SGD ended 19 % / 13 % behind AdamW frozen after 18 updates (its
#: recipe's 0.6 LR warm-ups), 1.7 % / 2.7 % after 60 and 0.3 % / 0.7 % after 150; PowerSGD +2.0 %
#: / +3.2 % after 36, -5.7 % / +0.5 % after 120
SHORTEST_WARMUP = 150
SHORT_RUN_SHARE = 0.25
#: a warm-up longer than this share of a run of known length is a short run's: its codec is the
#: cheaper one of :data:`SHORT_RUN_CODECS` (8-bit QSGD over a tenth of the run is 0.8 bits per element
#: by itself); on 600 updates at AdamW's best learning rate (docs/compressors.md) 4-bit QSGD moved no
#: recipe's median of three seeds against AdamW by more than half a point from 8-bit's, at a third
#: fewer bits
SHORT_RUN_CODEC_SHARE = 0.1
SHORT_RUN_CODECS = {"qsgd": "qsgd4"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One compressor's momentum exchange: ``compressor`` (its settings, applied when the
    compressor is given by name), ``warmup`` (the lossless warm-up in LR warm-ups: K = warmup x
    the run's LR warm-up, at least :data:`SHORTEST_WARMUP`), ``refresh_every``
    (``variance_refresh_every``), ``codec`` (``compression_warmup_codec``; its
    :data:`SHORT_RUN_CODECS` one where K is more than :data:`SHORT_RUN_CODEC_SHARE` of
    ``total_steps``), ``send`` (``exchange_momentum_as``)."""

    compressor: Dict[str, Any]
    warmup: float
    refresh_every: Optional[int]
    codec: str
    send: str = "momentum"

    def codec_for(self, after: Any, total: Optional[int]) -> str:
        """The warm-up codec of a warm-up ``after`` (updates, or decided as the run goes) in a
        run of ``total`` updates (None or 0: not known)."""
        short = isinstance(after, int) and total and after > SHORT_RUN_CODEC_SHARE * total
        return SHORT_RUN_CODECS.get(self.codec, self.codec) if short else self.codec


#: recipes below this beta2 warn (they were measured with 0.999)
MEASURED_BETA2 = 0.99

#: by compressor name; measured with an LR warm-up of 100 updates in 2,000 (docs/compressors.md)
RECIPES: Dict[str, Recipe] = {
    "none": Recipe({}, 1.0, None, "none"),
    "fp16": Recipe({}, 1.0, None, "none"),
    "bf16": Recipe({}, 1.0, None, "none"),
    "onebit": Recipe({}, 0.6, 32, "qsgd"),
    "efsignsgd": Recipe({}, 0.6, 32, "qsgd"),
    "terngrad": Recipe({"packing": "base3"}, 0.6, 40, "qsgd"),
    "qsgd": Recipe({"levels": 7}, 0.6, 64, "fp16"),
    "topk": Recipe({"ratio": 0.025, "value_dtype": "fp16"}, 1.5, 32, "qsgd"),
    "powersgd": Recipe({"rank": 16, "factor_dtype": "bf16"}, 1.2, 48, "qsgd", "increment"),
}


def _named(compression: Any) -> Optional[str]:
    """The registry name of ``compression`` (a name, or a compressor instance; None otherwise)."""
    return compression if isinstance(compression, str) else getattr(compression, "name", None)


def choose(compression: Any, options: Dict[str, Any], who: str) -> Tuple[Any, Dict[str, Any], Tuple[str, ...]]:
    """``(compression, options, chosen)`` with ``exchange_momentum_after="auto"`` replaced by its
    recipe's settings (:data:`RECIPES`): the compressor named with the recipe's settings, K from
    the run's LR warm-up (``lr_warmup_steps`` where given, else 5 % of ``total_steps``; neither:
    :class:`~.momentum_exchange.LrWarmup`, from the learning rate as it moves) and at
    least :data:`SHORTEST_WARMUP` (a quarter of a shorter ``total_steps``), and the
    refresh interval, warm-up codec (:meth:`Recipe.codec_for`) and wire form unless ``options``
    gives them; ``chosen``: the
    momentum options the recipe set (for :func:`adapt`); the two run options are taken out of
    ``options``.  Without ``"auto"``, unchanged and nothing chosen (the run options refused).
    ValueError naming the option or the compressor."""
    options = dict(options)
    run = {name: options.pop(name, None) for name in RUN_OPTIONS}
    if options.get(OPTION) != AUTO:
        given = [name for name, value in run.items() if value is not None]
        if given:
            raise ValueError(f"{who}: {given[0]} is only used with {OPTION}='auto'")
        return compression, options, ()
    name = _named(compression)
    recipe = RECIPES.get(name) if isinstance(compression, (str, Compressor)) else None
    if recipe is None:
        raise ValueError(f"{who}: {OPTION}='auto' has recipes for {sorted(RECIPES)}, not {compression!r}; "
                         f"give {OPTION}=K and the momentum exchange's other options yourself")
    for option, value in run.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{who}: {option} must be an int >= 0, got {value!r}")
    lr_warmup, total = run[WARMUP_OPTION], run[TOTAL_OPTION]
    shortest = min(SHORTEST_WARMUP, math.ceil(SHORT_RUN_SHARE * total)) if total else SHORTEST_WARMUP
    chosen = [OPTION]
    if lr_warmup or total:
        lr_warmup = lr_warmup or math.ceil(LR_WARMUP_SHARE * total)
        options[OPTION] = max(1, math.ceil(recipe.warmup * lr_warmup), shortest)
    else:  # decided from the learning rate as it moves
        options[OPTION] = LrWarmup(recipe.warmup, shortest)
    if recipe.refresh_every is not None and options.get(REFRESH_OPTION) is None:
        options[REFRESH_OPTION] = recipe.refresh_every
        chosen.append(REFRESH_OPTION)
    if options.get(SEND_OPTION) is None:
        options[SEND_OPTION] = recipe.send
    options.setdefault("compression_warmup_codec", recipe.codec_for(options[OPTION], total))
    if isinstance(compression, str) and recipe.compressor:
        compression = get_compressor(compression, **recipe.compressor)
    after = options[OPTION]
    warmup = (f"{after} ({recipe.warmup:.1f} x an LR warm-up of {lr_warmup} updates, at least {shortest})"
              if isinstance(after, int) else
              f"{recipe.warmup:.1f} x the LR warm-up, at least {shortest} updates, once the learning rate stops rising")
    logger.info("%s: %s='auto' for %s: %s=%s, %s=%s, %s=%r, compression_warmup_codec=%r", who, OPTION, compression,
                OPTION, warmup, REFRESH_OPTION, options.get(REFRESH_OPTION), SEND_OPTION, options[SEND_OPTION],
                options["compression_warmup_codec"])
    return compression, options, tuple(chosen)


def settings_of(compression: Any, options: Dict[str, Any], after: Any, refresh_every: Any, send: Any,
                grad_scaler: Any, who: str) -> Tuple[Any, Dict[str, Any], Optional[MomentumSettings]]:
    """A front end's ``(compression, options, settings)``: ``exchange_momentum_after=after``
    (``"auto"``: :func:`choose`), ``variance_refresh_every``, ``exchange_momentum_as`` and
    ``grad_scaler`` as :class:`MomentumSettings` (None without ``after``), ``options`` the rest;
    ValueError/TypeError naming the option."""
    named = _named(compression)
    compression, options, chosen = choose(compression, {**options, OPTION: after, REFRESH_OPTION: refresh_every,
                                                        SEND_OPTION: send}, who)
    settings = MomentumSettings.create(options.pop(OPTION), options.pop(REFRESH_OPTION), options.pop(SEND_OPTION),
                                       grad_scaler, chosen, named if chosen else None)
    return compression, options, settings


def adapt(settings: MomentumSettings, optimizer: Any, who: str) -> MomentumSettings:
    """``settings`` for ``optimizer`` (an Adam or AdamW), once it is known: a refresh interval
    the recipe chose is at most :func:`refresh_limit` of its smallest ``beta2``, and a ``beta2``
    below :data:`MEASURED_BETA2` under ``"auto"`` warns (``UserWarning`` naming ``who``) that the
    recipe's warm-up may be too short.  Settings the user gave are returned as they are."""
    if OPTION not in settings.chosen:
        return settings
    beta2 = smallest_beta2(optimizer)
    if beta2 < MEASURED_BETA2:
        warnings.warn(f"{who}: {OPTION}='auto' uses recipes measured with beta2=0.999 (and on one 600-update run "
                      f"with 0.95); with beta2={beta2} its warm-up can be too short: compare with uncompressed "
                      f"{type(optimizer).__name__} once, or give {OPTION}=K (docs/compressors.md)", UserWarning,
                      stacklevel=4)
    if REFRESH_OPTION in settings.chosen:
        return dataclasses.replace(settings, refresh_every=min(settings.refresh_every, refresh_limit(beta2)))
    return settings


def momentum_by_default(compression: Any, memory: Any, optimizers: Sequence[Any], options: Dict[str, Any],
                        who: str, note: str = "") -> Dict[str, Any]:
    """A front end's ``options`` once it knows the ``optimizers`` it serves (frameworks'
    wrappers of them too).  Where ``options`` has no ``exchange_momentum_after`` (given as None,
    the user's gradients stand, without a word) and an optimizer is an Adam or AdamW whose
    gradients a lossy compressor with error feedback would send
    (:func:`~.momentum_exchange.sends_adam_gradients`): ``"auto"`` is added, its momentum
    exchanged by the compressor's recipe, logged as a warning naming the option that turns it
    off (and ``note``); where no recipe serves it (:func:`_unserved`), the gradients' warning
    names the line to add instead.  Returns ``options`` (a new dict where changed)."""
    if OPTION in options:
        return options
    compressor, sent_with = resolve(compression, memory)
    adams = [opt for opt in map(inner_optimizer, optimizers) if sends_adam_gradients(opt, compressor, sent_with)]
    if not adams:
        return options
    adam, name = adams[0], type(adams[0]).__name__
    why = _unserved(compression, memory, adam, len(optimizers))
    if why is not None:
        logger.info("%s: %s's momentum is not exchanged by default: %s", who, name, why)
        warn_adam_gradients(adam, compressor, sent_with, who)
        return options
    logger.warning("%s: %s's gradients through %r with error feedback end far behind uncompressed %s: exchanging "
                   "its momentum instead (%s='auto', the compressor's recipe; docs/compressors.md); %s=None "
                   "exchanges the gradients%s", who, name, compressor.name, name, OPTION, OPTION, note)
    return {**options, OPTION: AUTO}


def _unserved(compression: Any, memory: Any, adam: Any, optimizers: int) -> Optional[str]:
    """Why ``"auto"`` cannot serve ``adam`` (one of ``optimizers``) with ``compression`` and
    ``memory``, or None."""
    if optimizers != 1:
        return f"the exchange serves one optimizer, the DDP model has {optimizers}"
    name = _named(compression) if isinstance(compression, (str, Compressor)) else None
    if name not in RECIPES:
        return f"{OPTION}='auto' has no recipe for {compression!r}"
    compressor, exchanged_with = resolve(compression, default_memory(compression) if memory is None else memory)
    return refusal_of(adam, compressor, exchanged_with)
