"""The docs' compatibility tables, rendered from the library's own declarations: which route
carries which compressor (:mod:`mergecomp.exchange.compatibility`) and which options each front
end takes (:data:`mergecomp.pipeline.options.FRONT_ENDS`).  Registered in
:data:`mergecomp_bench.results.TABLES`, so CI fails when the docs and the code disagree."""
import dataclasses
from typing import Dict, List

from mergecomp.exchange.compatibility import ROUTES, TRAITS
from mergecomp.pipeline.options import FRONT_ENDS, StepOptions
from mergecomp.registry import compressor_names, get_compressor
from mergecomp_bench.results.markdown import table

__all__ = ["routes", "front_end_options"]


def _value(value) -> str:
    """An option's value as the docs write it: ``"auto"``, ``None``, ``0``."""
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def _columns() -> Dict[str, List[str]]:
    """The routes' names by their rules (routes with the same rules share a column)."""
    columns: Dict[str, List[str]] = {}
    for route in ROUTES.values():
        columns.setdefault(repr((route.refuses, route.memories)), []).append(route.name)
    return columns


def routes() -> str:
    """Every registered compressor against every route with a rule: "yes", or the trait that
    route refuses; allreduce and allgather carry them all."""
    columns = list(_columns().values())
    rows = []
    for name in sorted(compressor_names()):
        compressor = get_compressor(name)
        cells = []
        for names in columns:
            refused = [trait for trait in ROUTES[names[0]].refuses if TRAITS[trait].has(compressor)]
            cells.append(f"no: {TRAITS[refused[0]].said(compressor)}" if refused else "yes")
        rows.append([f"`{name}`", *cells])
    header = ["compressor", *(", ".join(names) for names in columns)]
    memories = [f"{route.name} refuses memory `{memory}`" for route in ROUTES.values() for memory in route.memories]
    return table(header, ["---"] * len(header), rows) + ("\n" + "; ".join(memories) + ".\n" if memories else "")


def front_end_options() -> str:
    """Each :class:`StepOptions` field against each front end: taken (with its values where
    the front end refuses some, and its own default where it refuses the common one), set by
    its own arguments, or not an option there."""
    rows = []
    for option in dataclasses.fields(StepOptions):
        cells = []
        for accepts in FRONT_ENDS.values():
            if option.name in accepts.fixed:
                cells.append("set by " + ", ".join(f"`{a.strip()}`" for a in accepts.fixed[option.name].split(",")))
            elif option.name in accepts.without:
                cells.append("–")
            elif option.name in accepts.values:
                values, why = accepts.values[option.name]
                cells.append(" / ".join(_value(v) for v in values) + f" ({why})")
            else:
                cells.append("yes")
            if option.name in accepts.defaults:
                cells[-1] += f"; default {_value(accepts.defaults[option.name])}"
        default = option.default if option.default is not dataclasses.MISSING else option.default_factory()
        rows.append([f"`{option.name}`", _value(default), *cells])
    header = ["option", "default", *(f"`{who}`" for who in FRONT_ENDS)]
    return table(header, ["---"] * len(header), rows)
