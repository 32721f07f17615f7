"""A domain's tasks for a run: the four disjoint splits (weight-training, harness-search,
validation, test), fixed by ``--split_seed``, from the real data a user fetched
(``python -m whale_jax.fetch_data``) or from the domain's offline source.

Each domain's folder decides how (``harness.domains``: its ``load``, ``DATA_FILES`` and
``SOURCES``); the data directory's layout is the one ``whale_jax.fetch_data`` writes, and a missing
file is an error naming it, the flag and the command that fetches it.
"""

from __future__ import annotations

from harness.domains import add_domain_dir, plugin
from harness.domains.base import DataError, DomainData
from whale_jax.loop.config import ConfigError, DataConfig

__all__ = ["DomainData", "load_domain_data"]


def load_domain_data(cfg: DataConfig) -> DomainData:
    """The domain folder's ``load`` (``harness.domains``); its bad input is a ``ConfigError``
    (exit 2) naming the flag or file."""
    try:
        if cfg.domain_dir:
            add_domain_dir(cfg.domain_dir)
        return plugin(cfg.domain).load(cfg)
    except DataError as e:
        raise ConfigError(str(e)) from None
