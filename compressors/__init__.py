"""Built-in compressors, one module per algorithm.

Every module here is imported on first use of the registry; each registers its class with
``@register_compressor("name")``, so adding an algorithm is adding one file.
"""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
