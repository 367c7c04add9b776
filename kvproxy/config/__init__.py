"""Configuration: one frozen `Settings`, resolved once at start by `load_settings`.

A model's own settings (engines, tokenizer, template, declared context, budget) are
`ModelFields`, declared once; `Settings.model_table()` lists the models either form names and
`Settings.for_model(spec)` gives each its complete settings.
"""

from kvproxy.config.models import (
    IMPLICIT_MODEL,
    EngineSpec,
    ModelSpec,
    RouterSetting,
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
    "IMPLICIT_MODEL",
    "CanaryTenant",
    "ConfigError",
    "EngineSpec",
    "ModelSpec",
    "RouterSetting",
    "Settings",
    "effective_tokenizer",
    "load_settings",
    "split_host_port",
]
