"""What the runner can run: workloads, modes and goals, each registered where it is defined.

Adding a workload, a mode or a goal is one small addition in the module that defines it
(``benchmark/capture.py``, ``benchmark/readback.py``, ``benchmark/peers.py``, ...; a new
module is listed once in :data:`MODULES`):

.. code-block:: python

    from .registry import register_mode, register_goal, ratio_goal

    @register_mode("scope_store_compiled", workloads=("toy",), doc="...", quick=False)
    class CompiledStore(Mode):
        def run(self, i): ...

    @register_goal
    def compiled_goals(results):
        return [ratio_goal("toy_compiled_vs_plain", "toy, compiled: <= 1.1x plain", results,
                           ("toy", "scope_store_compiled"), ("toy", "plain"), "<=", 1.1)]

A mode object has ``setup()`` (untimed), ``run(i)`` (repeat ``i``, timed), ``describe()``
(untimed, after the cold repeat: bytes captured, ...), ``reset()`` (untimed, between
repeats) and optionally ``summary()`` (after the last repeat). Only a missing *optional*
package may skip a mode (:class:`MissingOptional`); anything else that goes wrong is an
error, which fails the run.
"""

from __future__ import annotations

import importlib
import math
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Modules that register workloads, modes and goals, imported by the runner and every child.
MODULES = ("workloads", "capture", "peers", "interleaved", "readback", "goals")


class MissingOptional(Exception):
    """An optional package (a peer, the demo model) is not installed: the mode is skipped."""


