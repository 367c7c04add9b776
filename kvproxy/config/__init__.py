"""Configuration: one frozen `Settings`, resolved once at start by `load_settings`.

A model's own settings (engines, tokenizer, template, declared context, budget) are
`ModelFields`, declared once; `Settings.model_table()` lists the models either form names and
`Settings.for_model(spec)` gives each its complete settings. A model's upstream clusters
(gateway mode: `upstreams`, else the one implicit cluster) are `Settings.clusters(spec)`, each
cluster's complete settings `Settings.for_cluster(spec, cluster)`.
"""

from kvproxy.config.models import (
    IMPLICIT_CLUSTER,
    IMPLICIT_MODEL,
    EngineSpec,
    ModelSpec,
    RouterSetting,
    UpstreamCluster,
    effective_tokenizer,
)
from kvproxy.config.settings import (
    CanaryTenant,
    ConfigError,
    Settings,
    load_settings,
    split_host_port,
)

__all__ = [
    "IMPLICIT_CLUSTER",
    "IMPLICIT_MODEL",
    "CanaryTenant",
    "ConfigError",
    "EngineSpec",
    "ModelSpec",
    "RouterSetting",
    "Settings",
    "UpstreamCluster",
    "effective_tokenizer",
    "load_settings",
    "split_host_port",
]
