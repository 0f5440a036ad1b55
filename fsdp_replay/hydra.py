"""Hydra registration of :class:`~fsdp_replay.PrefetchConfig`, the schema of a ``prefetch`` config group.

Only this module imports Hydra, so ``fsdp_replay`` itself works without hydra-core installed. A
Hydra override such as ``prefetch.mode=static`` then sets exactly the field a Python user passes
to ``fully_shard(prefetch=...)``; Hydra converts ``mode`` by the :class:`~fsdp_replay.PrefetchMode`
member name and leaves ``on_divergence`` a string, which ``PrefetchConfig`` validates.
Applications keep their own schemas next to them (the training recipe's are in
``recipes/train_lib/config.py``).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from fsdp_replay.config import PrefetchConfig

__all__ = ["register_prefetch_config"]


def register_prefetch_config(*, group: str = "prefetch", name: str = "base_prefetch") -> None:
    """Store :class:`~fsdp_replay.PrefetchConfig` in Hydra's ConfigStore as ``group/name``.

    Args:
        group: the config group whose YAML options extend it through their defaults lists.
        name: the stored schema's name, as those defaults lists give it.
    """
    ConfigStore.instance().store(group=group, name=name, node=PrefetchConfig)
