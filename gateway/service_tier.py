"""``service_tier``: OpenAI's ``auto | default | flex | priority`` on tiergate's tiers.

A key's tier is the most it gets; a request may ask to run lower, never higher:

==============  =================================================================
asked           served at
==============  =================================================================
(absent)        the key's tier
``auto``        the key's tier
``default``     the key's tier
``priority``    the key's tier (a key cannot buy a higher one per request)
``flex``        the batch tier (``batch: true``; the lowest tier when none is
                marked): admitted only while the other tiers are idle, and it
                yields to them at every step, in exchange for not costing a slot
                of the key's own tier
a tier's name   that tier if it is not above the key's, else the key's tier
==============  =================================================================

Responses echo the tier actually served in OpenAI's words (:func:`label`): ``priority`` for the
highest tier, ``flex`` for the batch tier, ``default`` for the others; the header
``x-tiergate-tier`` names tiergate's tier.
"""

from __future__ import annotations

from gateway.config import Config
from gateway.errors import bad_request

OPENAI_TIERS = ("auto", "default", "flex", "priority")


def check(config: Config, asked: str | None) -> None:
    """400 for a ``service_tier`` that is neither OpenAI's nor a tier's name."""
    if asked is not None and asked not in OPENAI_TIERS and asked not in config.tier_names:
        raise bad_request(f"service_tier must be one of {', '.join(OPENAI_TIERS)} or a tier's name "
                          f"({', '.join(config.tier_names)}), not {asked[:40]!r}", "service_tier")


def served_tier(config: Config, key_tier: str, asked: str | None) -> str:
    """The tier a request of a ``key_tier`` key that asks for ``asked`` runs at (``asked`` passed
    :func:`check`)."""
    names = config.tier_names
    if asked is None or asked in ("auto", "default", "priority"):
        return key_tier
    if asked == "flex":
        asked = names[config.batch_rank]
    check(config, asked)
    return asked if names.index(asked) >= names.index(key_tier) else key_tier


def label(config: Config, tier: str) -> str:
    """OpenAI's name for tiergate's ``tier``."""
    rank = config.tier_names.index(tier)
    if rank == config.batch_rank and (config.tiers[rank].batch or rank > 0):
        return "flex"
    return "priority" if rank == 0 else "default"
