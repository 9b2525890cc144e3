"""Built-in plugins, written only against the public plugin API of `epp.framework`."""

from epp.framework.registry import PluginRegistry


def register_builtin_plugins(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group for the built-in plugins."""