def require_optional(module: str, extra: str, what: str = "") -> None:
    """Raise :class:`MissingOptional` unless ``module`` can be imported (found, not imported)."""
    if importlib.util.find_spec(module) is None:
        raise MissingOptional(f"{what or module} is not installed (optional `{extra}` extra: pip install -e '.[{extra}]')")


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload: what a mode runs on.

    ``kind`` is ``model`` (``build(**params)`` returns a :class:`benchmark.workloads.Workload`)
    or ``data`` (the modes get the params dict). ``params`` maps profile (``full``,
    ``quick``) to the builder's keyword arguments; ``repeats`` maps profile to timed repeats
    (default: the profile's); ``quick``: whether ``--quick`` runs it. ``available()`` returns why the workload cannot run (a missing
    optional package) or None.
    """

    name: str
    kind: str
    build: Callable[..., Any] | None
    params: dict[str, dict[str, Any]]
    doc: str
    repeats: dict[str, int] = field(default_factory=dict)
    available: Callable[[], str | None] | None = None
    describe: Callable[[dict[str, Any]], str] | None = None
    quick: bool = True


@dataclass(frozen=True)
class ModeSpec:
    """A mode: one thing measured on one or more workloads, in its own child process.

    ``workloads``: names of the workloads it runs on (``"*"``: every model workload).
    ``optional``: it needs an optional package (a peer): a missing package skips it.
    ``slow``: one timed repeat within ``slow_budget_s``. ``quick``: whether ``--quick`` runs
    it (True, False, or a tuple of workloads). ``position``: -1 runs first, 1 last.
    ``repeats``: timed repeats (overrides the profile; 0: the cold run only).
    ``timeout``: name of the profile's timeout key (``child_timeout_s``, ``build_timeout_s``).
    ``needs``: modes of the same workload that must have succeeded first (builds).
    ``budget_s``: seconds of timed repeats after which no new one starts (default: the profile's).
    ``peer``: it measures another library (or hand-written code around one): its error is
    reported, but only errors of the other modes (ActivationScope and the baselines its goals
    are measured against) fail the run.
    ``own_interpreter``: the child is a fresh ``python -m benchmark.child``, not forked from the
    runner's pre-imported server (for a library that refuses to run in a forked child).
    """

    name: str
    factory: Callable[..., Any]
    workloads: tuple[str, ...]
    doc: str
    optional: bool = False
    slow: bool = False
    quick: bool | tuple[str, ...] = True
    position: int = 0
    repeats: int | None = None
    timeout: str = "child_timeout_s"
    needs: tuple[str, ...] = ()
    budget_s: float | None = None
    peer: bool = False
    own_interpreter: bool = False

    def runs_on(self, workload: str, kind: str) -> bool:
        return workload in self.workloads or ("*" in self.workloads and kind == "model")

    def in_quick(self, workload: str) -> bool:
        return self.quick if isinstance(self.quick, bool) else workload in self.quick


WORKLOADS: dict[str, WorkloadSpec] = {}
MODES: dict[str, ModeSpec] = {}
GOALS: list[Callable[[dict[str, dict[str, Any]]], list[dict[str, Any]]]] = []
_order: dict[str, int] = {}


def register_workload(spec: WorkloadSpec) -> WorkloadSpec:
    if spec.name in WORKLOADS:
        raise ValueError(f"workload {spec.name!r} is registered twice")
    WORKLOADS[spec.name] = spec
    return spec


def register_mode(name: str, *, workloads: tuple[str, ...] | str, doc: str, **kw: Any) -> Callable[[Any], Any]:
    """Decorator: register a mode class (or factory) taking ``(workload, ctx)``."""
    wls = (workloads,) if isinstance(workloads, str) else tuple(workloads)

    def deco(factory: Any) -> Any:
        add_mode(ModeSpec(name=name, factory=factory, workloads=wls, doc=doc, **kw))
        return factory

    return deco


def add_mode(spec: ModeSpec) -> None:
    if spec.name in MODES:
        raise ValueError(f"mode {spec.name!r} is registered twice")
    MODES[spec.name] = spec
    _order[spec.name] = len(_order)


def register_goal(fn: Callable[[dict[str, dict[str, Any]]], list[dict[str, Any]]]) -> Callable[..., Any]:
    """Decorator: ``fn(results) -> [goal, ...]`` (build them with :func:`goal` / :func:`ratio_goal`)."""
    GOALS.append(fn)
    return fn


def load_all() -> None:
    """Import every registering module (idempotent)."""
    for m in MODULES:
        importlib.import_module(f"benchmark.{m}")


def modes_for(workload: str) -> list[ModeSpec]:
    """The modes of a workload in run order (position, then registration order)."""
    kind = WORKLOADS[workload].kind
    specs = [s for s in MODES.values() if s.runs_on(workload, kind)]
    return sorted(specs, key=lambda s: (s.position, _order[s.name]))


# ---------------------------------------------------------------------------- goals
def record(results: dict[str, dict[str, Any]], workload: str, mode: str) -> dict[str, Any] | None:
    rec = results.get(workload, {}).get(mode)
    return rec if rec and rec.get("status") == "ok" else None


def median_s(results: dict[str, dict[str, Any]], workload: str, mode: str) -> float | None:
    rec = record(results, workload, mode)
    return None if rec is None else rec.get("median_s")


def missing(results: dict[str, dict[str, Any]], *keys: tuple[str, str]) -> str:
    """Why a goal has no figure: which of its modes did not run, and how they ended."""
    bad = []
    for w, mo in keys:
        rec = results.get(w, {}).get(mo)
        if rec is None:
            bad.append(f"{w}/{mo} not run")
        elif rec.get("status") != "ok":
            bad.append(f"{w}/{mo} {rec.get('status')}: {rec.get('note', '')[:100]}")
    return "not measured: " + "; ".join(bad or ["no figure"])


#: Least coverage of a goal's interval for the median over rounds (:func:`median_interval`).
INTERVAL_COVERAGE = 0.90


def median_interval(values: list[float], coverage: float = INTERVAL_COVERAGE) -> tuple[float, float, float] | None:
    """Distribution-free confidence interval for the median of ``values`` (independent rounds).

    The order statistics ``x(k) .. x(n + 1 - k)`` of the ``n`` sorted values, with the
    largest ``k`` whose coverage ``1 - 2 P(B <= k - 1)``, ``B ~ Binomial(n, 1/2)``, is at
    least ``coverage`` (the sign-test interval for a median: W. J. Conover, *Practical
    Nonparametric Statistics*, 3rd ed., 1999, section 3.2). Returns ``(low, high,
    achieved coverage)``, or None when no ``k`` reaches ``coverage`` (fewer than 5 values
    for 0.90).
    """
    xs = sorted(float(v) for v in values)
    n = len(xs)
    best = None
    tail = 0.0  # P(B <= k - 1)
    for k in range(1, n // 2 + 1):
        tail += math.comb(n, k - 1) / 2 ** n
        cov = 1.0 - 2.0 * tail
        if cov < coverage:
            break
        best = (xs[k - 1], xs[n - k], cov)
    return best


def _holds(op: str, x: float, threshold: float) -> bool:
    return {"<=": x <= threshold, "<": x < threshold, ">=": x >= threshold, ">": x > threshold}[op]


def goal(gid: str, text: str, measured: float | None, op: str, threshold: float, unit: str = "x",
         note: str = "", info: str = "", rounds: list[float] | None = None) -> dict[str, Any]:
    """One goal: PASS / FAIL when ``measured`` is a figure, SKIP (with ``note``) when None;
    ``info`` is the note of a measured goal (figures that explain it).

    ``rounds``: the per-round figures whose median ``measured`` is (a goal measured over
    interleaved rounds). The goal then also carries ``interval`` (``[low, high]``, the
    confidence interval of that median, :func:`median_interval`), ``interval_coverage`` and
    ``settled``: True when the whole interval is on the side of the bound that the status
    says (the verdict would hold for any median inside it), False when the interval spans the
    bound (the verdict is within the rounds' noise and can flip between runs).
    """
    if measured is None:
        status = "SKIP"
    else:
        status = "PASS" if _holds(op, measured, threshold) else "FAIL"
    out = {"id": gid, "goal": text, "measured": measured, "op": op, "threshold": threshold, "unit": unit,
           "status": status, "note": note if measured is None else info}
    if measured is not None and rounds:
        iv = median_interval(rounds)
        out["rounds"] = [float(v) for v in rounds]
        if iv is not None:
            lo, hi, cov = iv
            out.update(interval=[lo, hi], interval_coverage=cov,
                       settled=_holds(op, lo, threshold) == _holds(op, hi, threshold))
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def ratio_goal(gid: str, text: str, results: dict[str, dict[str, Any]], num: tuple[str, str],
               den: tuple[str, str], op: str, threshold: float) -> dict[str, Any]:
    """Goal on ``median(num) / median(den)`` of two modes of this run."""
    return goal(gid, text, ratio(median_s(results, *num), median_s(results, *den)), op, threshold,
                note=missing(results, num, den))
